"""Membership alone, fed by hand: gossip out, digests in, expiry, tombstones, bootstrap."""
from __future__ import annotations

import numpy as np
import pytest

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
    assert {r[0] for r in reply.peers} == {pid(1), pid(2)}  # pid(3) is second-hand news: not relayed yet
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


def test_a_client_is_counted_and_relayed_never_sent_to_and_expires_when_silent():
    """A client-mode peer (client://<id>: it binds nothing) was in nobody's table, so its record (e.g. its
    training progress) reached nobody. It is kept apart from the peers: relayed, never a target."""
    c, cep = pid(9), "client://" + pid(9)
    a, out_a = make(1)
    b, out_b = make(2)
    a.start(0.0)
    b.start(0.0)
    a.on_gossip(digest(2, 1), 0.0)  # a and b know each other; b never hears from the client
    b.on_gossip(digest(1, 1), 0.0)
    out_a.take()
    out_b.take()
    hello = M.Gossip(c, cep, heartbeat=3, peers=((c, cep, 3, 4.0, {"n": 24.0}), (pid(1), ep(1), 1, None, {})))
    a.observe(c, cep, 0.1)  # (the node observes every message's sender before handling it)
    a.on_gossip(hello, 0.1)
    assert a.clients[c].info == {"n": 24.0} and a.clients[c].share is None  # a client serves no state
    assert c not in a.peers and a.live_ids() == [pid(2)] and c not in a.everyone() and not a.donors()
    assert a.discovered == [ep(2)]  # no connection is opened for the client
    [(to, reply)] = out_a.take(M.GossipReply)
    assert to == cep  # answered on the connection it opened, as before
    for t in (0.5, 1.0):  # relayed: b learns of the client from a's digests
        a.on_timer(t)
        for to, msg in out_a.take():
            assert to == ep(2)  # never a gossip target
            b.on_gossip(msg, t)
    assert b.clients[c].info == {"n": 24.0} and c not in b.peers
    for t in (1.5, 2.0):  # the client keeps gossiping to a: its heartbeat grows, both keep it
        hello = M.Gossip(c, cep, heartbeat=int(2 * t) + 3, peers=((c, cep, int(2 * t) + 3, None, {"n": 40.0}),))
        a.on_gossip(hello, t)
        a.on_timer(t)
        for _, msg in out_a.take(M.Gossip):
            b.on_gossip(msg, t)
        b.on_timer(t)
    assert b.clients[c].info == {"n": 40.0}
    for t in np.arange(2.5, 5.1, 0.5):  # silent from 2.0: forgotten after peer_timeout (2 s), by both
        a.on_timer(float(t))
        b.on_timer(float(t))
    assert not a.clients and not b.clients and c not in a.forgotten  # (no connection to close)
    a.merge([(c, cep, 7, None, {"n": 40.0})], 5.1)  # stale news from someone's table
    assert not a.clients
    assert [e for e, _ in out_a.take() + out_b.take() if e.startswith("client://")] == [cep] * 2  # replies only


def test_a_client_that_says_goodbye_is_forgotten_at_once_and_entries_must_be_addresses():
    c, cep = pid(9), "client://" + pid(9)
    m, out = make(1)
    m.start(0.0)
    m.merge([(c, cep, 3, None, {"n": 8.0}), (pid(8), "client://a b", 3, None, {})], 0.0)
    assert list(m.clients) == [c] and m.bad_endpoints == 1
    m.on_bye(M.Bye(c, cep, heartbeat=4), 0.1)
    assert not m.clients
    m.merge([(c, cep, 4, None, {"n": 8.0})], 0.2)  # what it said before its goodbye
    assert not m.clients
    m.admit = lambda peer_id: peer_id != pid(7)  # with keys: only allowed ids are entered, clients too
    m.merge([(pid(7), "client://" + pid(7), 1, None, {})], 0.3)
    m.observe(pid(7), "client://" + pid(7), 0.3)
    assert not m.clients


