"""Overlapped averaging (delay_optimizer_step / delay_grad_averaging / delay_state_averaging) and the
DecentralizedOptimizer's staleness bound, on real averagers in threads of this process (loopback).

Two peers with ``target_batch_size == batch_size`` end an epoch at every step and always meet in a
group of two, so every epoch averages exactly one batch of each peer: runs of different modes see
the same gradients and can be compared bit for bit.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from zgossip.collaborative import CollaborativeOptimizer
from zgossip.optim import DecentralizedSGD
from zgossip.train_demo import Task, make_model

from training_helpers import FAST, live_swarm

BS = 16


def _pair(prefix: str, **kw: Any) -> tuple[list, list]:
    models = [make_model(0) for _ in range(2)]
    opts = live_swarm(2, lambda i, peers: CollaborativeOptimizer(
        torch.optim.Adam(models[i].parameters(), lr=0.01), prefix=prefix, model=models[i], initial_peers=peers,
        target_batch_size=BS, batch_size=BS, matchmaking_time=1.0, target_group_size=2, min_group_size=2,
        averager_opts=dict(FAST), **kw))
    return opts, models


def _run(opts: list, models: list, steps: int, after_step: Any = None, timeout: float = 30.0,
         until_epoch: int | None = None) -> dict:
    """Each peer in a thread: `steps` batches from its own fixed stream (with `until_epoch`: batches of
    ~5 ms until every peer reached that epoch)."""
    task = Task()
    errors: dict[int, BaseException] = {}
    rounds: dict[int, list] = {0: [], 1: []}

    def run(i: int) -> None:
        try:
            gen = task.stream(7, i)
            deadline = time.monotonic() + timeout
            k = 0
            while (k < steps) if until_epoch is None else (min(o.local_epoch for o in opts) < until_epoch):
                k += 1
                assert time.monotonic() < deadline, "training took too long"
                if until_epoch is not None:
                    time.sleep(0.005)  # compute the round can overlap
                x, y = task.sample(gen, BS)
                torch.nn.functional.cross_entropy(models[i](x), y).backward()
                opts[i].step()
                opts[i].zero_grad()
                if after_step is not None:
                    after_step(opts[i])
                rounds[i].append(dict(opts[i].last_round))
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    assert not any(t.is_alive() for t in threads), "a training thread hung"
    return {"errors": errors, "rounds": rounds}


def _params(models: list) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def test_delayed_update_applied_at_once_equals_the_synchronous_path_bit_for_bit():
    """Delay 0: the delayed machinery (separate accumulators, the optimizer's own copy of the parameters,
    the round and optimizer step on the worker) with the update applied before the next batch gives
    exactly the parameters of the synchronous path; so does offloading alone."""
    steps = 4
    results = {}
    for mode, kw, after in [("sync", {}, None),
                            ("offload", dict(offload_optimizer=True), None),
                            ("delay0", dict(delay_optimizer_step=True, delay_grad_averaging=True),
                             lambda o: o.apply_pending(wait=True, timeout=20))]:
        opts, models = _pair(f"eq-{mode}", **kw)
        try:
            out = _run(opts, models, steps, after)
            assert not out["errors"], out["errors"]
            assert all(o.local_epoch == steps for o in opts), [o.local_epoch for o in opts]
            assert all(r.get("ok") and r.get("group_size") == 2 for i in (0, 1) for r in out["rounds"][i])
            if mode == "delay0":
                assert all(r["delayed"] and r["staleness"]["batches"] == 0 for r in out["rounds"][0])
            results[mode] = _params(models)
        finally:
            for o in opts:
                o.shutdown()
    for mode in results:
        for a, b in zip(*results[mode]):
            assert torch.equal(a, b), f"{mode}: the two peers differ"
    for mode in ("offload", "delay0"):
        for a, b in zip(results["sync"][0], results[mode][0]):
            assert torch.equal(a, b), f"{mode} differs from the synchronous path"


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_while_the_delayed_update_steps_leaves_its_gradients_alone(set_to_none):
    """The usual loop calls ``zero_grad()`` right after the ``step()`` that ended an epoch, while the worker
    runs the delayed update. zero_grad also cleared the .grad of the optimizer's own copies, which the worker
    had just set to the averaged gradients: landing before its optimizer step, it made the update step on no
    gradient (set_to_none=False: a zeroed one) and be lost -- the parameters unchanged, last_round["stepped"]
    True. Here the worker's optimizer step waits until zero_grad ran, so that order happens every time."""
    entered, released = threading.Event(), threading.Event()

    class Gated(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            entered.set()
            assert released.wait(10), "the test never released the optimizer step"
            return super().step(closure)

    p = torch.nn.Parameter(torch.zeros(2))
    opt = CollaborativeOptimizer(Gated([p], lr=1.0), prefix=f"zg-race-{set_to_none}", target_batch_size=2,
                                 batch_size=2, delay_optimizer_step=True, load_state_on_start=False,
                                 averager_opts=dict(FAST))
    with opt:
        p.grad = torch.tensor([1.0, -2.0])
        opt.step()  # ends the epoch: the update runs on the worker
        assert entered.wait(10), "the delayed update did not start"
        opt.zero_grad(set_to_none=set_to_none)
        released.set()
        assert opt.apply_pending(wait=True, timeout=10)
        assert opt.last_round["stepped"] and opt.local_epoch == 1
        assert p.tolist() == [-1.0, 2.0]


def test_overlapped_updates_stay_in_sync_with_staleness_at_most_one_step():
    """With the delay on and nobody waiting, batches are computed while the round runs: the staleness is
    reported (at most one global step), both peers hold identical parameters, and the result differs from
    the synchronous one (the gradients really were taken on older parameters)."""
    opts, models = _pair("ov", delay_optimizer_step=True, delay_grad_averaging=True)
    try:
        before = _params(models)
        out = _run(opts, models, 0, until_epoch=4)
        assert not out["errors"], out["errors"]
        for o in opts:
            o.apply_pending(wait=True, timeout=20)
            assert o.pending_update is None
        # the loops stop once both reached the epoch; a peer whose last step began the next epoch's round
        # then runs it alone (the other no longer steps), fails it and steps on local gradients, an epoch
        # ahead and out of sync (about 1 run in 16): the documented recovery, a resynchronisation, evens them
        deadline = time.monotonic() + 15
        while opts[0].local_epoch != opts[1].local_epoch and time.monotonic() < deadline:
            for o in opts:
                o.synchronize()
            time.sleep(0.1)
        applied = [r for r in out["rounds"][0] if r.get("delayed")]
        assert applied and all(r["ok"] and r["stepped"] for r in applied), out["rounds"][0]
        stale = [r["staleness"] for r in applied]
        assert all(s["global_steps"] <= 1 for s in stale)
        assert any(s["batches"] >= 1 for s in stale), stale  # the overlap happened
        assert opts[0].local_epoch == opts[1].local_epoch >= 4
        for a, b in zip(*(m.parameters() for m in models)):
            assert torch.equal(a, b)
        assert any(not torch.equal(a, b) for a, b in zip(before[0], models[0].parameters()))
        # the model's tensors are the optimizer's after the update was applied
        for p, m in zip(opts[0].model_params, opts[0].params):
            assert torch.equal(p, m) and p is not m
    finally:
        for o in opts:
            o.shutdown()


def test_delay_options_are_checked():
    model = make_model(0)
    with pytest.raises(ValueError, match="delay_grad_averaging needs delay_optimizer_step"):
        CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), prefix="x", target_batch_size=8,
                               delay_grad_averaging=True, delay_optimizer_step=False)
    with pytest.raises(ValueError, match="offload_optimizer"):
        CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), prefix="x", target_batch_size=8,
                               delay_optimizer_step=True, offload_optimizer=False)


