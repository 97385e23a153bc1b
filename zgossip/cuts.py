"""Connections into a node's ROUTERs that closed without a goodbye: counted, and logged once per source.

libzmq closes a connection that sends a frame over ``MAXMSGSIZE`` before any byte of that frame
reaches Python, and says nothing but "disconnected" (a socket-monitor event that names the
connection's file descriptor). A crash of the peer or a network failure gives the very same
event, so the three are counted together (``stats["connections_cut"]``) under a name that says
so. A peer that said goodbye (BYE) first is a normal shutdown and is not counted.

Which connection was it? Every message read from a ROUTER carries its connection's descriptor
(the ``__fd`` message property) beside its routing id; the first message of a connection names
its source (the sender's peer id, checked against the connection's key when there are keys).
A DISCONNECTED event then finds it by descriptor. Two things make that less simple than it sounds:

* libzmq reuses a descriptor as soon as it closes one, and monitor events travel apart from the
  messages. A message on a known descriptor with a *new* routing id means the old connection is
  gone though its DISCONNECTED has not been read yet: it is judged now, and that event skipped.
* A connection that closed before one complete message (its very first frame was over the limit,
  a handshake that failed, a port probe) names no source. libzmq reports each failed handshake
  (a HANDSHAKE_FAILED_* event) before that connection's DISCONNECTED, so message-less
  disconnects are matched off against failed handshakes; the rest are counted with an unknown
  source. Which message-less connection was which is not known, only how many there were.

A cut waits `grace` seconds before it is judged, for the BYE its peer may have sent on another
connection (lanes are separate connections, read in no fixed order). Plain data with the time
passed in: the ZeroMQ driver feeds it and carries out nothing for it. Memory is bounded: one
record per open connection (at most `cap`), `cap` goodbyes, `cap` cuts waiting.
"""
from __future__ import annotations

import collections
import logging
from typing import Optional

from .droplog import DropLog

__all__ = ["ConnectionCuts", "UNKNOWN_SOURCE", "KIND"]

UNKNOWN_SOURCE = "an unknown sender (it sent no complete message before)"
KIND = "connection closed without goodbye"
_BYE_MEMORY = 30.0  # seconds a goodbye excuses its peer's connections closing


class ConnectionCuts:
    """Bookkeeping of the connections into one node's ROUTERs (see the module docstring)."""

    def __init__(self, stats: dict, drops: DropLog, logger: logging.Logger, limit_bytes: int,
                 grace: float = 0.5, cap: int = 8192) -> None:
        self.stats, self.drops, self.log = stats, drops, logger
        self.limit_bytes, self.grace, self.cap = limit_bytes, grace, cap
        stats.setdefault("connections_cut", 0)
        #: descriptor -> [routing id, peer id or None, source as logged]; read by the driver per message
        self.conns: dict[str, list] = {}
        self._skip: dict[str, int] = {}  # descriptor -> DISCONNECTED events of connections already judged
        self._failed_handshakes = 0  # reported, and not matched with their DISCONNECTED yet
        self._goodbyes: dict[str, float] = {}  # peer id -> when it said goodbye
        self._waiting: collections.deque = collections.deque()  # (judge at, cut at, peer id, source)

    # ------------------------------------------------------------------ fed by the driver
    def opened(self, fd: str, rid: bytes, peer_id: Optional[str], source: str, now: float) -> None:
        """A message from a connection the table does not know by (fd, rid) yet, or whose source
        it did not learn yet (`peer_id` None: the message named no checked source)."""
        rec = self.conns.get(fd)
        if rec is not None and rec[0] != rid:  # the descriptor's previous connection is gone
            self._skip[fd] = self._skip.get(fd, 0) + 1
            self._cut(rec[1], rec[2], now)
        elif rec is None and len(self.conns) >= self.cap:
            # more open connections than descriptors a process usually has: forget the oldest (its
            # cut, should one come, counts with an unknown source)
            del self.conns[next(iter(self.conns))]
        if rec is not None and rec[0] == rid and peer_id is None:
            return
        self.conns[fd] = [rid, peer_id, source]

    def said_goodbye(self, peer_id: str, now: float) -> None:
        self._goodbyes.pop(peer_id, None)
        if len(self._goodbyes) >= self.cap:
            del self._goodbyes[next(iter(self._goodbyes))]
        self._goodbyes[peer_id] = now

    def handshake_failed(self) -> None:
        self._failed_handshakes = min(self._failed_handshakes + 1, self.cap)

    def closed(self, fd: str, now: float) -> None:
        """libzmq's DISCONNECTED for the connection on descriptor `fd`."""
        skip = self._skip.get(fd)
        if skip:
            if skip == 1:
                del self._skip[fd]
            else:
                self._skip[fd] = skip - 1
            return
        rec = self.conns.pop(fd, None)
        if rec is None:
            if self._failed_handshakes > 0:
                self._failed_handshakes -= 1
                return
            self._cut(None, UNKNOWN_SOURCE, now)
        else:
            self._cut(rec[1], rec[2], now)

    def _cut(self, peer_id: Optional[str], source: str, now: float) -> None:
        if len(self._waiting) >= self.cap:
            self._judge(*self._waiting.popleft()[1:], counting=True)
        self._waiting.append((now + self.grace, now, peer_id, source))

    # ------------------------------------------------------------------ timers
    def next_deadline(self) -> Optional[float]:
        return self._waiting[0][0] if self._waiting else None

    def on_timer(self, now: float, counting: bool = True) -> None:
        """Judge the cuts whose grace is over; `counting` False while this node itself leaves
        (its peers then close their connections to it: nothing to report)."""
        while self._waiting and self._waiting[0][0] <= now:
            self._judge(*self._waiting.popleft()[1:], counting=counting)

    def _judge(self, at: float, peer_id: Optional[str], source: str, counting: bool) -> None:
        if not counting:
            return
        if peer_id is not None:
            bye = self._goodbyes.get(peer_id)
            if bye is not None and at - _BYE_MEMORY <= bye:
                return  # a normal shutdown
        self.stats["connections_cut"] += 1
        self.drops.note(self.log, source, KIND, counter="connections_cut", text=(
            f"connection from {source} closed without goodbye: a frame over the {self.limit_bytes}-byte limit "
            "(cut by libzmq), a crash or a network failure (ZeroMQ does not tell these apart)"))
