"""Wire codecs: how a range of the flat buffer is compressed for the trip to its reducer and back.

A codec turns a run of float32 (or float64) values into bytes and back. The all-reduce
(`zgossip.allreduce`) stays in float32 on the owner: members send their parts encoded, the owner
decodes each term, reduces in the fixed member order, encodes the mean once and sends those bytes
to every contributor -- and writes the *decoded* form of the same bytes into its own buffer, so every
member applies exactly the same values (bit-identical results survive compression).

Codecs (id on the wire, error bound of one round trip ``y = decode(encode(x))``, for finite x):

* ``none`` (0): raw values, exact.
* ``fp16`` (1): IEEE half, round to nearest even. ``|y - x| <= max(|x| * 2**-11, 2**-25)`` for
  ``|x| <= 65504``; larger values become inf.
* ``bf16`` (2): the top 16 bits of float32, round to nearest even. ``|y - x| <= max(|x| * 2**-8, 2**-134)``;
  ``|x| >= 3.3961e38`` rounds to inf.
* ``int8`` (3): blocks of `INT8_BLOCK` (1,024) values share one float32 scale ``max|x| / 127``; each
  value is ``round(x / scale)`` in [-127, 127]. ``|y - x| <= max|block| / 250 + 2**-140`` (half a
  step, 1/254, plus float32 rounding; a block of values under ~3.7e-37 has a subnormal scale, whose
  inverse is not finite: its values are divided by the scale instead).

Non-finite values are never turned into finite garbage: fp16/bf16 keep NaN/inf (and turn
out-of-range values into inf), and an int8 block holding NaN or inf decodes as all NaN. Either
way the reducer's NaN/inf policy (`zgossip.numeric`) applies to the decoded term exactly as to a
raw one: the sender is excluded from that span, and a result is taken up to its first
non-finite block.

A `CodecMap` assigns a codec to each range of the flat buffer (one range per tensor); a part
that crosses ranges is the concatenation of its pieces, each encoded on its own (int8 blocks
start at the piece's first element). Its header carries the part's codec id (`MIXED` when the
pieces differ); the receiver checks id and byte count against its own map. Pure numpy; no
peers, no messages. The C extension (`zgossip.kernels.codec_encode`) does the same work, with
the same bytes, when it is built; ``ZGOSSIP_NATIVE=0`` keeps to numpy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from . import kernels

__all__ = ["CODECS", "CODEC_IDS", "NONE", "FP16", "BF16", "INT8", "MIXED", "INT8_BLOCK", "error_bound",
           "encoded_nbytes", "encode", "decode", "CodecMap", "by_size", "resolve", "check_name"]

NONE, FP16, BF16, INT8 = 0, 1, 2, 3
#: header id of a part whose pieces use different codecs (each piece as the map says)
MIXED = 255
CODECS: dict[str, int] = {"none": NONE, "fp16": FP16, "bf16": BF16, "int8": INT8}
CODEC_IDS: dict[int, str] = {v: k for k, v in CODECS.items()}
#: values per int8 scale
INT8_BLOCK = 1024


def check_name(name: Any) -> int:
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"unknown codec {name!r}: expected one of {', '.join(CODECS)}")
    return CODECS[name]


def error_bound(codec: int, x: np.ndarray) -> np.ndarray:
    """The documented per-element bound on ``|decode(encode(x)) - x|`` for finite, in-range `x`."""
    a = np.abs(x.astype(np.float64))
    if codec == NONE:
        return np.zeros_like(a)
    if codec == FP16:
        return np.maximum(a * 2.0 ** -11, 2.0 ** -25)
    if codec == BF16:
        return np.maximum(a * 2.0 ** -8, 2.0 ** -134)
    if codec == INT8:
        out = np.empty_like(a)
        for s in range(0, a.size, INT8_BLOCK):
            out[s:s + INT8_BLOCK] = a[s:s + INT8_BLOCK].max() / 250 + 2.0 ** -140
        return out
    raise ValueError(f"unknown codec id {codec}")


def encoded_nbytes(codec: int, n: int, itemsize: int = 4) -> int:
    """Bytes of `n` values encoded with `codec` (`itemsize`: of the raw values, for ``none``)."""
    if codec == NONE:
        return n * itemsize
    if codec in (FP16, BF16):
        return 2 * n
    if codec == INT8:
        return n + 4 * (-(-n // INT8_BLOCK))
    raise ValueError(f"unknown codec id {codec}")


def _bf16_bits(x32: np.ndarray) -> np.ndarray:
    bits = x32.view(np.uint32)
    # round to nearest even on the 16 bits dropped; NaN must stay NaN (rounding can carry a NaN with
    # only low mantissa bits into the inf pattern)
    r = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x32)
    if nan.any():
        r[nan] = 0x7FC0
    return r


def encode(codec: int, x: np.ndarray, out: np.ndarray) -> None:
    """Encode the 1-D float array `x` into the uint8 array `out` (exactly `encoded_nbytes` long)."""
    n = x.size
    if codec == NONE:
        out[...] = x.view(np.uint8)
    elif kernels.codec_encode(codec, x, out):
        pass
    elif codec == FP16:
        with np.errstate(over="ignore"):
            out.view(np.float16)[...] = x
    elif codec == BF16:
        x32 = x if x.dtype == np.float32 else x.astype(np.float32)
        out.view(np.uint16)[...] = _bf16_bits(np.ascontiguousarray(x32))
    elif codec == INT8:
        nb = -(-n // INT8_BLOCK)
        scales = out[:4 * nb].view(np.float32)
        q = out[4 * nb:].view(np.int8)
        full = n - n % INT8_BLOCK
        if full:
            _int8_blocks(x[:full].reshape(-1, INT8_BLOCK), scales[:full // INT8_BLOCK],
                         q[:full].reshape(-1, INT8_BLOCK))
        if full < n:
            _int8_blocks(x[full:].reshape(1, -1), scales[nb - 1:], q[full:].reshape(1, -1))
    else:
        raise ValueError(f"unknown codec id {codec}")


def _largest_scale() -> np.float32:
    """The largest float32 scale whose 127 steps are still finite: a block near float32's maximum
    gets this scale instead (so it never decodes as inf; the clipped error stays under the bound)."""
    s = np.float32(np.finfo(np.float32).max / 127)
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(127) * s):
            s = np.nextafter(s, np.float32(0))
    return s


_MAX_SCALE = _largest_scale()


def _int8_blocks(x: np.ndarray, scales: np.ndarray, q: np.ndarray) -> None:
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        hi = x.max(axis=1)
        lo = x.min(axis=1)
        absmax = np.abs(np.maximum(hi, -lo)).astype(np.float32)  # NaN propagates; abs: +0 for a zero block
        scale = absmax / np.float32(127)
        bad = ~np.isfinite(scale)
        np.minimum(scale, _MAX_SCALE, out=scale)
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        inv[bad] = 0
        scale[bad] = np.nan  # decodes the whole block as NaN: the reducer's NaN/inf policy applies
        tmp = x * inv[:, None] if x.dtype == np.float32 else (x * inv[:, None]).astype(np.float32)
        tiny = np.isinf(inv)  # a subnormal scale has no finite inverse: divide (x * inf made every value +-127)
        if tiny.any():
            tmp[tiny] = x[tiny] / scale[tiny, None]
        np.rint(tmp, out=tmp)
        np.clip(tmp, -127, 127, out=tmp)
        tmp[bad] = 0  # (NaN * 0): a bad block's values are 0, its scale NaN
        q[...] = tmp
        scales[...] = scale


def decode(codec: int, data: np.ndarray, out: np.ndarray) -> None:
    """Decode the uint8 array `data` into the 1-D float array `out` (its length fixes the count)."""
    n = out.size
    if codec == NONE:
        out[...] = data.view(out.dtype)
    elif kernels.codec_decode(codec, data, out):
        pass
    elif codec == FP16:
        out[...] = data.view(np.float16)
    elif codec == BF16:
        bits = data.view(np.uint16).astype(np.uint32) << np.uint32(16)
        out[...] = bits.view(np.float32)
    elif codec == INT8:
        nb = -(-n // INT8_BLOCK)
        scales = data[:4 * nb].view(np.float32)
        q = data[4 * nb:].view(np.int8)
        full = n - n % INT8_BLOCK
        if full:
            np.multiply(q[:full].reshape(-1, INT8_BLOCK), scales[:full // INT8_BLOCK, None],
                        out=out[:full].reshape(-1, INT8_BLOCK), casting="unsafe")
        if full < n:
            np.multiply(q[full:], scales[nb - 1], out=out[full:], casting="unsafe")
    else:
        raise ValueError(f"unknown codec id {codec}")


# ---------------------------------------------------------------------------- per-tensor choice
@dataclass(frozen=True)
class by_size:  # noqa: N801 - used like a function: compression=by_size(65536, "int8")
    """A per-tensor rule: tensors of at least `min_numel` elements use `large`, the others `small`."""

    min_numel: int
    large: str = "int8"
    small: str = "none"

    def __post_init__(self) -> None:
        check_name(self.large), check_name(self.small)

    def __call__(self, index: int, shape: tuple[int, ...], dtype: np.dtype) -> str:
        return self.large if math.prod(shape) >= self.min_numel else self.small


#: how `zgossip.tensors.FlatLayout` names a bfloat16 tensor's dtype (numpy has none)
BF16_DTYPE = "bf16"


def _is_bf16(dtype: Any) -> bool:
    return isinstance(dtype, str) and dtype == BF16_DTYPE


def _default(dtype: Any) -> int:
    """An fp16 tensor travels as fp16, a bfloat16 one as bf16 (each exact for its values); others raw."""
    if _is_bf16(dtype):
        return BF16
    return FP16 if np.dtype(dtype) == np.float16 else NONE


def _rule_dtype(dtype: Any) -> Any:
    """What a compression rule is told of a tensor's dtype: a numpy dtype, or ``"bfloat16"``."""
    return "bfloat16" if _is_bf16(dtype) else np.dtype(dtype)


