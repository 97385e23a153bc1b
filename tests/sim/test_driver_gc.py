"""`SimCluster.run` keeps the objects alive before it out of the cyclic collector's sight while it
runs (`gc.freeze`) and hands them back afterwards; it leaves a freeze made by someone else alone."""
from __future__ import annotations

import gc
import threading

import numpy as np

from sim import SimCluster
from zgossip.node import NodeConfig


def _cluster() -> SimCluster:
    cl = SimCluster(seed=1)
    cfg = NodeConfig(prefix="gc", target_group_size=2, gossip_interval=0.05, peer_timeout=2.0)
    a = cl.add_peer(cfg, tensors=[np.ones(8)])
    cl.add_peer(cfg, tensors=[np.zeros(8)], known=[a])
    return cl


def test_run_freezes_what_exists_and_unfreezes_after():
    cl = _cluster()
    seen: list[int] = []
    cl.env.timeout(0.01).callbacks.append(lambda _e: seen.append(gc.get_freeze_count()))
    assert gc.get_freeze_count() == 0
    cl.run(until=0.5)
    assert seen and seen[0] > 0  # during the run, what existed before was frozen
    assert gc.get_freeze_count() == 0  # and handed back after


def test_run_leaves_a_freeze_of_someone_else_and_a_disabled_collector_alone():
    cl = _cluster()
    gc.freeze()
    try:
        cl.run(until=0.2)
        assert gc.get_freeze_count() > 0  # still frozen: the run did not unfreeze what it had not frozen
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        seen: list[int] = []
        cl.env.timeout(0.01).callbacks.append(lambda _e: seen.append(gc.get_freeze_count()))
        cl.run(until=0.4)
        assert seen == [0] and not gc.isenabled()
    finally:
        gc.enable()


def test_runs_in_several_threads_at_once_unfreeze_when_the_last_ends():
    clusters = [_cluster() for _ in range(3)]
    threads = [threading.Thread(target=cl.run, kwargs={"until": 2.0}) for cl in clusters]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert gc.get_freeze_count() == 0
    cl = _cluster()  # and the next run freezes again
    seen: list[int] = []
    cl.env.timeout(0.01).callbacks.append(lambda _e: seen.append(gc.get_freeze_count()))
    cl.run(until=0.5)
    assert seen and seen[0] > 0 and gc.get_freeze_count() == 0
