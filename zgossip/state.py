"""State download: a peer fetches (metadata, tensors) in checksummed chunks from several donors at once.

A donor serves a *snapshot*: private copies of its state cut into chunks of ``chunk_bytes``
(never spanning two tensors), each with a 128-bit SHA-256 digest, and a *root* digest over
the layout and every chunk digest. The root names the state: two peers with bit-identical
tensors have the same root (it is what `zgossip.repair` votes on), and a downloader that
knows the root it wants can check every chunk, from any donor, against the chunk digests
the root covers. SHA-256 and not a faster non-cryptographic hash because a hostile donor
must not be able to forge a chunk that passes (the CPU has SHA extensions: ~1 GB/s a core).

Protocol (all messages in `zgossip.messages`):

* ``STATE_REQ count=0`` asks a donor for its snapshot's ``STATE_META`` (layout, chunk
  digests, root, the user's metadata). A donor holding a published snapshot (`publish`)
  answers from it at once, on the I/O thread; otherwise its owner takes a snapshot first.
* ``STATE_REQ root=R first=i count=n`` asks for chunks i..i+n-1 of snapshot R. The donor
  serves them from its snapshot cache, never from the live tensors, so serving never waits
  for the tensor lock while the owner averages. The cache holds at most ``max_snapshots``
  snapshots (least recently used evicted): memory is bounded by that many copies of the
  state; a request for an evicted root is refused and the downloader moves on. While both are
  being downloaded, a META request gets the one taken last if it is fresh (`StateDonor.shared`)
  rather than a new snapshot that would evict one a download still fetches.

The downloader asks up to ``max_donors`` donors of the best priority tier for their META,
adopts the first root it accepts (the ``target_root`` it was given, if any) and hands out
windows of chunks to every donor that answered with that root; each donor keeps up to two
windows in flight and a faster donor simply asks for more -- but never more than its share of the
state's chunks among the donors answering or asked (so a state of a few chunks is spread over
them too, instead of going wholly to the donor that answered first; a donor that finished its
share takes what the others have not been given yet). A donor that refuses, stalls for
``chunk_timeout``, drops its connection, sends a chunk it was not asked for or a chunk whose
digest is wrong is dropped: its outstanding chunks go back to the pool and are fetched from
the others (counted in `refetched`, bad digests in `bad_chunks`), and the next candidate is
asked. A donor that has not answered the META request within ``chunk_timeout`` is not dropped
but awaited while the membership counts it live (it may be snapshotting and hashing a large
state), and the next candidate is asked meanwhile. Once no donor of the adopted state is left,
the donors passed over for holding another state and those that moved on from ours (refused its
chunks) are asked again, once each, and the download starts over with the state the first of
them holds. Bytes are only written into buffers this module owns: a partial download never
reaches the user's tensors.

The root does not cover the user's metadata (the first item of ``get_current_state``: a
trainer's epoch, its optimizer's learning rate): any peer holds the swarm's tensors, so a liar
can serve them -- the same root -- under metadata of its own, and the downloader used to take the
metadata of the first donor it accepted. Now every donor of the adopted root votes with its
metadata (compared by a digest of its msgpack bytes, so 1, 1.0 and True differ), and the
download hands out what a strict majority of them sent, counting the donors still asked (their
answers could change it): with every chunk in, it waits for those answers at most
``chunk_timeout`` more. One liar among two or more honest donors of the root cannot win, even
if it answers first and serves every chunk; as in the repair vote, liars need at least as many
donors among those asked as the honest ones (a tie is drawn). Without a strict majority once
all have answered (1 against 1, or metadata that differs per donor), up to `EXTRA_META_ASKS`
more donors are asked; then the largest group wins (ties drawn from the download's seeded
generator), with a warning. A donor outvoted keeps serving chunks (they are checked against
the root) and is counted (`meta_outvoted`) and logged once; one that sent a chunk failing its
digest loses its vote. The metadata is thus as trustworthy as the majority of the donors asked
(up to ``max_donors``, plus the extra ones): a lone donor's is its word, as the tensors are
where no ``target_root`` was given.

A snapshot taken for a request may carry its float tensors compressed (``state_compression=``,
`zgossip.codecs`): its chunks are then of the encoded bytes (their digests and the root are of
those bytes, and the root covers the codec of every tensor), and the downloader decodes once
every chunk checked out. Published (versioned) snapshots stay raw: their root names the exact
state the repair vote compares.
"""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence

import numpy as np

from . import codecs as _codecs
from .droplog import DropLog
from .errors import IllegalTransition, StateUnavailable
from .messages import CODE_OF, DTYPES, Message, StateChunk, StateMeta, StateReq
from .view import MembershipView
from .wire import WireLimits, header_nbytes, pack_value

__all__ = ["state_digest", "chunk_digest", "StateSnapshot", "StateDonor", "StateDownload", "DownloadPhase",
           "DIGEST_BYTES", "MAX_CHUNKS_PER_REQUEST"]

log = logging.getLogger(__name__)

