"""``python -m sim autogrid``: ``grid="auto"`` in a swarm that grows and shrinks (issue 13, item 5).

A message-level run on the real protocol (gossip membership by default): the swarm starts with
``sizes[0]`` peers, then peers arrive (bootstrapping from random live peers) or crash at random
to reach each next size. Peers train through every change: a round, then ``interval`` virtual
seconds of compute, and so on. After a change the run trains until every live peer uses the
shape for the new size (the time this takes is reported, with the transition rounds' outcomes
and the shapes in use), then ``settle`` seconds more; then every live peer gets fresh N(0, 1)
values and the phase measures the mean squared distance to their mean after each of ``rounds``
rounds (back to back).

The yardstick for each phase is a *hand-sized* grid: a fresh swarm of that phase's size on the
grid `zgossip.autogrid.shape_for` gives for it (what a user who knew the size would pick; random
coordinates, as ``grid="auto"`` draws them), trained ``settle`` seconds and measured the same
way. Both grids start from random coordinates, which each round's re-indexing (`zgossip.grid`)
evens out, so both get the same number of rounds on their shape before measuring. With
``--fixed``, a third run keeps the first phase's shape through every phase (what a hand-set
grid does when the swarm changes).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zgossip.autogrid import quantise, shape_for
from zgossip.node import NodeConfig, StepDone

from .driver import SimCluster
from .network import NetworkModel

__all__ = ["AutoGridRun", "run_autogrid", "summarize", "main_text", "main"]

PROTOCOL = dict(gossip_interval=0.5, peer_timeout=5.0, matchmaking_time=0.5, request_timeout=0.3, part_timeout=1.0,
                allreduce_timeout=10.0, min_group_size=2)


@dataclass
class Phase:
    size: int
    shapes: dict  # grid shape -> how many live peers use it when the phase's measurement starts
    mse: list  # after each measured round (index 0: before the first)
    transition: list = field(default_factory=list)  # per transition round: (steppers, done, shapes)
    agreed: float | None = None  # grid="auto": virtual seconds until every live peer used the new shape


class AutoGridRun:
    """One swarm on the simulator; `grid` is "auto" or a fixed shape."""

    def __init__(self, seed: int, target: int, grid: Any, numel: int = 8, membership: str = "gossip",
                 latency: float = 0.005) -> None:
        self.cluster = SimCluster(seed=seed, network=NetworkModel(latency=latency), encode=False, membership=membership)
        self.env = self.cluster.env
        self.rng = np.random.default_rng([seed, 7])
        self.target, self.grid, self.numel, self.membership = target, grid, numel, membership
        self.peers: list = []
        self.round = 0

    def live(self) -> list:
        return [p for p in self.peers if p.alive]

    def resize(self, n: int) -> None:
        live = self.live()
        if n > len(live):
            for _ in range(n - len(live)):
                self._add()
        else:
            for i in sorted(self.rng.choice(len(live), size=len(live) - n, replace=False)):
                live[int(i)].crash()
            self.peers = [p for p in self.peers if p.alive]  # only `live` reads them: the departed need not stay

    def _add(self) -> None:
        auto = self.grid == "auto"
        cfg = NodeConfig(prefix="autogrid", target_group_size=self.target, grid=() if auto else tuple(self.grid),
                         grid_auto=auto, **PROTOCOL)
        live = self.live()
        boot = [] if self.membership == "static" or not live else [live[int(self.rng.integers(len(live)))].endpoint]
        self.peers.append(self.cluster.add_peer(cfg, tensors=[np.zeros(self.numel)], initial_peers=boot))

    def shapes(self) -> dict:
        return dict(sorted(Counter(str(p.node.grid.shape) for p in self.live()).items()))

    def step_round(self, timeout: float = 5.0) -> tuple[int, int]:
        """Every live peer steps once (the round number pinned, as `sim.scenario` does)."""
        live = self.live()
        evs = [p.step_tensors(timeout=timeout, round=self.round) for p in live]
        self.round += 1
        limit = self.env.timeout(timeout + PROTOCOL["allreduce_timeout"] + 1.0)
        self.cluster.run(until=self.env.any_of([self.env.all_of(evs), limit]))
        return len(live), sum(1 for ev in evs if ev.triggered and isinstance(ev.value, StepDone))

    def agree(self, shape: tuple, most: float, interval: float) -> tuple[float | None, list]:
        """Train (a round, then `interval` seconds of compute, ...) until every live peer uses grid
        `shape`, for at most `most` virtual seconds: how long that took (None: not within `most`)
        and what each round did."""
        start, out = self.env.now, []
        while True:
            if all(p.node.grid.shape == shape for p in self.live()):
                return self.env.now - start, out
            if self.env.now - start >= most:
                return None, out
            shapes = self.shapes()
            n, done = self.step_round()
            out.append((n, done, shapes))
            self.cluster.run(until=self.env.now + interval)

    def settle(self, seconds: float, interval: float) -> list:
        """Train for `seconds` of virtual time: a round, then `interval` seconds of compute, and so on
        (at least one round); what each round did: (steppers, averaged, shapes at its start)."""
        end, out = self.env.now + seconds, []
        while True:
            shapes = self.shapes()
            n, done = self.step_round()
            out.append((n, done, shapes))
            if self.env.now >= end:
                return out
            self.cluster.run(until=self.env.now + interval)

    def measure(self, rounds: int) -> list:
        live = self.live()
        for p in live:
            p.tensors[0][:] = self.rng.standard_normal(self.numel)
        truth = np.mean([p.tensors[0] for p in live], axis=0)
        out = [self._mse(live, truth)]
        for _ in range(rounds):
            self.step_round()
            out.append(self._mse(live, truth))
        return out

    @staticmethod
    def _mse(live: list, truth: np.ndarray) -> float:
        return float(np.mean([np.mean((p.tensors[0] - truth) ** 2) for p in live if p.alive]))


def _rounds_to(mse: list, eps: float) -> float:
    """Rounds until the MSE first reaches `eps` (inf if it never did)."""
    return next((float(i) for i, x in enumerate(mse) if x <= eps), math.inf)


def run_autogrid(sizes=(16, 512, 64), target: int = 16, rounds: int = 6, settle: float = 8.0, seed: int = 0,
                 membership: str = "gossip", fixed: bool = False, numel: int = 8, interval: float = 1.0,
                 agree_within: float = 60.0) -> dict:
    """One seed: the churn run with grid="auto", each phase's hand-sized yardstick and (`fixed`)
    the first phase's shape kept throughout. Figures are MSE per round after fresh values."""
    def churn(grid: Any) -> list[dict]:
        run = AutoGridRun(seed, target, grid, numel, membership)
        phases, size = [], 0
        for n in sizes:
            run.resize(n)
            agreed, trans = None, []
            if grid == "auto":  # train until the swarm agrees on the shape for its new size...
                size = quantise(n, size)
                agreed, trans = run.agree(shape_for(size, target), agree_within, interval)
            trans += run.settle(settle, interval)  # ...then as long as the hand-sized grid had
            ph = Phase(n, run.shapes(), [], trans, agreed)
            ph.mse = run.measure(rounds)
            phases.append(vars(ph))
        return phases

    out: dict = {"sizes": list(sizes), "target": target, "rounds": rounds, "settle": settle, "interval": interval,
                 "seed": seed, "membership": membership, "auto": churn("auto"), "hand": []}
    for n in sizes:  # the same schedule on a fresh swarm that was given the right grid from the start
        run = AutoGridRun(seed + 1000, target, shape_for(quantise(n), target), numel, membership)
        run.resize(n)
        run.settle(settle, interval)
        out["hand"].append({"size": n, "shapes": run.shapes(), "mse": run.measure(rounds)})
    if fixed:
        out["fixed"] = churn(shape_for(quantise(sizes[0]), target))
    return out


