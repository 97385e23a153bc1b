"""Matchmaker alone, fed by hand: joiner and rendezvous sides driven through their public
methods with typed messages, time passed in, no sockets and no node around them."""
from __future__ import annotations

import numpy as np
import pytest

from handfed import Outbox, ep, membership_with, pid
from zgossip import messages as M
from zgossip.errors import GroupNotFound, ProtocolError
from zgossip.matchmaking import GroupSpec, JoinPhase, Matchmaker


class Machine:
    """One peer's Matchmaker with a membership that knows `others`, recording sends and outcomes."""

    def __init__(self, me: int, others: list[int], **kw) -> None:
        self.out = Outbox()
        self.membership = membership_with(me, others, self.out)
        self.groups: list[GroupSpec] = []
        self.failures: list[tuple[str, Exception]] = []
        opts = dict(target_group_size=2, min_group_size=2, matchmaking_time=1.0, request_timeout=0.5)
        self.mm = Matchmaker(self.membership, self.out, np.random.default_rng(me),
                             lambda spec, now: self.groups.append(spec),
                             lambda step, err: self.failures.append((step, err)), **{**opts, **kw})


def rendezvous_for(key: str, ids: list[int]) -> int:
    m = Machine(ids[0], ids[1:])
    best = m.mm.ranking(key)[0]
    return next(i for i in ids if pid(i) == best)


def test_joiner_asks_the_rendezvous_peer_and_gets_its_group():
    key, ids = "k/0", [1, 2, 3]
    rv = rendezvous_for(key, ids)
    joiner = next(i for i in ids if i != rv)
    j = Machine(joiner, [i for i in ids if i != joiner])
    j.mm.begin("step-1", key, 1.0, "L", now=0.0, timeout=5.0)
    [(to, join)] = j.out.take()
    assert to == ep(rv) and isinstance(join, M.Join) and join.step_id == "step-1" and join.hops == 0
    assert j.mm.join.phase is JoinPhase.ASKING

    j.mm.on_join_ack(M.JoinAck(pid(rv), ep(rv), key=key, step_id="step-1"), 0.01)
    assert j.mm.join.phase is JoinPhase.QUEUED
    members = (M.MemberInfo(pid(rv), ep(rv), 1.0, "rv-step"), M.MemberInfo(pid(joiner), ep(joiner), 1.0, "step-1"))
    j.mm.on_group(M.Group(pid(rv), ep(rv), key=key, group_id="g1", members=members), 0.2)
    [spec] = j.groups
    assert spec.group_id == "g1" and spec.rank == 1 and spec.members == members
    assert j.mm.join is None and not j.failures


def test_rendezvous_cuts_a_full_group_at_once_and_tells_every_member():
    key, ids = "k/0", [1, 2, 3]
    rv = rendezvous_for(key, ids)
    a, b = [i for i in ids if i != rv]
    r = Machine(rv, [a, b])
    for i, t in ((a, 0.0), (b, 0.1)):
        r.mm.on_join(M.Join(pid(i), ep(i), key=key, step_id=f"s{i}", bandwidth=1.0, layout="L", hops=0, want=2,
                            gathers=True), t)
    acks = r.out.take(M.JoinAck)
    assert [e for e, _ in acks] == [ep(a)]  # the JOIN that fills the group is answered by the GROUP alone
    groups = r.out.take(M.Group)
    assert sorted(e for e, _ in groups) == sorted([ep(a), ep(b)])
    g = groups[0][1]
    assert [m.peer_id for m in g.members] == [pid(a), pid(b)] and [m.step_id for m in g.members] == [f"s{a}", f"s{b}"]
    assert r.mm.pools == {}