DIGEST_BYTES = 16  # per chunk: 128 bits of SHA-256
MAX_CHUNKS_PER_REQUEST = 256  # a donor queues at most this many chunks for one request
REQUEST_BYTES = 16 << 20  # a downloader asks for at least this much per request (4 default chunks)
MAX_DIGEST_BYTES = 16 << 15  # what STATE_META's `hashes` may hold (zgossip.messages): 32768 chunks
MAX_META_BYTES = WireLimits().max_header_bytes  # a STATE_META's header: what every receiver accepts
#: donors asked for their META beyond `max_donors` when the metadata of the adopted state's donors has no
#: strict majority (`StateDownload._pick_meta`)
EXTRA_META_ASKS = 2
#: `StateDonor.shared`: a snapshot fetched this recently is still being downloaded, and one taken this
#: recently is fresh enough to hand a newcomer instead of a new one
ACTIVE_SECONDS = 5.0


def chunk_digest(data: Any) -> bytes:
    return hashlib.sha256(data).digest()[:DIGEST_BYTES]


def meta_digest(meta: Any) -> bytes:
    """What a donor's metadata is compared by: a digest of its msgpack bytes, as the header carried
    it (1, 1.0 and True, which Python calls equal, differ there, as they do for the code that reads
    them; so do -0.0 and 0.0, and dicts whose keys come in another order). Not `repr`: metadata
    nested a thousand deep, which msgpack decodes, makes it raise RecursionError."""
    try:
        data = b"msgpack;" + pack_value(meta)
    except (TypeError, ValueError, OverflowError):  # never sent so: a donor refuses metadata that does not pack
        data = b"type;" + type(meta).__name__.encode()
    return hashlib.sha256(data).digest()[:DIGEST_BYTES]


