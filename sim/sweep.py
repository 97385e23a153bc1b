"""Sweeps: a grid of scenarios × seeds, run as independent tasks, stored per run, resumable.

A sweep file (TOML) names a base scenario, axes of values and seeds:

    name = "group_size"                  # optional; default: the file's stem
    kind = "scenario"                    # "scenario" (message level, `sim.scenario`),
                                         # "moshpit" (round level, one `sim.moshpit` method run) or
                                         # "train" (simulated training, `sim.train`: one row per
                                         # evaluation step, ``round`` = local steps made)
    seed = 0                             # the sweep's seed
    seeds = 10                           # 10 means seed indices 0..9; or a list, e.g. [0, 3, 7]
    scenario = "../scenarios/flaky_home.toml"   # optional base file, relative to this file
    [base]                               # inline base, deep-merged over `scenario`
    rounds = 4
    [axes]                               # every combination is one point, in this order
    unavailability = [0.0, 0.05]
    protocol.target_group_size = [4, 8]  # dotted keys reach into the scenario's tables
    profiles = [{home = 1.0}, {datacenter = 1.0}]   # a value may be a whole table
    [plot]                               # defaults for `python -m sim plot`
    metric = "mse"
    eps = 1e-9
    heatmap = ["unavailability", "protocol.target_group_size"]

A *point* is one combination of axis values; a *run* is a point with one seed index. A sweep
holds at most ``MAX_RUNS`` (10^6) runs; a larger grid is refused when it is loaded.
Every run is one task, and its result depends only on its resolved scenario:

* **Seeds.** ``kind = "scenario"`` (and ``"train"``): the run's scenario seed is the first 63 bits of
  blake2b(canonical JSON of [sweep seed, point, seed index]) — a function of the sweep
  and the point, never of the worker, the order or the process. ``kind = "moshpit"``:
  the seed index is the paper table's *restart*, and the run draws exactly as
  `sim.moshpit.mse_curves` does (initial values from (seed, N, restart), the method's
  generator from (seed, N, restart, p, method)), so methods and dropout rates of one
  restart start from the same values and the sweep reproduces `moshpit_table` exactly.
* **Store.** ``OUT/runs/<key>.json`` holds one run: kind, code version, resolved
  scenario (with the CPU and TCP profiles it names read in, see `_inline_profiles`) and result. ``key`` is blake2b of (kind, resolved scenario, code version),
  so a re-run computes only the keys that are missing (or whose file cannot be read), and
  two sweeps sharing a run share its file. Files are written to a temporary name and renamed, so Ctrl-C never
  leaves half a run. A failed run is not stored (a re-run retries it); it is listed
  in ``OUT/failures.json`` and printed to stderr with its scenario.
* **Code version.** A hash of every ``.py/.c/.h`` source under ``sim/`` and
  ``zgossip/`` plus numpy's version: any change to the code that could move a number
  invalidates the cache, also in a dirty tree or an installed copy with no git. A
  worker whose sources differ from the client's refuses to run (its results would
  not be the ones the key promises).
* **Tables.** At the end ``OUT/results.csv`` (and ``OUT/results.parquet`` when pyarrow
  is installed) hold one row per run × round, in sweep order: the axes (dotted names),
  ``seed``, ``run_seed``, ``key``, ``round`` (rounds completed) and the kind's metrics;
  ``OUT/sweep.json`` describes the sweep. No file holds a wall-clock time, so every
  file is byte-identical however and wherever the runs ran.

Executors: ``workers=0`` runs serially in this process; the default runs on all
local cores (a process pool whose workers ignore SIGINT, so Ctrl-C reaches only this
process, which stops them; a worker whose parent died without stopping it, as on SIGTERM or SIGKILL,
leaves within a second); ``cluster=ADDRESS`` (or a `distributed.Client` /
`LocalCluster`) submits to an existing Dask cluster (the ``zgossip[cluster]`` extra).
Runs are batched into chunks so short round-level runs do not drown in IPC.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import hashlib
import io
import itertools
import json
import math
import os
import signal
import sys
import time
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from zgossip.cliargs import positive_int

__all__ = ["Sweep", "Run", "SweepOutcome", "load_sweep", "run_sweep", "read_table", "rounds_to_eps",
           "code_version", "run_seed", "KINDS"]

SWEEPS_DIR = Path(__file__).resolve().parent / "sweeps"
MAX_RUNS = 1_000_000  # runs in one sweep (points x seeds): more is refused at load
_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------- helpers
def canonical(obj: Any) -> str:
    """The one JSON text of a value (sorted keys, no spaces): what hashes and seeds are taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


def _blake(text: str, size: int) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=size).digest()


def run_seed(sweep_seed: int, point: dict, seed_index: int) -> int:
    """A scenario run's seed: 63 bits of blake2b over the sweep seed, the point and the seed index."""
    return int.from_bytes(_blake(canonical([sweep_seed, point, seed_index]), 8), "big") >> 1


_CODE_VERSION: str | None = None


