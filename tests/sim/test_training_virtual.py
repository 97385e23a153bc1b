"""The training classes in virtual time: moolib's Accumulator loop, the collaborative optimizer with a late
joiner, and background averaging of DecentralizedSGD — the real classes on the simulator's transport.

These are the training tests whose real-ZeroMQ versions (tests/real/) have to pace themselves with the
wall clock; here every wait and sleep goes through the averager's clock, so a run costs no idle wall
time and one seed gives one run (asserted: the same seed twice gives bit-identical parameters).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.harness import virtual_swarm
from zgossip.accumulator import Accumulator, Group
from zgossip.collaborative import CollaborativeOptimizer
from zgossip.optim import DecentralizedSGD
from zgossip.trainer import params_digest
from zgossip.train_demo import Task, evaluate, make_model


def _flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


# ---------------------------------------------------------------------------- moolib's loop
def _moolib_run(seed: int) -> tuple[list, list, float]:
    """moolib's documented Accumulator loop on 3 peers (peer 2 joins 2 s late), with its
    ``time.sleep(0.25)`` taken from the clock; each peer stops at model version 12 and stays up serving
    state until the others finish."""
    versions, batch_size, n = 12, 32, 3
    task = Task()
    models = [make_model(i) for i in range(n)]  # different initialisations: the state sync must fix that
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    finished = [False] * n

    def make(i, peers, averager_opts):
        group = Group("foo_group", initial_peers=peers, **averager_opts)
        acc = Accumulator("bar", models[i].parameters(), models[i].buffers(), group=group, virtual_batch_size=96,
                          target_group_size=n)
        acc.start()
        return acc

    def body(i, acc):
        clock, group, opt = acc.clock, acc.group, opts[i]
        gen = task.stream(n, i)
        deadline = clock.now() + 120
        while acc.model_version() < versions and clock.now() < deadline:
            group.update()
            acc.update()
            if not acc.connected():
                clock.sleep(0.25)
                continue
            if acc.wants_state():
                acc.set_state({"optimizer": opt.state_dict()})
            if acc.has_new_state():
                opt.load_state_dict(acc.state()["optimizer"])
            if acc.wants_gradients():
                x, y = task.sample(gen, batch_size)
                torch.nn.functional.cross_entropy(models[i](x), y).backward()
                acc.reduce_gradients(batch_size)
            if acc.has_gradients():
                opt.step()
                acc.zero_gradients()
            clock.sleep(0.01)  # the compute of one batch
        finished[i] = True
        while not all(finished) and clock.now() < deadline:  # stay up for peers still catching up
            acc.update()
            if acc.wants_state():
                acc.set_state({"optimizer": opt.state_dict()})
            clock.sleep(0.005)
        out = (acc.model_version(), _flat(models[i]), clock.now())
        acc.shutdown()
        return out

    _, out = virtual_swarm(n, make, body, seed=seed, start_at=[0.0, 0.0, 2.0])
    hx, hy = task.heldout()
    return out, models, evaluate(make_model(0), hx, hy)[0]


def test_moolib_loop_in_virtual_time_trains_keeps_peers_identical_and_is_reproducible():
    out, models, untrained = _moolib_run(seed=3)
    assert all(v >= 12 for v, _, _ in out), [v for v, _, _ in out]
    # every version is one all-reduce of the same gradients: the peers hold the same bits
    for _, flat, _ in out[1:]:
        np.testing.assert_array_equal(flat, out[0][1])
    hx, hy = Task().heldout()
    assert evaluate(models[0], hx, hy)[0] < 0.9 * untrained
    assert all(t < 120 for _, _, t in out)  # finished in virtual time, far within the deadline
    again, _, _ = _moolib_run(seed=3)
    for (v1, f1, t1), (v2, f2, t2) in zip(out, again):
        assert v1 == v2 and t1 == t2
        np.testing.assert_array_equal(f1, f2)


# ---------------------------------------------------------------------------- collaborative, late joiner
def test_collaborative_global_batch_in_virtual_time_with_a_late_joiner():
    """3 trainers start, a 4th joins at t = 1 s (mid-run: 3 peers with target 4 no longer wait out the
    matchmaking window every epoch, so the run is over in a few seconds): it downloads the state and continues at the swarm's epoch;
    at the end all 4 hold bit-identical parameters at the same epoch."""
    epochs, n = 10, 4
    task = Task()
    models = [make_model(i) for i in range(n)]
    joined_at: dict[int, int] = {}

    def make(i, peers, averager_opts):
        opt = torch.optim.SGD(models[i].parameters(), lr=0.05)
        return CollaborativeOptimizer(opt, prefix="collab", target_batch_size=192, batch_size=32,
                                      matchmaking_time=0.5, target_group_size=n, initial_peers=peers,
                                      averager_opts=averager_opts)

    def body(i, opt):
        clock = opt.clock
        joined_at[i] = opt.local_epoch
        gen = task.stream(n, i)
        deadline = clock.now() + 200
        while opt.local_epoch < epochs and clock.now() < deadline:
            x, y = task.sample(gen, 32)
            torch.nn.functional.cross_entropy(models[i](x), y).backward()
            opt.step()
            opt.zero_grad()
            clock.sleep(0.05)  # the compute of one batch
        # stay up for peers still finishing (they may need this one in a group, or as a donor)
        while clock.now() < deadline and any(o is not None and o.local_epoch < epochs for o in peers_ref):
            clock.sleep(0.05)
        out = (opt.local_epoch, opt.in_sync, _flat(models[i]))
        opt.shutdown()  # inside the simulated thread: a shutdown may wait (virtually) for owed results
        return out

    peers_ref: list = []

    def make_and_track(i, peers, averager_opts):
        opt = make(i, peers, averager_opts)
        while len(peers_ref) <= i:
            peers_ref.append(None)
        peers_ref[i] = opt
        return opt

    _, out = virtual_swarm(n, make_and_track, body, seed=1, start_at=[0.0, 0.0, 0.0, 1.0])
    assert joined_at[3] >= 2, joined_at  # the newcomer started at the swarm's epoch, not at 0
    assert all(e == epochs for e, _, _ in out), [e for e, _, _ in out]
    for _, _, flat in out[1:]:
        np.testing.assert_array_equal(flat, out[0][2])


# ---------------------------------------------------------------------------- collaborative, a mixed-epoch round
@pytest.mark.parametrize("delay", [False, True])
def test_a_member_behind_in_a_mixed_epoch_round_does_not_step_and_resynchronises(delay):
    """Rounds are keyed by the prefix alone, so a peer whose records lagged can end an epoch the others
    already ended and meet them in their next round. Forced here: peer 0 holds epoch 1 and peer 1 epoch 0
    (same parameters), and both end their epoch at once. Peer 0 (the newest epoch) steps to epoch 2;
    peer 1 must not step to epoch 1 with parameters peer 0 never held at epoch 1: it keeps epoch 0 and
    its parameters, marks itself out of sync, and its next step downloads peer 0's state."""
    task = Task()
    models = [make_model(0) for _ in range(2)]  # the same initialisation
    seen: dict[int, dict] = {}
    done = [False, False]

    def make(i, peers, averager_opts):
        opt = torch.optim.SGD(models[i].parameters(), lr=0.5)
        return CollaborativeOptimizer(opt, prefix="mixed", target_batch_size=10_000, batch_size=32,
                                      matchmaking_time=0.5, target_group_size=2, initial_peers=peers,
                                      averager_opts=averager_opts, delay_optimizer_step=delay,
                                      delay_grad_averaging=delay)

    def body(i, opt):
        clock = opt.clock
        deadline = clock.now() + 30
        while opt.num_peers < 2 and clock.now() < deadline:
            clock.sleep(0.05)
        if i == 0:  # ahead: it already ended epoch 0 (with no change, so that both hold the same values)
            opt.local_epoch = 1
            opt._param_digest = params_digest(opt.params, 1)
            opt._publish()
        clock.sleep(0.5)  # the records spread
        before = _flat(models[i])
        gen = task.stream(2, i)
        x, y = task.sample(gen, 32)
        torch.nn.functional.cross_entropy(models[i](x), y).backward()
        opt._accumulate(32)
        opt.zero_grad()
        opt._finish_epoch(opt._view())  # both end their epoch now: one round, epochs {0, 1}
        opt.apply_pending(wait=True)
        seen[i] = {"epoch": opt.local_epoch, "in_sync": opt.in_sync, "changed": not np.array_equal(before, _flat(
            models[i])), "round": dict(opt.last_round), "flat": _flat(models[i])}
        if i == 1:  # the next step resynchronises: it downloads peer 0's state
            x, y = task.sample(gen, 32)
            torch.nn.functional.cross_entropy(models[i](x), y).backward()
            opt.step()
            opt.zero_grad()
            seen[2] = {"epoch": opt.local_epoch, "in_sync": opt.in_sync, "flat": _flat(models[i])}
        done[i] = True
        while not all(done) and clock.now() < deadline:  # peer 0 stays up as the donor
            clock.sleep(0.05)
        opt.shutdown()

    virtual_swarm(2, make, body, seed=5)
    ahead, behind, after = seen[0], seen[1], seen[2]
    assert ahead["round"]["group_size"] == 2 and behind["round"]["group_size"] == 2, (ahead, behind)
    assert ahead["epoch"] == 2 and ahead["changed"] and ahead["in_sync"]
    assert behind["epoch"] == 0 and not behind["changed"] and not behind["in_sync"], behind
    assert behind["round"]["behind"] == 1 and not behind["round"]["stepped"]
    # the next step adopted the swarm's state: peer 0's epoch and parameters
    assert after["epoch"] == 2 and after["in_sync"]
    np.testing.assert_array_equal(after["flat"], ahead["flat"])


