"""``python -m sim bench``: the simulator's speed and memory, each against a yardstick in the same run.

* **Message level, real protocol:** one Moshpit round of 1,024 peers on a 32x32 grid in groups
  of 32 (SimPy, every message through the network model), wall seconds per round; beside it a
  bare SimPy model with no protocol code (1,024 peers in groups of 16, 30 messages each per
  round, latency only), so the ratio shows what the protocol adds on top of SimPy itself.
  The same round runs on FIFO links (the default without hosts) and on TCP connections
  (`sim.tcp`, 100 Mbit/s access links), whose per-RTT rounds cost more events.
* **Memory:** peak resident memory of a child process that builds and runs one round of
  16,384 peers (128x128 grid, groups of 32).
* **Round level:** seconds per round of 10^6 peers (`sim.roundlevel`).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
import simpy

__all__ = ["bare_simpy_round", "message_level_round", "main"]


def bare_simpy_round(n: int = 1024, group: int = 16, messages: int = 30, seed: int = 0) -> float:
    """Wall seconds for one round of a protocol-free SimPy model of the same traffic shape."""
    env = simpy.Environment()
    rng = np.random.default_rng(seed)
    received = np.zeros(n, dtype=np.int64)
    t0 = time.perf_counter()
    order = rng.permutation(n)
    for g in range(n // group):
        members = order[g * group:(g + 1) * group]
        for src in members:
            dsts = rng.choice(members, size=messages)
            lats = rng.uniform(0.001, 0.01, size=messages)
            for d, lat in zip(dsts, lats):
                ev = env.timeout(float(lat))
                ev.callbacks.append(lambda _e, d=int(d): received.__setitem__(d, received[d] + 1))
    env.run()
    assert received.sum() == n * messages
    return time.perf_counter() - t0


def message_level_round(n: int = 1024, side: int = 32, group: int = 32, rounds: int = 3, seed: int = 0,
                        transfer: str = "fifo") -> list[float]:
    from .scenario import run_scenario

    network = {} if transfer == "fifo" else {"transfer": transfer, "bandwidth": 12.5e6}
    res = run_scenario({"peers": n, "grid": [side, n // side], "rounds": rounds, "seed": seed, "membership": "static",
                        "encode": False, "bootstrap_time": 0.0, "placement": "full",
                        "protocol": {"target_group_size": group}, "network": network})
    assert all(r["succeeded"] == n for r in res.rounds)
    return res.wall_seconds


def _memory_child(n: int, side: int) -> None:
    from .scenario import run_scenario

    t0 = time.perf_counter()
    # side x ceil(n / side) cells hold every peer (side x n // side held fewer when n is no multiple of side)
    res = run_scenario({"peers": n, "grid": [side, -(-n // side)], "rounds": 1, "seed": 0, "membership": "static",
                        "encode": False, "bootstrap_time": 0.0, "placement": "full",
                        "protocol": {"target_group_size": 32}})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peers": n, "peak_rss_bytes": peak, "succeeded": res.rounds[0]["succeeded"],
                      "wall_s": time.perf_counter() - t0}))


def main(argv: list[str] | None = None) -> int:
    import argparse

    from zgossip.cliargs import positive_int

    ap = argparse.ArgumentParser(prog="python -m sim bench")
    ap.add_argument("--memory-peers", type=positive_int, default=16384,
                    help="peers of the message-level run whose peak memory is measured (default 16384)")
    ap.add_argument("--skip-memory", action="store_true", help="skip the memory measurement (the slowest part)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    from zgossip.machine import OtherLoad, machine, machine_line

    out: dict = {"machine": machine(), "loadavg": list(os.getloadavg())}
    if not args.json:  # a speed figure means little without the machine and its load (README, Benchmarks)
        print(f"{machine_line(out['machine'])}, load {out['loadavg'][0]:.2f}")
    # what other processes used while the timed rounds ran: the load average only tells the minute before
    load = OtherLoad()
    bare = [bare_simpy_round() for _ in range(3)]
    real = message_level_round()
    tcp = message_level_round(transfer="tcp")
    out["other_load_cores"] = load.cores()
    out["bare_simpy_round_s"] = float(np.median(bare))
    out["message_level_round_s"] = float(np.median(real))
    out["message_level_tcp_round_s"] = float(np.median(tcp))
    out["ratio"] = out["message_level_round_s"] / out["bare_simpy_round_s"]
    from .roundlevel import bench as round_bench

    rl = round_bench(n_peers=1_000_000, rounds=3)
    out["round_level"] = rl
    if not args.skip_memory:
        side = int(round(args.memory_peers ** 0.5))
        p = subprocess.run([sys.executable, "-c", f"from sim.bench import _memory_child; _memory_child({args.memory_peers}, {side})"],
                           capture_output=True, text=True, timeout=1200)
        out["memory"] = json.loads(p.stdout) if p.returncode == 0 else {"error": p.stderr[-500:]}
    if args.json:
        print(json.dumps(out, indent=1, sort_keys=True))
    else:
        print(f"message level, real protocol: 1,024 peers, 32x32 grid, groups of 32: "
              f"{out['message_level_round_s']:.3f} s/round (median of {len(real)})")
        print(f"  the same on TCP connections (sim.tcp, 100 Mbit/s links):        "
              f"{out['message_level_tcp_round_s']:.3f} s/round (median of {len(tcp)})")
        print(f"bare SimPy, no protocol:      1,024 peers, groups of 16, 30 msgs each: "
              f"{out['bare_simpy_round_s']:.3f} s/round  -> ratio {out['ratio']:.2f}x")
        print(f"round level: {rl}")
        print(f"other processes kept {out['other_load_cores']:.2f} cores busy during the timed rounds")
        if "memory" in out:
            m = out["memory"]
            if "peak_rss_bytes" in m:
                print(f"memory: {m['peers']:,} peers, one round: peak RSS {m['peak_rss_bytes'] / 2**30:.2f} GiB "
                      f"({m['wall_s']:.0f} s)")
            else:
                print(f"memory run failed: {m['error']}")
    return 0
