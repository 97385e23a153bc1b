"""A churn run keeps what its live peers need, not what every departed peer had.

The simulator used to keep each departed peer whole (its node, averager and tables, ~70 KB, in
`SimCluster.peers` and in the run's slots) and a time per connection it ever used (`NetworkModel`),
so memory grew ~100 KB with every departure of a long churn run. Now a departed peer leaves a
`sim.driver.Departed` behind, and the network model, the TCP model and the CPU model forget what
holds no later message back -- without changing a result.
"""
from __future__ import annotations

import gc
import weakref

import pytest

from sim.cpu import CpuModel
from sim.driver import Departed
from sim.network import NetworkModel
from sim.scenario import Scenario, ScenarioRun

# ~40 departures among ~10 live peers, and a slot that crashes and comes back
CHURN = {"seed": 1, "peers": 8, "numel": 2, "rounds": 8, "grid": [], "round_gap": 0.5, "bootstrap_time": 0.5,
         "step_timeout": 1.0, "protocol": {"target_group_size": 4},
         "churn": {"arrival_rate": 4.0, "departure_rate": 0.5},
         "faults": [{"kind": "crash_rejoin", "peer": 2, "at": 1.0, "back": 2.0}]}


@pytest.mark.parametrize("extra", [{"network": {"bandwidth": 1e6, "jitter": 0.001}},
                                   {"network": {"transfer": "tcp", "bandwidth": 12.5e6}},
                                   {"cpu": {"costs": {"handle_msg": 1e-4, "encode_msg": 2e-5}}}],
                         ids=["fifo", "tcp", "cpu"])
def test_departed_peers_leave_only_a_compact_record(extra, monkeypatch):
    monkeypatch.setattr(NetworkModel, "prune_min", 16)  # prune as soon as there is something to prune
    monkeypatch.setattr(CpuModel, "prune_min", 8)
    run = ScenarioRun(Scenario.from_dict({**CHURN, **extra}))
    made: list[weakref.ref] = []
    add_peer = run.cluster.add_peer

    def add_and_watch(*a, **kw):
        peer = add_peer(*a, **kw)
        made.append(weakref.ref(peer))
        return peer

    run.cluster.add_peer = add_and_watch  # the slots' peers from now on (arrivals, the rejoin)
    most_live = [0]

    def count_live(_e=None) -> None:
        most_live[0] = max(most_live[0], sum(p.alive for p in run.slots))
        run.env.timeout(0.1).callbacks.append(count_live)

    count_live()
    run.run()
    gc.collect()
    departed = [p for p in run.slots if not p.alive]
    assert len(departed) >= 30 and len(made) >= 30 and most_live[0] < len(departed) / 2  # many more left than live
    # every departed slot, and every departed endpoint of the cluster, holds a Departed, not the peer
    assert all(isinstance(p, Departed) for p in departed)
    assert all(isinstance(p, Departed) for p in run.cluster.peers.values() if not p.alive)
    # the peers themselves are gone, but for the few that messages or timers in flight still name
    kept = [p for p in (r() for r in made) if p is not None and not p.alive]
    assert len(kept) <= most_live[0], f"{len(kept)} departed peers still in memory"
    # per-connection and per-endpoint tables: bounded by what is busy now, not by who ever was there
    net = run.network
    for table in (net._first, net._last, net._up_free, net._down_free):
        assert len(table) <= 4 * most_live[0], len(table)
    cpu = run.cluster.cpu_model
    if cpu is not None:
        assert len(cpu._peers) <= 2 * most_live[0]
    tcp = run.cluster.tcp
    if tcp is not None:
        assert all(tcp._up.values()) and all(tcp._down.values())  # no endpoint kept with no connection
        assert len(tcp._up) <= most_live[0] and len(tcp._busy_up) <= most_live[0]


def test_pruning_changes_no_result(monkeypatch):
    """The network model and the CPU model pruning on every message give the results they give
    never pruning, bit for bit (the pruned times only ever lose a ``max`` against a later one)."""
    sc = {**CHURN, "profiles": {"home": 0.5, "mobile": 0.5}, "network": {"jitter": 0.002, "loss": 0.01},
          "cpu": {"costs": {"handle_msg": 1e-4, "encode_msg": 2e-5}}}
    out = []
    for least in (1, 10 ** 9):
        monkeypatch.setattr(NetworkModel, "prune_min", least)
        monkeypatch.setattr(CpuModel, "prune_min", least)
        run = ScenarioRun(Scenario.from_dict(sc))
        out.append(run.run().to_json())
        assert (len(run.network._first) < 100) == (least == 1)  # it did prune, or did not
    assert out[0] == out[1]
