"""The ``mccl`` torch.distributed backend: a ProcessGroup driving the MCCL engine.

Reductions, broadcast and all-gather live here; the collectives that only move data
(scatter, gather, all-to-all, point-to-point) are in ``exchange``. Each
collective checks its arguments (``args``), asks the device layer for a plan of its
tensors (``libmccl.devices.plan``: host buffers, a device's staging and tickets), lets
the plan launch one engine operation and returns an ``MCCLWork`` at once; the engine's
completion thread finishes the Work through the ``CompletionRouter``. Coalesced variants
are flattened into one buffer, so they cost one engine operation.

Every collective torch offers is overridden, under both of its spellings where
torch renamed it: a method left to the C++ base class fails with "No backend type
associated with device type cpu", because this group has no C++ Backend behind it.
"""

from __future__ import annotations

import datetime
import os
import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from mccl_common import jobkey
from mccl_common.errors import AbortedError, ConfigError, DaemonUnavailableError, MCCLError
from mccl_common import setting_names
from mccl_common.settings import EngineConfig, load

from .. import BACKEND_NAME, DEVICES
from ..devices import device_tensors
from ..devices.plan import Plan, prepare
from . import args, compat
from .. import rendezvous
from . import switch_groups
from .options import Options
from .exchange import ExchangeOps
from ..devices.copy_stats import merged as merged_copies
from ..devices.segment_staging import SegmentStaging
from .solo_comm import SoloCommunicator
from .work import AllOf, CompletionRouter, MCCLWork, shutdown_error

_c10d = torch.distributed


