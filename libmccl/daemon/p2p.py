"""A daemon-mode rank's receives between posting and matching.

A recv is posted to mccld at once, outside the rank's op queue (a rank blocked in a
recv must still be able to send, or two ranks that both post first would deadlock);
mccld answers when a send matched, with its source, and the communicator then queues
a ``take`` that brings the data through its segment. Not thread-safe: the
communicator calls every method with its lock held.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from mccl_common.errors import CollectiveTimeout


@dataclass
class PostedRecv:
    op_id: int
    ptr: int
    nbytes: int
    args: dict[str, Any]                     # the ``recv`` request's arguments
    deadline: float = 0.0
    req: int = 0


class PostedRecvs:
    def __init__(self) -> None:
        self._unsent: collections.deque[PostedRecv] = collections.deque()
        self._waiting: dict[int, PostedRecv] = {}          # request id -> recv awaiting a match

    def __bool__(self) -> bool:
        return bool(self._unsent or self._waiting)

    def add(self, recv: PostedRecv) -> None:
        self._unsent.append(recv)

    def next_unsent(self, req: int, deadline: float) -> PostedRecv | None:
        """The oldest recv not yet sent, now waiting under request id ``req``."""
        if not self._unsent:
            return None
        recv = self._unsent.popleft()
        recv.req, recv.deadline = req, deadline
        self._waiting[req] = recv
        return recv

    def answered(self, req: int) -> PostedRecv | None:
        return self._waiting.pop(req, None)

    def deadlines(self) -> list[float]:
        return [r.deadline for r in self._waiting.values()]

    def expired(self, now: float, rank: int, timeout_s: float) -> CollectiveTimeout | None:
        late = [r for r in self._waiting.values() if now > r.deadline]
        if not late:
            return None
        src = late[0].args["src"]
        return CollectiveTimeout(
            f"[daemon-client] Timed out after {timeout_s:.0f}s: recv (op {late[0].op_id}) from "
            f"{'any rank' if src == -1 else f'rank {src}'} got no message on rank {rank}; the sender is stuck or "
            "skipped the send, and mccld did not say so (is it overloaded?)", peer_rank=src)

    def take_all(self) -> list[PostedRecv]:
        out = list(self._waiting.values()) + list(self._unsent)
        self._waiting.clear()
        self._unsent.clear()
        return out
