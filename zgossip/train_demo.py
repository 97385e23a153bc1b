"""``zgossip train-demo``: local peer processes train one model collaboratively; one joins late.

The task is synthetic, so nothing is downloaded: inputs are 16-dimensional standard
normal vectors, labelled with one of 4 classes by a fixed random "teacher" network (a
16-64-4 tanh MLP drawn from seed 1234, labels = argmax of its output). Each peer draws
its own stream of examples from ``(data seed, peer index)``; the student is a 16-64-4
ReLU MLP trained with cross-entropy and Adam. A held-out set of 2048 examples (seed 999)
measures the loss every peer reports.

The peers run a `CollaborativeOptimizer` with a global ``target_batch_size``: every
epoch is one optimizer step on ``target_batch_size`` samples contributed by all peers
together. Peer 0 prints one line per epoch (held-out loss and accuracy, peers in the
swarm, samples per epoch); the late peer starts after ``--late-at`` epochs, downloads
the state of the running peers, says at which epoch it continues, and trains on. At
the end every peer reports its loss and a checksum of its parameters: equal checksums
mean the peers hold identical models.
"""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import time
import sys
from typing import Any

from .cliargs import log_level, nonnegative_float, positive_float, positive_int
from .swarm import start_child, stop_children

__all__ = ["add_arguments", "run", "Task", "make_model", "train_peer"]

DIM, CLASSES, HIDDEN = 16, 4, 64


class Task:
    """The synthetic classification task (see the module docstring)."""

    def __init__(self, teacher_seed: int = 1234) -> None:
        import torch

        g = torch.Generator().manual_seed(teacher_seed)
        self.w1 = torch.randn(DIM, HIDDEN, generator=g) / DIM ** 0.5
        self.w2 = torch.randn(HIDDEN, CLASSES, generator=g) / HIDDEN ** 0.5

    def sample(self, gen: Any, n: int) -> tuple[Any, Any]:
        import torch

        x = torch.randn(n, DIM, generator=gen)
        y = (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=1)
        return x, y

    def stream(self, data_seed: int, index: int) -> Any:
        import torch

        return torch.Generator().manual_seed(data_seed * 1000 + index + 1)

    def heldout(self, n: int = 2048) -> tuple[Any, Any]:
        import torch

        return self.sample(torch.Generator().manual_seed(999), n)