class ProcessGroupMCCL(ExchangeOps, compat.ProcessGroupBase):
    """One communicator (in-process engine, or the local mccld with MCCL_DAEMON=1)
    per torch process group."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta,
                 group_id: str = "", cfg: EngineConfig | None = None, options: Options | None = None) -> None:
        super().__init__(rank, size)
        compat.declare_devices(self, list(DEVICES))
        self._group_name = group_id
        self._group_desc = ""
        self._cfg = cfg if cfg is not None else load(EngineConfig)
        self._options = options
        self._timeout_s = compat.timedelta_seconds(timeout) or 1800.0
        self._router = CompletionRouter(rank)
        self._closed = False
        self._close_lock = threading.Lock()
        self._coalescing: list[MCCLWork] | None = None
        self._lost_result: BaseException | None = None
        self._daemon: Any = None    # the DaemonCommunicator, when self._comm is one (shared buffers)
        self._comm = self._connect(store, group_id)
        self._solo = isinstance(self._comm, SoloCommunicator)
        # Through mccld, device buckets are staged in memory mccld reduces in (segment_staging.py).
        self._segment_staging = (SegmentStaging(self._daemon.alloc_buffer, self._cfg.cuda_staging_bytes,
                                                "MCCL_CUDA_STAGING_BYTES", rank)
                                 if self._daemon is not None else None)
        # An interpreter exiting without destroy_process_group() still stops the
        # engine's threads and closes its links; holds the comm, not self.
        self._finalizer = weakref.finalize(self, _shutdown_quietly, self._comm, self._segment_staging)

    # -- construction ---------------------------------------------------------
    def _engine_options(self) -> Any:
        from .. import _core

        return self._cfg.engine_options(_core.Options(), self._timeout_s,
                                        self._cfg.connect_timeout_s or self._timeout_s)

    def _connect(self, store: Any, group_id: str) -> Any:
        from .. import _core

        rank, size, opts = self.rank(), self.size(), self._engine_options()
        if size == 1:
            # Nothing to exchange with anyone, with or without mccld (MCCL_DAEMON=1): each op
            # is done on the caller's thread, with no segment, copy or attach.
            return SoloCommunicator(self._router.on_complete)
        if self._cfg.daemon:
            try:
                from ..daemon.client import DaemonCommunicator
            except ImportError as exc:
                raise DaemonUnavailableError(f"[mccl] MCCL_DAEMON=1 but the daemon client cannot be imported ({exc}); "
                                             "install MCCL with its daemon, or unset MCCL_DAEMON") from exc
            rv = rendezvous.exchange(store, rank, size, None, self._cfg, opts.connect_timeout_s, group_id)
            self._daemon = DaemonCommunicator(rank=rank, size=size, comm_id=rv.comm_id, store=rv.store, opts=opts,
                                              on_complete=self._router.on_complete,
                                              timeout_s=opts.connect_timeout_s)
            return self._daemon
        # A rank without the job key fails in the rendezvous, which tells its peers why.
        rv = rendezvous.exchange(store, rank, size, _core.Listener, self._cfg, opts.connect_timeout_s, group_id)
        try:
            secret = jobkey.engine_secret(self._cfg.wire_security)
            opts.switch_of_rank = switch_groups.agree(rv.store, rank, size, rv.peer_addrs, self._cfg,
                                                      opts.connect_timeout_s)
        except BaseException:
            rv.listener.close()
            raise
        return _core.Communicator(rank, size, rv.comm_id, rv.listener, rv.peer_addrs, opts, self._router.on_complete,
                                  secret=secret)

    # -- identity (torch's PyProcessGroup trampoline forwards these) -------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    @property
    def timeout_s(self) -> float:
        """Seconds a collective may wait: init_process_group's timeout, or set_timeout's."""
        return self._timeout_s

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Timeout of the ops issued from now on: the engine's per-op deadline and
        Work.wait(). Through the daemon (MCCL_DAEMON=1) the daemon side keeps the timeout
        the job joined with; only the client's own waits change."""
        seconds = compat.timedelta_seconds(timeout)
        if not seconds or seconds <= 0:
            raise ConfigError(f"[mccl] set_timeout({timeout!r}): the timeout must be positive")
        self._comm.set_timeout(seconds)
        self._timeout_s = seconds

    _set_default_timeout = set_timeout  # the name c10d's own backends use

    @property
    def options(self) -> Options | None:
        """The pg_options this group was created with; torch's split_group() hands them
        to the subgroups it splits off."""
        return self._options

    @property
    def compression(self) -> str:
        """The compression this group's all-reduces apply (MCCL_COMPRESSION or Options(compression=));
        "off" where the engine has no such setting. Callers that must not send fp32 in place of a
        compressed payload (DiLoCo's compression=) check it."""
        return str(getattr(self._cfg, "compression", "off"))

    @property
    def communicator(self) -> Any:
        """The engine communicator (stats(), peer_address()); for tools and tests."""
        return self._comm

    def shared_buffer(self, nbytes: int) -> Any:
        """Memory the local mccld maps too (daemon.buffers.SharedBuffer), for shared_tensors;
        None in-process, where the engine reads tensors in place anyway."""
        if self._closed:
            raise AbortedError(f"[mccl] shared_empty on rank {self.rank()}: the process group was shut down")
        return self._daemon.alloc_buffer(nbytes) if self._daemon is not None else None

    # -- lifecycle -------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine (drain, join threads, close links); idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        try:
            self._comm.shutdown(10.0)
        finally:
            self._router.fail_all(shutdown_error(self.rank()))
            self._close_staging()

    def abort(self) -> None:
        """Fail every pending op with AbortedError and tell live peers; idempotent."""
        with self._close_lock:
            already = self._closed
            self._closed = True
        if not already:
            self._finalizer.detach()
            self._comm.abort(f"process group {self._group_name!r} aborted by rank {self.rank()}")
            self._comm.shutdown(10.0)
        self._router.fail_all(AbortedError(f"[mccl] process group {self._group_name!r} was aborted on "
                                           f"rank {self.rank()}; create a new process group to continue"))
        self._close_staging()

    def _close_staging(self) -> None:
        if self._segment_staging is not None:
            device_tensors.settle()  # ops whose copy back is queued give their blocks back first
            self._segment_staging.close()

    def copy_stats(self) -> dict[str, float]:
        """Bytes, copies and seconds per direction (libmccl/devices/copy_stats.py): the daemon client's
        copies into and out of its segment, and the device staging copies of this process."""
        client = self._daemon.stats() if self._daemon is not None else {}
        return merged_copies(client, device_tensors.copy_stats())

    # -- submission --------------------------------------------------------------
    def _plan(self, name: str, tensors: Sequence[Any] = (), blocks: Any = None) -> Plan:
        return prepare(name, tensors, blocks, self._lose_result)

    def _submit(self, name: str, plan: Plan, outputs: Sequence[Any], opts: Any, call: Callable[..., int],
                *engine_args: Any) -> MCCLWork:
        """One engine op, ``call(*engine_args)``, on the buffers ``plan`` staged; its Work, at once."""
        if self._closed or self._lost_result is not None:
            plan.abandon()  # never launched: a device op's blocks and words go back at once
        if self._closed:
            raise AbortedError(f"[mccl] {name} on rank {self.rank()}: the process group was shut down or aborted; "
                               "create a new one with init_process_group()/new_group()")
        if self._lost_result is not None:
            raise MCCLError(f"[mccl] {name} on rank {self.rank()}: an earlier device all_reduce failed after its "
                            f"future was handed out ({self._lost_result}); the tensor it wrote holds garbage. "
                            "Create a new process group") from self._lost_result
        timeout = compat.options_timeout(opts) if opts is not None else None
        work = MCCLWork(name, self.rank(), outputs, plan.keep, plan.finish, timeout or self._timeout_s, plan.waiter)
        plan.launch(work, self._router.track, self._comm.gate, call, *engine_args)
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _lose_result(self, error: BaseException) -> None:
        """A device op failed after its future completed (device_tensors.DeviceSide)."""
        if self._lost_result is None:
            self._lost_result = error

    # -- all-reduce ---------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> MCCLWork:
        t, opts, dtype, count, op = args.reduction(tensors, opts, _c10d.AllreduceOptions, "allreduce")
        # In a group of one the identity: no staging buffer, gate or helper thread, and the
        # Work is complete before this returns.
        plan = prepare("allreduce", [t], self._segment_staging, self._lose_result, in_place=t, solo=self._solo)
        return self._submit("allreduce", plan, [t], opts, self._comm.allreduce, plan.buffer, count, dtype, op)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> MCCLWork:
        opts = compat.options_or_default(opts, _c10d.AllreduceCoalescedOptions)
        ts = args.tensor_list(tensors, "allreduce_coalesced", "tensors", min_len=1)
        for i, t in enumerate(ts[1:], 1):
            if t.dtype != ts[0].dtype:
                raise ConfigError(f"[mccl] allreduce_coalesced: tensors[{i}] has dtype {t.dtype} but tensors[0] "
                                  f"has {ts[0].dtype}; coalesced all-reduce needs one dtype")
        st = self._plan("allreduce_coalesced", ts, self._segment_staging)
        flat = st.scratch(sum(t.numel() for t in ts), ts[0].dtype)
        offset = 0
        for t in ts:
            part = flat[offset:offset + t.numel()]
            st.input_into(t, part)
            st.copy_back(t, part)
            offset += t.numel()
        dtype, count, op = args.reduce_codes(flat, opts.reduceOp, "allreduce_coalesced")
        return self._submit("allreduce_coalesced", st, ts, opts, self._comm.allreduce, flat.data_ptr(), count, dtype,
                            op)

    # -- broadcast / reduce -----------------------------------------------------------
    def broadcast(self, tensors: Any, opts: Any = None) -> MCCLWork:
        opts = compat.options_or_default(opts, _c10d.BroadcastOptions)
        t = args.check_tensor(args.single(tensors, "broadcast"), "broadcast", "tensor")
        root = args.check_rank(opts.rootRank, self.size(), "broadcast", "root")
        if self._solo:
            return self._submit("broadcast", self._plan("broadcast"), [t], opts, self._comm.broadcast, 0, 0, root)
        st = self._plan("broadcast", [t])
        buf = st.input(t) if root == self.rank() else st.inout(t)
        return self._submit("broadcast", st, [t], opts, self._comm.broadcast, buf.data_ptr(), args.nbytes(buf), root)

    def reduce(self, tensors: Any, opts: Any = None) -> MCCLWork:
        t, opts, dtype, count, op = args.reduction(tensors, opts, _c10d.ReduceOptions, "reduce")
        root = args.check_rank(opts.rootRank, self.size(), "reduce", "root")
        if self._solo:
            return self._submit("reduce", self._plan("reduce"), [t], opts, self._comm.reduce, 0, count, dtype, op, root)
        st = self._plan("reduce", [t])
        # The engine leaves non-root buffers unchanged: only the root needs a copy-back.
        buf = st.inout(t) if root == self.rank() else st.input(t)
        return self._submit("reduce", st, [t], opts, self._comm.reduce, buf.data_ptr(), count, dtype, op, root)

    # -- all-gather --------------------------------------------------------------------
    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> MCCLWork:
        inp = args.check_tensor(args.single(input_tensors, "allgather", "input_tensors"), "allgather", "input")
        outs = args.tensor_list(args.single(output_tensors, "allgather", "output_tensors"), "allgather",
                             "output_tensors", self.size())
        for r, o in enumerate(outs):
            args.check_like(o, inp, "allgather", f"output_tensors[{r}]", "the input")
        n = args.nbytes(inp)
        st = self._plan("allgather", [inp, outs])
        src = st.input(inp)
        recv = st.scratch(self.size() * inp.numel(), inp.dtype)
        for r, o in enumerate(outs):
            st.copy_back(o, recv[r * inp.numel():(r + 1) * inp.numel()])
        return self._submit("allgather", st, [outs], opts, self._comm.allgather, src.data_ptr(), recv.data_ptr(), n)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MCCLWork:
        args.check_tensor(input, "all_gather_into_tensor", "input")
        args.check_tensor(output, "all_gather_into_tensor", "output")
        args.check_like(output, input, "all_gather_into_tensor", "output", "input", self.size() * input.numel())
        n = args.nbytes(input)
        st = self._plan("all_gather_into_tensor", [output, input])
        dst = st.output(output)
        # In-place gathers (FSDP passes this rank's block of the output as input) would
        # hand the engine overlapping send/recv buffers.
        src = st.input(input.clone() if args.overlaps(input, dst) else input)
        return self._submit("all_gather_into_tensor", st, [output], opts, self._comm.allgather, src.data_ptr(),
                            dst.data_ptr(), n)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any = None) -> MCCLWork:
        name = "allgather_coalesced"
        ins = args.tensor_list(input_list, name, "input_list")
        if not isinstance(output_lists, (list, tuple)) or len(output_lists) != self.size():
            raise ConfigError(f"[mccl] {name}: output_lists must hold one list per rank ({self.size()})")
        outs = [args.tensor_list(lst, name, f"output_lists[{r}]", len(ins)) for r, lst in enumerate(output_lists)]
        for r, lst in enumerate(outs):
            for i, o in enumerate(lst):
                args.check_like(o, ins[i], name, f"output_lists[{r}][{i}]", f"input_list[{i}]")
        st = self._plan(name, [ins, outs])
        bufs = [[st.output(o) for o in lst] for lst in outs]
        return self._gather_packed(name, st, ins, lambda r, i: bufs[r][i], [t for lst in outs for t in lst], opts)

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> MCCLWork:
        name = "all_gather_into_tensor_coalesced"
        ins = args.tensor_list(inputs, name, "inputs")
        outs = args.tensor_list(outputs, name, "outputs", len(ins))
        for i, (o, x) in enumerate(zip(outs, ins)):
            args.check_like(o, x, name, f"outputs[{i}]", f"inputs[{i}]", self.size() * x.numel())
        st = self._plan(name, [ins, outs])
        # Rank r's block of outputs[i] is row r of a (size, numel) view.
        blocks = [st.output(o).view(self.size(), x.numel()) for o, x in zip(outs, ins)]
        return self._gather_packed(name, st, ins, lambda r, i: blocks[i][r], outs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _gather_packed(self, name: str, st: Plan, ins: list[torch.Tensor],
                       out_block: Callable[[int, int], torch.Tensor], outputs: list[torch.Tensor],
                       opts: Any) -> MCCLWork:
        """All-gather several tensors (any dtypes) as one packed byte buffer per rank;
        ``out_block(r, i)`` is the contiguous CPU buffer for rank r's tensor i."""
        sizes = [args.nbytes(x) for x in ins]
        total = sum(sizes)
        send = st.packed(ins)
        recv = st.scratch(self.size() * total, torch.uint8)
        offset = 0
        for r in range(self.size()):
            for i, nb in enumerate(sizes):
                st.unpack(out_block(r, i), recv[offset:offset + nb])
                offset += nb
        return self._submit(name, st, outputs, opts, self._comm.allgather, send.data_ptr(), recv.data_ptr(), total)

    # -- reduce-scatter ----------------------------------------------------------------
    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> MCCLWork:
        opts = compat.options_or_default(opts, _c10d.ReduceScatterOptions)
        out = args.check_tensor(args.single(output_tensors, "reduce_scatter", "output_tensors"), "reduce_scatter",
                                "output")
        ins = args.tensor_list(args.single(input_tensors, "reduce_scatter", "input_tensors"), "reduce_scatter",
                            "input_list", self.size())
        for r, x in enumerate(ins):
            args.check_like(x, out, "reduce_scatter", f"input_list[{r}]", "the output")
        dtype, count, op = args.reduce_codes(out, opts.reduceOp, "reduce_scatter")
        st = self._plan("reduce_scatter", [out, ins])
        send = st.scratch(self.size() * out.numel(), out.dtype)
        for r, x in enumerate(ins):
            st.input_into(x, send[r * out.numel():(r + 1) * out.numel()])
        dst = st.output(out)
        return self._submit("reduce_scatter", st, [out], opts, self._comm.reduce_scatter, send.data_ptr(),
                            dst.data_ptr(), count, dtype, op)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MCCLWork:
        opts = compat.options_or_default(opts, _c10d.ReduceScatterOptions)
        name = "reduce_scatter_tensor"
        args.check_tensor(input, name, "input")
        args.check_tensor(output, name, "output")
        args.check_like(input, output, name, "input", "output", self.size() * output.numel())
        dtype, count, op = args.reduce_codes(output, opts.reduceOp, name)
        st = self._plan(name, [output, input])
        dst = st.output(output)
        src = st.input(input.clone() if args.overlaps(input, dst) else input)
        return self._submit(name, st, [output], opts, self._comm.reduce_scatter, src.data_ptr(), dst.data_ptr(),
                            count, dtype, op)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> MCCLWork:
        opts = compat.options_or_default(opts, _c10d.ReduceScatterOptions)
        name = "reduce_scatter_tensor_coalesced"
        outs = args.tensor_list(outputs, name, "outputs", min_len=1)
        ins = args.tensor_list(inputs, name, "inputs", len(outs))
        for i, (o, x) in enumerate(zip(outs, ins)):
            args.check_like(o, outs[0], name, f"outputs[{i}]", "outputs[0]", o.numel())
            args.check_like(x, o, name, f"inputs[{i}]", f"outputs[{i}]", self.size() * o.numel())
        counts = [o.numel() for o in outs]
        chunk = sum(counts)
        dtype, count, op = args.reduce_codes(outs[0].new_empty(chunk), opts.reduceOp, name)
        st = self._plan(name, [outs, ins])
        # Rank-major layout: block r holds every input's r-th slice, so one
        # reduce-scatter hands rank r all of its outputs at once.
        send = st.scratch(self.size() * chunk, outs[0].dtype).view(self.size(), chunk)
        recv = st.scratch(chunk, outs[0].dtype)
        offset = 0
        for x, n, o in zip(ins, counts, outs):
            st.input_into(x, send[:, offset:offset + n])
            st.copy_back(o, recv[offset:offset + n])
            offset += n
        return self._submit(name, st, outs, opts, self._comm.reduce_scatter, send.data_ptr(), recv.data_ptr(),
                            count, dtype, op)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- coalescing manager (dist._coalescing_manager with a device) -------------------------
    def _start_coalescing(self, device: torch.device) -> None:
        if self._coalescing is not None:
            raise ConfigError("[mccl] _start_coalescing: already coalescing; nested coalescing is not supported")
        self._coalescing = []

    def _end_coalescing(self, device: torch.device) -> MCCLWork:
        works, self._coalescing = self._coalescing or [], None
        return AllOf(works, self.rank(), self._timeout_s)


def _shutdown_quietly(comm: Any, staging: Any = None) -> None:
    try:
        comm.shutdown(2.0)
        if staging is not None:
            staging.close()
    except Exception:  # noqa: BLE001 - interpreter exit: nothing left to report to
        pass


def create(dist_opts: Any, backend_options: Any = None) -> ProcessGroupMCCL:
    """One ProcessGroupMCCL per group, from c10d's DistributedBackendOptions (extended API).
    ``backend_options`` is what the caller passed as ``pg_options``: None or an Options."""
    setting_names.warn_unknown(os.environ)   # once per process: a mistyped MCCL_* is said, not ignored
    cfg = load(EngineConfig)
    if backend_options is not None:
        if not isinstance(backend_options, Options):
            raise ConfigError(f"[mccl] pg_options of type {type(backend_options).__name__} is not understood by "
                              "the mccl backend; pass libmccl.Options(name=value, ...) with engine setting names, "
                              "or leave pg_options unset")
        cfg = backend_options.apply(cfg)
    return ProcessGroupMCCL(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout,
                            group_id=str(getattr(dist_opts, "group_id", "") or ""), cfg=cfg,
                            options=backend_options)
