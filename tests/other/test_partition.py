"""Property tests of the partition and reduction math."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zgossip.kernels import accumulate
from zgossip.partition import make_plan, span_fractions, span_sizes

bandwidths = st.lists(st.one_of(st.just(0.0), st.floats(0.01, 1000.0)), min_size=1, max_size=24).filter(lambda b: sum(b) > 0)


def _slowest(fracs, bws):
    """Time of the slowest member per byte of vector: S(1 + (n-2) f) through its link."""
    n = len(bws)
    return max((1 + (n - 2) * f) / b for f, b in zip(fracs, bws) if b > 0)


@given(numel=st.integers(0, 10_000), bws=bandwidths)
def test_spans_cover_everything_and_follow_the_best_split(numel, bws):
    sizes = span_sizes(numel, bws)
    fracs = span_fractions(bws)
    assert sum(sizes) == numel and all(s >= 0 for s in sizes)
    assert abs(sum(fracs) - 1.0) < 1e-9
    for s, f, b in zip(sizes, fracs, bws):
        if b == 0:
            assert s == 0 and f == 0  # clients reduce nothing
        assert abs(s - numel * f) < 1.0 + 1e-9  # largest remainder: off by less than one element
    # the split never makes the slowest member slower than the proportional split does
    total = sum(bws)
    assert _slowest(fracs, bws) <= _slowest([b / total for b in bws], bws) * (1 + 1e-9)


def test_best_split_examples():
    assert span_sizes(12, [1.0, 1.0, 1.0]) == [4, 4, 4]  # equal rates: equal spans
    assert span_sizes(10, [1.0, 3.0]) == [3, 7]  # two members: proportional (the split does not matter)
    # the issue-10 network, hints = link rates in Mbit/s: the 1 Gbit host can take the whole vector
    # (S(1 + 2) bytes at 1 Gbit/s) and still finish before any other host has moved its own S
    assert span_fractions([1000.0, 100.0, 20.0, 50.0]) == [1.0, 0.0, 0.0, 0.0]
    # home links 100/20/50/100: the two 100 Mbit hosts share the vector; at that point the 50 Mbit
    # host's own data and results already take as long as theirs, so it owns nothing either
    f = span_fractions([100.0, 20.0, 50.0, 100.0])
    assert f[1] == f[2] == 0.0 and abs(f[0] - 0.5) < 1e-9 and f[0] == f[3]
    # with room to spare, a middle host does own a share, less than the fast ones
    f = span_fractions([100.0, 80.0, 100.0, 100.0])
    assert 0 < f[1] < f[0] == f[2] == f[3]


@given(numel=st.integers(0, 5000), bws=bandwidths, part=st.integers(1, 700))
def test_parts_tile_each_span_exactly(numel, bws, part):
    plan = make_plan(numel, bws, part)
    covered = np.zeros(numel, dtype=np.int64)
    for o in range(plan.size):
        lo, hi = plan.span(o)
        prev = lo
        for p in range(plan.num_parts(o)):
            a, b = plan.part(o, p)
            assert a == prev and 0 < b - a <= part
            covered[a:b] += 1
            prev = b
        assert prev == hi
    assert (covered == 1).all()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    numel=st.integers(1, 400),
    part=st.integers(1, 64),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_partitioned_ordered_reduction_equals_weighted_mean(n, numel, part, seed, data):
    bws = data.draw(st.lists(st.floats(0.0, 10.0), min_size=n, max_size=n).filter(lambda b: sum(b) > 0))
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n, numel))
    w = rng.uniform(0.01, 10.0, n)
    plan = make_plan(numel, bws, part)
    out = np.empty(numel)
    for o in range(plan.size):
        for p in range(plan.num_parts(o)):
            a, b = plan.part(o, p)
            acc = np.empty(b - a)
            wsum = 0.0
            for j in range(n):  # fixed member order, as the owner does; the weight sum comes with the last
                wsum += w[j]
                assert accumulate(acc, [xs[j, a:b]], [w[j]], first=j == 0, divisor=wsum if j == n - 1 else 0.0) == (-1, 0)
            out[a:b] = acc
    np.testing.assert_allclose(out, (w[:, None] * xs).sum(0) / w.sum(), rtol=1e-12, atol=1e-12)


def test_all_clients_is_an_error():
    with pytest.raises(ValueError, match="clients"):
        span_sizes(10, [0.0, 0.0])


def test_streamed_part_size_splits_each_span_but_keeps_large_parts():
    from zgossip.partition import MIN_PART_BYTES, MIN_PARTS, streamed_part_elems

    mib = 1 << 18  # float32 per MiB
    # 4 MiB tensor, 4 members, 4 MiB parts configured: each 1 MiB span in MIN_PARTS parts
    pe = streamed_part_elems(4 * mib, [1.0] * 4, 4 * mib, 4)
    assert make_plan(4 * mib, [1.0] * 4, pe).num_parts(0) == MIN_PARTS
    # the loopback bench's 64 MiB over 4 keeps the configured 4 MiB parts
    assert streamed_part_elems(64 * mib, [1.0] * 4, 4 * mib, 4) == 4 * mib
    # never above the configured size, never below MIN_PART_BYTES (unless configured so)
    assert streamed_part_elems(1000, [1.0] * 4, 100_000, 4) == MIN_PART_BYTES // 4
    assert streamed_part_elems(1000, [1.0] * 4, 10, 4) == 10
    # clients do not count as span owners
    assert streamed_part_elems(8 * mib, [1.0, 1.0, 0.0, 0.0], 4 * mib, 4) == mib
