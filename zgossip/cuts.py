"""Connections into a node's ROUTERs that closed without a goodbye: counted, and logged once per source.

libzmq closes a connection that sends a frame over ``MAXMSGSIZE`` before any byte of that frame
reaches Python, and says nothing but "disconnected" (a socket-monitor event that names the
connection's file descriptor). A crash of the peer or a network failure gives the very same
event, so the three are counted together (``stats["connections_cut"]``) under a name that says
so. A peer that said goodbye (BYE) first is a normal shutdown and is not counted.

Which connection was it? The ROUTER's monitor reports each connection ACCEPTED and DISCONNECTED
with its descriptor, in order; every message read from the ROUTER carries its connection's
descriptor (the ``__fd`` message property) beside its routing id, and the first message of a
connection names its source (the sender's peer id, checked against the connection's key when
there are keys). So each descriptor has a short list of connections ("slots", in the order
libzmq accepted them): DISCONNECTED closes the oldest open one, a connection's first message
fills in the slot it belongs to. Three things make that less simple than it sounds:

* libzmq reuses a descriptor as soon as it closes one, and monitor events travel apart from the
  messages. The driver reads the monitor before it hands in a connection's first message, so
  the ACCEPTED of that message's connection (and everything before it) is in; the message then
  belongs to the *newest* slot of its descriptor that has none yet. Older such slots are
  connections that sent nothing -- e.g. the probe a peer on this host makes of our local socket
  before it connects (`zgossip.local_ipc.listener_uid`), reaped a moment before on that descriptor.
* A connection may close with messages still queued for us: its slot is judged only `grace`
  seconds after its DISCONNECTED, and a late first message still fills it in.
* A connection that closed before one complete message (its very first frame was over the limit,
  a handshake that failed, a port probe, or a peer's results lane that it opened early and never
  needed, `wire.warm_lanes`) names no source. libzmq reports each failed handshake (a
  HANDSHAKE_FAILED_* event, which names no descriptor) before that connection's DISCONNECTED, so
  silent connections are matched off against failed handshakes first. A peer has two
  connections to us (`wire.LANES`), closed together when it exits, crashes or drops us: a silent
  one that closed within `grace` of a connection with a source is taken as that peer's other
  lane and judged with it (a goodbye excuses both; a crash counts once). The rest are counted
  with an unknown source. Which silent connection was which is not known, only how many there
  were; an oversize first message that coincides with a peer leaving is not counted.

The grace also lets a BYE that travels on the peer's other connection (lanes are separate
connections, read in no fixed order) arrive. Plain data with the time passed in: the ZeroMQ
driver feeds it and carries out nothing for it. Memory is bounded: at most `cap` descriptors
with `_SLOTS` slots each, `cap` goodbyes, `cap` cuts waiting.
"""
from __future__ import annotations

import collections
import logging
from typing import Optional

from .droplog import DropLog

__all__ = ["ConnectionCuts", "UNKNOWN_SOURCE", "KIND"]

UNKNOWN_SOURCE = "an unknown sender (it sent no complete message before)"
KIND = "connection closed without goodbye"
_BYE_MEMORY = 5.0  # seconds after its goodbye in which a peer's connections may close uncounted
_SLOTS = 8  # connections remembered per descriptor (one is open at a time; the rest wait for judgement)
# a slot: [routing id or None, peer id or None, source as logged or None, open, took a silent sibling]
_RID, _PEER, _SOURCE, _OPEN, _PAIRED = range(5)


