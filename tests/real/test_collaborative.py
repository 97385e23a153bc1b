"""CollaborativeOptimizer: a global batch across peers, catching up, donors dying, bad models and bad gradients.

The multi-process tests run real peer processes (multiprocessing spawn, tcp on
127.0.0.1, ephemeral ports) and stop every one of them in ``finally``; the others run
several peers as threads of this process, each with its own averager. Every wait is bounded.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from zgossip.swarm import stop_children

import zgossip
from zgossip.collaborative import CollaborativeOptimizer
from zgossip.train_demo import Task, evaluate, make_model, single_process_reference, train_peer
from zgossip.errors import StateUnavailable
from zgossip.training_state import LayoutMismatch

FAST = dict(gossip_interval=0.05, peer_timeout=2.0, request_timeout=0.3, part_timeout=2.0)


def _recv(conn: Any, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    return conn.recv()


class _Procs:
    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []

    def start(self, target: Any, *args: Any) -> int:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(*args[:1], child, *args[1:]), daemon=True)
        p.start()
        child.close()
        self.procs.append(p)
        self.conns.append(parent)
        return len(self.procs) - 1

    def close(self) -> None:
        stop_children(self.conns, self.procs, "stop", 10.0)


# ---------------------------------------------------------------------------- 4 processes
def test_four_processes_reach_identical_parameters_and_a_late_peer_catches_up():
    """3 processes start, a 4th joins once the run is past epoch 3: it downloads the state and continues
    at the swarm's epoch. At the end all 4 hold bit-identical parameters, and the held-out loss is within
    a small factor of one process trained with the global batch size for the same number of epochs."""
    epochs, late_at = 14, 3
    cfg = dict(epochs=epochs, target_batch_size=384, batch_size=32, lr=0.02, data_seed=1, step_delay=0.1,
               target_group_size=4, matchmaking_time=1.0, averager_opts=dict(FAST), time_limit=90.0, linger=60.0)
    procs = _Procs()
    try:
        for i in range(4):  # start-up (imports) takes seconds: pay for it before anyone trains
            procs.start(train_peer, i, dict(cfg, wait_for_go=True, wait_for_start=i < 3))
        for k in range(4):
            assert _recv(procs.conns[k], 90, f"peer {k} ready")["event"] == "ready"
        procs.conns[0].send({})
        first = _recv(procs.conns[0], 30, "peer 0 up")
        for k in (1, 2):
            procs.conns[k].send({"initial_peers": [first["endpoint"]]})
        for k in (1, 2):
            up = _recv(procs.conns[k], 30, f"peer {k} up")
            assert up["event"] == "up" and up["epoch"] == 0
        for k in range(3):
            procs.conns[k].send("start")
        events: dict[int, list] = {0: [], 1: [], 2: [], 3: []}
        done: dict[int, dict] = {}
        late_up = None
        deadline = time.monotonic() + 120
        while len(done) < 4:
            assert time.monotonic() < deadline, f"training did not finish: done={sorted(done)}"
            for k in range(len(procs.procs)):
                while k not in done and procs.conns[k].poll(0):
                    msg = procs.conns[k].recv()
                    if msg["event"] == "done":
                        done[k] = msg
                    else:
                        events[k].append(msg)
            swarm_epoch = max((e["epoch"] for k in (0, 1, 2) for e in events[k] if e["event"] == "epoch"), default=0)
            if late_up is None and swarm_epoch >= late_at:
                procs.conns[3].send({"initial_peers": [first["endpoint"]]})
                late_up = _recv(procs.conns[3], 30, "late peer up")
            time.sleep(0.01)
        # the newcomer downloaded the state: it started at the swarm's epoch, not at 0
        assert late_up is not None and late_up["epoch"] >= late_at
        first_epochs = [e["epoch"] for e in events[3] if e["event"] == "epoch"]
        assert first_epochs and first_epochs[0] >= late_at, (late_up, events[3], done[3]["epoch"],
                                                             [e["epoch"] for e in events[0]])
        assert all(d["epoch"] == epochs for d in done.values()), {k: d["epoch"] for k, d in done.items()}
        # identical parameters: every round hands every member the same bits, and resyncs fix the rest
        for k in (1, 2, 3):
            for a, b in zip(done[0]["params"], done[k]["params"]):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        ref_loss, _ = single_process_reference(cfg)
        task = Task()
        untrained, _ = evaluate(make_model(0), *task.heldout())
        loss = done[0]["loss"]
        assert loss < 0.8 * untrained, (loss, untrained)
        assert loss < 1.5 * ref_loss, (loss, ref_loss)
        # later rounds included the newcomer
        groups = [e["group"] for e in events[0] if e["event"] == "epoch" and e["epoch"] > late_up["epoch"] + 1]
        assert groups and max(g for g in groups if g) == 4, groups
    finally:
        procs.close()


# ---------------------------------------------------------------------------- donor dies mid-download
def _donor(index: int, conn: Any, seed: int, epoch: int, die_mid_stream: bool, initial: list) -> None:
    """A peer holding a model drawn from `seed`, declaring `epoch`. With `die_mid_stream`, it answers the
    first chunk request with half the chunks asked for, then the process is SIGKILLed."""
    import signal

    torch.set_num_threads(1)
    if die_mid_stream:
        from zgossip import state

        serve_chunks = state.StateDonor.serve_chunks
        served: list = []

        def first_request_then_die(self: Any, msg: Any) -> None:
            if served:
                return  # dying: later chunk requests go unanswered
            import dataclasses

            half = dataclasses.replace(msg, count=max(1, msg.count // 2))  # (one request may ask for all)
            serve_chunks(self, half)
            served.append(half.count)
            conn.send({"event": "partial", "sent": half.count, "of": len(self._cache[msg.root].plan)})
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()

        state.StateDonor.serve_chunks = first_request_then_die
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = CollaborativeOptimizer(torch.optim.Adam(model.parameters()), prefix="dl", target_batch_size=10 ** 9,
                                 initial_peers=initial, load_state_on_start=False,
                                 averager_opts=dict(FAST, part_size_bytes=4096, state_chunk_bytes=4096))  # ~33 chunks
    try:
        opt.local_epoch = epoch
        opt._update_sharing()
        opt._publish()
        conn.send({"event": "up", "endpoint": opt.endpoint, "peer_id": opt.peer_id})
        conn.poll(60)
    except (EOFError, BrokenPipeError):
        pass
    finally:
        opt.shutdown()


def test_donor_killed_mid_download_falls_back_and_never_applies_partial_state():
    procs = _Procs()
    try:
        procs.start(_donor, 0, 11, 4, False, [])  # the fallback donor, epoch 4
        up_b = _recv(procs.conns[0], 60, "donor B up")
        procs.start(_donor, 1, 22, 7, True, [up_b["endpoint"]])  # the preferred donor (epoch 7), dies mid-stream
        up_a = _recv(procs.conns[1], 60, "donor A up")
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        initial = [p.detach().clone() for p in model.parameters()]
        g = torch.Generator().manual_seed(11)
        want_b = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        g = torch.Generator().manual_seed(22)
        values_a = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        new = CollaborativeOptimizer(torch.optim.Adam(model.parameters()), prefix="dl", target_batch_size=10 ** 9,
                                     initial_peers=[up_b["endpoint"]], load_state_on_start=False,
                                     state_chunk_timeout=1.0, averager_opts=dict(FAST, part_size_bytes=4096,
                                                                                 state_chunk_bytes=4096))
        try:
            deadline = time.monotonic() + 20
            # both donors' latest records (epoch, and the sharing priority gossiped with it) have arrived
            while {p.peer_id: p.epoch for p in new._view().peers} != {up_a["peer_id"]: 7, up_b["peer_id"]: 4,
                                                                       new.peer_id: 0}:
                assert time.monotonic() < deadline, "donors not seen"
                time.sleep(0.02)
            seen: list[str] = []
            stop = threading.Event()

            def watch() -> None:  # the model is either untouched or entirely donor B's, never a mix
                while not stop.is_set():
                    with new._lock:  # what the optimizer would see: writes happen under this lock
                        current = [p.detach().clone() for p in model.parameters()]
                    for cur, i, b, a in zip(current, initial, want_b, values_a):
                        if torch.equal(cur, i):
                            seen.append("initial")
                        elif torch.equal(cur, b):
                            seen.append("B")
                        else:
                            seen.append("A" if torch.equal(cur, a) else "MIXED")
                    time.sleep(0.001)

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                new.load_state_from_peers(timeout=30)
            finally:
                stop.set()
                watcher.join(5)
            partial = _recv(procs.conns[1], 10, "donor A's partial stream")
            assert partial["event"] == "partial" and 0 < partial["sent"] < partial["of"]
            procs.procs[1].join(10)
            assert not procs.procs[1].is_alive()  # donor A really died mid-download
            assert set(seen) <= {"initial", "B"}, set(seen)
            for p, b in zip(model.parameters(), want_b):
                assert torch.equal(p.detach(), b)
            assert new.local_epoch == 4  # donor B's epoch, not donor A's
        finally:
            new.shutdown()
    finally:
        procs.close()


# ---------------------------------------------------------------------------- in-process peers
def _see_each_other(opts: list, n: int) -> None:
    """Everyone sees everyone (and their records) before training."""
    deadline = time.monotonic() + 10
    while any(o.num_peers < n for o in opts):
        assert time.monotonic() < deadline, "peers did not see each other"
        time.sleep(0.02)


def _peers(n: int, models: list, prefix: str, **kw: Any) -> list[CollaborativeOptimizer]:
    opts: list[CollaborativeOptimizer] = []
    try:
        for i in range(n):
            opts.append(CollaborativeOptimizer(
                torch.optim.SGD(models[i].parameters(), lr=0.05), prefix=prefix, model=models[i],
                initial_peers=[opts[0].endpoint] if opts else [],
                **{"target_batch_size": 96, "batch_size": 16, "matchmaking_time": 0.5, "target_group_size": n,
                   "averager_opts": dict(FAST), **kw}))
        _see_each_other(opts, n)
    except BaseException:
        for o in opts:
            o.shutdown()
        raise
    return opts


def _train(opts: list, models: list, epochs: int, poison: Any = None, timeout: float = 40.0) -> dict:
    """Each peer in a thread: steps until `epochs`. `poison(i, epoch)` -> True makes that batch NaN."""
    task = Task()
    errors: dict[int, BaseException] = {}
    rounds: dict[int, list] = {i: [] for i in range(len(opts))}

    def run(i: int) -> None:
        try:
            gen = task.stream(5, i)
            deadline = time.monotonic() + timeout
            last = -1
            while (opts[i].local_epoch < epochs or not opts[i].in_sync) and time.monotonic() < deadline:
                x, y = task.sample(gen, 16)
                if poison is not None and poison(i, opts[i].local_epoch):
                    x = x * float("nan")
                torch.nn.functional.cross_entropy(models[i](x), y).backward()
                opts[i].step()
                opts[i].zero_grad()
                if opts[i].local_epoch != last:
                    last = opts[i].local_epoch
                    rounds[i].append(dict(opts[i].last_round))
                time.sleep(0.002)
        except BaseException as e:  # reported to the test thread
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(opts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return {"errors": errors, "rounds": rounds}


def test_mismatched_model_raises_naming_the_tensor_and_is_never_averaged_with():
    models = [make_model(0), make_model(0), torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(),
                                                                 torch.nn.Linear(48, 4))]
    opts = _peers(2, models, "mm")
    try:
        def odd_peer(**kw: Any) -> CollaborativeOptimizer:
            return CollaborativeOptimizer(torch.optim.SGD(models[2].parameters(), lr=0.05), prefix="mm",
                                          model=models[2], target_batch_size=96, batch_size=16,
                                          initial_peers=[opts[0].endpoint], averager_opts=dict(FAST), **kw)

        # joining the run: the constructor listens for the swarm and refuses at once
        with pytest.raises(LayoutMismatch, match=r"tensor 0 '0\.weight' \(shape \(48, 16\), float32\) has a "
                                                 r"different shape or dtype there"):
            odd_peer()
        odd = odd_peer(startup_timeout=0)  # no check at start: the first step finds out
        try:
            deadline = time.monotonic() + 10
            while odd.averager.peer_infos().keys() < {opts[0].peer_id, opts[1].peer_id}:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.2)
            x, y = Task().sample(torch.Generator().manual_seed(0), 16)
            torch.nn.functional.cross_entropy(models[2](x), y).backward()
            with pytest.raises(LayoutMismatch, match=r"tensor 0 '0\.weight' \(shape \(48, 16\), float32\)"):
                odd.step()
            # the download path names both shapes
            with pytest.raises(LayoutMismatch, match=r"tensor 0 '0\.weight' \(shape \(48, 16\), float32\) here has "
                                                     r"shape \(64, 16\), float32 at the other peer"):
                odd.load_state_from_peers(timeout=10)
            # the two matching peers train together; the odd one never joins their groups
            out = _train(opts, models, epochs=3)
            assert not out["errors"], out["errors"]
            assert opts[0].mismatched_peers.keys() == {odd.peer_id}
            assert "different shape" in opts[0].mismatched_peers[odd.peer_id]
            groups = [r.get("group_size") for r in out["rounds"][0] if r]
            assert groups and max(groups) == 2
            for a, b in zip(models[0].parameters(), models[1].parameters()):
                assert torch.equal(a, b)
        finally:
            odd.shutdown()
    finally:
        for o in opts:
            o.shutdown()



def test_a_joiner_with_other_param_groups_is_refused_before_anything_is_written():
    """The same model with its optimizer's param groups split differently: torch refused the donor's optimizer
    state (a bare ValueError) only after the donor's parameters were copied in: a partial state. Now checked
    first: LayoutMismatch naming the groups, and the joiner's parameters untouched."""
    ma, mb = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    with torch.no_grad():
        mb.weight.fill_(7.0)
    a = CollaborativeOptimizer(torch.optim.Adam(ma.parameters(), lr=0.1), prefix="groups", target_batch_size=1,
                               batch_size=1, model=ma, averager_opts=dict(FAST))
    try:
        for _ in range(2):  # alone: a global step per batch
            ma(torch.randn(3, 4)).sum().backward()
            a.step()
            a.zero_grad()
        assert a.local_epoch == 2
        split = torch.optim.Adam([{"params": [mb.weight]}, {"params": [mb.bias], "weight_decay": 0.1}], lr=0.1)
        with pytest.raises(LayoutMismatch, match=r"param groups hold \[2\] tensors, this optimizer's \[1, 1\]"):
            CollaborativeOptimizer(split, prefix="groups", target_batch_size=1, batch_size=1, model=mb,
                                   initial_peers=[a.endpoint], averager_opts=dict(FAST))
        assert (mb.weight == 7.0).all()
        # downloading in the background (delay_state_averaging), the step that adopts the state raises it too:
        # it was logged as a failed download and retried every second, for ever
        late = CollaborativeOptimizer(split, prefix="groups", target_batch_size=1, batch_size=1, model=mb,
                                      initial_peers=[a.endpoint], averager_opts=dict(FAST), startup_timeout=0,
                                      delay_state_averaging=True)
        try:
            deadline = time.monotonic() + 10
            while late.num_peers < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(LayoutMismatch, match="param groups"):
                while time.monotonic() < deadline:
                    mb(torch.randn(3, 4)).sum().backward()
                    late.step()
                    late.zero_grad()
                    time.sleep(0.02)
            assert late.local_epoch == 0 and (mb.weight == 7.0).all()
        finally:
            late.shutdown()
    finally:
        a.shutdown()


