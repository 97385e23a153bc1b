"""Failure semantics of the all-reduce, in virtual time (SimPy) where a crash can land exactly mid-round.

The guarantee under test: for every surviving member, every element ends either as a
weighted mean over a set of contributors that includes that member, or unchanged; the
elements outside `result.updated` are bit-for-bit unchanged; and a lost owner's span
is re-reduced by a substitute (rescued) when time allows.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import zgossip
from sim import NetworkModel, SimCluster
from zgossip.node import NodeConfig, StepDone, StepFailed

N, NUMEL = 4, 4096


def _cluster(seed=0, bandwidth=2e6, **cfg):
    net = NetworkModel(latency=0.001, bandwidth=bandwidth)
    cl = SimCluster(seed=seed, network=net)
    kw = dict(prefix="f", target_group_size=N, min_group_size=2, part_size_bytes=1024, part_timeout=0.5,
              gossip_interval=0.05, peer_timeout=3.0, matchmaking_time=0.3, request_timeout=0.2)
    kw.update(cfg)
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.5, 2.0, N)
    peers = []
    for i in range(N):
        ts = [rng.standard_normal(NUMEL).astype(np.float64)]
        peers.append(cl.add_peer(NodeConfig(**kw), tensors=ts, known=peers))
    return cl, peers, weights


def _check_semantics(before, weights, after, me, result):
    """Each element: unchanged, or the weighted mean over some subset of members that contains `me`."""
    candidates = [before[me]]
    for k in range(1, N):
        for subset in itertools.combinations([i for i in range(N) if i != me], k):
            s = (me, *subset)
            w = weights[list(s)]
            candidates.append(sum(w[j] * before[i] for j, i in enumerate(s)) / w.sum())
    cand = np.stack(candidates)
    ok = np.isclose(cand, after[None, :], rtol=0, atol=1e-12).any(axis=0)
    assert ok.all(), f"{(~ok).sum()} elements are neither unchanged nor a mean over a set containing this peer"
    mask = np.zeros(NUMEL, bool)
    if result is not None:
        for lo, hi in result.updated:
            mask[lo:hi] = True
    assert np.array_equal(after[~mask], before[me][~mask]), "an element outside result.updated changed"


@pytest.mark.parametrize("crash_at", [0.0005, 0.004, 0.008, 0.012])
@pytest.mark.parametrize("victim", [0, 2])
def test_crash_mid_allreduce_keeps_the_guarantee(crash_at, victim):
    cl, peers, weights = _cluster()
    before = [p.tensors[0].copy() for p in peers]
    evs = [p.step_tensors(weight=float(w)) for p, w in zip(peers, weights)]
    start = cl.env.now
    # run until the group formed and the round is in flight, then crash the victim
    cl.run(until=cl.env.timeout(0))
    while not all(p.node.step is not None and p.node.step.round is not None for p in peers):
        cl.run(until=cl.env.now + 0.0005)
        assert cl.env.now - start < 2
    cl.run(until=cl.env.now + crash_at)
    peers[victim].crash()
    survivors = [i for i in range(N) if i != victim]
    cl.run(until=cl.env.all_of([evs[i] for i in survivors]))
    assert cl.env.now - start < 10, "survivors must finish within their timeouts"
    for i in survivors:
        act = evs[i].value
        if isinstance(act, StepFailed):
            assert isinstance(act.error, zgossip.PeerLost)
            result = None
        else:
            assert isinstance(act, StepDone)
            result = act.result
            assert peers[victim].peer_id in result.lost or peers[victim].peer_id in result.contributors
            assert peers[i].peer_id in result.contributors
        _check_semantics(before, weights, peers[i].tensors[0], i, result)


def test_lost_owner_span_is_rescued_by_survivors():
    """The victim dies right after sending its data: its span is re-reduced among the survivors."""
    cl, peers, weights = _cluster()
    before = [p.tensors[0].copy() for p in peers]
    victim = 1
    evs = [p.step_tensors(weight=float(w)) for p, w in zip(peers, weights)]
    while not all(p.node.step is not None and p.node.step.round is not None for p in peers):
        cl.run(until=cl.env.now + 0.0005)
    cl.run(until=cl.env.now + 0.004)
    peers[victim].crash()
    survivors = [i for i in range(N) if i != victim]
    cl.run(until=cl.env.all_of([evs[i] for i in survivors]))
    for i in survivors:
        res = evs[i].value.result
        span = next(s for s in res.spans if s.owner == peers[victim].peer_id)
        assert span.rescued > 0, "the lost owner's span should have been re-reduced"
        assert span.averaged == span.parts, "with time to spare, nothing of the lost span stays unchanged"
        _check_semantics(before, weights, peers[i].tensors[0], i, res)
        # after a successful rescue every element of every survivor was averaged
        assert res.updated == [(0, NUMEL)]


def test_next_round_among_survivors_is_exact():
    cl, peers, weights = _cluster(min_group_size=3)
    evs = [p.step_tensors() for p in peers]
    while not all(p.node.step is not None and p.node.step.round is not None for p in peers):
        cl.run(until=cl.env.now + 0.0005)
    peers[3].crash()
    cl.run(until=cl.env.all_of(evs[:3]))
    cl.run(until=cl.env.now + 4.0)  # the crashed peer expires from membership
    now_vals = [peers[i].tensors[0].copy() for i in range(3)]
    ev2 = [peers[i].step_tensors() for i in range(3)]
    cl.run(until=cl.env.all_of(ev2))
    truth = np.mean(now_vals, axis=0)
    for i in range(3):
        assert isinstance(ev2[i].value, StepDone), ev2[i].value
        np.testing.assert_allclose(peers[i].tensors[0], truth, atol=1e-12)


@pytest.mark.parametrize("loss", [0.02, 0.1])
@pytest.mark.parametrize("seed", range(6))
def test_message_loss_never_corrupts(seed, loss):
    """With messages lost at random, steps may average less, never wrongly."""
    net = NetworkModel(latency=0.001, bandwidth=5e6, loss=loss)
    cl = SimCluster(seed=seed, network=net)
    rng = np.random.default_rng(seed)
    kw = dict(prefix="l", target_group_size=N, min_group_size=2, part_size_bytes=1024, part_timeout=0.3,
              gossip_interval=0.05, peer_timeout=3.0, matchmaking_time=0.3, request_timeout=0.2)
    peers = []
    for i in range(N):
        peers.append(cl.add_peer(NodeConfig(**kw), tensors=[rng.standard_normal(NUMEL)], known=peers))
    weights = np.ones(N)
    for _ in range(3):
        before = [p.tensors[0].copy() for p in peers]
        evs = [p.step_tensors(timeout=3.0) for p in peers]
        cl.run(until=cl.env.all_of(evs))
        for i, e in enumerate(evs):
            res = e.value.result if isinstance(e.value, StepDone) else None
            _check_semantics(before, weights, peers[i].tensors[0], i, res)


def test_peer_down_notice_excludes_at_once():
    """A transport-level disconnect (what the ZeroMQ driver reports on SIGKILL) skips the timeouts."""
    cl, peers, weights = _cluster(part_timeout=5.0)
    before = [p.tensors[0].copy() for p in peers]
    evs = [p.step_tensors(weight=float(w)) for p, w in zip(peers, weights)]
    while not all(p.node.step is not None and p.node.step.round is not None for p in peers):
        cl.run(until=cl.env.now + 0.0005)
    t_crash = cl.env.now + 0.002
    cl.run(until=t_crash)
    victim = peers[3]
    victim.crash()
    for p in peers[:3]:
        p.node.on_peer_down(victim.endpoint, cl.env.now)
        p.pump()
    cl.run(until=cl.env.all_of(evs[:3]))
    assert cl.env.now - t_crash < 1.0  # far below part_timeout=5 s
    for i in range(3):
        res = evs[i].value.result
        assert victim.peer_id in res.lost
        _check_semantics(before, weights, peers[i].tensors[0], i, res)


def test_a_peer_with_nan_data_is_left_out_without_stalling_the_round():
    cl, peers, weights = _cluster(part_timeout=5.0)
    peers[2].tensors[0][100] = np.nan
    before = [p.tensors[0].copy() for p in peers]
    evs = [p.step_tensors(weight=float(w)) for p, w in zip(peers, weights)]
    t0 = cl.env.now
    cl.run(until=cl.env.all_of(evs))
    assert cl.env.now - t0 < 1.0  # no timeout was needed (part_timeout is 5 s)
    ok = [0, 1, 3]
    w = weights[ok]
    mean_others = sum(wi * before[i] for wi, i in zip(w, ok)) / w.sum()
    mean_all = sum(wi * b for wi, b in zip(weights, before)) / weights.sum()
    span = slice(0, NUMEL // N)  # the span holding element 100: its owner left peer 2 out of it
    rest = slice(NUMEL // N, NUMEL)  # other owners got only finite parts from peer 2 and kept it
    for i in ok:
        assert np.isfinite(peers[i].tensors[0]).all()
        np.testing.assert_allclose(peers[i].tensors[0][span], mean_others[span], atol=1e-12)
        np.testing.assert_allclose(peers[i].tensors[0][rest], mean_all[rest], atol=1e-12)
    # the NaN peer keeps its own copy of that span exactly (nothing averaged without it there)
    np.testing.assert_array_equal(peers[2].tensors[0][span], before[2][span])
    np.testing.assert_allclose(peers[2].tensors[0][rest], mean_all[rest], atol=1e-12)
    assert peers[2].peer_id in evs[0].value.result.contributors  # per span: it did contribute elsewhere


def test_a_result_holding_nan_is_taken_only_up_to_its_first_bad_block(monkeypatch):
    """A buggy reducer sends a result with a NaN in it: receivers copy the result block by block
    and stop before the bad block; `updated` says exactly which elements changed."""
    from zgossip import kernels
    from zgossip.allreduce import AllReduceRound
    import dataclasses

    from zgossip.wire import MsgType

    numel = 4 * 4096  # spans of 4096 float64, parts of 2048: blocks of kernels.BLOCK=1024 inside
    cl = SimCluster(seed=3, network=NetworkModel(latency=0.001, bandwidth=2e6))
    kw = dict(prefix="f", target_group_size=N, min_group_size=2, part_size_bytes=2048 * 8, part_timeout=5.0,
              gossip_interval=0.05, peer_timeout=3.0, matchmaking_time=0.3, request_timeout=0.2)
    rng = np.random.default_rng(3)
    weights = rng.uniform(0.5, 2.0, N)
    peers = []
    for i in range(N):
        peers.append(cl.add_peer(NodeConfig(**kw), tensors=[rng.standard_normal(numel)], known=peers))
    buggy = peers[1].peer_id
    bad_at = 1500  # inside the second block of part 0 of the buggy peer's span
    orig_send = AllReduceRound._send

    def send(self, member, msg):
        if self.me.peer_id == buggy and msg.type is MsgType.RESULT and msg.part == 0 and msg.data.size:
            data = msg.payload[0].copy()
            data[bad_at] = np.nan
            msg = dataclasses.replace(msg, data=data)
        orig_send(self, member, msg)

    monkeypatch.setattr(AllReduceRound, "_send", send)
    before = [p.tensors[0].copy() for p in peers]
    evs = [p.step_tensors(weight=float(w)) for p, w in zip(peers, weights)]
    t0 = cl.env.now
    cl.run(until=cl.env.all_of(evs))
    assert cl.env.now - t0 < 1.0  # nobody waited for a timeout
    mean_all = sum(w * b for w, b in zip(weights, before)) / weights.sum()
    for i, p in enumerate(peers):
        res = evs[i].value.result
        after = p.tensors[0]
        assert np.isfinite(after).all()
        span = [s for s in res.spans if s.owner == buggy][0]
        start = [k for k, s in enumerate(res.spans) if s.owner == buggy][0] * 4096
        cut = start + bad_at - bad_at % kernels.BLOCK
        if p.peer_id == buggy:
            assert res.complete  # the reducer's own copy was correct
            continue
        assert not res.complete
        assert span.averaged == span.parts - 1  # part 0 was taken only in part
        np.testing.assert_allclose(after[start:cut], mean_all[start:cut], atol=1e-12)
        np.testing.assert_array_equal(after[cut:start + 2048], before[i][cut:start + 2048])
        np.testing.assert_allclose(after[start + 2048:start + 4096], mean_all[start + 2048:start + 4096], atol=1e-12)
        mask = np.zeros(numel, bool)
        for a, b in res.updated:
            mask[a:b] = True
        assert not mask[cut:start + 2048].any() and mask[start:cut].all()
        np.testing.assert_array_equal(after[~mask], before[i][~mask])


def test_a_mean_that_overflows_is_left_unchanged_for_everyone_without_a_timeout():
    cl, peers, weights = _cluster(part_timeout=5.0)
    big = np.finfo(np.float64).max
    for p in peers:
        p.tensors[0][:] = big / 8  # the sum of N=4 of these is finite
    for p in peers:
        p.tensors[0][:NUMEL // N] = big / 2  # every term finite, their mean too, but their sum overflows
    before = [p.tensors[0].copy() for p in peers]
    evs = [p.step_tensors(weight=1.0) for p in peers]
    t0 = cl.env.now
    cl.run(until=cl.env.all_of(evs))
    assert cl.env.now - t0 < 1.0
    for i, p in enumerate(peers):
        res = evs[i].value.result
        np.testing.assert_array_equal(p.tensors[0][:NUMEL // N], before[i][:NUMEL // N])
        assert res.spans[0].averaged == 0
        assert all(lo >= NUMEL // N for lo, _ in res.updated)


@pytest.fixture
def one_part_per_span(monkeypatch):
    """Spans are not split below the configured part size (`partition.MIN_PARTS`), so that a span
    of a few accumulate blocks is one part, as these tests need."""
    from zgossip import partition

    monkeypatch.setattr(partition, "MIN_PARTS", 1)


def _big_part_cluster(n, span, seed=5):
    """n peers, float64, one part per span of `span` elements (several accumulate blocks); use with
    the `one_part_per_span` fixture."""
    cl = SimCluster(seed=seed, network=NetworkModel(latency=0.001, bandwidth=1e8))
    kw = dict(prefix="f", target_group_size=n, min_group_size=2, part_size_bytes=span * 8, part_timeout=5.0,
              gossip_interval=0.05, peer_timeout=3.0, matchmaking_time=0.3, request_timeout=0.2)
    rng = np.random.default_rng(seed)
    peers = []
    for _ in range(n):
        peers.append(cl.add_peer(NodeConfig(**kw), tensors=[rng.standard_normal(n * span)], known=peers))
    return cl, peers, rng.uniform(0.5, 2.0, n)


def _own_span(res, me, span):
    k = [s.owner for s in res.spans].index(me)
    return k * span, (k + 1) * span


def test_a_nan_met_in_the_owners_last_pass_keeps_the_mean_it_already_stored_in_its_own_tensor(one_part_per_span):
    """The owner's last pass writes the mean straight into its tensor; a NaN found there after some
    blocks were stored leaves those blocks averaged for the owner only: the part is unchanged for
    everyone else, and `updated` says exactly that."""
    from zgossip import kernels

    n, span = 3, 2 * kernels.ACC_BLOCK
    cl, peers, weights = _big_part_cluster(n, span)
    off = kernels.ACC_BLOCK + 5  # in the second block of every span
    # a group lists its members by peer id: the last one's term is in every owner's last pass
    last = max(range(n), key=lambda i: peers[i].peer_id)
    for k in range(n):
        peers[last].tensors[0][k * span + off] = np.nan
    before = [p.tensors[0].copy() for p in peers]
    t0 = cl.env.now
    evs = [p.step_tensors(weight=float(w)) for p, w in zip(peers, weights)]
    cl.run(until=cl.env.all_of(evs))
    assert evs[0].value.result.members[-1] == peers[last].peer_id
    assert cl.env.now - t0 < 1.0  # no timeout
    mean_all = sum(w * b for w, b in zip(weights, before)) / weights.sum()
    for i, p in enumerate(peers):
        res = evs[i].value.result
        lo, hi = _own_span(res, p.peer_id, span)
        cut = lo + kernels.ACC_BLOCK
        after = p.tensors[0]
        assert res.updated == [(lo, cut)]
        np.testing.assert_allclose(after[lo:cut], mean_all[lo:cut], rtol=0, atol=1e-12)
        mask = np.zeros(after.size, bool)
        mask[lo:cut] = True
        np.testing.assert_array_equal(after[~mask], before[i][~mask])  # NaN included, for the last member
        assert set(res.contributors) == {q.peer_id for q in peers}
        assert not res.complete


def test_a_mean_that_overflows_part_way_keeps_what_the_owner_stored_before(one_part_per_span):
    from zgossip import kernels

    n, span = 3, 2 * kernels.ACC_BLOCK
    cl, peers, weights = _big_part_cluster(n, span, seed=6)
    big = np.finfo(np.float64).max
    ok = 3 * kernels.SUB_BLOCK + 11
    for p in peers:
        for k in range(n):
            p.tensors[0][k * span + ok:(k + 1) * span] = big / 2  # every term finite, the sum is not
    before = [p.tensors[0].copy() for p in peers]
    evs = [p.step_tensors(weight=1.0) for p in peers]
    t0 = cl.env.now
    cl.run(until=cl.env.all_of(evs))
    assert cl.env.now - t0 < 1.0
    with np.errstate(over="ignore"):
        mean_all = sum(before) / n  # inf past the cut, where it is not compared
    for i, p in enumerate(peers):
        res = evs[i].value.result
        lo, hi = _own_span(res, p.peer_id, span)
        cut = lo + ok - ok % kernels.SUB_BLOCK  # the owner stored the sub-blocks before the overflow
        assert res.updated == [(lo, cut)]
        np.testing.assert_allclose(p.tensors[0][lo:cut], mean_all[lo:cut], rtol=0, atol=1e-12)
        mask = np.zeros(p.tensors[0].size, bool)
        mask[lo:cut] = True
        np.testing.assert_array_equal(p.tensors[0][~mask], before[i][~mask])
        assert np.isfinite(p.tensors[0]).all()


def test_a_part_left_with_one_contributor_stays_bit_for_bit_unchanged():
    """When every other member of a part is gone, its "mean" is the survivor's own data: the part
    is left unchanged (and not listed in `updated`), not rewritten as x*w/w, which can differ in
    the last bit."""
    cl = SimCluster(seed=9, network=NetworkModel(latency=0.001, bandwidth=2e6))
    kw = dict(prefix="f", target_group_size=2, min_group_size=2, part_size_bytes=1024, part_timeout=0.5,
              gossip_interval=0.05, peer_timeout=3.0, matchmaking_time=0.3, request_timeout=0.2)
    rng = np.random.default_rng(9)
    peers = []
    for _ in range(2):
        peers.append(cl.add_peer(NodeConfig(**kw), tensors=[rng.standard_normal(NUMEL)], known=peers))
    before = [p.tensors[0].copy() for p in peers]
    evs = [peers[0].step_tensors(weight=3.0)]  # x*3/3 != x for some x
    # peer 1 steps 1 ms later: peer 0's note is there, so it starts its round at once, while peer 0
    # starts when peer 1's note reaches it, 1 ms on
    cl.run(until=cl.env.now + 0.001)
    evs.append(peers[1].step_tensors(weight=3.0))
    while not all(p.node.step is not None and p.node.step.round is not None for p in peers):
        cl.run(until=cl.env.now + 0.0001)
    peers[1].crash()  # before its parts of peer 0's span could arrive (1 ms latency)
    cl.run(until=evs[0])
    res = evs[0].value.result
    after = peers[0].tensors[0]
    assert peers[1].peer_id in res.lost
    own = [s for s in res.spans if s.owner == peers[0].peer_id][0]
    assert own.averaged < own.parts  # parts of our own span were left with our term alone
    mask = np.zeros(NUMEL, bool)
    for a, b in res.updated:  # results peer 1 had sent before it died: means over both
        mask[a:b] = True
        np.testing.assert_allclose(after[a:b], (before[0][a:b] + before[1][a:b]) / 2, rtol=0, atol=1e-12)
    assert np.array_equal(after[~mask], before[0][~mask])  # the rest, own span included: the same bits


def one_way_cut_scenario():
    """Three hosts on 20 Mbit/s; 0.8 s into the first round (a 4 MiB all-reduce of ~3 s) host 2's
    traffic to host 0 stops for good, while host 0 still reaches host 2 (asymmetric reachability:
    a firewall rule, a half-broken route). Shared with the testbed test of the same fault."""
    return {"seed": 2, "rounds": 1, "numel": 1 << 20, "dtype": "float32", "grid": [], "step_timeout": 4.0,
            "round_gap": 0.0, "bootstrap_time": 2.0,
            "faults": [{"kind": "partition", "sides": [[2], [0]], "start": 2.8, "end": 1000.0, "one_way": True}],
            "protocol": {"target_group_size": 3, "min_group_size": 2, "matchmaking_time": 1.0,
                         "part_timeout": 1.0, "allreduce_timeout": 10.0},
            "hosts": [{"up_mbit": 20, "down_mbit": 20, "latency_ms": 5}] * 3}


def test_a_member_cut_off_one_way_is_told_it_was_given_up_and_ends_with_its_group():
    """Host 0 stops hearing host 2 and gives it up after its silence limit; host 2 still hears
    everyone. Told so (GAVE_UP), host 2 keeps its own values where host 0 went on without it and
    ends with the group -- before, it waited for results and rescues that were never coming until
    `allreduce_timeout` (10 s here; 18-21 s on the testbed's lossy 300 ms links), and asked a
    substitute to re-reduce the span of an owner that was alive. The in-place step does not wait
    for what it still had queued to host 0 either (`Node.gone`)."""
    from sim.scenario import Scenario, ScenarioRun

    sc = one_way_cut_scenario()
    run = ScenarioRun(Scenario.from_dict(sc))
    env = run.env
    run.cluster.run(until=sc["bootstrap_time"])
    t0 = env.now
    evs = {i: p.step_tensors(timeout=sc["step_timeout"]) for i, p in enumerate(run.slots)}
    ends = {}
    for i, ev in evs.items():
        ev.callbacks.append(lambda _e, i=i: ends.__setitem__(i, env.now - t0))
    run.cluster.run(until=env.any_of([env.all_of(list(evs.values())), env.timeout(30.0)]))
    res = {i: ev.value.result for i, ev in evs.items()}
    assert all(isinstance(ev.value, StepDone) for ev in evs.values())
    ids = [p.node.peer_id for p in run.slots]
    assert res[0].lost == (ids[2],) and res[2].lost == (ids[0],)  # host 2 asked no substitute for host 0's span
    # host 1 hears host 2: it refuses to re-reduce host 2's span for host 0 (empty notices: host 0
    # keeps its own values there at once) and keeps host 2's own results, whole
    assert res[1].lost == () and res[1].complete
    assert not any(s.rescued for r in res.values() for s in r.spans)
    # it ended with its group: it neither waited for its own limits (10 s) nor for what it had
    # queued to host 0 (part_timeout, 1 s)
    assert ends[2] <= max(ends[0], ends[1]), ends
    covered = sum(b - a for a, b in res[2].updated)
    assert 0 < covered < sc["numel"], covered  # host 0's span stayed as it was on host 2; the rest was averaged
    print("ends", ends, "host 2 averaged", covered / sc["numel"])


def test_a_round_that_cannot_start_ends_its_step_at_once_and_tells_the_group(monkeypatch):
    """A round the node cannot build (a bug, or a plan it refuses) ends its step with that error at
    once, and the group is told (ABORT) -- not a step waiting out its deadline with no round."""
    import zgossip.node as node_mod
    from zgossip.errors import ProtocolError

    cl, peers, weights = _cluster(allreduce_timeout=20.0)
    real = node_mod.AllReduceRound
    victim = peers[1]

    def build(spec, *a, **kw):
        if spec.members[spec.rank].peer_id == victim.peer_id:
            raise ProtocolError("refusing to build a PART: w out of range")
        return real(spec, *a, **kw)

    monkeypatch.setattr(node_mod, "AllReduceRound", build)
    before = [p.tensors[0].copy() for p in peers]
    t0 = cl.env.now
    evs = [p.step_tensors(weight=float(w)) for p, w in zip(peers, weights)]
    cl.run(until=cl.env.all_of(evs))
    assert isinstance(evs[1].value, StepFailed) and isinstance(evs[1].value.error, ProtocolError)
    assert cl.env.now - t0 < 5.0  # neither its step nor the others' waited for allreduce_timeout (20 s)
    assert np.array_equal(victim.tensors[0], before[1])
    for i in (0, 2, 3):
        res = evs[i].value.result
        assert victim.peer_id in res.lost
        _check_semantics(before, weights, peers[i].tensors[0], i, res)