def code_version() -> str:
    """Hash of the simulator and protocol sources (and numpy's version): part of every run's key."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        import numpy

        h = hashlib.blake2b(digest_size=10)
        for pkg in ("sim", "zgossip"):
            base = _ROOT / pkg
            for path in sorted(p for ext in ("py", "c", "h") for p in base.rglob(f"*.{ext}")):
                if "__pycache__" in path.parts:
                    continue
                h.update(path.relative_to(_ROOT).as_posix().encode() + b"\0")
                h.update(path.read_bytes() + b"\0")
        h.update(f"numpy {numpy.__version__}".encode())
        _CODE_VERSION = h.hexdigest()
    return _CODE_VERSION


def _set_path(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for i, k in enumerate(keys[:-1]):
        nxt = d.get(k)
        if nxt is None:
            nxt = d[k] = {}
        elif not isinstance(nxt, dict):  # it was replaced by a table, silently: latency = 0.02 became {median = ...}
            raise ValueError(f"axis {dotted!r} reaches into {'.'.join(keys[:i + 1])}, which the base sets to "
                             f"{nxt!r}, not a table; vary {'.'.join(keys[:i + 1])} itself, or make it a table in the base")
        d = nxt
    d[keys[-1]] = copy.deepcopy(value)


def _flatten_axes(axes: dict, prefix: str = "") -> dict[str, list]:
    """TOML turns ``protocol.target_group_size = [..]`` into nested tables: flatten back to dotted names."""
    out: dict[str, list] = {}
    for k, v in axes.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten_axes(v, name + "."))
        elif isinstance(v, list) and v:
            out[name] = v
        else:
            raise ValueError(f"axis {name!r} needs a non-empty list of values, not {v!r}")
    return out


def _deep_merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name beside ``path``, then rename: a reader (or Ctrl-C) never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# ---------------------------------------------------------------------------------------- kinds
@dataclass(frozen=True)
class Kind:
    """What one kind of run needs: how a run's seed enters its scenario, how it runs, its tidy rows."""

    name: str
    seeded: Callable[[dict, int, dict, int], dict]  # (base-with-point, sweep seed, point, seed index) -> spec
    run: Callable[[dict], dict]                       # spec -> JSON-able result
    rows: Callable[[dict], list[dict]]               # result -> one row of metrics per round
    columns: tuple[str, ...]
    check: Callable[[dict], None] | None = None      # base-with-point -> None, or a ValueError naming the key


def _scenario_seeded(spec: dict, sweep_seed: int, point: dict, k: int) -> dict:
    return {**spec, "seed": run_seed(sweep_seed, point, k)}


def _scenario_check(spec: dict) -> None:
    from .scenario import Scenario

    Scenario.from_dict(spec)


def _train_check(spec: dict) -> None:
    from .train import TrainScenario

    TrainScenario.from_dict(spec)


def _scenario_run(spec: dict) -> dict:
    from .scenario import run_scenario

    res = run_scenario(spec)
    data = json.loads(res.to_json())
    del data["scenario"]  # it is the run's spec, stored beside the result
    return data


_SCENARIO_COLUMNS = ("sim_seconds", "live", "participants", "succeeded", "failed", "n_groups", "mse", "max_abs",
                     "spread", "bytes_sent_mean", "bytes_received_mean", "bytes_sent_cum")


def _nan(x: float | None) -> float:
    """A metric as the tables and plots take it: NaN where the results JSON holds null (no peer was
    live to measure it, or a loss that was not finite; `scenario.json_ready`)."""
    return math.nan if x is None else x


def _scenario_rows(result: dict) -> list[dict]:
    rows, cum = [], 0.0
    for r in result["rounds"]:
        cum += r["bytes_sent_mean"]
        rows.append({"round": r["round"] + 1, "sim_seconds": r["sim_seconds"], "live": r["live"],
                     "participants": r["participants"], "succeeded": r["succeeded"],
                     "failed": sum(r["failures"].values()), "n_groups": sum(r["groups"].values()),
                     # null in the results JSON (`scenario.json_ready`): no peer was live to measure
                     "mse": _nan(r["mse"]), "max_abs": _nan(r["max_abs"]), "spread": _nan(r["spread"]),
                     "bytes_sent_mean": r["bytes_sent_mean"], "bytes_received_mean": r["bytes_received_mean"],
                     # cumulative mean bytes sent per stepping peer: the x axis of bytes-vs-accuracy
                     "bytes_sent_cum": cum})
    return rows


_MOSHPIT_KEYS = {"n", "p", "method", "cap", "seed", "restart", "group_size", "grid", "min_group_size", "placement",
                 "cut"}


def _moshpit_seeded(spec: dict, sweep_seed: int, point: dict, k: int) -> dict:
    # the paper table's derivation (see the module docstring): seed = the sweep's, restart = the seed index
    return {**spec, "seed": sweep_seed, "restart": k}


