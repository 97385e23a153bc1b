"""The averaging experiment of the Moshpit SGD paper (arXiv 2103.03239, Sec. 4.1), on the round-level model.

Setup: every peer holds one scalar drawn from N(0, 1); each round every peer is
independently unavailable with probability ``p``; the metric is the mean squared
distance to the true global average (the mean of all peers' initial scalars). For
each method we report the mean number of rounds, over ``restarts`` runs capped at
``cap`` rounds, to reach an MSE of 1e-9 and of 1e-4 (a run that never reaches it
counts as ``cap``). Methods (see `sim.roundlevel` for their exact definitions):

* ``moshpit`` — a 32×32 grid, groups of up to 32 peers (a whole grid line);
* ``random`` — random groups of 32 drawn afresh every round;
* ``allreduce`` — everybody at once, which succeeds only in a round where no peer
  is unavailable;
* ``ring`` — synchronous Metropolis gossip with the two ring neighbours.

Placement on the grid. With N < 1024 the 32×32 grid is not full. Peers start on
*distinct random cells* (``placement="distinct"``): this keeps every line at <= 32
peers so a line is exactly one group, and it is the only placement under which
N = 1024 is the paper's full grid (exact mean after d = 2 rounds with p = 0). The
alternative a real swarm gets when nodes pick their own coordinates
(``placement="iid"``, every coordinate uniform) lets cells collide, so some lines
hold more than 32 peers and are cut in two groups of ~16 while other lines are
short; the ``moshpit-iid`` variant measures what that costs. ``moshpit-fill``
measures the matchmaker rule with ``straggler_grace=0`` (a group closes as soon as 32 peers
of a line joined; leftovers form one group only if at least ``min_group_size``); the
default grace cuts an overfull line evenly, as ``moshpit`` does.

Randomness: the initial scalars depend only on (seed, N, restart), so every method
and every p starts from the same values in a restart; each run then draws from its
own generator seeded by (seed, N, restart, p, method) — the table is a pure
function of the seed.

CLI: ``python -m sim.moshpit [--quick] [--json] [--extra]`` (one process, no store);
``python -m sim table`` runs the same table as the sweep ``sim/sweeps/moshpit_table.toml``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from zgossip.cliargs import positive_int
from zgossip.grid import seed_from

from .roundlevel import Method, RoundLevelSwarm

__all__ = ["MethodSpec", "METHODS", "EXTRA_METHODS", "NS", "PS", "THRESHOLDS", "mse_curves", "rounds_to",
           "moshpit_table", "table_from_sweep", "format_table", "main"]

NS = (512, 768, 900, 1024)
PS = (0.0, 0.005, 0.01)
THRESHOLDS = {"1e-9": 1e-9, "1e-4": 1e-4}


@dataclass(frozen=True)
class MethodSpec:
    """One column of the table: a round-level method and its settings."""

    name: str
    method: Method
    group_size: int = 32
    grid: tuple[int, ...] = ()
    min_group_size: int = 2
    placement: str = "distinct"
    cut: str = "even"

    def swarm(self, values: np.ndarray, p: float, rng: np.random.Generator) -> RoundLevelSwarm:
        return RoundLevelSwarm(values, self.method, rng, p_unavailable=p, group_size=self.group_size,
                               min_group_size=self.min_group_size, grid=self.grid, placement=self.placement,
                               cut=self.cut)


METHODS = (
    MethodSpec("moshpit", Method.MOSHPIT, grid=(32, 32)),
    MethodSpec("random", Method.RANDOM_GROUPS),
    MethodSpec("allreduce", Method.ALL_REDUCE),
    MethodSpec("ring", Method.RING),
)
EXTRA_METHODS = (
    MethodSpec("moshpit-fill", Method.MOSHPIT, grid=(32, 32), cut="fill"),
    MethodSpec("moshpit-iid", Method.MOSHPIT, grid=(32, 32), placement="iid"),
)


def _p_code(p: float) -> int:
    return int(round(p * 1_000_000))


def mse_curves(n: int, p: float, specs: Sequence[MethodSpec] = METHODS, *, restarts: int = 10, cap: int = 50,
               seed: int = 0) -> dict[str, np.ndarray]:
    """MSE after each round, per method: arrays of shape ``(restarts, cap + 1)``; column 0 is before round 1."""
    out = {s.name: np.empty((restarts, cap + 1)) for s in specs}
    for r in range(restarts):
        values = np.random.default_rng([seed, n, r]).standard_normal(n)
        for s in specs:
            rng = np.random.default_rng([seed, n, r, _p_code(p), seed_from(s.name)])
            swarm = s.swarm(values, p, rng)
            curve = out[s.name][r]
            curve[0] = swarm.metric()[0]
            for k in range(1, cap + 1):
                curve[k] = swarm.step().mse
    return out


def rounds_to(curves: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Per run (row): the first round whose MSE is <= threshold, or the cap; and whether it got there."""
    hit = curves[:, 1:] <= threshold
    reached = hit.any(axis=1)
    first = np.where(reached, hit.argmax(axis=1) + 1, curves.shape[1] - 1)
    return first, reached


