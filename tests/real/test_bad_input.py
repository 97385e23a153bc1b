"""Bad input from the network: a live node drops it, counts it, and keeps averaging correctly.

Real in-process `Averager`s on tcp loopback receive hand-made frames from raw ZeroMQ
sockets: garbage, empty and truncated frames, wrong versions, types, dtypes and field
values, oversize frames, and — from a fake groupmate that joined a real group over the
wire — parts that do not fit the group's plan. After each, the drop must show in the
averager's `stats`, no internal error may have been logged, the tensors must be
untouched, and the next round must still give the exact mean.

Near-valid messages are built with `wire.encode` and then mutated, so each case breaks
exactly one thing. A hypothesis test checks that `wire.decode` only ever raises
`InvalidMessage` or returns a valid `Message`.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, Iterator

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

import zgossip
from zgossip import wire
from zgossip.errors import InvalidMessage
from zgossip.matchmaking import rendezvous_order
from zgossip.partition import make_plan
from zgossip.wire import Message, MsgType, make_message

PREFIX = "bad"
MAX_MSG = 1 << 20
KW = dict(
    prefix=PREFIX, target_group_size=2, min_group_size=2, matchmaking_time=0.3, request_timeout=0.3,
    gossip_interval=0.05, peer_timeout=20.0, part_timeout=3.0, allreduce_timeout=20.0,
    part_size_bytes=64 << 10, max_message_bytes=MAX_MSG,
)
NUMEL = 50_000  # three parts of 64 KiB per peer


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def drops(avg: zgossip.Averager) -> int:
    """Everything the averager reports as refused: undecodable (driver) or out of context (node)."""
    s = avg.stats
    return s["invalid"] + s["dropped"]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def pair() -> Iterator[tuple[zgossip.Averager, zgossip.Averager]]:
    rng = np.random.default_rng(7)
    ta = [rng.standard_normal(NUMEL).astype(np.float32)]
    tb = [rng.standard_normal(NUMEL).astype(np.float32)]
    with zgossip.Averager(ta, **KW) as a, zgossip.Averager(tb, initial_peers=[a.endpoint], **KW) as b:
        wait_for(lambda: a.peers() == [b.peer_id] and b.peers() == [a.peer_id], 10, "the two peers to meet")
        yield a, b


def snapshot(avg: zgossip.Averager) -> list[np.ndarray]:
    with avg.get_tensors() as ts:
        return [np.array(t, copy=True) for t in ts]


def assert_next_round_exact(*avgs: zgossip.Averager, weights: tuple[float, ...] | None = None) -> list[Any]:
    w = weights or (1.0,) * len(avgs)
    before = [snapshot(a)[0].astype(np.float64) for a in avgs]
    expected = sum(wi * x for wi, x in zip(w, before)) / sum(w)
    futs = [a.step(weight=wi, wait=False, timeout=10) for a, wi in zip(avgs, w)]
    results = [f.result(40) for f in futs]
    for r, a in zip(results, avgs):
        assert r.complete, r
        assert set(r.contributors) == {x.peer_id for x in avgs}
        np.testing.assert_allclose(snapshot(a)[0], expected, rtol=1e-5, atol=1e-6)
    return results


def send_raw(ctx: zmq.Context, endpoint: str, frames: list[bytes]) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(frames)
    return sock


# --------------------------------------------------------------------------- near-valid messages
def frames_of(msg: Message, header: Callable[[list], Any] | None = None) -> list[bytes]:
    """`msg` as frames; `header` may rewrite the unpacked header list (return the new header)."""
    out = wire.encode(msg)
    head = msgpack.unpackb(out[0], raw=False)
    if header is not None:
        head = header(head)
    return [msgpack.packb(head, use_bin_type=True), *[np.ascontiguousarray(a).tobytes() for a in out[1:]]]


def gossip(sender: str = "0123456789abcdef", endpoint: str = "tcp://127.0.0.1:9") -> Message:
    return make_message(MsgType.GOSSIP, sender, endpoint, {"hb": 1, "peers": []})


def part(sender: str = "0123456789abcdef", endpoint: str = "tcp://127.0.0.1:9", gid: str = "feedfacefeedface",
         n: int = 16, owner: int = 0, index: int = 0) -> Message:
    body = {"gid": gid, "owner": owner, "part": index, "w": 1.0, "resc": 0}
    return make_message(MsgType.PART, sender, endpoint, body, (np.arange(n, dtype=np.float32),))


def with_body(**changes: Any) -> Callable[[list], list]:
    def edit(h: list) -> list:
        h[4] = {**h[4], **changes}
        return h

    return edit


def set_item(i: int, value: Any) -> Callable[[list], list]:
    def edit(h: list) -> list:
        h[i] = value
        return h

    return edit


def drop_field(name: str) -> Callable[[list], list]:
    def edit(h: list) -> list:
        h[4] = {k: v for k, v in h[4].items() if k != name}
        return h

    return edit


def _garbage() -> list[bytes]:
    return [np.random.default_rng(1).bytes(997)]


def _truncated_header() -> list[bytes]:
    f = frames_of(part())
    return [f[0][: len(f[0]) // 2], f[1]]


def _short_payload() -> list[bytes]:
    f = frames_of(part(n=16))  # header declares 16 x f4 = 64 bytes
    return [f[0], f[1][:63]]


def _long_payload() -> list[bytes]:
    f = frames_of(part(n=16))
    return [f[0], f[1] + b"\0\0\0\0"]


#: (case id, frames) whose first problem `wire.decode` must catch -> the driver's `invalid` counter
UNDECODABLE: list[tuple[str, Callable[[], list[bytes]]]] = [
    ("garbage bytes", _garbage),
    ("empty frame", lambda: [b""]),
    ("empty header, one payload", lambda: [b"", b"\0" * 8]),
    ("truncated header", _truncated_header),
    ("payload shorter than declared", _short_payload),
    ("payload longer than declared", _long_payload),
    ("PART without its payload frame", lambda: frames_of(part())[:1]),
    ("GOSSIP with a payload frame", lambda: frames_of(gossip()) + [b"\0" * 8]),
    ("too many frames", lambda: frames_of(gossip()) + [b"\0" * 4] * 80),
    ("wrong version 2", lambda: frames_of(gossip(), set_item(0, 2))),
    ("wrong version '1'", lambda: frames_of(gossip(), set_item(0, "1"))),
    ("wrong version 0", lambda: frames_of(gossip(), set_item(0, 0))),
    ("unknown type 99", lambda: frames_of(gossip(), set_item(1, 99))),
    ("type as a string", lambda: frames_of(gossip(), set_item(1, "GOSSIP"))),
    ("negative type", lambda: frames_of(gossip(), set_item(1, -1))),
    ("dtype c8 not allowed", lambda: frames_of(part(n=16), set_item(5, [["c8", 8]]))),
    ("dtype O not allowed", lambda: frames_of(part(n=16), set_item(5, [["O", 8]]))),
    ("dtype as numpy str", lambda: frames_of(part(n=16), set_item(5, [["<f4", 16]]))),
    ("dtype as bytes", lambda: frames_of(part(n=16), set_item(5, [[b"f4", 16]]))),
    ("negative count", lambda: frames_of(part(n=16), set_item(5, [["f4", -16]]))),
    ("float count", lambda: frames_of(part(n=16), set_item(5, [["f4", 16.0]]))),
    ("payload meta not a list", lambda: frames_of(part(n=16), set_item(5, {"f4": 16}))),
    ("payload meta too short", lambda: frames_of(part(n=16), set_item(5, [["f4"]]))),
    ("header is a map", lambda: [msgpack.packb({"v": 1, "t": 1})]),
    ("header has 5 items", lambda: frames_of(gossip(), lambda h: h[:5])),
    ("header has 7 items", lambda: frames_of(gossip(), lambda h: h + [0])),
    ("header is an int", lambda: [msgpack.packb(5)]),
    ("sender is an int", lambda: frames_of(gossip(), set_item(2, 12345))),
    ("sender too long", lambda: frames_of(gossip(), set_item(2, "x" * 1000))),
    ("endpoint is None", lambda: frames_of(gossip(), set_item(3, None))),
    ("body is a list", lambda: frames_of(gossip(), set_item(4, [1, []]))),
    ("body field missing", lambda: frames_of(part(), drop_field("w"))),
    ("body field extra", lambda: frames_of(part(), with_body(extra=1))),
    ("part index a string", lambda: frames_of(part(), with_body(part="0"))),
    ("part index a bool", lambda: frames_of(part(), with_body(part=True))),
    ("part index negative", lambda: frames_of(part(), with_body(part=-1))),
    ("owner out of range", lambda: frames_of(part(), with_body(owner=1 << 20))),
    ("weight NaN", lambda: frames_of(part(), with_body(w=float("nan")))),
    ("weight inf", lambda: frames_of(part(), with_body(w=float("inf")))),
    ("weight negative", lambda: frames_of(part(), with_body(w=-1.0))),
    ("resc flag 2", lambda: frames_of(part(), with_body(resc=2))),
    ("gid too long", lambda: frames_of(part(), with_body(gid="g" * 1000))),
    ("gid bytes", lambda: frames_of(part(), with_body(gid=b"feedface"))),
    ("gossip heartbeat negative", lambda: frames_of(gossip(), with_body(hb=-5))),
    ("gossip peers a string", lambda: frames_of(gossip(), with_body(peers="everyone"))),
    ("gossip peer record short", lambda: frames_of(gossip(), with_body(peers=[["ab", "tcp://127.0.0.1:9"]]))),
    ("map with int keys", lambda: frames_of(gossip(), set_item(4, {1: 2}))),
]


@pytest.mark.parametrize("build", [b for _, b in UNDECODABLE], ids=[n for n, _ in UNDECODABLE])
def test_undecodable_message_is_dropped_and_counted(pair, ctx, build) -> None:
    a, b = pair
    frames = build()
    with pytest.raises(InvalidMessage):
        wire.decode(frames, wire.WireLimits(max_frame_bytes=MAX_MSG))
    before, tensors = a.stats, snapshot(a)
    sock = send_raw(ctx, a.endpoint, frames)
    wait_for(lambda: a.stats["invalid"] == before["invalid"] + 1, 10, "the driver to count the invalid message")
    sock.close(0)
    after = a.stats
    assert after["errors"] == before["errors"] == 0, "bad input raised inside the node"
    for t0, t1 in zip(tensors, snapshot(a)):
        assert np.array_equal(t0, t1)
    assert_next_round_exact(a, b)
    assert a.stats["errors"] == 0 and b.stats["errors"] == 0


#: valid messages for a round A is not in (spoofed as coming from B) -> the node's `dropped` counter
OUT_OF_CONTEXT: list[tuple[str, Callable[[zgossip.Averager], Message]]] = [
    ("PART for an unknown group", lambda b: part(b.peer_id, b.endpoint)),
    ("RESULT for an unknown group", lambda b: make_message(
        MsgType.RESULT, b.peer_id, b.endpoint,
        {"gid": "feedfacefeedface", "owner": 0, "part": 0, "contrib": [0, 1], "resc": 0},
        (np.full(16, np.nan, np.float32),))),
    ("GATHER for an unknown group", lambda b: make_message(
        MsgType.GATHER, b.peer_id, b.endpoint, {"gid": "feedfacefeedface", "w": 1.0, "data": {"x": 1}})),
    ("ABORT for an unknown group", lambda b: make_message(
        MsgType.ABORT, b.peer_id, b.endpoint, {"gid": "feedfacefeedface", "reason": "no"})),
    # a JOIN_NOTE whose view leaves the receiver out: it may not count on this note (zgossip.matchmaking)
    ("JOIN_NOTE naming a view without the receiver", lambda b: make_message(
        MsgType.JOIN_NOTE, b.peer_id, b.endpoint,
        {"key": PREFIX, "step": "s", "bw": 1.0, "layout": "L", "want": 2, "g": 1, "rnd": 0,
         "vw": sorted([b.peer_id, "0" * 16])})),
]


@pytest.mark.parametrize("build", [b for _, b in OUT_OF_CONTEXT], ids=[n for n, _ in OUT_OF_CONTEXT])
def test_round_message_for_unknown_group_is_dropped_and_counted(pair, ctx, build) -> None:
    a, b = pair
    before, tensors = a.stats, snapshot(a)
    sock = send_raw(ctx, a.endpoint, frames_of(build(b)))
    wait_for(lambda: a.stats["dropped"] == before["dropped"] + 1, 10, "the node to count the dropped message")
    sock.close(0)
    assert a.stats["errors"] == 0
    for t0, t1 in zip(tensors, snapshot(a)):
        assert np.array_equal(t0, t1)
    assert_next_round_exact(a, b)


def _cut_lines(caplog: pytest.LogCaptureFixture, source: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "closed without goodbye" in r.getMessage() and f"connection from {source}" in r.getMessage()]


def _send_and_get_cut(ctx: zmq.Context, endpoint: str, messages: list[list[bytes]]) -> None:
    """Send `messages` on one fresh connection; the last one must make the node drop it."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    for frames in messages:
        sock.send_multipart(frames)
    assert monitor.poll(10_000), "the node did not drop the connection that sent an oversize frame"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    sock.disable_monitor()
    monitor.close(0)
    sock.close(0)