def summarize(runs: list[dict], eps: tuple = (1e-4, 1e-9)) -> dict:
    """Over seeds, per phase and method: the median MSE after each round and the mean rounds to
    each threshold in `eps` (the Moshpit paper's metric; inf if some seed never got there)."""
    methods = [m for m in ("auto", "hand", "fixed") if m in runs[0]]
    out: dict = {"sizes": runs[0]["sizes"], "target": runs[0]["target"], "seeds": [r["seed"] for r in runs],
                 "membership": runs[0]["membership"], "settle": runs[0]["settle"], "interval": runs[0]["interval"],
                 "phases": []}
    for i, n in enumerate(out["sizes"]):
        ph: dict = {"size": n, "hand_shape": list(shape_for(quantise(n), out["target"]))}
        for m in methods:
            curves = np.array([r[m][i]["mse"] for r in runs])
            ph[m] = {"mse": [float(x) for x in np.median(curves, axis=0)],
                     "rounds_to": {f"{e:g}": float(np.mean([_rounds_to(list(c), e) for c in curves])) for e in eps},
                     "shapes": [r[m][i]["shapes"] for r in runs]}
            if m != "hand":
                tr = [t for r in runs for t in r[m][i]["transition"]]
                ph[m]["transition"] = {"rounds": len(tr), "steps": sum(t[0] for t in tr), "done": sum(t[1] for t in tr)}
            if m == "auto":
                ph[m]["agreed"] = [r[m][i]["agreed"] for r in runs]
        out["phases"].append(ph)
    return out


