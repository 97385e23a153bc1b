"""Protocol messages: one frozen dataclass per message type, and the checks every field passes.

A message is a value: ``Part(sender, endpoint, group_id=..., owner=..., part=..., weight=...,
rescue=False, data=array)``. Building one with the ordinary constructor validates every field
(type and range, the payload's dtype against the allow-list) and raises `ProtocolError`: a bad
message built here is a bug of ours. `wire.decode` runs the very same checks on what a peer sent
and raises `InvalidMessage` (a peer's bad data, a different branch of the error hierarchy), then
builds the message with `trusted`, which skips the checks it just made. The protocol's own
hot-path messages (PART, RESULT: ~50 per peer and step) are built with `trusted` too, from
values that come straight from the group's plan.

Each class lists its fields with the key it travels under (`FIELDS`: attribute, wire key,
check, form); `body()` is the wire form of the fields (short keys, 0/1 for flags, lists for
sequences), which is what `wire.encode` packs. Nothing here knows bytes: `zgossip.wire` does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from enum import IntEnum
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from .errors import InvalidMessage, ProtocolError

__all__ = [
    "MsgType", "DTYPES", "Message", "MemberInfo", "make_message", "check_info", "SCHEMAS", "MESSAGE_CLASSES", "check_body",
    "Gossip", "GossipReply", "Join", "JoinNote", "JoinAck", "Redirect", "Group", "NoGroup", "Leave", "Bye", "OPTIONAL",
    "Gather", "Part", "Result", "Abort", "RescueCall", "Rescue", "Done", "GaveUp",
    "StateReq", "StateMeta", "StateChunk", "MAX_WEIGHT", "MAX_ROUND",
]

#: the largest weight a GATHER / PART may carry (receivers refuse more); `Averager.step` checks
#: weights against it at the call
MAX_WEIGHT = 1e30
#: the largest round number JOINs carry (`Averager.step(round=)`); and counters such as heartbeats
MAX_ROUND = 1 << 62

#: dtype allow-list: wire code -> numpy dtype (little-endian on the wire).
DTYPES: dict[str, np.dtype] = {
    "f2": np.dtype("<f2"),
    "f4": np.dtype("<f4"),
    "f8": np.dtype("<f8"),
    "i4": np.dtype("<i4"),
    "i8": np.dtype("<i8"),
    "u1": np.dtype("u1"),
}
CODE_OF = {dt: code for code, dt in DTYPES.items()}


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
    JOIN_NOTE = 17  # joiner -> every peer it expects in its group: my JOIN, and whom I expect (matchmaking)
    GATHER = 20  # member -> members: my weight and gather data
    PART = 21  # member -> span owner: one part of my tensor for your span
    RESULT = 22  # span owner -> members: one averaged part
    ABORT = 23  # member -> members: I left this round
    RESCUE_CALL = 24  # substitute -> members: send me your unresolved parts of a lost span
    RESCUE = 25  # member -> substitute: which parts of the lost span I still need
    DONE = 26  # member -> members: my round is over, I need nothing more from you
    GAVE_UP = 27  # member -> member: I gave you up in this round (you were silent); expect nothing more from me
    STATE_REQ = 30  # newcomer -> donor: send me your state
    STATE_META = 31  # donor -> newcomer: refusal, or what the state holds and its checksum
    STATE_CHUNK = 32  # donor -> newcomer: one chunk of one tensor's bytes


# ----------------------------------------------------------------------------
# field checks: each returns the (possibly normalised) value or raises InvalidMessage.
# msgpack happily decodes many mutated inputs, so every field's type and range is checked
# here, not trusted.
Check = Callable[[Any], Any]


def _str(max_len: int) -> Check:
    def check(v: Any) -> str:
        if not isinstance(v, str) or len(v) > max_len:
            raise InvalidMessage(f"expected str of at most {max_len} chars, got {type(v).__name__}")
        return v

    return check


def _bytes(max_len: int) -> Check:
    def check(v: Any) -> bytes:
        if type(v) is not bytes or len(v) > max_len:
            raise InvalidMessage(f"expected bytes of at most {max_len}, got {type(v).__name__}")
        return v

    return check


def _int(lo: int, hi: int) -> Check:
    def check(v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise InvalidMessage(f"expected int in [{lo}, {hi}], got {v!r:.40}")
        return v

    return check


def _float(lo: float, hi: float) -> Check:
    def check(v: Any) -> float:
        if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
            raise InvalidMessage(f"expected finite number in [{lo}, {hi}], got {v!r:.40}")
        return float(v)

    return check


def _list(item: Check, max_len: int) -> Check:
    def check(v: Any) -> tuple:
        if not isinstance(v, (list, tuple)) or len(v) > max_len:
            raise InvalidMessage(f"expected list of at most {max_len} items")
        return tuple(item(x) for x in v)

    return check


def _record(*items: Check) -> Check:
    def check(v: Any) -> tuple:
        if not isinstance(v, (list, tuple)) or len(v) != len(items):
            raise InvalidMessage(f"expected record of {len(items)} fields")
        return tuple(f(x) for f, x in zip(items, v))

    return check


def _any(v: Any) -> Any:  # gather data, state meta: any msgpack value; its size is bounded by the header limit
    return v


_ID = _str(64)
_EP = _str(256)
_KEY = _str(512)
_IDX = _int(0, 1 << 16)
_BIG = _int(0, MAX_ROUND)
_FLAG = _int(0, 1)
_CODEC = _int(0, 255)  # a codec id (zgossip.codecs); whether it is known is the round's check
_WEIGHT = _float(0.0, MAX_WEIGHT)
_REASON = _str(4000)


#: entries in a peer's gossiped info record: 14 of the user's (`Node.check_user_info`) and the node's
#: own ``zg.`` keys (round, prefix tag, state version and hash); receivers refuse larger records
MAX_INFO = 24
#: the most peers a JOIN's `view` may name: closing without the rendezvous peer is for small groups
MAX_VIEW = 64


def _info(v: Any) -> dict:
    """A small public record a peer gossips about itself (e.g. training progress)."""
    if not isinstance(v, dict) or len(v) > MAX_INFO:
        raise InvalidMessage(f"info must be a map of at most {MAX_INFO} entries")
    for k, x in v.items():
        if not isinstance(k, str) or len(k) > 32:
            raise InvalidMessage(f"info key {_shown(k)}: keys must be str of at most 32 characters")
        if x is not None and type(x) not in (bool, int, float, str) or (type(x) is str and len(x) > 128):
            what = f"a str of {len(x)} characters" if type(x) is str else f"a {type(x).__name__}"
            raise InvalidMessage(f"info[{k!r}] is {what}: values must be None, bool, int, float or a str of at "
                                 "most 128 characters")
        if type(x) is float and not math.isfinite(x):
            raise InvalidMessage(f"info[{k!r}] is {x!r}: floats must be finite")
    return v


def _shown(k: Any) -> str:
    """A key as an error message names it: short, whatever a peer sent."""
    return repr(k[:40]) + "..." if isinstance(k, str) and len(k) > 40 else f"{k!r}"[:60]


def check_info(info: Any) -> dict:
    """Validate a peer's public info record; raises ValueError for local misuse."""
    try:
        return _info(info)
    except InvalidMessage as e:
        raise ValueError(str(e)) from None


