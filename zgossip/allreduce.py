"""Butterfly all-reduce inside one group: reduce-scatter, then all-gather, with failure semantics.

Member i owns span i of the flattened vector (`partition.make_plan`). Every member
streams its parts of span i to member i; the owner sums them *in the fixed member
order* (parts that arrive early wait, so arrival order never changes the bits),
weighted by each member's weight, divides by the weight sum and streams the averaged
part back to everyone whose data it contains. The two phases overlap part by part.

Failure semantics (see README, "What a step guarantees"):

* every element of a member's buffer ends either as a weighted mean over a set of
  contributors that includes that member, or unchanged — never a partial sum;
* a member silent for its silence limit (``part_timeout``, or with adaptive deadlines
  the limit its measured pace gives, `linkstats.silence_limit`) while it owes an owner
  data is excluded from that owner's remaining parts; an owner silent for twice the
  largest limit while others wait for results is declared lost, and its unresolved parts are *re-reduced* by a
  substitute (the next live member in ring order) among the survivors that still
  need them. If the substitute fails too, or ``deadline`` passes, what is left stays
  unchanged;
* the outcome lists, per span, how many parts were averaged and over whom.

Every part has an explicit state, and every state change goes through `_move`, which checks it
against the one transition table `MOVES` and raises `IllegalTransition` on a move it does not
list (a bug). A member sees each part of the buffer as `PartState` (waiting for its result, then
averaged, partly averaged or unchanged); a reducer sees each part it reduces as `ReduceState`
(collecting terms, then reduced or given up); the round itself is `RoundPhase`. What a reducer
does with NaN/inf, overflow and partial runs of terms is `zgossip.numeric`'s policy.

This module never touches sockets, threads or clocks: it is driven by `on_*` calls
with the current time and sends through the callable it is given.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import numpy as np

from .codecs import NONE, CodecMap
from .droplog import DropLog
from .endpoints import listens
from .errors import IllegalTransition, ProtocolError
from .matchmaking import GroupSpec
from .messages import Abort, Gather, GaveUp, Message, Part, Rescue, RescueCall, Result
from .numeric import PassPlan, add_pass, divide, plan_pass, scaled, take_finite, weight_exponent
from .linkstats import LinkStats, silence_limit
from .partition import PartPlan, group_plan, plan_bandwidths

__all__ = ["AllReduceRound", "FinishedRound", "RoundOutcome", "SpanOutcome", "RoundPhase", "PartState", "ReduceState", "MOVES", "transition"]

log = logging.getLogger(__name__)


class RoundPhase(Enum):
    RUNNING = "running"
    DONE = "done"


class PartState(Enum):
    """A part of the buffer, as one member sees it."""

    WAITING = "waiting"  # no result yet
    AVERAGED = "averaged"  # holds the mean over a set of contributors that includes this member
    PARTIAL = "partial"  # a leading range holds such a mean, the rest is unchanged (a NaN/inf cut it short)
    UNCHANGED = "unchanged"  # left as it was: given up, left out, its reducers lost, or the deadline passed


class ReduceState(Enum):
    """A part this member reduces (as the span's owner, or as the substitute of a lost owner)."""

    COLLECTING = "collecting"  # adding terms in member order as they come
    REDUCED = "reduced"  # the mean is computed and sent to its contributors
    GIVEN_UP = "given up"  # no mean (every other term lost, NaN/inf, overflow): members told to keep theirs


#: The one transition table of a round: every legal move of the round, of a part and of a reduction.
#: Terminal states have no moves; a handler that meets a part already settled ignores the message
#: (late or duplicate data) instead of asking for a move.
MOVES: dict[Enum, frozenset] = {
    RoundPhase.RUNNING: frozenset({RoundPhase.DONE}),
    RoundPhase.DONE: frozenset(),
    PartState.WAITING: frozenset({PartState.AVERAGED, PartState.PARTIAL, PartState.UNCHANGED}),
    PartState.AVERAGED: frozenset(),
    PartState.PARTIAL: frozenset(),
    PartState.UNCHANGED: frozenset(),
    ReduceState.COLLECTING: frozenset({ReduceState.REDUCED, ReduceState.GIVEN_UP}),
    ReduceState.REDUCED: frozenset(),
    ReduceState.GIVEN_UP: frozenset(),
}


def transition(old: Enum, new: Enum, what: str) -> Enum:
    """`new`, if `old` -> `new` is in `MOVES`; else IllegalTransition (a bug in this module)."""
    if new not in MOVES[old]:
        raise IllegalTransition(f"{what}: illegal move {old.value} -> {new.value}")
    return new


@dataclass(frozen=True)
class SpanOutcome:
    owner: str  # peer id of the member that owned the span
    parts: int
    averaged: int  # parts of this span that were averaged here
    rescued: int  # of which re-reduced by a substitute after the owner was lost
    contributors: tuple[str, ...]  # peers whose data is in at least one averaged part


@dataclass
class RoundOutcome:
    group_id: str
    key: str
    members: tuple[str, ...]
    rank: int
    gathered: dict[str, Any]
    weights: dict[str, float]
    spans: tuple[SpanOutcome, ...]
    updated: list[tuple[int, int]]  # element ranges of the buffer that now hold averages
    lost: tuple[str, ...]  # members excluded or declared lost during the round
    bytes_sent: int = 0
    bytes_received: int = 0
    auxiliary: tuple[str, ...] = ()  # members that lent bandwidth only (weight 0, no data)

    @property
    def complete(self) -> bool:
        """True when every element was averaged over every member that brought data."""
        n = len(self.members) - len(self.auxiliary)
        return not self.lost and all(
            s.parts == 0 or (s.averaged == s.parts and len(s.contributors) == n) for s in self.spans
        )

    @property
    def contributors(self) -> tuple[str, ...]:
        out = set()
        for s in self.spans:
            out.update(s.contributors)
        return tuple(p for p in self.members if p in out)


@dataclass(frozen=True)
class FinishedRound:
    """What a node keeps of a round it finished (`AllReduceRound.finished`), to answer the rescue
    messages that still come: a substitute's call hears that we need nothing, a request to rescue a
    span gets an empty notice per part it asked for (the requester settles them unchanged at once).
    A request to a member whose round was over went unanswered before: a member that saw the
    owner die after we had all its results asked us, waited 2 x part_timeout and gave us up."""

    me: tuple[str, str]  # our peer id and endpoint
    group_id: str
    members: tuple[tuple[str, str], ...]  # (peer id, endpoint) in member order
    parts: tuple[int, ...]  # parts of each member's span

    def answer(self, msg: RescueCall | Rescue) -> list[Message] | None:
        """The replies to `msg` (to its sender; none for a request that asks for nothing, e.g. an answer
        to a call of ours that came after our round was over), or None if it is refused: from a
        non-member, or a request to rescue a span that is ours or the requester's."""
        if (msg.sender, msg.endpoint) not in self.members or not 0 <= msg.owner < len(self.parts):
            return None
        sender, endpoint = self.me
        if type(msg) is RescueCall:
            return [Rescue(sender, endpoint, group_id=self.group_id, owner=msg.owner, need=())]
        if self.members[msg.owner] in (self.me, (msg.sender, msg.endpoint)):
            return None
        empty = np.empty(0, np.float32)
        return [Result.trusted(sender, endpoint, self.group_id, msg.owner, p, (), True, NONE, (), empty)
                for p in sorted(set(msg.need)) if p < self.parts[msg.owner]]


class _Reduce:
    """Reduction of one span: as its owner, or as the substitute of a lost owner (rescue)."""

    def __init__(self, owner: int, plan: PartPlan, dtype: np.dtype, n: int, rescue: bool) -> None:
        lo, hi = plan.span(owner)
        self.owner, self.lo, self.rescue, self.n = owner, lo, rescue, n
        self.nparts = plan.num_parts(owner)
        self.acc = np.empty(hi - lo, dtype=dtype)
        self.pos = [0] * self.nparts
        self.wsum = [0.0] * self.nparts
        self.wexp = [0] * self.nparts  # the power of two each part's weights are divided by (`numeric.weight_exponent`)
        self.divided = [False] * self.nparts  # the weight sum's division was fused into the last term
        self.own_left_out: set[int] = set()  # parts our own data was left out of (it held NaN/inf)
        self.contrib: list[list[int]] = [[] for _ in range(self.nparts)]
        self.pending: dict[tuple[int, int], tuple[np.ndarray, float]] = {}
        self.state = [ReduceState.COLLECTING] * self.nparts
        self.left = self.nparts
        self.excluded: set[int] = set()
        self.declared: dict[int, frozenset[int]] = {}  # rescue only: member -> parts it needs

    def owes(self, member: int) -> bool:
        """Does the reduction still wait for something from `member`?"""
        if member in self.excluded:
            return False
        if self.rescue and member not in self.declared:
            return True
        need = self.declared[member] if self.rescue else range(self.nparts)
        return any(
            self.state[p] is ReduceState.COLLECTING and self.pos[p] <= member and (member, p) not in self.pending
            for p in need
        )

    def settle(self, p: int, state: ReduceState) -> None:
        self.state[p] = transition(self.state[p], state, f"reduction of span {self.owner} part {p}")
        self.left -= 1


class AllReduceRound:
    def __init__(
        self,
        spec: GroupSpec,
        buffer: np.ndarray,
        weight: float,
        gather: Any,
        send: Callable[[str, Message], None],
        now: float,
        *,
        part_elems: int,
        part_timeout: float,
        deadline: float,
        on_done: Callable[["AllReduceRound", float], None],
        linkstats: LinkStats | None = None,
        part_timeout_floor: float | None = None,
        deadline_slack: float = 4.0,
        rtt: Callable[[str], float | None] | None = None,
        rate_of: Callable[[str], float | None] | None = None,
        drops: DropLog | None = None,
        codec: CodecMap | None = None,
    ) -> None:
        if buffer.ndim != 1:
            raise ProtocolError("the all-reduce buffer must be flat")
        self.spec = spec
        self.members = spec.members
        self.n = len(spec.members)
        self.rank = spec.rank
        self.me = spec.members[spec.rank]
        self.buf = buffer
        self.weight = float(weight)
        self._send_raw = send
        self._on_done = on_done
        #: refusals are logged once per source and kind (shared with the node, so across rounds too)
        self.drops = drops if drops is not None else DropLog(self.me.peer_id[:8])
        self.part_timeout = part_timeout
        self.deadline = deadline
        self.started = now
        self._now = now  # time of the event being handled
        # Adaptive deadlines: with `linkstats` and a floor, each member's silence limit follows its
        # measured pace (`linkstats.silence_limit`) instead of the fixed part_timeout.
        self.stats = linkstats
        self._floor = part_timeout_floor
        self._slack = deadline_slack
        self._rtt = rtt
        self._rate_of = rate_of  # a member's gossiped rate (Mbit/s): its pace before we measured one
        self._limits_seen: list[float] = []  # data-silence limits used (min/max reported)
        self._result_limits_seen: list[float] = []
        if linkstats is not None:
            linkstats.begin(now)
        self._watchdog = now + part_timeout / 4
        self.phase = RoundPhase.RUNNING
        # the round's own PARTs and RESULTs are built unchecked on the hot path (`Part.trusted`): what
        # they hold is checked here once -- ids, group id, weight and the buffer's dtype
        Part(self.me.peer_id, self.me.endpoint, group_id=spec.group_id, owner=0, part=0, weight=self.weight,
             rescue=False, data=buffer[:0])
        self._gid = spec.group_id
        bws = plan_bandwidths([m.bandwidth for m in spec.members], [m.gathers for m in spec.members])
        self.plan = group_plan(buffer.size, tuple(bws), part_elems, buffer.dtype.itemsize)
        self.index = {m.peer_id: i for i, m in enumerate(spec.members)}
        self.last_heard = [now] * self.n  # when each member's last message came (only messages count)
        self.asked_at = [float("-inf")] * self.n  # when we last asked each member for a rescue
        self.lost: set[int] = set()
        # members done with us: they told us they went on without us (GAVE_UP) or left (ABORT), or
        # their connection dropped -- nothing still queued for them is of use (`Node.gone`); unlike
        # members we gave up ourselves, which may be alive and still take results queued before
        self.done_with_us: set[int] = set()
        # rescue calls / requests we could not believe yet (the owner still heard from): (until, sender,
        # message). A crash's disconnect notice reaches members a few ms apart, so a call can come just
        # before our own notice: it is decided when the owner is lost to us, or refused at `until`
        self._deferred: list[tuple[float, int, Message]] = []
        # rescue parts that came right behind a deferred request (the requester sends its parts with
        # it): (sender, owner) -> parts, replayed when the request is decided. Dropping them left the
        # substitute waiting for parts already sent, and it gave a live member up (`_on_part`)
        self._held: dict[tuple[int, int], list[Part]] = {}
        # owner -> members whose request to rescue that span we refused with notices: they settled
        # those parts unchanged, so a rescue we start later counts them as needing nothing. Waiting
        # for a declaration they had no reason to send, we gave live members up after part_timeout
        self._refused: dict[int, set[int]] = {}
        # members that pass no gather data send no GATHER (in large groups that all-to-all would
        # dominate the traffic); their entry is None and their weight is known to the span owners only
        self.gathered: dict[int, Any] = {i: None for i, m in enumerate(spec.members) if not m.sends_gather}
        # two client-mode peers cannot reach each other (neither listens): they exchange no GATHER
        self.client = not listens(self.me.endpoint)
        if self.client:
            self.gathered.update({i: None for i, m in enumerate(spec.members) if not listens(m.endpoint)})
        self.gathered[self.rank] = gather
        self.weights: dict[int, float] = {self.rank: self.weight}
        nparts = [self.plan.num_parts(o) for o in range(self.n)]
        waiting = PartState.WAITING
        self.status = [[waiting] * k for k in nparts]
        self.part_contrib: list[list[tuple[int, ...]]] = [[()] * k for k in nparts]
        self.rescued = [0] * self.n
        self.unresolved = sum(nparts)
        self.own = _Reduce(self.rank, self.plan, buffer.dtype, self.n, rescue=False)
        # Auxiliary members (weight 0) bring no data: nobody waits for their parts, they send none,
        # and they need no results -- they only reduce their span for the others.
        self.aux = frozenset(i for i, m in enumerate(spec.members) if m.auxiliary)
        self.own.excluded |= self.aux
        if self.rank in self.aux:
            for o in range(self.n):
                if o != self.rank:
                    self.status[o] = [PartState.UNCHANGED] * len(self.status[o])
                    self.unresolved -= len(self.status[o])
        self.rescues: dict[int, _Reduce] = {}  # spans I re-reduce as a substitute
        self.rescue_target: dict[int, int] = {}  # lost owner -> substitute I declared to
        self.bytes_sent = 0
        self.bytes_received = 0
        self.late_results = 0
        self.partial: list[tuple[int, int, int, tuple[int, ...]]] = []  # (owner, lo, hi, contrib) of results taken in part
        self.dropped = 0  # messages refused by validation against the group's plan (logged too)
        self.late = 0  # late or duplicate messages ignored: what they carry was settled already
        # wire compression (`zgossip.codecs`): parts and results travel encoded as the group agreed (the
        # map is part of the layout peers are grouped by); terms are decoded before they are reduced
        self.codec = codec if codec is not None and not codec.lossless else None
        # receipts (upload measurement, `LinkStats.on_receipt`): as an owner, when each member's
        # first PART of the round and each of its parts arrived here, returned in RESULT's `rx`; as a
        # member, the wire bytes of each part we sent, to pair with the receipts coming back
        self._first_rx: dict[int, float] = {}
        self._rx_at: dict[tuple[int, int], float] = {}
        self._sent_bytes: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------------ helpers
    def _part(self, owner: int, p: int, rescue: bool) -> Part:
        lo, hi = self.plan.part(owner, p)
        cid, data = (NONE, self.buf[lo:hi]) if self.codec is None else self.codec.encode(lo, hi, self.buf[lo:hi])
        return Part.trusted(self.me.peer_id, self.me.endpoint, self._gid, owner, p, self.weight, rescue, cid, data)

    def _result(self, owner: int, p: int, contrib: tuple[int, ...], rescue: bool, data: np.ndarray,
                cid: int = NONE) -> Result:
        rx: tuple[int, ...] = ()
        if self.stats is not None and not rescue and owner == self.rank and data.size:
            first, at = self._first_rx, self._rx_at
            # (capped at the wire's bound, 12.7 days: an over-long receipt must not cost the result)
            rx = tuple(min(round((at[(j, p)] - first[j]) * 1e6), 1 << 40) if (j, p) in at else -1 for j in contrib)
            if max(rx, default=-1) < 0:
                rx = ()
        return Result.trusted(self.me.peer_id, self.me.endpoint, self._gid, owner, p, contrib, rescue, cid, rx, data)

    def _decoded(self, lo: int, hi: int, cid: int, data: np.ndarray) -> np.ndarray | str:
        """A received payload as values (what the codec map says range [lo, hi) travels as), or why not."""
        if self.codec is None:
            if cid != NONE:
                return f"codec {cid} where the group agreed on raw values"
            return data
        out = np.empty(hi - lo, dtype=self.buf.dtype)
        why = self.codec.decode(lo, hi, cid, data, out)
        return out if why is None else why

    def _send(self, member: int, msg: Message) -> None:
        for arr in msg.payload:
            self.bytes_sent += arr.nbytes
        self._send_raw(self.members[member].endpoint, msg)

    def _others(self) -> list[int]:
        return [i for i in range(self.n) if i != self.rank and i not in self.lost]

    # ------------------------------------------------------------------ start
    def start(self, now: float) -> None:
        if self.me.sends_gather:
            gather_msg = Gather(self.me.peer_id, self.me.endpoint, group_id=self._gid, weight=self.weight,
                                data=self.gathered[self.rank])
            for j in self._others():
                if not (self.client and not listens(self.members[j].endpoint)):
                    self._send(j, gather_msg)
        # interleave owners part by part, starting after our own rank, so that all
        # owners receive their first parts early and the reductions overlap
        order = [(self.rank + k) % self.n for k in range(1, self.n)] if self.rank not in self.aux else []
        most = max((self.plan.num_parts(o) for o in order), default=0)
        for p in range(most):
            for o in order:
                if p < self.plan.num_parts(o):
                    msg = self._part(o, p, rescue=False)
                    self._sent_bytes[(o, p)] = msg.data.nbytes
                    self._send(o, msg)
        if self.codec is not None and self.rank not in self.aux:
            self.codec.zero_residual(*self.plan.span(self.rank))  # our own term is reduced exactly
        for p in range(self.own.nparts):
            self._advance(self.own, p, now)
        # the first watchdog tick follows the limits known now (measured paces, gossiped rates)
        self._refresh_limits(now)
        self._check_done(now)

    # ------------------------------------------------------------------ reduction
    def _expected(self, r: _Reduce, p: int, j: int) -> bool:
        """Is member j's term of part p still part of this reduction?"""
        if j in r.excluded or (r.rescue and j == r.owner):
            return False
        if j == self.rank and p in r.own_left_out:
            return False
        if r.rescue:
            need = r.declared.get(j)
            return need is None or p in need  # undeclared: it may still declare this part
        return True

    def _advance(self, r: _Reduce, p: int, now: float) -> None:
        """Add the terms of part p that are here, in fixed member order, up to the first one that
        is not; after the last, the part is done.

        The terms at hand are added in one pass (`kernels.accumulate`), which checks them for
        NaN/inf block by block, once they are all in or at least `numeric.MIN_RUN` of them are. The
        owner's last pass stores the mean straight into its own tensor (the result is sent from
        there), other passes into scratch space. A member whose term is not finite is excluded
        from this span (our own data is only left out of this part); its term is dropped exactly when nothing of the pass was stored yet (the bad
        value is in the first block, or the pass was the first and wrote scratch space), and
        otherwise the part is left unchanged for everyone, who are told so at once -- except
        the blocks the owner's last pass already stored in its own tensor: those are the mean
        over the pass's terms, and `updated` lists them. A sum that overflows is treated alike.
        """
        excluded = self._sum_part(r, p, now)
        if excluded is not None:  # parts that were waiting for that member's data may be complete now
            for q in range(r.nparts):
                if q != p:
                    self._advance(r, q, now)

    def _sum_part(self, r: _Reduce, p: int, now: float) -> int | None:
        """The body of `_advance`; returns a member it excluded, if any."""
        if r.state[p] is not ReduceState.COLLECTING:
            return None
        lo, hi = self.plan.part(r.owner, p)
        a = r.acc[lo - r.lo : hi - r.lo]
        excluded = None
        while True:
            run: list[tuple[int, np.ndarray, float]] = []
            k = r.pos[p]
            while k < self.n:
                if not self._expected(r, p, k):
                    k += 1
                elif r.rescue and k not in r.declared:
                    break  # wait for k's declaration (or its exclusion)
                elif k == self.rank:
                    run.append((k, self.buf[lo:hi], self.weight))
                    k += 1
                elif (k, p) in r.pending:
                    data, w = r.pending[(k, p)]
                    if data.dtype != self.buf.dtype:  # an encoded term (`_on_part` checked it against the map)
                        data = self._decoded(lo, hi, self.codec.layout(lo, hi)[0], data)
                    run.append((k, data, w))
                    k += 1
                else:
                    break  # wait for k's part
            complete = k >= self.n
            first = not r.contrib[p]
            plan = plan_pass(len(run), complete, first)
            if plan is PassPlan.WAIT:
                return excluded
            if plan is PassPlan.FINISH:
                break
            if plan is PassPlan.ALONE:
                # every other member's term is gone (lost, excluded): the part is left unchanged for
                # that member too, as the others are told (`numeric`: a mean over one is no mean)
                r.pending.pop((run[0][0], p), None)
                self._finish_part(r, p, (), a, now)
                return excluded
            wsum = r.wsum[p] + sum(w for _, _, w in run)
            if first:  # weights are relative: scaled by a power of two so that float32 can hold them
                r.wexp[p] = weight_exponent([w for _, _, w in run])
            e = r.wexp[p]
            # the owner's last pass writes the mean straight into its own tensor (saving a copy of
            # the part) when its own data is in the mean; a rescuer's always goes to scratch space
            mine = not r.rescue and (self.rank in r.contrib[p] or any(j == self.rank for j, _, _ in run))
            out = self.buf[lo:hi] if complete and mine else a
            verdict = add_pass(out, a, [d for _, d, _ in run], [scaled(w, e) for _, _, w in run], first,
                               scaled(wsum, e) if complete else 0.0)
            if verdict.ok:
                for j, _, _ in run:
                    r.pending.pop((j, p), None)
                    r.contrib[p].append(j)
                r.wsum[p] = wsum
                r.pos[p] = k
                r.divided[p] = complete
                if complete:
                    self._finish_part(r, p, tuple(r.contrib[p]), a, now, in_buf=out is not a)
                return excluded
            kept = (lo, lo + verdict.kept, tuple(r.contrib[p]) + tuple(j for j, _, _ in run)) \
                if verdict.kept else None
            if verdict.bad_term is not None:
                j = run[verdict.bad_term][0]
                if j == self.rank:
                    log.warning("%s: own data in span %d part %d holds NaN or inf: left out", self.me.peer_id[:8],
                                r.owner, p)
                    r.own_left_out.add(p)
                else:
                    # one NaN would poison every member's average: the sender is excluded from this
                    # reduction (its own copy of these elements stays unchanged), the others go on
                    self.dropped += 1
                    self.drops.note(log, self.members[j].peer_id, "a PART holding NaN or inf",
                                    f"part {p} of span {r.owner}: sender excluded from this span")
                    r.excluded.add(j)
                    for key in [key for key in r.pending if key[0] == j]:
                        del r.pending[key]
                    excluded = j
            if verdict.give_up is not None:
                self._give_up(r, p, a, now, verdict.give_up, kept)
                return excluded
            # nothing of that pass counts: try again without the bad term
        # the last expected term never came (its member was excluded), so the division was not
        # fused into it: done here, it can still overflow
        why = divide(a, scaled(r.wsum[p], r.wexp[p])) if r.contrib[p] and not r.divided[p] else None
        if why is not None:
            self._give_up(r, p, a, now, why)
        else:
            self._finish_part(r, p, tuple(r.contrib[p]), a, now)
        return excluded

    def _give_up(self, r: _Reduce, p: int, a: np.ndarray, now: float, why: str,
                 kept: tuple[int, int, tuple[int, ...]] | None = None) -> None:
        """Leave part p unchanged for every member (they get notices, so nobody waits) -- except
        for `kept`, a leading range (lo, hi, contributors) our own tensor already holds the mean of."""
        log.warning("%s: span %d part %d left unchanged for everyone%s: %s", self.me.peer_id[:8], r.owner, p,
                    f" (but the first {kept[1] - kept[0]} elements here)" if kept else "", why)
        if kept:
            self.partial.append((r.owner, *kept))
        self._finish_part(r, p, (), a, now, partial=bool(kept))

    def _finish_part(self, r: _Reduce, p: int, contrib: tuple[int, ...], a: np.ndarray, now: float,
                     in_buf: bool = False, partial: bool = False) -> None:
        """Part p is reduced (its mean is in `a`, or already in our tensor when `in_buf`), or given
        up (no contributors; `partial`: but a leading range of our tensor holds a mean): send the
        result or notices, and settle the part here."""
        r.settle(p, ReduceState.REDUCED if contrib else ReduceState.GIVEN_UP)
        for key in [k for k in r.pending if k[1] == p]:  # terms that came after the part was given up
            del r.pending[key]
        lo, hi = self.plan.part(r.owner, p)
        if in_buf:
            a = self.buf[lo:hi]  # sent zero-copy from there; nothing writes a settled part again
        cid, wire_a = NONE, a
        if contrib and self.codec is not None:
            # the mean is encoded once; we keep its *decoded* form, as every other member does
            cid, wire_a = self.codec.encode(lo, hi, a, feedback=False)
            if cid != NONE:
                decoded = self._decoded(lo, hi, cid, wire_a)
                assert not isinstance(decoded, str)
                if self.rank in contrib and self.weight > 0:
                    self.codec.carry_result(lo, hi, a, decoded, r.wsum[p] / self.weight)
                a = decoded
                in_buf = False
        if contrib:
            msg = self._result(r.owner, p, contrib, r.rescue, wire_a, cid)
            for j in contrib:
                if j != self.rank:
                    self._send(j, msg)
        # members we left out but believe alive (e.g. their data held NaN, or the mean overflowed)
        # get an empty notice, so they settle this part as unchanged instead of waiting for it
        # until a timeout
        expected = r.declared if r.rescue else range(self.n)
        notice = None
        for j in expected:
            if (j != self.rank and j not in contrib and j not in self.lost and j not in self.aux
                    and (not r.rescue or p in r.declared[j])):
                notice = notice or self._result(r.owner, p, contrib, r.rescue, a[:0])
                self._send(j, notice)
        if contrib and not r.rescue and self.rank in self.aux:
            self.part_contrib[self.rank][p] = contrib  # what we reduced for the others, for the outcome
        if self.rank in contrib and cid != NONE:
            self._resolve(r.owner, p, contrib, a, rescued=r.rescue)  # as the others take it (up to a NaN/inf)
        elif self.rank in contrib:
            if not in_buf:
                self.buf[lo:hi] = a  # checked finite by the reduction
            self._settle(r.owner, p, contrib, rescued=r.rescue)
        else:
            # our own data is not in this part (we left it out, e.g. NaN): our copy stays unchanged
            # (a no-op when the part was resolved already, e.g. a rescue part we did not need)
            self._resolve(r.owner, p, None, None, partial=partial)

    def _set_part(self, owner: int, p: int, state: PartState) -> None:
        self.status[owner][p] = transition(self.status[owner][p], state, f"span {owner} part {p}")
        self.unresolved -= 1

    def _settle(self, owner: int, p: int, contrib: tuple[int, ...], rescued: bool) -> None:
        self._set_part(owner, p, PartState.AVERAGED)
        self.part_contrib[owner][p] = contrib
        self.rescued[owner] += int(rescued)

    def _resolve(self, owner: int, p: int, contrib: tuple[int, ...] | None, data: np.ndarray | None,
                 rescued: bool = False, partial: bool = False) -> None:
        """Settle part p of `owner`'s span: with a result (copied into the buffer only as far as it
        is finite) or, without one, as unchanged (`partial`: but for a leading range already
        recorded in `self.partial`). A part already settled stays as it is (late or duplicate news)."""
        if self.status[owner][p] is not PartState.WAITING:
            return
        if contrib is not None and data is not None:
            lo, hi = self.plan.part(owner, p)
            done = take_finite(self.buf[lo:hi], data)
            if done == hi - lo:
                self._settle(owner, p, contrib, rescued)
                return
            self.dropped += 1
            self.drops.note(log, self.members[owner].peer_id, "a RESULT holding NaN or inf",
                            f"span {owner} part {p}: {done} of {hi - lo} elements taken (those before the first bad "
                            "block), the rest left unchanged")
            if done:
                self.partial.append((owner, lo, lo + done, contrib))
                partial = True
        self._set_part(owner, p, PartState.PARTIAL if partial else PartState.UNCHANGED)

    def _exclude(self, j: int, now: float) -> None:
        for r in [self.own, *self.rescues.values()]:
            if j in r.excluded:
                continue
            r.excluded.add(j)
            for key in [k for k in r.pending if k[0] == j]:
                del r.pending[key]
            for p in range(r.nparts):
                self._advance(r, p, now)

    # ------------------------------------------------------------------ failures
    def _unresolved_parts(self, owner: int) -> list[int]:
        return [p for p, s in enumerate(self.status[owner]) if s is PartState.WAITING]

    def _substitute_for(self, owner: int) -> int | None:
        for k in range(1, self.n):
            s = (owner + k) % self.n
            if s not in self.lost and self.members[s].bandwidth > 0:
                return s
        return None

    def _member_lost(self, j: int, now: float, substitute: int | None = None, tell: bool = False,
                     rescue: bool = True) -> None:
        """Member j is out of this round for us. `tell`: j may well be alive (it was silent past its
        limit, or a substitute's call says another member gave it up), so it is told (GAVE_UP) and
        settles at once what it waits for from us, instead of timing us out in turn -- on a lossy
        long link a member given up that way waited 18-21 s for results and rescues that were
        never coming, while its group finished in 4 s. `rescue=False` (j gave *us* up, and
        reduces its span without us): what we wait for from j stays unchanged, nothing is re-reduced."""
        if j == self.rank:
            return
        first = j not in self.lost
        self.lost.add(j)
        if first:
            log.info("%s: round %s: member %s lost", self.me.peer_id[:8], self.spec.group_id[:8], self.members[j].peer_id[:8])
            if tell:
                self._send(j, GaveUp(self.me.peer_id, self.me.endpoint, group_id=self._gid))
            self._exclude(j, now)
            # parts I had declared to j as a substitute will not come back
            for owner, s in self.rescue_target.items():
                if s == j:
                    for p in self._unresolved_parts(owner):
                        self._resolve(owner, p, None, None)
        if first and self._deferred:
            self._redo_deferred(now, owner=j)
        if j in self.rescue_target or self.plan.num_parts(j) == 0:
            return
        if not rescue:
            for p in self._unresolved_parts(j):
                self._resolve(j, p, None, None)
            return
        # a substitute lost to us is none (a call it sent before it died, held for a grace, is taken
        # when the owner is silent to us too): no limit covers a lost member, so we waited for its
        # results until the deadline. The next live one takes over, as if the call never came.
        s = substitute if substitute is not None and substitute not in self.lost else self._substitute_for(j)
        need = self._unresolved_parts(j)
        if s is None or s == j:
            for p in need:
                self._resolve(j, p, None, None)
            return
        self.rescue_target[j] = s
        self._asked(s)
        if s == self.rank:
            r = self._start_rescue(j)
            r.declared[self.rank] = frozenset(need)
            for p in range(r.nparts):
                self._advance(r, p, now)
            return
        self._send(s, Rescue(self.me.peer_id, self.me.endpoint, group_id=self._gid, owner=j, need=tuple(need)))
        for p in need:
            self._send(s, self._part(j, p, rescue=True))

    def _asked(self, k: int) -> None:
        """We just asked k for something (a rescue): what k owes for it is waited for from now.

        Only that: what k owed before (its GATHER, its parts of our span, the results of its own
        span) is still measured from its last message. Restarting k's clock altogether let every
        rescue add a fresh 2 x part_timeout: a peer cut off from its group went through the
        silent members one by one as substitutes and took 6 x part_timeout (30 s) in a group of 4."""
        self.asked_at[k] = max(self.asked_at[k], self._now)

    def _start_rescue(self, owner: int) -> _Reduce:
        """Become the substitute reducer of `owner`'s span and call the survivors in."""
        r = self.rescues.get(owner)
        if r is None:
            r = self.rescues[owner] = _Reduce(owner, self.plan, self.buf.dtype, self.n, rescue=True)
            r.excluded |= self.lost | self.aux
            r.declared.setdefault(self.rank, frozenset())
            for k in self._refused.get(owner, ()):
                r.declared.setdefault(k, frozenset())
            call = RescueCall(self.me.peer_id, self.me.endpoint, group_id=self._gid, owner=owner)
            for k in self._others():
                if k != owner and k not in r.declared:
                    self._send(k, call)
                    self._asked(k)
        return r

    # ------------------------------------------------------------------ messages
    def on_message(self, msg: Message, now: float) -> None:
        j = self.index.get(msg.sender)
        if j is None or j == self.rank or self.members[j].endpoint != msg.endpoint:
            self.dropped += 1
            self.drops.note(log, f"{msg.sender[:16]} at {msg.endpoint}", f"{msg.type.name} from a non-member",
                            f"group {self._gid[:8]}")
            return
        self._now = now
        self.last_heard[j] = now
        _HANDLERS[type(msg)](self, j, msg, now)
        self._check_done(now)

    def _on_gather(self, j: int, msg: Gather, now: float) -> None:
        if not self.members[j].sends_gather:
            return self._bad(j, msg, "GATHER from a member that announced it sends none")
        if j in self.gathered:
            self.late += 1  # a duplicate: the first GATHER stands
            return
        self.gathered[j] = msg.data
        self.weights[j] = msg.weight

    def _bad(self, j: int, msg: Message, why: str) -> None:
        self.dropped += 1
        self.drops.note(log, self.members[j].peer_id, f"{msg.type.name}: {why}", f"group {self._gid[:8]}")

    def _part_range(self, owner: int, p: int, payload: np.ndarray, cid: int = NONE) -> tuple[int, int] | None:
        if owner >= self.n or p >= self.plan.num_parts(owner):
            return None
        lo, hi = self.plan.part(owner, p)
        if self.codec is not None:  # length and codec are the map's to check (`_decoded`)
            return lo, hi
        if payload.size != hi - lo or payload.dtype != self.buf.dtype:
            return None
        return lo, hi

    def _on_part(self, j: int, msg: Part, now: float) -> None:
        owner, p, arr = msg.owner, msg.part, msg.data
        rng = self._part_range(owner, p, arr)
        if rng is None:
            return self._bad(j, msg, "part index, length or dtype does not match the group's plan")
        if msg.rescue and self._hold(j, msg):
            return
        if self.stats is not None:  # a transfer that completed, even one too late to be used: it measures the link
            self.stats.on_payload(msg.sender, arr.nbytes, now)
        if msg.rescue:
            r = self.rescues.get(owner)
            if r is None or p not in r.declared.get(j, ()):
                return self._bad(j, msg, "rescue part that was not declared")
        else:
            if owner != self.rank:
                return self._bad(j, msg, "part of a span this member does not own")
            r = self.own
        if j in r.excluded or r.state[p] is not ReduceState.COLLECTING or r.pos[p] > j or (j, p) in r.pending:
            self.late += 1  # late or duplicate: that member's share of this part is already settled
            return
        self.bytes_received += arr.nbytes
        if not msg.rescue and self.stats is not None:  # a receipt for its sender (`_result`)
            self._first_rx.setdefault(j, now)
            self._rx_at[(j, p)] = now
        if msg.codec != NONE or self.codec is not None:
            # checked now, decoded only when its pass comes (`_sum_part`): a few terms at a time in memory
            why = "codec where the group agreed on raw values" if self.codec is None else \
                self.codec.check(*rng, msg.codec, arr, self.buf.dtype)
            if why is not None:
                return self._bad(j, msg, why)
        if msg.weight <= 0:  # only an auxiliary member's weight is 0, and it sends no data: a 0 would
            # list the sender among the contributors of a mean without its data (all of them 0: no mean)
            return self._bad(j, msg, "weight 0 on a PART (its data cannot count)")
        self.weights.setdefault(j, msg.weight)
        r.pending[(j, p)] = (arr, msg.weight)
        self._advance(r, p, now)

    def _on_result(self, j: int, msg: Result, now: float) -> None:
        owner, p, arr = msg.owner, msg.part, msg.data
        contrib = tuple(msg.contributors)
        left_out = self.rank not in contrib and arr.size == 0  # a notice: this part was averaged without us
        rng = (owner, p) if left_out and owner < self.n and p < self.plan.num_parts(owner) else \
            self._part_range(owner, p, arr)
        if rng is None or any(c >= self.n for c in contrib):
            return self._bad(j, msg, "result does not match the group's plan")
        if self.stats is not None and arr.nbytes:  # counts for our download rate, not for the owner's pace
            self.stats.on_payload(msg.sender, arr.nbytes, now, pace=False)
        if not msg.rescue and owner in self.rescue_target:
            # a late result from an owner we already declared lost: our part of its span was handed to
            # the substitute (and may still be on its way, zero-copy from our buffer), so only the
            # substitute's result may write it
            self.late_results += 1
            self.late += 1
            return
        expected = self.rescue_target.get(owner) if msg.rescue else owner
        if j != expected:
            return self._bad(j, msg, "result from a member that does not reduce that span")
        if msg.rx:
            if len(msg.rx) != len(contrib):
                return self._bad(j, msg, "result's receipts do not match its contributors")
            if self.stats is not None and not msg.rescue and self.rank in contrib:
                rx, sent = msg.rx[contrib.index(self.rank)], self._sent_bytes.get((owner, p))
                if rx >= 0 and sent:
                    self.stats.on_receipt(msg.sender, sent, rx * 1e-6)
        self.bytes_received += arr.nbytes
        if self.status[owner][p] is not PartState.WAITING:
            self.late += 1  # settled already (by a rescue, or unchanged at a timeout): this news is late
            return
        if self.rank in contrib and (msg.codec != NONE or self.codec is not None):
            arr = self._decoded(*self.plan.part(owner, p), msg.codec, arr)
            if isinstance(arr, str):
                return self._bad(j, msg, arr)
        if self.rank in contrib:
            self._resolve(owner, p, contrib, arr, rescued=msg.rescue)
        else:
            self._resolve(owner, p, None, None)

    def _on_abort(self, j: int, msg: Abort, now: float) -> None:
        log.info("%s: member %s left round: %s", self.me.peer_id[:8], self.members[j].peer_id[:8], msg.reason)
        self.done_with_us.add(j)
        self._member_lost(j, now)

    def _on_gave_up(self, j: int, msg: GaveUp, now: float) -> None:
        log.info("%s: member %s gave us up in round %s", self.me.peer_id[:8], self.members[j].peer_id[:8], self._gid[:8])
        self.done_with_us.add(j)
        self._member_lost(j, now, rescue=False)

    def _silent(self, k: int, now: float) -> bool:
        """Whether member k may be gone as far as we can tell: lost to us, or not heard from for half
        of its silence limit."""
        if k in self.lost:
            return True
        return now - self.last_heard[k] >= 0.5 * self._limits(now).get(k, self.part_timeout)

    def _implausible_rescue(self, owner: int, sub: int, now: float) -> str | None:
        """Why a rescue of `owner`'s span by `sub` is not to be believed, or None. A substitute takes
        over a span: a member may only be one if it reduces (bandwidth > 0), if the owner is silent to
        us too, and if every member between the owner and it in ring order (the substitutes that
        come first) is silent to us -- else any groupmate could claim a live member's span and
        write what it likes there (a rescue call, or a rescue request naming us). An honest cut that
        only some members see (they do not hear the owner, we do) is refused the same way: we keep
        the owner's own results, the others average that span without us."""
        if self.members[sub].bandwidth <= 0:
            return "its substitute reduces nothing (bandwidth 0)"
        if not self._silent(owner, now):
            return "its owner is still heard from"
        k = (owner + 1) % self.n
        while k != sub:
            if k != self.rank and self.members[k].bandwidth > 0 and not self._silent(k, now):
                return f"member {k} comes first in ring order and is still heard from"
            k = (k + 1) % self.n
        return None

    def _defer(self, j: int, msg: Message, now: float, why: str) -> bool:
        """Keep a rescue call / request we cannot believe yet, for a grace of a quarter of
        part_timeout (at most 1 s); True if kept. Not for a substitute that reduces nothing, and
        not twice (a deferred message comes back here when its grace is over)."""
        if self.members[j if type(msg) is RescueCall else self.rank].bandwidth <= 0:
            return False
        if any(m is msg for _, _, m in self._deferred) or getattr(self, "_expiring", False):
            return False
        self._deferred.append((now + min(1.0, 0.25 * self.part_timeout), j, msg))
        return True

    def _hold(self, j: int, msg: Part) -> bool:
        """Keep a rescue part from j that its deferred request (`Rescue`) declared, until the request
        is decided; True if kept. A part nobody declared is not kept (`_on_part` drops it)."""
        r = self.rescues.get(msg.owner)
        if r is not None and msg.part in r.declared.get(j, ()):
            return False
        if not any(k == j and type(m) is Rescue and m.owner == msg.owner and msg.part in m.need
                   for _, k, m in self._deferred):
            return False
        held = self._held.setdefault((j, msg.owner), [])
        if any(h.part == msg.part for h in held):
            return False  # a duplicate: dropped and counted as one
        held.append(msg)
        return True

    def _redo_deferred(self, now: float, owner: int | None = None) -> None:
        """Decide the deferred rescue messages about `owner` (lost to us now), or those whose grace is
        over; then the rescue parts held behind a request (taken if it was, dropped and counted if not)."""
        due = [d for d in self._deferred if (owner is not None and d[2].owner == owner) or (owner is None and d[0] <= now)]
        if not due:
            return
        self._deferred = [d for d in self._deferred if d not in due]
        self._expiring = True
        try:
            for _, j, msg in due:
                _HANDLERS[type(msg)](self, j, msg, now)
                for part in self._held.pop((j, msg.owner), []) if type(msg) is Rescue else []:
                    self._on_part(j, part, now)
        finally:
            self._expiring = False

    def _on_rescue_call(self, j: int, msg: RescueCall, now: float) -> None:
        owner = msg.owner
        if owner >= self.n or owner == self.rank:
            return self._bad(j, msg, "rescue call for a span that is not another member's")
        if owner in self.rescue_target:
            if self.rescue_target[owner] != j:  # we asked another substitute: j need not wait for us
                self._send(j, Rescue(self.me.peer_id, self.me.endpoint, group_id=self._gid, owner=owner, need=()))
            return
        why = self._implausible_rescue(owner, j, now)
        if why is not None and self._defer(j, msg, now, why):
            return
        if why is not None:
            self._send(j, Rescue(self.me.peer_id, self.me.endpoint, group_id=self._gid, owner=owner, need=()))
            return self._bad(j, msg, f"rescue call for span {owner} refused: {why}")
        self._member_lost(owner, now, substitute=j, tell=True)
        if owner not in self.rescue_target:  # nothing to rescue here: still answer, so j need not wait
            self._send(j, Rescue(self.me.peer_id, self.me.endpoint, group_id=self._gid, owner=owner, need=()))

    def _on_rescue(self, j: int, msg: Rescue, now: float) -> None:
        owner = msg.owner
        if owner >= self.n or owner == self.rank or self.plan.num_parts(owner) == 0:
            return self._bad(j, msg, "rescue of a span that is not another member's or is empty")
        need = frozenset(p for p in msg.need if p < self.plan.num_parts(owner))
        if owner not in self.rescue_target:
            why = self._implausible_rescue(owner, self.rank, now)
            if why is not None and self._defer(j, msg, now, why):
                return
            if why is not None:
                # settle what j asked for as unchanged on its side at once (empty notices), not by its timeout
                for p in sorted(need):
                    self._send(j, self._result(owner, p, (), True, self.buf[:0]))
                self._refused.setdefault(owner, set()).add(j)
                return self._bad(j, msg, f"request to rescue span {owner} refused: {why}")
            self._member_lost(owner, now, substitute=self.rank, tell=True)  # declares my own needs too
        r = self._start_rescue(owner)
        old = r.declared.get(j)
        if old is None:
            r.declared[j] = need
        elif need - old:
            # j declared less before: it refused our call while it still heard the owner, and lost the
            # owner itself since. Its parts are taken where j's term can still be added in order;
            # where the part was summed past j without it, j is told at once to keep its own values
            # (it was not: the parts it sent were dropped as undeclared, it waited for results that
            # never came, and each of two live members ended by giving the other up)
            r.declared[j] = old | need
            for p in sorted(need - old):
                if r.state[p] is not ReduceState.COLLECTING or r.pos[p] > j:
                    self._send(j, self._result(owner, p, (), True, self.buf[:0]))
        for p in range(r.nparts):
            self._advance(r, p, now)

    def peer_down(self, endpoint: str, now: float) -> None:
        self._now = now
        for j, m in enumerate(self.members):
            if j != self.rank and m.endpoint == endpoint and j not in self.lost:
                self.done_with_us.add(j)
                self._member_lost(j, now)
        self._check_done(now)

    # ------------------------------------------------------------------ time
    def _waiting_on(self, j: int) -> tuple[bool, bool, bool, bool]:
        """What we still expect from member j: (data it owed from the start -- its GATHER, its parts
        of our span --, data for a rescue we run, results of its own span, results of a rescue
        we asked it for)."""
        data = self.own.owes(j) or j not in self.gathered
        rescue_data = any(r.owes(j) for r in self.rescues.values())
        results = bool(self._unresolved_parts(j)) and j not in self.rescue_target
        rescue_results = any(s == j and self._unresolved_parts(o) for o, s in self.rescue_target.items())
        return data, rescue_data, results, rescue_results

    def next_deadline(self) -> float | None:
        # Silence is checked on a watchdog tick of a quarter of the shortest silence limit
        # (`_refresh_limits`) rather than per member per event (which costs O(n^2) per message
        # in large groups): a silent member is noticed between T and 1.25 T after its last message.
        if self.phase is RoundPhase.DONE:
            return None
        return min(self.deadline, self._watchdog, *(d[0] for d in self._deferred))

    def on_timer(self, now: float) -> None:
        if self.phase is RoundPhase.DONE:
            return
        self._now = now
        if self._deferred:
            self._redo_deferred(now)
        if now >= self.deadline:
            for o in range(self.n):
                for p in self._unresolved_parts(o):
                    self._resolve(o, p, None, None)
            self._check_done(now, force=True)
            return
        if now < self._watchdog:
            return
        T = self.part_timeout
        limits, R = self._refresh_limits(now)
        for j in range(self.n):
            if j == self.rank or j in self.lost:
                continue
            Tj = limits.get(j, T)
            heard = self.last_heard[j]
            asked = max(heard, self.asked_at[j])
            if now < heard + min(Tj, T):
                continue
            data, rescue_data, results, rescue_results = self._waiting_on(j)
            if ((data and now >= heard + Tj) or (results and now >= heard + R)
                    or (rescue_data and now >= asked + T) or (rescue_results and now >= asked + 2 * T)):
                self._member_lost(j, now, tell=True)
        self._check_done(now)

    def _refresh_limits(self, now: float) -> tuple[dict[int, float], float]:
        """The silence limits for this tick (`_limits`) and for results (an owner's results wait on
        its slowest sender, so they get the largest limit, doubled); records them for
        `deadlines_used` and sets the next watchdog tick to a quarter of the shortest."""
        T = self.part_timeout
        limits = self._limits(now)
        R = 2 * max(limits.values(), default=T)
        self._watchdog = now + min([T, *limits.values()]) / 4
        if limits:
            self._limits_seen.append(min(limits.values()))
            self._limits_seen.append(max(limits.values()))
            self._result_limits_seen.append(R)
        return limits, R

    def _limits(self, now: float) -> dict[int, float]:
        """Each live groupmate's data-silence limit: `part_timeout`, or with adaptive deadlines the
        limit its measured pace gives for one part (`linkstats.silence_limit`)."""
        T = self.part_timeout
        others = [j for j in range(self.n) if j != self.rank and j not in self.lost]
        if self.stats is None or self._floor is None:
            return {j: T for j in others}
        # a part's raw bytes: with a codec its wire bytes are fewer, so the limit errs long (paces
        # are measured in wire bytes), never short
        part_bytes = self.plan.part_elems * self.buf.dtype.itemsize
        out = {}
        ceiling = self.deadline - self.started
        ours = self.stats.estimate_mbit() if self._rate_of is not None else None
        for j in others:
            m = self.members[j]
            rtt = self._rtt(m.endpoint) if self._rtt is not None else None
            floor = min(T, max(self._floor, 4 * rtt if rtt else 0.0))
            pace = self.stats.pace(m.peer_id)
            if pace is None and self._rate_of is not None:
                # not measured yet: the slower of its gossiped rate and ours, shared by the n - 1
                # streams each link carries. Without our own rate it may only lengthen the wait.
                theirs = self._rate_of(m.peer_id)
                rate = min(r for r in (theirs, ours) if r) if theirs or ours else None
                if rate:
                    limit = silence_limit((self.n - 1) / (rate * 125_000.0), part_bytes, T, floor, self._slack, ceiling)
                    out[j] = limit if theirs and ours else max(T, limit)
                    continue
            out[j] = silence_limit(pace, part_bytes, T, floor, self._slack, ceiling)
        return out

    def deadlines_used(self) -> dict[str, float]:
        """The silence limits this round applied (see `StepResult.deadlines`)."""
        parts = self._limits_seen or [self.part_timeout]
        return {"part": max(parts), "part_min": min(parts),
                "result": max(self._result_limits_seen or [2 * self.part_timeout]),
                "allreduce": self.deadline - self.started}

    # ------------------------------------------------------------------ after the round (DONE notices)
    def may_owe_me(self) -> list[int]:
        """Members that may still be sending this member data of the round when its round is over,
        and so wait for its DONE before they may shut down: the owners of a span (its results) and
        the substitutes this member asked to rescue one. Nobody else reduces anything for it, so
        nobody else gets a DONE: with a 1-element tensor a group of 32 has one span owner, so the
        group sends 31 DONEs instead of 32 x 31. `i_owe` is its mirror."""
        subs = set(self.rescue_target.values())
        return [j for j in range(self.n) if j != self.rank and (self.plan.num_parts(j) > 0 or j in subs)]

    def i_owe(self) -> list[int]:
        """Members this member may still owe data of the round (results queued on a slow link) until
        they say DONE: every member not lost when it owns a span; else those that declared a need to
        a span it rescued (they asked it, so it is among their `may_owe_me`)."""
        if self.plan.num_parts(self.rank) > 0:
            return [j for j in range(self.n) if j != self.rank and j not in self.lost]
        need = {j for r in self.rescues.values() for j, parts in r.declared.items() if parts}
        return [j for j in sorted(need) if j != self.rank and j not in self.lost]

    def _check_done(self, now: float, force: bool = False) -> None:
        if self.phase is RoundPhase.DONE:
            return
        waiting_gather = [j for j in range(self.n) if j not in self.gathered and j not in self.lost]
        busy_rescue = any(r.left for r in self.rescues.values())
        if not force and (self.unresolved or waiting_gather or busy_rescue or self.own.left):
            return
        # what we deferred is moot now: a caller hears we need nothing, a requester gets notices
        for _, j, msg in self._deferred:
            if type(msg) is RescueCall:
                self._send(j, Rescue(self.me.peer_id, self.me.endpoint, group_id=self._gid, owner=msg.owner, need=()))
            else:
                for p in sorted(set(msg.need)):
                    if p < self.plan.num_parts(msg.owner):
                        self._send(j, self._result(msg.owner, p, (), True, self.buf[:0]))
        self._deferred = []
        self._held.clear()  # parts behind those requests: moot with them (their sender got notices)
        self.phase = transition(self.phase, RoundPhase.DONE, f"round {self._gid}")
        self._on_done(self, now)

    def finished(self) -> FinishedRound:
        """What answers the rescue messages that come after this round is over (`FinishedRound`)."""
        return FinishedRound((self.me.peer_id, self.me.endpoint), self._gid,
                             tuple((m.peer_id, m.endpoint) for m in self.members),
                             tuple(self.plan.num_parts(o) for o in range(self.n)))

    # ------------------------------------------------------------------ result
    def outcome(self) -> RoundOutcome:
        ids = tuple(m.peer_id for m in self.members)
        spans, ranges = [], []
        partial_owners = {owner for owner, _lo, _hi, _who in self.partial}
        for o in range(self.n):
            if not self.status[o] and o not in partial_owners and not (o == self.rank and self.rank in self.aux):
                # an empty span (most of them, when a group is larger than the vector's parts)
                spans.append(SpanOutcome(owner=ids[o], parts=0, averaged=0, rescued=self.rescued[o], contributors=()))
                continue
            contrib: set[int] = set()
            for p, s in enumerate(self.status[o]):
                if s is PartState.AVERAGED:
                    contrib.update(self.part_contrib[o][p])
                    ranges.append(self.plan.part(o, p))
            if o == self.rank and self.rank in self.aux:  # our tensor is untouched; report what we served
                served = [c for c in self.part_contrib[o] if c]
                for c in served:
                    contrib.update(c)
                spans.append(SpanOutcome(owner=ids[o], parts=len(self.status[o]), averaged=len(served),
                                         rescued=0, contributors=tuple(ids[i] for i in sorted(contrib))))
                continue
            for owner, lo, hi, who in self.partial:  # results taken up to their first non-finite block
                if owner == o:
                    contrib.update(who)
                    ranges.append((lo, hi))
            spans.append(
                SpanOutcome(
                    owner=ids[o],
                    parts=len(self.status[o]),
                    averaged=sum(1 for s in self.status[o] if s is PartState.AVERAGED),
                    rescued=self.rescued[o],
                    contributors=tuple(ids[i] for i in sorted(contrib)),
                )
            )
        updated: list[tuple[int, int]] = []
        for lo, hi in sorted(ranges):
            if updated and updated[-1][1] == lo:
                updated[-1] = (updated[-1][0], hi)
            else:
                updated.append((lo, hi))
        return RoundOutcome(
            group_id=self.spec.group_id,
            key=self.spec.key,
            members=ids,
            rank=self.rank,
            gathered={ids[i]: d for i, d in sorted(self.gathered.items())},
            weights={ids[i]: w for i, w in sorted(self.weights.items())},
            spans=tuple(spans),
            updated=updated,
            lost=tuple(ids[i] for i in sorted(self.lost)),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            auxiliary=tuple(ids[i] for i in sorted(self.aux)),
        )


#: the handler of each message class a round receives (the node routes these by group id)
_HANDLERS: dict[type[Message], Callable[[AllReduceRound, int, Any, float], None]] = {
    Gather: AllReduceRound._on_gather,
    Part: AllReduceRound._on_part,
    Result: AllReduceRound._on_result,
    Abort: AllReduceRound._on_abort,
    GaveUp: AllReduceRound._on_gave_up,
    RescueCall: AllReduceRound._on_rescue_call,
    Rescue: AllReduceRound._on_rescue,
}
