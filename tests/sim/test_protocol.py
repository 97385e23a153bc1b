"""One protocol suite, run on both transports: SimPy virtual time and real ZeroMQ sockets."""
from __future__ import annotations

import numpy as np
import pytest

import zgossip
from harness import TRANSPORTS, make

pytestmark = pytest.mark.timeout(120)


def _random_tensors(rng, n, shapes=((7, 5), (13,), (3, 2, 2))):
    return [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(n)]


def _weighted_mean(tensors, weights, k):
    w = np.asarray(weights, dtype=np.float64)
    return sum(wi * t[k].astype(np.float64) for wi, t in zip(w, tensors)) / w.sum()


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
def test_weighted_average_equals_numpy(transport, n):
    rng = np.random.default_rng(n)
    tensors = _random_tensors(rng, n)
    original = [[t.copy() for t in ts] for ts in tensors]
    weights = list(rng.uniform(0.1, 5.0, n))
    h = make(transport, tensors, target_group_size=n, min_group_size=n, part_size_bytes=64)
    try:
        results = h.step_all(weights=weights)
        for r in results:
            assert isinstance(r, zgossip.StepResult), r
            assert len(r.members) == n and r.complete and len(r.contributors) == n
        for i in range(n):
            for k in range(3):
                np.testing.assert_allclose(h.tensors(i)[k], _weighted_mean(original, weights, k), rtol=1e-5, atol=1e-6)
        # every peer ends with the same bits: the reduction order is fixed, not arrival order
        for i in range(1, n):
            for k in range(3):
                assert np.array_equal(h.tensors(i)[k], h.tensors(0)[k])
    finally:
        h.close()


def test_gather_returns_every_members_data(transport):
    n = 4
    rng = np.random.default_rng(7)
    h = make(transport, _random_tensors(rng, n), target_group_size=n)
    try:
        gathers = [{"rank": i, "loss": float(i) / 3, "tags": ["a", i]} for i in range(n)]
        results = h.step_all(gathers=gathers, weights=[1, 2, 3, 4])
        for r in results:
            assert sorted(d["rank"] for d in r.gathered.values()) == list(range(n))
            assert {tuple(d["tags"]) for d in r.gathered.values()} == {("a", i) for i in range(n)}
            assert sorted(r.weights.values()) == [1.0, 2.0, 3.0, 4.0]
            assert set(r.gathered) == set(r.members)
    finally:
        h.close()


def test_clients_reduce_nothing_but_get_the_average(transport):
    n = 5
    rng = np.random.default_rng(11)
    tensors = _random_tensors(rng, n)
    original = [[t.copy() for t in ts] for ts in tensors]
    per_peer = [{"bandwidth": 0.0 if i in (1, 3) else 2.0} for i in range(n)]  # (uneven rates: test_partition)
    h = make(transport, tensors, per_peer=per_peer, target_group_size=n, min_group_size=n, part_size_bytes=32)
    try:
        results = h.step_all()
        for r in results:
            assert r.complete
            assert sum(1 for s in r.spans if s.parts == 0) == 2  # the two clients own no span
        for i in range(n):
            for k in range(3):
                np.testing.assert_allclose(h.tensors(i)[k], _weighted_mean(original, [1] * n, k), rtol=1e-5, atol=1e-6)
    finally:
        h.close()


