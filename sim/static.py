"""A converged, shared membership for very large simulations.

Gossip membership costs every node a table of every other node: at 16,384 peers that
is 268 M records. A `StaticTable` holds the live set once, and each node gets a
`StaticView` with the interface of `zgossip.membership.Membership` (what `Node`,
`Matchmaker` and `StateDownload` call), as if gossip had converged. Crashed peers
leave the table after their ``peer_timeout``, the time gossip would take to forget
them. The rendezvous ranking for a key is the same for every view, so it is computed
once per key per membership version for the whole swarm.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from zgossip.membership import PeerRecord
from zgossip.rendezvous import RankingCache

__all__ = ["StaticTable", "StaticView"]


class StaticTable:
    def __init__(self) -> None:
        self.records: dict[str, PeerRecord] = {}
        self.version = 0
        self._sorted: list[str] | None = None
        self._ranking = RankingCache(max_keys=1 << 16)

    def add(self, peer_id: str, endpoint: str, now: float) -> None:
        self.records[peer_id] = PeerRecord(peer_id, endpoint, 0, now)
        self._changed()

    def remove(self, peer_id: str) -> None:
        if self.records.pop(peer_id, None) is not None:
            self._changed()

    def _changed(self) -> None:
        self.version += 1
        self._sorted = None

    def everyone(self) -> list[str]:
        if self._sorted is None:
            self._sorted = sorted(self.records)
        return self._sorted

    def ranking(self, key: str) -> list[str]:
        return self._ranking.ranking(self.version, self.everyone(), key)


class _Others(Mapping):
    """The shared records less one peer's own, read in place: building that dict on every read
    (the adaptive deadlines read a groupmate's record per part) made a 1,024-peer round 10x slower."""

    __slots__ = ("_records", "_me")

    def __init__(self, records: dict[str, PeerRecord], me: str) -> None:
        self._records, self._me = records, me

    def __getitem__(self, peer_id: str) -> PeerRecord:
        if peer_id == self._me:
            raise KeyError(peer_id)
        return self._records[peer_id]

    def __iter__(self) -> Iterator[str]:
        return (p for p in self._records if p != self._me)

    def __len__(self) -> int:
        return len(self._records) - (self._me in self._records)

    # the Mapping mixins go through __getitem__ / __iter__ per key; these are read per message
    def get(self, peer_id: str, default: Any = None) -> Any:
        return default if peer_id == self._me else self._records.get(peer_id, default)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id != self._me and peer_id in self._records

    def items(self) -> list[tuple[str, PeerRecord]]:  # type: ignore[override]
        me = self._me
        return [(p, r) for p, r in self._records.items() if p != me]

    def values(self) -> list[PeerRecord]:  # type: ignore[override]
        me = self._me
        return [r for p, r in self._records.items() if p != me]


class StaticView:
    """One node's window on a `StaticTable` (duck-types `Membership`)."""

    def __init__(self, table: StaticTable, peer_id: str, endpoint: str) -> None:
        self.table = table
        self.peer_id = peer_id
        self.endpoint = endpoint
        self.heartbeat = 0
        self.forgotten: list[str] = []
        self.discovered: list[str] = []  # stays empty: a converged view meets nobody (connections open on first use)
        self._others = _Others(table.records, peer_id)  # reads the table in place: one per view will do

    # what the node reads and writes about itself lives in the shared record
    @property
    def _me(self) -> PeerRecord:
        return self.table.records[self.peer_id]

    @property
    def share(self) -> float | None:
        rec = self.table.records.get(self.peer_id)
        return rec.share if rec else None

    @share.setter
    def share(self, value: float | None) -> None:
        if self.peer_id in self.table.records:
            self._me.share = value

    @property
    def info(self) -> dict:
        rec = self.table.records.get(self.peer_id)
        return rec.info if rec else {}

    @info.setter
    def info(self, value: dict) -> None:
        if self.peer_id in self.table.records:
            self._me.info = value

    @property
    def version(self) -> int:
        return self.table.version

    @property
    def peers(self) -> Mapping[str, PeerRecord]:
        return self._others

    @property
    def clients(self) -> Mapping[str, PeerRecord]:
        return {}  # a static table holds no client-mode peers (`SimCluster.add_peer` refuses them)

    def live_ids(self) -> list[str]:
        return [p for p in self.table.everyone() if p != self.peer_id]

    def everyone(self) -> list[str]:
        return self.table.everyone()

    def ranking(self, key: str) -> list[str]:
        return self.table.ranking(key)

    def endpoint_of(self, peer_id: str) -> str | None:
        rec = self.table.records.get(peer_id)
        return rec.endpoint if rec else None

    def donors(self) -> list[PeerRecord]:
        recs = [r for p, r in self.table.records.items() if r.share is not None and p != self.peer_id]
        return sorted(recs, key=lambda r: (-r.share, r.peer_id))

    # gossip is a no-op: the table is already converged
    def start(self, now: float) -> None: ...
    def deadline(self) -> float | None:
        return None
    def on_timer(self, now: float) -> None: ...
    def observe(self, peer_id: str, endpoint: str, now: float) -> None: ...
    def on_gossip(self, msg: Any, now: float) -> None: ...
    def merge(self, entries: Any, now: float) -> None: ...
    def forget(self, peer_id: str, now: float, why: str = "") -> None: ...

    def goodbye(self, now: float) -> None:
        """A clean shutdown leaves the converged table at once (gossip: BYE; see zgossip.membership)."""
        self.table.remove(self.peer_id)

    def on_bye(self, msg: Any, now: float) -> None: ...
