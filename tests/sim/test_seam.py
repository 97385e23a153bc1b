"""The seam as code: frozen actions and one executor, membership views, the clocks, and the real
`Averager` running blocking user code on the simulated transport in virtual time."""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim import SimCluster
from sim.clock import VirtualClock, WouldBlock
from sim.static import StaticView
from zgossip import actions
from zgossip.membership import Membership
from zgossip.node import NodeConfig
from zgossip.view import MembershipView

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ actions and their executor
def test_actions_are_frozen_values():
    for cls in (actions.Send, actions.Disconnect, actions.StepDone, actions.StepFailed, actions.ServeState,
                actions.DownloadDone, actions.DownloadFailed):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        actions.Disconnect("sim://a").endpoint = "sim://b"  # type: ignore[misc]


def test_execute_routes_each_action_once_in_order():
    seen = []

    class Carrier:
        def transmit(self, ep, msg, batch):
            seen.append(("send", ep))

        def disconnect(self, ep):
            seen.append(("disconnect", ep))

    class Owner:
        def step_finished(self, act):
            seen.append(("step", act.step_id))

        def serve_state(self, act):
            seen.append(("serve", act.req))

        def download_finished(self, act):
            seen.append(("download", act.req))

    acts = [actions.Send("a", None), actions.StepDone("s1", None), actions.Disconnect("b"),
            actions.ServeState("r1", "c"), actions.StepFailed("s2", ValueError()), actions.DownloadFailed("d", ValueError())]
    actions.execute(acts, Carrier(), Owner())
    assert seen == [("send", "a"), ("step", "s1"), ("disconnect", "b"), ("serve", "r1"), ("step", "s2"),
                    ("download", "d")]
    errors = []

    class Broken(Owner):
        def step_finished(self, act):
            raise RuntimeError("owner bug")

    seen.clear()
    actions.execute(acts[:3], Carrier(), Broken(), errors.append)  # the ZeroMQ way: report, keep going
    assert seen == [("send", "a"), ("disconnect", "b")] and len(errors) == 1
    with pytest.raises(RuntimeError):  # the simulator's way: loud
        actions.execute(acts[:3], Carrier(), Broken())


# ------------------------------------------------------------------ membership views
@pytest.mark.parametrize("cls", [Membership, StaticView])
def test_membership_implementations_provide_the_whole_view(cls):
    members = {n for n, _ in inspect.getmembers(MembershipView) if not n.startswith("_")}
    members |= set(MembershipView.__annotations__)
    if cls is Membership:
        obj = Membership("p", "sim://p", lambda ep, m: None, np.random.default_rng(0))
    else:
        from sim.static import StaticTable

        table = StaticTable()
        table.add("p", "sim://p", 0.0)
        obj = StaticView(table, "p", "sim://p")
    missing = {m for m in members if not hasattr(obj, m)}
    assert not missing, f"{cls.__name__} lacks {sorted(missing)}"
    assert isinstance(obj, MembershipView)


# ------------------------------------------------------------------ the virtual clock
def test_virtual_clock_orders_wakeups_by_time_then_sequence():
    import simpy

    env = simpy.Environment()
    clock = VirtualClock(env)
    log = []

    def worker(name, naps):
        for nap in naps:
            clock.sleep(nap)
            log.append((clock.now(), name))
        return name

    ths = [clock.spawn(worker, n, naps) for n, naps in (("a", [1, 1, 1]), ("b", [2, 1]), ("c", [0.5, 1.5]))]
    env.run(until=env.all_of([t.done for t in ths]))
    # equal times wake in the order the waits were registered: b (at t=0), c (t=0.5), a (t=1)
    assert log == [(0.5, "c"), (1, "a"), (2, "b"), (2, "c"), (2, "a"), (3, "b"), (3, "a")]
    assert [t.future.result() for t in ths] == ["a", "b", "c"]
    with pytest.raises(WouldBlock):
        clock.sleep(1.0)  # the scheduler itself cannot wait


def test_closing_a_virtual_clock_ends_every_thread_it_made():
    """A simulated thread still waiting when its simulation ended (a worker between tasks, a user
    thread the run left blocked, one waiting for a lock) kept its OS thread -- and through it the
    whole simulation -- for the life of the process. `close` unwinds each with SimulationClosed."""
    import threading

    import simpy

    from sim.clock import SimulationClosed

    env = simpy.Environment()
    clock = VirtualClock(env)
    lock = clock.lock()
    unwound = []

    def sleeper():
        try:
            clock.sleep(100.0)
        finally:
            unwound.append("sleeper")

    def holder():
        with lock:
            clock.sleep(100.0)

    def waiter():
        clock.sleep(0.5)
        try:
            lock.acquire()
        finally:
            unwound.append("waiter")

    before = set(threading.enumerate())
    ths = [clock.spawn(f) for f in (sleeper, holder, waiter)]
    quick = clock.spawn(lambda: clock.sleep(0.2))  # its thread then sits idle in the pool
    env.run(until=1.0)
    made = set(threading.enumerate()) - before
    assert quick.future.done() and len(made) == 4
    clock.close()
    assert not any(t.is_alive() for t in made)
    assert sorted(unwound) == ["sleeper", "waiter"]
    assert all(isinstance(t.future.exception(0), SimulationClosed) for t in ths)
    clock.close()  # (twice: nothing left to do)
    with pytest.raises(SimulationClosed):
        clock.spawn(lambda: None)  # a closed clock runs no more simulated threads
    with pytest.raises(SimulationClosed):
        clock.executor("late").submit(lambda: None)


