"""The all-reduce round alone: a few AllReduceRounds built directly from a GroupSpec, their
messages carried by hand (through the wire codec), time passed in. No node, no driver."""
from __future__ import annotations

import numpy as np
import pytest

from handfed import Outbox, ep, pid
from zgossip.allreduce import MOVES, AllReduceRound, PartState, ReduceState, RoundPhase, transition
from zgossip.errors import IllegalTransition, ProtocolError
from zgossip.matchmaking import GroupSpec
from zgossip.linkstats import LinkStats
from zgossip.messages import Abort, GaveUp, MemberInfo, Part, Rescue, RescueCall, Result

NUMEL, PART = 3000, 256


class Group:
    """n rounds of one group; `carry` delivers what they sent, in order, until nothing is left."""

    def __init__(self, buffers: list[np.ndarray], weights: list[float], part_timeout: float = 1.0,
                 deadline: float = 10.0, bandwidths: list[float] | None = None, codec=None,
                 linkstats: list | None = None) -> None:
        n = len(buffers)
        bws = bandwidths or [1.0] * n
        members = tuple(MemberInfo(pid(i), ep(i), bws[i], f"s{i}") for i in range(n))
        self.outs = [Outbox() for _ in range(n)]
        self.done: list[float | None] = [None] * n
        self.rounds = [
            AllReduceRound(GroupSpec("k", "g1", members, i), buffers[i], weights[i], {"rank": i}, self.outs[i], 0.0,
                           part_elems=PART, part_timeout=part_timeout, deadline=deadline,
                           on_done=lambda rnd, now, i=i: self.done.__setitem__(i, now),
                           codec=None if codec is None else codec(),
                           linkstats=None if linkstats is None else linkstats[i])
            for i in range(n)
        ]
        self.by_ep = {ep(i): r for i, r in enumerate(self.rounds)}
        self.cut: set[int] = set()  # members whose messages are lost both ways
        self.oneway: set[tuple[int, int]] = set()  # (sender, receiver): lost on that way only
        self.log: list[tuple[float, int, int, object]] = []  # (time, sender, receiver, message) delivered

    def start(self, now: float = 0.0) -> None:
        for i, r in enumerate(self.rounds):
            if i not in self.cut:
                r.start(now)

    def carry(self, now: float = 0.0) -> int:
        moved = 0
        while True:
            batch = [(i, e, m) for i, o in enumerate(self.outs) for e, m in o.take()]
            if not batch:
                return moved
            for i, e, m in batch:
                dst = self.by_ep[e]
                if i in self.cut or dst.rank in self.cut or (i, dst.rank) in self.oneway:
                    continue
                self.log.append((now, i, dst.rank, m))
                dst.on_message(m, now)
                moved += 1


def data(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(NUMEL) for _ in range(n)]


def mean(bufs: list[np.ndarray], weights: list[float], who: list[int]) -> np.ndarray:
    w = np.array([weights[i] for i in who])
    return sum(wi * bufs[i] for wi, i in zip(w, who)) / w.sum()


def assert_averaged_or_unchanged(g: Group, before: list[np.ndarray], weights: list[float]) -> None:
    """Every element ends as a weighted mean over contributors that include its member, or unchanged."""
    for i, r in enumerate(g.rounds):
        out = r.outcome()
        buf = r.buf
        changed = np.zeros(NUMEL, bool)
        for lo, hi in out.updated:
            changed[lo:hi] = True
        assert np.array_equal(buf[~changed], before[i][~changed], equal_nan=True)
        for o, span in enumerate(out.spans):
            for p in range(r.plan.num_parts(o)):
                lo, hi = r.plan.part(o, p)
                if r.status[o][p] is PartState.AVERAGED:
                    who = list(r.part_contrib[o][p])
                    assert i in who
                    np.testing.assert_allclose(buf[lo:hi], mean(before, weights, who)[lo:hi], rtol=1e-12)


