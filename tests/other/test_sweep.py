"""Sweeps: byte-identical files whatever runs them, resuming, Ctrl-C, failing points, the Moshpit table."""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest

from sim import sweep as sw
from sim.sweep import Sweep, load_sweep, read_table, run_sweep

ROOT = Path(__file__).resolve().parents[2]

SMALL = """
name = "small"
kind = "scenario"
seed = 3
seeds = 2
[base]
peers = 8
grid = [4, 2]
rounds = 2
numel = 4
membership = "static"
bootstrap_time = 0.0
[axes]
unavailability = [0.0, 0.25]
protocol.target_group_size = [2, 4]
"""


def _small(tmp_path: Path, text: str = SMALL) -> Sweep:
    path = tmp_path / "small.toml"
    path.write_text(text)
    return load_sweep(path)


def _files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_sweep_file_format(tmp_path):
    s = _small(tmp_path)
    assert s.axes == {"unavailability": [0.0, 0.25], "protocol.target_group_size": [2, 4]}
    assert s.seeds == [0, 1]
    runs = s.runs()
    assert len(runs) == 8 and len({r.key for r in runs}) == 8
    assert runs[1].point == {"unavailability": 0.0, "protocol.target_group_size": 2} and runs[1].seed_index == 1
    assert runs[2].spec["protocol"] == {"target_group_size": 4}
    # seeds: from the sweep seed, the point and the seed index only
    assert runs[0].spec["seed"] == sw.run_seed(3, runs[0].point, 0)
    assert len({r.spec["seed"] for r in runs}) == 8
    base_file = tmp_path / "base.toml"
    base_file.write_text("peers = 4\ngrid = [2, 2]\n[protocol]\nmin_group_size = 2\n")
    s2 = _small(tmp_path, f'scenario = "{base_file.name}"\nseeds = [5, 7]\n[base]\nrounds = 1\n'
                          '[axes]\n"protocol.target_group_size" = [2]\n')
    assert s2.base == {"peers": 4, "grid": [2, 2], "protocol": {"min_group_size": 2}, "rounds": 1}
    assert s2.seeds == [5, 7] and s2.runs()[0].spec["protocol"] == {"min_group_size": 2, "target_group_size": 2}
    with pytest.raises(ValueError, match="unknown sweep keys"):
        _small(tmp_path, "axis = {}\n")
    with pytest.raises(ValueError, match="seed comes from the sweep"):
        _small(tmp_path, "[axes]\nseed = [1, 2]\n")


def test_key_depends_on_scenario_and_code_version(tmp_path, monkeypatch):
    s = _small(tmp_path)
    keys = [r.key for r in s.runs()]
    assert keys == [r.key for r in s.runs()]
    monkeypatch.setattr(sw, "_CODE_VERSION", "some-other-version")
    assert not set(keys) & {r.key for r in s.runs()}
    # a worker on other sources refuses to run
    monkeypatch.setattr(sw, "_CODE_VERSION", None)
    [(key, status, text, _)] = sw._run_chunk("scenario", "not-this-code", [("k", s.runs()[0].spec)])
    assert status == "error" and "code version" in text


