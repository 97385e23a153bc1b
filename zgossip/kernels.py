"""The all-reduce's arithmetic on parts: checked weighted means and checked copies.

Two implementations with identical results: the C extension `zgossip._kernels` (built by
``pip install`` when a C compiler is present; it checks and sums each block while it is in
L1, so every byte is read from memory once) and numpy (always there). Which one runs is
`NATIVE`; ``ZGOSSIP_NATIVE=0`` forces numpy. Both sum terms in the order given, each
operation rounded to the element type, so the bits do not depend on the path: peers with
and without the extension produce the same averages, and a simulation gives the same trace.

Nothing here knows about peers or messages: the protocol (`allreduce`) calls these.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

__all__ = ["NATIVE", "BLOCK", "OVERFLOW", "all_finite", "weighted_mean", "copy_finite"]

try:  # pragma: no cover - depends on the build
    from . import _kernels as _native
except ImportError:  # no compiler at install time: numpy does the same work, slower
    _native = None
if os.environ.get("ZGOSSIP_NATIVE", "1") == "0":
    _native = None

#: True when the C kernels are in use.
NATIVE = _native is not None
#: Granularity of `copy_finite`: it copies whole blocks of this many elements.
BLOCK = 1024
#: `weighted_mean` result: every term was finite, but their mean is not (it overflowed).
OVERFLOW = -2

_FAST = (np.dtype(np.float32), np.dtype(np.float64))


def _fast(*arrays: np.ndarray) -> bool:
    return _native is not None and all(a.dtype in _FAST and a.flags.c_contiguous for a in arrays)


def _numpy_finite(arr: np.ndarray) -> bool:
    if arr.dtype.kind != "f":
        return True
    # the dot product reads the array once and writes nothing, where isfinite().all() writes a bool
    # array and reads it again; it is non-finite whenever an element is, and a finite array whose
    # squares overflow falls through to the exact check
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.dot(arr, arr)):
            return True
    return bool(np.isfinite(arr).all())


def all_finite(arr: np.ndarray) -> bool:
    """No NaN or inf in the 1-D array `arr` (integer arrays always pass)."""
    if _fast(arr):
        return bool(_native.all_finite(arr, arr.itemsize))
    return _numpy_finite(arr)


def weighted_mean(out: np.ndarray, terms: Sequence[np.ndarray], weights: Sequence[float]) -> int:
    """``out = (w0*t0 + w1*t1 + ...) / (w0 + w1 + ...)`` for float arrays, summed in the order given.

    Returns -1 on success; the index of the first term, in order, holding a NaN or inf anywhere;
    or `OVERFLOW` when the terms are finite but the mean is not. In the last two cases `out`
    holds scratch. The weight sum is accumulated in Python floats in order.
    """
    wsum = 0.0
    for w in weights:
        wsum += float(w)
    if _fast(out, *terms) and len(terms) <= 256 and all(t.dtype == out.dtype for t in terms):
        return _native.weighted_mean(out, terms, [float(w) for w in weights], wsum, out.itemsize)
    for i, t in enumerate(terms):
        if not _numpy_finite(t):
            return i
    one = out.dtype.type
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # overflow is reported below
        for i, (t, w) in enumerate(zip(terms, weights)):
            if i == 0:
                np.multiply(t, one(w), out=out)
            elif float(w) == 1.0:
                np.add(out, t, out=out)
            else:
                out += t * one(w)
        np.divide(out, one(wsum), out=out)
    return -1 if _numpy_finite(out) else OVERFLOW


def copy_finite(dst: np.ndarray, src: np.ndarray) -> int:
    """Copy `src` into `dst` block by block, stopping before the first block of `BLOCK` elements
    that holds a NaN or inf. Returns how many leading elements were copied (all of them when
    `src` is finite): the rest of `dst` is untouched."""
    if dst.shape != src.shape:
        raise ValueError("dst and src differ in shape")
    if _fast(dst, src) and dst.dtype == src.dtype:
        return _native.copy_finite(dst, src, dst.itemsize)
    if _numpy_finite(src):
        dst[...] = src
        return src.size
    bad = int(np.flatnonzero(~np.isfinite(src))[0])
    good = bad - bad % BLOCK
    dst[:good] = src[:good]
    return good
