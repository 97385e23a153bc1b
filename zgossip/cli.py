"""The ``zgossip`` command: ``demo``, ``peer``, ``bench``, ``train-demo``, ``bench-train`` and ``bench-state``."""
from __future__ import annotations

import argparse
import logging
import sys

from .cliargs import log_level  # the type of every --log-level (kept importable from here)

__all__ = ["main", "log_level"]


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C: the command's finally blocks stopped its peer processes; no traceback, the shell's
        # exit status for SIGINT (128 + 2). Also while the commands' modules load (numpy, torch:
        # a second or more), which used to end in a KeyboardInterrupt traceback.
        print(file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="zgossip", description="Decentralized tensor averaging over ZeroMQ.")
    parser.add_argument("--version", action="version", version=_version(),
                        help="print zgossip's version and those of what it runs on (Python, pyzmq, libzmq), then exit")
    sub = parser.add_subparsers(dest="command", required=True)

    from . import bench, bench_state, bench_train, demo, peer, train_demo

    demo.add_arguments(sub.add_parser("demo", help="8 local peers average random tensors on a Moshpit grid"))
    peer.add_arguments(sub.add_parser("peer", help="run one peer for real (multi-host) use"))
    bench.add_arguments(sub.add_parser("bench", help="time the all-reduce, optionally against torch.distributed gloo"))
    train_demo.add_arguments(sub.add_parser("train-demo", help="local peers train one model together; one joins late"))
    bench_train.add_arguments(sub.add_parser("bench-train", help="one collaborative step (4 peers, 10M params) vs gloo"))
    bench_state.add_arguments(sub.add_parser("bench-state", help="state download from N donors vs 1 (1 GiB, loopback)"))
    kg = sub.add_parser("keygen", help="write a CURVE key pair: FILE (secret, mode 600) and FILE.pub (allow-file line)")
    kg.add_argument("file", help="where to write the secret key (FILE.pub gets the public key)")
    kg.add_argument("--force", action="store_true", help="overwrite an existing key file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return {"demo": demo.run, "peer": peer.run, "bench": bench.run, "train-demo": train_demo.run,
            "bench-train": bench_train.run, "bench-state": bench_state.run, "keygen": _keygen}[args.command](args)


def _version() -> str:
    """One line for bug reports: zgossip's version, and the Python, pyzmq and libzmq it runs on."""
    import platform

    import zmq

    from . import __version__

    return (f"zgossip {__version__} (Python {platform.python_version()}, pyzmq {zmq.pyzmq_version()}, "
            f"libzmq {zmq.zmq_version()})")


def _keygen(args: argparse.Namespace) -> int:
    from .identity import write_key_file

    try:
        kp = write_key_file(args.file, overwrite=args.force)
    except (ValueError, OSError) as e:
        print(f"zgossip keygen: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.file} (secret, mode 600) and {args.file}.pub")
    print(f"public key: {kp.public}")
    print(f"peer id:    {kp.peer_id}")
    print(f"add the public key (the line in {args.file}.pub, optionally followed by this peer's tcp://HOST:PORT) "
          "to every peer's allow file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