def test_window_closes_on_the_timer_with_what_came():
    key, ids = "k/0", [1, 2, 3, 4]
    rv = rendezvous_for(key, ids)
    others = [i for i in ids if i != rv]
    r = Machine(rv, others, target_group_size=4)
    for i in others[:2]:
        r.mm.on_join(M.Join(pid(i), ep(i), key=key, step_id="s", bandwidth=1.0, layout="L", hops=0, want=4,
                            gathers=False), 0.0)
    r.out.take(M.JoinAck)
    assert r.mm.deadline() == pytest.approx(1.0)
    r.mm.on_timer(0.99)
    assert not r.out.take(M.Group)
    r.mm.on_timer(1.0)
    [(_, g1), (_, g2)] = r.out.take(M.Group)
    assert g1 is not None and len(g1.members) == 2 and all(m.gathers == 0 for m in g1.members)


def test_a_lone_joiner_is_refused_when_the_window_closes():
    key, ids = "k/0", [1, 2]
    rv = rendezvous_for(key, ids)
    other = next(i for i in ids if i != rv)
    r = Machine(rv, [other])
    r.mm.on_join(M.Join(pid(other), ep(other), key=key, step_id="s", bandwidth=1.0, layout="L", hops=0, want=2,
                        gathers=True), 0.0)
    r.mm.on_timer(1.0)
    [(to, no)] = r.out.take(M.NoGroup)
    assert to == ep(other) and no.retry and no.seen == 1 and "min_group_size=2" in no.reason


def test_a_better_ranked_peer_gets_the_joiner_redirected():
    key, ids = "k/0", [1, 2, 3]
    rv = rendezvous_for(key, ids)
    host, joiner = [i for i in ids if i != rv]
    h = Machine(host, [rv, joiner])
    h.mm.on_join(M.Join(pid(joiner), ep(joiner), key=key, step_id="s", bandwidth=1.0, layout="L", hops=0, want=2,
                        gathers=True), 0.0)
    [(to, red)] = h.out.take()
    assert to == ep(joiner) and isinstance(red, M.Redirect) and red.to_id == pid(rv) and red.to_endpoint == ep(rv)


def test_silent_rendezvous_peer_is_skipped_and_the_step_fails_with_what_happened():
    key, ids = "k/0", [1, 2]
    rv = rendezvous_for(key, ids)
    joiner = next(i for i in ids if i != rv)
    j = Machine(joiner, [rv])
    j.mm.begin("s", key, 1.0, "L", now=0.0, timeout=1.2)
    assert j.out.take()[0][0] == ep(rv)
    j.mm.on_timer(0.5)  # no JOIN_ACK within request_timeout: the next candidate is this peer itself
    assert j.mm.join.silent == {pid(rv)}
    [(to, join)] = j.out.take()  # the next candidate is this node itself (a node loops such sends back)
    assert to == ep(joiner) and join.step_id == "s"
    j.mm.on_timer(1.2)
    [(step, err)] = j.failures
    assert step == "s" and isinstance(err, GroupNotFound) and "no JOIN_ACK" in str(err)
    assert j.mm.join is None


def test_a_group_for_an_abandoned_step_is_answered_with_abort():
    key, ids = "k/0", [1, 2]
    rv = rendezvous_for(key, ids)
    joiner = next(i for i in ids if i != rv)
    j = Machine(joiner, [rv])
    members = (M.MemberInfo(pid(rv), ep(rv), 1.0, "x"), M.MemberInfo(pid(joiner), ep(joiner), 1.0, "old"))
    j.mm.on_group(M.Group(pid(rv), ep(rv), key=key, group_id="g9", members=members), 0.0)
    [(to, abort)] = j.out.take()
    assert to == ep(rv) and isinstance(abort, M.Abort) and abort.group_id == "g9"
    assert not j.groups


def test_local_misuse_raises():
    j = Machine(1, [2])
    j.mm.begin("s", "k", 1.0, "L", now=0.0, timeout=1.0)
    with pytest.raises(ProtocolError):
        j.mm.begin("t", "k", 1.0, "L", now=0.0, timeout=1.0)
    with pytest.raises(ValueError):
        Machine(1, [2], min_group_size=3, target_group_size=2)
