"""State download: a newcomer fetches (metadata, tensors) from a peer that shares its state.

Donors declare a priority (e.g. their epoch) in the membership gossip. A downloader
asks the best-priority donor, choosing at random among equally good ones so that
newcomers spread out instead of all hitting one peer. The donor answers with
STATE_META (dtype and shape of every tensor, chunk size, a blake2b checksum) and
streams STATE_CHUNKs of raw bytes. Every chunk must be the next one expected, with
the right tensor, offset and length, and arrive within ``chunk_timeout`` of the
previous; the checksum is verified before anything is handed over. A donor may send its float
tensors compressed (``state_compression=``, `zgossip.codecs`): STATE_META then names each tensor's
codec, chunks carry the encoded bytes (their checksum is of those bytes), and the downloader decodes
once everything arrived and checked out. Any failure (a
refusal, silence, a bad chunk, a dropped connection, a checksum mismatch) moves on
to the next donor, and bytes are only ever written into buffers this module owns:
a partial download never reaches the user's tensors.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence

import numpy as np

from . import codecs as _codecs
from .droplog import DropLog
from .errors import IllegalTransition, StateUnavailable
from .messages import CODE_OF, DTYPES, Message, StateChunk, StateMeta, StateReq
from .view import MembershipView

__all__ = ["state_digest", "StateDonor", "StateDownload", "DownloadPhase"]

log = logging.getLogger(__name__)

def state_digest(arrays: Sequence[np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def _chunks(nbytes: int, chunk: int) -> int:
    return -(-nbytes // chunk)


class StateDonor:
    """Donor side: refuses, or streams a snapshot the driver obtained from the user."""

    def __init__(self, peer_id: str, endpoint: str, send: Callable[[str, Message], None], chunk_bytes: int) -> None:
        self.peer_id, self.endpoint, self._send, self.chunk_bytes = peer_id, endpoint, send, chunk_bytes
        self.served = 0

    def _meta(self, req: str, ok: bool, reason: str = "", meta: Any = None, specs: tuple = (),
              digest: str = "", codecs: tuple = ()) -> StateMeta:
        return StateMeta(self.peer_id, self.endpoint, req=req, ok=ok, reason=reason, meta=meta, specs=specs,
                         chunk_bytes=self.chunk_bytes, digest=digest, codecs=codecs)

    def refuse(self, req: str, endpoint: str, reason: str) -> None:
        self._send(endpoint, self._meta(req, False, reason))

    def serve(self, req: str, endpoint: str, meta: Any, arrays: Sequence[np.ndarray], compression: Any = None) -> None:
        """Stream `arrays`; `compression` (as `zgossip.codecs.resolve` takes it) applies to float tensors only."""
        specs = []
        for a in arrays:
            if a.dtype not in CODE_OF:
                self.refuse(req, endpoint, f"donor state holds dtype {a.dtype}, which cannot be sent")
                return
            specs.append((CODE_OF[a.dtype], tuple(a.shape)))
        arrays = [np.ascontiguousarray(a) for a in arrays]
        codecs: tuple = ()
        if compression is not None:
            chosen = _codecs.resolve(compression, [a.shape for a in arrays], [a.dtype for a in arrays])
            codecs = tuple(c if a.dtype.kind == "f" else _codecs.NONE for c, a in zip(chosen, arrays))
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
            arrays = wire
        self._send(endpoint, self._meta(req, True, meta=meta, specs=tuple(specs), digest=state_digest(arrays),
                                        codecs=codecs))
        idx = 0
        for t, a in enumerate(arrays):
            raw = a.reshape(-1).view(np.uint8)
            for off in range(0, raw.size, self.chunk_bytes):
                self._send(endpoint, StateChunk(self.peer_id, self.endpoint, req=req, index=idx, tensor=t, offset=off,
                                                data=raw[off: off + self.chunk_bytes]))
                idx += 1
        self.served += 1


class DownloadPhase(Enum):
    ASKING = "asking"  # STATE_REQ sent, waiting for STATE_META
    STREAMING = "streaming"  # receiving chunks
    DONE = "done"


_MOVES = {
    DownloadPhase.ASKING: {DownloadPhase.ASKING, DownloadPhase.STREAMING, DownloadPhase.DONE},
    DownloadPhase.STREAMING: {DownloadPhase.ASKING, DownloadPhase.DONE},
    DownloadPhase.DONE: set(),
}


@dataclass
class StateDownload:
    """Downloader side of one `load_state_from_peers` call."""

    req: str
    membership: MembershipView
    send: Callable[[str, Message], None]
    rng: np.random.Generator
    started: float
    deadline: float
    chunk_timeout: float
    max_bytes: int
    on_done: Callable[["StateDownload", Any, list[np.ndarray] | None, Exception | None], None]
    phase: DownloadPhase = DownloadPhase.ASKING
    donor: tuple[str, str] = ("", "")
    tried: list[str] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    wait_until: float = 0.0
    dropped: int = 0  # the donor's data refused (bad layout, dtype, size, checksum)
    late: int = 0  # messages not for this request's current donor and phase, ignored
    drops: DropLog | None = None  # the node's: refused donor data is logged once per donor
    _meta: Any = None
    _bufs: list[np.ndarray] = field(default_factory=list)
    _plan: list[tuple[int, int, int]] = field(default_factory=list)  # (tensor, offset, length) per chunk
    _next: int = 0
    _digest: str = ""
    _specs: list = field(default_factory=list)
    _codecs: tuple = ()

    def _move(self, phase: DownloadPhase) -> None:
        if phase not in _MOVES[self.phase]:
            raise IllegalTransition(f"download {self.req}: illegal move {self.phase.value} -> {phase.value}")
        self.phase = phase

    # ------------------------------------------------------------------ donor choice
    def start(self, now: float) -> None:
        self._ask_next(now)

    def _ask_next(self, now: float) -> None:
        donors = [r for r in self.membership.donors() if r.peer_id not in self.tried]
        if not donors:
            live = len(self.membership.live_ids())
            sharing = len(self.membership.donors())
            what = "; ".join(self.history[-6:]) or "nothing to try"
            self._finish(None, None, StateUnavailable(
                f"could not download state: {live} live peers known, {sharing} share state, "
                f"{len(self.tried)} tried. What happened: {what}. Start a peer with allow_state_sharing=True "
                "or retry once more peers are up."))
            return
        best = donors[0].share
        tier = [r for r in donors if r.share == best]
        pick = tier[int(self.rng.integers(len(tier)))]  # spread newcomers over equally good donors
        self.tried.append(pick.peer_id)
        self.donor = (pick.peer_id, pick.endpoint)
        self._move(DownloadPhase.ASKING)
        self.wait_until = now + self.chunk_timeout
        self.send(pick.endpoint, StateReq(self.membership.peer_id, self.membership.endpoint, req=self.req))

    def _give_up_on_donor(self, now: float, why: str, bad: bool = False) -> None:
        self.dropped += int(bad)
        self.history.append(f"{self.donor[0][:8]}: {why}")
        if bad:
            if self.drops is None:
                self.drops = DropLog(self.membership.peer_id[:8])
            self.drops.note(log, self.donor[0], "state data failing its checks (layout, size or checksum)",
                            f"download {self.req}: {why}; trying another donor")
        else:
            log.info("state download %s: donor %s failed: %s", self.req, self.donor[0][:8], why)
        self._bufs, self._plan, self._next = [], [], 0
        self._ask_next(now)

    def _finish(self, meta: Any, arrays: list[np.ndarray] | None, err: Exception | None) -> None:
        self._move(DownloadPhase.DONE)
        self.on_done(self, meta, arrays, err)

    # ------------------------------------------------------------------ messages
    def on_meta(self, msg: StateMeta, now: float) -> None:
        if self.phase is not DownloadPhase.ASKING or msg.sender != self.donor[0] or msg.req != self.req:
            self.late += 1
            return
        if not msg.ok:
            return self._give_up_on_donor(now, f"refused: {msg.reason}")
        specs, chunk = msg.specs, msg.chunk_bytes
        codecs = tuple(msg.codecs) or (_codecs.NONE,) * len(specs)
        if len(codecs) != len(specs):
            return self._give_up_on_donor(now, "codecs do not match the tensors announced", bad=True)
        bufs, plan, total, total_raw = [], [], 0, 0
        for t, (code, shape) in enumerate(specs):
            if code not in DTYPES:
                return self._give_up_on_donor(now, f"tensor {t} has disallowed dtype {code!r}", bad=True)
            c = codecs[t]
            if c not in _codecs.CODEC_IDS or (c != _codecs.NONE and DTYPES[code].kind != "f"):
                return self._give_up_on_donor(now, f"tensor {t}: codec {c} cannot carry dtype {code!r}", bad=True)
            numel = int(np.prod(shape, dtype=np.int64))
            total_raw += numel * DTYPES[code].itemsize  # what the decoded state will take in memory
            if total_raw > self.max_bytes:
                return self._give_up_on_donor(now, f"state larger than the {self.max_bytes}-byte limit", bad=True)
            nbytes = _codecs.encoded_nbytes(c, numel, DTYPES[code].itemsize)
            total += nbytes
            if total > self.max_bytes:
                return self._give_up_on_donor(now, f"state larger than the {self.max_bytes}-byte limit", bad=True)
            bufs.append(np.empty(nbytes, dtype=np.uint8))
            plan += [(t, off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
        self._meta, self._specs, self._bufs, self._plan, self._next = msg.meta, specs, bufs, plan, 0
        self._codecs = codecs
        self._digest = msg.digest
        self._move(DownloadPhase.STREAMING)
        self.wait_until = now + self.chunk_timeout
        self._maybe_complete(now)

    def on_chunk(self, msg: StateChunk, now: float) -> None:
        if self.phase is not DownloadPhase.STREAMING or msg.sender != self.donor[0] or msg.req != self.req:
            self.late += 1
            return
        if self._next >= len(self._plan):
            return self._give_up_on_donor(now, "sent more chunks than announced", bad=True)
        t, off, length = self._plan[self._next]
        arr = msg.data
        if msg.index != self._next or msg.tensor != t or msg.offset != off or arr.nbytes != length:
            return self._give_up_on_donor(now, f"chunk {msg.index} does not match the announced layout", bad=True)
        self._bufs[t][off: off + length] = arr.view(np.uint8)
        self._next += 1
        self.wait_until = now + self.chunk_timeout
        self._maybe_complete(now)

    def _maybe_complete(self, now: float) -> None:
        if self._next < len(self._plan):
            return
        if state_digest(self._bufs) != self._digest:  # of the bytes as they came (the same for raw tensors)
            return self._give_up_on_donor(now, "checksum mismatch", bad=True)
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
        if self.phase is not DownloadPhase.DONE and self.donor[1] == endpoint:
            self._give_up_on_donor(now, "connection lost")

    # ------------------------------------------------------------------ time
    def next_deadline(self) -> float | None:
        return None if self.phase is DownloadPhase.DONE else min(self.deadline, self.wait_until)

    def on_timer(self, now: float) -> None:
        if self.phase is DownloadPhase.DONE:
            return
        if now >= self.deadline:
            self.history.append(f"{self.donor[0][:8]}: overall timeout")
            self._finish(None, None, StateUnavailable(
                f"state download timed out after {now - self.started:.1f}s: " + "; ".join(self.history[-6:])))
        elif now >= self.wait_until:
            what = "no answer" if self.phase is DownloadPhase.ASKING else f"stalled after chunk {self._next}"
            self._give_up_on_donor(now, f"{what} within {self.chunk_timeout:g}s")
