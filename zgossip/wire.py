"""Wire format: message dataclasses <-> ZeroMQ frames, and validation of everything that arrives.

A message travels as ``[header, *payload]``. The header is a small msgpack array
``[version, type, sender_id, sender_endpoint, body, payload_meta]``; each payload
frame is the raw bytes of one contiguous numpy array, described in ``payload_meta``
by ``[dtype_code, count]``. Payloads never pass through msgpack (packing 64 MiB
costs ~75 ms and two copies) and nothing is ever pickled.

`decode` checks version, type, every body field's type and range, the dtype
allow-list, frame lengths against the header and the size limits, and raises
`InvalidMessage` on the first problem. This is the only module that knows bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, Mapping, Sequence

import msgpack
import numpy as np

from .errors import InvalidMessage, ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "MsgType",
    "Message",
    "WireLimits",
    "encode",
    "decode",
    "message_nbytes",
    "DTYPES",
    "check_info",
    "LANES",
    "lane_of",
]

PROTOCOL_VERSION = 1

#: dtype allow-list: wire code -> numpy dtype (little-endian on the wire).
DTYPES: dict[str, np.dtype] = {
    "f2": np.dtype("<f2"),
    "f4": np.dtype("<f4"),
    "f8": np.dtype("<f8"),
    "i4": np.dtype("<i4"),
    "i8": np.dtype("<i8"),
    "u1": np.dtype("u1"),
}
_CODE_OF = {dt: code for code, dt in DTYPES.items()}


class MsgType(IntEnum):
    GOSSIP = 1  # membership digest, asks for a reply
    GOSSIP_REPLY = 2  # membership digest, no reply
    JOIN = 10  # joiner -> rendezvous peer: put me in a group for `key`
    JOIN_ACK = 11  # rendezvous peer -> joiner: you are queued
    REDIRECT = 12  # rendezvous peer -> joiner: ask `to` instead
    GROUP = 13  # rendezvous peer -> each member: your group
    NO_GROUP = 14  # rendezvous peer -> joiner: window over, no group (reason inside)
    LEAVE = 15  # joiner -> rendezvous peer: I stopped waiting
    BYE = 16  # a peer shutting down cleanly -> every peer it knows: forget me now (membership)
    GATHER = 20  # member -> members: my weight and gather data
    PART = 21  # member -> span owner: one part of my tensor for your span
    RESULT = 22  # span owner -> members: one averaged part
    ABORT = 23  # member -> members: I left this round
    RESCUE_CALL = 24  # substitute -> members: send me your unresolved parts of a lost span
    RESCUE = 25  # member -> substitute: which parts of the lost span I still need
    DONE = 26  # member -> members: my round is over, I need nothing more from you
    STATE_REQ = 30  # newcomer -> donor: send me your state
    STATE_META = 31  # donor -> newcomer: refusal, or what the state holds and its checksum
    STATE_CHUNK = 32  # donor -> newcomer: one chunk of one tensor's bytes


# Lanes: a driver keeps one connection per peer and lane, and keeps order only within a lane.
# Averaged parts (RESULT) take lane 1, so they are not queued behind the bulk of PART data still
# streaming to that peer; everything else shares lane 0, in order. The ZeroMQ driver and the
# simulator both take the mapping from here (the simulator must model exactly these connections).
LANES = 2
_LANE_OF = {MsgType.RESULT: 1}


def lane_of(mtype: MsgType) -> int:
    """The connection (0 or 1) a message of this type travels on."""
    return _LANE_OF.get(mtype, 0)


@dataclass(frozen=True)
class WireLimits:
    """Size limits enforced on every incoming message."""

    max_header_bytes: int = 1 << 20
    max_frame_bytes: int = 64 << 20
    max_frames: int = 64

    def __post_init__(self) -> None:
        if min(self.max_header_bytes, self.max_frame_bytes, self.max_frames) <= 0:
            raise ValueError("wire limits must be positive")


# ----------------------------------------------------------------------------
# field validators: each returns the (possibly normalised) value or raises
# InvalidMessage. msgpack happily decodes many mutated inputs, so every field's
# type and range is checked here, not trusted.
Validator = Callable[[Any], Any]


def _fail(what: str) -> InvalidMessage:
    return InvalidMessage(what)


def _str(max_len: int) -> Validator:
    def check(v: Any) -> str:
        if not isinstance(v, str) or len(v) > max_len:
            raise _fail(f"expected str of at most {max_len} chars, got {type(v).__name__}")
        return v

    return check


def _int(lo: int, hi: int) -> Validator:
    def check(v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise _fail(f"expected int in [{lo}, {hi}], got {v!r:.40}")
        return v

    return check


def _float(lo: float, hi: float) -> Validator:
    def check(v: Any) -> float:
        if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
            raise _fail(f"expected finite number in [{lo}, {hi}], got {v!r:.40}")
        return float(v)

    return check


def _list(item: Validator, max_len: int) -> Validator:
    def check(v: Any) -> tuple:
        if not isinstance(v, (list, tuple)) or len(v) > max_len:
            raise _fail(f"expected list of at most {max_len} items")
        return tuple(item(x) for x in v)

    return check


def _record(*items: Validator) -> Validator:
    def check(v: Any) -> tuple:
        if not isinstance(v, (list, tuple)) or len(v) != len(items):
            raise _fail(f"expected record of {len(items)} fields")
        return tuple(f(x) for f, x in zip(items, v))

    return check


def _any(v: Any) -> Any:  # gather data: any msgpack value; its size is bounded by the header limit
    return v


_ID = _str(64)
_EP = _str(256)
_KEY = _str(512)
_IDX = _int(0, 1 << 16)
_BIG = _int(0, 1 << 62)
_WEIGHT = _float(0.0, 1e30)
def _opt_float(v: Any) -> float | None:
    return None if v is None else _float(-1e300, 1e300)(v)


def _info(v: Any) -> dict:
    """A small public record a peer gossips about itself (e.g. training progress)."""
    if not isinstance(v, dict) or len(v) > 16:
        raise _fail("info must be a map of at most 16 entries")
    for k, x in v.items():
        if not isinstance(k, str) or len(k) > 32:
            raise _fail("info keys must be short strings")
        if x is not None and type(x) not in (bool, int, float, str) or (type(x) is str and len(x) > 128):
            raise _fail("info values must be scalars (short strings)")
        if type(x) is float and not math.isfinite(x):
            raise _fail("info floats must be finite")
    return v


def check_info(info: Any) -> dict:
    """Validate a peer's public info record; raises ValueError for local misuse."""
    try:
        return _info(info)
    except InvalidMessage as e:
        raise ValueError(str(e)) from None


