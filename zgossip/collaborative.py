"""Collaborative training with a global batch size: many peers, one large-batch optimizer.

    opt = CollaborativeOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), prefix="run1",
                                 target_batch_size=4096, batch_size=32, initial_peers=[...])
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()          # accumulates; every ~target_batch_size samples swarm-wide: one global step
        opt.zero_grad()

Each `step` adds this batch's gradients, times its size, to a local accumulator and
publishes the peer's progress (epoch, samples accumulated, throughput) by gossip. When
the samples that all peers at this epoch hold together reach ``target_batch_size``, every
peer joins one averaging round: it contributes its mean gradient with weight = its
samples, so the result is the mean gradient over every sample the swarm saw -- exactly
what one process would compute on the global batch. Then each peer takes the same
optimizer step from the same parameters (the all-reduce hands every member identical
bits) and advances its epoch; an LR scheduler steps once per epoch.

What can go wrong, and what happens (the issue's rules, plus what it left open):

* **Averaging fails** (no group, a timeout): if other peers finished the epoch without
  us, our gradients are stale -- we load their state instead. Otherwise we step with our
  local gradients, say so in the log, and mark ourselves out of sync (published): at the
  next `step` we download the state of an in-sync peer at our epoch. If nobody is in sync
  (everyone failed), the lowest peer id among the diverged ones declares itself the
  reference so the swarm converges again.
* **A partial round** (a member died mid-round and part of the vector kept local
  values) is treated the same way: step, then resynchronise.
* **Silent drift** (peers that started from different initialisations, or a swarm that
  split into several groups because ``target_group_size`` is smaller than the swarm):
  each peer publishes a digest of a strided sample of its parameters; at one epoch the
  largest set of equal digests (ties: the one holding the lowest peer id) is the
  reference and every other peer marks itself out of sync and downloads the state.
* **Behind** (a newcomer, or a peer that missed a round): the swarm is at a higher epoch,
  so we load parameters, optimizer and scheduler state and the epoch from the best donor. Its
  record says it downloads; the others hold off their next global step meanwhile (at most
  ``catchup_pause`` seconds per catch-up), so that a download longer than a global step does not
  find the swarm epochs ahead again, and no round waits for it.
* **NaN/inf gradients** in a local batch: the batch is dropped (not accumulated), the
  peer logs which tensor was bad and publishes a counter; it still joins the round with
  nothing to contribute (weight ~0), so it receives everyone else's average and stays in
  sync. If the *averaged* gradients are non-finite (a peer sent NaN without flagging
  it), every member of the group sees the same bits and skips the step in the same way.
* **A different model** on some peer: the averager never groups different layouts; the
  published layout digest lets each peer name the tensor that differs (logged), and a
  peer whose model matches nobody else's raises `LayoutMismatch`.

Rounds are keyed by the prefix alone (the core has no per-step key), so peers of
different epochs can meet in one round (a peer whose records lagged finishes an epoch the
others already ended). Each round is bounded to a single matchmaking window, and every
member gathers every member's epoch: the members at the newest epoch step (together, on
the same bits), a member behind it does not step and keeps its epoch, marks itself out of
sync and downloads the state at its next `step` -- so at any epoch number, the peers that
report it in sync hold the same parameters.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .errors import RoundTimeout, ZGossipError
from .overlap import OffloadedParams, PendingUpdate
from .progress import SwarmView, reference_digest
from .trainer import SchedulerLike, TrainerPeer, first_nonfinite, params_digest
from .training_state import LayoutMismatch

__all__ = ["CollaborativeOptimizer", "GlobalProgress"]

log = logging.getLogger(__name__)

_NOTHING = 1e-9  # the weight of a member that contributes no samples: it receives the mean, adds nothing


def _count(name: str, value: Any, least: int) -> int:
    """A sample count as an int >= `least` (an int, or a float holding one), or ValueError naming it."""
    n = None
    if not isinstance(value, (bool, str)):
        try:
            n = operator.index(value)  # int, numpy and 0-d torch integers
        except TypeError:
            if isinstance(value, float) and value.is_integer():
                n = int(value)
    if n is None or n < least:
        raise ValueError(f"{name} must be a whole number of samples >= {least}, not {value!r}")
    return n


@dataclass(frozen=True)
class GlobalProgress:
    """The swarm as this peer sees it (records travel by gossip, so they lag by a few gossip intervals)."""

    epoch: int  # the highest epoch of any peer training this model
    samples_accumulated: float  # samples the peers at `epoch` hold toward the next step
    target_batch_size: int
    num_peers: int  # live peers training this model, this one included
    samples_per_second: float  # summed throughput of the peers at `epoch`
    eta_next_epoch: float  # seconds until the target is reached at that rate (inf if unknown)


class CollaborativeOptimizer(TrainerPeer):
    """Wrap `optimizer` so that peers with the same `prefix` take one step per `target_batch_size`
    samples seen swarm-wide (see the module docstring).

    ``batch_size`` is the default for `step`; ``scheduler`` (an LR scheduler or a factory
    ``optimizer -> scheduler``) steps once per epoch; ``model`` (optional) only names
    tensors in messages. ``matchmaking_time`` is the window in which the peers of an epoch
    gather: it must exceed the spread of the moments they notice the target was reached
    (gossip lag plus one local step). ``target_group_size`` caps a group; set it to the
    number of peers you expect, so that a group forms as soon as all have joined instead of
    when the window closes. More peers than that would average in separate groups and
    drift apart (then resynchronise), so keep it at least the swarm size. Other
    `Averager` settings go in ``averager_opts``.

    Overlapped averaging (hivemind's options, same meanings): ``delay_optimizer_step`` runs the
    optimizer step on a worker, on the optimizer's own copy of the parameters
    (``offload_optimizer``, implied), and copies the new parameters into the model at the first
    `step` after it finished; ``delay_grad_averaging`` (needs ``delay_optimizer_step``) runs the
    gradient round there too, so averaging overlaps the next batches' compute. Those batches are
    computed on parameters one global step old; at most one update is ever in flight, so the
    staleness is at most one global step, and ``last_round["staleness"]`` reports it (batches,
    seconds, and how long the step that applied it ``waited`` for it). When this peer has
    accumulated its share of the next global batch (as many samples as it gave the update in
    flight) before that update finished, `step` waits for it rather than compute on older
    parameters. `apply_pending` waits for the update in flight and applies it (e.g. before a
    checkpoint). ``delay_state_averaging``: when this peer must resynchronise (behind, out of
    sync), it downloads the swarm's state in the background and adopts it at a later `step`
    (batches computed meanwhile are dropped: they belong to the old model), instead of blocking.

    ``pre_schedule``: when the swarm is about one matchmaking window from the global batch
    (by its gossiped throughput), start matchmaking for the round already (a triggered step,
    `zgossip.StepControl`) and trigger it when the target is reached, so the all-reduce begins
    then instead of a matchmaking window later. If the pre-scheduled step fails before its
    trigger (no group in time), the round falls back to a plain step.

    ``local_epoch``: the epoch to start at, when resuming from a checkpoint that saved it with the
    optimizer's state (the Lightning strategy does): a swarm behind it downloads this peer's state, a
    swarm ahead of it is downloaded as usual.

    ``catchup_pause``: while a peer downloads the state (a newcomer, a peer behind or out of sync; its
    record says so), hold off the next global step for it, for at most this many seconds per catch-up
    (renewed only once it was seen caught up or gone; 0: never hold), so that a swarm whose global step
    is shorter than the download does not outrun it. Batches keep accumulating meanwhile: the step
    after a pause averages more samples than ``target_batch_size``. Set it above a newcomer's download
    time, the same on every peer (a newcomer still behind after a download logs that time). A round
    never waits for a downloading peer: a peer left alone with one steps alone.
    """

    kind = "collaborative"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        prefix: str,
        target_batch_size: int,
        batch_size: int | None = None,
        scheduler: SchedulerLike = None,
        model: torch.nn.Module | None = None,
        initial_peers: Sequence[str] = (),
        listen: str = "tcp://127.0.0.1:0",
        matchmaking_time: float = 1.0,
        target_group_size: int = 64,
        min_group_size: int = 2,
        matchmaking_timeout: float | None = None,
        allreduce_timeout: float = 60.0,
        load_state_on_start: bool = True,
        load_state_timeout: float = 60.0,
        state_chunk_timeout: float = 5.0,
        startup_timeout: float | None = None,
        averager_opts: dict | None = None,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = False,
        offload_optimizer: bool | None = None,
        pre_schedule: bool = False,
        local_epoch: int = 0,
        catchup_pause: float = 10.0,
    ) -> None:
        target_batch_size = _count("target_batch_size", target_batch_size, 1)
        if isinstance(catchup_pause, bool) or not isinstance(catchup_pause, (int, float)) or not (
                0 <= catchup_pause < math.inf):
            raise ValueError(f"catchup_pause must be a finite number of seconds >= 0 (0: never pause for a "
                             f"downloading peer), not {catchup_pause!r}")
        self.catchup_pause = float(catchup_pause)
        self._catchup_seen: dict[str, float] = {}  # downloading peer -> when this peer began to hold for it
        local_epoch = _count("local_epoch", local_epoch, 0)
        if batch_size is not None:
            batch_size = _count("batch_size", batch_size, 0)
        if delay_optimizer_step is None:
            delay_optimizer_step = bool(delay_grad_averaging)
        if delay_grad_averaging and not delay_optimizer_step:
            raise ValueError("delay_grad_averaging needs delay_optimizer_step=True: the optimizer step waits for "
                             "the averaged gradients, so it must run in the background too")
        if offload_optimizer is None:
            offload_optimizer = bool(delay_optimizer_step)
        if delay_optimizer_step and not offload_optimizer:
            raise ValueError("delay_optimizer_step needs offload_optimizer: the optimizer steps its own copy of the "
                             "parameters while the model computes the next batches with the current ones")
        self._delay_optimizer_step = bool(delay_optimizer_step)
        self._delay_grad_averaging = bool(delay_grad_averaging)
        self.delay_state_averaging = bool(delay_state_averaging)
        # the optimizer steps copies of the parameters; the model's tensors are updated from them between batches
        self._offload = OffloadedParams(optimizer) if offload_optimizer else None
        self._pending: PendingUpdate | None = None
        self._download: cf.Future | None = None  # a background state download (delay_state_averaging)
        self._worker: Any = None
        self.target_batch_size = int(target_batch_size)
        self.batch_size = batch_size
        self.samples = 0  # accumulated toward the next epoch on this peer
        self.last_round: dict[str, Any] = {}
        self._epoch_nonfinite = 0
        self._phases: dict[str, float] = {}
        self._rate = 0.0
        self._last_step_time: float | None = None
        self._grads: list[torch.Tensor] = []
        self._acc_stale = True  # the accumulators hold nothing of this epoch yet (whatever their contents)
        self.pre_schedule = bool(pre_schedule)
        self._target_checked = False  # `_check_target` warned, or found the target long enough
        self._scheduled: Any = None  # the pre-scheduled round's StepControl (pre_schedule)
        self._model_loaded = False  # a checkpoint was loaded: the model's tensors (maybe loaded later) are the truth
        opts = dict(averager_opts or {})
        opts.setdefault("matchmaking_time", matchmaking_time)
        opts.setdefault("target_group_size", target_group_size)
        opts.setdefault("min_group_size", min_group_size)
        opts.setdefault("allreduce_timeout", allreduce_timeout)
        mm, rq = float(opts["matchmaking_time"]), float(opts.get("request_timeout", 0.5))
        # one matchmaking window, not several: a later window could hold peers of the next epoch
        self.matchmaking_timeout = matchmaking_timeout if matchmaking_timeout is not None else mm + 2 * rq + 0.5
        super().__init__(optimizer, prefix=prefix, scheduler=scheduler, model=model, initial_peers=initial_peers,
                         listen=listen, averager_opts=opts, load_state_on_start=load_state_on_start,
                         startup_timeout=startup_timeout, load_state_timeout=load_state_timeout,
                         state_chunk_timeout=state_chunk_timeout, local_epoch=local_epoch)
        self._started = True  # from now on, delay_state_averaging downloads in the background

    # ------------------------------------------------------------------ TrainerPeer hooks
    def _averaged_tensors(self) -> tuple[list[torch.Tensor], list[str]]:
        self._param_digest = params_digest(self.params, self.local_epoch)  # published from the first record on
        self._grads = [torch.zeros(p.shape, dtype=p.dtype) for p in self.params]
        # the gradients accumulate where the round averages them, unless a delayed round may still be
        # averaging the previous epoch's while this one's accumulate, or the parameters are float16/bfloat16:
        # their sums accumulate in float32 (in bfloat16 a sum stops growing once it is 256 times the batch's
        # gradient, 2**8: the mean of 512 equal gradients came out halved; in float16 a sum of finite
        # gradients overflows to inf past 65504), and the epoch's mean is rounded to their dtype once
        self._acc = [torch.zeros(g.shape, dtype=torch.float32) if g.dtype in (torch.float16, torch.bfloat16)
                     else torch.zeros_like(g) if self.delay_optimizer_step else g for g in self._grads]
        return self._grads, list(self.param_names)

    def _model_tensors(self) -> list[torch.Tensor]:
        return self.model_params

    @property
    def param_groups(self) -> list:
        """The optimizer's param groups; offloaded, with the model's tensors (which hold the gradients) as
        ``"params"`` and the other entries the optimizer's own (`zgossip.overlap.ModelParamGroup`), so that
        gradient clipping over ``param_groups`` (Lightning's ``gradient_clip_val``) clips what is accumulated."""
        return self._offload.model_param_groups if self._offload is not None else self.opt.param_groups

    @property
    def model_params(self) -> list[torch.Tensor]:
        """The tensors the model computes with (the optimizer's own copies when offloaded)."""
        return self._offload.model_params if self._offload is not None else self.params

    def _progress_samples(self) -> float:
        if self._pending is not None:  # still in the round of the epoch it ends
            return float(self._pending.samples)
        return float(self.samples)

    def _progress_rate(self) -> float:
        return self._rate

    def _before_download(self) -> None:
        """A synchronous download waits (bounded) until every other peer holds off its next global step
        for it (their records say so): the state it then downloads is the swarm's newest, and stays so
        while the download lasts, up to `catchup_pause` -- one download instead of one per global step
        that a download outlasts. Without the wait, a step taken before they heard of it already made
        the state it downloads one epoch old. A peer holds when it next steps, after our record
        reached it (a few gossip intervals): the wait is that long, and one matchmaking timeout
        longer only while a peer is in a round (it holds once the round is over). A peer that does
        not step (one that only serves, or is at rest) never holds, and is not waited for longer:
        peers idle beside a newcomer cost its every download 2.3 s (a test's swarm)."""
        if self.catchup_pause <= 0:
            return
        start = self.clock.now()
        hear = min(self.catchup_pause / 2, 4 * self._gossip_interval)
        rounds = min(self.catchup_pause / 2, 4 * self._gossip_interval + self.matchmaking_timeout)
        while True:
            others = [p for p in self._view().others() if not p.wants_state]
            if all(p.holding and not p.averaging for p in others):
                return
            waited = self.clock.now() - start
            if waited >= rounds or (waited >= hear and not any(p.averaging for p in others)):
                return
            self.clock.sleep(min(0.02, self._gossip_interval / 4))

    def _after_download(self, seconds: float) -> None:
        view = self._view()
        if view.donor_epoch > self.local_epoch:
            log.warning("%s: the state download took %.1fs and the swarm is at epoch %d already (this peer: %d), so "
                        "this peer downloads again. Peers hold off their next global step for a downloading peer for "
                        "at most catchup_pause=%gs per catch-up: set catchup_pause above the download's time on every "
                        "peer (or raise target_batch_size)", self.peer_id[:8], seconds, view.donor_epoch,
                        self.local_epoch, self.catchup_pause)

    def _paused(self, view: SwarmView) -> bool:
        """Whether to hold off the next global step for a peer that downloads the state (its record says
        so): for at most `catchup_pause` seconds per catch-up, counted from when this peer first saw it
        download, and renewed only once it was seen caught up (done, at this peer's epoch or later) or gone.
        Without it a swarm whose global step is shorter than a newcomer's download is epochs ahead each
        time the download ends, and the newcomer downloads again and again."""
        if self.catchup_pause <= 0:
            return False
        now = self.clock.now()
        live = {p.peer_id: p for p in view.others()}
        for pid in list(self._catchup_seen):
            p = live.get(pid)
            if p is None or (not p.wants_state and p.epoch >= self.local_epoch):
                del self._catchup_seen[pid]  # gone, or caught up: a later catch-up gets its own pause
        for p in live.values():
            if p.wants_state:
                self._catchup_seen.setdefault(p.peer_id, now)
        return any(live[pid].wants_state and now - t < self.catchup_pause for pid, t in self._catchup_seen.items())

    @staticmethod
    def _expected_peers(view: SwarmView) -> int:
        """The peers a round of this epoch waits for: every live peer of the run (this one included) but
        those downloading the state -- they join no round until their download ends, so a round that
        counted them failed (a peer left alone with one marked itself out of sync every round)."""
        return view.num_peers - sum(1 for p in view.others() if p.wants_state)

    def _after_state_loaded(self) -> None:
        if self._offload is not None:
            self._offload.copy_to_model()
        self._drop_scheduled()  # a round pre-scheduled for the epoch we left
        self._param_digest = params_digest(self.params, self.local_epoch)
        self._model_loaded = False  # the downloaded parameters are in the model now
        self.samples = 0
        self._epoch_nonfinite = 0
        self._acc_stale = True

    # ------------------------------------------------------------------ checkpoints
    # Kept (beyond the optimizer's and scheduler's state): the epoch and whether this peer was in sync.
    # Not kept: the gradients accumulated toward the next global step and their sample count (a resumed
    # peer starts the epoch with none: they are as large as the model, and by the time it is back the
    # swarm has usually taken that step without them), an update in flight (`state_dict` applies it first,
    # `load_state_dict` waits for it and discards it), a background download or pre-scheduled round
    # (dropped on loading), and counters of this process (nonfinite_batches, last_round).
    def state_dict(self) -> dict:
        """See `TrainerPeer.state_dict`. An update in flight (``delay_optimizer_step``) is applied first
        (waiting for it), so the checkpoint holds the newest optimizer state and the epoch it belongs to,
        and the model the parameters; the gradients accumulated toward the next global step are not saved."""
        self.apply_pending(wait=True)
        return super().state_dict()

    def _settle_for_load(self, timeout: float | None) -> None:
        pending = self._pending
        if pending is not None:
            # its optimizer step writes the optimizer's state under the lock: it must end before a checkpoint
            # loads, else it would land on top. Its result is discarded: the checkpoint replaces it
            bound = timeout if timeout is not None else (self.matchmaking_timeout
                                                         + self.averager.config.allreduce_timeout + 30.0)
            if pending.future is not None and not self.clock.wait(pending.future, bound):
                raise RoundTimeout(f"the delayed update of epoch {pending.epoch} is still running after {bound:g}s: "
                                   "nothing was loaded. Call load_state_dict again once it ended (apply_pending() "
                                   "waits for it)")
            self._pending = None
            self._averaging = False
            log.info("%s: the delayed update of epoch %d is discarded: a checkpoint replaces it", self.peer_id[:8],
                     pending.epoch)
        if self._download is not None:
            self._download = None  # its state will not be adopted: the next step compares with the swarm anew
            self._downloading = False
        self._drop_scheduled()  # a round pre-scheduled for the epoch being replaced

    def _restore_progress(self, progress: dict) -> None:
        super()._restore_progress(progress)
        self.samples = 0
        self._epoch_nonfinite = 0
        self._acc_stale = True
        # the parameters are the model's (its own state_dict, loaded before or after this): the optimizer's
        # copies (offloaded) and the published digest follow them at the next step, or when a state is served
        self._model_loaded = True
        self._param_digest = params_digest(self.model_params, self.local_epoch)

    def _adopt_model_params(self) -> None:
        if not self._model_loaded:
            return
        with self._lock:
            if self._offload is not None:
                self._offload.copy_to_optimizer()
            self._param_digest = params_digest(self.params, self.local_epoch)
            self._model_loaded = False

    def _current_state(self) -> tuple[Any, list]:
        with self._lock:
            self._adopt_model_params()
            return super()._current_state()

    # ------------------------------------------------------------------ public
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (`opt`), under the name Lightning's ``LearningRateMonitor`` reads on
        wrapping optimizers: its curves keep the optimizer's name (``lr-AdamW``), and an optimizer with a
        scheduler is logged once (as the scheduler's), not a second time as ``lr-CollaborativeOptimizer``."""
        return self.opt

    @property
    def delay_optimizer_step(self) -> bool:
        """Fixed at construction: it decides where the gradients accumulate (apart from the round's
        tensors, or in them) and whether the optimizer steps its own copy of the parameters."""
        return self._delay_optimizer_step

    @delay_optimizer_step.setter
    def delay_optimizer_step(self, value: bool) -> None:
        # switched mid-run, the synchronous path would step on the previous epoch's averaged gradients
        # (the new ones accumulate elsewhere), or a background step would write the model's own tensors
        raise AttributeError("delay_optimizer_step is fixed when the CollaborativeOptimizer is made (it decides where "
                             "gradients accumulate); build a new one to change it")

    @property
    def delay_grad_averaging(self) -> bool:
        """Whether the gradient round runs on the worker too; may change between steps (needs
        ``delay_optimizer_step``)."""
        return self._delay_grad_averaging

    @delay_grad_averaging.setter
    def delay_grad_averaging(self, value: bool) -> None:
        if value and not self._delay_optimizer_step:
            raise ValueError("delay_grad_averaging needs delay_optimizer_step=True, which is fixed when the "
                             "CollaborativeOptimizer is made")
        self._delay_grad_averaging = bool(value)

    @property
    def global_progress(self) -> GlobalProgress:
        view = self._view()
        ep = view.max_epoch
        have, rate = view.estimate_at(ep, self.clock.wall_time(), 4 * self._gossip_interval), view.rate_at(ep)
        left = max(0.0, self.target_batch_size - have)
        eta = left / rate if rate > 0 else (0.0 if left == 0 else float("inf"))
        return GlobalProgress(ep, have, self.target_batch_size, view.num_peers, rate, eta)

    def synchronize(self) -> bool:
        """Compare with the swarm now (not only at the next `step`): if this peer is behind, out of sync,
        or holds parameters that differ from the reference at its epoch, load the swarm's state.
        True if it did. Useful before saving a checkpoint, or at the end of training."""
        self._raise_if_closed()
        self.apply_pending(wait=True)
        self._adopt_model_params()
        view = self._view()
        self._check_layouts(view)
        return self._resync_if_needed(view)

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:
        """Accumulate this batch's gradients (``p.grad``, from a loss averaged over `batch_size`
        samples); when the swarm reached the target, average and take one optimizer step (after
        which ``p.grad`` is None, as after ``zero_grad()``)."""
        self._raise_if_closed()
        self._adopt_model_params()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        bs = batch_size if batch_size is not None else self.batch_size
        if bs is None:
            raise ValueError("give step() a batch_size (or the constructor a default batch_size)")
        bs = _count("batch_size", bs, 0)
        if self._download is not None:  # a background resynchronisation (delay_state_averaging)
            if not self._download.done():
                return loss  # this batch belongs to the model being replaced
            self._finish_download()
            return loss
        accumulated = False
        if self._pending is not None:  # a delayed update: apply it at this boundary if it is ready
            pending = self._pending
            pending.stale_batches += 1  # this batch, too, was computed on the parameters it replaces
            if not pending.done():
                self._accumulate(int(bs))  # toward the next epoch
                accumulated = True
                if self.samples < max(pending.samples, 1):
                    return loss
                # this peer's share of the next global batch is ready (as many samples as it gave the one in
                # flight): more batches would only swell that batch on older parameters, so wait (bounded)
                # for the update in flight; at most one global step of staleness, never two
            self._commit_pending()
        t0 = self.clock.now()
        infos = self.averager.peer_infos()
        view = self._view(infos)
        self._check_layouts(view)
        if self._resync_if_needed(view):
            return loss  # this batch's gradients belonged to a model we no longer have
        t1 = self.clock.now()
        if not accumulated:
            self._accumulate(int(bs))
        self._phases = {"read_progress": t1 - t0, "accumulate": self.clock.now() - t1}
        view = self._view(infos)
        self._check_target(view)
        # records lag by the gossip delay: extrapolate them with each peer's throughput, and follow
        # any peer that already entered the round, so that the peers of an epoch meet in one window
        horizon = 4 * self._gossip_interval
        # a peer downloads the state: hold off the next global step (bounded, `_paused`), unless another peer
        # already entered this epoch's round (then follow it: the peers of an epoch meet in one round)
        self._holding = self._paused(view) and not view.averaging_at(self.local_epoch)
        if not self._holding and (
                view.estimate_at(self.local_epoch, self.clock.wall_time(), horizon) >= self.target_batch_size
                or view.averaging_at(self.local_epoch)):
            self._finish_epoch(view)
        else:
            self._publish()
            if self.pre_schedule and not self._holding:
                self._maybe_pre_schedule(view)
        return loss

    # ------------------------------------------------------------------ internals
    def _check_target(self, view: SwarmView) -> None:
        """Warn once when the swarm fills `target_batch_size` in under 5 gossip intervals (docs/training.md:
        records arrive a few intervals late, so such a global step is decided on a guess -- two fast
        peers with a target of 256 took 32-384 samples per step). Decided once, at the third epoch
        this peer takes part in with others: by then the records carry measured throughputs."""
        if self._target_checked or view.num_peers < 2 or self.local_epoch < 3:
            return
        rate = view.rate_at(self.local_epoch)
        if not rate > 0:
            return
        self._target_checked = True
        fill = self.target_batch_size / rate
        if fill < 5 * self._gossip_interval:
            log.warning("%s: the swarm trains %.0f samples/s, so target_batch_size=%d fills in %.2f s, under 5 gossip "
                        "intervals (%.2f s): peers learn of each other's samples a few intervals late, so global steps "
                        "will hold much more or much less than the target. Raise target_batch_size to %d or more, or "
                        "lower gossip_interval", self.peer_id[:8], rate, self.target_batch_size, fill,
                        5 * self._gossip_interval, math.ceil(5 * self._gossip_interval * rate))

    def _maybe_pre_schedule(self, view: SwarmView) -> None:
        """About one matchmaking window before the target: start matchmaking for the round now."""
        if self._scheduled is not None or self._expected_peers(view) < 2:
            return
        have = view.estimate_at(self.local_epoch, self.clock.wall_time(), 4 * self._gossip_interval)
        rate = view.rate_at(self.local_epoch)
        eta = (self.target_batch_size - have) / rate if rate > 0 else float("inf")
        mm = self.averager.config.matchmaking_time
        if eta > mm:
            return
        n = self.samples
        self._scheduled = self.averager.step(
            weight=n if n > 0 else _NOTHING, gather={"ep": self.local_epoch, "n": n, "bad": 0},
            require_trigger=True, timeout=self.matchmaking_timeout + 2 * eta + mm, wait=False)

    def _drop_scheduled(self) -> None:
        ctl, self._scheduled = self._scheduled, None
        if ctl is not None and not ctl.cancel() and not ctl.done():
            ctl.trigger()  # its all-reduce began: let it end (its result is not used)
            self.clock.wait(ctl, self.averager.config.allreduce_timeout + 1.0)

    def _trigger_scheduled(self, n: float, gather: dict) -> Any:
        """Hand the pre-scheduled round (if any) its weight and gathered values and trigger it; the
        control (check `.triggered`: one that ended before, with no group in time, was not), or None."""
        ctl, self._scheduled = self._scheduled, None
        if ctl is not None:
            try:
                ctl.weight = n if n > 0 else _NOTHING
                ctl.gather = gather
                ctl.trigger()
            except RuntimeError:  # it ended (no group in time) before we got here
                pass
        return ctl

    def _run_round(self, n: float, gather: dict) -> Any:
        """The averaging step of `_finish_epoch`: trigger the pre-scheduled round if there is one
        that can still run, else (or if it failed before its trigger) a plain step."""
        ctl = self._trigger_scheduled(n, gather)
        if ctl is not None:
            if ctl.triggered:
                bound = self.averager.config.allreduce_timeout + self.matchmaking_timeout + 1.0
                try:
                    return self.clock.result(ctl, bound)
                except cf.TimeoutError:
                    raise RoundTimeout(f"the pre-scheduled round did not finish within {bound:.0f}s") from None
                except ZGossipError:
                    if ctl.reached_allreduce:
                        raise
            log.info("%s: the pre-scheduled round failed before its all-reduce (%s); averaging with a plain step",
                     self.peer_id[:8], ctl.exception() if ctl.done() and not ctl.cancelled() else "cancelled")
        return self.averager.step(weight=n if n > 0 else _NOTHING, gather=gather, timeout=self.matchmaking_timeout)

    def _start_round(self, n: float, gather: dict) -> cf.Future:
        """`_run_round` without waiting (delay_grad_averaging): the pre-scheduled round triggered if it can
        still run, else a plain step; its future."""
        ctl = self._trigger_scheduled(n, gather)
        if ctl is not None:
            if ctl.triggered:
                return ctl
            log.info("%s: the pre-scheduled round failed before its all-reduce; averaging with a plain step",
                     self.peer_id[:8])
        return self.averager.step(weight=n if n > 0 else _NOTHING, gather=gather, timeout=self.matchmaking_timeout,
                                  wait=False)

    def _accumulate(self, bs: int) -> None:
        grads = [p.grad for p in self.model_params]
        if all(g is None for g in grads):
            # no backward ran for this batch (Lightning's training_step returned None: "skip this batch"): as a
            # torch optimizer's step would, it changes nothing; counted, its samples diluted the mean of the
            # others (weighted as samples with a zero gradient) and took their place in the global batch
            bs = 0
        now = self.clock.now()
        if self._last_step_time is not None and now > self._last_step_time:
            inst = bs / (now - self._last_step_time)
            self._rate = inst if self._rate == 0 else 0.8 * self._rate + 0.2 * inst
        self._last_step_time = now
        if bs == 0:
            return
        bad = first_nonfinite(grads)
        if bad is not None:
            self.nonfinite_batches += 1
            self._epoch_nonfinite += 1
            log.warning("%s: NaN/inf in the gradient of %s: this batch of %d samples is dropped, not averaged "
                        "(%d such batches so far)", self.peer_id[:8], self.param_layout.describe(bad), bs,
                        self.nonfinite_batches)
            return
        with torch.no_grad(), self.averager.get_tensors():
            if self._acc_stale:  # first batch of the epoch: overwrite instead of zeroing, then adding
                for acc, g in zip(self._acc, grads):
                    if g is None:
                        acc.zero_()
                    elif g.layout != torch.strided:  # a sparse gradient (Embedding(sparse=True)): added to zeros
                        acc.zero_().add_(g, alpha=bs)
                    else:
                        acc.copy_(g).mul_(bs)  # (a float32 accumulator: the product in float32, not in g's dtype)
                self._acc_stale = False
            else:
                for acc, g in zip(self._acc, grads):
                    if g is not None:
                        acc.add_(g, alpha=bs)
        self.samples += bs

    def _resync_if_needed(self, view: SwarmView) -> bool:
        """Load state if we are behind the swarm or out of sync with it; True if we did."""
        if view.donor_epoch > self.local_epoch:
            return self._try_load_state(view, f"behind: epoch {self.local_epoch} < swarm's {view.donor_epoch}")
        if self.in_sync:
            self._compare_digests(view)
        if self.in_sync:
            return False
        # a client-mode peer serves no state: it can be no reference (nobody could download from it)
        ref = [p for p in view.others() if p.in_sync and p.epoch >= self.local_epoch and not p.client]
        if ref:
            return self._try_load_state(view, "out of sync after a failed or partial round")
        diverged = [p.peer_id for p in view.at(self.local_epoch) if not p.in_sync and not p.client]
        if not diverged or min(diverged) == self.peer_id:
            log.info("%s: no in-sync peer left; this peer becomes the reference for the others", self.peer_id[:8])
            self.in_sync = True
            self._update_sharing()
            self._publish()
        return False

    def _compare_digests(self, view: SwarmView) -> None:
        """Peers at one epoch should hold identical parameters. If they do not (the swarm split into
        several groups, e.g. target_group_size < peers), the largest set of equal digests (ties: the one
        holding the lowest peer id) is the reference, and every other peer marks itself out of sync.
        A set of client-mode peers alone is never the reference: nobody could download its state."""
        found = reference_digest(view, self.local_epoch)
        if found is None:
            return
        ref, different = found
        if ref != self._param_digest:
            log.warning("%s: at epoch %d the peers hold %d different sets of parameters (groups split? "
                        "target_group_size=%d, live peers=%d): resynchronising with the majority",
                        self.peer_id[:8], self.local_epoch, different, self.averager.config.target_group_size,
                        view.num_peers)
            self.in_sync = False
            self._update_sharing()
            self._publish()

    def _finish_epoch(self, view: SwarmView) -> None:
        if self.delay_optimizer_step:
            self._launch_delayed(view)
            return
        t0 = self.clock.now()
        epoch, n = self.local_epoch, self.samples
        with torch.no_grad(), self.averager.get_tensors():
            if self._acc_stale:  # nothing accumulated this epoch: contribute zeros (with weight ~0)
                for g in self._grads:
                    g.zero_()
                self._acc_stale = False
            else:
                for g, acc in zip(self._grads, self._acc):
                    if acc is not g:  # a float32 sum of float16/bfloat16 gradients: the mean, rounded once
                        torch.div(acc, max(n, 1), out=g)
                    elif n > 0:
                        g.div_(n)
        # every live peer of the run is expected, not only those whose record shows this epoch: right
        # after an epoch ends, records still show the previous one for a gossip delay, and a fast peer
        # that "found itself alone" then would step without the others and drift away. Only a peer
        # that downloads the state is not: it joins no round before its download ends
        expected = self._expected_peers(view)
        gather = {"ep": epoch, "n": n, "bad": self._epoch_nonfinite}
        result, error = None, None
        t1 = self.clock.now()
        if expected > 1:
            self._averaging = True
            self._publish()
            try:
                result = self._run_round(n, gather)
            except ZGossipError as e:
                error = e
            finally:
                self._averaging = False
        seconds = self.clock.now() - t1
        rnd: dict[str, Any] = {"epoch": epoch, "local_samples": n, "seconds": seconds, "expected_peers": expected,
                               "group_size": 1, "samples": n, "excluded": {}, "ok": result is not None,
                               "error": None if error is None else f"{type(error).__name__}: {error}"}
        do_step = n > 0
        t2 = self.clock.now()
        if result is not None:
            do_step = self._check_round(result, rnd)
            if "behind" in rnd:  # no step, no new epoch: these gradients are stale; resynchronise at the next step
                self.samples, self._epoch_nonfinite, self._acc_stale = 0, 0, True
                rnd["stepped"] = False
                self.last_round = rnd
                self._update_sharing()
                self._publish()
                return
        elif expected > 1:
            later = self._view()
            if later.donor_epoch > epoch:
                log.warning("%s: averaging for epoch %d failed (%s) and the swarm moved on: loading its state",
                            self.peer_id[:8], epoch, rnd["error"])
                self.last_round = rnd
                self.samples, self._acc_stale = 0, True  # these gradients are stale either way
                self._try_load_state(later, "missed the round of epoch %d" % epoch)
                return
            log.warning("%s: averaging for epoch %d failed (%s); proceeding with local gradients (%d samples) "
                        "and resynchronising afterwards", self.peer_id[:8], epoch, rnd["error"], n)
            self.in_sync = False
        t3 = self.clock.now()
        try:
            self._apply_step(do_step)
        except BaseException:
            # the accumulators now hold this epoch's mean, not a sum: later batches added to it would be
            # mis-weighted. Drop the epoch's gradients, as a delayed update that raised does
            self.samples, self._epoch_nonfinite, self._acc_stale = 0, 0, True
            raise
        rnd["stepped"] = do_step
        # where the time of this step went (the wrapper's overhead over plain averaging, for benchmarks)
        rnd["phases"] = {**self._phases, "prepare": t1 - t0, "average": t2 - t1, "check": t3 - t2,
                         "optimizer_step": self.clock.now() - t3}
        self.last_round = rnd
        log.debug("%s: epoch %d -> %d: %s", self.peer_id[:8], epoch, self.local_epoch, rnd)

    def _check_round(self, result: Any, rnd: dict) -> bool:
        gathered = result.gathered
        contributors = [c for c in result.contributors if isinstance(gathered.get(c), dict)]
        rnd["group_size"] = len(result.members)
        rnd["contributors"] = len(result.contributors)
        rnd["timings"] = dict(result.timings)  # the averager's own matchmaking / all-reduce times
        total = 0.0
        epochs = set()
        for c in contributors:
            g = gathered[c]
            n, ep, bad = g.get("n", 0), g.get("ep"), g.get("bad", 0)
            if type(n) in (int, float) and n > 0:
                total += n
            epochs.add(ep)
            if c != self.peer_id and not n:
                rnd["excluded"][c] = f"{bad} batch(es) with NaN/inf gradients dropped" if bad else "no samples"
            elif c != self.peer_id and bad:
                # its finite batches are in the mean: it is no excluded peer, it dropped some of its batches
                rnd.setdefault("dropped", {})[c] = bad
                log.info("%s: peer %s dropped %s batch(es) with NaN/inf gradients in epoch %s (it contributed %s "
                         "samples)", self.peer_id[:8], c[:8], bad, rnd["epoch"], n)
        rnd["samples"] = total
        for c, why in rnd["excluded"].items():
            log.info("%s: peer %s contributed nothing to epoch %s: %s", self.peer_id[:8], c[:8], rnd["epoch"], why)
        seen = sorted(e for e in epochs if type(e) is int)
        if seen and seen[-1] > rnd["epoch"]:
            # a member that was behind (its records lagged: it finished an epoch the others had already
            # ended) met a round of a later epoch. Stepping would give its parameters -- of an older epoch
            # -- the number of the epoch the others hold, with different values: it does not step, keeps
            # its epoch, and resynchronises (every member sees the same gathered epochs, so the members
            # at the newest epoch step, together, and only the ones behind hold back)
            log.warning("%s: the round for epoch %s mixed gradients of epochs %s: this peer was behind, so it "
                        "does not step; it resynchronises", self.peer_id[:8], rnd["epoch"], seen)
            rnd["behind"] = seen[-1]
            self.in_sync = False
            return False
        if epochs != {rnd["epoch"]}:
            log.warning("%s: the round for epoch %s mixed gradients of epochs %s: stepping (the members behind "
                        "do not, and resynchronise)", self.peer_id[:8], rnd["epoch"], seen)
        if not result.complete:
            log.warning("%s: the round for epoch %s was partial (lost: %s); stepping, then resynchronising",
                        self.peer_id[:8], rnd["epoch"], ", ".join(p[:8] for p in result.lost) or "none")
            self.in_sync = False
        bad = first_nonfinite(self._grads)
        if bad is not None:
            log.error("%s: the averaged gradient of %s is NaN/inf: a peer contributed non-finite values without "
                      "flagging them. Skipping this optimizer step (every member of the group does the same).",
                      self.peer_id[:8], self.param_layout.describe(bad))
            rnd["nonfinite_average"] = True
            return False
        return total > 0

    def _apply_step(self, do_step: bool) -> None:
        self._optimizer_step(do_step)
        if self._offload is not None:
            self._offload.copy_to_model()
        self._update_sharing()
        self._publish()

    def _optimizer_step(self, do_step: bool, reset: bool = True) -> None:
        """The optimizer and scheduler step and the epoch's end, on the parameters the optimizer owns
        (`reset`: also start the next epoch's accumulation; a delayed update did that when it began)."""
        with self._lock, torch.no_grad():
            if do_step:
                # the optimizer reads the averaged gradients where they are (no copy); afterwards p.grad is
                # None, as after zero_grad(), so a later backward cannot write into the averager's buffers
                for p, g in zip(self.params, self._grads):
                    p.grad = g if p.requires_grad else None
                try:
                    self.opt.step()
                finally:
                    for p in self.params:
                        p.grad = None
            if self.scheduler is not None:
                self.scheduler.step()
            self.local_epoch += 1
            if reset:
                self.samples = 0
                self._epoch_nonfinite = 0
                self._acc_stale = True  # overwritten by the next epoch's first batch
            self._param_digest = params_digest(self.params, self.local_epoch)

    # ------------------------------------------------------------------ overlapped averaging
    def _launch_delayed(self, view: SwarmView) -> None:
        """End the epoch in the background: hand this epoch's mean gradient to the round (with
        delay_grad_averaging: a round of its own, else a round now) and the optimizer step to the worker;
        the next batches accumulate toward the next epoch meanwhile, and `_commit_pending` applies it."""
        t0 = self.clock.now()
        epoch, n = self.local_epoch, self.samples
        with torch.no_grad(), self.averager.get_tensors():
            for g, acc in zip(self._grads, self._acc):
                if self._acc_stale:
                    g.zero_()
                elif n > 0:
                    torch.div(acc, n, out=g)
                else:
                    g.copy_(acc)
        bad_batches = self._epoch_nonfinite
        self.samples, self._epoch_nonfinite, self._acc_stale = 0, 0, True  # the next epoch accumulates in _acc
        expected = self._expected_peers(view)
        gather = {"ep": epoch, "n": n, "bad": bad_batches}
        rnd: dict[str, Any] = {"epoch": epoch, "local_samples": n, "expected_peers": expected, "group_size": 1,
                               "samples": n, "excluded": {}, "ok": False, "error": None, "delayed": True}
        pending = PendingUpdate(epoch, n, t0)
        self._pending = pending
        round_future: cf.Future | None = None
        scheduled = self._scheduled  # the pre-scheduled round, if any: _start_round may trigger it
        result, error = None, None
        if expected > 1:
            self._averaging = True
            self._publish()
            try:
                if self.delay_grad_averaging:
                    round_future = self._start_round(n, gather)
                else:
                    result = self._run_round(n, gather)
            except ZGossipError as e:
                error = e
            if not self.delay_grad_averaging:
                self._averaging = False
        if self._worker is None:
            self._worker = self.clock.executor("zgossip-delayed-step")
        fallback = gather if scheduled is not None and round_future is scheduled else None
        pending.future = self._worker.submit(self._delayed_update, pending, rnd, round_future, result, error,
                                             fallback)

    def _delayed_update(self, pending: PendingUpdate, rnd: dict, round_future: cf.Future | None, result: Any,
                        error: BaseException | None, fallback: dict | None = None) -> dict:
        """On the worker: wait for the round (bounded), check it, step the optimizer's own parameters.
        `fallback`: the gathered values of a pre-scheduled round, which falls back to a plain step if it
        failed before its all-reduce (as `_run_round` does)."""
        t1 = self.clock.now()
        if round_future is not None:
            bound = self.matchmaking_timeout + self.averager.config.allreduce_timeout + 5.0
            failed = False  # before its bound (a round that timed out is not retried, as in _run_round)
            try:
                result = self.clock.result(round_future, bound)
            except ZGossipError as e:
                error, failed = e, True
            except cf.TimeoutError:
                round_future.cancel()
                error = RoundTimeout(f"the delayed round did not finish within {bound:.0f}s")
            if fallback is not None and failed and not getattr(round_future, "reached_allreduce", True):
                log.info("%s: the pre-scheduled round failed before its all-reduce (%s); averaging with a plain step",
                         self.peer_id[:8], error)
                n = pending.samples
                try:
                    result, error = self.averager.step(weight=n if n > 0 else _NOTHING, gather=fallback,
                                                       timeout=self.matchmaking_timeout), None
                except ZGossipError as e:
                    error = e
        rnd["seconds"] = self.clock.now() - t1
        rnd["ok"] = result is not None
        rnd["error"] = None if error is None else f"{type(error).__name__}: {error}"
        do_step = pending.samples > 0
        if result is not None:
            do_step = self._check_round(result, rnd)
            if "behind" in rnd:  # no step, no new epoch (see _check_round): the next step resynchronises
                rnd["stepped"] = False
                rnd["phases"] = {"average": self.clock.now() - t1, "optimizer_step": 0.0}
                return rnd
        elif rnd["expected_peers"] > 1:
            log.warning("%s: averaging for epoch %d failed (%s); proceeding with local gradients (%d samples) "
                        "and resynchronising afterwards", self.peer_id[:8], pending.epoch, rnd["error"],
                        pending.samples)
            self.in_sync = False
        t2 = self.clock.now()
        self._optimizer_step(do_step, reset=False)
        rnd["stepped"] = do_step
        rnd["phases"] = {"average": t2 - t1, "optimizer_step": self.clock.now() - t2}
        return rnd

    def _commit_pending(self, timeout: float | None = None) -> None:
        """Apply the finished delayed update: the model's tensors take the optimizer's, and the swarm hears
        of the new epoch. Re-raises what the optimizer step raised."""
        pending = self._pending
        assert pending is not None
        if timeout is None:
            timeout = self.matchmaking_timeout + self.averager.config.allreduce_timeout + 30.0
        t0 = self.clock.now()
        try:
            rnd = self.clock.result(pending.future, timeout) if pending.future is not None else {}
        except cf.TimeoutError:
            raise RoundTimeout(f"the delayed update of epoch {pending.epoch} did not finish within {timeout:.0f}s")
        finally:
            if pending.future is None or pending.future.done():
                self._pending = None
                self._averaging = False
        waited = self.clock.now() - t0
        with self._lock:
            if self._offload is not None:
                self._offload.copy_to_model()
        # waited: how long training stood still at this boundary for the update (0 when it overlapped fully)
        rnd["staleness"] = {"global_steps": 1 if pending.stale_batches else 0, "batches": pending.stale_batches,
                            "seconds": self.clock.now() - pending.started, "waited": waited}
        self.last_round = rnd
        self._update_sharing()
        self._publish()
        log.debug("%s: epoch %d -> %d (delayed): %s", self.peer_id[:8], pending.epoch, self.local_epoch, rnd)

    def apply_pending(self, wait: bool = True, timeout: float | None = None) -> bool:
        """Apply the update in flight (delay_optimizer_step) now, waiting for it with `wait`; True if one was
        applied. After it the model holds the newest parameters (e.g. before saving a checkpoint)."""
        if self._pending is None or (not wait and not self._pending.done()):
            return False
        self._commit_pending(timeout)
        return True

    @property
    def pending_update(self) -> PendingUpdate | None:
        """The delayed update in flight, if any (its epoch, and the batches computed meanwhile)."""
        return self._pending

    # ------------------------------------------------------------------ background resynchronisation
    def _try_load_state(self, view: SwarmView, why: str) -> bool:
        if not (self.delay_state_averaging and getattr(self, "_started", False)):
            return super()._try_load_state(view, why)
        if self.clock.now() < self._next_sync_try:
            return False
        self.apply_pending(wait=True)
        log.info("%s: downloading the swarm's state in the background (%s)", self.peer_id[:8], why)
        self._downloading = True  # published: peers hold off their next step meanwhile (catchup_pause)
        self._publish()
        try:
            self._download = self.averager.load_state_from_peers(timeout=self.load_state_timeout,
                                                                 chunk_timeout=self.state_chunk_timeout,
                                                                 apply=False, wait=False)
        except BaseException:
            self._downloading = False
            self._publish()
            raise
        return True

    def _finish_download(self) -> None:
        fut, self._download = self._download, None
        assert fut is not None
        self._downloading = False  # published below, with the adopted state or after the failure
        try:
            meta, arrays = self.clock.result(fut, 0)
            before = self.local_epoch
            self._apply_state(meta, arrays)
            log.info("%s: adopted the state downloaded in the background: epoch %d -> %d", self.peer_id[:8],
                     before, self.local_epoch)
        except LayoutMismatch:
            self._publish()
            raise  # another model or optimizer: no retry can fix it (the synchronous path raises it too)
        except ZGossipError as e:
            self._next_sync_try = self.clock.now() + max(1.0, 5 * self._gossip_interval)
            log.warning("%s: background state download failed: %s; training on and retrying later",
                        self.peer_id[:8], e)
            self._publish()

    def load_state_from_peers(self, timeout: float | None = None) -> None:
        self.apply_pending(wait=True)  # the update in flight would otherwise land on top of the loaded state
        super().load_state_from_peers(timeout)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._offload is not None:
            # only the model's: the gradients of the optimizer's own copies are the averaged buffers, which a
            # delayed update on the worker sets as their .grad and clears, under the lock. Clearing them here,
            # on the training thread, raced with it: the update then stepped on no gradient (or, with
            # set_to_none=False, a zeroed one) and was lost, with last_round["stepped"] True
            self._offload.zero_model_grads(set_to_none)
        else:
            super().zero_grad(set_to_none)

    def shutdown(self) -> None:
        super().shutdown()  # a round in flight fails at once (AveragerClosed), so the worker ends soon
        if self._worker is not None:
            self._worker.shutdown(wait=True)
