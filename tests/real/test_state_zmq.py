"""State download through the real `Averager` on ZeroMQ loopback (the protocol cases run in
virtual time in tests/sim/test_state.py)."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

import zgossip
from harness import FAST


def _wait_for_donor(downloader: zgossip.Averager, donor: zgossip.Averager, timeout: float = 10.0) -> None:
    """Until ``downloader`` has heard ``donor`` declare that it shares state (bounded)."""
    deadline = time.monotonic() + timeout
    while donor.peer_id not in downloader._ask_node(lambda n: [r.peer_id for r in n.membership.donors()]):
        assert time.monotonic() < deadline, "the donor's sharing never reached the downloader"
        time.sleep(0.02)


def test_averager_load_state_from_peers_over_zmq():
    src = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones(5)]
    dst = [np.zeros((3, 4), np.float32), np.zeros(5)]
    with zgossip.Averager(src, prefix="st", **FAST) as a, \
            zgossip.Averager(dst, prefix="st", initial_peers=[a.endpoint], allow_state_sharing=False, **FAST) as b:
        _wait_for_donor(b, a)
        meta, arrays = b.load_state_from_peers(timeout=10)
        assert meta is None
        assert np.array_equal(dst[0], src[0]) and np.array_equal(dst[1], src[1])
        # b does not share: a download from b's side fails with a clear reason
        with pytest.raises(zgossip.StateUnavailable, match="share"):
            a.load_state_from_peers(timeout=3)


def test_shape_mismatch_names_the_tensor_and_writes_nothing():
    src = [np.ones(4, np.float32), np.ones((2, 2))]
    dst = [np.zeros(4, np.float32), np.zeros((2, 3))]
    with zgossip.Averager(src, prefix="st", **FAST) as a, \
            zgossip.Averager(dst, prefix="st", initial_peers=[a.endpoint], allow_state_sharing=False, **FAST) as b:
        _wait_for_donor(b, a)
        with pytest.raises(zgossip.ZGossipError, match=r"tensor 1: peer state has shape \(2, 2\)"):
            b.load_state_from_peers(timeout=10)
        assert not dst[0].any()  # nothing written, not even the tensor that matched


def test_shutdown_with_downloads_in_flight_fails_them_and_returns():
    """shutdown() raised RuntimeError (dictionary changed size during iteration) when a
    load_state_from_peers(wait=False) was in flight: failing its future ran the callback that
    removes it from the dict shutdown was walking, and the rest of the shutdown was skipped."""
    release = threading.Event()

    class SlowDonor(zgossip.Averager):
        def get_current_state(self):
            release.wait(5.0)  # the META answer waits: the downloads stay in flight
            return super().get_current_state()

    with SlowDonor([np.ones(4)], prefix="st", **FAST) as a:
        b = zgossip.Averager([np.zeros(4)], prefix="st", initial_peers=[a.endpoint], allow_state_sharing=False,
                             **FAST)
        try:
            _wait_for_donor(b, a)
            futs = [b.load_state_from_peers(timeout=10, wait=False) for _ in range(2)]
            b.shutdown(timeout=2.0)
            for f in futs:
                with pytest.raises(zgossip.AveragerClosed, match="state download"):
                    f.result(2.0)
        finally:
            release.set()
            b.shutdown(timeout=2.0)


def test_state_chunks_larger_than_the_default_frame_limit_download_and_a_given_limit_is_warned_of(caplog):
    """state_chunk_bytes past the 64 MiB default frame limit: libzmq cut the connection at every chunk and
    each download failed as "stalled with 1 chunks owed". The default limit now fits the chunks, and a
    max_message_bytes given below them is warned of at construction."""
    with caplog.at_level(logging.WARNING, logger="zgossip.averager"):
        zgossip.Averager([np.zeros(4)], prefix="st", state_chunk_bytes=80 << 20, max_message_bytes=64 << 20,
                         **FAST).shutdown()
    assert any("state_chunk_bytes (83886080) exceeds max_message_bytes" in r.getMessage() for r in caplog.records)
    src = [np.arange(66 << 17, dtype=np.float64)]  # 66 MiB: one chunk of 80 MiB carries it whole
    dst = [np.zeros(66 << 17)]
    with zgossip.Averager(src, prefix="st", state_chunk_bytes=80 << 20, **FAST) as a, \
            zgossip.Averager(dst, prefix="st", initial_peers=[a.endpoint], allow_state_sharing=False,
                             state_chunk_bytes=80 << 20, **FAST) as b:
        _wait_for_donor(b, a)
        b.load_state_from_peers(timeout=20, chunk_timeout=5)
        assert np.array_equal(dst[0], src[0]) and b.stats["connections_cut"] == 0


def test_a_liar_serving_the_swarms_tensors_under_forged_metadata_is_outvoted_over_zmq():
    """Any peer holds the swarm's tensors, so it can serve them -- the same root -- under metadata of its
    making (an epoch, a learning rate). The downloader took the metadata of the first donor to answer:
    the liar here, which answers from a published snapshot while the honest donors still copy theirs."""
    honest, forged = {"epoch": 5, "lr": 0.1}, {"epoch": 999, "lr": 1e9}
    release = threading.Event()

    class Donor(zgossip.Averager):
        def __init__(self, *args, meta, **kw):
            self.meta = meta
            super().__init__(*args, **kw)

        def get_current_state(self):
            if self.meta is honest:
                release.wait(5.0)  # until the liar's answer was adopted
            return self.meta, super().get_current_state()[1]

    state = np.arange(4096, dtype=np.float32)
    peers: list = []
    try:
        peers.append(Donor([state.copy()], prefix="mv", meta=forged, state_chunk_bytes=4096, **FAST))
        peers += [Donor([state.copy()], prefix="mv", meta=honest, initial_peers=[peers[0].endpoint],
                        state_chunk_bytes=4096, **FAST) for _ in range(2)]
        peers[0].publish_state(1)
        new = zgossip.Averager([np.zeros(4096, np.float32)], prefix="mv", initial_peers=[peers[0].endpoint],
                               allow_state_sharing=False, state_chunk_bytes=4096, **FAST)
        peers.append(new)
        for donor in peers[:3]:
            _wait_for_donor(new, donor)
        fut = new.load_state_from_peers(timeout=10, wait=False)
        deadline = time.monotonic() + 5.0
        while not fut.done() and not any(new._ask_node(lambda n: [d.root for d in n.downloads.values()])):
            assert time.monotonic() < deadline, "the liar's answer was never adopted"
            time.sleep(0.01)
        release.set()
        meta, arrays = fut.result(10.0)
        assert meta == honest and np.array_equal(arrays[0], state)
        assert new.stats["state_meta_outvoted"] == 1
    finally:
        release.set()
        for p in peers:
            p.shutdown(timeout=2.0)
