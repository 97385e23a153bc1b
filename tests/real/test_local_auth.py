"""Local Unix sockets of peers with keys: authenticated (key proof + same user), not encrypted.

The proof is checked on its own (right pair of keys only), then against a running node's local
socket: a forged proof, a valid proof of a key not on the allow list and (as root) a valid proof
from a process of another user are refused and counted; a valid proof of an allowed key is let in.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

import zgossip
from zgossip import local_auth
from zgossip.identity import KeyPair
from zgossip.local_ipc import local_name

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux-only"),
    pytest.mark.skipif(not local_auth.available(), reason="no libsodium to make key proofs with"),
]

KW = dict(prefix="lauth", target_group_size=2, min_group_size=2, matchmaking_time=0.4, gossip_interval=0.1)


def test_proof_holds_for_exactly_one_pair_of_keys():
    a, b, c = (KeyPair.generate() for _ in range(3))
    p = local_auth.proof(a, b.peer_id)
    assert local_auth.verify(b, a.peer_id, p)
    assert not local_auth.verify(c, a.peer_id, p)  # made for b: worthless to any other server
    assert not local_auth.verify(b, c.peer_id, p)  # a cannot pass it off as c's
    assert not local_auth.verify(b, a.peer_id, p[:-1] + (b"0" if p[-1:] != b"0" else b"1"))
    assert not local_auth.verify(b, "00" * 32, p)  # a low-order key proves nothing
    assert not local_auth.verify(b, "not a key", p)
    assert local_auth.peer_uid("localhost:1000:1000:4242") == 1000
    assert local_auth.peer_uid("127.0.0.1") is None


def _handshake(address: str, user: str, password: bytes, timeout: float = 5.0) -> str:
    """'ok' or 'refused': the outcome of a PLAIN handshake with the socket at `address`."""
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.PLAIN_USERNAME, user.encode())
    d.setsockopt(zmq.PLAIN_PASSWORD, password)
    mon = d.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        d.connect(address)
        if not mon.poll(int(timeout * 1000)):
            return "no answer"
        ev = recv_monitor_message(mon)["event"]
        return "ok" if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
    finally:
        d.disable_monitor()
        mon.close(0)
        d.close(0)


_OTHER_USER = textwrap.dedent("""
    import os, sys, zmq
    from zmq.utils.monitor import recv_monitor_message
    os.setgid(65534); os.setuid(65534)
    d = zmq.Context().socket(zmq.DEALER); d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.PLAIN_USERNAME, sys.argv[2].encode()); d.setsockopt(zmq.PLAIN_PASSWORD, sys.argv[3].encode())
    mon = d.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    d.connect(sys.argv[1])
    if not mon.poll(5000):
        print("no answer")
    else:
        print("ok" if recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused")
""")


def test_local_socket_admits_only_proven_allowed_keys_of_this_user():
    ka, kb, spare, intruder = (KeyPair.generate() for _ in range(4))
    allow = [ka.public, kb.public, spare.public]
    x = np.zeros(1 << 12, np.float32)
    y = np.full(1 << 12, 2.0, np.float32)
    with zgossip.Averager([x], secret_key=ka, allowed_keys=allow, **KW) as a, \
            zgossip.Averager([y], secret_key=kb, allowed_keys=allow, initial_peers=[f"{a.endpoint}#{ka.public}"],
                             **KW) as b:
        # peers with keys on one host use the local sockets, and average exactly
        fa, fb = a.step(wait=False, timeout=10), b.step(wait=False, timeout=10)
        assert fa.result(20).complete and fb.result(20).complete
        assert np.array_equal(x, np.ones_like(x)) and np.array_equal(y, np.ones_like(y))
        assert a.stats["local_connections"] > 0 and b.stats["local_connections"] > 0
        assert a._transport.route(b.endpoint).startswith("ipc://@")
        address = "ipc://@" + local_name(a.endpoint)
        assert a._transport._local.getsockopt(zmq.MECHANISM) == zmq.PLAIN  # not encrypted

        refused = a.stats["refused"]
        # a forged proof for an allowed id (made with another key): refused
        assert _handshake(address, spare.peer_id, local_auth.proof(intruder, ka.peer_id)) == "refused"
        # a proof meant for another server: refused
        assert _handshake(address, spare.peer_id, local_auth.proof(spare, kb.peer_id)) == "refused"
        # a valid proof of a key that is not allowed: refused
        assert _handshake(address, intruder.peer_id, local_auth.proof(intruder, ka.peer_id)) == "refused"
        assert a.stats["refused"] == refused + 3
        # a valid proof of an allowed key, from this user: let in
        assert _handshake(address, spare.peer_id, local_auth.proof(spare, ka.peer_id)) == "ok"
        if os.getuid() == 0:
            # the same valid proof from a process of another user: refused (SO_PEERCRED)
            out = subprocess.run([sys.executable, "-c", _OTHER_USER, address, spare.peer_id,
                                  local_auth.proof(spare, ka.peer_id).decode()],
                                 capture_output=True, text=True, timeout=30, cwd="/")
            assert out.stdout.strip() == "refused", out.stderr[-2000:]
            deadline = time.monotonic() + 5
            while a.stats["refused"] < refused + 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert a.stats["refused"] == refused + 4


def test_client_mode_with_keys_keeps_to_curve_over_tcp():
    ka, kc = KeyPair.generate(), KeyPair.generate()
    allow = [ka.public, kc.public]
    x, y = np.zeros(1 << 12, np.float32), np.full(1 << 12, 2.0, np.float32)
    with zgossip.Averager([x], secret_key=ka, allowed_keys=allow, **KW) as a, \
            zgossip.Averager([y], secret_key=kc, allowed_keys=allow, client_mode=True,
                             initial_peers=[f"{a.endpoint}#{ka.public}"], **KW) as c:
        fa, fc = a.step(wait=False, timeout=10), c.step(wait=False, timeout=10)
        assert fa.result(20).complete and fc.result(20).complete
        assert np.array_equal(x, np.ones_like(x)) and np.array_equal(y, np.ones_like(y))
        # its answers come back on its own connections, which must prove the server's key: CURVE
        assert c.stats["local_connections"] == 0 and c._transport.route(a.endpoint) == a.endpoint
