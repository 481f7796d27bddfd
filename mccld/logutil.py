"""Log a repeated network error once at WARNING, then at DEBUG (a flapping peer must not flood logs)."""

from __future__ import annotations

import collections
import logging
import threading
import time

# Keys remembered (most recently warned first out last). Keys name peers, addresses and client
# connections, which a hostile LAN host can mint without end: past this many the oldest is
# forgotten, and warns again should it recur.
MAX_KEYS = 4096


class OnceLogger:
    """``warn(key, ...)`` logs at WARNING the first time for ``key``, at DEBUG afterwards. With
    ``rewarn_s`` a key warns again once that long has passed since its last WARNING, so a
    refusal that keeps happening stays visible (once per peer per ``rewarn_s``) without
    letting a peer that retries in a loop write the log full."""

    def __init__(self, logger: logging.Logger, max_keys: int = MAX_KEYS, rewarn_s: float | None = None):
        self._log = logger
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()  # key -> last WARNING
        self._max = max_keys
        self._rewarn_s = rewarn_s
        self._lock = threading.Lock()

    def warn(self, key: str, msg: str, *args, exc_info: bool = False) -> None:
        """``exc_info``: with the current exception's traceback, on the WARNING only (a bug that a
        peer can trigger at will must not write a traceback per connection)."""
        now = time.monotonic()
        with self._lock:
            last = self._seen.get(key)
            loud = last is None or (self._rewarn_s is not None and now - last >= self._rewarn_s)
            self._seen[key] = now if loud else last
            self._seen.move_to_end(key)
            if len(self._seen) > self._max:
                self._seen.popitem(last=False)
        self._log.log(logging.WARNING if loud else logging.DEBUG, msg, *args, exc_info=exc_info and loud)

    def forget(self, key: str) -> None:
        """The condition cleared (peer back up): warn again if it recurs."""
        with self._lock:
            self._seen.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