_SCALARS = (bool, int, float, str, type(None))


def _peer_list(v: Any) -> tuple:
    """A gossip digest: [(peer id, endpoint, heartbeat, sharing priority, info)], checked in one
    tight loop (digests are the bulk of what a node decodes, so the generic validators are too slow)."""
    if not isinstance(v, (list, tuple)) or len(v) > 4096:
        raise _fail("expected a list of at most 4096 peer records")
    for rec in v:
        if not isinstance(rec, (list, tuple)) or len(rec) != 5:
            raise _fail("peer record must have 5 fields")
        pid, ep, hb, share, info = rec
        if type(pid) is not str or len(pid) > 64 or type(ep) is not str or len(ep) > 256:
            raise _fail("bad peer id or endpoint")
        if type(hb) is not int or not 0 <= hb <= 1 << 62:
            raise _fail("bad heartbeat")
        if share is not None and (type(share) not in (int, float) or not math.isfinite(share)):
            raise _fail("bad sharing priority")
        if type(info) is not dict or len(info) > 16:
            raise _fail("info must be a map of at most 16 entries")
        for k, x in info.items():
            t = type(x)
            if type(k) is not str or len(k) > 32 or t not in _SCALARS:
                _info(info)  # the slow path words the error precisely
            if (t is str and len(x) > 128) or (t is float and not math.isfinite(x)):
                _info(info)
    return tuple(v)
_SPEC = _record(_str(4), _list(_int(0, 1 << 40), 32))  # dtype code, shape
_MEMBER = _record(_ID, _EP, _float(0.0, 1e18), _ID, _int(0, 3))  # id, endpoint, bandwidth, step, flags (1 GATHER, 2 aux)