def _moshpit_check(spec: dict) -> None:
    """A moshpit run's keys and values (the sweep's seed and restart come later)."""
    from .moshpit import EXTRA_METHODS, METHODS

    unknown = set(spec) - _MOSHPIT_KEYS
    if unknown:
        raise ValueError(f"unknown moshpit keys {sorted(unknown)} (known: {sorted(_MOSHPIT_KEYS)})")
    # (n = 2.5 ran with 2 peers and cap = -1 with no round, silently; n = 0 ended in numpy's empty-slice
    # warnings and a reshape error; p = "x" in "could not convert string to float")
    for key, low in (("n", 1), ("cap", 0)):
        v = spec.get(key, 50 if key == "cap" else None)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"moshpit: {key} must be a whole number >= {low}, not {v!r}")
    p = spec.get("p")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
        raise ValueError(f"moshpit: p must be a probability in [0, 1], not {p!r}")
    named = {s.name: s for s in METHODS + EXTRA_METHODS}
    if not isinstance(spec.get("method"), str) or spec["method"] not in named:
        raise ValueError(f"unknown method {spec.get('method')!r}; known: {sorted(named)}")


def _moshpit_run(spec: dict) -> dict:
    import numpy as np

    from zgossip.grid import seed_from

    from .moshpit import EXTRA_METHODS, METHODS, _p_code

    _moshpit_check(spec)
    named = {s.name: s for s in METHODS + EXTRA_METHODS}
    over = {k: (tuple(v) if k == "grid" and isinstance(v, list) else v) for k, v in spec.items()
            if k in ("group_size", "grid", "min_group_size", "placement", "cut")}
    ms = dataclasses.replace(named[spec["method"]], **over)
    n, p, seed, r, cap = int(spec["n"]), float(spec["p"]), int(spec["seed"]), int(spec["restart"]), int(spec.get("cap", 50))
    # exactly sim.moshpit.mse_curves for one (restart, method)
    values = np.random.default_rng([seed, n, r]).standard_normal(n)
    rng = np.random.default_rng([seed, n, r, _p_code(p), seed_from(ms.name)])
    swarm = ms.swarm(values, p, rng)
    mse, max_sq = swarm.metric()
    rounds = [{"round": 0, "mse": float(mse), "max_abs": math.sqrt(max_sq), "participants": 0, "n_groups": 0}]
    for _ in range(cap):
        rec = swarm.step()
        rounds.append({"round": rec.round, "mse": float(rec.mse), "max_abs": math.sqrt(rec.max_sq),
                       "participants": int(rec.participants), "n_groups": int(rec.n_groups)})
    return {"rounds": rounds}


def _moshpit_rows(result: dict) -> list[dict]:
    return [dict(r) for r in result["rounds"]]


def _train_run(spec: dict) -> dict:
    from .train import run_train

    data = json.loads(run_train(spec).to_json())
    del data["scenario"]
    return data


_TRAIN_COLUMNS = ("sim_seconds", "live", "loss", "loss_max", "bytes_sent_cum", "bytes_received_cum")


def _train_rows(result: dict) -> list[dict]:
    # one row per evaluation step (``round`` = local steps made): means over the trainers evaluated there
    return [{"round": c["step"], "sim_seconds": c["t"], "live": c["n"], "loss": _nan(c["loss"]), "loss_max": _nan(c["loss_max"]),
             "bytes_sent_cum": c["sent"], "bytes_received_cum": c["received"]} for c in result["curve"]]


KINDS: dict[str, Kind] = {
    "scenario": Kind("scenario", _scenario_seeded, _scenario_run, _scenario_rows, _SCENARIO_COLUMNS, _scenario_check),
    "moshpit": Kind("moshpit", _moshpit_seeded, _moshpit_run, _moshpit_rows,
                    ("mse", "max_abs", "participants", "n_groups"), _moshpit_check),
    # simulated training (`sim.train`): the spec is a train scenario, seeded like "scenario"
    "train": Kind("train", _scenario_seeded, _train_run, _train_rows, _TRAIN_COLUMNS, _train_check),
}


# ---------------------------------------------------------------------------------------- the sweep
@dataclass(frozen=True)
class Run:
    """One task: a point with one seed index, its resolved scenario and its key in the store."""

    index: int
    point: dict
    seed_index: int
    spec: dict
    key: str


