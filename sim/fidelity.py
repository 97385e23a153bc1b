"""The fidelity matrix: the same cases on the testbed (real peers, shaped links) and in the simulator.

``python -m sim fidelity`` runs every case below on the testbed (`sim.testbed`, root and
network namespaces needed) and replays it in the simulator, then prints one row per case:
measured median step (over rounds; each round's step is the median over its peers),
predicted, their ratio, the link floor (`sim.linkfloor`) and measured / floor. After the
table it checks, for every pair of cases that differ in one knob (bandwidth hints on/off,
packet loss on/off, one slow host), that the simulator moves the step time in the same
direction as the testbed. A change smaller than `FLAT` (relative) on the testbed counts
as "no change", and then the simulator must not move by more than 2 × `FLAT` either.

The replay models the machine the testbed ran on, from what the run recorded
(`sim.compare.replay_scenario`): the host namespaces' TCP settings (this machine: BBR, so no
restart after idle and no window cut on loss -- the largest single change: CUBIC's restart
after the 0.5 s round gap made steady rounds ~1.7x too slow), and the CPU profile with the
machine's cores shared by every peer. Transport mechanisms the testbed showed and `sim.tcp`
now models: the TCP + ZMTP connection set-up (3 RTT per new connection and direction), BBR
loss recovery, Linux's tail-loss probe and in-order delivery (what follows a lost segment waits
for its repair), and (`sim.driver`) the in-place step's wait for
its zero-copy sends, which makes a fast peer that owes a slow one its results wait with it.
BBR's pacing of app-limited bursts and its path model as Linux's BBR v1 keeps it (`sim.bbr`: a
bandwidth estimate over the last 10 round trips, which a retransmission at a burst's tail can
pull down to a few segments per RTT -- the lat150-loss stalls). The testbed's forwarder runs under
SCHED_FIFO and counts each frame's delay from the kernel's receive time, but its per-frame work
(which includes the receiving host's softirq) still shares the cores with the peers: the replay
charges the CPU per byte this run's forwarder spent (`sim.cpu.CpuCosts.switch_byte`) to one
serial queue on the shared cores, which is what bounds the 1 Gbit cases (the table shows the
forwarder's cores). That cost is taken from the run itself -- a property of the machine and of
the frame sizes the run's rates gave, as the CPU profile is -- not predicted. The hosts' downlinks
get the testbed's finite tbf queues, whose tail drops under incast (the 20 Mbit host of home4-4m
drops hundreds of packets a round) `sim.tcp` models as losses ("Queues"; the table prints the
drops per round measured and predicted: 1.2-1.6x the testbed's where it drops hundreds).
Not modelled: the kernel's send buffer in the release time.

The goal (issue 10): every ratio within 0.85–1.15 and every direction right.
``--quick`` runs `QUICK` (the suite's small version); ``--cases a,b`` picks cases.
"""
from __future__ import annotations

import math
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .compare import compare_runs, replay, replay_scenario
from .linkfloor import floor_for_scenario
from .scenario import Scenario, json_text

__all__ = ["CASES", "PAIRS", "QUICK", "case_scenario", "run_case", "run_matrix", "directions", "main"]

GOAL = (0.85, 1.15)
#: a case whose forwarder kept this much of a core busy through its rounds is marked forwarder-bound
#: (it still counts against the goal: the mark says why it misses, it excuses nothing)
BUSY_FORWARDER = 0.75
#: a case during whose rounds processes outside the run used this many cores of user CPU is marked: on
#: 2 cores the forwarder and the peers then wait for the CPU, and the testbed's figure is not the links'
BUSY_MACHINE = 0.1
FLAT = 0.05


def _h(up: float, lat: float, *, down: float | None = None, loss: float = 0.0, hint: float | None = None,
       count: int = 1) -> dict:
    d: dict[str, Any] = {"up_mbit": up, "down_mbit": down if down is not None else up, "latency_ms": lat,
                         "loss": loss, "count": count}
    if hint is not None:
        d["hint"] = hint
    return d


