"""BBR v1's model of the path, kept per connection for `sim.tcp`'s paced (BBR) connections.

The testbed's hosts run Linux's BBR (v1, ``net/ipv4/tcp_bbr.c``, with the delivery-rate samples
of ``net/ipv4/tcp_rate.c``). What it sends is decided by two numbers, and this module keeps both
the way Linux does, so the simulator can predict what BBR does to bursty, lossy traffic:

* **The bandwidth estimate** is the largest delivery-rate sample of the last 10 packet-timed
  round trips (``bbr_bw_rtts``), kept by Kathleen Nichols' windowed max filter (``lib/win_minmax.c``,
  `WindowedMax`). A round trip ends when a packet sent after the previous one ended is acknowledged
  (``bbr_update_bw``), so an idle connection's rounds do not advance. A sample is delivered bytes
  over the longer of the send and the ACK phase of its packet (``tcp_rate_gen``): in a flight's
  first round trip the bytes sent so far over their sending time plus the RTT, later the bytes
  sent over the last round trip. A sample is *app-limited* when its packet left after the
  application wrote with nothing unsent, the window not full and no lost segment awaiting its
  retransmission, and before the ACK of the first packet sent after that write came back
  (``tcp_rate_check_app_limited``); such a sample enters the filter only if it is at least the
  current estimate. A retransmission is a sample like any other: its packet leaves when the loss
  is detected and is acknowledged an RTT later, so it reads the bytes the connection sent in the
  round trip before it plus the retransmitted segments (whole segments, however short the message:
  Linux counts packets), over at least that RTT. At the tail of a burst that is a few segments per
  RTT -- tens of kbit/s on a 300 ms path -- and it is not app-limited. When the high samples are
  older than 10 round trips, such a sample becomes the estimate. Entering recovery starts a round.
* **The pacing gain** follows BBR's modes. STARTUP paces at 2/ln 2 (``bbr_high_gain``;
  `TcpParams.pacing_gain`) times the estimate and its pacing rate never falls; it ends when 3
  round starts with non-app-limited samples (``bbr_full_bw_cnt``) saw the estimate grow by less
  than 25 % (``bbr_full_bw_thresh``). DRAIN paces at 1/2.885 (``bbr_drain_gain``) until what is in
  flight fits the estimated BDP. PROBE_BW cycles the gains 1.25, 0.75, 1 x 6 (``bbr_pacing_gain``),
  from a phase drawn among the 7 that are not 0.75 (``bbr_cycle_rand``); a phase lasts a min RTT,
  the 1.25 phase until a loss or until 1.25 x BDP is in flight, the 0.75 phase no longer than it
  takes what is in flight to fit the BDP (``bbr_is_next_cycle_phase``). After idle, a PROBE_BW
  connection paces at 1 x the estimate until the next ACK (``bbr_cwnd_event``). Every pacing rate
  is 1 % below gain x estimate (``bbr_pacing_margin_percent``). So once the estimate has fallen
  after STARTUP, it grows only by the probe gain, 1.25 per gain cycle, as the testbed showed.
* **The window** (``bbr_set_cwnd``) grows by what each ACK acknowledges towards the cwnd gain
  (2.885 in STARTUP and DRAIN, 2 in PROBE_BW) x the estimated BDP plus room for three TSO bursts;
  before the pipe was found full it never shrinks, after that it falls to that target; at least
  4 segments. `sim.tcp` uses it in place of its slow-start window for BBR connections.

Not modelled: PROBE_RTT (the simulator's RTT is constant, and Linux renews its min-RTT filter
with every sample that is not above it, ``bbr_update_min_rtt``), the long-term ("policer")
estimate (it needs 20 % loss over 4-16 round trips), the packet conservation of recovery's first
round and what an RTO resets (``bbr_set_state``), ACK aggregation. ACKs are not events: the
samples of what a connection sends wait in a heap and are taken, in ACK order, when the connection
next sends or writes, which is when BBR would act on them. Randomness is the caller's generator.
The constants below are Linux's (``net/ipv4/tcp_bbr.c``; names in the comments).
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Any

__all__ = ["Bbr", "WindowedMax"]

BW_RTTS = 10  # bbr_bw_rtts = CYCLE_LEN + 2: the bandwidth filter's window, in round trips
DRAIN_GAIN = 1000 / 2885  # bbr_drain_gain: drains STARTUP's queue in about one round
PROBE_BW_GAINS = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)  # bbr_pacing_gain[]
CYCLE_RAND = 7  # bbr_cycle_rand: the first PROBE_BW phase is drawn among this many
FULL_BW_THRESH = 1.25  # bbr_full_bw_thresh: STARTUP goes on while the estimate grows by this
FULL_BW_CNT = 3  # bbr_full_bw_cnt: ... and ends after this many round starts without
PACING_MARGIN = 0.99  # bbr_pacing_margin_percent = 1: pace 1 % below gain x estimate
MIN_TSO_RATE = 1_200_000 / 8  # bbr_min_tso_rate (bytes/s): below it a TSO burst is 1 segment, else >= 2
PACING_SHIFT = 10  # sk_pacing_shift default: a TSO burst holds ~1 ms (rate >> 10) of data
GSO_MAX = 65536  # GSO_MAX_SIZE: the largest TSO burst
CYCLE_LEN = len(PROBE_BW_GAINS)  # CYCLE_LEN
CWND_GAIN = 2.0  # bbr_cwnd_gain: PROBE_BW's window is twice the estimated BDP
CWND_MIN_TARGET = 4  # bbr_cwnd_min_target: never fewer segments in flight
INIT_CWND_SEGS = 10  # TCP_INIT_CWND: below this many delivered segments the window always grows

STARTUP, DRAIN, PROBE_BW = "startup", "drain", "probe_bw"


class WindowedMax:
    """The largest value of the last `window` time units, in constant space: the best, second and
    third best values of the window with the invariant that each is at least as recent as the one
    before (Kathleen Nichols' algorithm, Linux ``lib/win_minmax.c``). It moves only when given a
    value, so a window with no new values keeps its maximum however old it gets."""

    __slots__ = ("window", "s")

    def __init__(self, window: int) -> None:
        self.window = window
        self.s = [(0, 0.0)] * 3  # (time, value): best, second, third choice

    def get(self) -> float:
        return self.s[0][1]

    def update(self, t: int, v: float) -> float:
        s, win, val = self.s, self.window, (t, v)
        if v >= s[0][1] or t - s[2][0] > win:  # a new maximum, or nothing left in the window
            s[0] = s[1] = s[2] = val
            return v
        if v >= s[1][1]:
            s[1] = s[2] = val
        elif v >= s[2][1]:
            s[2] = val
        dt = t - s[0][0]
        if dt > win:  # the best aged out: the second becomes the best (and maybe the third)
            s[0], s[1], s[2] = s[1], s[2], val
            if t - s[0][0] > win:
                s[0], s[1], s[2] = s[1], s[2], val
        elif s[1][0] == s[0][0] and dt > win // 4:  # a second choice from the window's second quarter
            s[1] = s[2] = val
        elif s[2][0] == s[1][0] and dt > win // 2:  # a third choice from its second half
            s[2] = val
        return s[0][1]


class _Retransmission:
    """A retransmission's sample, still counting the bytes its connection sends in the round trip
    before it leaves (they are what its ACK reports delivered besides itself)."""

    __slots__ = ("leaves", "lost", "delivered", "app_limited", "cum_after", "acked_from")

    def __init__(self, leaves: float, lost: float, acked_from: float) -> None:
        self.leaves = leaves
        self.lost = lost
        # the send time of the latest byte whose ACK is back when it leaves: its sample's interval
        # runs from there (both the send and the ACK phase), at least an RTT
        self.acked_from = acked_from
        self.delivered = 0.0
        self.app_limited = False
        self.cum_after: float | None = None  # bytes sent by the time it left (None: not known yet)


class Bbr:
    """One connection's BBR v1 state (see the module docstring). `sim.tcp` calls `on_write` when
    the application writes to a connection with nothing unsent, `pacing_rate` before each round,
    and `on_sent` after it."""

    __slots__ = ("rtt", "mss", "high_gain", "rng", "bw", "rtt_cnt", "round_from", "recovery_until", "mode",
                 "full_bw", "full_bw_cnt", "full_bw_reached", "cycle_idx", "cycle_stamp", "rate",
                 "app_limited_until", "acks", "seq", "outstanding_until", "flight_t0", "flight_cum0", "cum",
                 "sent", "open", "cwnd", "window_cap", "in_flight", "delivered")

    def __init__(self, rtt: float, mss: int, init_window: float, high_gain: float, rng: Any,
                 window_cap: float = float("inf")) -> None:
        self.rtt = rtt  # also BBR's min RTT: the simulated path's RTT does not vary
        self.mss = mss
        self.high_gain = high_gain
        self.rng = rng
        self.bw = WindowedMax(BW_RTTS)  # bytes/s
        self.rtt_cnt = 0
        self.round_from = 0.0  # a packet sent at or after this time ends the current round when acked
        self.recovery_until = -1.0
        self.mode = STARTUP
        self.full_bw = 0.0
        self.full_bw_cnt = 0
        self.full_bw_reached = False
        self.cycle_idx = 0
        self.cycle_stamp = 0.0
        # bbr_init_pacing_rate_from_rtt: high gain x the initial window per RTT
        self.rate = PACING_MARGIN * high_gain * init_window / rtt
        self.app_limited_until = -1.0
        self.acks: list[tuple] = []  # heap of (ack time, seq, sent at, sample, app-limited, losses, sent by then, retx)
        self.seq = 0
        self.outstanding_until = -1.0  # when everything sent so far is acknowledged
        self.flight_t0 = 0.0  # when the current flight began (nothing was in flight before)
        self.flight_cum0 = 0.0
        self.cum = 0.0  # bytes sent, ever
        self.in_flight = 0.0  # bytes sent whose ACK has not been taken
        self.delivered = 0.0  # bytes whose ACK was taken
        self.sent: deque[tuple[float, float, float, float]] = deque()  # this flight's chunks: start, end, cum before, bytes
        self.open: list[_Retransmission] = []  # retransmissions that have not left yet
        self.cwnd = float(init_window)  # bytes
        self.window_cap = window_cap

    # ------------------------------------------------------------------ what sim.tcp calls
    def on_write(self, now: float, first_send: float) -> None:
        """The application wrote with nothing unsent: unless the window is full or a lost segment
        still waits for its retransmission (tcp_rate_check_app_limited), what leaves until the first
        new packet's ACK is back (`first_send` + RTT) is app-limited, and a connection with nothing
        in flight restarts from idle (``CA_EVENT_TX_START``)."""
        self.take_acks(now)
        if self.in_flight >= self.cwnd or any(r.leaves > now for r in self.open):
            return
        until = first_send + self.rtt
        self.app_limited_until = max(self.app_limited_until, until)
        for r in self.open:
            if now <= r.leaves < until:
                r.app_limited = True
        if first_send >= self.outstanding_until and self.mode == PROBE_BW:
            self.rate = PACING_MARGIN * self.bw.get()  # pace at 1 x the estimate until the next ACK

    def pacing_rate(self, now: float) -> float:
        self.take_acks(now)
        return self.rate

    def on_sent(self, start: float, end: float, nbytes: float, lost: float = 0.0,
                retransmit_leaves: float | None = None) -> None:
        """`nbytes` left between `start` and `end`; `lost` of them are retransmitted when
        `retransmit_leaves`. Queues the samples their ACKs will give."""
        if nbytes <= 0:
            return
        rtt = self.rtt
        if start >= self.outstanding_until:  # nothing in flight: a new flight (tcp_rate_skb_sent)
            self.flight_t0, self.flight_cum0 = start, self.cum
            self.sent.clear()
        span = end - start
        for r in self.open:  # bytes leaving in the round trip before a retransmission
            r.acked_from = max(r.acked_from, min(end, r.leaves - rtt))
            lo, hi = max(start, r.leaves - rtt), min(end, r.leaves)
            if hi > lo:
                r.delivered += nbytes * (hi - lo) / span
            elif span <= 0 and r.leaves - rtt < start <= r.leaves:
                r.delivered += nbytes
        self.sent.append((start, end, self.cum, nbytes))
        self.cum += nbytes
        self.in_flight += nbytes
        for r in self.open:
            if r.leaves <= end:
                r.cum_after = self.cum
        self.open = [r for r in self.open if r.cum_after is None]
        resent = min(lost, nbytes)  # of these bytes (`lost` counts whole segments, as BBR's samples do)
        self._push(end + rtt, end, self._sample(end), end < self.app_limited_until, lost > 0, self.cum,
                   nbytes - resent, None)
        if lost > 0 and retransmit_leaves is not None:
            r = _Retransmission(retransmit_leaves, lost, end)
            r.app_limited = retransmit_leaves < self.app_limited_until
            self.open.append(r)
            self._push(retransmit_leaves + rtt, retransmit_leaves, 0.0, False, False, None, resent, r)

    # ------------------------------------------------------------------ samples
    def _push(self, ack: float, sent_at: float, sample: float, app_limited: bool, losses: bool,
              cum_after: float | None, acked: float, retx: _Retransmission | None) -> None:
        self.seq += 1
        heapq.heappush(self.acks, (ack, self.seq, sent_at, sample, app_limited, losses, cum_after, acked, retx))
        self.outstanding_until = max(self.outstanding_until, ack)

    def _sample(self, end: float) -> float:
        """The delivery rate the ACK of the byte that left at `end` reports (tcp_rate_gen)."""
        rtt = self.rtt
        if end < self.flight_t0 + rtt:  # no ACK of this flight back yet: sending time + RTT
            return (self.cum - self.flight_cum0) / (end - self.flight_t0 + rtt)
        # the latest ACK back when it left is that of the last byte that left an RTT before it
        edge = end - rtt
        sent = self.sent
        while len(sent) > 1 and sent[1][0] <= edge:
            sent.popleft()
        a, b, before, n = sent[0]
        if edge < b and b > a:
            since, cum_then = edge, before + n * (edge - a) / (b - a)
        else:
            since, cum_then = b, before + n
        return (self.cum - cum_then) / max(end - since, rtt)

    def take_acks(self, now: float) -> None:
        """Act on every ACK due by `now`, in order."""
        acks = self.acks
        while acks and acks[0][0] <= now:
            ack, _, sent_at, sample, app_limited, losses, cum_after, acked, retx = heapq.heappop(acks)
            if retx is not None:
                sample = (retx.delivered + retx.lost) / max(self.rtt, retx.leaves - retx.acked_from)
                app_limited = retx.app_limited
                cum_after = self.cum if retx.cum_after is None else retx.cum_after
                if retx.cum_after is None:
                    self.open.remove(retx)
            self.in_flight -= acked
            self.delivered += acked
            self._on_ack(ack, sent_at, sample, app_limited, losses, self.cum - cum_after, acked)

    def _on_ack(self, ack: float, sent_at: float, sample: float, app_limited: bool, losses: bool,
                inflight: float, acked: float) -> None:
        # bbr_update_bw: a packet sent after the round began ends it
        round_start = sent_at >= self.round_from
        if round_start:
            self.rtt_cnt += 1
            self.round_from = ack
        if losses and ack >= self.recovery_until:
            # entering recovery starts a round now (bbr_set_cwnd_to_recover_or_restore)
            self.round_from = max(self.round_from, ack)
            self.recovery_until = ack + self.rtt
        if not app_limited or sample >= self.bw.get():
            self.bw.update(self.rtt_cnt, sample)
        bw = self.bw.get()
        if self.mode == PROBE_BW and self._next_phase(ack, losses, inflight, bw):  # bbr_update_cycle_phase
            self._advance_phase(ack)
        if not self.full_bw_reached and round_start and not app_limited:  # bbr_check_full_bw_reached
            if bw >= self.full_bw * FULL_BW_THRESH:
                self.full_bw, self.full_bw_cnt = bw, 0
            else:
                self.full_bw_cnt += 1
                self.full_bw_reached = self.full_bw_cnt >= FULL_BW_CNT
        if self.mode == STARTUP and self.full_bw_reached:  # bbr_check_drain
            self.mode = DRAIN
        if self.mode == DRAIN and inflight <= self._inflight(bw, 1.0):
            self.mode = PROBE_BW
            self.cycle_idx = CYCLE_LEN - 1 - int(self.rng.random() * CYCLE_RAND)  # bbr_reset_probe_bw_mode
            self._advance_phase(ack)
        rate = PACING_MARGIN * self._gain() * bw  # bbr_set_pacing_rate: never falls in STARTUP
        if self.full_bw_reached or rate > self.rate:
            self.rate = rate
        # bbr_set_cwnd: towards cwnd gain x BDP (2/ln 2 in STARTUP and DRAIN, 2 in PROBE_BW) plus the
        # TSO room; it grows by what was acked, and only falls to the target once the pipe was full
        target = self._inflight(bw, self.high_gain if self.mode in (STARTUP, DRAIN) else CWND_GAIN)
        if self.full_bw_reached:
            cwnd = min(self.cwnd + acked, target)
        elif self.cwnd < target or self.delivered < INIT_CWND_SEGS * self.mss:
            cwnd = self.cwnd + acked
        else:
            cwnd = self.cwnd
        self.cwnd = min(max(cwnd, CWND_MIN_TARGET * self.mss), self.window_cap)

    # ------------------------------------------------------------------ gains
    def _gain(self) -> float:
        if self.mode == STARTUP:
            return self.high_gain
        if self.mode == DRAIN:
            return DRAIN_GAIN
        return PROBE_BW_GAINS[self.cycle_idx]

    def _advance_phase(self, ack: float) -> None:
        self.cycle_idx = (self.cycle_idx + 1) % CYCLE_LEN
        self.cycle_stamp = ack

    def _next_phase(self, ack: float, losses: bool, inflight: float, bw: float) -> bool:
        full_length = ack - self.cycle_stamp > self.rtt
        gain = PROBE_BW_GAINS[self.cycle_idx]
        if gain == 1.0:
            return full_length
        if gain > 1.0:
            return full_length and (losses or inflight >= self._inflight(bw, gain))
        return full_length or inflight <= self._inflight(bw, 1.0)

    def _inflight(self, bw: float, gain: float) -> float:
        """bbr_inflight: gain x BDP plus room for three TSO bursts (bbr_quantization_budget), bytes."""
        burst = min(self.rate / (1 << PACING_SHIFT), GSO_MAX) // self.mss
        segs = min(max(burst, 1 if self.rate < MIN_TSO_RATE else 2), 127)
        bdp = -(-bw * self.rtt * gain // self.mss)
        cwnd = bdp + 3 * segs
        cwnd += cwnd % 2  # rounded up to an even count
        if self.mode == PROBE_BW and self.cycle_idx == 0:
            cwnd += 2
        return cwnd * self.mss
