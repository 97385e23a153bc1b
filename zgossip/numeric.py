"""Numeric policy of the all-reduce: what a reducer does with numbers that are unfit to average.

The all-reduce (`zgossip.allreduce`) decides *whose* terms go into a part and in which order;
this module decides *when* to add them and what a bad number does to the part. It knows
nothing of peers or messages, only terms, weights and buffers, and the arithmetic itself is in
`zgossip.kernels`. The rules:

* **Fixed order, partial runs.** Terms are added in member order (float addition is not
  associative). A reducer adds the terms at hand once all are in, or once `MIN_RUN` consecutive
  terms are, to a partial sum in scratch space (`plan_pass`).
* **Weights are relative.** A reducer divides every weight of a part by one power of two (its
  exponent chosen at the part's first pass, `weight_exponent`), so that the largest weight of the
  part's first `MIN_RUN` terms lies in [1, 2): scaling by a power of two is exact, so weights of
  1 keep their bits, and weights of 1e30 or 1e-300 (past float32's range, where the sum is taken)
  give the mean weights of 1 would (to float32 rounding) -- instead of a sum that overflows or a
  weight that rounds to 0. Those terms are the first `MIN_RUN` in member order that the part
  expects, whatever arrived first, so the exponent does not depend on arrival order. A later
  weight over ~2**127 times theirs cannot be held in float32: the part is given up, as for an
  overflow (and one under ~2**-149 times theirs counts as 0).
* **A mean over one member is no mean.** If every other term is gone, ``x*w/w`` would not always
  give ``x`` back to the last bit: the part is left unchanged for that member too.
* **NaN/inf in a term.** The pass stops at the first block holding one (`kernels.accumulate`
  checks block by block). The member whose term it is gets left out (the caller excludes it from
  the span, or leaves its own data out of this part); if nothing of the pass was stored yet, the
  pass is redone without it, otherwise the part is *given up*: left unchanged for everyone --
  except the blocks an owner's last pass already stored in its own tensor, which hold the mean
  over the pass's terms (`PassVerdict.kept`).
* **Overflow.** Finite terms whose divided sum is not finite: the part is given up alike.
* **Results.** A result from a reducer is taken up to its first non-finite block; the rest stays
  unchanged (`take_finite`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import numpy as np

from .kernels import OVERFLOW, accumulate, copy_finite, finish_mean

__all__ = ["MIN_RUN", "PassPlan", "plan_pass", "weight_exponent", "scaled", "PassVerdict", "add_pass", "divide",
           "take_finite"]

# An owner adds the terms of a part in one pass once all of them are in, which reads each term
# once and writes the mean once, straight into its own tensor. In large groups it does not hold
# every term that long: as soon as this many consecutive terms (in member order) are at hand, it
# adds them to a partial sum in scratch space. (Adding terms as they came, in passes of two or
# three, was measured 2-4% slower on the 4-peer bench: every pass reads and writes the partial sum.)
MIN_RUN = 4


class PassPlan(Enum):
    WAIT = "wait"  # too few terms at hand: wait for more
    FINISH = "finish"  # nothing left to add: the part's sum is complete (divide, if not done yet)
    ALONE = "alone"  # the only term of the whole part: leave the part unchanged
    SUM = "sum"  # add the terms at hand now


def plan_pass(nterms: int, complete: bool, first: bool) -> PassPlan:
    """What to do with `nterms` consecutive terms at hand; `complete`: no term after them is still
    expected; `first`: nothing has been added to this part yet."""
    if not nterms:
        return PassPlan.FINISH if complete else PassPlan.WAIT
    if not complete and nterms < MIN_RUN:
        return PassPlan.WAIT
    if complete and first and nterms == 1:
        return PassPlan.ALONE
    return PassPlan.SUM


def weight_exponent(weights: Sequence[float]) -> int:
    """The power of two (its exponent) a part's weights are divided by, from the weights of its first
    pass in member order: the largest of the first `MIN_RUN` of them becomes a number in [1, 2)."""
    return math.frexp(max(weights[:MIN_RUN]))[1] - 1


def scaled(weight: float, exponent: int) -> float:
    """``weight / 2**exponent``: exact in float64 (and, above 2**-126, in float32)."""
    return math.ldexp(weight, -exponent)


@dataclass(frozen=True, slots=True)
class PassVerdict:
    """How a pass went. `ok`: every term was added (and divided, if asked). Otherwise `bad_term`
    is the index, in the pass, of the first term holding NaN/inf (None for an overflow), and
    `give_up` says why the part must be left unchanged -- None when the pass can simply be redone
    without that term. `kept`: leading elements of `out` that already hold the mean over the pass's
    terms (only when `out` is not the scratch space)."""

    ok: bool
    bad_term: int | None = None
    give_up: str | None = None
    kept: int = 0


_OK = PassVerdict(True)


def add_pass(out: np.ndarray, scratch: np.ndarray, terms: Sequence[np.ndarray], weights: Sequence[float],
             first: bool, divisor: float) -> PassVerdict:
    """Add `terms` (in order, weighted) to the partial sum in `scratch` (ignored when `first`) and
    store the result in `out`, divided by `divisor` unless it is 0. `out` is `scratch`, or the
    owner's own tensor for the last pass (its mean is stored there directly)."""
    top = float(np.finfo(out.dtype).max)
    if divisor > top or max(weights) > top:  # weights more than ~2**127 apart (`weight_exponent`): nothing stored
        return PassVerdict(False, None, f"the weights differ by more than {out.dtype} can hold")
    verdict, bad_at = accumulate(out, terms, weights, first, divisor, src=scratch)
    if verdict == -1:
        return _OK
    # what was stored before the bad block: in scratch space it is a spoiled sum unless it is to
    # be overwritten anyway (`first`); in our tensor it is the mean over these terms
    kept = bad_at if out is not scratch else 0
    if verdict == OVERFLOW:
        return PassVerdict(False, None, "the sum of finite terms overflowed", kept)
    if bad_at > 0 and (out is not scratch or not first):
        return PassVerdict(False, verdict, "it was partly summed before the bad block", kept)
    return PassVerdict(False, verdict)  # nothing of the pass counts: redo it without the bad term


def divide(acc: np.ndarray, wsum: float) -> str | None:
    """Divide a complete sum whose last term never came (so the division was not fused into it);
    returns why the part must be given up (the mean overflowed), or None."""
    if wsum > float(np.finfo(acc.dtype).max):  # as the element type, inf: x / inf would be a "mean" of zeros
        return f"the weights differ by more than {acc.dtype} can hold"
    return None if finish_mean(acc, wsum) else "the sum of finite terms overflowed"


def take_finite(dst: np.ndarray, result: np.ndarray) -> int:
    """Copy a reducer's result into `dst` up to its first block holding NaN/inf; returns how many
    elements were taken (all of them when it is finite)."""
    return copy_finite(dst, result)