def _hints(hosts: list[dict]) -> list[dict]:
    """The same hosts declaring their uplink rate as the bandwidth hint."""
    return [{**h, "hint": float(min(h["up_mbit"], h["down_mbit"]))} for h in hosts]


def _auto(hosts: list[dict]) -> list[dict]:
    """The same hosts with bandwidth="auto": each peer measures its rate (zgossip.linkstats)."""
    return [{**h, "hint": "auto"} for h in hosts]


def _lossy(hosts: list[dict], p: float) -> list[dict]:
    return [{**h, "loss": p} for h in hosts]


_HOME = [_h(100, 10), _h(20, 40), _h(50, 80), _h(100, 20)]
_ISSUE = [_h(1000, 1), _h(100, 10), _h(20, 40), _h(50, 80)]
_FAST4 = [_h(1000, 1, count=4)]
_SLOW1 = [_h(10, 5), _h(1000, 1, count=3)]
_LAT150 = [_h(1000, 75, count=4)]
#: home lines whose uplinks are a fraction of their downlinks (cable, ADSL): the upload decides
_ASYM = [_h(100, 10), _h(10, 20, down=100), _h(50, 40), _h(20, 30, down=100)]
_HOME6 = [_h(100, 10), _h(20, 40), _h(50, 80), _h(100, 20), _h(30, 30), _h(60, 15)]

MIB = 1 << 18  # float32 values in one MiB

#: name -> (hosts, MiB of float32 per peer)
CASES: dict[str, tuple[list[dict], int]] = {
    "fast4-1g-4m": (_FAST4, 4),
    "fast4-auto-1g-4m": (_auto(_FAST4), 4),
    "fast8-1g-16m": ([_h(1000, 1, count=8)], 16),
    "slow1-4m": (_SLOW1, 4),
    "slow1-hints-4m": (_hints(_SLOW1), 4),
    "slow1-auto-4m": (_auto(_SLOW1), 4),
    "home4-4m": (_HOME, 4),
    "home4-hints-4m": (_hints(_HOME), 4),
    "home4-auto-4m": (_auto(_HOME), 4),
    "home4-loss-1m": (_lossy(_HOME, 0.01), 1),
    "home4-1m": (_HOME, 1),
    "home6-1m": (_HOME6, 1),
    "issue4-4m": (_ISSUE, 4),
    "issue4-hints-4m": (_hints(_ISSUE), 4),
    "issue4-auto-4m": (_auto(_ISSUE), 4),
    "lat150-1m": (_LAT150, 1),
    "lat150-loss-1m": (_lossy(_LAT150, 0.01), 1),
    "home4-100m-16m": ([_h(100, 10, count=4)], 16),
    "asym4-4m": (_ASYM, 4),
    "asym4-hints-4m": (_hints(_ASYM), 4),
    "asym4-auto-4m": (_auto(_ASYM), 4),
    # scheduled steps (scenario `step_ahead`): matchmaking runs before the step's instant, as in a
    # training loop that schedules the next step before its compute; the step is the all-reduce
    "home4-hints-ahead-4m": (_hints(_HOME), 4),
    "home4-auto-ahead-4m": (_auto(_HOME), 4),
    "issue4-auto-ahead-4m": (_auto(_ISSUE), 4),
}

#: scenario keys of a case beyond its hosts and size
EXTRA: dict[str, dict] = {name: {"step_ahead": 0.5} for name in CASES if "-ahead-" in name}

#: pairs of cases that differ in one knob: (knob, without, with)
PAIRS: list[tuple[str, str, str]] = [
    ("hints", "home4-4m", "home4-hints-4m"),
    ("hints", "issue4-4m", "issue4-hints-4m"),
    ("hints", "slow1-4m", "slow1-hints-4m"),
    ("auto", "home4-4m", "home4-auto-4m"),
    ("auto", "issue4-4m", "issue4-auto-4m"),
    ("auto", "slow1-4m", "slow1-auto-4m"),
    ("auto", "fast4-1g-4m", "fast4-auto-1g-4m"),
    ("hints", "asym4-4m", "asym4-hints-4m"),
    ("auto", "asym4-4m", "asym4-auto-4m"),
    ("ahead", "home4-hints-4m", "home4-hints-ahead-4m"),
    ("loss", "home4-1m", "home4-loss-1m"),
    ("loss", "lat150-1m", "lat150-loss-1m"),
    ("slow host", "fast4-1g-4m", "slow1-4m"),
]