# ---------------------------------------------------------------------------- background averaging
def test_background_averaging_every_k_steps_keeps_peers_together_in_virtual_time():
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
              for _ in range(3)]  # different starting points
    initial = max(float(np.abs(_flat(a) - _flat(b)).max()) for a in models for b in models)

    def make(i, peers, averager_opts):
        return DecentralizedSGD(models[i].parameters(), lr=0.05, prefix="bg", average_every=3, matchmaking_time=0.3,
                                target_group_size=3, initial_peers=peers, averager_opts=averager_opts)

    def body(i, opt):
        g = torch.Generator().manual_seed(100 + i)
        for _ in range(60):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
            ((models[i](x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            opt.clock.sleep(0.01)
        opt.apply_pending(wait=True, timeout=10)
        rounds = dict(opt.rounds)
        opt.shutdown()
        return rounds

    _, rounds = virtual_swarm(3, make, body, seed=2)
    assert all(r["done"] >= 3 for r in rounds), rounds
    spread = max(float(np.abs(_flat(a) - _flat(b)).max()) for a in models for b in models)
    assert spread < 0.25 * initial, (spread, initial)


@pytest.mark.parametrize("target,warns", [(64, True), (4096, False)])
def test_a_target_batch_the_swarm_fills_within_a_few_gossip_intervals_is_warned_about(target, warns, caplog):
    """docs/training.md: a global step shorter than ~5 gossip intervals is decided on a guess (two fast
    peers with a target of 256 took 32-384 samples per step). Documented, never checked: a user with
    a small target saw erratic global batches and no word why. Two peers at 640 samples/s each,
    gossip every 0.05 s: 64 samples fill in 0.05 s (warned, once), 4096 in 3.2 s (not)."""
    import logging

    task = Task()
    models = [make_model(i) for i in range(2)]

    def make(i, peers, averager_opts):
        opt = torch.optim.SGD(models[i].parameters(), lr=0.05)
        return CollaborativeOptimizer(opt, prefix="tgt", target_batch_size=target, batch_size=32,
                                      matchmaking_time=0.5, target_group_size=2, initial_peers=peers,
                                      averager_opts=averager_opts)

    def body(i, opt):
        gen = task.stream(2, i)
        end = opt.clock.now() + (4.0 if warns else 30.0)
        while opt.clock.now() < end and opt.local_epoch < 5:
            x, y = task.sample(gen, 32)
            torch.nn.functional.cross_entropy(models[i](x), y).backward()
            opt.step()
            opt.zero_grad()
            opt.clock.sleep(0.05)
        epoch = opt.local_epoch
        opt.shutdown()
        return epoch

    with caplog.at_level(logging.WARNING, logger="zgossip.collaborative"):
        _, epochs = virtual_swarm(2, make, body, seed=3)
    assert min(epochs) >= 3, epochs  # (the check is made from the third epoch on)
    said = [r.getMessage() for r in caplog.records if "fills in" in r.getMessage()]
    if warns:
        assert len(said) == 2, said  # once per peer
        assert f"target_batch_size={target}" in said[0] and "Raise target_batch_size to" in said[0]
    else:
        assert said == []


# ---------------------------------------------------------------------------- collaborative, a newcomer on a slow link
def _catchup_run(n: int, catchup_pause: float, stop_at: float, download: float = 1.5, seed: int = 4) -> tuple:
    """`n` - 1 trainers from t = 0 and a newcomer at t = 1 s whose every state download takes `download`
    seconds (a slow link, emulated: its averager's download returns the state it fetched -- the donor's at
    the request -- that much later), while a global step takes ~0.5 s (~1 s for a trainer alone). Every peer trains until virtual
    time `stop_at`, then serves the others until they are done. Returns what each body saw (its epochs
    with their rounds) and each peer's downloads (start, seconds, epoch reached)."""
    task = Task()
    models = [make_model(0) for _ in range(n)]
    downloads: dict[int, list] = {i: [] for i in range(n)}
    done = [False] * n

    class SlowDownloads(CollaborativeOptimizer):
        def __init__(self, *args, index: int, **kwargs):
            self.index = index  # (before the constructor, which may download)
            super().__init__(*args, **kwargs)

        def load_state_from_peers(self, timeout=None):
            fetch, t0 = self.averager.load_state_from_peers, self.clock.now()

            def slow(*args, **kwargs):
                got = fetch(*args, **kwargs)
                self.clock.sleep(download)  # the rest of the bytes, on the slow link
                return got

            self.averager.load_state_from_peers = slow
            try:
                super().load_state_from_peers(timeout)
            finally:
                del self.averager.load_state_from_peers
            downloads[self.index].append((round(t0, 2), round(self.clock.now() - t0, 2), self.local_epoch))

    def make(i, peers, averager_opts):
        opt = torch.optim.Adam(models[i].parameters(), lr=1e-3)
        return SlowDownloads(opt, index=i, prefix="catchup", target_batch_size=640, batch_size=64,
                             matchmaking_time=0.5,
                             target_group_size=n, initial_peers=peers, catchup_pause=catchup_pause,
                             averager_opts=averager_opts)

    def body(i, opt):
        clock = opt.clock
        gen = task.stream(n, i)
        epochs = [(clock.now(), opt.local_epoch, {}, opt.in_sync)]
        while clock.now() < stop_at:
            x, y = task.sample(gen, 64)
            torch.nn.functional.cross_entropy(models[i](x), y).backward()
            before = opt.local_epoch
            opt.step()
            opt.zero_grad()
            if opt.local_epoch != before:
                epochs.append((clock.now(), opt.local_epoch, dict(opt.last_round), opt.in_sync))
            clock.sleep(0.1)  # the compute of one batch
        done[i] = True
        while not all(done) and clock.now() < stop_at + 30:  # serve peers still downloading
            clock.sleep(0.1)
        out = {"epochs": epochs, "epoch": opt.local_epoch, "in_sync": opt.in_sync, "flat": _flat(models[i])}
        opt.shutdown()
        return out

    _, out = virtual_swarm(n, make, body, seed=seed, start_at=[0.0] * (n - 1) + [1.0])
    return out, downloads


def _steps(epochs: list) -> list:
    return [e for e in epochs[1:]]  # (time, epoch, last_round, in_sync) per global step or download


def test_a_newcomer_whose_download_outlasts_global_steps_catches_up_in_one_download():
    """docs/training.md, "a newcomer on a slow link": its state download (1.5 s here, a global step ~0.5 s)
    outlasted several global steps, so when it ended the swarm was epochs ahead, the newcomer downloaded
    again, and again, and never averaged (the testbed: 7 downloads in 40 s, no round joined), while every
    round of the others waited for it. The others now hold off their next global step while it downloads (for at most
    catchup_pause): it downloads once, joins the round of the epoch it downloaded, and all end identical."""
    out, downloads = _catchup_run(3, catchup_pause=10.0, stop_at=4.0)
    assert len(downloads[2]) == 1, downloads
    start, seconds, epoch = downloads[2][0]
    first = next(e for e in _steps(out[2]["epochs"]) if e[2].get("group_size", 1) > 1)
    assert first[2]["epoch"] == epoch and first[2]["group_size"] == 3 and first[2]["error"] is None, first
    for i in (0, 1):
        steps = _steps(out[i]["epochs"])
        assert all(e[2]["error"] is None and e[3] for e in steps), steps
        gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:])]
        assert max(gaps) < seconds + 2.0, gaps  # held for the download (and its spreading), not longer
        # nothing was dropped meanwhile: the held step averaged every sample taken during the pause
        held = max(steps, key=lambda e: e[2]["samples"])
        assert held[2]["samples"] > 2 * 640, held
    assert [o["epoch"] for o in out] == [out[0]["epoch"]] * 3 and out[0]["epoch"] >= epoch + 2  # 2 rounds together
    for o in out[1:]:
        np.testing.assert_array_equal(o["flat"], out[0]["flat"])


