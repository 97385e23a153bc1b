"""The TCP transfer model (sim.tcp), lanes, disconnect notices and CPU time in the SimPy driver."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import simpy

from sim import NetworkModel, SimCluster
from sim.cpu import CpuCosts, CpuSpec, calibrate
from sim.network import Partition
from sim.scenario import run_scenario
from sim.tcp import TcpParams, TcpTransport
from zgossip.node import NodeConfig
from zgossip.wire import MsgType, lane_of, make_message, warm_lanes

ROOT = Path(__file__).resolve().parents[2]
MB = 1_000_000


def _transport(latency: float, bw: float, **tcp):
    """A bare transport between endpoints a and b; returns (env, transport, arrivals)."""
    net = NetworkModel(latency=latency, bandwidth=bw, transfer="tcp", tcp=tcp)
    env = simpy.Environment()
    got: list = []
    tr = TcpTransport(net, net.tcp, env, np.random.default_rng(0), lambda tok, sent: got.append((tok, env.now)))
    return env, tr, got


def _send_at(env, tr, t, nbytes, tok, src="a", dst="b", lane=0):
    ev = env.timeout(t)
    ev.callbacks.append(lambda _e: tr.send(src, dst, lane, nbytes, tok))


def test_slow_start_makes_the_first_transfer_on_a_long_rtt_connection_slow():
    rate, owd = 12.5e6, 0.05  # 100 Mbit/s, 100 ms RTT: BDP 1.25 MB
    env, tr, got = _transport(owd, rate)
    _send_at(env, tr, 0.0, 2 * MB, "first")
    env.run()
    first = got[0][1]
    ideal = 2 * MB / rate + owd
    assert first > 2.0 * ideal  # slow start: ~7 RTTs to reach the BDP from 10 segments
    # back to back (no idle): the window is open now, the same bytes take about bytes/rate
    _send_at(env, tr, 0.0, 2 * MB, "second")
    t0 = env.now
    env.run()
    assert got[1][1] - t0 == pytest.approx(ideal, rel=0.15)


def test_throughput_is_bound_by_the_window_over_the_rtt():
    # a 128 KiB receive buffer (window 64 KiB) on a 100 ms RTT path: ~655 KB/s whatever the link
    env, tr, got = _transport(0.05, 125e6, rmem_max=128 << 10)
    nbytes = 20 * MB
    _send_at(env, tr, 0.0, nbytes, "x")
    env.run()
    window = TcpParams(rmem_max=128 << 10).window_cap
    expect = nbytes / (window / 0.1)
    assert got[0][1] == pytest.approx(expect, rel=0.1)
    assert got[0][1] > 50 * (nbytes / 125e6)


def _two_transfers(gap: float, **tcp) -> float:
    env, tr, got = _transport(0.02, 12.5e6, **tcp)
    _send_at(env, tr, 0.0, 2 * MB, "warm")
    env.run()
    start = env.now + gap
    _send_at(env, tr, gap, 2 * MB, "again")
    env.run()
    return got[1][1] - start


def test_window_restarts_after_idle_longer_than_an_rto_except_under_bbr():
    short = _two_transfers(0.05)  # idle 50 ms < RTO (rtt + 200 ms): window kept
    long = _two_transfers(3.0)  # idle > RTO: halved per RTO down to the initial window
    assert long > 1.3 * short
    no_restart = TcpParams(slow_start_after_idle=False).to_dict()
    assert _two_transfers(3.0, **no_restart) == pytest.approx(short, rel=0.05)
    # BBR keeps its window and paces the restart at 1 x its estimate (the link's rate, less BBR's
    # 1 % margin) until the next ACK: within 10 % of the back-to-back transfer, not restarted
    bbr = _two_transfers(3.0, congestion_control="bbr")
    assert bbr == pytest.approx(short, rel=0.1) and bbr < long / 1.2


def test_bbr_paces_bursts_after_idle_at_its_estimate_which_grows_burst_by_burst():
    # 1 Gbit/s, 300 ms RTT, 256 KiB bursts 1 s apart: CUBIC's window (kept, slow_start_after_idle off)
    # sends each later burst in one flight, ~half an RTT; BBR paces it at gain x its delivery-rate
    # estimate, which an app-limited burst raises only towards burst x (1 - 1/gain) / RTT -- so a
    # burst settles near RTT / (gain - 1) of pacing on top (the testbed's lat150 cases: all-reduce
    # 0.55 s measured where unpaced flights gave 0.32 s)
    burst, owd, gap = 256 << 10, 0.15, 1.0

    def lags(**tcp):
        env, tr, got = _transport(owd, 125e6, **tcp)
        _send_at(env, tr, 0.0, burst, "warm-up")  # handshake and slow start out of the way
        for k in range(8):
            _send_at(env, tr, 5.0 + k * gap, burst, k)
        env.run()
        return [t - 5.0 - k * gap for k, t in got[1:]]

    cubic = lags(congestion_control="cubic", slow_start_after_idle=False)
    bbr = lags(congestion_control="bbr")
    assert cubic[-1] == pytest.approx(owd, abs=0.01)
    gain = TcpParams().pacing_gain
    settle = owd + 2 * owd / (gain - 1)
    assert owd + 0.25 * (2 * owd) < bbr[-1] < 1.1 * settle  # paced: a quarter to half an RTT on top
    assert all(a >= b - 1e-9 for a, b in zip(bbr, bbr[1:]))  # each burst no slower than the one before
    assert bbr[0] > bbr[-1] + 0.05  # the estimate did grow


def test_concurrent_connections_share_the_uplink():
    env, tr, got = _transport(0.001, 1e6)
    for d in ("b", "c"):
        _send_at(env, tr, 0.0, MB, d, dst=d)
    env.run()
    times = sorted(t for _, t in got)
    # fair share: both finish near 2 s (FIFO would give 1 s and 2 s)
    assert times[0] > 1.6 and times[1] == pytest.approx(2.0, rel=0.1)


def _pair(transfer="tcp", **net):
    cl = SimCluster(seed=0, network=NetworkModel(transfer=transfer, **net))
    cfg = NodeConfig(gossip_interval=100.0, peer_timeout=1000.0)
    a = cl.add_peer(cfg)
    b = cl.add_peer(cfg, known=[a])
    seen: list = []
    orig = b.node.on_message
    b.node.on_message = lambda msg, now: (seen.append((now, msg)), orig(msg, now))[1]
    return cl, a, b, seen


def _gossip(a, hb):
    return make_message(MsgType.GOSSIP_REPLY, a.peer_id, a.endpoint, {"hb": hb, "peers": []})


def test_loss_slows_tcp_but_never_loses_or_reorders_a_message():
    def run(loss):
        cl, a, b, seen = _pair(latency=0.02, bandwidth=2e6, loss=loss)
        cl.run(until=0.5)
        seen.clear()
        for hb in range(10_001, 10_301):  # far above the nodes' own heartbeats
            cl._transmit(a, b.endpoint, _gossip(a, hb))
        big = make_message(MsgType.PART, a.peer_id, a.endpoint, {"gid": "g", "owner": 0, "part": 0, "w": 1.0, "resc": 0},
                      (np.zeros(1 << 18, np.float32),))
        cl._transmit(a, b.endpoint, big)
        cl.run(until=200.0)
        return cl, seen

    clean, seen0 = run(0.0)
    lossy, seen1 = run(0.05)
    hbs = [m.heartbeat for _, m in seen1 if m.type is MsgType.GOSSIP_REPLY and m.heartbeat > 10_000]
    assert hbs == list(range(10_001, 10_301))  # all there, in order
    assert lossy.lost == 0 and lossy.tcp.loss_events > 0
    part_at = [next(t for t, m in seen if m.type is MsgType.PART) for seen in (seen0, seen1)]
    assert part_at[1] > 1.5 * part_at[0]  # the big part came much later


def test_a_result_on_lane_1_overtakes_parts_queued_on_lane_0():
    assert lane_of(MsgType.RESULT) == 1 and lane_of(MsgType.PART) == 0
    cl, a, b, seen = _pair(latency=0.01, bandwidth=1e6)
    cl.run(until=0.5)
    seen.clear()
    body = {"gid": "g", "owner": 0, "part": 0, "w": 1.0, "resc": 0}
    for p in range(3):
        cl._transmit(a, b.endpoint, make_message(MsgType.PART, a.peer_id, a.endpoint, {**body, "part": p},
                                            (np.zeros(1 << 17, np.float32),)))
    res = {"gid": "g", "owner": 0, "part": 0, "contrib": [0], "resc": 0}
    cl._transmit(a, b.endpoint, make_message(MsgType.RESULT, a.peer_id, a.endpoint, res, (np.zeros(16, np.float32),)))
    cl.run(until=30.0)
    kinds = [(m.type, m.part) for _, m in seen if m.type in (MsgType.PART, MsgType.RESULT)]
    assert kinds[0] == (MsgType.RESULT, 0)
    assert [p for t, p in kinds if t is MsgType.PART] == [0, 1, 2]  # lane 0 keeps its order


def test_the_first_part_opens_the_result_lane_so_its_handshake_runs_while_parts_stream():
    assert warm_lanes(MsgType.PART) == (1,) and warm_lanes(MsgType.RESULT) == ()
    cl, a, b, seen = _pair(latency=0.05, bandwidth=1e6)
    cl.run(until=0.5)
    seen.clear()
    assert (a.endpoint, b.endpoint, 1) not in cl.tcp.conns
    body = {"gid": "g", "owner": 0, "part": 0, "w": 1.0, "resc": 0}
    # a sends b's span a 1 MB part (a second on the wire); a owns a span too and owes b its result
    cl._transmit(a, b.endpoint, make_message(MsgType.PART, a.peer_id, a.endpoint, body, (np.zeros(1 << 18, np.float32),)))
    conn = cl.tcp.conns[(a.endpoint, b.endpoint, 1)]  # opened with the part, before any result
    cl.run(until=cl.env.now + 1.5)
    assert conn.ready <= cl.env.now
    res = {"gid": "g", "owner": 1, "part": 0, "contrib": [0], "resc": 0}
    t0 = cl.env.now
    cl._transmit(a, b.endpoint, make_message(MsgType.RESULT, a.peer_id, a.endpoint, res, (np.zeros(16, np.float32),)))
    cl.run(until=t0 + 5.0)
    (at,) = [t for t, m in seen if m.type is MsgType.RESULT]
    assert at - t0 < conn.rtt  # one-way latency: no handshake left to pay (else 3 RTT more)


def test_partition_delays_tcp_traffic_until_it_heals_and_loses_nothing():
    cl, a, b, seen = _pair(latency=0.01, bandwidth=1e6,
                           partitions=[Partition(1.0, 4.0, frozenset({"sim://peer0"}), frozenset({"sim://peer1"}))])
    cl.run(until=1.5)
    seen.clear()
    cl._transmit(a, b.endpoint, _gossip(a, 42))
    cl.run(until=20.0)
    assert [m.heartbeat for _, m in seen] == [42]
    assert seen[0][0] >= 4.0


def _watch_downs(peer):
    downs: list = []
    orig = peer.node.on_peer_down
    peer.node.on_peer_down = lambda ep, now: (downs.append((ep, now)), orig(ep, now))[1]
    return downs


def test_peers_met_are_connected_at_once_up_to_warm_peers():
    cl = SimCluster(seed=0, network=NetworkModel(transfer="tcp", latency=0.05))
    quiet = dict(gossip_interval=100.0, peer_timeout=1000.0)  # one gossip exchange at start, then silence
    a = cl.add_peer(NodeConfig(**quiet))
    b = cl.add_peer(NodeConfig(**quiet), known=[a])
    c = cl.add_peer(NodeConfig(**quiet), known=[a])
    d = cl.add_peer(NodeConfig(**quiet, warm_peers=1), known=[a])
    cl.run(until=2.0)
    conns = cl.tcp.conns
    # b, c and d sent a gossip to a; a answered each, and met them: a's connections to all three
    assert all((a.endpoint, x.endpoint, 0) in conns for x in (b, c, d))
    # b heard of c and d in a's answer: it opened connections to them without sending them anything
    assert (b.endpoint, c.endpoint, 0) in conns and (b.endpoint, d.endpoint, 0) in conns
    assert conns[(b.endpoint, c.endpoint, 0)].ready < 2.0  # handshakes done before any step
    # d warms one peer only (a, the first it met); b and c it would connect to on first use
    assert [x for x in (b, c) if (d.endpoint, x.endpoint, 0) in conns] == []
    assert cl._dealers.get((b.endpoint, c.endpoint), "absent") is None  # monitored: a crash of c is noticed


@pytest.mark.parametrize("transfer", ["tcp", "fifo"])
def test_crash_sends_disconnect_notices_one_way_latency_later(transfer):
    cl, a, b, _ = _pair(transfer, latency=0.03)
    c = cl.add_peer(NodeConfig(gossip_interval=100.0, peer_timeout=1000.0, warm_peers=0), known=[a])  # never connects to b
    downs_a, downs_c = _watch_downs(a), _watch_downs(c)
    cl.run(until=0.5)
    cl._transmit(a, b.endpoint, _gossip(a, 1))  # a holds a lane-0 DEALER to b; c never sent to b
    cl.run(until=1.0)
    b.crash()
    cl.run(until=2.0)
    assert downs_a == [(b.endpoint, pytest.approx(1.03))]
    assert downs_c == []


def test_pause_and_partition_send_no_notice():
    cl, a, b, _ = _pair(latency=0.03,
                        partitions=[Partition(2.0, 3.0, frozenset({"sim://peer0"}), frozenset({"sim://peer1"}))])
    downs = _watch_downs(a)
    cl.run(until=0.5)
    cl._transmit(a, b.endpoint, _gossip(a, 1))
    cl.run(until=1.0)
    b.pause()
    cl.run(until=1.5)
    b.resume()
    cl.run(until=4.0)
    assert downs == [] and cl.notices == 0


def test_disconnect_action_closes_the_monitored_dealer():
    cl, a, b, _ = _pair(latency=0.01)
    downs = _watch_downs(a)
    cl.run(until=0.5)
    cl._transmit(a, b.endpoint, _gossip(a, 1))
    cl.run(until=1.0)
    cl._disconnect(a, b.endpoint)  # as when a's membership forgets b
    assert cl.tcp.rtt(a.endpoint, b.endpoint) is None
    b.crash()
    cl.run(until=2.0)
    assert downs == []


SMALL_HOSTS = {"seed": 3, "rounds": 2, "numel": 1 << 16, "dtype": "float32", "grid": [], "round_gap": 0.5,
               "bootstrap_time": 2.0, "step_timeout": 10.0,
               "protocol": {"target_group_size": 4, "min_group_size": 2, "matchmaking_time": 1.0,
                            "part_timeout": 5.0, "allreduce_timeout": 60.0, "part_size_bytes": 65536},
               "hosts": [{"up_mbit": 1000, "down_mbit": 1000, "latency_ms": 1},
                         {"up_mbit": 100, "down_mbit": 100, "latency_ms": 10},
                         {"up_mbit": 20, "down_mbit": 20, "latency_ms": 40, "loss": 0.01}]}


def _median_step(res) -> float:
    return float(np.median([s for r in res.rounds for _, s in r["step_seconds"]]))


def _mean_step(res) -> float:
    return float(np.mean([s for r in res.rounds for _, s in r["step_seconds"]]))


def test_hosts_scenarios_default_to_tcp():
    res = run_scenario(SMALL_HOSTS)
    assert all(r["succeeded"] == 3 for r in res.rounds)
    fifo = run_scenario({**SMALL_HOSTS, "network": {"transfer": "fifo"}})
    assert res.trace != fifo.trace
    # without hosts the default stays FIFO
    assert run_scenario({"peers": 4, "grid": [2, 2], "rounds": 1}).trace == \
        run_scenario({"peers": 4, "grid": [2, 2], "rounds": 1, "network": {"transfer": "fifo"}}).trace


def _profile(tmp_path: Path, **costs) -> str:
    path = tmp_path / "prof.json"
    path.write_text(json.dumps({"cpu": CpuCosts(**costs).__dict__, "tcp": TcpParams().to_dict(), "machine": {}}))
    return str(path)


def test_cpu_profile_slows_steps_as_its_costs_say_and_keeps_determinism(tmp_path):
    # fast links and a full group at once, so CPU (not a link or the matchmaking window) sets the pace
    fast = {**SMALL_HOSTS, "protocol": {**SMALL_HOSTS["protocol"], "target_group_size": 3},
            "hosts": [{"up_mbit": 1000, "down_mbit": 1000, "latency_ms": 1, "count": 3}]}
    base = run_scenario(fast)
    # 20 ns per byte of term: a 256 KiB part's sum costs ~5 ms, per PART received
    slow = _profile(tmp_path, accumulate_byte=2e-8, handle_msg=1e-4)
    own = run_scenario({**fast, "cpu": {"profile": slow}})
    shared = run_scenario({**fast, "cpu": {"profile": slow, "cores": 1}})
    assert _median_step(own) > _median_step(base)
    # three peers on one core wait for each other (the median can sit on a link-bound peer: use the mean)
    assert _mean_step(shared) > _mean_step(own)
    assert run_scenario({**fast, "cpu": {"profile": slow, "cores": 1}}).to_json() == shared.to_json()
    assert all(r["succeeded"] == 3 for r in shared.rounds)
    assert CpuSpec.from_value({"profile": slow}).cores is None


def test_the_testbed_switch_is_one_serial_cpu_consumer_that_caps_throughput(tmp_path):
    # 1 Gbit links, 3 peers, 4 MiB each: the links need ~70 ms a step; a forwarder at 100 ns per byte
    # (10 MB/s) must move every byte of the step through one queue: at least bytes x 100 ns
    fast = {**SMALL_HOSTS, "numel": 1 << 20, "protocol": {**SMALL_HOSTS["protocol"], "target_group_size": 3},
            "hosts": [{"up_mbit": 1000, "down_mbit": 1000, "latency_ms": 1, "count": 3}]}
    free = run_scenario({**fast, "cpu": {"profile": _profile(tmp_path), "cores": 2}})
    sw = run_scenario({**fast, "cpu": {"profile": _profile(tmp_path, switch_byte=1e-7), "cores": 2}})
    moved = sw.rounds[-1]["bytes_sent_mean"] * 3
    assert _median_step(sw) >= 0.9 * moved * 1e-7 > 3 * _median_step(free)
    assert all(r["succeeded"] == 3 for r in sw.rounds)
    again = run_scenario({**fast, "cpu": {"profile": _profile(tmp_path, switch_byte=1e-7), "cores": 2}})
    assert again.to_json() == sw.to_json()


def test_calibrate_measures_positive_costs_and_reads_the_sysctls():
    prof = calibrate(quick=True)
    c = prof["cpu"]
    assert c["handle_msg"] > 0 and c["decode_msg"] > 0 and c["accumulate_byte"] > 0 and c["copy_byte"] > 0
    assert c["transport_byte"] > 0
    assert prof["tcp"]["mss"] > 0 and prof["machine"]["kernel"]
    assert prof["calibration_seconds"] < 20


def test_hosts_scenario_is_identical_across_hash_seeds(tmp_path):
    scen = tmp_path / "s.json"
    scen.write_text(json.dumps(SMALL_HOSTS))
    outs = []
    for hs in ("0", "12345"):
        out = tmp_path / f"r{hs}.json"
        env = dict(os.environ, PYTHONHASHSEED=hs, PYTHONPATH=str(ROOT))
        p = subprocess.run([sys.executable, "-m", "sim", "run", str(scen), "--out", str(out), "--quiet"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        outs.append(out.read_text())
    assert outs[0] == outs[1]


@pytest.mark.parametrize("tcp, expect", [
    ({"mss": 0}, "[network] tcp: mss must be a whole number >= 1, not 0"),
    ({"mss": -5}, "[network] tcp: mss must be a whole number >= 1, not -5"),
    ({"init_cwnd": 0}, "[network] tcp: init_cwnd must be a whole number >= 1, not 0"),
    ({"mss": "x"}, "[network] tcp: mss must be a whole number >= 1, not 'x'"),
    ({"frame_bytes": -100}, "[network] tcp: frame_bytes must be a whole number >= 0, not -100"),
    ({"rto_min": float("nan")}, "[network] tcp: rto_min must be a finite number > 0, not nan"),
    (3, "[network] tcp must be a table of TCP settings"),
])
def test_tcp_settings_that_mean_nothing_are_refused_at_load(tcp, expect):
    """mss = 0 ended a run in a ZeroDivisionError; mss = -5 or init_cwnd = 0 moved no byte (every step
    failed with GroupNotFound, silently); a negative frame_bytes made links faster than their rate."""
    from sim.scenario import Scenario

    with pytest.raises(ValueError, match=re.escape(expect)):
        Scenario.from_dict({"peers": 2, "grid": [], "network": {"transfer": "tcp", "tcp": tcp}})
    if isinstance(tcp, dict):
        with pytest.raises(ValueError, match=re.escape(expect)):
            TcpParams(**tcp)


def _incast(down: float, congestion_control: str, seed: int = 0):
    """Three 100 Mbit senders each send 1 MB at once to one receiver whose downlink runs at `down`
    bytes/s behind the testbed's tbf queue (200 ms of its rate, at least 512 KiB), on a 200 ms RTT,
    twice (the second time with the windows and estimates the first left, as a testbed round after
    the first); returns (segments its queue dropped, arrival times)."""
    net = NetworkModel(latency=0.1, bandwidth={"a": 12.5e6, "b": 12.5e6, "c": 12.5e6, "d": down},
                       transfer="tcp", tcp={"congestion_control": congestion_control},
                       down_queue={"seconds": 0.2, "min_bytes": 512 << 10})
    env = simpy.Environment()
    got: list = []
    tr = TcpTransport(net, net.tcp, env, np.random.default_rng(seed), lambda tok, sent: got.append((tok, env.now)))
    for k in range(2):
        for src in "abc":
            tr.send(src, "d", 0, MB, (k, src))
        env.run()
    assert sorted(tok for tok, _ in got) == [(k, s) for k in range(2) for s in "abc"]  # slower, nothing lost
    return tr.tail_drops.get("d", 0), [t for _, t in got]


@pytest.mark.parametrize("cc", ["bbr", "cubic"])
def test_incast_into_a_slow_downlink_overflows_its_finite_queue(cc):
    """Where what arrives at a downlink exceeds what it drains plus its queue, the excess is dropped
    (the testbed's tbf, under the incast of three fast senders into a 20 Mbit host) and the senders
    retransmit; a 1 Gbit downlink takes the same senders without a drop. Same seed, same drops."""
    drops, slow = _incast(2.5e6, cc)
    assert drops > 0
    assert _incast(2.5e6, cc) == (drops, slow)
    none, fast = _incast(125e6, cc)
    assert none == 0 and max(fast) < max(slow)
    # 6 MB through 20 Mbit/s can take no less than the link's time for it
    assert max(slow) > 6 * MB / 2.5e6
    without = NetworkModel(latency=0.1, bandwidth=2.5e6, transfer="tcp")  # the default: unbounded, no drops
    assert without.down_queue is None and without.queue_limit("d", 0.0) is None


def test_down_queue_setting_is_checked():
    for bad in ({"seconds": 0}, {"seconds": -0.2}, {"min_bytes": 1}, {"seconds": 0.2, "size": 1}, 0.2,
                {"seconds": "x"}, {"seconds": 0.2, "min_bytes": -1}):
        with pytest.raises(ValueError, match="down_queue"):
            NetworkModel(transfer="tcp", down_queue=bad)
    net = NetworkModel(bandwidth=2.5e6, down_queue={"seconds": 0.2, "min_bytes": 512 << 10})
    assert net.queue_limit("x", 0.0) == 512 << 10  # 200 ms of 20 Mbit/s is less than the minimum
    assert NetworkModel(bandwidth=125e6, down_queue={"seconds": 0.2}).queue_limit("x", 0.0) == 25e6
    assert NetworkModel(down_queue={"seconds": 0.2}).queue_limit("x", 0.0) is None  # unlimited link: no queue
    from sim.scenario import Scenario

    with pytest.raises(ValueError, match="down_queue"):  # refused at load, before anything runs
        Scenario.from_dict({"peers": 2, "grid": [], "network": {"down_queue": {"seconds": -1}}})


class _Draws:
    """The transport's generator with its loss draws scripted: `random()` gives the values queued in
    `next`, then 1.0 (no loss, no tail loss, no lost retransmission). A connection's BBR keeps the
    generator it was made with, so only the transport's own draws are scripted."""

    def __init__(self) -> None:
        self.next: list[float] = []

    def random(self) -> float:
        return self.next.pop(0) if self.next else 1.0


def _lossy_link(owd: float, **tcp):
    """A 1 Gbit/s link with 1 % loss whose losses happen only where a test scripts them."""
    net = NetworkModel(latency=owd, bandwidth=125e6, loss=0.01, transfer="tcp", tcp=tcp)
    env = simpy.Environment()
    got: list = []
    tr = TcpTransport(net, net.tcp, env, np.random.default_rng(0), lambda tok, sent: got.append((tok, env.now)))
    tr.open("a", "b", 0)  # the handshake's draws come from the real generator: no handshake loss here
    draws = _Draws()
    tr.rng = draws
    return env, tr, got, draws


def _send_scripted(env, tr, draws, t, nbytes, tok, script):
    def go(_e):
        draws.next[:] = script
        tr.send("a", "b", 0, nbytes, tok)
    env.timeout(t).callbacks.append(go)


@pytest.mark.parametrize("nbytes, cost", [(100, 0.5), (20 * 1448, 0.8)])
def test_a_tail_loss_costs_what_linuxs_tail_loss_probe_costs(nbytes, cost):
    # 300 ms RTT (RTO 0.5 s). The last segment of a flight is lost: nothing sent after it reveals
    # the loss, so Linux's tail-loss probe resends it (tcp_schedule_loss_probe): 2 SRTT, + RTO_min
    # for a lone segment, never later than the RTO, re-armed at each ACK -- a lone segment is resent
    # an RTO (0.5 s) after it left, a longer flight's last an RTT + min(2 SRTT, RTO) after (0.8 s)
    owd = 0.15

    def arrival(script):
        env, tr, got, draws = _lossy_link(owd, congestion_control="cubic", slow_start_after_idle=False)
        _send_scripted(env, tr, draws, 0.0, 4 * MB, "warm-up", [])  # the window opens beyond the flight
        _send_scripted(env, tr, draws, 10.0, nbytes, "flight", script)
        env.run()
        return dict(got)["flight"]

    clean = arrival([])
    assert clean == pytest.approx(10.0 + owd, abs=0.01)  # one round, no loss
    assert arrival([0.0, 0.0]) - clean == pytest.approx(cost, abs=0.005)  # lost, and it was the tail


def test_a_loss_early_in_a_burst_holds_back_its_end_until_the_repair_arrives():
    # BBR paces a 256 KiB burst out in less than an RTT (300 ms) once its estimate grew. A segment
    # lost in the burst's first 10 ms is resent an RTT after it left (SACK), and TCP delivers in
    # order: the burst cannot reach the receiver before that repair does, an RTT + one way after the
    # burst began -- whichever later round its last byte left in
    owd, burst, start = 0.15, 256 << 10, 13.0

    def arrival(script):
        env, tr, got, draws = _lossy_link(owd, congestion_control="bbr")
        for k in range(8):  # warm-up bursts 1 s apart: BBR's estimate grows burst by burst
            _send_scripted(env, tr, draws, 5.0 + k, burst, k, [])
        _send_scripted(env, tr, draws, start, burst, "burst", script)
        env.run()
        return dict(got)["burst"]

    clean = arrival([])
    repaired = start + 2 * owd + owd
    assert clean < repaired - 0.05  # without the loss the burst is there well before the repair
    assert arrival([0.0]) == pytest.approx(repaired, abs=0.015)  # lost in the burst's first round
