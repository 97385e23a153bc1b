"""DecentralizedOptimizer / SGD / Adam: periodic averaging of parameters and optimizer statistics.

Peers are threads of this process, each with its own averager on 127.0.0.1 (ephemeral
ports); every wait is bounded and every averager is shut down.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from zgossip.optim import DecentralizedAdam, DecentralizedOptimizer, DecentralizedSGD, init_optimizer_state
from zgossip.training_state import ModelLayout, pack_state, unpack_state

from harness import virtual_swarm
from training_helpers import FAST, in_threads, live_swarm, local_steps, tiny_model


def test_decentralized_adam_round_averages_parameters_and_adam_statistics():
    models = [tiny_model(i) for i in range(3)]
    opts = live_swarm(3, lambda i, peers: DecentralizedAdam(
        models[i].parameters(), lr=0.01, prefix="adam", average_every=None, average_period=3600.0,
        matchmaking_time=0.5, target_group_size=3, model=models[i], initial_peers=peers, averager_opts=FAST))
    try:
        for i, (m, o) in enumerate(zip(models, opts)):
            local_steps(m, o, seed=i, steps=3)
        names = ("exp_avg", "exp_avg_sq")

        def snapshot(o: DecentralizedAdam) -> list[torch.Tensor]:
            return [p.detach().clone() for p in o.params] + [o.opt.state[p][n].clone() for n in names for p in o.params]

        before = [snapshot(o) for o in opts]
        steps_before = [[float(o.opt.state[p]["step"]) for p in o.params] for o in opts]
        results = in_threads([lambda o=o: o.average(wait=True, timeout=10) for o in opts])
        assert all(r is not None and r.complete and len(r.members) == 3 for r in results)
        after = [snapshot(o) for o in opts]
        for j in range(len(before[0])):
            mean = sum(b[j].double() for b in before) / 3
            for a in after:
                torch.testing.assert_close(a[j].double(), mean, rtol=1e-6, atol=1e-7)
        # what is not named is not averaged
        assert [[float(o.opt.state[p]["step"]) for p in o.params] for o in opts] == steps_before
        # the averaged tensors are the averager's own buffers, never the live parameters
        live = {p.data_ptr() for o in opts for p in o.params}
        with opts[0].averager.get_tensors() as ts:
            assert not live & {t.data_ptr() for t in ts}
    finally:
        for o in opts:
            o.shutdown()


def test_a_round_is_applied_between_steps_with_the_delta_rule():
    """Local progress made while a round ran is kept: x = x_now + (mean - x_at_round_start)."""
    models = [tiny_model(i) for i in range(2)]
    opts = live_swarm(2, lambda i, peers: DecentralizedSGD(
        models[i].parameters(), lr=0.1, prefix="delta", average_every=None, average_period=3600.0,
        matchmaking_time=0.3, target_group_size=2, initial_peers=peers, averager_opts=FAST))
    try:
        start = [[p.detach().clone() for p in o.params] for o in opts]
        futs = [o.average(wait=False) for o in opts]
        for f in futs:
            assert f.result(10).complete
        # the round is over but not applied: the parameters are untouched
        for o, s in zip(opts, start):
            assert all(torch.equal(p, q) for p, q in zip(o.params, s))
        local_steps(models[0], opts[0], seed=7, steps=2, inner=True)  # progress while the result waits
        progressed = [p.detach().clone() for p in opts[0].params]
        assert opts[0].apply_pending() is not None
        for p, now, s0, s1 in zip(opts[0].params, progressed, start[0], start[1]):
            torch.testing.assert_close(p.detach(), now + ((s0 + s1) / 2 - s0), rtol=1e-5, atol=1e-6)
        # the other peer made no progress: it gets the mean exactly
        opts[1].apply_pending()
        for p, s0, s1 in zip(opts[1].params, start[0], start[1]):
            torch.testing.assert_close(p.detach(), (s0 + s1) / 2, rtol=0, atol=1e-7)
    finally:
        for o in opts:
            o.shutdown()


@pytest.mark.parametrize("every", [{"average_every": None}, {}], ids=["average_every=None", "period alone"])
def test_averaging_every_t_seconds(every):
    """``average_period``: a round starts when the wall clock enters a new period (the same moment on every
    peer), whatever the step rate. In virtual time: 2.5 s of steps every 10 ms with a 0.4 s period.
    Given alone (as docs/training.md shows it), the period used to be joined by average_every's default of 1:
    a round at every step (about 250 rounds here instead of 6)."""
    models = [tiny_model(i) for i in range(2)]

    def make(i, peers, opts):
        return DecentralizedSGD(models[i].parameters(), lr=0.01, prefix="period", **every,
                                average_period=0.4, matchmaking_time=0.2, target_group_size=2,
                                initial_peers=peers, averager_opts=opts)

    def train(i, opt):
        clock = opt.clock
        start = clock.now()
        while clock.now() < start + 2.5:
            local_steps(models[i], opt, seed=i, steps=1)
            clock.sleep(0.01)
        opt.apply_pending(wait=True, timeout=10)
        return opt.rounds, clock.now() - start

    opts, out = virtual_swarm(2, make, train)
    for rounds, took in out:
        # 2.5 s cross 6 period boundaries (a round every 0.4 s); one may fall while the last still runs
        assert 5 <= rounds["done"] <= 7 and rounds["failed"] == 0, rounds
        assert 2.5 <= took < 3.0
    assert out[0][0]["done"] == out[1][0]["done"]  # both peers start their rounds at the same moments


def test_a_peer_too_far_behind_loads_state_and_one_slightly_behind_adopts_the_epoch():
    lead_model = tiny_model(0)
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9)  # noqa: E731
    lead = DecentralizedAdam(lead_model.parameters(), lr=0.01, prefix="lag", average_every=None,
                             average_period=3600.0, steps_per_epoch=5, scheduler=sched, averager_opts=FAST)
    try:
        local_steps(lead_model, lead, seed=0, steps=31)  # alone: 6 epochs
        assert lead.local_epoch == 6
        new_model = tiny_model(1)
        new = DecentralizedAdam(new_model.parameters(), lr=0.01, prefix="lag", average_every=None,
                                average_period=3600.0, steps_per_epoch=5, max_epoch_lag=2, scheduler=sched,
                                initial_peers=[lead.endpoint], averager_opts=FAST)
        try:
            assert new.local_epoch == 6
            for a, b in zip(lead_model.parameters(), new_model.parameters()):
                assert torch.equal(a, b)
            for pa, pb in zip(lead.params, new.params):
                for k in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(lead.opt.state[pa][k], new.opt.state[pb][k])
            assert new.param_groups[0]["lr"] == pytest.approx(lead.param_groups[0]["lr"])
            assert new.scheduler.last_epoch == lead.scheduler.last_epoch
        finally:
            new.shutdown()
        near_model = tiny_model(2)
        near = DecentralizedAdam(near_model.parameters(), lr=0.01, prefix="lag", average_every=None,
                                 average_period=3600.0, steps_per_epoch=5, max_epoch_lag=10,
                                 initial_peers=[lead.endpoint], load_state_on_start=False, averager_opts=FAST)
        try:
            assert near.local_epoch == 0
            local_steps(near_model, near, seed=2, steps=1)
            deadline = time.monotonic() + 5
            while near.local_epoch < 6:
                assert time.monotonic() < deadline
                time.sleep(0.05)
                local_steps(near_model, near, seed=3, steps=1)
            # within the allowed lag: it only adopted the epoch, it downloaded nothing
            assert not torch.equal(next(near_model.parameters()), next(lead_model.parameters()))
        finally:
            near.shutdown()
    finally:
        lead.shutdown()


def test_wrapping_any_optimizer_and_clear_errors():
    m = tiny_model(0)
    rms = torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.9)
    with pytest.raises(ValueError, match="nothing to average"):
        DecentralizedOptimizer(rms, prefix="e", average_parameters=False)
    with pytest.raises(ValueError, match="say when"):
        DecentralizedOptimizer(rms, prefix="e", average_every=None)
    with pytest.raises(Exception, match=r"no floating-point statistic 'nope'.*square_avg"):
        DecentralizedOptimizer(rms, prefix="e", average_opt_statistics=("nope",), averager_opts=FAST)
    with DecentralizedOptimizer(rms, prefix="e", average_opt_statistics=("square_avg", "momentum_buffer"),
                                averager_opts=FAST) as opt:
        assert len(opt.layout.shapes) == 3 * len(opt.params)
        local_steps(m, opt, seed=0, steps=2)  # alone: rounds fail quietly, training goes on
        assert opt.local_step == 2


def test_init_optimizer_state_creates_statistics_without_training():
    m = tiny_model(0)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5)
    before = [p.detach().clone() for p in m.parameters()]
    init_optimizer_state(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    for p in m.parameters():
        st = opt.state[p]
        assert float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
        assert p.grad is None


def test_pack_state_round_trip_and_refusals():
    m = tiny_model(0)
    opt = torch.optim.Adam(m.parameters(), lr=0.01, betas=(0.8, 0.9))
    local_steps(m, opt, seed=0, steps=2)
    state = {"optimizer": opt.state_dict(), "mask": torch.tensor([True, False]), "arr": np.arange(3),
             ("a", 1): [1.5, None, "x", b"y"]}
    meta, arrays = pack_state(state)
    back = unpack_state(meta, arrays)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert set(back["optimizer"]["state"]) == set(opt.state_dict()["state"])  # int keys survive
    assert back["mask"].dtype == torch.bool and back["mask"].tolist() == [True, False]
    assert back[("a", 1)] == [1.5, None, "x", b"y"] and back["arr"].tolist() == [0, 1, 2]
    other = torch.optim.Adam(tiny_model(1).parameters(), lr=0.5)
    other.load_state_dict(back["optimizer"])
    assert other.param_groups[0]["lr"] == 0.01
    # the packed arrays are copies: later training does not change what would be sent
    local_steps(m, opt, seed=1, steps=1)
    assert not torch.equal(unpack_state(meta, arrays)["optimizer"]["state"][0]["exp_avg"],
                           opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(TypeError, match=r"state\['fn'\]: function cannot be shared"):
        pack_state({"fn": lambda: 0})
    with pytest.raises(TypeError, match="complex64 cannot be shared"):
        pack_state([torch.zeros(2, dtype=torch.complex64)])
    # bfloat16 travels as float32 (exact) and comes back as bfloat16; an unknown tensor kind is refused
    x = torch.randn(5).to(torch.bfloat16)
    meta, arrays = pack_state({"x": x})
    assert arrays[0].dtype == np.float32
    back = unpack_state(meta, arrays)["x"]
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)
    with pytest.raises(ValueError, match="unknown tensor kind"):
        unpack_state({"T": [0, False, "float8"]}, arrays)


def test_model_layout_names_the_tensor_that_differs():
    a = ModelLayout.of([torch.zeros(4, 3), torch.zeros(3)], ["fc.weight", "fc.bias"])
    b = ModelLayout.of([torch.zeros(4, 5), torch.zeros(3)], ["fc.weight", "fc.bias"])
    assert a.difference(a) is None
    assert a.difference(b) == ("tensor 0 'fc.weight' (shape (4, 3), float32) here has shape (4, 5), float32 "
                               "at the other peer")
    assert "tensor 0 'fc.weight'" in a.difference_from_digest(2, b.signature)
    c = ModelLayout.of([torch.zeros(4, 3)], ["fc.weight"])
    assert a.difference(c) == "this peer has 2 tensors, the other peer has 1"
    assert a.fingerprint != b.fingerprint and len(a.signature) == 2


def test_the_delta_rule_on_float16_parameters_does_not_overflow():
    """``x += mean - snapshot`` was computed in the parameter's dtype: with float16 parameters the
    difference of two values in range overflows (a mean of -23,328 against a snapshot of 60,000 is
    -83,328, past float16's 65,504), and a peer that had made local progress got -inf. It is now
    computed in float32 and rounded once. Three peers in virtual time."""

    def make(i: int, peers: list, opts: dict) -> DecentralizedSGD:
        p = torch.nn.Parameter(torch.full((4,), 60000.0 if i == 0 else -65000.0, dtype=torch.float16))
        return DecentralizedSGD([p], lr=0.1, prefix="fp16-delta", average_every=None, average_period=3600.0,
                                matchmaking_time=0.5, target_group_size=3, min_group_size=3, initial_peers=peers,
                                averager_opts=opts)

    def body(i: int, o: DecentralizedSGD) -> torch.Tensor:
        clock = o.clock
        while o.num_peers < 3:
            clock.sleep(0.05)
        assert clock.result(o.average(wait=False), 10).complete
        if i == 0:
            with torch.no_grad():
                o.params[0].add_(32.0)  # local progress while the result waited: the delta path
        assert o.apply_pending() is not None
        out = o.params[0].detach().clone()
        o.shutdown()
        return out

    _, out = virtual_swarm(3, make, body)
    mean = torch.tensor((60000.0 - 2 * 65000.0) / 3).to(torch.float16)  # the averaged buffer, in float16
    assert torch.equal(out[0], torch.full((4,), 60032.0 + (mean.item() - 60000.0)).to(torch.float16)), out[0]
    assert all(torch.equal(o, torch.full((4,), mean.item(), dtype=torch.float16)) for o in out[1:]), out