def resolve(compression: Any, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[Any]) -> tuple[int, ...]:
    """The codec id of each tensor. `compression`: None (fp16 tensors as fp16, bfloat16 tensors as
    bf16, the rest raw), one codec name for every tensor, a sequence of names (one per tensor), a
    mapping tensor index -> name (others as None gives them), or a callable ``(index, shape, dtype)
    -> name`` such as `by_size` (a bfloat16 tensor's dtype is given as the string ``"bfloat16"``).
    An fp16 tensor named bf16 travels as fp16: the same 2 bytes, exact for its values -- bf16 rounds
    fp16 values above 65408 up to 65536, which an fp16 tensor holds as inf. A bfloat16 tensor named
    none travels as bf16: exact for its values too, half the bytes of raw float32, and the mean it
    gets is the same float32 mean rounded to bfloat16 once (as writing it back would round it)."""
    n = len(shapes)
    base = [_default(d) for d in dtypes]
    if compression is None:
        return tuple(base)
    if isinstance(compression, str):
        out = [check_name(compression)] * n
    elif isinstance(compression, Mapping):
        out = list(base)
        for k, v in compression.items():
            if not isinstance(k, int) or not 0 <= k < n:
                raise ValueError(f"compression names tensor {k!r}, but there are {n} tensors")
            out[k] = check_name(v)
    elif callable(compression):
        out = [check_name(compression(i, tuple(s), _rule_dtype(d))) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    else:
        names = list(compression)
        if len(names) != n:
            raise ValueError(f"compression lists {len(names)} codecs for {n} tensors")
        out = [check_name(v) for v in names]
    return tuple(FP16 if c == BF16 and b == FP16 else BF16 if c == NONE and b == BF16 else c
                 for c, b in zip(out, base))


class CodecMap:
    """The codec of each range of a flat buffer, and the encoding of parts ``[lo, hi)`` of it.

    `residual` (error feedback): when given, encoding a part stores there what the codec lost
    (``x - decode(encode(x))``), for the averager to add to the next step's data."""

    def __init__(self, offsets: Sequence[int], codecs: Sequence[int], itemsize: int = 4,
                 residual: np.ndarray | None = None) -> None:
        if len(offsets) != len(codecs) + 1:
            raise ValueError("one codec per range")
        # merge neighbours with the same codec: fewer pieces per part
        bounds, ids = [int(offsets[0])], []
        for c, hi in zip(codecs, offsets[1:]):
            if int(hi) == bounds[-1]:
                continue
            if ids and ids[-1] == c:
                bounds[-1] = int(hi)
            else:
                ids.append(int(c))
                bounds.append(int(hi))
        self.bounds, self.ids = tuple(bounds), tuple(ids)
        self.itemsize = itemsize
        self.residual = residual
        self._pieces: dict[tuple[int, int], tuple[int, tuple[tuple[int, int, int, int], ...], int]] = {}

    @property
    def lossless(self) -> bool:
        return all(c == NONE for c in self.ids)

    def layout(self, lo: int, hi: int) -> tuple[int, tuple[tuple[int, int, int, int], ...], int]:
        """(header codec id, pieces (codec, lo, hi, byte offset), total bytes) of part [lo, hi)."""
        key = (lo, hi)
        got = self._pieces.get(key)
        if got is None:
            pieces, off = [], 0
            for c, a, b in zip(self.ids, self.bounds, self.bounds[1:]):
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    pieces.append((c, s, e, off))
                    off += encoded_nbytes(c, e - s, self.itemsize)
            kinds = {p[0] for p in pieces}
            cid = kinds.pop() if len(kinds) == 1 else (MIXED if kinds else NONE)
            got = self._pieces[key] = (cid, tuple(pieces), off)
            if len(self._pieces) > 4096:
                self._pieces.clear()
        return got

    def encode(self, lo: int, hi: int, x: np.ndarray, feedback: bool = True) -> tuple[int, np.ndarray]:
        """(codec id, bytes) for the values `x` of range [lo, hi); raw parts are returned as `x` itself."""
        cid, pieces, nbytes = self.layout(lo, hi)
        if cid == NONE:
            return NONE, x
        out = np.empty(nbytes, dtype=np.uint8)
        for c, s, e, off in pieces:
            xs = x[s - lo:e - lo]
            seg = out[off:off + encoded_nbytes(c, e - s, self.itemsize)]
            encode(c, xs, seg)
            if feedback and self.residual is not None and c != NONE:
                r = self.residual[s:e]
                decode(c, seg, r)
                with np.errstate(invalid="ignore"):
                    np.subtract(xs, r, out=r)
                if not kernels.all_finite(r):
                    # what the codec could not carry (NaN, inf, out of range; the owner excludes such a
                    # term) is not owed: a NaN carried would make this range NaN at every later step
                    r[~np.isfinite(r)] = 0
        return cid, out

    def check(self, lo: int, hi: int, cid: int, data: np.ndarray, dtype: np.dtype) -> str | None:
        """Why a payload for [lo, hi) with header codec `cid` does not fit the map, or None."""
        want, _, nbytes = self.layout(lo, hi)
        if cid != want:
            return f"codec {CODEC_IDS.get(cid, cid)} where {CODEC_IDS.get(want, 'mixed')} was agreed"
        if cid == NONE:
            if data.dtype != dtype or data.size != hi - lo:
                return "length or dtype does not match the group's plan"
        elif data.dtype != np.uint8 or data.size != nbytes:
            return f"{data.nbytes} bytes where the codec makes {nbytes}"
        return None

    def decode(self, lo: int, hi: int, cid: int, data: np.ndarray, out: np.ndarray) -> str | None:
        """Decode a part's payload into `out`; returns why it does not fit the map (then `out` is untouched)."""
        why = self.check(lo, hi, cid, data, out.dtype)
        if why is not None:
            return why
        if cid == NONE:
            out[...] = data
            return None
        for c, s, e, off in self.layout(lo, hi)[1]:
            decode(c, data[off:off + encoded_nbytes(c, e - s, self.itemsize)], out[s - lo:e - lo])
        return None

    def carry_result(self, lo: int, hi: int, exact: np.ndarray, decoded: np.ndarray, scale: float) -> None:
        """Error feedback for a result we reduced: what its encoding lost, times `scale` (the weight sum
        over our weight), joins our residual there, so the next step's mean makes up for it."""
        if self.residual is not None:
            with np.errstate(invalid="ignore", over="ignore"):
                lost = (exact - decoded) * exact.dtype.type(scale)
            lost[~np.isfinite(lost)] = 0  # a value the codec could not carry (inf) is not owed
            self.residual[lo:hi] += lost

    def zero_residual(self, lo: int, hi: int) -> None:
        """Range [lo, hi) went out exactly (our own span): nothing is owed to the next step there."""
        if self.residual is not None:
            self.residual[lo:hi] = 0

