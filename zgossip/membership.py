"""Membership: who is alive and where, learned by gossip; no peer is special.

Gossip-style failure detection (van Renesse et al., 1998): every node increments its
own heartbeat counter each gossip tick and pushes a digest ``[(peer_id, endpoint,
heartbeat)]`` to a few random peers, which answer with theirs (push-pull). A peer
whose heartbeat has not grown for ``peer_timeout`` is forgotten; a tombstone stops
stale digests from resurrecting it, while a fresh heartbeat (it came back) does.
Bootstrap is just gossip to ``initial_peers`` endpoints, repeated while the table is
empty, so any running peer can serve as the entry point.

A peer forgotten for silence may be dead or alive behind a network cut. Now and then (one
gossip tick in ten) a node sends a digest to the endpoint of one such peer, among the last
`REJOIN_MAX` it forgot and for `REJOIN_FOR` after it did, as it does to its initial peers: two
halves cut apart for longer than ``peer_timeout`` meet again when the cut heals, even when no
initial peer is alive across it.

A peer that shuts down cleanly says goodbye (`goodbye`: BYE with its last heartbeat to every
peer it knows, then it stops gossiping): the others forget it at once (`on_bye`) instead of
counting it live for ``peer_timeout``. Its last heartbeat goes into the tombstone, so digests
that still carry it cannot bring it back, and for ``peer_timeout`` a late message of it (a
result on the other lane) does not count as contact either; a peer restarted under the same id
announces itself by gossip, which does. A restarted peer counts its heartbeat from 0 again while
the swarm holds its last life's: the first digest that names it with a higher one makes it go on
from there (`merge`), or peers that know it only second-hand would take its news for stale.

**Client-mode peers** (endpoint ``client://<id>``, `zgossip.endpoints.listens` is False) bind
nothing, so nobody may gossip to them, connect to them or meet at them: they are never entered
in `peers`. Their records still count (a client's training progress is part of the swarm's), so
they live in a second table, `clients`, by the same rules: entered from the client's own gossip
(the first entry of its digest, under the id the transport authenticated) or from other peers'
digests, refreshed while the heartbeat grows or the client talks to us, forgotten after
``peer_timeout`` of silence or at its goodbye, tombstoned like a peer, and checked like one
(`admit`, `endpoint_ok`, `clean_info`; the ZeroMQ transport delivers a client's own messages
only under ``client://<its authenticated id>``). A client entry is relayed in digests but is never a gossip
target, never `discovered` (no connection is opened for it), never in `live_ids`, `everyone`,
`ranking` or `donors`, and does not change `version`. A peer older than this one skips the
client entries of a digest, as it always did.
"""
from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from .endpoints import listens, peer_check
from .rendezvous import RankingCache
from .messages import Bye, Gossip, GossipReply, Message

__all__ = ["PeerRecord", "Membership", "MAX_HEARTBEAT"]

log = logging.getLogger(__name__)

#: the highest heartbeat a node takes over from news of its own earlier life (half the wire's
#: limit, `messages.MAX_ROUND`): a liar naming one at the limit would otherwise push this node's
#: heartbeat past what a message may carry. Honest nodes count one per gossip interval.
MAX_HEARTBEAT = 1 << 61

#: how long the endpoint of a peer forgotten for silence is knocked at now and then (`_lost`), the
#: chance per gossip tick that one of them is, and how many are kept (the most recently forgotten)
REJOIN_FOR = 1800.0
REJOIN_CHANCE = 0.1
REJOIN_MAX = 256


@dataclass
class PeerRecord:
    peer_id: str
    endpoint: str
    heartbeat: int
    updated: float  # local time the heartbeat last grew, or of direct contact
    share: float | None = None  # state-sharing priority it declared, None = does not share
    info: dict = field(default_factory=dict)  # small public record it gossips (e.g. training progress)
    # seen alive by this node: direct contact, or its heartbeat grew here after we first heard of
    # it. Only such records are relayed in our digests (see `Membership._digest_message`)
    heard: bool = True