QUICK = ["home4-1m"]

#: cases that run more rounds than ``--rounds``: with 1 % loss a lost SYN (1 s) or an RTO (0.2 s and
#: more) moves a single round by 0.2-1 s, so the median of 4 rounds is mostly luck -- two quiet
#: matrices of the same code measured home4-loss-1m at 1.53 and 2.03 s, lat150-loss-1m at 5.4 and
#: 2.8 s. Ten rounds make the median less a matter of the draw; the simulator's side is
#: moreover the median of `LOSSY_SEEDS` replays (`predict`). lat150-loss-1m takes 20: its rounds
#: spread 1.5-7.0 s within one run (a retransmission timeout on a 150 ms path is 0.35 s and more,
#: and a round waits for the worst of 12 streams); with ten, equal spans read 2.07-2.78 s over
#: five matrices (23-24 Nov), and bandwidth="auto" 1.86-2.99 s over four runs. More rounds would
#: not steady it: its rounds are not alike over a run. In seven runs (24-25 Nov) rounds 1-9 took a
#: median 2.03-2.20 s in every run, but rounds 10-19 2.21-4.51 s: in four of the seven, rounds stalled
#: from about the tenth step on (BBR's estimate collapsing, README "Simulator vs testbed"; rounds of
#: 3-12 s, 25 of 70 above 3 s against 10 of 63 in rounds 1-9; a 40-round run stayed so through round
#: 39, median 3.44 s), and `sim.bbr` does not produce that late collapse -- a longer run would
#: measure more of what the model lacks.
MIN_ROUNDS = {"home4-loss-1m": 10, "lat150-loss-1m": 20,
              # 0.08 s steps move by +-8 % between runs here (the forwarder and the peers share 2 cores),
              # more than the 5 % the direction check calls flat: with ten rounds two runs of the
              # same equal split still read 6.8 % apart once; twenty cost 12 s more than the default
              "fast4-1g-4m": 20, "fast4-auto-1g-4m": 20}


def case_scenario(name: str, rounds: int = 4, seed: int = 1) -> dict:
    hosts, mib = CASES[name]
    return {
        "seed": seed, "rounds": rounds, "numel": mib * MIB, "dtype": "float32", "grid": [],
        "step_timeout": 20.0, "round_gap": 0.5, "bootstrap_time": 2.0,
        "protocol": {"target_group_size": sum(h.get("count", 1) for h in hosts), "min_group_size": 2,
                     "matchmaking_time": 1.0, "part_timeout": 5.0, "allreduce_timeout": 60.0},
        "hosts": [dict(h) for h in hosts],
        **EXTRA.get(name, {}),
    }


