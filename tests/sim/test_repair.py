"""Self-repair in virtual time: a peer whose state was corrupted on purpose is outvoted on its
gossiped (version, hash) and downloads the majority's state; ties and lying peers repair nobody."""
from __future__ import annotations

import numpy as np

from sim import NetworkModel, SimCluster
from zgossip.node import NodeConfig
from zgossip.state import StateSnapshot

CFG = dict(prefix="rp", gossip_interval=0.05, peer_timeout=3.0, part_size_bytes=4096, state_chunk_bytes=256)  # 68 chunks


def _swarm(n, seed=0, configs=None):
    cl = SimCluster(seed=seed, network=NetworkModel(latency=0.001))
    rng = np.random.default_rng(seed)
    state = [rng.standard_normal((64, 33)), rng.standard_normal(100).astype(np.float32)]
    peers = []
    for i in range(n):
        cfg = NodeConfig(**{**CFG, **((configs or {}).get(i, {}))})
        p = cl.add_peer(cfg, tensors=[a.copy() for a in state], known=peers)
        p.node.set_state_sharing(0.0)
        peers.append(p)
    cl.run(until=cl.env.now + 0.5)  # everyone knows everyone
    return cl, peers, state


def _corrupt(p):
    p.tensors[0][5, 7] += 1e-3  # one value off: another hash


def test_a_corrupted_peer_is_outvoted_and_repairs_itself_from_the_majority():
    cl, peers, state = _swarm(4)
    for p in peers:
        p.averager.publish_state(1)
    _corrupt(peers[2])
    bad_root = peers[2].averager.publish_state(1)
    assert bad_root != peers[0].node.state_mark[1]
    cl.run(until=cl.env.now + 2.0)
    for a, b in zip(peers[2].tensors, state):
        assert np.array_equal(a, b)
    assert peers[2].node.stats["repairs"] == 1 and peers[2].node.state_mark == peers[0].node.state_mark
    assert all(p.node.stats["repairs"] == 0 for p in peers[:2] + peers[3:])
    assert {p.averager.state_verdict().action for p in peers} == {"agree"}
    # the chunks came from several majority donors, and the corrupted peer never served as one
    assert sum(p.node.donor.chunks_served > 0 for p in peers) >= 2 and peers[2].node.donor.chunks_served == 0


def test_a_tie_repairs_nobody_and_a_new_version_is_not_outvoted_by_peers_still_at_the_old():
    cl, peers, state = _swarm(2)
    for p in peers:
        p.averager.publish_state(1)
    _corrupt(peers[1])
    peers[1].averager.publish_state(1)
    cl.run(until=cl.env.now + 1.0)
    assert peers[1].averager.state_verdict().action == "split"
    assert peers[1].tensors[0][5, 7] != state[0][5, 7] and peers[1].node.stats["repairs"] == 0
    peers[0].averager.publish_state(2)  # "mid-step": peer 1 still at version 1
    cl.run(until=cl.env.now + 1.0)
    assert peers[0].averager.state_verdict().action == "alone" and peers[0].node.stats["repairs"] == 0


def test_a_minority_of_liars_forces_no_repair_and_a_liar_serving_bad_chunks_is_caught():
    # peers 4 and 5 lie: they claim another hash and never repair themselves
    cl, peers, state = _swarm(7, configs={4: {"self_repair": False}, 5: {"self_repair": False}})
    for p in peers:
        p.averager.publish_state(1)
    good = peers[0].node.state_mark[1]
    for p in peers[4:6]:
        _corrupt(p)
        p.averager.publish_state(1)
    # peer 6 claims the honest hash but serves other bytes under it
    honest = peers[0].node.donor.published
    forged = StateSnapshot(honest.meta, tuple(a + 1 for a in honest.arrays), honest.specs, honest.chunk_bytes,
                           honest.plan, honest.hashes, honest.root)
    peers[6].node.publish_state(1, forged, cl.env.now)
    cl.run(until=cl.env.now + 1.0)
    assert all(p.node.stats["repairs"] == 0 for p in peers)  # 5 claims of the honest hash against 2 lies
    assert {peers[i].averager.state_verdict().action for i in (0, 1, 2, 3, 6)} == {"agree"}
    # now an honest peer gets corrupted: 4 of 7 still hold the honest hash (one of them lying about
    # its bytes): it repairs from them, and every chunk the forger serves fails its digest
    _corrupt(peers[1])
    peers[1].averager.publish_state(1)
    cl.run(until=cl.env.now + 3.0)
    assert peers[1].node.stats["repairs"] == 1 and peers[1].node.state_mark == (1, good)
    for a, b in zip(peers[1].tensors, state):
        assert np.array_equal(a, b)
    # all 4 holders of the honest hash were asked (state_donors=4), the forger too: its first chunk was refused
    assert peers[6].node.donor.chunks_served > 0 and peers[1].node.stats["state_bad_chunks"] == 1


def test_a_repair_the_owner_could_not_write_is_neither_counted_nor_announced():
    """The majority's state arrived but was not written (here writing fails; in the probe, a step had
    begun since): the peer must not count a repair, nor serve or gossip the majority's root as its
    own while its tensors still hold the corrupted values -- it counts a failure and votes again."""
    cl, peers, state = _swarm(3)
    for p in peers:
        p.averager.publish_state(1)
    _corrupt(peers[2])
    bad_root = peers[2].averager.publish_state(1)

    def refuse(meta, arrays):
        raise RuntimeError("cannot write now")

    peers[2].averager._write_state = refuse
    cl.run(until=cl.env.now + 2.0)
    node = peers[2].node
    assert node.stats["repairs"] == 0 and node.stats["repair_failures"] >= 1
    assert node.state_mark == (1, bad_root)  # still gossips the root of what it holds
    assert peers[2].tensors[0][5, 7] != state[0][5, 7]
    assert peers[2].averager.state_verdict().action == "repair"
