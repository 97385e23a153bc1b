"""zgossip's own zero-copy sends (`zgossip._zsend`): bytes arrive intact, a lent buffer stays
alive exactly as long as libzmq holds it, bad calls raise, and the driver falls back to pyzmq."""
from __future__ import annotations

import contextlib

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import weakref

import numpy as np
import pytest
import zmq

from zgossip import fast_send, zmq_driver


def test_fast_send_is_built_on_linux():
    # where it can be built, `pip install` must have built it (the pyzmq fallback is tested below)
    if (not sys.platform.startswith("linux") or not (shutil.which("cc") or shutil.which("gcc"))
            or os.environ.get("ZGOSSIP_FAST_SEND") == "0"):
        pytest.skip("not Linux, no C compiler, or fallback forced")
    assert zmq_driver.FAST_SEND


@pytest.fixture
def zs():
    if not zmq_driver.FAST_SEND:
        pytest.skip("zgossip._zsend not in use here")
    return fast_send.zsend


@pytest.fixture
def pair():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def _recv(sock: zmq.Socket, timeout: float = 5.0) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), "nothing arrived"
    return sock.recv_multipart()


def test_bytes_and_payloads_arrive_intact(zs, pair):
    router, dealer = pair
    a = np.arange(1 << 18, dtype=np.float32)
    b = np.linspace(-1, 1, 1000, dtype=np.float64)
    pa, pb = zs.Payload(a), zs.Payload(b)
    assert pa.nbytes == a.nbytes and pb.nbytes == b.nbytes
    zs.send(dealer.underlying, (b"head", pa, b"", pb))
    zs.send(dealer.underlying, (b"second",))
    got = _recv(router)
    assert got[1:3] == [b"head", a.tobytes()] and got[3] == b"" and got[4] == b.tobytes()
    assert _recv(router)[1:] == [b"second"]
    assert pa.wait(5.0) and pb.wait(5.0) and pa.done and pb.done


def test_one_payload_in_several_messages_is_released_after_the_last(zs, pair):
    router, dealer = pair
    a = np.full(1 << 16, 7, dtype=np.float32)
    p = zs.Payload(a)
    for _ in range(3):
        zs.send(dealer.underlying, (b"h", p))
    for _ in range(3):
        assert np.array_equal(np.frombuffer(_recv(router)[2], np.float32), a)
    assert p.wait(5.0)


def test_empty_payload_is_sent_and_never_pending(zs, pair):
    router, dealer = pair
    p = zs.Payload(np.zeros(0, np.float32))
    zs.send(dealer.underlying, (b"h", p))
    assert p.done  # nothing was lent
    assert _recv(router)[1:] == [b"h", b""]


def test_buffer_lives_until_libzmq_releases_it(zs):
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect("tcp://127.0.0.1:9")  # nobody listens: the message stays queued in libzmq
    a = np.ones(1 << 16, dtype=np.float32)
    ref = weakref.ref(a)
    p = zs.Payload(a)
    zs.send(dealer.underlying, (b"h", p))
    assert not p.wait(0.05) and not p.done
    del a, p  # only libzmq holds the buffer now
    zs.reap()
    assert ref() is not None, "the array was freed while libzmq still had its bytes"
    dealer.close(0)  # drops the queued message: libzmq calls the release function
    deadline = time.monotonic() + 5
    while ref() is not None and time.monotonic() < deadline:
        zs.reap()
        time.sleep(0.01)
    assert ref() is None, "the buffer was never released after libzmq dropped the message"
    ctx.term()


