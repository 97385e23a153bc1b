"""``zgossip demo``: 8 local peer processes average random tensors on a 4x2 Moshpit grid.

Round 0 averages along the first axis (two groups of 4), round 1 along the second
(four groups of 2, each holding one peer of each earlier group): after those two
rounds every peer holds the exact global mean, and later rounds keep it there.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from .cliargs import log_level
from .swarm import LocalSwarm

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=8, help="number of local peer processes (default 8)")
    p.add_argument("--grid", default=None, help="Moshpit grid shape, e.g. 4x2; its product must equal --peers "
                                              "(default: the most even AxB that does, 4x2 for 8 peers; N for a prime N)")
    p.add_argument("--rounds", type=int, default=3, help="averaging rounds to run (default 3)")
    p.add_argument("--numel", type=int, default=1 << 20, help="float32 elements per peer (default 1M = 4 MiB)")
    p.add_argument("--seed", type=int, default=0, help="seed of the peers' random tensors (default 0)")
    p.add_argument("--log-level", type=log_level, default="WARNING", help="logging level of the peer processes (DEBUG, INFO, WARNING, ...; default WARNING)")


def _fmt_groups(sizes: list[int]) -> str:
    return "+".join(str(s) for s in sorted(sizes, reverse=True)) or "none"


def _grid_shape(args: argparse.Namespace) -> tuple[int, ...]:
    """The grid of `--grid`, once every size given is checked; a ValueError names the flag otherwise."""
    if args.peers < 2:
        raise ValueError(f"--peers must be at least 2 (the demo averages in groups of 2 or more), not {args.peers}")
    if args.numel < 1:
        raise ValueError(f"--numel must be at least 1, not {args.numel}")
    if args.rounds < 0:
        raise ValueError(f"--rounds must be >= 0, not {args.rounds}")
    if args.grid is None:  # --peers alone: a grid that fits it (the default once fitted only 8 peers)
        side = max(d for d in range(1, math.isqrt(args.peers) + 1) if args.peers % d == 0)
        return (args.peers // side, side) if side > 1 else (args.peers,)
    try:
        shape = tuple(int(x) for x in args.grid.lower().split("x"))
    except ValueError:
        raise ValueError(f"--grid takes sizes separated by x, such as 4x2, not {args.grid!r}") from None
    if min(shape) < 1:
        raise ValueError(f"--grid sizes must be at least 1, not {args.grid!r}")
    if 1 in shape:
        rest = "x".join(str(m) for m in shape if m != 1)
        raise ValueError(f"--grid {args.grid} has a dimension of size 1: every peer is alone along it, so every "
                         f"round along it fails; leave it out (--grid {rest})")
    if int(np.prod(shape)) != args.peers:
        raise ValueError(f"--grid {args.grid} has {int(np.prod(shape))} cells but --peers is {args.peers}")
    return shape


def run(args: argparse.Namespace) -> int:
    try:  # a bad size is the user's typo: one line and exit status 2, like argparse
        shape = _grid_shape(args)
    except ValueError as e:
        print(f"zgossip demo: error: {e}", file=sys.stderr)
        return 2
    coords = list(np.ndindex(*shape))
    per_peer = [{"grid_coords": c} for c in coords]
    kw = dict(prefix="demo", grid=shape, target_group_size=max(shape), min_group_size=2,
              gossip_interval=0.1, matchmaking_time=1.0, part_size_bytes=1 << 20)
    print(f"zgossip demo: {args.peers} peer processes listening on tcp loopback, grid {'x'.join(map(str, shape))}, "
          f"{args.numel:,} float32 each ({args.numel * 4 / 2**20:.1f} MiB)")
    t0 = time.perf_counter()
    with LocalSwarm(args.peers, args.numel, seed=args.seed, averager_kwargs=kw, per_peer_kwargs=per_peer) as swarm:
        swarm.wait_membership()
        print(f"peers up and know each other after {time.perf_counter() - t0:.1f}s; endpoints "
              f"{swarm.endpoints[0]} ... {swarm.endpoints[-1]}")
        truth = swarm.truth()
        dist0 = max(float(np.abs(swarm.call(i, "tensor")["tensor"] - truth).max()) for i in range(args.peers))
        print()
        print(f"{'round':>5} {'axis':>4} {'group sizes':>12} {'max |x - mean|':>15} {'step s':>8} {'MB/s':>8}  ok")
        print(f"{'-':>5} {'':>4} {'':>12} {dist0:>15.3e} {'':>8} {'':>8}")
        failures = 0
        for r in range(args.rounds):
            res = swarm.step_all(timeout=30)
            ok = [x for x in res if x.get("ok")]
            failures += len(res) - len(ok)
            groups = {x["group_id"]: x["group_size"] for x in ok}
            wall = max((x["timings"]["wall"] for x in ok), default=float("nan"))
            sent = sum(x["bytes_sent"] for x in ok)
            dist = max(float(np.abs(swarm.call(i, "tensor")["tensor"] - truth).max()) for i in range(args.peers))
            print(f"{r:>5} {r % len(shape):>4} {_fmt_groups(list(groups.values())):>12} {dist:>15.3e} "
                  f"{wall:>8.3f} {sent / wall / 1e6:>8.0f}  {len(ok)}/{len(res)}")
            for x in res:
                if not x.get("ok"):
                    print(f"      a peer failed: {x.get('type')}: {x.get('error')}")
        stats = [swarm.call(i, "stats")["stats"] for i in range(args.peers)]
    local, total = sum(s["local_connections"] for s in stats), sum(s["connections"] for s in stats)
    print()
    print(f"{local} of the {total} connections the peers opened went through local Unix sockets, "
          f"{total - local} over TCP (peers on one host find each other's sockets; ZGOSSIP_LOCAL_IPC=0 keeps TCP).")
    print("max |x - mean| is over all peers and elements; MB/s counts every byte of tensor data sent by all peers.")
    return 1 if failures else 0
