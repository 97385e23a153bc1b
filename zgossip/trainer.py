"""A training peer on the swarm: what the PyTorch wrappers share.

`TrainerPeer` owns, for one optimizer: the `Averager` (whose averaged tensors each
wrapper chooses -- gradient accumulators, or copies of parameters and optimizer
statistics), the state it serves to newcomers (parameters, optimizer and scheduler
state, epoch: a consistent snapshot taken under the peer's lock), the progress record
it gossips, loading state from peers (verified against this peer's model before
anything is written), torch's checkpoint API (`state_dict` / `load_state_dict`; the
dict's layout and checks live in `zgossip.checkpoint`), and the model-layout check that
turns "never finds a group" into an error naming the tensor that differs.

Time: every reading of the time and every wait goes through the averager's clock
(`zgossip.clock.Clock`, from its transport): the wall clock on ZeroMQ, virtual time in
the simulator (`python -m sim train`), where the very same training loop runs.

Locking: ``self._lock`` is held whenever parameters or optimizer state change (the
optimizer step, applying averaged values, loading state or a checkpoint) and while the
donor side copies them, so a newcomer never receives a half-stepped model. It is never held
while waiting for an averaging round: the averager's worker thread, which serves
state, would otherwise wait for it.
"""
from __future__ import annotations

import hashlib
import logging
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .averager import Averager
from .checkpoint import check_checkpoint, checkpoint_dict, whole_number
from .clock import WALL_CLOCK, Clock
from .errors import StateUnavailable, ZGossipError
from .progress import PeerProgress, SwarmView, progress_record, run_digest
from .training_state import (LayoutMismatch, ModelLayout, bf16_state_compression, copy_arrays, named_tensors,
                             pack_state, unpack_state)

__all__ = ["TrainerPeer", "ServingAverager", "clock_of", "refuse_auxiliary",
           "SchedulerLike", "first_nonfinite", "params_digest"]

log = logging.getLogger(__name__)

SchedulerLike = Any  # an LR scheduler, or a callable(optimizer) -> scheduler

#: Averager settings the training wrappers use unless told otherwise: gossip often enough that
#: progress records spread within a fraction of a second.
TRAINING_DEFAULTS = dict(gossip_interval=0.2, peer_timeout=4.0, request_timeout=0.5)


def refuse_auxiliary(averager_opts: dict, who: str) -> None:
    """A training wrapper trains: as an auxiliary peer its averaged contribution would be dropped (weight 0) while
    its samples still counted toward the swarm's batch, and it would step on its own gradients. An auxiliary
    helper is a plain `Averager` with the wrapper's averaged tensors' shapes, stepping in a loop."""
    if averager_opts.get("auxiliary"):
        raise ValueError(f"{who} cannot be auxiliary (it trains, and an auxiliary peer brings no data): to lend a "
                         "machine's bandwidth to a run, loop zgossip.Averager(tensors of the same shapes, prefix=the "
                         "run's prefix, auxiliary=True, initial_peers=...).step() beside it (docs/training.md)")


def clock_of(averager_opts: dict) -> Clock:
    """The clock an `Averager` built with these keyword arguments will run on: its transport's
    (the default ZeroMQ transport's is the wall clock). Known before the averager exists, so that
    locks the averager's workers take can be made first."""
    transport = averager_opts.get("transport")
    return transport.clock if transport is not None else WALL_CLOCK


class ServingAverager(Averager):
    """An `Averager` whose state for newcomers comes from a callback (called on a worker thread)."""

    def __init__(self, tensors: Sequence[Any], *, state_fn: Callable[[], tuple[Any, list]], **kwargs: Any) -> None:
        self._state_fn = state_fn
        super().__init__(tensors, **kwargs)

    def get_current_state(self) -> tuple[Any, list]:
        return self._state_fn()


def first_nonfinite(tensors: Sequence[torch.Tensor | None]) -> int | None:
    """Index of the first tensor holding a NaN or an infinity.

    One sum per tensor in its own dtype (a NaN or inf anywhere makes the sum non-finite; ~1 ms
    per 10M floats, where ``isfinite().all()`` or a float64 sum cost 20-30 ms); a non-finite sum
    is confirmed element-wise, so an overflowing sum of finite values is not a false alarm.
    """
    for i, t in enumerate(tensors):
        if t is None or not t.numel():
            continue
        if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
            return i
    return None