def test_a_grid_too_large_for_one_sweep_is_refused_at_once(tmp_path, capsys):
    # 40^4 points x 10 seeds: listing the runs took minutes and gigabytes before any ran
    axes = "\n".join(f"protocol.{k} = [{', '.join(str(0.1 * (i + 1)) for i in range(40))}]"
                     for k in ("gossip_interval", "peer_timeout", "matchmaking_time", "part_timeout"))
    path = tmp_path / "huge.toml"
    path.write_text(f'kind = "scenario"\nseeds = 10\n[axes]\n{axes}\n')
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="25,600,000 runs .*40 protocol.gossip_interval.* split it"):
        load_sweep(path)
    assert time.monotonic() - t0 < 5
    s = _small(tmp_path)  # 4 points: a --seeds override counts too
    with pytest.raises(ValueError, match="more than the 1,000,000"):
        dataclasses.replace(s, seeds=list(range(sw.MAX_RUNS // 4 + 1)))
    from sim.__main__ import main

    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "split it into several sweeps" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_serial_processes_and_local_dask_cluster_give_byte_identical_files(tmp_path):
    distributed = pytest.importorskip("distributed")
    s = _small(tmp_path)
    serial = run_sweep(s, tmp_path / "serial", workers=0, quiet=True)
    procs = run_sweep(s, tmp_path / "procs", workers=2, quiet=True)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as lc:
        dask = run_sweep(s, tmp_path / "dask", cluster=lc, quiet=True)
    assert serial.computed == procs.computed == dask.computed == 8
    assert not serial.failures
    a, b, c = (_files(tmp_path / d) for d in ("serial", "procs", "dask"))
    assert len([f for f in a if f.startswith("runs/")]) == 8
    assert "results.csv" in a and "sweep.json" in a
    assert a == b == c
    desc, rows = read_table(tmp_path / "serial")
    assert len(rows) == 8 * 2  # runs × rounds
    assert {r["round"] for r in rows} == {1, 2}
    assert all(r["mse"] >= 0 for r in rows) and any(r["bytes_sent_mean"] > 0 for r in rows)


def test_interrupted_sweep_resumes_and_computes_only_the_rest(tmp_path):
    s = _small(tmp_path)
    seen: list[str] = []

    def interrupt_after_three(key: str) -> None:
        seen.append(key)
        if len(seen) == 3:
            raise KeyboardInterrupt

    out = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(s, out, workers=0, quiet=True, on_result=interrupt_after_three)
    stored = sorted(p.name for p in (out / "runs").iterdir())
    assert stored == sorted(f"{k}.json" for k in seen)  # the three finished runs, and no temporary file
    # plotting the unfinished folder says so (it said the folder was no sweep's --out folder at all)
    from sim.plot import plot_results

    with pytest.raises(ValueError, match="holds runs but no sweep.json: its sweep has not finished"):
        plot_results(out)
    again = run_sweep(s, out, workers=2, quiet=True)
    assert (again.computed, again.reused) == (5, 3)
    full = run_sweep(s, tmp_path / "whole", workers=0, quiet=True)
    assert full.computed == 8
    assert _files(out) == _files(tmp_path / "whole")
    assert run_sweep(s, out, workers=0, quiet=True).computed == 0


def test_a_recalibrated_profile_is_a_new_run_not_a_stale_reuse(tmp_path):
    # the key hashed `cpu = "prof.json"` (the name), so a resume after recalibrating reused the
    # runs made with the old numbers; a Dask worker elsewhere would have read its own file
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"cpu": {"handle_msg": 1e-4, "decode_byte": 1e-9}, "tcp": {"init_cwnd": 4}}))
    text = SMALL.replace("bootstrap_time = 0.0", f'bootstrap_time = 0.0\ncpu = "{prof}"\n'
                         f'network = {{ transfer = "tcp", tcp = {{ profile = "{prof}", mss = 1000 }} }}')
    s = _small(tmp_path, text)
    spec = s.runs()[0].spec
    assert spec["cpu"] == {"costs": {"handle_msg": 1e-4, "decode_byte": 1e-9}}
    assert spec["network"]["tcp"] == {"init_cwnd": 4, "mss": 1000}
    first = run_sweep(s, tmp_path / "out", workers=0, quiet=True)
    assert first.computed == 8
    _, before = read_table(tmp_path / "out")
    prof.write_text(json.dumps({"cpu": {"handle_msg": 1e-2, "decode_byte": 1e-7}, "tcp": {"init_cwnd": 4}}))
    again = run_sweep(s, tmp_path / "out", workers=0, quiet=True)
    assert (again.computed, again.reused) == (8, 0)
    _, after = read_table(tmp_path / "out")
    assert [r["sim_seconds"] for r in after] != [r["sim_seconds"] for r in before]
    # the inlined costs run exactly as the file did
    fresh = run_sweep(s, tmp_path / "fresh", workers=0, quiet=True)
    assert fresh.computed == 8 and read_table(tmp_path / "fresh")[1] == after


def test_a_damaged_run_file_is_run_again_not_a_failure_of_every_resume(tmp_path):
    # a run file cut short (a copy of the results interrupted, a full disk) failed every later
    # resume with a bare JSONDecodeError naming no file, and was never recomputed
    s = _small(tmp_path)
    out = tmp_path / "out"
    run_sweep(s, out, workers=0, quiet=True)
    whole = _files(out)
    key = s.runs()[3].key
    (out / "runs" / f"{key}.json").write_text('{"kind": "scen')
    err = io.StringIO()
    res = run_sweep(s, out, workers=0, quiet=True, stream=err)
    assert (res.computed, res.reused, res.failures) == (1, 7, [])
    assert f"{key}.json" in err.getvalue() and "run again" in err.getvalue()
    assert _files(out) == whole


