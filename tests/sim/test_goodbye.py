"""A peer that shuts down cleanly says goodbye (BYE): the others forget it at once, not after
``peer_timeout``. By hand on the membership state machine, in virtual time, and on real sockets."""
from __future__ import annotations


import numpy as np
import pytest

import zgossip
from sim import SimCluster
from zgossip import wire
from zgossip.membership import Membership
from zgossip.node import NodeConfig
from zgossip.wire import Message, MsgType, make_message


class Net:
    """Memberships wired together by hand: `deliver` moves queued messages (in order)."""

    def __init__(self, n: int, peer_timeout: float = 5.0) -> None:
        self.queue: list[tuple[str, Message]] = []
        self.by_ep: dict[str, Membership] = {}
        for i in range(n):
            ep = f"tcp://10.0.0.{i + 1}:1"
            m = Membership(f"p{i}", ep, lambda dst, msg: self.queue.append((dst, msg)), np.random.default_rng(i),
                           initial_peers=["tcp://10.0.0.1:1"] if i else [], gossip_interval=0.5,
                           peer_timeout=peer_timeout)
            self.by_ep[ep] = m
        self.members = list(self.by_ep.values())

    def deliver(self, now: float, drop_from: str | None = None) -> None:
        while self.queue:
            dst, msg = self.queue.pop(0)
            m = self.by_ep.get(dst)
            if m is None or msg.sender == drop_from:
                continue
            msg = wire.decode(wire.encode(msg))  # as it travels
            m.observe(msg.sender, msg.endpoint, now)
            if msg.type is MsgType.BYE:
                m.on_bye(msg, now)
            else:
                m.on_gossip(msg, now)

    def converge(self, until: float) -> float:
        t = 0.0
        for m in self.members:
            m.start(t)
        while t < until:
            t += 0.5
            for m in self.members:
                m.on_timer(t)
            self.deliver(t)
        return t


def test_bye_removes_the_peer_at_once_and_stale_gossip_does_not_bring_it_back():
    net = Net(3)
    t = net.converge(6.0)
    a, b, c = net.members
    assert a.live_ids() == ["p1", "p2"] and b.live_ids() == ["p0", "p2"]
    c.goodbye(t)
    assert c.deadline() is None  # it stopped gossiping
    net.deliver(t)
    assert "p2" not in a.live_ids() and "p2" not in b.live_ids()
    assert "tcp://10.0.0.3:1" in a.forgotten  # -> the node closes its connections to it
    # a digest that still carries p2 at its last heartbeat (gossip in flight) does not revive it
    stale = make_message(MsgType.GOSSIP_REPLY, "p9", "tcp://10.0.0.9:1",
                    {"hb": 1, "peers": [("p2", "tcp://10.0.0.3:1", c.heartbeat, None, {})]})
    a.on_gossip(stale, t + 0.1)
    assert "p2" not in a.live_ids()
    # nor does a late message of it on another lane (observe = direct contact)
    a.observe("p2", "tcp://10.0.0.3:1", t + 0.2)
    assert "p2" not in a.live_ids()
    # and the two that stay keep gossiping without it
    for k in range(6):
        t += 0.5
        for m in (a, b):
            m.on_timer(t)
        net.deliver(t)
        assert "p2" not in a.live_ids() and "p2" not in b.live_ids()


def test_without_bye_a_stopped_peer_counts_as_live_until_peer_timeout():
    """The baseline the goodbye fixes (and a check that the test above could fail)."""
    net = Net(3, peer_timeout=5.0)
    t = net.converge(6.0)
    a = net.members[0]
    stop = t
    while "p2" in a.live_ids():
        t += 0.5
        for m in net.members[:2]:
            m.on_timer(t)
        net.deliver(t, drop_from="p2")
    assert t - stop >= 5.0


def test_a_peer_restarted_under_the_same_id_comes_back_by_gossiping():
    net = Net(2)
    t = net.converge(3.0)
    a, b = net.members
    b.goodbye(t)
    net.deliver(t)
    assert a.live_ids() == []
    t += 0.2
    hello = make_message(MsgType.GOSSIP, "p1", "tcp://10.0.0.2:1", {"hb": 1, "peers": [("p1", "tcp://10.0.0.2:1", 1, None, {})]})
    a.observe("p1", "tcp://10.0.0.2:1", t)  # what the node does first, for any message
    a.on_gossip(hello, t)
    assert a.live_ids() == ["p1"]


def test_bye_from_a_namesake_at_another_address_is_ignored():
    net = Net(2)
    t = net.converge(3.0)
    a = net.members[0]
    fake = make_message(MsgType.BYE, "p1", "tcp://10.6.6.6:1", {"hb": 10**6})
    a.on_bye(fake, t)
    assert a.live_ids() == ["p1"]


def test_goodbye_in_virtual_time_with_the_real_averager():
    cl = SimCluster(seed=3)
    cfg = NodeConfig(prefix="bye", gossip_interval=0.1, peer_timeout=5.0)
    peers = []
    for i in range(4):
        peers.append(cl.add_peer(cfg, initial_peers=[peers[0].endpoint] if peers else [],
                                 tensors=[np.zeros(4, np.float32)]))
    cl.run(until=2.0)
    assert all(len(p.node.membership.live_ids()) == 3 for p in peers)
    gone = peers[3]
    done = gone.shutdown(timeout=1.0)
    cl.run(until=done)
    stopped = cl.env.now
    cl.run(until=stopped + 0.5)  # a few link latencies, far below peer_timeout
    for p in peers[:3]:
        assert gone.peer_id not in p.node.membership.live_ids()
    cl.run(until=stopped + 3.0)  # and it stays gone
    for p in peers[:3]:
        assert gone.peer_id not in p.node.membership.live_ids()
        assert len(p.node.membership.live_ids()) == 2


@pytest.mark.parametrize("body", [{}, {"hb": -1}, {"hb": "x"}, {"hb": 1, "extra": 2}])
def test_malformed_bye_is_refused_by_the_wire(body):
    frames = wire.encode(make_message(MsgType.BYE, "p1", "tcp://10.0.0.2:1", {"hb": 1}))
    import msgpack

    header = msgpack.unpackb(frames[0], raw=False)
    header[4] = body
    with pytest.raises(zgossip.InvalidMessage):
        wire.decode([msgpack.packb(header, use_bin_type=True)])
