"""Matchmaking: cut the peers that step with the same key into groups, with no fixed coordinator.

Rendezvous hashing picks, for each key, the live peer with the highest
``blake2b(peer_id | key)``: every joiner sends JOIN to that peer, which acknowledges,
collects joiners for ``matchmaking_time`` from the first arrival (or until
``target_group_size`` have come), cuts them into groups of at least ``min_group_size``
and sends each member its group. Any peer can be the rendezvous for some key, and a
dead one is simply skipped: a joiner that gets no JOIN_ACK within ``request_timeout``
asks the next candidate. A rendezvous peer that knows a better-ranked live peer
redirects the joiner (at most twice), which repairs disagreeing membership views.

A far peer is not a dead one: the wait for a JOIN_ACK grows with the round-trip time
the membership gossip measured to that peer (a first contact also pays for the
connection's set-up), and a joiner that moved on anyway still takes the JOIN_ACK or
GROUP of any rendezvous peer it asked during this step, if it has no group yet -- it
then tells the others it asked (LEAVE), so their pools drop it while they are open; a
GROUP that comes after it found one is answered with ABORT, so that group does not
wait for it.

The joiner keeps a log of every attempt, so a failure can say exactly what happened
instead of a bare "could not find a group".

**Closing without the rendezvous peer.** A cold step pays a round trip for its group: every
JOIN goes to the rendezvous peer, and the GROUP comes back -- across the farthest hosts on uneven
links (0.1-0.25 s on the testbed's home lines, against a ~2 s all-reduce). When a joiner can tell
whom to expect (the live peers that may use its key this round, `expected`; a small swarm or a
settled Moshpit line; the node asks only in swarms of fewer than 4 x `NOTES_MAX` known peers)
and that is a group's worth (of at most `NOTES_MAX`), its JOIN names them (`view`) and it also sends
a JOIN_NOTE (the same fields) to each of them. A member that holds the notes of every peer of its
view, each naming that same view (and the same round and layout), forms the group itself: the
members sorted by peer id, the id a hash of the key and their step ids (`group_id_of`), which is
exactly the GROUP the rendezvous peer sends once it holds those JOINs (it closes its pool on the
same rule, whatever its own view). So a member starts one one-way trip after the last joiner
called, not after a trip to the rendezvous peer and back, and members that close themselves and
members that wait for the GROUP meet in the same group. Views that differ anywhere (gossip not
settled, a newcomer) close nothing early: then the rendezvous peer decides, as before. A joiner
that gives up tells the peers it noted (LEAVE), so a later step does not count on its note.

That holds while the rendezvous peer's pool is still open when the last of those JOINs comes. Its
window closes `matchmaking_time` after the first JOIN, and then it cuts whoever came: a member that
calls later (a far peer whose previous step ended later, peers stepping on their own timers) finds
the others' notes waiting and used to close the group of all from them -- while the others had
taken the rendezvous peer's GROUP without it, their LEAVEs still crossing its link. One round then
had a peer in two groups. (The simulator shows it at once: 4 peers, one 80-150 ms away, calls
spread over 1 s against a 0.5 s window: 146 of 360 rounds.) No rule a member applies alone can
know what the rendezvous peer decided without asking it, which is the round trip notes exist to
save. So a member closes from notes only when the calls came close enough together that the
window cannot have closed in between: when we called, and when each other member's note came,
lie less than `matchmaking_time` apart, less the longest round trip the gossip measured to a
member (the note's own trip, and the JOINs' unequal trips to the rendezvous peer), that margin
at most half the window (half the window where none was measured yet). Calls farther apart
leave the group to the rendezvous peer, whose GROUP every member then takes. Steps that begin
together (a settled swarm, a training loop) are far inside that bound and keep closing early.
What is left: links whose round trip exceeds half the window, or a JOIN delayed past the window
while the notes were not (in a seeded sweep, 2 of 360 such rounds with a 0.5 s window, none of
360 with 1 s and calls spread over 2.5 s; the testbed's case is in tests/sim/test_matchmaking_far.py
and tests/unit/test_matchmaker.py). A peer that gets round data of a
group it is not in still answers ABORT (`Node._disown`), so such a group ends at once.

Only peers with equal tensor layouts are grouped. Each JOIN also carries a short description of
its layout (`zgossip.layouts`); when a window closes with several layouts for one key, every
peer involved learns what differs: those left without a group in the NO_GROUP reason, members
of a group that formed in the GROUP message (``odd``: who was left out, and why), which their
step reports as ``StepResult.left_out``.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import numpy as np

from . import layouts
from .droplog import DropLog
from .endpoints import listens
from .errors import GroupNotFound, IllegalTransition, ProtocolError
from .messages import Abort, Group, Join, JoinAck, JoinNote, Leave, MemberInfo, Message, NoGroup, Redirect
from .rendezvous import rendezvous_order
from .view import MembershipView

__all__ = ["MemberInfo", "GroupSpec", "Matchmaker", "rendezvous_order", "JoinPhase", "group_id_of"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupSpec:
    key: str
    group_id: str
    members: tuple[MemberInfo, ...]
    rank: int  # this peer's index in `members`
    left_out: tuple[tuple[str, str], ...] = ()  # (peer id, what differs) of joiners of this key with other layouts

    def __post_init__(self) -> None:
        if not 0 <= self.rank < len(self.members):
            raise ProtocolError("rank outside the group")
        if len({m.peer_id for m in self.members}) != len(self.members):
            raise ProtocolError("a peer appears twice in one group")


def group_id_of(key: str, members: tuple[MemberInfo, ...]) -> str:
    """A group's id: a hash of its key and of every member's peer id and step id (in member order).
    Step ids are fresh for every step, so ids do not repeat across rounds; and anyone holding the
    same JOINs names the group alike, which is what lets members close it themselves."""
    h = hashlib.blake2b(digest_size=8)
    for s in (key, *(x for m in members for x in (m.peer_id, m.step_id))):
        b = s.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return h.hexdigest()


#: groups of at most this many close from notes: each member sends one note per groupmate, n(n-1) in
#: all, against 2n messages through the rendezvous peer -- for 32 members 992 more per group (a
#: 1,024-peer Moshpit round went from 1.0 to 4.0 s in the simulator), for 4 members 12
NOTES_MAX = 16  # (<= messages.MAX_VIEW)


class JoinPhase(Enum):
    ASKING = "asking"  # JOIN sent, waiting for JOIN_ACK
    QUEUED = "queued"  # acknowledged, waiting for GROUP / NO_GROUP
    DONE = "done"


_PHASE_MOVES = {
    JoinPhase.ASKING: {JoinPhase.ASKING, JoinPhase.QUEUED, JoinPhase.DONE},
    JoinPhase.QUEUED: {JoinPhase.ASKING, JoinPhase.QUEUED, JoinPhase.DONE},  # QUEUED: back to a late one
    JoinPhase.DONE: set(),
}


@dataclass
class _Join:
    step_id: str
    key: str
    bandwidth: float
    layout: str
    want: int
    gathers: int
    started: float
    deadline: float
    phase: JoinPhase = JoinPhase.ASKING
    target: tuple[str, str] = ("", "")
    hops: int = 0
    wait_until: float = 0.0
    silent: set = field(default_factory=set)
    history: list = field(default_factory=list)
    asked: dict = field(default_factory=dict)  # peer id -> endpoint of every peer sent a JOIN this step
    since: float = 0.0  # when the current wait (for a JOIN_ACK, or for the group) began
    seen: int = 0
    desc: str = ""  # layout description (zgossip.layouts)
    round: int = -1  # the swarm round this step is in (-1: not known), told to the rendezvous peer
    view: tuple[str, ...] = ()  # the peers we expect in our group, us included, sorted (): none to close with
    noted: dict = field(default_factory=dict)  # peer id -> endpoint of every peer sent a JOIN_NOTE this step

    def move(self, phase: JoinPhase) -> None:
        if phase not in _PHASE_MOVES[self.phase]:
            raise IllegalTransition(f"join {self.step_id}: illegal move {self.phase.value} -> {phase.value}")
        self.phase = phase


@dataclass
class _Entry:
    peer_id: str
    endpoint: str
    step_id: str
    bandwidth: float
    layout: str
    want: int
    gathers: int
    desc: str = ""
    round: int = -1
    view: tuple[str, ...] = ()


def _round_of(entries: list[_Entry]) -> int:
    """The latest round the entries of a group said they step in (-1: none said)."""
    return max((e.round for e in entries), default=-1)


@dataclass
class _Pool:
    closes: float
    opened: float
    entries: list = field(default_factory=list)
    coming: set | None = None  # peers that may still join (`expected`), None = not asked yet


class Matchmaker:
    def __init__(
        self,
        membership: MembershipView,
        send: Callable[[str, Message], None],
        rng: np.random.Generator,
        on_group: Callable[[GroupSpec, float], None],
        on_fail: Callable[[str, Exception], None],
        *,
        target_group_size: int,
        min_group_size: int,
        matchmaking_time: float,
        request_timeout: float,
        straggler_grace: float = 0.0,
        expected: Callable[[str, int, float], set[str] | None] | None = None,
        moved_on: Callable[[str, int, float], bool] | None = None,
    ) -> None:
        """`expected(key, round, now)` names the live peers that may still join `key` in `round`, or
        None if it cannot tell; a pool closes as soon as all of them joined (see `_all_came`).
        `moved_on(key, round, now)`: whether the swarm provably went past that round without this
        peer; a joiner whose window closed short then fails at once instead of opening another."""
        if not 1 <= min_group_size <= target_group_size:
            raise ValueError(f"need 1 <= min_group_size <= target_group_size, not min_group_size={min_group_size!r} "
                             f"and target_group_size={target_group_size!r}")
        if matchmaking_time <= 0 or request_timeout <= 0:
            raise ValueError("matchmaking_time and request_timeout must be positive")
        self.membership = membership
        self._send = send
        self._rng = rng
        self._on_group = on_group
        self._on_fail = on_fail
        self.dropped = 0  # malformed answers refused (counted by the node in stats["dropped"])
        self.late = 0  # answers to joins no longer made, ignored (stats["late"])
        self.target_group_size = target_group_size
        self.min_group_size = min_group_size
        self.matchmaking_time = matchmaking_time
        self.request_timeout = request_timeout
        self.straggler_grace = straggler_grace
        self.join: _Join | None = None
        self.pools: dict[str, _Pool] = {}
        #: key -> when a group last formed for it, and the latest round its members said (-1: none said)
        self._formed: dict[str, tuple[float, int]] = {}
        self._expected = expected
        self._moved_on = moved_on
        self._notes: dict[tuple[str, str], tuple[JoinNote, float]] = {}  # (key, sender) -> its note, when it came
        self._closed: dict[str, str] = {}  # step id -> group id of our steps whose group we formed from notes
        self._met: dict[str, None] = {}  # step ids of peers that were in a group with us lately: their notes are spent
        self.closed_early = 0  # groups this peer formed from notes (stats["closed_early"])
        self._steps: dict[str, None] = {}  # ids of our recent steps: a GROUP for one we gave up is answered
        #: whether a member of a GROUP for a step we gave up may be sent the courtesy ABORT: a peer
        #: we know at that endpoint (the node adds clients it heard from). Nobody else is contacted
        #: for a GROUP: an outsider's GROUP naming thousands of made-up members opens no connection.
        self.knows: Callable[[str, str], bool] = lambda peer_id, endpoint: membership.endpoint_of(peer_id) == endpoint
        self.drops: DropLog | None = None  # the node's: refused input is logged once per source and kind

    @property
    def peer_id(self) -> str:
        return self.membership.peer_id

    @property
    def endpoint(self) -> str:
        return self.membership.endpoint

    # ================================================================ joiner side
    def begin(self, step_id: str, key: str, bandwidth: float, layout: str, now: float, timeout: float,
              want: int | None = None, gathers: bool = True, layout_desc: str = "", round: int = -1,
              view: set[str] | None = None) -> None:
        """Start looking for a group. `want` is how many peers the key can hold at most (a
        full Moshpit line); the rendezvous peer closes the group as soon as that many came.
        `view`: the peers (this one included) this joiner expects in its group, if it can tell
        (module docstring, "closing without the rendezvous peer"); used when it is a group's worth."""
        if self.join is not None:
            raise ProtocolError("a join is already running")
        want = self.target_group_size if want is None else max(1, min(want, self.target_group_size))
        ids = tuple(sorted(view)) if view else ()
        if not (round >= 0 and self.peer_id in ids and max(2, self.min_group_size) <= len(ids) <= min(want, NOTES_MAX)
                and all(p == self.peer_id or self.membership.endpoint_of(p) for p in ids)):
            ids = ()
        self.join = j = _Join(step_id, key, bandwidth, layout, want, int(gathers), now, now + timeout,
                              desc=layout_desc[:layouts.MAX_CHARS], round=round, view=ids)
        self._steps[step_id] = None
        while len(self._steps) > 64:
            self._steps.pop(next(iter(self._steps)))
        if ids:
            note = JoinNote(self.peer_id, self.endpoint, key=key, step_id=step_id, bandwidth=bandwidth, layout=layout,
                            want=want, gathers=int(gathers), round=round, view=ids)
            for pid in ids:
                ep = self.membership.endpoint_of(pid) if pid != self.peer_id else None
                if ep is not None:
                    j.noted[pid] = ep
                    self._send(ep, note)
        self._ask_next(now)
        self._close_from_notes(now)

    def cancel(self, now: float, why: str) -> None:
        j = self.join
        if j is None:
            return
        self._leave_all(j)
        leave = Leave(self.peer_id, self.endpoint, key=j.key, step_id=j.step_id)
        for pid, ep in j.noted.items():  # they must not form a group with our note
            if pid not in j.asked:
                self._send(ep, leave)
        self.join = None

    def _leave_all(self, j: _Join, keep: str | None = None) -> None:
        """Tell every rendezvous peer we asked during this join (but `keep`) that we do not come:
        an open pool drops us; a closed one already sent its GROUP, which we answer with ABORT."""
        leave = Leave(self.peer_id, self.endpoint, key=j.key, step_id=j.step_id)
        for pid, ep in j.asked.items():
            if pid != keep:
                self._send(ep, leave)

    def _rtt(self, endpoint: str) -> float:
        rtt = getattr(self.membership, "rtt", None)
        r = rtt(endpoint) if rtt is not None and endpoint != self.endpoint else None
        return r or 0.0

    def ack_wait(self, endpoint: str) -> float:
        """How long a JOIN to `endpoint` may go unanswered before we ask the next candidate:
        `request_timeout`, plus three measured round trips (the JOIN and its JOIN_ACK, and the
        set-up of connections that may not exist yet on a first contact)."""
        return self.request_timeout + 3.0 * self._rtt(endpoint)

    def ranking(self, key: str) -> list[str]:
        """Live peers (this one included) in rendezvous order for `key`."""
        return self.membership.ranking(key)

    def _best_candidate(self, j: _Join) -> str | None:
        """The best-ranked peer that has not gone silent on this join (a scan stops at the first)."""
        return next((p for p in self.ranking(j.key) if p not in j.silent), None)

    def _ask(self, j: _Join, peer_id: str, endpoint: str, now: float) -> None:
        j.move(JoinPhase.ASKING)
        j.target = (peer_id, endpoint)
        j.asked[peer_id] = endpoint
        j.since = now
        j.wait_until = now + self.ack_wait(endpoint)
        log.debug("%s t=%.3f JOIN -> %s hops=%d", self.peer_id[:8], now, peer_id[:8], j.hops)
        self._send(endpoint, Join(self.peer_id, self.endpoint, key=j.key, step_id=j.step_id, bandwidth=j.bandwidth,
                                  layout=j.layout, hops=j.hops, want=j.want, gathers=int(j.gathers), layout_desc=j.desc,
                                  round=j.round, view=j.view))

    def _ask_next(self, now: float) -> None:
        j = self.join
        assert j is not None
        pid = self._best_candidate(j)
        if pid is None:  # everyone went silent: start over rather than give up early
            j.silent.clear()
            pid = self._best_candidate(j)
        if pid is None:  # a client that knows no peer yet (the ranking holds no one): look again soon
            j.move(JoinPhase.ASKING)
            j.target = ("", "")
            j.since = now
            j.wait_until = now + self.request_timeout
            return
        j.hops = 0
        self._ask(j, pid, self.membership.endpoint_of(pid) or self.endpoint, now)

    def _swarm_moved_on(self, j: _Join, now: float) -> bool:
        """A window closed without a group: is another worth opening? Not once every other live peer
        that used the key is past the join's round -- rounds only grow, so nobody is left to come. (A
        far peer that called after its swarm's group formed, before it heard that the swarm moved
        on, waited out its whole timeout window after window: 9.9 s of a 10 s timeout in
        tests/sim/test_matchmaking_far.py, 0.9 s now.) Asked only after a window closed, so a gossip
        view one window old does not fail a step that others are about to join; with no other live
        peer known at all (a swarm starting up) the answer is no."""
        return self._moved_on is not None and j.round >= 0 and self._moved_on(j.key, j.round, now)

    def _fail(self, now: float, reason: str, advice: str = "") -> None:
        j = self.join
        assert j is not None
        self.cancel(now, reason)
        live = len(self.membership.live_ids())
        steps = _summarize(j.history) or "no rendezvous peer answered"
        if not advice and any(_OTHER_LAYOUT in h for h in j.history):
            reason = f"{reason}; other peers with this key have different tensors"
            advice = ("Peers average only tensors of the same count, shapes and dtypes: give every peer that "
                      "steps with this prefix the same tensors (or another prefix).")
        elif not advice:
            advice = ("Check that enough peers step with the same prefix and round, or lower min_group_size / "
                      "raise timeout or matchmaking_time.")
        err = GroupNotFound(
            f"no group for key {j.key!r} after {now - j.started:.2f}s ({reason}). "
            f"Live peers known: {live}; most peers seen with this key: {j.seen} "
            f"(min_group_size={self.min_group_size}). What happened: {steps}. {advice}"
        )
        self._on_fail(j.step_id, err)

    def _current(self, msg: JoinAck | Redirect | NoGroup) -> _Join | None:
        j = self.join
        if j is None or msg.step_id != j.step_id or msg.key != j.key or msg.sender != j.target[0]:
            return None
        return j

    def _late(self, msg: JoinAck | Group) -> _Join | None:
        """The join `msg` answers if it comes from a rendezvous peer we asked during it, but moved
        on from (it was slow, not dead)."""
        j = self.join
        if (j is None or msg.step_id != j.step_id or msg.key != j.key or msg.sender == j.target[0]
                or j.asked.get(msg.sender) != msg.endpoint):
            return None
        return j

    def on_join_ack(self, msg: JoinAck, now: float) -> None:
        log.debug("%s t=%.3f JOIN_ACK <- %s", self.peer_id[:8], now, msg.sender[:8])
        j = self._current(msg)
        if j is None:
            j = self._late(msg)
            if j is None:
                if msg.step_id not in self._closed:  # (the rendezvous peer's answer to a step we grouped from notes)
                    self.late += 1  # an answer to a join we are no longer making
                return
            # a peer we gave up on holds our JOIN after all. Go back to it if it ranks before the one
            # we wait on now (it is where the others go); else stay, it will drop us on our LEAVE
            order = self.ranking(j.key)
            rank = {p: i for i, p in enumerate(order)}
            if rank.get(msg.sender, len(order)) >= rank.get(j.target[0], len(order)):
                self._send(msg.endpoint, Leave(self.peer_id, self.endpoint, key=j.key, step_id=j.step_id))
                return
            j.history.append(f"{msg.sender[:8]}: late JOIN_ACK, back to it")
            self._send(j.target[1], Leave(self.peer_id, self.endpoint, key=j.key, step_id=j.step_id))
            j.silent.discard(msg.sender)
            j.target = (msg.sender, msg.endpoint)
            j.move(JoinPhase.QUEUED)
        elif j.phase is not JoinPhase.ASKING:
            return
        else:
            j.move(JoinPhase.QUEUED)
        # the rendezvous peer closes its window at most matchmaking_time after our join
        j.since = now
        j.wait_until = now + self.matchmaking_time + 2 * self.request_timeout + 2.0 * self._rtt(msg.endpoint)

    def on_redirect(self, msg: Redirect, now: float) -> None:
        j = self._current(msg)
        if j is None:
            if msg.step_id not in self._closed:
                self.late += 1  # an answer to a join we are no longer making
            return
        j.history.append(f"{msg.sender[:8]} redirected to {msg.to_id[:8]}")
        if msg.to_id in j.silent:
            # the redirecting peer still believes in a peer that already failed us (gossip has not
            # expired it yet): ask the redirecting peer again with the hop budget spent, so it
            # takes the join itself instead of bouncing us back until peer_timeout
            j.history.append(f"{msg.to_id[:8]} already silent: asking {msg.sender[:8]} to host")
            j.hops = 2
            self._ask(j, msg.sender, msg.endpoint, now)
            return
        j.hops += 1
        self._ask(j, msg.to_id, msg.to_endpoint, now)

    def on_no_group(self, msg: NoGroup, now: float) -> None:
        j = self._current(msg)
        if j is None:
            if msg.step_id not in self._closed:
                self.late += 1  # an answer to a join we are no longer making
            return
        j.seen = max(j.seen, msg.seen)
        j.history.append(f"{msg.sender[:8]}: {msg.reason}")
        if not msg.retry:
            self._fail(now, "left over after the key's full group formed")
        elif self._swarm_moved_on(j, now):
            self._fail(now, f"every other live peer with this key went past round {j.round}",
                       "This peer called after the others' group formed: call step() when they do (a schedule "
                       "they share, e.g. step(scheduled_time=...)), or raise matchmaking_time if its link is slow.")
        elif now + self.matchmaking_time + self.request_timeout <= j.deadline:
            self._ask_next(now)  # another window fits in the budget: try again
        else:
            self._fail(now, "matchmaking window closed without enough peers")

    def on_group(self, msg: Group, now: float) -> None:
        j = self.join
        log.debug("%s t=%.3f GROUP <- %s", self.peer_id[:8], now, msg.sender[:8])
        members = msg.members
        mine = [i for i, m in enumerate(members) if m.peer_id == self.peer_id]
        if len(mine) == 1 and self._closed.get(members[mine[0]].step_id) == msg.group_id:
            return  # the group we formed from the notes: the rendezvous peer formed it too
        # any GROUP that holds our current step is taken while we have none: its pool got our JOIN
        # (perhaps after we moved on from a slow rendezvous peer), and its members wait for us
        current = (j is not None and msg.key == j.key and len(mine) == 1 and members[mine[0]].step_id == j.step_id)
        if not current:
            if len(mine) != 1 or members[mine[0]].step_id not in self._steps:
                # not a group of ours (an honest rendezvous peer sends a GROUP only to its members,
                # and only with the step they joined with): refused, and nobody is contacted for it
                self.dropped += 1
                if self.drops is not None:
                    self.drops.note(log, f"{msg.sender[:16]} at {msg.endpoint}", "a GROUP for a step this peer never made",
                                    f"group {msg.group_id[:8]} of {len(members)}")
                return
            # a group for a step we gave up on: tell its members not to wait for us -- those we
            # know (`knows`); any other member excludes us after its part_timeout, as it would a dead one
            abort = Abort(self.peer_id, self.endpoint, group_id=msg.group_id, reason="step no longer active")
            for m in members:
                if m.peer_id != self.peer_id and self.knows(m.peer_id, m.endpoint):
                    self._send(m.endpoint, abort)
            return
        if len({m.peer_id for m in members}) != len(members):  # a peer's bad data: GroupSpec would refuse it
            log.warning("%s: dropped malformed GROUP from %s: a peer appears twice", self.peer_id, msg.sender)
            self.dropped += 1
            return
        spec = GroupSpec(j.key, msg.group_id, members, mine[0], msg.left_out)
        if msg.sender != j.target[0]:
            j.history.append(f"{msg.sender[:8]}: late GROUP taken")
        # the other pools we joined must not count on us (the sender's is closed: it sent this), nor
        # the peers we noted that are not in this group
        self._leave_all(j, keep=msg.sender)
        inside = {m.peer_id for m in members}
        leave = Leave(self.peer_id, self.endpoint, key=j.key, step_id=j.step_id)
        for pid, ep in j.noted.items():
            if pid not in inside and pid not in j.asked:
                self._send(ep, leave)
        self._spend_notes(j.key, members)
        j.move(JoinPhase.DONE)
        self.join = None
        self._on_group(spec, now)

    # ================================================================ closing from notes
    #: notes older than this are forgotten (a groupmate may call its step this much later than we do)
    NOTE_TTL = 120.0
    MAX_NOTES = 4096

    def on_join_note(self, msg: JoinNote, now: float) -> None:
        """A peer that expects us in its group told us its JOIN: keep it (the latest per key and
        sender) and see whether our own join can now close from notes."""
        if self.peer_id not in msg.view or msg.sender not in msg.view or list(msg.view) != sorted(set(msg.view)):
            self.dropped += 1  # a note must name its sender and us, once each, sorted
            log.debug("%s: dropped JOIN_NOTE from %s: a view that names not both of us, or not sorted",
                      self.peer_id[:8], msg.sender[:8])
            return
        if msg.step_id in self._met:
            return  # it came after the GROUP that holds that step: spent
        if len(self._notes) >= self.MAX_NOTES:
            horizon = now - self.NOTE_TTL
            for k in [k for k, (_, t) in self._notes.items() if t < horizon] or [next(iter(self._notes))]:
                del self._notes[k]
        self._notes.pop((msg.key, msg.sender), None)
        self._notes[(msg.key, msg.sender)] = (msg, now)
        self._close_from_notes(now)

    def _spend_notes(self, key: str, members: tuple[MemberInfo, ...]) -> None:
        """A group with us formed: the notes of its members' steps are spent (a later step of ours in
        the same key and round -- a peer that repeats a pinned round -- must not form a group with
        steps that already averaged), and so is any such note still on its way."""
        for m in members:
            if m.peer_id == self.peer_id:
                continue
            got = self._notes.get((key, m.peer_id))
            if got is not None and got[0].step_id == m.step_id:
                del self._notes[(key, m.peer_id)]
            self._met.pop(m.step_id, None)
            self._met[m.step_id] = None
        while len(self._met) > 1024:
            self._met.pop(next(iter(self._met)))

    def _close_from_notes(self, now: float) -> None:
        """Form our group ourselves if every peer of our view told us, in a note, that it joins this
        key in this round with the same layout and the same view (module docstring)."""
        j = self.join
        if j is None or not j.view:
            return
        size = len(j.view)
        members = []
        calls = [j.started]  # when we called, and when each other member's note came
        rtt = 0.0  # the longest round trip to a member the gossip measured (0: none measured)
        for pid in j.view:
            if pid == self.peer_id:
                members.append(MemberInfo(pid, self.endpoint, j.bandwidth, j.step_id, int(j.gathers)))
                continue
            got = self._notes.get((j.key, pid))
            if got is None or now - got[1] > self.NOTE_TTL:
                return
            n = got[0]
            if n.round != j.round or n.view != j.view or n.layout != j.layout or n.want < size:
                return
            members.append(MemberInfo(pid, n.endpoint, n.bandwidth, n.step_id, int(n.gathers)))
            calls.append(got[1])
            rtt = max(rtt, self._rtt(n.endpoint))
        half = self.matchmaking_time / 2
        if max(calls) - min(calls) >= self.matchmaking_time - (min(rtt, half) if rtt > 0 else half):
            # the calls came so far apart that the rendezvous peer's window, opened by the first JOIN,
            # may have closed before the last: it may have cut the early ones into a group of their
            # own. Only it knows, so its GROUP decides (module docstring, "closing without ...")
            return
        if all(m.auxiliary for m in members) or all(m.bandwidth == 0 for m in members):
            return  # the rendezvous peer refuses such a group, with the reason
        gid = group_id_of(j.key, tuple(members))
        rank = j.view.index(self.peer_id)
        self._spend_notes(j.key, tuple(members))
        self._closed[j.step_id] = gid
        while len(self._closed) > 64:
            self._closed.pop(next(iter(self._closed)))
        self.closed_early += 1
        log.debug("%s t=%.3f group %s formed from notes (%d members)", self.peer_id[:8], now, gid[:8], size)
        j.move(JoinPhase.DONE)
        self.join = None
        self._on_group(GroupSpec(j.key, gid, tuple(members), rank), now)

    # ================================================================ rendezvous side
    def on_join(self, msg: Join, now: float) -> None:
        key = msg.key
        log.debug("%s t=%.3f JOIN <- %s hops=%d", self.peer_id[:8], now, msg.sender[:8], msg.hops)
        if not listens(self.endpoint):
            # a client-mode peer hosts no rendezvous (nobody ranks it; an honest joiner never asks
            # it): refused. Knowing no peer yet, it used to fail here on an empty ranking
            self.dropped += 1
            if self.drops is not None:
                self.drops.note(log, f"{msg.sender[:16]} at {msg.endpoint}", "a JOIN sent to a client-mode peer",
                                f"key {key[:80]!r}")
            return
        if msg.hops < 2:
            best = self.ranking(key)[0]
            if best != self.peer_id and best != msg.sender:
                ep = self.membership.endpoint_of(best)
                assert ep is not None
                self._send(msg.endpoint, Redirect(self.peer_id, self.endpoint, key=key, step_id=msg.step_id,
                                                  to_id=best, to_endpoint=ep))
                return
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = _Pool(closes=now + self.matchmaking_time, opened=now)
        pool.entries = [e for e in pool.entries if e.peer_id != msg.sender]
        pool.entries.append(_Entry(msg.sender, msg.endpoint, msg.step_id, msg.bandwidth, msg.layout, msg.want,
                                   int(msg.gathers), msg.layout_desc, msg.round, msg.view))
        if msg.view and self._close_agreed(key, pool, msg, now):
            return
        same = [e for e in pool.entries if e.layout == msg.layout]
        enough = max(self.min_group_size, min([self.target_group_size] + [e.want for e in same]))
        if len(same) < enough:
            close = self._all_came(key, pool, now, refresh=False)  # a small swarm: nobody else can come
        else:
            # Full: close after a short grace for stragglers rather than at once, so that a line that
            # turns out overfull (33 peers for groups of 32, common after faults) is cut evenly
            # (17 + 16) at close instead of leaving one peer without a group.
            close = (self.straggler_grace <= 0 or self._nobody_missing(pool)
                     or self._all_came(key, pool, now, refresh=False))
            if not close:
                pool.closes = min(pool.closes, now + self.straggler_grace)
        if not close:
            # the pool closes now otherwise, and its GROUP (or NO_GROUP) answers this joiner on the same
            # connection right away: an acknowledgement first would only cost the last joiner, at the
            # moment every member waits, one more message to build, send and read
            self._send(msg.endpoint, JoinAck(self.peer_id, self.endpoint, key=key, step_id=msg.step_id))
        else:
            self._close_pool(key, self.pools.pop(key), now)

    def _close_agreed(self, key: str, pool: _Pool, msg: Join, now: float) -> bool:
        """The rule members close by from notes, applied to the pool: if it holds the JOINs of every
        peer of `msg`'s view, each naming that view (same round and layout), form that group now --
        the group those members may already have formed themselves -- whatever this peer's own view
        says. The pool's other entries stay. True if it formed it."""
        view = msg.view
        if msg.sender not in view or list(view) != sorted(set(view)):
            return False
        size = len(view)
        if not (max(2, self.min_group_size) <= size <= min(self.target_group_size, NOTES_MAX)):
            return False
        by_id = {e.peer_id: e for e in pool.entries}
        got = [by_id.get(pid) for pid in view]
        if any(e is None or e.view != view or e.round != msg.round or e.round < 0 or e.layout != msg.layout
               or e.want < size for e in got):
            return False
        pool.entries = [e for e in pool.entries if e.peer_id not in view]
        self._formed[key] = (now, _round_of(got))  # type: ignore[arg-type]
        self._form(key, got)  # type: ignore[arg-type]
        if not pool.entries:
            self.pools.pop(key, None)
        return True

    def _nobody_missing(self, pool: _Pool) -> bool:
        """Every peer this node knows alive, itself included, is in the pool: no straggler can come,
        so waiting `straggler_grace` would only delay the group (e.g. a swarm that is one group)."""
        live = self.membership.live_ids()
        if len(pool.entries) <= len(live):
            return False
        joined = {e.peer_id for e in pool.entries}
        return self.peer_id in joined and joined.issuperset(live)

    def _all_came(self, key: str, pool: _Pool, now: float, refresh: bool) -> bool:
        """Whether every live peer that may use `key` this round has joined `pool`, so waiting out
        the window could only delay the group (a swarm smaller than the target). Only when the
        pool can form a group (else closing would just send everyone round for another window),
        and only when every joiner said its round. `refresh` asks `expected` again (the view
        changed); otherwise its answer from the pool's first check is reused, minus the peers
        that have joined since, so that a pool costs one scan of the view, not one per join."""
        if self._expected is None or not pool.entries or any(e.round < 0 for e in pool.entries):
            return False
        counts: dict[str, int] = {}
        for e in pool.entries:
            counts[e.layout] = counts.get(e.layout, 0) + 1
        if max(counts.values()) < self.min_group_size:
            return False
        if pool.coming is None or refresh:
            coming = self._expected(key, max(e.round for e in pool.entries), now)
            if coming is None:
                return False
            pool.coming = set(coming)
        pool.coming -= {e.peer_id for e in pool.entries}
        return not pool.coming

    def recheck(self, now: float) -> None:
        """The membership view changed (gossip, a goodbye, an expiry): a pool whose last missing
        peers turn out to be elsewhere or gone closes now."""
        for key in [k for k, p in self.pools.items() if p.coming is not None]:
            if self._all_came(key, self.pools[key], now, refresh=True):
                self._close_pool(key, self.pools.pop(key), now)

    def on_leave(self, msg: Leave, now: float) -> None:
        got = self._notes.get((msg.key, msg.sender))
        if got is not None and got[0].step_id == msg.step_id:
            del self._notes[(msg.key, msg.sender)]  # its step ended: no group may count on its note
        pool = self.pools.get(msg.key)
        if pool is not None:
            pool.entries = [e for e in pool.entries if not (e.peer_id == msg.sender and e.step_id == msg.step_id)]

    def _form(self, key: str, entries: list[_Entry], odd: list | None = None, why_odd: str = "") -> None:
        if all(e.gathers & 2 for e in entries):
            self._refuse(key, entries, f"all {len(entries)} peers with this key are auxiliary (no data to average)")
            return
        if all(e.bandwidth == 0 for e in entries):
            self._refuse(key, entries, f"all {len(entries)} peers with this key are clients (bandwidth 0)" + why_odd)
            return
        members = tuple(sorted((MemberInfo(e.peer_id, e.endpoint, e.bandwidth, e.step_id, e.gathers) for e in entries),
                               key=lambda m: m.peer_id))
        gid = group_id_of(key, members)
        # one message for all: each finds itself
        msg = Group(self.peer_id, self.endpoint, key=key, group_id=gid, members=members,
                    left_out=tuple((pid, what) for pid, what in odd or ()))
        for e in entries:
            self._send(e.endpoint, msg)

    def _refuse(self, key: str, entries: list[_Entry], reason: str, retry: bool = True) -> None:
        for e in entries:
            self._send(e.endpoint, NoGroup(self.peer_id, self.endpoint, key=key, step_id=e.step_id, reason=reason[:4000],
                                           seen=len(entries), retry=retry))

    def _close_pool(self, key: str, pool: _Pool, now: float) -> None:
        by_layout: dict[str, list[_Entry]] = {}
        for e in pool.entries:
            by_layout.setdefault(e.layout, []).append(e)
        total = len(pool.entries)
        for layout, entries in by_layout.items():
            n = len(entries)
            odd, why_odd = _layout_report(layout, entries[0].desc, by_layout) if n < total else ([], "")
            if n < self.min_group_size:
                why = f"window closed with {n} peer(s) for this key (min_group_size={self.min_group_size})" + why_odd
                # "this round": the group closed shortly before this pool opened (the leftover came
                # late) or while it was open -- not a group of an earlier round. Time alone cannot
                # tell: steps of a few ms follow each other closer than that, and a peer that steps
                # again at once after its group averaged must not be told its round is over (it
                # failed after one window, its timeout unspent, and the peer coming a moment later
                # found nobody). So a leftover whose every entry said a later round than the group's
                # members is a new round's first joiner: it tries another window.
                at, rnd = self._formed.get(key, (float("-inf"), -1))
                full = at >= pool.opened - self.matchmaking_time / 2 and not (
                    rnd >= 0 and all(e.round > rnd for e in entries))
                if full:
                    # the key's line already filled a group this round: nobody else is coming, so
                    # waiting another window would only burn the joiner's timeout
                    why += "; a full group for this key already formed this round"
                self._refuse(key, entries, why, retry=not full)
                continue
            groups = -(-n // self.target_group_size)
            while groups > 1 and n // groups < self.min_group_size:
                groups -= 1
            self._formed[key] = (now, _round_of(entries))
            if len(self._formed) > 4096:
                self._formed.clear()
            if groups == 1 and n > self.target_group_size:
                self._form(key, entries[: self.target_group_size], odd, why_odd)
                rest = entries[self.target_group_size :]
                self._refuse(key, rest, f"{len(rest)} peer(s) left over after cutting full groups; "
                             "a full group for this key already formed this round" + why_odd, retry=False)
                continue
            start = 0
            for g in range(groups):
                size = n // groups + (1 if g < n % groups else 0)
                self._form(key, entries[start : start + size], odd, why_odd)
                start += size

    def peer_down(self, endpoint: str, now: float) -> None:
        """The rendezvous peer we wait on is gone: ask the next candidate now."""
        j = self.join
        if j is not None and j.target[1] == endpoint and j.target[0] != self.peer_id:
            j.history.append(f"{j.target[0][:8]}: connection lost")
            j.silent.add(j.target[0])
            self._ask_next(now)

    # ================================================================ timers
    def deadline(self) -> float | None:
        times = [p.closes for p in self.pools.values()]
        if self.join is not None:
            times += [self.join.wait_until, self.join.deadline]
        return min(times) if times else None

    def on_timer(self, now: float) -> None:
        for key in [k for k, p in self.pools.items() if p.closes <= now]:
            self._close_pool(key, self.pools.pop(key), now)
        j = self.join
        if j is None:
            return
        if now >= j.deadline:
            self._fail(now, "step timeout reached")
        elif now >= j.wait_until:
            what = "no JOIN_ACK" if j.phase is JoinPhase.ASKING else "no group after the window"
            if j.target[0]:
                j.history.append(f"{j.target[0][:8]}: {what} within {j.wait_until - j.since:.2g}s")
                j.silent.add(j.target[0])
            else:  # nobody was asked (a client that knows no peer): say so, not ": no JOIN_ACK"
                j.history.append("no peer known to ask (a client learns peers only from its initial peers)")
            if j.phase is JoinPhase.QUEUED:
                self._send(j.target[1], Leave(self.peer_id, self.endpoint, key=j.key, step_id=j.step_id))
                j.asked.pop(j.target[0], None)  # it was told we left: its GROUP would not hold us
            self._ask_next(now)


_OTHER_LAYOUT = "with a different tensor layout"


def _layout_report(layout: str, desc: str, by_layout: dict[str, list[_Entry]]) -> tuple[list, str]:
    """For the peers of one layout: who used the key with another layout and what differs, as the
    GROUP message's ``odd`` list and as a sentence for a NO_GROUP reason ("yours" = the receiver's)."""
    odd: list[list[str]] = []
    parts: list[str] = []
    for other, entries in by_layout.items():
        if other == layout:
            continue
        what = layouts.difference(desc, entries[0].desc) if desc and entries[0].desc else None
        what = what or "their tensors differ in count, shape or dtype (no description was sent)"
        ids = [e.peer_id for e in entries]
        odd += [[pid, what[:1000]] for pid in ids[:64 - len(odd)]]
        names = ", ".join(p[:8] for p in ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
        parts.append(f"{len(ids)} other peer(s) ({names}) used this key {_OTHER_LAYOUT}: {what}")
    return odd, ("; " + "; ".join(parts)) if parts else ""


def _summarize(history: list[str], keep: int = 6) -> str:
    """The join's log for an error message: repeated entries once, with a count, in order of first
    appearance; the last `keep` distinct ones."""
    counts: dict[str, int] = {}
    for h in history:
        counts[h] = counts.get(h, 0) + 1
    lines = [h + (f" ({n} times)" if n > 1 else "") for h, n in counts.items()]
    if len(lines) > keep:
        lines = [f"({len(lines) - keep} earlier entries)"] + lines[-keep:]
    return "; ".join(lines)
