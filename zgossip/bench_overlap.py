"""``zgossip bench-train --overlap``: training throughput with and without overlapped averaging.

N peer processes (default 2) train the same MLP with a `CollaborativeOptimizer` whose
``target_batch_size`` is one local batch, so every local batch ends a global step (an
epoch) and every epoch averages the gradients of all N peers. Each process holds two
optimizers over two copies of the model: one synchronous (the round and the optimizer step
inside `step()`), one with ``delay_optimizer_step=True, delay_grad_averaging=True`` (the
round and the optimizer step run on a worker while the next batch computes; applied at the
next step boundary). Repetitions alternate (sync, overlap, sync, ...), so both see the same
machine; 1 warm-up of each is discarded.

A repetition: every peer is told to go at once and trains until it has taken ``--epochs``
more global steps (forward, backward, ``opt.step()``, ``zero_grad()`` on a fixed batch);
the delayed optimizer then applies its last update (included in the time). Figures per
repetition are the slowest peer's: global steps per second (optimizer steps, the figure the
goal is stated in) and local batches per second (with overlap a peer may compute more than
one batch per global step while a round is slow: batches on parameters one step old).
The synchronous runs also report where a step's time goes (compute vs the round), which
says how close the chosen model is to "averaging takes about as long as compute".
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

from .cliargs import nonnegative_float, positive_int
from .swarm import stop_children

__all__ = ["add_arguments", "run", "bench_overlap", "machine_line", "report"]

WARMUP = 1


def machine_line() -> str:
    """The machine line (`zgossip.machine`) and the load: a figure is only valid on its machine, and
    suspect under load."""
    from .machine import machine_line as line

    return line() + ", load " + "/".join(f"{x:.1f}" for x in os.getloadavg())


def _model(cfg: dict) -> Any:
    import torch

    torch.manual_seed(0)
    h = cfg["hidden"]
    return torch.nn.Sequential(torch.nn.Linear(cfg["inputs"], h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                               torch.nn.ReLU(), torch.nn.Linear(h, 10))


def _peer(rank: int, conn: Any, cfg: dict) -> None:
    if cfg.get("netns"):  # this peer is one host of a shaped testbed (sim.testbed_bench)
        from .netns import enter_netns

        enter_netns(cfg["netns"][rank])
    import logging

    logging.basicConfig(level=os.environ.get("ZGOSSIP_LOG", "WARNING"))
    import torch

    torch.set_num_threads(1)
    from .collaborative import CollaborativeOptimizer

    g = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(cfg["batch"], cfg["inputs"], generator=g)
    y = torch.randint(0, 10, (cfg["batch"],), generator=g)
    conn.send({"event": "ready"})
    try:
        initial = conn.recv()
    except (EOFError, OSError):
        return  # the parent went away before starting us
    if not isinstance(initial, dict):
        return  # "stop" (the run was interrupted) before the start-up data: nothing to tear down
    opts: dict[str, Any] = {}
    models: dict[str, Any] = {}
    where: dict[str, Any] = {}
    if cfg.get("listen"):  # a testbed host: its own address, and no Unix-socket shortcut past the shaped link
        where = {"listen": cfg["listen"][rank]}
    try:
        for mode, kw in (("sync", {}), ("overlap", dict(delay_optimizer_step=True, delay_grad_averaging=True))):
            models[mode] = _model(cfg)
            opts[mode] = CollaborativeOptimizer(
                torch.optim.SGD(models[mode].parameters(), lr=1e-3), prefix=f"bench-overlap-{mode}",
                target_batch_size=cfg["batch"], batch_size=cfg["batch"], initial_peers=initial.get(mode, []),
                target_group_size=cfg["peers"], min_group_size=cfg["peers"], matchmaking_time=5.0,
                load_state_on_start=False, **where,
                averager_opts=dict(gossip_interval=0.1, peer_timeout=10.0, request_timeout=1.0, part_timeout=10.0,
                                   **({"local_ipc": False} if where else {})), **kw)
        conn.send({"event": "up", "endpoints": {m: o.endpoint for m, o in opts.items()}})
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd == "peers":
                conn.send(min(o.num_peers for o in opts.values()))
                continue
            _, mode, epochs = cmd
            opt, model = opts[mode], models[mode]
            target = opt.local_epoch + epochs
            batches, compute, stepping, rounds = 0, 0.0, [], []
            t0 = time.perf_counter()
            # stop once the round of the last global step was launched: a further step() would launch one more,
            # which the other peers (stopped) would never join
            while opt.local_epoch < target and not (opt.pending_update and opt.pending_update.epoch >= target - 1):
                c0 = time.perf_counter()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                if cfg["accel_ms"]:
                    time.sleep(cfg["accel_ms"] / 1000)  # an accelerator's compute: this CPU is free meanwhile
                compute += time.perf_counter() - c0
                s0 = time.perf_counter()
                opt.step()
                stepping.append(time.perf_counter() - s0)
                opt.zero_grad()
                batches += 1
                if not rounds or opt.last_round is not rounds[-1]:
                    rounds.append(opt.last_round)
            opt.apply_pending(wait=True)
            if opt.last_round is not rounds[-1]:
                rounds.append(opt.last_round)
            rounds = [r for r in rounds if r]
            dt = time.perf_counter() - t0
            ok = all(r.get("ok") and r.get("group_size") == cfg["peers"] for r in rounds) and opt.in_sync
            conn.send({"time": dt, "batches": batches, "epochs": epochs, "compute": compute / batches,
                       "step": statistics.median(stepping),
                       "average": statistics.median(r["phases"]["average"] for r in rounds) if rounds else None,
                       "matchmaking": [round(r.get("timings", {}).get("matchmaking", -1), 4) for r in rounds],
                       "timings": {k: statistics.median(r["timings"][k] for r in rounds if k in r.get("timings", {}))
                                   for k in sorted({k for r in rounds for k in r.get("timings", {})})},
                       "ok": ok, "error": next((r.get("error") for r in rounds if r.get("error")), None),
                       "staleness": [r["staleness"]["batches"] for r in rounds if "staleness" in r],
                       "waited": statistics.median([r["staleness"]["waited"] for r in rounds if "staleness" in r]
                                                   or [0.0])})
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        for o in opts.values():
            o.shutdown()


class _Group:
    def __init__(self, n: int, cfg: dict) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for r in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_peer, args=(r, child, cfg), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def recv(self, r: int, timeout: float, what: str) -> Any:
        if not self.conns[r].poll(timeout):
            raise TimeoutError(f"{what}: process {r} did not answer within {timeout:.0f}s")
        try:
            return self.conns[r].recv()
        except EOFError:
            raise RuntimeError(f"{what}: process {r} exited (code {self.procs[r].exitcode})") from None

    def ask(self, msg: Any, timeout: float, what: str) -> list:
        for c in self.conns:
            c.send(msg)
        deadline = time.monotonic() + timeout
        return [self.recv(r, max(0.0, deadline - time.monotonic()), what) for r in range(len(self.conns))]

    def close(self) -> None:
        stop_children(self.conns, self.procs, "stop", 15.0)


def bench_overlap(peers: int = 2, reps: int = 5, epochs: int = 20, hidden: int = 512, inputs: int = 512,
                  batch: int = 256, timeout: float = 120.0, accel_ms: float = 0.0,
                  netns: list[str] | None = None, listen: list[str] | None = None) -> dict:
    """`netns` / `listen`: per process, the network namespace it runs in and the address it listens on
    (one testbed host each, `sim.testbed_bench`); default: all on this host's loopback."""
    if (netns is None) != (listen is None) or (netns is not None and len(netns) != peers) \
            or (listen is not None and len(listen) != peers):
        raise ValueError("netns and listen go together, one per peer")
    cfg = {"peers": peers, "hidden": hidden, "inputs": inputs, "batch": batch, "accel_ms": accel_ms,
           "netns": netns, "listen": listen}
    group = _Group(peers, cfg)
    res: dict[str, list] = {"sync": [], "overlap": []}
    try:
        for r in range(peers):
            assert group.recv(r, timeout, "start-up")["event"] == "ready"
        group.conns[0].send({})
        first = group.recv(0, timeout, "peer 0 up")["endpoints"]
        for c in group.conns[1:]:
            c.send({m: [ep] for m, ep in first.items()})
        for r in range(1, peers):
            group.recv(r, timeout, f"peer {r} up")
        deadline = time.monotonic() + timeout
        while min(group.ask("peers", timeout, "membership")) < peers:
            if time.monotonic() > deadline:
                raise TimeoutError("peers did not find each other")
            time.sleep(0.1)
        for k in range(WARMUP + reps):
            for mode in ("sync", "overlap"):
                ans = group.ask(("run", mode, epochs), timeout + epochs * 10, f"{mode} repetition")
                bad = [a for a in ans if not a["ok"]]
                if bad:
                    raise RuntimeError(f"a {mode} repetition did not average over all {peers} peers: {bad[0]}")
                if k >= WARMUP:
                    res[mode].append(ans)
    finally:
        group.close()

    def rate(mode: str, key: str) -> list[float]:
        return [min(a[key] / a["time"] for a in rep) for rep in res[mode]]

    out: dict[str, Any] = {"benchmark": "overlap", "peers": peers, "reps": reps, "epochs": epochs,
                           "hidden": hidden, "inputs": inputs, "batch": batch, "accel_ms": accel_ms,
                           "params": inputs * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10,
                           "machine": machine_line()}
    for mode in res:
        out[mode] = {"steps_per_s": rate(mode, "epochs"), "batches_per_s": rate(mode, "batches"),
                     "compute_s": statistics.median(a["compute"] for rep in res[mode] for a in rep),
                     "step_s": statistics.median(a["step"] for rep in res[mode] for a in rep)}
    out["sync"]["average_s"] = statistics.median(a["average"] for rep in res["sync"] for a in rep)
    out["overlap"]["waited_s"] = statistics.median(a["waited"] for rep in res["overlap"] for a in rep)
    out["overlap"]["stale_batches_last"] = [a["staleness"] for a in res["overlap"][-1]]
    out["raw"] = res
    # side by side: each repetition's overlap run against the sync run just before it
    ratios = [o / s for o, s in zip(out["overlap"]["steps_per_s"], out["sync"]["steps_per_s"])]
    out["ratio_steps"] = {"median": statistics.median(ratios), "min": min(ratios), "all": ratios}
    out["ratio_batches"] = statistics.median(
        o / s for o, s in zip(out["overlap"]["batches_per_s"], out["sync"]["batches_per_s"]))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overlap-epochs", type=positive_int, default=20, help="global steps per repetition (default 20)")
    p.add_argument("--hidden", type=positive_int, default=512, help="MLP width (default 512: 0.53M parameters)")
    p.add_argument("--overlap-batch", type=positive_int, default=256, help="samples per local batch (default 256)")
    p.add_argument("--accel-ms", type=nonnegative_float, default=0.0,
                   help="add this many ms of waiting to each batch's compute, standing in for an accelerator "
                        "(the CPU is free meanwhile, as while a GPU computes); 0: CPU compute only")