def test_nan_gradients_are_dropped_reported_and_do_not_poison_the_swarm(caplog):
    models = [make_model(0) for _ in range(3)]
    opts = _peers(3, models, "nan")
    try:
        with caplog.at_level(logging.INFO, logger="zgossip.collaborative"):
            out = _train(opts, models, epochs=5, poison=lambda i, ep: i == 2 and ep in (1, 2))
        assert not out["errors"], out["errors"]
        assert opts[2].nonfinite_batches > 0
        assert opts[0].nonfinite_batches == opts[1].nonfinite_batches == 0
        # the bad batches were reported by the peer that had them, naming the tensor
        assert any("NaN/inf in the gradient of tensor" in r.getMessage() for r in caplog.records)
        # the others saw it contribute nothing in those epochs
        excluded = [r for i in (0, 1) for r in out["rounds"][i] if opts[2].peer_id in r.get("excluded", {})]
        assert excluded and "NaN/inf" in excluded[0]["excluded"][opts[2].peer_id]
        for m in models:
            for p in m.parameters():
                assert torch.isfinite(p).all()
        for a, b, c in zip(*(m.parameters() for m in models)):
            assert torch.equal(a, b) and torch.equal(a, c)  # the bad peer still received the mean
    finally:
        for o in opts:
            o.shutdown()



