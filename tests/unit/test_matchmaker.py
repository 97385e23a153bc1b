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
    j.mm.begin("old", key, 1.0, "L", now=0.0, timeout=5.0)
    j.mm.cancel(0.1, "gave up")
    j.out.take()
    members = (M.MemberInfo(pid(rv), ep(rv), 1.0, "x"), M.MemberInfo(pid(joiner), ep(joiner), 1.0, "old"))
    j.mm.on_group(M.Group(pid(rv), ep(rv), key=key, group_id="g9", members=members), 0.2)
    [(to, abort)] = j.out.take()
    assert to == ep(rv) and isinstance(abort, M.Abort) and abort.group_id == "g9"
    assert not j.groups and j.mm.dropped == 0


def test_a_group_of_strangers_contacts_nobody():
    """The ABORT for a group we gave up is a courtesy to peers we know: an outsider's GROUP that
    does not hold a step of ours, or names members we never met, opens no connection to them."""
    key, ids = "k/0", [1, 2]
    rv = rendezvous_for(key, ids)
    joiner = next(i for i in ids if i != rv)
    j = Machine(joiner, [rv])
    strangers = tuple(M.MemberInfo(f"{90 + i:02d}" * 8, f"tcp://10.9.{i // 250}.{i % 250}:1", 1.0, "s")
                      for i in range(1000))
    # not naming us at all (the rendezvous peer sends a GROUP only to its members): refused
    j.mm.on_group(M.Group(pid(rv), ep(rv), key=key, group_id="g1", members=strangers), 0.0)
    assert j.out.take() == [] and j.mm.dropped == 1
    # naming us with a step we never made: refused too
    me = M.MemberInfo(pid(joiner), ep(joiner), 1.0, "never")
    j.mm.on_group(M.Group(pid(rv), ep(rv), key=key, group_id="g2", members=strangers + (me,)), 0.0)
    assert j.out.take() == [] and j.mm.dropped == 2
    # a step we did make and gave up: only the members we know (at the endpoint we know) hear of it
    j.mm.begin("old", key, 1.0, "L", now=0.0, timeout=5.0)
    j.mm.cancel(0.1, "gave up")
    j.out.take()
    me = M.MemberInfo(pid(joiner), ep(joiner), 1.0, "old")
    moved = M.MemberInfo(pid(rv), "tcp://10.7.7.7:1", 1.0, "x")  # a known id at an endpoint we do not know
    j.mm.on_group(M.Group(pid(rv), ep(rv), key=key, group_id="g3", members=strangers + (me,)), 0.2)
    assert j.out.take() == []
    j.mm.on_group(M.Group(pid(rv), ep(rv), key=key, group_id="g4",
                          members=tuple(sorted((me, moved, *strangers[:3]), key=lambda m: m.peer_id))), 0.2)
    assert j.out.take() == []
    rvm = M.MemberInfo(pid(rv), ep(rv), 1.0, "x")
    j.mm.on_group(M.Group(pid(rv), ep(rv), key=key, group_id="g5",
                          members=tuple(sorted((me, rvm, *strangers), key=lambda m: m.peer_id))), 0.2)
    assert [(to, type(m)) for to, m in j.out.take()] == [(ep(rv), M.Abort)]


def test_local_misuse_raises():
    j = Machine(1, [2])
    j.mm.begin("s", "k", 1.0, "L", now=0.0, timeout=1.0)
    with pytest.raises(ProtocolError):
        j.mm.begin("t", "k", 1.0, "L", now=0.0, timeout=1.0)
    with pytest.raises(ValueError):
        Machine(1, [2], min_group_size=3, target_group_size=2)


# ------------------------------------------------------------------ closing without the rendezvous peer
def _begin_all(machines: dict[int, Machine], key: str, views: dict[int, set[int]] | None = None) -> dict:
    """Every machine begins step s<i> with `views[i]` (default: all of them); returns what each sent."""
    sent = {}
    for i, m in machines.items():
        view = {pid(x) for x in (views or {}).get(i, machines)}
        m.mm.begin(f"s{i}", key, float(i), "L", now=0.0, timeout=5.0, want=4, round=7, view=view)
        sent[i] = m.out.take()
    return sent


