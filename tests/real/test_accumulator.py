"""The moolib-style Accumulator: its documented loop on 3 peers, sample weighting, NaN, leader, connect.

Peers are accumulators in this process (threads where a loop must run concurrently),
each with its own averager on 127.0.0.1; every wait is bounded and every peer shut down.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
import pytest
import torch

import zgossip
from zgossip.accumulator import Accumulator, Group
from zgossip.train_demo import Task, evaluate, make_model

FAST = dict(gossip_interval=0.05, peer_timeout=2.0, request_timeout=0.3, part_timeout=2.0)


def _until(pred: Callable[[], bool], timeout: float, what: str, tick: Callable[[], None] = lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        tick()
        time.sleep(0.005)


def moolib_loop(group: Group, accumulator: Accumulator, model: torch.nn.Module, opt: torch.optim.Optimizer,
                data: Callable[[], tuple], batch_size: int, keep_going: Callable[[], bool]) -> None:
    """moolib's documented Accumulator loop; only `while True` became `while keep_going()` and the batch
    comes from `data()`."""
    while keep_going():
        # Update the status of the objects across the network
        group.update()
        accumulator.update()

        # 0. Check we are connected.
        if not accumulator.connected():
            time.sleep(0.25)
            continue

        # 1. Synchronize our state.
        if accumulator.wants_state():
            accumulator.set_state({"optimizer": opt.state_dict()})
        if accumulator.has_new_state():
            opt.load_state_dict(accumulator.state()["optimizer"])

        # 2. Generate our gradients then reduce them.
        if accumulator.wants_gradients():
            X, Y = data()
            y_pred = model(X)
            loss = torch.nn.functional.cross_entropy(y_pred, Y)
            loss.backward()
            accumulator.reduce_gradients(batch_size)  # has_gradients() -> True after this

        # 3. Step our gradients then reset.
        if accumulator.has_gradients():
            opt.step()
            accumulator.zero_gradients()  # has_gradients() -> False after this


def test_moolib_loop_runs_unchanged_on_three_peers_and_trains():
    versions, batch_size = 30, 32
    task = Task()
    hx, hy = task.heldout()
    models = [make_model(i) for i in range(3)]  # different initialisations: the state sync must fix that
    untrained = evaluate(models[0], hx, hy)[0]
    groups = [Group("foo_group", **FAST)]
    accs = [Accumulator("bar", models[0].parameters(), models[0].buffers(), group=groups[0], virtual_batch_size=96,
                        target_group_size=3)]
    accs[0].start()
    for i in (1, 2):
        groups.append(Group("foo_group", initial_peers=[accs[0].endpoint], **FAST))
        accs.append(Accumulator("bar", models[i].parameters(), models[i].buffers(), group=groups[i],
                                virtual_batch_size=96, target_group_size=3))
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    finished = [False] * 3
    errors: list = []

    def peer(i: int) -> None:
        try:
            gen = task.stream(3, i)
            deadline = time.monotonic() + 60
            moolib_loop(groups[i], accs[i], models[i], opts[i], lambda: task.sample(gen, batch_size), batch_size,
                        lambda: accs[i].model_version() < versions and time.monotonic() < deadline)
            finished[i] = True
            while not all(finished) and time.monotonic() < deadline:  # stay up for peers still catching up
                accs[i].update()
                if accs[i].wants_state():
                    accs[i].set_state({"optimizer": opts[i].state_dict()})
                time.sleep(0.005)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(3)]
    try:
        accs[1].start()
        _until(lambda: len(accs[1]._averager.peers()) == 1, 10, "peers 0 and 1 to meet")
        threads[0].start()
        threads[1].start()
        _until(lambda: accs[0].model_version() >= 5 or errors, 30, "the first updates")
        threads[2].start()  # peer 2 joins a running swarm
        for t in threads:
            t.join(70)
        assert not errors, errors
        assert all(finished)
        assert [a.model_version() for a in accs] == [versions] * 3
        for a, b, c in zip(*(m.parameters() for m in models)):
            assert torch.equal(a, b) and torch.equal(a, c)
        assert evaluate(models[0], hx, hy)[0] < 0.8 * untrained
        stats = [a.get_gradient_stats() for a in accs]
        assert stats[2]["num_state_downloads"] >= 1 and stats[0]["num_state_downloads"] == 0
        assert stats[0]["num_updates"] >= versions - 1 and stats[0]["num_peers"] == 3
        assert stats[0]["batch_size"] >= 96
        _until(lambda: len({a.get_leader() for a in accs}) == 1, 5, "views of the leader to agree")
        assert sum(a.is_leader() for a in accs) == 1
        # the joiner's optimizer state came from the leader through has_new_state()/state()
        assert all(float(opts[2].state[p]["step"]) == float(opts[0].state[q]["step"])
                   for p, q in zip(models[2].parameters(), models[0].parameters()))
    finally:
        for a in accs:
            a.shutdown()


def _pair(vbs: int, **kw: Any) -> tuple[Accumulator, Accumulator, torch.nn.Module, torch.nn.Module]:
    ma, mb = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    a = Accumulator("w", ma.parameters(), group=Group("w", **FAST), virtual_batch_size=vbs, target_group_size=2, **kw)
    a.start()
    b = Accumulator("w", mb.parameters(), group=Group("w", initial_peers=[a.endpoint], **FAST),
                    virtual_batch_size=vbs, target_group_size=2, **kw)
    try:
        _until(lambda: a.connected() and b.connected(), 10, "both connected", tick=lambda: (a.update(), b.update(),
                                                                                            a.wants_state() and a.set_state({})))
    except BaseException:
        a.shutdown()
        b.shutdown()
        raise
    return a, b, ma, mb


def _set_grads(model: torch.nn.Module, value: float) -> list[torch.Tensor]:
    gs = []
    for k, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, value + k)
        gs.append(p.grad.clone())
    return gs


def test_gradients_are_weighted_by_samples_not_by_peers():
    a, b, ma, mb = _pair(vbs=40)
    try:
        ga, gb = _set_grads(ma, 1.0), _set_grads(mb, 5.0)
        a.reduce_gradients(10)
        assert all(not p.grad.any() for p in ma.parameters())  # taken: the next backward starts clean
        b.reduce_gradients(30)
        _until(lambda: a.has_gradients() and b.has_gradients(), 10, "the reduction", tick=lambda: (a.update(), b.update()))
        for m in (ma, mb):
            for p, x, y in zip(m.parameters(), ga, gb):
                torch.testing.assert_close(p.grad, (10 * x + 30 * y) / 40)
        assert a.get_gradient_stats()["batch_size"] == 40
        v = a.model_version()
        a.zero_gradients()
        assert a.model_version() == v + 1 and not a.has_gradients() and a.wants_gradients()
        assert all(not p.grad.any() for p in ma.parameters())
    finally:
        a.shutdown()
        b.shutdown()


def test_nan_gradients_are_dropped_and_a_skipping_peer_still_receives_the_mean():
    a, b, ma, mb = _pair(vbs=20)
    try:
        for p in ma.parameters():
            p.grad = torch.full_like(p, float("nan"))
        a.reduce_gradients(16)  # dropped, counted
        assert a.get_gradient_stats()["num_nonfinite_batches"] == 1
        a.skip_gradients()
        gb = _set_grads(mb, 2.0)
        b.reduce_gradients(20)
        _until(lambda: a.has_gradients() and b.has_gradients(), 10, "the reduction", tick=lambda: (a.update(), b.update()))
        for p, y in zip(ma.parameters(), gb):
            torch.testing.assert_close(p.grad, y)  # a contributed nothing, received b's mean
        assert a.get_gradient_stats()["num_skipped"] == 1
        with pytest.raises(zgossip.ZGossipError, match="wants_gradients"):
            a.reduce_gradients(1)
    finally:
        a.shutdown()
        b.shutdown()


def test_float16_and_bfloat16_gradients_are_summed_in_float32():
    """320 one-sample batches of the same gradient: the reduced gradient is that gradient. The sums used
    to accumulate in the parameters' dtype: in bfloat16 a sum stops growing at 256 times the gradient, so
    3.0 came out 3.2; in float16 320 * 256 overflowed, and the lone peer handed p.grad = inf to the user."""
    bf, half = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    want_bf, want_half = torch.tensor([3.0, 0.5, 1.0 / 3], dtype=torch.bfloat16), torch.tensor([256.0, 0.1], dtype=torch.float16)
    acc = Accumulator("lowp", [bf, half], group=Group("lowp", **FAST), virtual_batch_size=320)
    try:
        batches, deadline = 0, time.monotonic() + 20
        while not acc.has_gradients():
            assert time.monotonic() < deadline, "timed out waiting for the reduced gradients"
            acc.update()
            if acc.wants_gradients():
                bf.grad, half.grad = want_bf.clone(), want_half.clone()
                acc.reduce_gradients(1)
                batches += 1
            else:
                time.sleep(0.005)
        assert batches == 320
        assert torch.equal(bf.grad, want_bf) and torch.equal(half.grad, want_half)
    finally:
        acc.shutdown()


def test_sparse_gradients_are_reduced_and_handed_back_sparse():
    """An Embedding(sparse=True) gives sparse gradients: handing back the reduced (dense) gradient raised
    "copy_() between dense and sparse Tensors is not implemented". It is handed back sparse, so SparseAdam,
    the optimizer such gradients are meant for, steps on it."""
    emb = torch.nn.Embedding(10, 3, sparse=True)
    before = emb.weight.detach().clone()
    acc = Accumulator("sparse", emb.parameters(), group=Group("sparse", **FAST), virtual_batch_size=4)
    try:
        acc.update()

        def one_batch() -> None:
            acc.update()
            if acc.wants_gradients():
                emb(torch.tensor([1, 2])).sum().backward()
                acc.reduce_gradients(2)

        _until(acc.has_gradients, 10, "the reduced gradients", tick=one_batch)
        grad = emb.weight.grad
        assert grad.is_sparse and torch.equal(grad.to_dense()[1:3], torch.ones(2, 3)) and grad.to_dense().sum() == 6
        torch.optim.SparseAdam(emb.parameters(), lr=0.1).step()
        moved = (emb.weight.detach() != before).any(dim=1)
        assert moved.tolist() == [i in (1, 2) for i in range(10)]
    finally:
        acc.shutdown()


def test_connect_and_misuse():
    g = Group("c")
    g.connect("127.0.0.1:5555")
    assert g.initial_peers == ["tcp://127.0.0.1:5555"]
    acc = Accumulator("c", torch.nn.Linear(2, 1).parameters(), group=Group("c", **FAST))
    try:
        with pytest.raises(zgossip.ZGossipError, match="update"):
            acc.set_state({})
        acc.connect("127.0.0.1:1")  # before start: recorded
        acc.group.initial_peers.clear()
        acc.update()
        assert acc.connected() and acc.is_leader()  # alone: it starts the run
        with pytest.raises(zgossip.ZGossipError, match="before the first update"):
            acc.connect("127.0.0.1:2")
        with pytest.raises(TypeError, match="cannot be shared"):
            acc.set_state({"f": print})
    finally:
        acc.shutdown()
    with pytest.raises(ValueError, match="at least one parameter"):
        Accumulator("c", [])


def test_calls_out_of_order_say_why_and_a_shut_down_accumulator_refuses_to_train():
    """Before the first update(), zero_gradients() raised AttributeError ('NoneType' ... 'get_tensors') and
    reduce_gradients() blamed a running round or pending zero_gradients(); after shutdown(), update() and
    reduce_gradients() were accepted and did nothing (start() even built a new averager)."""
    model = torch.nn.Linear(3, 1)
    acc = Accumulator("order", model.parameters(), group=Group("order", **FAST))
    try:
        _set_grads(model, 1.0)
        acc.zero_gradients()  # nothing accumulated yet: it zeroes p.grad
        assert all(not p.grad.any() for p in model.parameters()) and acc.model_version() == 0
        for call in (lambda: acc.reduce_gradients(4), acc.skip_gradients):
            with pytest.raises(zgossip.ZGossipError, match=r"call update\(\) first"):
                call()
        acc.update()
        assert acc.connected()
        _set_grads(model, 1.0)
        acc.reduce_gradients(4)
        deadline = time.monotonic() + 5
        while not acc.has_gradients() and time.monotonic() < deadline:
            acc.update()  # alone: it steps on its own gradients
        assert acc.has_gradients()
        with pytest.raises(zgossip.ZGossipError, match=r"await zero_gradients\(\)"):
            acc.reduce_gradients(4)
        for bad in (0, "2", 1.5):
            with pytest.raises(ValueError, match="set_parallel_gradients"):
                acc.set_parallel_gradients(bad)
    finally:
        acc.shutdown()
    for call in (acc.update, acc.start, lambda: acc.reduce_gradients(4), acc.skip_gradients, lambda: acc.set_state({})):
        with pytest.raises(zgossip.ZGossipError, match="shut down"):
            call()
    acc.zero_gradients()  # harmless after shutdown
    acc.shutdown()


def test_a_malformed_state_from_a_donor_is_refused_before_anything_is_written():
    """A donor's state missing its version (KeyError out of update()), with a version that is no int (parameters
    written, then ValueError), a parameter of shape (1,) (broadcast into the parameter), too few tensors (half
    written) or a negative version (adopted) is now a failed download: a ZGossipError, which update() logs and
    retries, before any tensor or the version changes."""
    from zgossip.training_state import LayoutMismatch, pack_state

    model = torch.nn.Linear(3, 2)
    acc = Accumulator("adopt", model.parameters(), group=Group("adopt", **FAST))
    try:
        acc.start()
        good = {"kind": "accumulator", "version": 3, "layout": acc.layout.as_meta(), "buffers": 0,
                "user": pack_state({})[0]}
        full = [np.zeros((2, 3), np.float32), np.zeros(2, np.float32)]
        before = [p.detach().clone() for p in model.parameters()]
        for meta, arrays in (({k: v for k, v in good.items() if k != "version"}, full), ({**good, "version": "3"}, full),
                             ({**good, "version": -1}, full), (good, [np.ones(1, np.float32)] * 2), (good, full[:1])):
            with pytest.raises(zgossip.ZGossipError) as err:
                acc._adopt(meta, arrays)
            assert not isinstance(err.value, LayoutMismatch), err.value  # the donor's fault: retried, not fatal
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and acc.model_version() == 0
        acc._adopt(good, full)  # the well-formed one is adopted
        assert all(not p.any() for p in model.parameters()) and acc.model_version() == 3 and acc.has_new_state()
    finally:
        acc.shutdown()


def test_bad_batch_sizes_and_versions_are_refused_before_anything_is_accumulated():
    """A negative or fractional batch size used to be accumulated as a weight (-4 negated the gradients;
    2.5 weighted them 2.5 but counted 2 samples), and a NaN or "8" was accumulated before failing."""
    model = torch.nn.Linear(3, 1)
    acc = Accumulator("bad", model.parameters(), group=Group("bad", **FAST))
    try:
        acc.set_virtual_batch_size(1000)  # no round: the accumulated gradients stay where the test reads them
        acc.update()
        assert acc.connected() and acc.wants_gradients()
        for bad in (-4, 2.5, float("nan"), "8", None, True):
            grads = _set_grads(model, 1.0)
            with pytest.raises(ValueError, match="batch_size must be a whole number"):
                acc.reduce_gradients(bad)
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # p.grad untouched
            assert acc._samples == 0 and all(not a.any() for a in acc._grads)
        grads = _set_grads(model, 1.0)
        acc.reduce_gradients(4.0)  # a float that holds a whole number is fine
        assert acc._samples == 4 and all(torch.equal(a, 4 * g) for a, g in zip(acc._grads, grads))
        for bad in (-3, 2.5, "x", None):
            with pytest.raises(ValueError, match="virtual batch size"):
                acc.set_virtual_batch_size(bad)
        with pytest.raises(ValueError, match="virtual_batch_size"):
            Accumulator("bad", model.parameters(), virtual_batch_size=-1)
        for bad in (-3, 2.5, "x", None, True):
            with pytest.raises(ValueError, match="model version"):
                acc.set_model_version(bad)
        assert acc.get_gradient_stats()["virtual_batch_size"] == 1000 and acc.model_version() == 0
    finally:
        acc.shutdown()


def test_a_failed_round_never_leaves_peers_at_one_version_with_different_parameters():
    """Regression: a peer whose round failed (here: the others were busy and never joined its
    matchmaking window) used to step on its local gradients, which made it the highest model
    version -- the leader -- so it never resynchronised, while the others, in a round of their
    own, updated to the same version with other parameters. A failed round must change nothing."""
    opts = dict(FAST, matchmaking_time=0.2)
    models = [torch.nn.Linear(4, 3) for _ in range(3)]
    accs = [Accumulator("f", models[0].parameters(), group=Group("f", **opts), target_group_size=3)]
    accs[0].start()
    for m in models[1:]:
        accs.append(Accumulator("f", m.parameters(), group=Group("f", initial_peers=[accs[0].endpoint], **opts),
                                target_group_size=3))
    sgd = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    contributed = [False, False, False]

    def tick(i: int, contribute: bool) -> None:
        acc = accs[i]
        acc.update()
        if not acc.connected():
            return
        if acc.wants_state():
            acc.set_state({"optimizer": sgd[i].state_dict()})
        if acc.has_new_state():
            sgd[i].load_state_dict(acc.state()["optimizer"])
        if contribute and not contributed[i] and acc.wants_gradients() and acc.model_version() == 0:
            contributed[i] = True
            _set_grads(models[i], float(i + 1))
            acc.reduce_gradients(8)
        if acc.has_gradients():
            sgd[i].step()
            acc.zero_gradients()

    try:
        def settled(a: Accumulator) -> bool:  # connected, and nobody pauses rounds for a catch-up any more
            return a.connected() and a._view is not None and a._view.num_peers == 3 and all(
                p.ready and not p.wants_state for p in a._view.peers)

        _until(lambda: all(settled(a) for a in accs), 10, "three connected peers",
               tick=lambda: [tick(i, False) for i in range(3)])
        for a, b, c in zip(*(m.parameters() for m in models)):
            assert torch.equal(a, b) and torch.equal(a, c)  # the state sync gave everyone peer 0's
        # peer 0 starts a round alone and it fails: the others are busy (their loops do not run)
        contributed[0] = True
        _set_grads(models[0], 1.0)
        accs[0].reduce_gradients(8)
        assert accs[0]._round is not None  # its round runs
        _until(lambda: accs[0]._round.done(), 10, "the lonely round to fail")
        # before peer 0's loop sees the failure, peers 1 and 2 contribute and start a round together
        for i in (1, 2):
            contributed[i] = True
            _set_grads(models[i], float(i + 1))
            accs[i].reduce_gradients(8)
            assert accs[i]._round is not None  # its round runs
        # every loop runs until each peer made one update (peer 0: in their round if still open, else by a resync)
        _until(lambda: all(a.model_version() == 1 and a.connected() and a.wants_gradients() for a in accs), 20,
               "every peer at version 1", tick=lambda: [tick(i, True) for i in range(3)])
        for a, b, c in zip(*(m.parameters() for m in models)):
            assert torch.equal(a, b) and torch.equal(a, c)
        stats = accs[0].get_gradient_stats()
        assert stats["num_failed_rounds"] >= 1 and stats["num_local_fallbacks"] == 0
    finally:
        for a in accs:
            a.shutdown()


def test_a_client_mode_accumulator_is_refused_instead_of_never_connecting():
    """Accumulator(group=Group(..., listen=None)) once stayed SYNCING with connected() False forever (nobody
    gossiped a client's record then); a client's record counts now, but a client could become the leader,
    whose state newcomers download and nobody can download from a client: refused, saying what to do."""
    model = torch.nn.Linear(3, 1)
    for group, kw in ((Group("cl", listen=None, **FAST), {}), (Group("cl", **FAST), {"client_mode": True}),
                      (Group("cl", client_mode=True, **FAST), {})):
        with pytest.raises(ValueError, match="cannot run in client mode.*listen address"):
            Accumulator("cl", model.parameters(), group=group, **kw)

