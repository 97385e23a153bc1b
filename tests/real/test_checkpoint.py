"""Checkpoint and resume of the training wrappers: ``state_dict()`` / ``load_state_dict()`` (zgossip.checkpoint).

Peers are threads of this process, each with its own averager on 127.0.0.1 (ephemeral ports);
checkpoints go through a real ``torch.save`` / ``torch.load`` (weights_only, torch's default).
Every wait is bounded and every averager is shut down.
"""
from __future__ import annotations

import io
import threading
import time
from typing import Any

import pytest
import torch

import zgossip
from zgossip.collaborative import CollaborativeOptimizer
from zgossip.optim import DecentralizedAdam, DecentralizedSGD
from zgossip.training_state import LayoutMismatch

from training_helpers import FAST, local_steps, tiny_model



def _save(model: torch.nn.Module, opt: Any) -> dict:
    """A checkpoint as users write one, read back as torch.load reads it (copies: training goes on)."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf)


def _resume(model: torch.nn.Module, opt: Any, ckpt: dict, model_first: bool = True) -> None:
    if model_first:
        model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    if not model_first:
        model.load_state_dict(ckpt["model"])


def _count_downloads(opt: Any) -> list:
    calls: list = []
    real = opt.averager.load_state_from_peers
    opt.averager.load_state_from_peers = lambda **kw: (calls.append(kw), real(**kw))[1]
    return calls


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _step_lr(o: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)


def test_decentralized_adam_round_trip_into_a_fresh_wrapper_continues_bit_for_bit():
    """Adam's moments and step counts, the scheduler's LR, the epoch and the local step counters survive
    torch.save/torch.load into a fresh wrapper; the next step of both is identical."""
    kw = dict(lr=0.01, average_every=None, average_period=3600.0, steps_per_epoch=2, scheduler=_step_lr,
              averager_opts=FAST)
    model = tiny_model(0)
    opt = DecentralizedAdam(model.parameters(), prefix="rt-a", **kw)
    fresh_model = tiny_model(1)
    fresh = DecentralizedAdam(fresh_model.parameters(), prefix="rt-b", **kw)
    try:
        local_steps(model, opt, seed=0, steps=5)  # alone: epochs at steps 2 and 4, one step into epoch 2
        assert (opt.local_epoch, opt.local_step, opt.steps_in_epoch) == (2, 5, 1)
        ckpt = _save(model, opt)
        assert ckpt["opt"]["zgossip"]["progress"] == {"local_epoch": 2, "in_sync": True, "local_step": 5,
                                                      "steps_in_epoch": 1}
        _resume(fresh_model, fresh, ckpt)
        assert (fresh.local_epoch, fresh.local_step, fresh.steps_in_epoch) == (2, 5, 1)
        assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.01 * 0.25
        assert fresh.scheduler.last_epoch == opt.scheduler.last_epoch == 2
        for p, q in zip(opt.params, fresh.params):
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.opt.state[p][k], fresh.opt.state[q][k])
        local_steps(model, opt, seed=9, steps=1)
        local_steps(fresh_model, fresh, seed=9, steps=1)
        assert _equal(model, fresh_model)
        assert fresh.local_epoch == opt.local_epoch == 3  # the epoch's 2nd step, counted on both
    finally:
        opt.shutdown()
        fresh.shutdown()


def test_decentralized_resume_downloads_only_from_a_swarm_ahead_and_drops_a_round_in_flight():
    kw = dict(lr=0.01, prefix="resume", average_every=None, average_period=3600.0, steps_per_epoch=2,
              max_epoch_lag=5, matchmaking_time=0.3, target_group_size=2, averager_opts=FAST)
    lead_model = tiny_model(0)
    lead = DecentralizedAdam(lead_model.parameters(), **kw)
    try:
        local_steps(lead_model, lead, seed=0, steps=2)
        at_1 = _save(lead_model, lead)
        local_steps(lead_model, lead, seed=1, steps=2)
        at_2 = _save(lead_model, lead)
        assert lead.local_epoch == 2 and lead.steps_in_epoch == 0
        local_steps(lead_model, lead, seed=2, steps=1, inner=True)  # the lead moves on (the epoch does not)
        model = tiny_model(1)
        opt = DecentralizedAdam(model.parameters(), initial_peers=[lead.endpoint], **kw)
        try:
            assert opt.local_epoch == 2  # a newcomer at epoch 0: it downloaded the swarm's state
            downloads = _count_downloads(opt)
            # a round both peers start, then a checkpoint loads on one: that round averaged the replaced state
            rounds = [lead.average(wait=False), opt.average(wait=False)]
            _resume(model, opt, at_2)
            assert lead.apply_pending(wait=True, timeout=10) is not None  # the round itself went through
            assert rounds[1].result(10).complete and opt.apply_pending(wait=True, timeout=10) is None  # dropped here
            for p, q in zip(model.parameters(), at_2["model"].values()):
                assert torch.equal(p.detach(), q)
            # the swarm is at the checkpoint's epoch: training goes on without a download
            local_steps(model, opt, seed=3, steps=1)
            assert opt.local_epoch == 2 and not downloads
            # a checkpoint of an epoch behind the swarm: loaded, then the swarm's state downloaded at the next
            # step, as a wrapper built with local_epoch=1 would (although max_epoch_lag=5 would only adopt it)
            _resume(model, opt, at_1)
            assert opt.local_epoch == 1
            local_steps(model, opt, seed=4, steps=1)
            assert len(downloads) == 1 and opt.local_epoch == 2
            assert _equal(model, lead_model)
        finally:
            opt.shutdown()
    finally:
        lead.shutdown()


def test_collaborative_resume_at_the_swarms_epoch_downloads_nothing_in_either_load_order():
    """The parameter digest a peer publishes follows the model loaded after the optimizer's state, too: else
    the peers at one epoch disagree and one downloads the other's state."""
    kw = dict(prefix="c-resume", target_batch_size=4, batch_size=4, averager_opts=FAST)
    model_a = tiny_model(0)
    a = CollaborativeOptimizer(torch.optim.Adam(model_a.parameters(), lr=0.01), scheduler=_step_lr, **kw)
    try:
        local_steps(model_a, a, seed=0, steps=1)
        at_1 = _save(model_a, a)
        local_steps(model_a, a, seed=1, steps=1)
        at_2 = _save(model_a, a)
        assert a.local_epoch == 2 and at_2["opt"]["zgossip"]["progress"] == {"local_epoch": 2, "in_sync": True}
        model = tiny_model(1)
        b = CollaborativeOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), scheduler=_step_lr,
                                   initial_peers=[a.endpoint], load_state_on_start=False, **kw)
        try:
            downloads = _count_downloads(b)
            _resume(model, b, at_2, model_first=False)
            deadline = time.monotonic() + 10
            while {p.epoch for p in b._view().peers} != {2}:
                assert time.monotonic() < deadline, "records not seen"
                time.sleep(0.02)
            assert b.synchronize() is False and not downloads and b.local_epoch == 2
            assert b._param_digest == a._param_digest  # what b publishes: the same parameters at the same epoch
            assert b.param_groups[0]["lr"] == a.param_groups[0]["lr"] == 0.01 * 0.25
            _resume(model, b, at_1)
            assert b.local_epoch == 1 and b.samples == 0
            assert b.synchronize() is True and len(downloads) == 1 and b.local_epoch == 2
            assert _equal(model, model_a)
        finally:
            b.shutdown()
    finally:
        a.shutdown()


