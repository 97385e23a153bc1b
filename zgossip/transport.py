"""`Transport`: how one protocol node is attached to the network, and the delivery contract
both transports keep.

The `Averager` owns a node but never a socket: it hands the transport a factory for the node
(`start`) and from then on talks to the node only through `call` / `run_on_io`, which run a
function where the node lives (the ZeroMQ I/O thread; the simulator's event loop). The
transport feeds the node (`on_message`, `on_timer`, `on_peer_down`), drains its actions and
carries them out with `zgossip.actions.execute`: sends and disconnects itself, the rest
reported to the owner (`zgossip.actions.Owner`). Two implementations:
`zgossip.zmq_driver.ZmqTransport` (real sockets; the default) and `sim.driver.SimTransport`
(virtual time, one `simpy.Environment`).

Delivery contract -- what the protocol may assume, and what the simulator must model:

* **Lanes.** Every message travels on the lane `wire.lane_of` gives its type: lane 1 carries
  averaged results (RESULT), lane 0 everything else. Each (sender, receiver, lane) is one
  connection.
* **Order.** Messages from one sender to one receiver arrive in the order sent *within a
  lane*; across lanes there is no order (a RESULT may overtake PART data queued before it).
* **No duplicates, no corruption.** A message arrives once and intact, or not at all. Frames
  that fail `wire.decode` are dropped and counted, never raised.
* **Loss.** Messages still queued or in flight when either end dies, when the sender closes
  the connection (`Disconnect`, shutdown), or when an in-place step drops unsent parts
  (`settle_sends`) are lost, silently -- except that `settle_sends` sends the RESULTs it had to
  drop again, from a copy, to the members the node still owes (`Node.still_owes`); a client's
  payloads are copies from the start (its queue on our ROUTER cannot be dropped). A live, reachable peer loses nothing (TCP retransmits
  through short partitions; nothing is dropped for being slow: no high-water mark).
* **Disconnect notices.** When the connection (lane 0) to a peer this node has sent to drops
  because the peer's process died, the node is told (`Node.on_peer_down(endpoint, now)`),
  about one-way latency later. A paused process or a partition produces no notice.
* **Time.** Every entry into the node is passed ``transport.clock.now()`` at the moment the
  handling starts; the node's deadline is honoured no earlier than it asks.
* **Threads.** The node is touched only where the transport runs it; `call` may be used from
  any user thread of the transport's clock.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from .actions import Owner
    from .clock import Clock
    from .node import Node
    from .view import MembershipView

__all__ = ["Transport", "NodeFactory"]

#: ``make_node(endpoint, membership)``: the node for the endpoint the transport got; `membership`
#: is the transport's own `MembershipView` (simulated converged swarms) or None for gossip.
NodeFactory = Callable[[str, "MembershipView | None"], "Node"]


@runtime_checkable
class Transport(Protocol):
    clock: "Clock"
    endpoint: str  # where peers reach this node (valid once started)
    node: "Node"  # valid once started
    stats: dict  # transport counters (messages received, sent, invalid, ...)

    def start(self, peer_id: str, make_node: NodeFactory, owner: "Owner") -> None:
        """Bind, build the node with `make_node`, start it, and begin delivering."""

    def call(self, fn: Callable[[float], Any]) -> None:
        """Run ``fn(now)`` where the node lives, soon and in call order; its actions are then
        carried out. Raises RuntimeError once the transport is closed."""

    def run_on_io(self, fn: Callable[["Node", float], Any], timeout: float) -> Any:
        """Run ``fn(node, now)`` where the node lives and return its result (inline when already
        there). Raises RuntimeError when closed, concurrent.futures.TimeoutError after `timeout`."""

    def sends_pending(self) -> bool:
        """Whether a payload lent to the transport zero-copy may still be read."""

    def settle_sends(self, timeout: float, release_timeout: float = 5.0, group_id: str | None = None) -> int:
        """Wait (at most `timeout`) until no lent payload is still queued; drop what is (see
        "Loss"); return the number of peers whose data was dropped. With the `group_id` of the
        round just finished, what is queued for the members it lost (`Node.gone`) is not waited for."""

    def close(self, timeout: float = 5.0) -> None:
        """Stop: no more deliveries; queued data is lost."""