_SCALARS = (bool, int, float, str, type(None))


def _peer_list(v: Any) -> tuple:
    """A gossip digest: [(peer id, endpoint, heartbeat, sharing priority, info)], checked in one
    tight loop (digests are the bulk of what a node decodes, so the generic checks are too slow)."""
    if not isinstance(v, (list, tuple)) or len(v) > 4096:
        raise InvalidMessage("expected a list of at most 4096 peer records")
    for rec in v:
        if not isinstance(rec, (list, tuple)) or len(rec) != 5:
            raise InvalidMessage("peer record must have 5 fields")
        pid, ep, hb, share, info = rec
        if type(pid) is not str or len(pid) > 64 or type(ep) is not str or len(ep) > 256:
            raise InvalidMessage("bad peer id or endpoint")
        if type(hb) is not int or not 0 <= hb <= 1 << 62:
            raise InvalidMessage("bad heartbeat")
        if share is not None and (type(share) not in (int, float) or not math.isfinite(share)):
            raise InvalidMessage("bad sharing priority")
        if type(info) is not dict or len(info) > MAX_INFO:
            raise InvalidMessage(f"info must be a map of at most {MAX_INFO} entries")
        for k, x in info.items():
            t = type(x)
            if type(k) is not str or len(k) > 32 or t not in _SCALARS:
                _info(info)  # the slow path words the error precisely
            if (t is str and len(x) > 128) or (t is float and not math.isfinite(x)):
                _info(info)
    return tuple(v)