def test_oversize_frames_are_cut_by_zeromq_and_counted_with_their_source(pair, ctx, caplog) -> None:
    """MAXMSGSIZE: libzmq drops the connection that sent a frame over the limit before Python reads a
    byte of it; the node counts the cut (`connections_cut`) and logs it once per source, naming the
    source its earlier messages on that connection gave (zgossip.cuts)."""
    a, b = pair
    caplog.set_level(logging.WARNING)
    oversize_payload = np.zeros(MAX_MSG // 4 + 1024, np.float32)
    named = "5eed5eed5eed5eed"
    before, tensors = a.stats, snapshot(a)
    cases = [
        # first on its connection: no earlier message names the source
        [frames_of(part(n=oversize_payload.size))[:1] + [oversize_payload.tobytes()]],  # payload frame
        [[b"\x96" + b"\0" * (MAX_MSG + 1024)]],  # header frame
        # after a valid (out-of-context, so dropped) message that names its sender
        [frames_of(make_message(MsgType.ABORT, named, "tcp://127.0.0.1:9", {"gid": "feedfacefeedface", "reason": "x"})),
         frames_of(part(sender=named, n=oversize_payload.size))[:1] + [oversize_payload.tobytes()]],
    ]
    for k, messages in enumerate(cases, 1):
        # one at a time: a connection without a source that closes within the grace (0.5 s) of one
        # with a source is taken for the same peer's other lane (zgossip.cuts)
        _send_and_get_cut(ctx, a.endpoint, messages)
        wait_for(lambda: a.stats["connections_cut"] >= before["connections_cut"] + k, 10, "the node to count the cut")
    named_lines = _cut_lines(caplog, f"{named} at tcp://127.0.0.1:9")
    assert len(named_lines) == 1 and f"{MAX_MSG}-byte limit" in named_lines[0], named_lines
    assert len(_cut_lines(caplog, "an unknown sender")) == 1
    # a marker sent afterwards on a fresh connection is the only undecodable message Python saw: had
    # an oversize frame got through, decode would have refused (or the node dropped) it as well
    marker = send_raw(ctx, a.endpoint, _garbage())
    wait_for(lambda: a.stats["invalid"] >= before["invalid"] + 1, 10, "the marker message")
    marker.close(0)
    assert a.stats["invalid"] == before["invalid"] + 1
    assert a.stats["dropped"] == before["dropped"] + 1  # the ABORT
    assert a.stats["errors"] == 0
    for t0, t1 in zip(tensors, snapshot(a)):
        assert np.array_equal(t0, t1)
    assert_next_round_exact(a, b)
    assert b.stats["connections_cut"] == 0  # (b's peer a is alive: nothing cut)


def test_goodbye_is_no_cut_and_an_exit_without_one_is(pair, caplog) -> None:
    """A peer that leaves with a goodbye (BYE) is not counted; one whose connections close without
    it (here: shut down without BYE, as after a crash) is counted and logged once, by peer id."""
    a, b = pair
    caplog.set_level(logging.WARNING)
    before = a.stats["connections_cut"]
    x = np.zeros(NUMEL, np.float32)
    with zgossip.Averager([x.copy()], initial_peers=[a.endpoint], **KW) as polite:
        wait_for(lambda: polite.peer_id in a.peers() and a.peer_id in polite.peers(), 10, "the third peer to meet a")
        # its goodbye, and a reads it, before its sockets close (shutdown gives the BYE 20 ms to leave,
        # which a loaded machine may miss: that exit would then count, rightly, as one without goodbye)
        polite.transport.run_on_io(lambda node, now: node.leave(now), 5.0)
        wait_for(lambda: polite.peer_id in a.transport._cuts._goodbyes, 10, "a to read the goodbye")
    time.sleep(1.5)  # the cut's grace (0.5 s) is over
    assert a.stats["connections_cut"] == before
    assert not [r for r in caplog.records if "closed without goodbye" in r.getMessage()
                and r.getMessage().startswith(f"zgossip node {a.endpoint}:")]
    rude = zgossip.Averager([x.copy()], initial_peers=[a.endpoint], **KW)
    try:
        wait_for(lambda: rude.peer_id in a.peers() and a.peer_id in rude.peers(), 10, "the fourth peer to meet a")
        rude._shutdown(5.0, deliver=False)  # no BYE
        wait_for(lambda: a.stats["connections_cut"] > before, 10, "a to count the cut")
        lines = [r.getMessage() for r in caplog.records
                 if "closed without goodbye" in r.getMessage() and rude.peer_id in r.getMessage()
                 and r.getMessage().startswith(f"zgossip node {a.endpoint}:")]  # (b may count it too)
        assert len(lines) == 1, lines
    finally:
        rude.shutdown(1.0)


# --------------------------------------------------------------------------- a fake groupmate
def ranked_last(ids: list[str], tag: str) -> str:
    """A peer id that ranks below every id in `ids` for the test's key."""
    for k in range(100_000):
        pid = f"{tag}{k:012x}"
        if rendezvous_order(ids + [pid], PREFIX)[-1] == pid:
            return pid
    raise AssertionError("no id ranks last")  # pragma: no cover - 1 in 3 ids do


class FakeMember:
    """A peer made of raw sockets: joins a real group over the wire and then sends what it likes."""

    def __init__(self, ctx: zmq.Context, peer_id: str) -> None:
        self.ctx = ctx
        self.peer_id = peer_id
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.dealers: dict[str, zmq.Socket] = {}

    def msg(self, mtype: MsgType, body: dict, payload: tuple = ()) -> Message:
        return make_message(mtype, self.peer_id, self.endpoint, body, payload)

    def send(self, endpoint: str, frames: list[bytes] | Message) -> None:
        sock = self.dealers.get(endpoint)
        if sock is None:
            sock = self.dealers[endpoint] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        sock.send_multipart(frames_of(frames) if isinstance(frames, Message) else frames)

    def expect(self, mtype: MsgType, timeout: float) -> Message:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.router.poll(int(left * 1000) + 1):
                frames = self.router.recv_multipart()
                msg = wire.decode(frames[1:])
                if msg.type is mtype:
                    return msg
        raise AssertionError(f"the fake member got no {mtype.name} within {timeout}s")

    def close(self) -> None:
        for s in self.dealers.values():
            s.close(0)
        self.router.close(0)


def test_bad_parts_from_a_groupmate_in_a_live_round(ctx) -> None:
    """A real group of A, B and a fake member F (a client, bandwidth 0). While the round waits
    for F, F sends parts that do not fit the plan (wrong length, dtype, index, owner, span),
    a result it has no right to send, and a part from a non-member; then its real data.
    A and B must ignore the junk, count it, and average exactly over A, B and F."""
    rng = np.random.default_rng(8)
    # the window is long enough for F's JOIN; with three joined the group forms at once
    kw = dict(KW, target_group_size=3, min_group_size=2, matchmaking_time=2.0)
    ta = [rng.standard_normal(NUMEL).astype(np.float32)]
    tb = [rng.standard_normal(NUMEL).astype(np.float32)]
    tf = rng.standard_normal(NUMEL).astype(np.float32)
    wa, wb, wf = 1.0, 1.5, 2.0
    with zgossip.Averager(ta, **kw) as a, zgossip.Averager(tb, initial_peers=[a.endpoint], **kw) as b:
        wait_for(lambda: a.peers() == [b.peer_id] and b.peers() == [a.peer_id], 10, "the two peers to meet")
        ids = [a.peer_id, b.peer_id]
        # F (and the outsider below) rank last for the key: nobody sends them a JOIN or is redirected to them
        fid, outsider_id = ranked_last(ids, "fa4e"), ranked_last(ids, "0ut5")
        rv = a if rendezvous_order(ids, PREFIX)[0] == a.peer_id else b
        fake = FakeMember(ctx, fid)
        try:
            before = {x.peer_id: x.stats for x in (a, b)}
            expect_a, expect_b = snapshot(a)[0].astype(np.float64), snapshot(b)[0].astype(np.float64)
            join = dict(key=PREFIX, step="fake-step-1", bw=0.0, layout=a.layout.fingerprint, hops=2, want=3, g=1, rnd=-1, vw=[],
                        ld=a.layout.description)
            schema = wire.SCHEMAS[MsgType.JOIN][0]
            missing = set(schema) - set(join)
            assert not missing, f"JOIN gained fields {missing}: teach this fake member about them"
            # F joins first (its pool entry acknowledged before A and B step): a pool closes as soon
            # as every peer the rendezvous knows of has joined (small swarms do not wait), and F, which
            # never gossiped, is not one of them; its JOIN names no round (-1), so its pool waits
            fake.send(rv.endpoint, fake.msg(MsgType.JOIN, {k: join[k] for k in schema}))
            fake.expect(MsgType.JOIN_ACK, 10)
            fa, fb = a.step(weight=wa, wait=False, timeout=15), b.step(weight=wb, wait=False, timeout=15)
            group = fake.expect(MsgType.GROUP, 10)
            gid = group.group_id
            members = [m.peer_id for m in group.members]
            assert sorted(members) == sorted(ids + [fid])
            ra, rb = members.index(a.peer_id), members.index(b.peer_id)
            plan = make_plan(NUMEL, [m.bandwidth for m in group.members], KW["part_size_bytes"] // 4)
            assert plan.num_parts(ra) >= 2

            def bad_part(n: int, *, dtype: Any = np.float32, owner: int = ra, index: int = 0, resc: int = 0) -> Message:
                body = {"gid": gid, "owner": owner, "part": index, "w": wf, "resc": resc}
                return fake.msg(MsgType.PART, body, (np.ones(n, dtype=dtype),))

            lo, hi = plan.part(ra, 0)
            n0 = hi - lo
            junk = [
                bad_part(n0 - 1),  # one element short
                bad_part(n0 + 1),  # one element long
                bad_part(1),
                bad_part(n0, dtype=np.float64),  # allowed dtype, but not this group's
                bad_part(n0, dtype=np.int32),
                bad_part(n0, index=plan.num_parts(ra)),  # no such part
                bad_part(n0, index=1 << 40),
                bad_part(n0, owner=7),  # no such member
                bad_part(plan.part(rb, 0)[1] - plan.part(rb, 0)[0], owner=rb),  # a span A does not own
                bad_part(n0, resc=1),  # a rescue part nobody asked for
                fake.msg(MsgType.RESULT, {"gid": gid, "owner": ra, "part": 0, "contrib": [0, 1, 2], "resc": 0},
                         (np.full(n0, 1e6, np.float32),)),  # F does not reduce A's span
            ]
            for m in junk:
                fake.send(a.endpoint, m)
            # the same part from someone who is not in the group (nodes know senders by header, not
            # socket: F's socket keeps it in order, so the round is still live when it arrives)
            fake.send(a.endpoint, part(outsider_id, "tcp://127.0.0.1:9", gid=gid, n=n0, owner=ra))

            # now F's real contribution: weight and gather to both, every part of both spans
            for ep in (a.endpoint, b.endpoint):
                fake.send(ep, fake.msg(MsgType.GATHER, {"gid": gid, "w": wf, "data": {"fake": True}}))
            for owner, ep in ((ra, a.endpoint), (rb, b.endpoint)):
                for p in range(plan.num_parts(owner)):
                    plo, phi = plan.part(owner, p)
                    body = {"gid": gid, "owner": owner, "part": p, "w": wf, "resc": 0}
                    fake.send(ep, fake.msg(MsgType.PART, body, (tf[plo:phi],)))
            ra_res, rb_res = fa.result(40), fb.result(40)

            expected = (wa * expect_a + wb * expect_b + wf * tf.astype(np.float64)) / (wa + wb + wf)
            for res, avg in ((ra_res, a), (rb_res, b)):
                assert res.complete, res
                assert set(res.contributors) == {a.peer_id, b.peer_id, fid}
                assert res.gathered[fid] == {"fake": True}
                np.testing.assert_allclose(snapshot(avg)[0], expected, rtol=1e-5, atol=1e-6)
            assert a.stats["errors"] == 0 and b.stats["errors"] == 0, "bad input raised inside the node"
            # every junk message and the outsider's part was refused *and counted* (issue 2:
            # "an invalid message is dropped with a logged warning and a counter")
            refused = drops(a) - (before[a.peer_id]["invalid"] + before[a.peer_id]["dropped"])
            assert refused >= len(junk) + 1, (
                f"A refused {len(junk) + 1} messages of the live round but its stats count {refused}: {a.stats}")
        finally:
            fake.close()
        # and A and B still average exactly between themselves (a group of 2 after the window)
        assert_next_round_exact(a, b, weights=(3.0, 1.0))


# --------------------------------------------------------------------------- decode never crashes
_LIMITS = wire.WireLimits(max_header_bytes=1 << 16, max_frame_bytes=1 << 16, max_frames=8)


def _valid_frames() -> list[list[bytes]]:
    out = [frames_of(gossip()), frames_of(part())]
    out.append(frames_of(make_message(MsgType.ABORT, "ab", "tcp://h:1", {"gid": "g", "reason": "r"})))
    out.append(frames_of(make_message(MsgType.RESULT, "ab", "tcp://h:1",
                                 {"gid": "g", "owner": 1, "part": 2, "contrib": [0, 1], "resc": 1},
                                 (np.zeros(3, np.float64),))))
    return out


_VALID = _valid_frames()

_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=8), kids, max_size=6),
    max_leaves=20,
)


