"""A connection that a send reopens to a peer the node has already forgotten is closed again.

When a peer dies while we wait on it (a rendezvous peer that acknowledged our JOIN), the node
forgets it (Disconnect) and later tells it it leaves (LEAVE): that send opens a new connection,
which no later Disconnect closed, so every such peer left a DEALER, its monitor and their file
descriptors behind in a long run with churn (3 descriptors per dead peer on loopback).
State machines fed by hand, time passed in; no sockets."""
from __future__ import annotations

import numpy as np

from handfed import ep, pid
from zgossip.actions import Disconnect, Send
from zgossip.messages import Gossip, JoinAck, Leave
from zgossip.node import Node, NodeConfig, StepRequest


def _gossip(i: int, beat: int) -> Gossip:
    return Gossip(pid(i), ep(i), heartbeat=beat, peers=((pid(i), ep(i), beat, None, {}),))


def _run(rejoin_at: float | None = None) -> list[tuple[float, object]]:
    """Peer 1 joins at rendezvous peer 2, which acknowledges and falls silent while 3 and 4 keep
    gossiping; the actions for peer 2's endpoint, with their times."""
    node = Node(pid(1), ep(1), NodeConfig(prefix="t", gossip_interval=0.5, peer_timeout=1.0, matchmaking_time=3.0),
                np.random.default_rng(0))
    node.start(0.0)
    for i in (2, 3, 4):
        node.on_message(_gossip(i, 1), 0.0)
    node.submit_step(StepRequest("s1", np.zeros(4), 1.0, None, 20.0, "L"), 0.1)
    first = node.take_actions()
    assert any(type(a) is Send and a.endpoint == ep(2) and type(a.msg).__name__ == "Join" for a in first)
    node.on_message(JoinAck(pid(2), ep(2), key=node.current_key(), step_id="s1"), 0.15)
    seen = []
    for k in range(2, 120):
        t = k / 10
        beat = k + 2
        for i in (3, 4) if rejoin_at is None or t < rejoin_at else (2, 3, 4):
            node.on_message(_gossip(i, beat), t)
        node.on_timer(t)
        seen += [(t, a) for a in node.take_actions() if getattr(a, "endpoint", None) == ep(2)]
    return seen


def test_a_leave_to_a_forgotten_rendezvous_peer_does_not_leave_its_connection_open() -> None:
    seen = _run()
    kinds = [(type(a).__name__, type(getattr(a, "msg", None)).__name__) for _, a in seen]
    forgot = kinds.index(("Disconnect", "NoneType"))
    leave = kinds.index(("Send", "Leave"))
    assert forgot < leave  # the LEAVE went out after the peer was forgotten: it reopened a connection
    assert type(seen[-1][1]) is Disconnect  # ... which is closed again
    assert seen[-1][0] - seen[leave][0] <= 1.0 + 0.5 + 0.1  # within peer_timeout (and a gossip tick)
    assert all(type(a) is Disconnect for _, a in seen[leave + 1:])


def test_a_peer_back_at_a_forgotten_endpoint_keeps_its_connection() -> None:
    seen = _run(rejoin_at=4.25)  # back (restarted) just after our LEAVE, before the reclose
    leave = next(i for i, (_, a) in enumerate(seen) if type(a) is Send and type(a.msg) is Leave)
    assert not any(type(a) is Disconnect for _, a in seen[leave + 1:])


def test_the_reclose_fires_at_the_deadline_the_node_reports() -> None:
    """Driven only at `next_deadline()` (as both drivers do), the reclose happens; compared as
    `now - since >= peer_timeout` it could miss its own deadline by a rounding error, and a
    driver would call on_timer at that same time for ever."""
    # 0.5 + 0.9 - 0.5 < 0.9 in floats: the case that missed
    node = Node(pid(1), ep(1), NodeConfig(prefix="t", peer_timeout=0.9), np.random.default_rng(0))
    node.start(0.0)
    node.on_message(_gossip(2, 1), 0.0)
    node.membership.forget(pid(2), 0.1)
    assert Disconnect(ep(2)) in node.take_actions()
    node._send(ep(2), Leave(pid(1), ep(1), key="t/x", step_id="s"))
    node.take_actions()
    now, closed = 0.5, False
    for _ in range(200):
        node.on_timer(now)
        if Disconnect(ep(2)) in node.take_actions():
            closed = True
            break
        nxt = node.next_deadline()
        assert nxt is not None and nxt >= now
        now = max(nxt, now)
    assert closed and now == 0.5 + 0.9  # peer_timeout after the first tick that saw the send


def test_a_peer_that_moved_to_another_endpoint_has_its_old_connection_closed() -> None:
    """A peer restarted under its id at another address (a key file keeps the id; the port or
    host changed): its record follows it, and the connection to the old address, which nothing
    closed before (it reconnected to a dead address for good and kept one of the `warm_peers`
    slots), is closed -- unless another record still names that address."""
    from zgossip.actions import Connect
    node = Node(pid(1), ep(1), NodeConfig(prefix="t", gossip_interval=0.5), np.random.default_rng(0))
    node.start(0.0)
    node.take_actions()
    old, new = ep(2), "tcp://10.0.0.2:6666"
    node.on_message(_gossip(2, 1), 0.1)
    node.on_message(Gossip(pid(9), old, heartbeat=1, peers=((pid(9), old, 1, None, {}),)), 0.1)  # a namesake there
    assert [(type(a), a.endpoint) for a in node.take_actions() if type(a) is Connect] == [(Connect, old)]
    node.on_message(Gossip(pid(2), new, heartbeat=2, peers=((pid(2), new, 2, None, {}),)), 0.2)
    acts = [(type(a), a.endpoint) for a in node.take_actions() if type(a) in (Connect, Disconnect)]
    assert acts == [(Connect, new)]  # pid(9) still names the old address: its connection stays
    node.on_message(Gossip(pid(9), "tcp://10.0.0.9:1", heartbeat=2, peers=()), 0.3)
    acts = [(type(a), a.endpoint) for a in node.take_actions() if type(a) in (Connect, Disconnect)]
    assert acts == [(Disconnect, old), (Connect, "tcp://10.0.0.9:1")]
    assert node.membership.endpoint_of(pid(2)) == new and old not in node._warm
