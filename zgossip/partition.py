"""Partition math of the butterfly all-reduce: who reduces which span, in which parts.

The flattened vector of ``numel`` elements is cut into one contiguous span per group
member, sized in proportion to the bandwidth each member advertised (bandwidth 0 =
a client that reduces nothing), and every span into parts of at most ``part_elems``
elements. Everything here is pure arithmetic so it can be property-tested alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


__all__ = ["PartPlan", "make_plan", "span_sizes", "streamed_part_elems", "MIN_PARTS", "MIN_PART_BYTES"]

#: a span is streamed in at least this many parts (when parts stay >= MIN_PART_BYTES): with one part per
#: span a slow host cannot download results while it still uploads, and a part's transfer on the
#: slowest link is the pipeline's tail
MIN_PARTS = 4
MIN_PART_BYTES = 64 << 10


def span_sizes(numel: int, bandwidths: Sequence[float]) -> list[int]:
    """Split `numel` in proportion to `bandwidths` (largest-remainder rounding, ties to the lower index)."""
    if numel < 0:
        raise ValueError("numel must be >= 0")
    bws = [float(b) for b in bandwidths]
    if not bws or any(not (b >= 0.0) or b == float("inf") for b in bws):
        raise ValueError("bandwidths must be finite and >= 0")
    total = sum(bws)
    if total <= 0.0:
        raise ValueError("at least one member must have bandwidth > 0 (all are clients)")
    exact = [numel * b / total for b in bws]
    sizes = [int(x) for x in exact]
    short = numel - sum(sizes)
    # hand the leftover elements to the largest fractional remainders among non-clients
    order = sorted((i for i, b in enumerate(bws) if b > 0), key=lambda i: (-(exact[i] - sizes[i]), i))
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

    @property
    def size(self) -> int:
        return len(self.bounds) - 1

    def span(self, owner: int) -> tuple[int, int]:
        return self.bounds[owner], self.bounds[owner + 1]

    def num_parts(self, owner: int) -> int:
        start, end = self.span(owner)
        return -(-(end - start) // self.part_elems)

    def part(self, owner: int, index: int) -> tuple[int, int]:
        """Absolute element range of part `index` of `owner`'s span."""
        start, end = self.span(owner)
        lo = start + index * self.part_elems
        if not 0 <= index < self.num_parts(owner):
            raise IndexError(f"span {owner} has no part {index}")
        return lo, min(lo + self.part_elems, end)


def streamed_part_elems(numel: int, bandwidths: Sequence[float], part_elems: int, itemsize: int) -> int:
    """The part size a group uses: the configured `part_elems`, capped so that a span of the mean
    size (over members that reduce) holds `MIN_PARTS` parts, but never below `MIN_PART_BYTES`
    (nor above `part_elems`). A pure function of what every member knows, so all agree.

    E.g. 4 members, 4 MiB parts configured: a 64 MiB tensor keeps 4 MiB parts; a 4 MiB tensor
    streams each 1 MiB span in 4 parts of 256 KiB."""
    servers = sum(1 for b in bandwidths if b > 0) or 1
    cap = -(-numel // (servers * MIN_PARTS))
    floor = max(1, MIN_PART_BYTES // max(1, itemsize))
    return max(1, min(part_elems, max(cap, floor)))


def make_plan(numel: int, bandwidths: Sequence[float], part_elems: int) -> PartPlan:
    sizes = span_sizes(numel, bandwidths)
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return PartPlan(numel, tuple(bounds), part_elems)
