"""Network model for the SimPy driver: latency, per-peer bandwidth with queueing, loss, partitions.

Delivery contract — the one the ZeroMQ transport gives, which is what the protocol
may rely on: messages between one ordered pair of peers arrive in the order they
were sent, or not at all when the sender or the receiver is down; nothing is
duplicated or corrupted. Beyond that contract the model adds only the faults a
scenario asks for: random loss, partitions, slow links (and, in the driver, crashes
and pauses).

Timing of one message of B bytes from s to d:

* it waits for s's uplink (messages leave one after another: a peer that sends 16
  parts at once waits for its uplink) and takes ``B / up[s]`` to serialize;
* it travels ``latency(s, d)``: the link latency (a constant, a callable, a sampled
  distribution or a region-to-region matrix) plus both ends' access latency (from their
  profiles) plus optional jitter; never less than the previous message on that pair;
* it shares d's downlink the same way (cut-through: one transfer on an idle path costs
  ``B / bw + latency``, not twice ``B / bw``).

Every random draw comes from the generator the caller passes in.

The times it keeps per peer and per connection (when an uplink or downlink is free, when the last
message on a connection arrives) only ever hold a later message back: one at or before ``now``
holds nothing back, since a message sent now leaves and arrives at or after now. `send` drops
those from time to time (`_prune`), so that a long run with churn keeps only the links busy now,
not an entry per connection that ever carried a message (it kept every departed peer's). This
relies on calls coming in time order, as the driver makes them.

That is the ``transfer = "fifo"`` model: a message is a unit on a FIFO link, and loss drops
whole messages. ``transfer = "tcp"`` (`sim.tcp`) keeps the links, latencies, partitions and
slow links defined here but moves the bytes as TCP would: per-connection windows, slow
start, restart after idle, fair sharing, loss as retransmissions (nothing is lost), and, where
``down_queue`` gives the downlinks a finite queue, its tail drops as losses of the senders.
Order is kept per connection -- ``(src, dst, lane)``, see `zgossip.wire.lane_of` -- so a
later message on another lane may overtake.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

__all__ = ["NetworkModel", "Delivery", "Transfer", "Profile", "PROFILES", "Partition", "SlowLink"]


@dataclass(frozen=True)
class Profile:
    """A kind of peer: its access link in bytes/s, access latency (one way, s), loss probability
    and jitter (std of an extra N(0, jitter) delay, clipped at 0, on each message through this
    access link -- as the testbed's forwarder draws one per end)."""

    name: str
    up: float
    down: float
    latency: float = 0.0
    loss: float = 0.0
    jitter: float = 0.0


#: Typical access links. Mbit/s figures converted to bytes/s.
PROFILES: dict[str, Profile] = {
    "datacenter": Profile("datacenter", up=1.25e9, down=1.25e9, latency=0.0002),  # 10 Gbit/s
    "home": Profile("home", up=2.5e6, down=12.5e6, latency=0.010),  # 20 up / 100 down Mbit/s
    "mobile": Profile("mobile", up=0.625e6, down=2.5e6, latency=0.035, loss=0.002),  # 5 / 20 Mbit/s
}


@dataclass(frozen=True)
class Partition:
    """Between `start` and `end`, no message crosses between `side_a` and `side_b` (endpoints); with
    `one_way`, only what `side_a` sends to `side_b` (b still reaches a: asymmetric reachability)."""

    start: float
    end: float
    side_a: frozenset
    side_b: frozenset
    one_way: bool = False

    def cuts(self, src: str, dst: str, t: float) -> bool:
        if not self.start <= t < self.end:
            return False
        return (src in self.side_a and dst in self.side_b) or (
            not self.one_way and src in self.side_b and dst in self.side_a)


@dataclass(frozen=True)
class SlowLink:
    """Between `start` and `end`, `endpoint`'s up- and downlink run `factor` times slower."""

    start: float
    end: float
    endpoint: str
    factor: float


@dataclass
class Delivery:
    at: float  # virtual time of arrival (all bytes in, after the receiver's downlink)
    lost: bool
    sent: float  # when the last byte left the sender: a sender that dies before then never sent it


@dataclass
class Transfer:
    """A message on its way: it reaches the receiver's downlink at `first` (first byte)."""

    first: float
    last: float  # the last byte cannot arrive before this (sender serialization + latency)
    sent: float
    lost: bool


def check_down_queue(q: Any) -> None:
    """A `NetworkModel.down_queue` setting: None, or a table of seconds (> 0) and min_bytes (>= 0)."""
    if q is None:
        return
    if not isinstance(q, Mapping) or not set(q) <= {"seconds", "min_bytes"} or "seconds" not in q:
        raise ValueError(f"[network] down_queue must be a table {{seconds = S, min_bytes = B}} (the testbed's tbf: "
                         f"seconds = 0.2, min_bytes = 524288), or left out for unbounded queues; not {q!r}")
    for name, low_open in (("seconds", True), ("min_bytes", False)):
        v = q.get(name, 0)
        if (not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, (bool, np.bool_))
                or not np.isfinite(v) or v < 0 or (low_open and v == 0)):
            raise ValueError(f"[network] down_queue {name} must be a finite number {'> 0' if low_open else '>= 0'}, "
                             f"not {v!r}")


