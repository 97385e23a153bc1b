"""Regression tests for the faults found on emulated links (issue 10, item 5): shutdown right after a
step, the step's time bound under partition / pause / SIGSTOP, timings, the advertised address,
malformed addresses, an unreachable bootstrap peer, and cancelling a step's future."""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import zgossip
from harness import FAST
from sim import NetworkModel, SimCluster
from sim.network import Partition
from zgossip.node import NodeConfig, StepDone, StepFailed
from zgossip.endpoints import advertised_host, check_endpoint

N = 4


def _sim(seed=0, bandwidth=None, numel=1 << 14, **cfg):
    net = NetworkModel(latency=0.01, bandwidth=bandwidth if bandwidth is not None else 2e6)
    cl = SimCluster(seed=seed, network=net)
    kw = dict(prefix="flt", target_group_size=N, min_group_size=2, part_size_bytes=4096, part_timeout=1.0,
              allreduce_timeout=60.0, gossip_interval=0.1, peer_timeout=3.0, matchmaking_time=0.2, request_timeout=0.2)
    kw.update(cfg)
    rng = np.random.default_rng(seed)
    peers = []
    for _ in range(N):
        peers.append(cl.add_peer(NodeConfig(**kw), tensors=[rng.standard_normal(numel).astype(np.float32)],
                                 known=peers))
    return cl, net, peers, NodeConfig(**kw)


# ------------------------------------------------------------------ 1. shutdown right after the step
@pytest.mark.parametrize("graceful", [True, False])
def test_peers_shutting_down_after_their_step_still_deliver_what_they_owe(graceful):
    """Peer 3 sits behind a slow link: the others finish first while results for it are still on
    their way. Stopping a peer drops its connections, which the ZeroMQ transport reports to peer 3
    at once (`on_peer_down`, emulated here), and peer 3 then gives that peer's missing results up.
    A graceful shutdown waits until peer 3 said DONE (peer 3 ends complete); an abrupt stop (what
    shutdown did before) loses results, which shows the test can fail."""
    slow = {f"sim://peer{i}": 5e6 for i in range(N)}
    slow["sim://peer3"] = 1e5
    cl, _, peers, _ = _sim(bandwidth=slow)
    evs = [p.step_tensors(timeout=5.0) for p in peers]
    stopped = []

    def stop(i):
        def cb(_ev):
            stopped.append(i)
            def notify(_e=None):
                if peers[3].alive:
                    peers[3].node.on_peer_down(peers[i].endpoint, cl.env.now)
                    peers[3].pump()
            if graceful:
                peers[i].shutdown(timeout=30.0).callbacks.append(notify)
            else:
                peers[i].crash()
                notify()
        return cb

    for i in range(3):
        evs[i].callbacks.append(stop(i))
    cl.run(until=cl.env.all_of(evs))
    assert sorted(stopped) == [0, 1, 2]
    last = evs[3].value
    if graceful:
        assert isinstance(last, StepDone), last
        assert last.result.complete and not last.result.lost
    else:
        assert isinstance(last, StepFailed) or not last.result.complete


def test_averagers_that_shut_down_right_after_their_step_leave_every_result_complete():
    numel = 1 << 20
    data = [np.random.default_rng(i).standard_normal(numel).astype(np.float32) for i in range(N)]
    avgs = []
    try:
        for i in range(N):
            avgs.append(zgossip.Averager([data[i]], initial_peers=[avgs[0].endpoint] if avgs else [], seed=i,
                                         **{**FAST, "prefix": "sd", "target_group_size": N,
                                            "part_size_bytes": 64 << 10, "shutdown_timeout": 10.0}))
        deadline = time.monotonic() + 10
        while any(len(a.peers()) < N - 1 for a in avgs):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        futs = [a.step(wait=False, timeout=5.0) for a in avgs]
        closers: list[threading.Thread] = []

        def close_when_done(a):
            def cb(_f):
                t = threading.Thread(target=a.shutdown)
                closers.append(t)
                t.start()
            return cb

        for a, f in zip(avgs, futs):  # each shuts down the moment its own step is over
            f.add_done_callback(close_when_done(a))
        results = [f.result(30) for f in futs]
        assert all(r.complete and not r.lost for r in results), [(r.complete, r.lost) for r in results]
        deadline = time.monotonic() + 30
        while len(closers) < N:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for t in closers:
            t.join(30)
            assert not t.is_alive()
    finally:
        for a in avgs:
            a.shutdown()


