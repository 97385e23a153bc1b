"""``zgossip bench-state``: a state download from N donors against the same from 1, side by side.

Donor processes on loopback each publish the same state (``--size-mib`` of float64, a versioned
snapshot as `Averager.publish_state` makes one; the donors hold only that copy). One downloader
process then fetches it again and again, alternating 1 donor and N donors (ABBA order per
repetition, so drift of a shared machine hits both alike), with `load_state_from_peers(donors=k,
apply=False)`: the time is from the call to a complete, verified state in the downloader's buffers.
Beside each time the CPU seconds every process spent (from /proc) say where the time goes: on a
machine with few cores a loopback download is CPU-bound, and N donors cannot beat 1 by more than
the cores left idle by one donor and the downloader.

The same processes serve the test suite (`donor_main` with ``die_after``: a donor that SIGKILLs
itself mid-transfer).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

from .cliargs import nonnegative_float, positive_float, positive_int
from .machine import cpu_seconds, machine_busy_seconds, machine_line

__all__ = ["add_arguments", "run", "bench_state_download", "donor_main", "hash_cost", "report_lines"]

PREFIX = "bench-state"
_PEER_OPTS = dict(gossip_interval=0.1, peer_timeout=5.0, part_size_bytes=4 << 20)


def bench_state(size_bytes: int) -> np.ndarray:
    """The state every donor holds: the same bytes everywhere, distinct in every chunk."""
    return np.arange(size_bytes // 8, dtype=np.float64)


def hash_cost(size_bytes: int = 64 << 20, chunk_bytes: int = 4 << 20, reps: int = 5) -> dict:
    """Seconds to snapshot-hash `size_bytes` (SHA-256 per chunk + root), best of `reps`, and GB/s."""
    from .state import StateSnapshot

    a = np.random.default_rng(0).standard_normal(size_bytes // 8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        StateSnapshot.build(None, [a], chunk_bytes)
        times.append(time.perf_counter() - t0)
    return {"bytes": size_bytes, "seconds": min(times), "median": statistics.median(times),
            "gb_per_s": size_bytes / min(times) / 1e9}


def _place(where: dict | None) -> dict:
    """Averager settings for a process on one testbed host (`where`: its namespace and listen address,
    no Unix-socket shortcut past the shaped links), after moving the process there; {} on loopback."""
    if not where:
        return {}
    from .netns import enter_netns

    enter_netns(where["netns"])
    return {"listen": where["listen"], "local_ipc": False}


def donor_main(conn: Any, size_bytes: int, chunk_bytes: int, initial_peers: Sequence[str], die_after: int = 0,
               tcp_only: bool = True, uplink: float = 0.0, where: dict | None = None) -> None:
    """A donor process: publish the bench state, report where it listens, serve until told to stop.
    With ``die_after`` k > 0 it SIGKILLs itself as soon as it was asked for chunks k times. With
    ``uplink`` > 0 (bytes/s) it emulates a donor whose upload link is that fast: before serving a
    request its I/O thread waits until a token bucket of that rate has room (it serves nothing else
    meanwhile, as a saturated link would not)."""
    placed = _place(where)
    from .averager import Averager
    from .state import StateSnapshot

    av = Averager([np.zeros(1)], prefix=PREFIX, initial_peers=list(initial_peers),
                  **{"local_ipc": not tcp_only, **placed}, state_chunk_bytes=chunk_bytes, **_PEER_OPTS)
    try:
        snap = StateSnapshot.build(None, [bench_state(size_bytes)], chunk_bytes)
        node = av.transport.node
        if uplink > 0:
            paced, free_at = node.donor.serve_chunks, [0.0]

            def serve_paced(msg: Any) -> None:
                now = time.monotonic()
                free_at[0] = max(free_at[0], now) + msg.count * chunk_bytes / uplink
                time.sleep(max(0.0, free_at[0] - now - msg.count * chunk_bytes / uplink))
                paced(msg)

            node.donor.serve_chunks = serve_paced
        if die_after > 0:
            serve, asked = node.donor.serve_chunks, [0]

            def serve_then_die(msg: Any) -> None:
                serve(msg)  # queued, and lost with the process: the downloader must fetch them elsewhere
                asked[0] += 1
                if asked[0] >= die_after:
                    try:
                        conn.send({"event": "dying", "requests": asked[0]})
                    finally:
                        os.kill(os.getpid(), signal.SIGKILL)

            node.donor.serve_chunks = serve_then_die
        av.transport.call(lambda now: node.publish_state(1, snap, now))
        conn.send({"event": "up", "endpoint": av.endpoint, "peer_id": av.peer_id, "root": snap.root})
        while not conn.poll(0.5) or conn.recv() != "stop":
            if os.getppid() == 1:
                break  # the parent died
    except (EOFError, OSError):
        pass
    finally:
        av.shutdown(timeout=2.0)


def downloader_main(conn: Any, initial_peers: Sequence[str], donors: int, chunk_bytes: int, timeout: float,
                    tcp_only: bool = True, where: dict | None = None) -> None:
    """Wait until `donors` donors are known, then download on request: ("get", k) -> seconds."""
    placed = _place(where)
    from .averager import Averager

    av = Averager([np.zeros(1)], prefix=PREFIX, initial_peers=list(initial_peers),
                  **{"local_ipc": not tcp_only, **placed}, allow_state_sharing=False, state_chunk_bytes=chunk_bytes,
                  **_PEER_OPTS)
    try:
        end = time.monotonic() + timeout
        while av._ask_node(lambda node: len(node.membership.donors())) < donors:
            if time.monotonic() > end:
                raise TimeoutError(f"saw fewer than {donors} donors within {timeout:.0f}s")
            time.sleep(0.05)
        conn.send({"event": "ready", "pid": os.getpid()})
        while True:
            msg = conn.recv()
            if msg == "stop":
                break
            _, k = msg
            t0 = time.perf_counter()
            meta, arrays = av.load_state_from_peers(timeout=timeout, chunk_timeout=10.0, apply=False, donors=k)
            dt = time.perf_counter() - t0
            a = arrays[0]
            ok = a.dtype == np.float64 and a.size > 0 and int(a[-1]) == a.size - 1 and int(a[a.size // 2]) == a.size // 2
            del arrays, a
            st = av.stats
            conn.send({"event": "got", "seconds": dt, "ok": ok, "bad_chunks": st["state_bad_chunks"],
                       "refetched": st["state_refetched"]})
    except Exception as e:  # reported to the parent, which says what failed
        try:
            conn.send({"event": "error", "error": f"{type(e).__name__}: {e}"})
        except OSError:
            pass
    finally:
        av.shutdown(timeout=2.0)


class _Procs:
    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []

    def start(self, target: Any, *args: Any) -> int:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        child.close()
        self.procs.append(p)
        self.conns.append(parent)
        return len(self.procs) - 1

    def recv(self, i: int, timeout: float, what: str) -> dict:
        if not self.conns[i].poll(timeout):
            raise TimeoutError(f"no answer from {what} within {timeout:.0f}s")
        msg = self.conns[i].recv()
        if msg.get("event") == "error":
            raise RuntimeError(f"{what}: {msg['error']}")
        return msg

    def close(self) -> None:
        from .swarm import stop_children

        stop_children(self.conns, self.procs, "stop", 10.0)


def bench_state_download(size_mib: int, donors: int, reps: int, chunk_bytes: int = 4 << 20,
                         timeout: float = 120.0, tcp_only: bool = True, uplink: float = 0.0,
                         hosts: list[dict] | None = None) -> dict:
    """`hosts`: per process (the donors, then the downloader) its network namespace and listen address
    (``{"netns": ..., "listen": ...}``, one testbed host each, `sim.testbed_bench`); default: loopback."""
    if hosts is not None and len(hosts) != donors + 1:
        raise ValueError(f"hosts: one per donor and one for the downloader ({donors + 1}), not {len(hosts)}")
    where = hosts or [None] * (donors + 1)
    size = size_mib << 20
    procs = _Procs()
    try:
        procs.start(donor_main, size, chunk_bytes, [], 0, tcp_only, uplink, where[0])
        first = procs.recv(0, timeout, "donor 0")
        for i in range(1, donors):
            procs.start(donor_main, size, chunk_bytes, [first["endpoint"]], 0, tcp_only, uplink, where[i])
        ups = [first] + [procs.recv(i, timeout, f"donor {i}") for i in range(1, donors)]
        assert len({u["root"] for u in ups}) == 1, "donors hold different states"
        d = procs.start(downloader_main, [first["endpoint"]], donors, chunk_bytes, timeout, tcp_only, where[-1])
        procs.recv(d, timeout, "downloader")
        pids = [p.pid for p in procs.procs]
        procs.conns[d].send(("get", donors))  # untimed: connects to every donor, warms the buffers' path
        procs.recv(d, timeout + 30, "warm-up download")
        runs: dict[int, list[dict]] = {1: [], donors: []}
        for rep in range(reps):
            order = (1, donors) if rep % 2 == 0 else (donors, 1)
            for k in order:
                cpu0, busy0 = [cpu_seconds(p) for p in pids], machine_busy_seconds()
                procs.conns[d].send(("get", k))
                got = procs.recv(d, timeout + 30, f"download from {k} donor(s)")
                cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
                if not got["ok"]:
                    raise RuntimeError("downloaded state differs from the donors'")
                runs[k].append({"seconds": got["seconds"], "downloader_cpu": cpu[-1], "donors_cpu": sum(cpu[:-1]),
                                "others_cpu": max(0.0, machine_busy_seconds() - busy0 - sum(cpu))})
        ratios = [a["seconds"] / b["seconds"] for a, b in zip(runs[1], runs[donors])]
        med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
        return {"size_bytes": size, "donors": donors, "uplink": uplink, "reps": reps, "chunk_bytes": chunk_bytes, "runs": runs,
                "median_seconds": med, "speedup_paired_median": statistics.median(ratios), "speedups": ratios,
                "gb_per_s": {k: size / v / 1e9 for k, v in med.items()}}
    finally:
        procs.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=positive_int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--donors", type=positive_int, default=4, help="donors of the parallel download (default 4); 1 is always timed too")
    p.add_argument("--reps", type=positive_int, default=3, help="repetitions of each (ABBA order; default 3)")
    p.add_argument("--chunk-mib", type=positive_float, default=4.0, help="state chunk size in MiB (default 4)")
    p.add_argument("--donor-uplink-mbps", type=nonnegative_float, default=0.0, metavar="MB/S",
                   help="emulate donors whose upload is this many MB/s (paced in the donor process; default: "
                        "unlimited, i.e. loopback at whatever the CPUs allow)")
    p.add_argument("--ipc", action="store_true", help="peers on one host use Unix sockets (default: TCP loopback)")
    p.add_argument("--hash-only", action="store_true", help="only measure the cost of hashing a 64 MiB state")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="bound on every wait, in seconds (default 120)")


def run(args: argparse.Namespace) -> int:
    if args.donors < 2 or args.size_mib < 1 or args.reps < 1:
        print("zgossip bench-state: need --donors >= 2, --size-mib >= 1, --reps >= 1", file=sys.stderr)
        return 2
    chunk = max(4096, int(args.chunk_mib * (1 << 20)))
    hc = hash_cost(64 << 20, chunk)
    if args.hash_only:
        out: dict = {"hash_64mib": hc}
    else:
        out = {"hash_64mib": hc, **bench_state_download(args.size_mib, args.donors, args.reps, chunk, args.timeout,
                                                         not args.ipc, args.donor_uplink_mbps * 1e6)}
    if args.json:
        print(json.dumps({"machine": machine_line(), **out}))
        return 0
    print(machine_line())
    print(f"state hash (SHA-256 per {chunk >> 20} MiB chunk + root) of 64 MiB: {hc['seconds'] * 1e3:.0f} ms "
          f"(median {hc['median'] * 1e3:.0f} ms), {hc['gb_per_s']:.2f} GB/s")
    if args.hash_only:
        return 0
    paced = f", donors' upload paced to {args.donor_uplink_mbps:g} MB/s each" if args.donor_uplink_mbps > 0 else ""
    print(f"state download of {args.size_mib} MiB over {'Unix sockets' if args.ipc else 'TCP loopback'}{paced}, "
          f"{out['reps']} reps each, ABBA order:")
    print("\n".join(report_lines(out)))
    return 0


def report_lines(out: dict) -> list[str]:
    """The figures of a `bench_state_download` result, one line per number of donors and the ratio
    (also printed by `python -m sim state`, which runs it across testbed hosts)."""
    n = out["donors"]
    lines = []
    for k in (1, n):
        rs = out["runs"][k]
        lines.append(f"  {k} donor{'s' if k > 1 else ' '}: median {out['median_seconds'][k]:.2f} s "
                     f"({out['gb_per_s'][k]:.2f} GB/s, {out['gb_per_s'][k] * 8e3:.0f} Mbit/s), all "
                     f"{', '.join('%.2f' % r['seconds'] for r in rs)} s; CPU s per download: downloader "
                     f"{statistics.median(r['downloader_cpu'] for r in rs):.2f}, donors "
                     f"{statistics.median(r['donors_cpu'] for r in rs):.2f}, other processes "
                     f"{statistics.median(r['others_cpu'] for r in rs):.2f}")
    lines.append(f"  {n} donors vs 1: {out['speedup_paired_median']:.2f}x faster (paired median; "
                 f"{', '.join(f'{r:.2f}' for r in out['speedups'])})")
    return lines
