"""Completion routing: engine op ids -> torch Work objects and Futures.

The engine calls ``CompletionRouter.on_complete(batch)`` on its completion thread
(GIL held) once per batch of finished operations. For each op the router runs the
op's post-processing (copy-back of staged or flattened outputs), then completes its
torch Future, which runs any chained callbacks (DDP comm hooks) on that thread.

``MCCLWork.wait`` blocks the *caller's* thread and re-raises the op's typed error
there: errors born on the network threads always surface where the user called.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any, Callable, Sequence

import torch

from mccl_common.errors import AbortedError, CollectiveTimeout, MCCLError, from_kind

from . import compat

_log = logging.getLogger(__name__)

# Work.wait() without a timeout waits for the group's timeout plus this grace, so the
# engine's own deadline (same timeout, with a precise typed error naming the peer)
# normally fires first; the grace only matters if the engine itself is wedged.
_WAIT_GRACE_S = 5.0

PostFn = Callable[[], None]


class MCCLWork(compat.WorkBase):
    """One enqueued operation. Holds the buffers the engine reads/writes until done."""

    def __init__(self, op_name: str, rank: int, outputs: Sequence[torch.Tensor], keep_alive: Sequence[Any],
                 post: PostFn | None, default_timeout_s: float, device: Any = None) -> None:
        super().__init__()
        self.op_name = op_name
        self._rank = rank
        self._outputs = list(outputs)
        # Staging buffers and inputs: the engine holds raw pointers into them.
        self._keep_alive: list[Any] | None = list(keep_alive)
        self._post = post
        self._timeout_s = default_timeout_s
        self._result = compat.ResultFuture()
        self._done = threading.Event()
        # Set once the future is completed and the callbacks chained on it ran (after _done):
        # wait() returns only then, so a caller that waited may read and chain the future as
        # a completed one. torchft builds its callback chain right after wait(); the chain
        # raced the completion thread and dropped the op ("AssertionError" in its callback).
        self._settled = threading.Event()
        self._error: BaseException | None = None
        self._source_rank_value = -1
        self._router: CompletionRouter | None = None
        # Device tensors (devices.device_tensors.DeviceSide): orders the waiter's stream after the
        # result (O2) on the waiter's thread, never on the completion thread.
        self._device = device

    # -- completion (engine's completion thread) ------------------------------------
    def _complete(self, error: BaseException | None, info: int) -> None:
        if error is None and self._post is not None:
            try:
                self._post()
            except Exception as exc:  # noqa: BLE001 - a copy-back failure must fail this op, not the engine
                error = MCCLError(f"[mccl] {self.op_name} finished on the network but copying its "
                                  f"result back failed on rank {self._rank}: {exc}")
        self._source_rank_value = info
        self._keep_alive = None
        self._post = None
        self._error = error
        self._done.set()
        # Future callbacks (comm hooks) run inline here; a failure inside one is the
        # hook's error and is already stored in its chained future by torch.
        try:
            if error is None:
                self._result.set_result(self._outputs)
            else:
                self._result.set_exception(error)
        finally:
            self._settled.set()

    # -- torch Work API (caller's thread) ---------------------------------------
    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = compat.timedelta_seconds(timeout)
        limit = seconds if seconds is not None else self._timeout_s + _WAIT_GRACE_S
        if self._device is not None:
            self._refuse_completion_thread("wait()")
            self._device.wait()
        if not self._done.is_set():
            if self._on_completion_thread():
                raise MCCLError(
                    f"[mccl] {self.op_name}: wait() called from a future callback running on the "
                    f"engine's completion thread (rank {self._rank}); it would wait on itself. "
                    "Chain with future.then(...) instead of waiting inside a callback")
            if not self._done.wait(limit):
                raise CollectiveTimeout(
                    f"[mccl] Timed out after {limit:.1f} s waiting for {self.op_name} on rank {self._rank}; "
                    "likely cause: a peer is stuck, slow or skipped this collective; "
                    "check every rank issues the same collectives in the same order, or raise the timeout")
        # The callbacks chained on the future run on the completion thread right after _done;
        # on that thread (a callback waiting on its own op) they are what is running now.
        if not self._settled.is_set() and not self._on_completion_thread() and not self._settled.wait(limit):
            raise CollectiveTimeout(
                f"[mccl] {self.op_name} finished on rank {self._rank}, but the callbacks chained on its future "
                f"did not return within {limit:.1f} s; likely cause: a future.then() callback that blocks; "
                "make the callback return, or wait on the chained future instead")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        if self._device is not None:
            self._refuse_completion_thread("get_future()")
            return self._device.future(self._result, self._outputs)
        return self._result.future

    def _on_completion_thread(self) -> bool:
        return self._router is not None and self._router.on_completion_thread()

    def _refuse_completion_thread(self, what: str) -> None:
        if self._on_completion_thread():
            raise MCCLError(f"[mccl] {self.op_name}: {what} of a device op called on the engine's completion "
                            f"thread (rank {self._rank}), which must not touch the device stream; call it on "
                            "the thread that issued the collective or waits for it")

    def is_completed(self) -> bool:
        return self._done.is_set()

    def on_failure(self, fn: Callable[[BaseException], None]) -> None:
        """``fn(error)`` on the completion thread if the op fails (a device op's tickets)."""
        self._result.on_failure(fn)

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        return self._source_rank_value

    def _source_rank(self) -> int:
        return self._source_rank_value

    def synchronize(self) -> None:
        self.wait()


class CompletionRouter:
    """op_id -> pending MCCLWork for one communicator.

    The engine may finish an op before ``track`` has recorded it (it runs on its own
    thread as soon as the op is enqueued), so early completions are parked.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._lock = threading.Lock()
        self._pending: dict[int, MCCLWork] = {}
        self._early: dict[int, tuple[BaseException | None, int]] = {}
        # Set while on_complete runs: a solo group delivers on the caller's thread, which is
        # the completion thread only for that long.
        self._delivering = threading.local()
        self._closed_error: BaseException | None = None

    def on_completion_thread(self) -> bool:
        return getattr(self._delivering, "depth", 0) > 0

    def track(self, op_id: int, work: MCCLWork) -> MCCLWork:
        work._router = self
        with self._lock:
            early = self._early.pop(op_id, None)
            if early is None:
                if self._closed_error is not None:
                    early = (self._closed_error, -1)
                else:
                    self._pending[op_id] = work
                    return work
        work._complete(*early)
        return work

    def on_complete(self, batch: list[tuple[int, Any, int]]) -> None:
        """The engine's callback. Never raises into the engine."""
        self._delivering.depth = getattr(self._delivering, "depth", 0) + 1  # a callback may deliver again
        try:
            self._route(batch)
        finally:
            self._delivering.depth -= 1

    def _route(self, batch: list[tuple[int, Any, int]]) -> None:
        for op_id, err, info in batch:
            error = None if err is None else from_kind(*err)
            with self._lock:
                work = self._pending.pop(op_id, None)
                if work is None:
                    self._early[op_id] = (error, info)
                    continue
            try:
                work._complete(error, info)
            except Exception:  # noqa: BLE001 - keep routing the rest of the batch
                _log.exception("[mccl] completing op %d (%s) on rank %d failed", op_id, work.op_name, self._rank)

    def fail_all(self, error: BaseException) -> None:
        """Fail every pending op (and every later one) with ``error``: used when the
        communicator is shut down or aborted and the engine will not report them."""
        with self._lock:
            self._closed_error = error
            pending = list(self._pending.values())
            self._pending.clear()
        for work in pending:
            work._complete(error, -1)

    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)


def shutdown_error(rank: int) -> AbortedError:
    return AbortedError(f"[mccl] the process group was shut down on rank {rank} while this operation "
                        "was pending; do not issue collectives after destroy_process_group()")


class AllOf(MCCLWork):
    """A Work done when every Work issued inside a coalescing block is done."""

    def __init__(self, works: list[MCCLWork], rank: int, timeout_s: float) -> None:
        super().__init__("coalesced", rank, [], (), None, timeout_s)
        self._works = works
        # The settled futures always succeed: collecting the failing ones would end
        # at the first error, before the other works are done.
        futures = [w._result.settled for w in works]
        if not futures:
            self._complete(None, -1)
            return
        torch.futures.collect_all(futures).then(self._collected)

    def _collected(self, fut: torch.futures.Future) -> None:
        errors = [w.exception() for w in self._works if w.exception() is not None]
        self._complete(errors[0] if errors else None, -1)
