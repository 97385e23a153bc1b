"""Record and replay: a testbed run's scenario replayed in the simulator, measured against predicted.

``python -m sim compare RUN.json`` reads what ``python -m sim testbed SCENARIO --out RUN.json``
wrote (the scenario it ran is inside), runs the same scenario in the simulator and prints,
per round and overall, the measured and predicted step time (median and slowest peer),
bytes sent per peer and outcomes, with their ratios (predicted / measured). The numbers
come from one place, `compare_runs`, which the fidelity matrix (`sim.fidelity`) uses too.

Bytes are not the same quantity on both sides, so the columns say which is which: the testbed
counts the kernel's bytes on each host's link (Ethernet/IP/TCP headers, ACKs and ZMTP framing
included), the simulator the messages' bytes; "p wire" estimates the latter on the wire
(each MSS of payload carries 66 bytes of headers: Ethernet 14, IP 20, TCP with timestamps 32).
ACKs (a host's ACKs count in its sent bytes) are left out, so "p wire" stays a little below.

Step time of a round = the median over the peers that stepped of the time their `step()`
took (``step_seconds``); "slowest" is the largest. Overall figures are medians over rounds.
The phases (``phase_seconds``: matchmaking and all-reduce of each successful step) are
compared the same way, as medians over peers, so a gap can be placed in one phase or the other.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RoundComparison", "Comparison", "compare_runs", "replay", "replay_scenario", "format_comparison", "step_stats"]


WIRE = (1448 + 66) / 1448  # bytes on the link per byte of payload in full segments (see the module doc)


def step_stats(rnd: dict) -> tuple[float, float]:
    """(median, max) of a round's per-peer step durations; NaN when nobody finished."""
    xs = [float(s) for _, s in rnd.get("step_seconds", [])]
    if not xs:
        return math.nan, math.nan
    return float(np.median(xs)), float(max(xs))


def phase_stats(rnd: dict) -> tuple[float, float]:
    """(median matchmaking, median all-reduce) seconds of a round's successful steps; NaN if none
    (or if the results file predates ``phase_seconds``)."""
    ph = rnd.get("phase_seconds") or []
    if not ph:
        return math.nan, math.nan
    return float(np.median([float(m) for _, m, _ in ph])), float(np.median([float(a) for _, _, a in ph]))


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


@dataclass
class RoundComparison:
    round: int
    measured: float
    predicted: float
    measured_max: float
    predicted_max: float
    bytes_measured: float
    bytes_predicted: float
    ok_measured: int
    ok_predicted: int
    failures_measured: dict
    failures_predicted: dict
    matchmaking_measured: float = math.nan
    matchmaking_predicted: float = math.nan
    allreduce_measured: float = math.nan
    allreduce_predicted: float = math.nan

    @property
    def ratio(self) -> float:
        return _ratio(self.predicted, self.measured)


@dataclass
class Comparison:
    rounds: list[RoundComparison]
    measured: float  # median over rounds
    predicted: float
    skip: int = 0  # leading rounds left out of the overall figures (warm-up)
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return _ratio(self.predicted, self.measured)

    def to_dict(self) -> dict:
        return {"measured": self.measured, "predicted": self.predicted, "ratio": self.ratio, "skip": self.skip,
                "rounds": [{**r.__dict__, "ratio": r.ratio} for r in self.rounds], **self.extra}


def replay_scenario(run: dict) -> dict:
    """The scenario of a testbed run as the simulator should replay it: with the machine the run
    recorded (``testbed.tcp``: the host namespaces' TCP settings; ``testbed.cpu``: the CPU cost
    profile and the cores that every peer shares) and the testbed's downlink queues (tbf: finite,
    tail drop; `sim.testbed.TBF_QUEUE`), unless the scenario itself sets them."""
    sc = dict(run["scenario"])
    tb = run.get("testbed") or {}
    if tb.get("tcp"):
        net = dict(sc.get("network") or {})
        net["tcp"] = {**tb["tcp"], **(net.get("tcp") or {})}
        sc["network"] = net
    if sc.get("hosts") and "down_queue" not in (sc.get("network") or {}):
        from .testbed import TBF_QUEUE

        # the testbed's downlinks are tbf queues of a finite size that tail-drop (its incast drops)
        sc["network"] = {**(sc.get("network") or {}), "down_queue": dict(TBF_QUEUE)}
    if tb.get("cpu") and not sc.get("cpu"):
        from dataclasses import fields

        from .cpu import CpuCosts

        # the costs this version models (a record from another version may hold more, which went unused)
        known = {f.name for f in fields(CpuCosts)}
        costs = {k: v for k, v in tb["cpu"]["costs"].items() if k in known}
        # the testbed's switch is a process on the same cores: its CPU per byte forwarded, as this run
        # measured it (its frame sizes follow the run's rates), makes it one more serial consumer
        fwd = tb.get("forwarder") or {}
        moved = sum(p.get("rx_bytes", 0) for p in fwd.get("ports", ()))
        # (a calibrated profile holds switch_byte 0.0 -- `calibrate` writes every field and measures no
        # switch -- so 0 means "not given", as a missing key does: testing the key alone left the
        # forwarder out of every replay on a machine whose profile was written since the field came,
        # and the forwarder-bound fast8 case read 0.64 instead of ~0.9)
        if fwd.get("cpu_seconds") and moved and not costs.get("switch_byte"):
            costs["switch_byte"] = fwd["cpu_seconds"] / moved
        sc["cpu"] = {"costs": costs, "cores": int(tb["cpu"]["cores"]), "shared": True}
    return sc


def replay(scenario: dict) -> dict:
    """Run a scenario (as a testbed run recorded it) in the simulator; the results dict."""
    from .scenario import run_scenario

    return json.loads(run_scenario(dict(scenario)).to_json())


