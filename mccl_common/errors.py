"""Typed errors raised by every MCCL component.

Messages follow one shape so that a log line alone tells an operator what to do:
``[component] what failed, peer=host:port, likely cause, what to do``.
The C++ engine reports an error *kind* (see ``csrc/core/errors.h``); ``from_kind``
maps it onto the classes below.
"""

from __future__ import annotations


class MCCLError(RuntimeError):
    """Base class of every MCCL error."""

    def __init__(self, message: str, *, peer_rank: int | None = None, peer_addr: str | None = None):
        super().__init__(message)
        self.peer_rank = peer_rank if peer_rank is not None and peer_rank >= 0 else None
        self.peer_addr = peer_addr or None


class PeerLostError(MCCLError):
    """A peer died, closed its link or reset it while an operation needed it."""


class CollectiveTimeout(MCCLError, TimeoutError):
    """An operation did not finish within the process group's timeout."""


class ConfigError(MCCLError, ValueError):
    """A bad argument or setting: wrong sizes, unsupported dtype/op, bad rank, bad MCCL_* value."""


class ProtocolError(MCCLError):
    """A malformed frame or message, or a protocol/communicator mismatch."""


class CollectiveMismatch(MCCLError):
    """Ranks disagree on the collective, its size or its order."""


class AbortedError(MCCLError):
    """The communicator was aborted or shut down while the operation was pending."""


class DaemonUnavailableError(MCCLError):
    """MCCL_DAEMON=1 but no mccld answers on this host."""


class AuthError(MCCLError):
    """A peer or client failed fleet-key authentication."""


class StoreAuthError(AuthError, ProtocolError):
    """A value read from a rendezvous or c10d store failed its MAC under the job's key: someone
    without the key wrote it, or copied it there from another key or run."""


# Order matches mccl::ErrorKind in csrc/core/errors.h.
_KINDS: dict[int, type[MCCLError]] = {
    0: MCCLError,
    1: PeerLostError,
    2: CollectiveTimeout,
    3: ConfigError,
    4: ProtocolError,
    5: CollectiveMismatch,
    6: AbortedError,
    # 7 only in Python (libmccl/daemon/client.py); 8 also from the engine's link handshake (kAuth).
    7: DaemonUnavailableError,
    8: AuthError,
}


def from_kind(kind: int, message: str, peer_rank: int = -1, peer_addr: str = "") -> MCCLError:
    """Build the typed exception for an engine error kind."""
    cls = _KINDS.get(int(kind), MCCLError)
    return cls(message, peer_rank=peer_rank, peer_addr=peer_addr)


def kind_of(exc: BaseException) -> int:
    """The engine error kind of an exception (0 for any other class): ``from_kind``'s inverse,
    for mccld handing a Python error to the engine (not in ``__all__``: no user needs it)."""
    return next((k for k, cls in _KINDS.items() if type(exc) is cls), 0)


__all__ = [
    "MCCLError",
    "PeerLostError",
    "CollectiveTimeout",
    "ConfigError",
    "ProtocolError",
    "CollectiveMismatch",
    "AbortedError",
    "DaemonUnavailableError",
    "AuthError",
    "StoreAuthError",
    "from_kind",
]