def _deliver(machines: dict[int, Machine], sent: dict, kinds: tuple, t: float = 0.05) -> None:
    for i, msgs in sent.items():
        for to, msg in msgs:
            if isinstance(msg, kinds) and to in {ep(k) for k in machines}:  # (a peer not built here gets nothing)
                dest = next(k for k in machines if ep(k) == to)
                handler = {M.JoinNote: machines[dest].mm.on_join_note, M.Join: machines[dest].mm.on_join,
                           M.Leave: machines[dest].mm.on_leave}[type(msg)]
                handler(msg, t)


def test_members_that_agree_on_their_view_form_the_group_from_notes_as_the_rendezvous_peer_would():
    key, ids = "k/0", [1, 2, 3]
    machines = {i: Machine(i, [x for x in ids if x != i], target_group_size=4) for i in ids}
    sent = _begin_all(machines, key)
    for i, msgs in sent.items():  # a note to each other member, and the JOIN (with the view) to the rendezvous peer
        notes = [(to, m) for to, m in msgs if isinstance(m, M.JoinNote)]
        assert sorted(to for to, _ in notes) == sorted(ep(x) for x in ids if x != i)
        assert all(m.view == tuple(sorted(pid(x) for x in ids)) and m.round == 7 for _, m in notes)
        [join] = [m for _, m in msgs if isinstance(m, M.Join)]
        assert join.view == notes[0][1].view
    _deliver(machines, sent, (M.JoinNote,))
    specs = [m.groups[0] for m in machines.values()]
    assert len({s.group_id for s in specs}) == 1 and all(m.mm.join is None for m in machines.values())
    members = specs[0].members
    assert [x.peer_id for x in members] == sorted(pid(i) for i in ids)
    assert [x.bandwidth for x in members] == [float(ids[[pid(i) for i in ids].index(x.peer_id)]) for x in members]
    assert all(s.members == members and s.members[s.rank].peer_id == pid(i) for i, s in zip(machines, specs))

    # the rendezvous peer holds the same JOINs and forms the very same group; its GROUP is then ignored
    rv = rendezvous_for(key, ids)
    _deliver(machines, sent, (M.Join,))
    groups = machines[rv].out.take(M.Group)
    assert len(groups) == len(ids) and {g.group_id for _, g in groups} == {specs[0].group_id}
    assert groups[0][1].members == members and machines[rv].mm.pools == {}
    for i, m in machines.items():
        late = m.mm.late
        m.mm.on_group(groups[0][1], 0.2)
        assert len(m.groups) == 1 and not m.out.take(M.Abort) and m.mm.late == late  # no ABORT of our own group


def test_views_that_differ_close_nothing_early_and_the_rendezvous_peer_decides():
    key, ids = "k/0", [1, 2, 3]
    machines = {i: Machine(i, [x for x in ids if x != i], target_group_size=4) for i in ids}
    machines[1] = Machine(1, [2, 3, 4], target_group_size=4)  # peer 1 also expects a peer 4 (gossip not settled)
    sent = _begin_all(machines, key, views={1: {1, 2, 3, 4}})
    assert {m.view for _, m in sent[1] if isinstance(m, M.JoinNote)} == {tuple(sorted(pid(x) for x in (1, 2, 3, 4)))}
    _deliver(machines, sent, (M.JoinNote,))
    assert not any(m.groups for m in machines.values())
    assert all(m.mm.join is not None for m in machines.values())
    # nor does the rendezvous peer close on its JOINs: it waits as before (its window, or its own view)
    rv = rendezvous_for(key, [2, 1, 3])
    _deliver(machines, sent, (M.Join,))
    assert not machines[rv].out.take(M.Group)