def _check_decode(frames: list[bytes]) -> None:
    try:
        msg = wire.decode(frames, _LIMITS)
    except InvalidMessage:
        return
    # anything that decodes is a well-formed message whose payload matches the header
    assert isinstance(msg, Message)
    assert isinstance(msg.type, MsgType)
    assert len(msg.payload) == len(frames) - 1
    for arr, frame in zip(msg.payload, frames[1:]):
        assert arr.nbytes == len(frame)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(_VALID))), st.data())
def test_decode_of_mutated_valid_frames_only_raises_invalid_message(which: int, data: st.DataObject) -> None:
    frames = [bytearray(f) for f in _VALID[which]]
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "drop_frame", "add_frame"]))
        i = data.draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        if op == "flip" and f:
            k = data.draw(st.integers(0, len(f) - 1))
            f[k] = data.draw(st.integers(0, 255))
        elif op == "cut":
            frames[i] = f[: data.draw(st.integers(0, len(f)))]
        elif op == "insert":
            k = data.draw(st.integers(0, len(f)))
            frames[i] = f[:k] + data.draw(st.binary(min_size=1, max_size=8)) + f[k:]
        elif op == "drop_frame" and len(frames) > 1:
            del frames[i]
        elif op == "add_frame":
            frames.append(bytearray(data.draw(st.binary(max_size=16))))
    _check_decode([bytes(f) for f in frames])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_decode_of_random_bytes_only_raises_invalid_message(frames: list[bytes]) -> None:
    _check_decode(frames)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(range(len(_VALID))),
    st.integers(0, 5),
    _msgpack_values,
)
def test_decode_of_valid_header_with_one_item_replaced_only_raises_invalid_message(which: int, item: int, value: Any) -> None:
    head = msgpack.unpackb(_VALID[which][0], raw=False)
    head[item] = value
    _check_decode([msgpack.packb(head, use_bin_type=True), *_VALID[which][1:]])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(len(_VALID))), st.data())