#: body schema of each message type: field -> validator; plus the number of payload frames.
SCHEMAS: dict[MsgType, tuple[dict[str, Validator], int]] = {
    MsgType.GOSSIP: ({"hb": _BIG, "peers": _peer_list}, 0),
    MsgType.GOSSIP_REPLY: ({"hb": _BIG, "peers": _peer_list}, 0),
    MsgType.JOIN: (
        {"key": _KEY, "step": _ID, "bw": _float(0.0, 1e18), "layout": _str(128), "hops": _int(0, 16), "want": _IDX,
         "g": _int(0, 3), "ld": _str(2048)},  # g flags: 1 = sends GATHER, 2 = auxiliary; ld: layout description (zgossip.layouts)
        0,
    ),
    MsgType.JOIN_ACK: ({"key": _KEY, "step": _ID}, 0),
    MsgType.REDIRECT: ({"key": _KEY, "step": _ID, "to_id": _ID, "to_ep": _EP}, 0),
    MsgType.GROUP: ({"key": _KEY, "gid": _ID, "members": _list(_MEMBER, 4096),
                     "odd": _list(_record(_ID, _str(1000)), 64)}, 0),  # same key, left out: layout differs
    MsgType.NO_GROUP: ({"key": _KEY, "step": _ID, "reason": _str(4000), "seen": _IDX, "retry": _int(0, 1)}, 0),
    MsgType.LEAVE: ({"key": _KEY, "step": _ID}, 0),
    MsgType.BYE: ({"hb": _BIG}, 0),  # the leaver's last heartbeat: older news of it is stale
    MsgType.GATHER: ({"gid": _ID, "w": _WEIGHT, "data": _any}, 0),
    MsgType.PART: ({"gid": _ID, "owner": _IDX, "part": _BIG, "w": _WEIGHT, "resc": _int(0, 1)}, 1),
    MsgType.RESULT: (
        {"gid": _ID, "owner": _IDX, "part": _BIG, "contrib": _list(_IDX, 4096), "resc": _int(0, 1)},
        1,
    ),
    MsgType.ABORT: ({"gid": _ID, "reason": _str(4000)}, 0),
    MsgType.RESCUE_CALL: ({"gid": _ID, "owner": _IDX}, 0),
    MsgType.RESCUE: ({"gid": _ID, "owner": _IDX, "need": _list(_BIG, 1 << 20)}, 0),
    MsgType.DONE: ({"gid": _ID}, 0),
    MsgType.STATE_REQ: ({"req": _ID}, 0),
    MsgType.STATE_META: (
        {"req": _ID, "ok": _int(0, 1), "reason": _str(4000), "meta": _any, "specs": _list(_SPEC, 1 << 16),
         "chunk_bytes": _int(1, 1 << 40), "digest": _str(64)},
        0,
    ),
    MsgType.STATE_CHUNK: ({"req": _ID, "idx": _BIG, "tensor": _IDX, "offset": _BIG}, 1),
}


#: fields a sender may leave out, with the value they then take (added after the first release of
#: their message type; receivers read them with ``msg.body.get(name, default)``)
OPTIONAL: dict[MsgType, dict[str, Any]] = {
    MsgType.JOIN: {"ld": ""},
    MsgType.GROUP: {"odd": ()},
}


@dataclass(frozen=True)
class Message:
    """One protocol message. Validated on construction: building a bad one is a bug."""

    type: MsgType
    sender: str
    endpoint: str
    body: Mapping[str, Any] = field(default_factory=dict)
    payload: tuple[np.ndarray, ...] = ()

    def __post_init__(self) -> None:
        try:
            _validate(self.type, self.sender, self.endpoint, self.body, len(self.payload))
        except InvalidMessage as e:
            raise ProtocolError(f"refusing to build an invalid {self.type!r}: {e}") from None
        for arr in self.payload:
            if not isinstance(arr, np.ndarray) or arr.dtype not in _CODE_OF or arr.ndim != 1:
                raise ProtocolError("payload frames must be 1-D numpy arrays of an allowed dtype")

    def __getitem__(self, name: str) -> Any:
        return self.body[name]

    @classmethod
    def _trusted(cls, mtype: MsgType, sender: str, endpoint: str, body: Mapping[str, Any],
                 payload: tuple[np.ndarray, ...]) -> "Message":
        """Build without re-validating: only for fields that were just validated (decode) or
        copied from an already valid message."""
        msg = object.__new__(cls)
        object.__setattr__(msg, "type", mtype)
        object.__setattr__(msg, "sender", sender)
        object.__setattr__(msg, "endpoint", endpoint)
        object.__setattr__(msg, "body", body)
        object.__setattr__(msg, "payload", payload)
        return msg


