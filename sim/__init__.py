"""Deterministic SimPy simulation of the real zgossip protocol.

The protocol nodes of `zgossip.node` run unchanged; `sim.network` decides when each
message arrives (latency, per-peer bandwidth, loss) in virtual time, and
`sim.driver` plays the role the ZeroMQ transport plays in a real run: each simulated peer is a
real `zgossip.Averager` on a `SimTransport`, and blocking user code runs in virtual time on the
cluster's `sim.clock.VirtualClock` (`SimCluster.spawn`).
"""
from .clock import VirtualClock
from .driver import SimCluster, SimPeer, SimTransport
from .network import NetworkModel

__all__ = ["SimCluster", "SimPeer", "SimTransport", "VirtualClock", "NetworkModel"]