_SPEC = _record(_str(4), _list(_int(0, 1 << 40), 32))  # dtype code, shape


def _join_flags(v: Any) -> Any:
    """JOIN's `g`: flags (1 = sends GATHER, 2 = auxiliary, 4 = bandwidth measured, 8 = bandwidth="auto"
    not measured yet: `partition.plan_bandwidths`); a bool, as first released, means 0/1."""
    if type(v) is bool:
        return v
    return _int(0, 15)(v)
_MEMBER = _record(_ID, _EP, _float(0.0, 1e18), _ID, _int(0, 15))  # id, endpoint, bandwidth, step, flags as JOIN's


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """One member of a group, as the rendezvous peer announces it in GROUP."""

    peer_id: str
    endpoint: str
    bandwidth: float
    step_id: str
    gathers: int = 1  # flags: 1 = sends GATHER (it passed gather data), 2 = auxiliary (weight 0, no data),
    # 4 / 8 = `bandwidth` is a measured estimate / a placeholder of an auto peer (partition.plan_bandwidths)

    @property
    def sends_gather(self) -> bool:
        return bool(self.gathers & 1)

    @property
    def auxiliary(self) -> bool:
        return bool(self.gathers & 2)


# How a field's typed value and its wire form differ. The wire form of a node-built message is
# exactly what the untyped messages used to carry (lists, 0/1), so the packed header -- and with
# it the simulator's trace hash -- did not change with the typed messages.
_PLAIN, _BOOL, _SEQ, _MEMBERS, _SPECS, _RECORDS = range(6)


def _to_wire(form: int, v: Any) -> Any:
    if form == _PLAIN:
        return v
    if form == _BOOL:
        return int(v) if type(v) is bool else v
    if form == _SEQ:
        return list(v) if isinstance(v, tuple) else v
    if form == _MEMBERS:
        return [[m.peer_id, m.endpoint, m.bandwidth, m.step_id, m.gathers] if type(m) is MemberInfo else m for m in v]
    if form == _RECORDS:
        return [list(r) if isinstance(r, tuple) else r for r in v]
    return [[code, list(shape)] if isinstance(shape, tuple) else [code, shape] for code, shape in v]  # _SPECS