def test_a_note_from_another_round_or_layout_does_not_count_and_a_leave_withdraws_one():
    key, ids = "k/0", [1, 2]
    machines = {i: Machine(i, [x for x in ids if x != i]) for i in ids}
    a = machines[1]
    view = tuple(sorted((pid(1), pid(2))))
    a.mm.begin("s1", key, 1.0, "L", now=0.0, timeout=5.0, round=7, view=set(view))
    a.out.take()
    for other in (dict(round=6), dict(layout="other")):
        note = dict(key=key, step_id="s2", bandwidth=1.0, layout="L", want=2, gathers=1, round=7, view=view) | other
        a.mm.on_join_note(M.JoinNote(pid(2), ep(2), **note), 0.1)
        assert not a.groups
    # a note of an ended step is withdrawn by its LEAVE, before our step begins
    a.mm.cancel(0.2, "test")
    a.out.take()
    b_note = M.JoinNote(pid(2), ep(2), key=key, step_id="s2", bandwidth=1.0, layout="L", want=2, gathers=1, round=7,
                        view=view)
    a.mm.on_join_note(b_note, 0.3)
    a.mm.on_leave(M.Leave(pid(2), ep(2), key=key, step_id="s2"), 0.4)
    a.mm.begin("s1b", key, 1.0, "L", now=0.5, timeout=5.0, round=7, view=set(view))
    assert not a.groups
    # the same note, not withdrawn, closes the group at once
    a.mm.cancel(0.6, "test")
    a.mm.on_join_note(b_note, 0.7)
    a.mm.begin("s1c", key, 1.0, "L", now=0.8, timeout=5.0, round=7, view=set(view))
    [spec] = a.groups
    assert [m.step_id for m in spec.members] == ["s1c", "s2"][:: 1 if pid(1) < pid(2) else -1]


def test_a_joiner_that_gives_up_withdraws_its_notes():
    key, ids = "k/0", [1, 2, 3]
    m = Machine(1, [2, 3], target_group_size=4)
    m.mm.begin("s1", key, 1.0, "L", now=0.0, timeout=5.0, want=4, round=7, view={pid(i) for i in ids})
    noted = {to for to, msg in m.out.take() if isinstance(msg, M.JoinNote)}
    m.mm.cancel(0.1, "test")
    leaves = {to for to, msg in m.out.take(M.Leave)}
    assert noted == {ep(2), ep(3)} and noted <= leaves


def test_bad_notes_are_dropped_and_counted():
    m = Machine(1, [2, 3], target_group_size=4)
    view_without_us = tuple(sorted((pid(2), pid(3))))
    unsorted = tuple(sorted((pid(1), pid(2))))[::-1]
    for view in (view_without_us, unsorted, (pid(1), pid(1), pid(2))):
        m.mm.on_join_note(M.JoinNote(pid(2), ep(2), key="k", step_id="s", bandwidth=1.0, layout="L", want=4,
                                     gathers=1, round=1, view=view), 0.0)
    assert m.mm.dropped == 3 and not m.mm._notes


def test_no_view_or_too_big_a_view_sends_no_notes():
    m = Machine(1, [2, 3], target_group_size=2)
    m.mm.begin("s1", "k", 1.0, "L", now=0.0, timeout=5.0, round=7, view={pid(1), pid(2), pid(3)})  # 3 > target 2
    assert not m.out.take(M.JoinNote)
    m.mm.cancel(0.1, "test")
    m.out.take()
    m.mm.begin("s2", "k", 1.0, "L", now=0.2, timeout=5.0, round=-1, view={pid(1), pid(2)})  # round not known
    assert not m.out.take(M.JoinNote)


