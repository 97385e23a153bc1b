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

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from zgossip.grid import seed_from

from .network import Partition, SlowLink

log = logging.getLogger(__name__)

__all__ = ["Fault", "Crash", "CrashRejoin", "Pause", "PartitionFault", "Slow", "Churn", "fault_from_dict",
           "check_pause_windows", "warn_unfired"]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _check_time(kind: str, name: str, t: float) -> None:
    # a time before 0 would fire at 0 (`SimFaultContext.at`): a typo, not a wish
    if not _is_number(t) or not 0 <= t < math.inf:
        raise ValueError(f"{kind}: {name} must be a time >= 0 seconds, not {t!r}")


def _time(kind: str, name: str, v: Any) -> float:
    """A fault's time field as float seconds, or a ValueError naming it ("soon" said only "could not
    convert string to float: 'soon'", naming neither the fault nor the field)."""
    _check_time(kind, name, v)
    return float(v)


def _slot(kind: str, v: Any, name: str = "peer") -> int:
    """A peer slot: a whole number (int() made 1.7 peer 1 and true peer 1, silently)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{kind}: {name} must be a peer index (a whole number >= 0), not {v!r}")
    return int(v)


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
        if not _is_number(self.factor) or not 0 < self.factor < math.inf:  # the link's rate is divided by it
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
            if not _is_number(rate) or not 0 <= rate < math.inf:  # a negative rate was taken as no churn at all
                raise ValueError(f"churn: {name} must be a finite rate >= 0 per second, not {rate!r}")
        if not _is_number(self.until) or not self.until >= 0:
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
    if not isinstance(d, dict):  # `[faults]` for `[[faults]]`, or `faults = [...]` of numbers or strings
        raise ValueError(f"each [[faults]] entry is a table with a kind ({', '.join(_FAULT_FIELDS)}) and its "
                         f"fields, not {d!r}")
    kind = d.get("kind")
    args = {k: v for k, v in d.items() if k != "kind"}
    valid = _FAULT_FIELDS.get(kind) if isinstance(kind, str) else None
    if valid is not None and set(args) - set(valid):
        bad = sorted(set(args) - set(valid))
        raise ValueError(f"unknown field{'s' * (len(bad) > 1)} {', '.join(bad)} in a {kind!r} fault "
                         f"(valid: kind, {', '.join(valid)})")
    try:
        if kind == "crash":
            return Crash(_slot(kind, args["peer"]), _time(kind, "at", args["at"]))
        if kind == "crash_rejoin":
            return CrashRejoin(_slot(kind, args["peer"]), _time(kind, "at", args["at"]), _time(kind, "back", args["back"]))
        if kind == "pause":
            return Pause(_slot(kind, args["peer"]), _time(kind, "start", args["start"]), _time(kind, "end", args["end"]))
        if kind == "partition":
            sides = args["sides"]
            if not (isinstance(sides, (list, tuple)) and len(sides) == 2
                    and all(isinstance(side, (list, tuple)) for side in sides)):
                raise ValueError(f"partition: sides must be two lists of peer indices, e.g. [[0, 1], [2, 3]], "
                                 f"not {sides!r}")
            if not sides[0] or not sides[1] or set(sides[0]) & set(sides[1]):  # (cut nothing, silently)
                raise ValueError(f"partition: sides must be two non-empty lists with no peer on both, not {sides!r}")
            one_way = args.get("one_way", False)
            if not isinstance(one_way, bool):
                raise ValueError(f"a partition's one_way must be true or false, got {one_way!r}")
            return PartitionFault((tuple(_slot(kind, x, "sides") for x in sides[0]),
                                   tuple(_slot(kind, x, "sides") for x in sides[1])),
                                  _time(kind, "start", args["start"]), _time(kind, "end", args["end"]), one_way)
        if kind == "slow":
            factor = args["factor"]
            if not _is_number(factor):
                raise ValueError(f"slow: factor must be a number > 0, not {factor!r}")
            return Slow(_slot(kind, args["peer"]), _time(kind, "start", args["start"]), _time(kind, "end", args["end"]),
                        float(factor))
    except KeyError as e:
        raise ValueError(f"fault {kind!r} needs field {e.args[0]!r}") from None
    raise ValueError(f"unknown fault kind {kind!r} (crash, crash_rejoin, pause, partition, slow)")


def check_pause_windows(faults: list[Fault]) -> None:
    """Pauses of one peer must not overlap: a pause's end resumes the process whatever other pause is
    on, so [0.5, 3] with [1, 2] ran the peer again from 2 s, silently cutting the first window short."""
    by_peer: dict[int, list[Pause]] = {}
    for f in faults:
        if isinstance(f, Pause):
            by_peer.setdefault(f.peer, []).append(f)
    for peer, pauses in sorted(by_peer.items()):
        pauses.sort(key=lambda p: (p.start, p.end))
        for a, b in zip(pauses, pauses[1:]):
            if b.start < a.end:
                raise ValueError(f"pause faults on peer {peer} overlap ([{a.start:g}, {a.end:g}] and "
                                 f"[{b.start:g}, {b.end:g}]): give one pause from {a.start:g} to {max(a.end, b.end):g}")


def check_after_crash(faults: list[Fault]) -> None:
    """A `crash` is for good: a later fault of that peer (a crash_rejoin brought it back; a pause's end
    would resume it; a slow link or a second crash act on nothing) contradicts it. A peer that comes
    back is a `crash_rejoin`."""
    first: dict[int, Crash] = {}
    for f in faults:
        if isinstance(f, Crash) and (f.peer not in first or f.at < first[f.peer].at):
            first[f.peer] = f
    crashed = {peer: f.at for peer, f in first.items()}
    for f in faults:
        peer = getattr(f, "peer", None)
        t = getattr(f, "at", getattr(f, "start", None))
        if peer in crashed and t is not None and t >= crashed[peer] and f is not first[peer]:
            kind = {Crash: "crash", CrashRejoin: "crash_rejoin", Pause: "pause", Slow: "slow"}.get(type(f), "fault")
            raise ValueError(f"peer {peer} crashes for good at {crashed[peer]:g} s, yet a {kind} fault of it comes at "
                             f"{t:g} s (a peer that comes back is a crash_rejoin: crash at one time, back at another)")


def warn_unfired(faults: list[dict], now: float) -> None:
    """Warn of each fault (as the scenario gives them) whose time comes at or after `now`, the end of a
    run: how long a run's rounds or steps take is known only once they ran, and a fault timed past the
    end (crash at = 100 in a run over at 8 s) left a run without it, looking like one with it."""
    for given in faults:
        f = fault_from_dict(given)
        t = getattr(f, "at", getattr(f, "start", None))
        if t is not None and t >= now:
            log.warning("the %s fault at t = %g s never took effect: the run ended at t = %.3f s "
                        "(the times of faults are virtual seconds from the start, bootstrap included)",
                        given["kind"], t, now)


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
        """The peer in slot `index`; a fault naming a slot that churn has not filled by the time it fires
        is refused by name (it raised a bare "list index out of range" once the run had got that far)."""
        if not 0 <= index < len(self.slots):
            raise ValueError(f"a fault names peer {index}, but at t = {self.env.now:.3f} s only peers "
                             f"0..{len(self.slots) - 1} have joined (the initial peers and churn's arrivals)")
        return self.slots[index]

    def endpoint(self, index: int) -> str:
        return f"sim://peer{index}"