@dataclass
class Sweep:
    name: str
    kind: str
    base: dict
    axes: dict[str, list]
    seeds: list[int]
    seed: int = 0
    plot: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown sweep kind {self.kind!r}; known: {sorted(KINDS)}")
        if "seed" in self.axes or ("seed" in self.base and self.kind == "moshpit"):
            raise ValueError("the seed comes from the sweep (`seed`, `seeds`), not from an axis or the base")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds must be a positive count or a list of distinct seed indices")
        for name, values in self.axes.items():
            # (a value listed twice ran once and was written twice into results.csv: the grid was one
            # point short, silently, and the rounds-to-eps heatmap refused the doubled rows)
            seen: set[str] = set()
            for v in values:
                if canonical(v) in seen:
                    raise ValueError(f"axis {name!r} lists {canonical(v)} twice: each value is one point")
                seen.add(canonical(v))
        # counted before any run is built: listing 10^7 runs took minutes and gigabytes before the
        # first one ran, and the store (a file per run) is no place for that many
        total = math.prod(len(v) for v in self.axes.values()) * len(self.seeds)
        if total > MAX_RUNS:
            sizes = " x ".join(f"{len(v)} {a}" for a, v in self.axes.items())
            raise ValueError(f"this sweep has {total:,} runs ({sizes or 'one point'} x {len(self.seeds)} seeds), more "
                             f"than the {MAX_RUNS:,} one sweep holds: split it into several sweeps")

    def points(self) -> list[dict]:
        names = list(self.axes)
        return [dict(zip(names, combo)) for combo in itertools.product(*(self.axes[a] for a in names))]

    def runs(self) -> list[Run]:
        kind, code, out = KINDS[self.kind], code_version(), []
        refused: list[str] = []  # why each point the scenario loader refuses is refused
        points = self.points()
        for point in points:
            spec = copy.deepcopy(self.base)
            for name, value in point.items():
                _set_path(spec, name, value)
            if self.kind != "moshpit":
                spec = _inline_profiles(spec)
            if kind.check is not None:
                try:
                    kind.check(spec)
                except (ValueError, TypeError) as e:
                    refused.append(f"point {canonical(point) if point else '(the base)'}: {e}")
            for k in self.seeds:
                s = kind.seeded(spec, self.seed, point, k)
                key = _blake(canonical({"kind": self.kind, "spec": s, "code": code}), 16).hex()
                out.append(Run(len(out), point, k, s, key))
        if refused and len(refused) == len(points):
            # no point can run (an axis naming a setting that does not exist, protocol.target_group_sz, or a
            # base out of range): refused here, in one line; it ran every run to the same ValueError, each
            # printed with a traceback, and ended in status 1 as if some runs had had bad luck. A grid where
            # only some points are refused still runs the others (their runs fail and are listed).
            raise ValueError(f"sweep {self.name!r}: no point can run; {refused[0]}")
        return out

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "seed": self.seed, "seeds": self.seeds, "base": self.base,
                "axes": self.axes, "plot": self.plot, "code": code_version()}


def _inline_profiles(spec: dict) -> dict:
    """The spec with the `python -m sim calibrate` profiles it names read in: ``cpu`` (a path, "auto"
    = this machine's, or a table with ``profile``) becomes ``{costs = the profile's cpu section, ...}``
    and ``[network] tcp = {profile = PATH}`` the profile's tcp settings under the given ones. A run's
    key then hashes the numbers it runs with -- with the file's name only, a recalibrated profile
    reused every stored run -- and a worker on another machine runs what the parent read."""
    from .cpu import default_profile_path, load_profile

    cpu = spec.get("cpu")
    if isinstance(cpu, str) or (isinstance(cpu, dict) and "costs" not in cpu):
        value = {"profile": cpu} if isinstance(cpu, str) else dict(cpu)
        prof = value.pop("profile", "auto")
        data = load_profile(default_profile_path(create=True) if prof == "auto" else prof)
        spec = {**spec, "cpu": {**value, "costs": data["cpu"]}}
    tcp = spec.get("network", {}).get("tcp") if isinstance(spec.get("network"), dict) else None
    if isinstance(tcp, dict) and tcp.get("profile") is not None:
        given = {k: v for k, v in tcp.items() if k != "profile"}
        sysctls = json.loads(Path(tcp["profile"]).read_text()).get("tcp", {})
        spec = {**spec, "network": {**spec["network"], "tcp": {**sysctls, **given}}}
    return spec


_SWEEP_KEYS = {"name", "kind", "seed", "seeds", "scenario", "base", "axes", "plot"}


def load_sweep(path: str | Path) -> Sweep:
    from .scenario import read_file

    path = Path(path)
    d = read_file(path)
    unknown = set(d) - _SWEEP_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown sweep keys {sorted(unknown)} (known: {sorted(_SWEEP_KEYS)})")
    _check_sweep_types(path, d)
    base: dict = {}
    if "scenario" in d:
        base = read_file((path.parent / d["scenario"]).resolve())
        if not isinstance(base, dict):
            raise ValueError(f"{path}: the base scenario {d['scenario']} is not a table of settings")
    base = _deep_merge(base, d.get("base", {}))
    seeds = d.get("seeds", 1)
    seeds = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    return Sweep(name=d.get("name", path.stem), kind=d.get("kind", "scenario"), base=base,
                 axes=_flatten_axes(d.get("axes", {})), seeds=seeds, seed=int(d.get("seed", 0)),
                 plot=d.get("plot", {}))


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_sweep_types(path: Path, d: Any) -> None:
    """The sweep file's own keys, by type: `axes = [...]` or `base = 3` ended the command in an
    AttributeError traceback, `seeds = 2.5` in "'float' object is not iterable", `seed = "x"` in an
    int() error naming no key, and `seeds = true` ran one seed, silently."""
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a sweep file is a table (kind, seed, seeds, scenario, [base], [axes], [plot]), "
                         f"not {type(d).__name__}")
    for key in ("base", "axes", "plot"):
        if key in d and not isinstance(d[key], dict):
            raise ValueError(f"{path}: {key} must be a table ([{key}]), not {d[key]!r}")
    for key in ("name", "kind", "scenario"):
        if key in d and not isinstance(d[key], str):
            raise ValueError(f"{path}: {key} must be a string, not {d[key]!r}")
    if "seed" in d and not (_whole(d["seed"]) and d["seed"] >= 0):
        raise ValueError(f"{path}: seed must be a whole number >= 0, not {d['seed']!r}")
    seeds = d.get("seeds", 1)
    if _whole(seeds):
        if seeds < 1:
            raise ValueError(f"{path}: seeds must be a count >= 1 or a list of seed indices, not {seeds!r}")
    elif not (isinstance(seeds, list) and all(_whole(s) and s >= 0 for s in seeds)):
        raise ValueError(f"{path}: seeds must be a count >= 1 or a list of seed indices (whole numbers >= 0), "
                         f"not {seeds!r}")