@pytest.mark.parametrize("delay", [True, False])
def test_delay_optimizer_step_cannot_be_switched_mid_run(delay):
    """It decides where gradients accumulate: switched off after a delayed epoch, the synchronous path
    stepped on the previous epoch's averaged gradient (a lone peer, SGD lr=1: -2 where -11 was due); switched
    on, a background step would write the model's own tensors. Refused; delay_grad_averaging may change."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = CollaborativeOptimizer(torch.optim.SGD([p], lr=1.0), prefix=f"sw{delay}", target_batch_size=1,
                                 batch_size=1, delay_optimizer_step=delay, load_state_on_start=False,
                                 averager_opts=dict(FAST))
    with opt:
        p.grad = torch.ones(3)
        opt.step()
        opt.apply_pending(wait=True, timeout=10)
        with pytest.raises(AttributeError, match="fixed"):
            opt.delay_optimizer_step = not delay
        assert opt.delay_optimizer_step is delay
        if delay:
            opt.delay_grad_averaging = True
            opt.delay_grad_averaging = False
        else:
            with pytest.raises(ValueError, match="needs delay_optimizer_step"):
                opt.delay_grad_averaging = True
        opt.zero_grad()
        p.grad = torch.full((3,), 10.0)
        opt.step()
        opt.apply_pending(wait=True, timeout=10)
        assert p.detach().tolist() == [-11.0] * 3 and opt.local_epoch == 2



def test_offloaded_param_groups_hold_the_model_tensors_so_clipping_over_them_clips_the_gradients():
    """Lightning clips (gradient_clip_val) the gradients of ``optimizer.param_groups``' params. Offloaded, those
    were the optimizer's copies, whose .grad is None: clipping did nothing and the accumulated gradient kept its
    norm (785 where 0.001 was asked, in the Lightning example). The groups now hold the model's tensors; their
    other entries stay the optimizer's (lr written through, and still after loading a state dict)."""
    p = torch.nn.Parameter(torch.zeros(4))
    inner = torch.optim.SGD([p], lr=1.0)
    opt = CollaborativeOptimizer(inner, prefix="clip", target_batch_size=8, batch_size=4, offload_optimizer=True,
                                 load_state_on_start=False, averager_opts=dict(FAST))
    with opt:
        (group,) = opt.param_groups
        assert group["params"] == [p] and group["lr"] == 1.0
        p.grad = torch.full((4,), 100.0)
        torch.nn.utils.clip_grad_norm_([q for g in opt.param_groups for q in g["params"]], 1.0)
        opt.step()
        group["lr"] = 0.5
        assert inner.param_groups[0]["lr"] == 0.5
        opt.zero_grad()
        p.grad = torch.full((4,), 100.0)
        torch.nn.utils.clip_grad_norm_([q for g in opt.param_groups for q in g["params"]], 1.0)
        opt.step()  # 8 samples: one step with the mean clipped gradient (0.5 each), lr 0.5
        assert opt.local_epoch == 1
        assert torch.allclose(p.detach(), torch.full((4,), -0.25))
        inner.load_state_dict(inner.state_dict())  # new group dicts: the view follows them
        opt.param_groups[0]["lr"] = 0.25
        assert inner.param_groups[0]["lr"] == 0.25 and opt.param_groups[0]["params"] == [p]


