"""Halves of a swarm cut apart for longer than `peer_timeout` meet again when the cut heals.

Each half forgets the other after `peer_timeout`. Before, only `initial_peers` were knocked at
afterwards, so halves with no live initial peer across the cut (here: everyone bootstrapped from
peer 0, which has crashed) stayed apart for good, averaging in two separate swarms. A node now
also knocks now and then at the endpoints of peers it forgot for silence
(`zgossip.membership.REJOIN_FOR`).
"""
from __future__ import annotations

from sim.scenario import Scenario, ScenarioRun

HEAL = 10.0


def scenario(cut_end: float) -> dict:
    return {"seed": 3, "peers": 7, "numel": 2, "rounds": 1, "grid": [], "round_gap": 0.0, "bootstrap_time": 2.0,
            "step_timeout": 1.0, "protocol": {"target_group_size": 3, "gossip_interval": 0.5, "peer_timeout": 3.0},
            "faults": [{"kind": "crash", "peer": 0, "at": 2.5},
                       {"kind": "partition", "sides": [[1, 2, 3], [4, 5, 6]], "start": 3.0, "end": cut_end}]}


def views(run: ScenarioRun) -> dict[int, set[int]]:
    index = {p.peer_id: i for i, p in enumerate(run.slots)}
    return {i: {index[pid] for pid in p.node.membership.peers if pid in index}
            for i, p in enumerate(run.slots) if p.alive}


def test_halves_cut_apart_past_peer_timeout_meet_again_without_an_initial_peer():
    cut_end = 12.0  # 9 s of cut, 3x peer_timeout: each half forgets the other
    run = ScenarioRun(Scenario.from_dict(scenario(cut_end)))
    seen: dict[float, dict[int, set[int]]] = {}
    try:
        for t in (cut_end - 0.1, cut_end + HEAL):
            run.cluster.run(until=t)
            seen[t] = views(run)
    finally:
        run.close()
    during, after = seen[cut_end - 0.1], seen[cut_end + HEAL]
    assert during[1] == {2, 3} and during[4] == {5, 6}  # apart: each half forgot the other (and peer 0)
    everyone = {1, 2, 3, 4, 5, 6}
    for i, known in after.items():
        assert known == everyone - {i}, f"peer {i} knows {sorted(known)} {HEAL:.0f} s after the cut healed"