def test_a_peer_that_dropped_some_batches_is_reported_as_such_not_as_contributing_nothing():
    """Peer A: a finite batch of 10 then a NaN one (dropped); peer B: 30 samples. The mean holds A's 10
    (-(10*1 + 30*3)/40 = -2.5 with SGD lr=1): B's round said A "contributed nothing" (`excluded`) all the same.
    Now `excluded` names only peers with no samples, and `dropped` says how many batches A dropped."""
    models = [torch.nn.Linear(4, 1, bias=False) for _ in range(2)]
    opts: list = []
    try:
        for m in models:
            with torch.no_grad():
                m.weight.zero_()
            opts.append(CollaborativeOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), prefix="dropped", model=m,
                                               target_batch_size=40, matchmaking_time=0.5, target_group_size=2,
                                               initial_peers=[opts[0].endpoint] if opts else [],
                                               averager_opts=dict(FAST)))
        _see_each_other(opts, 2)
        time.sleep(0.3)

        def peer(i: int, batches: list) -> None:
            for value, bs in batches:
                models[i].weight.grad = torch.full((1, 4), value)
                opts[i].step(batch_size=bs)
            deadline = time.monotonic() + 20
            while opts[i].local_epoch < 1 and time.monotonic() < deadline:  # poll without samples: follow the round
                time.sleep(0.01)
                opts[i].step(batch_size=0)

        a = threading.Thread(target=peer, args=(0, [(1.0, 10), (float("nan"), 10)]))
        a.start()
        time.sleep(0.3)
        peer(1, [(3.0, 30)])
        a.join(25)
        for m in models:
            assert torch.allclose(m.weight.detach(), torch.full((1, 4), -2.5))
        rnd = opts[1].last_round
        assert rnd["samples"] == 40 and rnd["excluded"] == {}, rnd
        assert rnd["dropped"] == {opts[0].peer_id: 1}, rnd
    finally:
        for o in opts:
            o.shutdown()


