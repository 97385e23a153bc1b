"""Peers on one host reach each other over Unix sockets found by their TCP endpoint, and fall back
to TCP whenever that socket is missing, switched off or not owned by this user."""
from __future__ import annotations

import logging
import os
import socket
import sys

import numpy as np
import pytest

import zgossip
from zgossip import local_ipc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux-only")

KW = dict(prefix="ipc", target_group_size=2, min_group_size=2, matchmaking_time=0.5)


def _pair_step(**kw_b):
    a, b = np.zeros(1 << 16, np.float32), np.full(1 << 16, 2, np.float32)
    with zgossip.Averager([a], **KW) as x, zgossip.Averager([b], initial_peers=[x.endpoint], **KW, **kw_b) as y:
        # the I/O thread keeps the averager's name (the local socket's name once overwrote it)
        assert x._transport._thread.name == f"zgossip-{x.peer_id[:8]}-io"
        fx, fy = x.step(wait=False, timeout=20), y.step(wait=False, timeout=20)
        assert fx.result(40).complete and fy.result(40).complete
        routes = (x._transport.route(y.endpoint), y._transport.route(x.endpoint))
        addresses = (x._transport.local_address, y._transport.local_address)
        endpoints = (x.endpoint, y.endpoint)
    assert np.array_equal(a, np.ones_like(a)) and np.array_equal(b, np.ones_like(b))
    return routes, addresses, endpoints


def test_local_peers_connect_over_their_unix_sockets():
    (xy, yx), (ax, ay), (ex, ey) = _pair_step()
    assert ax == "ipc://@zgossip-" + ex[len("tcp://"):] and ay == "ipc://@zgossip-" + ey[len("tcp://"):]
    assert xy == ay and yx == ax  # each connected to the other's local socket


def test_switched_off_on_one_side_means_tcp_both_ways():
    (xy, yx), (ax, ay), _ = _pair_step(local_ipc=False)
    assert ay is None  # y does not listen locally, so x finds nothing and uses TCP
    assert xy.startswith("tcp://") and yx.startswith("tcp://")


def test_environment_switch(monkeypatch):
    monkeypatch.setenv("ZGOSSIP_LOCAL_IPC", "0")
    (xy, yx), (ax, ay), _ = _pair_step()
    assert ax is None and ay is None and xy.startswith("tcp://") and yx.startswith("tcp://")


def test_names():
    assert local_ipc.local_name("tcp://127.0.0.1:5555") == "zgossip-127.0.0.1:5555"
    assert local_ipc.local_name("ipc:///tmp/x") is None
    assert local_ipc.local_name("tcp://" + "h" * 200 + ":1") is None  # too long for a socket address


def test_probe_finds_only_listeners_of_this_user(monkeypatch, caplog):
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # a TCP listener that is not zgossip
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    ep = f"tcp://127.0.0.1:{plain.getsockname()[1]}"
    squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with zgossip.Averager([np.zeros(4, np.float32)], **KW) as x:
            d = x._transport
            assert d.routes.route(ep) == ep  # no local socket under that name
            squat.bind("\0" + local_ipc.local_name(ep))
            squat.listen()
            assert local_ipc.listener_uid(local_ipc.local_name(ep)) == os.getuid()
            assert d.routes.route(ep) == "ipc://@" + local_ipc.local_name(ep)
            # a listener of another user is not trusted with the data
            monkeypatch.setattr(local_ipc, "listener_uid", lambda name: os.getuid() + 1)
            with caplog.at_level(logging.WARNING, logger="zgossip.local_ipc"):
                assert d.routes.route(ep) == ep
            assert "not to this user" in caplog.text
    finally:
        squat.close()
        plain.close()


def test_taken_local_name_is_reported_and_tcp_still_works(caplog):
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a port that is free now; its local name is taken first
    squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squat.bind(f"\0zgossip-127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.WARNING, logger="zgossip.zmq_driver"):
            with zgossip.Averager([np.zeros(4, np.float32)], listen=f"tcp://127.0.0.1:{port}", **KW) as x:
                assert x._transport.local_address is None
                assert x.endpoint == f"tcp://127.0.0.1:{port}"
        assert "could not listen on the local socket" in caplog.text
    finally:
        squat.close()
