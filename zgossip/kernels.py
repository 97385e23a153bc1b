"""The all-reduce's arithmetic on parts: checked fixed-order weighted sums and checked copies.

Two implementations with identical results: the C extension `zgossip._kernels` (built by
``pip install`` when a C compiler is present; it checks and sums each block while it is in
cache, so each term is read from memory once) and numpy (always there, one more pass per
term). Which one runs is
`NATIVE`; ``ZGOSSIP_NATIVE=0`` forces numpy. Both sum terms in the order given, each
operation rounded to the element type, so the bits do not depend on the path: peers with
and without the extension produce the same averages, and a simulation gives the same trace.

Nothing here knows about peers or messages: the protocol (`allreduce`) calls these.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

__all__ = ["NATIVE", "ISA", "STREAM_STORES", "LLC_BYTES", "BLOCK", "ACC_BLOCK", "SUB_BLOCK", "OVERFLOW", "all_finite",
           "accumulate", "finish_mean", "copy_finite", "codec_encode", "codec_decode"]

try:  # pragma: no cover - depends on the build
    from . import _kernels as _native
except ImportError:  # no compiler at install time: numpy does the same work, slower
    _native = None
if os.environ.get("ZGOSSIP_NATIVE", "1") == "0":
    _native = None

#: True when the C kernels are in use.
NATIVE = _native is not None
#: The instruction set the C kernels' loops run with ("avx512f", "avx2", "default", "baseline"), or None (numpy).
ISA = _native.isa() if _native is not None and hasattr(_native, "isa") else None


def _last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache (Linux sysfs), None where unknown."""
    best = None
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    for e in entries:
        try:
            with open(f"{base}/{e}/size") as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best or 0, int(digits) * scale)
    return best


#: Size of this machine's last-level cache, read at start-up (None where unknown).
LLC_BYTES = _last_level_cache_bytes()
#: Non-temporal stores in `copy_finite` (C kernels only): "auto" (default), "on" or "off"
#: (``ZGOSSIP_STREAM_STORES=1`` / ``0``). They pay when the destination's cache lines are cold and
#: will not be read again soon -- true when the tensor a result goes into is larger than the last-
#: level cache (the rule glibc's memcpy uses for its own non-temporal threshold), so "auto" uses them
#: for destinations inside a buffer larger than `LLC_BYTES`, and never where that size is unknown.
#: Measured on the 4-peer 64 MiB bench (docs/performance.md): 3-5% less CPU with them.
STREAM_STORES = {"1": "on", "0": "off"}.get(os.environ.get("ZGOSSIP_STREAM_STORES", ""), "auto")


def _stream(dst: np.ndarray) -> bool:
    if STREAM_STORES != "auto":
        return STREAM_STORES == "on"
    if LLC_BYTES is None:
        return False
    size, a = dst.nbytes, dst
    while isinstance(a.base, np.ndarray):  # a view: the buffer it lies in decides how cold it is
        a = a.base
        size = max(size, a.nbytes)
    return size > LLC_BYTES


#: Granularity of `copy_finite`: it copies whole blocks of this many elements.
BLOCK = 1024
#: Granularity of `accumulate`'s checks: it reports the block where a bad value sits.
ACC_BLOCK = 16384
#: Granularity of `accumulate`'s overflow check: a divided sub-block is stored only when finite.
SUB_BLOCK = 2048
#: `accumulate` result: the terms were finite, but the divided sum is not (the sum overflowed).
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