def test_three_members_average_exactly_and_bit_identically():
    bufs, w = data(3), [1.0, 2.0, 0.5]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w)
    g.start()
    g.carry(0.1)
    assert g.done == [0.1, 0.1, 0.1]
    for r in g.rounds:
        out = r.outcome()
        assert r.phase is RoundPhase.DONE and out.complete and out.lost == ()
        assert all(s is PartState.AVERAGED for row in r.status for s in row)
        assert all(s is ReduceState.REDUCED for s in r.own.state)
        assert out.gathered == {pid(i): {"rank": i} for i in range(3)} and out.weights == {pid(i): w[i] for i in range(3)}
    np.testing.assert_allclose(bufs[0], mean(before, w, [0, 1, 2]), rtol=1e-12)
    assert np.array_equal(bufs[0], bufs[1]) and np.array_equal(bufs[1], bufs[2])  # fixed summation order


def test_a_member_whose_data_holds_nan_is_left_out_of_that_span_only():
    bufs, w = data(3, 1), [1.0, 1.0, 1.0]
    g = Group(bufs, w)
    lo, hi = g.rounds[0].plan.part(0, 1)
    bufs[2][lo + 3] = np.nan  # member 2's term of part 1 of member 0's span
    before = [b.copy() for b in bufs]
    g.start()
    g.carry()
    r0, r2 = g.rounds[0], g.rounds[2]
    assert 2 in r0.own.excluded and r0.dropped == 1
    # part 0 was reduced before the bad part came; from part 1 on, member 2 is out of span 0
    assert [r0.part_contrib[0][p] for p in range(r0.plan.num_parts(0))] == [(0, 1, 2)] + [(0, 1)] * 3
    # and was told, at once, to keep its own copy of those parts
    assert r2.status[0] == [PartState.AVERAGED] + [PartState.UNCHANGED] * 3
    assert all(s is PartState.AVERAGED for o in (1, 2) for s in r2.status[o])
    assert np.isnan(bufs[2][lo + 3])
    assert_averaged_or_unchanged(g, before, w)


def test_a_silent_member_is_declared_lost_and_its_span_is_rescued():
    bufs, w = data(3, 2), [1.0, 3.0, 2.0]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w, part_timeout=1.0)
    g.cut = {2}
    g.start()
    g.carry()
    assert g.done == [None, None, None]
    t = 0.0
    while g.done[0] is None or g.done[1] is None:
        t = min(r.next_deadline() for r in g.rounds[:2])
        for r in g.rounds[:2]:
            if r.next_deadline() <= t:
                r.on_timer(t)
        g.carry(t)
        assert t < 5.0
    for i in (0, 1):
        out = g.rounds[i].outcome()
        assert out.lost == (pid(2),) and not out.complete
        assert out.spans[2].rescued == out.spans[2].parts > 0  # the substitute re-reduced the lost span
        assert set(out.contributors) == {pid(0), pid(1)}
    assert 1.0 <= t <= 2.6  # noticed between T and 1.25 T of silence (owed data), rescued at once
    assert np.array_equal(bufs[0], bufs[1])
    assert_averaged_or_unchanged(g, before, w)


def test_a_member_given_up_while_alive_is_told_and_settles_at_once():
    """Member 2's messages to member 0 are lost (one way): 0 gives 2 up after its silence limit and
    re-reduces 2's span. Member 2 still hears everyone; told (GAVE_UP), it keeps its own values
    where 0 went on without it and ends at once -- it neither waits out its own limits for
    results that are not coming nor asks a substitute to rescue a live owner's span (which
    made the substitute declare that live owner lost too)."""
    bufs, w = data(3, 7), [1.0, 1.0, 1.0]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w, part_timeout=1.0)
    g.oneway = {(2, 0)}
    g.start()
    g.carry()
    t = 0.0
    while None in g.done:
        t = min(d for d in (r.next_deadline() for r in g.rounds) if d is not None)
        for r in g.rounds:
            d = r.next_deadline()
            if d is not None and d <= t:
                r.on_timer(t)
        g.carry(t)
        assert t < 10.0
    r0, r1, r2 = g.rounds
    told = [(at, i) for at, i, j, m in g.log if isinstance(m, GaveUp) and j == 2]
    assert told and told[0][1] == 0 and 1.0 <= told[0][0] <= 1.25  # 0 gave 2 up after its limit ...
    assert g.done[2] == told[0][0]  # ... and 2 ended when it was told, not after limits of its own
    assert r2.done_with_us >= {0} and 0 in r2.lost
    assert not any(isinstance(m, (Rescue, RescueCall)) for _, i, _, m in g.log if i == 2)  # 2 rescued nothing
    assert 0 not in r1.lost and 1 not in r0.lost  # nobody took a live owner for lost
    assert r0.outcome().lost == (pid(2),)
    assert all(s is PartState.UNCHANGED for s in r2.status[0])  # 0 averaged its span without 2
    assert all(s is PartState.AVERAGED for o in (1, 2) for s in r2.status[o])
    assert_averaged_or_unchanged(g, before, w)


