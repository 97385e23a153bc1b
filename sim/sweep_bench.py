"""``python -m sim sweep SWEEP --bench N``: the sweep on all cores against ``--serial``, and the
machine's own ceiling for two CPU-bound processes, side by side in one run.

A sweep's speed-up can only be as good as what the machine gives two busy processes. On a VM
the vCPUs may share physical cores (or their caches and clock) with each other or with other
tenants, and a pair of processes then runs slower each than one alone. So every repetition
measures three things in turn, fresh each time:

* ``serial``: ``python -m sim sweep SWEEP --serial`` into an empty results folder (the whole
  command: start-up, runs, tables), wall and CPU;
* ``parallel``: the same with the default executor (one process per core);
* ``ceiling``: a fixed pure-Python loop run by one process alone, then by one process per core
  at once (each the same loop); ``cores x t_alone / t_together`` is how much throughput the
  machine gave that many busy processes at that moment (2.0 on two idle, independent cores),
  and the loop's CPU seconds in company over alone says whether the processes slowed each
  other down on the CPU itself (a shared physical core, cache or clock) rather than by waiting.

``others`` is how many cores other processes kept busy meanwhile (the machine's busy time
from /proc/stat less this benchmark's own): above ~0.1 the figures are not the machine's.
It prints the machine line, each repetition's figures and the medians: the speed-up
(serial / parallel wall), the ceiling, and the speed-up as a share of the ceiling, which is the
part of the figure the sweep's own code controls.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["bench_sweep", "ceiling", "SPIN"]

# a loop of plain Python bytecode: no memory traffic, no I/O, no library
SPIN = "x = 0\nfor i in range({n}): x += i\n"


def _timed(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of a child process run to its end."""
    before = os.times()
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = os.times()
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def ceiling(procs: int, n: int = 15_000_000) -> dict:
    """The spin loop of ``n`` additions alone, then in ``procs`` processes at once: wall and CPU
    seconds of each, ``ceiling`` = procs x t_alone / t_together, and ``cpu_inflation`` = the CPU
    seconds one loop took in company over alone (1.0 where the processes do not slow each other
    down; above 1 where they share a physical core, its caches or its clock)."""
    cmd = [sys.executable, "-S", "-c", SPIN.format(n=n)]
    alone, alone_cpu = _timed(cmd)
    before = os.times()
    t0 = time.perf_counter()
    ps = [subprocess.Popen(cmd) for _ in range(procs)]
    for p in ps:
        p.wait()
    together = time.perf_counter() - t0
    after = os.times()
    for p in ps:
        if p.returncode:
            raise RuntimeError(f"the ceiling loop failed (exit {p.returncode})")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"alone_s": alone, "together_s": together, "ceiling": procs * alone / together,
            "cpu_inflation": cpu / procs / alone_cpu}


def bench_sweep(sweep_path: str, reps: int, stream=None, spin: int = 15_000_000) -> dict:
    """Run ``reps`` repetitions of (serial, parallel, ceiling); print and return the figures."""
    from zgossip.machine import machine_busy_seconds, machine_line

    stream = stream or sys.stdout
    procs = os.cpu_count() or 1
    base = [sys.executable, "-m", "sim", "sweep", sweep_path, "--quiet"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    stream.write(f"{machine_line()}\n")
    stream.write(f"sweep {sweep_path}: {reps} repetitions of serial, all cores ({procs} processes), ceiling\n")
    stream.write(f"{'rep':>3} {'serial s':>9} {'cpu':>6} {'parallel s':>10} {'cpu':>6} {'speed-up':>8} "
                 f"{'cpu par/ser':>11} {'ceiling':>8} {'spin cpu':>8} {'share':>6} {'others':>6}\n")
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="zgossip-sweep-bench-"))
    try:
        for rep in range(reps):
            out_s, out_p = tmp / f"s{rep}", tmp / f"p{rep}"
            busy0, own0, t0 = machine_busy_seconds(), os.times(), time.perf_counter()
            ws, cs = _timed(base + ["--out", str(out_s), "--serial"], env)
            wp, cp = _timed(base + ["--out", str(out_p)], env)
            if (out_s / "results.csv").read_bytes() != (out_p / "results.csv").read_bytes():
                raise RuntimeError("the serial and parallel results differ: the benchmark is void")
            c = ceiling(procs, spin)
            ceil = c["ceiling"]
            own1 = os.times()
            own = sum(getattr(own1, k) - getattr(own0, k) for k in ("user", "system", "children_user", "children_system"))
            others = max(0.0, machine_busy_seconds() - busy0 - own) / (time.perf_counter() - t0)
            shutil.rmtree(out_s)
            shutil.rmtree(out_p)
            row = {"serial_s": ws, "serial_cpu_s": cs, "parallel_s": wp, "parallel_cpu_s": cp,
                   "speedup": ws / wp, "cpu_ratio": cp / cs, "ceiling": ceil,
                   "ceiling_cpu_inflation": c["cpu_inflation"], "share": (ws / wp) / ceil,
                   "others_load": others}
            rows.append(row)
            stream.write(f"{rep + 1:>3} {ws:>9.2f} {cs:>6.2f} {wp:>10.2f} {cp:>6.2f} {row['speedup']:>7.2f}x "
                         f"{row['cpu_ratio']:>10.2f}x {ceil:>7.2f}x {c['cpu_inflation']:>7.2f}x {row['share']:>6.2f} {others:>6.2f}\n")
            stream.flush()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    stream.write(f"median: serial {med['serial_s']:.2f} s ({med['serial_cpu_s']:.2f} CPU s), parallel "
                 f"{med['parallel_s']:.2f} s ({med['parallel_cpu_s']:.2f} CPU s); speed-up {med['speedup']:.2f}x; "
                 f"CPU parallel/serial {med['cpu_ratio']:.2f}x; "
                 f"machine ceiling for {procs} busy processes {med['ceiling']:.2f}x (a spin loop's CPU in company "
                 f"{med['ceiling_cpu_inflation']:.2f}x its CPU alone); "
                 f"speed-up / ceiling {med['share']:.2f}; other processes kept {med['others_load']:.2f} cores busy"
                 f"{' (figures unreliable)' if med['others_load'] > 0.1 else ''}\n")
    return {"machine": machine_line(), "processes": procs, "reps": rows, "median": med}