def test_second_hand_news_is_relayed_only_once_its_heartbeat_grew_here():
    """A record learned from someone's digest is passed on only after this node saw the peer alive
    (its heartbeat grew here, or it made contact). A node that joined after a peer died has no
    tombstone for it: relaying the dead peer's last entry would make it fresh news for another
    `peer_timeout` at every node that hears it, and under churn with short lives the dead were
    passed round for ever (tests/sim/test_membership_churn.py)."""
    m, out = make()
    m.start(0.0)
    out.take()
    m.on_gossip(digest(2, 5, (pid(3), ep(3), 7, None, {}), (pid(4), ep(4), 3, None, {})), 0.1)
    relayed = lambda: {r[0] for r in out.take()[-1][1].peers}
    assert relayed() == {pid(1), pid(2)}
    assert set(m.live_ids()) == {pid(2), pid(3), pid(4)}  # counted live all the same
    m.on_gossip(digest(2, 6, (pid(3), ep(3), 8, None, {}), (pid(4), ep(4), 3, None, {})), 0.6)
    assert relayed() == {pid(1), pid(2), pid(3)}  # pid(3)'s heartbeat grew: alive; pid(4)'s did not
    m.observe(pid(4), ep(4), 0.7)  # direct contact
    m.on_gossip(digest(2, 7), 0.8)
    assert relayed() == {pid(1), pid(2), pid(3), pid(4)}
    # a dead peer's last entry, heard only second-hand, expires here after peer_timeout, never relayed
    m2, out2 = make(5)
    m2.start(0.0)
    m2.on_gossip(digest(2, 9, (pid(6), ep(6), 4, None, {})), 0.1)
    for t in np.arange(0.5, 2.6, 0.5):
        m2.on_timer(float(t))
        m2.on_gossip(digest(2, 10 + int(2 * t), (pid(6), ep(6), 4, None, {})), float(t) + 0.01)
        assert all(pid(6) not in {r[0] for r in msg.peers} for _, msg in out2.take())
    assert pid(6) not in m2.live_ids()
    # a peer we buried whose heartbeat is now past its tombstone's came back: that growth we saw
    m2.on_gossip(digest(2, 30, (pid(6), ep(6), 5, None, {})), 3.0)
    assert pid(6) in m2.live_ids() and pid(6) in _relayed_after_a_digest(m2, out2)


def _relayed_after_a_digest(m: Membership, out) -> set:
    out.take()
    m.on_gossip(digest(2, 99), 3.1)
    return {r[0] for r in out.take()[-1][1].peers}


def test_a_peer_restarted_under_its_id_takes_up_its_old_heartbeat_so_second_hand_news_of_it_counts():
    """A peer restarted under the same id counts its heartbeat from 0 again, while the swarm holds
    its last life's (here 500). Peers that hear of it only second-hand took every record of it for
    stale news and expired it, until its heartbeat grew past 500 on its own -- as long as it had
    lived (a 32-peer swarm, 60 s of life: a third of the peers lost it for 60 s). A digest that
    names the node itself with a higher heartbeat tells it so: it continues from there."""
    old_life = 500
    me, out = make(1)
    me.start(0.0)
    out.take()
    me.on_gossip(digest(2, 9, (pid(1), ep(1), old_life, None, {})), 0.1)  # a peer that knew us before
    assert me.heartbeat > old_life
    me.on_timer(0.5)
    [mine] = {msg.peers[0][2] for _, msg in out.take() if isinstance(msg, M.Gossip)}
    # a peer that knows us only second-hand (at our old heartbeat, or buried) takes this as news
    other, _ = make(3)
    other.start(0.0)
    other.merge([(pid(1), ep(1), old_life, None, {})], 0.0)
    other.merge([(pid(1), ep(1), mine, None, {})], 0.6)
    assert other.peers[pid(1)].heartbeat == mine > old_life and other.peers[pid(1)].updated == 0.6
    # a liar naming our id near the wire's limit cannot push our heartbeat past what a message carries
    me.merge([(pid(1), ep(1), 1 << 62, None, {})], 0.7)
    assert me.heartbeat == mine
    me.on_gossip(digest(2, 10, (pid(1), ep(1), mine - 5, None, {})), 0.8)  # our own news, relayed back late
    assert me.heartbeat == mine


