"""tools/bench/reform.py's pure parts: the global batch both worlds split, the fit, the
milestones read off mcclctl's time-stamped output, and the summary. (The tool itself runs
fleets of mcclds for minutes: python -m tools.bench.reform --hosts 2 --repeats 1 checks it.)"""

from __future__ import annotations

from tools.bench.reform import _milestones, global_batch, linear_fit, summarize


def test_the_global_batch_splits_over_n_and_n_minus_1_ranks():
    for n in range(2, 40):
        g = global_batch(n)
        assert g >= 64 and g % n == 0 and g % (n - 1) == 0, (n, g)
    assert global_batch(2) == 64 and global_batch(16) == 240


def test_the_linear_fit_finds_a_line_and_refuses_one_x():
    fit = linear_fit([4, 8, 12, 16], [5.0, 6.0, 7.0, 8.0])
    assert fit["a"] == 4.0 and fit["b"] == 0.25 and fit["r2"] == 1.0
    assert linear_fit([4, 4], [1.0, 2.0]) is None


def test_milestones_are_the_last_remaining_host_to_reach_each():
    items = [(10.0, "h1", "err", "[mcclctl] left after step 8 (its user is back)"),
             (10.5, "h0", "err", "E1 api.py:1002] failed (exitcode: 75) local_rank: 0 (pid: 1) of binary: py"),
             (10.9, "h2", "err", "E1 api.py:1002] failed (exitcode: 75) local_rank: 0 (pid: 2) of binary: py"),
             (11.0, "h1", "err", "E1 api.py:1002] failed (exitcode: 75) local_rank: 0 (pid: 3) of binary: py"),
             (13.0, "h0", "err", "I1 api.py:553] [default] Rendezvous complete for workers. Result:"),
             (13.1, "h2", "err", "I1 api.py:553] [default] Rendezvous complete for workers. Result:"),
             (15.0, "h2", "out", "world 2 on h2: resumed after step 8, from step 9"),
             (15.2, "h2", "out", "step 9 loss 1.000000 world 2")]
    m = _milestones(items, 0, 7, 10.0, ["h0", "h2"], 75)
    assert m == {"hosts_seen_exit": 2, "hosts_seen_rdzv": 2, "workers_exited": 0.9, "rendezvous_done": 3.1,
                 "resumed": 5.0, "first_step": 5.2}


def test_the_summary_takes_medians_per_n_and_fits_every_trial():
    trials = [{"hosts": n, "repeat": r, "ok": True, "leave_s": 0.5, "reform_s": 4.0 + 0.1 * n + r,
               "kill": {"reform_s": 6.0}, "step_problems": [], "leftovers": []}
              for n in (4, 8) for r in (0, 1)]
    trials.append({"hosts": 8, "repeat": 2, "ok": False, "error": "x", "leftovers": ["pid 1"]})
    s = summarize(trials, 100)
    assert s["per_hosts"]["4"]["reform_s"] == {"median": 4.9, "max": 5.4, "min": 4.4}
    assert s["per_hosts"]["8"]["ok"] == 2 and s["per_hosts"]["8"]["trials"] == 3
    assert s["per_hosts"]["8"]["leftovers"] == 1
    fit = s["fits"]["reform_s"]
    assert abs(fit["b"] - 0.1) < 1e-9 and abs(fit["at_100"] - (4.5 + 10.0)) < 1e-6