def test_groupmates_confirm_with_done_so_shutdown_after_a_step_does_not_wait():
    x, y = np.ones(1 << 16, np.float32), np.zeros(1 << 16, np.float32)
    kw = {**FAST, "shutdown_timeout": 10.0}
    a = zgossip.Averager([x], prefix="dn", target_group_size=2, seed=1, **kw)
    b = zgossip.Averager([y], prefix="dn", target_group_size=2, initial_peers=[a.endpoint], seed=2, **kw)
    try:
        deadline = time.monotonic() + 10
        while not (a.peers() and b.peers()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        fa, fb = a.step(wait=False), b.step(wait=False)
        assert fa.result(20).complete and fb.result(20).complete
        while a._ask_node(lambda n: n.owes_others()):  # b's DONE is on its way
            assert time.monotonic() < deadline + 10, "the groupmate never confirmed"
            time.sleep(0.01)
        t0 = time.monotonic()
        a.shutdown()
        assert time.monotonic() - t0 < 2.0
    finally:
        a.shutdown()
        b.shutdown()


def test_shutdown_is_bounded_by_shutdown_timeout():
    a = zgossip.Averager([np.zeros(4, np.float32)], prefix="sdt", shutdown_timeout=0.3, **FAST)
    # pretend a groupmate never confirmed: shutdown gives up after shutdown_timeout
    a._transport.run_on_io(lambda node, now: node._owed.__setitem__("g", {"x": "tcp://127.0.0.1:9"}), 5)
    t0 = time.monotonic()
    a.shutdown()
    assert time.monotonic() - t0 < 3.0


# ------------------------------------------------------------------ 2. the step's bound
def _bound(cfg: NodeConfig, timeout: float) -> float:
    return timeout + cfg.allreduce_timeout


@pytest.mark.parametrize("fault_at", [0.05, 0.15, 0.2])
@pytest.mark.parametrize("victim", range(N))
def test_partition_every_step_ends_within_the_stated_bounds(victim, fault_at):
    cl, net, peers, cfg = _sim(seed=victim, numel=1 << 16, part_size_bytes=16384, part_timeout=1.0,
                               allreduce_timeout=60.0)
    evs = [p.step_tensors(timeout=2.0) for p in peers]
    t0 = cl.env.now
    T = cfg.part_timeout
    ended = [None] * N

    def record(i):
        def cb(_e):
            ended[i] = cl.env.now - t0
        return cb

    for i, e in enumerate(evs):
        e.callbacks.append(record(i))
    cl.run(until=t0 + fault_at)
    eps = frozenset(p.endpoint for p in peers)
    net.partitions.append(Partition(cl.env.now, 1e9, frozenset([peers[victim].endpoint]), eps - {peers[victim].endpoint}))
    cl.run(until=cl.env.all_of(evs))
    for i, e in enumerate(evs):
        # every step, done or failed: within the stated bound, and in fact ended by failure
        # detection, not by allreduce_timeout: an owner is given up 2 T after its last message
        # (checked every T/4). Before the fix the cut-off peer took up to 6 T.
        assert ended[i] <= _bound(cfg, 2.0)
        assert ended[i] <= fault_at + 2.25 * T + 0.2, (i, ended[i], e.value)
        if isinstance(e.value, StepDone):
            assert e.value.result.timings["total"] <= ended[i] + 1e-9


def test_partition_with_a_short_allreduce_timeout_ends_at_the_hard_bound():
    cl, net, peers, cfg = _sim(part_timeout=5.0, allreduce_timeout=3.0)
    evs = [p.step_tensors(timeout=2.0) for p in peers]
    t0 = cl.env.now
    cl.run(until=t0 + 0.1)
    eps = frozenset(p.endpoint for p in peers)
    net.partitions.append(Partition(cl.env.now, 1e9, frozenset([peers[0].endpoint]), eps - {peers[0].endpoint}))
    cl.run(until=cl.env.all_of(evs))
    assert cl.env.now - t0 <= _bound(cfg, 2.0) + 1e-9


@pytest.mark.parametrize("victim", range(N))
def test_paused_member_others_end_within_the_bound_and_it_ends_when_resumed(victim):
    cl, _, peers, cfg = _sim(seed=10 + victim, part_timeout=1.0, allreduce_timeout=8.0)
    evs = [p.step_tensors(timeout=2.0) for p in peers]
    t0 = cl.env.now
    cl.run(until=t0 + 0.1)
    peers[victim].pause()
    others = [evs[i] for i in range(N) if i != victim]
    cl.run(until=cl.env.all_of(others))
    assert cl.env.now - t0 <= 0.1 + 2.25 * cfg.part_timeout + 0.5
    cl.run(until=t0 + 30.0)
    peers[victim].resume()  # its deadline passed while it was frozen: it ends at once
    cl.run(until=cl.env.now + 0.5)
    assert evs[victim].triggered


def test_sigstop_a_member_mid_round_others_end_within_the_bound():
    from zgossip.swarm import LocalSwarm

    part_timeout, allreduce_timeout, timeout = 1.0, 20.0, 5.0
    kw = dict(prefix="stop", matchmaking_time=0.5, request_timeout=0.3, gossip_interval=0.1, peer_timeout=30.0,
              target_group_size=4, part_size_bytes=4096, part_timeout=part_timeout, allreduce_timeout=allreduce_timeout)
    with LocalSwarm(4, 1 << 20, seed=3, averager_kwargs=kw) as swarm:
        swarm.wait_membership(timeout=20)
        victim = 2
        pid = swarm.procs[victim].pid
        for i in range(4):
            swarm.send(i, "step", timeout=timeout)
        time.sleep(0.4)
        os.kill(pid, signal.SIGSTOP)
        try:
            results = [swarm.recv(i, timeout + allreduce_timeout + 5) for i in range(4) if i != victim]
        finally:
            os.kill(pid, signal.SIGCONT)
        swarm.recv(victim, timeout + allreduce_timeout + 5)
        for r in results:
            assert r["timings"]["wall"] <= timeout + allreduce_timeout + 1.0, r
            if r["ok"]:
                # failure detection ended it: a silent member is given up within 2.25 x part_timeout
                assert r["timings"]["allreduce"] <= 2.25 * part_timeout + 3.0, r["timings"]


# ------------------------------------------------------------------ 3. timings
@pytest.mark.parametrize("wait", [True, False])
def test_timings_total_is_the_callers_wall_time(wait):
    x, y = np.ones(1 << 18, np.float32), np.zeros(1 << 18, np.float32)
    a = zgossip.Averager([x], prefix="tm", target_group_size=2, seed=1, **FAST)
    b = zgossip.Averager([y], prefix="tm", target_group_size=2, initial_peers=[a.endpoint], seed=2, **FAST)
    with a, b:
        deadline = time.monotonic() + 10
        while not (a.peers() and b.peers()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        fb = b.step(wait=False)
        t0 = time.monotonic()
        if wait:
            ra = a.step()
        else:
            ra = a.step(wait=False).result(20)
        took = time.monotonic() - t0
        fb.result(20)
    t = ra.timings
    assert {"matchmaking", "allreduce", "settle", "apply", "total"} <= set(t)
    assert t["total"] <= took + 1e-3
    assert t["total"] >= took - 0.05
    assert t["total"] >= t["matchmaking"] + t["allreduce"] + t["settle"] - 0.01


# ------------------------------------------------------------------ 4. the advertised address
def test_bound_to_every_interface_advertises_the_address_routing_to_the_initial_peer():
    a = zgossip.Averager([np.zeros(2, np.float32)], prefix="adv", listen="tcp://127.0.0.1:0", **FAST)
    with a:
        with zgossip.Averager([np.zeros(2, np.float32)], prefix="adv", listen="tcp://0.0.0.0:0",
                              initial_peers=[a.endpoint], **FAST) as b:
            assert b.endpoint.startswith("tcp://127.0.0.1:")
            deadline = time.monotonic() + 10
            while not a.peers():
                assert time.monotonic() < deadline
                time.sleep(0.02)


def test_advertised_host_branches(caplog):
    routes = {"10.0.0.5": "10.0.0.7"}
    ifaces = lambda: ["127.0.0.1", "192.168.1.4", "10.0.0.7"]  # noqa: E731
    assert advertised_host(["tcp://10.0.0.5:41000"], route=routes.get, interfaces=ifaces) == "10.0.0.7"
    # no route to the initial peer: the first non-loopback interface
    assert advertised_host(["tcp://10.9.9.9:1"], route=routes.get, interfaces=ifaces) == "192.168.1.4"
    assert advertised_host([], route=routes.get, interfaces=ifaces) == "192.168.1.4"
    with caplog.at_level(logging.WARNING, logger="zgossip.endpoints"):
        assert advertised_host([], route=routes.get, interfaces=lambda: ["127.0.0.1"]) == "127.0.0.1"
    assert any("loopback" in r.getMessage() for r in caplog.records)


def test_announce_host_still_overrides():
    with zgossip.Averager([np.zeros(2, np.float32)], prefix="adv", listen="tcp://0.0.0.0:0",
                          announce_host="peer.example", **FAST) as a:
        assert a.endpoint.startswith("tcp://peer.example:")


# ------------------------------------------------------------------ 5. malformed addresses
@pytest.mark.parametrize("bad", ["127.0.0.1:41000", "tcp://127.0.0.1", "tcp://:41000", "tcp://h:0", "tcp://h:x",
                                 "udp://h:1", ""])
def test_malformed_initial_peer_raises_at_construction(bad):
    with pytest.raises(ValueError, match="tcp://HOST:PORT") as e:
        zgossip.Averager([np.zeros(2, np.float32)], prefix="bad", initial_peers=[bad], **FAST)
    assert repr(bad) in str(e.value)


def test_a_listen_address_that_cannot_be_bound_says_which_and_why():
    """libzmq's reasons alone -- "No such device (addr='tcp://h:*')" for a host name it cannot bind,
    "Address already in use" -- named neither the option nor a fix (and showed port 0 as *)."""
    import zmq

    with pytest.raises(zmq.ZMQError, match=re.escape("cannot listen at tcp://no-such-host.invalid:0: No such device "
                                                     "(no interface or address of this host has that name")):
        zgossip.Averager([np.zeros(2, np.float32)], prefix="bind", listen="tcp://no-such-host.invalid:0", **FAST)
    with zgossip.Averager([np.zeros(2, np.float32)], prefix="bind", listen="tcp://127.0.0.1:0", **FAST) as a:
        with pytest.raises(zmq.ZMQError, match=re.escape(f"cannot listen at {a.endpoint}: Address already in use "
                                                         "(another process listens there: pick another port")):
            zgossip.Averager([np.zeros(2, np.float32)], prefix="bind", listen=a.endpoint, **FAST)


@pytest.mark.parametrize("bad", ["bad host!", "", "10.0.0.5:41000", "tcp://10.0.0.5"])
def test_malformed_announce_host_raises_at_construction(bad):
    """It was taken as given: the peer advertised `tcp://bad host!:PORT`, which every other peer drops
    as unreachable, so nobody ever reached it and nothing said why."""
    with pytest.raises(ValueError, match=f"invalid announce_host {re.escape(repr(bad))}: expected the host name"):
        zgossip.Averager([np.zeros(2, np.float32)], prefix="bad", listen="tcp://127.0.0.1:0", announce_host=bad,
                         **FAST)


@pytest.mark.parametrize("bad", ["127.0.0.1:0", "tcp://127.0.0.1", "tcp://127.0.0.1:99999"])
def test_malformed_listen_raises_at_construction(bad):
    with pytest.raises(ValueError, match="listen address"):
        zgossip.Averager([np.zeros(2, np.float32)], prefix="bad", listen=bad, **FAST)


def test_check_endpoint_accepts_the_valid_forms():
    assert check_endpoint("tcp://10.0.0.5:41000") == ("10.0.0.5", 41000)
    assert check_endpoint("tcp://host-a.example:1") == ("host-a.example", 1)
    assert check_endpoint("tcp://[::1]:5") == ("[::1]", 5)
    assert check_endpoint("tcp://0.0.0.0:0", listen=True) == ("0.0.0.0", 0)
    assert check_endpoint("tcp://*:*", listen=True) == ("*", 0)
    assert check_endpoint("tcp://[fe80::1%eth0]:5") == ("[fe80::1%eth0]", 5)
    assert check_endpoint("tcp://eth0:0", listen=True) == ("eth0", 0)


@pytest.mark.parametrize("bad", ["tcp://a#b:1", "tcp://a\nb:1", "tcp://a\x00b:1", "tcp://a b:1", "tcp://a@b:1",
                                 "tcp://[]:1", "tcp://[zz]:1", "tcp://h\u00e9:1"])
def test_check_endpoint_refuses_hosts_no_address_can_have(bad):
    # a "#" starts the key in HOST:PORT#KEY, and a newline or a NUL in an address passed every check
    # (found by the operator probe): now only names, IPv4 and bracketed IPv6 addresses pass
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        check_endpoint(bad)


def test_cli_rejects_a_malformed_initial_peer_in_one_line():
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(zgossip.__file__))))
    p = subprocess.run([sys.executable, "-m", "zgossip.cli", "peer", "--initial-peers", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "127.0.0.1:1" in lines[0] and "tcp://HOST:PORT" in lines[0], p.stderr


# ------------------------------------------------------------------ 6. unreachable bootstrap peer
def test_unreachable_bootstrap_peer_is_named_once(caplog):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    dead = f"tcp://127.0.0.1:{port}"
    with caplog.at_level(logging.WARNING, logger="zgossip.membership"):
        with zgossip.Averager([np.zeros(2, np.float32)], prefix="boot", initial_peers=[dead], **FAST):
            time.sleep(5.0)  # warned after 3 s; gossip goes out every 0.05 s
    hits = [r for r in caplog.records if dead in r.getMessage()]
    assert len(hits) == 1, [r.getMessage() for r in hits]


def test_unreachable_bootstrap_peer_in_the_simulator(caplog):
    cl = SimCluster(seed=1)
    cfg = NodeConfig(prefix="boot", gossip_interval=0.1, peer_timeout=2.0)
    good = cl.add_peer(cfg)
    with caplog.at_level(logging.WARNING, logger="zgossip.membership"):
        p = cl.add_peer(cfg, initial_peers=["sim://nowhere"])
        cl.run(until=10.0)
        assert sum("sim://nowhere" in r.getMessage() for r in caplog.records) == 1
        q = cl.add_peer(cfg, initial_peers=[good.endpoint])
        cl.run(until=20.0)
    assert not any(good.endpoint in r.getMessage() for r in caplog.records)
    assert p.node.membership.unreached_bootstrap() == ("sim://nowhere",)
    assert q.node.membership.unreached_bootstrap() == ()


# ------------------------------------------------------------------ 7. cancelling a step
def test_cancel_during_matchmaking_really_cancels(caplog):
    x = np.arange(4, dtype=np.float32)
    with caplog.at_level(logging.ERROR):
        with zgossip.Averager([x], prefix="cx", **FAST) as a:
            f = a.step(wait=False, timeout=3.0)
            assert f.cancel() is True
            assert f.cancelled()
            with pytest.raises(cf.CancelledError):
                f.result(1)
            g = a.step(wait=False, timeout=0.5)  # the averager is free again: no StepInProgress
            with pytest.raises(zgossip.GroupNotFound):
                g.result(10)
            time.sleep(0.2)
    assert np.array_equal(x, np.arange(4, dtype=np.float32))
    assert not any("InvalidStateError" in r.getMessage() or r.exc_info for r in caplog.records)


def test_cancel_after_the_allreduce_began_returns_false_and_the_step_completes():
    numel = 1 << 20
    x, y = np.ones(numel, np.float32), np.zeros(numel, np.float32)
    kw = {**FAST, "part_size_bytes": 16 << 10}
    a = zgossip.Averager([x], prefix="cy", target_group_size=2, seed=1, **kw)
    b = zgossip.Averager([y], prefix="cy", target_group_size=2, initial_peers=[a.endpoint], seed=2, **kw)
    with a, b:
        deadline = time.monotonic() + 10
        while not (a.peers() and b.peers()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        fa, fb = a.step(wait=False), b.step(wait=False)
        while not a._ask_node(lambda n: n.step is None or n.step.round is not None):
            assert time.monotonic() < deadline + 10
            time.sleep(0.001)
        assert fa.cancel() is False
        ra = fa.result(20)
        assert not fa.cancelled() and ra.complete
        fb.result(20)
    np.testing.assert_allclose(x, 0.5)
