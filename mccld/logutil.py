"""Log a repeated network error once at WARNING, then at DEBUG (a flapping peer must not flood logs)."""

from __future__ import annotations

import logging
import threading


class OnceLogger:
    def __init__(self, logger: logging.Logger):
        self._log = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def warn(self, key: str, msg: str, *args) -> None:
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
        self._log.log(logging.WARNING if first else logging.DEBUG, msg, *args)

    def forget(self, key: str) -> None:
        """The condition cleared (peer back up): warn again if it recurs."""
        with self._lock:
            self._seen.discard(key)
