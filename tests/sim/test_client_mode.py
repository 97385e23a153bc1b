"""Client mode in the simulator: a peer that accepts no connection still averages, with the
very protocol code a real client runs (sim.driver models the ROUTER reply routes)."""
import numpy as np
import pytest

from sim import NetworkModel, SimCluster
from zgossip.messages import Leave
from zgossip.node import NodeConfig, StepDone

NUMEL = 4096


def _run(clients, seed=0, n=4, gather=None):
    cl = SimCluster(seed=seed, network=NetworkModel(latency=0.002, bandwidth=5e6))
    cfg = NodeConfig(prefix="c", target_group_size=n, min_group_size=n, part_size_bytes=4096, part_timeout=0.5,
                     gossip_interval=0.05, peer_timeout=3.0, matchmaking_time=0.3, request_timeout=0.2)
    rng = np.random.default_rng(seed)
    peers = []
    for i in range(n):
        ts = [rng.standard_normal(NUMEL)]
        boot = [peers[0].endpoint] if peers else []
        peers.append(cl.add_peer(cfg, tensors=ts, initial_peers=boot, client=i in clients))
    cl.run(until=1.0)
    before = np.stack([p.tensors[0].copy() for p in peers])
    evs = [p.step_tensors(weight=1.0, gather=gather, timeout=5.0) for p in peers]
    cl.run(until=cl.env.all_of(evs))
    return cl, peers, before, [e.value for e in evs]


@pytest.mark.parametrize("clients", [(3,), (1, 3)])
@pytest.mark.parametrize("gather", [None, {"x": 1}])
def test_clients_average_over_connections_they_opened(clients, gather):
    cl, peers, before, acts = _run(clients, gather=gather)
    mean = before.mean(axis=0)
    for p, act in zip(peers, acts):
        assert isinstance(act, StepDone), act
        assert len(act.result.members) == 4 and len(act.result.contributors) == 4 and not act.result.lost
        np.testing.assert_allclose(p.tensors[0], mean, rtol=0, atol=1e-12)
    for i in clients:  # nobody lists a client in its table, and a client hosts no rendezvous
        assert all(peers[i].peer_id not in p.node.membership.peers for p in peers)
        assert peers[i].endpoint.startswith("client://")
    assert cl.unreachable == 0  # clients never try to reach each other


def test_what_waits_for_a_client_that_never_connects_expires_as_in_the_zeromq_driver():
    """The simulator keeps the ZeroMQ driver's rule (`endpoints.CLIENT_BACKLOG_TTL`): messages for a
    client that opened no connection are dropped after that long, counted in `unreachable`."""
    from zgossip.endpoints import CLIENT_BACKLOG_TTL
    from zgossip.messages import Done

    cl = SimCluster(seed=0, network=NetworkModel(latency=0.002, bandwidth=5e6))
    cfg = NodeConfig(prefix="c", target_group_size=2, min_group_size=2)
    server = cl.add_peer(cfg, tensors=[np.zeros(4)])
    client = cl.add_peer(cfg, tensors=[np.zeros(4)], client=True, initial_peers=[])
    cl.run(until=0.5)
    msg = lambda k: Done(server.peer_id, server.endpoint, group_id="%016x" % k)  # noqa: E731
    cl._transmit(server, client.endpoint, msg(0))
    cl._transmit(server, client.endpoint, msg(1))
    assert len(cl._backlog[(server.endpoint, client.endpoint)]) == 2
    cl.run(until=cl.env.now + CLIENT_BACKLOG_TTL + 1.0)
    before = cl.unreachable
    cl._transmit(server, client.endpoint, msg(2))  # the two old ones expire as a new one is queued
    assert [m.group_id for _, m in cl._backlog[(server.endpoint, client.endpoint)]] == ["%016x" % 2]
    assert cl.unreachable - before == 2


def test_a_client_that_said_goodbye_is_not_waited_for():
    """Two peers and a client, target 16: the small swarm closes its pool once all three joined. After
    the client's clean goodbye, the rendezvous peer still counted it as coming (it had spoken within
    peer_timeout), so every step of the other two waited out the whole matchmaking window (2.02 s
    instead of 0.02 s) for peer_timeout -- as a listening peer's goodbye does not make them wait."""
    cl = SimCluster(seed=2, network=NetworkModel(latency=0.005, bandwidth=1e8))
    cfg = NodeConfig(prefix="cb", target_group_size=16, min_group_size=2, matchmaking_time=2.0, request_timeout=0.3,
                     gossip_interval=0.2, peer_timeout=4.0)
    a = cl.add_peer(cfg, tensors=[np.zeros(4)])
    b = cl.add_peer(cfg, tensors=[np.ones(4)], initial_peers=[a.endpoint])
    c = cl.add_peer(cfg, tensors=[np.ones(4)], initial_peers=[a.endpoint], client=True)
    cl.run(until=2.0)
    evs = [p.step_tensors(timeout=5.0) for p in (a, b, c)]
    cl.run(until=cl.env.all_of(evs))
    assert all(isinstance(e.value, StepDone) for e in evs)
    cl.run(until=c.shutdown())
    cl.run(until=cl.env.now + 0.3)
    late = Leave(c.peer_id, c.endpoint, key="k", step_id="late")  # a late message of it, on another lane
    for p in (a, b):
        p.node.on_message(late, cl.env.now)
    assert c.peer_id not in a.node._clients and c.peer_id not in b.node._clients
    t0 = cl.env.now
    evs = [p.step_tensors(timeout=5.0) for p in (a, b)]
    cl.run(until=cl.env.all_of(evs))
    assert all(isinstance(e.value, StepDone) for e in evs)
    assert cl.env.now - t0 < 0.5 * cfg.matchmaking_time