def interleave(m: tuple[float, float], p: tuple[float, float]) -> tuple[float, float, float, float]:
    return m[0], p[0], m[1], p[1]


def compare_runs(measured: dict, predicted: dict, skip: int = 0) -> Comparison:
    """Compare two results dicts round by round (`measured`: testbed, `predicted`: simulator).
    `skip` leading rounds are shown but left out of the overall medians."""
    out = []
    steps = (measured.get("testbed") or {}).get("steps") or []
    for rm, rp in zip(measured["rounds"], predicted["rounds"]):
        if "phase_seconds" not in rm and steps:  # a results file from before rounds carried them
            rm = {**rm, "phase_seconds": [[s["slot"], s["timings"].get("matchmaking", 0.0), s["timings"].get("allreduce", 0.0)]
                                          for s in steps if s.get("round") == rm["round"] and s.get("timings")]}
        mm, mx = step_stats(rm)
        pm, px = step_stats(rp)
        out.append(RoundComparison(rm["round"], mm, pm, mx, px, float(rm.get("bytes_sent_mean", math.nan)),
                                   float(rp.get("bytes_sent_mean", math.nan)), int(rm.get("succeeded", 0)),
                                   int(rp.get("succeeded", 0)), dict(rm.get("failures", {})),
                                   dict(rp.get("failures", {})), *interleave(phase_stats(rm), phase_stats(rp))))
    used = [r for r in out[skip:] if not (math.isnan(r.measured) or math.isnan(r.predicted))]
    med = lambda xs: float(np.median(xs)) if xs else math.nan  # noqa: E731
    return Comparison(out, med([r.measured for r in used]), med([r.predicted for r in used]), skip)


def format_comparison(c: Comparison) -> str:
    head = (f"{'round':>5} {'measured s':>10} {'predicted s':>11} {'ratio':>6} {'slowest m/p':>13} "
            f"{'MB sent m link/p msgs/p wire':>28} {'ok m/p':>7} {'match m/p':>11} {'allred m/p':>11}  failures m / p")
    lines = [head]
    for r in c.rounds:
        fm = ",".join(f"{k}:{v}" for k, v in sorted(r.failures_measured.items())) or "-"
        fp = ",".join(f"{k}:{v}" for k, v in sorted(r.failures_predicted.items())) or "-"
        lines.append(f"{r.round:>5} {r.measured:>10.3f} {r.predicted:>11.3f} {r.ratio:>6.2f} "
                     f"{r.measured_max:>6.2f}/{r.predicted_max:<6.2f} "
                     f"{r.bytes_measured / 1e6:>8.2f}/{r.bytes_predicted / 1e6:<8.2f}/"
                     f"{r.bytes_predicted * WIRE / 1e6:<9.2f} "
                     f"{r.ok_measured:>3}/{r.ok_predicted:<3} "
                     f"{r.matchmaking_measured:>5.2f}/{r.matchmaking_predicted:<5.2f} "
                     f"{r.allreduce_measured:>5.2f}/{r.allreduce_predicted:<5.2f}  {fm} / {fp}")
    note = f" (rounds {c.skip}+)" if c.skip else ""
    lines.append(f"overall{note}: measured median step {c.measured:.3f} s, predicted {c.predicted:.3f} s, "
                 f"ratio {c.ratio:.3f}")
    return "\n".join(lines)


def _not_a_run(run: Any) -> str | None:
    """Why `run` is not a testbed run's results, or None. Checks the shape the replay reads (a file cut
    short by a full disk or edited by hand crashed the comparison with an AttributeError)."""
    # a simulator run (python -m sim run --out) has 'scenario' and 'rounds' too: only a testbed run
    # has the 'testbed' section (what was measured), and replaying a simulator run compares it with itself
    if not isinstance(run, dict) or not {"scenario", "rounds", "testbed"} <= set(run):
        return ("a simulator run (python -m sim run), not a testbed run" if isinstance(run, dict) and "trace" in run
                else "not a testbed run (no 'scenario', 'rounds' and 'testbed')")
    for key, typ, what in (("scenario", dict, "a table"), ("testbed", dict, "a table"), ("rounds", list, "a list")):
        if not isinstance(run[key], typ):
            return f"not a testbed run ('{key}' is {type(run[key]).__name__}, not {what})"
    bad = [i for i, r in enumerate(run["rounds"]) if not isinstance(r, dict) or not isinstance(r.get("round"), int)]
    if bad:
        return f"not a testbed run (round entry {bad[0]} is not a round's metrics)"
    return None


def main(path: str, skip: int = 0, as_json: bool = False) -> int:
    from .scenario import json_text  # here, as run_scenario above: sim.scenario loads the whole simulator

    try:
        run = json.loads(Path(path).read_text())
    except ValueError as e:  # UnicodeDecodeError is one too
        print(f"python -m sim compare: error: {path} is not JSON ({e}); a run file cut short, or not one "
              "python -m sim testbed SCENARIO --out RUN.json wrote", file=sys.stderr)
        return 2
    why = _not_a_run(run)
    if why:
        print(f"python -m sim compare: error: {path} is {why}; expected the testbed run JSON that "
              "python -m sim testbed SCENARIO --out RUN.json writes", file=sys.stderr)
        return 2
    pred = replay(replay_scenario(run))
    c = compare_runs(run, pred, skip=skip)
    if as_json:
        print(json_text(c.to_dict(), sort_keys=True, indent=1))
    else:
        print(format_comparison(c))
    return 0


def run_cli(args: Any) -> int:
    return main(args.run, skip=args.skip, as_json=args.json)
