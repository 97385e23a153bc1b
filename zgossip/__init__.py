"""zgossip: decentralized group averaging of tensors over ZeroMQ, without a central server.

The protocol (membership, matchmaking, butterfly all-reduce) is written once as sans-IO
state machines and driven either by ZeroMQ (`Averager`) or by SimPy (the `sim` package).
"""
from .averager import Averager
from .errors import (
    AveragerClosed,
    GroupNotFound,
    IllegalTransition,
    InvalidMessage,
    PeerLost,
    ProtocolError,
    RoundTimeout,
    StateUnavailable,
    StepInProgress,
    ZGossipError,
)
from .node import NodeConfig, StepResult
from .step_control import StepControl, StepStage

__version__ = "0.1.0"

# The training integrations import torch; load them on first use so `import zgossip` stays light.
_LAZY = {
    "CollaborativeOptimizer": "collaborative",
    "DecentralizedOptimizer": "optim",
    "DecentralizedSGD": "optim",
    "DecentralizedAdam": "optim",
    "Accumulator": "accumulator",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'zgossip' has no attribute {name!r}")

__all__ = [
    "Averager",
    "NodeConfig",
    "StepResult",
    "StepControl",
    "StepStage",
    "ZGossipError",
    "ProtocolError",
    "IllegalTransition",
    "InvalidMessage",
    "GroupNotFound",
    "RoundTimeout",
    "PeerLost",
    "AveragerClosed",
    "StepInProgress",
    "StateUnavailable",
    "CollaborativeOptimizer",
    "DecentralizedOptimizer",
    "DecentralizedSGD",
    "DecentralizedAdam",
    "Accumulator",
    "__version__",
]
