"""Error feedback's key and cap (compress/feedback.h; what mccld needs of it): an op may key its
residual by something other than its buffer (mccld runs every op on one reused segment and
passes the client's tensor address), and MCCL_COMPRESSION_FEEDBACK_MAX_BYTES bounds the
residuals a communicator keeps. Ranks are threads."""

from __future__ import annotations

import numpy as np
import pytest

from support.engine import SUM, make_options, ptr, ranks, run_ranks

pytestmark = pytest.mark.timeout(120)

F32 = 0
N = 3
COUNT = 70_001


def _inputs(step: int, bucket: int) -> list[np.ndarray]:
    return [np.random.default_rng(1000 * step + 10 * bucket + r).standard_normal(COUNT).astype(np.float32)
            for r in range(N)]


def _run(opts, buckets: int, steps: int, scratch: bool) -> list[list[bytes]]:
    """``steps`` rounds over ``buckets`` same-sized buckets; ``scratch``: every op runs on one
    reused buffer keyed by its bucket's own (as mccld runs them), else on the bucket itself."""
    out = []
    with ranks(N, opts=opts) as comms:
        own = [[np.zeros(COUNT, np.float32) for _ in range(buckets)] for _ in range(N)]
        reused = [np.zeros(COUNT, np.float32) for _ in range(N)]
        for step in range(steps):
            got = []
            for b in range(buckets):
                xs = _inputs(step, b)

                def body(r, c, b=b, xs=xs):
                    if scratch:
                        reused[r][:] = xs[r]
                        c.wait(c.allreduce(ptr(reused[r]), COUNT, F32, SUM, feedback_key=ptr(own[r][b])), 30)
                        return reused[r].tobytes()
                    own[r][b][:] = xs[r]
                    c.wait(c.allreduce(ptr(own[r][b]), COUNT, F32, SUM), 30)
                    return own[r][b].tobytes()
                res = run_ranks(comms, body)
                assert all(x == res[0] for x in res)
                got.append(res[0])
            out.append(got)
    return out


def test_a_feedback_key_stands_for_the_buffer():
    opts = make_options(compression="int8")
    by_buffer = _run(opts, buckets=2, steps=3, scratch=False)
    assert _run(opts, buckets=2, steps=3, scratch=True) == by_buffer
    # Keyed by the reused buffer itself instead, the two buckets would share one residual.
    no_feedback = _run(make_options(compression="int8", compression_feedback=False), buckets=2, steps=3,
                       scratch=False)
    assert by_buffer[1] != no_feedback[1]


def test_the_cap_drops_the_least_recently_used_residual():
    fed = _run(make_options(compression="int8"), buckets=2, steps=3, scratch=False)
    plain = _run(make_options(compression="int8", compression_feedback=False), buckets=2, steps=3, scratch=False)
    # Room for one bucket's residual: each op drops the other's, so every op starts from zero.
    capped = _run(make_options(compression="int8", compression_feedback_max_bytes=4 * COUNT), buckets=2, steps=3,
                  scratch=False)
    assert capped == plain and capped != fed
    # Smaller than one residual: no feedback at all, rather than a residual past the cap.
    assert _run(make_options(compression="int8", compression_feedback_max_bytes=4 * COUNT - 4), buckets=2,
                steps=3, scratch=False) == plain
