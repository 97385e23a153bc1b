"""Under churn with lives shorter than `peer_timeout`, live nodes must not fill up with the dead.

A node that joined after a peer died has no tombstone for it. When it relayed every record it
held, a dead peer's last digest entry became fresh news at every node that heard it (its
`updated` set to "now"), for another `peer_timeout` each time, so dead records went round for
ever: in this scenario (peers live 2 s on average, peer_timeout 5 s) a live node held ~110 dead
records against ~10 live ones it knew. Records are now relayed only once seen alive here
(`zgossip.membership.PeerRecord.heard`).
"""
from __future__ import annotations

import statistics

from sim.scenario import Scenario, ScenarioRun

CHURN = {"seed": 1, "peers": 16, "numel": 2, "rounds": 16, "grid": [], "round_gap": 0.5, "bootstrap_time": 0.5,
         "step_timeout": 1.0, "protocol": {"target_group_size": 4},
         "churn": {"arrival_rate": 8.0, "departure_rate": 0.5}}


def test_dead_records_stay_bounded_by_the_deaths_of_one_peer_timeout():
    run = ScenarioRun(Scenario.from_dict(CHURN))
    samples: list[tuple[int, int, int]] = []  # (live peers, live ones a node knows, dead ones it holds)

    def sample(_e=None) -> None:
        live = [p for p in run.slots if p.alive]
        ids = {p.peer_id for p in live}
        if run.env.now > 4.0:  # past the start: the swarm has turned over
            for p in live:
                held = p.node.membership.peers
                dead = sum(1 for pid in held if pid not in ids)
                samples.append((len(live), len(held) - dead, dead))
        run.env.timeout(0.5).callbacks.append(sample)

    sample()
    try:
        run.run()
    finally:
        run.close()
    assert len(samples) > 200
    live = statistics.mean(s[0] for s in samples)
    dead = statistics.mean(s[2] for s in samples)
    peer_timeout = run.slots[0].node.config.peer_timeout if run.slots[0].alive else 5.0
    # peers that died within one peer_timeout: what a node may rightly still count (it cannot know yet)
    deaths = CHURN["churn"]["departure_rate"] * live * peer_timeout
    assert dead < deaths, f"a live node holds {dead:.0f} dead records on average; {deaths:.0f} died per peer_timeout"
    assert statistics.mean(s[1] for s in samples) > 0.3 * live  # and it still knows the living
