"""torchft's own DiLoCo and LocalSGD on an mccl process group (issue 35 item 4), against torchft
0.2.0 as scripts/setup.sh pins it: two replicas (one process each, tests/torch/torchft_replica.py)
under torchft's Lighthouse and Managers, with ``Manager(pg=libmccl.torchft_process_group())``.
Their parameters after three rounds equal torchft's Gloo process group's bit for bit and a plain
reference of the algorithm within float32 noise; torchft committing every round is checked too,
since torchft swallows a process group's errors and goes on without syncing. DiLoCo runs through
mccld (MCCL_DAEMON=1) too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import torchft   # noqa: F401 - pinned in scripts/setup.sh; a missing torchft fails here, by name

import libmccl
from mccl_common.errors import ConfigError
from torchft_replica import build_model, replica_data   # this folder: the replicas' model and data

HERE = os.path.dirname(os.path.abspath(__file__))
ROUNDS, H = 3, 2


# The Lighthouse runs in a process of its own: its runtime's sockets would outlive shutdown() in
# pytest's process (the leak check sees them). It prints its address, and stops when stdin closes.
LIGHTHOUSE = ("import sys; from torchft._torchft import LighthouseServer; "
              "lh = LighthouseServer(bind='[::]:0', min_replicas=2); print(lh.address(), flush=True); "
              "sys.stdin.read(); lh.shutdown()")


def _train(tmp_path, backend: str, algorithm: str, env: dict | None = None) -> list[dict]:
    lighthouse = subprocess.Popen([sys.executable, "-c", LIGHTHOUSE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
    procs, outs = [], []
    try:
        address = lighthouse.stdout.readline().strip()
        assert address.startswith("http://"), f"the lighthouse did not start: {address!r}"
        for r in range(2):
            out = tmp_path / f"{algorithm}-{backend}-{r}.json"
            plan = {"replica": r, "backend": backend, "algorithm": algorithm, "rounds": ROUNDS, "sync_every": H,
                    "timeout_s": 60, "lighthouse": address, "out": str(out)}
            log = open(tmp_path / f"{algorithm}-{backend}-{r}.log", "w")
            procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "torchft_replica.py"), json.dumps(plan)],
                                          stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}))
            log.close()
            outs.append(out)
        for r, p in enumerate(procs):
            try:
                rc = p.wait(timeout=150)
            except subprocess.TimeoutExpired:
                rc = "timed out"
            log = (tmp_path / f"{algorithm}-{backend}-{r}.log").read_text()
            assert rc == 0, f"replica {r} ({backend}, {algorithm}): {rc}\n{log[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        lighthouse.stdin.close()
        try:
            lighthouse.wait(timeout=10)
        except subprocess.TimeoutExpired:
            lighthouse.kill()
            lighthouse.wait(timeout=10)
        lighthouse.stdout.close()
    return [json.loads(o.read_text()) for o in outs]


def _reference(algorithm: str) -> list[torch.Tensor]:
    """The algorithm written out with plain tensors: both replicas' data as the replica script draws it."""
    model = build_model()
    glob = [p.detach().clone() for p in model.parameters()]
    datas = [replica_data(rid, ROUNDS * H) for rid in range(2)]
    outer_params = [torch.nn.Parameter(g.clone()) for g in glob]
    outer = torch.optim.SGD(outer_params, lr=0.7, momentum=0.9, nesterov=True)
    for k in range(ROUNDS):
        locals_ = []
        for rid in range(2):
            with torch.no_grad():
                for p, g in zip(model.parameters(), outer_params):
                    p.copy_(g)
            inner = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in datas[rid][k * H:(k + 1) * H]:
                inner.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                inner.step()
            locals_.append([p.detach().clone() for p in model.parameters()])
        mean = [(a + b) / 2 for a, b in zip(*locals_)]
        if algorithm == "localsgd":   # the replicas' average becomes everyone's parameters
            with torch.no_grad():
                for g, m in zip(outer_params, mean):
                    g.copy_(m)
            continue
        for g, m in zip(outer_params, mean):   # DiLoCo: the outer gradient is global - mean(local)
            g.grad = g.detach() - m
        outer.step()
    return [g.detach().flatten() for g in outer_params]


@pytest.mark.timeout(420)
def test_torchft_diloco_on_mccl_equals_gloo_and_the_published_algorithm(tmp_path):
    mccl = _train(tmp_path, "mccl", "diloco")
    gloo = _train(tmp_path, "gloo", "diloco")
    for res, name in ((mccl, "torchft-mccl"), (gloo, "torchft-gloo")):
        # every round committed (torchft would go on uncommitted after a failed process group)
        assert [r["step"] for r in res] == [ROUNDS, ROUNDS] and {r["pg"] for r in res} == {name}
        assert res[0]["params"] == res[1]["params"], "the replicas disagree after the outer steps"
    assert {r["inner_pg"] for r in mccl} == {"ProcessGroupMCCL"}
    assert mccl[0]["params"] == gloo[0]["params"]   # an average of two float32 values is exact on both
    ref = _reference("diloco")
    got = [torch.tensor(p) for p in mccl[0]["params"]]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    start = [p.detach().flatten() for p in build_model().parameters()]
    assert any(not torch.equal(a, s) for a, s in zip(got, start)), "the outer steps moved nothing"


@pytest.mark.timeout(300)
def test_torchft_diloco_through_mccld_equals_the_published_algorithm(tmp_path, daemon):
    """Both replicas attach to one mccld (MCCL_DAEMON=1): each quorum's group is a daemon
    communicator, and the rounds end on the reference's parameters as in-process."""
    _, env = daemon
    res = _train(tmp_path, "mccl", "diloco", env=dict(env, MCCL_DAEMON="1"))
    assert [r["step"] for r in res] == [ROUNDS, ROUNDS] and all(r["via_daemon"] for r in res)
    assert res[0]["params"] == res[1]["params"]
    for a, b in zip([torch.tensor(p) for p in res[0]["params"]], _reference("diloco")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_torchft_local_sgd_on_mccl_averages_the_replicas(tmp_path):
    res = _train(tmp_path, "mccl", "localsgd")
    assert [r["step"] for r in res] == [ROUNDS, ROUNDS] and res[0]["params"] == res[1]["params"]
    for a, b in zip([torch.tensor(p) for p in res[0]["params"]], _reference("localsgd")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_job_without_a_key_is_refused_when_the_process_group_is_made(monkeypatch):
    # torchft swallows an error in a quorum's process group and trains on unsynced; a missing key
    # must stop the script where it builds the group, not leave it training alone.
    monkeypatch.delenv("MCCL_JOB_KEY_FILE", raising=False)
    monkeypatch.delenv("MCCL_JOB_KEY", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent-home-for-this-test")
    monkeypatch.delenv("MCCL_WIRE_SECURITY", raising=False)
    with pytest.raises(ConfigError, match="no job key"):
        libmccl.torchft_process_group()


def test_without_torchft_the_error_names_the_package(monkeypatch):
    from libmccl.torch import torchft_pg

    torchft_pg._wrapper_class.cache_clear()
    monkeypatch.setitem(sys.modules, "torchft.process_group", None)   # import fails as if not installed
    try:
        with pytest.raises(ConfigError, match=r"needs torchft.*torchft==0\.2\.0"):
            libmccl.torchft_process_group()
    finally:
        torchft_pg._wrapper_class.cache_clear()
    with pytest.raises(ConfigError, match="positive datetime.timedelta"):
        libmccl.torchft_process_group(timeout=5)
