"""What a trainer shares: nested training state as (msgpack metadata, arrays), and model layouts.

Two things every training integration needs and the core `Averager` leaves to its user:

* `pack_state` / `unpack_state` turn a nested object -- an optimizer ``state_dict()``, a
  scheduler's, a moolib-style user state -- into ``(metadata, arrays)`` for
  `Averager.get_current_state` and back. Tensors and numpy arrays travel as raw arrays
  (the donor streams them in checksummed chunks; a bfloat16 tensor as float32, which holds it
  exactly, restored to bfloat16); everything else must be a msgpack
  scalar, list, tuple or dict. Nothing is pickled: a state with another kind of object
  raises `TypeError` naming where it sits.
* `ModelLayout` describes the tensors a peer averages (names, shapes, dtypes) compactly
  enough to gossip (`Averager.publish` records hold short strings), so that a peer whose
  model differs from the run's is told *which* tensor differs instead of silently never
  finding a group (the averager only groups equal layouts).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from .errors import ZGossipError

__all__ = ["pack_state", "unpack_state", "ModelLayout", "LayoutMismatch", "copy_arrays", "bf16_state_compression"]

# dtypes the state stream accepts (zgossip.wire.DTYPES); bool travels as uint8 and is restored
_TORCH_TO_NUMPY = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
    torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8, torch.bool: np.uint8,
}
_NUMPY_OK = {np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8)}
_SIG_ALPHABET = "0123456789abcdefghijklmnopqrstuv"  # 32 symbols: 5 bits of hash per tensor
_SIG_MAX = 128  # a published info string holds at most 128 characters


class LayoutMismatch(ZGossipError):
    """This peer's tensors differ (in number, shape or dtype) from a peer's it should train with."""


def _tensor_array(t: torch.Tensor, where: str) -> tuple[np.ndarray, bool]:
    if t.dtype not in _TORCH_TO_NUMPY and t.dtype != torch.bfloat16:
        raise TypeError(f"state at {where}: torch dtype {t.dtype} cannot be shared (use float16/32/64, bfloat16, "
                        "int32/64, uint8 or bool)")
    return _host_array(t), t.dtype == torch.bool


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A private numpy copy of `t`: bool as uint8, bfloat16 as float32 (both exact)."""
    t = t.detach().cpu()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    elif t.dtype == torch.bfloat16:
        t = t.float()
    return np.array(t.contiguous().numpy(), copy=True)