@pytest.mark.parametrize("pause", [10.0, 0.0], ids=["paused", "no_pause"])
def test_a_trainer_left_alone_with_a_downloading_newcomer_keeps_training(pause):
    """The testbed: once one trainer was killed, the one left failed every round (3 s each, marked out of
    sync) while the newcomer downloaded, because its record counted the newcomer among the peers each
    round expects. A downloading peer is no longer expected: with catchup_pause the trainer holds for it
    and then they average together; without (0) it steps alone, as a lone peer does, never failing."""
    out, downloads = _catchup_run(2, catchup_pause=pause, stop_at=5.0, download=3.0)  # past a round's timeout
    steps = _steps(out[0]["epochs"])
    assert steps and all(e[2]["error"] is None and e[3] for e in steps), steps
    assert out[0]["in_sync"]
    if pause:
        assert len(downloads[1]) == 1, downloads
        together = [e for e in steps if e[2]["group_size"] == 2]
        assert together and together[0][2]["epoch"] == downloads[1][0][2], steps
        np.testing.assert_array_equal(out[1]["flat"], out[0]["flat"])
    else:
        assert len(downloads[1]) >= 2, downloads  # (documented: without the pause it is outrun)
        # the steps it took while the newcomer downloaded (once its record had spread): alone, each one
        alone = [e for e in steps if any(t + 0.5 < e[0] < t + d for t, d, _ in downloads[1])]
        assert len(alone) >= 2 and all(e[2]["expected_peers"] == 1 and e[2]["stepped"] for e in alone), steps