def test_decentralized_synchronous_rounds_and_bounded_staleness():
    """DecentralizedOptimizer: delay_state_averaging=False applies each round inside the step that started
    it (staleness 0); with max_staleness=1 a round is applied at most one local step after it began."""
    for kw, limit in [(dict(delay_state_averaging=False), 0), (dict(max_staleness=1), 1)]:
        models = [make_model(s) for s in (0, 1)]
        opts: list = []
        try:
            for i in range(2):
                opts.append(DecentralizedSGD(models[i].parameters(), lr=0.05, prefix=f"dz{limit}",
                                             initial_peers=[opts[0].endpoint] if opts else [], average_every=1,
                                             matchmaking_time=0.3, target_group_size=2, averager_opts=dict(FAST),
                                             **kw))
            deadline = time.monotonic() + 10
            while any(o.num_peers < 2 for o in opts):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            task = Task()
            seen: dict[int, list] = {0: [], 1: []}
            errors: list = []

            def run(i: int) -> None:
                try:
                    gen = task.stream(3, i)
                    for _ in range(6):
                        x, y = task.sample(gen, BS)
                        torch.nn.functional.cross_entropy(models[i](x), y).backward()
                        opts[i].step()
                        opts[i].zero_grad()
                        if opts[i].last_round.get("ok"):
                            seen[i].append(opts[i].last_round["staleness"])
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(40)
            assert not errors, errors
            assert seen[0] and seen[1]
            assert max(seen[0] + seen[1]) <= limit, seen
        finally:
            for o in opts:
                o.shutdown()