def moshpit_table(ns: Sequence[int] = NS, ps: Sequence[float] = PS, specs: Sequence[MethodSpec] = METHODS, *,
                  restarts: int = 10, cap: int = 50, seed: int = 0) -> list[dict]:
    """One row per (N, p, method): mean rounds to each threshold and the fraction of runs that reached it."""
    rows = []
    for n in ns:
        for p in ps:
            curves = mse_curves(n, p, specs, restarts=restarts, cap=cap, seed=seed)
            for s in specs:
                row = {"n": n, "p": p, "method": s.name}
                for label, thr in THRESHOLDS.items():
                    first, reached = rounds_to(curves[s.name], thr)
                    row[f"rounds_{label}"] = float(first.mean())
                    row[f"reached_{label}"] = float(reached.mean())
                rows.append(row)
    return rows


def message_level_curves(n: int, p: float, *, restarts: int = 10, cap: int = 50, seed: int = 0,
                         grid: tuple[int, int] = (32, 32), group_size: int = 32,
                         progress=None) -> np.ndarray:
    """The same experiment on the real protocol (`sim.scenario`, message level, SimPy), Moshpit only.

    Same initial scalars per restart as the round-level table. A run stops once its MSE is
    at or below 1e-9 (both thresholds are then reached); later columns repeat that value.
    """
    from .scenario import Scenario, ScenarioRun

    out = np.empty((restarts, cap + 1))
    for r in range(restarts):
        values = np.random.default_rng([seed, n, r]).standard_normal(n)
        sc = Scenario.from_dict({
            "peers": n, "grid": list(grid), "rounds": 0, "seed": seed_from(f"{seed}-{n}-{r}-{p}") % (1 << 31),
            "placement": "distinct", "unavailability": p, "membership": "static", "encode": False,
            "bootstrap_time": 0.0, "protocol": {"target_group_size": group_size, "min_group_size": 2}})
        run = ScenarioRun(sc)
        for peer, v in zip(run.slots, values):
            peer.tensors[0][...] = v
        run.truth = values.mean(keepdims=True)
        out[r, 0] = float(((values - values.mean()) ** 2).mean())
        k = 0
        try:
            while k < cap:
                run.sc.rounds = 1
                res = run.run_rounds(start=k)
                k += 1
                out[r, k] = res[-1]["mse"]
                if progress:
                    progress(r, k)
                if out[r, k] <= 1e-9:
                    out[r, k + 1:] = out[r, k]
                    break
        finally:
            run.close()
    return out


