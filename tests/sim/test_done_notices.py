"""DONE notices (what lets `shutdown()` stop only once groupmates need nothing more from it) go only to
the members that may still owe the sender data: the span owners and the substitutes it asked to
rescue a span. Every debt a member records is cleared by a DONE from the member it is owed to."""
from __future__ import annotations

import numpy as np

from sim import NetworkModel, SimCluster
from zgossip import wire
from zgossip.node import NodeConfig, StepDone

N = 4


def _cluster(numel: int, seed: int = 0):
    cl = SimCluster(seed=seed, network=NetworkModel(latency=0.001, bandwidth=2e6))
    cfg = NodeConfig(prefix="dn", target_group_size=N, min_group_size=2, part_timeout=0.5, gossip_interval=0.05,
                     peer_timeout=3.0, matchmaking_time=0.3, request_timeout=0.2)
    rng = np.random.default_rng(seed)
    peers = []
    for _ in range(N):
        peers.append(cl.add_peer(cfg, tensors=[rng.standard_normal(numel)], known=peers))
    dones: list[tuple[str, str]] = []  # (sender endpoint, receiver endpoint) of every DONE sent
    transmit = cl._transmit

    def spy(src, endpoint, msg):
        if msg.type is wire.MsgType.DONE:
            dones.append((src.endpoint, endpoint))
        transmit(src, endpoint, msg)

    cl._transmit = spy
    return cl, peers, dones


def _owners(peer) -> set[str]:
    rnd = peer.node.step.round
    return {m.endpoint for i, m in enumerate(rnd.members) if rnd.plan.num_parts(i) > 0}


def _start_round(cl, peers):
    evs = [p.step_tensors() for p in peers]
    while not all(p.node.step is not None and p.node.step.round is not None for p in peers):
        cl.run(until=cl.env.now + 0.0005)
        assert cl.env.now < 5
    return evs


def test_done_goes_to_span_owners_only_and_clears_what_they_are_owed():
    cl, peers, dones = _cluster(numel=1)  # one element: one member owns the only span
    evs = _start_round(cl, peers)
    owners = _owners(peers[0])
    assert len(owners) == 1
    cl.run(until=cl.env.all_of(evs))
    assert all(isinstance(e.value, StepDone) and e.value.result.complete for e in evs)
    cl.run(until=cl.env.now + 0.1)  # the notices arrive
    assert sorted(dones) == sorted((p.endpoint, o) for p in peers for o in owners if o != p.endpoint)
    assert not any(p.node.owes_others() for p in peers)  # the owner's debts were all confirmed
    # with every member owning a span, every member tells every other (the former behaviour)
    cl, peers, dones = _cluster(numel=4096)
    evs = _start_round(cl, peers)
    assert len(_owners(peers[0])) == N
    cl.run(until=cl.env.all_of(evs))
    cl.run(until=cl.env.now + 0.1)
    assert len(dones) == N * (N - 1)
    assert not any(p.node.owes_others() for p in peers)


def test_a_substitute_without_a_span_is_told_done_by_those_it_rescued_for():
    cl, peers, dones = _cluster(numel=1)
    evs = _start_round(cl, peers)
    (owner,) = _owners(peers[0])
    victim = next(p for p in peers if p.endpoint == owner)
    rounds = {p.endpoint: p.node.step.round for p in peers}
    victim.crash()  # before any result left: the survivors re-reduce its span at a substitute
    survivors = [p for p in peers if p is not victim]
    cl.run(until=cl.env.all_of([evs[peers.index(p)] for p in survivors]))
    for p in survivors:
        res = evs[peers.index(p)].value.result
        assert res.spans[res.members.index(victim.peer_id)].rescued == 1
    subs = {r.members[s].endpoint for ep, r in rounds.items() if ep != owner for s in r.rescue_target.values()}
    assert len(subs) == 1 and owner not in subs
    (sub,) = subs
    sub_round = rounds[sub]
    assert sub_round.plan.num_parts(sub_round.rank) == 0 and sub_round.rescues
    owed_by_sub = {sub_round.members[j].endpoint for j in sub_round.i_owe()}
    assert owed_by_sub == {p.endpoint for p in survivors} - {sub}  # it sent them the rescued span's result
    cl.run(until=cl.env.now + 0.1)
    assert {s for s, d in dones if d == sub} == owed_by_sub  # ... and each of them said DONE
    assert {d for _s, d in dones} <= {owner, sub}  # nobody else was told
    assert not any(p.node.owes_others() for p in survivors)
