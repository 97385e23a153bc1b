"""CURVE on one node's sockets: keys for each connection, and who sent each message.

With a key pair, a node's ROUTER is a CURVE server (ZeroMQ RFC 26, the guide's "Ironhouse"
pattern): every connection, TCP or a local Unix socket, is authenticated both ways and
encrypted, and a client's key must be on the node's allow list (`zgossip.zap`). Each DEALER
the node opens is a CURVE client that must know the key of the peer it connects to, so it
cannot be fooled into talking to anyone else. That key comes from, in order:

1. what peers told us themselves: an authenticated message from peer id P claiming endpoint E
   means P's key for E (a peer id is its public key in hex, `zgossip.identity`);
2. `tcp://h:p#KEY` initial peers, and endpoints written in the allow file;
3. the membership table (gossip carries peer ids, which are keys).

A message is accepted only when its sender field equals the key that authenticated its
connection and that key is still allowed (so revoking takes effect at once); anything else is
dropped, counted in ``stats["unauthenticated"]`` and logged once per source.

**An endpoint a handshake proved.** A CURVE handshake our DEALER completed at endpoint E with
key K proves that K's holder listens at E (nobody else could have finished it). From then on,
while that connection stands, a message from another key claiming E as its own endpoint is a
lie: it is dropped (counted in ``stats["unauthenticated"]``, logged once per sender) and changes
nothing -- before, each such claim re-keyed our connection to E, so an allowed peer repeating
an honest peer's endpoint broke every round with that peer. The proof ends when the
connection is closed or dropped, or a later handshake there fails (K may be gone, and another
peer may take the address: a peer restarted under a new key at its old address is taken at
once), and a claim that made us connect with a key the server there refused is forgotten, so
the next claim, its real owner's, is taken.
"""
from __future__ import annotations

import logging
from typing import Callable

import zmq

from .droplog import OncePer
from .identity import AllowList, KeyPair, public_key_of

__all__ = ["Curve"]

log = logging.getLogger(__name__)