def table_from_sweep(rows: Sequence[dict]) -> list[dict]:
    """`moshpit_table`'s rows from a sweep's tidy rows (`sim.sweep.read_table`; axes n, p, method):
    the same numbers, since the sweep's runs draw exactly as `mse_curves` does."""
    from .sweep import rounds_to_eps

    out: list[dict] = []
    for label, thr in THRESHOLDS.items():
        for i, s in enumerate(rounds_to_eps(rows, ("n", "p", "method"), thr, "mse")):
            if len(out) <= i:
                out.append({"n": s["n"], "p": float(s["p"]), "method": s["method"]})
            out[i][f"rounds_{label}"] = float(s["rounds"])
            out[i][f"reached_{label}"] = float(s["reached"])
    return out


def _cell(row: dict, label: str) -> str:
    mark = "" if row[f"reached_{label}"] == 1.0 else "*"
    return f"{row[f'rounds_{label}']:.1f}{mark}"


def format_table(rows: Sequence[dict], *, restarts: int, cap: int) -> str:
    """A readable table: one line per (N, p), per method 'rounds to 1e-9 / rounds to 1e-4'."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = max(14, *(len(m) + 2 for m in methods))
    lines = [
        f"Mean rounds to reach MSE <= 1e-9 / 1e-4 ({restarts} restarts, capped at {cap}; "
        f"* = some runs never got there, counted as {cap})",
        f"{'N':>5} {'p':>6}  " + "".join(f"{m:>{width}}" for m in methods),
    ]
    by_key: dict[tuple, dict] = {}
    for r in rows:
        by_key.setdefault((r["n"], r["p"]), {})[r["method"]] = r
    for (n, p), cells in by_key.items():
        parts = [f"{_cell(cells[m], '1e-9')} / {_cell(cells[m], '1e-4')}" for m in methods]
        lines.append(f"{n:>5} {p:>6.3f}  " + "".join(f"{c:>{width}}" for c in parts))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.moshpit",
                                 description="Moshpit averaging experiment (arXiv 2103.03239) on the round-level model")
    ap.add_argument("--quick", action="store_true", help="3 restarts instead of 10")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument("--extra", action="store_true", help="also run the moshpit-fill and moshpit-iid variants")
    ap.add_argument("--restarts", type=positive_int, default=None)
    ap.add_argument("--cap", type=positive_int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--message-level", action="store_true",
                    help="run Moshpit on the real protocol (SimPy, message level) for N=1024, p in {0, 0.01}")
    args = ap.parse_args(argv)
    if args.message_level:
        return _message_level_main(args)
    restarts = args.restarts if args.restarts is not None else (3 if args.quick else 10)
    specs = METHODS + (EXTRA_METHODS if args.extra else ())
    t0 = time.perf_counter()
    rows = moshpit_table(NS, PS, specs, restarts=restarts, cap=args.cap, seed=args.seed)
    wall = time.perf_counter() - t0
    if args.json:
        json.dump({"restarts": restarts, "cap": args.cap, "seed": args.seed,
                   "methods": [asdict(s) | {"method": s.method.value} for s in specs], "rows": rows},
                  sys.stdout, indent=1)
        print()
    else:
        print(format_table(rows, restarts=restarts, cap=args.cap))
        print(f"({wall:.1f} s wall)")
    return 0


def _message_level_main(args: argparse.Namespace) -> int:
    restarts = args.restarts if args.restarts is not None else (3 if args.quick else 10)
    rows = []
    t0 = time.perf_counter()
    for p in (0.0, 0.01):
        curves = message_level_curves(1024, p, restarts=restarts, cap=args.cap, seed=args.seed)
        row = {"n": 1024, "p": p, "method": "moshpit (message level)"}
        for label, thr in THRESHOLDS.items():
            first, reached = rounds_to(curves, thr)
            row[f"rounds_{label}"] = float(first.mean())
            row[f"reached_{label}"] = float(reached.mean())
        rows.append(row)
    wall = time.perf_counter() - t0
    if args.json:
        json.dump({"restarts": restarts, "cap": args.cap, "seed": args.seed, "rows": rows}, sys.stdout, indent=1)
        print()
    else:
        print(format_table(rows, restarts=restarts, cap=args.cap))
        print(f"({wall:.1f} s wall)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