# ---------------------------------------------------------------------------------------- running one chunk
def _run_one(kind_name: str, spec: dict) -> tuple[str, str, str]:
    """("ok", the run's file text, its CSV lines) or ("error", "Type: message\\n\\ntraceback", "")."""
    try:
        result = KINDS[kind_name].run(spec)
        text = json.dumps({"kind": kind_name, "code": code_version(), "spec": spec, "result": result},
                          sort_keys=True, separators=(",", ":"), allow_nan=True) + "\n"
        return "ok", text, _metric_lines(kind_name, result)
    except Exception as e:  # a failing run is a result to report, not a reason to stop the others
        return "error", f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}", ""


def _run_chunk(kind_name: str, code: str, items: list[tuple[str, dict]],
               store: str | None = None) -> list[tuple[str, str, str, str]]:
    """Run a chunk of (key, spec) in a worker: [(key, status, text, csv lines)].

    With ``store`` (a folder this worker can write: local processes), the worker stores each run's
    file itself and returns ``""`` as its text, so the parent neither receives nor writes it; a
    Dask worker, maybe on another machine, returns the text for the parent to store.
    """
    if code != code_version():
        msg = (f"RuntimeError: this worker's code version is {code_version()}, the sweep's is {code}: "
               f"it runs different sim/ or zgossip/ sources, so its results would not match their keys")
        return [(key, "error", msg, "") for key, _ in items]
    out = []
    for key, spec in items:
        status, text, lines = _run_one(kind_name, spec)
        if store is not None and status == "ok":
            _write_atomic(Path(store) / f"{key}.json", text.encode())
            text = ""
        out.append((key, status, text, lines))
    return out


def _worker_init(sweep_pid: int) -> None:
    # Ctrl-C in a terminal signals the whole process group: only the parent handles it (and stops us)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a sweep process that dies without stopping us (SIGTERM, SIGKILL, the OOM killer) leaves a pool
    # worker waiting for work forever: each worker leaves once that process is gone. It is watched by
    # its pid, not as our parent: under forkserver the parent is the server, which lives on as long
    # as its children do
    threading.Thread(target=_exit_with, args=(sweep_pid,), name="exit-with-sweep", daemon=True).start()


def _exit_with(pid: int) -> None:
    while _alive(pid):
        time.sleep(0.5)
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # killed but not yet reaped by its own parent (a zombie): gone all the same
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# ---------------------------------------------------------------------------------------- executors
Chunk = list  # list[Run]
Done = Callable[[list[tuple[str, str, str, str]]], None]


def _chunks(runs: list[Run], workers: int) -> list[Chunk]:
    """Guided chunks: each takes 1/(4 x workers) of the runs still unassigned (at most 16, at least 1),
    so chunks shrink towards the end and the last ones are single runs -- a worker is never left
    alone with a long chunk while the others idle. Fewer, larger chunks early keep the parent's
    share (one message per chunk) small."""
    out: list[Chunk] = []
    i, w = 0, max(1, workers)
    while i < len(runs):
        size = max(1, min(16, (len(runs) - i) // (4 * w)))
        out.append(runs[i:i + size])
        i += size
    return out


def _payload(chunk: Chunk) -> list[tuple[str, dict]]:
    return [(r.key, r.spec) for r in chunk]


def _execute_serial(kind: str, runs: list[Run], done: Done, tick: Callable[[], None]) -> None:
    code = code_version()
    for r in runs:
        done(_run_chunk(kind, code, _payload([r])))
        tick()


def _preload_parquet() -> None:
    # results.parquet is written after the last run; importing pyarrow (~0.3 s) while the workers
    # compute takes it off the serial tail of a parallel sweep
    import importlib

    for name in ("pyarrow.csv", "pyarrow.parquet"):
        try:
            importlib.import_module(name)
        except ImportError:
            return


def _execute_processes(kind: str, runs: list[Run], workers: int, done: Done, tick: Callable[[], None],
                       store: Path) -> None:
    import concurrent.futures as cf

    ctx = _mp_context()
    preload: threading.Thread | None = None
    code = code_version()
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                                  initargs=(os.getpid(),))
    try:
        queue = iter(_chunks(runs, workers))
        pending: set = set()
        while True:
            while len(pending) < 2 * workers:  # a bounded window: Ctrl-C cancels little, memory stays flat
                chunk = next(queue, None)
                if chunk is None:
                    break
                pending.add(pool.submit(_run_chunk, kind, code, _payload(chunk), str(store)))
                if preload is None:  # after the first submit: the workers are forked by then
                    preload = threading.Thread(target=_preload_parquet, name="preload-pyarrow", daemon=True)
                    preload.start()
            if not pending:
                break
            finished, pending = cf.wait(pending, timeout=1.0, return_when=cf.FIRST_COMPLETED)
            for f in finished:
                done(f.result())
            tick()
    except BaseException:
        _stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def _mp_context():
    """fork where it is safe (a single-threaded parent): workers start in milliseconds with the
    simulator already imported, and nothing re-runs the parent's main script. A threaded parent
    (a Jupyter kernel, a Dask client) gets forkserver, which forks from a clean single-threaded
    server that imported the simulator once."""
    import multiprocessing as mp

    if "fork" in mp.get_all_start_methods() and threading.active_count() == 1:
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["sim.sweep", "sim.scenario", "sim.moshpit"])
    return ctx


