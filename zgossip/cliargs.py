"""Argument types for the ``zgossip`` commands: a bad number is refused by argparse in one line
(``error: argument --timeout: ...``, exit status 2) before anything starts, instead of surfacing
later as a traceback from a child process, or running with a value that means nothing."""
from __future__ import annotations

import argparse
import logging
import math

__all__ = ["positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "log_level"]


def _int(text: str, low: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number {what}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be a whole number {what}, got {text!r}")
    return v


def _float(text: str, positive: bool) -> float:
    what = "> 0" if positive else ">= 0"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number {what}, got {text!r}") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise argparse.ArgumentTypeError(f"must be a finite number {what}, got {text!r}")
    return v


def positive_int(text: str) -> int:
    return _int(text, 1, ">= 1")


def nonnegative_int(text: str) -> int:
    return _int(text, 0, ">= 0")


def positive_float(text: str) -> float:
    return _float(text, True)


def nonnegative_float(text: str) -> float:
    return _float(text, False)


def log_level(text: str) -> str:
    """The argparse type of every ``--log-level``: a logging level name in any case, upper-cased
    (``debug`` used to end in a traceback from `logging.basicConfig`, as did a typo)."""
    name = str(text).strip().upper()
    if not isinstance(logging.getLevelName(name), int):
        raise argparse.ArgumentTypeError(f"{text!r} is no logging level (DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    return name