def _fmt(x: float) -> str:
    return f"{x:9.1e}" if x > 0 else f"{0:9d}"


def main_text(s: dict) -> str:
    eps = list(s["phases"][0]["auto"]["rounds_to"])
    lines = [f"grid=auto: swarm {' -> '.join(map(str, s['sizes']))} peers, target group size {s['target']}, "
             f"{s['membership']} membership, seeds {s['seeds']}. Each phase: {s['settle']:g} s to settle after the "
             f"change (a round every {s['interval']:g} s of compute), then fresh N(0,1) values; median MSE to their mean after each round; rounds to "
             f"MSE <= {' / '.join(eps)} (mean over seeds). hand = a fresh swarm of the phase's size on the grid "
             f"sized for it by hand."]
    for i, ph in enumerate(s["phases"]):
        lines.append(f"phase {i}: {ph['size']} peers, hand-sized grid {tuple(ph['hand_shape'])}")
        for m in ("auto", "hand", "fixed"):
            if m not in ph:
                continue
            r = ph[m]
            shapes = sorted({k for d in r["shapes"] for k in d})
            to = " / ".join(f"{v:.1f}" if math.isfinite(v) else "never" for v in r["rounds_to"].values())
            lines.append(f"  {m:<6}" + "".join(_fmt(x) for x in r["mse"][1:]) + f"   rounds {to:<11} grids {', '.join(shapes)}")
        tr, ag = ph["auto"]["transition"], ph["auto"]["agreed"]
        agreed = ", ".join("never" if a is None else f"{a:.1f}" for a in ag)
        lines.append(f"  (auto: every live peer on {tuple(ph['hand_shape'])} after {agreed} s; before measuring, "
                     f"{tr['rounds']} rounds, {tr['done']} of {tr['steps']} steps averaged)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import time

    p = argparse.ArgumentParser(prog="python -m sim autogrid", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sizes", default="16,512,64", help="swarm size of each phase (default 16,512,64)")
    p.add_argument("--target", type=int, default=16, help="target_group_size (default 16)")
    p.add_argument("--rounds", type=int, default=6, help="measured rounds per phase (default 6)")
    p.add_argument("--settle", type=float, default=8.0, help="virtual seconds of training after each change (default 8)")
    p.add_argument("--interval", type=float, default=1.0, help="virtual seconds of compute between rounds (default 1)")
    p.add_argument("--seeds", type=int, default=1, help="runs with seeds 0..N-1 (default 1)")
    p.add_argument("--membership", choices=["gossip", "static"], default="gossip")
    p.add_argument("--fixed", action="store_true", help="also run the first phase's grid kept through every phase")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)
    try:
        sizes = tuple(int(x) for x in a.sizes.split(","))
    except ValueError:
        p.error(f"--sizes takes swarm sizes separated by commas, such as 16,512,64, not {a.sizes!r}")
    if min(sizes) < 1 or a.target < 2 or a.rounds < 1 or a.seeds < 1 or a.settle < 0 or a.interval < 0:
        p.error("sizes and seeds must be >= 1, --target >= 2, --rounds >= 1, --settle and --interval >= 0")
    t0 = time.perf_counter()
    runs = [run_autogrid(sizes, a.target, a.rounds, a.settle, seed, a.membership, a.fixed, interval=a.interval)
            for seed in range(a.seeds)]
    s = summarize(runs)
    s["wall_seconds"] = time.perf_counter() - t0
    print(json.dumps(s) if a.json else main_text(s) + f"\n({s['wall_seconds']:.0f} s wall)")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
