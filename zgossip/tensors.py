"""The user's tensors <-> the flat buffer the protocol averages.

A `FlatLayout` records shapes and offsets of a list of numpy arrays / CPU torch
tensors, copies them into one flat buffer (the snapshot a step averages) and writes
averaged ranges back. The buffer's dtype is float64 when every tensor is float64, else
float32; each tensor's range travels as its codec says (`zgossip.codecs`: an fp16 tensor as
fp16, a bfloat16 tensor as bf16, unless told otherwise). Only the element ranges a step reports
as averaged are written, so elements whose span was lost stay exactly as they were.

numpy has no bfloat16: a bfloat16 torch tensor is averaged through a float32 host mirror
(`zgossip.staging`), and the layout records its dtype as `BF16_DTYPE` (``"bf16"``) so that peers holding
float32 versions of it are told the dtypes differ.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import codecs as _codecs
from . import layouts

__all__ = ["FlatLayout", "as_array", "is_bf16", "BF16_DTYPE"]

_FLOATS = (np.dtype("float16"), np.dtype("float32"), np.dtype("float64"))
#: the dtype a layout records for a bfloat16 tensor (numpy has none; its host array is a float32 mirror)
BF16_DTYPE = _codecs.BF16_DTYPE


def is_bf16(t: Any) -> bool:
    """Whether `t` is a bfloat16 torch tensor (on any device); torch is not imported for the check."""
    return type(t).__module__.startswith("torch") and str(getattr(t, "dtype", "")) == "torch.bfloat16"


def as_array(t: Any) -> np.ndarray:
    """A plain numpy view of a numpy array or a CPU torch tensor (no copy). Raises TypeError otherwise.

    An ndarray subclass is viewed as a plain ndarray over the same memory (``np.memmap`` is still
    averaged in place): a subclass may change what reshaping does (``np.matrix.reshape(-1)`` stays
    2-D), and the protocol must be handed a flat buffer."""
    if isinstance(t, np.ndarray):
        arr = t if type(t) is np.ndarray else t.view(np.ndarray)
    elif type(t).__module__.startswith("torch"):
        if t.device.type != "cpu":
            raise TypeError(f"only CPU torch tensors can be averaged (got one on {t.device})")
        if is_bf16(t):
            raise TypeError("a bfloat16 tensor has no numpy view: zgossip.Averager averages it through a float32 "
                            "mirror (zgossip.staging); pass it to the Averager, not to as_array")
        if t.requires_grad:
            t = t.detach()
        try:
            arr = t.numpy()
        except TypeError as e:  # a dtype numpy does not have
            raise TypeError(f"torch dtype {t.dtype} cannot be averaged: {e}") from None
    else:
        raise TypeError(f"expected numpy arrays or torch tensors, got {type(t).__name__}")
    if arr.dtype not in _FLOATS:
        raise TypeError(f"only float16/32/64 tensors can be averaged, got {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise TypeError("tensors must be C-contiguous to be averaged in place")
    if not arr.flags.writeable:
        raise TypeError("tensors must be writeable to be averaged in place")
    return arr


@dataclass(frozen=True)
class FlatLayout:
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int, ...]  # len(shapes)+1 boundaries in the flat buffer
    dtype: np.dtype
    codecs: tuple[int, ...] = ()  # wire codec id per tensor (`zgossip.codecs`); () = each dtype's default

    @classmethod
    def of(cls, tensors: Sequence[Any], compression: Any = None, bf16: Sequence[int] = ()) -> "FlatLayout":
        """`compression`: as `zgossip.codecs.resolve` takes it (None: fp16 tensors as fp16, bfloat16 ones
        as bf16, the rest raw). `bf16`: indices of the tensors that are float32 mirrors of bfloat16
        tensors (their dtype is recorded as `BF16_DTYPE`)."""
        arrays = [as_array(t) for t in tensors]
        for k in bf16:
            if not 0 <= k < len(arrays) or arrays[k].dtype != np.float32:
                raise ValueError(f"tensor {k} is named a bfloat16 mirror but is not a float32 array")
        if not arrays:
            raise ValueError("need at least one tensor to average")
        if not any(a.size for a in arrays):
            raise ValueError(f"the tensors hold no elements (shapes {[a.shape for a in arrays]}): there is nothing "
                             "to average")
        offsets = [0]
        for a in arrays:
            offsets.append(offsets[-1] + a.size)
        all64 = all(a.dtype == np.float64 for a in arrays)
        dtypes = tuple(BF16_DTYPE if k in bf16 else a.dtype.str for k, a in enumerate(arrays))
        return cls(
            tuple(a.shape for a in arrays),
            dtypes,
            tuple(offsets),
            np.dtype("<f8" if all64 else "<f4"),
            _codecs.resolve(compression, [a.shape for a in arrays], dtypes),
        )

    @functools.cached_property
    def _host_dtypes(self) -> tuple[str, ...]:
        """Per tensor, the dtype of the host array the layout reads (a bfloat16 tensor's is its float32 mirror)."""
        return tuple("<f4" if d == BF16_DTYPE else d for d in self.dtypes)

    @functools.cached_property
    def _codec_names(self) -> tuple[str, ...]:
        """Per tensor, its codec's name where it is not its dtype's default, else ""."""
        defaults = _codecs.resolve(None, self.shapes, self.dtypes)
        return tuple("" if c == d else _codecs.CODEC_IDS[c] for c, d in zip(self.codecs or defaults, defaults))

    def codec_map(self, residual: np.ndarray | None = None) -> "_codecs.CodecMap":
        """How the flat buffer travels; `residual`: error feedback's carry (see `CodecMap`)."""
        codecs = self.codecs or _codecs.resolve(None, self.shapes, self.dtypes)
        return _codecs.CodecMap(self.offsets, codecs, self.dtype.itemsize, residual)

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    @functools.cached_property
    def fingerprint(self) -> str:
        """Equal only for layouts that can be averaged together (shapes, dtypes: bfloat16 is not float32)."""
        text = repr((self.shapes, self.dtypes, self.dtype.str))
        if any(self._codec_names):  # peers that compress a tensor differently cannot average it together
            text += repr(self._codec_names)
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    @functools.cached_property
    def description(self) -> str:
        """Count, shapes and dtypes as short text (`zgossip.layouts`): what a rendezvous peer
        compares to tell peers with different layouts what differs."""
        return layouts.describe(self.shapes, self.dtypes, codecs=self._codec_names)

    def describe(self) -> str:
        return f"{len(self.shapes)} tensors, {self.numel} elements as {self.dtype}"

    def check(self, arrays: Sequence[np.ndarray]) -> None:
        if tuple(a.shape for a in arrays) != self.shapes or tuple(a.dtype.str for a in arrays) != self._host_dtypes:
            raise ValueError("tensors changed shape or dtype since the averager was created")

    def new_buffer(self) -> np.ndarray:
        return np.empty(self.numel, dtype=self.dtype)

    def snapshot(self, arrays: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
        for a, lo, hi in zip(arrays, self.offsets, self.offsets[1:]):
            out[lo:hi] = a.reshape(-1)
        return out

    def apply(self, arrays: Sequence[np.ndarray], buf: np.ndarray, ranges: Sequence[tuple[int, int]], alpha: float = 1.0) -> None:
        """``local += alpha * (avg - local)`` on the averaged `ranges` (alpha=1 copies exactly)."""
        for lo, hi in ranges:
            for k, a in enumerate(arrays):
                t_lo, t_hi = self.offsets[k], self.offsets[k + 1]
                s, e = max(lo, t_lo), min(hi, t_hi)
                if s >= e:
                    continue
                dst = a.reshape(-1)[s - t_lo : e - t_lo]
                src = buf[s:e]
                if dst.dtype == np.float16:
                    src = _within_f16(src)
                if alpha == 1.0:
                    dst[...] = src
                else:
                    dst[...] = _moved(dst, src, alpha)


#: the largest finite float16
_F16_MAX = float(np.finfo(np.float16).max)  # 65504


def _within_f16(avg: np.ndarray) -> np.ndarray:
    """A mean for a float16 tensor, finite values beyond float16's range set to +-65504. The mean of
    float16 values lies within it, but a lossy codec can overshoot: int8 with error feedback sends
    value + residual, up to half a step (~260 at 65504) beyond, and written back as float16 that was
    inf -- hundreds of elements of a tensor at the edge turned inf in a round. Non-finite values are
    left as they are (the averaged ranges hold none)."""
    big = np.abs(avg) > _F16_MAX
    if not big.any():
        return avg
    return np.where(big & np.isfinite(avg), np.copysign(_F16_MAX, avg), avg).astype(avg.dtype, copy=False)


def _moved(local: np.ndarray, avg: np.ndarray, alpha: float) -> np.ndarray:
    """``local + alpha * (avg - local)`` in float64, rounded once to `local`'s dtype. The move lies
    between the two, so it is finite where they are; rounding the step alone to the tensor's dtype
    could overflow (a float16 tensor at -60000 moving 90 % toward 20000 stepped by inf)."""
    x = local.astype(np.float64)
    a = avg.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        out = x + alpha * (a - x)
    if not np.isfinite(out).all():  # float64 tensors near its limit: avg - local overflowed
        bad = ~np.isfinite(out)
        out[bad] = (1.0 - alpha) * x[bad] + alpha * a[bad]
    return out.astype(local.dtype)