def run(args: argparse.Namespace) -> int:
    peers = args.peers if args.peers != 4 else 2  # bench-train's default is 4 processes; overlap defaults to 2
    if peers < 2:
        print("zgossip bench-train --overlap: need --peers >= 2 (processes that average together)", file=sys.stderr)
        return 2
    res = bench_overlap(peers=peers, reps=args.reps, epochs=args.overlap_epochs, hidden=args.hidden,
                        inputs=args.hidden, batch=args.overlap_batch, timeout=args.timeout, accel_ms=args.accel_ms)
    if args.json:
        print(json.dumps(res))
        return 0
    report(res, f"zgossip bench-train --overlap: {peers} local processes")
    return 0


def report(res: dict, title: str) -> None:
    s, o = res["sync"], res["overlap"]
    print(f"{title}, {res['params']:,} float32 parameters, batch "
          f"{res['batch']}, accelerator stand-in {res['accel_ms']:g} ms/batch, {res['epochs']} global steps per repetition, {res['reps']} reps after {WARMUP} warm-up, "
          "alternating sync / overlap; slowest process per rep")
    print(f"  a synchronous step: compute (forward+backward) {s['compute_s'] * 1000:.1f} ms, "
          f"round (average) {s['average_s'] * 1000:.1f} ms (median)")
    print(f"  time inside opt.step() per batch (median): sync {s['step_s'] * 1000:.1f} ms, overlap "
          f"{o['step_s'] * 1000:.1f} ms (waiting for the update in flight: {o['waited_s'] * 1000:.1f} ms); "
          f"compute per batch with overlap {o['compute_s'] * 1000:.1f} ms")
    print("  global steps/s  sync    " + " ".join(f"{v:6.2f}" for v in s["steps_per_s"]))
    print("  global steps/s  overlap " + " ".join(f"{v:6.2f}" for v in o["steps_per_s"]))
    print("  batches/s       sync    " + " ".join(f"{v:6.2f}" for v in s["batches_per_s"]))
    print("  batches/s       overlap " + " ".join(f"{v:6.2f}" for v in o["batches_per_s"]))
    r = res["ratio_steps"]
    print(f"  overlap / sync, global steps/s (rep by rep): median {r['median']:.2f}x, min {r['min']:.2f}x; "
          f"batches/s median {res['ratio_batches']:.2f}x")
    print(f"  staleness of the last overlapped update per peer: {o['stale_batches_last']}")
    print(f"  {res['machine']}")
