"""`MembershipView`: what the protocol reads and writes about who is alive.

`Node`, `Matchmaker` and `StateDownload` see membership only through this interface. Two
classes implement it: `zgossip.membership.Membership` (gossip, what real peers run) and
`sim.static.StaticView` (a converged table shared by a whole simulated swarm, for very large
simulations). `tests/sim/test_seam.py` checks that both provide every member listed here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from .membership import PeerRecord
    from .wire import Message

__all__ = ["MembershipView"]


@runtime_checkable
class MembershipView(Protocol):
    peer_id: str
    endpoint: str
    heartbeat: int  # this peer's own heartbeat; the node raises it to push fresh info out at once
    forgotten: list  # endpoints forgotten since the node last drained them (-> `Disconnect` actions)
    discovered: list  # endpoints of peers met since the node last drained them (-> `Connect` actions)
    share: float | None  # this peer's state-sharing priority (None: does not share)
    info: dict  # this peer's small public record
    version: int  # grows whenever the set of live peers changes

    @property
    def peers(self) -> dict[str, "PeerRecord"]:
        """Live peers other than this one, by peer id."""

    @property
    def clients(self) -> dict[str, "PeerRecord"]:
        """Live client-mode peers (they bind nothing: never sent to), by peer id; their records count."""

    def live_ids(self) -> list[str]:
        """Ids of the live peers other than this one."""

    def everyone(self) -> list[str]:
        """Ids of every live peer, this one included, sorted."""

    def ranking(self, key: str) -> list[str]:
        """Every live peer id (this one included) in rendezvous order for `key`."""

    def endpoint_of(self, peer_id: str) -> str | None: ...

    def donors(self) -> list["PeerRecord"]:
        """Peers that share their state, best priority first."""

    def start(self, now: float) -> None: ...

    def deadline(self) -> float | None:
        """When `on_timer` wants to run next (None: never)."""

    def on_timer(self, now: float) -> None: ...

    def observe(self, peer_id: str, endpoint: str, now: float) -> None:
        """A message from `peer_id` at `endpoint` arrived: it is alive."""

    def on_gossip(self, msg: "Message", now: float) -> None: ...

    def goodbye(self, now: float) -> None:
        """This peer shuts down cleanly: tell the others to forget it now (BYE)."""

    def on_bye(self, msg: "Message", now: float) -> None:
        """`msg.sender` said goodbye: it is no longer live."""