def _from_wire(form: int, v: Any) -> Any:
    """Typed value of a field that passed its check."""
    if form == _BOOL:
        return bool(v)
    if form == _MEMBERS:
        return tuple(MemberInfo(*m) for m in v)
    return v


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every protocol message: who sent it and where it listens."""

    sender: str
    endpoint: str

    type: ClassVar[MsgType]
    #: (attribute, wire key, check, form) of each body field, in wire order
    FIELDS: ClassVar[tuple[tuple[str, str, Check, int], ...]] = ()
    #: number of raw payload frames (0, or 1 for the `data` field)
    FRAMES: ClassVar[int] = 0
    #: fields a sender may leave out (added after the first release of their type), with the value
    #: they then take; the node's own messages always carry them
    OPTIONAL: ClassVar[dict[str, Any]] = {}
    #: every attribute in constructor order (sender, endpoint, fields..., data)
    NAMES: ClassVar[tuple[str, ...]] = ("sender", "endpoint")

    def __post_init__(self) -> None:
        try:
            _ID(self.sender)
            _EP(self.endpoint)
            for attr, key, check, form in self.FIELDS:
                try:
                    check(_to_wire(form, getattr(self, attr)))
                except InvalidMessage as e:
                    raise InvalidMessage(f"{key}: {e}") from None
        except InvalidMessage as e:
            raise ProtocolError(f"refusing to build an invalid {self.type.name}: {e}") from None
        for arr in self.payload:
            if not isinstance(arr, np.ndarray) or arr.dtype not in CODE_OF or arr.ndim != 1:
                raise ProtocolError("payload frames must be 1-D numpy arrays of an allowed dtype")

    @classmethod
    def trusted(cls, *values: Any) -> "Message":
        """Build from values known to be valid, in field order (sender, endpoint, fields..., data),
        without checking them: for values `wire.decode` just checked, or that the protocol takes
        from its own plan on the hot path."""
        msg = object.__new__(cls)
        for name, v in zip(cls.NAMES, values):
            object.__setattr__(msg, name, v)
        return msg

    @property
    def payload(self) -> tuple[np.ndarray, ...]:
        """The raw frames that travel beside the header."""
        return ()

    def body(self) -> dict[str, Any]:
        """The fields in wire form, keyed as on the wire."""
        return {key: _to_wire(form, getattr(self, attr)) for attr, key, _, form in self.FIELDS}

    def detached(self) -> "Message":
        """The same message with its payload copied (what a receiver gets: never a view of the sender's buffer)."""
        return self


class _WithData(Message):
    """Mixin body of the messages that carry one raw payload frame in `data`."""

    __slots__ = ()
    FRAMES: ClassVar[int] = 1

    @property
    def payload(self) -> tuple[np.ndarray, ...]:
        return (self.data,)  # type: ignore[attr-defined]

    def detached(self) -> "Message":
        values = [getattr(self, n) for n in self.NAMES]
        values[-1] = values[-1].copy()
        return type(self).trusted(*values)


def _fields(*spec: tuple[str, str, Check, int]) -> tuple:
    return spec


# ---------------------------------------------------------------------------- membership
@dataclass(frozen=True, slots=True)
class Gossip(Message):
    """Membership digest that asks for a reply: (peer id, endpoint, heartbeat, share, info) records."""

    heartbeat: int
    peers: tuple
    type: ClassVar[MsgType] = MsgType.GOSSIP
    FIELDS = _fields(("heartbeat", "hb", _BIG, _PLAIN), ("peers", "peers", _peer_list, _SEQ))


@dataclass(frozen=True, slots=True)
class GossipReply(Message):
    heartbeat: int
    peers: tuple
    type: ClassVar[MsgType] = MsgType.GOSSIP_REPLY
    FIELDS = Gossip.FIELDS


# ---------------------------------------------------------------------------- matchmaking
@dataclass(frozen=True, slots=True)
class Join(Message):
    key: str
    step_id: str
    bandwidth: float
    layout: str  # fingerprint: only equal layouts are grouped
    hops: int
    want: int
    gathers: int  # flags: 1 = it will send GATHER, 2 = auxiliary (weight 0: it brings no data)
    layout_desc: str = ""  # count, shapes and dtypes as text (zgossip.layouts), to say what differs
    round: int = -1  # the swarm round the joiner steps in (-1: not said); see zgossip.announce
    view: tuple[str, ...] = ()  # the peers the joiner expects in its group, itself included (sorted; () = not said)
    type: ClassVar[MsgType] = MsgType.JOIN
    FIELDS = _fields(("key", "key", _KEY, _PLAIN), ("step_id", "step", _ID, _PLAIN),
                     ("bandwidth", "bw", _float(0.0, 1e18), _PLAIN), ("layout", "layout", _str(128), _PLAIN),
                     ("hops", "hops", _int(0, 16), _PLAIN), ("want", "want", _IDX, _PLAIN),
                     ("gathers", "g", _join_flags, _PLAIN), ("layout_desc", "ld", _str(2048), _PLAIN),
                     ("round", "rnd", _int(-1, MAX_ROUND), _PLAIN), ("view", "vw", _list(_ID, MAX_VIEW), _SEQ))
    OPTIONAL = {"ld": "", "rnd": -1, "vw": ()}

    def body(self) -> dict[str, Any]:
        b = Message.body(self)
        if not self.view:
            del b["vw"]  # a JOIN that names no view is the JOIN of the release before views
        return b


@dataclass(frozen=True, slots=True)
class JoinNote(Message):
    """A joiner's JOIN as told to a peer it expects in its group (not a request: nobody answers).
    Every member that holds the notes of all of `view` with that same view forms the group itself
    (`zgossip.matchmaking`, "closing without the rendezvous peer")."""
    key: str
    step_id: str
    bandwidth: float
    layout: str
    want: int
    gathers: int
    round: int
    view: tuple[str, ...]
    type: ClassVar[MsgType] = MsgType.JOIN_NOTE
    FIELDS = _fields(("key", "key", _KEY, _PLAIN), ("step_id", "step", _ID, _PLAIN),
                     ("bandwidth", "bw", _float(0.0, 1e18), _PLAIN), ("layout", "layout", _str(128), _PLAIN),
                     ("want", "want", _IDX, _PLAIN), ("gathers", "g", _join_flags, _PLAIN),
                     ("round", "rnd", _int(0, MAX_ROUND), _PLAIN), ("view", "vw", _list(_ID, MAX_VIEW), _SEQ))


@dataclass(frozen=True, slots=True)
class JoinAck(Message):
    key: str
    step_id: str
    type: ClassVar[MsgType] = MsgType.JOIN_ACK
    FIELDS = _fields(("key", "key", _KEY, _PLAIN), ("step_id", "step", _ID, _PLAIN))


@dataclass(frozen=True, slots=True)
class Redirect(Message):
    key: str
    step_id: str
    to_id: str
    to_endpoint: str
    type: ClassVar[MsgType] = MsgType.REDIRECT
    FIELDS = _fields(("key", "key", _KEY, _PLAIN), ("step_id", "step", _ID, _PLAIN),
                     ("to_id", "to_id", _ID, _PLAIN), ("to_endpoint", "to_ep", _EP, _PLAIN))


@dataclass(frozen=True, slots=True)
class Group(Message):
    key: str
    group_id: str
    members: tuple[MemberInfo, ...]
    left_out: tuple[tuple[str, str], ...] = ()  # (peer id, what differs): same key, other tensor layout
    type: ClassVar[MsgType] = MsgType.GROUP
    FIELDS = _fields(("key", "key", _KEY, _PLAIN), ("group_id", "gid", _ID, _PLAIN),
                     ("members", "members", _list(_MEMBER, 4096), _MEMBERS),
                     ("left_out", "odd", _list(_record(_ID, _str(1000)), 64), _RECORDS))
    OPTIONAL = {"odd": ()}


@dataclass(frozen=True, slots=True)
class NoGroup(Message):
    key: str
    step_id: str
    reason: str
    seen: int
    retry: bool
    type: ClassVar[MsgType] = MsgType.NO_GROUP
    FIELDS = _fields(("key", "key", _KEY, _PLAIN), ("step_id", "step", _ID, _PLAIN),
                     ("reason", "reason", _REASON, _PLAIN), ("seen", "seen", _IDX, _PLAIN),
                     ("retry", "retry", _FLAG, _BOOL))


@dataclass(frozen=True, slots=True)
class Leave(Message):
    key: str
    step_id: str
    type: ClassVar[MsgType] = MsgType.LEAVE
    FIELDS = JoinAck.FIELDS


@dataclass(frozen=True, slots=True)
class Bye(Message):
    """A peer shutting down cleanly: forget me now. `heartbeat` is its last (older news is stale)."""

    heartbeat: int
    type: ClassVar[MsgType] = MsgType.BYE
    FIELDS = _fields(("heartbeat", "hb", _BIG, _PLAIN),)


# ---------------------------------------------------------------------------- all-reduce
@dataclass(frozen=True, slots=True)
class Gather(Message):
    group_id: str
    weight: float
    data: Any
    type: ClassVar[MsgType] = MsgType.GATHER
    FIELDS = _fields(("group_id", "gid", _ID, _PLAIN), ("weight", "w", _WEIGHT, _PLAIN),
                     ("data", "data", _any, _PLAIN))


@dataclass(frozen=True, slots=True, eq=False)
class Part(_WithData):
    """One part of a member's tensor for the reducer of that span (`rescue`: for a substitute)."""

    group_id: str
    owner: int
    part: int
    weight: float
    rescue: bool
    codec: int = 0  # how `data` is encoded (zgossip.codecs: 0 raw values, else uint8 bytes of that codec)
    data: np.ndarray = field(repr=False, default=None)
    type: ClassVar[MsgType] = MsgType.PART
    FIELDS = _fields(("group_id", "gid", _ID, _PLAIN), ("owner", "owner", _IDX, _PLAIN),
                     ("part", "part", _BIG, _PLAIN), ("weight", "w", _WEIGHT, _PLAIN),
                     ("rescue", "resc", _FLAG, _BOOL), ("codec", "codec", _CODEC, _PLAIN))
    # added after the first release: a raw part leaves it out (so its header is as it always was)
    OPTIONAL = {"codec": 0}

    def body(self) -> dict[str, Any]:  # the hot path: spelled out
        b = {"gid": self.group_id, "owner": self.owner, "part": self.part, "w": self.weight, "resc": int(self.rescue)}
        if self.codec:
            b["codec"] = self.codec
        return b


@dataclass(frozen=True, slots=True, eq=False)
class Result(_WithData):
    """An averaged part over `contributors` (member indices); empty `data` for a member left out of it."""

    group_id: str
    owner: int
    part: int
    contributors: tuple[int, ...]
    rescue: bool
    codec: int = 0  # as in PART
    # receipts (upload measurement, `zgossip.linkstats`): per contributor, in `contributors` order,
    # the microseconds from that contributor's first PART of the round reaching the owner to its
    # PART of this part reaching it; -1 where the owner has none (its own term). Empty: none sent.
    rx: tuple[int, ...] = ()
    data: np.ndarray = field(repr=False, default=None)
    type: ClassVar[MsgType] = MsgType.RESULT
    FIELDS = _fields(("group_id", "gid", _ID, _PLAIN), ("owner", "owner", _IDX, _PLAIN),
                     ("part", "part", _BIG, _PLAIN), ("contributors", "contrib", _list(_IDX, 4096), _SEQ),
                     ("rescue", "resc", _FLAG, _BOOL), ("codec", "codec", _CODEC, _PLAIN),
                     ("rx", "rx", _list(_int(-1, 1 << 40), 4096), _SEQ))
    OPTIONAL = {"codec": 0, "rx": ()}

    def body(self) -> dict[str, Any]:
        b = {"gid": self.group_id, "owner": self.owner, "part": self.part, "contrib": list(self.contributors),
             "resc": int(self.rescue)}
        if self.codec:
            b["codec"] = self.codec
        if self.rx:
            b["rx"] = list(self.rx)
        return b


@dataclass(frozen=True, slots=True)
class Abort(Message):
    group_id: str
    reason: str
    type: ClassVar[MsgType] = MsgType.ABORT
    FIELDS = _fields(("group_id", "gid", _ID, _PLAIN), ("reason", "reason", _REASON, _PLAIN))


@dataclass(frozen=True, slots=True)
class RescueCall(Message):
    group_id: str
    owner: int
    type: ClassVar[MsgType] = MsgType.RESCUE_CALL
    FIELDS = _fields(("group_id", "gid", _ID, _PLAIN), ("owner", "owner", _IDX, _PLAIN))


@dataclass(frozen=True, slots=True)
class Rescue(Message):
    group_id: str
    owner: int
    need: tuple[int, ...]
    type: ClassVar[MsgType] = MsgType.RESCUE
    FIELDS = _fields(("group_id", "gid", _ID, _PLAIN), ("owner", "owner", _IDX, _PLAIN),
                     ("need", "need", _list(_BIG, 1 << 20), _SEQ))


@dataclass(frozen=True, slots=True)
class Done(Message):
    group_id: str
    type: ClassVar[MsgType] = MsgType.DONE
    FIELDS = _fields(("group_id", "gid", _ID, _PLAIN),)


@dataclass(frozen=True, slots=True)
class GaveUp(Message):
    """To a groupmate this member declared lost while it may be alive (silent past its limit, or
    given up by a substitute's call): it gets nothing more from this member in the round, so it
    settles what it still waits for from it as unchanged at once instead of timing it out."""

    group_id: str
    type: ClassVar[MsgType] = MsgType.GAVE_UP
    FIELDS = _fields(("group_id", "gid", _ID, _PLAIN),)


# ---------------------------------------------------------------------------- state download
@dataclass(frozen=True, slots=True)
class StateReq(Message):
    """``count`` 0: send me your snapshot's STATE_META; else chunks ``first..first+count-1`` of snapshot ``root``."""

    req: str
    root: str = ""
    first: int = 0
    count: int = 0
    type: ClassVar[MsgType] = MsgType.STATE_REQ
    FIELDS = _fields(("req", "req", _ID, _PLAIN), ("root", "root", _str(64), _PLAIN),
                     ("first", "first", _int(0, 1 << 32), _PLAIN), ("count", "n", _int(0, 1 << 16), _PLAIN))
    OPTIONAL = {"root": "", "first": 0, "n": 0}


@dataclass(frozen=True, slots=True)
class StateMeta(Message):
    """A donor's answer: a refusal (`ok` False, `reason`), or the state's layout, the digest of each
    chunk (`hashes`, 16 bytes each: see `zgossip.state`) and the root digest over them (`digest`)."""

    req: str
    ok: bool
    reason: str
    meta: Any
    specs: tuple  # (dtype code, shape) per tensor
    chunk_bytes: int
    digest: str  # the state's root (zgossip.state): covers the layout, codecs and chunk digests
    hashes: bytes = b""
    codecs: tuple = ()  # wire codec per tensor (zgossip.codecs); () = every tensor raw
    type: ClassVar[MsgType] = MsgType.STATE_META
    FIELDS = _fields(("req", "req", _ID, _PLAIN), ("ok", "ok", _FLAG, _BOOL), ("reason", "reason", _REASON, _PLAIN),
                     ("meta", "meta", _any, _PLAIN), ("specs", "specs", _list(_SPEC, 1 << 16), _SPECS),
                     ("chunk_bytes", "chunk_bytes", _int(1, 1 << 40), _PLAIN), ("digest", "digest", _str(64), _PLAIN),
                     ("hashes", "hashes", _bytes(16 << 15), _PLAIN), ("codecs", "codecs", _list(_CODEC, 1 << 16), _SEQ))
    OPTIONAL = {"hashes": b"", "codecs": ()}

    def body(self) -> dict[str, Any]:
        b = Message.body(self)
        if not self.codecs:
            del b["codecs"]  # an uncompressed state's header is as it always was
        return b


@dataclass(frozen=True, slots=True, eq=False)
class StateChunk(_WithData):
    req: str
    index: int
    tensor: int
    offset: int
    data: np.ndarray = field(repr=False)
    type: ClassVar[MsgType] = MsgType.STATE_CHUNK
    FIELDS = _fields(("req", "req", _ID, _PLAIN), ("index", "idx", _BIG, _PLAIN), ("tensor", "tensor", _IDX, _PLAIN),
                     ("offset", "offset", _BIG, _PLAIN))


#: the class of each message type
MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.type: cls for cls in (Gossip, GossipReply, Join, JoinNote, JoinAck, Redirect, Group, NoGroup, Leave, Bye, Gather, Part,
                              Result, Abort, RescueCall, Rescue, Done, GaveUp, StateReq, StateMeta, StateChunk)
}
for _cls in MESSAGE_CLASSES.values():
    _cls.NAMES = tuple(f.name for f in dataclass_fields(_cls))
    assert _cls.NAMES[2:] == tuple(a for a, _, _, _ in _cls.FIELDS) + (("data",) if _cls.FRAMES else ())