@dataclass
class CaseResult:
    name: str
    hosts: int
    mib: int
    measured: float
    predicted: float
    floor: float
    wall: float
    testbed: dict
    simulated: dict

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured if self.measured and not math.isnan(self.measured) else math.nan

    @property
    def over_floor(self) -> float:
        return self.measured / self.floor if self.floor else math.nan

    @property
    def forwarder_load(self) -> float:
        """The testbed forwarder's CPU while steps ran, in cores: its CPU seconds from the first round
        to the last over the rounds' durations (the gaps between rounds carry almost no traffic; NaN
        if the run did not record it). Near 1 the forwarder, not the emulated links, sets the pace:
        the machine cannot emulate that case, whatever the simulator says."""
        tb = (self.testbed or {}).get("testbed", {})
        rounds = (self.testbed or {}).get("rounds") or []
        cpu = tb.get("forwarder", {}).get("cpu_seconds_rounds")
        if cpu is None or not rounds:
            return math.nan
        span = sum(r.get("sim_seconds", 0.0) for r in rounds)
        return cpu / span if span > 0 else math.nan

    @property
    def other_load(self) -> float:
        """Cores of user CPU that processes outside the run used while its rounds ran (NaN if the run
        did not record it; `testbed_run.run_testbed`)."""
        v = (self.testbed or {}).get("testbed", {}).get("other_user_cores")
        return float(v) if v is not None else math.nan

    @property
    def drops_per_round(self) -> float:
        """Packets the hosts' downlink queues (tbf) dropped, per round, over the whole run (NaN if the
        run did not record its qdiscs): hundreds where a slow host owns a span and its downlink takes
        the incast of every sender."""
        tb = (self.testbed or {}).get("testbed", {})
        rounds = (self.testbed or {}).get("rounds") or []
        qd = tb.get("qdiscs")
        if not qd or not rounds:
            return math.nan
        return sum(q.get("down", {}).get("drops", 0) for q in qd) / len(rounds)

    @property
    def predicted_drops_per_round(self) -> float:
        """Segments the replay's downlink queues dropped, per round (`sim.tcp`, "Queues"; NaN if the
        replay did not count them)."""
        drops = (self.simulated or {}).get("tail_drops")
        rounds = (self.simulated or {}).get("rounds") or []
        if drops is None or not rounds:
            return math.nan
        return sum(drops) / len(rounds)

    def row(self) -> dict:
        return {"case": self.name, "hosts": self.hosts, "MiB": self.mib, "measured": self.measured,
                "predicted": self.predicted, "ratio": self.ratio, "floor": self.floor, "over_floor": self.over_floor,
                "wall": self.wall, "forwarder_load": self.forwarder_load, "drops_per_round": self.drops_per_round,
                "predicted_drops_per_round": self.predicted_drops_per_round, "other_load": self.other_load}


#: replays of a lossy case, one per seed (the run's seed first): the prediction is their median
LOSSY_SEEDS = 5