def _is_ip_endpoint(endpoint: str) -> bool:
    host = endpoint.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Membership:
    def __init__(
        self,
        peer_id: str,
        endpoint: str,
        send: Callable[[str, Message], None],
        rng: np.random.Generator,
        *,
        initial_peers: Sequence[str] = (),
        gossip_interval: float = 0.5,
        fanout: int = 2,
        peer_timeout: float = 5.0,
        max_digest: int = 256,
    ) -> None:
        if gossip_interval <= 0 or peer_timeout <= gossip_interval:
            raise ValueError("need 0 < gossip_interval < peer_timeout")
        if fanout < 1 or max_digest < 2:
            raise ValueError("need fanout >= 1 and max_digest >= 2")
        self.peer_id = peer_id
        self.endpoint = endpoint
        # A client-mode peer (`zgossip.endpoints.listens`) is never entered in anyone's table: it
        # cannot host a rendezvous, serve state or take gossip, and it talks to peers directly.
        self.listening = listens(endpoint)
        self._send = send
        self._rng = rng
        self.initial_peers = tuple(ep for ep in initial_peers if ep != endpoint)
        self.gossip_interval = gossip_interval
        self.fanout = fanout
        self.peer_timeout = peer_timeout
        self.max_digest = max_digest
        self.admit: Callable[[str], bool] = lambda peer_id: True  # with keys: is this peer id allowed?
        # is this endpoint (from the network) one we could ever reach? Entries naming anything else
        # ("nonsense", a bad port, ipc:// or inproc://) are never entered, so never gossiped on nor
        # connected to; each is counted here (the node adds them to stats["dropped"])
        self.endpoint_ok: Callable[[str], bool] = peer_check(endpoint, initial_peers)
        self.bad_endpoints = 0
        # the node's check of the entries it reads from a peer's info record (bad ones dropped, counted)
        self.clean_info: Callable[[str, dict], dict] = lambda peer_id, info: info
        self.heartbeat = 0
        self.share: float | None = None  # this node's state-sharing priority, gossiped with its heartbeat
        self.info: dict = {}  # this node's public record, gossiped with its heartbeat
        self.peers: dict[str, PeerRecord] = {}
        self._at: dict[str, int] = {}  # endpoint -> how many records in `peers` name it
        # client-mode peers' records (see the module docstring): counted, never sent to
        self.clients: dict[str, PeerRecord] = {}
        self.max_clients = 4 * max_digest  # a flood of invented client ids fills this, not memory
        # and peers likewise: a digest carries at most `max_digest` entries (every honest one does),
        # and the table holds at most `max_peers`. Without keys anyone may gossip invented ids; with
        # no bound one peer's 4096-entry digests entered 600,000 records in 3 s (300 MB) and cost
        # 80 s of CPU. Entries refused so (past a digest's limit, or a full table) are counted here
        # (the node adds them to stats["dropped"])
        self.max_peers = 16 * max_digest
        self.refused_entries = 0
        self.version = 0  # grows whenever the set of live peers changes (for callers' caches)
        self._sorted: list[str] | None = None
        self._ranking = RankingCache()
        self._tombstones: dict[str, tuple[int, float]] = {}
        self._left: dict[str, float] = {}  # peers that said goodbye -> when (late messages are no contact)
        # endpoints of peers we saw alive and then forgot for silence -> when: dead, or alive behind
        # a cut. Now and then one is sent a digest (`on_timer`), so that two halves cut apart for
        # longer than peer_timeout meet again when the cut heals -- before, only an initial peer
        # could bridge them, and halves with none across the cut stayed apart for good
        self._lost: dict[str, float] = {}
        self.said_goodbye = False
        self._next_tick: float | None = None
        self.forgotten: list[str] = []  # endpoints of forgotten peers, drained by the node
        self.discovered: list[str] = []  # endpoints of peers newly entered in the table, drained by the node
        # bootstrap peers nobody has heard from are named in one warning after `bootstrap_warn_after`
        self.bootstrap_warn_after = max(3.0, 4 * gossip_interval)
        self._started_at: float | None = None
        self._reached: set[str] = set()
        self._warned: tuple[str, ...] = ()
        # round-trip times measured on the gossip push-pull (GOSSIP out, its GOSSIP_REPLY back),
        # per endpoint: how long a request to that peer may take before it counts as silent
        self._pinged: dict[str, list[float]] = {}  # endpoint -> when each of our unanswered GOSSIPs left
        self._rtt: dict[str, float] = {}

    # -- queries ---------------------------------------------------------------------
    def live_ids(self) -> list[str]:
        """Known live peer ids (not including this node), sorted for determinism. Do not mutate."""
        if self._sorted is None:
            self._sorted = sorted(self.peers)
        return self._sorted

    def everyone(self) -> list[str]:
        """Live peers including this node (unless it is a client: nobody can reach it to meet there)."""
        return self.live_ids() + [self.peer_id] if self.listening else self.live_ids()

    def ranking(self, key: str) -> list[str]:
        """Everyone in rendezvous order for `key` (see `zgossip.rendezvous`), cached per membership version."""
        return self._ranking.ranking(self.version, self.everyone(), key)

    def _changed(self) -> None:
        self.version += 1
        self._sorted = None

    def left_lately(self, peer_id: str, now: float) -> bool:
        """It said goodbye less than ``peer_timeout`` ago: a late message of it is no contact."""
        left = self._left.get(peer_id)
        return left is not None and now - left < self.peer_timeout

    def endpoint_of(self, peer_id: str) -> str | None:
        if peer_id == self.peer_id:
            return self.endpoint
        rec = self.peers.get(peer_id)
        return rec.endpoint if rec else None

    # -- events ------------------------------------------------------------------------
    def unreached_bootstrap(self) -> tuple[str, ...]:
        """Initial peers that have not been heard from: none of the peers we know uses that
        endpoint. (An initial peer given by host name is counted as reached once anybody answered:
        it advertises itself under another name.)"""
        anyone = bool(self.peers)
        out = []
        for ep in self.initial_peers:
            if ep in self._reached:
                continue
            if anyone and not _is_ip_endpoint(ep):
                continue
            out.append(ep)
        return tuple(out)

    def _check_bootstrap(self, now: float) -> None:
        if not self.initial_peers or self._started_at is None or now - self._started_at < self.bootstrap_warn_after:
            return
        cur = self.unreached_bootstrap()
        if cur == self._warned:
            return
        if cur:
            log.warning("%s: initial peer%s %s not reachable: no answer within %.0f s (check the address, that a "
                        "peer runs there and that the port is open)%s", self.peer_id[:8], "s" if len(cur) > 1 else "",
                        ", ".join(cur), now - self._started_at,
                        "" if self.peers else "; this peer knows no other peer yet")
        else:
            log.info("%s: all initial peers reached", self.peer_id[:8])
        self._warned = cur

    def start(self, now: float) -> None:
        self._started_at = now
        self._next_tick = now
        self.on_timer(now)

    def deadline(self) -> float | None:
        return self._next_tick

    def on_timer(self, now: float) -> None:
        if self._next_tick is None or now < self._next_tick:
            return
        self._next_tick = now + self.gossip_interval
        self.heartbeat += 1
        self._expire(now)
        self._check_bootstrap(now)
        targets = self._pick_targets()
        if not self.peers or self._rng.random() < 0.1:
            # keep knocking on the bootstrap endpoints while alone, and now and then
            # afterwards, so that two halves that lost each other find each other again
            targets += [ep for ep in self.initial_peers if ep not in targets]
        if self._lost and self._rng.random() < REJOIN_CHANCE:
            lost = list(self._lost)
            ep = lost[int(self._rng.integers(len(lost)))]
            if ep not in targets:
                targets.append(ep)
        if targets:
            msg = self._digest_message(Gossip)
            for ep in targets:
                sent = [t for t in self._pinged.get(ep, ()) if now - t < self.peer_timeout][-7:]  # a lost one expires
                self._pinged[ep] = sent + [now]
                self._send(ep, msg)

    def observe(self, peer_id: str, endpoint: str, now: float) -> None:
        """Direct contact from a peer proves it is alive."""
        if peer_id == self.peer_id or not self.admit(peer_id):
            return
        client = not listens(endpoint)
        if client and peer_id in self.peers:
            return  # (a listening peer of that id is the newer news)
        table = self.clients if client else self.peers
        rec = table.get(peer_id)
        if rec is None and len(table) >= (self.max_clients if client else self.max_peers):
            self.refused_entries += 1
            return
        if (rec is None or rec.endpoint != endpoint) and not self.endpoint_ok(endpoint):
            self.bad_endpoints += 1
            return
        left = self._left.get(peer_id)
        if left is not None:
            if now - left < self.peer_timeout:
                return  # a message it sent before its goodbye, overtaken on another lane
            del self._left[peer_id]
        if client:
            self._enter_client(peer_id, endpoint, None, now, direct=True)
            return
        if endpoint in self.initial_peers:
            self._reached.add(endpoint)
        if rec is None:
            tomb = self._tombstones.pop(peer_id, None)
            hb = tomb[0] if tomb else 0
            self._enter(PeerRecord(peer_id, endpoint, hb, now))
        else:
            rec.updated = now
            self._move(rec, endpoint)
            rec.heard = True

    def on_gossip(self, msg: Gossip | GossipReply, now: float) -> None:
        if self._left.pop(msg.sender, None) is not None:
            self.observe(msg.sender, msg.endpoint, now)  # it said goodbye, and now gossips again: back
        peers = msg.peers
        if len(peers) > self.max_digest:
            self.refused_entries += len(peers) - self.max_digest
            peers = peers[: self.max_digest]
        self.merge(peers, now)
        rec = self.peers.get(msg.sender) or self.clients.get(msg.sender)
        if rec is not None and rec.endpoint == msg.endpoint:
            rec.heard = True  # its own entry: the digest is direct contact (the node observes it too)
        if self.said_goodbye:
            return  # we left: answering would only tell others about us again
        if type(msg) is Gossip:
            self._send(msg.endpoint, self._digest_message(GossipReply))
        else:
            # it answers our oldest GOSSIP in flight to that peer (one connection keeps their order).
            # Timing it against the latest instead, when the round trip was longer than the gap
            # between two pings, measured a 0.24 s round trip as 0.07 s; a lost one, until it
            # expires, only makes the estimate higher (its safe side: waits a little longer)
            sent = [t for t in self._pinged.pop(msg.endpoint, ()) if now - t < self.peer_timeout]
            if sent:
                self._sample_rtt(msg.endpoint, now - sent[0])
            if len(sent) > 1:
                self._pinged[msg.endpoint] = sent[1:]

    def _sample_rtt(self, endpoint: str, sample: float) -> None:
        # biased upwards on purpose: a rise is taken at once, a fall only slowly (the first sample
        # may include the connection's set-up, which a later first contact may pay again)
        old = self._rtt.get(endpoint)
        self._rtt[endpoint] = sample if old is None else max(sample, 0.75 * old + 0.25 * sample)
        if len(self._rtt) > 4 * self.max_digest:
            self._rtt.pop(next(iter(self._rtt)))

    def rtt(self, endpoint: str) -> float | None:
        """The round-trip time to `endpoint` measured by gossip (an upper-biased average), or the
        largest one measured to any peer if none was measured to this one yet; None if none at all."""
        r = self._rtt.get(endpoint)
        if r is None and self._rtt:
            r = max(self._rtt.values())
        return r

    def donors(self) -> list[PeerRecord]:
        """Live peers that declared they share state, best priority first (ties in id order)."""
        recs = [r for r in self.peers.values() if r.share is not None]
        return sorted(recs, key=lambda r: (-r.share, r.peer_id))

    def merge(self, entries: Iterable[tuple[str, str, int, float | None, dict]], now: float) -> None:
        for pid, ep, hb, share, info in entries:
            if pid == self.peer_id:
                if self.heartbeat < hb < MAX_HEARTBEAT:
                    # news of an earlier life of ours (we restarted under this id): its heartbeat is
                    # the one to beat, or peers that hear of us second-hand take our records for stale
                    # and expire us until ours grows past it, on its own, after as long as it lived
                    self.heartbeat = hb + 1
                continue
            if not self.admit(pid):
                continue
            if not listens(ep):
                if not self.endpoint_ok(ep):
                    self.bad_endpoints += 1
                elif pid not in self.peers:  # (a listening peer of that id is the newer news)
                    self._enter_client(pid, ep, (hb, share, info), now)
                continue
            rec = self.peers.get(pid)
            if rec is None and len(self.peers) >= self.max_peers:
                self.refused_entries += 1
                continue
            if (rec is None or rec.endpoint != ep) and not self.endpoint_ok(ep):
                self.bad_endpoints += 1  # (checked once per new endpoint: a known one passed already)
                continue
            if rec is None:
                tomb = self._tombstones.get(pid)
                if tomb is not None and hb <= tomb[0]:
                    continue  # stale news of a peer we already buried
                self._tombstones.pop(pid, None)
                if ep in self.initial_peers:
                    self._reached.add(ep)
                # (a heartbeat past its tombstone's grew under our watch: it came back, and we may say so)
                self._enter(PeerRecord(pid, ep, hb, now, share, self.clean_info(pid, info), heard=tomb is not None))
            elif hb > rec.heartbeat:
                rec.heartbeat, rec.updated, rec.share, rec.heard = self._grown(rec, hb, now), now, share, True
                self._move(rec, ep)
                rec.info = self.clean_info(pid, info)

    def _grown(self, rec: PeerRecord, hb: int, now: float) -> int:
        """A known record's heartbeat after news of `hb` (higher): at most 2 more than it was, plus 2 per
        gossip interval since it last grew here. An honest heartbeat grows by 1 per interval, and a
        record that lags is only refreshed in smaller steps; a liar that names a known peer with a
        huge heartbeat no longer pins it -- before, every later honest digest entry of that peer
        read as stale, so the peers that knew it second-hand expired it, and its tombstone kept it
        out for 10 x peer_timeout, while the peer could not follow past `MAX_HEARTBEAT`."""
        return min(hb, rec.heartbeat + 2 + int(2 * max(0.0, now - rec.updated) / self.gossip_interval))

    def goodbye(self, now: float) -> None:
        """Shutting down cleanly: tell every live peer to forget us now, and stop gossiping."""
        if self.said_goodbye:
            return
        self.said_goodbye = True
        self._next_tick = None
        msg = Bye(self.peer_id, self.endpoint, heartbeat=self.heartbeat)
        for pid in self.live_ids():
            self._send(self.peers[pid].endpoint, msg)

    def on_bye(self, msg: Bye, now: float) -> None:
        """`msg.sender` shut down cleanly: forget it at once (not after peer_timeout)."""
        pid = msg.sender
        if pid == self.peer_id:
            return
        rec = self.peers.get(pid) or self.clients.get(pid)
        if rec is not None and rec.endpoint != msg.endpoint:
            return  # a namesake elsewhere (e.g. restarted on another address): not the one we know
        self._left[pid] = now
        if len(self._left) > 4096:  # bounded: the oldest entries are past peer_timeout first
            self._left.pop(next(iter(self._left)))
        if rec is not None:
            rec.heartbeat = max(rec.heartbeat, msg.heartbeat)
            self.forget(pid, now, why="said goodbye")
        else:
            old = self._tombstones.get(pid, (0, now))[0]
            self._tombstones[pid] = (max(old, msg.heartbeat), now)

    def forget(self, peer_id: str, now: float, why: str = "silent") -> None:
        rec = self.clients.pop(peer_id, None)
        if rec is not None:
            self._tombstones[peer_id] = (rec.heartbeat, now)
            log.info("%s: forgot client-mode peer %s (%s)", self.peer_id, peer_id, why)
            return
        rec = self.peers.pop(peer_id, None)
        if rec is not None:
            self._changed()
            self._tombstones[peer_id] = (rec.heartbeat, now)
            self._left_endpoint(rec.endpoint)
            log.info("%s: forgot peer %s at %s (%s)", self.peer_id, peer_id, rec.endpoint, why)

    # -- internals -----------------------------------------------------------------------
    def _enter(self, rec: PeerRecord) -> None:
        self.peers[rec.peer_id] = rec
        self._lost.pop(rec.endpoint, None)
        self._at[rec.endpoint] = self._at.get(rec.endpoint, 0) + 1
        self.clients.pop(rec.peer_id, None)  # a client restarted as a listening peer
        self.discovered.append(rec.endpoint)
        self._changed()

    def _move(self, rec: PeerRecord, endpoint: str) -> None:
        """A known peer now at another endpoint (restarted elsewhere under its id): the connection
        to the old one is closed like a forgotten peer's, unless another record still names it, and
        one to the new one opened like a newly met peer's. (The old one's was kept open for good,
        reconnecting to a dead address, and held one of the node's `warm_peers` slots.)"""
        if endpoint == rec.endpoint:
            return
        old, rec.endpoint = rec.endpoint, endpoint
        self._at[endpoint] = self._at.get(endpoint, 0) + 1
        self._lost.pop(endpoint, None)
        self._left_endpoint(old)
        self.discovered.append(endpoint)

    def _left_endpoint(self, endpoint: str) -> None:
        """A record no longer names `endpoint`: once none does, its connection is closed."""
        n = self._at.pop(endpoint, 0) - 1
        if n > 0:
            self._at[endpoint] = n
            return
        self.forgotten.append(endpoint)
        self._pinged.pop(endpoint, None)
        self._rtt.pop(endpoint, None)

    def _enter_client(self, pid: str, ep: str, entry: tuple[int, float | None, dict] | None, now: float,
                      direct: bool = False) -> None:
        """A client-mode peer's record: `entry` = (heartbeat, share, info) from a digest, or None for
        direct contact (which proves it alive, as `observe` does for a peer)."""
        rec = self.clients.get(pid)
        if rec is None:
            tomb = self._tombstones.get(pid)
            if not direct and tomb is not None and entry is not None and entry[0] <= tomb[0]:
                return  # stale news of a client we already buried
            if len(self.clients) >= self.max_clients:
                self.refused_entries += 1
                return
            self._tombstones.pop(pid, None)
            hb = tomb[0] if tomb is not None and direct else 0
            if entry is None:
                self.clients[pid] = PeerRecord(pid, ep, hb, now)
            else:
                # a client serves no state (nobody can connect to it): its declared priority is not kept
                self.clients[pid] = PeerRecord(pid, ep, max(hb, entry[0]), now, None, self.clean_info(pid, entry[2]),
                                               heard=False)
        elif entry is None:
            rec.updated, rec.heard = now, True
        elif entry[0] > rec.heartbeat:
            rec.heartbeat, rec.updated, rec.heard = self._grown(rec, entry[0], now), now, True
            rec.info = self.clean_info(pid, entry[2])

    def _expire(self, now: float) -> None:
        for pid in [p for p, r in self.peers.items() if now - r.updated > self.peer_timeout]:
            rec = self.peers[pid]
            self.forget(pid, now)
            if rec.heard and rec.endpoint not in self._at:  # no other record names it
                self._lost.pop(rec.endpoint, None)
                self._lost[rec.endpoint] = now
                if len(self._lost) > REJOIN_MAX:
                    self._lost.pop(next(iter(self._lost)))
        while self._lost and now - next(iter(self._lost.values())) > REJOIN_FOR:
            self._lost.pop(next(iter(self._lost)))
        for pid in [p for p, r in self.clients.items() if now - r.updated > self.peer_timeout]:
            self.forget(pid, now)
        horizon = now - 10 * self.peer_timeout
        for pid in [p for p, (_, t) in self._tombstones.items() if t < horizon]:
            del self._tombstones[pid]
        for pid in [p for p, t in self._left.items() if now - t >= self.peer_timeout]:
            del self._left[pid]

    def _pick_targets(self) -> list[str]:
        ids = self.live_ids()
        if not ids:
            return []
        k = min(self.fanout, len(ids))
        chosen = self._rng.choice(len(ids), size=k, replace=False)
        return [self.peers[ids[i]].endpoint for i in sorted(chosen)]

    def _digest_message(self, kind: type[Gossip] | type[GossipReply]) -> Gossip | GossipReply:
        # Only records this node saw alive are relayed. One it merely heard of is held back until its
        # heartbeat grows here: a peer that joined after another died has no tombstone for it, and
        # would otherwise pass on the dead peer's last digest entry as fresh news for a whole
        # peer_timeout -- under churn with lives shorter than peer_timeout, dead records went round
        # for ever (a live node held ~110 dead records against ~10 live ones; `tests/sim/test_membership_churn.py`).
        # A live peer's heartbeat grows every gossip interval, so this delays its relaying by about one.
        ids = [p for p in self.live_ids() if self.peers[p].heard]
        if self.clients:  # relayed too, so that every peer learns of a client that gossips to a few
            ids = ids + sorted(p for p, r in self.clients.items() if r.heard)
        if len(ids) > self.max_digest - 1:
            pick = self._rng.choice(len(ids), size=self.max_digest - 1, replace=False)
            ids = [ids[i] for i in sorted(pick)]
        entries = [(self.peer_id, self.endpoint, self.heartbeat, self.share, self.info)]
        entries += [(p, r.endpoint, r.heartbeat, r.share, r.info)
                    for p in ids for r in (self.peers.get(p) or self.clients[p],)]
        return kind(self.peer_id, self.endpoint, heartbeat=self.heartbeat, peers=tuple(entries))
