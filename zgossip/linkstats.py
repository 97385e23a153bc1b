"""Link statistics: what this peer learns about links from the transfers it completes.

Two things are measured from the payloads (PART and RESULT data) a peer receives during its
all-reduce rounds, with the times the driver passes in (no clock here):

* **its own download rate** (`LinkStats.download_mbit`): every payload of a round left its sender
  after the round began (`begin`), so the bytes that arrived by time t, over t minus the start,
  are a rate the link really carried -- with every concurrent transfer into this peer counted,
  since they all share the downlink. Per-message rates (bytes over the gap to the previous
  arrival) are no use: transfers that ran side by side complete together and read as a burst
  several times the link. A round's sample is the largest such running rate once at least
  `min_window_s` and `min_window_bytes` came in (lulls -- an owner still waiting for a slow
  sender -- only lower it); the estimate is a high percentile (`PERCENTILE`) of the last
  `window` rounds' samples.
* **its own upload rate** (`LinkStats.upload_mbit`): a ZeroMQ send completes into a queue, so
  the sender never sees its uploads leave; the owners it sent parts to do. Each owner returns,
  in the RESULT of every part (`messages.Result.rx`), how long after our *first* part of the
  round reached it this part did -- a duration on the owner's own clock, so no two clocks are
  compared. Our parts to every owner leave side by side, interleaved part by part, so the streams
  start together and share the uplink: each stream's first part is taken to have lasted as long,
  per byte, as its second, which puts every receipt on one time axis from our round's start. The
  round's sample is then the largest running rate, as for the download (bytes delivered by t over
  t, once a minimal window has passed): a stream held back by a slow owner's downlink lowers it
  only while it is the only one left. An owner that froze mid-stream (a gap between its receipts
  more than `STALL` times every other gap of the stream, and over 50 ms) times itself, not our
  uplink: the stream is cut before that gap. Like the download
  it is what the link carried, a lower bound; the estimate is the same percentile over the last
  `window` rounds, counting rounds that gave no sample, so an old sample ages out on links whose
  rounds are too short to measure the upload again. Its window is longer
  (`min_upload_s`, 0.2 s): a receipt is when the owner's event loop got to the part, and over
  a few milliseconds that times the owner's CPU, not our link -- on the testbed's 1 Gbit hosts
  (4 MiB, 70 ms rounds on 2 busy cores) 50 ms windows read 450-590 Mbit/s, split the equal
  hosts into rate classes and slowed the steps 1.6x. Uploads that short are not measured; the
  download then stands alone, as before receipts existed.
* **the link rate it announces** (`estimate_mbit`): the lower of the two. Every member of a
  butterfly round uploads as many bytes as it downloads (`sim.linkfloor`), so its time is set by
  the slower direction; on an asymmetric home line (100 down, 10 up) that is the upload.
* **each groupmate's pace** (`LinkStats.pace`): seconds per byte between successive PART payloads
  from that peer, its first one of a round timed from the round's start (bounded history, the
  largest recent sample). RESULT data counts for the rate only: an owner's results wait on its
  slowest sender, so their spacing says little about the owner's link. Parts that came too late
  to be used count too: they still measure the link. The all-reduce scales the pace by the
  bytes of the next part it expects to give every member its own silence limit (adaptive
  deadlines, `silence_limit`).

`valid_rate` is the one check a gossiped estimate from another peer must pass.
"""
from __future__ import annotations

import math
from collections import deque

__all__ = ["LinkStats", "valid_rate", "silence_limit", "MAX_RATE_MBIT", "MIN_PACE_BYTES"]

#: the largest rate a peer may claim (10 Tbit/s); anything above is garbage
MAX_RATE_MBIT = 1e7
#: payloads smaller than this say more about latency than about the link: not used for pace
MIN_PACE_BYTES = 16 << 10
PERCENTILE = 0.9
#: a gap between an owner's receipts this many times every other gap of the stream (and at least
#: `STALL_S`) says the owner stalled there: the stream's later receipts are no upload sample
STALL = 4.0
STALL_S = 0.05