def test_moshpit_4x4_grid_exact_after_two_rounds(transport):
    n, side = 16, 4
    rng = np.random.default_rng(3)
    tensors = [[rng.standard_normal(10).astype(np.float64)] for _ in range(n)]
    truth = np.mean([t[0] for t in tensors], axis=0)
    per_peer = [{"grid_coords": (i % side, i // side)} for i in range(n)]
    # a line's pool closes as soon as its 4 peers joined, so a long window costs nothing here; it only
    # keeps 16 real peers on 2 busy cores from missing the default 0.5 s one (CI, once, on zmq). Nobody
    # fails here either, so the silence limits are long too: 16 peers' threads in one process on 2
    # loaded cores failed this test once more with the harness's 2 s ones
    # The zmq variant failed once more in a fresh-clone CI run on an idle machine (it passes alone):
    # a rendezvous peer among 16 in one process may take over the 1 s request_timeout to answer, and a
    # joiner that moves on splits its line's pool. 3 s; and the failure now says who got what.
    h = make(transport, tensors, per_peer=per_peer, grid=(side, side), target_group_size=side, min_group_size=side,
             matchmaking_time=4.0, request_timeout=3.0, part_timeout=10.0, peer_timeout=10.0)

    def outcome(results: list) -> list:
        return [(r.key, len(r.members)) if isinstance(r, zgossip.StepResult) else repr(r)[:200] for r in results]

    try:
        first = h.step_all(timeout=15.0)
        assert all(isinstance(r, zgossip.StepResult) and len(r.members) == side for r in first), outcome(first)
        assert len({r.group_id for r in first}) == side
        errs = [np.abs(h.tensors(i)[0] - truth).max() for i in range(n)]
        assert max(errs) > 1e-3  # one round along one axis is not the global mean yet
        second = h.step_all(timeout=15.0)
        assert all(isinstance(r, zgossip.StepResult) and len(r.members) == side for r in second), outcome(second)
        for i in range(n):
            np.testing.assert_allclose(h.tensors(i)[0], truth, rtol=0, atol=1e-12)
    finally:
        h.close()


def test_group_not_found_says_why(transport):
    rng = np.random.default_rng(5)
    h = make(transport, _random_tensors(rng, 2), target_group_size=4, min_group_size=3, matchmaking_time=0.3)
    try:
        results = h.step_all(timeout=1.0)
        for r in results:
            assert isinstance(r, zgossip.GroupNotFound)
            text = str(r)
            assert "min_group_size=3" in text and "2 peer(s)" in text and "Live peers known: 1" in text
    finally:
        h.close()


def test_mismatched_layouts_are_never_averaged_together(transport):
    rng = np.random.default_rng(9)
    tensors = [[rng.standard_normal(8).astype(np.float32)] for _ in range(2)]
    tensors.append([rng.standard_normal(9).astype(np.float32)])
    before = tensors[2][0].copy()
    h = make(transport, tensors, target_group_size=3, min_group_size=2, matchmaking_time=0.3)
    try:
        results = h.step_all(timeout=1.0)
        assert isinstance(results[0], zgossip.StepResult) and len(results[0].members) == 2
        assert isinstance(results[2], zgossip.GroupNotFound)
        assert "different tensor layout" in str(results[2])
        assert np.array_equal(h.tensors(2)[0], before)
    finally:
        h.close()


def test_peer_that_sat_out_a_round_follows_the_swarm_axis():
    """Round numbers are gossiped: a peer that skipped a round steps on the swarm's axis afterwards."""
    from harness import SimHarness

    n, side = 4, 2
    rng = np.random.default_rng(13)
    tensors = [[rng.standard_normal(3)] for _ in range(n)]
    per_peer = [{"grid_coords": (i % side, i // side)} for i in range(n)]
    h = SimHarness(tensors, per_peer=per_peer, grid=(side, side), target_group_size=side, min_group_size=1)
    h.step_all()                                   # round 0, everyone
    h.step_all(indices=[1, 2, 3])                  # round 1, peer 0 sits out
    h.cluster.run(until=h.cluster.env.now + 0.3)   # a few gossip ticks
    assert h.peers[0].node.swarm_round() == 2
    results = h.step_all()                         # round 2: peer 0 must use axis 0 like the others
    assert all(isinstance(r, zgossip.StepResult) for r in results)
    assert {r.key.split("/")[1] for r in results} == {"a0"}


def test_leftover_of_an_overfull_line_fails_fast_and_says_why():
    """Three peers on a line of two: two average at once, the third is told nobody else is coming."""
    from harness import SimHarness

    rng = np.random.default_rng(17)
    tensors = [[rng.standard_normal(3)] for _ in range(3)]
    per_peer = [{"grid_coords": (0, 0)}, {"grid_coords": (1, 0)}, {"grid_coords": (1, 0)}]
    h = SimHarness(tensors, per_peer=per_peer, grid=(2, 2), target_group_size=2, min_group_size=2,
                   matchmaking_time=0.5)
    t0 = h.cluster.env.now
    results = h.step_all(timeout=5.0)
    ok = [r for r in results if isinstance(r, zgossip.StepResult)]
    bad = [r for r in results if isinstance(r, zgossip.GroupNotFound)]
    assert len(ok) == 2 and len(bad) == 1
    assert "full group for this key already formed" in str(bad[0])
    assert h.cluster.env.now - t0 < 1.5  # one window, not the whole 5 s timeout
