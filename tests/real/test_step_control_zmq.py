"""Step control on real sockets (loopback): scheduled and triggered steps, cancel at each stage,
and cancel racing the trigger from two threads. The same logic in virtual time, at every stage,
is in tests/sim/test_step_control.py."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import zgossip
from harness import FAST
from zgossip import PeerLost, StepStage


@pytest.fixture
def trio():
    avgs = []
    try:
        for i in range(3):
            avgs.append(zgossip.Averager([np.full(16, float(i), np.float32)], prefix="ctl", target_group_size=3,
                                         initial_peers=[avgs[0].endpoint] if avgs else [], seed=10 + i,
                                         **{**FAST, "part_timeout": 5.0}))
        deadline = time.monotonic() + 10
        while not all(len(a.peers()) == 2 for a in avgs):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield avgs
    finally:
        for a in avgs:
            a.shutdown(1.0)


def _until(ctl, stage, limit=5.0):
    end = time.monotonic() + limit
    while ctl.stage is not stage:
        assert time.monotonic() < end, ctl.stage
        time.sleep(0.005)


def test_scheduled_steps_start_at_the_scheduled_time(trio):
    at = trio[0].clock.now() + 1.2
    ctls = [a.step(scheduled_time=at, wait=False) for a in trio]
    assert all(c.stage is StepStage.SCHEDULED for c in ctls)
    results = [c.result(10) for c in ctls]
    assert all(r.complete and len(r.members) == 3 for r in results)
    assert min(r.timings["awaiting_trigger"] for r in results) > 0
    for a in trio:
        with a.get_tensors() as (t,):
            np.testing.assert_allclose(t, 1.0)


def test_trigger_and_cancel_after_grouping(trio):
    ctls = [a.step(require_trigger=True, timeout=5.0, wait=False) for a in trio]
    for c in ctls:
        _until(c, StepStage.AWAITING_TRIGGER)
    assert ctls[2].cancel() is True  # after matchmaking, before the all-reduce
    t0 = time.monotonic()
    ctls[0].trigger()
    ctls[1].trigger()
    for c in ctls[:2]:
        r = c.result(10)
        assert trio[2].peer_id in r.lost and len(r.contributors) == 2
    assert time.monotonic() - t0 < 4.0  # told by ABORT, not timed out (that takes part_timeout, 5 s)
    for a in trio[:2]:
        with a.get_tensors() as (t,):
            np.testing.assert_allclose(t, 0.5)
    with trio[2].get_tensors() as (t,):
        np.testing.assert_array_equal(t, 2.0)
    assert ctls[0].cancel() is False
    ctls = [a.step(wait=False, timeout=5.0) for a in trio]  # every averager is free again
    assert all(c.result(10).complete for c in ctls)


def test_cancel_when_every_groupmate_left_fails_the_rest_fast():
    a = zgossip.Averager([np.zeros(8, np.float32)], prefix="duo", target_group_size=2, seed=1, **FAST)
    b = zgossip.Averager([np.ones(8, np.float32)], prefix="duo", target_group_size=2, seed=2,
                         initial_peers=[a.endpoint], **FAST)
    with a, b:
        deadline = time.monotonic() + 10
        while not (a.peers() and b.peers()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        ca, cb = a.step(require_trigger=True, wait=False), b.step(require_trigger=True, wait=False)
        _until(ca, StepStage.AWAITING_TRIGGER)
        _until(cb, StepStage.AWAITING_TRIGGER)
        assert cb.cancel() is True
        with pytest.raises(PeerLost):
            ca.result(3)
        with a.get_tensors() as (t,):
            np.testing.assert_array_equal(t, 0.0)


def test_cancel_racing_the_trigger_from_two_threads():
    """Many rounds of trigger() and cancel() at once from two threads: whichever reaches the I/O
    thread first wins; either the step is cancelled with the tensors untouched, or it completes."""
    a = zgossip.Averager([np.zeros(8, np.float32)], prefix="race", target_group_size=2, seed=1, **FAST)
    b = zgossip.Averager([np.zeros(8, np.float32)], prefix="race", target_group_size=2, seed=2,
                         initial_peers=[a.endpoint], **FAST)
    outcomes = []
    with a, b:
        deadline = time.monotonic() + 10
        while not (a.peers() and b.peers()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for k in range(6):
            with a.get_tensors() as (t,):
                t[:] = 2.0 * k
            with b.get_tensors() as (t,):
                t[:] = 2.0 * k + 2.0
            ca, cb = a.step(require_trigger=True, wait=False), b.step(require_trigger=True, wait=False)
            _until(ca, StepStage.AWAITING_TRIGGER)
            cb.trigger()
            go = threading.Barrier(2)
            said = []

            def cancel():
                go.wait(5)
                said.append(ca.cancel())

            th = threading.Thread(target=cancel)
            th.start()
            go.wait(5)
            ca.trigger()
            th.join(5)
            if said[0]:
                assert ca.cancelled()
                with a.get_tensors() as (t,):
                    np.testing.assert_array_equal(t, 2.0 * k)
                with pytest.raises(PeerLost):
                    cb.result(5)
            else:
                assert ca.result(5).complete and cb.result(5).complete
                with a.get_tensors() as (t,):
                    np.testing.assert_allclose(t, 2.0 * k + 1.0)
            outcomes.append(said[0])
    assert len(outcomes) == 6  # which side won varies; every outcome was clean