def _long_sweep(tmp_path: Path) -> tuple[Path, Path, str, dict]:
    """A sweep file that runs for minutes, its output folder, and an environment holding a marker
    that every process it starts inherits (`_marked` finds them)."""
    path = tmp_path / "long.toml"
    path.write_text('kind = "moshpit"\nseeds = 400\n[base]\ncap = 200\n[axes]\nn = [1024]\np = [0.01]\n'
                    'method = ["moshpit", "random"]\n')
    out = tmp_path / "out"
    marker = f"ZGOSSIP_SWEEP_TEST_{uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{marker: "1"})
    return path, out, marker, env


def test_ctrl_c_keeps_finished_runs_and_stops_every_worker(tmp_path):
    """SIGINT to the command (as a terminal's Ctrl-C, to the whole process group): exit 130, the
    finished runs are whole files, no worker is left behind."""
    path, out, marker, env = _long_sweep(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "sim", "sweep", str(path), "--out", str(out), "--workers", "2",
                             "--quiet"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            # SIGINT at its default, as a terminal's job has it: a suite started in the
                            # background by a script (`pytest &`) ignores SIGINT, and the sweep inherited
                            # that -- it ran all 800 runs to the end
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list((out / "runs").glob("*.json"))) < 4:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    files = list((out / "runs").iterdir())
    assert 4 <= len(files) < 800
    for f in files:
        assert f.suffix == ".json" and json.loads(f.read_text())["result"]["rounds"][-1]["round"] == 200

    deadline = time.monotonic() + 10
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked(marker) == []


