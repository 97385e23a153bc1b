"""Deterministic SimPy simulation of the real zgossip protocol.

The protocol nodes of `zgossip.node` run unchanged; `sim.network` decides when each
message arrives (latency, per-peer bandwidth, loss) in virtual time, and
`sim.driver` plays the role the ZeroMQ transport plays in a real run: each simulated peer is a
real `zgossip.Averager` on a `SimTransport`, and blocking user code runs in virtual time on the
cluster's `sim.clock.VirtualClock` (`SimCluster.spawn`).
"""
import importlib

__all__ = ["SimCluster", "SimPeer", "SimTransport", "VirtualClock", "NetworkModel"]

# Imported on first use (PEP 562): `python -m sim sweep` and the round-level model need none of the
# message-level simulator, and a sweep's serial start-up is what caps its speed-up on few cores.
_HOMES = {"SimCluster": "driver", "SimPeer": "driver", "SimTransport": "driver", "VirtualClock": "clock",
          "NetworkModel": "network"}


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sim' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