def predict(measured: dict, sc: dict) -> tuple[dict, Any]:
    """The simulator's replay of a testbed run and its comparison (`compare.compare_runs`). On
    lossy links one replay is one draw of the losses: the same 10-round run predicted 1.08-1.28 s
    for home4-loss-1m over seeds 1-7 (lat150-loss-1m 1.70-2.27 s), as wide as the band the table
    checks. There the prediction is the median replay of `LOSSY_SEEDS` seeds (by its median
    step); the testbed side stays the one run it is."""
    base = replay_scenario({"scenario": sc, **measured})
    lossy = any(float(h.get("loss", 0.0)) > 0 for h in sc.get("hosts", ()))
    seeds = [int(sc.get("seed", 1)) + k for k in range(LOSSY_SEEDS if lossy else 1)]
    tries = []
    for s_ in seeds:
        predicted = replay({**base, "seed": s_})
        tries.append((compare_runs(measured, predicted), predicted))
    tries.sort(key=lambda t: t[0].predicted)
    c, predicted = tries[len(tries) // 2]
    return predicted, c


def run_case(name: str, rounds: int = 6, seed: int = 1,
             testbed: Callable[[dict], dict] | None = None) -> CaseResult:
    """One case on the testbed and in the simulator."""
    if testbed is None:
        from .testbed_run import run_testbed as testbed
    sc = case_scenario(name, max(rounds, MIN_ROUNDS.get(name, 0)), seed)
    t0 = time.perf_counter()
    measured = testbed(sc)
    wall = time.perf_counter() - t0
    predicted, c = predict(measured, sc)
    floor = floor_for_scenario(Scenario.from_dict(sc)).seconds
    hosts, mib = CASES[name]
    return CaseResult(name, sum(h.get("count", 1) for h in hosts), mib, c.measured, c.predicted, floor, wall,
                      measured, predicted)


def directions(results: dict[str, CaseResult], pairs: Sequence[tuple[str, str, str]] = PAIRS) -> list[dict]:
    """For each pair present in `results`: the relative change on the testbed and in the simulator,
    and whether they agree (same sign, or both flat)."""
    out = []
    for knob, a, b in pairs:
        if a not in results or b not in results:
            continue
        ra, rb = results[a], results[b]
        dm = (rb.measured - ra.measured) / ra.measured
        dp = (rb.predicted - ra.predicted) / ra.predicted
        if abs(dm) < FLAT:
            ok = abs(dp) < 2 * FLAT
        else:
            ok = (dm > 0) == (dp > 0) and abs(dp) >= FLAT / 2
        out.append({"knob": knob, "without": a, "with": b, "testbed": dm, "simulator": dp, "agree": ok})
    return out


def format_table(results: Sequence[CaseResult], dirs: Sequence[dict]) -> str:
    lines = [f"{'case':<18} {'hosts':>5} {'MiB':>4} {'measured s':>10} {'predicted s':>11} {'ratio':>6} "
             f"{'floor s':>8} {'meas/floor':>10} {'fwd cores':>9} {'drops/rnd':>9} {'sim drops':>9}"]
    for r in results:
        flag = "" if GOAL[0] <= r.ratio <= GOAL[1] else "  *"
        if r.forwarder_load >= BUSY_FORWARDER:
            flag += "  (forwarder-bound)"
        if r.other_load >= BUSY_MACHINE:
            flag += f"  (busy machine: other processes {r.other_load:.2f} cores)"
        lines.append(f"{r.name:<18} {r.hosts:>5} {r.mib:>4} {r.measured:>10.3f} {r.predicted:>11.3f} "
                     f"{r.ratio:>6.2f} {r.floor:>8.3f} {r.over_floor:>10.2f} {r.forwarder_load:>9.2f} "
                     f"{r.drops_per_round:>9.0f} {r.predicted_drops_per_round:>9.0f}{flag}")
    if dirs:
        lines.append("")
        lines.append(f"{'knob':<10} {'without -> with':<36} {'testbed':>8} {'simulator':>9}  agree")
        for d in dirs:
            lines.append(f"{d['knob']:<10} {d['without'] + ' -> ' + d['with']:<36} {d['testbed']:>+8.1%} "
                         f"{d['simulator']:>+9.1%}  {'yes' if d['agree'] else 'NO'}")
    inside = sum(GOAL[0] <= r.ratio <= GOAL[1] for r in results)
    busy = [r.name for r in results if r.other_load >= BUSY_MACHINE]
    if busy:
        lines.append("")
        lines.append(f"other processes used >= {BUSY_MACHINE} cores during {', '.join(busy)}: run "
                     f"{'that case' if len(busy) == 1 else 'those cases'} again on an idle machine")
    lines.append("")
    lines.append(f"{inside} of {len(results)} cases within {GOAL[0]}-{GOAL[1]} (* outside); "
                 f"{sum(d['agree'] for d in dirs)} of {len(dirs)} directions agree")
    return "\n".join(lines)


def run_matrix(names: Sequence[str], rounds: int = 6, seed: int = 1,
               progress: Callable[[str], None] | None = None) -> tuple[list[CaseResult], list[dict]]:
    results: dict[str, CaseResult] = {}
    for name in names:
        if progress:
            progress(name)
        results[name] = run_case(name, rounds, seed)
    return list(results.values()), directions(results)


def _machine() -> str:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import os

    return f"machine: {model}, {os.cpu_count()} cores, kernel {platform.release()}"


def main(args: Any) -> int:
    from .testbed import check_output_paths, check_support, interrupt_on_signals

    # the matrix takes many minutes: its results must not be lost to a typo in --out
    reason = check_support() or check_output_paths([args.out])
    if reason:
        print(f"python -m sim fidelity: {reason}", file=sys.stderr)
        return 2
    if args.cases:
        names = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = [n for n in names if n not in CASES]
        if unknown:
            print(f"unknown cases {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
            return 2
    else:
        names = QUICK if args.quick else list(CASES)
    interrupt_on_signals()  # a SIGTERM or SIGHUP mid-case tears its testbed down (python -m sim: exit 130)
    print(_machine(), flush=True)
    results, dirs = run_matrix(names, args.rounds, args.seed,
                               progress=lambda n: print(f"... {n}", file=sys.stderr, flush=True))
    print(format_table(results, dirs))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json_text({"machine": _machine(), "cases": [r.row() for r in results], "directions": dirs,
                               "runs": {r.name: {"testbed": r.testbed, "simulator": r.simulated} for r in results}},
                              indent=1, sort_keys=True))
    return 0
