"""Matchmaking with a far peer (found on the testbed, sim/scenarios/hetero4.toml round 0): a joiner
whose round trip to the rendezvous peer exceeds `request_timeout` gave up on it, asked the next
candidate, was redirected back, hosted a pool of one and failed after the whole step timeout --
while the rendezvous peer had put it into the group. Now the JOIN_ACK wait grows with the round
trip the gossip measured, and a joiner that moved on still takes a late JOIN_ACK or GROUP.
"""
from __future__ import annotations

import numpy as np
import pytest

from sim import NetworkModel, SimCluster
from zgossip.matchmaking import Matchmaker
from zgossip.membership import Membership
from zgossip.errors import GroupNotFound
from zgossip.node import NodeConfig, StepDone, StepFailed
from zgossip.wire import MsgType, make_message

N = 4
FAR = 0.2  # one-way access latency of the far peer: a round trip of 0.4 s > request_timeout


def _cluster(far_index, membership="gossip", seed=3):
    def latency(src, dst):
        far = f"sim://peer{far_index}"
        return FAR if far in (src, dst) else 0.002

    cl = SimCluster(seed=seed, network=NetworkModel(latency=latency, bandwidth=50e6), membership=membership)
    cfg = NodeConfig(prefix="far", target_group_size=N, min_group_size=2, part_size_bytes=1 << 14,
                     part_timeout=2.0, gossip_interval=0.1, peer_timeout=5.0, matchmaking_time=0.5,
                     request_timeout=0.3)
    rng = np.random.default_rng(seed)
    peers = []
    for _ in range(N):
        peers.append(cl.add_peer(cfg, tensors=[rng.standard_normal(1 << 14).astype(np.float32)], known=peers))
    return cl, peers, cfg


def _rendezvous(peers):
    node = peers[0].node
    top = node.matchmaker.ranking(node.current_key())[0]
    return next(i for i, p in enumerate(peers) if p.peer_id == top)


def _far_index(membership):
    """A slot that is not the rendezvous peer of the first round (so the far one is a joiner)."""
    cl, peers, _ = _cluster(0, membership)
    return next(i for i in range(N) if i != _rendezvous(peers))


@pytest.mark.parametrize("membership", ["gossip", "static"])
def test_far_joiner_gets_into_the_group_of_its_first_round(membership):
    """gossip: the JOIN_ACK wait covers the measured round trip, so the far peer never moves on.
    static (no round trips measured, so it does move on after request_timeout): the late GROUP of the
    rendezvous peer it left is taken. Either way every peer averages over all four at once --
    nobody waits part_timeout for a member that went elsewhere."""
    far = _far_index(membership)
    cl, peers, cfg = _cluster(far, membership)
    cl.run(until=2.0)  # gossip warm-up (round trips measured)
    evs = [p.step_tensors(timeout=5.0) for p in peers]
    start = cl.env.now
    cl.run(until=cl.env.all_of(evs))
    for ev in evs:
        act = ev.value
        assert isinstance(act, StepDone), act
        assert act.result.complete and len(act.result.members) == N
    assert cl.env.now - start < cfg.part_timeout, "a member waited out part_timeout"
    if membership == "static":
        assert peers[far].node.matchmaker.join is None


