"""The error hierarchy users see. Every error zgossip raises derives from ZGossipError.

Messages say what happened and what to try next; bad input from a *peer* never
raises (it is a logged drop), these are for the local user.
"""
from __future__ import annotations

__all__ = [
    "ZGossipError",
    "ProtocolError",
    "InvalidMessage",
    "GroupNotFound",
    "RoundTimeout",
    "PeerLost",
    "AveragerClosed",
    "StepInProgress",
    "StateUnavailable",
]


class ZGossipError(Exception):
    """Base class of every zgossip error."""


class ProtocolError(ZGossipError):
    """An illegal state transition or a violated protocol invariant (a bug, or misuse)."""


class InvalidMessage(ProtocolError):
    """A message failed validation. Raised only by `wire.decode`; the node turns it into a logged drop."""


class GroupNotFound(ZGossipError):
    """Matchmaking ended without a group; the message says how many peers were seen and what timed out."""


class RoundTimeout(ZGossipError):
    """A step did not finish within its time budget."""


class PeerLost(ZGossipError):
    """Every other member of the group was lost before anything could be averaged."""


class AveragerClosed(ZGossipError):
    """The averager was shut down; create a new one to keep averaging."""


class StepInProgress(ZGossipError):
    """step() was called while the previous step of this averager is still running."""


class StateUnavailable(ZGossipError):
    """No peer could provide its state (none shares it, all failed, or the download timed out)."""