def test_decode_of_valid_header_with_one_body_field_replaced_only_raises_invalid_message(which: int, data: st.DataObject) -> None:
    head = msgpack.unpackb(_VALID[which][0], raw=False)
    field = data.draw(st.sampled_from(sorted(head[4])))
    head[4][field] = data.draw(_msgpack_values)
    _check_decode([msgpack.packb(head, use_bin_type=True), *_VALID[which][1:]])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local Unix sockets are Linux-only")
def test_bad_input_over_the_local_socket(pair, ctx) -> None:
    """The node's local Unix socket (peers on its host use it) is the same ROUTER: same checks, same limits."""
    a, b = pair
    local = a._transport.local_address
    assert local and local.startswith("ipc://@")
    before, tensors = a.stats, snapshot(a)
    bad = [_garbage(), frames_of(part(), with_body(part=-1)), frames_of(gossip(), set_item(0, 99))]
    socks = [send_raw(ctx, local, frames) for frames in bad]
    wait_for(lambda: a.stats["invalid"] == before["invalid"] + len(bad), 10, "the driver to count the bad messages")
    for s in socks:
        s.close(0)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(local)
    sock.send_multipart(frames_of(gossip(sender="10ca110ca110ca11")))  # names its source, then
    sock.send_multipart([b"\x96" + b"\0" * (MAX_MSG + 1024)])  # oversize: libzmq drops the connection
    assert monitor.poll(10_000), "the node did not drop the local connection that sent an oversize frame"
    sock.disable_monitor()
    monitor.close(0)
    sock.close(0)
    wait_for(lambda: a.stats["connections_cut"] > before["connections_cut"], 10, "the node to count the cut")
    assert a.stats["errors"] == 0 and a.stats["dropped"] == before["dropped"]
    for t0, t1 in zip(tensors, snapshot(a)):
        assert np.array_equal(t0, t1)
    assert_next_round_exact(a, b)