class _Saboteur(CollaborativeOptimizer):
    """Sends NaN without flagging it (bypasses the local check)."""

    def _accumulate(self, bs: int) -> None:
        super()._accumulate(bs)
        if self.local_epoch == 1:
            with torch.no_grad(), self.averager.get_tensors():
                self._grads[0].view(-1)[0] = float("nan")


def test_unflagged_nan_in_the_average_is_detected_and_every_member_skips_the_step(caplog):
    """A NaN gradient sent without the local check is refused by the span owner: the others average
    that span without the saboteur and step; the saboteur keeps its NaN there, sees a non-finite
    average, skips the step, and resynchronises from the others (the parameter digests disagree)."""
    models = [make_model(0) for _ in range(3)]
    fast = dict(FAST, part_timeout=0.5)
    opts = _peers(2, models, "sab", target_group_size=3, averager_opts=fast)
    try:
        bad = _Saboteur(torch.optim.SGD(models[2].parameters(), lr=0.05), prefix="sab", target_batch_size=96,
                        batch_size=16, model=models[2], initial_peers=[opts[0].endpoint], matchmaking_time=0.5,
                        target_group_size=3, averager_opts=fast)
        opts.append(bad)
        # all three see each other before training: a saboteur still unknown at epoch 0 left the others'
        # first round as a pair, then loaded their state past epoch 1 and never sent its NaN (CI, once)
        _see_each_other(opts, 3)
        with caplog.at_level(logging.ERROR, logger="zgossip.collaborative"):
            out = _train(opts, models, epochs=3)
        assert not out["errors"], out["errors"]
        skipped = [r for i in range(3) for r in out["rounds"][i] if r.get("nonfinite_average")]
        assert skipped, out["rounds"]
        assert not any(r.get("nonfinite_average") for i in range(2) for r in out["rounds"][i])  # never poisoned
        assert any("averaged gradient of tensor 0" in r.getMessage() for r in caplog.records)
        # the saboteur missed a step: it notices by the parameter digests and downloads the others' state
        deadline = time.monotonic() + 15
        while [o.synchronize() for o in opts] != [False] * 3 or len({o._param_digest for o in opts}) > 1:
            assert time.monotonic() < deadline, "the saboteur did not resynchronise"
            time.sleep(0.1)
        for a, b, c in zip(*(m.parameters() for m in models)):
            assert torch.isfinite(a).all() and torch.equal(a, b) and torch.equal(a, c), repr(out["rounds"])
    finally:
        for o in opts:
            o.shutdown()


