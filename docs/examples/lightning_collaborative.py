"""Collaborative training with Lightning and zgossip: run it on several machines (or terminals).

    python docs/examples/lightning_collaborative.py                       # the first peer prints its address
    PL_INITIAL_PEERS=tcp://10.0.0.5:41000 python docs/examples/lightning_collaborative.py   # every other peer

Each peer trains the same small classifier on its own stream of a synthetic task; together
they take one optimizer step per --target-batch-size samples. A peer that joins later
downloads the model, optimizer and scheduler state and the epoch from the others first.
``--out FILE`` writes, per global step (epoch) this peer saw, a digest of its parameters:
peers in sync hold identical digests at the same epoch (tests/real/test_lightning.py uses it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    import pytorch_lightning as pl

from zgossip.lightning import strategy_for
from zgossip.trainer import params_digest


class Classifier(pl.LightningModule):
    def __init__(self, dim: int = 16, hidden: int = 32, classes: int = 4, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)  # every peer starts from the same weights (else they resynchronise first)
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def synthetic_data(seed: int, n: int, dim: int = 16, classes: int = 4) -> torch.utils.data.TensorDataset:
    teacher = torch.randn(dim, classes, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(x, (x @ teacher).argmax(dim=1))


class Progress(pl.Callback):
    """Stop after the swarm's global step `epochs`; record a parameter digest at every global step (written to
    `out` as it goes); with `min_peers`, hold training while fewer peers than that train this run."""

    def __init__(self, strategy, epochs: int, out: str | None, min_peers: int) -> None:
        self.strategy, self.epochs, self.out, self.min_peers = strategy, epochs, out, min_peers
        self.digests: dict[int, str] = {}
        self.peers = 1

    def summary(self, trainer) -> dict:
        opt = self.strategy.zgossip_optimizer
        return {"endpoint": opt.endpoint, "epoch": opt.local_epoch, "digests": self.digests,
                "local_batches": trainer.global_step, "in_sync": opt.in_sync, "num_peers": self.peers,
                "last_round": opt.last_round}

    def write(self, trainer) -> None:
        if self.out:
            with open(self.out + ".tmp", "w") as f:
                json.dump(self.summary(trainer), f, default=str)
            os.replace(self.out + ".tmp", self.out)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        opt = self.strategy.zgossip_optimizer
        if batch_idx == 0:
            self.write(trainer)  # the address others join, as soon as it is known
        if opt.pending_update is None and opt.local_epoch not in self.digests:
            # the model holds the parameters of this global step: in-sync peers hold the same
            self.digests[opt.local_epoch] = params_digest(list(module.parameters()), opt.local_epoch)
            self.peers = opt.num_peers
            self.write(trainer)
        if opt.local_epoch >= self.epochs:
            trainer.should_stop = True
            return  # (before the hold: the peers that reached the end with us may be gone already)
        if self.min_peers > 1:
            deadline = time.monotonic() + 60
            while opt.num_peers < self.min_peers:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fewer than {self.min_peers} peers for 60 s")
                time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=20, help="stop after this many global steps")
    # a global step should last several gossip intervals (docs/lightning.md): this toy model computes
    # ~5,000 samples/s per peer, so 4096 samples take ~0.4 s with two peers
    p.add_argument("--target-batch-size", type=int, default=4096, help="the same on every peer")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="this peer's data stream")
    p.add_argument("--listen", default="tcp://0.0.0.0:0")
    p.add_argument("--initial-peers", default=None, help="comma-separated (or set PL_INITIAL_PEERS)")
    p.add_argument("--matchmaking-time", type=float, default=1.0)
    p.add_argument("--target-group-size", type=int, default=16)
    p.add_argument("--delay", action="store_true", help="delay_optimizer_step + delay_grad_averaging")
    p.add_argument("--compression", default=None, help="how gradients travel: fp16, bf16, int8 (default: raw)")
    p.add_argument("--fast", action="store_true", help="gossip often (a loopback test)")
    p.add_argument("--min-peers", type=int, default=1, help="hold training while fewer peers than this train")
    p.add_argument("--out", default=None, help="write a JSON summary here (updated at every global step)")
    args = p.parse_args(argv)

    strategy = strategy_for(pl.__name__)(
        target_batch_size=args.target_batch_size, run_id="lightning-example", batch_size=args.batch_size,
        initial_peers=args.initial_peers, listen=args.listen, matchmaking_time=args.matchmaking_time,
        averaging_timeout=30.0, target_group_size=args.target_group_size,
        delay_optimizer_step=args.delay or None, delay_grad_averaging=args.delay, compression=args.compression,
        averager_opts=dict(gossip_interval=0.05, peer_timeout=3.0, request_timeout=0.3) if args.fast else None)
    progress = Progress(strategy, args.epochs, args.out, args.min_peers)
    data = torch.utils.data.DataLoader(synthetic_data(args.seed, 100_000), batch_size=args.batch_size)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=1, callbacks=[progress], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(), data)
    progress.write(trainer)
    opt = strategy.zgossip_optimizer
    print(f"done: global step (epoch) {opt.local_epoch}, {trainer.global_step} local batches", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