def test_the_deadline_leaves_what_is_unresolved_unchanged():
    bufs, w = data(2, 3), [1.0, 1.0]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w, part_timeout=100.0, deadline=3.0)
    g.cut = {1}
    g.start()
    g.carry()
    r = g.rounds[0]
    assert r.next_deadline() <= 3.0
    r.on_timer(3.0)
    assert g.done[0] == 3.0 and r.phase is RoundPhase.DONE and r.next_deadline() is None
    assert all(s is PartState.UNCHANGED for row in r.status for s in row)
    assert r.outcome().updated == [] and np.array_equal(bufs[0], before[0])


def test_messages_from_outside_the_group_are_dropped_and_counted():
    bufs = data(2, 4)
    g = Group(bufs, [1.0, 1.0])
    g.start()
    r = g.rounds[0]
    stranger = Part(pid(9), ep(9), group_id="g1", owner=0, part=0, weight=1.0, rescue=False,
                    data=np.zeros(PART))
    namesake = Part(pid(1), ep(9), group_id="g1", owner=0, part=0, weight=1.0, rescue=False, data=np.zeros(PART))
    r.on_message(stranger, 0.0)
    r.on_message(namesake, 0.0)
    wrong_len = Part(pid(1), ep(1), group_id="g1", owner=0, part=0, weight=1.0, rescue=False, data=np.zeros(3))
    r.on_message(wrong_len, 0.0)
    assert r.dropped == 3 and r.own.pending == {}


def test_an_abort_mid_round_excludes_the_member():
    bufs, w = data(3, 5), [1.0, 1.0, 1.0]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w)
    g.rounds[0].start(0.0)
    g.rounds[1].start(0.0)
    g.rounds[0].on_message(Abort(pid(2), ep(2), group_id="g1", reason="user cancelled"), 0.0)
    g.rounds[1].on_message(Abort(pid(2), ep(2), group_id="g1", reason="user cancelled"), 0.0)
    g.cut = {2}
    g.carry()
    for i in (0, 1):
        assert g.done[i] == 0.0 and g.rounds[i].outcome().lost == (pid(2),)
    assert_averaged_or_unchanged(g, before, w)


def test_one_transition_table_refuses_illegal_moves():
    for old, moves in MOVES.items():
        for new in type(old):
            if new in moves:
                assert transition(old, new, "x") is new
            else:
                with pytest.raises(IllegalTransition, match="illegal move"):
                    transition(old, new, "x")
    terminal = [s for s, m in MOVES.items() if not m]
    assert set(terminal) == {RoundPhase.DONE, PartState.AVERAGED, PartState.PARTIAL, PartState.UNCHANGED,
                             ReduceState.REDUCED, ReduceState.GIVEN_UP}
    assert set(MOVES) == set(RoundPhase) | set(PartState) | set(ReduceState)


def test_local_misuse_raises_protocol_error():
    members = (MemberInfo(pid(0), ep(0), 1.0, "s"), MemberInfo(pid(1), ep(1), 1.0, "t"))
    spec = GroupSpec("k", "g", members, 0)
    kw = dict(part_elems=PART, part_timeout=1.0, deadline=1.0, on_done=lambda r, now: None)
    with pytest.raises(ProtocolError):
        AllReduceRound(spec, np.zeros((2, 2)), 1.0, None, Outbox(), 0.0, **kw)
    with pytest.raises(ProtocolError):  # a weight no peer would accept
        AllReduceRound(spec, np.zeros(4), float("nan"), None, Outbox(), 0.0, **kw)
    with pytest.raises(ProtocolError):  # a dtype the wire does not carry
        AllReduceRound(spec, np.zeros(4, np.complex64), 1.0, None, Outbox(), 0.0, **kw)