def _marked(marker: str) -> list[int]:
    """The processes whose environment holds `marker` (a test's own, inherited by what it starts)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and marker.encode() in (d / "environ").read_bytes():
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


_THREADED_SWEEP = ("import sys, threading, time\n"
                   "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
                   "from sim.sweep import load_sweep, run_sweep\n"
                   "run_sweep(load_sweep(sys.argv[1]), sys.argv[2], workers=2, quiet=True)\n")


@pytest.mark.parametrize("sig,threaded", [(signal.SIGTERM, False), (signal.SIGKILL, False), (signal.SIGKILL, True)])
def test_workers_leave_when_the_sweep_is_killed(tmp_path, sig, threaded):
    """SIGTERM or SIGKILL to the command alone (a batch scheduler, `kill`, the OOM killer): it runs no
    clean-up, and its pool workers were left behind for good, waiting for work that never came.
    ``threaded``: a parent with a thread (a Jupyter kernel) starts its workers from a forkserver,
    which lives as long as they do."""
    path, out, marker, env = _long_sweep(tmp_path)

    def ours() -> list[int]:
        return _marked(marker)

    cmd = (["-c", _THREADED_SWEEP, str(path), str(out)] if threaded else
           ["-m", "sim", "sweep", str(path), "--out", str(out), "--workers", "2", "--quiet"])
    proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list((out / "runs").glob("*.json"))) < 2:
            assert proc.poll() is None
            time.sleep(0.05)
        assert len(ours()) >= 3  # the command and its two workers (and a forkserver)
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while ours() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = ours()
    finally:
        for pid in ours():  # only what this test started (its marker is in their environment)
            os.kill(pid, signal.SIGKILL)
    assert left == []
    assert all(json.loads(f.read_text())["result"]["rounds"][-1]["round"] == 200 for f in (out / "runs").iterdir()
               if f.suffix == ".json")


def test_a_sweep_whose_every_point_is_refused_by_the_loader_is_refused_before_running(tmp_path, capsys):
    """An axis naming a setting that does not exist ran every run to the same ValueError, each printed with
    a traceback, and ended in status 1 (as if some runs had had bad luck), leaving a results folder."""
    s = _small(tmp_path, SMALL.replace("unavailability = [0.0, 0.25]", "protocol.target_group_sz = [2, 4]"))
    with pytest.raises(ValueError, match=re.escape("sweep 'small': no point can run; point "
                                                   '{"protocol.target_group_size":2,"protocol.target_group_sz":2}: '
                                                   "unknown [protocol] setting target_group_sz")):
        run_sweep(s, tmp_path / "out", workers=0, quiet=True)
    assert not (tmp_path / "out").exists()
    from sim.__main__ import main

    assert main(["sweep", str(tmp_path / "small.toml"), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown [protocol] setting target_group_sz" in err[0], err


def test_a_moshpit_sweep_whose_every_point_is_refused_is_refused_before_running(tmp_path):
    """kind = "moshpit" checked its keys only in each run: an axis `grp_size` failed all of them."""
    path = tmp_path / "m.toml"
    path.write_text('kind = "moshpit"\nseeds = 2\n[base]\nn = 16\np = 0.0\ncap = 2\nmethod = "moshpit"\n'
                    '[axes]\ngrp_size = [4, 8]\n')
    with pytest.raises(ValueError, match=re.escape("sweep 'm': no point can run; point {\"grp_size\":4}: "
                                                   "unknown moshpit keys ['grp_size']")):
        run_sweep(load_sweep(path), tmp_path / "out", workers=0, quiet=True)


def test_an_axis_value_listed_twice_is_refused(tmp_path):
    """unavailability = [0.0, 0.0] (for [0.0, 0.1]) ran one point, wrote its rows twice into results.csv,
    and the heatmap refused the doubled rows; the grid was a point short, silently."""
    with pytest.raises(ValueError, match=re.escape("axis 'unavailability' lists 0.25 twice: each value is one point")):
        _small(tmp_path, SMALL.replace("unavailability = [0.0, 0.25]", "unavailability = [0.25, 0.0, 0.25]"))


def test_a_failing_point_is_reported_with_its_scenario_and_the_others_finish(tmp_path):
    s = _small(tmp_path, SMALL.replace("unavailability = [0.0, 0.25]", "peers = [8, 100]"))
    err = io.StringIO()
    res = run_sweep(s, tmp_path / "out", workers=2, stream=err, quiet=True)
    assert res.computed == 4 and len(res.failures) == 4  # peers = 100 do not fit 4x2 cells
    assert all(f["point"]["peers"] == 100 and "ValueError" in f["error"] for f in res.failures)
    assert err.getvalue().count("run failed") == 4 and '"peers":100' in err.getvalue()
    _, rows = read_table(tmp_path / "out")
    assert {r["peers"] for r in rows} == {8} and len(rows) == 4 * 2
    assert len(json.loads((tmp_path / "out" / "failures.json").read_text())) == 4
    # failures are not stored: a re-run retries them (and reuses the rest)
    again = run_sweep(s, tmp_path / "out", workers=0, quiet=True, stream=io.StringIO())
    assert (again.computed, again.reused, len(again.failures)) == (0, 4, 4)
    from sim.__main__ import main

    assert main(["sweep", str(tmp_path / "small.toml"), "--out", str(tmp_path / "out"), "--quiet"]) == 1


def test_the_moshpit_table_sweep_reproduces_moshpit_table(tmp_path):
    from sim.moshpit import METHODS, moshpit_table, table_from_sweep

    s = load_sweep(sw.SWEEPS_DIR / "moshpit_table.toml")
    assert s.kind == "moshpit" and len(s.points()) == 4 * 3 * 4 and s.seeds == list(range(10))
    s = dataclasses.replace(s, seeds=[0, 1], axes={"n": [512, 1024], "p": [0.0, 0.01], "method": s.axes["method"]},
                            base={**s.base, "cap": 12})
    run_sweep(s, tmp_path / "t", quiet=True)
    got = table_from_sweep(read_table(tmp_path / "t")[1])
    assert got == moshpit_table((512, 1024), (0.0, 0.01), METHODS, restarts=2, cap=12, seed=0)


def test_plot_draws_the_standard_figures(tmp_path):
    pytest.importorskip("matplotlib")
    from sim.plot import plot_results

    s = _small(tmp_path)
    run_sweep(s, tmp_path / "out", workers=0, quiet=True)
    paths = plot_results(tmp_path / "out")
    assert sorted(p.name for p in paths) == ["bytes_vs_accuracy.png", "metric_vs_rounds.png", "rounds_to_eps.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_plot_results_in_a_notebook_keeps_its_backend_and_figures(tmp_path):
    # plot_results called matplotlib.use("Agg") unconditionally: a notebook was left on Agg, so the
    # user's later figures no longer showed inline
    pytest.importorskip("matplotlib")
    pytest.importorskip("matplotlib_inline")
    run_sweep(_small(tmp_path), tmp_path / "out", workers=0, quiet=True)
    code = ("import sys, matplotlib\n"
            "matplotlib.use('module://matplotlib_inline.backend_inline')\n"
            "import matplotlib.pyplot as plt\n"
            "mine = plt.figure()\n"
            "from sim.plot import plot_results\n"
            "paths = plot_results(sys.argv[1])\n"
            "print(matplotlib.get_backend(), plt.fignum_exists(mine.number), plt.get_fignums() == [mine.number], "
            "len(paths))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["module://matplotlib_inline.backend_inline", "True", "True", "3"]


def test_a_boolean_axis_reads_back_as_booleans_and_plots(tmp_path):
    # results.csv spells a boolean "True"/"False": read back as strings, they matched no axis value,
    # so the heatmap failed ('"True"' is not in list) and the curves were left out
    pytest.importorskip("matplotlib")
    from sim.plot import plot_results

    s = _small(tmp_path, SMALL.replace("unavailability = [0.0, 0.25]", "encode = [true, false]"))
    run_sweep(s, tmp_path / "out", workers=0, quiet=True)
    _, rows = read_table(tmp_path / "out")
    assert {r["encode"] for r in rows} == {True, False} and all(type(r["encode"]) is bool for r in rows)
    paths = plot_results(tmp_path / "out")
    assert "rounds_to_eps.png" in [p.name for p in paths]


def test_plot_draws_a_sweep_whose_metric_is_nan_throughout(tmp_path):
    # every peer crashed before round 1: mse is NaN in every row; the all-NaN curves on a log
    # scale made matplotlib fail ("Data cannot be log-scaled because all values are <= 0")
    pytest.importorskip("matplotlib")
    from sim.plot import plot_results

    crashes = ", ".join(f'{{kind = "crash", peer = {i}, at = 0.0}}' for i in range(8))
    s = _small(tmp_path, SMALL.replace("bootstrap_time = 0.0", f"bootstrap_time = 0.5\nfaults = [{crashes}]"))
    run_sweep(s, tmp_path / "out", workers=0, quiet=True)
    _, rows = read_table(tmp_path / "out")
    assert rows and all(math.isnan(r["mse"]) for r in rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's "All-NaN slice"
        paths = plot_results(tmp_path / "out")
    assert sorted(p.name for p in paths) == ["bytes_vs_accuracy.png", "metric_vs_rounds.png", "rounds_to_eps.png"]


TINY_MOSHPIT = """
name = "tiny"
kind = "moshpit"
seeds = 2
[base]
cap = 5
[axes]
n = [64]
p = [0.0, 0.01]
method = ["moshpit"]
"""


def test_bench_compares_serial_and_parallel_beside_the_machine_ceiling(tmp_path):
    from sim.sweep_bench import bench_sweep

    path = tmp_path / "tiny.toml"
    path.write_text(TINY_MOSHPIT)
    out = io.StringIO()
    res = bench_sweep(str(path), 1, stream=out, spin=500_000)
    text = out.getvalue()
    assert text.startswith("machine: ") and "speed-up / ceiling" in text
    (row,) = res["reps"]
    assert row["serial_s"] > 0 and row["parallel_s"] > 0 and row["ceiling"] > 0
    assert row["speedup"] == pytest.approx(row["serial_s"] / row["parallel_s"])
    assert row["share"] == pytest.approx(row["speedup"] / row["ceiling"])
    assert 0.3 < row["ceiling_cpu_inflation"] < 5  # a CPU-time ratio of one loop, not a wall-clock one
    assert row["others_load"] >= 0


@pytest.mark.parametrize("n,workers", [(1, 2), (7, 2), (90, 2), (480, 2), (480, 8), (3, 16)])
def test_chunks_cover_every_run_once_in_order_and_shrink_to_single_runs(n, workers):
    chunks = sw._chunks(list(range(n)), workers)
    assert [r for c in chunks for r in c] == list(range(n))
    sizes = [len(c) for c in chunks]
    assert all(1 <= s <= 16 for s in sizes)
    assert sizes == sorted(sizes, reverse=True)  # guided: never a larger chunk after a smaller one
    assert sizes[-min(n, workers):] == [1] * min(n, workers)  # the tail is single runs, one per worker


def test_stopping_the_pool_terminates_workers_that_are_running():
    # Ctrl-C on a parallel sweep: the workers must stop, not finish their runs (Python 3.11's
    # shutdown() forgets the processes, so they are taken first)
    import concurrent.futures as cf
    import multiprocessing as mp
    import time

    from sim.sweep import _running, _stop_pool

    pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
    fut = pool.submit(time.sleep, 60)
    deadline = time.monotonic() + 30
    while not fut.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = list(pool._processes.values())
    assert procs and all(p.is_alive() for p in procs)
    t0 = time.monotonic()
    _stop_pool(pool)
    # (`is_alive()` may stay True for a worker the pool's own thread reaped first: `_running` asks the OS)
    assert not any(_running(p) for p in procs) and time.monotonic() - t0 < 15


def test_plot_of_a_folder_that_is_no_sweep_says_so_and_creates_nothing(tmp_path, capsys):
    """It reported a missing 'FOLDER/sweep.json' file (FileNotFoundError) after creating FOLDER/plots."""
    from sim.__main__ import main

    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{tmp_path} is not a sweep's results folder (it holds no sweep.json)" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, expect", [
    ("axes = [1, 2]\n", "axes must be a table ([axes]), not [1, 2]"),
    ("base = 3\n", "base must be a table ([base]), not 3"),
    ('plot = "x"\n', "plot must be a table ([plot]), not 'x'"),
    ("seeds = 2.5\n", "seeds must be a count >= 1 or a list of seed indices (whole numbers >= 0), not 2.5"),
    ("seeds = true\n", "seeds must be a count >= 1 or a list of seed indices (whole numbers >= 0), not True"),
    ("seeds = [-1, 0]\n", "not [-1, 0]"),
    ('seed = "x"\n', "seed must be a whole number >= 0, not 'x'"),
])
def test_sweep_keys_of_the_wrong_type_are_refused_naming_the_key(tmp_path, text, expect):
    """`axes = [...]` or `base = 3` ended `python -m sim sweep` in an AttributeError traceback (exit 1),
    `seeds = 2.5` in "'float' object is not iterable", `seed = "x"` in an int() error naming no key;
    `seeds = true` ran one seed, silently."""
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(expect)):
        load_sweep(path)


def test_plot_refuses_a_heatmap_axis_that_is_none_and_results_with_no_rows(tmp_path, capsys):
    """`--heatmap a b` raised a bare KeyError ('a'); a results folder whose every run failed drew three
    empty figures and exited 0, saying nothing."""
    pytest.importorskip("matplotlib")
    from sim.__main__ import main

    s = _small(tmp_path)
    run_sweep(s, tmp_path / "out", workers=0, quiet=True)
    import matplotlib.pyplot as plt

    assert main(["plot", str(tmp_path / "out"), "--heatmap", "a", "unavailability"]) == 2
    assert not plt.get_fignums()  # the figure drawn before the heatmap failed is closed too
    err = capsys.readouterr().err
    assert "the heatmap's axes must be two different axes of the sweep, not ['a', 'unavailability']; its axes: " \
           "unavailability, protocol.target_group_size" in err, err
    # (a run that fails only as it runs: a point the loader refuses no longer runs when every point is refused)
    bad = dataclasses.replace(s, name="bad", base={**s.base, "churn": {"arrival_rate": 1e-6}},
                              axes={"faults": [[{"kind": "crash", "peer": 9, "at": 0.0}]]}, seeds=[0])
    assert run_sweep(bad, tmp_path / "bad", workers=0, quiet=True, stream=io.StringIO()).failures
    assert main(["plot", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "results.csv holds no rows, nothing to draw: 1 of its runs failed (see failures.json)" in err, err
    assert not (tmp_path / "bad" / "plots").exists()


def test_plots_take_their_default_axes_in_the_sweep_files_order(tmp_path):
    """sweep.json stores the axes with sorted keys, and the plots took "the last axis" (one line per
    value) and "the first two" (the heatmap) from that alphabetical order: SMALL's lines were
    unavailability, not its last axis protocol.target_group_size."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from sim.plot import metric_vs_rounds, rounds_to_eps_heatmap

    run_sweep(_small(tmp_path), tmp_path / "out", workers=0, quiet=True)
    desc, rows = read_table(tmp_path / "out")
    assert list(desc["axes"]) == ["unavailability", "protocol.target_group_size"]
    fig = metric_vs_rounds(desc, rows)
    assert fig.axes[0].get_legend().get_title().get_text() == "protocol.target_group_size"
    assert fig.axes[0].get_title() == "unavailability=0.0"
    plt.close(fig)
    fig = rounds_to_eps_heatmap(desc, rows)
    assert (fig.axes[0].get_xlabel(), fig.axes[0].get_ylabel()) == ("unavailability", "protocol.target_group_size")
    plt.close(fig)


