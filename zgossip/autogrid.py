"""``grid="auto"``: the Moshpit grid's shape follows the gossiped estimate of the swarm's size.

On a full grid of M_1 x ... x M_d peers, d rounds reach the exact global mean (Moshpit SGD,
arXiv 2103.03239); a grid sized for 16 peers leaves a swarm of 512 far from the mean after d
rounds, and one sized for 512 splits a swarm of 16 into lines of one or two. So the shape is
derived, deterministically, from one number every peer can agree on:

* **Estimate.** Each node counts the live peers of its prefix in its membership view (itself
  and client-mode peers included) and quantises the count to a power of two, with hysteresis: it moves only once the
  count is more than 2^0.75 (x1.68) away from the current value, so a swarm near a boundary does
  not flip between shapes (`quantise`). It announces that value (`zgossip.announce`).
* **Agreement.** The swarm's size is the *largest* value that at least two live peers of the
  prefix announced, or this node's own if larger (`swarm_size`): gossip spreads a maximum in a
  few intervals, so peers converge on one value even though their views differ; as a swarm
  shrinks, each survivor's own count drops once it has expired the dead (``peer_timeout``), and
  with it the maximum. The maximum of single announcements let one peer set everyone's shape: a
  peer announcing 2^30 put a swarm of 8 (target 4) on a 15-axis grid, where no step ever found a
  group; the value of one peer alone is never adopted.
* **Shape** (`shape_for`): no grid while the swarm fits one group (size <= target); else
  d = ceil(log2(size) / floor(log2(target))) axes, the size's bits split as evenly as possible
  (larger axes first): 512 peers with target 16 -> (8, 8, 8); 64 -> (8, 8); 32 -> (8, 4).
* **When.** A node re-derives the shape at round boundaries only (when a round ends and when a
  step begins), never inside a round; on a change it draws new random coordinates on the new
  grid (`Node._resize_grid`). The key of a round names the axis and the other coordinates but
  not the shape, so peers that still disagree about the shape meet whenever their keys coincide
  (same number of axes); the others form smaller groups on their own keys for a round or two
  until the maximum has spread -- no peer waits for a shape it will never use, since the key it
  announces is the one of the shape it will use.
"""
from __future__ import annotations

import math
from typing import Iterable

__all__ = ["quantise", "shape_for", "swarm_size", "HYSTERESIS"]

HYSTERESIS = 0.25  # in log2 units beyond the half-way point between two powers of two


def quantise(count: int, current: int = 0) -> int:
    """`count` live peers as a power of two; `current` (a power of two, 0 = none yet) is kept
    while log2(count) stays within 0.5 + HYSTERESIS of log2(current)."""
    count = max(1, int(count))
    if current > 0 and abs(math.log2(count) - math.log2(current)) < 0.5 + HYSTERESIS:
        return current
    return 1 << max(0, round(math.log2(count)))


def shape_for(size: int, target_group_size: int) -> tuple[int, ...]:
    """The grid for a swarm of `size` (a power of two) peers and groups of at most
    `target_group_size`: () when one group holds them all, else the fewest axes of at most
    2^floor(log2(target)) each whose product is `size`, as even as possible."""
    if size <= target_group_size or target_group_size < 2:
        return ()
    bits = max(1, round(math.log2(size)))
    per_axis = int(math.log2(target_group_size))
    d = -(-bits // per_axis)
    split = [bits // d + (1 if i < bits % d else 0) for i in range(d)]
    return tuple(1 << b for b in split)


def swarm_size(own: int, announced: Iterable[int]) -> int:
    """The swarm's size as every peer will eventually agree on it: the largest value that at least
    two other peers announced (one peer alone cannot set it), or this node's own if larger."""
    top = sorted(announced, reverse=True)[:2]
    return max(own, top[1]) if len(top) == 2 else own
