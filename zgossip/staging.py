"""Tensors the protocol cannot read where they lie -- on a device (CUDA and others), or in bfloat16
-- staged through reusable host buffers.

The protocol averages flat host buffers. A tensor that lives on a device gets a host mirror of
its shape and dtype, allocated once (pinned on CUDA, so copies are asynchronous DMA); the
`Averager` sees only the mirrors, and this module keeps them in step with the device. A
bfloat16 tensor (on the host or a device) gets a *float32* mirror: numpy has no bfloat16, and
bfloat16 -> float32 is exact, so the protocol averages float32 values; ``copy_`` back rounds
float32 -> bfloat16 to nearest even, which leaves values already bfloat16 (what the default bf16
wire codec delivers, `zgossip.codecs`) exactly as they are. A host bfloat16 tensor is copied with
plain ``copy_``; a device one takes its device's engine like any device tensor (the dtype
conversion is then torch's part of the copy -- untested here: no GPU in CI).

* `pull` before a snapshot (and before a partial write-back, ``averaging_alpha < 1``): device
  -> mirror. On CUDA the copies run on a side stream that first waits for what the *training
  stream* had queued (an event), and the calling thread waits for those copies only.
* `push` after the averaged ranges were written into the mirrors: mirror -> device, only the
  averaged element ranges. On CUDA the side stream waits for the training stream's queued work
  (so a kernel still writing the tensor is not overtaken), copies with ``non_blocking=True``,
  records an event, and the training stream waits on that event: work queued on it afterwards
  sees the averaged values, and it is held no longer than the copy. The calling thread then
  waits for the event, so the mirrors may be reused.

The training stream is the current stream of each tensor's device when the averager was
created (normally the default stream). Every `pull` / `push` runs under the averager's tensor
lock, so `get_tensors()` keeps its meaning: nothing is written into the user's tensors while a
caller is inside.

Nothing here imports torch (let alone torch.cuda) at import time; a CUDA stream and events are
made only for a tensor that is on a CUDA device. Other devices (mps, xpu, ...) use plain copies,
which block the caller until done.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["on_device", "needs_mirror", "DeviceStaging"]


def on_device(t: Any) -> bool:
    """Whether `t` is a torch tensor that is not in host memory (it needs staging)."""
    return type(t).__module__.startswith("torch") and getattr(t, "device", None) is not None and t.device.type != "cpu"


def _bf16(t: Any) -> bool:
    return str(getattr(t, "dtype", "")) == "torch.bfloat16"


def needs_mirror(t: Any) -> bool:
    """Whether the `Averager` averages `t` through a host mirror: a device tensor, or a bfloat16 one."""
    return on_device(t) or (type(t).__module__.startswith("torch") and _bf16(t))


def _mirror_dtype(t: Any) -> Any:
    """A mirror's dtype: the tensor's own, but float32 for bfloat16 (exact; numpy has no bfloat16)."""
    import torch

    return torch.float32 if t.dtype == torch.bfloat16 else t.dtype


def _merge(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if hi <= lo:
            continue
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


class BlockingCopies:
    """Copies for devices without streams we know of: plain ``copy_``, which blocks until done."""

    def host_like(self, t: Any) -> Any:
        import torch

        return torch.empty(tuple(t.shape), dtype=_mirror_dtype(t))

    def to_host(self, pairs: list[tuple[Any, Any]]) -> None:
        for host, dev in pairs:
            host.copy_(dev)

    def to_device(self, pairs: list[tuple[Any, Any]]) -> None:
        for dev, host in pairs:
            dev.copy_(host)


class CudaCopies:
    """Asynchronous copies on a side stream, ordered against the training stream with events."""

    def __init__(self, device: Any, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self.cuda = cuda
        self.train = cuda.current_stream(device)  # the stream the user's kernels run on
        self.side = cuda.Stream(device)
        self._ready = cuda.Event()  # what the training stream queued before a copy
        self._done = cuda.Event()  # the copies themselves

    def host_like(self, t: Any) -> Any:
        import torch

        return torch.empty(tuple(t.shape), dtype=_mirror_dtype(t), pin_memory=True)

    def _copy(self, pairs: list[tuple[Any, Any]]) -> None:
        self._ready.record(self.train)
        self.side.wait_event(self._ready)
        with self.cuda.stream(self.side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        self._done.record(self.side)

    def to_host(self, pairs: list[tuple[Any, Any]]) -> None:
        self._copy(pairs)
        self._done.synchronize()  # this thread waits for the copies, the training stream does not

    def to_device(self, pairs: list[tuple[Any, Any]]) -> None:
        self._copy(pairs)
        self.train.wait_event(self._done)  # later training work sees the averaged values
        self._done.synchronize()  # the mirrors may be rewritten after this


def copies_for(device: Any) -> Any:
    return CudaCopies(device) if device.type == "cuda" else BlockingCopies()


class DeviceStaging:
    """Host mirrors of the device and bfloat16 tensors among `tensors` (others are left alone).

    ``copies_for(device)`` picks the copy engine per device (`CudaCopies` for CUDA, else
    `BlockingCopies`); tests pass their own, and treat host tensors as device ones with
    ``staged=`` (indices to stage)."""

    def __init__(self, tensors: Sequence[Any], copies: Callable[[Any], Any] = copies_for,
                 staged: Sequence[int] | None = None) -> None:
        self.index = list(staged) if staged is not None else [i for i, t in enumerate(tensors) if needs_mirror(t)]
        self._dev: dict[int, Any] = {}
        self._host: dict[int, Any] = {}
        self._engine: dict[int, Any] = {}
        engines: dict[str, Any] = {}
        for i in self.index:
            t = tensors[i]
            if t.requires_grad:
                t = t.detach()  # same storage: writes reach the parameter
            if not t.is_contiguous():
                raise TypeError(f"tensor {i} ({t.dtype} on {t.device}) must be contiguous to be averaged")
            key = str(t.device)
            if key not in engines:
                engines[key] = copies(t.device)
            self._engine[i] = engines[key]
            self._dev[i] = t
            self._host[i] = engines[key].host_like(t)
        self._engines = list(engines.values())

    def host_tensors(self, tensors: Sequence[Any]) -> list:
        """`tensors` with each staged one replaced by its host mirror."""
        return [self._host.get(i, t) for i, t in enumerate(tensors)]

    def _by_engine(self, pairs: dict[int, list]) -> list[tuple[Any, list]]:
        out = []
        for eng in self._engines:
            work = [p for i, ps in pairs.items() if self._engine[i] is eng for p in ps]
            if work:
                out.append((eng, work))
        return out

    def pull(self) -> None:
        """Device -> mirrors, for every staged tensor."""
        pairs = {i: [(self._host[i], self._dev[i])] for i in self.index}
        for eng, work in self._by_engine(pairs):
            eng.to_host(work)

    def push(self, ranges: Sequence[tuple[int, int]], offsets: Sequence[int]) -> int:
        """Mirrors -> device for the flat element `ranges` (of the layout with tensor boundaries
        `offsets`); returns the number of elements copied."""
        merged = _merge(ranges)
        pairs: dict[int, list] = {}
        n = 0
        for i in self.index:
            t_lo, t_hi = offsets[i], offsets[i + 1]
            dev, host = self._dev[i].view(-1), self._host[i].view(-1)
            for lo, hi in merged:
                s, e = max(lo, t_lo), min(hi, t_hi)
                if s < e:
                    pairs.setdefault(i, []).append((dev[s - t_lo:e - t_lo], host[s - t_lo:e - t_lo]))
                    n += e - s
        for eng, work in self._by_engine(pairs):
            eng.to_device(work)
        return n

    def push_all(self, offsets: Sequence[int]) -> int:
        return self.push([(0, offsets[-1])], offsets)