def test_progress_to_a_file_prints_the_finished_line_once(tmp_path):
    """Off a terminal (a log file, CI), a sweep whose first progress update was also its last (one run,
    or every run in one finished chunk) printed "[####] 1/1 runs, 0 failed, ..., done" twice."""
    err = io.StringIO()
    run_sweep(dataclasses.replace(_small(tmp_path), axes={}, seeds=[0]), tmp_path / "out", workers=0, stream=err)
    lines = err.getvalue().splitlines()
    assert sum("1/1 runs" in line for line in lines) == 1, lines


def test_an_axis_reaching_into_a_base_value_that_is_no_table_is_refused_before_any_run(tmp_path):
    """`network.latency.median = [...]` over a base `latency = 0.02` replaced the number with
    {median = ...}, silently, and every run failed on the half-made distribution."""
    s = _small(tmp_path, SMALL.replace("[axes]", "network = {latency = 0.02}\n[axes]\nnetwork.latency.median = [0.01]"))
    with pytest.raises(ValueError, match=r"axis 'network.latency.median' reaches into network.latency, which the "
                                         r"base sets to 0.02, not a table"):
        s.runs()


@pytest.mark.parametrize("spec, expect", [
    ({"n": 2.5}, "moshpit: n must be a whole number >= 1, not 2.5"),
    ({"n": 0}, "moshpit: n must be a whole number >= 1, not 0"),
    ({"cap": -1}, "moshpit: cap must be a whole number >= 0, not -1"),
    ({"p": "x"}, "moshpit: p must be a probability in [0, 1], not 'x'"),
])
def test_a_moshpit_run_refuses_counts_and_rates_that_mean_nothing(spec, expect):
    """n = 2.5 ran with 2 peers and cap = -1 with no round at all, silently; n = 0 ended in numpy's
    empty-slice warnings and a reshape error."""
    with pytest.raises(ValueError, match=re.escape(expect)):
        sw._moshpit_run({"n": 16, "p": 0.0, "method": "random", "seed": 0, "restart": 0, "cap": 2, **spec})