def _stop_pool(pool) -> None:
    """Stop every worker now (Ctrl-C or an error): cancel what is queued, terminate what runs."""
    # the workers are read first: shutdown() forgets them (Python 3.11 sets _processes to None), and
    # then none was terminated -- Ctrl-C printed "interrupted" while both workers went on computing
    procs = list((getattr(pool, "_processes", None) or {}).values())  # no public handle before Python 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5.0)
        if _running(p):
            p.kill()
            p.join(timeout=5.0)


def _running(p) -> bool:
    """Whether worker `p` still runs. `is_alive()` alone can say True for ever: the pool's own thread,
    told to shut down, joins the workers too, and when it reaps one first our join gets ECHILD and
    multiprocessing never learns the exit code. A pid that no longer exists is a worker gone."""
    if not p.is_alive():
        return False
    try:
        os.kill(p.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _execute_dask(kind: str, runs: list[Run], cluster: Any, done: Done, tick: Callable[[], None]) -> None:
    try:
        from distributed import Client
    except ImportError as e:
        raise SystemExit("--cluster needs Dask distributed: pip install 'zgossip[cluster]'") from e
    own = not isinstance(cluster, Client)
    if own:
        address = getattr(cluster, "scheduler_address", cluster)  # an address, or a LocalCluster object
        client = Client(address, timeout=30, set_as_default=False)
    else:
        client = cluster
    futures: list = []
    try:
        workers = max(1, sum(client.nthreads().values()))
        code = code_version()
        futures = [client.submit(_run_chunk, kind, code, _payload(c), pure=False) for c in _chunks(runs, workers)]
        pending = set(futures)
        while pending:
            # poll: a future's state is local to the client, and every wait stays short (Ctrl-C, progress)
            finished = {f for f in pending if f.done()}
            if not finished:
                time.sleep(0.05)
            pending -= finished
            for f in finished:
                done(f.result(timeout=60))
            tick()
    except BaseException:
        if futures:
            client.cancel(futures)
        raise
    finally:
        if own:
            client.close(timeout=10)


# ---------------------------------------------------------------------------------------- progress
class Progress:
    """A one-line bar on stderr: runs done (of this sweep), failures, elapsed and ETA. Never in a results file."""

    def __init__(self, total: int, reused: int, stream=None, quiet: bool = False) -> None:
        self.total, self.done, self.failed = total, reused, 0
        self.reused, self.stream, self.quiet = reused, stream or sys.stderr, quiet
        self.start = time.perf_counter()
        self._last = 0.0
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, ok: int = 0, failed: int = 0) -> None:
        self.done += ok + failed
        self.failed += failed
        self.show()

    def show(self, final: bool = False) -> None:
        if self.quiet:
            return
        now = time.perf_counter()
        if not final and now - self._last < (0.2 if self.tty else 10.0):
            return
        if not final and not self.tty and self.done >= self.total:  # the final line follows: printed once
            return
        self._last = now
        el = now - self.start
        fresh = self.done - self.reused
        left = self.total - self.done
        eta = f"ETA {left * el / fresh:.0f}s" if fresh and left else ("done" if not left else "ETA ?")
        width = 30
        fill = int(width * self.done / max(1, self.total))
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} runs, {self.failed} failed, "
                f"{el:.1f}s, {eta}")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if final and self.tty:
            self.stream.write("\n")
        self.stream.flush()