def test_peers_that_start_apart_are_caught_by_the_parameter_digest_and_converge(caplog):
    """Different initialisations (a common slip) would train three different models; the published
    parameter digests disagree at epoch 0, so the two non-reference peers download the reference's state."""
    models = [make_model(seed) for seed in (0, 1, 2)]
    opts = _peers(3, models, "drift")
    try:
        with caplog.at_level(logging.WARNING, logger="zgossip.collaborative"):
            out = _train(opts, models, epochs=3)
            assert not out["errors"], out["errors"]
            # a peer that stopped right after a round may not have compared digests yet: synchronize() does
            deadline = time.monotonic() + 10
            while [o.synchronize() for o in opts] != [False] * 3 or len({o._param_digest for o in opts}) > 1:
                assert time.monotonic() < deadline, "peers did not converge"
                time.sleep(0.1)
        assert any("different sets of parameters" in r.getMessage() for r in caplog.records)
        for a, b, c in zip(*(m.parameters() for m in models)):
            assert torch.equal(a, b) and torch.equal(a, c)
        assert all(o.local_epoch >= 3 for o in opts)
    finally:
        for o in opts:
            o.shutdown()


def test_scheduler_steps_once_per_epoch_and_progress_is_exposed():
    models = [make_model(0) for _ in range(2)]
    opts = _peers(2, models, "sched", scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    try:
        out = _train(opts, models, epochs=3)
        assert not out["errors"], out["errors"]
        for o in opts:
            assert o.local_epoch >= 3
            assert o.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** o.local_epoch)
        gp = opts[0].global_progress
        assert gp.epoch >= 3 and gp.num_peers == 2 and gp.target_batch_size == 96
        assert opts[0].num_peers == 2
    finally:
        for o in opts:
            o.shutdown()