def test_figures_say_when_they_leave_panels_out_and_draw_one_round_curves(tmp_path):
    """A sweep with more than 16 panel combinations lost the rest from its figures without a word; a
    1-round sweep drew every curve as a line of one point, i.e. nothing, under a legend."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from sim.plot import metric_vs_rounds

    desc = {"name": "many", "axes": {"a": list(range(5)), "b": list(range(5)), "c": [0, 1]}, "seeds": [0], "plot": {}}
    rows = [{"a": a, "b": b, "c": c, "seed": 0, "round": 1, "mse": 0.5} for a in range(5) for b in range(5)
            for c in (0, 1)]
    fig = metric_vs_rounds(desc, rows)
    try:
        assert len(fig.axes) == 16 and fig.get_suptitle().startswith("the first 16 of 25 panels")
        line = fig.axes[0].get_lines()[0]
        assert line.get_marker() == "o" and list(line.get_ydata()) == [0.5]
    finally:
        plt.close(fig)


def test_rounds_to_eps_refuses_rows_of_a_sweep_with_an_axis_it_was_not_given(tmp_path):
    """table_from_sweep reads n, p and method: a moshpit sweep over group_size too had the runs of both
    group sizes merged into one per seed (the first round either reached eps), silently."""
    from sim.moshpit import table_from_sweep

    s = _small(tmp_path, TINY_MOSHPIT.replace('method = ["moshpit"]', 'method = ["moshpit"]\ngroup_size = [4, 8]'))
    run_sweep(s, tmp_path / "out", workers=0, quiet=True)
    _, rows = read_table(tmp_path / "out")
    with pytest.raises(ValueError, match="several runs for one point of \\['n', 'p', 'method'\\] and seed 0"):
        table_from_sweep(rows)
    assert len(table_from_sweep([r for r in rows if r["group_size"] == 4])) == 2
