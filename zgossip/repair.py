"""State that repairs itself: the vote on (model version, state hash) that peers gossip.

After PCCL: every peer whose shared state should be bit-identical to its peers' (after a
global all-reduce and the same optimizer step) publishes ``(version, root)`` -- the version
its owner names (an epoch, a step count) and the root digest of a snapshot of the state
(`zgossip.state.StateSnapshot`, taken at a step boundary). `vote` compares this peer's pair
with what the live peers published at the same version:

* ``agree``: a strict majority of the voters at this version (this peer included) holds our
  root, or nobody else is at this version (``alone``).
* ``repair``: a strict majority holds another root: we are the odd one out (a bit flip, a
  missed step, a diverged optimizer) and download the majority's state from its holders.
* ``split``: no root has a strict majority (e.g. 1 against 1): nobody can tell who is right,
  so nobody repairs; it is logged, and resolves once more peers reach the version.

Why a *strict* majority of voters: an allowed but hostile peer can publish any root. With
H honest voters holding the same root and L liars, the liars win only if L > H; a minority
of liars can never make honest peers repair. A liar that claims the majority's root but
serves other bytes fails the per-chunk digests the root covers and is dropped as a donor.
Peers mid-step keep publishing their previous version (the node only votes between steps,
and versions are published at step boundaries), so a peer that finished its step first
meets no opposition at the new version until the others have published it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["Verdict", "vote", "VERSION_KEY", "HASH_KEY", "read_mark"]

VERSION_KEY, HASH_KEY = "zg.sv", "zg.sh"  # in a peer's gossiped info record
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Verdict:
    action: str  # "agree", "alone", "repair" or "split"
    version: int
    mine: str
    majority: str  # the root held by a strict majority ("" if none)
    voters: int  # peers at this version, this one included
    agreeing: int  # voters holding `majority` (or ours, when there is no majority)
    donors: tuple[str, ...]  # peers holding the majority root (for a repair), sorted


def read_mark(info: dict) -> tuple[int, str] | None:
    """(version, root) a peer published, or None if it published none or a malformed one."""
    v, h = info.get(VERSION_KEY), info.get(HASH_KEY)
    if type(v) is not int or v < 0 or type(h) is not str or len(h) != 32 or not _HEX.issuperset(h):
        return None
    return v, h


def vote(version: int, mine: str, peers: Iterable[tuple[str, int, str]]) -> Verdict:
    """Compare our (version, root) with ``(peer id, version, root)`` of the live peers."""
    holders: dict[str, list[str]] = {mine: []}
    for pid, v, root in peers:
        if v == version:
            holders.setdefault(root, []).append(pid)
    voters = 1 + sum(len(p) for p in holders.values())
    if voters == 1:
        return Verdict("alone", version, mine, mine, 1, 1, ())
    counts = {root: len(p) + (root == mine) for root, p in holders.items()}
    top = max(counts, key=lambda r: (counts[r], r == mine))
    if 2 * counts[top] <= voters:
        return Verdict("split", version, mine, "", voters, counts[mine], ())
    if top == mine:
        return Verdict("agree", version, mine, mine, voters, counts[mine], ())
    return Verdict("repair", version, mine, top, voters, counts[top], tuple(sorted(holders[top])))
