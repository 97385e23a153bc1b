"""bandwidth="auto" and adaptive deadlines on real ZeroMQ sockets (loopback, in one process): each
peer measures its download rate from its rounds' transfers, the estimates reach every peer by
gossip, the average stays exact, and the step result reports the deadlines it used."""
from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np

import zgossip
from harness import FAST
from zgossip.linkstats import valid_rate

N = 3
NUMEL = 1 << 23  # 32 MiB of float32 per peer: even on a fast idle machine a round lasts longer than
# linkstats.min_window_s (50 ms), so it yields a sample (8 MiB rounds were too short when the machine was idle)


def test_auto_bandwidth_is_measured_gossiped_and_averages_exactly():
    rng = np.random.default_rng(5)
    data = [rng.standard_normal(NUMEL).astype(np.float32) for _ in range(N)]
    avgs: list[zgossip.Averager] = []
    try:
        for i in range(N):
            avgs.append(zgossip.Averager(
                [data[i]], prefix="auto", target_group_size=N, seed=40 + i, bandwidth="auto",
                part_size_bytes=256 << 10, initial_peers=[avgs[0].endpoint] if avgs else [],
                **{**FAST, "part_timeout": 5.0, "matchmaking_time": 2.0}))
        deadline = time.monotonic() + 15
        while not all(len(a.peers()) == N - 1 for a in avgs):
            assert time.monotonic() < deadline, "membership did not converge"
            time.sleep(0.02)
        ids = {a.peer_id for a in avgs}
        results = []
        for r in range(4):
            snaps = [np.array(d, dtype=np.float64) for d in data]
            with cf.ThreadPoolExecutor(N) as ex:
                futs = [ex.submit(a.step, timeout=10.0) for a in avgs]
                results.append([f.result(40) for f in futs])
            for res in results[-1]:
                assert res.complete and not res.lost and len(res.members) == N, r
                d = res.deadlines
                assert set(d) == {"part", "part_min", "result", "allreduce"}, d
                assert 0 < d["part_min"] <= d["part"] and d["result"] >= d["part"], d
                assert d["part"] <= d["allreduce"] <= 60.0 + 1e-9, d
            mean = sum(snaps) / N
            for d_ in data:  # every member holds the same bits, the mean of what they had
                np.testing.assert_allclose(d_, mean, rtol=1e-5, atol=1e-6)
                assert np.array_equal(d_, data[0])
            time.sleep(3 * FAST["gossip_interval"])  # the new estimates gossip
        # every peer measured a rate, and every peer knows every peer's (its own and the gossiped ones)
        deadline = time.monotonic() + 5
        while True:
            ests = [a.bandwidth_estimates() for a in avgs]
            if all(set(e) == ids for e in ests) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for e in ests:
            assert set(e) == ids, ests
            assert all(valid_rate(v) for v in e.values()), ests
        for a, e in zip(avgs, ests):  # its own reading, by direction: what it gossips is the lower one
            mine = a.link_rates()
            assert valid_rate(mine["download"]) and mine["estimate"] == min(
                x for x in (mine["download"], mine["upload"]) if x is not None), mine
        # after the first rounds groupmates' pace on loopback is known: the silence limit for a
        # member owing data drops below part_timeout (5 s) -- a stalled one is given up sooner
        assert min(res.deadlines["part_min"] for res in results[-1]) < 5.0, [r.deadlines for r in results[-1]]
        assert all(a.stats["invalid"] == 0 for a in avgs)
    finally:
        for a in avgs:
            a.shutdown()
