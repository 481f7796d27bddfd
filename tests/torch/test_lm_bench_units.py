"""The lm workload's pieces without a fleet (tools/bench/lm): the corpus and its split, the data
order, the model, the variants' check against the installed mccl, and the harness's arithmetic."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mccl_common.errors import ConfigError
from mccl_common.errors import MCCLError
from tools.bench.lm import data, model, runner, train, variants


def _tree(root: Path) -> Path:
    for rel, text in {"a.py": "x = 1\n", "pkg/b.py": "def f():\n    return 2\n", "pkg/c.py": "y = 'c'\n",
                      "site-packages/third.py": "no\n", "test/test_a.py": "no\n", "pkg/tests/t.py": "no\n",
                      "notes.txt": "no\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_corpus_lists_own_sources_sorted_and_splits_by_path_hash(tmp_path):
    root = _tree(tmp_path / "lib")
    assert [p.as_posix() for p in data.source_files(root)] == ["a.py", "pkg/b.py", "pkg/c.py"]
    c1 = data.build(str(tmp_path / "o1"), root)
    c2 = data.build(str(tmp_path / "o2"), root)
    assert c1.sha256 == c2.sha256 and c1.files == 3
    val = [r for r in data.source_files(root) if data.is_val(r)]
    assert c1.val_files == len(val)
    pieces = [x for p in (c1.train_path, c1.val_path) for x in Path(p).read_bytes().split(b"\0")[:-1]]
    assert sorted(pieces) == sorted((root / r).read_bytes() for r in data.source_files(root))
    # the real standard library: a fixed list with a held-out share of about 1/VAL_EVERY
    files = data.source_files()
    assert len(files) > 200 and files == sorted(files, key=lambda r: r.as_posix())
    share = sum(map(data.is_val, files)) / len(files)
    assert 0.5 / data.VAL_EVERY < share < 2 / data.VAL_EVERY


def test_batches_are_deterministic_per_rank_and_shifted_by_one():
    import torch

    buf = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    a = data.batches(torch, buf, 16, 4, seed=7, rank=0)
    b = data.batches(torch, buf, 16, 4, seed=7, rank=0)
    c = data.batches(torch, buf, 16, 4, seed=7, rank=1)
    (xa, ya), (xb, yb), (xc, _) = next(a), next(b), next(c)
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and not torch.equal(xa, xc)
    assert torch.equal(xa[:, 1:], ya[:, :-1]) and xa.shape == (4, 16)
    x0, _ = data.val_windows(torch, buf, 16, 6, rank=0, world=2)
    x1, _ = data.val_windows(torch, buf, 16, 6, rank=1, world=2)
    assert len(x0) == len(x1) == 3 and not torch.equal(x0, x1)


def test_model_is_the_same_from_the_same_seed_and_learns():
    import torch

    torch.set_num_threads(1)
    cfg = model.ModelConfig(layers=1, d_model=32, heads=2, context=16, seed=3)
    m1, m2 = model.build(torch, cfg), model.build(torch, cfg)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    assert sum(p.numel() for p in m1.parameters()) == cfg.params()
    x = torch.randint(0, 256, (4, 16))
    logits = m1(x)
    assert logits.shape == (4, 16, model.VOCAB)
    # causal: the first position's output ignores the rest of the window
    y = x.clone()
    y[:, 1:] = (y[:, 1:] + 1) % 256
    assert torch.allclose(m1(y)[:, 0], logits[:, 0], atol=1e-5)
    opt = torch.optim.AdamW(m1.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = model.loss_fn(torch, m1(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5, losses


def test_a_variant_the_installed_mccl_does_not_know_stops_the_run():
    declared = variants.declared_settings()
    assert "MCCL_ALGO" in declared
    without = {k: v for k, v in declared.items() if not k.startswith("MCCL_COMPRESSION")}
    # off needs nothing: uncompressed is what an mccl without compression does
    assert [v.name for v in variants.resolve(["gloo", "off"], without)] == ["gloo", "off"]
    for name in ("bf16", "int8", "int8-nofb"):
        with pytest.raises(ConfigError, match="MCCL_COMPRESSION.*does not declare"):
            variants.resolve(["off", name], without)
    with pytest.raises(ConfigError, match="unknown lm variant"):
        variants.resolve(["gloo", "int4"], declared)


def test_a_value_the_installed_mccl_refuses_stops_the_run():
    @dataclasses.dataclass(frozen=True)
    class Fake:
        compression: str = dataclasses.field(default="off", metadata={"env": "MCCL_COMPRESSION", "unit": "",
                                                                        "help": ""})
        ef: bool = dataclasses.field(default=True, metadata={"env": "MCCL_COMPRESSION_ERROR_FEEDBACK",
                                                             "unit": "bool", "help": ""})

        def validate(self):
            if self.compression not in ("off", "bf16"):
                raise ConfigError(f"[config] MCCL_COMPRESSION={self.compression!r} is out of range")

    declared = {f.metadata["env"]: (Fake, f) for f in dataclasses.fields(Fake)}
    assert variants.resolve(["bf16"], declared)[0].env == {"MCCL_COMPRESSION": "bf16"}
    with pytest.raises(ConfigError, match="'int8'.*refuses.*MCCL_COMPRESSION='int8'"):
        variants.resolve(["int8"], declared)


def test_wire_check_flags_a_compressed_variant_that_sent_fp32():
    res = {"variant": variants.VARIANTS["int8"].to_dict(), "wire_over_fp32_ring": 1.04}
    assert "did not compress" in runner.check_wire(res)
    assert runner.check_wire({**res, "wire_over_fp32_ring": 0.27}) is None
    assert runner.check_wire({"variant": variants.VARIANTS["off"].to_dict(), "wire_over_fp32_ring": 1.04}) is None
    assert runner.check_wire({**res, "wire_over_fp32_ring": None}) is None   # loopback: nothing measured


def test_rate_time_to_loss_and_summary_arithmetic():
    # 1 MB of gradients, 2 hosts: 1 MB per host per all-reduce; at R=2 over 0.1 s it must take 0.2 s
    bps = runner.rate_for(1_000_000, 2, 0.1, 2.0)
    assert runner.fp32_ring_bytes(1_000_000, 2) * 8 / (bps * runner.WIRE_EFFICIENCY) == pytest.approx(0.2, rel=1e-3)
    assert runner.STUDIO["comm_s"] == pytest.approx(6.8, abs=0.1)
    curve = [{"wall_s": 0.0, "val_loss": 5.5, "samples": 0}, {"wall_s": 10.0, "val_loss": 3.0, "samples": 8},
             {"wall_s": 20.0, "val_loss": 2.0, "samples": 16}]
    assert runner.time_to_loss(curve, 2.5) == pytest.approx(15.0)
    assert runner.time_to_loss(curve, 1.0) is None
    ref = {"ok": True, "curve": curve, "final_val_loss": 2.0, "wall_s": 20.0, "samples": 16}
    fast = {"ok": True, "curve": [dict(p, wall_s=p["wall_s"] / 4) for p in curve], "final_val_loss": 2.0,
            "wall_s": 5.0, "samples": 16}
    s = runner.summarize({"gloo": ref, "int8": fast, "bad": {"ok": False}}, "gloo")
    assert s["target_loss"] == 2.0 and set(s["variants"]) == {"gloo", "int8"}
    assert s["variants"]["int8"]["time_to_ref_loss_over_ref"] == pytest.approx(0.25)
    assert s["variants"]["gloo"]["time_to_ref_loss_over_ref"] == 1.0
    # within the tolerance (fp32 sums in another order) counts as reached; beyond it does not
    slower = {**ref, "curve": [dict(p, val_loss=p["val_loss"] * 1.0005) for p in curve]}
    assert runner.summarize({"gloo": ref, "off": slower}, "gloo")["variants"]["off"]["time_to_ref_loss_s"]
    assert runner.summarize({"gloo": ref, "off": slower}, "gloo", 0.0)["variants"]["off"]["time_to_ref_loss_s"] is None
    assert s["variants"]["gloo"]["val_loss_at_ref_samples_pct"] == pytest.approx(0.0)


def test_wire_bytes_come_from_this_namespaces_interface():
    assert train.tx_bytes(None) is None
    assert train.tx_bytes("lo") >= 0
    with pytest.raises(MCCLError, match="no interface 'nope0'"):
        train.tx_bytes("nope0")


# -- slow hosts and the balanced variants (issue 37) ----------------------------------------------
def test_slow_option_parses_and_bad_hosts_are_refused():
    from tools.bench.lm import cli

    assert cli._slow("3:2@20, 1:1.5") == {3: (2.0, 20), 1: (1.5, 0)}
    with pytest.raises(Exception, match="HOST:FACTOR"):
        cli._slow("3")
    for bad in ({4: (2.0, 0)}, {0: (0.5, 0)}, {1: (2.0, -1)}):
        with pytest.raises(ConfigError, match="--slow"):
            runner.LMConfig(hosts=4, variants=["gloo"], slow=bad).validate()
    assert variants.VARIANTS["balanced"].balanced and variants.VARIANTS["balanced"].to_dict()["balanced"]


def test_cpu_cap_options_parse_merge_per_host_and_bad_ones_are_refused():
    from tools.bench.lm import cli
    from tools.cpucap import Cap

    assert cli._cpu_cap("3:0.25@20, 1:0.5") == {3: (0.25, 20), 1: (0.5, 0)}
    assert cli._background("2@7,0") == {2: 7, 0: 0}
    with pytest.raises(Exception, match="HOST:CORES"):
        cli._cpu_cap("3")
    caps = runner.caps_from({3: (0.25, 20)}, {3: 20, 1: 0})
    assert caps == {1: Cap(None, True, 0), 3: Cap(0.25, True, 20)}
    with pytest.raises(ConfigError, match="same step"):
        runner.caps_from({3: (0.25, 20)}, {3: 5})
    for bad in ({4: Cap(0.5)}, {0: Cap(0.0)}, {1: Cap(0.5, at=-1)}):
        with pytest.raises(ConfigError, match="--cpu-cap"):
            runner.LMConfig(hosts=4, variants=["gloo"], cpu_caps=bad).validate()


@pytest.mark.parametrize("backend", ["gloo", "mccl"])
def test_a_teardown_abort_after_every_result_was_written_is_forgiven_only_to_gloo(tmp_path, monkeypatch, backend):
    """A rank that aborted (SIGABRT) after writing its results: Gloo's measurement stands with the
    abort reported (torch's Gloo teardown aborted once in ~25 CI runs); mccl's fails the variant."""
    import json
    import signal

    from tools.bench.launch import Finished

    v = variants.Variant("x", backend)

    def fake_group(launcher, argvs, envs, log_dir, timeout_s, what, **kw):
        for r in range(2):
            (tmp_path / what / f"x-rank{r}.json").write_text(json.dumps({"rank": r}))
        return [Finished(-signal.SIGABRT, "terminate called without an active exception", "", 1),
                Finished(-signal.SIGKILL, "", "", 2)]

    monkeypatch.setattr(runner, "run_group", fake_group)
    cfg = runner.LMConfig(ranks=2, variants=["gloo"])
    launcher = runner.LocalLauncher(2)
    if backend == "gloo":
        docs = runner._run_ranks(launcher, cfg, {"calibrate": True}, v, str(tmp_path), "x")
        assert [d["rank"] for d in docs] == [0, 1]
        assert "exited with -6" in docs[0]["teardown_failure"]

        def died_before_writing(*a, **kw):
            done = fake_group(*a, **kw)
            (tmp_path / "x" / "x-rank1.json").unlink()
            return done

        monkeypatch.setattr(runner, "run_group", died_before_writing)
        with pytest.raises(MCCLError, match="exited with -6"):
            runner._run_ranks(launcher, cfg, {"calibrate": True}, v, str(tmp_path), "x")
    else:
        with pytest.raises(MCCLError, match="exited with -6"):
            runner._run_ranks(launcher, cfg, {"calibrate": True}, v, str(tmp_path), "x")


def test_sampler_draws_the_same_data_as_fixed_batches():
    import torch

    split = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    fixed = data.batches(torch, split, 16, 4, 7, 2)
    draw = data.sampler(torch, split, 16, 7, 2)
    for _ in range(3):
        x1, y1 = next(fixed)
        x2, y2 = draw(4)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert draw(9)[0].shape == (9, 16)       # a balanced rank's share changes from step to step


def test_slow_host_sleeps_in_proportion_to_its_samples(monkeypatch):
    slept = []
    monkeypatch.setattr(train.time, "sleep", slept.append)
    plan = {"slow": {"1": [2.0, 3]}, "sample_compute_s": 0.01}
    host = train.SlowHost.from_plan(plan, 1)
    host.compute(2, 8)                        # before its step: full speed
    host.compute(3, 8)
    host.compute(4, 4)
    assert slept == pytest.approx([0.08, 0.04]) and host.to_dict()["slept_s"] == pytest.approx(0.12)
    train.SlowHost.from_plan(plan, 0).compute(5, 8)   # another host: never slowed
    assert len(slept) == 2
    with pytest.raises(MCCLError, match="sample_compute_s"):
        train.SlowHost.from_plan({"slow": {"0": [2.0, 0]}}, 0)


def test_global_sampler_gives_every_split_the_same_samples():
    import torch

    split = (torch.arange(5000, dtype=torch.int64) * 7).to(torch.uint8)
    equal = [data.global_sampler(torch, split, 16, 5) for _ in range(4)]
    skewed = [data.global_sampler(torch, split, 16, 5) for _ in range(4)]
    for shares in ([3, 13, 8, 8], [11, 11, 5, 5]):
        a = torch.cat([equal[r]([8, 8, 8, 8], r)[0] for r in range(4)])
        b = torch.cat([skewed[r](shares, r)[0] for r in range(4)])
        assert a.shape == (32, 16) and torch.equal(a, b)


def test_diloco_variants_carry_their_schedule_and_expected_wire_share():
    declared = variants.declared_settings()
    got = {v.name: v for v in variants.resolve(["diloco-h8", "diloco-h32", "diloco-h32-int8", "streaming-f4"],
                                               declared)}
    assert got["diloco-h8"].to_dict()["diloco"] == {"H": 8, "F": 1, "tau": 0, "alpha": 0.0, "compression": None}
    assert got["diloco-h8"].env == {"MCCL_COMPRESSION": "off"} and got["diloco-h8"].wire_factor == 1 / 8
    assert got["diloco-h32-int8"].env == {"MCCL_COMPRESSION": "int8", "MCCL_COMPRESSION_ERROR_FEEDBACK": "1"}
    assert got["diloco-h32-int8"].wire_factor == 0.25 / 32
    assert got["streaming-f4"].diloco == {"H": 32, "F": 4, "tau": 1, "alpha": 0.5, "compression": None}
    adaptive = variants.resolve(["diloco-h8-adaptive"], declared)[0]
    assert adaptive.diloco == {**got["diloco-h8"].diloco, "adaptive": True} and adaptive.wire_factor == 1 / 8
    # a DiLoCo run that sent every step's gradients is caught by the same wire check as compression
    res = {"variant": got["diloco-h32"].to_dict(), "wire_over_fp32_ring": 1.01}
    assert "did not compress" in runner.check_wire(res)
    assert runner.check_wire({**res, "wire_over_fp32_ring": 0.033}) is None
    without = {k: v for k, v in declared.items() if not k.startswith("MCCL_COMPRESSION")}
    with pytest.raises(ConfigError, match="does not declare"):
        variants.resolve(["diloco-h32-int8"], without)


def _diloco_run_rank(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from support.ranks import init_pg

    torch.manual_seed(0)
    init_pg(rank, world)
    try:
        m = torch.nn.Linear(4, 3)
        inner = torch.optim.AdamW(m.parameters(), lr=0.05)
        run = train.DiLoCoRun(torch, m, inner, {"H": 2, "F": 1, "tau": 0, "alpha": 0.0, "compression": None})
        start = [p.detach().clone() for p in m.parameters()]
        run.enter()
        x = torch.full((2, 4), float(rank + 1))
        for _ in range(3):            # syncs after inner step 2; step 3 moves the local model alone
            inner.zero_grad()
            m(x).square().sum().backward()
            inner.step()
        local = [p.detach().clone() for p in m.parameters()]
        glob = [g.clone() for g in run.global_params()]
        with run.global_weights():
            seen = [p.detach().clone() for p in m.parameters()]
        after = [p.detach().clone() for p in m.parameters()]
        run.exit()
        spread = train._replica_spread(torch, dist, m, run)
        return {"moved": not all(torch.equal(a, b) for a, b in zip(glob, start)),
                "evaluates_global": all(torch.equal(a, b) for a, b in zip(seen, glob)),
                "restores_local": all(torch.equal(a, b) for a, b in zip(after, local)),
                "local_differs": not all(torch.equal(a, b) for a, b in zip(local, glob)),
                "spread": spread, "stats": run.to_dict()}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_diloco_run_evaluates_theta_global_and_its_replicas_agree(ranks):
    """The bench's DiLoCo: the validation model is theta_global (the local model put back after),
    theta_global is the same on every rank, and the counts say one sync of the parameters' bytes."""
    for r in ranks(_diloco_run_rank, 2, timeout_s=50):
        assert r["moved"] and r["evaluates_global"] and r["restores_local"] and r["local_differs"], r
        assert r["spread"]["identical"], r["spread"]
        assert r["stats"]["syncs"] == 1 and r["stats"]["inner_steps"] == 3 and r["stats"]["rounds"] == [1]
        assert r["stats"]["payload_bytes"] == (4 * 3 + 3) * 4