class ConnectionCuts:
    """Bookkeeping of the connections into one node's ROUTERs (see the module docstring)."""

    def __init__(self, stats: dict, drops: DropLog, logger: logging.Logger, limit_bytes: int,
                 grace: float = 0.5, cap: int = 8192) -> None:
        self.stats, self.drops, self.log = stats, drops, logger
        self.limit_bytes, self.grace, self.cap = limit_bytes, grace, cap
        stats.setdefault("connections_cut", 0)
        #: descriptor -> the slot its latest message came from; the driver's per-message check
        self.conns: dict[str, list] = {}
        self._slots: dict[str, list[list]] = {}  # descriptor -> slots, oldest first
        self._failed_handshakes = 0  # reported, and not matched with a silent connection yet
        self._goodbyes: dict[str, float] = {}  # peer id -> when it said goodbye
        self._waiting: collections.deque = collections.deque()  # (judge at, closed at, descriptor, slot)
        self._judged: collections.deque = collections.deque(maxlen=64)  # (closed at, slot) with a source

    # ------------------------------------------------------------------ fed by the driver
    def accepted(self, fd: str) -> None:
        slots = self._slots.get(fd)
        if slots is None:
            if len(self._slots) >= self.cap:  # more descriptors than a process has: forget the oldest
                old = next(iter(self._slots))
                del self._slots[old]
                self.conns.pop(old, None)
            slots = self._slots[fd] = []
        if len(slots) >= _SLOTS:
            del slots[0]
        slots.append([None, None, None, True, False])

    def opened(self, fd: str, rid: bytes, peer_id: Optional[str], source: str) -> None:
        """A message on descriptor `fd` whose connection the driver does not know by (fd, rid)
        yet, or that names a source where the connection's earlier ones did not (`peer_id` None:
        this one names no checked source either). The driver read the monitor just before."""
        slots = self._slots.get(fd)
        slot = None
        if slots:
            for s in slots:
                if s[_RID] == rid:
                    slot = s
                    break
            else:
                for s in reversed(slots):  # the newest connection that has not spoken yet
                    if s[_RID] is None:
                        slot = s
                        break
        if slot is None:  # its ACCEPTED was lost (the monitor's queue overflowed): a slot of its own
            self.accepted(fd)
            slot = self._slots[fd][-1]
        slot[_RID] = rid
        if slot[_PEER] is None:
            slot[_PEER], slot[_SOURCE] = peer_id, source
        self.conns[fd] = slot

    def said_goodbye(self, peer_id: str, now: float) -> None:
        self._goodbyes.pop(peer_id, None)
        if len(self._goodbyes) >= self.cap:
            del self._goodbyes[next(iter(self._goodbyes))]
        self._goodbyes[peer_id] = now

    def handshake_failed(self) -> None:
        self._failed_handshakes = min(self._failed_handshakes + 1, self.cap)

    def closed(self, fd: str, now: float) -> None:
        """libzmq's DISCONNECTED for the oldest open connection on descriptor `fd`."""
        for slot in self._slots.get(fd, ()):
            if slot[_OPEN]:
                break
        else:  # its ACCEPTED was lost: nothing known of it
            slot = [None, None, None, False, False]
        slot[_OPEN] = False
        if self.conns.get(fd) is slot:
            del self.conns[fd]
        if len(self._waiting) >= self.cap:
            self._judge(*self._waiting.popleft()[1:], counting=True)
        self._waiting.append((now + self.grace, now, fd, slot))

    # ------------------------------------------------------------------ timers
    def next_deadline(self) -> Optional[float]:
        return self._waiting[0][0] if self._waiting else None

    def on_timer(self, now: float, counting: bool = True) -> None:
        """Judge the cuts whose grace is over; `counting` False while this node itself leaves
        (its peers then close their connections to it: nothing to report)."""
        while self._waiting and self._waiting[0][0] <= now:
            self._judge(*self._waiting.popleft()[1:], counting=counting)

    def _sibling(self, at: float) -> Optional[list]:
        """A connection with a source that closed within `grace` of `at` and took no silent one yet."""
        for closed_at, slot in self._judged:
            if abs(closed_at - at) <= self.grace and not slot[_PAIRED]:
                return slot
        for _, closed_at, _, slot in self._waiting:
            if closed_at > at + self.grace:
                break
            if slot[_RID] is not None and abs(closed_at - at) <= self.grace and not slot[_PAIRED]:
                return slot
        return None

    def _judge(self, at: float, fd: str, slot: list, counting: bool) -> None:
        slots = self._slots.get(fd)
        if slots is not None:
            for i, s in enumerate(slots):
                if s is slot:  # (by identity: two slots may hold equal values)
                    del slots[i]
                    break
            if not slots:
                del self._slots[fd]
        if self.conns.get(fd) is slot:
            del self.conns[fd]
        if slot[_RID] is None:
            if self._failed_handshakes > 0:  # a failed handshake, reported already
                self._failed_handshakes -= 1
                return
            sibling = self._sibling(at)
            if sibling is not None:  # another lane of a peer whose connection closed with it: judged there
                sibling[_PAIRED] = True
                return
        else:
            self._judged.append((at, slot))
        if not counting:
            return
        peer_id = slot[_PEER]
        if peer_id is not None:
            bye = self._goodbyes.get(peer_id)
            if bye is not None and at - _BYE_MEMORY <= bye:
                return  # a normal shutdown
        source = slot[_SOURCE] or UNKNOWN_SOURCE
        self.stats["connections_cut"] += 1
        self.drops.note(self.log, source, KIND, counter="connections_cut", text=(
            f"connection from {source} closed without goodbye: a frame over the {self.limit_bytes}-byte limit "
            "(cut by libzmq), a crash or a network failure (ZeroMQ does not tell these apart)"))
