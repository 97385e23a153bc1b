"""Step control in virtual time: ``step(scheduled_time=..., require_trigger=..., wait=False)``
returns a `StepControl` whose stage, trigger and cancel are checked at every stage, on the real
`Averager` running on the simulator's transport."""
from __future__ import annotations

import numpy as np
import pytest

from sim import NetworkModel, SimCluster
from zgossip import PeerLost, RoundTimeout, StepControl, StepStage
from zgossip.node import NodeConfig, StepPhase

MM = 0.5  # matchmaking_time


def _cluster(n: int, seed: int = 0, group: int | None = None) -> tuple[SimCluster, list]:
    net = NetworkModel(latency=lambda a, b: 0.002, bandwidth=1e8, loss=0.0)
    cl = SimCluster(seed=seed, network=net)
    cfg = NodeConfig(prefix="ctl", target_group_size=group or n, min_group_size=2, matchmaking_time=MM,
                     request_timeout=0.2, part_size_bytes=256, part_timeout=0.5, gossip_interval=0.1, peer_timeout=3.0)
    peers: list = []
    for i in range(n):
        peers.append(cl.add_peer(cfg, tensors=[np.full(64, float(i)), np.full(3, 10.0 * i)], known=list(peers)))
    cl.run(until=0.5)
    return cl, peers


def _wait(cl: SimCluster, ctls: list, until: float = 30.0) -> None:
    cl.run(until=cl.env.now + 0.001)
    while not all(c.done() for c in ctls) and cl.env.now < until:
        cl.run(until=cl.env.now + 0.05)
    assert all(c.done() for c in ctls), [c.stage for c in ctls]


def _run_until_stage(cl: SimCluster, ctl: StepControl, stage: StepStage, limit: float = 10.0) -> None:
    end = cl.env.now + limit
    while ctl.stage is not stage and cl.env.now < end:
        cl.run(until=cl.env.now + 0.01)
    assert ctl.stage is stage, ctl.stage


def test_scheduled_steps_go_through_every_stage_and_average_the_tensors_of_the_scheduled_time():
    cl, peers = _cluster(3)
    t0 = cl.env.now
    at = t0 + 2.0
    ctls = [p.averager.step(scheduled_time=at, wait=False) for p in peers]
    assert all(isinstance(c, StepControl) and c.stage is StepStage.SCHEDULED and not c.triggered for c in ctls)
    cl.run(until=at - MM - 0.01)
    assert all(c.stage is StepStage.SCHEDULED for c in ctls)  # matchmaking begins matchmaking_time early
    cl.run(until=at - MM + 0.001)
    assert all(c.stage is StepStage.MATCHMAKING for c in ctls)
    cl.run(until=at - 0.01)
    assert all(c.stage is StepStage.AWAITING_TRIGGER for c in ctls)  # grouped, waiting for the scheduled time
    for i, p in enumerate(peers):  # changes made before the scheduled time are what gets averaged
        with p.averager.get_tensors() as (a, b):
            a += 1.0
    _wait(cl, ctls)
    for c, p in zip(ctls, peers):
        res = c.result()
        assert c.stage is StepStage.FINISHED and c.triggered
        assert len(res.members) == 3 and res.complete
        assert res.timings["awaiting_trigger"] > 0
        with p.averager.get_tensors() as (a, b):
            np.testing.assert_allclose(a, 2.0)  # mean of 1, 2, 3
            np.testing.assert_allclose(b, 10.0)
    assert ctls[0].result().timings["matchmaking"] <= MM + 0.1