def test_notes_of_steps_that_already_averaged_with_us_are_spent():
    """A peer that repeats a pinned round (its step of that round ran, or it fell behind) must not form
    a group from the notes of steps that already averaged with it -- those peers moved on."""
    key, ids = "k/0/r7", [1, 2]
    machines = {i: Machine(i, [x for x in ids if x != i]) for i in ids}
    sent = _begin_all(machines, key)
    _deliver(machines, sent, (M.JoinNote,))
    assert all(len(m.groups) == 1 for m in machines.values())
    a = machines[1]
    a.mm.on_join_note(next(m for _, m in sent[2] if isinstance(m, M.JoinNote)), 0.1)  # a copy that came late
    a.mm.begin("again", key, 1.0, "L", now=0.2, timeout=5.0, want=4, round=7, view={pid(1), pid(2)})
    assert len(a.groups) == 1 and a.mm.join is not None

    # the same through the rendezvous peer: a GROUP that holds 2's step spends 2's note too
    b = Machine(1, [2])
    note2 = next(m for _, m in sent[2] if isinstance(m, M.JoinNote))
    b.mm.on_join_note(note2, 0.0)
    b.mm.begin("s1", key, 1.0, "L", now=0.0, timeout=5.0, want=4, round=7, view={pid(1), pid(2), pid(3)})  # 3: unknown
    members = tuple(sorted((M.MemberInfo(pid(1), ep(1), 1.0, "s1"), M.MemberInfo(pid(2), ep(2), 2.0, note2.step_id)),
                           key=lambda m: m.peer_id))
    b.mm.on_group(M.Group(pid(2), ep(2), key=key, group_id="g" * 16, members=members), 0.1)
    assert len(b.groups) == 1 and not b.mm._notes


def test_a_member_that_calls_after_the_rendezvous_window_could_close_leaves_the_group_to_it():
    """The testbed's far peer in two groups, message by message: the two others call at 0.0 (notes to
    each other, and to the far peer F, which has them at 0.3; JOINs to the rendezvous peer), F calls
    only at 1.1. The rendezvous window (1.0 s) closes at 1.05 with the two, whose GROUP they take, and
    their LEAVEs to F are still on F's slow link when F calls. F used to close the group of three from
    the notes it held -- a group nobody else was in; now calls that far apart close nothing early."""
    key, ids = "k/0", [1, 2, 3]
    rv = rendezvous_for(key, ids)
    far = next(i for i in ids if i != rv)
    machines = {i: Machine(i, [x for x in ids if x != i], target_group_size=4) for i in ids}
    near = {i: m for i, m in machines.items() if i != far}
    sent = _begin_all(near, key, views={i: set(ids) for i in near})
    _deliver(near, sent, (M.JoinNote, M.Join))
    _deliver({far: machines[far]}, sent, (M.JoinNote,), t=0.3)  # F is 0.3 s away
    machines[rv].mm.on_timer(1.05)  # the JOINs came at 0.05
    groups = machines[rv].out.take(M.Group)
    for to, g in groups:
        next(m for i, m in near.items() if ep(i) == to).mm.on_group(g, 1.07)
    [g1] = {g.group_id for _, g in groups}
    assert all([s.group_id for s in m.groups] == [g1] for m in near.values())
    f = machines[far]
    f.mm.begin("sF", key, 1.0, "L", now=1.1, timeout=5.0, want=4, round=7, view={pid(x) for x in ids})
    assert not f.groups and f.mm.join is not None and f.mm.closed_early == 0
    # calls close together do close from the notes: within half the window with no round trip
    # measured, within the window less the longest measured round trip (at most half the window)
    for rtt, late in ((None, 0.45), (0.2, 0.75)):
        a = Machine(1, [2])
        if rtt is not None:
            a.membership._sample_rtt(ep(2), rtt)
        view = tuple(sorted((pid(1), pid(2))))
        a.mm.on_join_note(M.JoinNote(pid(2), ep(2), key=key, step_id="s2", bandwidth=1.0, layout="L", want=2, gathers=1,
                                     round=7, view=view), 0.0)
        a.mm.begin("s1", key, 1.0, "L", now=late, timeout=5.0, round=7, view=set(view))
        assert len(a.groups) == 1, (rtt, late)
        a.mm.cancel(late, "test")
        b = Machine(1, [2])  # the same calls 0.1 s further apart: the rendezvous peer decides
        if rtt is not None:
            b.membership._sample_rtt(ep(2), rtt)
        b.mm.on_join_note(M.JoinNote(pid(2), ep(2), key=key, step_id="s2", bandwidth=1.0, layout="L", want=2,
                                     gathers=1, round=7, view=view), 0.0)
        b.mm.begin("s1", key, 1.0, "L", now=late + 0.1, timeout=5.0, round=7, view=set(view))
        assert not b.groups and b.mm.join is not None, (rtt, late)


