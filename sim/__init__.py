"""Deterministic SimPy simulation of the real zgossip protocol.

The protocol nodes of `zgossip.node` run unchanged; `sim.network` decides when each
message arrives (latency, per-peer bandwidth, loss) in virtual time, and
`sim.driver` plays the role the ZeroMQ driver plays in a real run.
"""
from .driver import SimCluster, SimPeer
from .network import NetworkModel

__all__ = ["SimCluster", "SimPeer", "NetworkModel"]