def test_triggered_steps_start_the_all_reduce_at_the_trigger_not_the_window():
    cl, peers = _cluster(3)
    ctls = [p.averager.step(require_trigger=True, timeout=5.0, wait=False) for p in peers]
    assert all(c.stage is StepStage.MATCHMAKING for c in ctls)  # no scheduled time: matchmaking at once
    _run_until_stage(cl, ctls[0], StepStage.AWAITING_TRIGGER)
    cl.run(until=cl.env.now + 1.0)  # long after the group formed: still held
    assert all(c.stage is StepStage.AWAITING_TRIGGER for c in ctls)
    started = cl.env.now
    for i, (c, p) in enumerate(zip(ctls, peers)):
        with p.averager.get_tensors() as (a, b):
            a[:] = 7.0 * i
        c.weight = 1.0 + i
        c.trigger()
        c.trigger()  # idempotent
        assert c.triggered
        with pytest.raises(RuntimeError):
            c.weight = 5.0  # too late: the snapshot is taken
    _wait(cl, ctls)
    want = sum(7.0 * i * (1 + i) for i in range(3)) / 6.0
    for c, p in zip(ctls, peers):
        res = c.result()
        assert res.complete and res.timings["allreduce"] < 0.5 and res.timings["awaiting_trigger"] >= 0.9
        with p.averager.get_tensors() as (a, _):
            np.testing.assert_allclose(a, want)
    assert cl.env.now - started < 0.5


def test_a_trigger_before_the_group_formed_starts_the_all_reduce_as_soon_as_grouped():
    cl, peers = _cluster(2)
    at = cl.env.now + 3.0
    ctls = [p.averager.step(scheduled_time=at, require_trigger=True, wait=False) for p in peers]
    for c in ctls:
        c.trigger()  # still SCHEDULED: starts matchmaking now
        assert c.stage is StepStage.MATCHMAKING
    _wait(cl, ctls)
    assert cl.env.now < at - 1.0
    assert all(c.result().complete for c in ctls)


@pytest.mark.parametrize("stage", [StepStage.SCHEDULED, StepStage.MATCHMAKING, StepStage.AWAITING_TRIGGER])
def test_cancel_before_the_all_reduce_leaves_the_tensors_and_frees_the_averager(stage):
    cl, peers = _cluster(2)
    a0 = peers[0].averager
    before = [t.copy() for t in peers[0].tensors]
    ctls = [p.averager.step(scheduled_time=cl.env.now + 1.5, require_trigger=True, timeout=5.0, wait=False)
            for p in peers]
    _run_until_stage(cl, ctls[0], stage)
    assert ctls[0].cancel() is True
    assert ctls[0].cancelled() and ctls[0].stage is StepStage.FINISHED
    ctls[0].trigger()  # a cancelled step ignores its trigger
    ctls[1].trigger()
    _wait(cl, ctls[1:])
    cl.run(until=cl.env.now + 1.0)
    for t, b in zip(peers[0].tensors, before):
        np.testing.assert_array_equal(t, b)
    if stage is StepStage.AWAITING_TRIGGER:
        # the groupmate left after the group formed: the other member fails at once, not at its timeout
        err = ctls[1].exception()
        assert isinstance(err, PeerLost), err
    # the averager is free again: a plain step with the other peer works
    f = [p.averager.step(wait=False, timeout=3.0) for p in peers]
    _wait(cl, f)
    assert all(x.result().complete for x in f)
    assert a0.transport.node.phase is StepPhase.IDLE


def test_cancel_after_the_group_formed_lets_the_others_average_without_the_canceller():
    cl, peers = _cluster(3)
    ctls = [p.averager.step(require_trigger=True, timeout=5.0, wait=False) for p in peers]
    _run_until_stage(cl, ctls[2], StepStage.AWAITING_TRIGGER)
    ctls[0].trigger()  # one member already runs its all-reduce when the third cancels
    cl.run(until=cl.env.now + 0.05)
    assert ctls[2].cancel() is True
    ctls[1].trigger()
    _wait(cl, ctls[:2])
    for c, p in zip(ctls[:2], peers):
        res = c.result()
        assert peers[2].peer_id in res.lost and set(res.contributors) == {peers[0].peer_id, peers[1].peer_id}
        assert res.timings["total"] < 2.0  # the ABORT told them at once: no part_timeout wait
        with p.averager.get_tensors() as (a, _):
            np.testing.assert_allclose(a, 0.5)
    np.testing.assert_array_equal(peers[2].tensors[0], 2.0)


