"""Auxiliary peers: weight 0, no data, but they reduce a span for the others (simulator, the
real protocol code)."""
import numpy as np
import pytest

from sim import NetworkModel, SimCluster
import zgossip
from zgossip.node import NodeConfig, StepDone, StepFailed

NUMEL = 5000


def _run(n_data, n_aux, seed=0, gather=None, client=()):
    cl = SimCluster(seed=seed, network=NetworkModel(latency=0.002, bandwidth=5e6))
    n = n_data + n_aux
    cfg = NodeConfig(prefix="a", target_group_size=n, min_group_size=n, part_size_bytes=4096, part_timeout=0.5,
                     gossip_interval=0.05, peer_timeout=3.0, matchmaking_time=0.3, request_timeout=0.2)
    rng = np.random.default_rng(seed)
    peers = []
    for i in range(n):
        aux = i >= n_data
        ts = [np.zeros(NUMEL) if aux else rng.standard_normal(NUMEL)]
        hub = min(set(range(n)) - set(client))
        boot = [f"sim://peer{hub}"] if i != hub else []
        peers.append(cl.add_peer(cfg, tensors=ts, initial_peers=boot, auxiliary=aux, client=i in client))
    cl.run(until=1.0)
    before = np.stack([p.tensors[0].copy() for p in peers])
    weights = rng.uniform(0.5, 2.0, n)
    evs = [p.step_tensors(weight=float(w), gather=gather, timeout=5.0) for p, w in zip(peers, weights)]
    cl.run(until=cl.env.all_of(evs))
    return peers, before, weights, [e.value for e in evs]


@pytest.mark.parametrize("n_data,n_aux", [(3, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("gather", [None, {"k": 1}])
def test_auxiliary_peers_reduce_but_bring_no_data(n_data, n_aux, gather):
    peers, before, weights, acts = _run(n_data, n_aux, gather=gather)
    w = weights[:n_data]
    mean = (before[:n_data] * w[:, None]).sum(axis=0) / w.sum()
    aux_ids = tuple(sorted(p.peer_id for p in peers[n_data:]))
    for i, (p, act) in enumerate(zip(peers, acts)):
        assert isinstance(act, StepDone), act
        res = act.result
        assert tuple(sorted(res.auxiliary)) == aux_ids and not res.lost
        assert set(res.contributors) == {q.peer_id for q in peers[:n_data]}
        if i < n_data:
            assert res.complete
            np.testing.assert_allclose(p.tensors[0], mean, rtol=0, atol=1e-12)
        else:
            assert np.array_equal(p.tensors[0], before[i]) and res.updated == []
            mine = [s for s in res.spans if s.owner == p.peer_id][0]
            assert mine.parts > 0 and mine.averaged == mine.parts  # it reduced its span for the others


def test_one_data_peer_with_an_auxiliary_keeps_its_tensor():
    """Nobody to average with: the data peer gets PeerLost (tensors untouched), as with any group
    where no other member's data arrived; the auxiliary peer's step ends normally."""
    peers, before, _, acts = _run(1, 1)
    for p, b in zip(peers, before):
        assert np.array_equal(p.tensors[0], b)
    assert isinstance(acts[0], StepFailed) and isinstance(acts[0].error, zgossip.PeerLost)
    assert isinstance(acts[1], StepDone) and acts[1].result.auxiliary == (peers[1].peer_id,)


def test_clients_average_through_an_auxiliary():
    peers, before, weights, acts = _run(2, 1, client=(0, 1))  # only the auxiliary peer reduces
    w = weights[:2]
    mean = (before[:2] * w[:, None]).sum(axis=0) / w.sum()
    for p, act in zip(peers[:2], acts):
        assert isinstance(act, StepDone), act
        np.testing.assert_allclose(p.tensors[0], mean, rtol=0, atol=1e-12)
