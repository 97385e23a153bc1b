"""The simulator's network model and faults: each does what it should and nothing else."""
from __future__ import annotations

import numpy as np
import pytest

from sim import NetworkModel, SimCluster
from sim.network import PROFILES, Partition, SlowLink
from sim.scenario import run_scenario
from zgossip.node import NodeConfig
from zgossip.wire import MsgType, make_message

RNG = np.random.default_rng(0)


def test_one_transfer_takes_size_over_bandwidth_plus_latency():
    net = NetworkModel(latency=0.05, bandwidth=1e6)
    d = net.schedule("a", "b", 2_000_000, now=1.0, rng=RNG)
    assert d.at == pytest.approx(1.0 + 2.0 + 0.05)
    assert not d.lost


def test_two_concurrent_uploads_share_the_uplink():
    net = NetworkModel(latency=0.01, bandwidth=1e6)
    d1 = net.schedule("a", "b", 1_000_000, now=0.0, rng=RNG)
    d2 = net.schedule("a", "c", 1_000_000, now=0.0, rng=RNG)
    assert d1.at == pytest.approx(1.01)
    assert d2.at == pytest.approx(2.01)  # waited for a's uplink
    d3 = net.schedule("x", "y", 1_000_000, now=0.0, rng=RNG)
    assert d3.at == pytest.approx(1.01)  # other peers are not affected


def test_downlink_is_shared_too():
    net = NetworkModel(latency=0.0, bandwidth={"a": 1e9, "b": 1e9, "c": 1e6})
    d1 = net.schedule("a", "c", 1_000_000, now=0.0, rng=RNG)
    d2 = net.schedule("b", "c", 1_000_000, now=0.0, rng=RNG)
    assert d1.at == pytest.approx(1.0, rel=1e-3) and d2.at == pytest.approx(2.0, rel=1e-3)


def test_order_per_pair_is_kept_under_jitter():
    net = NetworkModel(latency={"dist": "uniform", "low": 0.0, "high": 0.1}, jitter=0.05)
    rng = np.random.default_rng(1)
    times = [net.schedule("a", "b", 10, now=i * 0.001, rng=rng).at for i in range(200)]
    assert times == sorted(times)


def test_profiles_region_matrix_and_loss():
    regions = {"a": "eu", "b": "us"}
    net = NetworkModel(latency={"dist": "regions", "region_of": regions,
                                "matrix": {"eu": {"eu": 0.005, "us": 0.04}, "us": {"eu": 0.04, "us": 0.005}}},
                       profiles={"a": PROFILES["home"], "b": PROFILES["datacenter"]})
    d = net.schedule("a", "b", 2_500_000, now=0.0, rng=RNG)  # home uplink 2.5 MB/s
    assert d.at == pytest.approx(1.0 + 0.04 + PROFILES["home"].latency + PROFILES["datacenter"].latency)
    lossy = NetworkModel(loss=0.3)
    rng = np.random.default_rng(2)
    lost = sum(lossy.schedule("a", "b", 1, now=0.0, rng=rng).lost for _ in range(4000))
    assert 0.27 < lost / 4000 < 0.33


def test_partition_cuts_exactly_its_interval_and_only_across():
    p = Partition(1.0, 2.0, frozenset({"a"}), frozenset({"b"}))
    net = NetworkModel(partitions=[p])
    assert not net.schedule("a", "b", 1, now=0.999, rng=RNG).lost
    assert net.schedule("a", "b", 1, now=1.0, rng=RNG).lost
    assert net.schedule("b", "a", 1, now=1.999, rng=RNG).lost
    assert not net.schedule("a", "b", 1, now=2.0, rng=RNG).lost
    assert not net.schedule("a", "c", 1, now=1.5, rng=RNG).lost  # not across the cut


def test_slow_link_only_during_its_interval():
    net = NetworkModel(latency=0.0, bandwidth=1e6, slow_links=[SlowLink(10.0, 20.0, "a", 4.0)])
    assert net.schedule("a", "b", 1_000_000, now=0.0, rng=RNG).at == pytest.approx(1.0)
    assert net.schedule("a", "b", 1_000_000, now=10.0, rng=RNG).at == pytest.approx(14.0)
    assert net.schedule("a", "b", 1_000_000, now=30.0, rng=RNG).at == pytest.approx(31.0)