def test_cancel_once_the_all_reduce_runs_returns_false_and_the_step_completes():
    cl, peers = _cluster(2)
    ctls = [p.averager.step(require_trigger=True, wait=False) for p in peers]
    _run_until_stage(cl, ctls[0], StepStage.AWAITING_TRIGGER)
    ctls[0].trigger()
    assert ctls[0].stage is StepStage.RUNNING_ALLREDUCE
    assert ctls[0].cancel() is False and not ctls[0].cancelled()
    ctls[1].trigger()
    _wait(cl, ctls)
    assert ctls[0].cancel() is False
    assert all(c.result().complete for c in ctls)


def test_an_untriggered_step_times_out_and_its_group_goes_on_without_it():
    cl, peers = _cluster(3)
    ctls = [p.averager.step(require_trigger=True, timeout=2.0, wait=False) for p in peers]
    _run_until_stage(cl, ctls[0], StepStage.AWAITING_TRIGGER)
    ctls[0].trigger()
    ctls[1].trigger()
    _wait(cl, ctls, until=cl.env.now + 20)
    assert isinstance(ctls[2].exception(), RoundTimeout)
    np.testing.assert_array_equal(peers[2].tensors[0], 2.0)
    for c in ctls[:2]:
        res = c.result()
        assert peers[2].peer_id in res.lost
        np.testing.assert_allclose(res and peers[0].tensors[0], 0.5)


def test_cancel_racing_the_trigger_one_of_them_wins_cleanly():
    """Trigger and cancel in the same instant: whichever reaches the node first wins. A paused peer
    queues the trigger's hand-over (as a busy I/O thread would) while the cancel reaches the node
    first: the cancel wins and the queued trigger finds nothing to start. In the other order the
    all-reduce began and cancel says False."""
    cl, peers = _cluster(2)
    ctls = [p.averager.step(require_trigger=True, wait=False) for p in peers]
    _run_until_stage(cl, ctls[0], StepStage.AWAITING_TRIGGER)
    before = peers[0].tensors[0].copy()
    peers[0].pause()
    ctls[0].trigger()
    assert ctls[0].triggered and ctls[0].stage is StepStage.AWAITING_TRIGGER  # hand-over still queued
    assert ctls[0].cancel() is True
    peers[0].resume()
    ctls[1].trigger()
    _wait(cl, ctls[1:])
    cl.run(until=cl.env.now + 1.0)
    np.testing.assert_array_equal(peers[0].tensors[0], before)
    assert isinstance(ctls[1].exception(), PeerLost)
    assert peers[0].averager.transport.node.phase is StepPhase.IDLE
    ctls = [p.averager.step(require_trigger=True, wait=False) for p in peers]
    _run_until_stage(cl, ctls[0], StepStage.AWAITING_TRIGGER)
    ctls[0].trigger()
    assert ctls[0].cancel() is False
    ctls[1].trigger()
    _wait(cl, ctls)
    assert all(c.result().complete for c in ctls)


def test_scheduled_time_on_the_wrong_clock_is_refused():
    cl, peers = _cluster(2)
    with pytest.raises(ValueError, match="clock.now"):
        peers[0].averager.step(scheduled_time=1.7e9, wait=False)
    ctl = peers[0].averager.step(require_trigger=True, gather={"x": 1}, wait=False)  # the averager is still free
    with pytest.raises(ValueError):
        ctl.gather = None
    with pytest.raises(ValueError):
        ctl.weight = 0.0
    assert ctl.cancel()


# ---------------------------------------------------------------------------- the collaborative optimizer
def _collab_run(pre_schedule: bool, epochs: int = 3, n: int = 3) -> list:
    import torch

    from tests.harness import virtual_swarm
    from zgossip.collaborative import CollaborativeOptimizer
    from zgossip.train_demo import Task, make_model

    task = Task()
    models = [make_model(0) for _ in range(n)]

    def make(i, peers, averager_opts):
        return CollaborativeOptimizer(torch.optim.SGD(models[i].parameters(), lr=0.05), prefix="pre",
                                      target_batch_size=1536, batch_size=32, matchmaking_time=0.5,
                                      target_group_size=n + 1, initial_peers=peers, averager_opts=averager_opts,
                                      pre_schedule=pre_schedule)  # n + 1: a target the swarm never reaches

    def body(i, opt):
        clock = opt.clock
        gen = task.stream(n, i)
        clock.sleep(1.0)  # gossip converges
        rounds = []
        deadline = clock.now() + 100
        while opt.local_epoch < epochs and clock.now() < deadline:
            x, y = task.sample(gen, 32)
            torch.nn.functional.cross_entropy(models[i](x), y).backward()
            before = opt.local_epoch
            opt.step()
            opt.zero_grad()
            if opt.local_epoch != before:
                rounds.append(dict(opt.last_round))
            clock.sleep(0.05)
        while clock.now() < deadline and any(p is not None and p.local_epoch < epochs for p in peers_ref):
            clock.sleep(0.05)
        flat = np.concatenate([p.detach().numpy().ravel() for p in models[i].parameters()])
        opt.shutdown()
        return rounds, flat

    peers_ref: list = []

    def track(i, peers, averager_opts):
        opt = make(i, peers, averager_opts)
        peers_ref.extend([None] * (i + 1 - len(peers_ref)))
        peers_ref[i] = opt
        return opt

    return virtual_swarm(n, track, body, seed=4)[1]


