"""Membership alone, fed by hand: gossip out, digests in, expiry, tombstones, bootstrap."""
from __future__ import annotations

import numpy as np

from handfed import Outbox, ep, pid
from zgossip import messages as M
from zgossip.membership import Membership


def make(me: int = 1, **kw) -> tuple[Membership, Outbox]:
    out = Outbox()
    opts = dict(gossip_interval=0.5, peer_timeout=2.0, fanout=2)
    return Membership(pid(me), ep(me), out, np.random.default_rng(me), **{**opts, **kw}), out


def digest(i: int, hb: int, *records: tuple) -> M.Gossip:
    return M.Gossip(pid(i), ep(i), heartbeat=hb, peers=((pid(i), ep(i), hb, None, {}), *records))


def test_a_lone_peer_knocks_on_its_initial_peers_every_tick():
    m, out = make(initial_peers=(ep(2), ep(1)))  # its own endpoint is ignored
    m.start(0.0)
    [(to, msg)] = out.take()
    assert to == ep(2) and isinstance(msg, M.Gossip) and msg.heartbeat == 1
    assert tuple(msg.peers[0][:3]) == (pid(1), ep(1), 1)
    assert m.deadline() == 0.5
    m.on_timer(0.4)
    assert not out.take()
    m.on_timer(0.5)
    assert [e for e, _ in out.take()] == [ep(2)]
    assert m.unreached_bootstrap() == (ep(2),)


def test_gossip_is_merged_and_answered_a_reply_is_not():
    m, out = make()
    m.start(0.0)
    out.take()
    m.on_gossip(digest(2, 5, (pid(3), ep(3), 7, 1.5, {"epoch": 2})), 0.1)
    assert m.live_ids() == [pid(2), pid(3)]
    assert m.peers[pid(3)].share == 1.5 and m.peers[pid(3)].info == {"epoch": 2}
    [(to, reply)] = out.take()
    assert to == ep(2) and isinstance(reply, M.GossipReply)
    assert {r[0] for r in reply.peers} == {pid(1), pid(2), pid(3)}
    m.on_gossip(M.GossipReply(pid(2), ep(2), heartbeat=6, peers=((pid(2), ep(2), 6, None, {}),)), 0.2)
    assert not out.take()
    assert [r.peer_id for r in m.donors()] == [pid(3)]


def test_silent_peers_expire_and_stale_news_does_not_bring_them_back():
    m, out = make()
    m.start(0.0)
    m.on_gossip(digest(2, 5), 0.0)
    v = m.version
    for t in np.arange(0.5, 2.6, 0.5):
        m.on_timer(float(t))
    assert m.live_ids() == [] and m.forgotten == [ep(2)] and m.version > v
    m.merge([(pid(2), ep(2), 5, None, {})], 2.6)  # the same heartbeat, from someone's stale table
    assert m.live_ids() == []
    m.merge([(pid(2), ep(2), 6, None, {})], 2.7)  # it came back: its heartbeat grew
    assert m.live_ids() == [pid(2)]


def test_direct_contact_keeps_a_peer_alive_and_marks_the_bootstrap_reached():
    m, out = make(initial_peers=(ep(2),))
    m.start(0.0)
    m.observe(pid(2), ep(2), 0.1)
    assert m.live_ids() == [pid(2)] and m.unreached_bootstrap() == ()
    for t in (0.5, 1.0, 1.5, 2.0):
        m.on_timer(t)
        m.observe(pid(2), ep(2), t)
    assert m.live_ids() == [pid(2)]


def test_ranking_is_everyone_in_rendezvous_order_and_the_same_on_every_peer():
    a, _ = make(1)
    b, _ = make(2)
    a.merge([(pid(2), ep(2), 1, None, {}), (pid(3), ep(3), 1, None, {})], 0.0)
    b.merge([(pid(1), ep(1), 1, None, {}), (pid(3), ep(3), 1, None, {})], 0.0)
    assert a.ranking("k") == b.ranking("k") and sorted(a.ranking("k")) == [pid(1), pid(2), pid(3)]
