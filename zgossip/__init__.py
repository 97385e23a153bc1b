"""zgossip: decentralized group averaging of tensors over ZeroMQ, without a central server.

The protocol (membership, matchmaking, butterfly all-reduce) is written once as sans-IO
state machines and driven either by ZeroMQ (`Averager`) or by SimPy (the `sim` package).
"""
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

__version__ = "0.1.0"

# Loaded on first use (PEP 562), so `import zgossip` stays light: the training integrations import
# torch, and the averager pulls in the whole protocol stack (~0.25 s) that a round-level sweep
# importing `zgossip.grid` does not need.
_LAZY = {
    "Averager": "averager",
    "NodeConfig": "node",
    "StepResult": "node",
    "StepControl": "step_control",
    "StepStage": "step_control",
    "CollaborativeOptimizer": "collaborative",
    "DecentralizedOptimizer": "optim",
    "DecentralizedSGD": "optim",
    "DecentralizedAdam": "optim",
    "DiLoCoOptimizer": "diloco",
    "Accumulator": "accumulator",
}


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


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
    "DiLoCoOptimizer",
    "Accumulator",
    "__version__",
]