def test_parts_with_another_or_unknown_codec_or_the_wrong_byte_count_are_dropped_and_counted():
    from zgossip.codecs import FP16, INT8, CodecMap, encoded_nbytes

    bufs = [b.astype(np.float32) for b in data(2, 4)]
    g = Group(bufs, [1.0, 1.0], codec=lambda: CodecMap((0, NUMEL), (INT8,)))
    g.start()
    r = g.rounds[0]
    good = encoded_nbytes(INT8, PART)
    for codec, nbytes in ((FP16, 2 * PART), (77, good), (INT8, good - 1), (0, 4 * PART)):
        payload = np.zeros(nbytes // 4, np.float32) if codec == 0 else np.zeros(nbytes, np.uint8)
        r.on_message(Part(pid(1), ep(1), group_id="g1", owner=0, part=0, weight=1.0, rescue=False, codec=codec,
                          data=payload), 0.0)
    assert r.dropped == 4 and r.own.pending == {}
    g.carry()  # the real parts still average
    assert all(p is not None for p in g.done)
    assert np.array_equal(bufs[0].view(np.uint32), bufs[1].view(np.uint32))


def test_owners_return_receipts_and_members_measure_their_upload():
    stats = [LinkStats(min_window_s=0.0, min_window_bytes=1, min_upload_s=0.0) for _ in range(3)]
    g = Group(data(3), [1.0, 1.0, 1.0], linkstats=stats)
    g.start(0.0)
    # member 0's parts (interleaved: owner 1, owner 2, owner 1, ...) arrive one every 10 ms
    for k, (e, m) in enumerate(g.outs[0].take()):
        g.by_ep[e].on_message(m, 0.01 * (k + 1))
    g.carry(1.0)
    # (the RESULTs went out during carry; read what owner 1 sent member 0)
    r1 = g.rounds[1]
    rx = [r1._result(1, p, (0, 1, 2), False, r1.buf[:1]).rx for p in range(r1.plan.num_parts(1))]
    # each part of member 0 reached owner 1 20 ms after the previous one; owner 1's own term has none
    assert [x[0] for x in rx] == [20_000 * p for p in range(len(rx))] and all(x[1] == -1 for x in rx)
    assert all(r.outcome().complete for r in g.rounds)
    part_bytes = PART * 8
    up = stats[0].upload_mbit()
    assert up == pytest.approx(part_bytes / 0.01 * 8e-6, rel=0.1), up
    assert stats[0].estimate_mbit() == min(stats[0].download_mbit(), up)


def test_results_with_receipts_that_do_not_match_their_contributors_are_dropped():
    stats = [LinkStats(min_window_s=0.0, min_window_bytes=1, min_upload_s=0.0) for _ in range(2)]
    g = Group(data(2), [1.0, 1.0], linkstats=stats)
    g.start(0.0)
    r0 = g.rounds[0]
    arr = np.zeros(r0.plan.part(1, 0)[1] - r0.plan.part(1, 0)[0])
    bad = Result(pid(1), ep(1), group_id="g1", owner=1, part=0, contributors=(0, 1), rescue=False, rx=(5,), data=arr)
    r0.on_message(bad, 0.1)
    assert r0.dropped == 1 and r0.status[1][0] is PartState.WAITING


def test_a_rescue_call_for_a_live_owners_span_is_refused():
    """Any groupmate could otherwise claim a live member's span: member 2 calls member 0 in to
    'rescue' member 1's span while member 1 is talking. Member 0 refuses (counted), answers that it
    needs nothing (so an honest substitute need not wait for it), keeps member 1 and takes member
    1's own results: nothing the caller reduces reaches member 0's copy of that span."""
    bufs, w = data(3, 11), [1.0, 1.0, 1.0]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w)
    g.start()
    r0 = g.rounds[0]
    r0.on_message(RescueCall(pid(2), ep(2), group_id="g1", owner=1), 0.0)
    assert r0.dropped == 0 and r0.next_deadline() == 0.25  # held for a grace (a notice may be on its way)
    r0.on_timer(0.25)  # member 1 still heard from: refused
    assert r0.dropped == 1 and 1 not in r0.lost and 1 not in r0.rescue_target
    answer = [m for e, m in g.outs[0].sent if e == ep(2) and isinstance(m, Rescue)]
    assert answer and answer[-1].owner == 1 and answer[-1].need == ()
    g.carry(0.0)
    for r in g.rounds:
        assert r.outcome().complete and r.outcome().lost == ()
    assert np.array_equal(bufs[0], bufs[1]) and np.array_equal(bufs[1], bufs[2])
    assert_averaged_or_unchanged(g, before, w)


