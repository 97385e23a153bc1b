"""zgossip: decentralized group averaging of tensors over ZeroMQ, without a central server.

The protocol (membership, matchmaking, butterfly all-reduce) is written once as sans-IO
state machines and driven either by ZeroMQ (`Averager`) or by SimPy (the `sim` package).
"""
from .averager import Averager
from .errors import (
    AveragerClosed,
    GroupNotFound,
    InvalidMessage,
    PeerLost,
    ProtocolError,
    RoundTimeout,
    StateUnavailable,
    StepInProgress,
    ZGossipError,
)
from .node import NodeConfig, StepResult

__version__ = "0.1.0"

__all__ = [
    "Averager",
    "NodeConfig",
    "StepResult",
    "ZGossipError",
    "ProtocolError",
    "InvalidMessage",
    "GroupNotFound",
    "RoundTimeout",
    "PeerLost",
    "AveragerClosed",
    "StepInProgress",
    "StateUnavailable",
    "__version__",
]