def test_training_wrappers_refuse_to_be_auxiliary_and_a_plain_auxiliary_averager_helps_a_run():
    """``averager_opts={"auxiliary": True}`` (hivemind's auxiliary optimizer) was taken: the peer trained, its rounds
    carried weight 0 so its gradients were dropped while its samples still counted toward the global batch, and it
    stepped on its own gradients (then diverged and resynchronised). Refused now, pointing to the helper that
    works: a plain auxiliary Averager with the gradients' shapes, looping ``step()`` under the run's prefix."""
    from zgossip.accumulator import Accumulator
    from zgossip.optim import DecentralizedSGD

    model = make_model(0)
    for make in (lambda: CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), prefix="aux",
                                                target_batch_size=8, averager_opts={"auxiliary": True}),
                 lambda: DecentralizedSGD(model.parameters(), lr=0.1, prefix="aux", averager_opts={"auxiliary": True}),
                 lambda: Accumulator("aux", model.parameters(), auxiliary=True)):
        with pytest.raises(ValueError, match="cannot be auxiliary.*zgossip.Averager"):
            make()
    models = [make_model(0) for _ in range(2)]
    opts = _peers(2, models, "aux-run", target_group_size=3)
    helper = zgossip.Averager([torch.zeros_like(p) for p in models[0].parameters()], prefix="aux-run", auxiliary=True,
                              initial_peers=[opts[0].endpoint], **FAST)
    stop, sizes = threading.Event(), []

    def lend() -> None:
        while not stop.is_set():
            try:
                sizes.append(len(helper.step(timeout=1.0).members))
            except zgossip.ZGossipError:
                pass

    th = threading.Thread(target=lend, daemon=True)
    th.start()
    try:
        out = _train(opts, models, epochs=3)
        assert not out["errors"], out["errors"]
        assert 3 in sizes, sizes  # it took part in rounds
        helped = [r for rs in out["rounds"].values() for r in rs if r.get("group_size") == 3]
        assert helped and all(r["contributors"] == 2 and r["samples"] > 0 for r in helped), helped
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    finally:
        stop.set()
        th.join(10)
        helper.shutdown()
        for o in opts:
            o.shutdown()


def test_a_client_mode_peer_counts_toward_the_global_batch():
    """Nobody gossiped a client-mode peer's progress record: the listening peer counted neither the client in
    num_peers nor its samples toward the target, so each global step held target_batch_size samples of its
    own plus the client's (measured with two listening peers and a client, target 128, batches of 8: 184-192
    samples per step; with the fix 144, as with three listening peers)."""
    target, bs = 128, 8
    models = [make_model(0), make_model(0)]
    opts: list[CollaborativeOptimizer] = []
    try:
        for i in range(2):
            opts.append(CollaborativeOptimizer(
                torch.optim.SGD(models[i].parameters(), lr=0.05), prefix="cl", model=models[i],
                initial_peers=[opts[0].endpoint] if opts else [], target_batch_size=target, batch_size=bs,
                matchmaking_time=0.5, target_group_size=2, averager_opts=dict(FAST, client_mode=i == 1)))
        server, client = opts
        assert client.endpoint.startswith("client://") and client.peer_id not in server.averager.peers()
        _see_each_other(opts, 2)
        # the client's samples show in the listening peer's global progress (the record's extrapolation ends
        # once it is older than 4 gossip intervals: then exactly what the client holds)
        task = Task()
        gens = [task.stream(5, i) for i in range(2)]
        for _ in range(3):
            x, y = task.sample(gens[1], bs)
            torch.nn.functional.cross_entropy(models[1](x), y).backward()
            client.step()
            client.zero_grad()
        deadline = time.monotonic() + 5
        while server.global_progress.samples_accumulated != 3 * bs:
            assert time.monotonic() < deadline, server.global_progress
            time.sleep(0.02)
        assert server.global_progress.num_peers == 2
        # and each global step ends within a few batches of the target (records lag by a gossip interval or
        # two, as between listening peers; extrapolating them can end a step a little early, too), not near
        # twice the target (the server's own target plus the client's share)
        rounds: dict[int, list] = {0: [], 1: []}

        def run(i: int) -> None:
            end = time.monotonic() + 30
            while opts[i].local_epoch < 3 and time.monotonic() < end:
                x, y = task.sample(gens[i], bs)
                torch.nn.functional.cross_entropy(models[i](x), y).backward()
                before = opts[i].local_epoch
                opts[i].step()
                opts[i].zero_grad()
                if opts[i].local_epoch != before:
                    rounds[i].append(dict(opts[i].last_round))
                time.sleep(0.01)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert [len(r) for r in rounds.values()] == [3, 3], rounds
        for r in rounds[0] + rounds[1]:
            assert r["ok"] and r["group_size"] == 2 and 0 < r["samples"] <= target + 4 * bs, r
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
        client.shutdown()  # it says goodbye: its record stops counting at once (silent, after peer_timeout)
        deadline = time.monotonic() + 2 * FAST["peer_timeout"]
        while server.num_peers != 1 or client.peer_id in server.averager.peer_infos():
            assert time.monotonic() < deadline, server.averager.peer_infos().keys()
            time.sleep(0.02)
    finally:
        for o in opts:
            o.shutdown()


