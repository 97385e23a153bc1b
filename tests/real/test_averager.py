"""The user API on real sockets: torch and numpy tensors in place, futures, locks, errors, shutdown."""
from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np
import pytest
import torch

import zgossip
from harness import FAST


def _pair(t0, t1, **kw):
    a = zgossip.Averager(t0, prefix="api", target_group_size=2, seed=1, **{**FAST, **kw})
    b = zgossip.Averager(t1, prefix="api", target_group_size=2, initial_peers=[a.endpoint], seed=2, **{**FAST, **kw})
    deadline = time.monotonic() + 10
    while not (a.peers() and b.peers()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return a, b


def test_torch_and_numpy_tensors_are_averaged_in_place():
    ta = [torch.arange(6, dtype=torch.float32).reshape(2, 3), np.full(4, 2.0, dtype=np.float32)]
    tb = [torch.zeros(2, 3), np.zeros(4, dtype=np.float32)]
    a, b = _pair(ta, tb)
    with a, b:
        fa, fb = a.step(wait=False), b.step(wait=False)
        assert isinstance(fa, cf.Future)
        ra, rb = fa.result(10), fb.result(10)
        assert ra.group_id == rb.group_id and ra.complete
        expected = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 2
        assert torch.equal(ta[0], expected) and torch.equal(tb[0], expected)
        assert np.array_equal(ta[1], np.ones(4, np.float32)) and np.array_equal(tb[1], ta[1])
        with a.get_tensors() as ts:
            assert ts[0] is ta[0]


def test_averaging_alpha_moves_part_way():
    x, y = np.zeros(5), np.full(5, 4.0)
    a, b = _pair([x], [y], averaging_alpha=0.5)
    with a, b:
        fa, fb = a.step(wait=False), b.step(wait=False)
        fa.result(10), fb.result(10)
    np.testing.assert_allclose(x, 1.0)  # 0 + 0.5 * (2 - 0)
    np.testing.assert_allclose(y, 3.0)


def test_errors_are_clear():
    with pytest.raises(TypeError, match="float"):
        zgossip.Averager([np.arange(3)], prefix="e")
    with pytest.raises(TypeError, match="contiguous"):
        zgossip.Averager([np.zeros((4, 4), np.float32)[:, 1]], prefix="e")
    with pytest.raises(ValueError, match="at least one"):
        zgossip.Averager([], prefix="e")
    with zgossip.Averager([np.zeros(3, np.float32)], prefix="e", **FAST) as a:
        with pytest.raises(ValueError, match="weight must be > 0, not 0: .* Averager.auxiliary=True."):
            a.step(weight=0)
        with pytest.raises(ValueError, match="weight"):
            a.step(weight=float("nan"))
        with a.get_tensors():
            with pytest.raises(zgossip.ZGossipError, match="deadlock"):
                a.step()
        fut = a.step(wait=False, timeout=1.0)
        with pytest.raises(zgossip.StepInProgress):
            a.step(wait=False)
        with pytest.raises(zgossip.GroupNotFound, match="Live peers known: 0"):
            fut.result(10)
    with pytest.raises(zgossip.AveragerClosed):
        a.step()


def test_errors_share_one_base_class():
    for cls in (zgossip.GroupNotFound, zgossip.RoundTimeout, zgossip.PeerLost, zgossip.ProtocolError,
                zgossip.InvalidMessage, zgossip.AveragerClosed, zgossip.StepInProgress):
        assert issubclass(cls, zgossip.ZGossipError)


def test_shutdown_during_a_step_is_bounded_and_fails_the_future():
    a = zgossip.Averager([np.zeros(3, np.float32)], prefix="s", **FAST)
    fut = a.step(wait=False, timeout=30)
    t0 = time.monotonic()
    a.shutdown()
    assert time.monotonic() - t0 < 5
    with pytest.raises(zgossip.ZGossipError):
        fut.result(5)


def test_group_of_three_with_one_silent_late_joiner():
    """Two peers step, the third steps much later: the two average together, the late one finds no group."""
    xs = [np.full(3, float(i)) for i in range(3)]
    a, b = _pair([xs[0]], [xs[1]])
    c = zgossip.Averager([xs[2]], prefix="api", target_group_size=3, initial_peers=[a.endpoint], seed=3, **FAST)
    with a, b, c:
        fa, fb = a.step(wait=False), b.step(wait=False)
        assert fa.result(10).complete and fb.result(10).complete
        np.testing.assert_allclose(xs[0], 0.5)
        with pytest.raises(zgossip.GroupNotFound):
            c.step(timeout=1.0)
        np.testing.assert_allclose(xs[2], 2.0)


def test_published_info_reaches_peers():
    a, b = _pair([np.zeros(2)], [np.zeros(2)])
    with a, b:
        a.publish(epoch=3, samples=128, rate=17.5, name="a")
        with pytest.raises(ValueError):
            a.publish(bad=[1, 2])
        deadline = time.monotonic() + 5
        while b.peer_infos().get(a.peer_id, {}).get("epoch") != 3:
            assert time.monotonic() < deadline, "info did not propagate"
            time.sleep(0.02)
        assert b.peer_infos()[a.peer_id] == {"epoch": 3, "samples": 128, "rate": 17.5, "name": "a"}
        assert a.peer_infos()[a.peer_id]["name"] == "a"


def test_grid_auto_on_sockets_takes_the_shape_of_the_swarm():
    """grid="auto" (zgossip.autogrid): 4 peers with target 2 settle on a 2x2 grid by gossip and average
    along it: after a round on each axis every peer holds the global mean (a 2x2 grid with one peer
    per cell; random coordinates may double up a cell, then the next rounds even it out)."""
    vals = [np.full(3, float(i), np.float32) for i in range(4)]
    avgs = [zgossip.Averager([vals[0]], prefix="auto", target_group_size=2, grid="auto", seed=10, **FAST)]
    avgs += [zgossip.Averager([v], prefix="auto", target_group_size=2, grid="auto", seed=10 + i,
                              initial_peers=[avgs[0].endpoint], **FAST) for i, v in enumerate(vals[1:], 1)]
    try:
        def shapes():
            return [a._transport.run_on_io(lambda node, now: node.grid.shape, 5.0) for a in avgs]
        deadline = time.monotonic() + 10
        while shapes() != [(2, 2)] * 4:
            assert time.monotonic() < deadline, shapes()
            time.sleep(0.05)
        for _ in range(6):
            futs = [a.step(wait=False, timeout=3.0) for a in avgs]
            for f in futs:
                f.exception(10)  # a lone peer in a cell of its own may find no group: that round leaves it unchanged
            if all(np.allclose(v, 1.5, atol=1e-6) for v in vals):
                break
        assert all(np.allclose(v, 1.5, atol=1e-6) for v in vals), vals
    finally:
        for a in avgs:
            a.shutdown()


def test_members_that_agree_on_who_comes_close_their_group_from_notes_on_sockets():
    """Three peers on real ZeroMQ, gossip settled: after a first step (which settles everyone's
    announced round), the next steps' groups are formed by each member from the others' JOIN_NOTEs
    (stats["closed_early"]), the same group everywhere, and averaged exactly."""
    rng = np.random.default_rng(3)
    ts = [[rng.standard_normal(1000).astype(np.float32)] for _ in range(3)]
    kw = dict(prefix="notes", target_group_size=3, **FAST)
    a = zgossip.Averager(ts[0], seed=1, **kw)
    b = zgossip.Averager(ts[1], initial_peers=[a.endpoint], seed=2, **kw)
    c = zgossip.Averager(ts[2], initial_peers=[a.endpoint], seed=3, **kw)
    with a, b, c:
        deadline = time.monotonic() + 10
        while not all(len(p.peers()) == 2 for p in (a, b, c)):
            assert time.monotonic() < deadline, "the three peers did not meet"
            time.sleep(0.02)
        for _ in range(3):
            expect = np.mean([t[0] for t in ts], axis=0, dtype=np.float64)
            rs = [f.result(10) for f in [p.step(wait=False) for p in (a, b, c)]]
            assert len({r.group_id for r in rs}) == 1 and all(r.complete and len(r.members) == 3 for r in rs)
            for t in ts:
                np.testing.assert_allclose(t[0], expect, rtol=0, atol=1e-6)
            for t, k in zip(ts, (1.0, 2.0, 3.0)):
                t[0] += k  # differ again
        early = [p.stats["closed_early"] for p in (a, b, c)]
        assert all(e >= 2 for e in early), early