def _two_peers(**net):
    cl = SimCluster(seed=0, network=NetworkModel(**net))
    cfg = NodeConfig(gossip_interval=100.0, peer_timeout=1000.0)
    a = cl.add_peer(cfg)
    b = cl.add_peer(cfg, known=[a])
    seen: list = []
    orig = b.node.on_message
    b.node.on_message = lambda msg, now: (seen.append((now, msg.heartbeat)), orig(msg, now))[1]
    return cl, a, b, seen


def _gossip(cl, a, b, hb):
    msg = make_message(MsgType.GOSSIP_REPLY, a.peer_id, a.endpoint, {"hb": hb, "peers": []})
    cl._transmit(a, b.endpoint, msg)


def test_paused_peer_handles_its_messages_after_it_resumes():
    cl, a, b, seen = _two_peers(latency=0.01)
    cl.run(until=1.0)
    seen.clear()
    b.pause()
    _gossip(cl, a, b, 7)
    cl.run(until=1.5)
    assert seen == []  # frozen: nothing handled
    b.resume()
    assert seen == [(1.5, 7)]
    _gossip(cl, a, b, 8)
    cl.run(until=2.0)
    assert seen[-1] == (pytest.approx(1.51), 8)


def test_crashed_peer_loses_what_it_had_queued():
    cl, a, b, seen = _two_peers(latency=0.0, bandwidth=300.0)
    cl.run(until=1.0)
    seen.clear()
    big = make_message(MsgType.GOSSIP_REPLY, a.peer_id, a.endpoint, {"hb": 1, "peers": []})
    for _ in range(3):
        cl._transmit(a, b.endpoint, big)  # ~45 bytes: 0.15 s each on a 300 B/s uplink
    cl.run(until=cl.env.now + 0.2)
    a.crash()
    cl.run(until=cl.env.now + 2.0)
    assert len(seen) == 1  # the first left before the crash; the queued two never did


def test_scenario_faults_change_only_what_they_should():
    base = {"peers": 8, "grid": [4, 2], "rounds": 3, "seed": 5, "network": {"bandwidth": 1e7}}
    clean = run_scenario(base)
    assert all(r["succeeded"] == 8 for r in clean.rounds)
    assert clean.rounds[-1]["mse"] < 1e-25  # 4x2 full grid: exact after 2 rounds
    crashed = run_scenario({**base, "faults": [{"kind": "crash", "peer": 3, "at": 0.5}]})
    assert all(r["live"] == 7 for r in crashed.rounds)
    rejoin = run_scenario({**base, "rounds": 4, "round_gap": 1.0,
                           "faults": [{"kind": "crash_rejoin", "peer": 3, "at": 0.5, "back": 2.0}]})
    assert rejoin.rounds[0]["live"] == 7 and rejoin.rounds[-1]["live"] == 8
    part = run_scenario({**base, "membership": "static",
                         "faults": [{"kind": "partition", "sides": [[0, 2, 4, 6], [1, 3, 5, 7]],
                                     "start": 0.0, "end": 1000.0}]})
    # round 0 (axis 0) lines lie within one side of the cut and still average; the axis-1 pairs
    # straddle it, so nobody meets across and the two halves never mix
    assert part.rounds[0]["succeeded"] == 8
    assert part.rounds[1]["succeeded"] == 0
    assert part.rounds[-1]["mse"] > 1e-6
    healed = run_scenario({**base, "membership": "static", "rounds": 4,
                           "faults": [{"kind": "partition", "sides": [[0, 2, 4, 6], [1, 3, 5, 7]],
                                       "start": 0.0, "end": 3.0}]})
    assert healed.rounds[-1]["succeeded"] == 8  # after the interval traffic crosses again


def test_in_order_per_pair_end_to_end_under_heavy_jitter():
    cl = SimCluster(seed=3, network=NetworkModel(latency={"dist": "uniform", "low": 0.0, "high": 0.2}, jitter=0.1))
    cfg = NodeConfig(gossip_interval=100.0, peer_timeout=1000.0)
    a = cl.add_peer(cfg)
    b = cl.add_peer(cfg, known=[a])
    seen = []
    orig = b.node.on_message
    b.node.on_message = lambda msg, now: (seen.append(msg.heartbeat), orig(msg, now))[1]
    cl.run(until=1.0)
    seen.clear()
    for hb in range(100):
        _gossip(cl, a, b, 1000 + hb)
        cl.run(until=cl.env.now + 0.001)
    cl.run(until=cl.env.now + 2.0)
    assert seen == list(range(1000, 1100))
