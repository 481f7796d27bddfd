"""Log a repeated network error once at WARNING, then at DEBUG (a flapping peer must not flood logs)."""

from __future__ import annotations

import collections
import logging
import threading

# Keys remembered (most recently warned first out last). Keys name peers, addresses and client
# connections, which a hostile LAN host can mint without end: past this many the oldest is
# forgotten, and warns again should it recur.
MAX_KEYS = 4096


class OnceLogger:
    def __init__(self, logger: logging.Logger, max_keys: int = MAX_KEYS):
        self._log = logger
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._max = max_keys
        self._lock = threading.Lock()

    def warn(self, key: str, msg: str, *args) -> None:
        with self._lock:
            first = key not in self._seen
            self._seen[key] = None
            self._seen.move_to_end(key)
            if len(self._seen) > self._max:
                self._seen.popitem(last=False)
        self._log.log(logging.WARNING if first else logging.DEBUG, msg, *args)

    def forget(self, key: str) -> None:
        """The condition cleared (peer back up): warn again if it recurs."""
        with self._lock:
            self._seen.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