def test_errors_are_clear():
    model = make_model(0)
    with pytest.raises(ValueError, match="target_batch_size"):
        CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), prefix="e", target_batch_size=0)
    # were truncated (1.7 -> 1), taken (True), or refused with a message that does not name the argument
    for bad in (1.7, float("nan"), float("inf"), "64", True):
        with pytest.raises(ValueError, match="target_batch_size must be a whole number"):
            CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), prefix="e", target_batch_size=bad)
    with pytest.raises(ValueError, match="batch_size must be a whole number"):
        CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), prefix="e", target_batch_size=8,
                               batch_size=-1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        CollaborativeOptimizer(object(), prefix="e", target_batch_size=1)  # type: ignore[arg-type]
    for bad in (-1, float("nan"), float("inf"), "5", True, None):
        with pytest.raises(ValueError, match="catchup_pause must be a finite number of seconds >= 0"):
            CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), prefix="e", target_batch_size=8,
                                   catchup_pause=bad)
    opt = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), prefix="e", target_batch_size=8,
                                 averager_opts=dict(FAST))
    with opt:
        with pytest.raises(ValueError, match="batch_size"):
            opt.step()
        for bad in (2.5, -1, float("nan")):
            with pytest.raises(ValueError, match="batch_size must be a whole number"):
                opt.step(batch_size=bad)
        assert opt.samples == 0
        with pytest.raises(zgossip.StateUnavailable):
            opt.load_state_from_peers(timeout=1.0)
        # timeout=0 reaches the averager as 0 (`timeout or default` read it as "not given": 60 s)
        seen = []
        real = opt.averager.load_state_from_peers
        opt.averager.load_state_from_peers = lambda **kw: (seen.append(kw["timeout"]), real(**kw))[1]
        try:
            for t in (0, None):
                with pytest.raises(zgossip.StateUnavailable):
                    opt.load_state_from_peers(timeout=t)
        finally:
            opt.averager.load_state_from_peers = real
        assert seen == [0, opt.load_state_timeout]
        assert not opt._me().wants_state  # a failed download does not leave the others holding for it
    with pytest.raises(zgossip.ZGossipError, match="shut down"):
        opt.step(batch_size=1)


