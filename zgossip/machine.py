"""What a benchmark figure was measured on: the machine line and the optional fast paths that ran.

A speed figure from one machine can halve on another of the same kind (docs/performance.md), so
every benchmark prints the CPU model, the core count, the kernel and the transparent-huge-page
mode beside its figures, and which of zgossip's optional, machine-dependent paths a peer process
actually used: the C kernels (and the instruction set their loops were picked for), non-temporal
stores in `kernels.copy_finite`, the C sender/receiver (`fast_send`), the malloc tuning
(`process_tuning`). Reading only: nothing here changes a setting.
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

__all__ = ["machine", "machine_line", "optional_paths", "paths_line", "cpu_model", "cpu_seconds", "machine_busy_seconds",
           "machine_user_seconds", "tree_user_seconds", "OtherLoad"]


def cpu_model() -> str:
    """The CPU model as /proc/cpuinfo names it (else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _thp() -> str | None:
    """The transparent-huge-page mode in force ("always", "madvise", "never"), None where unknown."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("["):
            return word.strip("[]")
    return None


def machine() -> dict:
    """CPU model, cores, kernel, THP mode and libc of this machine."""
    libc = platform.libc_ver()
    return {"cpu_model": cpu_model(), "cores": os.cpu_count(), "system": platform.system(),
            "kernel": platform.release(), "thp": _thp(), "libc": " ".join(x for x in libc if x) or None,
            "python": platform.python_version()}


def machine_line(m: dict | None = None) -> str:
    m = machine() if m is None else m
    return (f"machine: {m['cpu_model']}, {m['cores']} cores, {m['system']} {m['kernel']}, "
            f"THP {m['thp'] or 'unknown'}, {m['libc'] or 'libc unknown'}, Python {m['python']}")


def optional_paths() -> dict:
    """Which optional paths this process runs (call after a ZeroMQ transport started, so that the
    once-per-process settings are in place)."""
    from . import kernels

    out = {"native_kernels": kernels.NATIVE, "kernels_isa": kernels.ISA,
           "stream_stores": kernels.STREAM_STORES if kernels.NATIVE else "off", "llc_bytes": kernels.LLC_BYTES}
    try:
        from . import fast_send, process_tuning
    except ImportError:  # no pyzmq: no ZeroMQ transport either
        return {**out, "fast_send": False, "malloc_tuned": False}
    return {**out, "fast_send": fast_send.FAST_SEND, "malloc_tuned": process_tuning.malloc_tuned()}


def paths_line(p: dict) -> str:
    kern = f"C ({p.get('kernels_isa') or '?'})" if p.get("native_kernels") else "numpy"
    yes = {True: "on", False: "off", None: "?"}
    stream = p.get("stream_stores")
    if stream == "auto":
        llc = p.get("llc_bytes")
        stream = f"auto (for tensors > the {llc / 2**20:g} MiB last-level cache)" if llc else "auto (cache size unknown: off)"
    return (f"optional paths: kernels {kern}; non-temporal copies {stream}; "
            f"C sender/receiver {yes[p.get('fast_send')]}; malloc tuning {yes[p.get('malloc_tuned')]}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_user_seconds() -> float:
    """CPU seconds the whole machine spent in user space (user + nice) since boot. Unlike
    `machine_busy_seconds` it leaves out the kernel's work, which on an emulated network
    (packets through veths, qdiscs and softirqs) no process is charged for."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (v[0] + v[1]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def tree_user_seconds(root: int | None = None) -> float:
    """User CPU seconds of process `root` (this one by default) and of every live descendant,
    each with the children it has reaped (``cutime``): what a process tree spent in user space,
    children that came and went included once their parent waited for them."""
    root = os.getpid() if root is None else root
    stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, utime + cutime ticks)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            stats[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[13]))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds spent by the whole machine outside idle and iowait since boot."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class OtherLoad:
    """How many cores processes other than ours kept busy from its making to `cores()`: the load
    average only tells the minute before, and a figure measured beside other work is not the
    machine's. Ours are this process and `pids` (busy time: user and system), or with `tree=True`
    this process and every descendant, exited ones included once reaped -- then user time only,
    since the kernel's work on an emulated network (veths, qdiscs, softirqs) is charged to no
    process (`tree_user_seconds`)."""

    def __init__(self, pids: list[int] | tuple[int, ...] = (), tree: bool = False) -> None:
        self.tree = tree
        self.pids = [os.getpid(), *pids]
        self.t0 = time.perf_counter()
        self.m0, self.c0 = self._machine(), self._ours()

    def _machine(self) -> float:
        return machine_user_seconds() if self.tree else machine_busy_seconds()

    def _ours(self) -> float:
        return tree_user_seconds() if self.tree else sum(cpu_seconds(p) for p in self.pids)

    def cores(self) -> float:
        dt = time.perf_counter() - self.t0
        other = self._machine() - self.m0 - (self._ours() - self.c0)
        return max(0.0, other / dt) if dt > 0 else 0.0
