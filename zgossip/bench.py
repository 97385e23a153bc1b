"""``zgossip bench``: time zgossip on local processes, optionally against torch.distributed (gloo).

Two benchmarks, chosen by flag:

``zgossip bench --peers N --numel M [--reps R] [--part-size BYTES] [--vs gloo] [--json]``
    The all-reduce. A `LocalSwarm` of N peer processes over tcp loopback (ephemeral
    ports), one group of exactly N (target = min group size = N), waits for
    membership, runs 2 warm-up steps, then R timed steps (default 7, at least 5).
    For each repetition it takes the *max over peers* of the wall time of
    ``Averager.step()`` measured inside each peer -- everything a user waits for:
    the snapshot copy, matchmaking, the all-reduce and writing the result back --
    and, separately, of ``result.timings['allreduce']`` and ``['matchmaking']``;
    it reports their median, min and max. It checks once that a peer's tensor
    equals the float64 mean of all peers' data at float32 tolerance, and reports
    memory: the peak resident set of each peer over the warm-up and timed steps
    minus its resident set just before the first step (``VmHWM``/``VmRSS`` from
    /proc, the peak reset via /proc/self/clear_refs), as a multiple of the averaged
    tensor's bytes; the figure is the largest over peers. Persistent buffers a step
    allocates count as extra memory.

    With ``--vs gloo``, the same run also starts N processes (multiprocessing spawn)
    that join a ``torch.distributed`` gloo group through a TCPStore held by this
    process on 127.0.0.1 (its port found by binding port 0), each with the same
    float32 tensor, and times R ``dist.all_reduce`` calls after 2 warm-ups, each
    rep starting after a barrier, again max over ranks per rep. The ratio printed
    is zgossip's median step time / gloo's median all_reduce time (lower is better
    for zgossip).

``zgossip bench --matchmaking [--peers 8] [--numel 1024] [--reps 10]``
    Matchmaking latency: 8 local peers that already know each other (membership is
    awaited first), a small tensor, target group size 8, and at least 10 timed
    steps after warm-up; reports the median over steps of the max over peers of
    ``result.timings['matchmaking']`` (time from ``step()`` until the group is known).

``--json`` prints one JSON object with every figure instead of the table. Every
process started is stopped (killed if it does not stop in time) and every wait has
a timeout; everything binds to 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

from .swarm import LocalSwarm, peer_data

__all__ = ["add_arguments", "run", "bench_zgossip", "bench_gloo", "bench_matchmaking"]

WARMUP = 2
MIN_REPS = 5
MIN_MATCHMAKING_STEPS = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=None, help="local peer processes (default 4; 8 with --matchmaking)")
    p.add_argument("--numel", type=int, default=None,
                   help="float32 elements per peer (default 16777216 = 64 MiB; 1024 with --matchmaking)")
    p.add_argument("--reps", type=int, default=7, help=f"timed repetitions (default 7, at least {MIN_REPS})")
    p.add_argument("--part-size", type=int, default=None, metavar="BYTES",
                   help="zgossip part_size_bytes (default: the Averager's default)")
    p.add_argument("--vs", choices=["gloo"], default=None, help="also time torch.distributed all_reduce on the same data")
    p.add_argument("--matchmaking", action="store_true", help="benchmark matchmaking latency instead of the all-reduce")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="bound on each step / each wait, in seconds")


# ---------------------------------------------------------------------------- helpers
def _summary(xs: Sequence[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": list(xs)}


def _checked(answers: list[dict], what: str) -> list[dict]:
    bad = [a for a in answers if not a.get("ok")]
    if bad:
        raise RuntimeError(f"{what} failed on {len(bad)} peer(s): {bad[0].get('type')}: {bad[0].get('error')}")
    return answers


def _swarm_kwargs(n: int, part_size: int | None, timeout: float) -> dict:
    kw: dict = {
        "prefix": "bench",
        "target_group_size": n,
        "min_group_size": n,
        "gossip_interval": 0.1,
        "matchmaking_time": 2.0,  # the group forms as soon as all n have joined; this is only a bound
        "allreduce_timeout": timeout,
    }
    if part_size is not None:
        kw["part_size_bytes"] = part_size
    return kw


def _timed_steps(swarm: LocalSwarm, steps: int, timeout: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"wall": [], "allreduce": [], "matchmaking": [], "parent": [], "cpu": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        res = _checked(swarm.step_all(timeout=timeout), "step")
        out["parent"].append(time.perf_counter() - t0)
        if not all(r["complete"] and r["group_size"] == swarm.n for r in res):
            raise RuntimeError(f"a step did not average over all {swarm.n} peers: {[r['group_size'] for r in res]}")
        for k in ("wall", "allreduce", "matchmaking"):
            out[k].append(max(r["timings"][k] for r in res))
        out["cpu"].append(sum(r["timings"]["cpu"] for r in res))
    return out


# ---------------------------------------------------------------------------- zgossip
def bench_zgossip(peers: int, numel: int, reps: int, part_size: int | None = None, seed: int = 0,
                  timeout: float = 120.0, truth: np.ndarray | None = None) -> dict:
    kw = _swarm_kwargs(peers, part_size, timeout)
    with LocalSwarm(peers, numel, seed=seed, averager_kwargs=kw, start_timeout=timeout) as swarm:
        swarm.wait_membership(timeout=min(timeout, 30.0))
        before = _checked([swarm.call(i, "rss", timeout=timeout, reset=True) for i in range(peers)], "rss")
        for _ in range(WARMUP):
            _timed_steps(swarm, 1, timeout)
        times = _timed_steps(swarm, reps, timeout)
        after = _checked([swarm.call(i, "rss", timeout=timeout) for i in range(peers)], "rss")
        got = _checked([swarm.call(0, "tensor", timeout=timeout)], "tensor")[0]["tensor"]
        if truth is None:
            truth = swarm.truth()
    tensor_bytes = numel * 4
    extra = []
    for b, a in zip(before, after):
        if b.get("reset") and "VmHWM" in a and "VmRSS" in b:
            extra.append(a["VmHWM"] - b["VmRSS"])
    err = float(np.max(np.abs(got.astype(np.float64) - truth))) if numel else 0.0
    correct = bool(np.allclose(got, truth, rtol=1e-5, atol=1e-5))
    return {
        "peers": peers,
        "numel": numel,
        "reps": reps,
        "part_size_bytes": part_size,
        "step": _summary(times["wall"]),
        "allreduce": _summary(times["allreduce"]),
        "matchmaking": _summary(times["matchmaking"]),
        "parent_round_trip": _summary(times["parent"]),
        "cpu_seconds_all_peers": _summary(times["cpu"]),
        "correct": correct,
        "max_abs_error": err,
        "memory": {
            "tensor_bytes": tensor_bytes,
            "extra_peak_bytes_per_peer": extra,
            "extra_peak_ratio": (max(extra) / tensor_bytes) if extra and tensor_bytes else None,
        },
    }


# ---------------------------------------------------------------------------- gloo
def _gloo_child(rank: int, n: int, port: int, numel: int, seed: int, reps: int, timeout: float, conn: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs listen on loopback only
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, n, False, timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=timeout))
        t = torch.from_numpy(peer_data(seed, rank, numel))
        times: list[float] = []
        cpus: list[float] = []
        for k in range(WARMUP + reps):
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            dist.all_reduce(t)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            t.div_(n)  # keep the values bounded (and the mean checkable); not part of the timed call
            if k >= WARMUP:
                times.append(dt)
                cpus.append(dc)
        conn.send({"ok": True, "times": times, "cpus": cpus, "tensor": t.numpy() if rank == 0 else None})
        dist.destroy_process_group()
    except Exception as e:
        conn.send({"ok": False, "error": str(e), "type": type(e).__name__})
    finally:
        conn.close()


def bench_gloo(peers: int, numel: int, reps: int, seed: int = 0, timeout: float = 120.0,
               truth: np.ndarray | None = None) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    procs: list[Any] = []
    conns: list[Any] = []
    try:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(128)
        port = lsock.getsockname()[1]
        # this process holds the store, listening on the socket bound above (127.0.0.1 only);
        # the store takes the descriptor over and closes it
        store = dist.TCPStore("127.0.0.1", port, peers, True, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False, master_listen_fd=lsock.fileno())
        lsock.detach()
        for r in range(peers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_gloo_child, args=(r, peers, port, numel, seed, reps, timeout, child), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        deadline = time.monotonic() + timeout + 30.0 * (1 + reps * numel / 2**26)
        answers = []
        for r, c in enumerate(conns):
            if not c.poll(max(0.1, deadline - time.monotonic())):
                raise TimeoutError(f"gloo rank {r} did not finish in time")
            try:
                answers.append(c.recv())
            except EOFError:
                raise RuntimeError(f"gloo rank {r} exited (code {procs[r].exitcode})") from None
        _checked(answers, "gloo all_reduce")
        del store
    finally:
        for p in procs:
            p.join(max(0.1, 10.0))
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in conns:
            c.close()
        lsock.close()
    per_rep = [max(a["times"][k] for a in answers) for k in range(reps)]
    cpu = [sum(a["cpus"][k] for a in answers) for k in range(reps)]
    out = {"peers": peers, "numel": numel, "reps": reps, "all_reduce": _summary(per_rep),
           "cpu_seconds_all_peers": _summary(cpu)}
    if truth is not None:
        got = answers[0]["tensor"]
        out["correct"] = bool(np.allclose(got, truth, rtol=1e-5, atol=1e-5))
        out["max_abs_error"] = float(np.max(np.abs(got.astype(np.float64) - truth))) if numel else 0.0
    return out


# ---------------------------------------------------------------------------- matchmaking
def bench_matchmaking(peers: int = 8, numel: int = 1024, steps: int = MIN_MATCHMAKING_STEPS, seed: int = 0,
                      timeout: float = 60.0) -> dict:
    kw = _swarm_kwargs(peers, None, timeout)
    with LocalSwarm(peers, numel, seed=seed, averager_kwargs=kw, start_timeout=timeout) as swarm:
        swarm.wait_membership(timeout=min(timeout, 30.0))
        for _ in range(WARMUP):
            _timed_steps(swarm, 1, timeout)
        times = _timed_steps(swarm, steps, timeout)
    return {
        "peers": peers,
        "numel": numel,
        "steps": steps,
        "matchmaking": _summary(times["matchmaking"]),
        "step": _summary(times["wall"]),
    }


# ---------------------------------------------------------------------------- CLI
def _ms(s: float) -> str:
    return f"{s * 1000:8.1f} ms"


def _line(name: str, s: dict) -> str:
    return f"  {name:<24}median {_ms(s['median'])}   min {_ms(s['min'])}   max {_ms(s['max'])}"


def run(args: argparse.Namespace) -> int:
    if args.reps < MIN_REPS:
        print(f"zgossip bench: --reps must be at least {MIN_REPS}", file=sys.stderr)
        return 2
    if args.matchmaking:
        peers = args.peers or 8
        numel = 1024 if args.numel is None else args.numel
        res = bench_matchmaking(peers, numel, max(args.reps, MIN_MATCHMAKING_STEPS), args.seed, args.timeout)
        if args.json:
            print(json.dumps({"benchmark": "matchmaking", **res}))
        else:
            print(f"zgossip bench --matchmaking: {peers} peers that know each other, {numel} floats, "
                  f"{res['steps']} steps (max over peers per step)")
            print(_line("matchmaking", res["matchmaking"]))
            print(_line("whole step", res["step"]))
        return 0

    peers = args.peers or 4
    numel = 16777216 if args.numel is None else args.numel
    if peers < 2 or numel < 1:
        print("zgossip bench: need --peers >= 2 and --numel >= 1", file=sys.stderr)
        return 2
    truth = peer_data_mean(args.seed, peers, numel)
    zg = bench_zgossip(peers, numel, args.reps, args.part_size, args.seed, args.timeout, truth=truth)
    out: dict = {"benchmark": "allreduce", "zgossip": zg}
    if args.vs == "gloo":
        gl = bench_gloo(peers, numel, args.reps, args.seed, args.timeout, truth=truth)
        out["gloo"] = gl
        out["ratio"] = zg["step"]["median"] / gl["all_reduce"]["median"]
    if args.json:
        print(json.dumps(out))
        return 0
    mib = numel * 4 / 2**20
    part = "default" if args.part_size is None else f"{args.part_size / 2**20:g} MiB"
    print(f"zgossip bench: {peers} peers x {numel} float32 ({mib:.1f} MiB), {args.reps} reps "
          f"after {WARMUP} warm-up, part size {part}; max over peers per rep")
    print(_line("zgossip step()", zg["step"]))
    print(_line("  of which all-reduce", zg["allreduce"]))
    print(_line("  of which matchmaking", zg["matchmaking"]))
    print(_line("  CPU, all peers", zg["cpu_seconds_all_peers"]))
    print(f"  correct: {'yes' if zg['correct'] else 'NO'} (max |error| vs float64 mean {zg['max_abs_error']:.2e})")
    ratio = zg["memory"]["extra_peak_ratio"]
    if ratio is not None:
        print(f"  extra peak memory per peer: {max(zg['memory']['extra_peak_bytes_per_peer']) / 2**20:.1f} MiB "
              f"= {ratio:.2f}x the averaged tensor")
    if "gloo" in out:
        gl = out["gloo"]
        print(_line("gloo all_reduce", gl["all_reduce"]))
        print(_line("  CPU, all ranks", gl["cpu_seconds_all_peers"]))
        print(f"  gloo correct: {'yes' if gl.get('correct') else 'NO'}")
        print(f"  ratio zgossip/gloo (median): {out['ratio']:.2f}x (lower is better for zgossip)")
    return 0 if zg["correct"] else 1


def peer_data_mean(seed: int, peers: int, numel: int) -> np.ndarray:
    acc = np.zeros(numel, dtype=np.float64)
    for i in range(peers):
        acc += peer_data(seed, i, numel)
    return acc / peers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zgossip bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
