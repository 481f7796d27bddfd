"""The one interface the torch glue (torch/backend.py, torch/exchange.py) drives a communicator by.

Three implementations: the in-process engine (``_core.Communicator``, pybind11), the
world-size-1 group's ``SoloCommunicator`` (torch/solo_comm.py) and ``DaemonCommunicator``
(daemon/client.py, ``MCCL_DAEMON=1``). Every operation takes raw pointers, byte or
element counts and the dtype / reduce-op codes of ``torch.args`` (no torch types), enqueues
the op and returns its id at once; completion reaches the backend through the
``on_complete`` callback the communicator was built with. tests/torch/test_communicator.py
checks each implementation against this protocol, parameter by parameter.

An implementation may take more than the protocol lists, as optional arguments only
(the engine's ticket arguments of ``allreduce``, a per-op ``timeout_s``).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Communicator(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def comm_id(self) -> int: ...

    # -- collectives: each returns the op's id --------------------------------------------
    def allreduce(self, ptr: int, count: int, dtype: int, op: int) -> int: ...

    def broadcast(self, ptr: int, nbytes: int, root: int) -> int: ...

    def reduce(self, ptr: int, count: int, dtype: int, op: int, root: int) -> int: ...

    def allgather(self, send_ptr: int, recv_ptr: int, nbytes: int) -> int: ...

    def reduce_scatter(self, send_ptr: int, recv_ptr: int, count: int, dtype: int, op: int) -> int: ...

    def gather(self, send_ptr: int, recv_ptr: int, nbytes: int, root: int) -> int: ...

    def scatter(self, send_ptr: int, recv_ptr: int, nbytes: int, root: int) -> int: ...

    def alltoall(self, send_ptr: int, recv_ptr: int, nbytes: int) -> int: ...

    def alltoallv(self, send_ptr: int, send_sizes: Sequence[int], send_offsets: Sequence[int], recv_ptr: int,
                  recv_sizes: Sequence[int], recv_offsets: Sequence[int]) -> int: ...

    def barrier(self) -> int: ...

    # Holds back the ops issued after it until ``ready`` >= base + nbytes (device staging,
    # device_order.StagedOp); a local step (through mccld, in the client's queue: daemon/gates.py).
    def gate(self, ready: Any, base: int, nbytes: int) -> None: ...

    # -- point to point -----------------------------------------------------------------------
    def send(self, ptr: int, nbytes: int, dst: int, tag: int = 0) -> int: ...

    def recv(self, ptr: int, nbytes: int, src: int, tag: int = 0) -> int: ...

    # -- lifecycle and tools ---------------------------------------------------------------------
    def set_timeout(self, timeout_s: float) -> None: ...

    def abort(self, reason: str = "") -> None: ...

    # The engine and the solo communicator say whether borrowed sockets ended clean; nobody
    # in the glue reads it.
    def shutdown(self, timeout_s: float = 10.0) -> Any: ...

    def stats(self) -> dict[str, Any]: ...

    def peer_address(self, r: int) -> str: ...