# ---------------------------------------------------------------------------------------- tables
def _text(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return canonical(v)
    return "" if v is None else repr(v) if isinstance(v, float) else str(v)


def _csv_line(values: Iterable[Any]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow([_text(v) for v in values])
    return out.getvalue()


def _metric_lines(kind_name: str, result: dict) -> str:
    """A run's part of the tidy table: its CSV lines for ``round`` and the kind's metrics. Rendered by
    the worker (the parent's share of a sweep stays small) and, for stored runs, by the parent: one
    function, so one text."""
    cols = ("round", *KINDS[kind_name].columns)
    return "".join(_csv_line(m.get(c) for c in cols) for m in KINDS[kind_name].rows(result))


def _table_text(sweep: Sweep, runs: list[Run], lines: dict[str, str]) -> str:
    """The tidy table: one row per run × round, in sweep order, for the runs that have a result."""
    head = _csv_line([*sweep.axes, "seed", "run_seed", "key", "round", *KINDS[sweep.kind].columns])
    parts = [head]
    for r in runs:
        if r.key in lines:
            prefix = _csv_line([*r.point.values(), r.seed_index, r.spec.get("seed"), r.key])[:-1] + ","
            parts.extend(prefix + line + "\n" for line in lines[r.key].splitlines())
    return "".join(parts)


def _write_parquet(path: Path, csv_path: Path) -> bool:
    """results.parquet from results.csv (pyarrow's reader infers the same types from the same text)."""
    try:
        import pyarrow.csv as pcsv
        import pyarrow.parquet as pq
    except ImportError:
        return False
    table = pcsv.read_csv(csv_path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return True


def read_table(out: str | Path) -> tuple[dict, list[dict]]:
    """(the sweep's description, its results.csv rows with numbers and booleans parsed back), for plots and tables."""
    out = Path(out)
    desc = json.loads((out / "sweep.json").read_text())
    rows = []
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            rows.append({k: _parse(v) for k, v in row.items()})
    # the axes in the sweep file's order, as results.csv's columns have them: sweep.json's keys are
    # sorted, and plots took their default lines axis ("its last axis") and heatmap axes ("the first
    # two") from that alphabetical order instead
    order = [c for c in (reader.fieldnames or []) if c in desc["axes"]]
    desc["axes"] = {a: desc["axes"][a] for a in [*order, *(a for a in desc["axes"] if a not in order)]}
    return desc, rows


def _parse(v: str) -> Any:
    if v == "":
        return None
    if v in ("True", "False"):  # a boolean axis value (`_text` writes Python's spelling)
        return v == "True"
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    if v[:1] in "[{":
        try:
            return json.loads(v)
        except ValueError:
            pass
    return v


def rounds_to_eps(rows: Sequence[dict], axes: Sequence[str], eps: float, metric: str = "mse") -> list[dict]:
    """Per point (in first-seen order): mean over seeds of the first round with ``metric <= eps``
    (a run that never gets there counts as its last round) and the fraction of runs that got there."""
    runs: dict[tuple, dict] = {}
    keys: dict[tuple, Any] = {}
    for row in rows:
        pk = tuple(canonical(row[a]) for a in axes)
        # one run per (point, seed): rows of a sweep with an axis not named here (a moshpit sweep over
        # group_size read by table_from_sweep's n, p, method) were merged into one run, silently
        k = keys.setdefault((pk, row["seed"]), row.get("key"))
        if k != row.get("key"):
            raise ValueError(f"the rows hold several runs for one point of {list(axes)} and seed {row['seed']}: "
                             f"the sweep has an axis not among them; select one value of each other axis first")
        run = runs.setdefault(pk, {"point": {a: row[a] for a in axes}, "by_seed": {}})
        first = run["by_seed"].setdefault(row["seed"], {"first": None, "last": 0})
        rnd = row["round"]
        first["last"] = max(first["last"], rnd)
        v = row[metric]
        if rnd >= 1 and v is not None and v <= eps and (first["first"] is None or rnd < first["first"]):
            first["first"] = rnd
    out = []
    for run in runs.values():
        seeds = run["by_seed"].values()
        got = [s["first"] if s["first"] is not None else s["last"] for s in seeds]
        reached = [s["first"] is not None for s in seeds]
        out.append({**run["point"], "rounds": sum(got) / len(got), "reached": sum(reached) / len(reached),
                    "seeds": len(got)})
    return out


# ---------------------------------------------------------------------------------------- the driver
@dataclass
class SweepOutcome:
    out: Path
    total: int
    computed: int
    reused: int
    failures: list[dict]


def run_sweep(sweep: Sweep, out: str | Path, *, workers: int | None = None, cluster: Any = None,
              quiet: bool = False, stream=None, on_result: Callable[[str], None] | None = None) -> SweepOutcome:
    """Run the missing runs of ``sweep`` into ``out`` and write its tables.

    ``workers``: None = one process per core, 0 = serially in this process, N = N processes.
    ``cluster``: a Dask scheduler address, `LocalCluster` or `Client` (then ``workers`` is ignored).
    ``on_result(key)`` is called after each stored run (tests use it to interrupt a sweep).
    """
    out = Path(out)
    runs = sweep.runs()  # (first: a point the scenario refuses leaves no results folder behind)
    store = out / "runs"
    store.mkdir(parents=True, exist_ok=True)
    stream = stream or sys.stderr
    stored = {p.stem for p in store.glob("*.json")}
    lines: dict[str, str] = {}  # key -> the run's CSV lines
    damaged: list[str] = []
    for key in dict.fromkeys(r.key for r in runs if r.key in stored):
        path = store / f"{key}.json"
        try:
            lines[key] = _metric_lines(sweep.kind, json.loads(path.read_text())["result"])
        except (ValueError, KeyError, TypeError):  # cut short or edited (a copy interrupted): run it again
            damaged.append(path.name)
    if damaged:
        stream.write(f"{len(damaged)} stored run file(s) in {store} cannot be read and are run again: "
                     f"{', '.join(damaged[:3])}{', ...' if len(damaged) > 3 else ''}\n")
    have = set(lines)
    by_key = {r.key: r for r in runs if r.key not in have}  # two runs with one scenario run once
    todo = list(by_key.values())
    reused = len(have)
    failures: list[dict] = []
    prog = Progress(len(runs), len(runs) - sum(r.key in by_key for r in runs), stream, quiet)
    computed = 0

    def done(batch: list[tuple[str, str, str, str]]) -> None:
        nonlocal computed
        ok = bad = 0
        for key, status, text, table_lines in batch:
            r = by_key[key]
            if status == "ok":
                if text:  # else the worker stored it
                    _write_atomic(store / f"{key}.json", text.encode())
                lines[key] = table_lines
                computed += 1
                ok += 1
            else:
                bad += 1
                failures.append({"index": r.index, "point": r.point, "seed": r.seed_index, "key": key,
                                 "error": text.split("\n", 1)[0], "scenario": r.spec})
                stream.write(f"\nrun failed: point {canonical(r.point)} seed {r.seed_index}: {text.strip()}\n"
                             f"  scenario: {canonical(r.spec)}\n")
            if on_result:
                on_result(key)
        prog.update(ok, bad)

    if todo:
        if cluster is not None:
            _execute_dask(sweep.kind, todo, cluster, done, prog.show)
        elif workers == 0 or len(todo) == 1:
            _execute_serial(sweep.kind, todo, done, prog.show)
        else:
            n = workers or os.cpu_count() or 1
            _execute_processes(sweep.kind, todo, min(n, len(todo)), done, prog.show, store)
    prog.show(final=True)

    failures.sort(key=lambda f: f["index"])
    _write_atomic(out / "results.csv", _table_text(sweep, runs, lines).encode())
    _write_parquet(out / "results.parquet", out / "results.csv")
    _write_atomic(out / "failures.json", (json.dumps(failures, sort_keys=True, indent=1) + "\n").encode())
    desc = {**sweep.describe(), "runs": [{"point": r.point, "seed": r.seed_index, "key": r.key} for r in runs]}
    _write_atomic(out / "sweep.json", (json.dumps(desc, sort_keys=True, indent=1) + "\n").encode())
    return SweepOutcome(out, len(runs), computed, reused, failures)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sim sweep``: see `sim.__main__`."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sim sweep", description="Run a sweep file (resumable).")
    add_arguments(ap)
    return cmd_sweep(ap.parse_args(argv))


def add_arguments(ap) -> None:
    ap.add_argument("sweep", help="a sweep file (TOML), e.g. sim/sweeps/moshpit_table.toml")
    ap.add_argument("--out", help="results folder (default: results/<sweep name>)")
    ap.add_argument("--workers", type=positive_int, default=None, help="local processes (default: one per core)")
    ap.add_argument("--serial", action="store_true", help="run in this process, one run after another")
    ap.add_argument("--cluster", help="address of an existing Dask scheduler, e.g. tcp://10.0.0.5:8786")
    ap.add_argument("--seeds", type=positive_int, help="override the sweep's seeds with 0..N-1")
    ap.add_argument("--plot", action="store_true", help="draw the standard figures into OUT/plots")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--bench", type=positive_int, metavar="REPS",
                    help="benchmark: REPS repetitions of --serial, all cores and the machine's two-process "
                         "ceiling, side by side (fresh temporary results folders; prints the medians)")


def cmd_sweep(args) -> int:
    if args.bench:
        from .sweep_bench import bench_sweep

        bench_sweep(args.sweep, args.bench)
        return 0
    sweep = load_sweep(args.sweep)
    if args.seeds is not None:
        sweep = dataclasses.replace(sweep, seeds=list(range(args.seeds)))
    out = Path(args.out or Path("results") / sweep.name)
    t0 = time.perf_counter()
    try:
        res = run_sweep(sweep, out, workers=0 if args.serial else args.workers, cluster=args.cluster,
                        quiet=args.quiet)
    except KeyboardInterrupt:
        done = len(list((out / "runs").glob("*.json")))
        sys.stderr.write(f"\ninterrupted: {done} finished runs are kept in {out / 'runs'}; run again to resume\n")
        return 130
    sys.stderr.write(f"{res.total} runs: {res.computed} computed, {res.reused} reused, {len(res.failures)} failed "
                     f"({time.perf_counter() - t0:.1f}s wall); results in {out}\n")
    if args.plot:
        from .plot import plot_results

        try:
            for path in plot_results(out):
                sys.stderr.write(f"  {path}\n")
        except ValueError as e:  # nothing to draw (every run failed): said, and the exit status is the sweep's
            sys.stderr.write(f"no figures: {e}\n")
            return 1 if res.failures else 2
    return 1 if res.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