def plan_chunks(specs: Sequence[tuple[str, tuple]], chunk_bytes: int,
                codecs: Sequence[int] = ()) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(tensor, offset, length) of every chunk, and the byte size of every tensor as it travels."""
    plan, sizes = [], []
    for t, (code, shape) in enumerate(specs):
        nbytes = _codecs.encoded_nbytes(codecs[t] if codecs else _codecs.NONE, int(np.prod(shape, dtype=np.int64)),
                                        DTYPES[code].itemsize)
        sizes.append(nbytes)
        plan += [(t, off, min(chunk_bytes, nbytes - off)) for off in range(0, nbytes, chunk_bytes)]
    return plan, sizes


def state_root(specs: Sequence[tuple[str, tuple]], chunk_bytes: int, hashes: bytes, codecs: Sequence[int] = ()) -> str:
    """The name of a state: a digest over its layout (and codecs, if any) and the digest of every chunk."""
    layout: tuple = (tuple((c, tuple(s)) for c, s in specs), int(chunk_bytes))
    if codecs:
        layout += (tuple(int(c) for c in codecs),)
    h = hashlib.sha256(repr(layout).encode())
    h.update(hashes)
    return h.hexdigest()[:32]


def state_digest(arrays: Sequence[np.ndarray], chunk_bytes: int = 4 << 20) -> str:
    """The root digest of `arrays` (what `StateSnapshot.build(...).root` gives)."""
    return StateSnapshot.build(None, arrays, chunk_bytes).root


@dataclass(frozen=True, eq=False)
class StateSnapshot:
    """Private copies of a state, cut into digested chunks. Built off the I/O thread (hashing costs)."""

    meta: Any
    arrays: tuple[np.ndarray, ...]  # contiguous; never written after the snapshot is built
    specs: tuple[tuple[str, tuple[int, ...]], ...]
    chunk_bytes: int
    plan: tuple[tuple[int, int, int], ...]
    hashes: bytes  # DIGEST_BYTES per chunk
    root: str
    codecs: tuple[int, ...] = ()  # wire codec per tensor (`arrays` then hold the encoded bytes); () = all raw

    @classmethod
    def build(cls, meta: Any, arrays: Sequence[np.ndarray], chunk_bytes: int,
              hashes: bytes | None = None, compression: Any = None) -> "StateSnapshot":
        """Raises TypeError for a dtype the stream cannot carry. `arrays` must not change afterwards
        (pass copies); `hashes`, when known (a verified download), skips the hashing. `compression`
        (as `zgossip.codecs.resolve` takes it) encodes the float tensors; the rest stay raw."""
        specs = []
        for a in arrays:
            if a.dtype not in CODE_OF:
                raise TypeError(f"state holds dtype {a.dtype}, which cannot be sent")
            specs.append((CODE_OF[a.dtype], tuple(int(n) for n in a.shape)))
        arrays = tuple(np.ascontiguousarray(a) for a in arrays)
        codecs: tuple = ()
        if compression is not None:
            chosen = _codecs.resolve(compression, [a.shape for a in arrays], [a.dtype for a in arrays])
            codecs = tuple(int(c) if a.dtype.kind == "f" else _codecs.NONE for c, a in zip(chosen, arrays))
            if not any(codecs):
                codecs = ()
        if codecs:
            wire = []
            for a, c in zip(arrays, codecs):
                if c == _codecs.NONE:
                    wire.append(a)
                else:
                    enc = np.empty(_codecs.encoded_nbytes(c, a.size, a.itemsize), np.uint8)
                    _codecs.encode(c, a.reshape(-1), enc)
                    wire.append(enc)
            arrays = tuple(wire)
        plan, _ = plan_chunks(specs, chunk_bytes, codecs)
        if hashes is None:
            raws = [a.reshape(-1).view(np.uint8) for a in arrays]
            hashes = b"".join(chunk_digest(raws[t][off: off + n]) for t, off, n in plan)
        return cls(meta, arrays, tuple(specs), chunk_bytes, tuple(plan), hashes,
                   state_root(specs, chunk_bytes, hashes, codecs), codecs)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def chunk(self, i: int) -> np.ndarray:
        t, off, n = self.plan[i]
        return self.arrays[t].reshape(-1).view(np.uint8)[off: off + n]


class StateDonor:
    """Donor side: answers META requests and chunk requests from a small cache of snapshots."""

    def __init__(self, peer_id: str, endpoint: str, send: Callable[[str, Message], None], chunk_bytes: int,
                 max_snapshots: int = 2) -> None:
        self.peer_id, self.endpoint, self._send, self.chunk_bytes = peer_id, endpoint, send, chunk_bytes
        self.max_snapshots = max(1, max_snapshots)
        self._cache: OrderedDict[str, StateSnapshot] = OrderedDict()
        self.published: StateSnapshot | None = None
        self._used: dict[str, float] = {}  # root -> when it last served a META answer or chunks
        self._fetchers: dict[str, set[str]] = {}  # root -> peers that fetched chunks of it (`shared`)
        self._latest = ""  # root of the snapshot kept last
        self._latest_at = -ACTIVE_SECONDS  # when it was taken (`note_use` with taken=True)
        self._unsendable = ""  # root of the last snapshot whose META could not be sent (warned once)
        self.served = 0  # META answers
        self.chunks_served = 0

    def _meta(self, req: str, ok: bool, reason: str = "", snap: StateSnapshot | None = None,
              root: str = "") -> StateMeta:
        if snap is None:
            return StateMeta(self.peer_id, self.endpoint, req=req, ok=ok, reason=reason, meta=None, specs=(),
                             chunk_bytes=self.chunk_bytes, digest=root)
        return StateMeta(self.peer_id, self.endpoint, req=req, ok=ok, reason=reason, meta=snap.meta, specs=snap.specs,
                         chunk_bytes=snap.chunk_bytes, digest=snap.root, hashes=snap.hashes, codecs=snap.codecs)

    def _keep(self, snap: StateSnapshot) -> None:
        self._cache[snap.root] = snap
        self._cache.move_to_end(snap.root)
        self._latest = snap.root
        while len(self._cache) > self.max_snapshots:
            root, _ = self._cache.popitem(last=False)  # in-flight chunk frames keep their own reference
            self._used.pop(root, None)
            self._fetchers.pop(root, None)

    def note_use(self, root: str, now: float, taken: bool = False, by: str = "") -> None:
        """A download fetches snapshot `root` (its META was answered, or chunks of it served to peer
        `by`) at `now`; `taken`: it is the snapshot just taken for a META request."""
        if root in self._cache:
            self._used[root] = now
            if taken and root == self._latest:
                self._latest_at = now
            who = self._fetchers.setdefault(root, set())
            if by and len(who) < 4096:
                who.add(by)

    def shared(self, now: float, asker: str = "") -> StateSnapshot | None:
        """The snapshot to answer a META request with instead of taking a new one: the one taken last,
        if that was within `ACTIVE_SECONDS`, when the cache is full and every snapshot in it was
        fetched within `ACTIVE_SECONDS`. A new one would evict a snapshot a download still fetches,
        which then has to start over -- with three or more newcomers downloading at once from a donor
        whose state changes (it trains), they evicted each other's until downloads failed. The
        newcomer gets a state at most `ACTIVE_SECONDS` old instead -- unless it fetched that one
        already (`asker`): a peer asking again wants a newer state than the one it got."""
        if (len(self._cache) < self.max_snapshots or self._latest not in self._cache
                or now - self._latest_at > ACTIVE_SECONDS or asker in self._fetchers.get(self._latest, ())
                or any(now - self._used.get(r, -ACTIVE_SECONDS) > ACTIVE_SECONDS for r in self._cache)):
            return None
        return self._cache[self._latest]

    def publish(self, snap: StateSnapshot | None) -> None:
        """The snapshot META requests get from now on (a versioned copy); None: take one per request."""
        self.published = snap
        if snap is not None:
            self._keep(snap)

    def refuse(self, req: str, endpoint: str, reason: str, root: str = "") -> None:
        """Refuse a META request, or (`root`: the state it asked chunks of) a chunk request: the
        refusal names that root, so that a downloader does not take it for an answer to a later
        META request (one asking again a donor that moved on) or to chunk requests of another state."""
        self._send(endpoint, self._meta(req, False, reason, root=root))

    def serve(self, req: str, endpoint: str, snap: StateSnapshot) -> None:
        """Answer a META request with `snap` (kept in the cache for the chunk requests that follow)."""
        if len(snap.hashes) > MAX_DIGEST_BYTES:
            return self.refuse(req, endpoint, f"state has {len(snap.plan)} chunks, more than a STATE_META can list "
                                              f"({MAX_DIGEST_BYTES // DIGEST_BYTES}): use a larger state_chunk_bytes")
        answer = self._meta(req, True, snap=snap)
        try:  # checked here: sent, it would be dropped by the receiver (too large) or by our driver
            size = header_nbytes(answer)  # (not packable), and the downloader would wait for nothing
        except (TypeError, ValueError) as e:
            return self._refuse_meta(req, endpoint, snap, f"its metadata cannot be packed ({str(e)[:200]})")
        if size > MAX_META_BYTES:
            return self._refuse_meta(req, endpoint, snap, f"its STATE_META takes {size} bytes, more than "
                                                          f"the {MAX_META_BYTES} a peer accepts (its metadata is "
                                                          "too large)")
        self._keep(snap)
        self._send(endpoint, answer)
        self.served += 1

    def _refuse_meta(self, req: str, endpoint: str, snap: StateSnapshot, why: str) -> None:
        if self._unsendable != snap.root:  # said once per snapshot: the owner must fix what it serves
            self._unsendable = snap.root
            log.warning("state donor %s cannot serve its state: %s. Keep large or non-msgpack data in tensors "
                        "(the metadata is the first item get_current_state returns)", self.peer_id[:8], why)
        self.refuse(req, endpoint, f"this peer cannot serve its state: {why}")

    def serve_chunks(self, msg: StateReq) -> None:
        snap = self._cache.get(msg.root)
        if snap is None:
            return self.refuse(msg.req, msg.endpoint, "this peer no longer holds that state (it moved on)", msg.root)
        if msg.count > MAX_CHUNKS_PER_REQUEST or msg.first + msg.count > len(snap.plan):
            return self.refuse(msg.req, msg.endpoint, "chunk range outside the state", msg.root)
        self._cache.move_to_end(msg.root)
        for i in range(msg.first, msg.first + msg.count):
            t, off, _ = snap.plan[i]
            self._send(msg.endpoint, StateChunk(self.peer_id, self.endpoint, req=msg.req, index=i, tensor=t,
                                                offset=off, data=snap.chunk(i)))
        self.chunks_served += msg.count


class DownloadPhase(Enum):
    ASKING = "asking"  # META requests out, no state adopted yet
    STREAMING = "streaming"  # a root adopted: chunks flow from every donor that holds it
    DONE = "done"


_MOVES = {
    DownloadPhase.ASKING: {DownloadPhase.STREAMING, DownloadPhase.DONE},
    DownloadPhase.STREAMING: {DownloadPhase.STREAMING, DownloadPhase.DONE},  # restart with another state
    DownloadPhase.DONE: set(),
}


@dataclass
class _Donor:
    endpoint: str
    wait_until: float
    inflight: set[int] = field(default_factory=set)
    got: int = 0


@dataclass
class StateDownload:
    """Downloader side of one `load_state_from_peers` call (or of a repair, with `target_root`)."""

    req: str
    membership: MembershipView
    send: Callable[[str, Message], None]
    rng: np.random.Generator
    started: float
    deadline: float
    chunk_timeout: float
    max_bytes: int
    on_done: Callable[["StateDownload", Any, list[np.ndarray] | None, Exception | None], None]
    target_root: str = ""  # accept only this state ("" = the first a best donor offers)
    only: tuple[str, ...] = ()  # ask only these peers ("" = every donor)
    max_donors: int = 4
    window: int = 4  # chunks per request (at least; see `_adopt`); a donor keeps at most two requests in flight
    phase: DownloadPhase = DownloadPhase.ASKING
    tried: list[str] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    bad_chunks: int = 0  # chunks whose digest was wrong (fetched again elsewhere)
    refetched: int = 0  # chunks asked again from another donor after theirs failed
    root: str = ""
    snapshot: StateSnapshot | None = None  # the verified result (hashes reused by a repair)
    _asked: dict[str, tuple[str, float]] = field(default_factory=dict)  # peer -> (endpoint, answer by)
    # asked donors that did not answer within chunk_timeout: still awaited while the membership counts
    # them live, but no longer counted against max_donors or the shares -- a donor without a published
    # snapshot copies and hashes its whole state before it answers, which takes longer for a large state
    _slow: set[str] = field(default_factory=set)
    _active: dict[str, _Donor] = field(default_factory=dict)
    dropped: int = 0  # donor data refused (bad layout, dtype, size, codec, digest)
    late: int = 0  # messages not for a donor or phase this download waits on, ignored
    drops: DropLog | None = None  # the node's: refused donor data is logged once per donor
    _meta: Any = None
    _specs: tuple = ()
    _chunk_bytes: int = 0
    _hashes: bytes = b""
    _bufs: list[np.ndarray] = field(default_factory=list)
    _plan: list[tuple[int, int, int]] = field(default_factory=list)
    _fresh: int = 0  # chunks from here on were never asked for
    _retry: list[int] = field(default_factory=list)  # chunks to ask again, sorted
    _received: int = 0
    _codecs: tuple = ()  # of the adopted state: () = raw
    _per_request: int = 4  # chunks per request for the adopted state's chunk size (`_adopt`)
    _placing: int = 0  # chunks handed out by `target` and not back through `on_placed` yet
    per_donor: dict[str, int] = field(default_factory=dict)  # chunks received from each donor
    # donors passed over because they hold another state than the adopted one: if every donor of the
    # adopted state turns out bad, they are asked again (once), and the first to answer sets the state
    _other_state: list[str] = field(default_factory=list)
    _readmitted: set[str] = field(default_factory=set)
    # the metadata every donor of the adopted state sent, by `meta_digest`: the download hands out the
    # one most of them agree on (`_pick_meta`), not the first donor's word
    _meta_votes: dict[str, tuple[bytes, Any]] = field(default_factory=dict)
    _vote_until: float | None = None  # every chunk in: answers still owed are awaited until then
    _extra_asks: int = 0  # donors asked only to break a tie of the metadata (`EXTRA_META_ASKS`)
    meta_outvoted: int = 0  # donors of the adopted state whose metadata the vote did not take

    def _move(self, phase: DownloadPhase) -> None:
        if phase not in _MOVES[self.phase]:
            raise IllegalTransition(f"download {self.req}: illegal move {self.phase.value} -> {phase.value}")
        self.phase = phase

    # ------------------------------------------------------------------ donor choice
    def start(self, now: float) -> None:
        self._ask_more(now)

    def _candidates(self) -> list:
        recs = [r for r in self.membership.donors() if r.peer_id not in self.tried
                and (not self.only or r.peer_id in self.only)]
        if not recs:
            return []
        best = recs[0].share
        tier = [r for r in recs if r.share == best]  # a lower tier most likely holds another state
        order = self.rng.permutation(len(tier))  # spread newcomers over equally good donors
        return [tier[int(i)] for i in order]

    def _ask(self, rec: Any, now: float) -> None:
        self.tried.append(rec.peer_id)
        self._asked[rec.peer_id] = (rec.endpoint, now + self.chunk_timeout)
        self.send(rec.endpoint, StateReq(self.membership.peer_id, self.membership.endpoint, req=self.req))

    def _ask_more(self, now: float) -> None:
        room = self.max_donors - (len(self._asked) - len(self._slow)) - len(self._active)
        for rec in self._candidates()[:max(0, room)]:
            self._ask(rec, now)
        if not self._asked and not self._active and self.phase is not DownloadPhase.DONE:
            live = len(self.membership.live_ids())
            sharing = len(self.membership.donors())
            what = "; ".join(self.history[-6:]) or "nothing to try"
            self._finish(None, None, StateUnavailable(
                f"could not download state: {live} live peers known, {sharing} share state, "
                f"{len(self.tried)} tried. What happened: {what}. "
                + ("Start a peer with allow_state_sharing=True or retry once more peers are up." if not sharing
                   else "Every donor known failed as said above: retry later.")))

    def _drop(self, peer: str, now: float, why: str, bad: bool = False) -> None:
        """Give up on `peer`: its outstanding chunks go back to the pool; ask another donor. `bad`:
        it sent data failing our checks (counted in `dropped`, logged once per donor)."""
        self.history.append(f"{peer[:8]}: {why}")
        if bad:
            self.dropped += 1
            if self.drops is None:
                self.drops = DropLog(self.membership.peer_id[:8])
            self.drops.note(log, peer, "state data failing its checks (layout, size, codec or digest)",
                            f"download {self.req}: {why}; its chunks are fetched from the others")
        else:
            log.info("state download %s: donor %s dropped: %s", self.req, peer[:8], why)
        self._asked.pop(peer, None)
        self._slow.discard(peer)
        if bad:  # a donor that sent data failing the state's own checks has no say on its metadata either
            self._meta_votes.pop(peer, None)
        d = self._active.pop(peer, None)
        if d is not None and d.inflight:
            self.refetched += len(d.inflight)
            self._retry = sorted(set(self._retry) | d.inflight)
        if self.phase is DownloadPhase.DONE:
            return
        if self._holds_all():  # only the metadata vote still waits: nothing to fetch again or start over
            return self._maybe_complete(now)
        if why.startswith(("holds another state", "refused chunks")):
            # passed over for another state, or moved on to one (it evicted ours from its cache after
            # publishing newer versions): an honest donor, worth asking again for what it holds now
            self._other_state.append(peer)
        if not self._active and self._other_state:
            # the state we adopted has no holder left -- its donors sent data failing its own digests,
            # died, stalled or refused: the donors we passed over for holding another state, or that
            # moved on from ours, are asked again, and the first to answer is adopted (`on_meta`:
            # restart). A hostile donor that answered first, a donor that died mid-download while the
            # others had moved on to a newer state, or donors that all published newer versions while
            # we downloaded (donors that keep training) must not make the download fail while they live
            back = [p for p in self._other_state if p not in self._readmitted]
            self._other_state.clear()
            self._readmitted.update(back)
            self.tried = [t for t in self.tried if t not in back]
            if back:
                self.history.append(f"asking {len(back)} donor(s) of another state again")
        self._ask_more(now)
        for p in list(self._active):
            self._assign(p, now)

    def _finish(self, meta: Any, arrays: list[np.ndarray] | None, err: Exception | None) -> None:
        self._move(DownloadPhase.DONE)
        self._asked.clear()
        self._active.clear()
        self.on_done(self, meta, arrays, err)

    # ------------------------------------------------------------------ chunk assignment
    def _assign(self, peer: str, now: float) -> None:
        d = self._active.get(peer)
        # a donor's share: the plan split among the donors that answered and those still asked
        share = max(1, -(-len(self._plan) // max(1, len(self._active) + len(self._asked) - len(self._slow))))
        while d is not None and len(d.inflight) <= self._per_request and len(d.inflight) < share:
            room = min(self._per_request, share - len(d.inflight))
            if self._retry:
                first, n = self._retry[0], 1
                while n < min(room, len(self._retry)) and self._retry[n] == first + n:
                    n += 1
                del self._retry[:n]
            elif self._fresh < len(self._plan):
                first, n = self._fresh, min(room, len(self._plan) - self._fresh)
                self._fresh += n
            else:
                return
            if not d.inflight:
                d.wait_until = now + self.chunk_timeout
            d.inflight.update(range(first, first + n))
            self.send(d.endpoint, StateReq(self.membership.peer_id, self.membership.endpoint, req=self.req,
                                           root=self.root, first=first, count=n))

    # ------------------------------------------------------------------ messages
    def on_meta(self, msg: StateMeta, now: float) -> None:
        peer = msg.sender
        if self.phase is DownloadPhase.DONE or msg.req != self.req:
            self.late += 1
            return
        if peer in self._active:  # a refusal of a chunk request (e.g. the donor moved on)
            if msg.ok or msg.digest not in ("", self.root):  # (of chunks of a state we since left: late)
                self.late += 1
            else:
                self._drop(peer, now, f"refused chunks: {msg.reason}")
            return
        if peer not in self._asked or (not msg.ok and msg.digest):  # a chunk request's refusal: not an answer
            self.late += 1
            return
        endpoint = self._asked[peer][0]
        if not msg.ok:
            return self._drop(peer, now, f"refused: {msg.reason}")
        # every holder of the adopted state is gone: without a wanted root, start over with this one
        restart = (bool(self.root) and msg.digest != self.root and not self._active and not self.target_root
                   and not self._holds_all())
        why = self._check_meta(msg, restart)
        if why:  # another state than ours is honest; anything else is bad data
            return self._drop(peer, now, why, bad=not why.startswith(("offers another", "holds another")))
        if not self.root or restart:
            if restart:
                self.history.append(f"{peer[:8]}: holds another state; starting over with it")
            self._adopt(msg)
        self._meta_votes[peer] = (meta_digest(msg.meta), msg.meta)
        del self._asked[peer]
        self._slow.discard(peer)
        self._active[peer] = _Donor(endpoint, now + self.chunk_timeout)
        self._assign(peer, now)
        self._maybe_complete(now)

    def _check_meta(self, msg: StateMeta, restart: bool = False) -> str:
        if self.target_root and msg.digest != self.target_root:
            return "offers another state than the one wanted"
        if self.root and msg.digest != self.root and not restart:
            return "holds another state than the other donors"
        codecs = tuple(msg.codecs)
        if codecs and len(codecs) != len(msg.specs):
            return "codecs do not match the tensors announced"
        total = chunks = 0
        for t, (code, shape) in enumerate(msg.specs):
            if code not in DTYPES:
                return f"tensor {t} has disallowed dtype {code!r}"
            c = codecs[t] if codecs else _codecs.NONE
            if c not in _codecs.CODEC_IDS or (c != _codecs.NONE and DTYPES[code].kind != "f"):
                return f"tensor {t}: codec {c} cannot carry dtype {code!r}"
            if any(n > self.max_bytes for n in shape):  # also keeps the product below overflow
                return (f"state larger than this peer's max_state_bytes ({self.max_bytes}): raise it to load it "
                        "(NodeConfig.max_state_bytes, given as Averager(config=...))")
            numel = int(np.prod(shape, dtype=object))
            total += numel * DTYPES[code].itemsize  # what the decoded state takes (a codec only shrinks it)
            if total > self.max_bytes:
                return (f"state larger than this peer's max_state_bytes ({self.max_bytes}): raise it to load it "
                        "(NodeConfig.max_state_bytes, given as Averager(config=...))")
            chunks += -(-_codecs.encoded_nbytes(c, numel, DTYPES[code].itemsize) // msg.chunk_bytes)
        # counted before any plan is built: a tiny chunk size must not make us list billions of chunks
        if len(msg.hashes) != DIGEST_BYTES * chunks:
            return "chunk digests do not match the announced layout"
        if state_root(msg.specs, msg.chunk_bytes, msg.hashes, codecs) != msg.digest:
            return "root digest does not match its chunk digests"
        return ""

    def _adopt(self, msg: StateMeta) -> None:
        self._codecs = tuple(msg.codecs)
        plan, sizes = plan_chunks(msg.specs, msg.chunk_bytes, self._codecs)
        self.root, self._meta, self._specs = msg.digest, msg.meta, tuple(msg.specs)
        self._chunk_bytes, self._hashes, self._plan = msg.chunk_bytes, msg.hashes, plan
        self._bufs = [np.empty(n, dtype=np.uint8) for n in sizes]
        self._fresh, self._retry, self._received, self.per_donor = 0, [], 0, {}
        self._meta_votes, self._vote_until = {}, None
        # a request covers at least REQUEST_BYTES: small chunks must not mean many small requests (each
        # one is work for the donor, which paces them, `node.CHUNK_RATE`)
        self._per_request = max(self.window, min(MAX_CHUNKS_PER_REQUEST,
                                                 -(-REQUEST_BYTES // max(1, int(msg.chunk_bytes)))))
        self._move(DownloadPhase.STREAMING)

    def target(self, msg: StateChunk) -> tuple[np.ndarray, int, int, bytes] | None:
        """For a chunk this download waits for, in the announced layout: (buffer, offset, length,
        digest it must have); None for any other. A cheap test (no hashing) for a driver that hashes
        chunks off its I/O thread: it may write the chunk's bytes into buffer[offset:offset+length]
        once, and only if, their digest is the one given, then hand the chunk to `on_chunk` with
        its digest and the buffer (`placed_in`). Bytes that match the digest are the right bytes,
        so a chunk placed twice (fetched again elsewhere) writes the same bytes."""
        if self.phase is not DownloadPhase.STREAMING or msg.req != self.req:
            return None
        d = self._active.get(msg.sender)
        if d is None or msg.index not in d.inflight:
            return None
        i = msg.index
        t, off, length = self._plan[i]
        if msg.tensor != t or msg.offset != off or msg.data.nbytes != length:
            return None
        self._placing += 1  # the download completes only when every chunk handed out came back
        return self._bufs[t], off, length, self._hashes[i * DIGEST_BYTES: (i + 1) * DIGEST_BYTES]

    def on_placed(self, msg: StateChunk, now: float, digest: bytes | None, placed_in: np.ndarray | None) -> None:
        """`on_chunk` for a chunk `target` handed out; every one must come back here (with
        `digest` None if it could not be hashed), so that no late write lands in a buffer already
        given to the user (a chunk fetched again elsewhere may be placed twice)."""
        self._placing -= 1
        if placed_in is not None and all(placed_in is not b for b in self._bufs):
            # placed into the buffers of a state this download has left since (it started over with a
            # donor's newer one): the chunk answers a request of that state, not of the one now wanted
            self.late += 1
        else:
            self.on_chunk(msg, now, digest, placed_in)
        self._maybe_complete(now)

    def on_chunk(self, msg: StateChunk, now: float, digest: bytes | None = None,
                 placed_in: np.ndarray | None = None) -> None:
        """`digest`: `chunk_digest` of the chunk's bytes, when the caller computed it; `placed_in`:
        the buffer (from `target`) the caller already wrote the verified bytes into."""
        if self.phase is not DownloadPhase.STREAMING or msg.req != self.req:
            self.late += 1
            return
        peer = msg.sender
        d = self._active.get(peer)
        if d is None:
            self.late += 1
            return  # from a donor already dropped: its chunks were asked again elsewhere
        i = msg.index
        if i not in d.inflight:
            return self._drop(peer, now, f"sent chunk {i}, which it was not asked for", bad=True)
        t, off, length = self._plan[i]
        raw = msg.data.view(np.uint8)
        if msg.tensor != t or msg.offset != off or raw.nbytes != length:
            return self._drop(peer, now, f"chunk {i} does not match the announced layout", bad=True)
        if digest is None:
            digest = chunk_digest(raw)
        if digest != self._hashes[i * DIGEST_BYTES: (i + 1) * DIGEST_BYTES]:
            self.bad_chunks += 1
            return self._drop(peer, now, f"chunk {i} failed its checksum", bad=True)
        if placed_in is None or placed_in is not self._bufs[t]:  # not written by the caller
            self._bufs[t][off: off + length] = raw
        d.inflight.discard(i)
        d.got += 1
        self.per_donor[peer] = self.per_donor.get(peer, 0) + 1
        self._received += 1
        d.wait_until = now + self.chunk_timeout
        self._assign(peer, now)
        self._maybe_complete(now)

    def _holds_all(self) -> bool:
        """Every chunk of the adopted state is in and verified (the metadata vote may still wait)."""
        return self.phase is DownloadPhase.STREAMING and self._received >= len(self._plan) and not self._placing

    def _pick_meta(self, now: float) -> tuple[bool, Any]:
        """(decided, metadata): the metadata a strict majority of the adopted state's donors sent --
        counting those still asked, whose answer could change it, until `_vote_until`. The root does
        not cover the metadata: taken from the first donor, a liar holding the real tensors (any peer
        of the swarm) served them with metadata of its making (an epoch, a learning rate of 1e9) and
        won whenever it answered first. Without a strict majority once every answer is in, up to
        `EXTRA_META_ASKS` more donors are asked; then the largest group wins (ties drawn at random),
        logged. Donors whose metadata was not taken are counted in `meta_outvoted`, logged once each."""
        groups: dict[bytes, list[str]] = {}
        for peer, (digest, _) in self._meta_votes.items():
            groups.setdefault(digest, []).append(peer)
        if not groups:  # cannot happen (the adopting donor voted); kept as the first donor's word
            return True, self._meta
        votes, top = len(self._meta_votes), max(len(g) for g in groups.values())
        if self._vote_until is None or now < self._vote_until:
            if not self._asked and 2 * top <= votes and self._extra_asks < EXTRA_META_ASKS:
                extra = self._candidates()[:1]
                if extra:
                    self._extra_asks += 1
                    self.history.append(f"{len(groups)} different metadata among {votes} donors: asking "
                                        f"{extra[0].peer_id[:8]} too")
                    self._ask(extra[0], now)
                    self._vote_until = min(now + self.chunk_timeout, self.deadline)  # its own time to answer
            if 2 * top <= votes + len(self._asked) and self._asked:  # an answer owed could still decide it
                if self._vote_until is None:
                    self._vote_until = min(now + self.chunk_timeout, self.deadline)
                return False, None
        leaders = sorted(d for d, g in groups.items() if len(g) == top)
        chosen = leaders[int(self.rng.integers(len(leaders)))] if len(leaders) > 1 else leaders[0]
        if len(groups) > 1:
            log.warning("state download %s: the %d donors of state %s sent %d different metadata; took the one "
                        "%d of them sent%s", self.req, votes, self.root[:8], len(groups), top,
                        "" if 2 * top > votes else " (no strict majority: it is their word against the others')")
            if self.drops is None:
                self.drops = DropLog(self.membership.peer_id[:8])
            for peer, (digest, _) in self._meta_votes.items():
                if digest != chosen:
                    self.meta_outvoted += 1
                    self.history.append(f"{peer[:8]}: its metadata was outvoted")
                    self.drops.note(log, peer, "state metadata the other donors of its state contradict",
                                    counter="state_meta_outvoted",
                                    text=f"download {self.req}: donor {peer[:16]} sent metadata for state "
                                         f"{self.root[:8]} that the vote did not take")
        return True, next(m for d, m in self._meta_votes.values() if d == chosen)

    def _maybe_complete(self, now: float) -> None:
        if not self._holds_all():
            return
        decided, meta = self._pick_meta(now)
        if not decided or self.phase is DownloadPhase.DONE:
            return
        self._meta = meta
        # every chunk matched its digest and the digests match the root: the state is verified
        if not self._codecs:
            arrays = [b.view(DTYPES[code]).reshape(shape) for b, (code, shape) in zip(self._bufs, self._specs)]
            self.snapshot = StateSnapshot(self._meta, tuple(arrays), self._specs, self._chunk_bytes,
                                          tuple(self._plan), self._hashes, self.root)
        else:  # decoded: not the bytes the root names, so no snapshot to serve again
            arrays = []
            for b, (code, shape), c in zip(self._bufs, self._specs, self._codecs):
                if c == _codecs.NONE:
                    arrays.append(b.view(DTYPES[code]).reshape(shape))
                else:
                    out = np.empty(int(np.prod(shape, dtype=np.int64)), DTYPES[code])
                    _codecs.decode(c, b, out)
                    arrays.append(out.reshape(shape))
        self._finish(self._meta, arrays, None)

    def peer_down(self, endpoint: str, now: float) -> None:
        if self.phase is DownloadPhase.DONE:
            return
        for peer in [p for p, (ep, _) in self._asked.items() if ep == endpoint]:
            self._drop(peer, now, "connection lost")
        for peer in [p for p, d in self._active.items() if d.endpoint == endpoint]:
            self._drop(peer, now, "connection lost")

    # ------------------------------------------------------------------ time
    def next_deadline(self) -> float | None:
        if self.phase is DownloadPhase.DONE:
            return None
        times = [self.deadline] + [t for _, t in self._asked.values()]
        if self._vote_until is not None:
            times.append(self._vote_until)
        times += [d.wait_until for d in self._active.values() if d.inflight]
        return min(times)

    def on_timer(self, now: float) -> None:
        if self.phase is DownloadPhase.DONE:
            return
        if self._vote_until is not None and now >= self._vote_until:  # every chunk in: decide with the answers
            self._maybe_complete(now)                                # in (a state must not time out now)
            if self.phase is DownloadPhase.DONE:
                return
        if now >= self.deadline:
            self.history.append("overall timeout")
            self._finish(None, None, StateUnavailable(
                f"state download timed out after {now - self.started:.1f}s: " + "; ".join(self.history[-6:])))
            return
        # a donor that has not answered within chunk_timeout is awaited while the membership counts it
        # live (it gossips: its I/O thread runs while its owner hashes); the next candidate is asked
        # meanwhile. One that went silent too (paused, gone) is dropped
        expired = [p for p, (_, t) in self._asked.items() if now >= t]
        live = set(self.membership.live_ids()) if expired else set()
        slow = False
        for peer in expired:
            if self.phase is DownloadPhase.DONE:
                return
            if peer not in self._asked:
                continue
            if peer not in live:
                self._drop(peer, now, f"no answer within {self.chunk_timeout:g}s" if peer not in self._slow
                           else "no answer, and its membership record expired (paused or gone)")
                continue
            self._asked[peer] = (self._asked[peer][0], now + self.chunk_timeout)  # looked at again then
            if peer not in self._slow:
                self._slow.add(peer)
                slow = True
                self.history.append(f"{peer[:8]}: no answer within {self.chunk_timeout:g}s (awaited while it "
                                    "lives: a donor snapshots and hashes its state before it answers)")
        if slow and self.phase is not DownloadPhase.DONE:
            self._ask_more(now)
            for p in list(self._active):
                self._assign(p, now)
        for peer in [p for p, d in self._active.items() if d.inflight and now >= d.wait_until]:
            if self.phase is not DownloadPhase.DONE and peer in self._active:
                self._drop(peer, now, f"stalled with {len(self._active[peer].inflight)} chunks owed "
                                      f"for {self.chunk_timeout:g}s")
