"""The data-movement half of the ``mccl`` process group: scatter, gather, all-to-all(v)
and point-to-point. Nothing here reduces; ``ProcessGroupMCCL`` mixes these in and
provides ``_plan`` (the device layer's plan of a call's tensors), ``_submit`` (one engine op ->
one Work), ``_comm`` and the rank/size."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mccl_common.errors import ConfigError

from . import args, compat
from .work import MCCLWork

_c10d = torch.distributed


class ExchangeOps:
    """Mixin for ProcessGroupMCCL (see its ``_plan`` and ``_submit``)."""

    # -- rooted data movement -----------------------------------------------------------
    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> MCCLWork:
        opts = compat.options_or_default(opts, _c10d.ScatterOptions)
        out = args.check_tensor(args.single(output_tensors, "scatter", "output_tensors"), "scatter", "output")
        root = args.check_rank(opts.rootRank, self.size(), "scatter", "root")
        n = args.nbytes(out)
        ins = args.root_list("scatter", input_tensors, "input_tensors", "scatter_list", out, "the output",
                             self.rank(), self.size(), root)
        st = self._plan("scatter", [out, ins])
        send_ptr = st.packed(ins).data_ptr() if ins else 0
        dst = st.output(out)
        return self._submit("scatter", st, [out], opts, self._comm.scatter, send_ptr, dst.data_ptr(), n, root)

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> MCCLWork:
        opts = compat.options_or_default(opts, _c10d.GatherOptions)
        inp = args.check_tensor(args.single(input_tensors, "gather", "input_tensors"), "gather", "input")
        root = args.check_rank(opts.rootRank, self.size(), "gather", "root")
        n = args.nbytes(inp)
        outs = args.root_list("gather", output_tensors, "output_tensors", "gather_list", inp, "the input",
                              self.rank(), self.size(), root)
        st = self._plan("gather", [inp, outs])
        recv_ptr = 0
        if outs:
            recv = st.scratch(self.size() * inp.numel(), inp.dtype)
            for r, o in enumerate(outs):
                st.copy_back(o, recv[r * inp.numel():(r + 1) * inp.numel()])
            recv_ptr = recv.data_ptr()
        src = st.input(inp)
        return self._submit("gather", st, [outs] if outs else [], opts, self._comm.gather, src.data_ptr(), recv_ptr,
                            n, root)

    # -- all-to-all ---------------------------------------------------------------------
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], opts: Any = None) -> MCCLWork:
        name = "all_to_all_single"
        args.check_tensor(input, name, "input")
        args.check_tensor(output, name, "output")
        if output.dtype != input.dtype:
            raise ConfigError(f"[mccl] {name}: output dtype {output.dtype} differs from input dtype {input.dtype}")
        st = self._plan(name, [output, input])
        dst = st.output(output)
        src = st.input(input.clone() if args.overlaps(input, dst) else input)
        if not output_split_sizes and not input_split_sizes:
            if input.numel() != output.numel() or input.numel() % self.size():
                raise ConfigError(f"[mccl] {name}: without split sizes input ({input.numel()} elements) and output "
                                  f"({output.numel()}) must be equal and divisible by the group size {self.size()}")
            n = args.nbytes(input) // self.size()
            return self._submit(name, st, [output], opts, self._comm.alltoall, src.data_ptr(), dst.data_ptr(), n)
        send_sizes = self._split_bytes(input, input_split_sizes, name, "input")
        recv_sizes = self._split_bytes(output, output_split_sizes, name, "output")
        return self._alltoallv(name, src, send_sizes, dst, recv_sizes, [output], st, opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> MCCLWork:
        name = "alltoall"
        ins = args.tensor_list(input_tensors, name, "input_tensor_list", self.size())
        outs = args.tensor_list(output_tensors, name, "output_tensor_list", self.size())
        for r, (o, x) in enumerate(zip(outs, ins)):
            if o.dtype != x.dtype:
                raise ConfigError(f"[mccl] {name}: output_tensor_list[{r}] dtype {o.dtype} differs from "
                                  f"input_tensor_list[{r}] dtype {x.dtype}")
        st = self._plan(name, [outs, ins])
        send = st.packed(ins)
        recv_sizes = [args.nbytes(o) for o in outs]
        recv = st.scratch(sum(recv_sizes), torch.uint8)
        offset = 0
        for o, nb in zip(outs, recv_sizes):
            st.unpack(st.output(o), recv[offset:offset + nb])
            offset += nb
        return self._alltoallv(name, send, [args.nbytes(x) for x in ins], recv, recv_sizes, outs, st, opts)

    def _split_bytes(self, t: torch.Tensor, splits: Sequence[int], name: str, what: str) -> list[int]:
        rows = t.shape[0] if t.dim() else 1
        row_bytes = args.nbytes(t) // rows if rows else 0
        if not splits:
            if rows % self.size():
                raise ConfigError(f"[mccl] {name}: {what} has {rows} rows, not divisible by the group size "
                                  f"{self.size()}; pass {what}_split_sizes")
            return [rows // self.size() * row_bytes] * self.size()
        if len(splits) != self.size() or sum(splits) != rows or min(splits) < 0:
            raise ConfigError(f"[mccl] {name}: {what}_split_sizes={list(splits)} must have {self.size()} "
                              f"non-negative entries summing to {what}.size(0)={rows}")
        return [int(s) * row_bytes for s in splits]

    def _alltoallv(self, name: str, send: torch.Tensor, send_sizes: list[int], recv: torch.Tensor,
                   recv_sizes: list[int], outputs: list[torch.Tensor], st: Any, opts: Any) -> MCCLWork:
        send_offsets = _offsets(send_sizes)
        recv_offsets = _offsets(recv_sizes)
        return self._submit(name, st, outputs, opts, self._comm.alltoallv, send.data_ptr(), send_sizes, send_offsets,
                            recv.data_ptr(), recv_sizes, recv_offsets)

    # -- barrier and point-to-point ---------------------------------------------------------
    def barrier(self, opts: Any = None) -> MCCLWork:
        return self._submit("barrier", self._plan("barrier"), [], opts, self._comm.barrier)

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> MCCLWork:
        t = args.check_tensor(args.single(tensors, "send"), "send", "tensor")
        dst = self._peer(dstRank, "send", "dst")
        st = self._plan("send", [t])
        buf = st.input(t)
        return self._submit("send", st, [t], None, self._comm.send, buf.data_ptr(), args.nbytes(buf), dst, int(tag))

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> MCCLWork:
        t = args.check_tensor(args.single(tensors, "recv"), "recv", "tensor")
        src = self._peer(srcRank, "recv", "src")
        return self._recv(t, src, int(tag))

    def recv_anysource(self, tensors: Any, tag: int = 0) -> MCCLWork:
        t = args.check_tensor(args.single(tensors, "recv"), "recv", "tensor")
        return self._recv(t, -1, int(tag))

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> MCCLWork:
        st = self._plan("recv", [t])
        buf = st.output(t)
        return self._submit("recv", st, [t], None, self._comm.recv, buf.data_ptr(), args.nbytes(buf), src, tag)

    def _peer(self, r: int, op: str, what: str) -> int:
        r = args.check_rank(r, self.size(), op, what)
        if r == self.rank():
            raise ConfigError(f"[mccl] {op}: {what}={r} is this rank itself; point-to-point needs another rank")
        return r


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out
