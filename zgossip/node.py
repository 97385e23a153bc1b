"""The protocol node: membership + matchmaking + all-reduce, as one sans-IO state machine.

A driver (ZeroMQ or SimPy) feeds it with `on_message`, `on_timer` and `submit_step`,
always passing the current time, asks `next_deadline()` when to call again, and
carries out the plain-data actions it drains with `take_actions()` (`zgossip.actions`,
re-exported here) with `zgossip.actions.execute`. Messages a node sends to itself (it can be
its own rendezvous peer) are delivered inside the node without touching the driver.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import numbers
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import numpy as np

from . import announce, autogrid, layouts
from .actions import Connect, Disconnect, DownloadDone, DownloadFailed, Send, ServeState, StepDone, StepFailed, StepProgress
from .allreduce import AllReduceRound, FinishedRound, RoundOutcome, SpanOutcome
from .codecs import CodecMap
from .droplog import DropLog
from .endpoints import client_endpoint, listens, peer_check
from .errors import IllegalTransition, PeerLost, ProtocolError, RoundTimeout, StepInProgress
from .grid import MoshpitGrid
from .linkstats import LinkStats, valid_rate
from .matchmaking import NOTES_MAX, GroupSpec, Matchmaker
from .partition import MEASURED, UNMEASURED
from .membership import Membership
from .messages import (
    Abort, Bye, Done, Gather, GaveUp, Gossip, GossipReply, Group, Join, JoinAck, JoinNote, Leave, Message, NoGroup, Part, Redirect,
    Rescue, RescueCall, Result, StateChunk, StateMeta, StateReq, check_info,
)
from .ratelimit import SourceLimits
from .repair import HASH_KEY, VERSION_KEY, Verdict, read_mark, vote
from .state import StateDonor, StateDownload, StateSnapshot
from .view import MembershipView

__all__ = [
    "NodeConfig", "StepRequest", "StepResult", "Node", "Send", "StepDone", "StepFailed", "Disconnect", "Connect", "StepPhase",
    "ServeState", "DownloadDone", "DownloadFailed", "StepProgress",
]

log = logging.getLogger(__name__)


#: `NodeConfig` fields that must be ints, and those that are seconds (finite numbers)
_CONFIG_INTS = frozenset(("target_group_size", "min_group_size", "part_size_bytes", "fanout", "early_buffer_messages",
                          "max_state_bytes", "state_chunk_bytes", "state_donors", "control_burst", "warm_peers",
                          "matchmaking_burst"))
_CONFIG_SECONDS = frozenset(("matchmaking_time", "request_timeout", "straggler_grace", "part_timeout",
                             "allreduce_timeout", "gossip_interval", "peer_timeout", "repair_timeout"))


@dataclass(frozen=True)
class NodeConfig:
    """Protocol settings. Times are in seconds of whatever clock the driver uses."""

    prefix: str = "zgossip"
    target_group_size: int = 16
    min_group_size: int = 2
    matchmaking_time: float = 1.0  # rendezvous window from the first join
    request_timeout: float = 0.5  # wait for a JOIN_ACK before trying the next candidate
    straggler_grace: float = 0.02  # a full group still waits this long, to cut an overfull line evenly
    part_size_bytes: int = 4 << 20
    part_timeout: float = 5.0  # a member silent this long while owing data is excluded
    allreduce_timeout: float = 60.0
    gossip_interval: float = 0.5
    peer_timeout: float = 5.0
    fanout: int = 2
    bandwidth: float | str = 1.0  # link rate (any unit every peer shares; 0 = client) or "auto": measured, Mbit/s
    grid: tuple[int, ...] = ()
    grid_coords: tuple[int, ...] | None = None
    grid_auto: bool = False  # the grid's shape follows the swarm's gossiped size (zgossip.autogrid)
    early_buffer_messages: int = 512  # round messages kept while our GROUP is still on its way
    # ... and their payload bytes at most (None: twice this peer's tensor bytes, at least four
    # parts): what groupmates that started first may send us before our GROUP arrives, or while a
    # held step awaits its trigger, is about one model's worth of parts; more is refused (counted)
    early_buffer_bytes: int | None = None
    max_state_bytes: int = 1 << 36  # largest state a download accepts
    # state chunks: the unit of transfer and of the digests; part of the state hash peers vote on
    # (zgossip.repair), so it must be equal across the swarm
    state_chunk_bytes: int = 4 << 20
    state_donors: int = 4  # a download fetches chunks from up to this many donors at once
    self_repair: bool = True  # a peer outvoted on its published state hash downloads the majority's
    repair_timeout: float = 120.0
    # adaptive deadlines (zgossip.linkstats.silence_limit): a member measured fast is given up after
    # `deadline_slack` x its pace for one part, at least `part_timeout_floor`; None = fixed part_timeout
    part_timeout_floor: float | None = 2.0
    deadline_slack: float = 4.0
    # control messages (gossip, joins, state requests, goodbyes) taken per second from one source,
    # and at once; more are dropped and counted (`zgossip.ratelimit`). The rate is at least
    # 4 / gossip_interval: an honest source sends about one gossip and one reply per interval.
    control_rate: float = 50.0
    control_burst: int = 100
    # matchmaking messages (JOIN, JOIN_NOTE, LEAVE) have a bucket of their own per source: an honest
    # groupmate sends us up to ~3 per step (its JOIN if we are the rendezvous peer, its note, a LEAVE),
    # so a swarm stepping small tensors back to back (45 steps a second in the simulator) went past the
    # control rate, lost JOINs and notes, and split into a group that counted a member that never knew
    # of it. 500 a second serves ~150 steps a second and still stops a flood.
    matchmaking_rate: float = 500.0
    matchmaking_burst: int = 200
    # connections opened as soon as a peer is met (`Connect`), up to this many peers: their TCP,
    # ZMTP and CURVE handshakes (3.5-5.5 round trips) are then done before the first step needs
    # them instead of inside its matchmaking; further peers are connected on first use. 0 = never.
    warm_peers: int = 16

    def __post_init__(self) -> None:
        # types first: hivemind's None defaults (target_group_size, allreduce_timeout, ...) used to fail below
        # as "'<=' not supported between instances of 'int' and 'NoneType'"
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _CONFIG_INTS and (type(v) is bool or not isinstance(v, numbers.Integral)):
                raise ValueError(f"{f.name} must be an int, not {v!r}")
            if f.name in _CONFIG_SECONDS and (isinstance(v, bool) or not isinstance(v, numbers.Real)
                                              or not math.isfinite(v)):
                raise ValueError(f"{f.name} must be a finite number of seconds, not {v!r} (every wait here has a "
                                 "deadline: there is no 'None = no limit')")
        for name in ("control_rate", "matchmaking_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < math.inf:
                # (a NaN rate switched the limit off without a word; 0 failed later, naming no setting)
                raise ValueError(f"{name} must be a finite number of messages per second > 0, not {v!r}")
        if self.fanout < 1:
            # 0: the node stopped gossiping once it knew a peer, and the others expired it; < 0 failed
            # at every gossip tick inside the I/O loop
            raise ValueError(f"fanout must be at least 1 (peers gossiped to per gossip_interval), not {self.fanout!r}")
        for name in ("control_burst", "matchmaking_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (messages taken at once), not {getattr(self, name)!r}")
        if not 1 <= self.min_group_size <= self.target_group_size:
            raise ValueError(f"need 1 <= min_group_size <= target_group_size (got min_group_size={self.min_group_size}, "
                             f"target_group_size={self.target_group_size})")
        if self.part_size_bytes < 16:
            raise ValueError("part_size_bytes must be at least 16")
        if self.state_chunk_bytes < 16 or self.state_donors < 1:
            raise ValueError("need state_chunk_bytes >= 16 and state_donors >= 1")
        if isinstance(self.bandwidth, str):
            if self.bandwidth != "auto":
                raise ValueError(f"bandwidth must be a number >= 0 or 'auto', not {self.bandwidth!r}")
        elif isinstance(self.bandwidth, bool) or not isinstance(self.bandwidth, numbers.Real):
            raise ValueError(f"bandwidth must be a number >= 0 or 'auto', not {self.bandwidth!r}")
        elif not self.bandwidth >= 0 or self.bandwidth == float("inf"):
            raise ValueError("bandwidth must be finite and >= 0 (0 = client)")
        if self.part_timeout_floor is not None and not 0 < self.part_timeout_floor:
            raise ValueError("part_timeout_floor must be positive (or None: fixed part_timeout)")
        if not self.deadline_slack >= 1:
            raise ValueError("deadline_slack must be >= 1")
        if self.warm_peers < 0:
            raise ValueError("warm_peers must be >= 0")
        if self.early_buffer_messages < 0 or (self.early_buffer_bytes is not None and self.early_buffer_bytes < 0):
            raise ValueError("early_buffer_messages and early_buffer_bytes must be >= 0")
        if self.part_timeout <= 0 or self.allreduce_timeout <= 0:
            raise ValueError(f"part_timeout and allreduce_timeout must be > 0 seconds, not {self.part_timeout!r} "
                             f"and {self.allreduce_timeout!r}")
        if not isinstance(self.prefix, str) or not self.prefix or len(self.prefix) > 200:
            # (a number failed as "object of type 'int' has no len()", naming no setting)
            raise ValueError(f"prefix must be a string of 1..200 characters, not {self.prefix!r}")
        if any(int(m) == 1 for m in self.grid):
            # on a grid that each peer has a cell of, every group along that axis is one peer: every
            # round along it failed with GroupNotFound after the whole matchmaking window
            rest = tuple(int(m) for m in self.grid if int(m) != 1)
            raise ValueError(f"grid {tuple(self.grid)} has a dimension of size 1: every peer is alone along it, so "
                             f"every round along it fails; leave it out (grid={rest})")
        if self.grid_auto and (self.grid or self.grid_coords is not None):
            raise ValueError('grid="auto" derives the shape and coordinates itself: give no grid_coords')


@dataclass(frozen=True)
class StepRequest:
    """One step. A *held* step (``held=True``, from ``Averager.step(scheduled_time=...)`` or
    ``require_trigger=True``) has no buffer yet: it may wait until ``begin_at`` before it starts
    matchmaking, and its all-reduce waits, once grouped, until `Node.trigger_step` hands it the
    snapshot (the owner does so when the user triggers, or when the node reports the step due at
    ``due_at`` with `StepProgress`). ``timeout`` then bounds matchmaking *and* the wait for the
    trigger, counted from when matchmaking begins."""

    step_id: str
    buffer: np.ndarray | None  # flat snapshot; the round writes averages into it (None: held, until triggered)
    weight: float
    gather: Any
    timeout: float  # seconds allowed for matchmaking
    layout: str  # fingerprint of numel/dtype/shapes: only equal layouts are grouped
    round: int | None = None  # the swarm-wide round number (picks the grid axis); None = follow the swarm
    layout_desc: str = ""  # count, shapes and dtypes as text (zgossip.layouts): to say what differs
    codec: CodecMap | None = None  # wire compression of the buffer's ranges (in the layout, so agreed by the group)
    held: bool = False  # the all-reduce waits for trigger_step (see above)
    begin_at: float | None = None  # held: start matchmaking no earlier than this (None: at once)
    due_at: float | None = None  # held: report the step due (StepProgress(due=True)) at this time

    def __post_init__(self) -> None:
        if (self.buffer is None) != self.held:
            raise ProtocolError("a held step has no buffer yet; any other step needs one")
        if self.buffer is not None and self.buffer.ndim != 1:  # refused here, in the caller, not by the round
            raise ProtocolError(f"a step's buffer must be flat, not {self.buffer.ndim}-D ({type(self.buffer).__name__})")


@dataclass(frozen=True)
class StepResult:
    """What one step did. ``updated`` ranges of the flat buffer hold averages; the rest is unchanged."""

    group_id: str
    key: str
    members: tuple[str, ...]
    gathered: dict[str, Any]
    weights: dict[str, float]
    contributors: tuple[str, ...]
    lost: tuple[str, ...]
    complete: bool
    spans: tuple[SpanOutcome, ...]
    updated: list[tuple[int, int]]
    timings: dict[str, float]
    bytes_sent: int
    bytes_received: int
    coords: tuple[int, ...]
    # peers that stepped with the same key but could not join: their tensors differ (peer id -> what differs)
    left_out: dict[str, str] = field(default_factory=dict)
    auxiliary: tuple[str, ...] = ()  # members that only lent bandwidth (weight 0, contributed no data)
    # the silence limits the round used (seconds): "part" / "part_min" the largest / smallest for a
    # member owing data, "result" the largest for an owner owing results, "allreduce" the round's deadline
    deadlines: dict[str, float] = field(default_factory=dict)


class StepPhase(Enum):
    IDLE = "idle"
    SCHEDULED = "scheduled"  # a held step waiting for its begin_at
    MATCHMAKING = "matchmaking"
    GROUPED = "grouped"  # a held step with a group, waiting for its trigger
    AVERAGING = "averaging"


_STEP_MOVES = {
    StepPhase.IDLE: {StepPhase.MATCHMAKING, StepPhase.SCHEDULED},
    StepPhase.SCHEDULED: {StepPhase.MATCHMAKING, StepPhase.IDLE},
    StepPhase.MATCHMAKING: {StepPhase.AVERAGING, StepPhase.GROUPED, StepPhase.IDLE},
    StepPhase.GROUPED: {StepPhase.AVERAGING, StepPhase.IDLE},
    StepPhase.AVERAGING: {StepPhase.IDLE},
}

#: messages of a running all-reduce round (routed by group id)
_ROUND_MESSAGES = (Gather, Part, Result, Abort, RescueCall, Rescue, GaveUp)
#: control messages rate-limited per source (`zgossip.ratelimit`); round data is checked by the round
_LIMITED = frozenset((Gossip, GossipReply, StateReq, Bye))
#: matchmaking messages: rate-limited per source too, in a bucket sized for steps (`NodeConfig.matchmaking_rate`)
_MATCHMAKING = frozenset((Join, JoinNote, Leave))
#: chunk requests of a state download are paced, not dropped, per source: a bucket of chunks
#: (`CHUNK_RATE` a second, `CHUNK_BURST` at once -- 16 GiB/s of 4 MiB chunks) and a few requests held
#: back while it is empty (a downloader keeps at most two in flight per donor); only what exceeds
#: that is dropped (`stats["rate_limited"]`). Under the control limit they were dropped at 50 a
#: second, and each drop stalled the download for its `chunk_timeout`.
CHUNK_RATE, CHUNK_BURST = 4096.0, 1024.0
HELD_CHUNK_REQUESTS, HELD_CHUNK_SOURCES = 4, 256
#: META requests that may wait for one snapshot being taken (more are refused: retry)
MAX_SNAPSHOT_WAITERS = 256


def _layout_bytes(desc: str) -> int:
    """The bytes of the tensors a layout description (`zgossip.layouts`) lists, 0 if it cannot tell."""
    got = layouts.parse(desc)
    if got is None or got[2]:
        return 0
    try:
        return sum(int(np.prod(shape, dtype=np.int64)) * (2 if code == "bf16" else np.dtype(code).itemsize)
                   for code, shape, _ in got[1])
    except (TypeError, ValueError):
        return 0


@dataclass
class _Step:
    req: StepRequest
    started: float  # when matchmaking began (for a SCHEDULED step: when it was submitted)
    key: str
    grouped: float = 0.0
    round: AllReduceRound | None = None
    buffer: np.ndarray | None = None  # the snapshot (a held step gets it from trigger_step)
    weight: float = 0.0
    gather: Any = None
    spec: GroupSpec | None = None  # a GROUPED step's group
    due_said: bool = False  # StepProgress(due=True) went out
    gone: set = field(default_factory=set)  # GROUPED: members that aborted or whose connection dropped
    downs: list = field(default_factory=list)  # GROUPED: endpoints reported down, replayed into the round
    released: float = 0.0  # when the all-reduce began


class Node:
    def __init__(
        self,
        peer_id: str,
        endpoint: str,
        config: NodeConfig,
        rng: np.random.Generator,
        initial_peers: tuple[str, ...] = (),
        membership: MembershipView | None = None,
    ) -> None:
        """`membership` replaces the gossip membership with another `MembershipView` (the
        simulator's converged, shared view for very large swarms)."""
        self.peer_id = peer_id
        self.endpoint = endpoint
        self.config = config
        self._rng = rng
        self._actions: list = []
        self._loopback: deque[Message] = deque()
        self._warm: set[str] = set()  # endpoints a Connect was issued for (config.warm_peers at most)
        # Endpoints of forgotten peers (each got a Disconnect), and those of them sent to since (a
        # LEAVE to a rendezvous peer that died, an ABORT to a lost groupmate): such a send opens a
        # connection again that no later Disconnect would close (the peer is forgotten already), so
        # every peer that died while we waited on it left a DEALER, its monitor and their file
        # descriptors behind for good. A reopened one is closed again once it has had
        # `peer_timeout` to deliver what it carries. Both bounded.
        self._forgotten_eps: dict[str, None] = {}
        self._reopened: dict[str, float | None] = {}  # -> when a timer first saw it reopened
        self.membership: MembershipView = membership if membership is not None else Membership(
            peer_id, endpoint, self._send, rng,
            initial_peers=initial_peers, gossip_interval=config.gossip_interval,
            fanout=config.fanout, peer_timeout=config.peer_timeout,
        )
        self.matchmaker = Matchmaker(
            self.membership, self._send, rng, self._on_group, self._on_match_fail,
            target_group_size=config.target_group_size, min_group_size=config.min_group_size,
            matchmaking_time=config.matchmaking_time, request_timeout=config.request_timeout,
            straggler_grace=config.straggler_grace, expected=self._may_join, moved_on=self._moved_on,
        )
        # what completed transfers taught us: our link rate (bandwidth="auto") and groupmates' pace
        self.linkstats = LinkStats()
        if isinstance(self.membership, Membership):
            self.membership.clean_info = self._clean_info
        self.grid = MoshpitGrid(config.grid)
        self.coords = self.grid.check(config.grid_coords) if config.grid_coords is not None else self.grid.random_coords(rng)
        self.round_index = 0  # the next round this node expects; see `swarm_round`
        self._prefix_tag = announce.tag(config.prefix)
        self._size = 0  # grid="auto": this node's quantised estimate of the swarm's size (0 = none yet)
        self._user_info: dict = {}
        self.state_mark: tuple[int, str] | None = None  # the (version, root) we published (zgossip.repair)
        self._publish_round()
        self.phase = StepPhase.IDLE
        self.step: _Step | None = None
        self._early: dict[str, list[Message]] = {}  # group id -> its round messages that came before we could use them
        self._early_bytes = 0  # their payload bytes
        self._tensor_bytes = 0  # of the latest step's buffer (or layout): sizes the early buffer
        self._finished: dict[str, FinishedRound] = {}  # recent rounds, to answer late rescue messages
        # (group id, sender) of round messages for groups we are not in, already answered with ABORT
        self._disowned: dict[tuple[str, str], None] = {}
        self._gone: dict[str, frozenset[str]] = {}  # recent rounds: endpoints of the members each lost
        # Shutdown: groupmates of recent rounds that have not said DONE may still wait for results
        # of ours (queued on a slow link); `owes_others` tells the driver to keep them flowing.
        self._owed: dict[str, dict[str, str]] = {}  # gid -> {peer id: endpoint} not DONE yet
        self._done_from: dict[str, set[tuple[str, str]]] = {}  # gid -> (peer id, endpoint) that said DONE
        self.donor = StateDonor(peer_id, endpoint, self._send, config.state_chunk_bytes)
        # META requests waiting for the snapshot the owner is taking (`ServeState`): answered with it
        # together, so a burst of newcomers costs one snapshot (a copy and a hash of the whole state)
        self._snapshot_waiters: list[tuple[str, str]] = []
        self.downloads: dict[str, StateDownload] = {}
        self.stats = {"messages": 0, "dropped": 0, "late": 0, "rate_limited": 0, "repairs": 0, "repair_failures": 0,
                      "state_bad_chunks": 0, "state_refetched": 0, "state_meta_outvoted": 0, "bad_bandwidth": 0,
                      "closed_early": 0}
        self._limits = SourceLimits(max(config.control_rate, 4.0 / config.gossip_interval), config.control_burst)
        self._mm_limits = SourceLimits(config.matchmaking_rate, config.matchmaking_burst)
        self._limited_logged: set[str] = set()
        self._chunk_limits = SourceLimits(CHUNK_RATE, CHUNK_BURST)
        self._held_chunks: dict[str, deque[StateReq]] = {}  # source -> chunk requests waiting for its bucket
        #: refused input is logged once per source and kind (rounds and downloads share it)
        self.drops = DropLog(f"zgossip node {endpoint}")
        # Endpoints from the network (a message's sender, gossip entries, GROUP members, REDIRECT
        # targets) that name nothing this node could reach are refused before anything is sent to
        # them: each send to one would open a connection (file descriptors) for nothing. The
        # transport says which addresses it can reach (`accept_endpoints`).
        self.endpoint_ok: Callable[[str], bool] = peer_check(endpoint, initial_peers)
        self._good_endpoints: set[str] = set()  # endpoints that passed endpoint_ok (bounded)
        self.accept_endpoints(self.endpoint_ok)
        self.matchmaker.drops = self.drops
        self.matchmaker.knows = self._knows
        # self-repair (zgossip.repair): the last verdict, the repair under way
        self.last_verdict: Verdict | None = None
        self._repair: tuple[str, int, str, str] | None = None  # (download req, version, root, our root)
        # a repair downloaded, waiting for the owner to write it (`repair_written`): (version, root,
        # our root, snapshot, when its download began)
        self._repair_downloaded: tuple[int, str, str, Any, float] | None = None
        self._outvoted_since: float | None = None
        self._next_vote = 0.0
        self._repair_seq = 0
        self._warned_layouts: set[tuple[str, str]] = set()
        self._clients: dict[str, tuple[dict, float]] = {}  # client peer id -> (its announcement, last heard)
        mm = self.matchmaker
        #: which part of the node handles each message class
        self._handlers: dict[type[Message], Any] = {
            Gossip: self._on_gossip, GossipReply: self._on_gossip,
            Join: mm.on_join, JoinNote: mm.on_join_note, Leave: mm.on_leave, JoinAck: mm.on_join_ack, Redirect: mm.on_redirect,
            NoGroup: mm.on_no_group, Group: mm.on_group,
            Bye: self._on_bye,
            **{cls: self._round_message for cls in _ROUND_MESSAGES},
            Done: self._on_done_msg,
            StateReq: self._on_state_req, StateMeta: self._on_state_meta, StateChunk: self._on_state_chunk,
        }

    # ------------------------------------------------------------------ endpoints from the network
    def accept_endpoints(self, check: Callable[[str], bool]) -> None:
        """Use `check` (e.g. `zgossip.endpoints.reachable` for the transport's schemes) to decide which
        endpoints that peers send are addresses at all; the others are dropped and counted."""
        self.endpoint_ok = check
        self._good_endpoints.clear()
        if isinstance(self.membership, Membership):
            self.membership.endpoint_ok = check

    def _reachable(self, endpoint: str) -> bool:
        if endpoint in self._good_endpoints:
            return True
        if not self.endpoint_ok(endpoint):
            return False
        if len(self._good_endpoints) >= 4096:
            self._good_endpoints.clear()
        self._good_endpoints.add(endpoint)
        return True

    def _bad_endpoint(self, msg: Message) -> str | None:
        """The first endpoint in `msg` that is no address (its sender's, a GROUP member's, a
        REDIRECT's target), or None. Gossip entries are checked one by one by the membership."""
        if not self._reachable(msg.endpoint):
            return msg.endpoint
        if type(msg) is Group:
            for m in msg.members:
                if not self._reachable(m.endpoint):
                    return m.endpoint
        elif type(msg) is Redirect and not self._reachable(msg.to_endpoint):
            return msg.to_endpoint
        return None

    def _knows(self, peer_id: str, endpoint: str) -> bool:
        """A peer we know at `endpoint`: in the membership table, or a client that spoke to us."""
        if listens(endpoint):
            return self.membership.endpoint_of(peer_id) == endpoint
        return peer_id in self._clients and endpoint == client_endpoint(peer_id)

    # ------------------------------------------------------------------ plumbing
    def _send(self, endpoint: str, msg: Message) -> None:
        if endpoint == self.endpoint:
            self._loopback.append(msg)
        else:
            self._actions.append(Send(endpoint, msg))
            if endpoint in self._forgotten_eps and endpoint not in self._reopened:
                self._reopened[endpoint] = None

    def _drain_loopback(self, now: float) -> None:
        while self._loopback:
            self._dispatch(self._loopback.popleft(), now)

    def take_actions(self) -> list:
        out, self._actions = self._actions, []
        mem = self.membership
        forgot = set(mem.forgotten)
        for ep in mem.forgotten:
            out.append(Disconnect(ep))
            self._forget_owed(ep)
            self._warm.discard(ep)
            self._reopened.pop(ep, None)
            self._forgotten_eps.pop(ep, None)
            if len(self._forgotten_eps) >= 4096:
                self._forgotten_eps.pop(next(iter(self._forgotten_eps)))
            self._forgotten_eps[ep] = None
        mem.forgotten.clear()
        if mem.discovered:
            for ep in mem.discovered:
                if ep in forgot and not any(r.endpoint == ep for r in getattr(mem, "peers", {}).values()):
                    continue  # met and forgotten again since the last batch: no connection wanted
                self._forgotten_eps.pop(ep, None)  # a peer there again: its connection is wanted
                self._reopened.pop(ep, None)
                if len(self._warm) < self.config.warm_peers and ep not in self._warm and ep != self.endpoint:
                    self._warm.add(ep)
                    out.append(Connect(ep))
            mem.discovered.clear()
        return out

    def _move(self, phase: StepPhase) -> None:
        if phase not in _STEP_MOVES[self.phase]:
            raise IllegalTransition(f"illegal step transition {self.phase.value} -> {phase.value}")
        self.phase = phase

    def current_key(self) -> str:
        return self.grid.key(self.config.prefix, self.coords, self.round_index)

    # Round numbers. The grid axis of a round is round mod d, so peers must agree on the round:
    # each node gossips the next round it expects (with a tag of its prefix; `zgossip.announce`),
    # and a step follows the highest round announced by live peers of its prefix. A peer that sat
    # out a round (or joined late) thereby steps on the swarm's axis instead of drifting out of
    # phase for good. The announcement also names the key of that round, so that a rendezvous
    # peer knows who else may come (`_may_join`).
    _BW = "zg.bw"  # this node's link-rate estimate (Mbit/s), beside the announcement (zgossip.linkstats)

    def swarm_round(self) -> int:
        best = self.round_index
        for rec in self.membership.peers.values():
            a = announce.Announcement.read(rec.info)
            if a is not None and a.prefix == self._prefix_tag and a.round > best:
                best = a.round
        return best

    def _estimate(self) -> int:
        """grid="auto": the swarm's size as far as this node can tell (`zgossip.autogrid`): its own
        quantised count of the live peers of its prefix (kept in `_size`, announced), or the largest
        size at least two other live peers announced (`autogrid.swarm_size`). Client-mode peers
        count: they take places on the grid's lines like any peer (4 peers and 12 clients, target 4,
        took no grid, as if they were 4)."""
        mine, sizes = 1, []
        for rec in itertools.chain(self.membership.peers.values(), self.membership.clients.values()):
            a = announce.Announcement.read(rec.info)
            if a is not None and a.prefix == self._prefix_tag:
                mine += 1
                if a.size:
                    sizes.append(a.size)
        self._size = autogrid.quantise(mine, self._size)
        return autogrid.swarm_size(self._size, sizes)

    def _refresh_estimate(self) -> None:
        """grid="auto", once per gossip tick: keep the announced estimate current between rounds (the
        others' maximum follows it), and between steps take a new shape at once."""
        before = (self._size, self.grid.shape)
        if self.phase is StepPhase.IDLE:
            self._resize_grid()
        else:
            self._estimate()  # inside a step the shape stays; only the announced size moves
        if (self._size, self.grid.shape) != before:
            self._publish_round()

    def _resize_grid(self) -> bool:
        """grid="auto", at a round boundary: re-derive the grid's shape from the swarm's size
        (`zgossip.autogrid`); on a change, new random coordinates on the new grid. True if it changed."""
        if not self.config.grid_auto:
            return False
        size = self._estimate()
        shape = autogrid.shape_for(size, self.config.target_group_size)
        if shape == self.grid.shape:
            return False
        log.info("%s: grid %s -> %s (swarm size estimate %d)", self.peer_id[:8], self.grid.shape, shape, size)
        self.grid = MoshpitGrid(shape)
        self.coords = self.grid.random_coords(self._rng)
        return True

    def _publish_round(self) -> None:
        a = announce.Announcement(self._prefix_tag, self.round_index, announce.tag(self.current_key(), 4), self._size)
        info = {**self._user_info, **a.record()}
        if self.state_mark is not None:
            info[VERSION_KEY], info[HASH_KEY] = self.state_mark
        est = self.linkstats.estimate_mbit()
        if est is not None:
            # gossiped whatever `bandwidth` says: groupmates time their deadlines by it (allreduce)
            info[self._BW] = float(f"{min(est, 1e7):.4g}")  # the gossiped estimate (Mbit/s), 4 digits
        self.membership.info = info

    def _may_join(self, key: str, rnd: int, now: float) -> set[str] | None:
        """Live peers (this one included) that may still join `key` in round `rnd`: the matchmaker
        closes a pool early once all of them joined (`zgossip.announce.may_join`). A pinned round's
        key carries the round as a suffix; the announcements name the key without it."""
        pinned = f"/r{rnd}"
        base = key[: -len(pinned)] if key.endswith(pinned) else key
        ms = self.membership
        records = [(pid, rec.info) for pid, rec in ms.peers.items()]
        if listens(self.endpoint):
            records.append((self.peer_id, ms.info))
        horizon = now - self.config.peer_timeout
        records += [(pid, info) for pid, (info, seen) in self._clients.items() if seen >= horizon]
        return announce.may_join(records, self._prefix_tag, announce.tag(base, 4), rnd)

    def _moved_on(self, key: str, rnd: int, now: float) -> bool:
        """Whether the swarm went past round `rnd` of `key` without this peer (`Matchmaker`): no other
        live peer may still join it (`_may_join`), and one of its prefix already announced a later round
        (`swarm_round`)."""
        return not self._may_join(key, rnd, now) - {self.peer_id} and self.swarm_round() > rnd

    def _heard_client(self, msg: Message, now: float) -> None:
        """A client-mode peer spoke to us: a rendezvous peer keeps what it announced (in its gossip)
        here, for `_may_join`, so a small swarm with a client still waits for it. (`Membership.clients`
        also holds clients, relayed ones too, for their progress; this table is what the client told
        this peer itself, fresh from its last message.) Forgotten after peer_timeout of silence; bounded."""
        info = self._clients.get(msg.sender, ({}, 0.0))[0]
        if type(msg) in (Gossip, GossipReply) and msg.peers and msg.peers[0][0] == msg.sender:
            info = msg.peers[0][4]  # a digest starts with the sender's own record
        self._clients.pop(msg.sender, None)
        self._clients[msg.sender] = (info, now)
        while len(self._clients) > 1024:
            self._clients.pop(next(iter(self._clients)))

    def _on_gossip(self, msg: Gossip | GossipReply, now: float) -> None:
        mem = self.membership
        bad = getattr(mem, "bad_endpoints", 0)
        mem.on_gossip(msg, now)
        refused = getattr(mem, "bad_endpoints", 0) - bad
        if refused:
            self.stats["dropped"] += refused
            self.drops.note(log, f"{msg.sender[:16]} at {msg.endpoint}", "gossip entries whose endpoint is no address",
                            f"{refused} of {len(msg.peers)} entries, e.g. "
                            f"{next((e[1] for e in msg.peers if not self._reachable(e[1])), '?')!r:.80}")
        if self.matchmaker.pools:
            self.matchmaker.recheck(now)  # fresher announcements may show the last missing peers elsewhere

    def _clean_info(self, peer_id: str, info: dict) -> dict:
        """A peer's gossiped bandwidth estimate that is not a sane rate is dropped (and counted)."""
        if self._BW in info and not valid_rate(info[self._BW]):
            self.stats["bad_bandwidth"] += 1
            self.drops.note(log, peer_id, "bandwidth estimate", f"{info[self._BW]!r:.40} is no rate in Mbit/s",
                            counter="bad_bandwidth", level=logging.INFO)
            info = {k: v for k, v in info.items() if k != self._BW}
        return info

    def peer_bandwidths(self) -> dict[str, float]:
        """The link-rate estimates (Mbit/s) live peers gossiped (those that measured one), with
        this peer's own."""
        out = {pid: r.info[self._BW] for pid, r in self.membership.peers.items() if self._BW in r.info}
        own = self.linkstats.estimate_mbit()
        if own is not None:
            out[self.peer_id] = own
        return out

    def _gossiped_rate(self, peer_id: str) -> float | None:
        rec = self.membership.peers.get(peer_id)
        return rec.info.get(self._BW) if rec is not None else None

    def advertised_bandwidth(self) -> tuple[float, int]:
        """The rate this peer announces in JOIN and its flags for it (`partition.plan_bandwidths`):
        a declared number as it is; with "auto" the measured estimate (Mbit/s) when its last round
        gave a sample (`LinkStats.fresh`), else a placeholder that the plan replaces (equal spans)."""
        bw = self.config.bandwidth
        if bw != "auto":
            return float(bw), 0
        est = self.linkstats.estimate_mbit()
        if est is None or not self.linkstats.fresh:  # see LinkStats.fresh
            return 1.0, UNMEASURED
        return min(est, 1e7), MEASURED

    def _advance_round(self, to: int) -> None:
        self.round_index = to
        self._resize_grid()  # a round boundary: the announced key is then the one of the next round's grid
        self._publish_round()
        self.membership.heartbeat += 1  # fresher than what others hold, so they adopt it at once

    # ------------------------------------------------------------------ driver entry points
    def start(self, now: float) -> None:
        self.membership.start(now)
        self._drain_loopback(now)

    def submit_step(self, req: StepRequest, now: float) -> None:
        if self.phase is not StepPhase.IDLE:
            self._actions.append(StepFailed(req.step_id, StepInProgress("the previous step is still running")))
            return
        self.step = _Step(req, now, "", buffer=req.buffer, weight=req.weight, gather=req.gather)
        self._tensor_bytes = req.buffer.nbytes if req.buffer is not None else (
            _layout_bytes(req.layout_desc) or self._tensor_bytes)
        if req.held and req.begin_at is not None and req.begin_at > now:
            self._move(StepPhase.SCHEDULED)
            self._progress(StepPhase.SCHEDULED)
            return
        self._begin_matchmaking(now)

    def _progress(self, phase: StepPhase, due: bool = False) -> None:
        st = self.step
        if st is not None:
            self._actions.append(StepProgress(st.req.step_id, phase.value, due))

    def _begin_matchmaking(self, now: float) -> None:
        st = self.step
        assert st is not None
        req = st.req
        self._move(StepPhase.MATCHMAKING)
        self._progress(StepPhase.MATCHMAKING)
        rnd = req.round if req.round is not None else self.swarm_round()
        resized = self._resize_grid()  # a step begins at a round boundary (grid="auto")
        if rnd != self.round_index or resized:
            self.round_index = rnd
            self._publish_round()  # goes out with the next heartbeat
        key = self.current_key()
        if req.round is not None:
            key += f"/r{req.round}"  # a pinned round (e.g. an epoch) only ever meets the same round
        st.started, st.key = now, key
        axis = self.grid.axis(self.round_index)
        want = self.grid.shape[axis] if axis is not None else None
        bw, bw_flags = self.advertised_bandwidth()
        cfg_target = self.config.target_group_size
        # whom we expect in our group: with a group's worth, members may close it without the
        # rendezvous peer (zgossip.matchmaking); a client cannot be told notes, so it names nobody.
        # Only where that can be small: the view is a scan of every known peer's announcement, and
        # one per step and peer made a simulated 1,024-peer round O(N^2)
        view = None
        if (listens(self.endpoint) and min(want or cfg_target, cfg_target) <= NOTES_MAX
                and len(self.membership.peers) < 4 * NOTES_MAX):
            view = self._may_join(key, self.round_index, now)
        self.matchmaker.begin(req.step_id, key, bw, req.layout, now, req.timeout, want,
                              gathers=int(req.gather is not None) | (2 if req.weight == 0 else 0) | bw_flags,
                              layout_desc=req.layout_desc, round=self.round_index, view=view)
        self._drain_loopback(now)

    def cancel_step(self, step_id: str, now: float, why: str, error: Exception | None = None) -> None:
        """Drop step `step_id` wherever it is (groupmates are told); it fails with `error`
        (default: `RoundTimeout` saying `why`)."""
        st = self.step
        if st is None or st.req.step_id != step_id:
            return
        self._drop_step(st, now, why, error if error is not None else RoundTimeout(why))

    def _drop_step(self, st: _Step, now: float, why: str, error: Exception) -> None:
        spec = st.round.spec if st.round is not None else st.spec
        if spec is not None:
            # groupmates count on us: tell them at once, so they reduce without us instead of timing us out
            abort = Abort(self.peer_id, self.endpoint, group_id=spec.group_id, reason=why)
            for i, m in enumerate(spec.members):
                if i != spec.rank:
                    self._send(m.endpoint, abort)
        elif self.phase is StepPhase.MATCHMAKING:
            self.matchmaker.cancel(now, why)
        if self.phase is not StepPhase.SCHEDULED:  # it met the swarm's round: the swarm moves on without it
            self._advance_round(self.round_index + 1)
        self._end_step(StepFailed(st.req.step_id, error))
        self._drain_loopback(now)

    def trigger_step(self, step_id: str, buffer: np.ndarray, weight: float, gather: Any, now: float) -> bool:
        """Hand a held step its snapshot: its all-reduce begins as soon as it has a group (at once
        if it has one; a step still SCHEDULED starts matchmaking now). False if `step_id` is not the
        current held step or was triggered already."""
        st = self.step
        if st is None or st.req.step_id != step_id or not st.req.held or st.buffer is not None:
            return False
        if (weight == 0) != (st.req.weight == 0) or (gather is None) != (st.req.gather is None):
            # what matchmaking announced (auxiliary, sends GATHER) must hold: refuse here, not in the round
            raise ProtocolError("a triggered step must keep weight 0 / non-zero and gather None / not None "
                                "as announced when it was scheduled")
        st.buffer, st.weight, st.gather = buffer, float(weight), gather
        self._tensor_bytes = buffer.nbytes
        if self.phase is StepPhase.SCHEDULED:
            self._begin_matchmaking(now)
        elif self.phase is StepPhase.GROUPED:
            assert st.spec is not None
            self._start_round(st.spec, now)
        self._drain_loopback(now)
        return True

    def cancel_matchmaking(self, step_id: str, now: float, why: str) -> bool:
        """Drop step `step_id` if it is still matchmaking (nobody counts on its data yet) and
        return True; False if it is not the current step or its all-reduce already began."""
        st = self.step
        if st is None or st.req.step_id != step_id or st.round is not None:
            return False
        self._drop_step(st, now, why, RoundTimeout(why))
        return True

    def on_message(self, msg: Message, now: float) -> None:
        self.stats["messages"] += 1
        bad = self._bad_endpoint(msg)
        if bad is not None:
            self.stats["dropped"] += 1
            self.drops.note(log, f"{msg.sender[:16]} at {msg.endpoint!r:.80}", "messages naming an endpoint that is no address",
                            f"{msg.type.name} naming {bad!r:.80}")
            return
        self._dispatch(msg, now)
        self._drain_loopback(now)

    # ------------------------------------------------------------------ state sharing
    def set_state_sharing(self, priority: float | None) -> None:
        """Declare (by gossip) that we share state with this priority; None stops sharing."""
        self.membership.share = None if priority is None else float(priority)

    @staticmethod
    def check_user_info(info: dict) -> dict:
        """What a user may publish: at most 14 scalar entries (the node adds its own 'zg.' keys), no 'zg.' keys."""
        info = dict(info)
        if len(info) > 14:
            raise ValueError(f"publish takes at most 14 entries, not {len(info)} (the node gossips its own "
                             "'zg.' entries in the same record)")
        reserved = sorted(k for k in info if isinstance(k, str) and k.startswith("zg."))
        if reserved:
            raise ValueError(f"info keys starting with 'zg.' are reserved for zgossip's own entries: {reserved}")
        return dict(check_info(info))  # the same check peers apply on receipt

    def set_info(self, info: dict) -> None:
        """Publish a small record about this peer (<= 14 scalar entries) with the membership gossip."""
        self._user_info = self.check_user_info(info)
        self._publish_round()
        self.membership.heartbeat += 1  # fresher than what others hold, so they take it at once

    def peer_infos(self) -> dict[str, dict]:
        """The latest record each live peer published (including this one and client-mode peers)."""
        def public(info: dict) -> dict:
            return {k: v for k, v in info.items() if not k.startswith("zg.")}

        out = {pid: public(r.info) for pid, r in self.membership.clients.items()}
        out.update((pid, public(r.info)) for pid, r in self.membership.peers.items())
        out[self.peer_id] = dict(self._user_info)
        return out

    def serve_state(self, req: str, endpoint: str, snap: StateSnapshot | None, now: float,
                    error: str = "") -> None:
        """The owner's answer to `ServeState`: a snapshot (`StateSnapshot.build`, hashed off this
        thread) or None with the reason."""
        waiters, self._snapshot_waiters = self._snapshot_waiters, []
        if (req, endpoint) not in waiters:
            waiters.insert(0, (req, endpoint))
        for r, ep in waiters:
            if snap is None:
                self.donor.refuse(r, ep, error or "state unavailable")
            else:
                self.donor.serve(r, ep, snap)
        if snap is not None:
            self.donor.note_use(snap.root, now, taken=True)
        self._drain_loopback(now)

    def publish_state(self, version: int, snap: StateSnapshot, now: float) -> None:
        """Serve `snap` from now on (no tensor lock, no fresh copy per request) and gossip
        (version, root) for the vote of `zgossip.repair`."""
        self.donor.publish(snap)
        self.state_mark = (int(version), snap.root)
        self._outvoted_since = None
        self._publish_round()
        self.membership.heartbeat += 1  # fresher than what others hold, so they take it at once

    def begin_download(self, req: str, now: float, timeout: float, chunk_timeout: float,
                       target_root: str = "", only: tuple[str, ...] = (), max_donors: int | None = None) -> None:
        dl = StateDownload(req, self.membership, self._send, self._rng, now, now + timeout, chunk_timeout,
                           self.config.max_state_bytes, self._on_download_done, target_root=target_root,
                           only=only, max_donors=max(1, max_donors or self.config.state_donors), drops=self.drops)
        self.downloads[req] = dl
        dl.start(now)
        self._drain_loopback(now)

    def _on_download_done(self, dl: StateDownload, meta: Any, arrays: list | None, err: Exception | None) -> None:
        self.downloads.pop(dl.req, None)
        self.stats["state_bad_chunks"] += dl.bad_chunks
        self.stats["state_refetched"] += dl.refetched
        self.stats["state_meta_outvoted"] += dl.meta_outvoted
        repair = None
        if self._repair is not None and self._repair[0] == dl.req:
            _, version, root, ours = self._repair
            self._repair = None
            if err is not None:
                self.stats["repair_failures"] += 1
                self._next_vote = dl.started + 4 * self.config.gossip_interval  # retry, not at once
                log.warning("%s: state repair to version %d root %s failed: %s", self.peer_id[:8], version,
                            root[:8], err)
                return
            repair = (version, root)
            log.info("%s: state repair downloaded: version %d, the majority's root %s (from %s)",
                     self.peer_id[:8], version, root[:8],
                     ", ".join(f"{p[:8]}:{n}" for p, n in sorted(dl.per_donor.items())))
            # counted, served and voted with only once the owner wrote it (`repair_written`): a repair
            # it could not write (a step began since) must not be announced as this peer's state
            self._repair = (dl.req, version, root, ours)
            self._repair_downloaded = (version, root, ours, dl.snapshot, dl.started)
        self._actions.append(DownloadFailed(dl.req, err) if err is not None
                             else DownloadDone(dl.req, meta, arrays, repair))

    def repair_written(self, version: int, root: str, written: bool, now: float) -> None:
        """The owner wrote (or could not write) the repair downloaded for (`version`, `root`). Written:
        counted in `repairs`, and served and voted with if the owner published nothing newer
        meanwhile. Not written (a newer step had begun, or writing failed): counted in
        `repair_failures`, and the vote may repair again after a pause."""
        got = self._repair_downloaded
        if got is None or got[:2] != (version, root):
            return
        self._repair_downloaded = None
        self._repair = None
        _, _, ours, snap, started = got
        if not written:
            self.stats["repair_failures"] += 1
            self._next_vote = now + 4 * self.config.gossip_interval
            return
        self.stats["repairs"] += 1
        log.warning("%s: state repaired: version %d now holds the majority's root %s", self.peer_id[:8], version,
                    root[:8])
        if self.state_mark == (version, ours):  # the owner published nothing newer meanwhile
            self.publish_state(version, snap, started)  # serve and vote with the repaired state

    # ------------------------------------------------------------------ self-repair (zgossip.repair)
    def state_verdict(self) -> Verdict | None:
        """How our published (version, root) compares with what the live peers published."""
        if self.state_mark is None:
            return None
        version, mine = self.state_mark
        marks = ((pid, *m) for pid, rec in self.membership.peers.items() if (m := read_mark(rec.info)) is not None)
        return vote(version, mine, marks)

    def _check_state(self, now: float) -> None:
        """Between steps, at most once a gossip interval: outvoted for two intervals running -> repair."""
        cfg = self.config
        if (not cfg.self_repair or self.state_mark is None or self._repair is not None or now < self._next_vote
                or self.phase is not StepPhase.IDLE):
            return
        self._next_vote = now + cfg.gossip_interval
        verdict = self.last_verdict = self.state_verdict()
        if verdict is None or verdict.action != "repair":
            self._outvoted_since = None
            return
        if self._outvoted_since is None:  # the view may be a moment old: wait for the next gossip
            self._outvoted_since = now
            return
        if now - self._outvoted_since < cfg.gossip_interval:
            return
        self._repair_seq += 1
        req = f"{self.peer_id[:8]}-r{self._repair_seq}"
        self._repair = (req, verdict.version, verdict.majority, verdict.mine)
        log.warning("%s: state hash %s at version %d is outvoted (%d of %d peers hold %s): repairing from them",
                    self.peer_id[:8], verdict.mine[:8], verdict.version, verdict.agreeing, verdict.voters,
                    verdict.majority[:8])
        self.begin_download(req, now, cfg.repair_timeout, min(cfg.peer_timeout, 10.0),
                            target_root=verdict.majority, only=verdict.donors)

    def _on_bye(self, msg: Bye, now: float) -> None:
        self.membership.on_bye(msg, now)
        if not listens(msg.endpoint):
            # a client that left is no longer expected by our pools (`_may_join`): kept, a small swarm
            # waited the whole matchmaking window at every step for peer_timeout after its goodbye
            self._clients.pop(msg.sender, None)
        if self.matchmaker.pools:
            self.matchmaker.recheck(now)
        self.on_peer_down(msg.endpoint, now)  # gone: a join waiting on it asks the next candidate now

    def _rate_limited(self, msg: Message, what: str) -> None:
        self.stats["rate_limited"] += 1
        if msg.sender not in self._limited_logged and len(self._limited_logged) < 4096:
            self._limited_logged.add(msg.sender)
            log.warning("zgossip node %s: %s from %s (%s) floods control messages: %s (later drops are only "
                        "counted in stats['rate_limited'])", self.endpoint, msg.type.name, msg.sender[:16],
                        msg.endpoint, what)

    def _on_state_req(self, msg: StateReq, now: float) -> None:
        if self.membership.share is None:
            self.donor.refuse(msg.req, msg.endpoint, "this peer does not share its state",
                              msg.root if msg.count else "")
        elif msg.count:
            held = self._held_chunks.get(msg.sender)
            if held is None and self._chunk_limits.allow(msg.sender, now, msg.count):
                self.donor.note_use(msg.root, now, by=msg.sender)
                self.donor.serve_chunks(msg)  # from the snapshot cache: never waits for the tensors
            elif held is not None and len(held) >= HELD_CHUNK_REQUESTS or (
                    held is None and len(self._held_chunks) >= HELD_CHUNK_SOURCES):
                self._rate_limited(msg, f"dropping chunk requests past {CHUNK_RATE:.0f} chunks/s and "
                                        f"{HELD_CHUNK_REQUESTS} held back")
            else:
                self._held_chunks.setdefault(msg.sender, deque()).append(msg)
        elif self.donor.published is not None:
            self.donor.serve(msg.req, msg.endpoint, self.donor.published)
        elif self._snapshot_waiters:  # a snapshot is being taken: this request gets it too
            if len(self._snapshot_waiters) >= MAX_SNAPSHOT_WAITERS:
                self.donor.refuse(msg.req, msg.endpoint, f"this peer is taking a snapshot for "
                                                         f"{MAX_SNAPSHOT_WAITERS} downloads already: retry soon")
            else:
                self._snapshot_waiters.append((msg.req, msg.endpoint))
        elif (snap := self.donor.shared(now, msg.sender)) is not None:  # a new one would evict one in use
            self.donor.serve(msg.req, msg.endpoint, snap)
            self.donor.note_use(snap.root, now)
        else:
            self._snapshot_waiters.append((msg.req, msg.endpoint))
            self._actions.append(ServeState(msg.req, msg.endpoint))

    def _on_state_meta(self, msg: StateMeta, now: float) -> None:
        dl = self.downloads.get(msg.req)
        if dl is None:
            self.stats["late"] += 1
        else:
            self._feed_download(dl, dl.on_meta, msg, now)

    def _on_state_chunk(self, msg: StateChunk, now: float) -> None:
        dl = self.downloads.get(msg.req)
        if dl is None:
            self.stats["late"] += 1
        else:
            self._feed_download(dl, dl.on_chunk, msg, now)

    def _feed_download(self, dl: StateDownload, handler: Any, msg: Message, now: float) -> None:
        """Hand `msg` to a download; the donor data it refused (dropped) or ignored (late) is counted."""
        dropped, late = dl.dropped, dl.late
        handler(msg, now)
        self.stats["dropped"] += dl.dropped - dropped
        self.stats["late"] += dl.late - late

    def chunk_target(self, msg: StateChunk) -> tuple[np.ndarray, int, int, bytes] | None:
        """Where a chunk a running download waits for goes, and its digest (`StateDownload.target`):
        a driver may hash and place it elsewhere, then must hand it in with `on_hashed_chunk` (the
        download waits for it). None: hand it in through `on_message`."""
        dl = self.downloads.get(msg.req)
        return None if dl is None else dl.target(msg)

    def on_hashed_chunk(self, msg: StateChunk, digest: bytes | None, placed_in: np.ndarray | None,
                        now: float) -> None:
        """`on_message` for a chunk whose `chunk_digest` the driver computed (None: it could not),
        written into `placed_in` when that digest was the one wanted."""
        self.stats["messages"] += 1
        dl = self.downloads.get(msg.req)
        if dl is None:
            self.stats["late"] += 1
        else:
            self._feed_download(dl, lambda m, t: dl.on_placed(m, t, digest, placed_in), msg, now)
        self._drain_loopback(now)

    def owes_others(self) -> bool:
        """Whether members of a recent round of ours may still wait for something we sent them (they
        have not said DONE and are not known dead). A peer shutting down waits (bounded) until not."""
        return any(self._owed.values())

    def gone(self, group_id: str) -> frozenset[str]:
        """Endpoints of the members of our finished round `group_id` that are done with us: they gave
        us up (GAVE_UP), left (ABORT) or their connection dropped. Nothing still queued for them matters
        to that round, so an in-place step drops it at once instead of waiting for it (`settle_sends`).
        Members *we* gave up are not among them: alive, they may still take results queued before."""
        return self._gone.get(group_id, frozenset())

    def still_owes(self, endpoint: str, group_id: str) -> bool:
        """Whether the member at `endpoint` of our finished round `group_id` may still wait for data
        of ours (it has not said DONE and is not known dead): a RESULT to it that an in-place step
        had to drop goes again from a copy (`zgossip.zerocopy.LentPayloads.settle`)."""
        return endpoint in self._owed.get(group_id, {}).values()

    def _on_done_msg(self, msg: Done, now: float) -> None:
        gid = msg.group_id
        st = self.step
        running = st is not None and st.round is not None and st.round.spec.group_id == gid
        if not running and gid not in self._finished:
            self.stats["late"] += 1
            return
        self._done_from.setdefault(gid, set()).add((msg.sender, msg.endpoint))
        while len(self._done_from) > 8:
            self._done_from.pop(next(iter(self._done_from)))
        owed = self._owed.get(gid)
        if owed is not None and owed.get(msg.sender) == msg.endpoint:  # the member itself, not a namesake
            del owed[msg.sender]

    def _forget_owed(self, endpoint: str) -> None:
        for owed in self._owed.values():
            for pid in [p for p, ep in owed.items() if ep == endpoint]:
                del owed[pid]

    def on_peer_down(self, endpoint: str, now: float) -> None:
        """The transport saw the connection to `endpoint` drop (e.g. its process died).

        Messages in flight on a dropped connection may be lost, so a groupmate at that
        endpoint is declared lost at once instead of after its timeout.
        """
        st = self.step
        if st is not None and st.round is not None:
            st.round.peer_down(endpoint, now)
        elif st is not None and st.spec is not None:
            st.downs.append(endpoint)  # replayed into the round when it starts
            self._note_gone(st, [m.peer_id for m in st.spec.members if m.endpoint == endpoint], now)
        self._forget_owed(endpoint)
        self.matchmaker.peer_down(endpoint, now)
        for dl in list(self.downloads.values()):
            dl.peer_down(endpoint, now)
        self._drain_loopback(now)

    def leave(self, now: float) -> int:
        """Shutting down cleanly (after the owed data went out): say goodbye to every peer we know,
        so they stop counting us live at once, and stop gossiping. Returns how many were told."""
        told = len(self.membership.live_ids())
        self.membership.goodbye(now)
        self._drain_loopback(now)
        return told

    def on_timer(self, now: float) -> None:
        version, beat = self.membership.version, self.membership.heartbeat
        self.membership.on_timer(now)
        if self.config.grid_auto and self.membership.heartbeat != beat:
            self._refresh_estimate()
        if self.matchmaker.pools and self.membership.version != version:
            self.matchmaker.recheck(now)  # a peer expired: it will not come
        self._held_timer(now)
        self.matchmaker.on_timer(now)
        if self.step is not None and self.step.round is not None:
            self.step.round.on_timer(now)
        for dl in list(self.downloads.values()):
            dl.on_timer(now)
        self._serve_held_chunks(now)
        self._check_state(now)
        self._close_reopened(now)
        self._drain_loopback(now)

    def _close_reopened(self, now: float) -> None:
        """Close again the connections to forgotten peers that a send reopened (see `_reopened`)."""
        for ep, since in list(self._reopened.items()):
            if since is None:
                self._reopened[ep] = now
            elif now >= since + self.config.peer_timeout:  # the very sum next_deadline() reports
                del self._reopened[ep]
                self._actions.append(Disconnect(ep))

    def _serve_held_chunks(self, now: float) -> None:
        """Serve the held-back chunk requests whose source's bucket refilled, oldest first."""
        for src in list(self._held_chunks):
            held = self._held_chunks[src]
            while held and self._chunk_limits.allow(src, now, held[0].count):
                msg = held.popleft()
                if self.membership.share is None:
                    self.donor.refuse(msg.req, msg.endpoint, "this peer does not share its state", msg.root)
                else:
                    self.donor.note_use(msg.root, now, by=msg.sender)
                    self.donor.serve_chunks(msg)
            if not held:
                del self._held_chunks[src]

    def next_deadline(self) -> float | None:
        times = [self.membership.deadline(), self.matchmaker.deadline(), self._held_deadline()]
        times += [since + self.config.peer_timeout for since in self._reopened.values() if since is not None]
        if self.step is not None and self.step.round is not None:
            times.append(self.step.round.next_deadline())
        times += [dl.next_deadline() for dl in self.downloads.values()]
        times += [self._chunk_limits.ready_at(src, held[0].count) for src, held in self._held_chunks.items()]
        times = [t for t in times if t is not None]
        return min(times) if times else None

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, msg: Message, now: float) -> None:
        over = getattr(self.membership, "refused_entries", 0)
        self._dispatch_checked(msg, now)
        over = getattr(self.membership, "refused_entries", 0) - over
        if over:
            mem = self.membership
            self.stats["dropped"] += over
            self.drops.note(log, f"{msg.sender[:16]} at {msg.endpoint}", "peer records past the membership's bounds",
                            f"{over} not entered (a digest carries at most {mem.max_digest} entries; the table "
                            f"holds at most {mem.max_peers} peers and {mem.max_clients} clients)")

    def _dispatch_checked(self, msg: Message, now: float) -> None:
        if msg.sender != self.peer_id:
            chunks = type(msg) is StateReq and msg.count > 0  # paced by `_on_state_req` instead
            if type(msg) in _LIMITED and not chunks and not self._limits.allow(msg.sender, now):
                self._rate_limited(msg, f"dropping what exceeds {self._limits.rate:.0f}/s")
                return
            if type(msg) in _MATCHMAKING and not self._mm_limits.allow(msg.sender, now):
                self._rate_limited(msg, f"dropping matchmaking messages past {self._mm_limits.rate:.0f}/s")
                return
            self.membership.observe(msg.sender, msg.endpoint, now)
            if not listens(msg.endpoint) and not (
                    type(msg) not in (Gossip, GossipReply) and isinstance(self.membership, Membership)
                    and self.membership.left_lately(msg.sender, now)):  # (gossip again: it is back)
                self._heard_client(msg, now)
        mm = self.matchmaker
        dropped, late = mm.dropped, mm.late
        self._handlers[type(msg)](msg, now)
        self.stats["dropped"] += mm.dropped - dropped
        self.stats["late"] += mm.late - late

    def _round_message(self, msg: Gather | Part | Result | Abort | RescueCall | Rescue | GaveUp, now: float) -> None:
        gid = msg.group_id
        st = self.step
        if st is not None and st.round is not None and st.round.spec.group_id == gid:
            self._feed_round(st.round, msg, now)
            return
        done = self._finished.get(gid)
        if done is not None and type(msg) in (Part, Result):
            for arr in msg.payload:  # a transfer of a round we finished still measures our link
                self.linkstats.on_payload(msg.sender, arr.nbytes, now, pace=type(msg) is Part)
        if done is not None:
            if type(msg) in (RescueCall, Rescue):
                # we finished already: a substitute hears that we need nothing, a member that asks us to
                # rescue gets notices (it keeps its own values), so neither waits for us and gives us up
                replies = done.answer(msg)
                for reply in replies or ():
                    self._send(msg.endpoint, reply)
                if replies is None:
                    self.stats["dropped"] += 1
                elif not replies:
                    self.stats["late"] += 1
            else:
                self.stats["late"] += 1
            return
        full = False
        if (self.phase is StepPhase.GROUPED and st is not None and st.spec is not None and st.spec.group_id == gid
                and any(m.peer_id == msg.sender for m in st.spec.members)):
            # our group, whose all-reduce waits for our trigger: keep its messages (aborts too) for then
            kept = self._keep_early(gid, msg)
            if type(msg) is Abort:
                self._note_gone(st, [msg.sender], now)
            if kept or type(msg) is Abort:
                return
            full = True
        elif self.phase is StepPhase.MATCHMAKING and type(msg) is not Abort:
            # a groupmate may start before our GROUP message arrives: keep its messages briefly
            if self._keep_early(gid, msg):
                return
            full = True
        self.stats["dropped"] += 1
        if full:
            self.drops.note(log, f"{msg.sender[:16]} at {msg.endpoint}", "round messages beyond the early buffer",
                            f"{msg.type.name} for group {gid[:8]}: the messages kept until our group is known are "
                            f"bounded by early_buffer_messages={self.config.early_buffer_messages} per group, 4 groups "
                            f"and {self._early_budget()} bytes (early_buffer_bytes)")
            return
        self._disown(gid, msg)
        # usually benign (a groupmate's late message after we gave the round up): INFO, once per source
        self.drops.note(log, f"{msg.sender[:16]} at {msg.endpoint}", f"{msg.type.name} for a round this node is "
                        "not in", f"group {gid[:8]}", level=logging.INFO)

    def _early_budget(self) -> int:
        cfg = self.config
        if cfg.early_buffer_bytes is not None:
            return cfg.early_buffer_bytes
        return max(2 * self._tensor_bytes, 4 * cfg.part_size_bytes)

    def _keep_early(self, gid: str, msg: Message) -> bool:
        """Keep `msg` for group `gid` until we know whether it is ours; False if that would pass the
        early buffer's bounds (messages per group, 4 groups, bytes in all)."""
        early = self._early.get(gid)
        if early is None:
            if len(self._early) >= 4:
                return False
            early = []
        size = sum(a.nbytes for a in msg.payload)
        if len(early) >= self.config.early_buffer_messages or self._early_bytes + size > self._early_budget():
            return False
        self._early[gid] = early
        early.append(msg)
        self._early_bytes += size
        return True

    def _take_early(self, gid: str) -> list[Message]:
        msgs = self._early.pop(gid, [])
        self._early_bytes -= sum(a.nbytes for m in msgs for a in m.payload)
        return msgs

    def _discard_early(self, keep: str | None = None, ours: str | None = None) -> None:
        """Discard the early messages of every group but `keep`, unused: those of group `ours` (a
        round we gave up before it began) are counted late, any other group's dropped (its GROUP
        never came: an outsider's, or a group we were not put in), each source logged once."""
        for gid in [g for g in self._early if g != keep]:
            for msg in self._take_early(gid):
                if gid == ours:
                    self.stats["late"] += 1
                    continue
                self.stats["dropped"] += 1
                self.drops.note(log, f"{msg.sender[:16]} at {msg.endpoint}", f"{msg.type.name} for a round this node is "
                                "not in", f"group {gid[:8]} (kept while our own group was on its way)", level=logging.INFO)
                self._disown(gid, msg)

    def _disown(self, gid: str, msg: Message) -> None:
        """Tell a known peer that sends us round data of group `gid`, which we are not in and cannot
        join any more (no step of ours is matchmaking towards it), that we are not coming: ABORT, once
        per group and sender. Its round then goes on without us at once. Such a group is one whose
        GROUP never reached us or came after we found another: a peer that closed its group from our
        JOIN_NOTE while the rendezvous peer cut us into another group (on far links the LEAVE that
        withdraws the note can arrive after that peer's step began). Without the ABORT it waited out
        its silence limits for each of us -- 3-4 s per step on the testbed's 80 ms links, with
        `PeerLost` at the end -- while every PART it streamed was dropped here."""
        if type(msg) not in (Gather, Part, Result, RescueCall, Rescue) or not self._knows(msg.sender, msg.endpoint):
            return  # never answer an ABORT or a GAVE_UP (no ping-pong), nor a stranger (no reflection)
        if (gid, msg.sender) in self._disowned:
            return
        self._disowned[(gid, msg.sender)] = None
        while len(self._disowned) > 256:
            self._disowned.pop(next(iter(self._disowned)))
        self._send(msg.endpoint, Abort(self.peer_id, self.endpoint, group_id=gid,
                                       reason="not in this group: its GROUP never reached this peer's step"))

    def _feed_round(self, rnd: AllReduceRound, msg: Message, now: float) -> None:
        """Hand `msg` to the running round; what it refused (dropped) or ignored (late) is counted."""
        dropped, late = rnd.dropped, rnd.late
        rnd.on_message(msg, now)
        self.stats["dropped"] += rnd.dropped - dropped
        self.stats["late"] += rnd.late - late

    # ------------------------------------------------------------------ step lifecycle
    def _on_group(self, spec: GroupSpec, now: float) -> None:
        st = self.step
        assert st is not None
        st.grouped = now
        self.stats["closed_early"] = self.matchmaker.closed_early
        for pid, what in spec.left_out:
            if (pid, what) not in self._warned_layouts:  # once per peer and difference, not every step
                if len(self._warned_layouts) > 256:
                    self._warned_layouts.clear()
                self._warned_layouts.add((pid, what))
                log.warning("%s: peer %s steps with the same key (%s) but cannot average with this one, its "
                            "tensors differ: %s", self.peer_id[:8], pid[:8], spec.key, what)
        if st.buffer is None:  # held, not triggered yet: keep the group, and its early messages, until then
            self._move(StepPhase.GROUPED)
            st.spec = spec
            self._discard_early(keep=spec.group_id)
            self._progress(StepPhase.GROUPED)
            return
        self._start_round(spec, now)

    def _start_round(self, spec: GroupSpec, now: float) -> None:
        st = self.step
        assert st is not None and st.buffer is not None
        self._move(StepPhase.AVERAGING)
        self._progress(StepPhase.AVERAGING)
        st.released = now
        cfg = self.config
        itemsize = st.buffer.dtype.itemsize
        try:
            st.round = AllReduceRound(
                spec, st.buffer, st.weight, st.gather, self._send, now,
                part_elems=max(1, cfg.part_size_bytes // itemsize), part_timeout=cfg.part_timeout,
                deadline=self.step_deadline(st, now), on_done=self._on_round_done, codec=st.req.codec,
                linkstats=self.linkstats, part_timeout_floor=cfg.part_timeout_floor, deadline_slack=cfg.deadline_slack,
                rtt=self.membership.rtt if isinstance(self.membership, Membership) else None,
                rate_of=self._gossiped_rate,
                drops=self.drops,
            )
            st.round.start(now)
        except (ProtocolError, ValueError) as e:
            # what the caller's checks let by and the round still refused (a bug, or a GROUP whose
            # plan we cannot build): the step ends now with that error and the group is told, rather
            # than the step waiting out its deadline with no round behind it
            log.error("%s: the round of group %s could not start: %s", self.peer_id[:8], spec.group_id[:8], e)
            st.round = None
            st.spec = spec
            self._drop_step(st, now, f"round could not start: {e}", ProtocolError(f"the round could not start: {e}"))
            return
        for msg in self._take_early(spec.group_id):
            if st.round is not None and st.round.spec.group_id == spec.group_id:
                self._feed_round(st.round, msg, now)
        self._discard_early()
        for ep in st.downs:  # connections that dropped while we waited for the trigger
            if st.round is not None:
                st.round.peer_down(ep, now)

    # ------------------------------------------------------------------ held steps (scheduled / triggered)
    def _held_deadline(self) -> float | None:
        st = self.step
        if st is None or not st.req.held or st.round is not None:
            return None
        times = []
        if self.phase is StepPhase.SCHEDULED:
            times.append(st.req.begin_at)
        if self.phase is StepPhase.GROUPED:
            times.append(st.started + st.req.timeout)  # the trigger is late: give up
        if st.req.due_at is not None and not st.due_said and st.buffer is None:
            times.append(st.req.due_at)
        return min(times) if times else None

    def _held_timer(self, now: float) -> None:
        st = self.step
        if st is None or not st.req.held or st.round is not None:
            return
        if self.phase is StepPhase.SCHEDULED and now >= st.req.begin_at:
            self._begin_matchmaking(now)
        if (st.req.due_at is not None and not st.due_said and st.buffer is None and now >= st.req.due_at
                and self.step is st):
            st.due_said = True
            self._progress(self.phase, due=True)
        if self.phase is StepPhase.GROUPED and self.step is st and now >= st.started + st.req.timeout:
            self._drop_step(st, now, "not triggered in time", RoundTimeout(
                f"the step had a group but was not triggered within its timeout ({st.req.timeout:.1f}s from the "
                "start of matchmaking); its groupmates were told to go on without it"))

    def _note_gone(self, st: _Step, peer_ids: list, now: float) -> None:
        """A member of our group (still waiting for our trigger) aborted or dropped. When none is left
        to average with, fail now rather than at the trigger."""
        assert st.spec is not None
        st.gone.update(peer_ids)
        others = {m.peer_id for i, m in enumerate(st.spec.members) if i != st.spec.rank}
        if others and others <= st.gone and self.step is st:
            self._drop_step(st, now, "every groupmate left", PeerLost(
                f"group {st.spec.group_id[:8]} of {len(st.spec.members)} formed, but every other member left before "
                "this step was triggered; tensors left unchanged"))

    def step_deadline(self, st: _Step, grouped: float) -> float:
        """When the all-reduce of step `st`, grouped at `grouped`, is over whatever happens:
        `allreduce_timeout` after the group formed, and never later than `timeout` +
        `allreduce_timeout` after the step began (a GROUP that arrives after the matchmaking
        deadline gets only what is left)."""
        cap = st.started + st.req.timeout + self.config.allreduce_timeout
        return min(grouped + self.config.allreduce_timeout, cap)

    def _on_match_fail(self, step_id: str, err: Exception) -> None:
        self._advance_round(self.round_index + 1)  # the swarm moved on to the next axis without us
        self._end_step(StepFailed(step_id, err))

    def _on_round_done(self, rnd: AllReduceRound, now: float) -> None:
        st = self.step
        assert st is not None and st.round is rnd
        out: RoundOutcome = rnd.outcome()
        coords_before = self.coords
        self.coords = self.grid.next_coords(self.coords, self.round_index, rnd.spec.group_id, rnd.rank)
        self._advance_round(self.round_index + 1)
        gid = rnd.spec.group_id
        self._finished[gid] = rnd.finished()
        while len(self._finished) > 8:
            self._finished.pop(next(iter(self._finished)))
        self._gone[gid] = frozenset(rnd.members[i].endpoint for i in rnd.done_with_us)
        while len(self._gone) > 8:
            self._gone.pop(next(iter(self._gone)))
        # tell those that may still send us something (span owners, substitutes we asked) that we need
        # nothing more, and remember who may still need something from us: each side computes these
        # from the group's plan, so a member that owes us is always among those told (allreduce.i_owe)
        done = Done(self.peer_id, self.endpoint, group_id=gid)
        said = self._done_from.get(gid, set())
        owed = {}
        for i in rnd.may_owe_me():
            m = rnd.members[i]
            if not (rnd.client and not listens(m.endpoint)):  # one client cannot reach another
                self._send(m.endpoint, done)
        for i in rnd.i_owe():  # a client with no span owes no results
            m = rnd.members[i]
            if not (rnd.client and not listens(m.endpoint)) and (m.peer_id, m.endpoint) not in said:
                owed[m.peer_id] = m.endpoint
        self._owed[gid] = owed
        while len(self._owed) > 8:
            self._owed.pop(next(iter(self._owed)))
        result = StepResult(
            group_id=out.group_id, key=out.key, members=out.members, gathered=out.gathered,
            weights=out.weights, contributors=out.contributors, lost=out.lost, complete=out.complete,
            spans=out.spans, updated=out.updated,
            timings=({"matchmaking": st.grouped - st.started, "allreduce": now - st.grouped, "total": now - st.started}
                     if not st.req.held else
                     {"matchmaking": st.grouped - st.started, "awaiting_trigger": st.released - st.grouped,
                      "allreduce": now - st.released, "total": now - st.started}),
            bytes_sent=out.bytes_sent, bytes_received=out.bytes_received, coords=coords_before,
            left_out=dict(rnd.spec.left_out), auxiliary=out.auxiliary, deadlines=rnd.deadlines_used(),
        )
        if len(out.members) > 1 and not set(out.contributors) - {self.peer_id} and self.peer_id not in out.auxiliary:
            self._end_step(StepFailed(st.req.step_id, PeerLost(
                f"group {out.group_id[:8]} of {len(out.members)} formed, but no other member's data arrived "
                f"(lost: {', '.join(p[:8] for p in out.lost) or 'none'}); tensors left unchanged")))
            return
        self._end_step(StepDone(st.req.step_id, result))

    def _end_step(self, action: StepDone | StepFailed) -> None:
        st = self.step
        self.step = None
        self._discard_early(ours=st.spec.group_id if st is not None and st.spec is not None else None)
        self._move(StepPhase.IDLE)
        self._actions.append(action)