def test_collaborative_optimizer_pre_schedules_the_round_and_stays_in_sync():
    pre = _collab_run(True)
    plain = _collab_run(False)
    for out in (pre, plain):
        for _, flat in out[1:]:
            np.testing.assert_array_equal(flat, out[0][1])  # every peer holds the same bits
    pre_rounds = [r for rounds, _ in pre for r in rounds if r.get("ok")]
    plain_rounds = [r for rounds, _ in plain for r in rounds if r.get("ok")]
    assert len(pre_rounds) >= 6 and len(plain_rounds) >= 6
    # most rounds found their group while the last batches computed: the all-reduce began at the trigger
    held = [r for r in pre_rounds if "awaiting_trigger" in r.get("timings", {})]
    assert len(held) >= 0.7 * len(pre_rounds), (len(held), len(pre_rounds))
    mean = lambda rs: sum(r["seconds"] for r in rs) / len(rs)  # noqa: E731
    # virtual time: ~0.02 s of blocking per round against ~0.03 s without. (Before small swarms stopped
    # waiting -- issue 13, item 4 -- the plain rounds of these 3 peers with target 4 waited out the 0.5 s
    # window; now their pool closes once all 3 joined, so what pre-scheduling hides is a few round trips.)
    assert mean(pre_rounds) < mean(plain_rounds), (mean(pre_rounds), mean(plain_rounds))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), "3", True, [1.0]])
def test_a_scheduled_time_that_is_no_finite_number_is_refused(bad):
    """NaN and +inf were refused as "nans/infs from now ... not time.time()", -inf, a str and a bool were
    taken (the str as a time, True as 1.0 s). Each is a ValueError naming the argument; nothing is queued."""
    cl, peers = _cluster(2)
    with pytest.raises(ValueError, match="scheduled_time must be"):
        peers[0].averager.step(scheduled_time=bad, wait=False)
    # a time in the past is fine: matchmaking begins at once and the all-reduce as soon as grouped
    ctls = [p.averager.step(scheduled_time=cl.env.now - 5.0, wait=False, timeout=3.0) for p in peers]
    _wait(cl, ctls)
    assert all(c.result().complete for c in ctls)


def test_the_stage_says_scheduled_only_while_matchmaking_waits_for_its_time():
    """Read before the node reports (its peer paused, as a busy I/O thread would be): a step with no
    time (require_trigger) or one in the past starts matchmaking at once and read SCHEDULED until the
    node's report came; only a step whose matchmaking really waits reads SCHEDULED."""
    cl, peers = _cluster(2)
    a = peers[0].averager
    for kw, stage in [(dict(require_trigger=True), StepStage.MATCHMAKING),
                      (dict(scheduled_time=cl.env.now - 1.0), StepStage.MATCHMAKING),
                      (dict(scheduled_time=cl.env.now + 5 * MM, require_trigger=True), StepStage.SCHEDULED)]:
        peers[0].pause()
        ctl = a.step(wait=False, timeout=3.0, **kw)
        assert ctl.stage is stage, (kw, ctl.stage)
        peers[0].resume()
        cl.run(until=cl.env.now + 0.01)
        assert ctl.stage is stage, (kw, ctl.stage)
        assert ctl.cancel() is True
