"""zgossip's own benchmarks with each process on its own testbed host (shaped links; root only).

``python -m sim overlap``: overlapped averaging where it is meant to help.

`zgossip bench-train --overlap` runs its peers on this host's loopback, where a round costs CPU
(copies, reductions, the I/O thread) that the next batch's compute then competes for. Users
overlap averaging because their links are slow: a round is mostly waiting for bytes. This runs
the same benchmark (the same processes, models and alternating sync / overlap repetitions) with
each process on its own testbed host (`sim.testbed`: a network namespace behind a shaped link),
so the round waits on the link and not on this machine's two cores.

``python -m sim state``: `zgossip bench-state` (a state download from N donors against the same
from 1) with each donor and the downloader on its own host. On loopback the download is bound by
this machine's CPUs; across hosts it is bound by the donors' uplinks, which is what spreading it
over several donors is for.

    python -m sim overlap --mbit 100 --latency-ms 5 --accel-ms 200 --reps 7
    python -m sim state --size-mib 256 --donors 4 --donor-mbit 200 --reps 3
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from zgossip.cliargs import nonnegative_float, positive_float, positive_int

__all__ = ["overlap_on_testbed", "state_on_testbed", "main", "state_main"]


def _on_testbed(hosts: list, seed: int, bench: Callable[[Any], dict]) -> dict:
    """Run `bench(tb)` on a testbed of `hosts`; its result gains the run's id (for leftover checks), the
    bytes each host's link carried (kernel counters) and the forwarder's CPU (read once more on close)."""
    from .testbed import Testbed

    with Testbed(hosts, seed=seed) as tb:
        res = bench(tb)
        res["testbed_id"] = tb.id
        res["link_bytes"] = [{"sent": c["sent_bytes"], "received": c["received_bytes"]} for c in tb.link_counters()]
    res["forwarder_cpu_s"] = tb.forwarder_cpu_seconds
    return res


def overlap_on_testbed(peers: int = 2, mbit: float = 100.0, latency_ms: float = 5.0, reps: int = 5,
                       epochs: int = 20, hidden: int = 512, batch: int = 16, accel_ms: float = 150.0,
                       timeout: float = 120.0, seed: int = 0) -> dict:
    """The overlap benchmark with peer i in testbed host i (up and down `mbit`, one-way `latency_ms`)."""
    from zgossip.bench_overlap import bench_overlap

    from .scenario import HostSpec

    hosts = [HostSpec(up_mbit=mbit, down_mbit=mbit, latency_ms=latency_ms) for _ in range(peers)]
    res = _on_testbed(hosts, seed, lambda tb: bench_overlap(
        peers=peers, reps=reps, epochs=epochs, hidden=hidden, inputs=hidden, batch=batch, timeout=timeout,
        accel_ms=accel_ms, netns=[tb.ns(i) for i in range(peers)], listen=[f"tcp://{tb.ip(i)}:0" for i in range(peers)]))
    res["link"] = {"mbit": mbit, "latency_ms": latency_ms}
    return res


def state_on_testbed(size_mib: int = 256, donors: int = 4, donor_mbit: float = 200.0, downloader_mbit: float = 1000.0,
                     latency_ms: float = 5.0, reps: int = 3, chunk_bytes: int = 4 << 20, timeout: float = 300.0,
                     seed: int = 0) -> dict:
    """The state-download benchmark with donor i in testbed host i (`donor_mbit` up and down) and the
    downloader in the last host (`downloader_mbit` up and down)."""
    from zgossip.bench_state import bench_state_download

    from .scenario import HostSpec

    hosts = [HostSpec(up_mbit=donor_mbit, down_mbit=donor_mbit, latency_ms=latency_ms) for _ in range(donors)]
    hosts.append(HostSpec(up_mbit=downloader_mbit, down_mbit=downloader_mbit, latency_ms=latency_ms))
    res = _on_testbed(hosts, seed, lambda tb: bench_state_download(
        size_mib, donors, reps, chunk_bytes, timeout, True, 0.0,
        hosts=[{"netns": tb.ns(i), "listen": f"tcp://{tb.ip(i)}:0"} for i in range(donors + 1)]))
    res["links"] = {"donor_mbit": donor_mbit, "downloader_mbit": downloader_mbit, "latency_ms": latency_ms}
    return res


def state_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim state",
                                description="zgossip bench-state with each donor and the downloader on a shaped host")
    p.add_argument("--size-mib", type=positive_int, default=256, help="state size in MiB (default 256)")
    p.add_argument("--donors", type=positive_int, default=4, help="donors of the parallel download (default 4)")
    p.add_argument("--donor-mbit", type=positive_float, default=200.0, help="each donor's up and down rate (default 200)")
    p.add_argument("--downloader-mbit", type=positive_float, default=1000.0, help="the downloader's rate (default 1000)")
    p.add_argument("--latency-ms", type=nonnegative_float, default=5.0, help="each host's one-way latency to the switch (default 5)")
    p.add_argument("--reps", type=positive_int, default=3, help="repetitions of each (ABBA order; default 3)")
    p.add_argument("--chunk-mib", type=positive_float, default=4.0, help="state chunk size in MiB (default 4)")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="bound on every wait, in seconds (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.donors < 2 or args.size_mib < 1 or args.reps < 1:
        p.error("need --donors >= 2, --size-mib >= 1, --reps >= 1")
    from zgossip.machine import machine_line

    from .testbed import TestbedUnavailable, interrupt_on_signals

    interrupt_on_signals()  # SIGTERM/SIGHUP tear the testbed down instead of leaving it behind
    try:
        res = state_on_testbed(args.size_mib, args.donors, args.donor_mbit, args.downloader_mbit, args.latency_ms,
                               args.reps, max(4096, int(args.chunk_mib * (1 << 20))), args.timeout)
    except TestbedUnavailable as e:
        print(f"python -m sim state: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"machine": machine_line(), **res}))
        return 0
    from zgossip.bench_state import report_lines

    n = args.donors
    print(machine_line())
    print(f"python -m sim state: {args.size_mib} MiB state download, {n} donor hosts at {args.donor_mbit:g} Mbit/s, "
          f"the downloader at {args.downloader_mbit:g} Mbit/s, {args.latency_ms:g} ms one-way to the switch; "
          f"{res['reps']} reps each, ABBA order")
    print("\n".join(report_lines(res)))
    print(f"  the links allow {min(n * args.donor_mbit, args.downloader_mbit) / min(args.donor_mbit, args.downloader_mbit):.2f}x; "
          f"testbed forwarder CPU: {res['forwarder_cpu_s']:.1f} s over the whole run")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim overlap", description=__doc__.split("\n\n")[1])
    p.add_argument("--peers", type=positive_int, default=2, help="processes, one per testbed host (default 2)")
    p.add_argument("--mbit", type=positive_float, default=100.0, help="each host's up and down rate (default 100)")
    p.add_argument("--latency-ms", type=nonnegative_float, default=5.0, help="each host's one-way latency to the switch (default 5)")
    p.add_argument("--reps", type=positive_int, default=5, help="repetitions of each (sync / overlap alternating; default 5)")
    p.add_argument("--epochs", type=positive_int, default=20, help="global steps per repetition (default 20)")
    p.add_argument("--hidden", type=positive_int, default=512, help="MLP width (default 512: 0.53M parameters)")
    p.add_argument("--batch", type=positive_int, default=16, help="samples per local batch (default 16)")
    p.add_argument("--accel-ms", type=nonnegative_float, default=150.0,
                   help="ms per batch during which this CPU is free, standing in for an accelerator's compute "
                        "(default 150: about a round of 0.53M float32 parameters between two 100 Mbit hosts)")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="bound on every wait, in seconds (default 120)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.peers < 2:
        p.error("need --peers >= 2 (processes that average together)")
    from .testbed import TestbedUnavailable, interrupt_on_signals

    interrupt_on_signals()  # SIGTERM/SIGHUP tear the testbed down instead of leaving it behind
    try:
        res = overlap_on_testbed(peers=args.peers, mbit=args.mbit, latency_ms=args.latency_ms, reps=args.reps,
                                 epochs=args.epochs, hidden=args.hidden, batch=args.batch, accel_ms=args.accel_ms,
                                 timeout=args.timeout)
    except TestbedUnavailable as e:
        print(f"python -m sim overlap: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res))
        return 0
    from zgossip.bench_overlap import report

    report(res, f"python -m sim overlap: {args.peers} testbed hosts, {args.mbit:g} Mbit/s up and down, "
                f"{args.latency_ms:g} ms one-way to the switch")
    print(f"  testbed forwarder CPU: {res['forwarder_cpu_s']:.1f} s over the whole run")
    return 0