def _sampler(spec: Any) -> Callable[[str, str, np.random.Generator], float]:
    if callable(spec):
        return lambda s, d, rng: float(spec(s, d))
    if isinstance(spec, (int, float)):
        value = float(spec)
        return lambda s, d, rng: value
    if isinstance(spec, Mapping):
        dist = spec.get("dist", "constant")
        if dist == "constant":
            value = float(spec["value"])
            return lambda s, d, rng: value
        if dist == "uniform":
            lo, hi = float(spec["low"]), float(spec["high"])
            return lambda s, d, rng: float(rng.uniform(lo, hi))
        if dist == "normal":
            mu, sd = float(spec["mean"]), float(spec["std"])
            return lambda s, d, rng: max(0.0, float(rng.normal(mu, sd)))
        if dist == "lognormal":
            med, sigma = float(spec["median"]), float(spec["sigma"])
            return lambda s, d, rng: float(med * np.exp(sigma * rng.standard_normal()))
        if dist == "regions":
            region_of: Mapping[str, str] = spec["region_of"]
            matrix: Mapping[str, Mapping[str, float]] = spec["matrix"]

            def regions(s: str, d: str, rng: np.random.Generator) -> float:
                for ep in (s, d):  # (a peer churn added beyond the map failed as a bare KeyError)
                    if ep not in region_of:
                        raise ValueError(f"[network] latency region_of places no region for {ep}")
                return float(matrix[region_of[s]][region_of[d]])

            return regions
        raise ValueError(f"unknown latency distribution {dist!r}")
    raise TypeError("latency must be a number, a callable(src, dst) or a distribution mapping")