def test_a_request_to_rescue_a_live_owners_span_is_answered_with_notices():
    """Member 2 asks member 0 to re-reduce member 1's span for it while member 1 is talking to
    member 0: refused (counted) with empty notices, so member 2 settles those parts as unchanged at
    once; member 0 keeps member 1 and its results."""
    bufs, w = data(3, 12), [1.0, 1.0, 1.0]
    g = Group(bufs, w)
    g.start()
    r0 = g.rounds[0]
    need = tuple(range(r0.plan.num_parts(1)))
    r0.on_message(Rescue(pid(2), ep(2), group_id="g1", owner=1, need=need), 0.0)
    r0.on_timer(0.25)
    assert r0.dropped == 1 and 1 not in r0.lost and not r0.rescues
    notices = [m for e, m in g.outs[0].take() if e == ep(2) and isinstance(m, Result)]
    assert sorted(m.part for m in notices) == list(need)
    assert all(m.rescue and m.owner == 1 and m.data.size == 0 and m.contributors == () for m in notices)


def test_a_rescue_call_from_a_member_that_reduces_nothing_is_refused():
    bufs, w = data(3, 13), [1.0, 1.0, 1.0]
    g = Group(bufs, w, bandwidths=[1.0, 1.0, 0.0])  # member 2 is a client: it reduces nothing
    g.start()
    r0 = g.rounds[0]
    r0.last_heard[1] = -100.0  # member 1 silent for long: only the caller is wrong
    r0.on_message(RescueCall(pid(2), ep(2), group_id="g1", owner=1), 0.0)
    assert r0.dropped == 1 and 1 not in r0.lost


def test_a_rescue_call_just_before_our_own_disconnect_notice_is_taken_when_it_comes():
    """A crash's disconnect notices reach the members milliseconds apart: a substitute's call can
    come while we still count the owner as heard from. It is held, and taken as soon as the owner
    is lost to us too: we declare to the caller and send it our parts, as if the call came after."""
    bufs, w = data(3, 14), [1.0, 1.0, 1.0]
    g = Group(bufs, w, part_timeout=30.0)
    g.start()
    r0 = g.rounds[0]
    r0.on_message(RescueCall(pid(2), ep(2), group_id="g1", owner=1), 0.01)
    assert r0.dropped == 0 and 1 not in r0.lost
    r0.peer_down(ep(1), 0.02)
    assert 1 in r0.lost and r0.rescue_target.get(1) == 2 and r0.dropped == 0 and not r0._deferred
    sent = [m for e, m in g.outs[0].sent if e == ep(2)]
    assert any(isinstance(m, Rescue) and m.owner == 1 and m.need for m in sent)
    assert any(isinstance(m, Part) and m.rescue and m.owner == 1 for m in sent)


