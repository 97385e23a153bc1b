"""``zgossip peer``: run one peer for real, multi-host use.

Start the first peer anywhere, then point others at it (or at any running peer):

    zgossip peer --listen tcp://0.0.0.0:41000
    zgossip peer --listen tcp://0.0.0.0:41000 --initial-peers tcp://HOST:41000

Each peer averages a random tensor every ``--interval`` seconds. On a terminal with `rich`
installed it keeps a live table on screen (peers it knows alive, steps, throughput; see
`zgossip.live`), else it prints one line per step. ``--metrics-port`` serves Prometheus
metrics, ``--log-json FILE`` appends one JSON object per step. Stop it with Ctrl-C (or SIGTERM,
or SIGHUP: the same clean stop).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import zmq

from .averager import MAX_STEP_TIMEOUT, Averager
from .cliargs import log_level
from .errors import ZGossipError
from .endpoints import check_endpoint, listens
from .live import PlainLines, make_display
from .metrics import JsonLinesLog

__all__ = ["add_arguments", "run"]

#: the signals that stop a running peer cleanly (SIGHUP: not on Windows)
_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="tcp://0.0.0.0:0", help="endpoint to bind (default tcp://0.0.0.0:0: every interface, an ephemeral port)")
    p.add_argument("--initial-peers", nargs="*", default=[], help="endpoints of any running peers")
    p.add_argument("--announce-host", default=None, help="host name/IP others should use to reach this peer")
    p.add_argument("--prefix", default="zgossip-peer",
                   help="peers with the same prefix average together (default zgossip-peer)")
    p.add_argument("--numel", type=int, default=1 << 20,
                   help="float32 elements of the random tensor this peer averages (default 1M = 4 MiB)")
    p.add_argument("--target-group-size", type=int, default=16, help="largest group to average in (default 16)")
    p.add_argument("--min-group-size", type=int, default=2,
                   help="smallest group worth averaging in; fewer peers and the step fails (default 2)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds from the start of one step to the start of the next (default 5)")
    p.add_argument("--rounds", type=int, default=0, help="stop after this many steps (0 = run until Ctrl-C)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the tensor and the peer id, a whole number >= 0 (default: random; two peers must "
                        "not share one)")
    p.add_argument("--tcp-only", action="store_true",
                   help="reach peers on this host over TCP too (by default through their local Unix sockets)")
    p.add_argument("--key", default=None, metavar="FILE",
                   help="this peer's key file (zgossip keygen FILE): authenticated, encrypted peers (needs --allow)")
    p.add_argument("--allow", default=None, metavar="FILE",
                   help="allow file: one public key per line, optionally followed by tcp://HOST:PORT")
    p.add_argument("--client", action="store_true",
                   help="client mode: listen nowhere (behind NAT/firewall); peers answer over our connections")
    p.add_argument("--auxiliary", action="store_true", help="bring no data, lend bandwidth to reduce for others")
    p.add_argument("--bandwidth", type=_bandwidth, default="auto", metavar="MBIT|auto",
                   help="this peer's link rate in Mbit/s, or auto (default): measured from its transfers and gossiped")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0 = a free port)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics endpoint binds (default 127.0.0.1; 0.0.0.0 lets other hosts scrape)")
    p.add_argument("--log-json", default=None, metavar="FILE",
                   help="append one JSON object per step to FILE (group, members, contributors, lost, left out, bytes, "
                        "timings, error)")
    p.add_argument("--plain", action="store_true",
                   help="one line per step instead of the live table (the default when stdout is no terminal "
                        "or rich is not installed)")
    p.add_argument("--log-level", type=log_level, default="INFO", help="logging level (DEBUG, INFO, WARNING, ...; default INFO)")


def _bandwidth(v: str) -> float | str:
    if v == "auto":
        return v
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bandwidth takes a rate in Mbit/s or 'auto', not {v!r}") from None
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError("--bandwidth must be finite and >= 0")
    return x


def _use_console_for_logs(console: Any) -> None:
    """Log lines go above the live table, not through it."""
    from rich.logging import RichHandler

    root = logging.getLogger()
    level = root.level
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(RichHandler(console=console, show_path=False, level=level))


def run(args: argparse.Namespace) -> int:
    try:  # a malformed address is the user's typo: one line and exit status 2, like argparse
        check_endpoint(args.listen, "--listen address", listen=True)
        for ep in args.initial_peers:
            check_endpoint(ep.partition("#")[0], "--initial-peers address")
        if (args.key is None) != (args.allow is None):
            raise ValueError("--key and --allow go together")
        if args.client and not args.initial_peers:
            raise ValueError("--client needs --initial-peers: a client listens nowhere, so it only ever meets the "
                             "peers it is told of")
        if args.numel < 1:
            raise ValueError(f"--numel must be at least 1, not {args.numel}")
        if args.seed is not None and args.seed < 0:  # numpy's generator took it for a traceback
            raise ValueError(f"--seed must be a whole number >= 0, not {args.seed}")
        if args.rounds < 0:
            raise ValueError(f"--rounds must be >= 0 (0 = run until Ctrl-C), not {args.rounds}")
        if not 0 <= args.interval <= MAX_STEP_TIMEOUT:  # a longer one failed every step with a traceback
            raise ValueError(f"--interval must be a number of seconds in [0, {MAX_STEP_TIMEOUT:g}], "
                             f"not {args.interval}")
        if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 0..65535 (0 = a free port), not {args.metrics_port}")
    except ValueError as e:
        print(f"zgossip peer: error: {e}", file=sys.stderr)
        return 2
    try:
        rng = np.random.default_rng(args.seed)
        data = rng.standard_normal(args.numel).astype(np.float32)
    except MemoryError:
        print(f"zgossip peer: error: --numel {args.numel} is more than this host's memory holds "
              f"({args.numel * 4 / 2**30:.3g} GiB of float32); give a smaller --numel", file=sys.stderr)
        return 2
    stop = threading.Event()
    # Ctrl-C, SIGTERM and SIGHUP (the terminal or ssh session closed) set the stop flag while the
    # peer runs, so it shuts down as it does on Ctrl-C (SIGHUP's default killed it mid-step, owing
    # its groupmates their results); the handlers that were there come back when it returns (run
    # in-process -- `cli.main` from a test or a notebook -- an early error left this process's
    # Ctrl-C setting a flag nobody reads)
    prev = [(sig, signal.signal(sig, lambda *_: stop.set())) for sig in _STOP_SIGNALS]
    try:
        return _serve(args, data, stop)
    finally:
        for sig, handler in prev:
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace, data: np.ndarray, stop: threading.Event) -> int:
    log_json = None
    if args.log_json:  # opened before the peer starts: a path it cannot write is refused in one line
        try:
            log_json = JsonLinesLog(args.log_json)
        except OSError as e:
            print(f"zgossip peer: error: cannot open --log-json file {args.log_json}: {e.strerror or e}",
                  file=sys.stderr)
            return 2
    try:
        avg = Averager([data], prefix=args.prefix, listen=None if args.client else args.listen,
                       initial_peers=args.initial_peers, announce_host=args.announce_host,
                       target_group_size=args.target_group_size, min_group_size=args.min_group_size, seed=args.seed,
                       local_ipc=not args.tcp_only, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                       secret_key=args.key, allowed_keys=args.allow, auxiliary=args.auxiliary,
                       bandwidth=args.bandwidth)
    except (OSError, ValueError, zmq.ZMQError) as e:  # e.g. the metrics port is taken, the listen address in use
        print(f"zgossip peer: error: {e}", file=sys.stderr)
        if log_json is not None:
            log_json.close()
        return 2
    # the log closes after the shutdown (leaving `with avg`): a step that Ctrl-C interrupts fails
    # there, with AveragerClosed, and its line used to be dropped by a log already closed
    try:
        with avg:
            if log_json is not None:
                log_json.extra = lambda: {"peer": avg.peer_id}
                avg.step_log.subscribe(log_json)
            # with keys the address carries our public key: `tcp://HOST:PORT#KEY`
            join = avg.endpoint if avg.public_key is None else f"'{avg.endpoint}#{avg.public_key}' --key FILE --allow FILE"
            if listens(avg.endpoint):
                info = [f"others can join with: zgossip peer --initial-peers {join}"]
                first = f"peer {avg.peer_id} listening; others can join with:\n  zgossip peer --initial-peers {join}"
                title = f"zgossip peer {avg.peer_id} (prefix {args.prefix!r}), listening at {avg.endpoint}"
            else:  # --client: a client:// endpoint is no address; nobody can join through this peer
                info = ["client mode: listens nowhere; it reaches the swarm through --initial-peers, and others cannot "
                        "join through it"]
                first = f"peer {avg.peer_id} in client mode (listens nowhere; others cannot join through it)"
                title = f"zgossip peer {avg.peer_id} (prefix {args.prefix!r}), client mode"
            if avg.metrics_endpoint:
                info.append(f"metrics: {avg.metrics_endpoint}")
            if args.log_json:
                info.append(f"step log: {args.log_json} (JSON lines)")
            display = make_display(title, info, plain=args.plain)
            if isinstance(display, PlainLines):
                print(first, flush=True)
                for line in info[1:]:
                    print(line, flush=True)
            else:
                _use_console_for_logs(display.console)
            with display:
                _loop(avg, args, data, stop, display)
    finally:
        if log_json is not None:
            log_json.close()
    return 0


def _live_peers(avg: Averager) -> int | None:
    try:
        return len(avg.peers())
    except ZGossipError:
        return None


def _step(avg: Averager, timeout: float) -> None:
    try:
        avg.step(timeout=timeout)
    except ZGossipError:
        pass  # recorded in the step log like a success (AveragerClosed: we are stopping)


def _loop(avg: Averager, args: argparse.Namespace, data: np.ndarray, stop: threading.Event, display: Any) -> None:
    done = 0
    while not stop.is_set() and (args.rounds == 0 or done < args.rounds):
        t0 = time.perf_counter()
        # the blocking (in-place) step runs on a thread of its own: Ctrl-C / SIGTERM only set `stop`,
        # and waiting in step() here would hold the peer for its matchmaking timeout (--interval, when
        # longer than 5 s) or, in an all-reduce a groupmate stalls, up to allreduce_timeout more
        worker = threading.Thread(target=_step, args=(avg, max(5.0, args.interval)), name="zgossip-peer-step",
                                  daemon=True)
        worker.start()
        while worker.is_alive() and not stop.is_set():
            worker.join(0.1)  # returns as the step ends; a stop is seen within 0.1 s
        if worker.is_alive():
            # stopping mid-step: leaving `with avg` shuts the averager down, which fails the step with
            # AveragerClosed (after delivering what it owes groupmates, at most shutdown_timeout)
            break
        rec = avg.step_log.recent(1)
        if rec:
            display.step(rec[0], _live_peers(avg), float(data.mean()))
        done += 1
        while not stop.is_set():  # redraw the peer count while waiting for the next step
            left = args.interval - (time.perf_counter() - t0)
            if left <= 0 or (args.rounds and done >= args.rounds):
                break
            stop.wait(min(1.0, left))
            display.refresh(_live_peers(avg))