@dataclass
class NetworkModel:
    latency: Any = 0.001  # number | callable(src, dst) | {"dist": ...} (see _sampler)
    bandwidth: float | dict[str, float] | None = None  # bytes/s, both directions, for peers without a profile
    loss: float = 0.0
    jitter: float = 0.0  # std of extra normal delay per message (clipped at 0)
    profiles: dict[str, Profile] = field(default_factory=dict)  # endpoint -> profile
    partitions: list[Partition] = field(default_factory=list)
    slow_links: list[SlowLink] = field(default_factory=list)
    transfer: str = "fifo"  # "fifo" (messages on FIFO links, loss drops messages) or "tcp" (sim.tcp)
    tcp: Any = None  # sim.tcp.TcpParams, or a dict of its fields (+ "profile": a calibrate JSON); tcp only
    # tcp only: each downlink's queue holds max(min_bytes, seconds x its rate) bytes and drops what
    # arrives beyond that (tail drop, as the testbed's tbf: {seconds = 0.2, min_bytes = 524288}); None:
    # unbounded, no drops (see "Queues" in `sim.tcp`)
    down_queue: Any = None
    _up_free: dict = field(default_factory=dict, repr=False)
    _down_free: dict = field(default_factory=dict, repr=False)
    _last: dict = field(default_factory=dict, repr=False)
    _first: dict = field(default_factory=dict, repr=False)
    sent_bytes: dict = field(default_factory=dict, repr=False)
    received_bytes: dict = field(default_factory=dict, repr=False)
    _prune_at: int = field(default=0, init=False, repr=False)  # prune once `_first` holds this many entries (and prune_min)
    #: the fewest per-connection times worth a pruning (`_prune`); a class constant
    prune_min: ClassVar[int] = 1024

    def __post_init__(self) -> None:
        self._latency = _sampler(self.latency)
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError("loss must be a probability")
        if self.transfer not in ("fifo", "tcp"):
            raise ValueError(f"transfer must be 'fifo' or 'tcp', not {self.transfer!r}")
        from .tcp import TcpParams

        if self.tcp is None or isinstance(self.tcp, dict):
            spec = dict(self.tcp or {})
            prof = spec.pop("profile", None)
            base = TcpParams()
            if prof is not None:  # the machine's sysctls, as `python -m sim calibrate` stored them
                import json
                from pathlib import Path

                base = TcpParams.from_dict(json.loads(Path(prof).read_text()).get("tcp", {}))
            self.tcp = TcpParams.from_dict({**base.to_dict(), **spec})
        elif not isinstance(self.tcp, TcpParams):  # (kept, and used only once a tcp transfer ran)
            raise ValueError(f"[network] tcp must be a table of TCP settings (e.g. {{mss = 1448}}), not {self.tcp!r}")
        check_down_queue(self.down_queue)

    def _bw(self, peer: str, up: bool, t: float) -> float | None:
        prof = self.profiles.get(peer)
        if prof is not None:
            bw: float | None = prof.up if up else prof.down
        elif isinstance(self.bandwidth, dict):
            bw = self.bandwidth.get(peer)
        else:
            bw = self.bandwidth
        if bw is None:
            return None
        for s in self.slow_links:
            if s.endpoint == peer and s.start <= t < s.end:
                bw = bw / s.factor
        return bw

    def queue_limit(self, peer: str, t: float) -> float | None:
        """Bytes `peer`'s downlink queue holds at `t` (on the link: headers count), or None: unbounded."""
        q = self.down_queue
        if q is None:
            return None
        bw = self._bw(peer, False, t)
        if bw is None:
            return None
        return max(float(q.get("min_bytes", 0)), float(q.get("seconds", 0.0)) * bw)

    def base_latency(self, src: str, dst: str, rng: np.random.Generator) -> float:
        """One-way latency without jitter: the link's plus both ends' access latency."""
        lat = self._latency(src, dst, rng)
        for ep in (src, dst):
            prof = self.profiles.get(ep)
            if prof is not None:
                lat += prof.latency
        return lat

    def jitter_draw(self, rng: np.random.Generator, src: str | None = None, dst: str | None = None) -> float:
        """Extra delay of one message: the network's jitter, plus each end's access-link jitter."""
        t = max(0.0, float(rng.normal(0.0, self.jitter))) if self.jitter > 0 else 0.0
        for ep in (src, dst):
            prof = self.profiles.get(ep) if ep is not None else None
            if prof is not None and prof.jitter > 0:
                t += max(0.0, float(rng.normal(0.0, prof.jitter)))
        return t

    def _lat(self, src: str, dst: str, rng: np.random.Generator) -> float:
        return self.base_latency(src, dst, rng) + self.jitter_draw(rng, src, dst)

    def _loss(self, src: str, dst: str) -> float:
        p = self.loss
        for ep in (src, dst):
            prof = self.profiles.get(ep)
            if prof is not None:
                p = 1.0 - (1.0 - p) * (1.0 - prof.loss)
        return p

    def cut(self, src: str, dst: str, t: float) -> bool:
        if not self.partitions:  # asked twice per message: no generator when there is nothing to cut
            return False
        return any(p.cuts(src, dst, t) for p in self.partitions)

    def cut_until(self, src: str, dst: str, t: float) -> float | None:
        """When the traffic from src to dst flows again, if a partition cuts it at `t` (else None)."""
        ends = [p.end for p in self.partitions if p.cuts(src, dst, t)]
        if not ends:
            return None
        end = max(ends)
        nxt = self.cut_until(src, dst, end)  # back-to-back partitions
        return end if nxt is None else nxt

    def send(self, src: str, dst: str, nbytes: int, now: float, rng: np.random.Generator, lane: int = 0) -> Transfer:
        """Uplink + latency. Call `receive` at ``transfer.first``, in order of arrival."""
        n = len(self._first)
        if n >= self._prune_at and n >= self.prune_min:
            self._prune(now)
        up = self._bw(src, True, now)
        tx_start = max(now, self._up_free.get(src, now))
        tx_end = tx_start + (nbytes / up if up else 0.0)
        self._up_free[src] = tx_end
        self.sent_bytes[src] = self.sent_bytes.get(src, 0) + nbytes
        lat = self._lat(src, dst, rng)
        p = self._loss(src, dst)
        lost = (p > 0 and rng.random() < p) or self.cut(src, dst, now)
        # in order per pair: a message never reaches the receiver before the previous one on this pair
        first = max(tx_start + lat, self._first.get((src, dst, lane), 0.0))
        self._first[(src, dst, lane)] = first
        return Transfer(first, max(tx_end + lat, first), tx_end, lost)

    def _prune(self, now: float) -> None:
        """Forget the free-at and last-arrival times at or before `now`: each is a lower bound
        taken with ``max`` against a time at or after `now` (see the module docstring), so
        without it every later message gets the same times. Amortized O(1) per message: the next
        pruning waits until the table has doubled."""
        for table in (self._first, self._last, self._up_free, self._down_free):
            stale = [k for k, t in table.items() if t <= now]
            for k in stale:
                del table[k]
        self._prune_at = 2 * len(self._first)

    def receive(self, src: str, dst: str, nbytes: int, t: Transfer, lane: int = 0) -> float:
        """The receiver's downlink (shared in order of arrival) and the per-pair order: delivery time."""
        down = self._bw(dst, False, t.first)
        if down:
            start = max(t.first, self._down_free.get(dst, 0.0))
            end = max(start + nbytes / down, t.last)
            self._down_free[dst] = end
        else:
            end = t.last
        at = max(end, self._last.get((src, dst, lane), 0.0))  # in order per connection (pair and lane)
        self._last[(src, dst, lane)] = at
        return at

    def schedule(self, src: str, dst: str, nbytes: int, now: float, rng: np.random.Generator,
                 lane: int = 0) -> Delivery:
        """`send` and `receive` at once: exact for one message, or when a receiver's transfers are
        scheduled in their order of arrival (the driver calls the two halves at the right times)."""
        t = self.send(src, dst, nbytes, now, rng, lane)
        return Delivery(self.receive(src, dst, nbytes, t, lane), t.lost, t.sent)
