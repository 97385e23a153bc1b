"""Partition math of the butterfly all-reduce: who reduces which span, in which parts.

The flattened vector of ``numel`` elements is cut into one contiguous span per group
member, sized in proportion to the bandwidth each member advertised (bandwidth 0 =
a client that reduces nothing), and every span into parts of at most ``part_elems``
elements. Everything here is pure arithmetic so it can be property-tested alone.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence


__all__ = ["PartPlan", "make_plan", "group_plan", "span_sizes", "span_fractions", "streamed_part_elems", "plan_bandwidths",
           "MIN_PARTS", "MIN_PARTS_UNEVEN", "MIN_PART_BYTES", "MEASURED", "UNMEASURED", "SAME_RATE"]

#: a span is streamed in at least this many parts (when parts stay >= MIN_PART_BYTES): with one part per
#: span a slow host cannot download results while it still uploads, and a part's transfer on the
#: slowest link is the pipeline's tail
MIN_PARTS = 4
MIN_PARTS_UNEVEN = 16
MIN_PART_BYTES = 64 << 10

#: member flags (`messages.MemberInfo.gathers`) of `bandwidth="auto"`: the number is a measured
#: estimate in Mbit/s, or the member has none yet (the number is a placeholder)
MEASURED, UNMEASURED = 4, 8
#: measured rates closer than this ratio count as one rate (the 1 MiB steps of
#: the fidelity matrix read 17-39 Mbit/s on links of 20-100: latency-bound transfers say little) (see `plan_bandwidths`)
SAME_RATE = 1.25


def plan_bandwidths(rates: Sequence[float], flags: Sequence[int]) -> list[float]:
    """The rates a group's plan splits by, from what its members announced (pure; every member
    computes the same list from the same GROUP).

    Declared rates are taken as they are. Measured ones (`MEASURED`) are noisy, and the best split
    magnifies small differences (4 members at 0.9/1/1/1 would own 19/27/27/27 %), so measured
    rates within `SAME_RATE` of their neighbour (sorted) form one class that takes the class's
    lowest rate -- equal links get equal spans. If any member has no estimate yet (`UNMEASURED`),
    every auto member stands at one common rate, the median of the group's other positive
    rates (1.0 if there are none): equal spans until everyone has measured."""
    out = [float(r) for r in rates]
    auto = [i for i, f in enumerate(flags) if f & (MEASURED | UNMEASURED) and out[i] > 0]
    if not auto:
        return out
    if any(flags[i] & UNMEASURED for i in auto):
        known = sorted(out[i] for i in range(len(out)) if out[i] > 0 and not flags[i] & UNMEASURED
                       and i not in auto)
        common = known[len(known) // 2] if known else 1.0
        for i in auto:
            out[i] = common
        return out
    order = sorted(auto, key=lambda i: (out[i], i))
    cls = out[order[0]]
    prev = cls
    for i in order:
        if out[i] >= prev * SAME_RATE:
            cls = out[i]
        prev = out[i]
        out[i] = cls
    return out


def span_fractions(bandwidths: Sequence[float]) -> list[float]:
    """The share of the vector each member reduces, from the link rates they declared.

    In a butterfly all-reduce over n members, a member owning a fraction f of the vector (S
    bytes) sends (1 - f)·S of its data to the others and (n - 1)·f·S of results, and receives
    as much: S·(1 + (n - 2)·f) each way. The split that makes the slowest member finish first
    gives member i ``f_i = max(0, (b_i·tau - 1) / (n - 2))`` (capped at 1), with tau such that
    the fractions sum to 1 -- a slow member may own nothing, since its own data and results
    already fill its link. The split depends only on the ratios of the rates, is found by a
    fixed-length bisection (the same bits on every member) and equals the proportional split
    when all declared rates are equal or the group has at most two members. Clients (0) own
    nothing. See `sim.linkfloor`, which uses the same algebra for the link floor.
    """
    bws = [float(b) for b in bandwidths]
    if not bws or any(not (b >= 0.0) or b == float("inf") for b in bws):
        raise ValueError("bandwidths must be finite and >= 0")
    servers = [b for b in bws if b > 0]
    if not servers:
        raise ValueError("at least one member must have bandwidth > 0 (all are clients)")
    n = len(bws)
    if n <= 2 or min(servers) == max(servers):
        total = sum(bws)
        return [b / total for b in bws]

    def shares(tau: float) -> list[float]:
        return [min(1.0, max(0.0, (b * tau - 1.0) / (n - 2))) if b > 0 else 0.0 for b in bws]

    lo, hi = 1.0 / max(servers), (n - 1.0) / min(servers)  # sum(shares) is 0 at lo and >= 1 at hi
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(shares(mid)) >= 1.0:
            hi = mid
        else:
            lo = mid
    fs = shares(hi)
    total = sum(fs)
    return [f / total for f in fs]


def span_sizes(numel: int, bandwidths: Sequence[float]) -> list[int]:
    """Split `numel` by `span_fractions` (largest-remainder rounding, ties to the lower index)."""
    if numel < 0:
        raise ValueError("numel must be >= 0")
    fracs = span_fractions(bandwidths)
    exact = [numel * f for f in fracs]
    sizes = [int(x) for x in exact]
    short = numel - sum(sizes)
    # hand the leftover elements to the largest fractional remainders among members that own a share
    order = sorted((i for i, f in enumerate(fracs) if f > 0), key=lambda i: (-(exact[i] - sizes[i]), i))
    for k in range(short):
        sizes[order[k % len(order)]] += 1
    return sizes


@dataclass(frozen=True)
class PartPlan:
    """Span boundaries and part size for one group. ``bounds[i]:bounds[i+1]`` is member i's span."""

    numel: int
    bounds: tuple[int, ...]
    part_elems: int

    def __post_init__(self) -> None:
        if self.part_elems <= 0:
            raise ValueError("part_elems must be positive")
        if self.bounds[0] != 0 or self.bounds[-1] != self.numel or list(self.bounds) != sorted(self.bounds):
            raise ValueError("span bounds must be sorted and cover [0, numel)")
        # parts per span, asked for on every message and member loop of a round: computed once
        b, pe = self.bounds, self.part_elems
        object.__setattr__(self, "_nparts", tuple(-(-(b[i + 1] - b[i]) // pe) for i in range(len(b) - 1)))

    @property
    def size(self) -> int:
        return len(self.bounds) - 1

    def span(self, owner: int) -> tuple[int, int]:
        return self.bounds[owner], self.bounds[owner + 1]

    def num_parts(self, owner: int) -> int:
        if owner < 0:
            raise IndexError(f"no span {owner}")
        return self._nparts[owner]  # type: ignore[attr-defined]

    def part(self, owner: int, index: int) -> tuple[int, int]:
        """Absolute element range of part `index` of `owner`'s span."""
        start, end = self.span(owner)
        lo = start + index * self.part_elems
        if not 0 <= index < self.num_parts(owner):
            raise IndexError(f"span {owner} has no part {index}")
        return lo, min(lo + self.part_elems, end)


def streamed_part_elems(numel: int, bandwidths: Sequence[float], part_elems: int, itemsize: int) -> int:
    """The part size a group uses: the configured `part_elems`, capped so that a span of the mean
    size (over members that own a span) holds `MIN_PARTS` parts -- `MIN_PARTS_UNEVEN` when the
    rates or the spans differ by 2x or more -- but never below `MIN_PART_BYTES` (nor above
    `part_elems`). A pure function of what every member knows, so all agree.

    Why more parts on uneven links: a slow member uploads its data to every owner in turn and
    downloads the results as they are reduced, so when its last upload ends, one part per owner
    is still to come back through its slow downlink (measured on the testbed: 0.8 s of a 4.2 s
    step with 4 parts per span at 10 Mbit/s). Even links keep `MIN_PARTS` (on the 64 MiB loopback
    bench smaller parts cost CPU per message).

    E.g. 4 members, 4 MiB parts configured: a 64 MiB tensor keeps 4 MiB parts; a 4 MiB tensor
    streams each 1 MiB span in 4 parts of 256 KiB (in 16 of 64 KiB on uneven links)."""
    rates = [b for b in bandwidths if b > 0]
    fracs = [f for b, f in zip(bandwidths, span_fractions(bandwidths)) if b > 0] if rates else []
    owners = sum(1 for f in fracs if f > 0) if rates else 1
    # uneven: the rates differ by 2x, or the split does (measured rates of uneven links read closer
    # together than the links are -- `linkstats` -- while the split still leaves a member out)
    uneven = bool(rates) and (max(rates) >= 2 * min(rates) or max(fracs) >= 2 * min(fracs))
    cap = -(-numel // (owners * (MIN_PARTS_UNEVEN if uneven else MIN_PARTS)))
    floor = max(1, MIN_PART_BYTES // max(1, itemsize))
    return max(1, min(part_elems, max(cap, floor)))


def make_plan(numel: int, bandwidths: Sequence[float], part_elems: int) -> PartPlan:
    sizes = span_sizes(numel, bandwidths)
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return PartPlan(numel, tuple(bounds), part_elems)


def group_plan(numel: int, bandwidths: tuple[float, ...], part_elems: int, itemsize: int) -> PartPlan:
    """The plan of a group: `make_plan` with the `streamed_part_elems` part size. A pure function of
    what every member knows, so a process hosting many members of one group (the simulator) computes
    it once; the plan is immutable, so sharing it is safe."""
    return _group_plan(numel, bandwidths, part_elems, itemsize, MIN_PARTS, MIN_PARTS_UNEVEN, MIN_PART_BYTES)


@functools.lru_cache(maxsize=256)
def _group_plan(numel: int, bandwidths: tuple[float, ...], part_elems: int, itemsize: int,
                *_constants: int) -> PartPlan:  # the module's constants are in the key: tests change them
    return make_plan(numel, bandwidths, streamed_part_elems(numel, bandwidths, part_elems, itemsize))