def test_delay_state_averaging_downloads_in_the_background_and_adopts_at_a_later_step():
    """A peer that is behind (epoch 0 against the swarm's 3) with delay_state_averaging starts the download
    and returns from step() at once; a later step() adopts the state: the swarm's epoch and parameters."""
    models = [make_model(0), make_model(1)]
    opts: list = []
    try:
        opts.append(CollaborativeOptimizer(torch.optim.SGD(models[0].parameters(), lr=0.1), prefix="bg",
                                           model=models[0], target_batch_size=BS, batch_size=BS,
                                           averager_opts=dict(FAST)))
        task = Task()
        gen = task.stream(5, 0)
        for _ in range(3):  # alone: one local step per epoch
            x, y = task.sample(gen, BS)
            torch.nn.functional.cross_entropy(models[0](x), y).backward()
            opts[0].step()
            opts[0].zero_grad()
        assert opts[0].local_epoch == 3
        opts.append(CollaborativeOptimizer(torch.optim.SGD(models[1].parameters(), lr=0.1), prefix="bg",
                                           model=models[1], target_batch_size=BS, batch_size=BS,
                                           initial_peers=[opts[0].endpoint], load_state_on_start=False,
                                           delay_state_averaging=True, averager_opts=dict(FAST)))
        b = opts[1]
        deadline = time.monotonic() + 10
        while b._view().max_epoch < 3:
            assert time.monotonic() < deadline, "B never heard of A's epoch"
            time.sleep(0.02)
        before = _params([models[1]])[0]
        gen = task.stream(5, 1)
        steps = 0
        while b.local_epoch < 3:
            assert time.monotonic() < deadline, "the background download never landed"
            x, y = task.sample(gen, BS)
            torch.nn.functional.cross_entropy(models[1](x), y).backward()
            b.step()
            b.zero_grad()
            steps += 1
            if steps == 1:  # the first step only started the download
                assert b._download is not None and b.local_epoch == 0
                assert all(torch.equal(p, q) for p, q in zip(before, models[1].parameters()))
            time.sleep(0.01)
        assert b.local_epoch == 3 and b._download is None
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q)
    finally:
        for o in opts:
            o.shutdown()


def test_a_delayed_round_whose_pre_scheduled_step_failed_before_its_all_reduce_falls_back_to_a_plain_step():
    """pre_schedule with delay_grad_averaging: the pre-scheduled step is triggered, then its window closes
    with nobody else in it (GroupNotFound, before any all-reduce). The synchronous path averaged with a
    plain step then; the delayed one stepped alone on local gradients and marked itself out of sync,
    while its peer stepped into the round a moment later. Both now meet in the fallback round."""
    opts, models = _pair("psfb", delay_optimizer_step=True, delay_grad_averaging=True)
    task = Task()
    try:
        a, b = opts
        # what _maybe_pre_schedule starts, with a window that closes before peer b steps
        a._scheduled = a.averager.step(require_trigger=True, timeout=1.2, gather={"ep": 0, "n": 0, "bad": 0},
                                       wait=False)

        def batch(i: int) -> None:
            x, y = task.sample(task.stream(7, i), BS)
            torch.nn.functional.cross_entropy(models[i](x), y).backward()

        def run_b() -> None:
            time.sleep(1.6)
            batch(1)
            b.step()
            b.apply_pending(wait=True, timeout=20)

        t = threading.Thread(target=run_b)
        t.start()
        batch(0)
        a.step()
        a.apply_pending(wait=True, timeout=20)
        t.join(30)
        assert not t.is_alive()
        for o in opts:
            assert o.last_round["ok"] and o.last_round["group_size"] == 2 and o.in_sync, o.last_round
            assert o.local_epoch == 1
        for x, y in zip(*(m.parameters() for m in models)):
            assert torch.equal(x, y)
    finally:
        for o in opts:
            o.shutdown()


def test_a_bench_peer_told_to_stop_before_its_start_up_data_just_exits():
    """A bench-train --overlap peer (and `python -m sim overlap`'s) interrupted right after it said
    "ready" received "stop" where it expected its start-up data: AttributeError: 'str' object has no
    attribute 'get' (a traceback per child on SIGHUP, and a slow exit)."""
    import multiprocessing as mp

    from zgossip.bench_overlap import _peer

    parent, child = mp.Pipe()
    parent.send("stop")
    threads = torch.get_num_threads()
    try:
        _peer(0, child, {"batch": 2, "inputs": 4, "hidden": 4, "peers": 2})  # returns, raises nothing
    finally:
        torch.set_num_threads(threads)  # (a bench peer keeps to one thread; this process must not)
    assert parent.recv() == {"event": "ready"}