def make_model(seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def evaluate(model: Any, x: Any, y: Any) -> tuple[float, float]:
    import torch

    with torch.no_grad():
        out = model(x)
        return float(torch.nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def param_digest(model: Any) -> str:
    h = hashlib.blake2b(digest_size=6)
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def train_peer(index: int, conn: Any, cfg: dict) -> None:
    """One peer process: build, (maybe) catch up, train to ``cfg['epochs']``, report, wait for 'stop'.

    With ``cfg['wait_for_go']`` it first imports and builds the model, says ``ready`` and waits for
    a dict of settings to add (so a late joiner can join fast); with ``cfg['wait_for_start']`` it
    waits for ``"start"`` after joining the swarm (so the first peers begin together)."""
    import logging

    logging.basicConfig(level=os.environ.get("ZGOSSIP_LOG", cfg.get("log_level", "WARNING")),
                        format=f"peer{index} %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(1)
    from .collaborative import CollaborativeOptimizer

    task = Task()
    hx, hy = task.heldout()
    model = make_model(cfg.get("model_seed", 0) if cfg.get("same_init", True) else 100 + index)
    gen = task.stream(cfg.get("data_seed", 0), index)
    # built before "ready": torch's first optimizer in a process imports its compiler stack (2-3 s on
    # the 2-core VM), which made the late joiner of the demo arrive ~25 epochs after it was told to
    adam = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    if cfg.get("wait_for_go"):  # pay for process start-up and imports now, join when told to
        conn.send({"event": "ready"})
        try:
            go = conn.recv()
        except EOFError:
            return
        if not isinstance(go, dict):
            return
        cfg = {**cfg, **go}
    opt = CollaborativeOptimizer(
        adam, prefix=cfg.get("prefix", "train-demo"),
        target_batch_size=cfg["target_batch_size"], batch_size=cfg["batch_size"], model=model,
        initial_peers=cfg.get("initial_peers", []), matchmaking_time=cfg.get("matchmaking_time", 1.0),
        target_group_size=cfg.get("target_group_size", 64), averager_opts=cfg.get("averager_opts"),
    )
    try:
        conn.send({"event": "up", "endpoint": opt.endpoint, "peer_id": opt.peer_id, "epoch": opt.local_epoch})
        if cfg.get("wait_for_start") and conn.recv() != "start":  # so that the first peers begin together
            return
        last = -1
        clock = opt.clock  # the training loop waits only through the optimizer's clock (as in `python -m sim train`)
        deadline = clock.now() + cfg.get("time_limit", 120.0)
        while (opt.local_epoch < cfg["epochs"] or not opt.in_sync) and clock.now() < deadline:
            x, y = task.sample(gen, cfg["batch_size"])
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if cfg.get("step_delay"):
                clock.sleep(cfg["step_delay"])
            if opt.local_epoch != last:
                last = opt.local_epoch
                hl, acc = evaluate(model, hx, hy)
                conn.send({"event": "epoch", "epoch": last, "loss": hl, "acc": acc, "peers": opt.num_peers,
                           "samples": opt.last_round.get("samples"), "group": opt.last_round.get("group_size"),
                           "ok": opt.last_round.get("ok")})
        clock.sleep(0.3)  # let the last records spread, then make sure this peer holds the swarm's model
        opt.synchronize()
        hl, acc = evaluate(model, hx, hy)
        conn.send({"event": "done", "epoch": opt.local_epoch, "loss": hl, "acc": acc, "digest": param_digest(model),
                   "params": [p.detach().numpy().copy() for p in model.parameters()],
                   "nonfinite": opt.nonfinite_batches})
        conn.poll(cfg.get("linger", 60.0))  # keep serving state until the parent says stop
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        opt.shutdown()


def single_process_reference(cfg: dict) -> tuple[float, float]:
    """The same model trained in one process with batches of the global batch size, same epochs."""
    import torch

    task = Task()
    hx, hy = task.heldout()
    model = make_model(cfg.get("model_seed", 0))
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    gen = task.stream(cfg.get("data_seed", 0), 10_000)
    for _ in range(cfg["epochs"]):
        x, y = task.sample(gen, cfg["target_batch_size"])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return evaluate(model, hx, hy)


# ---------------------------------------------------------------------------- CLI
def _late_at(text: str) -> int:
    v = int(text) if text.strip().lstrip("-").isdigit() else None
    if v is None or v < -1:
        raise argparse.ArgumentTypeError(f"must be an epoch >= 0, or -1 for no late joiner, got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=positive_int, default=3, help="peers that start together (default 3)")
    p.add_argument("--late-at", type=_late_at, default=5, help="epoch at which one more peer joins (default 5; -1: none)")
    p.add_argument("--epochs", type=positive_int, default=25, help="global steps to train (default 25)")
    p.add_argument("--target-batch-size", type=positive_int, default=512, help="samples per global step (default 512)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="samples per local batch (default 32)")
    p.add_argument("--lr", type=positive_float, default=0.01, help="Adam learning rate (default 0.01)")
    p.add_argument("--step-delay", type=nonnegative_float, default=0.01,
                   help="seconds each local step sleeps, standing in for a bigger model (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    p.add_argument("--log-level", type=log_level, default="WARNING", help="logging level of the peer processes (DEBUG, INFO, WARNING, ...; default WARNING)")


class _Peers:
    """Spawned peer processes with pipes; `close` stops and, if needed, kills every one."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []

    def start(self, index: int, cfg: dict) -> int:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=train_peer, args=(index, child, cfg), daemon=True)
        start_child(p)  # a Ctrl-C at the terminal reaches only this process, which stops the peers
        child.close()
        self.procs.append(p)
        self.conns.append(parent)
        return len(self.procs) - 1

    def recv(self, k: int, timeout: float) -> dict:
        try:
            if not self.conns[k].poll(timeout):
                raise TimeoutError(f"peer {k} said nothing for {timeout}s")
            return self.conns[k].recv()
        except (EOFError, OSError):
            p = self.procs[k]
            p.join(1.0)
            raise RuntimeError(f"peer process {k} exited (exit code {p.exitcode}); its error is printed above") from None

    def close(self, timeout: float = 10.0) -> None:
        stop_children(self.conns, self.procs, "stop", timeout)


def run(args: argparse.Namespace) -> int:
    late_at = args.late_at if 0 <= args.late_at < args.epochs else -1
    n = args.peers + (1 if late_at >= 0 else 0)
    cfg = dict(epochs=args.epochs, target_batch_size=args.target_batch_size, batch_size=args.batch_size, lr=args.lr,
               data_seed=args.seed, step_delay=args.step_delay, log_level=args.log_level, target_group_size=max(2, n),
               matchmaking_time=1.0, averager_opts=dict(gossip_interval=0.05, peer_timeout=3.0), time_limit=240.0,
               linger=60.0, wait_for_go=True)
    print(f"zgossip train-demo: {args.peers} local peer processes train a 16-64-4 MLP on a synthetic "
          f"4-class task (nothing is downloaded); global batch {args.target_batch_size} from local batches of "
          f"{args.batch_size}; {args.epochs} epochs"
          + (f"; one more peer joins at epoch {late_at}" if late_at >= 0 else ""))
    peers = _Peers()
    late: int | None = None
    try:
        for i in range(n):
            peers.start(i, dict(cfg, wait_for_start=i < args.peers))
        for k in range(n):
            peers.recv(k, 120)  # "ready": imports done
        peers.conns[0].send({})
        first = peers.recv(0, 60)
        for k in range(1, args.peers):
            peers.conns[k].send({"initial_peers": [first["endpoint"]]})
        for k in range(1, args.peers):
            peers.recv(k, 60)
        for k in range(args.peers):
            peers.conns[k].send("start")
        print(f"{args.peers} peers up (first at {first['endpoint']}); peer 0 reports:\n")
        print(f"{'epoch':>5} {'held-out loss':>13} {'accuracy':>8} {'peers':>5} {'samples':>7} {'group':>5}")
        done: dict[int, dict] = {}
        t0 = time.monotonic()
        while len(done) < n:
            for k in range(n):
                while k not in done and (k < args.peers or late is not None) and peers.conns[k].poll(0):
                    msg = peers.recv(k, 1)
                    if msg["event"] == "epoch" and k == 0:
                        samples = "-" if msg["samples"] is None else f"{msg['samples']:.0f}"
                        group = "-" if msg["group"] is None else str(msg["group"])
                        print(f"{msg['epoch']:>5} {msg['loss']:>13.4f} {msg['acc']:>8.3f} {msg['peers']:>5} "
                              f"{samples:>7} {group:>5}")
                        if late is None and 0 <= late_at <= msg["epoch"]:
                            # told now; its "up" (after joining and downloading the state) is read below, so
                            # its line lands at the epoch the swarm had reached by then, not here
                            late = n - 1
                            peers.conns[late].send({"initial_peers": [first["endpoint"]]})
                            print(f"      -> peer {late} starts joining (it downloads the swarm's state first)")
                    elif msg["event"] == "up" and k == late:
                        print(f"      -> peer {late} joined late, downloaded the swarm's state from its peers and "
                              f"continues at epoch {msg['epoch']}")
                    elif msg["event"] == "done":
                        done[k] = msg
            if time.monotonic() - t0 > 300:
                print("train-demo: gave up after 300 s")
                return 1
            time.sleep(0.005)
        ref_loss, ref_acc = single_process_reference(cfg)
        print()
        for k in sorted(done):
            d = done[k]
            tag = " (joined late)" if k == late else ""
            print(f"peer {k}{tag}: epoch {d['epoch']}, held-out loss {d['loss']:.4f}, accuracy {d['acc']:.3f}, "
                  f"parameters {d['digest']}")
        same = len({d["digest"] for d in done.values()}) == 1
        print(f"one process with batches of {args.target_batch_size}, same number of epochs: held-out loss "
              f"{ref_loss:.4f}, accuracy {ref_acc:.3f}")
        print("all peers hold identical parameters" if same else "the peers' parameters differ")
        return 0 if same else 1
    except KeyboardInterrupt:
        peers.close(timeout=1.0)  # Ctrl-C: training peers read "stop" only after their run, don't wait for it
        raise
    except (RuntimeError, TimeoutError) as e:
        print(f"zgossip train-demo: error: {e}", file=sys.stderr)
        return 1
    finally:
        peers.close()
