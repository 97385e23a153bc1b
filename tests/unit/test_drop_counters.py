"""Every message the protocol refuses or ignores is counted: refused (bad data from a peer) in
``dropped``, late or duplicate (already settled) in ``late``, control floods in ``rate_limited``.
State machines fed by hand, time passed in; no sockets."""
from __future__ import annotations

import numpy as np

from handfed import ep, pid
from test_allreduce_round import Group, data
from zgossip.messages import Gather, Gossip, NoGroup, Part, Redirect, RescueCall
from zgossip.node import Node, NodeConfig
from zgossip.ratelimit import SourceLimits


def test_round_counts_refused_and_late_messages():
    g = Group(data(2), [1.0, 1.0])
    g.start()
    r0 = g.rounds[0]
    sent = [m for _, m in g.outs[1].take()]  # round 1's GATHER and its parts of round 0's span
    for m in sent:
        r0.on_message(m, 0.0)
    assert r0.dropped == 0 and r0.late == 0
    part = next(m for m in sent if isinstance(m, Part))
    gather = next(m for m in sent if isinstance(m, Gather))
    r0.on_message(part, 0.0)  # the same part again: its share is settled
    r0.on_message(gather, 0.0)  # a second GATHER: the first stands
    assert (r0.dropped, r0.late) == (0, 2)
    r0.on_message(RescueCall(pid(1), ep(1), group_id="g1", owner=0), 0.0)  # "rescue" the receiver's own span
    r0.on_message(Part(pid(1), ep(1), group_id="g1", owner=1, part=0, weight=1.0, rescue=False,
                       data=part.data), 0.0)  # a part of a span the receiver does not own
    r0.on_message(Part(pid(7), ep(7), group_id="g1", owner=0, part=0, weight=1.0, rescue=False,
                       data=part.data), 0.0)  # from a non-member
    assert (r0.dropped, r0.late) == (3, 2)


def _node(**cfg) -> Node:
    return Node(pid(0), ep(0), NodeConfig(prefix="t", gossip_interval=0.5, **cfg), np.random.default_rng(0))


def test_matchmaking_messages_have_a_bucket_of_their_own():
    """JOIN / JOIN_NOTE / LEAVE are limited per source in their own bucket (`matchmaking_rate`, sized for
    steps): a flood of them is still dropped and counted, and it does not use up the source's control
    budget (its gossip still goes through), nor does gossip use up its matchmaking budget."""
    from zgossip.messages import JoinNote

    n = _node(control_rate=10.0, control_burst=20, matchmaking_rate=100.0, matchmaking_burst=30)
    n.start(0.0)
    for i in range(200):  # notes for made-up steps, all at once
        n.on_message(JoinNote(pid(1), ep(1), key="t/x", step_id=f"{i:016x}", bandwidth=1.0, layout="l", want=2,
                              gathers=0, round=0, view=(pid(0), pid(1))), 1.0)
    assert n.stats["rate_limited"] == 170
    for i in range(20):
        n.on_message(Gossip(pid(1), ep(1), heartbeat=i, peers=()), 1.0)
    assert n.stats["rate_limited"] == 170  # its control bucket is untouched
    n.on_message(JoinNote(pid(1), ep(1), key="t/x", step_id="f" * 16, bandwidth=1.0, layout="l", want=2,
                          gathers=0, round=0, view=(pid(0), pid(1))), 1.1)  # 100/s: 10 more by now
    assert n.stats["rate_limited"] == 170


def test_node_rate_limits_control_floods_per_source_and_counts_late_answers():
    n = _node(control_rate=10.0, control_burst=20)
    n.start(0.0)
    for i in range(200):  # one flooding source, all at once
        n.on_message(Gossip(pid(1), ep(1), heartbeat=i, peers=()), 1.0)
    assert n.stats["rate_limited"] == 180
    n.on_message(Gossip(pid(2), ep(2), heartbeat=1, peers=()), 1.0)  # another source is not held back
    assert n.stats["rate_limited"] == 180
    n.on_message(Gossip(pid(1), ep(1), heartbeat=500, peers=()), 2.0)  # the bucket refills (10/s)
    assert n.stats["rate_limited"] == 180
    # answers to a join this node is not making: ignored, counted late
    late = n.stats["late"]
    n.on_message(Redirect(pid(2), ep(2), key="t/0", step_id="s", to_id=pid(3), to_endpoint=ep(3)), 2.0)
    n.on_message(NoGroup(pid(2), ep(2), key="t/0", step_id="s", reason="x", seen=0, retry=True), 2.0)
    assert n.stats["late"] == late + 2
    # round data for no round of ours: dropped
    dropped = n.stats["dropped"]
    n.on_message(RescueCall(pid(2), ep(2), group_id="ab" * 8, owner=0), 2.0)
    assert n.stats["dropped"] == dropped + 1


def test_source_limits_forget_the_least_recent_source_first():
    lim = SourceLimits(rate=1.0, burst=1, max_sources=2)
    assert lim.allow("a", 0.0) and not lim.allow("a", 0.0)
    assert lim.allow("b", 0.0) and lim.allow("c", 0.0)  # "a" forgotten: a new source starts full
    assert lim.allow("a", 0.0)


