"""Decentralized SGD / Adam: local optimizer steps, with periodic parameter averaging in the background.

    opt = DecentralizedAdam(model.parameters(), lr=1e-3, prefix="run1", average_every=5,
                            initial_peers=[...])
    for x, y in data:
        loss_fn(model(x), y).backward()
        opt.step()              # a local Adam step; every 5th also starts an averaging round
        opt.zero_grad()

The classic scheme of the Moshpit SGD paper (arXiv 2103.03239) and of decentralized
SGD (Lian et al. 2017): each peer trains on its own, and every ``average_every`` local
steps (or every ``average_period`` seconds, aligned to the wall clock so that peers
start together) it averages its parameters -- and, optionally, named optimizer
statistics such as Adam's ``exp_avg`` / ``exp_avg_sq`` -- with whichever group it
meets. Any `torch.optim.Optimizer` can be wrapped (`DecentralizedOptimizer`).

**Never stepping on half-written parameters.** A round does not average the live
parameters: at the start it copies them (and the statistics) into buffers of its own
and keeps a snapshot; the averager writes its result into those buffers on its own
thread. The result is applied later by *this* thread, between two optimizer steps,
with the delta rule ``x += alpha * (mean - snapshot)`` -- so local progress made while
the round ran is kept rather than overwritten (with no local step in between the mean
is copied exactly). Elements a round could not average hold the snapshot, so their
delta is zero. The donor side of a state download copies parameters under the same
lock as the optimizer step.

**Epochs.** Each peer publishes its epoch and local steps in it; the epoch advances when
the peers at the highest epoch have made ``steps_per_epoch`` steps together, and a peer
behind by at most ``max_epoch_lag`` simply adopts the higher epoch (its scheduler steps
along). A peer further behind -- a newcomer, or one that was paused -- downloads
parameters, optimizer and scheduler state from the best donor.

`DiLoCoOptimizer` (re-exported here; it lives in `zgossip.diloco`) averages pseudo-gradients
instead and steps an outer optimizer on them, synchronously.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
from typing import Any, Callable, Iterable, Sequence

import torch

from .diloco import DiLoCoOptimizer  # DiLoCo (outer steps on averaged pseudo-gradients) lives in its own module
from .errors import ZGossipError
from .trainer import SchedulerLike, TrainerPeer

__all__ = ["DecentralizedOptimizer", "DecentralizedSGD", "DecentralizedAdam", "DiLoCoOptimizer", "init_optimizer_state"]

log = logging.getLogger(__name__)

#: ``average_every``'s default: 1 (every local step), unless ``average_period`` says when instead
_EVERY_STEP_UNLESS_PERIOD: Any = object()


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the lazily built per-parameter state (e.g. Adam's ``exp_avg``) without training.

    Runs one optimizer step on zero gradients, then restores the parameters and the
    gradients and resets ``step`` counters to zero, so the first real step behaves as
    on a fresh optimizer (Adam's statistics start at zero either way).
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(opt.state.get(p) for p in params):
        return
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, s, g in zip(params, saved, grads):
            p.copy_(s)
            p.grad = g
    for st in opt.state.values():
        if "step" in st:
            st["step"] = st["step"].zero_() if isinstance(st["step"], torch.Tensor) else 0


class DecentralizedOptimizer(TrainerPeer):
    """Wrap `optimizer`: local steps, plus background averaging of parameters and named statistics.

    ``average_every`` (local steps) and/or ``average_period`` (seconds) say when a round
    starts (with both, whichever comes first; ``average_every`` defaults to 1, or to None --
    no step-based rounds -- when ``average_period`` is given); a round still running when the
    next is due makes that one skip. ``averaging_alpha``
    moves part way to the mean (1 = all the way). ``steps_per_epoch`` (swarm-wide) and
    ``max_epoch_lag`` define when a peer is too far behind and downloads state. The
    remaining arguments are those of `CollaborativeOptimizer` / `Averager`.

    Rounds run in the background and their result is applied at a later `step` (hivemind's
    ``delay_state_averaging``, on by default); ``last_round["staleness"]`` says how many local
    steps were taken between the snapshot and the application. ``max_staleness`` bounds that:
    a `step` waits for a round that started ``max_staleness`` steps ago (None: never waits).
    ``delay_state_averaging=False`` averages synchronously: the step that starts a round waits
    for it and applies it (staleness 0).

    ``local_epoch``: the epoch to start at when resuming (or `load_state_dict` a checkpoint made with
    `state_dict`): a swarm ahead of it is downloaded, as for a newcomer.
    """

    kind = "decentralized"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        prefix: str,
        average_parameters: bool = True,
        average_opt_statistics: Sequence[str] = (),
        average_every: int | None | object = _EVERY_STEP_UNLESS_PERIOD,
        average_period: float | None = None,
        averaging_alpha: float = 1.0,
        steps_per_epoch: int = 100,
        max_epoch_lag: int = 1,
        scheduler: SchedulerLike = None,
        model: torch.nn.Module | None = None,
        initial_peers: Sequence[str] = (),
        listen: str = "tcp://127.0.0.1:0",
        matchmaking_time: float = 1.0,
        target_group_size: int = 16,
        min_group_size: int = 2,
        averaging_timeout: float | None = None,
        load_state_on_start: bool = True,
        load_state_timeout: float = 60.0,
        state_chunk_timeout: float = 5.0,
        startup_timeout: float | None = None,
        averager_opts: dict | None = None,
        delay_state_averaging: bool = True,
        max_staleness: int | None = None,
        local_epoch: int = 0,
    ) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 (or None)")
        self.delay_state_averaging = bool(delay_state_averaging)
        self.max_staleness = max_staleness
        if not average_parameters and not average_opt_statistics:
            raise ValueError("nothing to average: set average_parameters or name some average_opt_statistics")
        if average_every is _EVERY_STEP_UNLESS_PERIOD:
            # given alone, average_period says when: rounds every step as well made it meaningless
            average_every = None if average_period else 1
        if average_every is None and not average_period:
            raise ValueError("say when to average: average_every (steps) and/or average_period (seconds)")
        if average_every is not None and average_every < 1:
            raise ValueError("average_every must be >= 1")
        if not 0.0 < averaging_alpha <= 1.0:
            raise ValueError("averaging_alpha must be in (0, 1]")
        if steps_per_epoch < 1 or max_epoch_lag < 0:
            raise ValueError("need steps_per_epoch >= 1 and max_epoch_lag >= 0")
        self.average_parameters = bool(average_parameters)
        self.statistics = tuple(average_opt_statistics)
        self.average_every = average_every
        self.average_period = average_period
        self.averaging_alpha = float(averaging_alpha)
        self.steps_per_epoch = int(steps_per_epoch)
        self.max_epoch_lag = int(max_epoch_lag)
        self.local_step = 0
        self.steps_in_epoch = 0
        self.rounds = {"done": 0, "failed": 0, "skipped_busy": 0}
        self.last_round: dict[str, Any] = {}
        self._round: tuple[cf.Future, int, int] | None = None  # (future, generation, local_step at start)
        self._generation = 0
        self._last_round_step = 0
        self._last_round_slot: int | None = None
        self._next_progress = 0.0
        self._infos: dict | None = None
        self._rejoin = False  # a checkpoint was loaded: the next step compares with the swarm as on joining
        opts = dict(averager_opts or {})
        opts.setdefault("matchmaking_time", matchmaking_time)
        opts.setdefault("target_group_size", target_group_size)
        opts.setdefault("min_group_size", min_group_size)
        self.averaging_timeout = averaging_timeout
        super().__init__(optimizer, prefix=prefix, scheduler=scheduler, model=model, initial_peers=initial_peers,
                         listen=listen, averager_opts=opts, load_state_on_start=load_state_on_start,
                         startup_timeout=startup_timeout, load_state_timeout=load_state_timeout,
                         state_chunk_timeout=state_chunk_timeout, local_epoch=local_epoch)

    # ------------------------------------------------------------------ TrainerPeer hooks
    def _targets(self) -> list[torch.Tensor]:
        """The live tensors a round averages (looked up afresh: loading optimizer state replaces them)."""
        out = list(self.params) if self.average_parameters else []
        for name in self.statistics:
            for i, p in enumerate(self.params):
                t = self.opt.state.get(p, {}).get(name)
                if not isinstance(t, torch.Tensor) or t.shape != p.shape or not t.is_floating_point():
                    known = sorted(k for k, v in self.opt.state.get(p, {}).items() if isinstance(v, torch.Tensor))
                    raise ZGossipError(f"optimizer state of {self.param_layout.describe(i)} has no floating-point "
                                       f"statistic {name!r} shaped like the parameter (it has: {known})")
                out.append(t)
        return out

    def _averaged_tensors(self) -> tuple[list[torch.Tensor], list[str]]:
        if self.statistics:
            init_optimizer_state(self.opt)
        targets = self._targets()
        names = list(self.param_names) if self.average_parameters else []
        names += [f"{n}:{s}" for s in self.statistics for n in self.param_names]
        self._bufs = [t.detach().clone().contiguous() for t in targets]
        self._snaps = [b.clone() for b in self._bufs]
        return self._bufs, names

    def _progress_samples(self) -> float:
        return float(self.steps_in_epoch)

    def _after_state_loaded(self) -> None:
        self._generation += 1  # a round still running averaged the old model: its result is dropped
        self.steps_in_epoch = 0

    # ------------------------------------------------------------------ checkpoints
    # Kept: the epoch, the local steps (the average_every schedule and the statistics' step counts go on
    # from there) and the steps made in the epoch (they are in the parameters, and count toward it).
    # Not kept: a round in flight (its result is dropped when a checkpoint loads, as when a state is
    # downloaded), the round counters and `last_round` (statistics of this process).
    _PROGRESS_KEYS = {**TrainerPeer._PROGRESS_KEYS, "local_step": int, "steps_in_epoch": int}

    def _progress_state(self) -> dict:
        return {**super()._progress_state(), "local_step": self.local_step, "steps_in_epoch": self.steps_in_epoch}

    def _check_loaded_state(self, state_dict: dict) -> None:
        # a round averages these statistics: loaded without them, the next round would raise mid-training
        saved = state_dict["optimizer"]["state"]
        for name in self.statistics:
            for i, p in enumerate(self.params):  # torch numbers the parameters across groups, in this order
                t = saved.get(i, {}).get(name) if isinstance(saved.get(i), dict) else None
                if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                    raise ValueError(f"the state dict's optimizer state has no statistic {name!r} shaped like "
                                     f"{self.param_layout.describe(i)}, and this wrapper averages it "
                                     f"(average_opt_statistics={self.statistics}): load a checkpoint of a wrapper "
                                     "that averages the same statistics")

    def _restore_progress(self, progress: dict) -> None:
        super()._restore_progress(progress)
        self.local_step = progress["local_step"]
        self.steps_in_epoch = progress["steps_in_epoch"]
        self._last_round_step = self.local_step
        self._generation += 1  # a round in flight averaged the state being replaced: its result is dropped
        self._infos = None  # the next step reads the swarm afresh
        self._rejoin = self.load_state_on_start

    # ------------------------------------------------------------------ public
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One local optimizer step; applies a finished averaging round first, starts one if due."""
        self._raise_if_closed()
        self._collect()
        if self._round is not None and self.max_staleness is not None \
                and self.local_step - self._round[2] >= self.max_staleness:
            self._collect(wait=True)  # the bound: no further step on parameters this old
        with self._lock:
            loss = self.opt.step(closure)
        self.local_step += 1
        self.steps_in_epoch += 1
        self._track_epoch()
        if self._due():
            self._start_round()
            if not self.delay_state_averaging:
                self._collect(wait=True)
        return loss

    def average(self, wait: bool = True, timeout: float | None = None, round: int | None = None) -> Any:
        """Average now (outside the schedule). With `wait`, block until the round ended and apply its
        result; return the `StepResult`, or None if the round failed (logged). Without, return the
        Future; the result is applied at the next `step` (or `average` / `apply_pending`).
        ``round`` pins the round number (`Averager.step`): peers that pass the same one meet only each
        other, e.g. for a final round that no scheduled round can join."""
        self._raise_if_closed()
        if self._round is not None:
            self._collect(wait=True, timeout=timeout)
        fut = self._start_round(timeout, round)
        if not wait:
            return fut
        return self._collect(wait=True, timeout=timeout)

    def apply_pending(self, wait: bool = False, timeout: float | None = None) -> Any:
        """Apply the result of a finished (with `wait`: of the running) round; its `StepResult` or None."""
        return self._collect(wait=wait, timeout=timeout)

    # ------------------------------------------------------------------ rounds
    def _due(self) -> bool:
        if self._round is not None:
            due = (self.average_every is not None and self.local_step - self._last_round_step >= self.average_every)
            if due:
                self.rounds["skipped_busy"] += 1
                self._last_round_step = self.local_step
            return False
        if self.average_every is not None and self.local_step - self._last_round_step >= self.average_every:
            return True
        if self.average_period:
            slot = int(self.clock.wall_time() // self.average_period)  # the wall clock, so that peers start together
            if self._last_round_slot is None:
                self._last_round_slot = slot
            return slot != self._last_round_slot
        return False

    def _start_round(self, timeout: float | None = None, round: int | None = None) -> cf.Future:
        targets = self._targets()
        with torch.no_grad(), self.averager.get_tensors():  # no round is running: nothing else writes here
            for buf, snap, t in zip(self._bufs, self._snaps, targets):
                buf.copy_(t)
                snap.copy_(t)
        self._last_round_step = self.local_step
        if self.average_period:
            self._last_round_slot = int(self.clock.wall_time() // self.average_period)
        fut = self.averager.step(weight=1.0, gather={"ep": self.local_epoch},
                                 timeout=timeout or self.averaging_timeout, wait=False, round=round)
        self._round = (fut, self._generation, self.local_step)
        return fut

    def _collect(self, wait: bool = False, timeout: float | None = None) -> Any:
        if self._round is None:
            return None
        fut, generation, started = self._round
        if not wait and not fut.done():
            return None
        if timeout is None:  # the averager bounds matchmaking and the all-reduce; this only guards against a bug
            cfg = self.averager.config
            timeout = (self.averaging_timeout or max(5.0, 3 * cfg.matchmaking_time)) + cfg.allreduce_timeout + 30.0
        try:
            result = self.clock.result(fut, timeout)
        except cf.TimeoutError:
            log.warning("%s: averaging round still running after %.0fs; its result will be applied later",
                        self.peer_id[:8], timeout)
            return None
        except ZGossipError as e:
            self._round = None
            self.rounds["failed"] += 1
            self.last_round = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            log.info("%s: averaging round failed: %s", self.peer_id[:8], e)
            return None
        self._round = None
        if generation != self._generation:
            return None  # state was loaded from a peer while the round ran
        targets = self._targets()
        with self._lock, torch.no_grad(), self.averager.get_tensors():
            for t, buf, snap in zip(targets, self._bufs, self._snaps):
                if self.averaging_alpha == 1.0 and torch.equal(t, snap):
                    t.copy_(buf)  # nothing changed since the snapshot: take the mean exactly
                elif t.dtype in (torch.float16, torch.bfloat16):
                    # in float32: the difference of two fp16 values overflows to inf past 65504 (a mean of
                    # 40000 against a snapshot of -40000), and one rounding at the end beats two
                    t.copy_(t.float().add_(buf.float() - snap.float(), alpha=self.averaging_alpha))
                else:
                    t.add_(buf - snap, alpha=self.averaging_alpha)
        self.rounds["done"] += 1
        self.last_round = {"ok": True, "group_size": len(result.members), "complete": result.complete,
                           "seconds": result.timings.get("total"),
                           "staleness": self.local_step - started}  # local steps since the snapshot
        return result

    # ------------------------------------------------------------------ epochs
    def _track_epoch(self) -> None:
        now = self.clock.now()
        fresh = now >= self._next_progress or self._infos is None
        if fresh:  # reading the records is a round trip to the I/O thread: a few times per gossip interval
            self._next_progress = now + self._gossip_interval / 2
            self._infos = self.averager.peer_infos()
        view = self._view(self._infos)
        if fresh:
            self._check_layouts(view)
        top = view.max_epoch
        epoch = self.local_epoch
        # after a checkpoint loaded, the swarm is compared with as on joining (the constructor loads the state of
        # a swarm ahead at all); afterwards within max_epoch_lag the epoch is only adopted
        lag, self._rejoin = (0 if self._rejoin else self.max_epoch_lag), False
        if view.donor_epoch > epoch + lag:  # (a client ahead serves no state: followed below)
            self._try_load_state(view, f"{view.donor_epoch - epoch} epochs behind (max_epoch_lag={lag})")
            self._infos = None
            return
        if top > epoch:
            self._advance_to(top)
            view = self._view(self._infos)
        if view.samples_at(self.local_epoch) >= self.steps_per_epoch:
            self._advance_to(self.local_epoch + 1)
        if fresh or self.local_epoch != epoch:
            self._publish()

    def _advance_to(self, epoch: int) -> None:
        with self._lock:
            while self.local_epoch < epoch:
                if self.scheduler is not None:
                    self.scheduler.step()
                self.local_epoch += 1
            self.steps_in_epoch = 0
        self._update_sharing()

    def shutdown(self) -> None:
        super().shutdown()


def _params(params: Iterable[Any]) -> list:
    return list(params)


class DecentralizedSGD(DecentralizedOptimizer):
    """`torch.optim.SGD` with periodic parameter averaging (decentralized SGD, Lian et al. 2017, on Moshpit
    All-Reduce). Add ``average_opt_statistics=("momentum_buffer",)`` to average the momentum too."""

    def __init__(self, params: Iterable[Any], lr: float, *, prefix: str, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, **kwargs: Any) -> None:
        opt = torch.optim.SGD(_params(params), lr=lr, momentum=momentum, dampening=dampening,
                              weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(opt, prefix=prefix, **kwargs)


class DecentralizedAdam(DecentralizedOptimizer):
    """`torch.optim.Adam` with periodic averaging of the parameters and of Adam's statistics
    ``exp_avg`` and ``exp_avg_sq`` (plus ``max_exp_avg_sq`` with amsgrad); without them the
    peers' adaptive learning rates drift apart."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, *, prefix: str,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, average_opt_statistics: Sequence[str] | None = None,
                 **kwargs: Any) -> None:
        opt = torch.optim.Adam(_params(params), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                               amsgrad=amsgrad)
        if average_opt_statistics is None:
            average_opt_statistics = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        super().__init__(opt, prefix=prefix, average_opt_statistics=average_opt_statistics, **kwargs)