def test_bad_calls_raise(zs, pair):
    _, dealer = pair
    with pytest.raises(TypeError):
        zs.send(dealer.underlying, (b"h", np.zeros(4)))  # arrays must be wrapped in a Payload
    with pytest.raises(TypeError):
        zs.send(dealer.underlying, [b"h"])  # frames are a tuple
    with pytest.raises(ValueError):
        zs.send(dealer.underlying, ())
    with pytest.raises(ValueError):
        zs.send(0, (b"h",))
    with pytest.raises((BufferError, ValueError)):
        zs.Payload(np.zeros((4, 4))[:, 1])  # not contiguous
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)  # cannot send: libzmq's error comes back as OSError
    p = zs.Payload(np.zeros(1 << 14, np.float32))
    try:
        with pytest.raises(OSError, match="zmq_msg_send failed on frame 0"):
            zs.send(sub.underlying, (p,))
        assert p.done  # the failed message gave its reference back
    finally:
        sub.close(0)
        ctx.term()


def test_driver_falls_back_to_pyzmq():
    # the whole path without _zsend, in a fresh interpreter: two peers average correctly
    code = textwrap.dedent("""
        import numpy as np, zgossip
        from zgossip import zmq_driver
        assert not zmq_driver.FAST_SEND
        a, b = np.zeros(1 << 18, np.float32), np.full(1 << 18, 2, np.float32)
        kw = dict(prefix="fb", target_group_size=2, min_group_size=2, matchmaking_time=0.5)
        with zgossip.Averager([a], **kw) as x, zgossip.Averager([b], initial_peers=[x.endpoint], **kw) as y:
            fx = x.step(wait=False, timeout=20)
            fy = y.step(wait=False, timeout=20)
            assert fx.result(40).complete and fy.result(40).complete
        assert np.array_equal(a, np.ones_like(a)) and np.array_equal(b, np.ones_like(b))
        print("ok")
    """)
    env = dict(os.environ, ZGOSSIP_FAST_SEND="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@contextlib.contextmanager
def _stuck_part(x, gid: str = "0" * 16):
    """A 32 MiB PART (more than one connection's kernel buffers) lent by averager `x`'s transport to
    a peer that accepts and never reads: yields (transport, that peer's endpoint) once the loan is pending."""
    from zgossip import wire

    d = x._transport
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # accepts, never reads
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    ep = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    msg = wire.make_message(wire.MsgType.PART, x.peer_id, x.endpoint,
                            {"gid": gid, "owner": 0, "part": 0, "w": 1.0, "resc": 0}, (np.ones(8 << 20, np.float32),))
    try:
        x._transport.call(lambda now: d.transmit(ep, msg))
        deadline = time.monotonic() + 5
        while not d.sends_pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.sends_pending()
        yield d, ep
    finally:
        silent.close()


@pytest.mark.parametrize("path", ["zsend", "pyzmq"])
def test_settle_sends_drops_what_a_dead_peer_never_took(monkeypatch, path):
    # an in-place step ends with settle_sends: a payload still queued for a peer that does not read
    # must be dropped, and released by libzmq, before the caller may change the tensor
    if path == "zsend" and not zmq_driver.FAST_SEND:
        pytest.skip("zgossip._zsend not in use here")
    if path == "pyzmq":
        monkeypatch.setattr(fast_send, "zsend", None)  # transports read it when they start
    from zgossip import Averager

    with Averager([np.zeros(4, np.float32)], prefix="settle") as x, _stuck_part(x) as (d, _):
        assert d.settle_sends(0.3) == 1  # one peer's sockets reset
        assert not d.sends_pending()  # and libzmq let go of the bytes
        assert d.stats["send_errors"] == 0


@pytest.mark.parametrize("path", ["zsend", "pyzmq"])
def test_settle_sends_does_not_wait_for_a_member_the_round_lost(monkeypatch, path):
    # what is still queued for a member done with the round just finished (it gave us up, left, or
    # its connection dropped) is of no use: the step drops it at once instead of waiting out the
    # settle timeout for it
    if path == "zsend" and not zmq_driver.FAST_SEND:
        pytest.skip("zgossip._zsend not in use here")
    if path == "pyzmq":
        monkeypatch.setattr(fast_send, "zsend", None)
    from zgossip import Averager

    gid = "1" * 16
    with Averager([np.zeros(4, np.float32)], prefix="settle-gone") as x, _stuck_part(x, gid) as (d, ep):
        monkeypatch.setattr(d.node, "gone", lambda g: frozenset({ep}) if g == gid else frozenset())
        t0 = time.monotonic()
        assert d.settle_sends(5.0, group_id=gid) == 1
        assert time.monotonic() - t0 < 1.0  # not the 5 s it would wait for a member still in the round
        assert not d.sends_pending()


def _result(x, gid: str, part: int, data: np.ndarray):
    """A RESULT of owner 0 over members 0 and 1 from averager `x`, carrying `data` (a view, lent as sent)."""
    from zgossip import wire

    return wire.make_message(wire.MsgType.RESULT, x.peer_id, x.endpoint,
                             {"gid": gid, "owner": 0, "part": part, "contrib": [0, 1], "resc": 0}, (data,))


@pytest.mark.parametrize("path", ["zsend", "pyzmq"])
def test_settle_sends_resends_a_result_still_owed_from_a_copy(monkeypatch, path):
    # an in-place step's RESULT stuck behind a slow receiver: settle_sends closes that connection, as
    # for any stuck loan, but a groupmate still owed it (no DONE yet) gets it again from a copy, so it
    # can finish its round; the copy holds the values of the step, not what the caller writes after
    if path == "zsend" and not zmq_driver.FAST_SEND:
        pytest.skip("zgossip._zsend not in use here")
    if path == "pyzmq":
        monkeypatch.setattr(fast_send, "zsend", None)
    from zgossip import Averager, wire

    ctx = zmq.Context.instance()
    slow = ctx.socket(zmq.ROUTER)  # reads one message, then holds the rest back (RCVHWM 1): a slow link
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 64 << 10)
    slow.setsockopt(zmq.LINGER, 0)
    port = slow.bind_to_random_port("tcp://127.0.0.1")
    ep = f"tcp://127.0.0.1:{port}"
    gid = "0" * 16
    try:
        with Averager([np.zeros(4, np.float32)], prefix="resend") as x:
            d = x._transport
            tensor = np.arange(4 << 20, dtype=np.float32)  # 16 MiB per RESULT: more than the kernel buffers
            half = len(tensor) // 2

            def result(part: int, data: np.ndarray):
                return _result(x, gid, part, data)

            first, second = result(0, tensor[:half]), result(1, tensor[half:])

            def send(node, now):
                node._owed[gid] = {"f" * 16: ep}  # a groupmate of a finished round that has not said DONE
                d.transmit(ep, first)
                d.transmit(ep, second)

            d.run_on_io(send, 5)
            deadline = time.monotonic() + 5
            while not d.sends_pending() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert d.sends_pending()
            assert d.settle_sends(0.3) == 1  # the connection with the stuck RESULT is closed
            assert not d.sends_pending()  # the tensor is free: the copy sent again is the transport's own
            assert d.stats["resent"] >= 1
            tensor[:] = -1.0  # the caller changes its tensor once the step returned
            got = {}
            deadline = time.monotonic() + 20
            while 1 not in got and time.monotonic() < deadline:
                if slow.poll(200):
                    frames = slow.recv_multipart()
                    msg = wire.decode(frames[1:])
                    got[msg.part] = msg.data.copy()
            assert 1 in got, "the stuck RESULT never arrived again"
            assert np.array_equal(got[1], np.arange(half, 2 * half, dtype=np.float32))  # the step's values
            assert 0 in got and np.array_equal(got[0], np.arange(half, dtype=np.float32))

            # a groupmate that said DONE (or died) is owed nothing: nothing is sent again
            resent = d.stats["resent"]
            d.run_on_io(lambda node, now: node._owed[gid].clear(), 5)
            tensor[:] = np.arange(len(tensor), dtype=np.float32)
            d.run_on_io(lambda node, now: (d.transmit(ep, result(2, tensor[:half])),
                                           d.transmit(ep, result(3, tensor[half:]))), 5)
            deadline = time.monotonic() + 5  # nothing is read any more: the second one is stuck again
            while not d.sends_pending() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert d.sends_pending()
            assert d.settle_sends(0.3) == 1
            assert d.stats["resent"] == resent and not d.sends_pending()
    finally:
        slow.close(0)


