"""A daemon's link manager plus its data-socket pool in this process, as mccld wires them
(tests/daemon/test_daemon_datalinks.py, test_daemon_ondemand.py)."""

from __future__ import annotations

from typing import Any, Callable

from tools.bench.daemon_sockets import PoolHost

KEY = b"d" * 32
K = 2


class Host(PoolHost):
    """``heard``: every message it got; ``tap`` sees each first and may swallow it (True)."""

    def __init__(self, host_id: str, key: bytes = KEY, timeout_s: float = 5.0):
        super().__init__(host_id, key, K, timeout_s)
        self.heard: list[tuple[str, dict[str, Any]]] = []
        self.tap: Callable[[str, dict[str, Any]], bool] | None = None

    def on_message(self, peer: str, msg: dict) -> None:
        self.heard.append((peer, msg))
        if self.tap is None or not self.tap(peer, msg):
            self.data.on_message(peer, msg)

    def peer(self, name: str) -> dict:
        return next(p for p in self.data.status() if p["host"] == name)