def test_a_finished_scenario_keeps_nothing_alive():
    """`run_scenario` left the pooled OS threads of its peers' apply workers parked, each holding the
    run's clock and through it every peer and tensor: a notebook running scenario after scenario grew
    by a whole swarm per run (16 peers x 256 KiB: 18 MB per run)."""
    import gc
    import threading
    import weakref

    from sim.scenario import Scenario, ScenarioRun

    before = set(threading.enumerate())
    run = ScenarioRun(Scenario.from_dict({"seed": 1, "peers": 4, "rounds": 2, "numel": 4096, "grid": [4]}))
    res = run.run()
    assert res.rounds and all(r["participants"] == 4 for r in res.rounds)
    gone = weakref.ref(run.cluster)
    del run
    gc.collect()
    gc.collect()  # (the first pass finalizes what the run's futures and events still tie up)
    assert gone() is None
    assert set(threading.enumerate()) <= before


def test_virtual_lock_waits_in_virtual_time():
    import simpy

    env = simpy.Environment()
    clock = VirtualClock(env)
    lock = clock.lock(reentrant=True)
    log = []

    def holder():
        with lock:
            with lock:  # reentrant
                clock.sleep(5.0)
        log.append(("released", clock.now()))

    def waiter():
        clock.sleep(1.0)
        assert not lock.acquire(timeout=2.0)  # times out at t=3 while the holder sleeps
        log.append(("gave up", clock.now()))
        with lock:
            log.append(("got it", clock.now()))

    ths = [clock.spawn(holder), clock.spawn(waiter)]
    env.run(until=env.all_of([t.done for t in ths]))
    assert log == [("gave up", 3.0), ("released", 5.0), ("got it", 5.0)]


# ------------------------------------------------------------------ the real Averager, blocking, in virtual time
TRAIN = r'''
import hashlib, json, sys
import numpy as np
from sim import NetworkModel, SimCluster
from zgossip.node import NodeConfig

def run(seed, n=5, rounds=4):
    net = NetworkModel(latency=lambda a, b: 0.002 + 0.0005 * (a < b), bandwidth=2e7, loss=0.0)
    cl = SimCluster(seed=seed, network=net)
    rng = np.random.default_rng(seed)
    cfg = NodeConfig(prefix="train", target_group_size=n, min_group_size=2, matchmaking_time=0.3,
                     request_timeout=0.2, part_size_bytes=2048, part_timeout=0.5, gossip_interval=0.05,
                     peer_timeout=2.0)
    peers = []
    for i in range(n):
        peers.append(cl.add_peer(cfg, initial_peers=[peers[0].endpoint] if peers else [],
                                 tensors=[rng.standard_normal(4000)]))
    log = []

    def trainer(i, avg):
        clock = avg.clock
        out = []
        clock.sleep(1.0 + 0.01 * i)                       # let gossip converge, in virtual time
        for r in range(rounds):
            with avg.get_tensors() as (w,):
                w += 0.001 * (i + 1)                      # a "local update"
            res = avg.step(weight=1.0 + i, timeout=3.0)   # blocks, in virtual time (in place: one tensor)
            out.append([r, round(clock.now(), 9), len(res.members), res.complete])
            log.append((clock.now(), i, r))
            clock.sleep(0.05 * (i % 3))                   # uneven compute
        return out

    threads = [cl.spawn(trainer, i, p.averager, name=f"trainer{i}") for i, p in enumerate(peers)]
    cl.run(until=cl.env.all_of([t.done for t in threads]))
    return {"results": [t.future.result() for t in threads], "log": log, "trace": cl.trace_hash,
            "now": cl.env.now, "delivered": cl.delivered,
            "tensors": [hashlib.sha256(p.tensors[0].tobytes()).hexdigest() for p in peers]}

print(json.dumps(run(int(sys.argv[1]))))
'''


def _train(seed: int, hashseed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    out = subprocess.run([sys.executable, "-c", TRAIN, str(seed)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_blocking_averager_loops_run_in_virtual_time_one_seed_one_trace():
    a = _train(5, "0")
    b = _train(5, "4242")
    assert a == b  # results, wake-up order, trace and tensors: identical across runs and hash seeds
    # every trainer really averaged with others, every round, and virtual time moved on
    for per_trainer in a["results"]:
        assert len(per_trainer) == 4 and all(members >= 2 for _, _, members, _ in per_trainer)
    assert a["now"] > 1.0 and a["delivered"] > 0
    c = _train(6, "0")
    assert c["trace"] != a["trace"]


def test_blocking_step_outside_a_simulated_thread_says_what_to_do():
    cl = SimCluster(seed=0)
    cfg = NodeConfig(prefix="x", gossip_interval=0.05)
    p = cl.add_peer(cfg, tensors=[np.zeros(4)])
    with pytest.raises(WouldBlock, match="spawn"):
        p.averager.step(timeout=1.0)


# ------------------------------------------------------------------ imports stay light
def test_importing_zgossip_and_sim_loads_neither_pyzmq_nor_the_c_sender():
    code = ("import sys, zgossip, sim, sim.scenario, zgossip.averager, zgossip.node\n"
            "bad = [m for m in sys.modules if m == 'zmq' or m.startswith('zmq.') or m == 'zgossip._zsend']\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