def valid_rate(x: object) -> bool:
    """A link rate in Mbit/s as a peer may gossip it: a finite float or int in (0, MAX_RATE_MBIT]."""
    return type(x) in (int, float) and math.isfinite(x) and 0.0 < x <= MAX_RATE_MBIT  # type: ignore[operator]


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def silence_limit(pace: float | None, next_bytes: int, cap: float, floor: float, slack: float,
                  ceiling: float) -> float:
    """How long a member may stay silent before it is given up, for a part of `next_bytes`.

    Without a measured pace: `cap` (the configured `part_timeout`). With one: `slack` times the
    time the next part took at the measured pace, but at least `floor`; above `cap` only when the
    member was measured that slow (it is alive, its link is slow), and never above `ceiling`
    (what is left of the round)."""
    if pace is None:
        return cap
    want = slack * pace * max(1, next_bytes)
    return min(max(floor, want), max(cap, ceiling) if want > cap else cap)


class LinkStats:
    def __init__(self, *, window: int = 8, min_window_s: float = 0.05, min_window_bytes: int = 256 << 10,
                 pace_samples: int = 8, max_peers: int = 256, min_upload_s: float = 0.2) -> None:
        self.window = window
        self.min_window_s = min_window_s
        self.min_upload_s = min_upload_s
        self.min_window_bytes = min_window_bytes
        self.pace_samples = pace_samples
        self.max_peers = max_peers
        self._rates: deque[float] = deque(maxlen=window)  # bytes/s: each round's sample
        self._start: float | None = None  # when this round began here
        self._bytes = 0  # payload bytes that arrived since
        self._best = 0.0  # this round's largest running rate
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=128)  # (time, bytes so far) this round
        self._largest = 0  # largest payload this round
        self._last: dict[str, float] = {}  # peer -> arrival of its previous payload (this round)
        self._pace: dict[str, deque[float]] = {}  # peer -> recent seconds per byte
        # bytes/s: each round's upload sample, None for a round without one -- so a sample ages out after
        # `window` rounds even where rounds are too short to give new ones (fast links)
        self._up_rates: deque[float | None] = deque(maxlen=window)
        self._receipts: dict[str, list[tuple[float, int]]] = {}  # owner -> (rx seconds, bytes) this round
        self._up_best: float | None = 0.0  # this round's upload sample (None: receipts came since)

    def begin(self, now: float) -> None:
        """A round starts: the last one's sample joins the history. Payloads of a round still count
        after it ended here, until the next begins (a member that gave a slow sender up still sees
        its transfers complete, and they measure this link all the same)."""
        if self._best > 0:
            self._rates.append(self._best)
        if self._start is not None:
            up = self._upload_sample()
            self._up_rates.append(up if up > 0 else None)
        self._receipts.clear()
        self._up_best = 0.0
        self._start, self._bytes, self._best, self._largest = now, 0, 0.0, 0
        self._arrivals.clear()
        self._last.clear()

    def on_payload(self, peer: str, nbytes: int, now: float, pace: bool = True) -> None:
        """`nbytes` of payload from `peer` arrived at `now` (after `begin` of this round). `pace=False`
        (RESULT data): it counts for the download rate only -- an owner's results wait on its
        slowest sender, so their spacing says little about the owner's own link."""
        if self._start is None:
            return
        span = now - self._start
        if span > 0:  # messages kept while our GROUP was on its way are replayed at the start: not counted
            self._bytes += nbytes
            if span >= self.min_window_s and self._bytes >= self.min_window_bytes:
                self._best = max(self._best, self._bytes / span)
            self._windows(now, nbytes, peer)
        if not pace:
            return
        # a peer's first payload of the round is timed from the round's start: the wait for it
        # (latency, its other streams, its queue) is what a silence limit has to cover
        prev = self._last.get(peer, self._start)
        self._last[peer] = now
        if nbytes >= MIN_PACE_BYTES and now > prev:
            q = self._pace.get(peer)
            if q is None:
                if len(self._pace) >= self.max_peers:
                    self._pace.pop(next(iter(self._pace)))
                q = self._pace[peer] = deque(maxlen=self.pace_samples)
            q.append((now - prev) / nbytes)

    def _windows(self, now: float, nbytes: int, peer: str) -> None:
        """Busy stretches inside the round: bytes that completed between an earlier arrival and now,
        less what may have been in flight at that arrival (one partly sent payload per connection:
        two lanes from each sender), over the time between -- again a rate the link surely carried,
        but one a lull earlier in the round does not dilute."""
        self._largest = max(self._largest, nbytes)
        self._arrivals.append((now, self._bytes))
        inflight = 2 * (len(self._last) + (peer not in self._last)) * self._largest
        k = len(self._arrivals)
        for back in (16, 32, 64, 127):
            if back >= k:
                break
            t0, b0 = self._arrivals[k - 1 - back]
            moved = self._bytes - b0 - inflight
            if now - t0 >= self.min_window_s and moved >= self.min_window_bytes:
                self._best = max(self._best, moved / (now - t0))

    def on_receipt(self, owner: str, nbytes: int, rx: float) -> None:
        """`owner` reports that our part of `nbytes` (wire bytes) reached it `rx` seconds after our
        first part of this round did (`messages.Result.rx`)."""
        if self._start is None or not (0.0 <= rx < 1e6) or nbytes <= 0:
            return
        got = self._receipts.get(owner)
        if got is None:
            if len(self._receipts) >= self.max_peers:
                return
            got = self._receipts[owner] = []
        got.append((rx, nbytes))
        self._up_best = None

    def _upload_sample(self) -> float:
        """This round's upload sample in bytes/s (0: none), from the receipts so far (module docstring)."""
        if self._up_best is not None:
            return self._up_best
        arrivals: list[tuple[float, int]] = []  # (seconds since our streams began, bytes)
        for got in self._receipts.values():
            if len(got) < 2:
                continue  # one part gives no duration: its bytes are left out (the sample errs low)
            got = sorted(got)
            (r0, b0), (r1, b1) = got[0], got[1]
            if r1 <= r0:
                continue
            # the first part took as long as the second, per byte: both left while every stream of
            # the round still shared the uplink (the parts go out interleaved)
            # a gap far wider than every other of the stream says the owner stalled there (a pause, a
            # busy core): what follows times it, not our uplink -- cut before it (between the first two
            # receipts: the stream's lead is unknown, so it is left out)
            gaps = [got[k][0] - got[k - 1][0] for k in range(1, len(got))]
            keep = len(got)
            if len(gaps) >= 2:
                for k, gap in enumerate(gaps):
                    if gap > STALL_S and gap > STALL * max(g for i, g in enumerate(gaps) if i != k):
                        keep = k + 1
                        break
            if keep < 2:
                continue
            lead = (r1 - r0) * b0 / b1
            arrivals += [(r - r0 + lead, b) for r, b in got[:keep]]
        arrivals.sort()
        best, moved = 0.0, 0
        for t, b in arrivals:
            moved += b
            if t >= self.min_upload_s and moved >= self.min_window_bytes:
                best = max(best, moved / t)
        self._up_best = best
        return best

    def download_mbit(self) -> float | None:
        """This peer's download rate in Mbit/s (see the module docstring), None before a first sample."""
        rates = list(self._rates) + ([self._best] if self._best > 0 else [])
        if not rates:
            return None
        return _percentile(rates, PERCENTILE) * 8e-6

    def upload_mbit(self) -> float | None:
        """This peer's upload rate in Mbit/s, as its groupmates' receipts tell it; None before a first sample."""
        up = self._upload_sample()
        rates = [r for r in self._up_rates if r is not None] + ([up] if up > 0 else [])
        if not rates:
            return None
        return _percentile(rates, PERCENTILE) * 8e-6

    def estimate_mbit(self) -> float | None:
        """The rate this peer's link carries in Mbit/s: the lower of its download and upload rates
        (the download alone until an upload sample came), None before a first download sample."""
        down = self.download_mbit()
        if down is None:
            return None
        up = self.upload_mbit()
        return down if up is None else min(down, up)

    @property
    def fresh(self) -> bool:
        """Whether the latest round (the one begun last) gave a sample. Why it matters: a rate
        measured passively is what the link carried, a lower bound, and under any split of the
        vector every member's measured rate is about its load over the round's length -- so every
        split reproduces itself, and only a link that ran full tells its real rate. A member
        left with samples of older rounds only (its last round was too short to give one, or it
        sat out) would plan next to groupmates measured in a later round (after a faster one,
        or under another split) and lock that split in; it announces no estimate instead
        (`partition.UNMEASURED`: equal spans for the group's auto members)."""
        return self._best > 0

    def pace(self, peer: str) -> float | None:
        """Seconds per byte between `peer`'s payloads: the largest of its recent samples (None: none yet)."""
        q = self._pace.get(peer)
        return max(q) if q else None
