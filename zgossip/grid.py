"""Moshpit grid: group keys from virtual grid coordinates (Moshpit SGD, arXiv 2103.03239).

Peers sit at coordinates on a grid of shape ``(M_1, ..., M_d)``. Round ``r`` averages
along axis ``a = r mod d``: peers that share every coordinate except ``a`` meet in one
group. Afterwards the members draw *distinct random* new indices along ``a`` from a
permutation seeded by the group id, so every member computes the same permutation
without another message. On a full grid of ``prod(M)`` peers with no failures, each
group of round ``a`` holds one peer of every group of round ``a-1``, and after ``d``
rounds every peer holds the exact global mean. (Re-indexing by rank alone was measured
to converge more slowly on sparse grids, hence the random permutation.)
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np

__all__ = ["MoshpitGrid", "seed_from"]


def seed_from(text: str) -> int:
    """A 64-bit seed from a string, independent of PYTHONHASHSEED."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class MoshpitGrid:
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(m) for m in self.shape))
        if any(m < 1 for m in self.shape):
            raise ValueError("grid dimensions must be >= 1")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def check(self, coords: tuple[int, ...]) -> tuple[int, ...]:
        coords = tuple(int(c) for c in coords)
        if len(coords) != self.ndim or any(not 0 <= c < m for c, m in zip(coords, self.shape)):
            raise ValueError(f"coordinates {coords} do not fit grid {self.shape}")
        return coords

    def random_coords(self, rng: np.random.Generator) -> tuple[int, ...]:
        return tuple(int(rng.integers(m)) for m in self.shape)

    def axis(self, round_index: int) -> int | None:
        return round_index % self.ndim if self.ndim else None

    def key(self, prefix: str, coords: tuple[int, ...], round_index: int) -> str:
        """Group key for this round: the prefix, the axis, and every other coordinate."""
        axis = self.axis(round_index)
        if axis is None:
            return prefix
        cells = ["*" if i == axis else str(c) for i, c in enumerate(coords)]
        return f"{prefix}/a{axis}/{'.'.join(cells)}"

    def next_coords(self, coords: tuple[int, ...], round_index: int, group_id: str, rank: int) -> tuple[int, ...]:
        """New coordinates after averaging in group `group_id` where this peer had `rank`."""
        axis = self.axis(round_index)
        if axis is None:
            return coords
        perm = _permutation(group_id, self.shape[axis])
        new = list(coords)
        new[axis] = perm[rank % self.shape[axis]]
        return tuple(new)


@functools.lru_cache(maxsize=1024)
def _permutation(group_id: str, size: int) -> tuple[int, ...]:
    """The new indices along a round's axis that group `group_id` hands out by rank: every member of
    the group draws the same ones (a pure function of the id), so a process hosting many members (the
    simulator) draws them once."""
    return tuple(int(x) for x in np.random.default_rng(seed_from(group_id)).permutation(size))