#: fields a sender may leave out, per type, with the value they then take
OPTIONAL: dict[MsgType, dict[str, Any]] = {t: cls.OPTIONAL for t, cls in MESSAGE_CLASSES.items() if cls.OPTIONAL}

#: body schema of each message type, keyed as on the wire: key -> check; plus the number of payload frames.
SCHEMAS: dict[MsgType, tuple[dict[str, Check], int]] = {
    t: ({key: check for _, key, check, _ in cls.FIELDS}, cls.FRAMES) for t, cls in MESSAGE_CLASSES.items()
}


def check_body(mtype: Any, sender: Any, endpoint: Any, body: Any, nframes: int) -> tuple[type[Message], list]:
    """Check a message's header fields and body as they came off the wire: its class, and its typed
    values in constructor order (payload arrays not included; the caller checks those).
    Raises `InvalidMessage` on the first problem."""
    try:
        cls = MESSAGE_CLASSES[MsgType(mtype)]
    except (ValueError, KeyError, TypeError):
        raise InvalidMessage(f"unknown message type {mtype!r:.20}") from None
    _ID(sender)
    _EP(endpoint)
    fields_ = cls.FIELDS
    optional = cls.OPTIONAL
    if optional and isinstance(body, dict) and not body.keys() >= optional.keys():
        body = {**optional, **body}
    if not isinstance(body, dict) or len(body) != len(fields_) or any(key not in body for _, key, _, _ in fields_):
        raise InvalidMessage(f"{cls.type.name}: body fields do not match the schema")
    if nframes != cls.FRAMES:
        raise InvalidMessage(f"{cls.type.name}: expected {cls.FRAMES} payload frames, got {nframes}")
    values = [sender, endpoint]
    for attr, key, check, form in fields_:
        try:
            v = check(body[key])
        except InvalidMessage as e:
            raise InvalidMessage(f"{cls.type.name}.{key}: {e}") from None
        values.append(_from_wire(form, v) if form == _BOOL or form == _MEMBERS else v)
    return cls, values


def make_message(mtype: MsgType, sender: str, endpoint: str, body: Mapping[str, Any],
                 payload: tuple[np.ndarray, ...] = ()) -> Message:
    """Build a message from its wire-form body (short keys, as `Message.body` gives them), checked
    as `wire.decode` checks it; raises `ProtocolError`. For tests and tools that speak in bodies."""
    payload = tuple(payload)
    try:
        cls, values = check_body(mtype, sender, endpoint, dict(body), len(payload))
    except InvalidMessage as e:
        raise ProtocolError(f"refusing to build an invalid message: {e}") from None
    for arr in payload:
        if not isinstance(arr, np.ndarray) or arr.dtype not in CODE_OF or arr.ndim != 1:
            raise ProtocolError("payload frames must be 1-D numpy arrays of an allowed dtype")
    return cls.trusted(*values, *payload)
