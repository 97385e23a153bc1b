"""What every step of an `Averager` did: the last few records, running totals, and listeners.

The Averager records each step when its outcome is known (`record_result`, `record_failure`);
monitoring reads it: the Prometheus endpoint (`zgossip.metrics`), the JSON-lines log of
``zgossip peer --log-json`` (a listener), the live table of ``zgossip peer``
(`zgossip.live`). Times are the averager's clock (`zgossip.clock`), so the log works in
virtual time too; the lock comes from that clock.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["StepRecord", "StepLog", "DURATION_BUCKETS"]

#: upper bounds (seconds) of the step-duration histogram (Prometheus `le` buckets; +Inf is implied)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PHASES = ("matchmaking", "allreduce", "settle", "apply")


@dataclass(frozen=True)
class StepRecord:
    """One finished step: its outcome, group and traffic. ``error`` is "" for a step that averaged."""

    index: int  # 0, 1, ... in the order steps finished on this averager
    step_id: str
    at: float  # clock time it finished
    error: str = ""  # the error's class name when the step failed
    message: str = ""  # the error's message
    group_id: str = ""
    key: str = ""
    members: tuple[str, ...] = ()
    contributors: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    left_out: dict = field(default_factory=dict)  # peer id -> how its tensors differ
    complete: bool = False
    bytes_sent: int = 0
    bytes_received: int = 0
    timings: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.error

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (one line of the JSON-lines log)."""
        return {
            "index": self.index, "step_id": self.step_id, "at": self.at, "ok": self.ok, "error": self.error,
            "message": self.message, "group": self.group_id, "key": self.key, "members": list(self.members),
            "group_size": len(self.members), "contributors": list(self.contributors), "lost": list(self.lost),
            "left_out": dict(self.left_out), "complete": self.complete, "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received, "timings": {k: float(v) for k, v in self.timings.items()},
        }


class StepLog:
    """Step records of one averager: the last `keep`, totals since it started, listeners."""

    def __init__(self, lock: Any, keep: int = 64) -> None:
        self._lock = lock
        self._recent: deque[StepRecord] = deque(maxlen=keep)
        self._listeners: list[Callable[[StepRecord], None]] = []
        self._count = 0
        self.outcomes: dict[str, int] = {}  # "ok" or an error class name -> steps
        self.bytes_sent = 0
        self.bytes_received = 0
        self.peers_lost = 0  # groupmates lost, summed over steps
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self.duration_counts = [0] * (len(DURATION_BUCKETS) + 1)  # per bucket (not cumulative); last: > 60 s
        self.duration_sum = 0.0

    def subscribe(self, fn: Callable[[StepRecord], None]) -> None:
        """Call ``fn(record)`` for every step recorded from now on (on whichever thread records it;
        keep it short). An exception in `fn` is not the step's business: it is swallowed."""
        with self._lock:
            self._listeners.append(fn)

    def record_result(self, step_id: str, result: Any, now: float) -> StepRecord:
        return self._add(lambda i: StepRecord(
            i, step_id, now, group_id=result.group_id, key=result.key, members=tuple(result.members),
            contributors=tuple(result.contributors), lost=tuple(result.lost),
            left_out=dict(getattr(result, "left_out", {}) or {}), complete=bool(result.complete),
            bytes_sent=int(result.bytes_sent), bytes_received=int(result.bytes_received),
            timings=dict(result.timings)))

    def record_failure(self, step_id: str, error: BaseException, now: float) -> StepRecord:
        return self._add(lambda i: StepRecord(i, step_id, now, error=type(error).__name__, message=str(error)))

    def _add(self, make: Callable[[int], StepRecord]) -> StepRecord:
        with self._lock:
            rec = make(self._count)
            self._count += 1
            self._recent.append(rec)
            outcome = "ok" if rec.ok else rec.error
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            self.bytes_sent += rec.bytes_sent
            self.bytes_received += rec.bytes_received
            self.peers_lost += len(rec.lost)
            for ph in PHASES:
                self.phase_seconds[ph] += float(rec.timings.get(ph, 0.0))
            if rec.ok and "total" in rec.timings:
                total = float(rec.timings["total"])
                self.duration_sum += total
                k = next((i for i, b in enumerate(DURATION_BUCKETS) if total <= b), len(DURATION_BUCKETS))
                self.duration_counts[k] += 1
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(rec)
            except Exception:  # a broken monitor must not break averaging
                pass
        return rec

    @property
    def count(self) -> int:
        return self._count

    def recent(self, n: int | None = None) -> list[StepRecord]:
        """The last `n` records (all kept ones by default), oldest first."""
        with self._lock:
            out = list(self._recent)
        return out if n is None else out[-n:] if n > 0 else []

    def totals(self) -> dict[str, Any]:
        """A consistent copy of the running totals."""
        with self._lock:
            return {"steps": self._count, "outcomes": dict(self.outcomes), "bytes_sent": self.bytes_sent,
                    "bytes_received": self.bytes_received, "peers_lost": self.peers_lost,
                    "phase_seconds": dict(self.phase_seconds), "duration_counts": list(self.duration_counts),
                    "duration_sum": self.duration_sum}