def test_chunk_requests_are_paced_held_and_only_past_the_hold_dropped():
    """A state download's chunk requests are not control messages: a donor serves them from a bucket
    of chunks (CHUNK_RATE a second), holds a few back while it is empty and serves them as it refills,
    and drops (counted) only what exceeds the hold. Under the control limit (50/s) an honest
    download of small chunks had requests dropped, each stalling it for its chunk_timeout."""
    from zgossip.messages import StateChunk, StateReq
    from zgossip.node import CHUNK_BURST, CHUNK_RATE, HELD_CHUNK_REQUESTS
    from zgossip.state import StateSnapshot

    n = _node(control_rate=10.0, control_burst=20)
    n.start(0.0)
    n.set_state_sharing(0.0)
    snap = StateSnapshot.build(None, [np.arange(4096, dtype=np.float32)], 16)  # 1,024 chunks of 16 bytes
    n.publish_state(1, snap, 0.0)
    n.take_actions()

    def req(first: int) -> StateReq:
        return StateReq(pid(1), ep(1), req="r", root=snap.root, first=first, count=256)

    def served() -> list[int]:
        return [a.msg.index for a in n.take_actions() if isinstance(getattr(a, "msg", None), StateChunk)]

    per = int(CHUNK_BURST) // 256  # requests the full bucket serves at once
    for k in range(per + HELD_CHUNK_REQUESTS + 2):  # far past the control limit's burst of 20 too
        n.on_message(req((k % 4) * 256), 1.0)
    assert len(served()) == per * 256
    assert n.stats["rate_limited"] == 2  # only the two past the hold
    due = 1.0 + 256 / CHUNK_RATE  # when the bucket holds one more request's chunks
    assert n.next_deadline() <= due  # the node is woken by then
    n.on_timer(due - 1e-4)
    assert served() == []
    n.on_timer(due)
    assert len(served()) == 256
    n.on_timer(due + (HELD_CHUNK_REQUESTS - 1) * 256 / CHUNK_RATE)
    assert len(served()) == (HELD_CHUNK_REQUESTS - 1) * 256  # the rest of the hold, nothing lost
    assert not n._held_chunks and n.stats["rate_limited"] == 2


def test_a_flood_of_one_kind_from_made_up_sources_neither_floods_the_log_nor_silences_other_kinds(caplog):
    """A source is what a message claims (its sender *at its endpoint*), so one peer can pose as
    thousands: each kind logs at most `per_kind` sources, then one line; other kinds keep logging.
    (A single cap of 4,096 over all kinds let one peer's GROUPs silence every later refusal.)"""
    import logging

    from zgossip.droplog import DropLog, OncePer

    log = logging.getLogger("zgossip.test_droplog")
    drops = DropLog("node", per_kind=8)
    with caplog.at_level(logging.WARNING, logger=log.name):
        logged = [drops.note(log, f"{pid(1)[:16]} at tcp://10.0.0.1:{1000 + i}", "a GROUP for a step this peer never made")
                  for i in range(5000)]
        assert sum(logged) == 8
        assert drops.note(log, pid(2), "an invalid message", counter="invalid")  # another kind: still logged
        once = OncePer(log, "node", per_kind=8)
        assert sum(once.first(f"tcp://10.0.0.1:{1000 + i}", "eagain", "send_errors") for i in range(5000)) == 8
        assert once.first("tcp://10.0.0.2:1", "send:22", "send_errors")
        assert not once.first("tcp://10.0.0.2:1", "send:22", "send_errors")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 8 + 1 + 1 + 1, lines  # OncePer logs only its summary line: its caller logs the rest
    assert sum("from now on only counted" in m for m in lines) == 2
    assert any("an invalid message" in m for m in lines)


def test_a_finished_round_answers_rescue_messages_and_drops_a_strangers():
    """A request to rescue a span that reaches a node whose round is over gets empty notices (the
    requester keeps its own values at once, instead of giving the node up later); one from a
    non-member is dropped and counted, a member's "I need nothing" counted late."""
    from zgossip.allreduce import FinishedRound
    from zgossip.messages import Rescue, Result

    n = _node()
    n.start(0.0)
    gid = "cd" * 8
    n._finished[gid] = FinishedRound((pid(0), ep(0)), gid, tuple((pid(i), ep(i)) for i in range(3)), (2, 3, 2))
    n.take_actions()
    n.on_message(Rescue(pid(2), ep(2), group_id=gid, owner=1, need=(0, 2)), 1.0)
    sent = [(a.endpoint, a.msg) for a in n.take_actions() if hasattr(a, "msg")]
    assert [(e, type(m), m.owner, m.part, m.contributors, m.data.size) for e, m in sent] == \
        [(ep(2), Result, 1, p, (), 0) for p in (0, 2)]
    dropped, late = n.stats["dropped"], n.stats["late"]
    n.on_message(Rescue(pid(5), ep(5), group_id=gid, owner=1, need=(0,)), 1.0)
    n.on_message(RescueCall(pid(5), ep(5), group_id=gid, owner=1), 1.0)
    assert n.stats["dropped"] == dropped + 2 and not [a for a in n.take_actions() if hasattr(a, "msg")]
    n.on_message(Rescue(pid(1), ep(1), group_id=gid, owner=2, need=()), 1.0)  # a member's late "I need nothing"
    assert n.stats["late"] == late + 1 and n.stats["dropped"] == dropped + 2
    assert not [a for a in n.take_actions() if hasattr(a, "msg")]