def _join(i: int, key: str, step: str, rnd: int, want: int = 2) -> M.Join:
    return M.Join(pid(i), ep(i), key=key, step_id=step, bandwidth=1.0, layout="L", hops=0, want=want, gathers=True,
                  round=rnd)


def test_a_lone_joiner_of_the_next_round_right_after_a_group_formed_may_try_again():
    """Steps of a few ms follow each other within half a window: a peer that steps again at once
    after its group of round 0 averaged opens the key's next pool right after that group formed.
    Its window closing alone is no leftover of a full group (it said round 1): it is told to retry,
    so the groupmate stepping a moment later still finds it. Before, it was refused for good after
    one window ("left over after the key's full group formed"), its timeout unspent."""
    key, ids = "k", [1, 2, 3]
    rv = rendezvous_for(key, ids)
    a, b = [i for i in ids if i != rv]
    r = Machine(rv, [a, b])
    r.mm.on_join(_join(a, key, "a0", 0), 0.0)
    r.mm.on_join(_join(b, key, "b0", 0), 0.01)
    assert len(r.out.take(M.Group)) == 2  # round 0's group of 2, formed at once
    r.out.take()
    r.mm.on_join(_join(a, key, "a1", 1), 0.02)  # a steps again at once
    r.mm.on_timer(1.02)
    [(to, no)] = r.out.take(M.NoGroup)
    assert to == ep(a) and no.retry and "already formed" not in no.reason


def test_a_leftover_of_the_round_whose_full_group_formed_is_refused_for_good():
    """The case the rule is for: a third joiner of the same round, after that round's group of two
    filled, has nobody left to wait for."""
    key, ids = "k", [1, 2, 3, 4]
    rv = rendezvous_for(key, ids)
    a, b, c = [i for i in ids if i != rv]
    r = Machine(rv, [a, b, c])
    r.mm.on_join(_join(a, key, "a0", 0), 0.0)
    r.mm.on_join(_join(b, key, "b0", 0), 0.01)
    assert len(r.out.take(M.Group)) == 2
    r.out.take()
    r.mm.on_join(_join(c, key, "c0", 0), 0.05)
    r.mm.on_timer(1.05)
    [(to, no)] = r.out.take(M.NoGroup)
    assert to == ep(c) and not no.retry and "already formed this round" in no.reason


def test_a_client_that_knows_no_peer_says_so_when_its_step_fails():
    """A client-mode peer with no reachable initial peer failed its step with "What happened: : no
    JOIN_ACK within 0.5s (9 times)": a JOIN_ACK from nobody, under an empty peer id."""
    from handfed import Outbox
    from zgossip.membership import Membership

    out, failures = Outbox(), []
    me = Membership(pid(1), f"client://{pid(1)}", out, np.random.default_rng(1))
    mm = Matchmaker(me, out, np.random.default_rng(1), lambda spec, now: None,
                    lambda step, err: failures.append(err), target_group_size=2, min_group_size=2,
                    matchmaking_time=1.0, request_timeout=0.5)
    mm.begin("s", "k/0", 1.0, "L", now=0.0, timeout=2.0)
    t = 0.0
    while not failures and t < 5.0:
        t += 0.25
        mm.on_timer(t)
    [err] = failures
    assert isinstance(err, GroupNotFound)
    assert "What happened: no peer known to ask" in str(err) and ": :" not in str(err), str(err)


@pytest.mark.parametrize("lo, hi", [(0, 16), (5, 3), (1, 0)])
def test_bad_group_sizes_are_refused_with_the_values_given(lo, hi):
    """`zgossip peer --min-group-size 5 --target-group-size 3` said only "need 1 <= min_group_size <=
    target_group_size", not which values broke it."""
    with pytest.raises(ValueError, match=f"not min_group_size={lo} and target_group_size={hi}"):
        Machine(1, [2], min_group_size=lo, target_group_size=hi)
