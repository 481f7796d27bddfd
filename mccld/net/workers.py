"""A fixed pool of worker threads with a bound on the work it accepts.

The threads start with their owner, so all of a daemon's threads are up when its token
appears (the fuzzer and the fault campaign count them before and after; an executor
starting workers at the first task reads as growth). The bound: at most ``limit`` tasks
accepted and not yet finished, queued or running together. Past it ``submit`` refuses at
once (False) rather than block, so the caller (a link's reader, a gossip round) sheds work
instead of waiting on a peer. ``stop`` drops what has not started, ends every thread
within ``join_s`` each, and refuses every later ``submit``.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class WorkerPool:
    """``on_error()`` runs inside the ``except`` of a task that raised (so it can log with
    ``exc_info``); the worker goes on with the next task."""

    def __init__(self, name: str, workers: int, limit: int, on_error: Callable[[], None],
                 join_s: float = 10.0):
        self._name, self._n, self._limit, self._on_error, self._join_s = name, workers, limit, on_error, join_s
        self._tasks: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._unfinished = 0
        self._threads: list[threading.Thread] = []

    @property
    def unfinished(self) -> int:
        """Tasks accepted and not finished: queued or running."""
        with self._lock:
            return self._unfinished

    def start(self) -> "WorkerPool":
        with self._lock:
            self._threads = [threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                             for i in range(self._n)]
            threads = list(self._threads)
        for t in threads:
            t.start()
        return self

    def submit(self, fn: Callable[..., None], *args: Any) -> bool:
        """Run ``fn(*args)`` on a worker; False, and it never runs, when the pool is full or stopped."""
        with self._lock:
            if not self._threads or self._unfinished >= self._limit:
                return False
            self._unfinished += 1
            self._tasks.put((fn, args))
        return True

    def stop(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
            while True:   # what has not started will not
                try:
                    self._tasks.get_nowait()
                except queue.Empty:
                    break
                self._unfinished -= 1
            for _ in threads:
                self._tasks.put(None)
        for t in threads:
            t.join(self._join_s)

    def _work(self) -> None:
        while True:
            # No timeout: stop() always queues the None that ends this loop.
            task = self._tasks.get()
            if task is None:
                return
            fn, args = task
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one task's failure must not end the worker
                self._on_error()
            finally:
                with self._lock:
                    self._unfinished -= 1