_MECHANISM_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
# (not EVENT_HANDSHAKE_FAILED_NO_DETAIL: that is any connection closed mid-handshake, e.g. the
# SO_PEERCRED probe of `zgossip.local_ipc`)
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class Curve:
    """CURVE settings and bookkeeping of one node (None of these when the node has no keys)."""

    def __init__(self, keys: KeyPair, allowed: AllowList, known: dict[str, str], stats: dict, name: str) -> None:
        self.keys, self.allowed, self.stats, self.name = keys, allowed, stats, name
        self.allowed.ids.add(keys.peer_id)  # a node always accepts itself (restarts on the same key)
        self._told: dict[str, str] = {}  # endpoint -> peer id, from that peer's own messages
        self._given = {**{ep: pid for ep, pid in allowed.endpoints.items()}, **known}  # endpoint -> peer id
        # the one endpoint each peer is last said to be at, in `_told` / `_vouched`: a peer claims one
        # endpoint at a time, so both tables stay as small as the allow list however many endpoints
        # an allowed peer names (one per message used to be kept for ever)
        self._told_at: dict[str, str] = {}
        self._vouched: dict[str, str] = {}  # endpoint -> peer id, as an allowed peer named it (`vouched`)
        self._vouched_at: dict[str, str] = {}
        self._proven: dict[str, str] = {}  # endpoint -> peer id whose CURVE handshake there succeeded
        self._once = OncePer(log, f"zgossip node {name}")

    # ---------------------------------------------------------------- sockets
    def server(self, sock: zmq.Socket, domain: str) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public.encode())
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler (a bug, a shutdown): refuse, never admit all

    def client(self, sock: zmq.Socket, server_id: str) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, public_key_of(server_id).encode())  # type: ignore[union-attr]
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public.encode())

    # ---------------------------------------------------------------- keys of endpoints
    def peer_at(self, endpoint: str, membership_lookup: Callable[[str], str | None]) -> str | None:
        """The peer id (= key) expected at `endpoint`, or None when no source names one."""
        pid = (self._proven.get(endpoint) or self._told.get(endpoint) or self._given.get(endpoint)
               or self._vouched.get(endpoint) or membership_lookup(endpoint))
        return pid if pid is not None and public_key_of(pid) is not None else None

    def vouched(self, msg) -> None:
        """Peer ids and endpoints an authenticated peer names in a REDIRECT or GROUP: where to find
        keys for peers not yet in our membership table (a redirect target, a groupmate). Never
        overrides what a peer said of itself."""
        from .wire import MsgType

        if msg.type is MsgType.REDIRECT:
            pairs = [(msg.to_id, msg.to_endpoint)]
        elif msg.type is MsgType.GROUP:
            pairs = [(m.peer_id, m.endpoint) for m in msg.members]
        else:
            return
        for pid, ep in pairs:
            if public_key_of(pid) is None or pid == self.keys.peer_id:
                continue
            if pid not in self.allowed:  # never connected to (`connections`): nothing to remember for it
                self.once(("named", msg.sender), f"{msg.sender[:16]} named peer {pid[:16]} at {ep}, whose key is not "
                                                 "on the allow list: nothing is sent to it (logged once per sender)")
            elif ep not in self._told:
                _place(self._vouched, self._vouched_at, pid, ep)

    def disproves(self, peer_id: str, endpoint: str) -> str | None:
        """The peer id a handshake proved to be at `endpoint` when that is not `peer_id` (whose claim
        to it is then a lie), else None."""
        owner = self._proven.get(endpoint)
        return owner if owner is not None and owner != peer_id else None

    def handshake_done(self, endpoint: str, peer_id: str | None, ok: bool) -> None:
        """Our CURVE handshake at `endpoint` with key `peer_id` succeeded (`ok`) or failed."""
        if ok and peer_id is not None:
            if len(self._proven) >= 4 * len(self.allowed.ids) + 64 and endpoint not in self._proven:
                self._proven.pop(next(iter(self._proven)))  # (bounded: one per connection we hold)
            self._proven[endpoint] = peer_id
            return
        self._proven.pop(endpoint, None)
        if peer_id is not None and self._told.get(endpoint) == peer_id:
            # the server there refused the key a claim gave us: forget the claim, so that the next
            # claim (its real owner's) is taken, not weighed against this one
            del self._told[endpoint]
            if self._told_at.get(peer_id) == endpoint:
                del self._told_at[peer_id]

    def closed(self, endpoint: str) -> None:
        """Our connections to `endpoint` were closed or dropped: what their handshake proved ends with
        them (a reconnection proves it again)."""
        self._proven.pop(endpoint, None)

    def heard(self, peer_id: str, endpoint: str) -> bool:
        """An authenticated message from `peer_id` claims `endpoint`; True when that changes the key
        known for it (then connections opened with the old key must be closed)."""
        old = self._told.get(endpoint)
        _place(self._told, self._told_at, peer_id, endpoint)
        return old is not None and old != peer_id

    # ---------------------------------------------------------------- messages
    def check(self, sender: str, user_id: str | None, source: str) -> bool:
        """Whether a message claiming `sender`, on a connection authenticated as `user_id`, is taken."""
        if user_id is not None and sender == user_id and user_id in self.allowed:
            return True
        self.stats["unauthenticated"] += 1
        why = ("revoked key" if user_id == sender else
               f"sender {sender[:16]} on a connection authenticated as {str(user_id)[:16]}")
        self.once(("msg", str(user_id)), f"dropped a message from {source}: {why} (later ones are only counted)",
                  counter="unauthenticated")
        return False

    def once(self, key: tuple[str, str], text: str, level: int = logging.WARNING, counter: str = "send_errors") -> None:
        """Log `text` the first time for `key` = (kind, place); a bounded number of places per kind
        (`droplog.OncePer`: one peer may make us try thousands)."""
        if self._once.first(key[1], key[0], counter):
            log.log(level, "zgossip node %s: %s", self.name, text)


def _place(table: dict[str, str], at: dict[str, str], peer_id: str, endpoint: str) -> None:
    """`table[endpoint] = peer_id`, dropping the endpoint `peer_id` was at before (`at`) if it still
    names that peer."""
    before = at.get(peer_id)
    if before is not None and before != endpoint and table.get(before) == peer_id:
        del table[before]
    at[peer_id] = endpoint
    table[endpoint] = peer_id


def handshake_failure(event: dict, keyed: bool) -> tuple[str, str]:
    """(kind, explanation) for a failed-handshake monitor event on a node with (`keyed`) or
    without keys."""
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and event["value"] == _MECHANISM_MISMATCH:
        return "mixed", ("a peer without keys (plain) and a peer with keys (CURVE) met: mixed swarms are refused. "
                         + ("This peer has a key; give every peer one (`zgossip keygen`, Averager(secret_key=...))"
                            if keyed else "This peer has no key, the other has: give this peer a key and allow list "
                                          "or run the whole swarm without keys"))
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "auth", "the peer refused this peer's key (it is not on that peer's allow list)"
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # (seen only on our CURVE connections)
        return "hung up", ("the peer there hung up during the CURVE handshake: most likely it holds another key "
                           "than the one this peer was given for that address (check the #KEY of the initial peer "
                           "or the allow file's line), or it stopped at that moment")
    return "handshake", f"handshake failed (event {event['event']:#x}, value {event['value']:#x}): " \
                        "a wrong key for that endpoint, or not a zgossip peer"