@pytest.mark.parametrize("path", ["zsend", "pyzmq"])
def test_a_client_gets_its_payloads_from_a_copy(monkeypatch, path):
    # a client (a firewalled peer) is answered through our ROUTER, whose queue for one peer cannot be
    # dropped: a loan stuck there could be read after an in-place step handed the tensor back. So a
    # client's payloads are copies: nothing stays lent, and what arrives is what was sent
    if path == "zsend" and not zmq_driver.FAST_SEND:
        pytest.skip("zgossip._zsend not in use here")
    if path == "pyzmq":
        monkeypatch.setattr(fast_send, "zsend", None)
    from zgossip import Averager, wire
    from zgossip.endpoints import client_endpoint

    with Averager([np.zeros(4, np.float32)], prefix="client-copy") as x:
        d = x._transport
        client = zmq.Context.instance().socket(zmq.DEALER)  # reads nothing until the end: a slow link
        client.setsockopt(zmq.ROUTING_ID, b"c" * 8)
        client.setsockopt(zmq.RCVHWM, 1)
        client.setsockopt(zmq.RCVBUF, 64 << 10)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(x.endpoint)
        try:
            client.send_multipart([b"hello"])  # makes the ROUTER know the routing id (the bytes are dropped)
            pid = "c" * 16
            tensor = np.arange(4 << 20, dtype=np.float32)
            half = len(tensor) // 2

            time.sleep(0.3)
            d.run_on_io(lambda node, now: (d._replies.__setitem__(pid, b"c" * 8),
                                           d.transmit(client_endpoint(pid), _result(x, "0" * 16, 0, tensor[:half])),
                                           d.transmit(client_endpoint(pid), _result(x, "0" * 16, 1, tensor[half:]))), 5)
            assert not d.sends_pending()  # nothing of the tensor is lent
            assert d.stats["unreachable"] == 0 and d.stats["sent"] >= 2
            tensor[:] = -1.0  # the step returned; the caller changes its tensor
            got = {}
            deadline = time.monotonic() + 20
            while len(got) < 2 and time.monotonic() < deadline:
                if client.poll(200):
                    msg = wire.decode(client.recv_multipart())
                    got[msg.part] = msg.data.copy()
            assert set(got) == {0, 1}
            assert np.array_equal(np.concatenate([got[0], got[1]]), np.arange(4 << 20, dtype=np.float32))
        finally:
            client.close(0)


