"""``zgossip peer``: run one peer for real, multi-host use.

Start the first peer anywhere, then point others at it (or at any running peer):

    zgossip peer --listen tcp://0.0.0.0:41000
    zgossip peer --listen tcp://0.0.0.0:41000 --initial-peers tcp://HOST:41000

Each peer averages a random tensor every ``--interval`` seconds and prints one line
per step. Stop it with Ctrl-C.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

import numpy as np

from .averager import Averager
from .errors import ZGossipError
from .endpoints import check_endpoint

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="tcp://0.0.0.0:0", help="endpoint to bind (port 0 = ephemeral)")
    p.add_argument("--initial-peers", nargs="*", default=[], help="endpoints of any running peers")
    p.add_argument("--announce-host", default=None, help="host name/IP others should use to reach this peer")
    p.add_argument("--prefix", default="zgossip-peer")
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--target-group-size", type=int, default=16)
    p.add_argument("--min-group-size", type=int, default=2)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between steps")
    p.add_argument("--rounds", type=int, default=0, help="stop after this many steps (0 = run until Ctrl-C)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tcp-only", action="store_true",
                   help="reach peers on this host over TCP too (by default through their local Unix sockets)")
    p.add_argument("--key", default=None, metavar="FILE",
                   help="this peer's key file (zgossip keygen FILE): authenticated, encrypted peers (needs --allow)")
    p.add_argument("--allow", default=None, metavar="FILE",
                   help="allow file: one public key per line, optionally followed by tcp://HOST:PORT")
    p.add_argument("--client", action="store_true",
                   help="client mode: listen nowhere (behind NAT/firewall); peers answer over our connections")
    p.add_argument("--auxiliary", action="store_true", help="bring no data, lend bandwidth to reduce for others")
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    try:  # a malformed address is the user's typo: one line and exit status 2, like argparse
        check_endpoint(args.listen, "--listen address", listen=True)
        for ep in args.initial_peers:
            check_endpoint(ep.partition("#")[0], "--initial-peers address")
        if (args.key is None) != (args.allow is None):
            raise ValueError("--key and --allow go together")
    except ValueError as e:
        print(f"zgossip peer: error: {e}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    data = rng.standard_normal(args.numel).astype(np.float32)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        avg = Averager([data], prefix=args.prefix, listen=None if args.client else args.listen,
                       initial_peers=args.initial_peers, announce_host=args.announce_host,
                       target_group_size=args.target_group_size, min_group_size=args.min_group_size, seed=args.seed,
                       local_ipc=not args.tcp_only, secret_key=args.key, allowed_keys=args.allow,
                       auxiliary=args.auxiliary)
    except ValueError as e:
        print(f"zgossip peer: error: {e}", file=sys.stderr)
        return 2
    with avg:
        print(f"peer {avg.peer_id} listening; others can join with:\n"
              f"  zgossip peer --initial-peers {avg.endpoint}", flush=True)
        done = 0
        while not stop.is_set() and (args.rounds == 0 or done < args.rounds):
            t0 = time.perf_counter()
            try:
                res = avg.step(timeout=max(5.0, args.interval))
                print(f"step {done}: group of {len(res.members)}, {len(res.contributors)} contributed, "
                      f"{res.timings['total']:.3f}s, mean {float(data.mean()):+.6f}, live peers {len(avg.peers())}",
                      flush=True)
            except ZGossipError as e:
                print(f"step {done}: {type(e).__name__}: {e}", flush=True)
            done += 1
            stop.wait(max(0.0, args.interval - (time.perf_counter() - t0)))
    return 0