def test_a_huge_heartbeat_gossiped_for_a_known_peer_does_not_pin_it():
    """A liar names peer 2 (known here at heartbeat 10) with a heartbeat near the wire's limit. The
    record took it: every later honest entry of peer 2 read as stale, so this node, which knows peer
    2 only second-hand, expired it, and its tombstone kept it out. A known record now grows by at
    most 2 plus 2 per gossip interval since it last grew."""
    m, out = make(1)
    m.start(0.0)
    m.merge([(pid(2), ep(2), 10, None, {})], 0.0)
    m.merge([(pid(2), ep(2), 1 << 62, None, {})], 0.1)  # the liar (a third peer's digest)
    assert m.peers[pid(2)].heartbeat <= 12
    hb = 10
    for t in np.arange(0.5, 6.01, 0.5):  # peer 2's own heartbeat, relayed by honest peers
        hb += 1
        m.merge([(pid(2), ep(2), hb, None, {})], float(t))
        m.on_timer(float(t))
    assert pid(2) in m.live_ids()  # peer_timeout is 2 s here: it was refreshed all along
    assert m.peers[pid(2)].heartbeat == hb


def test_a_lagging_record_catches_up_in_steps_and_stays_refreshed():
    m, out = make(1)
    m.start(0.0)
    m.merge([(pid(2), ep(2), 10, None, {})], 0.0)
    m.merge([(pid(2), ep(2), 40, None, {})], 1.0)  # a fresher path: 30 ahead after 1 s
    assert m.peers[pid(2)].heartbeat == 10 + 2 + 4 and m.peers[pid(2)].updated == 1.0
    m.merge([(pid(2), ep(2), 41, None, {})], 1.5)
    assert m.peers[pid(2)].heartbeat == 16 + 2 + 2


def test_a_reply_is_timed_against_the_gossip_it_answers_not_a_later_one():
    """A round trip (0.24 s) longer than the gap between two pings to the same peer: each reply answers
    the oldest GOSSIP still in flight. Timing the second reply against the third ping (sent after the
    first reply came) measured 0.04 s, and the estimate sank to 0.19 s -- a JOIN_ACK wait and the
    notes' timing rule (`zgossip.matchmaking`) that trust it were too short for a far peer."""
    m, out = make(initial_peers=(ep(2),), gossip_interval=0.1)
    reply = lambda hb: M.GossipReply(pid(2), ep(2), heartbeat=hb, peers=((pid(2), ep(2), hb, None, {}),))  # noqa: E731
    m.start(0.0)  # ping 1
    m.on_timer(0.1)  # ping 2
    m.on_gossip(reply(1), 0.24)  # answers ping 1
    m.on_timer(0.3)  # ping 3
    m.on_gossip(reply(2), 0.34)  # answers ping 2
    m.on_gossip(reply(3), 0.54)  # answers ping 3
    assert [to for to, msg in out.take() if isinstance(msg, M.Gossip)] == [ep(2)] * 3
    assert m.rtt(ep(2)) == pytest.approx(0.24)


def test_a_lost_gossip_only_raises_the_round_trip_until_it_expires():
    m, out = make(initial_peers=(ep(2),), gossip_interval=0.1, peer_timeout=1.0)
    reply = lambda hb: M.GossipReply(pid(2), ep(2), heartbeat=hb, peers=((pid(2), ep(2), hb, None, {}),))  # noqa: E731
    m.start(0.0)  # lost: never answered
    m.on_timer(0.5)
    m.on_gossip(reply(1), 0.55)  # taken for the answer to the lost one: 0.55 s, too high, not too low
    assert m.rtt(ep(2)) == pytest.approx(0.55)
    for t in (2.0, 2.1):  # the lost ping has long expired: later replies are timed right again
        m.on_timer(t)
        m.on_gossip(reply(2), t + 0.05)
    assert m.rtt(ep(2)) < 0.55