def test_rescue_parts_that_come_with_a_request_we_held_are_taken_when_we_take_it():
    """A crash seen by member 0 first: it asks member 2 (the owner's substitute) to rescue member 1's
    span and sends its parts right behind the request. Member 2 still hears member 1, so it holds
    the request -- and dropped the parts as undeclared. When its own notice came it took the request
    and waited for parts already sent, then gave live member 0 up (a survivor "lost", seen in CI).
    The parts are now held with the request and taken with it."""
    bufs, w = data(3, 15), [1.0, 2.0, 3.0]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w, part_timeout=30.0)
    g.cut = {1}
    g.start(0.0)
    g.carry(0.0)
    r0, r2 = g.rounds[0], g.rounds[2]
    r0.peer_down(ep(1), 0.01)
    assert r0.rescue_target.get(1) == 2
    g.carry(0.01)  # member 2 holds the request (member 1 still heard from) and the parts behind it
    assert r2._deferred and 1 not in r2.lost
    r2.peer_down(ep(1), 0.02)
    g.carry(0.02)
    r2.on_timer(31.0)  # before: member 2 still waited for member 0's parts, and now gave it up
    g.carry(31.0)
    assert r2.dropped == 0 and not r2._held
    for i in (0, 2):
        out = g.rounds[i].outcome()
        assert g.done[i] == 0.02 and out.lost == (pid(1),), (i, out.lost)
        assert g.rounds[i].rescued[1] == g.rounds[i].plan.num_parts(1)  # the whole span re-reduced
    assert np.array_equal(bufs[0], bufs[2])
    lo, hi = r0.plan.part(1, 0)[0], r0.plan.part(1, r0.plan.num_parts(1) - 1)[1]
    np.testing.assert_allclose(bufs[0][lo:hi], mean(before, w, [0, 2])[lo:hi], rtol=1e-12)


def test_a_member_that_refused_a_rescue_call_and_asks_later_is_answered():
    """The owner dies; its substitute (member 2) hears of it first and calls member 0 in, but member
    0 heard the owner lately and refuses (its grace runs out first). Member 0 then times the owner
    out itself and asks member 2 to rescue after all. Member 2 had taken the refusal as "needs
    nothing" and kept it: member 0's parts were dropped as undeclared, it waited for results that
    never came, and each of the two live members ended by giving the other up. Now the later
    request is answered: parts that can still take member 0's term take it, the others are
    settled as unchanged for it at once."""
    bufs, w = data(3, 21), [1.0, 1.0, 1.0]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w, part_timeout=1.0)
    g.start(0.0)
    g.cut = {1}
    r0, r2 = g.rounds[0], g.rounds[2]
    r2.peer_down(ep(1), 0.05)
    g.carry(0.05)
    assert r0._deferred  # member 0 still hears member 1: the call waits for its grace
    t = 0.05
    while t < 20 and None in (g.done[0], g.done[2]):
        t = min(x for x in (r0.next_deadline(), r2.next_deadline()) if x is not None)
        for r in (r0, r2):
            r.on_timer(t)
        g.carry(t)
    for i in (0, 2):
        assert g.rounds[i].outcome().lost == (pid(1),), (i, g.rounds[i].outcome().lost)
        assert g.done[i] <= 1.5  # member 0's own silence limit for the owner (1 s), plus a watchdog tick
    assert r2.dropped == 0
    for i, r in ((0, r0), (2, r2)):
        out = r.outcome()
        changed = np.zeros(NUMEL, bool)
        for lo, hi in out.updated:
            changed[lo:hi] = True
        assert np.array_equal(bufs[i][~changed], before[i][~changed])
        for o in range(3):
            for p in range(r.plan.num_parts(o)):
                lo, hi = r.plan.part(o, p)
                if r.status[o][p] is PartState.AVERAGED:
                    who = list(r.part_contrib[o][p])
                    assert i in who
                    np.testing.assert_allclose(bufs[i][lo:hi], mean(before, w, who)[lo:hi], rtol=1e-12)


def test_rescue_parts_held_with_a_request_that_is_refused_are_dropped_and_counted():
    bufs, w = data(3, 16), [1.0, 1.0, 1.0]
    g = Group(bufs, w)
    g.start()
    r0 = g.rounds[0]
    need = (0, 1)
    r0.on_message(Rescue(pid(2), ep(2), group_id="g1", owner=1, need=need), 0.0)
    lo, hi = r0.plan.part(1, 0)
    for p in need:
        lo, hi = r0.plan.part(1, p)
        r0.on_message(Part.trusted(pid(2), ep(2), "g1", 1, p, 1.0, True, 0, bufs[2][lo:hi].copy()), 0.0)
    assert r0.dropped == 0 and len(r0._held[(2, 1)]) == 2
    r0.on_timer(0.25)  # member 1 still heard from: the request is refused, the held parts dropped
    assert r0.dropped == 1 + 2 and not r0._held and not r0.rescues


