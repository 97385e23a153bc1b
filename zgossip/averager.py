"""The user's object: average a list of tensors in place with whoever steps with the same prefix.

    avg = zgossip.Averager([w, b], prefix="run1", initial_peers=["tcp://10.0.0.5:41000"])
    result = avg.step(weight=32, gather={"loss": 0.7})   # or step(wait=False) -> Future
    with avg.get_tensors() as (w, b):                     # the averager never writes in here
        ...

The protocol runs on a `ZmqDriver` I/O thread. A step snapshots the tensors into a
flat buffer (under the tensor lock), the group averages that buffer, and a small
worker thread writes the averaged element ranges back under the lock.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import logging
import os
import threading
from typing import Any, Iterator, Sequence

import numpy as np

from . import wire
from .errors import AveragerClosed, RoundTimeout, StepInProgress, ZGossipError
from .node import Node, NodeConfig, StepDone, StepFailed, StepRequest, StepResult
from .tensors import FlatLayout, as_array
from .zmq_driver import ZmqDriver

__all__ = ["Averager"]

log = logging.getLogger(__name__)


class Averager:
    """Decentralized group averaging of `tensors` (numpy arrays and/or CPU torch tensors), in place.

    Parameters mirror hivemind's DecentralizedAverager where they mean the same thing:
    ``target_group_size`` / ``min_group_size`` bound group sizes; ``matchmaking_time`` is
    the rendezvous window; ``request_timeout`` how long a silent rendezvous peer is given;
    ``part_size_bytes`` the streaming unit; ``part_timeout`` how long a silent member is
    waited for before it is excluded (an owner gets twice that); ``allreduce_timeout``
    bounds a round; ``bandwidth`` is this peer's relative share of the reduction (0 makes
    it a client that reduces nothing); ``averaging_alpha`` moves tensors only part way
    to the mean; ``grid`` / ``grid_coords`` place the peer on a Moshpit grid.
    """

    def __init__(
        self,
        tensors: Sequence[Any],
        *,
        prefix: str,
        listen: str = "tcp://127.0.0.1:0",
        initial_peers: Sequence[str] = (),
        target_group_size: int = 16,
        min_group_size: int = 2,
        matchmaking_time: float = 1.0,
        request_timeout: float = 0.5,
        part_size_bytes: int = 4 << 20,
        part_timeout: float = 5.0,
        allreduce_timeout: float = 60.0,
        bandwidth: float = 1.0,
        averaging_alpha: float = 1.0,
        grid: Sequence[int] = (),
        grid_coords: Sequence[int] | None = None,
        gossip_interval: float = 0.5,
        peer_timeout: float = 5.0,
        max_message_bytes: int | None = None,
        announce_host: str | None = None,
        seed: int | None = None,
    ) -> None:
        if not 0.0 < averaging_alpha <= 1.0:
            raise ValueError("averaging_alpha must be in (0, 1]")
        self._tensors = list(tensors)
        self._arrays = [as_array(t) for t in self._tensors]
        self.layout = FlatLayout.of(self._tensors)
        self.averaging_alpha = float(averaging_alpha)
        self.config = NodeConfig(
            prefix=prefix, target_group_size=target_group_size, min_group_size=min_group_size,
            matchmaking_time=matchmaking_time, request_timeout=request_timeout,
            part_size_bytes=part_size_bytes, part_timeout=part_timeout, allreduce_timeout=allreduce_timeout,
            gossip_interval=gossip_interval, peer_timeout=peer_timeout, bandwidth=bandwidth,
            grid=tuple(grid), grid_coords=tuple(grid_coords) if grid_coords is not None else None,
        )
        frame_limit = max_message_bytes or max(64 << 20, part_size_bytes + (1 << 16))
        if part_size_bytes > frame_limit:
            raise ValueError("part_size_bytes exceeds max_message_bytes: peers would drop every part")
        self._rng = np.random.default_rng(seed)
        self.peer_id = self._rng.bytes(8).hex()
        self._lock = threading.RLock()
        self._inside = threading.local()  # set while the calling thread is inside get_tensors()
        self._buffer: np.ndarray | None = None
        self._futures: dict[str, tuple[cf.Future, np.ndarray]] = {}
        self._busy = threading.Lock()  # held from step() until its result is applied
        self._seq = itertools.count(1)
        self._closed = False
        self._applier = cf.ThreadPoolExecutor(1, thread_name_prefix="zgossip-apply")
        self._driver = ZmqDriver(
            lambda ep: Node(self.peer_id, ep, self.config, self._rng, tuple(initial_peers)),
            listen, self._on_result, limits=wire.WireLimits(max_frame_bytes=frame_limit),
            announce_host=announce_host, name=f"zgossip-{self.peer_id[:8]}",
        )
        self.endpoint = self._driver.endpoint

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list]:
        """The averaged tensors; the averager does not write them while you are inside."""
        with self._lock:
            self._inside.active = getattr(self._inside, "active", 0) + 1
            try:
                yield self._tensors
            finally:
                self._inside.active -= 1

    def step(self, weight: float = 1.0, gather: Any = None, timeout: float | None = None,
             wait: bool = True) -> StepResult | cf.Future:
        """Find a group and average with it once.

        ``timeout`` bounds matchmaking (default ``max(5, 3*matchmaking_time)`` seconds); the
        all-reduce itself is bounded by ``allreduce_timeout``. Raises `GroupNotFound`
        (with what was tried), `RoundTimeout`, `StepInProgress` or `AveragerClosed`; with
        ``wait=False`` returns a `concurrent.futures.Future` that carries the same.
        """
        if self._closed:
            raise AveragerClosed("this averager was shut down")
        if wait and getattr(self._inside, "active", 0):
            raise ZGossipError("step(wait=True) inside get_tensors() would deadlock: the averaged tensors "
                               "are written under that lock; leave the block first or use wait=False")
        weight = float(weight)
        if not (weight > 0.0 and np.isfinite(weight)):
            raise ValueError("weight must be a finite number > 0")
        if timeout is None:
            timeout = max(5.0, 3 * self.config.matchmaking_time)
        if not self._busy.acquire(blocking=False):
            raise StepInProgress("the previous step of this averager is still running; wait for it first")
        try:
            with self._lock:
                self.layout.check(self._arrays)
                if self._buffer is None or self._driver.sends_pending():
                    # a buffer still referenced by an unsent zero-copy frame must not be overwritten
                    self._buffer = self.layout.new_buffer()
                buf = self.layout.snapshot(self._arrays, self._buffer)
            step_id = f"{self.peer_id[:8]}-{next(self._seq)}"
            fut: cf.Future = cf.Future()
            self._futures[step_id] = (fut, buf)
            req = StepRequest(step_id, buf, weight, gather, float(timeout), self.layout.fingerprint)
            self._driver.call(lambda now: self._driver.node.submit_step(req, now))
        except BaseException:
            self._busy.release()
            raise
        if not wait:
            return fut
        bound = timeout + self.config.allreduce_timeout + 10.0
        try:
            return fut.result(bound)
        except cf.TimeoutError:
            self._driver.call(lambda now: self._driver.node.cancel_step(step_id, now, "caller gave up"))
            raise RoundTimeout(f"step did not finish within {bound:.0f}s") from None

    def peers(self) -> list[str]:
        """Peer ids this averager currently believes alive (a snapshot, for monitoring)."""
        return list(self._driver.node.membership.live_ids())

    @property
    def stats(self) -> dict[str, int]:
        return {**self._driver.stats, **self._driver.node.stats}

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        for sid, fut in list(self._futures.items()):
            self._driver.call(lambda now, s=sid: self._driver.node.cancel_step(s, now, "averager shut down"))
        self._driver.close(timeout)
        self._applier.shutdown(wait=True)
        for fut, _ in self._futures.values():
            if not fut.done():
                fut.set_exception(AveragerClosed("averager shut down during the step"))
        self._futures.clear()
        if self._busy.locked():
            try:
                self._busy.release()
            except RuntimeError:
                pass

    def __enter__(self) -> "Averager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown(0.5)
        except Exception:
            pass

    # ------------------------------------------------------------------ I/O-thread callbacks
    def _on_result(self, act: StepDone | StepFailed) -> None:
        entry = self._futures.pop(act.step_id, None)
        if entry is None:
            return
        fut, buf = entry
        if isinstance(act, StepFailed):
            self._release()
            fut.set_exception(act.error)
            return
        self._applier.submit(self._apply, act.result, fut, buf)

    def _apply(self, result: StepResult, fut: cf.Future, buf: np.ndarray) -> None:
        try:
            with self._lock:
                self.layout.apply(self._arrays, buf, result.updated, self.averaging_alpha)
        except Exception as e:  # pragma: no cover - defensive
            self._release()
            fut.set_exception(ZGossipError(f"could not write the averaged tensors: {e}"))
            return
        self._release()
        fut.set_result(result)

    def _release(self) -> None:
        try:
            self._busy.release()
        except RuntimeError:
            pass
