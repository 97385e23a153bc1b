"""Helpers for feeding protocol state machines by hand: an outbox that records what a machine
sends (each message passed through the real wire codec, so everything sent is encodable and the
receiver sees what a peer would), and ids/endpoints for made-up peers."""
from __future__ import annotations

from typing import Any

import numpy as np

from zgossip import wire
from zgossip.membership import Membership


def pid(i: int) -> str:
    return f"{i:02d}" * 8


def ep(i: int) -> str:
    return f"tcp://10.0.0.{i}:5555"


class Outbox:
    """A `send` callable that keeps (endpoint, message) pairs, decoded back from their frames."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, wire.Message]] = []

    def __call__(self, endpoint: str, msg: wire.Message) -> None:
        frames = wire.encode(msg)
        self.sent.append((endpoint, wire.decode([frames[0], *[np.asarray(f).tobytes() for f in frames[1:]]])))

    def take(self, kind: type | None = None) -> list[tuple[str, Any]]:
        """Everything sent since the last take (only messages of class `kind`, if given; the rest stay)."""
        out = [(e, m) for e, m in self.sent if kind is None or type(m) is kind]
        self.sent = [(e, m) for e, m in self.sent if not (kind is None or type(m) is kind)]
        return out


def membership_with(me: int, others: list[int], send: Any, now: float = 0.0, **kw: Any) -> Membership:
    """A gossip `Membership` for peer `me` that already knows `others` alive (merged as a digest)."""
    m = Membership(pid(me), ep(me), send, np.random.default_rng(me), **kw)
    m.merge([(pid(i), ep(i), 1, None, {}) for i in others], now)
    return m
