"""``zgossip bench-train``: one collaborative step of 4 local peers on a 10M-parameter model vs gloo.

What is timed, per repetition, on the same model (a 1024-2560-2560-320 MLP, 9,999,680
float32 parameters, identical initialisation everywhere) and the same machine:

* **zgossip**: N peer processes, each with a `CollaborativeOptimizer` (SGD) whose
  ``target_batch_size`` equals one local batch, so that every peer's `step()` ends an
  epoch. Each repetition, every peer first runs forward/backward on its batch (not
  timed); then all are told to go at once and each times its ``opt.step()``: gradient
  accumulation, reading the swarm's progress, matchmaking (which includes waiting for
  the last peer to be told to go), the sample-weighted all-reduce of all 10M gradients,
  and the optimizer step. The figure is the max over
  peers. Reported alongside: the averager's own matchmaking and all-reduce times (from
  the round's `StepResult.timings`) and the wrapper's overhead over plain averaging
  (the step minus the averager's ``timings['total']``).
* **gloo**: N processes in a ``torch.distributed`` gloo group (a TCPStore held by this
  process, bound to 127.0.0.1 on an ephemeral port), each with the same model. After
  the same untimed forward/backward and a barrier, each rank times what DDP does for
  the gradients -- flatten into 25 MiB buckets, ``all_reduce`` each, divide by N, copy
  back -- plus the same optimizer step. The figure is again the max over ranks.

Both sets of processes stay up and the repetitions alternate (zgossip, gloo, zgossip,
...), so both see the same machine; 2 warm-up repetitions of each are discarded. The
ratio is zgossip's median step / gloo's median step (lower is better for zgossip).
Every process is stopped (killed if it does not stop) and every wait is bounded.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any, Sequence

from .cliargs import positive_float, positive_int
from .swarm import stop_children

__all__ = ["add_arguments", "run", "bench_train", "PARAMS"]

HIDDEN, IN, OUT = 2560, 1024, 320
PARAMS = IN * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # 9,999,680
WARMUP = 2
BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))


def _backward(model: Any, batch: int, seed: int) -> None:
    import torch

    x = torch.randn(batch, IN, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()


def _zgossip_peer(rank: int, conn: Any, cfg: dict) -> None:
    import logging

    logging.basicConfig(level=os.environ.get("ZGOSSIP_LOG", "WARNING"))
    import torch

    torch.set_num_threads(1)
    from .collaborative import CollaborativeOptimizer

    model = _model()
    conn.send({"event": "ready"})
    initial = conn.recv()
    opt = CollaborativeOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-4), prefix="bench-train", target_batch_size=cfg["batch"],
        batch_size=cfg["batch"], initial_peers=initial, target_group_size=cfg["peers"], min_group_size=cfg["peers"],
        matchmaking_time=5.0, allreduce_timeout=cfg["timeout"], load_state_on_start=False,
        averager_opts=dict(gossip_interval=0.1, peer_timeout=10.0, request_timeout=1.0, part_timeout=10.0))
    try:
        conn.send({"event": "up", "endpoint": opt.endpoint})
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd == "peers":
                conn.send(opt.num_peers)
            elif cmd[0] == "prep":
                _backward(model, cfg["batch"], seed=1000 * cmd[1] + rank)
                conn.send("ok")
            elif cmd[0] == "step":
                t0 = time.perf_counter()
                opt.step()
                dt = time.perf_counter() - t0
                r = dict(opt.last_round)
                opt.zero_grad()
                conn.send({"step": dt, "ok": bool(r.get("ok")), "group": r.get("group_size"),
                           "timings": r.get("timings", {}), "phases": r.get("phases", {}), "error": r.get("error")})
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        opt.shutdown()


def _gloo_peer(rank: int, conn: Any, cfg: dict, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback only
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    n = cfg["peers"]
    store = dist.TCPStore("127.0.0.1", port, n, False, timeout=timedelta(seconds=cfg["timeout"]))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=cfg["timeout"]))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    buckets: list[list] = [[]]
    size = 0
    for p in reversed(params):  # DDP fills buckets in reverse order of registration
        if size and size + p.numel() * 4 > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * 4
    flats = [torch.empty(sum(p.numel() for p in b)) for b in buckets]
    try:
        conn.send({"event": "up"})
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd[0] == "prep":
                _backward(model, cfg["batch"], seed=1000 * cmd[1] + rank)
                conn.send("ok")
            elif cmd[0] == "step":
                dist.barrier()
                t0 = time.perf_counter()
                reduce = 0.0
                for b, flat in zip(buckets, flats):
                    torch.cat([p.grad.reshape(-1) for p in b], out=flat)
                    r0 = time.perf_counter()
                    dist.all_reduce(flat)
                    reduce += time.perf_counter() - r0
                    flat.div_(n)
                    off = 0
                    for p in b:
                        p.grad.copy_(flat[off: off + p.numel()].view_as(p))
                        off += p.numel()
                opt.step()
                dt = time.perf_counter() - t0
                opt.zero_grad()
                conn.send({"step": dt, "all_reduce": reduce})
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        dist.destroy_process_group()


class _Group:
    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []

    def start(self, target: Any, rank: int, *args: Any) -> None:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(rank, child, *args), daemon=True)
        p.start()
        child.close()
        self.procs.append(p)
        self.conns.append(parent)

    def ask(self, msg: Any, timeout: float, what: str) -> list:
        for c in self.conns:
            c.send(msg)
        return self.gather(timeout, what)

    def recv(self, r: int, timeout: float, what: str) -> Any:
        if not self.conns[r].poll(timeout):
            raise TimeoutError(f"{what}: no answer within {timeout:.0f}s")
        try:
            return self.conns[r].recv()
        except EOFError:
            raise RuntimeError(f"{what}: process {r} exited (code {self.procs[r].exitcode})") from None

    def gather(self, timeout: float, what: str) -> list:
        out = []
        deadline = time.monotonic() + timeout
        for r, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{what}: process {r} did not answer within {timeout:.0f}s")
            try:
                out.append(c.recv())
            except EOFError:
                raise RuntimeError(f"{what}: process {r} exited (code {self.procs[r].exitcode})") from None
        return out

    def close(self) -> None:
        stop_children(self.conns, self.procs, "stop", 15.0)


def _summary(xs: Sequence[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": list(xs)}


def bench_train(peers: int = 4, reps: int = 7, batch: int = 8, timeout: float = 120.0) -> dict:
    """Run both sides (see the module docstring); a dict of every figure."""
    from datetime import timedelta

    import torch.distributed as dist

    cfg = {"peers": peers, "batch": batch, "timeout": timeout}
    zg, gl = _Group(), _Group()
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    store = None
    try:
        for r in range(peers):
            zg.start(_zgossip_peer, r, cfg)
        zg.gather(timeout, "start-up")  # imports done everywhere
        zg.conns[0].send([])
        first = zg.recv(0, timeout, "zgossip peer 0 up")
        for c in zg.conns[1:]:
            c.send([first["endpoint"]])
        for r in range(1, peers):
            zg.recv(r, timeout, f"zgossip peer {r} up")
        deadline = time.monotonic() + timeout
        while min(zg.ask("peers", timeout, "membership")) < peers:
            if time.monotonic() > deadline:
                raise TimeoutError("zgossip peers did not find each other")
            time.sleep(0.1)
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(64)
        port = lsock.getsockname()[1]
        # this process holds the store, on the socket bound above (127.0.0.1 only); the store owns the fd now
        store = dist.TCPStore("127.0.0.1", port, peers, True, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False, master_listen_fd=lsock.fileno())
        lsock.detach()
        for r in range(peers):
            gl.start(_gloo_peer, r, cfg, port)
        gl.gather(timeout, "gloo start-up")
        zs, gs = [], []
        for k in range(WARMUP + reps):
            zg.ask(("prep", k), timeout, "zgossip backward")
            zres = zg.ask(("step", k), timeout + 30, "zgossip step")
            bad = [z for z in zres if not z["ok"] or z["group"] != peers]
            if bad:
                raise RuntimeError(f"a zgossip step did not average over all {peers} peers: {bad[0]}")
            gl.ask(("prep", k), timeout, "gloo backward")
            gres = gl.ask(("step", k), timeout + 30, "gloo step")
            if k >= WARMUP:
                zs.append(zres)
                gs.append(gres)
    finally:
        zg.close()
        gl.close()
        lsock.close()
        del store
    step = [max(z["step"] for z in rep) for rep in zs]
    mm = [max(z["timings"].get("matchmaking", 0.0) for z in rep) for rep in zs]
    ar = [max(z["timings"].get("allreduce", 0.0) for z in rep) for rep in zs]
    wrap = [max(z["step"] - z["timings"].get("total", 0.0) for z in rep) for rep in zs]
    gstep = [max(g["step"] for g in rep) for rep in gs]
    gar = [max(g["all_reduce"] for g in rep) for rep in gs]
    out = {
        "benchmark": "train", "peers": peers, "params": PARAMS, "batch": batch, "reps": reps,
        "zgossip": {"step": _summary(step), "matchmaking": _summary(mm), "allreduce": _summary(ar),
                    "wrapper_overhead": _summary(wrap)},
        "gloo": {"step": _summary(gstep), "all_reduce": _summary(gar)},
    }
    phases = sorted({k for rep in zs for z in rep for k in z["phases"]})
    out["zgossip"]["phases"] = {k: _summary([max(z["phases"].get(k, 0.0) for z in rep) for rep in zs]) for k in phases}
    out["ratio"] = out["zgossip"]["step"]["median"] / out["gloo"]["step"]["median"]
    return out


# ---------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=positive_int, default=4, help="local processes on each side (default 4)")
    p.add_argument("--reps", type=positive_int, default=7, help="timed repetitions after 2 warm-ups (default 7, at least 3)")
    p.add_argument("--batch", type=positive_int, default=8, help="samples per local batch (default 8; not timed)")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="bound on each wait, in seconds (default 120)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--overlap", action="store_true",
                   help="instead: global steps/s with and without delay_optimizer_step (zgossip.bench_overlap; "
                        "2 processes unless --peers)")
    from . import bench_overlap

    bench_overlap.add_arguments(p)


def _ms(s: dict) -> str:
    return f"median {s['median'] * 1000:8.1f} ms   min {s['min'] * 1000:8.1f}   max {s['max'] * 1000:8.1f}"


def run(args: argparse.Namespace) -> int:
    if getattr(args, "overlap", False):
        from . import bench_overlap

        return bench_overlap.run(args)
    if args.peers < 2 or args.reps < 3:
        print("zgossip bench-train: need --peers >= 2 and --reps >= 3", file=sys.stderr)
        return 2
    res = bench_train(args.peers, args.reps, args.batch, args.timeout)
    if args.json:
        print(json.dumps(res))
        return 0
    z, g = res["zgossip"], res["gloo"]
    print(f"zgossip bench-train: {args.peers} local processes per side, {PARAMS:,} float32 parameters "
          f"({PARAMS * 4 / 2**20:.0f} MiB of gradients), {args.reps} reps after {WARMUP} warm-ups, alternating; "
          "max over processes per rep")
    print(f"  zgossip collaborative step   {_ms(z['step'])}")
    print(f"    averager matchmaking        {_ms(z['matchmaking'])}")
    print(f"    averager all-reduce         {_ms(z['allreduce'])}")
    print(f"    wrapper overhead            {_ms(z['wrapper_overhead'])}")
    for k, v in z["phases"].items():
        print(f"      phase {k:<21} {_ms(v)}")
    print(f"  gloo DDP-style step          {_ms(g['step'])}")
    print(f"    of which all_reduce        {_ms(g['all_reduce'])}")
    print(f"  ratio zgossip/gloo (median step): {res['ratio']:.2f}x (lower is better for zgossip)")
    return 0
