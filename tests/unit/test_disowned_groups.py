"""A peer that gets round data of a group it is not in says so (ABORT), so that group's round goes on
without it at once instead of waiting out its silence limits.

Found on the testbed (4 hosts, 10-80 ms links, `zgossip peer` every 3 s): the far peer formed its
group from its groupmates' JOIN_NOTEs while the rendezvous peer had already cut them into another
group -- the LEAVEs withdrawing those notes were still crossing its 80 ms link -- and then streamed
PARTs that they dropped in silence; its step ended 3-4 s later with `PeerLost`, three steps in a
row. Two nodes fed by hand, time passed in; no sockets."""
from __future__ import annotations

import numpy as np

from handfed import ep, pid
from zgossip.actions import Send, StepFailed
from zgossip.errors import PeerLost
from zgossip.messages import Abort, GaveUp, JoinNote, Leave, Part
from zgossip.node import Node, NodeConfig, StepRequest


def _node(i: int, initial: tuple[str, ...] = ()) -> Node:
    n = Node(pid(i), ep(i), NodeConfig(prefix="t", gossip_interval=0.5, part_timeout=2.0, matchmaking_time=1.0),
             np.random.default_rng(i), initial_peers=initial)
    n.start(0.0)
    return n


def _exchange(nodes: dict[str, Node], now: float, hold=lambda msg: False) -> list:
    """Deliver every Send between the nodes (but those `hold` keeps back); the other actions."""
    rest, held = [], []
    for _ in range(20):
        moved = False
        for n in list(nodes.values()):
            for a in n.take_actions():
                if type(a) is Send and a.endpoint in nodes:
                    if hold(a.msg):
                        held.append(a)
                    else:
                        nodes[a.endpoint].on_message(a.msg, now)
                        moved = True
                elif type(a) is not Send:
                    rest.append((n.peer_id, a))
        if not moved:
            break
    return rest


def _two_nodes_that_know_each_other() -> tuple[Node, Node]:
    a, b = _node(1), _node(2, (ep(1),))
    nodes = {ep(1): a, ep(2): b}
    for t in (0.0, 0.5, 1.0):
        for n in (a, b):
            n.on_timer(t)
        _exchange(nodes, t)
    assert a.membership.endpoint_of(pid(2)) == ep(2) and b.membership.endpoint_of(pid(1)) == ep(1)
    return a, b


def test_a_group_formed_from_a_withdrawn_note_fails_at_once():
    a, b = _two_nodes_that_know_each_other()
    nodes = {ep(1): a, ep(2): b}
    # b steps and notes a; its step then ends elsewhere (here: cancelled) and the LEAVE that withdraws
    # its note is still on its way to a when a's own step begins
    b.submit_step(StepRequest("b-1", np.ones(1024, np.float32), 1.0, None, 5.0, "L"), 1.1)
    notes = [x for x in b.take_actions() if type(x) is Send and type(x.msg) is JoinNote and x.endpoint == ep(1)]
    assert notes, "b named a in its view: the swarm is small enough for notes"
    a.on_message(notes[0].msg, 1.15)
    b.cancel_step("b-1", 1.2, "ended elsewhere")
    b.take_actions()  # its LEAVE (and the failure) are not delivered yet
    a.submit_step(StepRequest("a-1", np.zeros(1024, np.float32), 1.0, None, 5.0, "L"), 1.3)
    out = a.take_actions()
    parts = [x for x in out if type(x) is Send and x.endpoint == ep(2) and type(x.msg) is Part]
    assert parts, "a formed the group {a, b} from b's note and streams its parts to b"
    for x in parts:
        b.on_message(x.msg, 1.35)
    aborts = [x for x in b.take_actions() if type(x) is Send and type(x.msg) is Abort]
    assert [(x.endpoint, x.msg.group_id) for x in aborts] == [(ep(1), parts[0].msg.group_id)]  # once, not per part
    a.on_message(aborts[0].msg, 1.4)
    failed = [x for x in a.take_actions() if type(x) is StepFailed]
    assert failed and isinstance(failed[0].error, PeerLost), failed  # at once, not after b's silence limit
    a.on_message(Leave(pid(2), ep(2), key=notes[0].msg.key, step_id="b-1"), 1.45)  # the LEAVE, late: harmless
    assert _exchange(nodes, 1.5) == []


def test_an_abort_or_gave_up_is_never_answered_and_a_part_once_per_group():
    a, b = _two_nodes_that_know_each_other()
    part = dict(group_id="9" * 16, owner=0, part=0, weight=1.0, rescue=False, data=np.zeros(4, np.float32))
    b.on_message(Abort(pid(1), ep(1), group_id="9" * 16, reason="x"), 2.0)  # no ABORT for an ABORT (no ping-pong)
    b.on_message(GaveUp(pid(1), ep(1), group_id="9" * 16), 2.0)
    assert not [x for x in b.take_actions() if type(x) is Send and type(x.msg) is Abort]
    for t in (2.1, 2.2):
        b.on_message(Part(pid(1), ep(1), **part), t)
    b.on_message(Part(pid(1), ep(1), **{**part, "group_id": "8" * 16}), 2.3)
    assert [x.msg.group_id for x in b.take_actions() if type(x) is Send and type(x.msg) is Abort] == ["9" * 16, "8" * 16]
