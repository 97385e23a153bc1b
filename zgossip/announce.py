"""What a node announces about its next step, and what others read from it.

Every node gossips, in the reserved ``zg.`` entries of its membership record, an
`Announcement`: the round it expects next, a tag of its prefix, a tag of the matchmaking
key it will use in that round, and (``grid="auto"``) its estimate of the swarm's size. Two
entries, so that a user keeps 14 of the record's 24 (`zgossip.messages` caps it):

    zg.round   = 7                      the next round (an int, as before)
    zg.prefix  = "<prefix tag>:<key tag>[:<size>]"

Readers:

* **Swarm round** (`zgossip.node`): the highest round among peers of the same prefix.
* **Who may still join a key** (`may_join`): a rendezvous peer closes a pool as soon as
  every live peer that may use the key has joined (small swarms do not wait the window).
  A peer counts as *possibly coming* unless its announcement proves it goes elsewhere: its
  round is past the pool's, or equal with another key, or it has another prefix. A peer
  whose announcement is older than the pool's round (it is still averaging the previous
  round, sat a round out, or our copy of its record is stale) or that announced nothing
  readable counts as coming: the pool then waits, bounded by the window, as it always did.
* **Swarm size** (`zgossip.autogrid`): the announced size estimates.

Tags are short blake2b digests in hex: the key itself can be long (a grid line), and only
equality is ever asked.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Iterable

__all__ = ["Announcement", "tag", "may_join", "ROUND", "TAGS"]

ROUND, TAGS = "zg.round", "zg.prefix"

#: the largest round an announcement may name (half the wire's `messages.MAX_ROUND`): peers adopt
#: the highest round announced, so a liar naming one near the limit would carry every peer past
#: it, after which no JOIN could be built and the swarm never averaged again. Honest swarms count
#: one round per step: they never come near 2**61.
MAX_ANNOUNCED_ROUND = 1 << 61


def tag(text: str, size: int = 6) -> str:
    """A short, PYTHONHASHSEED-independent digest of `text` (prefixes: 6 bytes; keys: 4, which
    keeps gossip small -- two keys of one round with equal tags only make a pool wait longer)."""
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


@dataclass(frozen=True)
class Announcement:
    prefix: str  # tag of the prefix
    round: int  # the round this peer expects next
    key: str = ""  # tag of the key it will match on in that round ("" = not known)
    size: int = 0  # its estimate of the swarm's live size (0 = none)

    def record(self) -> dict:
        tags = f"{self.prefix}:{self.key}:{self.size}" if self.size else f"{self.prefix}:{self.key}"
        return {ROUND: self.round, TAGS: tags}

    @classmethod
    def read(cls, info: dict) -> "Announcement | None":
        """The announcement in a peer's gossiped record, or None if it holds none readable (a
        peer's record is untrusted input: anything malformed reads as "announced nothing")."""
        r, t = info.get(ROUND), info.get(TAGS)
        if type(r) is not int or type(t) is not str or not 0 <= r <= MAX_ANNOUNCED_ROUND:
            return None
        return _parse(cls, r, t)

    @classmethod
    def _from_fields(cls, r: int, t: str) -> "Announcement | None":
        parts = t.split(":")
        if len(parts) == 1:  # a prefix tag alone: announces the round only
            return cls(parts[0], r)
        if len(parts) == 2:
            return cls(parts[0], r, parts[1])
        if len(parts) != 3 or not parts[2].isdigit() or len(parts[2]) > 12:
            return None
        return cls(parts[0], r, parts[1], int(parts[2]))


@functools.lru_cache(maxsize=4096)
def _parse(cls: type, r: int, t: str) -> "Announcement | None":
    """`Announcement.read` of one (round, tags) pair: a swarm announces few distinct ones, and a
    rendezvous reads every live peer's record per pool, so each is parsed once (the result is frozen)."""
    return cls._from_fields(r, t)


def may_join(records: Iterable[tuple[str, dict]], prefix: str, key: str, rnd: int) -> set[str]:
    """Ids among `records` ((peer id, gossiped info) pairs) that may still join the key tagged
    `key` in round `rnd` of the prefix tagged `prefix` (see the module docstring)."""
    out = set()
    for pid, info in records:
        a = Announcement.read(info)
        if a is None:
            out.add(pid)  # announced nothing readable: cannot rule it out
        elif a.prefix != prefix or a.round > rnd or (a.round == rnd and a.key and a.key != key):
            continue  # provably elsewhere
        else:
            out.add(pid)
    return out
