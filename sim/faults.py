"""Faults and churn for simulated runs, all scheduled in virtual time from the scenario's seed.

Each fault is plain data (`from_dict` reads the scenario format) and knows how to put
itself on a `SimCluster`'s clock:

* ``crash`` — the peer dies for good at ``at`` (queued outgoing messages are lost);
* ``crash_rejoin`` — it dies at ``at`` and a fresh process (new peer id, same endpoint,
  the tensors it had) starts at ``back`` and bootstraps from the live peers;
* ``pause`` — the process freezes from ``start`` to ``end``: it handles and sends
  nothing; messages to it wait in its socket buffers and are handled on resume;
* ``partition`` — no message crosses between the two sides from ``start`` to ``end``;
* ``slow`` — the peer's links run ``factor`` times slower from ``start`` to ``end``;
* churn — new peers arrive as a Poisson process (``arrival_rate`` per second) and each
  live peer leaves after an exponential time (``departure_rate`` per second).

Per-round unavailability (each peer sits out a round with probability p, the Moshpit
paper's model) is drawn by the scenario runner, not here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from zgossip.grid import seed_from

from .network import Partition, SlowLink

__all__ = ["Fault", "Crash", "CrashRejoin", "Pause", "PartitionFault", "Slow", "Churn", "fault_from_dict"]


def _check_time(kind: str, name: str, t: float) -> None:
    # a time before 0 would fire at 0 (`SimFaultContext.at`): a typo, not a wish
    if not 0 <= t < math.inf:
        raise ValueError(f"{kind}: {name} must be a time >= 0 seconds, not {t!r}")


def _check_window(kind: str, start: float, end: float) -> None:
    _check_time(kind, "start", start)
    if not end > start:  # an empty or reversed window would do nothing, or (pause) never resume
        raise ValueError(f"{kind}: end ({end!r}) must come after start ({start!r})")


@dataclass(frozen=True)
class Crash:
    peer: int
    at: float

    def __post_init__(self) -> None:
        _check_time("crash", "at", self.at)

    def install(self, ctx: "FaultContext") -> None:
        ctx.at(self.at, lambda: ctx.crash(self.peer))


@dataclass(frozen=True)
class CrashRejoin:
    peer: int
    at: float
    back: float

    def __post_init__(self) -> None:
        _check_time("crash_rejoin", "at", self.at)
        if not self.back > self.at:
            raise ValueError("crash_rejoin: back must come after at")

    def install(self, ctx: "FaultContext") -> None:
        ctx.at(self.at, lambda: ctx.crash(self.peer))
        ctx.at(self.back, lambda: ctx.rejoin(self.peer))


@dataclass(frozen=True)
class Pause:
    peer: int
    start: float
    end: float

    def __post_init__(self) -> None:
        _check_window("pause", self.start, self.end)

    def install(self, ctx: "FaultContext") -> None:
        ctx.at(self.start, lambda: ctx.peer(self.peer).pause())
        ctx.at(self.end, lambda: ctx.peer(self.peer).resume())


@dataclass(frozen=True)
class PartitionFault:
    sides: tuple[tuple[int, ...], tuple[int, ...]]
    start: float
    end: float
    one_way: bool = False  # only the first side's traffic to the second is cut

    def __post_init__(self) -> None:
        _check_window("partition", self.start, self.end)

    def install(self, ctx: "FaultContext") -> None:
        a = frozenset(ctx.endpoint(i) for i in self.sides[0])
        b = frozenset(ctx.endpoint(i) for i in self.sides[1])
        ctx.network.partitions.append(Partition(self.start, self.end, a, b, self.one_way))


@dataclass(frozen=True)
class Slow:
    peer: int
    start: float
    end: float
    factor: float

    def __post_init__(self) -> None:
        _check_window("slow", self.start, self.end)
        if not 0 < self.factor < math.inf:  # the link's rate is divided by it
            raise ValueError(f"slow: factor must be a number > 0, not {self.factor!r}")

    def install(self, ctx: "FaultContext") -> None:
        ctx.network.slow_links.append(SlowLink(self.start, self.end, ctx.endpoint(self.peer), self.factor))


@dataclass(frozen=True)
class Churn:
    arrival_rate: float = 0.0  # new peers per second
    departure_rate: float = 0.0  # per live peer, per second
    until: float = float("inf")

    def __post_init__(self) -> None:
        for name in ("arrival_rate", "departure_rate"):
            rate = getattr(self, name)
            if not 0 <= rate < math.inf:  # a negative rate was taken as no churn at all
                raise ValueError(f"churn: {name} must be a finite rate >= 0 per second, not {rate!r}")
        if not self.until >= 0:
            raise ValueError(f"churn: until must be a time >= 0 seconds, not {self.until!r}")

    def install(self, ctx: "FaultContext") -> None:
        rng = ctx.rng("churn")
        if self.arrival_rate > 0:
            # one arrival scheduled at a time, each scheduling the next: with no `until` (the default)
            # scheduling them all up front never ended (a scenario with churn hung at its start,
            # its memory growing); the times are the same draws in the same order
            def arrive(t: float) -> None:
                ctx.arrive()
                schedule(t)

            def schedule(after: float) -> None:
                t = after + float(rng.exponential(1.0 / self.arrival_rate))
                if t < self.until:
                    ctx.at(t, lambda: arrive(t))

            schedule(0.0)
        if self.departure_rate > 0:
            ctx.departure_rate = self.departure_rate
            ctx.departure_until = self.until
            for i in range(ctx.initial_count):
                ctx.schedule_departure(i, 0.0)


Fault = Crash | CrashRejoin | Pause | PartitionFault | Slow | Churn


_FAULT_FIELDS = {"crash": ("peer", "at"), "crash_rejoin": ("peer", "at", "back"), "pause": ("peer", "start", "end"),
                 "partition": ("sides", "start", "end", "one_way"), "slow": ("peer", "start", "end", "factor")}


def fault_from_dict(d: dict) -> Fault:
    kind = d.get("kind")
    args = {k: v for k, v in d.items() if k != "kind"}
    valid = _FAULT_FIELDS.get(kind) if isinstance(kind, str) else None
    if valid is not None and set(args) - set(valid):
        bad = sorted(set(args) - set(valid))
        raise ValueError(f"unknown field{'s' * (len(bad) > 1)} {', '.join(bad)} in a {kind!r} fault "
                         f"(valid: kind, {', '.join(valid)})")
    try:
        if kind == "crash":
            return Crash(int(args["peer"]), float(args["at"]))
        if kind == "crash_rejoin":
            return CrashRejoin(int(args["peer"]), float(args["at"]), float(args["back"]))
        if kind == "pause":
            return Pause(int(args["peer"]), float(args["start"]), float(args["end"]))
        if kind == "partition":
            a, b = args["sides"]
            one_way = args.get("one_way", False)
            if not isinstance(one_way, bool):
                raise ValueError(f"a partition's one_way must be true or false, got {one_way!r}")
            return PartitionFault((tuple(int(x) for x in a), tuple(int(x) for x in b)),
                                  float(args["start"]), float(args["end"]), one_way)
        if kind == "slow":
            return Slow(int(args["peer"]), float(args["start"]), float(args["end"]), float(args["factor"]))
    except KeyError as e:
        raise ValueError(f"fault {kind!r} needs field {e.args[0]!r}") from None
    raise ValueError(f"unknown fault kind {kind!r} (crash, crash_rejoin, pause, partition, slow)")


class FaultContext:
    """What faults may do to a running scenario; implemented by `sim.scenario.ScenarioRun`."""

    network: Any
    initial_count: int
    departure_rate: float = 0.0
    departure_until: float = float("inf")

    def at(self, t: float, fn: Callable[[], None]) -> None: ...
    def peer(self, index: int) -> Any: ...
    def endpoint(self, index: int) -> str: ...
    def crash(self, index: int) -> None: ...
    def rejoin(self, index: int) -> None: ...
    def arrive(self) -> None: ...
    def schedule_departure(self, index: int, now: float) -> None: ...
    def rng(self, purpose: str) -> np.random.Generator: ...


class SimFaultContext(FaultContext):
    """What the two simulator runs (`sim.scenario.ScenarioRun`, `sim.train.TrainRun`) share: generators
    seeded by (scenario seed, purpose), a SimPy timeline, ``sim://peerN`` endpoints, peers in ``slots``.
    Subclasses set ``sc`` (with a ``seed``), ``env`` and ``slots``."""

    sc: Any
    env: Any
    slots: list

    def rng(self, purpose: str) -> np.random.Generator:
        return np.random.default_rng([self.sc.seed, seed_from(purpose)])

    def at(self, t: float, fn: Callable[[], None]) -> None:
        ev = self.env.timeout(max(0.0, t - self.env.now))
        ev.callbacks.append(lambda _e: fn())

    def peer(self, index: int) -> Any:
        return self.slots[index]

    def endpoint(self, index: int) -> str:
        return f"sim://peer{index}"
