"""``python -m sim``: run simulated experiments on the real zgossip protocol.

    python -m sim run scenario.toml [--out results.json] [--csv rounds.csv]
    python -m sim train scenario.toml [--out results.json] [--json]   # N trainers in virtual time (sim.train)
    python -m sim moshpit --peers 1024 --group-size 32 --grid 32x32 --dropout 0.01 --rounds 10 \
                          --seed 0 --level message|round [--json]
    python -m sim table [--quick] [--json]      # the Moshpit paper's averaging table (a sweep, round level)
    python -m sim sweep SWEEP.toml [--out DIR] [--workers N | --serial | --cluster ADDRESS] [--plot]
    python -m sim plot RESULTS_DIR [--out DIR]  # the standard figures of a sweep, as PNG
    python -m sim bench [--json]                # speed vs a bare SimPy model, memory at 16,384 peers
    python -m sim compare RUN.json [--skip K]   # a testbed run replayed in the simulator, side by side
    python -m sim fidelity [--quick] [--cases a,b] [--out F]  # testbed vs simulator over a case matrix
    python -m sim autogrid [--sizes 16,512,64] [--seeds N] # grid="auto" as a swarm grows and shrinks (sim.autogrid)
    python -m sim calibrate [--out PROFILE.json] # CPU costs and TCP sysctls of this machine (sim.cpu)
    python -m sim testbed scenario.toml [--out run.json] [--csv rounds.csv] [--compare]   # real peers, root
    python -m sim testbed --selftest scenario.toml | --cleanup
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Sequence

import numpy as np

from zgossip.cliargs import log_level, nonnegative_int, positive_int

from .scenario import json_text

__all__ = ["main"]


class _Progress:
    """A progress bar on one line of `stream` (redrawn in place on a terminal, else printed once at
    the end), and a logging handler that prints records *above* it instead of into it."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.line = ""  # the bar as last drawn, while it is on screen

    def __call__(self, done: int, total: int) -> None:
        tty = self.stream.isatty()
        if not tty and done < total:
            return
        width = 30
        fill = int(width * done / max(1, total))
        el = time.perf_counter() - self.start
        self.line = f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total} rounds, {el:.1f}s"
        self.stream.write("\r" + self.line)
        if done >= total:
            self.stream.write("\n")
            self.line = ""
        self.stream.flush()

    def above(self, text: str) -> None:
        if self.line and self.stream.isatty():
            self.stream.write("\r\033[K" + text + "\n" + self.line)  # clear the bar, print, redraw it
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def log_handler(self) -> logging.Handler:
        bar = self

        class Above(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                try:
                    bar.above(self.format(record))
                except Exception:
                    self.handleError(record)

        h = Above()
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        return h


def _progress(stream=None) -> _Progress:
    """A progress bar that log records print above (see `_Progress`); the root logger writes through it."""
    bar = _Progress(stream)
    root = logging.getLogger()
    for h in list(root.handlers):  # ours from an earlier bar, or basicConfig's on stderr: replaced
        if getattr(h, "_sim_progress", False) or (type(h) is logging.StreamHandler and h.stream is bar.stream):
            root.removeHandler(h)
    h = bar.log_handler()
    h._sim_progress = True  # type: ignore[attr-defined]
    root.addHandler(h)
    return bar


def _load(path: str, prog: str):
    """The scenario at `path`, or a one-line error naming the problem (missing file, bad TOML/JSON,
    an unknown key and the valid ones) and exit status 2."""
    from .scenario import load_scenario

    try:
        return load_scenario(path)
    except OSError as e:
        raise _UsageError(f"{prog}: error: cannot read scenario {path}: {e.strerror or e}") from None
    except (ValueError, TypeError, KeyError) as e:  # TOML/JSON syntax errors are ValueErrors too
        raise _UsageError(f"{prog}: error: scenario {path}: {e}") from None


class _UsageError(Exception):
    pass


def _check_outputs(prog: str, paths: list[str | None]) -> None:
    """--out/--csv checked before the run: a missing folder or a directory given for a file failed
    only when the results were written, after the whole simulation, which was lost."""
    from .testbed import check_output_paths

    reason = check_output_paths(paths)
    if reason:
        raise _UsageError(f"{prog}: error: {reason}")


def _table(rows: list[dict], keys: Sequence[tuple[str, str, str]]) -> str:
    head = " ".join(f"{title:>{len(title) if len(title) > 8 else 8}}" for title, _, _ in keys)
    lines = [head]
    for r in rows:
        cells = []
        for title, key, fmt in keys:
            w = len(title) if len(title) > 8 else 8
            v = r[key]
            cells.append(f"{format(v, fmt) if not isinstance(v, (dict, list, str)) else _compact(v):>{w}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def _compact(v) -> str:
    if isinstance(v, dict):
        return ",".join(f"{k}x{n}" if str(k).isdigit() else f"{k}:{n}" for k, n in v.items()) or "-"
    return str(v)


_COLUMNS = [("round", "round", "d"), ("sim s", "sim_seconds", ".3f"), ("live", "live", "d"),
            ("stepped", "participants", "d"), ("ok", "succeeded", "d"), ("mse", "mse", ".3e"),
            ("max |err|", "max_abs", ".3e"), ("groups (size x n)", "groups", ""),
            ("KB sent", "bytes_sent_mean", ".1f"), ("failures", "failures", "")]


def _print_rounds(res, wall: list[float] | None = None) -> None:
    rows = []
    for r in res.rounds:
        rows.append({**r, "bytes_sent_mean": r["bytes_sent_mean"] / 1e3})
    print(_table(rows, _COLUMNS))
    if wall:
        print(f"wall time per round: median {np.median(wall):.3f}s, max {max(wall):.3f}s; trace {res.trace}")


def cmd_run(args: argparse.Namespace) -> int:
    from .scenario import run_scenario

    sc = _load(args.scenario, "python -m sim run")
    _check_outputs("python -m sim run", [args.out, args.csv])
    res = run_scenario(sc, progress=None if args.quiet else _progress())
    if args.out:
        with open(args.out, "w") as f:
            f.write(res.to_json())
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(res.to_csv())
    if args.json:
        print(res.to_json())
    else:
        _print_rounds(res, res.wall_seconds)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .train import load_train_scenario, run_train

    sc = load_train_scenario(args.scenario)
    _check_outputs("python -m sim train", [args.out])
    res = run_train(sc)
    if args.out:
        with open(args.out, "w") as f:
            f.write(res.to_json())
    if args.json:
        print(res.to_json())
        return 0
    spec = sc.spec
    print(f"{spec.optimizer}: {sc.peers} trainers, {spec.hidden * (spec.d_in + 1) + (spec.hidden + 1) * spec.d_out} "
          f"parameters, {spec.steps} steps of {spec.step_time} s")
    rows = [{**c, "sent": c["sent"] / 1e6, "received": c["received"] / 1e6} for c in res.curve]
    print(_table(rows, [("step", "step", "d"), ("trainers", "n", "d"), ("sim s", "t", ".2f"),
                        ("held-out loss", "loss", ".5f"), ("worst", "loss_max", ".5f"),
                        ("MB sent", "sent", ".2f"), ("MB received", "received", ".2f")]))
    print("\n" + _table([{**t, "sent": t["sent"] / 1e6, "received": t["received"] / 1e6,
                          "fate": "crashed" if t["crashed"] else ("late" if t["late"] else "-")} for t in res.trainers],
                        [("slot", "slot", "d"), ("joined", "joined", ".2f"), ("steps", "steps", "d"),
                         ("epoch", "epoch", "d"), ("MB sent", "sent", ".2f"), ("MB received", "received", ".2f"),
                         ("fate", "fate", "")]))
    fin = res.final
    print(f"\nfinal: {fin['live']} live trainers, {fin['distinct_params']} distinct parameter sets "
          f"(identical: {fin['identical']}), spread {fin['spread']:.3e}; simulated {fin['t_final']:.2f} s")
    print(f"loss hash {res.loss_hash}; trace {res.trace}; wall {res.wall_seconds:.1f} s")
    return 0


def grid_shape(text: str) -> list[int]:
    """The argparse type of ``--grid``: ``32x32`` as [32, 32], empty as [] (no grid); anything else is
    refused naming the option ("abc" said "invalid literal for int() with base 10", naming none)."""
    try:
        shape = [int(x) for x in text.lower().split("x")] if text else []
    except ValueError:
        shape = [0]
    if any(m < 1 for m in shape):
        raise argparse.ArgumentTypeError(f"must be sizes >= 1 joined by x (e.g. 32x32), or empty for no grid, "
                                         f"got {text!r}")
    return shape


def cmd_moshpit(args: argparse.Namespace) -> int:
    grid = args.grid
    if args.level == "round":
        from .roundlevel import RoundLevelSwarm

        rng = np.random.default_rng(args.seed)
        values = rng.standard_normal(args.peers)
        method = "moshpit" if grid else "random"
        # the round-level model's names: "random" (cells may repeat) is its "iid"; "full" fills the
        # cells in grid order, as the message level (`sim.scenario.place_peers`) does
        placement, coords = {"random": "iid"}.get(args.placement, args.placement), None
        if grid and placement == "full":
            cells = int(np.prod(grid))
            if args.peers > cells:
                raise ValueError(f"{args.peers} peers do not fit {cells} grid cells with placement=full")
            coords = np.array(list(np.ndindex(*grid))[:args.peers], dtype=np.int64).reshape(args.peers, len(grid))
            placement = "distinct"
        swarm = RoundLevelSwarm(values, method, rng, p_unavailable=args.dropout, group_size=args.group_size,
                                grid=tuple(grid), coords=coords, placement=placement)
        rows, walls = [], []
        show = None if args.json else _progress()
        for r in range(args.rounds):
            t0 = time.perf_counter()
            rec = swarm.step()
            walls.append(time.perf_counter() - t0)
            rows.append({"round": r, "mse": rec.mse, "max_abs": float(np.sqrt(rec.max_sq)),
                         "participants": rec.participants, "groups": rec.n_groups})
            if show:
                show(r + 1, args.rounds)
        if args.json:
            print(json_text({"level": "round", "rounds": rows}, sort_keys=True))
        else:
            print(_table(rows, [("round", "round", "d"), ("mse", "mse", ".3e"), ("max |err|", "max_abs", ".3e"),
                                ("averaged", "participants", "d"), ("groups", "groups", "d")]))
            print(f"wall time per round: median {np.median(walls):.4f}s")
        return 0

    from .scenario import run_scenario

    # distinct cells on a grid the peers fill are every cell: the grid order (full) is the same swarm up to
    # the peers' names; "random" (cells may repeat) stays random
    full = grid and np.prod(grid) == args.peers and args.placement == "distinct"
    sc = {"peers": args.peers, "grid": grid, "rounds": args.rounds, "seed": args.seed, "numel": args.numel,
          "unavailability": args.dropout, "placement": "full" if full else args.placement,
          "membership": "static", "encode": False, "bootstrap_time": 0.0,
          "protocol": {"target_group_size": args.group_size, "gossip_interval": 60.0, "peer_timeout": 600.0}}
    res = run_scenario(sc, progress=None if args.json else _progress())
    if args.json:
        print(res.to_json())
    else:
        _print_rounds(res, res.wall_seconds)
    return 0


def cmd_table(args: argparse.Namespace) -> int:
    """The Moshpit table as the sweep sim/sweeps/moshpit_table.toml (parallel, resumable), printed."""
    import dataclasses

    from .moshpit import format_table, table_from_sweep
    from .sweep import SWEEPS_DIR, load_sweep, read_table, run_sweep

    sweep = load_sweep(SWEEPS_DIR / "moshpit_table.toml")
    if args.quick:
        sweep = dataclasses.replace(sweep, seeds=list(range(3)))
    out = args.out or f"results/{sweep.name}-{len(sweep.seeds)}"
    t0 = time.perf_counter()
    res = run_sweep(sweep, out, workers=0 if args.serial else args.workers, quiet=args.json)
    rows = table_from_sweep(read_table(out)[1])
    cap = int(sweep.base["cap"])
    if args.json:
        print(json_text({"restarts": len(sweep.seeds), "cap": cap, "seed": sweep.seed, "rows": rows}, indent=1), end="")
        print()
    else:
        print(format_table(rows, restarts=len(sweep.seeds), cap=cap))
        print(f"({time.perf_counter() - t0:.1f} s wall; {res.computed} runs computed, {res.reused} reused from {out})")
    return 1 if res.failures else 0


def _step_medians(rounds: list[dict]) -> dict[int, float]:
    per: dict[int, list[float]] = {}
    for r in rounds:
        for slot, sec in r.get("step_seconds", []):
            per.setdefault(slot, []).append(sec)
    return {k: float(np.median(v)) for k, v in sorted(per.items())}


def cmd_testbed(args: argparse.Namespace) -> int:
    from .testbed import TestbedUnavailable, check_output_paths, check_support, cleanup, interrupt_on_signals

    if args.cleanup:
        removed = cleanup(force=args.force)
        print(json.dumps(removed, sort_keys=True))
        return 0
    if not args.scenario:
        print("python -m sim testbed: a scenario file is needed (or --cleanup)", file=sys.stderr)
        return 2
    from .scenario import ScenarioResult

    sc = _load(args.scenario, "python -m sim testbed")
    if not sc.hosts:
        print(f"{args.scenario}: the testbed needs [[hosts]] (per-host rates/latency/loss); profiles and [network] "
              "are simulator-only", file=sys.stderr)
        return 2
    bad = [kv for kv in args.sysctl if "=" not in kv or not kv.split("=", 1)[0].strip()]
    if bad:  # dict() of them said "dictionary update sequence element #0 has length 1; 2 is required"
        print(f"python -m sim testbed: --sysctl takes KEY=VALUE (e.g. net.ipv4.tcp_slow_start_after_idle=0), "
              f"not {bad[0]!r}", file=sys.stderr)
        return 2
    reason = check_support() or check_output_paths([args.out, args.csv])
    if reason:
        print(f"python -m sim testbed: {reason}", file=sys.stderr)
        return 2
    interrupt_on_signals()  # SIGTERM/SIGHUP unwind like Ctrl-C, so every finally tears down
    try:
        if args.selftest:
            from .testbed_probe import format_selftest, selftest

            st = selftest(sc.host_list(), seed=sc.seed)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(json_text(st, sort_keys=True, indent=1))
            print(format_selftest(st))
            return 0
        from .testbed_run import run_testbed

        measured = None
        if args.measure:
            from .testbed_probe import format_selftest, selftest

            measured = selftest(sc.host_list(), seed=sc.seed)
            if not args.quiet:
                print(format_selftest(measured), file=sys.stderr)
        sysctls = dict(kv.split("=", 1) for kv in args.sysctl)
        res = run_testbed(sc, sysctls=sysctls, curve=args.curve, progress=None if args.quiet else _progress(),
                          say=(lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr)))
        if measured is not None:
            res["testbed"]["measured_links"] = measured
    except TestbedUnavailable as e:
        print(f"python -m sim testbed: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"python -m sim testbed: interrupted ({e or 'Ctrl-C'}); the testbed was torn down", file=sys.stderr)
        return 130
    if args.out:
        with open(args.out, "w") as f:
            f.write(json_text(res, sort_keys=True, indent=1))
    sres = ScenarioResult(res["scenario"], res["rounds"], res["peer_bytes"], "", 0, 0)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(sres.to_csv())
    if args.json:
        print(json_text(res, sort_keys=True, indent=1))
        return 0
    _print_rounds(sres)
    tb = res["testbed"]
    print(f"forwarder: {tb['forwarder']['cpu_seconds']:.2f} CPU s for the run "
          f"({tb['forwarder']['cpu_seconds_rounds']:.2f} during rounds); "
          f"frames released {tb['forwarder']['late_mean_us']:.0f} us late on average; "
          f"{tb['machine']['cpu']}, {tb['machine']['kernel']}, load {tb['machine']['loadavg'][0]:.2f}")
    med = _step_medians(res["rounds"])
    sim_med: dict[int, float] = {}
    if args.compare:
        from .scenario import run_scenario

        sim_med = _step_medians(run_scenario(sc).rounds)
    print("median step seconds per host: " + ", ".join(
        f"{k}: {v:.3f}" + (f" (sim {sim_med[k]:.3f})" if k in sim_med else "") for k, v in med.items()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. What it refuses, or what fails on bad input (a value of the wrong type
    or range in a file, a file that cannot be read or written), ends in one line on stderr and exit
    status 2, Ctrl-C in "interrupted" and 130; ``SIM_TRACEBACK=1`` shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        if os.environ.get("SIM_TRACEBACK"):
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, KeyError, IndexError, OSError, RuntimeError, MemoryError) as e:
        if os.environ.get("SIM_TRACEBACK"):
            raise
        cmd = argv[0] if argv else ""
        print(f"python -m sim {cmd}: {type(e).__name__}: {e} (SIM_TRACEBACK=1 shows where)", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    # subcommands with parsers of their own (argparse's REMAINDER would take their options as ours)
    if argv[:1] == ["calibrate"]:
        from .cpu import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv[:1] == ["autogrid"]:
        from .autogrid import main as autogrid_main

        return autogrid_main(argv[1:])
    if argv[:1] == ["overlap"]:
        from .testbed_bench import main as overlap_main

        return overlap_main(argv[1:])
    if argv[:1] == ["state"]:
        from .testbed_bench import state_main

        return state_main(argv[1:])
    if argv[:1] == ["bench"]:
        from .bench import main as bench_main

        return bench_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m sim", description="Simulate zgossip on a modelled network.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a scenario file (TOML or JSON)")
    r.add_argument("scenario", help="scenario file (.toml or .json; see sim/scenarios/)")
    r.add_argument("--out", help="write the results JSON here (byte-identical for the same scenario and seed)")
    r.add_argument("--csv", help="write one row per round here")
    r.add_argument("--json", action="store_true", help="print the results JSON instead of the table")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--log-level", type=log_level, default="WARNING",
                   help="log records of the simulated peers shown (above the progress bar); default WARNING")
    r.set_defaults(fn=cmd_run)
    tr = sub.add_parser("train", help="simulated training: N real trainers in virtual time (a [train] scenario)")
    tr.add_argument("scenario", help="scenario file (TOML or JSON) with a [train] table, e.g. sim/scenarios/train64.toml")
    tr.add_argument("--out", help="write the results JSON here (byte-identical for the same scenario and seed)")
    tr.add_argument("--json", action="store_true", help="print the results JSON instead of the tables")
    tr.set_defaults(fn=cmd_train)
    m = sub.add_parser("moshpit", help="a Moshpit averaging experiment from flags")
    # (--peers 0 at the round level ran into numpy's "mean of empty slice" warnings and a reshape error)
    m.add_argument("--peers", type=positive_int, default=1024, help="number of peers (default 1024)")
    m.add_argument("--group-size", type=positive_int, default=32, help="target group size (default 32)")
    m.add_argument("--grid", type=grid_shape, default="32x32",
                   help="e.g. 32x32 (the default); empty for random groups (round level)")
    m.add_argument("--dropout", type=float, default=0.0, help="per-round unavailability probability")
    m.add_argument("--rounds", type=nonnegative_int, default=5, help="averaging rounds (default 5)")
    m.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the run (default 0)")
    m.add_argument("--numel", type=positive_int, default=1, help="values per peer (message level; default 1)")
    m.add_argument("--placement", default="distinct", choices=["full", "distinct", "random"],
                   help="how peers take grid cells: every cell (full), distinct cells, or random with collisions "
                        "(default distinct)")
    m.add_argument("--level", default="message", choices=["message", "round"],
                   help="simulate every message of the real protocol, or only who averages with whom (default message)")
    m.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    m.set_defaults(fn=cmd_moshpit)
    t = sub.add_parser("table", help="the Moshpit paper's averaging table on the round-level model")
    t.add_argument("--quick", action="store_true", help="3 restarts instead of 10")
    t.add_argument("--json", action="store_true", help="print the table as JSON")
    t.add_argument("--out", help="the sweep's results folder (default: results/moshpit_table-RESTARTS)")
    t.add_argument("--workers", type=positive_int, default=None, help="local processes (default: one per core)")
    t.add_argument("--serial", action="store_true", help="run in this process, one run after another")
    t.set_defaults(fn=cmd_table)
    c = sub.add_parser("compare", help="replay a testbed run in the simulator: measured vs predicted per round")
    c.add_argument("run", help="results JSON written by `python -m sim testbed SCENARIO --out RUN.json`")
    c.add_argument("--skip", type=nonnegative_int, default=0, help="leave this many leading rounds out of the overall figures")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON")
    c.set_defaults(fn=lambda a: __import__("sim.compare", fromlist=["run_cli"]).run_cli(a))
    fi = sub.add_parser("fidelity", help="testbed vs simulator over a matrix of network cases (root)")
    fi.add_argument("--quick", action="store_true", help="only the small case the test suite runs")
    fi.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    fi.add_argument("--rounds", type=positive_int, default=6, help="steps per case (the median is reported; default 6, so the first round -- connection set-up and slow start -- is not half of the median)")
    fi.add_argument("--seed", type=int, default=1, help="seed of every case (default 1)")
    fi.add_argument("--out", help="write every case's runs and the table as JSON here")
    fi.set_defaults(fn=lambda a: __import__("sim.fidelity", fromlist=["main"]).main(a))
    from . import sweep as _sweep  # light: imports nothing heavy until a sweep runs

    sw = sub.add_parser("sweep", help="run a sweep file: a base scenario x axes x seeds, resumable, in parallel")
    _sweep.add_arguments(sw)
    sw.set_defaults(fn=_sweep.cmd_sweep)
    pl = sub.add_parser("plot", help="draw a sweep's standard figures (PNG)")
    pl.add_argument("results", help="a sweep's results folder")
    pl.add_argument("--out", help="folder for the PNGs (default: RESULTS/plots)")
    pl.add_argument("--metric", help="metric column (default: the sweep's [plot] metric, else mse; loss for a train sweep)")
    pl.add_argument("--eps", type=float, help="threshold of the rounds-to-eps heatmap (default: [plot] eps, else 1e-9)")
    pl.add_argument("--heatmap", nargs=2, metavar=("X", "Y"), help="the heatmap's two axes")
    pl.set_defaults(fn=lambda a: __import__("sim.plot", fromlist=["main"]).cmd_plot(a))
    ag = sub.add_parser("autogrid", help='grid="auto" in a swarm that grows and shrinks, against hand-sized grids')
    ag.add_argument("rest", nargs=argparse.REMAINDER, help="options of python -m sim autogrid (see its --help)")
    ag.set_defaults(fn=lambda a: __import__("sim.autogrid", fromlist=["main"]).main(a.rest))
    b = sub.add_parser("bench", help="speed and memory of the simulator against a bare SimPy model")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options of python -m sim bench (see its --help)")
    b.set_defaults(fn=lambda a: __import__("sim.bench", fromlist=["main"]).main(a.rest))
    c = sub.add_parser("calibrate", help="measure this machine's CPU costs and TCP settings (a profile for cpu = ...)")
    c.add_argument("rest", nargs=argparse.REMAINDER, help="options of python -m sim calibrate (see its --help)")
    c.set_defaults(fn=lambda a: __import__("sim.cpu", fromlist=["main"]).main(a.rest))
    ov = sub.add_parser("overlap", help="zgossip bench-train --overlap with each process on a shaped testbed host (root)")
    ov.add_argument("rest", nargs=argparse.REMAINDER, help="options of python -m sim overlap (see its --help)")
    ov.set_defaults(fn=lambda a: __import__("sim.testbed_bench", fromlist=["main"]).main(a.rest))
    st = sub.add_parser("state", help="zgossip bench-state with each donor and the downloader on a shaped host (root)")
    st.add_argument("rest", nargs=argparse.REMAINDER, help="options of python -m sim state (see its --help)")
    st.set_defaults(fn=lambda a: __import__("sim.testbed_bench", fromlist=["state_main"]).state_main(a.rest))
    tb = sub.add_parser("testbed", help="run a scenario's [[hosts]] with real peers in network namespaces (root)")
    tb.add_argument("scenario", nargs="?", help="scenario file with [[hosts]]")
    tb.add_argument("--out", help="write the results JSON (the simulator's shape plus a 'testbed' section)")
    tb.add_argument("--csv", help="write one row per round here")
    tb.add_argument("--json", action="store_true", help="print the results JSON instead of the table")
    tb.add_argument("--quiet", action="store_true", help="no progress bar or testbed messages")
    tb.add_argument("--compare", action="store_true", help="also run the simulator: its median step per host")
    tb.add_argument("--selftest", action="store_true", help="measure each host's RTT and TCP rate vs configured")
    tb.add_argument("--curve", action="store_true", help="peers with CURVE keys: authenticated, encrypted links")
    tb.add_argument("--measure", action="store_true", help="run the selftest first and store it in the results")
    tb.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                    help="set a kernel setting in every host's namespace, e.g. net.ipv4.tcp_slow_start_after_idle=0")
    tb.add_argument("--cleanup", action="store_true", help="remove what crashed testbed runs left behind")
    tb.add_argument("--force", action="store_true", help="with --cleanup: also tear down runs still in progress")
    tb.set_defaults(fn=cmd_testbed)
    args = p.parse_args(argv)
    try:
        logging.basicConfig(level=getattr(args, "log_level", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
        return args.fn(args)
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