def _validate(mtype: Any, sender: Any, endpoint: Any, body: Any, nframes: int) -> dict:
    try:
        mtype = MsgType(mtype)
    except ValueError:
        raise _fail(f"unknown message type {mtype!r:.20}") from None
    _ID(sender)
    _EP(endpoint)
    schema, want_frames = SCHEMAS[mtype]
    optional = OPTIONAL.get(mtype)
    if optional and isinstance(body, dict) and not body.keys() >= optional.keys():
        body = {**optional, **body}
    if not isinstance(body, dict) or body.keys() != schema.keys():
        raise _fail(f"{mtype.name}: body fields do not match the schema")
    if nframes != want_frames:
        raise _fail(f"{mtype.name}: expected {want_frames} payload frames, got {nframes}")
    out = {}
    for name, check in schema.items():
        try:
            out[name] = check(body[name])
        except InvalidMessage as e:
            raise _fail(f"{mtype.name}.{name}: {e}") from None
    return out


def encode(msg: Message) -> list:
    """Frames for `msg`: the packed header followed by the payload arrays themselves (no copy)."""
    meta = [[_CODE_OF[a.dtype], int(a.size)] for a in msg.payload]
    header = msgpack.packb(
        [PROTOCOL_VERSION, int(msg.type), msg.sender, msg.endpoint, dict(msg.body), meta],
        use_bin_type=True,
    )
    return [header, *msg.payload]


def message_nbytes(msg: Message) -> int:
    """Approximate bytes on the wire (payload exact, header estimated) without encoding."""
    return 64 + len(msg.body) * 16 + sum(a.nbytes for a in msg.payload)


def _buffer_len(frame: Any) -> int:
    return memoryview(frame).nbytes


def decode(frames: Sequence[Any], limits: WireLimits = WireLimits()) -> Message:
    """Parse and validate `frames` (bytes, memoryviews or zmq.Frame buffers). Raises InvalidMessage."""
    if not frames:
        raise _fail("empty message")
    if len(frames) > limits.max_frames + 1:
        raise _fail(f"too many frames ({len(frames)})")
    raw = frames[0]
    if _buffer_len(raw) > limits.max_header_bytes:
        raise _fail("header exceeds the size limit")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise _fail(f"header is not msgpack: {type(e).__name__}") from None
    if not isinstance(header, list) or len(header) != 6:
        raise _fail("header must be a 6-item array")
    version, mtype, sender, endpoint, body, meta = header
    if version != PROTOCOL_VERSION:
        raise _fail(f"protocol version {version!r:.20} (this node speaks {PROTOCOL_VERSION})")
    payload_frames = frames[1:]
    body = _validate(mtype, sender, endpoint, body, len(payload_frames))
    if not isinstance(meta, list) or len(meta) != len(payload_frames):
        raise _fail("payload description does not match the frames")
    payload = []
    for (spec, frame) in zip(meta, payload_frames):
        if not isinstance(spec, list) or len(spec) != 2:
            raise _fail("bad payload description")
        code, count = spec
        if not isinstance(code, str) or code not in DTYPES:
            raise _fail(f"dtype {code!r:.20} is not allowed")
        dtype = DTYPES[code]
        if type(count) is not int or count < 0:
            raise _fail("bad element count")
        nbytes = _buffer_len(frame)
        if nbytes > limits.max_frame_bytes:
            raise _fail("payload frame exceeds the size limit")
        if nbytes != count * dtype.itemsize:
            raise _fail(f"frame holds {nbytes} bytes, header says {count} x {dtype}")
        payload.append(np.frombuffer(frame, dtype=dtype, count=count))
    return Message._trusted(MsgType(mtype), sender, endpoint, body, tuple(payload))