def test_sending_a_part_opens_the_result_lane_to_that_peer_at_once(pair) -> None:
    """The first PART to a groupmate also connects the lane-1 DEALER (results), so its handshake
    runs while the parts stream rather than after the span is reduced (`wire.warm_lanes`)."""
    a, b = pair
    tr = a._transport
    dealers = tr.connections._dealers  # only the I/O thread changes it; read below after run_on_io returned
    assert (b.endpoint, 1) not in dealers
    tr.run_on_io(lambda node, now: tr.transmit(b.endpoint, part(a.peer_id, a.endpoint)), 5.0)
    assert (b.endpoint, 0) in dealers and (b.endpoint, 1) in dealers
    n = a.stats["connections"]
    tr.run_on_io(lambda node, now: tr.transmit(b.endpoint, part(a.peer_id, a.endpoint, index=1)), 5.0)
    assert a.stats["connections"] == n  # opened once
    wait_for(lambda: b.stats["dropped"] >= 1, 5, "b to refuse the stray part")  # no such group: a counted drop
    assert_next_round_exact(a, b)


# --------------------------------------------------------------------------- endpoints that are no address
def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def test_endpoints_that_are_no_address_open_nothing_and_are_counted(pair, ctx, caplog) -> None:
    """GROUPs naming thousands of members at "nonsense", a gossip digest of made-up peers there,
    a JOIN from no address and a REDIRECT to ipc://: each used to make the node open a DEALER and
    a monitor per send that were never closed (until libzmq aborted on "Too many open files").
    Now each is dropped where it is read, counted, logged once per source, and nothing is opened."""
    a, b = pair
    caplog.set_level(logging.WARNING)
    time.sleep(0.3)  # the pair's own connections are up
    before, fds0 = a.stats, _open_fds()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(a.endpoint)
    n_groups = 20
    for k in range(n_groups):
        members = [[f"{k:04x}{i:012x}", "nonsense", 1.0, "s", 1] for i in range(500)]
        sock.send_multipart(frames_of(make_message(MsgType.GROUP, b.peer_id, b.endpoint,
                                                   {"key": PREFIX, "gid": f"feedface{k:08x}", "members": members,
                                                    "odd": []})))
    # members at well-formed addresses, for a step the node never made: nobody is contacted
    strangers = [[f"ff{i:014x}", f"tcp://10.255.{i // 250}.{i % 250 + 1}:1", 1.0, "s", 1] for i in range(1000)]
    sock.send_multipart(frames_of(make_message(MsgType.GROUP, b.peer_id, b.endpoint,
                                               {"key": PREFIX, "gid": "feedfacefeedface", "members": strangers,
                                                "odd": []})))
    digest = [[f"bad{i:013x}", "nonsense", 1 << 40, None, {}] for i in range(255)]
    sock.send_multipart(frames_of(make_message(MsgType.GOSSIP_REPLY, b.peer_id, b.endpoint, {"hb": 1, "peers": digest})))
    sock.send_multipart(frames_of(make_message(
        MsgType.JOIN, "0123456789abcdef", "inproc://zeromq.zap.01",
        {"key": PREFIX, "step": "s", "bw": 1.0, "layout": "L", "hops": 0, "want": 2, "g": 1})))
    sock.send_multipart(frames_of(make_message(
        MsgType.REDIRECT, b.peer_id, b.endpoint, {"key": PREFIX, "step": "s", "to_id": "0" * 16, "to_ep": "ipc://@x"})))
    expected = n_groups + 1 + len(digest) + 1 + 1
    wait_for(lambda: a.stats["dropped"] >= before["dropped"] + expected, 20, "the node to count every refusal")
    time.sleep(1.0)  # several gossip ticks: the node's own timers must not try the refused peers either
    after = a.stats
    sock.close(0)
    assert after["dropped"] - before["dropped"] == expected
    assert after["send_errors"] == before["send_errors"] and after["errors"] == 0
    assert _open_fds() - fds0 < 16, "sockets were opened for endpoints that are no address"
    assert a.peers() == [b.peer_id] and b.peers() == [a.peer_id]  # nothing made up was entered or passed on
    lines = [r.getMessage() for r in caplog.records if "no address" in r.getMessage() or "never made" in r.getMessage()]
    assert 1 <= len(lines) <= 4, lines  # once per source and kind, not once per message
    assert_next_round_exact(a, b)