def tick(g: Group, members: list[int], until: float) -> float:
    """Run the timers of `members` (carrying what they send) until they are all done; the time then."""
    t = 0.0
    while any(g.done[i] is None for i in members):
        t = min(d for d in (g.rounds[i].next_deadline() for i in members) if d is not None)
        assert t < until, f"not done by {until}"
        for i in members:
            d = g.rounds[i].next_deadline()
            if d is not None and d <= t:
                g.rounds[i].on_timer(t)
        g.carry(t)
    return t


def test_a_substitute_that_refused_a_request_does_not_wait_for_that_member_when_it_rescues():
    """Found by fuzzing: member 0 hears of member 1's crash first and asks member 2 (the
    substitute) to re-reduce span 1; 2 does not hear of it yet and refuses with notices, so 0 keeps
    its own values there. When 2's own notice came it started the rescue and waited for a
    declaration from 0 -- which, having asked 2 already, ignored 2's call -- and gave live member 0
    up after part_timeout. A member it refused now counts as needing nothing."""
    bufs, w = data(4, 18), [1.0, 2.0, 3.0, 4.0]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w, part_timeout=1.0)
    g.cut = {1}
    g.start(0.0)
    slow = [(e, m) for e, m in g.outs[3].sent if e == ep(0)]  # member 3's data to 0 comes late: 0 is still busy
    g.outs[3].sent = [(e, m) for e, m in g.outs[3].sent if e != ep(0)]
    g.carry(0.0)
    r0, r2 = g.rounds[0], g.rounds[2]
    r0.peer_down(ep(1), 0.01)
    g.carry(0.01)
    assert r0.rescue_target.get(1) == 2 and r2._deferred
    r2.on_timer(0.26)  # member 1 still heard from, to 2: refused with notices
    g.carry(0.26)
    assert all(s is PartState.UNCHANGED for s in r0.status[1]) and g.done[0] is None
    for i in (2, 3):
        g.rounds[i].peer_down(ep(1), 0.3)
    g.carry(0.3)  # 2 rescues span 1 with member 3
    for e, m in slow:
        r0.on_message(m, 0.3)
    g.carry(0.3)
    t = tick(g, [0, 2, 3], 5.0)
    assert t <= 0.3 and g.done == [0.3, None, 0.3, 0.3]
    for i in (0, 2, 3):
        assert g.rounds[i].outcome().lost == (pid(1),), i
    assert g.rounds[3].rescued[1] == r2.plan.num_parts(1)
    assert_averaged_or_unchanged(g, before, w)


def test_a_rescue_call_taken_after_its_caller_died_does_not_wait_for_the_dead_caller():
    """Found by fuzzing: member 1 (the dead owner 0's substitute) calls members 2 and 3 in, then dies
    too. They held the call (member 0 not silent to them yet) and took it when its grace was over --
    with member 1, lost to them by then, as the substitute: they waited for its results, which no
    limit covers once a member is lost, until the round's deadline (10 s). A lost member is never
    taken as a substitute: the next live one re-reduces the span."""
    bufs, w = data(4, 20), [1.0, 2.0, 3.0, 4.0]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w, part_timeout=1.0, deadline=10.0)
    g.cut = {0}
    g.start(0.0)
    g.carry(0.0)
    r1, r2, r3 = g.rounds[1:]
    r1.peer_down(ep(0), 0.4)
    g.carry(0.4)
    assert r2._deferred and r3._deferred  # member 0 not silent to them yet
    g.cut = {0, 1}
    for r in (r2, r3):
        r.peer_down(ep(1), 0.5)
    t = tick(g, [2, 3], 3.0)
    assert t <= 0.65
    for r in (r2, r3):
        assert r.outcome().lost == (pid(0), pid(1)) and r.rescue_target.get(0) == 2
    assert np.array_equal(bufs[2], bufs[3])
    assert g.rounds[3].rescued[0] == r2.plan.num_parts(0)  # span 0 re-reduced by member 2
    assert_averaged_or_unchanged(g, before, w)


