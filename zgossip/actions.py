"""What a protocol `Node` asks its driver to do: the seam's plain-data actions, and the one
executor every driver carries them out with.

`Node.take_actions()` returns a list of these frozen values. Two are for the transport
(`Send`, `Disconnect`), the others for the node's owner, the `Averager` (`StepDone`,
`StepFailed`, `StepProgress`, `ServeState`, `DownloadDone`, `DownloadFailed`). `execute` is the only place
that tells them apart, so the ZeroMQ driver and the simulator cannot drift apart in what
an action means (they once did: the simulator ignored `Disconnect` and served state inline).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Union

if TYPE_CHECKING:  # pragma: no cover
    from .node import StepResult
    from .wire import Message

__all__ = [
    "Send", "Disconnect", "Connect", "StepDone", "StepFailed", "StepProgress", "ServeState", "DownloadDone", "DownloadFailed",
    "Action", "OwnerAction", "Carrier", "Owner", "execute",
]


@dataclass(frozen=True, slots=True)
class Send:
    """Carry `msg` to the node listening at `endpoint` (on the lane `wire.lane_of` picks)."""

    endpoint: str
    msg: "Message"


@dataclass(frozen=True, slots=True)
class Disconnect:
    """The node forgot the peer at `endpoint`: close the connections to it (unsent data is dropped)."""

    endpoint: str


@dataclass(frozen=True, slots=True)
class Connect:
    """The node met the peer at `endpoint` and will likely talk to it: open the (lane-0) connection
    now, so its handshakes are done before a step's first message needs it."""

    endpoint: str


@dataclass(frozen=True, slots=True)
class StepDone:
    step_id: str
    result: "StepResult"


@dataclass(frozen=True, slots=True)
class StepFailed:
    step_id: str
    error: Exception


@dataclass(frozen=True, slots=True)
class StepProgress:
    """The current step entered `phase` (a `zgossip.node.StepPhase` value); ``due``: a held step
    reached its ``due_at`` untriggered, so the owner should trigger it now (`Node.trigger_step`)."""

    step_id: str
    phase: str
    due: bool = False


@dataclass(frozen=True, slots=True)
class ServeState:
    """A peer asked for our state: the owner obtains a snapshot and calls `Node.serve_state`."""

    req: str
    endpoint: str


@dataclass(frozen=True, slots=True)
class DownloadDone:
    req: str
    meta: Any
    arrays: list
    repair: tuple[int, str] | None = None  # a self-repair: (version, root) the arrays hold


@dataclass(frozen=True, slots=True)
class DownloadFailed:
    req: str
    error: Exception


OwnerAction = Union[StepDone, StepFailed, StepProgress, ServeState, DownloadDone, DownloadFailed]
Action = Union[Send, Disconnect, Connect, OwnerAction]


class Carrier(Protocol):
    """The transport's half of `execute`: moves messages, closes connections."""

    def transmit(self, endpoint: str, msg: "Message", batch: dict) -> None:
        """Send `msg`; `batch` is a dict private to one `execute` call (to encode a message sent
        to several peers in a row only once)."""

    def disconnect(self, endpoint: str) -> None: ...

    def connect(self, endpoint: str) -> None: ...


class Owner(Protocol):
    """The owner's half of `execute` (the `Averager`). Called on the driver's thread, in order."""

    def step_finished(self, act: StepDone | StepFailed) -> None: ...

    def step_progress(self, act: StepProgress) -> None: ...

    def serve_state(self, act: ServeState) -> None: ...

    def download_finished(self, act: DownloadDone | DownloadFailed) -> None: ...


def execute(actions: Iterable[Action], carrier: Carrier, owner: Owner | None,
            on_owner_error: Callable[[BaseException], None] | None = None) -> None:
    """Carry out `actions` in order. An owner callback that raises is handed to `on_owner_error`
    (the ZeroMQ driver logs it and keeps serving; the simulator lets it propagate); with no
    `owner`, owner actions are dropped."""
    batch: dict = {}
    for act in actions:
        kind = type(act)
        if kind is Send:
            carrier.transmit(act.endpoint, act.msg, batch)
        elif kind is Disconnect:
            carrier.disconnect(act.endpoint)
        elif kind is Connect:
            carrier.connect(act.endpoint)
        elif owner is not None:
            try:
                if kind is StepDone or kind is StepFailed:
                    owner.step_finished(act)
                elif kind is StepProgress:
                    owner.step_progress(act)
                elif kind is ServeState:
                    owner.serve_state(act)
                elif kind is DownloadDone or kind is DownloadFailed:
                    owner.download_finished(act)
                else:
                    raise TypeError(f"unknown action {act!r}")
            except Exception as e:
                if on_owner_error is None:
                    raise
                on_owner_error(e)