# ------------------------------------------------------------------ the state machine alone
class _Joiner:
    """A Matchmaker that knows peers a and b (plus itself) and records what it sends."""

    def __init__(self, rtt=None):
        self.sent = []
        self.groups = []
        self.fails = []
        send = lambda ep, msg: self.sent.append((ep, msg))  # noqa: E731
        rng = np.random.default_rng(0)
        self.ms = Membership("j" * 16, "tcp://j:1", send, rng, peer_timeout=5.0, gossip_interval=0.5)
        for p in ("a", "b"):
            self.ms.observe(p * 16, f"tcp://{p}:1", 0.0)
        if rtt is not None:
            for p in ("a", "b"):
                self.ms._sample_rtt(f"tcp://{p}:1", rtt)
        self.mm = Matchmaker(self.ms, send, rng, lambda spec, now: self.groups.append(spec),
                             lambda sid, err: self.fails.append(err), target_group_size=3, min_group_size=2,
                             matchmaking_time=0.5, request_timeout=0.3)
        # a key whose ranking puts the two others first, so the joiner asks them (not itself)
        self.key = next(k for k in (f"k{i}" for i in range(200)) if self.mm.ranking(k)[-1] == self.ms.peer_id)
        self.first, self.second = self.mm.ranking(self.key)[:2]

    def ep(self, pid):
        return self.ms.endpoint_of(pid)

    def msg(self, mtype, pid, **body):
        return make_message(mtype, pid, self.ep(pid), body)

    def group(self, pid, members, gid="g" * 16):
        rows = [[m, self.ep(m), 1.0, "s1", 1] for m in members]
        return self.msg(MsgType.GROUP, pid, key=self.key, gid=gid, members=rows)

    def of(self, mtype):
        return [(ep, m) for ep, m in self.sent if m.type is mtype]


def test_ack_wait_grows_with_the_measured_round_trip():
    assert _Joiner().mm.ack_wait("tcp://a:1") == pytest.approx(0.3)
    j = _Joiner(rtt=0.25)
    assert j.mm.ack_wait("tcp://a:1") == pytest.approx(0.3 + 3 * 0.25)
    assert j.mm.ack_wait("tcp://elsewhere:1") == pytest.approx(0.3 + 3 * 0.25)  # unknown: the largest known
    j.mm.begin("s1", j.key, 1.0, "L", 0.0, 10.0)
    j.mm.on_timer(0.5)  # within the wait: still asking the first candidate
    assert [ep for ep, _ in j.of(MsgType.JOIN)] == [j.ep(j.first)]


def test_late_group_from_a_left_rendezvous_peer_is_taken():
    j = _Joiner()
    j.mm.begin("s1", j.key, 1.0, "L", 0.0, 10.0)
    j.mm.on_timer(0.31)  # no JOIN_ACK from the first within request_timeout: ask the second
    assert [ep for ep, _ in j.of(MsgType.JOIN)] == [j.ep(j.first), j.ep(j.second)]
    j.mm.on_join_ack(j.msg(MsgType.JOIN_ACK, j.second, key=j.key, step="s1"), 0.35)
    j.mm.on_group(j.group(j.first, [j.first, j.ms.peer_id]), 0.5)  # the first was only slow
    assert len(j.groups) == 1 and j.groups[0].members[0].peer_id == j.first
    assert [ep for ep, _ in j.of(MsgType.LEAVE)] == [j.ep(j.second)]  # its pool must not count on us
    assert not j.of(MsgType.ABORT)
    # the second's group, if it closed before our LEAVE came, is told not to wait for us
    j.mm.on_group(j.group(j.second, [j.second, j.ms.peer_id], gid="h" * 16), 0.6)
    assert [ep for ep, _ in j.of(MsgType.ABORT)] == [j.ep(j.second)]


def test_late_join_ack_from_a_better_ranked_peer_takes_the_joiner_back():
    j = _Joiner()
    j.mm.begin("s1", j.key, 1.0, "L", 0.0, 10.0)
    j.mm.on_timer(0.31)
    j.mm.on_join_ack(j.msg(MsgType.JOIN_ACK, j.first, key=j.key, step="s1"), 0.4)
    assert j.mm.join.target[0] == j.first and j.mm.join.phase.value == "queued"
    assert [ep for ep, _ in j.of(MsgType.LEAVE)] == [j.ep(j.second)]
    # the second's own JOIN_ACK, late as well, is answered with LEAVE (it ranks after the first)
    j.mm.on_join_ack(j.msg(MsgType.JOIN_ACK, j.second, key=j.key, step="s1"), 0.45)
    assert j.mm.join.target[0] == j.first
    assert [ep for ep, _ in j.of(MsgType.LEAVE)] == [j.ep(j.second)] * 2


