"""DiLoCo: local inner steps, then one outer-optimizer step on the swarm's mean pseudo-gradient.

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    opt = DiLoCoOptimizer(inner, outer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
                          inner_steps=500, prefix="run1", initial_peers=[...])
    for x, y in data:
        loss_fn(model(x), y).backward()
        opt.step()          # an inner step; every 500th also averages and takes the outer step
        opt.zero_grad()

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): every peer starts an outer step from the
same parameters, the *anchor*, and takes ``inner_steps`` (H) steps of its own optimizer on its
own data. Then it computes the pseudo-gradient ``delta = anchor - params``, the peers average
their deltas, and every peer resets its parameters to the anchor, sets ``p.grad`` to the mean
delta and takes one step of the *outer* optimizer (the paper: SGD, lr 0.7, Nesterov momentum
0.9). The result is the next anchor, identical on every peer of the group (identical anchors,
identical averaged bits, identical outer state). With outer SGD at lr 1 and no momentum this is
exactly parameter averaging every H steps.

What this module owns, beyond that arithmetic:

* **Meeting at the same outer step.** The epoch (`local_epoch`) is the number of outer steps
  taken; the round of outer step k is pinned to round number k, so it never mixes deltas of two
  outer steps. Peers run at different speeds, so a peer that finished its H inner steps first
  waits (at most ``straggler_timeout`` seconds) until every peer it knows of at its epoch, or
  behind it, has published that it finished too -- or until one of them entered the round: views
  differ (a newcomer only some peers heard of), and the others then follow the first. So the
  peers enter the round within a few gossip intervals of each other and meet in one matchmaking
  window. Synchronous, as in the paper: the outer step waits for the round. (An overlapped
  "streaming" variant is not offered.)
* **Failures keep the "averaged or unchanged" rule.** Elements of the delta that a round did
  not average (a partial round) keep this peer's own delta, so there this peer applies its own
  pseudo-gradient; a round that fails entirely (no group, `PeerLost`, a timeout) still takes the
  outer step, on the local delta. A peer that knows of no other peer at its outer step takes it
  without a round. After a failed or partial round its anchor is its own: it marks itself out of
  sync, and since anchors of one epoch must be equal (each peer publishes a digest of its anchor),
  a peer out of sync -- or in the minority of a split -- downloads the anchor, the outer and inner
  optimizers' state from an in-sync peer at its next step.
* **NaN/inf.** As the other wrappers: an inner batch with a non-finite gradient is dropped
  (the inner step is skipped; it still counts as one of the H steps, so the schedule holds) and
  counted in `nonfinite_batches`. A non-finite delta (the inner optimizer diverged) is never
  sent: this peer joins the round with a zero delta and weight ~0, so it receives the others'
  mean; alone, if that round fails, or if every member of it was in this case (a mean of nothing), it
  skips the outer step (parameters reset to the anchor).
  The delta is checked again after the round: the averager never puts another member's NaN/inf
  into it (a member whose terms are not finite is left out of that span and keeps its own values
  there), so a non-finite value left in it is this peer's own, sent unflagged (a bug); this peer
  then skips the outer step rather than apply it, and is out of sync (the round was partial).
  Each case is logged and recorded in ``last_round``.
* **Joining.** A newcomer, or a peer behind the swarm's epoch, downloads the anchor (as the
  parameters), the outer optimizer's state, the inner optimizer's and scheduler's state and the
  epoch from a peer, and starts its H inner steps from that anchor; the peers at the outer step
  wait for it as for any straggler.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import math
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .checkpoint import check_state_keys, nonfinite_state
from .errors import StateUnavailable, ZGossipError
from .progress import SwarmView, reference_digest
from .trainer import SchedulerLike, TrainerPeer, first_nonfinite, params_digest
from .training_state import LayoutMismatch, copy_arrays, pack_state, unpack_state

__all__ = ["DiLoCoOptimizer", "paper_outer_optimizer"]

log = logging.getLogger(__name__)

_NOTHING = 1e-9  # the weight of a member whose delta is not finite: it receives the mean, adds nothing

OuterLike = Any  # a torch optimizer over the same parameters, or a callable(params) -> one


def paper_outer_optimizer(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """The outer optimizer of the DiLoCo paper: SGD, lr 0.7, Nesterov momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class DiLoCoOptimizer(TrainerPeer):
    """Wrap the inner `optimizer`: ``inner_steps`` local steps, then an outer step on the averaged pseudo-gradient.

    ``outer``: the outer optimizer, over the same parameters as `optimizer` (in the same order) --
    a torch optimizer, or a callable that builds one from the list of parameters; None: the
    paper's (`paper_outer_optimizer`). ``straggler_timeout``: how long a peer that finished its
    inner steps waits for the other peers of its epoch before averaging without them.
    ``averaging_timeout`` bounds the round's matchmaking (the averager's default when None).
    ``scheduler`` steps the inner optimizer's LR once per outer step (an epoch is an outer step).
    The remaining arguments are those of `DecentralizedOptimizer` / `Averager`.

    ``last_round`` describes the last outer step (``ok``, ``group_size``, ``complete``, ``waited``
    seconds at the barrier, ``outer_step`` taken or skipped, ``error``...); ``rounds`` counts them.
    """

    kind = "diloco"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        prefix: str,
        inner_steps: int,
        outer: OuterLike = None,
        straggler_timeout: float = 60.0,
        averaging_timeout: float | None = None,
        scheduler: SchedulerLike = None,
        model: torch.nn.Module | None = None,
        initial_peers: Sequence[str] = (),
        listen: str = "tcp://127.0.0.1:0",
        matchmaking_time: float = 1.0,
        target_group_size: int = 16,
        min_group_size: int = 2,
        load_state_on_start: bool = True,
        load_state_timeout: float = 60.0,
        state_chunk_timeout: float = 5.0,
        startup_timeout: float | None = None,
        averager_opts: dict | None = None,
        local_epoch: int = 0,
    ) -> None:
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
            raise ValueError(f"inner_steps must be a whole number >= 1, not {inner_steps!r}")
        for name, value in (("straggler_timeout", straggler_timeout), ("averaging_timeout", averaging_timeout)):
            if value is None and name == "averaging_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r} (every wait here "
                                 "has a bound)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        odd = sorted({str(p.dtype) for p in params} - {"torch.float16", "torch.float32", "torch.float64"})
        if odd:
            raise TypeError(f"DiLoCoOptimizer trains float16, float32 or float64 parameters, not {', '.join(odd)} "
                            "(not in this wrapper yet: its anchor and deltas are not tested in bfloat16, though the "
                            "Averager and the other wrappers average bfloat16): keep float32 parameters and compute "
                            "in lower precision with torch.autocast")
        self.outer = self._build_outer(outer, params, optimizer)
        self.inner_steps = inner_steps
        self.straggler_timeout = float(straggler_timeout)
        self.averaging_timeout = averaging_timeout
        self.local_step = 0
        self.steps_in_epoch = 0
        self.rounds = {"done": 0, "partial": 0, "failed": 0, "alone": 0, "skipped_nonfinite": 0}
        self.last_round: dict[str, Any] = {}
        self._next_check = 0.0
        self._loading: dict | None = None  # a checkpoint's or a donor's DiLoCo state, between its check and its use
        self._stale: cf.Future | None = None  # a round that outlived its bound (see `_average`)
        opts = dict(averager_opts or {})
        opts.setdefault("matchmaking_time", matchmaking_time)
        opts.setdefault("target_group_size", target_group_size)
        opts.setdefault("min_group_size", min_group_size)
        super().__init__(optimizer, prefix=prefix, scheduler=scheduler, model=model, initial_peers=initial_peers,
                         listen=listen, averager_opts=opts, load_state_on_start=load_state_on_start,
                         startup_timeout=startup_timeout, load_state_timeout=load_state_timeout,
                         state_chunk_timeout=state_chunk_timeout, local_epoch=local_epoch)

    @staticmethod
    def _build_outer(outer: OuterLike, params: list, inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if outer is None:
            outer = paper_outer_optimizer
        if not isinstance(outer, torch.optim.Optimizer):
            if not callable(outer):
                raise TypeError("outer must be a torch optimizer or a callable(params) -> optimizer, "
                                f"not a {type(outer).__name__}")
            outer = outer(list(params))
            if not isinstance(outer, torch.optim.Optimizer):
                raise TypeError(f"outer(params) returned a {type(outer).__name__}, not a torch optimizer")
        if outer is inner:
            raise ValueError("the outer optimizer must be another optimizer than the inner one")
        theirs = [p for g in outer.param_groups for p in g["params"]]
        if len(theirs) != len(params) or any(a is not b for a, b in zip(theirs, params)):
            raise ValueError(f"the outer optimizer must step the inner optimizer's parameters, in the same order "
                             f"({len(params)} tensors; it holds {len(theirs)}, or others): build it from "
                             "[p for g in inner.param_groups for p in g['params']]")
        return outer

    # ------------------------------------------------------------------ TrainerPeer hooks
    def _averaged_tensors(self) -> tuple[list[torch.Tensor], list[str]]:
        with torch.no_grad():
            self._anchor = [p.detach().clone() for p in self.params]
            # float32 (float64 for float64 parameters), float16 parameters included: the mean of many deltas
            self._delta = [torch.zeros(p.shape, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
                           for p in self.params]
        self._param_digest = params_digest(self._anchor, self.local_epoch)
        return self._delta, [f"{n}:delta" for n in self.param_names]

    def _progress_samples(self) -> float:
        return float(self.steps_in_epoch)

    def _extra_state(self) -> dict:
        return {**super()._extra_state(), "outer": self.outer.state_dict()}

    def _current_state(self) -> tuple[Any, list[np.ndarray]]:
        """The state a newcomer downloads: the anchor as the parameters (a peer mid-way through its
        inner steps serves where they started), the inner, outer and scheduler states, the epoch."""
        with self._lock:  # one consistent snapshot: no inner or outer step is half done
            extra_meta, extra = pack_state(self._extra_state())
            meta = {"kind": self.kind, "epoch": self.local_epoch, "in_sync": self.in_sync,
                    "layout": self.param_layout.as_meta(), "extra": extra_meta}
            return meta, copy_arrays(self._anchor) + extra

    def _apply_state(self, meta: Any, arrays: Sequence[np.ndarray]) -> None:
        n = len(self.params)
        outer = None
        if isinstance(meta, dict) and meta.get("kind") == self.kind and "extra" in meta and len(arrays) >= n:
            try:
                extra = unpack_state(meta["extra"], arrays[n:])
            except (ValueError, TypeError, IndexError, KeyError) as e:
                raise StateUnavailable(f"the donor's optimizer/scheduler state is malformed ({type(e).__name__}: "
                                       f"{e}): nothing was written") from None
            outer = extra.get("outer") if isinstance(extra, dict) else None
            if not isinstance(outer, Mapping):
                raise StateUnavailable("the donor's state holds no outer optimizer state: every peer of a run must "
                                       "run the same zgossip")
            self._check_outer_groups(outer, "the donor's")
        self._loading = {"outer": outer, "anchor": None}
        try:
            super()._apply_state(meta, arrays)  # checks the rest; writes under the lock, then _after_state_loaded
        finally:
            self._loading = None

    def _donor_states(self, extra: dict) -> list[tuple[Any, Any]]:
        loads = super()._donor_states(extra)
        if self._loading is not None and self._loading.get("outer") is not None:
            loads.append((self.outer, self._loading["outer"]))  # with the inner one's: all or none
        return loads

    def _after_state_loaded(self) -> None:
        with torch.no_grad():
            for a, p in zip(self._anchor, self.params):
                a.copy_(p)  # the donor served its anchor as the parameters
        self.steps_in_epoch = 0
        self._param_digest = params_digest(self._anchor, self.local_epoch)

    def _check_outer_groups(self, outer: Any, whose: str) -> None:
        groups = outer.get("param_groups") if isinstance(outer, Mapping) else None
        # torch's load_state_dict reads "state" too: checked here, before the inner optimizer's state is written
        if not isinstance(groups, list) or not isinstance(outer.get("state"), Mapping) or not all(
                isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
            raise LayoutMismatch(f"{whose} outer optimizer state is missing or malformed (expected {{'state': {{...}}, "
                                 "'param_groups': [{'params': [...], ...}, ...]}): every peer of a run must build "
                                 "the same DiLoCoOptimizer, and a checkpoint must be what its state_dict() returned")
        mine = [len(g["params"]) for g in self.outer.param_groups]
        theirs = [len(g["params"]) for g in groups]
        if mine != theirs:
            raise LayoutMismatch(f"{whose} outer optimizer's param groups hold {theirs} tensors, this one's {mine}: "
                                 "build the same outer optimizer on every peer")

    # ------------------------------------------------------------------ checkpoints
    # Kept besides the inner optimizer's and scheduler's state: the anchor and the outer optimizer's state
    # (under "diloco"), the epoch (= outer steps taken), the local steps and the inner steps made in this
    # outer step (the model's parameters, saved beside it, hold their progress). Not kept: counters of this
    # process (rounds, last_round, nonfinite_batches).
    _PROGRESS_KEYS = {**TrainerPeer._PROGRESS_KEYS, "local_step": int, "steps_in_epoch": int}

    def state_dict(self) -> dict:
        """`TrainerPeer.state_dict`, plus ``"diloco": {"anchor": [tensors], "outer": the outer optimizer's
        state_dict()}`` (references, as torch's optimizers give: save it between two steps)."""
        with self._lock:
            sd = super().state_dict()
            sd["diloco"] = {"anchor": list(self._anchor), "outer": self.outer.state_dict()}
        return sd

    def _progress_state(self) -> dict:
        return {**super()._progress_state(), "local_step": self.local_step, "steps_in_epoch": self.steps_in_epoch}

    def _check_loaded_state(self, state_dict: dict) -> None:
        d = state_dict.get("diloco")
        if not isinstance(d, Mapping) or not {"anchor", "outer"} <= set(d):
            raise ValueError("not a DiLoCoOptimizer state dict: its 'diloco' entry (the anchor and the outer "
                             "optimizer's state) is missing. Pass what DiLoCoOptimizer.state_dict() returned")
        anchor = d["anchor"]
        if not isinstance(anchor, (list, tuple)) or len(anchor) != len(self.params):
            raise ValueError(f"the state dict's diloco.anchor must be a list of {len(self.params)} tensors")
        for i, (a, p) in enumerate(zip(anchor, self.params)):
            if not isinstance(a, torch.Tensor) or a.shape != p.shape or a.dtype != p.dtype:
                raise ValueError(f"the state dict's anchor of {self.param_layout.describe(i)} is not a "
                                 f"{p.dtype} tensor of shape {tuple(p.shape)}")
        bad = first_nonfinite(anchor)
        if bad is not None:  # it would become the parameters at the next outer step, on every peer that downloads
            raise ValueError(f"the state dict's anchor of {self.param_layout.describe(bad)} holds NaN/inf: it was "
                             "saved after the training diverged, or it is damaged. Resume from an earlier checkpoint")
        try:
            self._check_outer_groups(d["outer"], "the state dict's")
        except LayoutMismatch as e:
            raise ValueError(str(e)) from None
        check_state_keys(d["outer"], "the state dict's outer optimizer")
        where = nonfinite_state(d["outer"]["state"], self.param_layout)
        if where is not None:
            raise ValueError(f"the state dict's outer optimizer state {where} holds NaN/inf: it was saved after the "
                             "training diverged, or it is damaged. Resume from an earlier checkpoint")
        self._loading = {"outer": d["outer"], "anchor": anchor}

    def _restore_progress(self, progress: dict) -> None:
        super()._restore_progress(progress)
        loading, self._loading = self._loading, None
        self.outer.load_state_dict(loading["outer"])
        with torch.no_grad():
            for a, s in zip(self._anchor, loading["anchor"]):
                a.copy_(s)
        self.local_step = progress["local_step"]
        self.steps_in_epoch = progress["steps_in_epoch"]
        self._param_digest = params_digest(self._anchor, self.local_epoch)
        self._next_check = 0.0  # the next step compares with the swarm afresh

    # ------------------------------------------------------------------ public
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step (a batch with NaN/inf gradients is dropped); after the ``inner_steps``-th of
        this epoch, average the pseudo-gradients and take the outer step (waits for the round)."""
        self._raise_if_closed()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        bad = first_nonfinite([p.grad for p in self.params])
        if bad is not None:
            self.nonfinite_batches += 1
            log.warning("%s: NaN/inf in the gradient of %s: this batch is dropped, no inner step (%d such batches "
                        "so far)", self.peer_id[:8], self.param_layout.describe(bad), self.nonfinite_batches)
        else:
            with self._lock:
                self.opt.step()
        self.local_step += 1
        self.steps_in_epoch += 1
        if self.steps_in_epoch >= self.inner_steps:
            self._outer_step()
        else:
            self._follow_swarm()
        return loss

    # ------------------------------------------------------------------ the swarm
    def _follow_swarm(self, force: bool = False) -> None:
        """A few times per gossip interval: download the state if the swarm took an outer step without this
        peer, or if this peer's anchor is not the one the swarm holds at its epoch."""
        now = self.clock.now()
        if now < self._next_check and not force:
            return
        self._next_check = now + self._gossip_interval / 2
        view = self._view()
        self._check_layouts(view)
        if view.donor_epoch > self.local_epoch:
            self._try_load_state(view, f"behind: outer step {self.local_epoch} < the swarm's {view.donor_epoch}")
        else:
            if self.in_sync:
                self._compare_anchors(view)
            if not self.in_sync:
                self._resync(view)
        self._publish()

    def _compare_anchors(self, view: SwarmView) -> None:
        """Peers at one epoch hold one anchor. If they do not (a failed or partial round, different
        initial parameters), the largest set of equal digests (ties: the one holding the lowest peer id;
        never a set of clients alone, which nobody can download from) is the reference."""
        found = reference_digest(view, self.local_epoch)
        if found is None:
            return
        ref, different = found
        if ref != self._param_digest:
            log.warning("%s: at outer step %d the peers hold %d different anchors: resynchronising with the "
                        "reference", self.peer_id[:8], self.local_epoch, different)
            self.in_sync = False
            self._update_sharing()

    def _resync(self, view: SwarmView) -> None:
        ref = [p for p in view.others() if p.in_sync and p.epoch >= self.local_epoch and not p.client]
        if ref:
            self._try_load_state(view, "out of sync after a failed or partial round")
            return
        diverged = [p.peer_id for p in view.at(self.local_epoch) if not p.in_sync and not p.client]
        if not diverged or min(diverged) == self.peer_id:
            log.info("%s: no in-sync peer left; this peer becomes the reference for the others", self.peer_id[:8])
            self.in_sync = True
            self._update_sharing()

    # ------------------------------------------------------------------ the outer step
    def _await_stragglers(self) -> SwarmView:
        """Publish that this peer finished its inner steps; wait (bounded) for the others at its epoch, or
        until one of them entered the round (then follow it: views differ, e.g. on a newcomer only some
        peers heard of, and a round entered late finds its group formed without it)."""
        self._publish()
        deadline = self.clock.now() + self.straggler_timeout
        while True:
            view = self._view()
            if view.donor_epoch > self.local_epoch:
                return view  # the swarm went on without this peer
            # a record of an earlier epoch is a peer behind (it downloads, then steps from this anchor) or one
            # whose newer record has not reached us yet: both are waited for, like the peers still stepping
            waiting = [p for p in view.others() if p.ready and p.epoch <= self.local_epoch and not (
                p.epoch == self.local_epoch and (p.averaging or p.samples >= self.inner_steps))]
            if not waiting or view.averaging_at(self.local_epoch) or self.clock.now() >= deadline:
                if waiting and not view.averaging_at(self.local_epoch):
                    log.warning("%s: %d peer(s) at outer step %d did not finish their inner steps within "
                                "straggler_timeout=%.1fs: averaging without them", self.peer_id[:8], len(waiting),
                                self.local_epoch, self.straggler_timeout)
                self._averaging = True  # entering the round: the peers still waiting follow
                self._publish()
                return view
            self.clock.sleep(min(0.02, self._gossip_interval / 4))

    def _outer_step(self) -> None:
        epoch = self.local_epoch
        t0 = self.clock.now()
        try:
            view = self._await_stragglers()
            rnd: dict[str, Any] = {"epoch": epoch, "ok": False, "group_size": 1, "complete": False,
                                   "waited": self.clock.now() - t0, "error": None}
            if view.donor_epoch > epoch:
                log.warning("%s: the swarm took outer step %d without this peer: downloading its state",
                            self.peer_id[:8], epoch)
                rnd.update(outer_step=False, error="behind")
                self.last_round = rnd
                self._try_load_state(view, "the swarm took the outer step without this peer")
                return
            self._settle_stale()
            with torch.no_grad(), self.averager.get_tensors():  # no round is running: nothing else writes here
                for d, a, p in zip(self._delta, self._anchor, self.params):
                    if d.dtype == p.dtype:
                        torch.sub(a, p, out=d)
                    else:  # float16 parameters: subtract in float32
                        d.copy_(a).sub_(p)
            bad = first_nonfinite(self._delta)
            if bad is not None:
                log.error("%s: the pseudo-gradient of %s is NaN/inf (the inner optimizer diverged): this peer "
                          "contributes nothing to outer step %d", self.peer_id[:8],
                          self.param_layout.describe(bad), epoch)
                rnd["nonfinite_delta"] = True
                with torch.no_grad(), self.averager.get_tensors():
                    for d in self._delta:
                        d.zero_()
            alone = len(view.at(epoch)) <= 1  # peers behind download the state, peers ahead are followed above
            result = None
            if alone:
                self.rounds["alone"] += 1
                rnd["error"] = "no other peer"
            else:
                result = self._average(epoch, weight=_NOTHING if bad is not None else 1.0, rnd=rnd)
            # no finite pseudo-gradient at all: nothing to step on. That includes a round in which every member's
            # delta was non-finite: its "mean" is of zeros, and an outer step on it would move the anchor by the outer
            # optimizer's momentum alone. Every member of a complete round sees these weights and skips alike
            nobody = result is not None and bad is not None and max(result.weights.values(), default=0.0) <= _NOTHING
            if nobody:
                log.error("%s: every member of the round of outer step %d had a NaN/inf pseudo-gradient: skipping "
                          "the outer step", self.peer_id[:8], epoch)
                rnd["nonfinite_everywhere"] = True
            do_step = not (bad is not None and result is None) and not nobody
            if result is None and not alone:
                self.in_sync = False  # others exist and this anchor is now this peer's alone: resync at the next step
            if result is not None and not result.complete:
                self.in_sync = False
            if do_step and result is not None:
                mean_bad = first_nonfinite(self._delta)
                if mean_bad is not None:
                    log.error("%s: the pseudo-gradient of %s is NaN/inf after the round (the averager left this "
                              "peer's own non-finite values in place): skipping outer step %d",
                              self.peer_id[:8], self.param_layout.describe(mean_bad), epoch)
                    rnd["nonfinite_average"] = True
                    do_step = False
            if not do_step:
                self.rounds["skipped_nonfinite"] += 1
            self._apply_outer(do_step)
            rnd["outer_step"] = do_step
            rnd["seconds"] = self.clock.now() - t0
            self.last_round = rnd
        finally:
            self._averaging = False
        self._update_sharing()
        self._publish()

    def _average(self, epoch: int, weight: float, rnd: dict) -> Any:
        """Average the deltas with the peers at this outer step; the `StepResult`, or None if the round failed
        (the deltas then hold this peer's own: "averaged or unchanged")."""
        try:
            fut = self.averager.step(weight=weight, gather={"ep": epoch}, timeout=self.averaging_timeout,
                                     wait=False, round=epoch)
            try:
                result = self.clock.result(fut, self._round_bound())
            except cf.TimeoutError:
                # the averager bounds the round, so this guards against a bug: drop it if it is still matchmaking,
                # else make the next outer step wait for it before it writes the new deltas (`_settle_stale`)
                if not fut.cancel():
                    self._stale = fut
                raise
        except (ZGossipError, cf.TimeoutError) as e:
            self.rounds["failed"] += 1
            rnd["error"] = f"{type(e).__name__}: {e}"
            log.warning("%s: the round of outer step %d failed (%s): stepping on this peer's own pseudo-gradient, "
                        "then resynchronising", self.peer_id[:8], epoch, rnd["error"])
            return None
        rnd.update(ok=True, group_size=len(result.members), complete=result.complete,
                   round_seconds=result.timings.get("total"))
        if result.complete:
            self.rounds["done"] += 1
        else:
            self.rounds["partial"] += 1
            log.warning("%s: the round of outer step %d was partial (lost: %s): elements it did not average take "
                        "this peer's own pseudo-gradient; resynchronising afterwards", self.peer_id[:8], epoch,
                        ", ".join(p[:8] for p in result.lost) or "none")
        return result

    def _round_bound(self) -> float:
        cfg = self.averager.config
        return (self.averaging_timeout or max(5.0, 3 * cfg.matchmaking_time)) + cfg.allreduce_timeout + 30.0

    def _settle_stale(self) -> None:
        """A round that outlived its bound may still write its result into the deltas: let it end first."""
        if self._stale is not None:
            if not self.clock.wait(self._stale, self._round_bound()):
                raise ZGossipError("an averaging round of an earlier outer step is still running after twice its "
                                   "bound: this is a bug in zgossip; restart this peer (it will download the state)")
            self._stale = None

    def _apply_outer(self, do_step: bool) -> None:
        """Reset to the anchor; with `do_step`, one outer step on the (averaged) delta; the result is the new
        anchor. The epoch advances and the scheduler steps either way."""
        with self._lock, torch.no_grad():
            for p, a in zip(self.params, self._anchor):
                p.copy_(a)
            if do_step:
                for p, d in zip(self.params, self._delta):
                    p.grad = (d if d.dtype == p.dtype else d.to(p.dtype)) if p.requires_grad else None
                try:
                    self.outer.step()
                finally:
                    for p in self.params:
                        p.grad = None  # as after zero_grad(): the averager's buffers are not the user's gradients
                for a, p in zip(self._anchor, self.params):
                    a.copy_(p)
            if self.scheduler is not None:
                self.scheduler.step()
            self.local_epoch += 1
            self.steps_in_epoch = 0
            self._param_digest = params_digest(self._anchor, self.local_epoch)

    def synchronize(self) -> None:
        """Compare with the swarm now (not only at the next `step`): download its state if this peer is
        behind it or holds another anchor at its epoch."""
        self._raise_if_closed()
        self._follow_swarm(force=True)
