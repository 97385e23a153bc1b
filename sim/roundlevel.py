"""Round-level model of group averaging: who is available, who meets, what they average — no messages.

The message-level simulator (`sim.driver`) runs the real protocol and costs real
messages; this module keeps only what decides the *values*: per round, which peers
are available, how they are cut into groups, and the group means. It is vectorized
over peers and groups (argsort / reduceat / fancy indexing — no Python loop over
peers or groups), so sweeps of 10^5-10^6 peers are cheap: see
``python -m sim.roundlevel --bench``.

Methods, one round each:

* ``moshpit`` — peers sit on a grid of shape ``(M_1, ..., M_d)``; round ``r`` uses
  axis ``a = r mod d``, and peers sharing every coordinate except ``a`` (one grid
  line, one matchmaking key) meet. A line of ``n`` available peers is cut
  (``cut="even"``, the default) like `zgossip.matchmaking.Matchmaker._close_pool`
  cuts a pool: ``g = ceil(n / target)`` near-equal groups, fewer if that would make
  groups smaller than ``min_group_size``; a line with fewer than ``min_group_size``
  peers meets nobody. ``cut="fill"`` mirrors the real matchmaker's early close
  instead (groups of a full line's size as peers arrive, then the remainder); the
  two differ only on lines holding more peers than one group.
  After averaging, the members of a group take *distinct* new indices along ``a``:
  member of rank ``k`` takes ``perm[k mod M_a]`` of a random permutation of
  ``range(M_a)`` drawn for the group (`distinct_indices`).
  `zgossip.grid.MoshpitGrid.next_coords` draws the same kind of permutation, seeded
  by the group id; `perms_from_group_ids` reproduces it exactly, for cross-checks. Unavailable or unmatched peers keep
  their value and their coordinates. The axis is the swarm's round, not a per-peer
  counter: a peer that skips a round rejoins on the swarm's current axis.
* ``random`` — every round the available peers are shuffled and cut into
  ``ceil(n / group_size)`` near-equal groups.
* ``allreduce`` — one group of everybody; it succeeds (everyone gets the exact
  mean) only in a round where no peer is unavailable, otherwise nothing changes.
* ``ring`` — synchronous gossip on a fixed ring (peer ``i`` next to ``i-1`` and
  ``i+1`` mod N) with Metropolis-Hastings weights: every edge whose two ends are
  available moves ``1/3`` of the difference, ``x_i += sum_j (x_j - x_i) / 3`` over
  available neighbours ``j``. With everyone available that is
  ``x_i = (x_{i-1} + x_i + x_{i+1}) / 3``. The weight matrix is symmetric and doubly
  stochastic, so the global mean is preserved and unavailable peers keep their value.

Metric: squared Euclidean distance of each peer's value to the true global average
(the mean over *all* peers at round 0); `distance_to_truth` returns its mean over
peers (the MSE) and its max.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

import numpy as np

from zgossip.grid import seed_from

__all__ = [
    "Method", "Groups", "RoundRecord", "RoundLevelSwarm",
    "draw_available", "place_on_grid", "line_keys", "moshpit_groups", "random_groups",
    "random_permutations", "distinct_indices", "perms_from_group_ids", "next_coords", "average_in_groups",
    "ring_gossip", "allreduce_all_or_nothing", "distance_to_truth", "bench",
]


class Method(str, Enum):
    MOSHPIT = "moshpit"
    RANDOM_GROUPS = "random"
    ALL_REDUCE = "allreduce"
    RING = "ring"


@dataclass(frozen=True)
class Groups:
    """Who met in one round, in CSR form.

    ``members`` lists peer indices group after group, each group in rank order;
    group ``g`` is ``members[starts[g] : starts[g] + sizes[g]]``. Peers absent from
    ``members`` met nobody this round.
    """

    members: np.ndarray
    sizes: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", np.asarray(self.members, dtype=np.int64).reshape(-1))
        object.__setattr__(self, "sizes", np.asarray(self.sizes, dtype=np.int64).reshape(-1))
        if self.sizes.size and self.sizes.min() < 1:
            raise ValueError("every group needs at least one member")
        if int(self.sizes.sum()) != self.members.size:
            raise ValueError(f"group sizes add up to {int(self.sizes.sum())}, but {self.members.size} members are listed")

    @classmethod
    def from_lists(cls, groups: Sequence[Sequence[int]]) -> "Groups":
        """Groups from Python lists of peer indices (each in rank order)."""
        members = np.fromiter((i for g in groups for i in g), dtype=np.int64)
        return cls(members, np.array([len(g) for g in groups], dtype=np.int64))

    @property
    def n_groups(self) -> int:
        return int(self.sizes.size)

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.sizes) - self.sizes

    def group_index(self) -> np.ndarray:
        """For each entry of ``members``: the index of its group."""
        return np.repeat(np.arange(self.n_groups), self.sizes)

    def ranks(self) -> np.ndarray:
        """For each entry of ``members``: its rank inside its group."""
        return np.arange(self.members.size) - np.repeat(self.starts, self.sizes)

    def validate(self, n_peers: int) -> None:
        """Raise unless every member is a peer index in range and appears once (for groups fed from outside)."""
        if self.members.size and (self.members.min() < 0 or self.members.max() >= n_peers):
            raise ValueError(f"group members must be peer indices in [0, {n_peers})")
        if np.bincount(self.members, minlength=n_peers).max(initial=0) > 1:
            raise ValueError("a peer appears in two groups, or twice in one group")

    def as_sets(self) -> set[frozenset[int]]:
        """The partition as a set of frozensets (for tests on small scenarios)."""
        return {frozenset(int(i) for i in g) for g in np.split(self.members, np.cumsum(self.sizes)[:-1])} if self.n_groups else set()


# ----------------------------------------------------------------------------- availability and placement
def draw_available(rng: np.random.Generator, n_peers: int, p_unavailable: float) -> np.ndarray:
    """Each peer independently unavailable with probability ``p_unavailable`` (the Moshpit paper's fault model)."""
    if not 0.0 <= p_unavailable <= 1.0:
        raise ValueError("p_unavailable must be in [0, 1]")
    if p_unavailable == 0.0:
        return np.ones(n_peers, dtype=bool)
    return rng.random(n_peers) >= p_unavailable


def place_on_grid(n_peers: int, shape: Sequence[int], rng: np.random.Generator, placement: str = "distinct") -> np.ndarray:
    """Initial grid coordinates, shape ``(n_peers, len(shape))``.

    ``distinct``: peers take distinct cells chosen uniformly at random (when there are
    more peers than cells, every cell is used ``floor`` or ``ceil`` of ``n/cells``
    times). No line then holds more than ``M_a`` peers, so with ``target >= M_a``
    every line is one group; a full grid is exactly the paper's setting.
    ``iid``: every coordinate uniform and independent — what a `zgossip` node does
    when it is given no ``grid_coords`` — so cells can collide and lines can be
    overfull.
    """
    shape = tuple(int(m) for m in shape)
    if not shape:
        raise ValueError("a Moshpit grid needs at least one axis")
    if placement == "iid":
        return np.stack([rng.integers(0, m, size=n_peers) for m in shape], axis=1).astype(np.int64)
    if placement != "distinct":
        raise ValueError("placement must be 'distinct' or 'iid'")
    cells = math.prod(shape)
    full, rest = divmod(n_peers, cells)
    flat = [rng.permutation(cells) for _ in range(full)]  # loop over whole grid fillings, not peers
    flat.append(rng.choice(cells, size=rest, replace=False))
    return np.stack(np.unravel_index(np.concatenate(flat), shape), axis=1).astype(np.int64)


def line_keys(coords: np.ndarray, shape: Sequence[int], axis: int) -> np.ndarray:
    """One int64 per peer naming its grid line along ``axis`` (every coordinate but ``axis``)."""
    strides = np.cumprod((1,) + tuple(int(m) for m in shape[:0:-1]))[::-1].astype(np.int64)
    strides = strides.copy()
    strides[axis] = 0
    return coords @ strides


# ----------------------------------------------------------------------------- group formation
def _cut_lines(order: np.ndarray, line_counts: np.ndarray, target: int, min_size: int, line_size: int,
               cut: str) -> Groups:
    """Cut runs of consecutive peers (one run per line, in ``order``) into groups.

    ``even`` (per line of ``n``): ``g = max(1, min(ceil(n/target), n // min_size))``
    near-equal groups, i.e. the largest count <= ceil(n/target) whose groups hold
    >= min_size peers, as `Matchmaker._close_pool` cuts a pool when its window
    closes; ``n < min_size``: no group; ``g == 1 and n > target``: one group of the
    first ``target``, the rest meet nobody.

    ``fill``: what zgossip's matchmaker does with ``straggler_grace=0``, where the rendezvous
    peer closes a group as soon as ``full = max(min_size, min(target, M_axis))`` peers joined
    (`Matchmaker.on_join`; by default it waits ``straggler_grace`` and then cuts evenly): ``n // full`` groups of ``full`` in arrival order, then
    the remainder ``r`` as one group at window close if ``r >= min_size``, else the
    remainder meets nobody. The two agree unless a line holds more than ``full``
    peers (possible once cells collide: i.i.d. placement, or faults).
    """
    n = line_counts
    if cut == "even":
        g = np.maximum(1, np.minimum(-(-n // target), n // min_size))
        g[n < min_size] = 0
        used = np.where(g == 0, 0, np.where((g == 1) & (n > target), target, n))
        gl = np.maximum(g, 1)
        base, extra = used // gl, used % gl
        line_of_group = np.repeat(np.arange(n.size), g)
        j = np.arange(line_of_group.size) - np.repeat(np.cumsum(g) - g, g)
        sizes = base[line_of_group] + (j < extra[line_of_group])
    elif cut == "fill":
        full = max(min_size, min(target, line_size))
        k, r = n // full, n % full
        tail = r >= min_size
        g = k + tail
        used = k * full + np.where(tail, r, 0)
        line_of_group = np.repeat(np.arange(n.size), g)
        j = np.arange(line_of_group.size) - np.repeat(np.cumsum(g) - g, g)
        sizes = np.where(j < k[line_of_group], full, r[line_of_group])
    else:
        raise ValueError("cut must be 'even' or 'fill'")
    line_starts = np.cumsum(n) - n
    pos = np.arange(order.size) - np.repeat(line_starts, n)
    members = order[pos < np.repeat(used, n)]
    return Groups(members, sizes)


def moshpit_groups(coords: np.ndarray, shape: Sequence[int], round_index: int, available: np.ndarray,
                   rng: np.random.Generator, *, target_group_size: int, min_group_size: int = 2,
                   cut: str = "even") -> Groups:
    """Groups of one Moshpit round: available peers on one line along axis ``round_index mod d``.

    Peers of a line are taken in random order (arrival order at the rendezvous peer,
    in the real protocol), so when a line is cut in several groups, who goes where
    and the ranks are random. ``cut``: see `_cut_lines`.
    """
    if not 1 <= min_group_size <= target_group_size:
        raise ValueError(f"need 1 <= min_group_size <= target_group_size, not min_group_size={min_group_size!r} "
                         f"and target_group_size={target_group_size!r}")
    axis = round_index % len(shape)
    idx = np.flatnonzero(available)
    if idx.size == 0:
        return Groups(np.empty(0, np.int64), np.empty(0, np.int64))
    keys = line_keys(coords, shape, axis)[idx]
    # Random order inside a line: sort on (line key, random bits) packed in one int64.
    # One unstable argsort of that is ~10x faster than a stable sort of a shuffle.
    spare = 63 - max(1, math.prod(int(m) for m in shape) - 1).bit_length()
    if spare >= 20:
        bits = min(spare, 32)
        packed = (keys << bits) | rng.integers(0, 1 << bits, size=idx.size, dtype=np.int64)
        order = np.argsort(packed)
        sorted_keys = packed[order] >> bits
    else:  # a grid too large to pack: lexsort on (random, key)
        order = np.lexsort((rng.random(idx.size), keys))
        sorted_keys = keys[order]
    line_starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    line_counts = np.diff(np.r_[line_starts, sorted_keys.size])
    return _cut_lines(idx[order], line_counts, target_group_size, min_group_size, int(shape[axis]), cut)


def random_groups(available: np.ndarray, group_size: int, rng: np.random.Generator) -> Groups:
    """The available peers, shuffled and cut into ``ceil(n / group_size)`` near-equal groups."""
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    idx = rng.permutation(np.flatnonzero(available))
    if idx.size == 0:
        return Groups(idx, np.empty(0, np.int64))
    g = -(-idx.size // group_size)
    base, extra = divmod(idx.size, g)
    return Groups(idx, base + (np.arange(g) < extra))


# ----------------------------------------------------------------------------- new coordinates
def random_permutations(rng: np.random.Generator, n_groups: int, m: int, chunk_elems: int = 1 << 22) -> np.ndarray:
    """``n_groups`` independent random permutations of ``range(m)``, one per row."""
    out = np.empty((n_groups, m), dtype=np.int64)
    rows = max(1, chunk_elems // max(m, 1))
    for lo in range(0, n_groups, rows):  # chunks of rows bound memory, not a loop over groups
        hi = min(n_groups, lo + rows)
        out[lo:hi] = np.argsort(rng.random((hi - lo, m)), axis=1)
    return out


def distinct_indices(rng: np.random.Generator, groups: Groups, m: int) -> np.ndarray:
    """For each entry of ``groups.members``: an index in ``range(m)``, distinct inside its group.

    Equivalent in distribution to taking entry ``rank mod m`` of a uniformly random
    permutation per group. When lines are long compared with groups (``m`` at least
    8x the largest group, e.g. a 1000x1000 grid with groups of 32) drawing whole
    permutations would cost ``n_groups * m``, so instead every member draws an
    index and members that collide with an earlier member of their group redraw
    until none do; the resulting set is uniform by symmetry over indices.
    """
    n = groups.members.size
    if n == 0:
        return np.empty(0, np.int64)
    gi = groups.group_index()
    if 8 * int(groups.sizes.max()) > m:
        return random_permutations(rng, groups.n_groups, m)[gi, groups.ranks() % m]
    vals = rng.integers(0, m, size=n, dtype=np.int64)
    while True:  # a few passes: the chance a member collides is < 1/8 and shrinks every pass
        packed = gi * m + vals
        order = np.argsort(packed, kind="stable")
        sp = packed[order]
        dup = order[1:][sp[1:] == sp[:-1]]
        if dup.size == 0:
            return vals
        vals[dup] = rng.integers(0, m, size=dup.size, dtype=np.int64)


def perms_from_group_ids(group_ids: Sequence[str], m: int) -> np.ndarray:
    """The permutations `zgossip.grid.MoshpitGrid.next_coords` draws for these group ids.

    One small generator per group id: a Python loop over groups, meant for
    cross-checking against the real protocol, not for large sweeps.
    """
    return np.array([np.random.default_rng(seed_from(gid)).permutation(m) for gid in group_ids],
                    dtype=np.int64).reshape(len(group_ids), m)


def next_coords(coords: np.ndarray, shape: Sequence[int], axis: int, groups: Groups, perms: np.ndarray) -> np.ndarray:
    """New coordinates: the member of rank ``k`` in group ``g`` takes ``perms[g, k mod M_axis]`` along ``axis``."""
    m = int(shape[axis])
    if perms.shape != (groups.n_groups, m):
        raise ValueError(f"need one permutation of range({m}) per group: shape ({groups.n_groups}, {m}), got {perms.shape}")
    new = coords.copy()
    new[groups.members, axis] = perms[groups.group_index(), groups.ranks() % m]
    return new


# ----------------------------------------------------------------------------- averaging
def average_in_groups(values: np.ndarray, groups: Groups) -> np.ndarray:
    """Every member of a group gets the group's mean (equal weights); everybody else keeps their value."""
    out = values.copy()
    if groups.n_groups == 0:
        return out
    sums = np.add.reduceat(values[groups.members], groups.starts, axis=0)
    means = sums / groups.sizes.reshape((-1,) + (1,) * (values.ndim - 1))
    out[groups.members] = np.repeat(means, groups.sizes, axis=0)
    return out


def ring_gossip(values: np.ndarray, available: np.ndarray) -> np.ndarray:
    """One round of Metropolis-Hastings gossip on the ring ``i ~ i+1 (mod N)`` (see the module docstring)."""
    right = np.roll(values, -1, axis=0)
    edge = available & np.roll(available, -1)  # edge (i, i+1) is up when both ends are available
    shape = (-1,) + (1,) * (values.ndim - 1)
    flow = (right - values) * edge.reshape(shape) / 3.0  # what i gains over edge (i, i+1); i+1 loses the same
    return values + flow - np.roll(flow, 1, axis=0)


def allreduce_all_or_nothing(values: np.ndarray, available: np.ndarray) -> tuple[np.ndarray, bool]:
    """Plain all-reduce: everyone gets the exact mean, but only if nobody is unavailable."""
    if not available.all():
        return values.copy(), False
    return np.broadcast_to(values.mean(axis=0), values.shape).copy(), True


def distance_to_truth(values: np.ndarray, truth: np.ndarray | float) -> tuple[float, float]:
    """(mean over peers, max over peers) of the squared Euclidean distance to ``truth``."""
    d = values - truth
    sq = (d * d).reshape(d.shape[0], -1).sum(axis=1)
    return float(sq.mean()), float(sq.max())


# ----------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class RoundRecord:
    round: int  # rounds done, 1 for the first
    mse: float
    max_sq: float
    participants: int  # peers that averaged with at least one other peer
    n_groups: int
    groups: Groups | None = field(default=None, repr=False)  # moshpit / random only


PermSource = Callable[[Groups], np.ndarray]


@dataclass
class RoundLevelSwarm:
    """The state of one round-level run: values, grid coordinates, round, seeded generator.

    ``values`` has one row per peer (shape ``(N,)`` for scalars or ``(N, D)``). The
    true global average is taken from the values given at construction.
    """

    values: np.ndarray
    method: Method | str
    rng: np.random.Generator
    p_unavailable: float = 0.0
    group_size: int = 32  # target group size (moshpit, random)
    min_group_size: int = 2  # moshpit: smaller lines meet nobody (zgossip's default)
    cut: str = "even"  # moshpit: how a line with more peers than a group is cut (see `_cut_lines`)
    grid: tuple[int, ...] = ()
    coords: np.ndarray | None = None  # moshpit: (N, d); placed by `placement` when None
    placement: str = "distinct"
    round_index: int = 0

    def __post_init__(self) -> None:
        self.method = Method(self.method)
        # types and ranges by name (a sweep's method overrides reach here unchecked): group_size = "x" said
        # "'<=' not supported between instances of 'int' and 'str'", 2.5 "Cannot cast array data from
        # dtype('float64')", grid = [0] raised a ZeroDivisionError and grid = "8x8" "invalid literal for int()"
        for name in ("group_size", "min_group_size"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be a whole number, not {v!r}")
        if not isinstance(self.grid, (list, tuple)) or not all(
                isinstance(m, (int, np.integer)) and not isinstance(m, (bool, np.bool_)) and m >= 1 for m in self.grid):
            raise ValueError(f"grid must be a list of whole numbers >= 1, e.g. [32, 32], not {self.grid!r}")
        self.values = np.array(self.values, dtype=np.float64)
        self.truth = self.values.mean(axis=0)
        n = self.values.shape[0]
        if self.method is Method.MOSHPIT:
            self.grid = tuple(int(m) for m in self.grid)
            if not self.grid:
                raise ValueError("method 'moshpit' needs a grid shape")
            if self.coords is None:
                self.coords = place_on_grid(n, self.grid, self.rng, self.placement)
            self.coords = np.array(self.coords, dtype=np.int64).reshape(n, len(self.grid))
            if ((self.coords < 0) | (self.coords >= np.array(self.grid))).any():
                raise ValueError(f"coordinates do not fit grid {self.grid}")

    @property
    def n_peers(self) -> int:
        return int(self.values.shape[0])

    def metric(self) -> tuple[float, float]:
        return distance_to_truth(self.values, self.truth)

    def step(self, available: np.ndarray | None = None, groups: Groups | None = None,
             perms: np.ndarray | PermSource | None = None) -> RoundRecord:
        """Run one round.

        Hooks for cross-checks: ``available`` replaces the availability draw;
        ``groups`` (moshpit / random) replaces group formation — members must be
        available and, for moshpit, share this round's line; ``perms`` (an array of
        shape ``(n_groups, M_axis)`` or a callable taking the groups) replaces the
        random permutations that give moshpit members their new coordinates.
        """
        n = self.n_peers
        if available is None:
            available = draw_available(self.rng, n, self.p_unavailable)
        available = np.asarray(available, dtype=bool)
        if available.shape != (n,):
            raise ValueError(f"available must have shape ({n},)")
        if groups is not None:
            groups.validate(n)
            if not available[groups.members].all():
                raise ValueError("an unavailable peer was put in a group")
        m = self.method
        rec_groups = None
        if m is Method.MOSHPIT:
            axis = self.round_index % len(self.grid)
            if groups is None:
                groups = moshpit_groups(self.coords, self.grid, self.round_index, available, self.rng,
                                        target_group_size=self.group_size, min_group_size=self.min_group_size,
                                        cut=self.cut)
            else:
                keys = line_keys(self.coords[groups.members], self.grid, axis)
                first = np.repeat(keys[groups.starts], groups.sizes) if groups.n_groups else keys
                if (keys != first).any():
                    raise ValueError(f"a group mixes peers of different lines along axis {axis}")
            self.values = average_in_groups(self.values, groups)
            if perms is None:
                self.coords = self.coords.copy()
                self.coords[groups.members, axis] = distinct_indices(self.rng, groups, self.grid[axis])
            else:
                p = perms(groups) if callable(perms) else np.asarray(perms)
                self.coords = next_coords(self.coords, self.grid, axis, groups, p)
            rec_groups = groups
        elif m is Method.RANDOM_GROUPS:
            if groups is None:
                groups = random_groups(available, self.group_size, self.rng)
            self.values = average_in_groups(self.values, groups)
            rec_groups = groups
        elif m is Method.ALL_REDUCE:
            self.values, ok = allreduce_all_or_nothing(self.values, available)
        else:
            self.values = ring_gossip(self.values, available)
        self.round_index += 1
        mse, mx = self.metric()
        if rec_groups is not None:
            participants = int(rec_groups.sizes[rec_groups.sizes > 1].sum())
            n_groups = rec_groups.n_groups
        elif m is Method.ALL_REDUCE:
            participants, n_groups = (n, 1) if ok else (0, 0)
        else:
            edge = available & np.roll(available, -1)
            participants, n_groups = int((edge | np.roll(edge, 1)).sum()), int(edge.sum())
        return RoundRecord(self.round_index, mse, mx, participants, n_groups, rec_groups)


# ----------------------------------------------------------------------------- benchmark
def bench(n_peers: int = 1_000_000, rounds: int = 5, p_unavailable: float = 0.01, seed: int = 0,
          grid: tuple[int, ...] = (32, 32, 32, 32), group_size: int = 32) -> dict[str, float]:
    """Wall seconds per round for each method (median of ``rounds``), on scalars."""
    out = {}
    for method in Method:
        rng = np.random.default_rng(seed)
        swarm = RoundLevelSwarm(rng.standard_normal(n_peers), method, rng, p_unavailable=p_unavailable,
                                group_size=group_size, grid=grid if method is Method.MOSHPIT else ())
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            swarm.step()
            times.append(time.perf_counter() - t0)
        out[method.value] = float(np.median(times))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.roundlevel", description=__doc__.split("\n")[0])
    ap.add_argument("--bench", action="store_true", help="print wall seconds per round for each method")
    ap.add_argument("--peers", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dropout", type=float, default=0.01, help="probability a peer is unavailable in a round")
    ap.add_argument("--grid", default="32x32x32x32", help="Moshpit grid shape, e.g. 32x32x32x32")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not args.bench:
        ap.print_help()
        return 0
    grid = tuple(int(x) for x in args.grid.lower().split("x"))
    res = bench(args.peers, args.rounds, args.dropout, args.seed, grid, args.group_size)
    print(f"round-level model, {args.peers:,} peers, p={args.dropout}, grid {args.grid}, groups up to {args.group_size}")
    print(f"{'method':>10}  {'s/round':>8}")
    for k, v in res.items():
        print(f"{k:>10}  {v:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