def pack_state(obj: Any) -> tuple[Any, list[np.ndarray]]:
    """``(metadata, arrays)`` for a nested object; arrays are private copies (safe to stream later).

    Encoding: scalars stay as they are; a list stays a list; every other container is a
    one-key map -- ``{"d": [[k, v], ...]}`` dict, ``{"t": [...]}`` tuple, ``{"T": [i, bool]}``
    torch tensor number i (``{"T": [i, False, "bfloat16"]}`` for a bfloat16 one, whose array is
    float32), ``{"A": i}`` numpy array number i -- so decoding is unambiguous.
    """
    arrays: list[np.ndarray] = []

    def enc(x: Any, where: str) -> Any:
        if x is None or isinstance(x, (bool, str, bytes)):
            return x
        if isinstance(x, int):
            if not -(1 << 63) <= x < (1 << 64):
                raise TypeError(f"state at {where}: integer {x} does not fit 64 bits")
            return x
        if isinstance(x, float):
            return x
        if isinstance(x, torch.Tensor):
            arr, is_bool = _tensor_array(x, where)
            arrays.append(arr)
            if x.dtype == torch.bfloat16:
                return {"T": [len(arrays) - 1, False, "bfloat16"]}
            return {"T": [len(arrays) - 1, is_bool]}
        if isinstance(x, np.ndarray):
            if x.dtype not in _NUMPY_OK:
                raise TypeError(f"state at {where}: numpy dtype {x.dtype} cannot be shared")
            arrays.append(np.array(x, copy=True, order="C"))
            return {"A": len(arrays) - 1}
        if isinstance(x, np.generic):
            return enc(x.item(), where)
        if isinstance(x, dict):
            return {"d": [[enc(k, f"{where}[key]"), enc(v, f"{where}[{k!r}]")] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"t": [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]
        raise TypeError(f"state at {where}: {type(x).__name__} cannot be shared (zgossip never pickles; use "
                        "tensors, arrays, numbers, strings, lists, tuples and dicts)")

    return enc(obj, "state"), arrays


def unpack_state(meta: Any, arrays: Sequence[np.ndarray]) -> Any:
    """Inverse of `pack_state`. Tensors come back as torch tensors that own their memory."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if len(x) != 1:
                raise ValueError("malformed state metadata: a container map must have exactly one key")
            (tag, v), = x.items()
            if tag == "d":
                out = {}
                for k, val in v:
                    k = dec(k)
                    out[tuple(k) if isinstance(k, list) else k] = dec(val)
                return out
            if tag == "t":
                return tuple(dec(e) for e in v)
            if tag == "T":
                i, is_bool, *kind = v
                if kind not in ([], ["bfloat16"]):
                    raise ValueError(f"malformed state metadata: unknown tensor kind {kind!r}")
                t = torch.from_numpy(np.array(arrays[i], copy=True))
                if kind:
                    if t.dtype != torch.float32:
                        raise ValueError(f"malformed state: a bfloat16 tensor came as {t.dtype}, not float32")
                    return t.to(torch.bfloat16)
                return t.to(torch.bool) if is_bool else t
            if tag == "A":
                return np.array(arrays[v], copy=True)
            raise ValueError(f"malformed state metadata: unknown tag {tag!r}")
        return x

    return dec(meta)


def copy_arrays(tensors: Iterable[torch.Tensor]) -> list[np.ndarray]:
    """Private numpy copies of CPU tensors (a consistent snapshot to serve to a peer; bfloat16 as float32)."""
    return [np.array((t.float() if t.dtype == torch.bfloat16 else t).detach().cpu().numpy(), copy=True)
            for t in tensors]


def bf16_state_compression(opts: dict, tensors: Sequence[torch.Tensor]) -> None:
    """Unless `opts` name a ``state_compression``: the bf16 codec for the bfloat16 ones among `tensors`,
    which a wrapper serves first in its state (as float32 holding bfloat16 values, so bf16 carries them
    exactly in half the bytes; `copy_arrays`)."""
    if opts.get("state_compression") is None:
        chosen = {i: "bf16" for i, t in enumerate(tensors) if t.dtype == torch.bfloat16}
        if chosen:
            opts["state_compression"] = chosen


def _fmt_shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def _shape_code(shape: tuple[int, ...], dtype: str) -> str:
    h = hashlib.blake2b(repr((tuple(shape), dtype)).encode(), digest_size=2).digest()
    return _SIG_ALPHABET[h[0] % 32]


@dataclass(frozen=True)
class ModelLayout:
    """Names, shapes and dtypes of the tensors a peer trains; compares itself with peers' digests."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> "ModelLayout":
        if names is None:
            names = [f"#{i}" for i in range(len(tensors))]
        if len(names) != len(tensors):
            raise ValueError("need one name per tensor")
        return cls(tuple(names), tuple(tuple(t.shape) for t in tensors),
                   tuple(str(t.dtype).replace("torch.", "") for t in tensors))

    @property
    def fingerprint(self) -> str:
        """Equal exactly when the numbers, shapes and dtypes of the tensors are (names do not matter)."""
        return hashlib.blake2b(repr((self.shapes, self.dtypes)).encode(), digest_size=10).hexdigest()

    @property
    def signature(self) -> str:
        """One character per tensor (first 128 tensors): where two layouts differ, usually these do."""
        return "".join(_shape_code(s, d) for s, d in zip(self.shapes[:_SIG_MAX], self.dtypes[:_SIG_MAX]))

    def describe(self, i: int) -> str:
        return f"tensor {i} {self.names[i]!r} (shape {_fmt_shape(self.shapes[i])}, {self.dtypes[i]})"

    def as_meta(self) -> list:
        return [[n, list(s), d] for n, s, d in zip(self.names, self.shapes, self.dtypes)]

    @classmethod
    def from_meta(cls, meta: Any) -> "ModelLayout":
        try:
            return cls(tuple(str(m[0]) for m in meta), tuple(tuple(int(x) for x in m[1]) for m in meta),
                       tuple(str(m[2]) for m in meta))
        except (TypeError, ValueError, IndexError):
            raise ValueError("malformed layout description") from None

    def difference(self, other: "ModelLayout", here: str = "this peer", there: str = "the other peer") -> str | None:
        """None if the layouts can be averaged together, else which tensor differs and how (`here` is
        this layout's owner, `there` the other's: a peer, a checkpoint)."""
        if self.fingerprint == other.fingerprint:
            return None
        for i in range(min(len(self.shapes), len(other.shapes))):
            if self.shapes[i] != other.shapes[i] or self.dtypes[i] != other.dtypes[i]:
                return (f"{self.describe(i)} here has shape {_fmt_shape(other.shapes[i])}, {other.dtypes[i]} "
                        f"at {there}")
        return f"{here} has {len(self.shapes)} tensors, {there} has {len(other.shapes)}"

    def difference_from_digest(self, count: int, signature: str) -> str:
        """Best description of how a peer that published (`count`, `signature`) differs from us."""
        for i, (mine, theirs) in enumerate(zip(self.signature, signature)):
            if mine != theirs:
                return f"{self.describe(i)} has a different shape or dtype there"
        if count != len(self.shapes):
            return f"this peer has {len(self.shapes)} tensors, the other {count}"
        if len(self.shapes) > _SIG_MAX:
            return f"a tensor after the first {_SIG_MAX} differs in shape or dtype"
        return "some tensor differs in shape or dtype"


def named_tensors(params: Sequence[torch.Tensor], model: torch.nn.Module | None) -> list[str]:
    """Names for `params` from ``model.named_parameters()`` where they match, else ``#i``."""
    names = {}
    if model is not None:
        for n, p in model.named_parameters():
            names.setdefault(id(p), n)
        for n, b in model.named_buffers():
            names.setdefault(id(b), n)
    return [names.get(id(p), f"#{i}") for i, p in enumerate(params)]