def test_a_joiner_that_gives_up_tells_every_peer_it_asked():
    """Before, only a rendezvous peer that had acknowledged was told; one that got the JOIN late kept
    the joiner in its pool and its group waited part_timeout for it."""
    j = _Joiner()
    j.mm.begin("s1", j.key, 1.0, "L", 0.0, 10.0)
    j.mm.on_timer(0.31)
    j.mm.cancel(0.5, "cancelled")
    assert sorted(ep for ep, _ in j.of(MsgType.LEAVE)) == sorted([j.ep(j.first), j.ep(j.second)])


def test_a_pool_drops_a_joiner_that_left_before_it_closed():
    sent = []
    rng = np.random.default_rng(0)
    ms = Membership("r" * 16, "tcp://r:1", lambda ep, m: sent.append((ep, m)), rng)
    mm = Matchmaker(ms, lambda ep, m: sent.append((ep, m)), rng, lambda s, n: None, lambda s, e: None,
                    target_group_size=4, min_group_size=2, matchmaking_time=0.5, request_timeout=0.3)
    for p in ("a", "b", "c"):
        ms.observe(p * 16, f"tcp://{p}:1", 0.0)
    key = next(k for k in (f"k{i}" for i in range(200)) if mm.ranking(k)[0] == ms.peer_id)
    join = lambda p: make_message(MsgType.JOIN, p * 16, f"tcp://{p}:1",  # noqa: E731
                             dict(key=key, step="s" + p, bw=1.0, layout="L", hops=0, want=4, g=1))
    for p in ("a", "b", "c"):
        mm.on_join(join(p), 0.1)
    mm.on_leave(make_message(MsgType.LEAVE, "c" * 16, "tcp://c:1", dict(key=key, step="sc")), 0.2)
    mm.on_timer(0.7)
    groups = [m for _, m in sent if m.type is MsgType.GROUP]
    assert groups and all("c" * 16 not in [m.peer_id for m in g.members] for g in groups)


# ------------------------------------------------------------------ closing from notes
def test_members_that_agree_close_their_group_themselves_one_way_trip_after_the_last_call():
    """Four peers, one 0.2 s away from the switch, gossip settled: every step's group is formed by
    each member from the others' JOIN_NOTEs (`stats["closed_early"]`), the same group everywhere,
    and the far peer's matchmaking takes about one trip from the farthest other (0.202 s), not a trip
    to the rendezvous peer and back (>= 0.404 s, the far peer being a joiner)."""
    far = _far_index("gossip")
    cl, peers, cfg = _cluster(far, "gossip")
    cl.run(until=2.0)
    for step in range(3):
        evs = [p.step_tensors(timeout=5.0) for p in peers]
        cl.run(until=cl.env.all_of(evs))
        res = [ev.value.result for ev in evs]
        assert all(r.complete and len(r.members) == N for r in res), res
        assert len({r.group_id for r in res}) == 1
        mm = res[far].timings["matchmaking"]
        assert 0.2 <= mm < 0.3, (step, mm)
        cl.run(until=cl.env.now + 0.5)
    assert all(p.node.stats["closed_early"] == 3 for p in peers), [p.node.stats["closed_early"] for p in peers]
    assert all(p.node.stats["dropped"] == 0 and p.node.stats["late"] == 0 for p in peers)


def _far_calls_late(timeout):
    """The near peers step at t0; the far one calls at t0 + 0.6 with `timeout`, after the rendezvous
    window closed. Runs until every step ended; returns the far peer's call time too."""
    far = _far_index("gossip")
    cl, peers, cfg = _cluster(far, "gossip")
    cl.run(until=2.0)
    near = [p for i, p in enumerate(peers) if i != far]
    evs = [p.step_tensors(timeout=5.0) for p in near]
    cl.run(until=cl.env.now + 0.6)
    start = cl.env.now
    late = peers[far].step_tensors(timeout=timeout)
    cl.run(until=cl.env.all_of([*evs, late]))
    return cl, peers, cfg, far, evs, late, start


