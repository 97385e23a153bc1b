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
    "header_nbytes",
    "pack_value",
    "message_nbytes",
    "make_message",
    "DTYPES",
    "SCHEMAS",
    "OPTIONAL",
    "check_info",
    "LANES",
    "lane_of",
    "warm_lanes",
    "MAX_GATHER_BYTES",
    "check_gather",
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


#: the most a step's `gather` value may take packed. It travels in the header of one GATHER message
#: to every groupmate (all to all), and receivers refuse headers past `WireLimits.max_header_bytes`
#: (1 MiB): a few scalars are what it is for.
MAX_GATHER_BYTES = 64 << 10
_GATHER_DEPTH = 32  # nesting levels a gather value may have
_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what msgpack can pack


def check_gather(value: Any, max_bytes: int = MAX_GATHER_BYTES) -> Any:
    """`value` (a step's ``gather``) as every groupmate will decode it, or TypeError / ValueError
    naming where in it the problem is. Checked where the user calls, because a value msgpack cannot
    pack fails only when the round sends it, on the I/O thread, far from the caller.

    Accepted: None, bool, int, float, str, bytes, lists / tuples (they arrive as lists) and dicts
    with str keys (receivers refuse other keys), nested at most 32 deep. numpy scalars, 0-d numpy
    arrays and one-element torch tensors become the Python scalar they hold (``.item()``).
    At most `max_bytes` packed."""
    out = _plain(value, "gather", 0)
    try:
        n = len(msgpack.packb(out, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as e:  # pragma: no cover - _plain lets only packable values by
        raise TypeError(f"gather cannot be sent: {e}") from None
    if n > max_bytes:
        raise ValueError(f"gather takes {n} bytes packed, more than the {max_bytes} allowed: it goes to every "
                         "groupmate in one message header; pass a few scalars and share bulk data otherwise")
    return out


def _plain(v: Any, where: str, depth: int) -> Any:
    """`v` with numpy / torch scalars as Python scalars and tuples as lists; raises for what cannot travel."""
    if v is None or type(v) in (bool, float, str, bytes):
        return v
    if type(v) is int:
        if not _INT_RANGE[0] <= v <= _INT_RANGE[1]:
            raise ValueError(f"{where}: int {v} is out of range (msgpack carries -2**63 .. 2**64-1)")
        return v
    if depth >= _GATHER_DEPTH:
        raise ValueError(f"{where}: nested more than {_GATHER_DEPTH} levels deep")
    if isinstance(v, (list, tuple)):
        return [_plain(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if isinstance(k, np.str_):
                k = str(k)
            if type(k) is not str:
                raise TypeError(f"{where}: key {k!r:.40} is a {type(k).__name__}; keys must be str (peers refuse "
                                "maps with other keys), e.g. {str(epoch): loss}")
            out[k] = _plain(x, f"{where}[{k!r:.40}]", depth + 1)
        return out
    if isinstance(v, np.generic) or (isinstance(v, np.ndarray) and v.ndim == 0):
        item = v.item()
        if isinstance(item, (np.generic, np.ndarray)) or type(item) in (complex,):
            raise TypeError(f"{where}: numpy {v.dtype} cannot be sent; pass an int, float, str or bytes")
        return _plain(item, where, depth + 1)
    if type(v).__module__.startswith("torch") and hasattr(v, "numel") and hasattr(v, "item"):
        if v.numel() != 1:
            raise TypeError(f"{where}: a torch tensor of {v.numel()} elements cannot be sent; gather takes "
                            "scalars (.item()) or lists (.tolist())")
        return _plain(v.item(), where, depth + 1)
    if isinstance(v, np.ndarray):
        raise TypeError(f"{where}: a numpy array of shape {v.shape} cannot be sent; gather takes scalars or "
                        "lists (.tolist())")
    if isinstance(v, bool):  # subclasses of the plain types arrive as the plain type
        return bool(v)
    if isinstance(v, int):
        return _plain(int(v), where, depth)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, str):
        return str(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise TypeError(f"{where}: {type(v).__name__} cannot be sent (gather takes None, bool, int, float, str, bytes, "
                    "lists and dicts with str keys of these)")


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


def pack_value(value: Any) -> bytes:
    """`value` (a body field's, such as a state's metadata) packed as a header carries it. Raises
    TypeError, ValueError or OverflowError (msgpack's) for a value msgpack cannot pack."""
    return msgpack.packb(value, use_bin_type=True)


def header_nbytes(msg: Message) -> int:
    """Bytes of `msg`'s packed header, which receivers refuse past `WireLimits.max_header_bytes`.
    Raises TypeError or ValueError (msgpack's) for a body msgpack cannot pack."""
    return len(encode(msg)[0])


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