class _Held(torch.optim.SGD):
    """SGD whose step waits for `gate` (so that a delayed update stays in flight)."""

    gate = threading.Event()
    entered = threading.Event()

    def step(self, closure: Any = None) -> Any:
        _Held.entered.set()
        assert _Held.gate.wait(10)
        return super().step(closure)


def test_collaborative_delayed_update_state_dict_applies_it_and_load_waits_then_discards_it():
    p = torch.nn.Parameter(torch.zeros(3))
    _Held.gate.set()
    opt = CollaborativeOptimizer(_Held([p], lr=1.0), prefix="held", target_batch_size=1, batch_size=1,
                                 delay_optimizer_step=True, load_state_on_start=False, averager_opts=dict(FAST))
    try:
        p.grad = torch.ones(3)
        opt.step()  # alone: an update in flight on the worker
        assert opt.clock.wait(opt.pending_update.future, 10)
        ckpt = {"opt": opt.state_dict()}  # applies it: epoch 1, p = -1
        ckpt["p"] = p.detach().clone()
        assert opt.pending_update is None and ckpt["opt"]["zgossip"]["progress"]["local_epoch"] == 1
        assert p.detach().tolist() == [-1.0] * 3
        _Held.gate.clear()
        _Held.entered.clear()
        opt.zero_grad()
        p.grad = torch.full((3,), 10.0)
        opt.step()
        assert _Held.entered.wait(10)  # the worker is inside the optimizer step, holding the wrapper's lock
        with pytest.raises(zgossip.RoundTimeout, match="still running.*nothing was loaded"):
            opt.load_state_dict(ckpt["opt"], timeout=0.2)
        assert opt.pending_update is not None and opt.local_epoch == 1
        _Held.gate.set()
        opt.load_state_dict(ckpt["opt"])  # waits for the update, then discards it: the checkpoint replaces it
        assert opt.pending_update is None and opt.local_epoch == 1
        # the optimizer stepped its own copy to -11; the loaded model (-1) is what the next step starts from
        with torch.no_grad():
            p.copy_(ckpt["p"])
        opt.zero_grad()
        p.grad = torch.ones(3)
        opt.step()
        opt.apply_pending(wait=True, timeout=10)
        assert p.detach().tolist() == [-2.0] * 3 and opt.local_epoch == 2
    finally:
        _Held.gate.set()
        opt.shutdown()