def test_a_step_without_gradients_counts_no_samples():
    """A step with every ``p.grad`` None (no backward: Lightning's training_step returned None to skip the batch)
    counted its samples: a lone peer with target 8 and batches of 4, one skipped, stepped after the skipped
    batch and one real one by half that batch's gradient. Now the skipped batch counts nothing."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = CollaborativeOptimizer(torch.optim.SGD([p], lr=1.0), prefix="nograd", target_batch_size=8, batch_size=4,
                                 matchmaking_time=0.1, load_state_on_start=False, averager_opts=dict(FAST))
    with opt:
        opt.step()  # no gradients
        assert opt.samples == 0 and opt.local_epoch == 0
        for _ in range(2):
            p.grad = torch.full((1,), 2.0)
            opt.step()
            opt.zero_grad()
        assert opt.local_epoch == 1 and p.item() == -2.0 and opt.last_round["local_samples"] == 8


def test_a_malformed_state_from_a_donor_is_a_failed_download_not_a_write():
    """A donor's parameter array of shape (1,) was broadcast into the parameter and adopted, a negative epoch was
    adopted, and an epoch that is no int raised ValueError out of step() (only StateUnavailable is retried)."""
    m = torch.nn.Linear(3, 2)
    opt = CollaborativeOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), prefix="malformed", target_batch_size=8,
                                 batch_size=4, load_state_on_start=False, averager_opts=dict(FAST))
    with opt:
        meta, arrays = opt._current_state()
        before = [p.detach().clone() for p in m.parameters()]
        broadcast = [np.ones(1, np.float32)] * 2 + list(arrays[2:])
        # and a broken donor's layout or optimizer state raised ValueError, IndexError or TypeError out of step();
        # an optimizer state torch refuses (KeyError) did so after the parameters were written
        other = [a + 1 for a in arrays]
        no_state = {"d": [[k, {"d": [e for e in v["d"] if e[0] != "state"]}] if k == "opt" else [k, v]
                          for k, v in meta["extra"]["d"]]}
        for bad_meta, bad_arrays in (({**meta, "epoch": 5}, broadcast), ({**meta, "epoch": -3}, list(arrays)),
                                     ({**meta, "epoch": "5"}, list(arrays)), ({**meta, "layout": 5}, other),
                                     ({**meta, "extra": {"T": [99, False]}}, other), ({**meta, "extra": {"d": 5}}, other),
                                     ({**meta, "epoch": 5, "extra": no_state}, other)):
            with pytest.raises(StateUnavailable, match="state|epoch|tensor"):
                opt._apply_state(bad_meta, bad_arrays)
            assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before)) and opt.local_epoch == 0
            assert opt.opt.state_dict()["param_groups"][0]["lr"] == 0.1
        opt._apply_state({**meta, "epoch": 5}, [np.zeros(a.shape, a.dtype) for a in arrays[:2]] + list(arrays[2:]))
        assert all(not p.any() for p in m.parameters()) and opt.local_epoch == 5


def test_an_optimizer_step_that_raises_drops_the_epoch_instead_of_mis_weighting_the_next():
    """The synchronous path divides the accumulated sum into a mean before the optimizer step. When that
    step raised, the mean stayed in the accumulators with the sample count, and the next epoch added its
    sums to it: a lone peer with batches of 4 (gradient 1, then 10) stepped by (1 + 40) / 8 = 5.125. The
    epoch that raised is dropped (as a delayed update that raises drops it): the next step is by 10."""
    class Boom(torch.optim.SGD):
        calls = 0

        def step(self, closure: Any = None) -> Any:
            Boom.calls += 1
            if Boom.calls == 1:
                raise RuntimeError("boom")
            return super().step(closure)

    p = torch.nn.Parameter(torch.zeros(1))
    opt = CollaborativeOptimizer(Boom([p], lr=1.0), prefix="boom", target_batch_size=4, batch_size=4,
                                 load_state_on_start=False, averager_opts=dict(FAST))
    with opt:
        p.grad = torch.ones(1)
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        assert opt.local_epoch == 0 and opt.samples == 0
        opt.zero_grad()
        p.grad = torch.full((1,), 10.0)
        opt.step()
        assert p.item() == -10.0 and opt.local_epoch == 1 and opt.last_round["local_samples"] == 4


@pytest.mark.parametrize("delay", [False, True], ids=["synchronous", "delay_optimizer_step"])
def test_float16_and_bfloat16_gradients_accumulate_in_float32(delay):
    """A lone peer, 320 batches of one sample with the same gradient: the epoch's mean is that gradient.
    The sums used to accumulate in the parameters' dtype: in bfloat16 a sum stops growing at 256 times the
    gradient (2**8), so the mean came out too small (3 -> 2.4); in float16 320 * 256 overflowed to inf."""
    bf, half = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    full = torch.nn.Parameter(torch.zeros(1))
    opt = CollaborativeOptimizer(torch.optim.SGD([bf, half, full], lr=1.0), prefix="lowp", target_batch_size=320,
                                 batch_size=1, delay_optimizer_step=delay, load_state_on_start=False,
                                 averager_opts=dict(FAST))
    with opt:
        for _ in range(320):
            bf.grad = torch.tensor([3.0, 0.5, 1.0 / 3], dtype=torch.bfloat16)
            half.grad = torch.tensor([256.0, 0.1], dtype=torch.float16)
            full.grad = torch.tensor([0.25])
            opt.step()
            opt.zero_grad()
        opt.apply_pending(wait=True, timeout=10)
        assert opt.local_epoch == 1
        assert torch.equal(bf.detach(), -torch.tensor([3.0, 0.5, 1.0 / 3], dtype=torch.bfloat16))
        assert torch.equal(half.detach(), -torch.tensor([256.0, 0.1], dtype=torch.float16))
        assert full.item() == -0.25


def test_sparse_gradients_accumulate():
    """An Embedding(sparse=True): the first batch of an epoch used to be written into the accumulator with
    torch.mul(g, bs, out=acc), which fails inside torch for a sparse g ("INTERNAL ASSERT FAILED")."""
    emb = torch.nn.Embedding(10, 3, sparse=True)
    before = emb.weight.detach().clone()
    opt = CollaborativeOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5), prefix="sparse", target_batch_size=4,
                                 batch_size=2, load_state_on_start=False, averager_opts=dict(FAST))
    with opt:
        for rows in ([1, 2], [2, 3]):
            emb(torch.tensor(rows)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert opt.local_epoch == 1
        # mean gradient per sample: rows 1 and 3 got 1 in one batch of 2, row 2 in both: 2/4, 4/4, 2/4
        step = (before - emb.weight.detach())[:, 0].tolist()
        assert step == pytest.approx([0, 0.25, 0.5, 0.25, 0, 0, 0, 0, 0, 0], abs=1e-6)


def test_train_demo_late_peer_builds_its_optimizer_before_saying_ready(monkeypatch):
    """`zgossip train-demo`'s late joiner pays its start-up costs before "ready", so that it joins when
    told (--late-at). The first torch optimizer of a process imports torch's compiler stack (2-3 s here),
    and that came after "ready": the joiner told at epoch 5 arrived at epoch 24-25 of 25, after the
    swarm had finished. The order is checked here; timing it would be flaky."""
    import torch

    events: list[str] = []
    real_adam = torch.optim.Adam

    def adam(*a, **k):
        events.append("optimizer")
        return real_adam(*a, **k)

    class Conn:
        def send(self, msg):
            events.append(msg.get("event", "?") if isinstance(msg, dict) else str(msg))

        def recv(self):
            return "stop"  # not a dict: the peer leaves before joining

    monkeypatch.setattr(torch.optim, "Adam", adam)
    train_peer(0, Conn(), dict(lr=0.01, wait_for_go=True, epochs=1, target_batch_size=64, batch_size=32))
    assert events == ["optimizer", "ready"]
