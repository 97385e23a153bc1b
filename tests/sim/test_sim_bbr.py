"""BBR v1's path model (sim.bbr): the windowed bandwidth filter and what it does to a connection."""
from __future__ import annotations

import numpy as np
import simpy

from sim import NetworkModel
from sim.bbr import PROBE_BW, Bbr, WindowedMax
from sim.network import SlowLink
from sim.tcp import TcpTransport

MB = 1_000_000
MSS = 1448


def test_windowed_max_forgets_a_maximum_older_than_its_window_once_given_a_value():
    f = WindowedMax(10)
    f.update(0, 100.0)
    for t in range(1, 11):
        assert f.update(t, 5.0) == 100.0  # 10 rounds old: still in the window
    assert f.get() == 100.0  # no new value, no change, however old
    assert f.update(11, 5.0) == 5.0  # 11 rounds old: gone, the best of the window takes over
    assert f.update(12, 50.0) == 50.0 and f.update(13, 7.0) == 50.0  # a new maximum stands at once


def _bbr(rtt=0.3):
    return Bbr(rtt, MSS, 10 * MSS, 2.885, np.random.default_rng(0))


def _stream(b: Bbr, t0: float, t1: float, rate: float, step: float = 0.01) -> float:
    """Send at `rate` from t0 to t1 in `step` chunks, taking ACKs as they fall due."""
    t = t0
    while t < t1 - 1e-9:
        b.pacing_rate(t)
        b.on_sent(t, t + step, rate * step)
        t += step
    return t


def test_a_low_retransmission_sample_becomes_the_estimate_once_the_high_ones_aged_out():
    # the lat150-loss stalls: a connection that carried a stream (estimate ~1 MB/s, PROBE_BW), then
    # only short app-limited messages for more than 10 round trips (they advance the rounds but cannot
    # lower the estimate), then loses the last segment of a burst: the retransmission's sample (one
    # segment in a round trip, not app-limited) is all the window holds, and BBR paces at it
    b = _bbr()
    b.on_write(0.0, 0.0)
    _stream(b, 0.0, 4.0, 1e6)
    b.pacing_rate(5.0)
    assert b.mode == PROBE_BW and b.bw.get() > 0.9e6
    high = b.bw.get()
    t = 5.0
    for _ in range(14):  # a control message per second: each one a round, each sample app-limited
        b.on_write(t, t)
        b.on_sent(t, t + 0.001, 300)
        t += 1.0
        b.pacing_rate(t)
    assert b.rtt_cnt >= 14 + 10 and b.bw.get() == high  # app-limited samples did not lower it
    b.on_write(t, t)
    b.on_sent(t, t + 0.05, 50_000, lost=MSS, retransmit_leaves=t + 0.05 + 0.3)  # tail loss
    b.pacing_rate(t + 1.0)
    assert b.bw.get() < 0.02 * high  # ~1 segment per RTT: ~5 KB/s
    assert b.pacing_rate(t + 1.0) < 1.25 * b.bw.get()


def _transport_with(slow: list[SlowLink]):
    net = NetworkModel(latency=0.02, bandwidth=12.5e6, transfer="tcp", tcp={"congestion_control": "bbr"},
                       slow_links=slow)
    env = simpy.Environment()
    got: list = []
    tr = TcpTransport(net, net.tcp, env, np.random.default_rng(0), lambda tok, sent: got.append((tok, env.now)))
    return env, tr, got


def _send_at(env, tr, t, nbytes, tok):
    env.timeout(t).callbacks.append(lambda _e: tr.send("a", "b", 0, nbytes, tok))


def test_bbr_follows_a_link_that_slowed_down_and_then_probes_back_up_slowly():
    # 100 Mbit/s, 40 ms RTT; a's link runs 100x slower from 2 s to 6 s while a transfer fills it: after
    # 10 round trips of samples at the slow rate, BBR's estimate is the slow rate (a max-ever estimate
    # kept 100 Mbit/s), and once the link is fast again it grows only by the probe gain, 1.25 per
    # 8-RTT gain cycle: 2 MB take seconds, not the ~0.2 s they take on a path that never slowed
    def after(slow):
        env, tr, got = _transport_with(slow)
        _send_at(env, tr, 0.0, 4 * MB, "warm")
        _send_at(env, tr, 2.0, MB // 2, "slow")
        _send_at(env, tr, 7.0, 2 * MB, "after")
        env.run()
        return dict(got)["after"] - 7.0, tr.conns[("a", "b", 0)].bbr

    quick, _ = after([])
    slowed, b = after([SlowLink(2.0, 6.0, "a", 100.0)])
    assert quick < 0.3
    assert slowed > 5 * quick
    assert b.mode == PROBE_BW


def test_app_limited_messages_do_not_lower_the_estimate():
    # a trickle of small messages after a transfer: 30 s of them, far more than 10 round trips, all
    # app-limited; the next 2 MB still go at the link's rate
    env, tr, got = _transport_with([])
    _send_at(env, tr, 0.0, 4 * MB, "warm")
    for k in range(60):
        _send_at(env, tr, 1.0 + 0.5 * k, 400, k)
    _send_at(env, tr, 32.0, 2 * MB, "after")
    env.run()
    b = tr.conns[("a", "b", 0)].bbr
    assert b.rtt_cnt > 60
    assert dict(got)["after"] - 32.0 < 0.3
