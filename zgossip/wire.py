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

from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np

from .errors import InvalidMessage
from .messages import CODE_OF, DTYPES, OPTIONAL, SCHEMAS, Message, MsgType, check_body, check_info, make_message

__all__ = [
    "PROTOCOL_VERSION",
    "MsgType",
    "Message",
    "WireLimits",
    "encode",
    "decode",
    "message_nbytes",
    "make_message",
    "DTYPES",
    "SCHEMAS",
    "OPTIONAL",
    "check_info",
    "LANES",
    "lane_of",
    "warm_lanes",
]

PROTOCOL_VERSION = 1


# Lanes: a driver keeps one connection per peer and lane, and keeps order only within a lane.
# Averaged parts (RESULT) take lane 1, so they are not queued behind the bulk of PART data still
# streaming to that peer; everything else shares lane 0, in order. The ZeroMQ driver and the
# simulator both take the mapping from here (the simulator must model exactly these connections).
LANES = 2
_LANE_OF = {MsgType.RESULT: 1}
# Sending a PART to a groupmate opens the lane-1 connection to it too: in a butterfly every
# member that owns a span both sends parts to and owes results to every other, so that
# connection will carry results soon. Opened with the first part, its TCP and ZMTP (and CURVE)
# handshakes run while the parts stream, instead of after the span is reduced, when the first
# result would otherwise wait for them: 3.5 round trips plain, two more with CURVE.
_WARM = {MsgType.PART: (1,)}


def lane_of(mtype: MsgType) -> int:
    """The connection (0 or 1) a message of this type travels on."""
    return _LANE_OF.get(mtype, 0)


def warm_lanes(mtype: MsgType) -> tuple[int, ...]:
    """Lanes whose connection to the same peer a driver opens (if not open) when it sends this type."""
    return _WARM.get(mtype, ())


@dataclass(frozen=True)
class WireLimits:
    """Size limits enforced on every incoming message."""

    max_header_bytes: int = 1 << 20
    max_frame_bytes: int = 64 << 20
    max_frames: int = 64

    def __post_init__(self) -> None:
        if min(self.max_header_bytes, self.max_frame_bytes, self.max_frames) <= 0:
            raise ValueError("wire limits must be positive")


def _fail(what: str) -> InvalidMessage:
    return InvalidMessage(what)


def encode(msg: Message) -> list:
    """Frames for `msg`: the packed header followed by the payload arrays themselves (no copy)."""
    payload = msg.payload
    meta = [[CODE_OF[a.dtype], int(a.size)] for a in payload]
    header = msgpack.packb(
        [PROTOCOL_VERSION, int(msg.type), msg.sender, msg.endpoint, msg.body(), meta],
        use_bin_type=True,
    )
    return [header, *payload]


def message_nbytes(msg: Message) -> int:
    """Approximate bytes on the wire (payload exact, header estimated) without encoding."""
    return 64 + len(msg.FIELDS) * 16 + sum(a.nbytes for a in msg.payload)


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
    cls, values = check_body(mtype, sender, endpoint, body, len(payload_frames))
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
    return cls.trusted(*values, *payload)
