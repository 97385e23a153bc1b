"""Training progress by gossip: what each training peer publishes, and what a peer concludes.

Every training wrapper (`optim`, `collaborative`, `accumulator`) publishes one small
record through `Averager.publish` -- it travels with the membership gossip, so there is
no progress server -- and reads everyone's with `Averager.peer_infos`. A record says
which run the peer belongs to (a digest of the prefix: membership is shared by every
prefix), its epoch (or model version), how many samples (or steps) it has accumulated
toward the next one, its throughput, a digest of its model layout, and a few flags.

`SwarmView.of` splits the live peers into those this peer can train with (same run,
same layout) and those whose model differs (same run, other layout), and answers the
questions the wrappers ask: what is the highest epoch, how many samples does the swarm
hold at an epoch, who leads. A client-mode peer's record counts like any other (the
membership gossips it: `zgossip.membership`), but nobody can connect to a client, so nobody can
download its state: its record says so (a flag), and `donor_epoch` leaves it out.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["PeerProgress", "SwarmView", "run_digest", "progress_record", "reference_digest"]

_IN_SYNC, _READY, _WANTS, _AVERAGING, _CLIENT, _HOLDING = 1, 2, 4, 8, 16, 32


def run_digest(prefix: str) -> str:
    return hashlib.blake2b(prefix.encode(), digest_size=6).hexdigest()


@dataclass(frozen=True)
class PeerProgress:
    peer_id: str
    epoch: int
    samples: float  # accumulated toward epoch + 1 (samples, or local steps for periodic averaging)
    samples_per_second: float
    layout: str  # ModelLayout.fingerprint
    signature: str  # ModelLayout.signature
    tensors: int
    in_sync: bool = True
    ready: bool = True
    wants_state: bool = False
    state_version: int = -1  # version of the state this peer can serve (-1: none)
    nonfinite: int = 0  # batches it dropped for NaN/inf gradients so far
    time: float = 0.0  # wall-clock time of the record (to extrapolate `samples` with the throughput)
    averaging: bool = False  # it is in (or about to enter) the round that ends `epoch`
    digest: str = ""  # a short digest of its parameters at `epoch` ("" if it does not publish one)
    client: bool = False  # a client-mode peer: it trains and counts, but serves no state to anyone
    holding: bool = False  # it holds off its next global step while a peer downloads the state (catchup_pause)


def progress_record(run: str, p: PeerProgress) -> dict:
    """The dict to `publish`: 12 short scalar entries (the core allows 14; flags share one int)."""
    flags = ((_IN_SYNC * p.in_sync) | (_READY * p.ready) | (_WANTS * p.wants_state) | (_AVERAGING * p.averaging)
             | (_CLIENT * p.client) | (_HOLDING * p.holding))  # (a reader that predates a flag ignores its bit)
    return {
        "run": run, "ep": int(p.epoch), "n": float(p.samples),
        "sps": float(p.samples_per_second) if math.isfinite(p.samples_per_second) else 0.0,
        "lay": p.layout, "sig": p.signature, "nt": int(p.tensors), "f": flags, "sv": int(p.state_version),
        "bad": int(p.nonfinite), "t": float(p.time), "pd": p.digest,
    }


def _parse(peer_id: str, rec: Mapping[str, Any], run: str) -> PeerProgress | None:
    """A peer's record, or None if it is not a training peer of this run or is malformed (ignored)."""
    if rec.get("run") != run:
        return None
    try:
        ep, n, sps, flags = rec["ep"], rec["n"], rec["sps"], rec["f"]
        if type(ep) is not int or ep < 0 or type(n) not in (int, float) or not (math.isfinite(n) and n >= 0):
            return None
        if type(flags) is not int or type(sps) not in (int, float) or sps < 0:
            return None
        return PeerProgress(
            peer_id, ep, float(n), float(sps), str(rec["lay"]), str(rec["sig"]), int(rec["nt"]),
            in_sync=bool(flags & _IN_SYNC), ready=bool(flags & _READY), wants_state=bool(flags & _WANTS),
            state_version=int(rec["sv"]), nonfinite=int(rec["bad"]), time=float(rec["t"]),
            averaging=bool(flags & _AVERAGING), digest=str(rec.get("pd", "")), client=bool(flags & _CLIENT),
            holding=bool(flags & _HOLDING),
        )
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class SwarmView:
    """One reading of the swarm from this peer's point of view (this peer included)."""

    me: PeerProgress
    peers: tuple[PeerProgress, ...]  # compatible peers, this one included, by peer id
    mismatched: tuple[PeerProgress, ...] = field(default=())  # same run, different layout

    @classmethod
    def of(cls, me: PeerProgress, infos: Mapping[str, Mapping[str, Any]], run: str) -> "SwarmView":
        ok, bad = [me], []
        for pid, rec in infos.items():
            if pid == me.peer_id:
                continue
            p = _parse(pid, rec, run)
            if p is None:
                continue
            (ok if p.layout == me.layout else bad).append(p)
        ok.sort(key=lambda p: p.peer_id)
        bad.sort(key=lambda p: p.peer_id)
        return cls(me, tuple(ok), tuple(bad))

    @property
    def num_peers(self) -> int:
        return len(self.peers)

    def others(self) -> list[PeerProgress]:
        return [p for p in self.peers if p.peer_id != self.me.peer_id]

    @property
    def max_epoch(self) -> int:
        return max(p.epoch for p in self.peers if p.ready)

    @property
    def donor_epoch(self) -> int:
        """The highest epoch among this peer's and those of the ready peers whose state it could download
        (all but clients): a client ahead of them is no reason to download, since nobody can download from it."""
        return max([self.me.epoch] + [p.epoch for p in self.peers if p.ready and not p.client])

    def at(self, epoch: int) -> list[PeerProgress]:
        return [p for p in self.peers if p.ready and p.epoch == epoch]

    def samples_at(self, epoch: int) -> float:
        return sum(p.samples for p in self.at(epoch))

    def estimate_at(self, epoch: int, now: float, horizon: float) -> float:
        """Samples the peers at `epoch` hold by now: each record extrapolated with its throughput for
        at most `horizon` seconds (records lag by the gossip delay; clocks of hosts may differ)."""
        total = 0.0
        for p in self.at(epoch):
            if p.peer_id == self.me.peer_id:
                total += p.samples
            else:
                age = max(0.0, now - p.time)
                # a record older than the horizon belongs to an idle peer: count what it holds, no more
                total += p.samples + (p.samples_per_second * age if age <= horizon else 0.0)
        return total

    def averaging_at(self, epoch: int) -> bool:
        """Whether some other peer at `epoch` announced it entered the round that ends it."""
        return any(p.averaging for p in self.at(epoch) if p.peer_id != self.me.peer_id)

    def rate_at(self, epoch: int) -> float:
        return sum(p.samples_per_second for p in self.at(epoch))

    def leader(self) -> PeerProgress:
        """Highest epoch among ready peers, ties broken by the lowest peer id (the same answer everywhere
        once the records have spread)."""
        ready = [p for p in self.peers if p.ready] or list(self.peers)
        return min(ready, key=lambda p: (-p.epoch, p.peer_id))


def reference_digest(view: "SwarmView", epoch: int) -> tuple[str, int] | None:
    """Peers at one epoch should hold one set of parameters (or one anchor). When the in-sync peers at
    `epoch` publish different digests: (the reference, how many different digests) -- the reference is
    the largest set of equal digests (ties: the set holding the lowest peer id), never a set of
    client-mode peers alone (nobody can download from a client). None when they agree."""
    groups: dict[str, list[PeerProgress]] = {}
    for p in view.at(epoch):
        if p.in_sync and p.digest:
            groups.setdefault(p.digest, []).append(p)
    if len(groups) < 2:
        return None
    ref = sorted(groups.items(), key=lambda kv: (all(p.client for p in kv[1]), -len(kv[1]),
                                                 min(p.peer_id for p in kv[1])))[0][0]
    return ref, len(groups)