def params_digest(params: Sequence[torch.Tensor], epoch: int, samples_per_tensor: int = 512) -> str:
    """A short digest of (a strided sample of) every parameter: equal models give equal digests, and
    two models that drifted apart (which touches every element) differ with near certainty. Cheap
    enough to compute after every optimizer step of a 10M-parameter model (~0.1 ms)."""
    h = hashlib.blake2b(str(epoch).encode(), digest_size=6)
    with torch.no_grad():
        for p in params:
            flat = p.detach().reshape(-1)
            if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: digest its bits
                flat = flat.view(torch.int16)
            stride = max(1, flat.numel() // samples_per_tensor)
            h.update(flat[::stride].contiguous().numpy().tobytes())
    return h.hexdigest()


class TrainerPeer:
    """Base of `DecentralizedOptimizer` and `CollaborativeOptimizer` (see the module docstring)."""

    kind = "trainer"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        prefix: str,
        scheduler: SchedulerLike = None,
        model: torch.nn.Module | None = None,
        initial_peers: Sequence[str] = (),
        listen: str = "tcp://127.0.0.1:0",
        averager_opts: dict | None = None,
        load_state_on_start: bool = True,
        startup_timeout: float | None = None,
        load_state_timeout: float = 60.0,
        state_chunk_timeout: float = 5.0,
        local_epoch: int = 0,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.opt = optimizer
        self.prefix = prefix
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.params:
            raise ValueError("the optimizer has no parameters")
        for p in self.params:
            if p.device.type != "cpu":
                raise TypeError("zgossip trains CPU parameters only (a parameter is on %s)" % p.device)
        self.param_names = named_tensors(self._model_tensors(), model)
        self.param_layout = ModelLayout.of(self.params, self.param_names)
        if scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            scheduler = scheduler(optimizer)  # a factory, e.g. functools.partial(StepLR, step_size=10)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError("ReduceLROnPlateau needs a metric at every step, which the optimizer does not have: "
                            "step it yourself, or use an epoch-based scheduler")
        self.scheduler = scheduler
        self._check_packable()
        # a resumed run's (checkpoint), else 0: compared with the swarm's on joining
        self.local_epoch = whole_number("local_epoch", local_epoch)
        self.load_state_on_start = bool(load_state_on_start)
        self.in_sync = True
        self.nonfinite_batches = 0
        self.load_state_timeout = float(load_state_timeout)
        self.state_chunk_timeout = float(state_chunk_timeout)
        self._closed = False
        self._averaging = False
        self._downloading = False  # published (wants_state): peers that pause for newcomers hold off meanwhile
        self._holding = False  # published: this peer holds off its next global step for a peer that downloads
        self._param_digest = ""  # published by wrappers whose peers must hold identical parameters
        opts = {**TRAINING_DEFAULTS, **(averager_opts or {})}
        bf16_state_compression(opts, self.params)  # the state served begins with the parameters
        refuse_auxiliary(opts, type(self).__name__)
        self.clock: Clock = clock_of(opts)
        self._lock = self.clock.lock(reentrant=True)
        self._run = run_digest(prefix)
        self._warned_layout: set[str] = set()
        self._next_sync_try = 0.0
        averaged, averaged_names = self._averaged_tensors()
        self.layout = ModelLayout.of(averaged, averaged_names)
        self.averager = ServingAverager(averaged, state_fn=self._current_state, prefix=prefix, listen=listen,
                                        initial_peers=list(initial_peers), **opts)
        self.peer_id = self.averager.peer_id
        self.endpoint = self.averager.endpoint
        self._gossip_interval = float(opts.get("gossip_interval", 0.5))
        try:
            self._update_sharing()
            self._publish()
            wait = startup_timeout if startup_timeout is not None else max(1.0, 5 * self._gossip_interval)
            if initial_peers and wait > 0:
                view = self._await_swarm(wait)
                if view is not None:
                    self._check_layouts(view)
                    if load_state_on_start and view.donor_epoch > self.local_epoch:
                        log.info("%s: the swarm is at epoch %d: loading its state", self.peer_id[:8],
                                 view.donor_epoch)
                        self._try_load_state(view, "joining a run at epoch %d" % view.donor_epoch)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ for subclasses
    def _model_tensors(self) -> list[torch.Tensor]:
        """The model's own tensors, in the order of `params` (they differ when the optimizer steps copies)."""
        return self.params

    def _averaged_tensors(self) -> tuple[list[torch.Tensor], list[str]]:
        raise NotImplementedError

    def _progress_samples(self) -> float:
        return 0.0

    def _progress_rate(self) -> float:
        return 0.0

    def _after_state_loaded(self) -> None:
        """Reset per-epoch bookkeeping after this peer adopted a peer's state."""

    #: what of the wrapper's own progress a checkpoint keeps (`state_dict`), and of which type
    _PROGRESS_KEYS: dict[str, type] = {"local_epoch": int, "in_sync": bool}

    def _progress_state(self) -> dict:
        return {"local_epoch": self.local_epoch, "in_sync": self.in_sync}

    def _restore_progress(self, progress: dict) -> None:
        """Adopt a checkpoint's progress entries (called under the lock, after the optimizer's state loaded)."""
        self.local_epoch = progress["local_epoch"]
        self.in_sync = progress["in_sync"]

    def _check_loaded_state(self, state_dict: dict) -> None:
        """Checks of a checkpoint that only the wrapper knows, before anything is written (raise ValueError)."""

    def _settle_for_load(self, timeout: float | None) -> None:
        """Before a checkpoint loads (without the lock): end what would otherwise land on top of it."""

    # ------------------------------------------------------------------ checkpoints (torch's optimizer API)
    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict, the scheduler's (if this wrapper has one), and the wrapper's
        own progress (the epoch at which it rejoins the swarm, ...): a plain dict for ``torch.save``
        (`zgossip.checkpoint`). Like any optimizer's, it holds no parameters (save the model's
        ``state_dict()`` beside it) and references to the optimizer's tensors: save it between steps."""
        with self._lock:  # a consistent snapshot: no optimizer step or state download is half done
            return checkpoint_dict(wrapper=type(self).__name__, kind=self.kind, optimizer=self.opt,
                                   scheduler=self.scheduler, layout=self.param_layout,
                                   progress=self._progress_state())

    def load_state_dict(self, state_dict: dict, timeout: float | None = None) -> None:
        """Resume from `state_dict()`'s dict: the optimizer's and scheduler's state and the progress. The
        wrapper then behaves as one built with ``local_epoch=`` the checkpoint's: a swarm ahead of it is
        downloaded at the next `step` (as the constructor would), one at it is not. Every check runs before
        anything is written (TypeError, ValueError or `LayoutMismatch` say what is wrong); work in flight
        is settled first as the wrapper documents (``timeout`` bounds that wait). Load the model's own
        ``state_dict()`` too, before or after this."""
        self._raise_if_closed()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout < math.inf):
            raise ValueError(f"timeout must be None (the wrapper's own bound) or a finite number of seconds >= 0, "
                             f"not {timeout!r}: every wait here has a bound")
        progress = check_checkpoint(state_dict, wrapper=type(self).__name__, kind=self.kind, optimizer=self.opt,
                                    scheduler=self.scheduler, layout=self.param_layout,
                                    progress_keys=self._PROGRESS_KEYS)
        self._check_loaded_state(state_dict)
        self._settle_for_load(timeout)
        with self._lock:  # a newcomer downloading from this peer sees the old state or the new one, never a mix
            self.opt.load_state_dict(state_dict["optimizer"])  # torch's own checks run before it writes
            if self.scheduler is not None:
                self.scheduler.load_state_dict(state_dict["scheduler"])
            self._restore_progress(progress)
        self._update_sharing()
        self._publish()
        log.info("%s: loaded a checkpoint: epoch %d", self.peer_id[:8], self.local_epoch)

    # ------------------------------------------------------------------ state for newcomers
    def _check_packable(self) -> None:
        try:
            pack_state(self._extra_state())
        except TypeError as e:
            raise TypeError(f"optimizer/scheduler state cannot be shared with newcomers: {e}") from None

    def _extra_state(self) -> dict:
        return {"opt": self.opt.state_dict(),
                "sched": self.scheduler.state_dict() if self.scheduler is not None else None}

    def _current_state(self) -> tuple[Any, list[np.ndarray]]:
        with self._lock:
            extra_meta, extra = pack_state(self._extra_state())
            params = copy_arrays(self.params)
            meta = {"kind": self.kind, "epoch": self.local_epoch, "in_sync": self.in_sync,
                    "layout": self.param_layout.as_meta(), "extra": extra_meta}
        return meta, params + extra

    def _apply_state(self, meta: Any, arrays: Sequence[np.ndarray]) -> None:
        """Check a downloaded state against this model, then adopt it (nothing is written on a mismatch)."""
        if not isinstance(meta, dict) or not {"kind", "epoch", "layout", "extra"} <= set(meta):
            raise StateUnavailable("the donor sent a state this wrapper does not understand "
                                   f"(expected a {self.kind} state)")
        if meta["kind"] != self.kind:
            raise StateUnavailable(f"the donor runs a {meta['kind']!r} wrapper, this peer a {self.kind!r} one")
        try:
            theirs = ModelLayout.from_meta(meta["layout"])
        except ValueError:  # a broken donor's: retried later like any failed download, not raised out of step()
            raise StateUnavailable("the donor's state has a malformed layout description (it runs another "
                                   "zgossip, or is broken): nothing was written") from None
        diff = self.param_layout.difference(theirs)
        n = len(self.params)
        if diff is not None or len(arrays) < n:
            raise LayoutMismatch(f"cannot load the donor's state: {diff or 'it holds too few tensors'}. "
                                 "Every peer of a run must build the same model.")
        epoch = meta["epoch"]
        if type(epoch) is not int or epoch < 0:  # a str failed only after this peer chose to load (ValueError)
            raise StateUnavailable(f"the donor's state has epoch {epoch!r}: expected a whole number >= 0")
        for i, (p, a) in enumerate(zip(self.params, arrays[:n])):
            if tuple(p.shape) != tuple(np.shape(a)):  # copy_ would broadcast it into the parameter
                raise StateUnavailable(f"the donor sent {self.param_layout.describe(i)} with shape "
                                       f"{tuple(np.shape(a))}, not {tuple(p.shape)}")
        try:
            extra = unpack_state(meta["extra"], arrays[n:])
        except (ValueError, TypeError, IndexError, KeyError) as e:
            raise StateUnavailable(f"the donor's optimizer/scheduler state is malformed ({type(e).__name__}: {e}): "
                                   "nothing was written") from None
        # torch refuses optimizer state of other param groups, but only once the parameters were written: check first
        mine = [len(g["params"]) for g in self.opt.param_groups]
        groups = extra.get("opt", {}).get("param_groups") if isinstance(extra, dict) else None
        theirs = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) and all(
            isinstance(g, dict) for g in groups) else None
        if theirs != mine:
            raise LayoutMismatch(f"cannot load the donor's optimizer state: its param groups hold {theirs} tensors, "
                                 f"this optimizer's {mine}. Every peer of a run must build the same optimizer "
                                 "(the same param groups, in the same order).")
        loads = self._donor_states(extra)
        with self._lock:
            # the optimizers and the scheduler load first, and all of them or none: torch checks a state as
            # it loads it, and one it refuses (a broken donor's) must leave the parameters, the epoch and
            # every optimizer as they were. Their own state_dict()s put them back (references: loading
            # replaces the tensors, it does not write into them)
            saved = [obj.state_dict() for obj, _ in loads]
            try:
                for obj, state in loads:
                    obj.load_state_dict(state)
            except Exception as e:
                refused = type(obj).__name__
                for (done, _), state in zip(loads, saved):
                    done.load_state_dict(state)
                raise StateUnavailable(f"the donor's {refused} state could not be loaded "
                                       f"({type(e).__name__}: {e}): nothing was written") from None
            with torch.no_grad():
                for p, a in zip(self.params, arrays[:n]):
                    p.copy_(torch.from_numpy(np.asarray(a)))
            self.local_epoch = epoch
            self.in_sync = bool(meta.get("in_sync", True))
            self._after_state_loaded()
        self._update_sharing()
        self._publish()

    def _donor_states(self, extra: dict) -> list[tuple[Any, Any]]:
        """(object, the donor's state_dict for it) for every optimizer and scheduler a downloaded state
        loads (`_apply_state` loads them all or none)."""
        loads = [(self.opt, extra["opt"])]
        if self.scheduler is not None and extra.get("sched") is not None:
            loads.append((self.scheduler, extra["sched"]))
        return loads

    def load_state_from_peers(self, timeout: float | None = None) -> None:
        """Download parameters, optimizer and scheduler state and the epoch from the best peer (the
        highest epoch, in-sync peers first) and adopt them. Raises `StateUnavailable` or `LayoutMismatch`.
        While it downloads, this peer's record says so (``wants_state``), so that peers which pause for
        newcomers (`CollaborativeOptimizer`'s ``catchup_pause``) hold off their next step meanwhile."""
        self._downloading = True
        t0 = self.clock.now()
        try:
            self._publish()
            self._before_download()
            meta, arrays = self.averager.load_state_from_peers(
                timeout=self.load_state_timeout if timeout is None else timeout,
                chunk_timeout=self.state_chunk_timeout, apply=False)
            before = self.local_epoch
            self._downloading = False
            self._apply_state(meta, arrays)  # (publishes the new epoch)
        except BaseException:
            self._downloading = False  # failed: the record says so at once, not at the next step
            self._publish()
            raise
        log.info("%s: loaded state from peers: epoch %d -> %d", self.peer_id[:8], before, self.local_epoch)
        self._after_download(self.clock.now() - t0)

    def _before_download(self) -> None:
        """Called once this peer published that it downloads, before the download begins."""

    def _after_download(self, seconds: float) -> None:
        """Called after a state download of `seconds` was adopted."""

    def _try_load_state(self, view: SwarmView, why: str) -> bool:
        now = self.clock.now()
        if now < self._next_sync_try:
            return False
        try:
            self.load_state_from_peers()
            return True
        except StateUnavailable as e:
            self._next_sync_try = self.clock.now() + max(1.0, 5 * self._gossip_interval)
            log.warning("%s: could not load state from peers (%s): %s; training on and retrying later",
                        self.peer_id[:8], why, e)
            return False

    def _update_sharing(self) -> None:
        # donors are chosen by priority: the newest epoch first, and among equals the in-sync ones
        self.averager.state_sharing_priority = 2.0 * self.local_epoch + (1.0 if self.in_sync else 0.0)

    # ------------------------------------------------------------------ progress
    def _me(self) -> PeerProgress:
        return PeerProgress(self.peer_id, self.local_epoch, self._progress_samples(), self._progress_rate(),
                            self.layout.fingerprint, self.layout.signature, len(self.layout.shapes),
                            in_sync=self.in_sync, nonfinite=self.nonfinite_batches, time=self.clock.wall_time(),
                            averaging=self._averaging, digest=self._param_digest, client=self.averager.client_mode,
                            wants_state=self._downloading, holding=self._holding)

    def _publish(self) -> None:
        self.averager.publish(**progress_record(self._run, self._me()))

    def _view(self, infos: dict | None = None) -> SwarmView:
        return SwarmView.of(self._me(), self.averager.peer_infos() if infos is None else infos, self._run)

    def _await_swarm(self, timeout: float) -> SwarmView | None:
        """Wait (bounded) until a peer of this run has been heard of; its view, or None if nobody was."""
        deadline = self.clock.now() + timeout
        while True:
            view = self._view()
            if len(view.peers) > 1 or view.mismatched:
                return view
            if self.clock.now() >= deadline:
                log.info("%s: no peer of this run heard of within %.1fs; starting alone", self.peer_id[:8], timeout)
                return None
            self.clock.sleep(min(0.02, self._gossip_interval / 4))

    @property
    def mismatched_peers(self) -> dict[str, str]:
        """Live peers of this run whose model differs from this one, with what differs."""
        return {p.peer_id: self.layout.difference_from_digest(p.tensors, p.signature)
                for p in self._view().mismatched}

    def _check_layouts(self, view: SwarmView) -> None:
        for p in view.mismatched:
            if p.peer_id not in self._warned_layout:
                self._warned_layout.add(p.peer_id)
                log.error("%s: peer %s of run %r trains a different model: %s. zgossip never averages with it.",
                          self.peer_id[:8], p.peer_id[:8], self.prefix,
                          self.layout.difference_from_digest(p.tensors, p.signature))
        if view.mismatched and len(view.peers) == 1 and any(p.epoch >= self.local_epoch for p in view.mismatched):
            p = view.mismatched[0]
            raise LayoutMismatch(
                f"this peer's model differs from that of every other peer of run {self.prefix!r} "
                f"({len(view.mismatched)} peer(s), e.g. {p.peer_id[:8]}): "
                f"{self.layout.difference_from_digest(p.tensors, p.signature)}. It cannot average with them: "
                "build the same model on every peer.")

    # ------------------------------------------------------------------ plumbing
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        return self.opt.param_groups

    @property
    def defaults(self) -> dict:
        """The wrapped optimizer's defaults (read by code that inspects optimizers, e.g. Lightning's
        ``LearningRateMonitor``: ``"betas" in optimizer.defaults``)."""
        return self.opt.defaults

    @property
    def num_peers(self) -> int:
        """Live peers training this run with the same model, this one included."""
        return self._view().num_peers

    def shutdown(self) -> None:
        self._closed = True
        self.averager.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise ZGossipError("this optimizer was shut down")
