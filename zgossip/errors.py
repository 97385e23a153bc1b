"""The error hierarchy users see. Every error zgossip raises derives from ZGossipError.

Messages say what happened and what to try next. Two branches are kept apart on purpose:

* `ProtocolError` -- *local* misuse or a bug: a message we refuse to build, a state machine asked
  for a move its transition table does not allow (`IllegalTransition`). It is raised.
* `InvalidMessage` -- a *remote* peer's bad data. `wire.decode` raises it, and the driver turns it
  into a logged, counted drop; it never reaches the user, and catching `ProtocolError` (a bug of
  ours) can never swallow it, nor the reverse.

```
ZGossipError
├── ProtocolError            local misuse or a bug
│   └── IllegalTransition    a state machine refused a move
├── InvalidMessage           a peer's message failed validation
├── GroupNotFound
├── RoundTimeout
├── PeerLost
├── AveragerClosed
├── StepInProgress
└── StateUnavailable
```
"""
from __future__ import annotations

__all__ = [
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
]


class ZGossipError(Exception):
    """Base class of every zgossip error."""


class ProtocolError(ZGossipError):
    """Local misuse or a violated protocol invariant (a bug): nothing a remote peer can cause."""


class IllegalTransition(ProtocolError):
    """A protocol state machine was asked for a move its transition table does not allow (a bug)."""


class InvalidMessage(ZGossipError):
    """A peer's message failed validation. Raised only by `wire.decode` (and the checks it shares);
    the driver turns it into a logged drop. Not a `ProtocolError`: bad remote data is not our bug."""


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
