"""Per-source rate limit on the control messages a node answers (gossip, joins, state requests).

A peer that floods GOSSIP or JOIN makes the receiver do work and send answers for every
message; with `SourceLimits` each source (a peer id; with keys, authenticated by the transport)
gets a token bucket: ``burst`` messages at once, refilled at ``rate`` per second. Over that,
its control messages are dropped and counted; the node logs the first drop per source. Honest
peers stay far below the budget: a peer gossips to ``fanout`` peers per ``gossip_interval``,
so any one source sends us about one GOSSIP (and one reply) per interval, and a step costs a
few JOINs. Round data (parts, results) is not limited here: the all-reduce checks who may send
it and how much (`zgossip.allreduce`). Sans-I/O: time is passed in.
"""
from __future__ import annotations

from collections import OrderedDict

__all__ = ["SourceLimits"]


class SourceLimits:
    """Token buckets per source, at most `max_sources` remembered (least recently seen forgotten)."""

    def __init__(self, rate: float, burst: float, max_sources: int = 4096) -> None:
        if rate <= 0 or burst < 1 or max_sources < 1:
            raise ValueError("rate must be > 0, burst >= 1, max_sources >= 1")
        self.rate, self.burst, self.max_sources = float(rate), float(burst), int(max_sources)
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # source -> [tokens, last time]

    def _bucket(self, source: str, now: float) -> list[float]:
        b = self._buckets.get(source)
        if b is None:
            if len(self._buckets) >= self.max_sources:
                self._buckets.popitem(last=False)
            b = self._buckets[source] = [self.burst, now]
        else:
            self._buckets.move_to_end(source)
            b[0] = min(self.burst, b[0] + max(0.0, now - b[1]) * self.rate)
            b[1] = max(b[1], now)
        return b

    def allow(self, source: str, now: float, cost: float = 1.0) -> bool:
        """Take `cost` tokens (at most `burst`) from `source`'s bucket; False (nothing taken) when it
        holds fewer."""
        b = self._bucket(source, now)
        cost = min(float(cost), self.burst)
        if b[0] < cost - 1e-9:  # (refilled exactly to `ready_at` may round a hair short)
            return False
        b[0] = max(0.0, b[0] - cost)
        return True

    def ready_at(self, source: str, cost: float = 1.0) -> float:
        """When `source`'s bucket will hold `cost` tokens (at most `burst`), from what it held when last
        used (an unknown source: at once, -inf)."""
        b = self._buckets.get(source)
        if b is None:
            return float("-inf")
        return b[1] + max(0.0, min(float(cost), self.burst) - b[0]) / self.rate