def test_bad_state_dicts_are_refused_with_clear_errors_and_change_nothing():
    model = tiny_model(0)
    sgd = DecentralizedSGD(model.parameters(), lr=0.1, prefix="bad", momentum=0.9, averager_opts=FAST)
    others: list = []
    try:
        local_steps(model, sgd, seed=0, steps=1)
        good = sgd.state_dict()
        before = _save(model, sgd)["opt"]
        adam = DecentralizedAdam(tiny_model(0).parameters(), prefix="bad-adam", averager_opts=FAST)
        coll = CollaborativeOptimizer(torch.optim.SGD(tiny_model(0).parameters(), lr=0.1, momentum=0.9),
                                      prefix="bad-c", target_batch_size=4, averager_opts=FAST)
        other = DecentralizedSGD(torch.nn.Linear(8, 3).parameters(), lr=0.1, prefix="bad-o", averager_opts=FAST)
        m = tiny_model(0)
        split = DecentralizedSGD([{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}],
                                 lr=0.1, prefix="bad-g", averager_opts=FAST)
        sched = DecentralizedSGD(tiny_model(0).parameters(), lr=0.1, prefix="bad-s", scheduler=_step_lr,
                                 averager_opts=FAST)
        stats = DecentralizedSGD(tiny_model(0).parameters(), lr=0.1, prefix="bad-m", momentum=0.9,
                                 average_opt_statistics=("momentum_buffer",), averager_opts=FAST)
        plain = DecentralizedSGD(tiny_model(0).parameters(), lr=0.1, prefix="bad-n", averager_opts=FAST)
        others += [adam, coll, other, split, sched, stats, plain]

        def edited(**progress: Any) -> dict:
            return {**good, "zgossip": {**good["zgossip"], "progress": {**good["zgossip"]["progress"], **progress}}}

        cases = [
            (sgd, [good], TypeError, "expects the dict DecentralizedSGD.state_dict"),
            (sgd, sgd.opt.state_dict(), ValueError, r"plain optimizer state dict.*opt\.opt\.load_state_dict"),
            (sgd, {k: v for k, v in good.items() if k != "scheduler"}, ValueError, "scheduler missing"),
            (sgd, edited(local_step=None), ValueError, "local_step must be a whole number"),
            (sgd, edited(local_epoch=-1), ValueError, "local_epoch must be a whole number >= 0"),
            (sgd, {**good, "zgossip": {**good["zgossip"], "format": 99}}, ValueError, "format 99"),
            (sgd, adam.state_dict(), ValueError, "optimizer class Adam; this DecentralizedSGD wraps class SGD"),
            (sgd, sched.state_dict(), ValueError, "holds the state of an LR scheduler \\(StepLR\\)"),
            (sched, good, ValueError, "has an LR scheduler \\(StepLR\\) but the state dict holds none"),
            (coll, good, ValueError, "saved by a DecentralizedSGD.*cannot load it"),
            (other, good, LayoutMismatch, r"tensor 0 '#0' \(shape \(3, 8\), float32\) here has shape \(16, 8\), "
                                          "float32 at the checkpoint"),
            (split, good, LayoutMismatch, r"param groups hold \[4\] tensors, this optimizer's \[2, 2\]"),
            (stats, plain.state_dict(), ValueError, "no statistic 'momentum_buffer'"),
            # keys turned into strings (a trip through JSON): torch would keep them unused and start the
            # momentum afresh, silently
            (sgd, {**good, "optimizer": {**good["optimizer"], "state": {
                str(k): v for k, v in good["optimizer"]["state"].items()}}}, ValueError,
             r"optimizer state has entries for '0', '1', '2', which no param group lists"),
            (sgd, {**good, "optimizer": {**good["optimizer"], "state": {
                **good["optimizer"]["state"], 0: {"momentum_buffer": torch.full((16, 8), float("nan"))}}}},
             ValueError, r"optimizer state 'momentum_buffer' of tensor 0 '#0' \(shape \(16, 8\), float32\) holds NaN/inf"),
        ]
        for opt, sd, error, match in cases:
            with pytest.raises(error, match=match):
                opt.load_state_dict(sd)
        # used to fail deep in a wait, if at all (TypeError on '>', OverflowError for inf, a RoundTimeout
        # "after nans" for NaN), and only with a delayed update in flight
        for timeout in ("5", -1.0, float("nan"), float("inf"), True):
            with pytest.raises(ValueError, match="timeout must be None .* or a finite number of seconds >= 0"):
                sgd.load_state_dict(good, timeout=timeout)
        for opt in others:  # nothing was written
            assert opt.local_epoch == 0 and (opt.scheduler is None or opt.scheduler.last_epoch == 0)
        after = _save(model, sgd)["opt"]
        assert after["zgossip"] == before["zgossip"]
        for k, st in before["optimizer"]["state"].items():
            assert torch.equal(after["optimizer"]["state"][k]["momentum_buffer"], st["momentum_buffer"])
        sgd.shutdown()
        with pytest.raises(zgossip.ZGossipError, match="shut down"):
            sgd.load_state_dict(good)
    finally:
        sgd.shutdown()
        for o in others:
            o.shutdown()
