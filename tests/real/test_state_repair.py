"""State download and self-repair over real ZeroMQ on loopback: a parallel download survives a
donor process killed mid-transfer, and a peer whose state was corrupted on purpose repairs itself."""
from __future__ import annotations

import time

import numpy as np

import zgossip
from harness import FAST
from zgossip.bench_state import _Procs, bench_state, donor_main

CHUNK = 64 << 10
SIZE = 8 << 20  # 128 chunks


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_parallel_download_survives_a_donor_killed_mid_transfer():
    procs = _Procs()
    try:
        procs.start(donor_main, SIZE, CHUNK, [], 0)
        first = procs.recv(0, 30, "donor 0")
        procs.start(donor_main, SIZE, CHUNK, [first["endpoint"]], 0)
        # dies as soon as it has queued the chunks of its first request (one request covers a donor's
        # share here: a request asks for at least 16 MiB), most of them still unsent
        procs.start(donor_main, SIZE, CHUNK, [first["endpoint"]], 1)
        ups = [first, procs.recv(1, 30, "donor 1"), procs.recv(2, 30, "donor 2")]
        with zgossip.Averager([np.zeros(SIZE // 8)], prefix="bench-state", initial_peers=[first["endpoint"]],
                              allow_state_sharing=False, state_chunk_bytes=CHUNK, local_ipc=False, **FAST) as av:
            _wait(lambda: av._ask_node(lambda node: len(node.membership.donors())) == 3, 10, "three donors")
            meta, arrays = av.load_state_from_peers(timeout=20, chunk_timeout=1.0, donors=3)
            dying = procs.recv(2, 5, "the victim's last words")
            assert dying["event"] == "dying"
            procs.procs[2].join(5)
            assert not procs.procs[2].is_alive()  # really killed mid-transfer
            with av.get_tensors() as (t,):
                assert np.array_equal(t, bench_state(SIZE)) and np.array_equal(arrays[0], t)
            st = av.stats
            assert st["state_refetched"] > 0 and st["state_bad_chunks"] == 0  # its chunks came from the others
            assert {u["root"] for u in ups} == {ups[0]["root"]}
    finally:
        procs.close()


def test_a_corrupted_peer_repairs_itself_over_zeromq():
    rng = np.random.default_rng(3)
    state = [rng.standard_normal((256, 64)).astype(np.float32), rng.standard_normal(10)]
    tensors = [[a.copy() for a in state] for _ in range(3)]
    avs: list = []
    try:
        for i in range(3):
            avs.append(zgossip.Averager(tensors[i], prefix="rp", initial_peers=[a.endpoint for a in avs[:1]],
                                        state_chunk_bytes=16 << 10, **FAST))
        _wait(lambda: all(len(a.peers()) == 2 for a in avs), 10, "membership")
        for a in avs:
            a.publish_state(4)
        with avs[1].get_tensors() as ts:
            ts[0][17, 3] = 1e6  # a bit flip's worth of damage
        bad = avs[1].publish_state(4)
        assert bad != avs[0].state_verdict().mine
        _wait(lambda: avs[1].stats["repairs"] == 1, 10, "the repair")
        _wait(lambda: avs[1].state_verdict().action == "agree", 5, "agreement")
        with avs[1].get_tensors() as ts:
            for got, want in zip(ts, state):
                assert np.array_equal(got, want)
        assert avs[0].stats["repairs"] == avs[2].stats["repairs"] == 0
    finally:
        for a in avs:
            a.shutdown(timeout=2.0)


def test_a_donor_serves_its_published_snapshot_while_its_tensors_are_locked():
    state = [np.arange(50000, dtype=np.float32)]
    with zgossip.Averager([state[0].copy()], prefix="snap", state_chunk_bytes=16 << 10, **FAST) as a, \
            zgossip.Averager([np.zeros(50000, np.float32)], prefix="snap", initial_peers=[a.endpoint],
                             allow_state_sharing=False, **FAST) as b:
        _wait(lambda: a.peers() and b._ask_node(lambda node: len(node.membership.donors())) == 1, 10, "membership")
        a.publish_state(1)
        with a.get_tensors() as ts:  # the tensor lock held, as while a round's result is written back
            ts[0][:] = 99.0  # changed since the publish: downloaders get the published version
            meta, arrays = b.load_state_from_peers(timeout=5, chunk_timeout=1.0, apply=False)
        assert np.array_equal(arrays[0], state[0])
