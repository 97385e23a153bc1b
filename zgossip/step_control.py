"""Step control: the Future of ``Averager.step(wait=False)``, with the step's stage, and for a
scheduled step ``trigger()`` (hivemind's ``StepControl``, more simply).

    ctl = avg.step(scheduled_time=avg.clock.now() + 2.0, wait=False)   # matchmaking starts early
    ...                                                                 # finish the batch meanwhile
    ctl.trigger()            # snapshot the tensors now; the all-reduce begins as soon as grouped
    result = ctl.result()    # or ctl.cancel(): True while the all-reduce has not begun

Stages (`StepStage`), in order: SCHEDULED (waiting for ``scheduled_time - matchmaking_time``),
MATCHMAKING, AWAITING_TRIGGER (grouped; a triggered step skips it), RUNNING_ALLREDUCE, FINISHED
(done, failed or cancelled). The stage is updated where the node lives; read it as a hint (it may
move on right after you read it), and rely on ``cancel()``'s answer, which is decided there.

This module owns only the user-facing object; what each stage means for the group is in
`zgossip.node` (held steps) and `zgossip.averager` (snapshots and write-back).
"""
from __future__ import annotations

import concurrent.futures as cf
import math
from enum import Enum
from typing import TYPE_CHECKING, Any

from .messages import MAX_WEIGHT
from .wire import check_gather

if TYPE_CHECKING:  # pragma: no cover
    from .averager import Averager

__all__ = ["StepStage", "StepFuture", "StepControl", "check_weight"]


def check_weight(value: Any) -> float:
    """A step's weight as a float, or ValueError: finite, > 0 and at most `MAX_WEIGHT` (1e30),
    the most a PART or GATHER carries (a larger one would be refused when the round sends it)."""
    if isinstance(value, (bool, str, bytes)):  # float() takes them, but "1" or True is a caller's slip, not a weight
        raise ValueError(f"weight must be a number, not {type(value).__name__}")
    try:
        w = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"weight must be a number, not {type(value).__name__}") from None
    if w == 0.0:  # what a peer with no data of its own is, not a step's weight
        raise ValueError("weight must be > 0, not 0: a step brings this peer's data; a peer that brings none "
                         "averages as Averager(auxiliary=True), and a peer with nothing this time can skip the step")
    if not (w > 0.0 and math.isfinite(w)):
        raise ValueError(f"weight must be a finite number > 0, not {w!r}")
    if w > MAX_WEIGHT:
        raise ValueError(f"weight {w:g} is above {MAX_WEIGHT:g}, the most a step's weight may be (peers refuse more); "
                         "scale the weights of every peer down alike")
    return w


class StepStage(Enum):
    SCHEDULED = "scheduled"
    MATCHMAKING = "matchmaking"
    AWAITING_TRIGGER = "awaiting_trigger"
    RUNNING_ALLREDUCE = "running_allreduce"
    FINISHED = "finished"


#: node phase (zgossip.node.StepPhase value) -> the stage users see
_OF_PHASE = {"scheduled": StepStage.SCHEDULED, "matchmaking": StepStage.MATCHMAKING,
             "grouped": StepStage.AWAITING_TRIGGER, "averaging": StepStage.RUNNING_ALLREDUCE}


class StepFuture(cf.Future):
    """The Future of ``step(wait=False)`` (also called `StepControl`).

    ``cancel()`` really cancels: while the step has not begun its all-reduce (scheduled,
    matchmaking, or grouped and awaiting its trigger) it is dropped -- the node leaves
    matchmaking, or tells its groupmates at once (ABORT) so they average without it; the tensors
    stay untouched; the averager is free for the next step -- and ``cancel()`` returns True. Once
    the all-reduce began (groupmates count on this peer's data) or the step finished, it returns
    False and the step runs to its end as usual.

    ``trigger()`` (scheduled steps; a no-op on others, which start triggered): snapshot the
    tensors now and let the all-reduce begin as soon as the step has a group. ``weight`` and
    ``gather`` may be changed until then (what matchmaking announced must hold: a weight stays
    non-zero, a gather stays given or None).
    """

    def __init__(self, averager: "Averager", step_id: str, *, held: bool = False, weight: float = 1.0,
                 gather: Any = None, scheduled_time: float | None = None, waits: bool = False) -> None:
        super().__init__()
        self._averager = averager
        self.step_id = step_id
        self.scheduled_time = scheduled_time
        self._held = held
        self._weight = weight
        self._gather = gather
        self._triggered = not held
        # SCHEDULED only while matchmaking waits for its time (`waits`); a held step with no time, or one in
        # the past, starts matchmaking at once, as the node will report (a hint until it does)
        self._phase = StepStage.SCHEDULED if held and waits else StepStage.MATCHMAKING
        self._reached_allreduce = False
        self._lock = averager.clock.lock()  # one trigger at a time (the user's, or the scheduled one)

    @property
    def stage(self) -> StepStage:
        return StepStage.FINISHED if self.done() else self._phase

    @property
    def triggered(self) -> bool:
        return self._triggered

    @property
    def reached_allreduce(self) -> bool:
        """Whether the all-reduce began (then groupmates count on this peer's data, and a failure is
        the round's, not matchmaking's)."""
        return self._reached_allreduce

    @property
    def weight(self) -> float:
        return self._weight

    @weight.setter
    def weight(self, value: float) -> None:
        self._check_settable("weight")
        self._weight = check_weight(value)

    @property
    def gather(self) -> Any:
        return self._gather

    @gather.setter
    def gather(self, value: Any) -> None:
        self._check_settable("gather")
        if (value is None) != (self._gather is None):
            raise ValueError("gather must stay None, or stay given, as it was when the step was scheduled "
                             "(matchmaking announced it)")
        self._gather = check_gather(value)

    def _check_settable(self, what: str) -> None:
        if self._triggered or self.done():
            raise RuntimeError(f"{what} can only change before the step is triggered")

    def trigger(self) -> None:
        """Snapshot the tensors now; the all-reduce begins as soon as this step has a group.
        Idempotent; does nothing once the step is triggered, cancelled or finished."""
        with self._lock:
            if self._triggered or self.done():
                return
            self._triggered = True
            self._averager._trigger(self)

    allow_allreduce = trigger  # hivemind's name

    @property
    def began_allreduce(self) -> bool:  # hivemind's name
        return self._reached_allreduce

    def cancel(self) -> bool:
        if self.done():
            return super().cancel()  # False unless already cancelled
        if not self._averager._drop_matchmaking(self.step_id):
            return False
        return super().cancel()

    def _set_phase(self, phase: str) -> None:
        stage = _OF_PHASE.get(phase)
        if stage is not None:
            self._phase = stage
            if stage is StepStage.RUNNING_ALLREDUCE:
                self._reached_allreduce = True

    def __repr__(self) -> str:
        return f"<StepControl {self.step_id} {self.stage.value}{' triggered' if self._triggered else ''}>"


StepControl = StepFuture