def test_a_far_peer_that_calls_after_the_window_closed_is_in_no_group_of_the_others():
    """The testbed's far peer in two groups (the message order of
    tests/unit/test_matchmaker.py, on the simulator): the three near peers call at t0, their notes
    reach the far one at t0 + 0.2; it calls only at t0 + 0.6, after the rendezvous window (0.5 s)
    closed with the three -- who took that GROUP and sent it LEAVEs, still on its 0.2 s link. It
    used to form the group of four from the notes it held: a group nobody else was in, whose PARTs
    the others dropped (and ABORTed) while its step failed with PeerLost. Now it leaves the group to
    the rendezvous peer, which has none for it left this round: a plain GroupNotFound."""
    cl, peers, cfg, far, evs, late, _ = _far_calls_late(timeout=1.0)
    res = [ev.value.result for ev in evs]
    assert all(r.complete and len(r.members) == N - 1 for r in res), res
    assert len({r.group_id for r in res}) == 1 and peers[far].peer_id not in res[0].members
    assert isinstance(late.value, StepFailed) and isinstance(late.value.error, GroupNotFound), late.value
    assert peers[far].node.stats["closed_early"] == 0
    assert all(p.node.stats["dropped"] == 0 for p in peers), [p.node.stats["dropped"] for p in peers]


def test_a_far_peer_that_calls_after_its_swarm_moved_on_fails_at_once_not_at_its_timeout():
    """The same late far peer with a 10 s timeout: it used to open window after window (the pool of
    one failing each time) until the timeout ran out, 9.9 s. Once a window closed short and every
    other live peer of the key announces a later round, nobody is left to come: it fails at once
    (0.9 s), and joins the next round."""
    cl, peers, cfg, far, evs, late, start = _far_calls_late(timeout=10.0)
    assert all(ev.value.result.complete and len(ev.value.result.members) == N - 1 for ev in evs)
    assert isinstance(late.value, StepFailed) and isinstance(late.value.error, GroupNotFound), late.value
    assert "went past round" in str(late.value.error) and "call step() when they do" in str(late.value.error)
    assert cl.env.now - start < 2 * cfg.matchmaking_time + 4 * FAR, cl.env.now - start
    evs = [p.step_tensors(timeout=5.0) for p in peers]
    cl.run(until=cl.env.all_of(evs))
    assert all(isinstance(ev.value, StepDone) and len(ev.value.result.members) == N for ev in evs)


def test_a_peer_alone_waits_for_a_peer_that_starts_later():
    """Nobody moved on when nobody else is known: a peer stepping before the swarm's other peers
    started keeps opening windows until one comes, as before."""
    cl = SimCluster(seed=1, network=NetworkModel(latency=0.002, bandwidth=50e6))
    cfg = NodeConfig(prefix="alone", target_group_size=2, min_group_size=2, gossip_interval=0.1, peer_timeout=5.0,
                     matchmaking_time=0.5, request_timeout=0.3)
    first = cl.add_peer(cfg, tensors=[np.ones(64, np.float32)])
    ev = first.step_tensors(timeout=6.0)
    cl.run(until=cl.env.now + 2.0)
    assert not ev.triggered
    second = cl.add_peer(cfg, tensors=[np.zeros(64, np.float32)], known=[first])
    cl.run(until=cl.env.now + 1.0)
    ev2 = second.step_tensors(timeout=3.0)
    cl.run(until=cl.env.all_of([ev, ev2]))
    assert isinstance(ev.value, StepDone) and isinstance(ev2.value, StepDone), (ev.value, ev2.value)
    assert len(ev.value.result.members) == 2
