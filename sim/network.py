"""Network model for the SimPy driver: per-link latency, per-peer up/down bandwidth, loss.

Delivery contract (the one the ZeroMQ transport gives): messages between one ordered
pair of peers arrive in the order they were sent, or not at all when the sender or
receiver is down; nothing is duplicated. Loss (probability ``loss``) is the one fault
beyond that contract, and is drawn from the seeded generator.

Timing: a message of B bytes waits for the sender's uplink (messages leave one after
another), takes B/up seconds to serialize, and reaches the receiver ``latency`` later;
the receiver's downlink is shared the same way (cut-through, so one transfer on an
idle path costs B/bw + latency, not twice B/bw).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

__all__ = ["NetworkModel", "Delivery"]


@dataclass
class Delivery:
    at: float  # virtual time of arrival
    lost: bool
    sent: float  # when the last byte left the sender: a sender that dies before then never sent it


@dataclass
class NetworkModel:
    latency: float | Callable[[str, str], float] = 0.001
    bandwidth: float | dict[str, float] | None = None  # bytes/s per peer, both directions; None = infinite
    loss: float = 0.0
    _up_free: dict = field(default_factory=dict, repr=False)
    _down_free: dict = field(default_factory=dict, repr=False)
    _last: dict = field(default_factory=dict, repr=False)

    def _bw(self, peer: str) -> float | None:
        if isinstance(self.bandwidth, dict):
            return self.bandwidth.get(peer)
        return self.bandwidth

    def _lat(self, src: str, dst: str) -> float:
        return self.latency(src, dst) if callable(self.latency) else float(self.latency)

    def schedule(self, src: str, dst: str, nbytes: int, now: float, rng: np.random.Generator) -> Delivery:
        up = self._bw(src)
        tx_start = max(now, self._up_free.get(src, now))
        tx_end = tx_start + (nbytes / up if up else 0.0)
        self._up_free[src] = tx_end
        lat = self._lat(src, dst)
        down = self._bw(dst)
        rx_start = max(tx_start + lat, self._down_free.get(dst, 0.0))
        rx_end = max(rx_start + (nbytes / down if down else 0.0), tx_end + lat)
        self._down_free[dst] = rx_end
        at = max(rx_end, self._last.get((src, dst), 0.0))  # in order per pair
        self._last[(src, dst)] = at
        lost = self.loss > 0 and rng.random() < self.loss
        return Delivery(at, lost, tx_end)
