"""A daemon's link manager plus its data-socket pool in this process, as mccld wires them
(tests/daemon/test_daemon_datalinks.py, test_daemon_ondemand.py)."""

from __future__ import annotations

from typing import Any, Callable

from mccld.datalinks import DataLinks
from mccld.links import LinkManager

KEY = b"d" * 32
K = 2


class Host:
    """``heard``: every message the pool did not take (a test's view of the replies)."""

    def __init__(self, host_id: str, key: bytes = KEY, timeout_s: float = 5.0):
        self.links = LinkManager(key, "f", host_id, "127.0.0.1", 0, timeout_s, self._on_message)
        self.data = DataLinks(self.links, K, timeout_s)
        self.heard: list[tuple[str, dict[str, Any]]] = []
        self.tap: Callable[[str, dict[str, Any]], bool] | None = None   # True: swallowed

    def _on_message(self, peer: str, msg: dict) -> None:
        self.heard.append((peer, msg))
        if self.tap is None or not self.tap(peer, msg):
            self.data.on_message(peer, msg)

    def __enter__(self) -> "Host":
        self.data.start()
        self.links.start()
        return self

    def __exit__(self, *exc) -> None:
        self.data.stop()
        self.links.stop()

    def peer(self, name: str) -> dict:
        return next(p for p in self.data.status() if p["host"] == name)

    def sockets(self) -> int:
        """Data sockets this host holds, idle or leased, to every peer."""
        return sum(p["idle"] + p["leased"] for p in self.data.status())
