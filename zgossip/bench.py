"""``zgossip bench`` (placeholder: being written)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=4)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("zgossip bench is not written yet")
