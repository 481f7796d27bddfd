"""torchrun's ``--rdzv-backend mccl`` handlers standing for hosts in one process
(``rdzv_handlers``), and ``in_threads`` to run their rounds side by side."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest


@pytest.fixture
def rdzv_handlers(monkeypatch):
    """make(port, min_nodes, max_nodes, *, key_file=None, host=None, **conf): a host's handler
    for run ``r`` at 127.0.0.1:``port``, its job key from ``key_file`` (else the session's),
    its host id ``host``; each is shut down (its keep-alive thread stopped) afterwards."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from libmccl.elastic import rdzv as er
    from mccl_common.launch_protocol import REFORM_ENV

    # Rank 0's handler would also start the workers' store (a second server); the tests only
    # look at the rendezvous itself.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # create_handler sets it for its workers; restored here so no later test inherits it.
    monkeypatch.delenv(REFORM_ENV, raising=False)
    made = []
    good = os.environ.get("MCCL_JOB_KEY_FILE")

    def make(port: int, min_nodes: int, max_nodes: int, *, key_file: str | None = None,
             host: str | None = None, **conf):
        conf.setdefault("join_timeout", "10")
        conf.setdefault("last_call_timeout", "0.5")
        if key_file is not None:
            monkeypatch.setenv("MCCL_JOB_KEY_FILE", key_file)
        if host is not None:
            monkeypatch.setenv("MCCL_HOST_ID", host)
        try:
            made.append(er.create_handler(RendezvousParameters("mccl", f"127.0.0.1:{port}", "r", min_nodes,
                                                               max_nodes, **conf)))
        finally:
            if key_file is not None:   # the next handler holds the session's key (or none) again
                if good is None:
                    monkeypatch.delenv("MCCL_JOB_KEY_FILE")
                else:
                    monkeypatch.setenv("MCCL_JOB_KEY_FILE", good)
            if host is not None:
                monkeypatch.delenv("MCCL_HOST_ID")
        return made[-1]

    yield make
    for h in reversed(made):  # the anchor's server, made first, waits for the others to shut down
        h.shutdown()
    made.clear()
    gc.collect()


def in_threads(*calls, within_s: float = 50.0) -> list:
    """Each call's result or exception, the calls run side by side; fails if one is still
    running after ``within_s`` (a round that never forms)."""
    out: list = [None] * len(calls)

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[i] = exc

    ts = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(calls)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + within_s
    for t in ts:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in ts), f"still running after {within_s} s: {out}"
    return out
