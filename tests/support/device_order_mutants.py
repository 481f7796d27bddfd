"""Broken variants of the ordering protocol (device_order), one missing piece each: the
negative controls of test_device_order and test_device_order_model. Each takes a
pytest MonkeyPatch and patches TicketedOp (OrderedOp and StagedOp alike) / MCCLWork for the test's duration."""

from __future__ import annotations

import pytest

from libmccl.devices.device_order import TicketedOp
from libmccl.torch.work import MCCLWork


def drop_o1(mp: pytest.MonkeyPatch) -> None:
    """The CPU says "ready" at once instead of the stream after the bucket's kernels (and,
    when staged, after the copies into host memory, which are still queued)."""
    def launch(self, s):
        self._before_ready(s)
        self.ready.signal(self.target)
        self.ops.commit(s)
    mp.setattr(TicketedOp, "launch", launch)


def drop_o2(mp: pytest.MonkeyPatch) -> None:
    """Nothing orders the stream's later work after the engine's result."""
    mp.setattr(TicketedOp, "finish", lambda self, s: None)


def skip_commit(mp: pytest.MonkeyPatch) -> None:
    """O1 and O2 are encoded but never committed (an encoder left open)."""
    for name in ("launch", "finish"):
        def uncommitted(self, s, original=getattr(TicketedOp, name)):
            self.ops.commit = lambda s: None  # shadows the method on this instance only
            try:
                original(self, s)
            finally:
                del self.ops.commit
        mp.setattr(TicketedOp, name, uncommitted)


def share_counter(mp: pytest.MonkeyPatch) -> None:
    """Every op of a device raises one ``ready`` word."""
    init, shared = TicketedOp.__init__, {}

    def one_word(self, *a):
        init(self, *a)
        self.ready = shared.setdefault(id(self.ops), self.ready)
    mp.setattr(TicketedOp, "__init__", one_word)


def o2_on_completion_thread(mp: pytest.MonkeyPatch) -> None:
    """The public MCCL's crash: O2 (with the copy back) run by the engine's completion thread."""
    init, complete = MCCLWork.__init__, MCCLWork._complete

    def hide_device(self, *a, **kw):
        init(self, *a, **kw)
        self._moved_device, self._device = self._device, None  # wait() and get_future() skip O2

    def o2_here(self, error, info):
        try:
            if self._moved_device is not None:
                self._moved_device.wait()
        finally:
            complete(self, error, info)
    mp.setattr(MCCLWork, "__init__", hide_device)
    mp.setattr(MCCLWork, "_complete", o2_here)