def accumulate(out: np.ndarray, terms: Sequence[np.ndarray], weights: Sequence[float], first: bool,
               divisor: float = 0.0, src: np.ndarray | None = None) -> tuple[int, int]:
    """Add `terms` in the order given to the partial sum in `src` (default: `out` itself) and store
    the result in `out`: ``t0*w0`` (`first`: `src` is not read) or ``src + t0*w0``, then
    ``+ t1*w1``, ...; then, if `divisor` is not 0, ``/ divisor``.

    Callers feed the terms of a sum in a fixed order (float addition is not associative, so a
    fixed order is what makes every run give identical bits), as many at a time as they have,
    and pass the weight sum as `divisor` with the last. `out` may be `src` or one of the terms
    (an owner writes its final mean over its own data). All terms are checked for NaN/inf block
    by block (`ACC_BLOCK` elements) before a block is used, and a divided sub-block (`SUB_BLOCK`)
    before it is stored. Returns ``(-1, 0)`` on success; ``(i, offset)`` when a term is not
    finite: `offset` is the first block holding a bad value in any term and `i` the first term,
    in order, bad there; or ``(OVERFLOW, offset)`` when the terms are finite but the divided sub-
    block at `offset` is not. Either way ``out[:offset]`` was stored and the rest is untouched.
    """
    if src is not None and src.shape != out.shape:
        raise ValueError("src and out differ in shape")
    if divisor != 0:
        with np.errstate(over="ignore", under="ignore"):
            d = out.dtype.type(divisor)
        if d == 0 or not np.isfinite(d):
            # the C path would take it as "no division" (0) and numpy would divide by it: refused on both
            raise ValueError(f"divisor {divisor!r} is 0 or not finite as {out.dtype}: scale the weights first "
                             "(`zgossip.numeric.weight_exponent`)")
    if _fast(out, *terms) and len(terms) <= 64 and all(t.dtype == out.dtype for t in terms) and (
            src is None or (src.dtype == out.dtype and src.flags.c_contiguous)):
        return _native.accumulate(out, terms, [float(w) for w in weights], first, float(divisor), out.itemsize, src)
    n = out.size
    cut, verdict = n, -1
    for i, t in enumerate(terms):
        if not _numpy_finite(t):
            bad = int(np.flatnonzero(~np.isfinite(t))[0])
            offset = bad - bad % ACC_BLOCK
            if offset < cut:
                cut, verdict = offset, i
    acc = out if src is None else src
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # overflow is reported below
        tmp = np.empty_like(out) if not first else None
        for i, (t, w) in enumerate(zip(terms, weights)):
            wt = out.dtype.type(w)
            if i == 0 and first:
                tmp = np.multiply(t, wt)
            elif i == 0:
                np.add(acc, t if float(wt) == 1.0 else t * wt, out=tmp)
            elif float(wt) == 1.0:
                np.add(tmp, t, out=tmp)
            else:
                tmp += t * wt
        if divisor != 0:
            np.divide(tmp, out.dtype.type(divisor), out=tmp)
            if not _numpy_finite(tmp[:cut]):
                bad = int(np.flatnonzero(~np.isfinite(tmp[:cut]))[0])
                cut, verdict = bad - bad % SUB_BLOCK, OVERFLOW
    out[:cut] = tmp[:cut]
    return (verdict, cut) if verdict != -1 else (-1, 0)


def finish_mean(out: np.ndarray, divisor: float) -> bool:
    """``out /= divisor`` for a sum whose last term came without the divisor (its sender was lost
    after the earlier ones were added); False if the result is not finite."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        np.divide(out, out.dtype.type(divisor), out=out)
    return all_finite(out)


def copy_finite(dst: np.ndarray, src: np.ndarray) -> int:
    """Copy `src` into `dst` block by block, stopping before the first block of `BLOCK` elements
    that holds a NaN or inf. Returns how many leading elements were copied (all of them when
    `src` is finite): the rest of `dst` is untouched."""
    if dst.shape != src.shape:
        raise ValueError("dst and src differ in shape")
    if _fast(dst, src) and dst.dtype == src.dtype:
        return _native.copy_finite(dst, src, dst.itemsize, _stream(dst))
    if _numpy_finite(src):
        dst[...] = src
        return src.size
    bad = int(np.flatnonzero(~np.isfinite(src))[0])
    good = bad - bad % BLOCK
    dst[:good] = src[:good]
    return good


_F32 = np.dtype(np.float32)


def codec_encode(codec: int, x: np.ndarray, out: np.ndarray) -> bool:
    """Encode float32 `x` into the bytes `out` with wire codec `codec` (fp16, bf16, int8) in C; False
    when the C path cannot (no extension, another dtype, a CPU without F16C for fp16): then
    `zgossip.codecs` does it in numpy, with the same bytes."""
    if _native is None or x.dtype != _F32 or not x.flags.c_contiguous or not hasattr(_native, "codec_encode"):
        return False
    return bool(_native.codec_encode(codec, x, out))


def codec_decode(codec: int, data: np.ndarray, out: np.ndarray) -> bool:
    """Decode `data` into float32 `out` in C (see `codec_encode`)."""
    if _native is None or out.dtype != _F32 or not out.flags.c_contiguous or not hasattr(_native, "codec_decode"):
        return False
    return bool(_native.codec_decode(codec, data, out))