def test_recv_whole_messages_small_frames_as_bytes(zs, pair):
    router, dealer = pair
    assert zs.recv(router.underlying, 4096) is None  # nothing waiting: None, not an exception
    a = np.arange(1 << 16, dtype=np.float32)
    dealer.send_multipart([b"header", a.tobytes(), b""])
    deadline = time.monotonic() + 5
    got = None
    while got is None and time.monotonic() < deadline:
        got = zs.recv(router.underlying, 4096)
        time.sleep(0.005)
    assert got is not None and len(got) == 4  # routing id, header, payload, empty frame
    ident, header, payload, empty = got
    assert isinstance(ident, bytes) and header == b"header" and empty == b""
    assert not isinstance(payload, bytes) and len(payload) == a.nbytes  # not copied
    view = np.frombuffer(payload, dtype=np.float32)
    del payload, got  # the array keeps libzmq's message alive
    assert np.array_equal(view, a)
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 1  # read-only: received bytes are never written in place
    assert zs.recv(router.underlying, 4096) is None


def test_recv_errors_raise(zs):
    with pytest.raises(ValueError):
        zs.recv(0, 10)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)  # cannot receive
    try:
        with pytest.raises(OSError, match="zmq_msg_recv failed on frame 0"):
            zs.recv(pub.underlying, 10)
    finally:
        pub.close(0)
        ctx.term()