def test_a_member_whose_round_is_over_answers_a_rescue_request_with_notices():
    """Found by fuzzing: owner 1 dies after its results reached member 2, not member 0. Member 2
    is done; member 0 asks it (the substitute) to re-reduce span 1. A request for a finished round
    was dropped by the node: member 0 waited 2 x part_timeout and gave live member 2 up. What the
    node keeps of the round (`FinishedRound`) now answers with notices: 0 keeps its own values."""
    bufs, w = data(3, 19), [1.0, 2.0, 3.0]
    before = [b.copy() for b in bufs]
    g = Group(bufs, w, part_timeout=1.0)
    g.start(0.0)
    for o in g.outs:  # every GATHER and PART arrives ...
        for e, m in o.take():
            g.by_ep[e].on_message(m, 0.0)
    g.oneway = {(1, 0)}  # ... but member 1's results reach member 2 only
    g.carry(0.0)
    assert g.done[2] == 0.0 and g.done[0] is None
    g.cut = {1}
    r0, r2 = g.rounds[0], g.rounds[2]
    r0.peer_down(ep(1), 0.01)
    request = [m for e, m in g.outs[0].take() if e == ep(2)]
    assert isinstance(request[0], Rescue) and request[0].need == tuple(range(r0.plan.num_parts(1)))
    answer = r2.finished().answer(request[0])
    assert [m.part for m in answer] == list(request[0].need)
    for m in answer:
        r0.on_message(m, 0.02)
    assert g.done[0] == 0.02 and r0.outcome().lost == (pid(1),) and r0.dropped == 0
    assert all(s is PartState.UNCHANGED for s in r0.status[1])
    assert_averaged_or_unchanged(g, before, w)
    fin = r2.finished()  # and nothing for what is not a member's request for another's span
    assert fin.answer(Rescue(pid(7), ep(7), group_id="g1", owner=1, need=(0,))) is None
    assert fin.answer(Rescue(pid(0), ep(0), group_id="g1", owner=0, need=(0,))) is None
    assert fin.answer(Rescue(pid(0), ep(0), group_id="g1", owner=2, need=(0,))) is None
    assert fin.answer(Rescue(pid(0), ep(0), group_id="g1", owner=9, need=(0,))) is None
    assert fin.answer(Rescue(pid(0), ep(0), group_id="g1", owner=1, need=())) == []  # "I need nothing": no reply
    assert [m.part for m in fin.answer(Rescue(pid(0), ep(0), group_id="g1", owner=1, need=(1, 1, 0, 99)))] == [0, 1]
    assert fin.answer(RescueCall(pid(0), ep(0), group_id="g1", owner=1))[0].need == ()


@pytest.mark.parametrize("weights", [[1e30, 1e30, 1e30], [1e-300, 3e-300, 2e-300], [1e30, 1e-30, 2e29]])
def test_weights_are_relative_even_past_float32s_range(weights):
    # float32 buffers: weights of 1e30 made |x| * w overflow (the part was left unchanged), weights of
    # 1e-300 rounded to 0 in float32 (the C kernels stored 0 * x, zeroing the tensors; numpy gave up)
    rng = np.random.default_rng(7)
    bufs = [(rng.standard_normal(NUMEL) * 1e10).astype(np.float32) for _ in range(3)]
    before = [b.astype(np.float64) for b in bufs]
    g = Group(bufs, weights)
    g.start()
    g.carry(0.1)
    for r in g.rounds:
        assert r.outcome().complete and r.outcome().updated == [(0, NUMEL)]
    np.testing.assert_allclose(bufs[0], mean(before, weights, [0, 1, 2]), rtol=0, atol=1e10 * 2.0 ** -20)
    assert np.array_equal(bufs[0], bufs[1]) and np.array_equal(bufs[1], bufs[2])


def test_a_part_that_carries_weight_0_is_dropped_and_counted():
    # only an auxiliary member's weight is 0, and it sends no parts: a PART with weight 0 put its
    # sender among the contributors of a mean its data was not in (with every weight 0: zeros)
    bufs, w = data(3, 3), [1.0, 0.0, 1.0]
    g = Group(bufs, w)
    g.start()
    g.carry(0.1)
    r0 = g.rounds[0]
    nparts = r0.plan.num_parts(0)
    assert r0.dropped == nparts
    assert all(1 not in (r0.part_contrib[0][p] or ()) for p in range(nparts))
    assert all(s is ReduceState.COLLECTING for s in r0.own.state)  # waits for member 1 as for a silent one