def test_a_connection_that_cannot_be_made_leaves_nothing_open() -> None:
    """The driver's last line: libzmq refusing an address (connect raises after the DEALER and its
    monitor were made) closes both, and the address is not tried again at each send."""
    from zgossip.connections import Connections
    from zgossip.local_ipc import LocalRoutes

    c = zmq.Context()
    try:
        poller = zmq.Poller()
        stats = {"connections": 0, "local_connections": 0}
        conns = Connections(c, poller, LocalRoutes("tcp://127.0.0.1:1", False), stats)
        c.socket(zmq.DEALER).close(0)  # the context's own threads and descriptors start with its first socket
        time.sleep(0.1)
        fds0 = _open_fds()
        for _ in range(300):
            with pytest.raises(zmq.ZMQError):
                conns.dealer("nonsense", 0)
            with pytest.raises(zmq.ZMQError):
                conns.dealer("nonsense", 1)
        assert _open_fds() - fds0 < 4 and not conns.monitors and not poller.sockets
        assert "nonsense" in conns.refused and stats["connections"] == 0
        conns.close("nonsense")  # forgetting a peer forgets that its address failed
        assert "nonsense" not in conns.refused
        conns.close_all()
    finally:
        c.destroy(linger=0)


def test_round_messages_during_matchmaking_are_bounded_and_every_discard_is_counted(ctx, caplog) -> None:
    """Round messages for groups a node is not (yet) in, sent while it is matchmaking, are kept in
    case they are its own group's (a groupmate that started first). Made-up groups' messages used
    to be held uncounted (up to 4 groups x 512 frames of any size) and thrown away silently; now
    the buffer is bounded by bytes too, what it refuses and what it later discards unused are
    counted in `dropped`, and the step averages exactly."""
    kw = dict(KW, target_group_size=3, matchmaking_time=2.0)  # the window waits its whole 2 s for c
    rng = np.random.default_rng(11)
    ta, tb = [rng.standard_normal(NUMEL).astype(np.float32)], [rng.standard_normal(NUMEL).astype(np.float32)]
    caplog.set_level(logging.INFO)
    with zgossip.Averager(ta, **kw) as a, zgossip.Averager(tb, initial_peers=[a.endpoint], **kw) as b, \
            zgossip.Averager([np.zeros(NUMEL, np.float32)], initial_peers=[a.endpoint], **kw) as c:
        wait_for(lambda: len(a.peers()) == 2 and len(b.peers()) == 2 and len(c.peers()) == 2, 10, "three peers to meet")
        before = a.stats
        expect = (snapshot(a)[0].astype(np.float64) + snapshot(b)[0]) / 2
        fa, fb = a.step(wait=False, timeout=10), b.step(wait=False, timeout=10)
        time.sleep(0.5)  # both inside their 2 s window
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(a.endpoint)
        sent = 0
        for g in range(6):  # six made-up groups (four are kept at most), small parts
            for i in range(2):
                sock.send_multipart(frames_of(part(b.peer_id, b.endpoint, gid=f"feedface{g:08x}", index=i)))
                sent += 1
        # a part larger than the whole early buffer (2 x a's 200 kB of tensors): refused at once
        sock.send_multipart(frames_of(part(b.peer_id, b.endpoint, gid="feedface00000000", n=150_000, index=5)))
        sent += 1
        ra, rb = fa.result(40), fb.result(40)
        sock.close(0)
        assert ra.complete and rb.complete
        np.testing.assert_allclose(snapshot(a)[0], expect, rtol=1e-5, atol=1e-6)
        wait_for(lambda: a.stats["dropped"] >= before["dropped"] + sent, 10, "every bogus part to be counted")
        after = a.stats
        assert after["dropped"] - before["dropped"] == sent and after["errors"] == 0
        assert any("beyond the early buffer" in r.getMessage() for r in caplog.records)
        assert any("kept while our own group was on its way" in r.getMessage() for r in caplog.records)
