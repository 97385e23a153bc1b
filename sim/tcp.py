"""TCP-like transfers for the SimPy driver: one congestion-controlled byte stream per connection.

What ZeroMQ over TCP gives the protocol is a reliable, ordered byte stream per connection
(the driver keeps one connection per peer pair and lane, see `zgossip.wire.lane_of`); how
*fast* the bytes go is TCP's business, and that is what this module models. A connection
``(src, dst, lane)`` holds a FIFO of messages and sends them in **rounds of one RTT**:

* **Window.** Each round sends at most ``cwnd`` bytes, and no more than the connection's
  share of the links can carry in one RTT (``rate * rtt``). A round that sent a full window
  ends one RTT after it began (the sender waits for ACKs); a round limited by the rate keeps
  the link busy for the whole RTT; the last bytes of a queue take ``bytes / rate``.
* **Slow start** from an initial window of ``init_cwnd`` segments (Linux: 10 MSS): a round
  that used its whole window grows it by the bytes it sent (doubling per RTT) up to
  ``ssthresh``, then by one MSS per RTT (Reno's congestion avoidance; CUBIC grows faster on
  large windows -- not modelled). Growth stops at the path's bandwidth-delay product (the
  slower of the sender's uplink and the receiver's downlink times the RTT) and at the
  receive window (``tcp_rmem`` max, scaled by ``tcp_adv_win_scale``) and half ``tcp_wmem``
  max (send-buffer autotuning); Linux's receive-buffer autotuning, which usually stays ahead
  of slow start, is not modelled.
* **Restart after idle** (``tcp_slow_start_after_idle = 1``): a connection that sent nothing
  for more than an RTO (``rtt + rto_min``, the Linux estimate for a steady RTT) halves its
  window once per RTO idle, down to the initial window -- as `tcp_cwnd_restart` does. Linux
  skips this for congestion controls with their own pacing model (BBR), and so does this.
* **Sharing.** A peer's uplink is shared by its connections that have bytes to send, and its
  downlink by those arriving to it, fairly: each round a connection gets the water-filling
  level of both links (others use what they used in their last round, min(cwnd/rtt, their
  share), and what one leaves is split among the rest). The share is fixed for the round
  (at most one RTT); shares of different connections are computed at their own round starts,
  so the links' capacity can be exceeded briefly. That is the approximation that keeps the
  model O(connections on the two links) per round rather than a global fluid recomputation.
* **Loss** slows TCP and never loses a message: a round of ``k`` segments sees a loss with
  probability ``1 - (1 - p)^k``; the round's bytes then arrive one RTT later (fast
  retransmit; a tail loss -- the lost segment is the last of the queue, so nothing sent after
  it reveals it -- waits for the tail-loss probe, which is the retransmission: Linux arms it at
  2 SRTT, plus RTO_min when a single segment is out, never later than the RTO, and arms it anew
  at each ACK, so a longer flight's lost last segment is resent RTT + min(2 SRTT, RTO) after it
  left -- 0.8 s on a 300 ms path -- and a lone segment an RTO after, 0.5 s). Delivery is in
  order, so whatever the connection sends after a lost segment reaches the receiver no earlier
  than its repair, in whichever later round its message ends (head-of-line blocking: a burst
  paced out in less than an RTT finishes only an RTT after its lost segment left; before this
  was modelled only a loss in a message's last round delayed it: on the testbed's lossy 300 ms
  case, `lat150-loss-1m`, rounds 1-9 took a median 2.03-2.20 s in each of seven runs, and the
  replays of those runs, 5 seeds each, now read 2.03 s (median of their rounds 1-9) and 1.98 s
  (rounds 10-19) where they read 1.94 and 1.77 s). When one of the round's
  retransmissions (about ``k·p`` of them, at least one) is lost as well, the retransmission
  timeout (RTT + ``rto_min``) comes on top. The window is cut by CUBIC's beta (0.7; Reno 0.5; BBR does
  not cut on loss). The resulting sawtooth gives the usual ~MSS/(RTT sqrt p) steady state.
  Under CUBIC/Reno the next round waits for the recovery; BBR keeps pacing at its bandwidth
  estimate through recovery (SACK), so only the arrivals wait (head-of-line blocking).
* **Queues** (``[network] down_queue``; unbounded unless given, as before; `sim.compare`'s replay
  of a testbed run gives the testbed's tbf: 200 ms of the rate, at least 512 KiB, tail drop). The
  sharing above never sends a connection faster than its share of the receiver's downlink; a real
  sender puts in flight what its window allows, at BBR's pacing rate (or its uplink's share) over
  an RTT that the queue's delay lengthens, and what the downlink's share does not carry in an RTT
  waits in the downlink's queue: ``min(cwnd, push x (RTT + backlog / rate), bytes left) - share x
  RTT`` per connection, as of its last round. Where the connections into a downlink hold more
  there than the queue's limit (counted in frames, as tbf does), the excess is dropped -- by each
  in proportion to what it holds, once per RTT (the queue's delay included: a sender refills its
  flight once per round trip) while the backlog stays -- and each dropped segment is a loss as
  above (retransmission one RTT later, tail-loss probe, RTO when a retransmission meets the full
  queue too, with the share of what it offers that was dropped; CUBIC/Reno cut, and BBR's samples
  count the retransmissions). BBR v1 does not cut, but in recovery it takes each lost packet off
  its window until the recovery ends, an RTT later (``bbr_set_cwnd_to_recover_or_restore``),
  which lowers what it holds in the queue. `tail_drops` counts dropped segments per receiver
  (`python -m sim fidelity` prints them per round beside the testbed's). Not modelled: the
  queue's delay on the data (the share already holds those bytes back at the sender) and on the
  ACKs a host's own downlink carries (tried: it slowed the slow1 cases, whose queues drop
  nothing, by 4-5 % against the testbed), the FIFO order a new connection would wait in, and an
  RTO's stall of a BBR connection (tried: home4-4m and issue4-4m read 2.1-2.3x the testbed).
  Replaying the 24 stored fidelity runs (24 Nov 2026 12:20 matrix, `sim.fidelity.predict` on
  each), the model moved home4-4m from 0.91 to 0.96 and issue4-4m from 0.87 to 0.89, no other
  case by more than 0.01; it drops 565 and 425 segments per round where the testbed's tbf dropped
  424 and 328 packets; a rerun of home4-4m with the qdisc read after each round (25 Nov)
  dropped 36, 966, 399, 773, 489, 258 packets in rounds 0-5, its replay 0, 972, 576, 550, 610, 509
  segments (its step time: 3.56 s measured, 2.97 s predicted before, 3.02 s now).
* **Pacing (BBR).** BBR sends every flight at gain x its bandwidth estimate, not as fast as the
  window allows, and keeps its own window (cwnd gain x estimated BDP). `sim.bbr` keeps both as
  Linux's BBR v1 does: the estimate is the largest delivery-rate sample of the last 10 round trips,
  app-limited samples only raise it, and a retransmission's sample counts like any other, so the
  tail loss of a burst on a connection whose high samples aged out leaves it pacing at a few
  segments per RTT (the testbed's lat150-loss stalls); STARTUP (gain 2.885, its pacing rate never
  falls), DRAIN and PROBE_BW's gain cycle decide the gain. Each round tells `sim.bbr` what it sent
  (and what of it is retransmitted, when); the samples are acted on at their ACK times. An
  all-reduce's parts are app-limited bursts after idle: in STARTUP a burst of B bytes raises the
  estimate only towards B (1 - 1/gain) / RTT, so a burst on a fast long link settles near
  RTT / (gain - 1) of pacing (~0.5 RTT) where an unpaced window would send it at once. The
  testbed's 300 ms RTT case (`lat150-1m`, 24 Nov 2026 12:20 matrix) shows it: steady steps
  0.65-0.73 s measured, 0.69-0.81 s predicted.
* **Partitions** stall a connection: a round that finds the path cut is retried with
  exponential RTO backoff (RTO, 2 RTO, 4 RTO ...) and resumes from one segment after the
  cut heals. Nothing is lost (Linux gives up after ``tcp_retries2`` -- about 15 minutes --
  which is not modelled).
* **Jitter** delays each message's arrival but never reorders a connection.
* **Connection set-up.** A connection opens on its first message (the ZeroMQ driver connects a
  DEALER lazily, and a reply travels on the replier's own DEALER: another set-up in the other
  direction). Its data can leave only after the TCP handshake (1 RTT: SYN, SYN-ACK) and
  ZeroMQ's ZMTP handshake: libzmq sends the 10-byte signature on connect, the rest of its
  greeting only after reading the peer's signature and version byte, and its READY only after
  the peer's whole greeting -- so the client reads the server's READY 3 RTT after connect, and
  the first message arrives 3.5 RTT after it was sent instead of 0.5 (measured on the testbed:
  3.51-3.53 RTT at 160 ms, every later message 0.50). ``handshake_rtts`` holds that 3. A
  handshake packet that is lost costs the SYN timeout (1 s, ``TCP_TIMEOUT_INIT``) for the SYN
  or SYN-ACK and an RTO for the ZMTP exchange (4 packets); a partition stalls it like data.
* **Release** (for `pending`): a message's bytes are the sender's until its last byte left
  (the real driver hands ZeroMQ zero-copy frames and libzmq releases them once written into the
  kernel; the send buffer, about two windows, is not modelled: releases are up to ~2 RTT late).

Messages still queued when a connection is reset (its peer crashed, or the driver closed
it) are dropped: the sender's process or socket is gone. What happens to bytes of a paused
receiver is not limited by its receive window here (its socket buffers hold everything).

Everything random comes from the generator the caller passes; connections are kept in
insertion-ordered dicts and lists, never iterated in hash order, so a seed gives one trace.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .bbr import Bbr

__all__ = ["TcpParams", "TcpTransport"]

_INF = float("inf")


@dataclass(frozen=True)
class TcpParams:
    """The kernel's TCP settings the model uses. Defaults are Linux's; `from_sysctl` reads this
    machine's (``python -m sim calibrate`` stores them in its profile)."""

    mss: int = 1448  # 1500-byte MTU less IP, TCP and timestamp headers
    init_cwnd: int = 10  # segments (RFC 6928, Linux since 2.6.39)
    rmem_max: int = 6 << 20  # net.ipv4.tcp_rmem[2]
    wmem_max: int = 4 << 20  # net.ipv4.tcp_wmem[2]
    adv_win_scale: int = 1  # net.ipv4.tcp_adv_win_scale: the window is rmem less 1/2^scale overhead
    slow_start_after_idle: bool = True  # net.ipv4.tcp_slow_start_after_idle
    rto_min: float = 0.2  # TCP_RTO_MIN
    congestion_control: str = "cubic"  # net.ipv4.tcp_congestion_control
    handshake_rtts: float = 3.0  # TCP (1 RTT) + ZMTP greeting and READY (2 RTT) before the first data
    syn_timeout: float = 1.0  # TCP_TIMEOUT_INIT: a lost SYN or SYN-ACK is sent again after this
    frame_bytes: int = 66  # link bytes per segment besides the payload: Ethernet 14, IP 20, TCP 20, timestamps 12
    ack_every: int = 2  # delayed ACKs: one frame_bytes-sized ACK per this many segments, on the reverse link
    # a round limited by the link's rate (not by the window) lasts at most this long, so each
    # connection's share of a link is recomputed at least this often (0 = a whole RTT)
    share_interval: float = 0.01
    # BBR paces every flight at gain x its bandwidth estimate (the startup gain, 2/ln 2: bursts that
    # stop before the link is full keep it in startup); see "Pacing" in the module docstring
    pacing_gain: float = 2.885

    def __post_init__(self) -> None:
        # every setting by type and range: mss = 0 ended a run in a ZeroDivisionError, mss = -5 or
        # init_cwnd = 0 moved no byte (every step failed, silently), a negative frame_bytes made the
        # link faster than its rate, mss = "x" said "could not convert string to float: 'xxxxxxxxxx'"
        def whole(v: Any) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

        for name, low in (("mss", 1), ("init_cwnd", 1), ("rmem_max", 1), ("wmem_max", 1), ("ack_every", 1),
                          ("frame_bytes", 0)):
            v = getattr(self, name)
            if not whole(v) or v < low:
                raise ValueError(f"[network] tcp: {name} must be a whole number >= {low}, not {v!r}")
        if not whole(self.adv_win_scale) or not -31 <= self.adv_win_scale <= 31:  # the sysctl's range
            raise ValueError(f"[network] tcp: adv_win_scale must be a whole number in [-31, 31], "
                             f"not {self.adv_win_scale!r}")
        for name, positive in (("rto_min", True), ("syn_timeout", True), ("pacing_gain", True),
                               ("handshake_rtts", False), ("share_interval", False)):
            v = getattr(self, name)
            if (not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, (bool, np.bool_))
                    or not math.isfinite(v) or v < 0 or (positive and v == 0)):
                raise ValueError(f"[network] tcp: {name} must be a finite number {'> 0' if positive else '>= 0'}, "
                                 f"not {v!r}")
        if not isinstance(self.slow_start_after_idle, (bool, np.bool_)):
            raise ValueError(f"[network] tcp: slow_start_after_idle must be true or false, "
                             f"not {self.slow_start_after_idle!r}")
        if not isinstance(self.congestion_control, str) or not self.congestion_control:
            raise ValueError(f"[network] tcp: congestion_control must be a name (cubic, reno, bbr, ...), "
                             f"not {self.congestion_control!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "TcpParams":
        known = {f.name for f in fields(cls)}
        bad = set(d) - known
        if bad:
            raise ValueError(f"unknown tcp settings {sorted(bad)} (known: {sorted(known)})")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_sysctl(cls, root: str = "/proc/sys/net/ipv4") -> "TcpParams":
        """This machine's settings (what is unreadable keeps Linux's default)."""
        base = Path(root)

        def read(name: str) -> str | None:
            try:
                return (base / name).read_text().strip()
            except OSError:
                return None

        kw: dict[str, Any] = {}
        if (v := read("tcp_rmem")) is not None:
            kw["rmem_max"] = int(v.split()[2])
        if (v := read("tcp_wmem")) is not None:
            kw["wmem_max"] = int(v.split()[2])
        if (v := read("tcp_adv_win_scale")) is not None:
            kw["adv_win_scale"] = int(v)
        if (v := read("tcp_slow_start_after_idle")) is not None:
            kw["slow_start_after_idle"] = v != "0"
        if (v := read("tcp_congestion_control")) is not None:
            kw["congestion_control"] = v
        return cls(**kw)

    @property
    def window_cap(self) -> int:
        """Most bytes in flight: the receive window at full buffer, and half the send buffer
        (autotuning keeps about twice the window there)."""
        s = self.adv_win_scale
        rwnd = self.rmem_max - (self.rmem_max >> s) if s > 0 else self.rmem_max >> -s
        return max(self.mss, min(rwnd, self.wmem_max // 2))

    @property
    def payload_share(self) -> float:
        """The share of a link's rate that carries payload. A shaper (tbf) counts whole frames, so
        each MSS costs ``mss + frame_bytes`` on the link, and the ACKs of the traffic coming the
        other way take ``frame_bytes / ack_every`` more per segment: an all-reduce loads both
        directions alike. 0.936 with Linux's defaults; the testbed's link counters agree within
        ~1 % (`sim.compare`'s "m link" against "p wire")."""
        return self.mss / (self.mss + self.frame_bytes + self.frame_bytes / max(1, self.ack_every))

    @property
    def iw(self) -> float:
        return float(self.init_cwnd * self.mss)

    @property
    def paced(self) -> bool:
        """BBR has its own model of the path: no restart after idle, no cut on random loss."""
        return self.congestion_control == "bbr"

    @property
    def beta(self) -> float:
        return {"reno": 0.5, "bbr": 1.0}.get(self.congestion_control, 0.7)


class _Msg:
    """A queued message; `send` returns it as the sender's tracker (see `released`, `watch`)."""

    __slots__ = ("left", "token", "release_at", "on_release")

    def __init__(self, nbytes: int, token: Any) -> None:
        self.left = float(nbytes)
        self.token = token
        self.release_at: float | None = None  # when its last byte left (or it was dropped); None: not yet known
        self.on_release: list[Callable[[], None]] | None = None


class _Conn:
    __slots__ = ("src", "dst", "lane", "owd", "rtt", "cwnd", "ssthresh", "queue", "last_sent", "busy_until",
                 "used", "scheduled", "last_arrival", "backoff", "gen", "ready", "bbr", "queued_at_dst", "drop_owed",
                 "recovery_until", "recovery_lost")

    def __init__(self, src: str, dst: str, lane: int, owd: float, back: float, iw: float) -> None:
        self.src, self.dst, self.lane = src, dst, lane
        self.owd = owd
        self.rtt = owd + back
        self.cwnd = iw
        self.ssthresh = _INF
        self.queue: deque[_Msg] = deque()
        self.last_sent = -_INF  # when its last byte left (for the idle restart)
        self.busy_until = -_INF  # its current round's bytes are on the link until then
        self.used = 0.0  # bytes/s it used in its last round (what the others' water-filling assumes)
        self.scheduled = False
        self.last_arrival = 0.0  # arrivals keep the connection's order under jitter
        self.backoff = 0  # RTO backoffs while a partition stalls it
        self.gen = 0  # bumped on reset, so its scheduled rounds are void
        self.ready = 0.0  # when the TCP and ZMTP handshakes are over (no data leaves before)
        self.bbr: Bbr | None = None  # BBR's path model (paced connections only)
        self.queued_at_dst = 0.0  # its bytes waiting in the receiver's downlink queue, as of its last round
        self.drop_owed = 0.0  # bytes that queue dropped of it, not yet counted as a loss (under a segment)
        self.recovery_until = -_INF  # BBR: until then its window is short of what that queue dropped ...
        self.recovery_lost = 0.0  # ... this many bytes


class TcpTransport:
    """Connections between endpoints over a `NetworkModel`'s links, on a SimPy environment.

    `send` queues a message; `deliver(token, sent)` is called at its arrival time, with the
    time its last byte left the sender. `reset` drops an endpoint's connections.
    """

    def __init__(self, net: Any, params: TcpParams, env: Any, rng: np.random.Generator,
                 deliver: Callable[[Any, float], None]) -> None:
        self.net = net
        self.p = params
        self.env = env
        self.rng = rng
        self.deliver = deliver
        self.conns: dict[tuple[str, str, int], _Conn] = {}
        self._up: dict[str, list[_Conn]] = {}  # sender -> its connections (insertion order)
        self._down: dict[str, list[_Conn]] = {}
        # per sender / receiver, the connections that may be sending now (queued bytes, or a round
        # on the link): each endpoint collects a connection per groupmate per round, and the
        # water-filling of every round would otherwise scan them all. Added on `send`; dropped,
        # lazily, by `_level` once idle (only a later `send` can make them busy again).
        self._busy_up: dict[str, dict[_Conn, None]] = {}
        self._busy_down: dict[str, dict[_Conn, None]] = {}
        self.rounds = 0  # rounds simulated (for benchmarks)
        self.loss_events = 0
        self.tail_drops: dict[str, int] = {}  # receiver -> segments its downlink queue dropped (finite queues only)

    # ------------------------------------------------------------------ connections
    def _conn(self, src: str, dst: str, lane: int) -> _Conn:
        key = (src, dst, lane)
        c = self.conns.get(key)
        if c is None:
            # one latency draw per connection: its path; jitter is drawn per message
            owd = self.net.base_latency(src, dst, self.rng)
            back = self.net.base_latency(dst, src, self.rng)
            c = _Conn(src, dst, lane, owd, back, self.p.iw)
            c.ready = self.env.now + self._handshake(c)
            if self.p.paced and c.rtt > 0.0:
                c.bbr = Bbr(c.rtt, self.p.mss, self.p.iw, self.p.pacing_gain, self.rng, self.p.window_cap)
            self.conns[key] = c
            self._up.setdefault(src, []).append(c)
            self._down.setdefault(dst, []).append(c)
        return c

    def _handshake(self, c: _Conn) -> float:
        """Seconds from connect until the first data may leave (see the module docstring)."""
        p = self.p
        t = p.handshake_rtts * c.rtt
        loss = self.net._loss(c.src, c.dst)
        if loss > 0.0:
            for _ in range(2):  # SYN, SYN-ACK: the initial timeout, doubling per try
                k = 0
                while self.rng.random() < loss and k < 6:
                    t += p.syn_timeout * (1 << k)
                    k += 1
            for _ in range(4):  # signature+version, greetings, READYs: an RTO each
                if self.rng.random() < loss:
                    t += self._rto(c)
        return t

    def _drop(self, c: _Conn) -> None:
        c.gen += 1
        for m in c.queue:
            self._release(m, self.env.now)
        c.queue.clear()
        del self.conns[(c.src, c.dst, c.lane)]
        # an endpoint left with no connection loses its entries (a long churn run kept an empty one per
        # departed peer); `_conn` and `send` make them anew, and an absent entry reads as an empty one
        for table, ep in ((self._up, c.src), (self._down, c.dst)):
            conns = table[ep]
            conns.remove(c)
            if not conns:
                del table[ep]
        for busy, ep in ((self._busy_up, c.src), (self._busy_down, c.dst)):
            peers = busy.get(ep)
            if peers is not None:
                peers.pop(c, None)
                if not peers:
                    del busy[ep]

    def reset(self, endpoint: str, peer: str | None = None) -> None:
        """Drop connections from and to `endpoint` (only those with `peer`, if given); queued
        bytes are lost. A later send opens a fresh connection (slow start again)."""
        for c in list(self._up.get(endpoint, ())) + list(self._down.get(endpoint, ())):
            if (c.src, c.dst, c.lane) in self.conns and (peer is None or peer in (c.src, c.dst)):
                self._drop(c)

    def close(self, src: str, dst: str) -> None:
        """Close src's connections to dst (every lane): what they still queued is dropped."""
        for c in list(self._up.get(src, ())):
            if c.dst == dst:
                self._drop(c)

    def rtt(self, src: str, dst: str, lane: int = 0) -> float | None:
        c = self.conns.get((src, dst, lane))
        return None if c is None else c.rtt

    def cwnd(self, src: str, dst: str, lane: int = 0) -> float | None:
        c = self.conns.get((src, dst, lane))
        return None if c is None else c.cwnd

    def open(self, src: str, dst: str, lane: int) -> None:
        """Connect src to dst on `lane` now, if not yet (its handshakes start; no data)."""
        self._conn(src, dst, lane)

    # ------------------------------------------------------------------ sending
    def send(self, src: str, dst: str, lane: int, nbytes: int, token: Any) -> _Msg:
        """Queue a message; returns its tracker (``released`` once its last byte left)."""
        now = self.env.now
        c = self._conn(src, dst, lane)
        if not c.queue and not c.scheduled:
            self._restart_after_idle(c, now)
        if c.bbr is not None and not c.queue:  # nothing unsent: what leaves next is app-limited
            c.bbr.on_write(now, max(now, c.busy_until, c.ready))
        msg = _Msg(nbytes, token)
        c.queue.append(msg)
        self._busy_up.setdefault(src, {})[c] = None
        self._busy_down.setdefault(dst, {})[c] = None
        if not c.scheduled:
            c.scheduled = True
            # a round in progress keeps the link until its bytes are out; the next starts then
            start = max(now, c.busy_until, c.ready)
            if start <= now:
                self._round(c, c.gen)
            else:
                self._at(start, c)
        return msg

    def _release(self, m: _Msg, at: float) -> None:
        # no event unless someone watches: most messages are never waited for
        m.release_at = at
        if m.on_release:
            fns, m.on_release = m.on_release, None
            for fn in fns:
                self.watch(m, fn)

    def released(self, m: _Msg) -> bool:
        """Whether the message's last byte left the sender (or it was dropped) by now."""
        return m.release_at is not None and m.release_at <= self.env.now

    def watch(self, m: _Msg, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when `m` is released (at once if it is)."""
        if m.release_at is None:
            m.on_release = (m.on_release or []) + [fn]
        elif m.release_at <= self.env.now:
            fn()
        else:
            self.env.timeout(m.release_at - self.env.now).callbacks.append(lambda _e: fn())

    def _at(self, t: float, c: _Conn) -> None:
        ev = self.env.timeout(max(0.0, t - self.env.now))
        ev.callbacks.append(lambda _e, c=c, g=c.gen: self._round(c, g))

    def _rto(self, c: _Conn) -> float:
        # Linux: srtt + max(4 rttvar, rto_min); with a steady RTT that is rtt + rto_min
        return c.rtt + self.p.rto_min

    def _probe_delay(self, c: _Conn, segs: int) -> float:
        """How much later than sent the last segment of a flight of `segs` arrives when it was lost:
        Linux's tail-loss probe resends it (tcp_schedule_loss_probe). The probe timeout is 2 SRTT
        (+ RTO_min when a single segment is out, else + 2 ms), but never later than the RTO; it is
        armed when the flight is sent and armed anew by each ACK, so with more than one segment it
        runs from the ACK of the segment before the lost one, an RTT after the flight left. On a
        300 ms path: 0.5 s for a single segment, 0.8 s for a longer flight's last."""
        rtt, rto = c.rtt, self._rto(c)
        if segs <= 1:
            return min(2.0 * rtt + self.p.rto_min, rto)
        return rtt + min(2.0 * rtt + 0.002, rto)

    def _restart_after_idle(self, c: _Conn, now: float) -> None:
        if not self.p.slow_start_after_idle or self.p.paced or c.last_sent == -_INF:
            return
        idle = now - max(c.last_sent, c.busy_until)
        rto = self._rto(c)
        restart = min(self.p.iw, c.cwnd)
        # tcp_cwnd_restart: halve once per RTO idle, not below the initial window
        while idle > rto and c.cwnd > restart:
            c.cwnd = max(restart, c.cwnd / 2)
            idle -= rto

    def _level(self, peers: dict[_Conn, None] | None, me: _Conn, capacity: float | None, now: float) -> float:
        """The water-filling share of `capacity` that `me` may take on a link it shares with
        `peers` (those with bytes queued or on the link), given what each used last."""
        if capacity is None:
            return _INF
        demands = []
        if peers:
            idle = []
            for o in peers:
                if o.queue or o.busy_until > now:
                    if o is not me:
                        demands.append(o.used)
                else:
                    idle.append(o)
            for o in idle:
                del peers[o]
        if not demands:
            return capacity
        demands.sort()
        left, n = capacity, len(demands) + 1
        for d in demands:
            if d * n > left:
                break
            left -= d
            n -= 1
        return left / n

    def _bottleneck(self, c: _Conn, now: float) -> float | None:
        up = self.net._bw(c.src, True, now)
        down = self.net._bw(c.dst, False, now)
        if up is None:
            return down
        return up if down is None else min(up, down)

    def _round(self, c: _Conn, gen: int) -> None:
        if gen != c.gen:
            return  # the connection was reset since this round was scheduled
        now = self.env.now
        if not c.queue:
            c.scheduled = False
            return
        p = self.p
        heal = self.net.cut_until(c.src, c.dst, now)
        if heal is not None:
            # retransmission timeouts back off exponentially until one falls after the cut heals
            t, k = now, c.backoff
            while t < heal:
                t += self._rto(c) * (1 << min(k, 16))
                k += 1
            c.backoff = k
            c.ssthresh = max(2.0 * p.mss, c.cwnd / 2)
            c.cwnd = float(p.mss)  # after an RTO: loss window of one segment
            if c.bbr is not None:
                c.bbr.cwnd = c.cwnd
            self._at(t, c)
            return
        c.backoff = 0
        self.rounds += 1
        # in payload bytes/s: headers and the reverse traffic's ACKs take the rest of each link
        up, down = self.net._bw(c.src, True, now), self.net._bw(c.dst, False, now)
        share = p.payload_share
        up_level = self._level(self._busy_up.get(c.src), c, None if up is None else up * share, now)
        rate = min(up_level, self._level(self._busy_down.get(c.dst), c, None if down is None else down * share, now))
        push = up_level  # what it could put on the path if the receiver's downlink did not hold it back
        queued = sum(m.left for m in c.queue)
        rtt = c.rtt
        bbr = c.bbr
        if bbr is not None:  # BBR paces at gain x its estimate, and keeps its own window
            pacing = bbr.pacing_rate(now)
            rate = min(rate, pacing)
            push = min(push, pacing)
            c.cwnd = bbr.cwnd
        window_limited = False
        if rtt <= 0.0:
            nbytes = queued  # no RTT, no window to wait for
        elif c.cwnd < rate * rtt:
            nbytes = min(c.cwnd, queued)
            window_limited = nbytes >= c.cwnd
        else:
            span = min(rtt, p.share_interval) if p.share_interval > 0 else rtt
            nbytes = min(rate * span, queued)
        duration = nbytes / rate if rate < _INF else 0.0
        if rtt > 0.0 and nbytes < queued:
            nxt = now + (rtt if window_limited else duration)
        else:
            nxt = now + duration
        if window_limited:
            c.used = nbytes / max(duration, rtt) if max(duration, rtt) > 0 else _INF
        else:  # sending at the rate it was given, for as long as its bytes last
            c.used = nbytes / duration if duration > 0 else _INF
        # loss: the round's bytes wait for the retransmission (head-of-line blocking)
        extra = 0.0
        lost_bytes = 0.0
        dropped, drop_p = 0, 0.0
        if self.net.down_queue is not None and down is not None and rtt > 0.0:
            dropped, drop_p = self._tail_drop(c, now, rate, push, queued, nxt - now)
        loss = self.net._loss(c.src, c.dst)
        hit = False
        if loss > 0.0 and nbytes > 0:
            segs = math.ceil(nbytes / p.mss)
            if self.rng.random() < 1.0 - (1.0 - loss) ** segs:
                hit = True
                self.loss_events += 1
                if nbytes >= queued and self.rng.random() * segs < 1.0:
                    # the last segment of the queue was lost: nothing after it reveals the loss, so the
                    # tail-loss probe does (`_probe_delay`)
                    extra = self._probe_delay(c, segs)
                else:  # SACK/RACK: a later segment reveals it; the retransmission follows one RTT later
                    extra = max(rtt, 1e-3)
                # the retransmissions (or the probe) cross the same lossy path: when one of them is
                # lost too, the retransmission timer repairs it (the testbed's 1 % links: ~1 RTO and
                # ~1.4 lost retransmissions per 1 MiB step of 4 hosts, nstat TCPTimeouts and
                # TCPLostRetransmit, against ~80 fast retransmissions)
                lost = max(1.0, segs * loss)
                lost_bytes = lost * p.mss  # what BBR counts: whole segments, however short the message
                if self.rng.random() < 1.0 - (1.0 - loss) ** lost:
                    extra += self._rto(c)
                if not p.paced:  # BBR's window follows its path model, not losses
                    c.cwnd = max(2.0 * p.mss, c.cwnd * p.beta)
                    c.ssthresh = c.cwnd
                if extra > 0 and nbytes < queued and not p.paced:
                    nxt = max(nxt, now + extra)
        if dropped and nbytes > 0:
            # the downlink queue's tail drops: a loss as above, of `dropped` segments; the retransmissions
            # meet the same queue, full for about the same share of what arrives
            segs = max(1, math.ceil(nbytes / p.mss))
            lost_bytes = max(lost_bytes, dropped * p.mss)
            if not hit:
                self.loss_events += 1
                if nbytes >= queued and self.rng.random() * segs < dropped:
                    extra = self._probe_delay(c, segs)
                else:
                    extra = max(rtt, 1e-3)
                if self.rng.random() < 1.0 - (1.0 - drop_p) ** dropped:
                    extra += self._rto(c)
                if not p.paced:
                    c.cwnd = max(2.0 * p.mss, c.cwnd * p.beta)
                    c.ssthresh = c.cwnd
                if nbytes < queued and not p.paced:
                    nxt = max(nxt, now + extra)
        if bbr is not None:  # the samples its ACKs (and those of its retransmissions) will give
            bbr.on_sent(now, now + duration, nbytes, lost_bytes, now + duration + extra)
        # messages whose last byte is in this round arrive `owd` (+ jitter) after it left
        sent = 0.0
        while c.queue and nbytes - sent > 1e-9:
            m = c.queue[0]
            take = min(m.left, nbytes - sent)
            m.left -= take
            sent += take
            if m.left <= 1e-9:
                c.queue.popleft()
                self._release(m, now + (sent / rate if rate < _INF else 0.0))
                left_at = now + (sent / rate if rate < _INF else 0.0)
                at = left_at + c.owd + extra + self.net.jitter_draw(self.rng, c.src, c.dst)
                at = max(at, c.last_arrival)
                c.last_arrival = at
                ev = self.env.timeout(at - now)
                ev.callbacks.append(lambda _e, tok=m.token, s=left_at, g=c.gen, c=c: self._arrive(c, g, tok, s))
        while c.queue and c.queue[0].left <= 1e-9:  # zero-byte messages ride along
            m = c.queue.popleft()
            self._release(m, now + duration)
            at = max(now + duration + c.owd + extra, c.last_arrival)
            c.last_arrival = at
            ev = self.env.timeout(at - now)
            ev.callbacks.append(lambda _e, tok=m.token, s=now + duration, g=c.gen, c=c: self._arrive(c, g, tok, s))
        if extra > 0.0:
            # in-order delivery: nothing sent after this round's lost segment reaches the receiver
            # before its repair does, whichever later round the message ends in (head-of-line blocking)
            c.last_arrival = max(c.last_arrival, now + duration + c.owd + extra)
        c.busy_until = now + duration
        c.last_sent = now + duration
        if (window_limited or rtt <= 0.0) and bbr is None:
            if c.cwnd < c.ssthresh:
                c.cwnd += nbytes  # slow start: one segment per segment acknowledged
            else:
                c.cwnd += p.mss * nbytes / c.cwnd  # congestion avoidance: one segment per RTT
            bdp = self._bottleneck(c, now)
            cap = p.window_cap if bdp is None or rtt <= 0.0 else min(p.window_cap, max(p.iw, bdp * rtt))
            c.cwnd = min(c.cwnd, float(cap))
        if c.queue:
            self._at(nxt, c)
        else:
            c.scheduled = False

    def _tail_drop(self, c: _Conn, now: float, rate: float, push: float, queued: float,
                   span: float) -> tuple[int, float]:
        """The receiver's downlink queue (see "Queues" in the module docstring) over `c`'s round: the
        segments of `c` it drops (whole ones; the rest is owed to later rounds) and the share of what
        `c` offers it that it drops."""
        p = self.p
        rtt = c.rtt
        # in flight: its window, or what it can push in an RTT (its packets' RTT: the queue's delay on
        # top); what its share of the downlink does not carry in an RTT waits in the queue (no more than
        # it has to send)
        others = 0.0
        for o in self._busy_down.get(c.dst, ()):
            if o is not c and (o.queue or o.busy_until > now):
                others += o.queued_at_dst
        delay = (others + c.queued_at_dst) / (self.net._bw(c.dst, False, now) * p.payload_share)
        window = c.cwnd
        if c.bbr is not None and now < c.recovery_until:
            # BBR v1 in recovery takes each lost packet off its window until the recovery ends, an RTT
            # (the queue's delay included) after it began (bbr_set_cwnd_to_recover_or_restore); CUBIC
            # and Reno cut theirs (`_round`)
            window = max(float(p.mss), window - c.recovery_lost)
        offered = min(window, push * (rtt + delay), queued)
        c.queued_at_dst = max(0.0, offered - rate * rtt)
        if c.queued_at_dst <= 0.0:
            return 0, 0.0
        backlog = others + c.queued_at_dst
        # the limit counts frames (tbf counts bytes on the link); the backlog is payload
        limit = self.net.queue_limit(c.dst, now) * p.mss / (p.mss + p.frame_bytes)
        if backlog <= limit:
            return 0, 0.0
        # what does not fit is dropped, by each sender in proportion to what it holds there, and sent
        # again: once per RTT (the queue's delay included) while the backlog stays (a round limited by
        # the rate is part of an RTT)
        over = (backlog - limit) * c.queued_at_dst / backlog
        c.drop_owed += over * min(1.0, span / (rtt + delay))
        segs = int(c.drop_owed // p.mss)
        if segs <= 0:
            return 0, 0.0
        c.drop_owed -= segs * p.mss
        if now >= c.recovery_until:
            c.recovery_until, c.recovery_lost = now + rtt + delay, 0.0
        c.recovery_lost += segs * p.mss
        self.tail_drops[c.dst] = self.tail_drops.get(c.dst, 0) + segs
        return segs, min(1.0, over / max(offered, p.mss))

    def _arrive(self, c: _Conn, gen: int, token: Any, sent: float) -> None:
        # bytes that left before a reset are the receiver's (the driver drops what a crashed
        # sender had not finished sending, and anything for a dead receiver)
        self.deliver(token, sent)
