"""The user's object: average a list of tensors in place with whoever steps with the same prefix.

    avg = zgossip.Averager([w, b], prefix="run1", initial_peers=["tcp://10.0.0.5:41000"])
    result = avg.step(weight=32, gather={"loss": 0.7})   # or step(wait=False) -> Future
    with avg.get_tensors() as (w, b):                     # the averager never writes in here
        ...

The protocol node runs on a `zgossip.transport.Transport`: ZeroMQ by default (its I/O
thread), or the simulator's (`sim.driver.SimTransport`), so the simulator runs this very
class. A step snapshots the tensors into a flat buffer (under the tensor lock), the group
averages that buffer, and a small worker writes the averaged element ranges back under the
lock. Every wait, lock, worker and reading of the time goes through the transport's
`zgossip.clock.Clock`: the wall clock for ZeroMQ, virtual time in the simulator.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import itertools
import logging
import math
from typing import Any, Iterator, Sequence

import numpy as np

from . import codecs, staging, wire
from .actions import DownloadDone, DownloadFailed, ServeState, StepDone, StepFailed, StepProgress
from .codecs import NONE
from .endpoints import check_endpoint
from .identity import AllowList, load_key, peer_id_of, split_peer
from .messages import MAX_ROUND
from .errors import AveragerClosed, RoundTimeout, StateUnavailable, StepInProgress, ZGossipError
from .node import Node, NodeConfig, StepRequest, StepResult
from .state import StateSnapshot
from .step_control import StepControl, StepFuture, StepStage, check_weight
from .steplog import StepLog
from .tensors import BF16_DTYPE, FlatLayout, as_array, is_bf16
from .transport import Transport

__all__ = ["Averager", "StepFuture", "StepControl", "StepStage"]

_GOODBYE_WAIT = 0.02  # seconds given to the BYE messages to leave before the sockets close
_SLACK = 0.5  # seconds: the safety net's margin past the node's deadline, and the most spent dropping unsent data
#: the longest `step` timeout (seconds, ~11.6 days): every wait has a deadline, and waits far
#: longer overflow the platform's timed waits
MAX_STEP_TIMEOUT = 1e6

log = logging.getLogger(__name__)


def _to_numpy(a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    if type(a).__module__.startswith("torch"):
        if is_bf16(a):  # numpy has no bfloat16: as float32 (exact), what a bfloat16 tensor's mirror holds
            return a.detach().cpu().float().numpy()
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _served(a: Any) -> np.ndarray:
    """`a` as a snapshot may hold it: copied unless it is an array owning its memory (what the default
    `get_current_state` returns). A torch tensor or a view is most likely live memory -- the model's
    own parameter -- and a snapshot must not change while downloaders fetch it: their chunks would fail
    the digests taken at the snapshot, and the honest donor be dropped as sending bad data."""
    out = _to_numpy(a)
    return out if out.flags.owndata and out.flags.c_contiguous else np.array(out, copy=True, order="C")


def _bf16_exact(a: np.ndarray) -> bool:
    """Whether the float32 array `a` holds only values a bfloat16 holds exactly (the low 16 bits are 0;
    NaN and inf included as bfloat16 -> float32 makes them)."""
    return a.dtype == np.float32 and not (np.ascontiguousarray(a).view(np.uint32) & np.uint32(0xFFFF)).any()


def _is_auto(grid: Any) -> bool:
    return isinstance(grid, str) and grid == "auto"


def _grid_shape(grid: Any) -> tuple[int, ...]:
    """The `grid` argument as a shape: a sequence of positive ints (``"auto"`` is handled apart)."""
    if isinstance(grid, str) or not all(isinstance(m, (int, np.integer)) and not isinstance(m, bool) for m in grid):
        raise ValueError(f'grid must be a sequence of positive ints or "auto", not {grid!r}')
    return tuple(int(m) for m in grid)


def _check_round(rnd: Any) -> int | None:
    """`step`'s ``round``: None or an int in [0, 2**62) (JOINs carry at most `MAX_ROUND`, and the
    node moves on to ``round + 1`` after the step), or ValueError."""
    if rnd is None:
        return None
    if isinstance(rnd, bool) or not isinstance(rnd, (int, np.integer)):
        raise ValueError(f"round must be None or an int, not {type(rnd).__name__}")
    if not 0 <= int(rnd) < MAX_ROUND:
        raise ValueError(f"round must be in [0, 2**62), not {int(rnd)}")
    return int(rnd)


def _seconds(name: str, value: Any, least: float | None) -> float:
    """`value` as finite seconds in [least, MAX_STEP_TIMEOUT] (least None: > 0), or ValueError naming it."""
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, not {type(value).__name__}") from None
    low_ok = t > 0.0 if least is None else t >= least
    if not (math.isfinite(t) and low_ok and t <= MAX_STEP_TIMEOUT):
        bound = "> 0" if least is None else f">= {least:g}"
        raise ValueError(f"{name} must be a finite number of seconds {bound} and <= {MAX_STEP_TIMEOUT:g}, "
                         f"not {value!r}")
    return t


def _settle_future(fut: cf.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a step's outcome unless the caller cancelled the future (then nothing may be set)."""
    if fut.cancelled():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except cf.InvalidStateError:  # cancelled or finished meanwhile
        pass


class Averager:
    """Decentralized group averaging of `tensors` (numpy arrays and/or torch tensors on any device), in place.

    Parameters mirror hivemind's DecentralizedAverager where they mean the same thing:
    ``target_group_size`` / ``min_group_size`` bound group sizes; ``matchmaking_time`` is
    the rendezvous window; ``request_timeout`` how long a silent rendezvous peer is given;
    ``part_size_bytes`` the streaming unit; ``part_timeout`` how long a silent member is
    waited for before it is excluded (an owner gets twice that); ``allreduce_timeout``
    bounds a round; ``bandwidth`` is this peer's link rate, what its share of the reduction
    follows: a number declares it (any unit every peer uses, Mbit/s where it meets measured
    rates; the default, the same number on every peer, gives equal spans); ``"auto"`` measures
    it in Mbit/s -- the lower of its download and upload rates -- from the transfers of its
    rounds and gossips it (`zgossip.linkstats`); 0 makes it a client that reduces nothing;
    ``part_timeout_floor`` /
    ``deadline_slack`` turn ``part_timeout`` into a cap on adaptive deadlines: a groupmate whose
    pace was measured is given up after ``deadline_slack`` x the time its next part takes at that
    pace, at least ``part_timeout_floor`` seconds, and past ``part_timeout`` only when it was
    measured that slow (never past the round's ``allreduce_timeout``); ``part_timeout_floor=None``
    keeps the fixed ``part_timeout``; ``averaging_alpha`` moves tensors only part way
    to the mean; ``grid`` / ``grid_coords`` place the peer on a Moshpit grid (``grid="auto"``:
    the shape follows the swarm's gossiped size, `zgossip.autogrid`).

    Torch tensors on a device (CUDA, ...) are staged through reusable host mirrors (pinned on
    CUDA) with asynchronous copies ordered against the training stream (`zgossip.staging`);
    `get_tensors` yields the device tensors themselves. bfloat16 tensors get float32 mirrors the
    same way (exact), travel as bf16 by default, and get the float32 mean rounded to bfloat16.

    ``in_place``: when the averager holds a single float32/float64 host tensor and
    ``averaging_alpha`` is 1, a blocking ``step()`` averages that tensor where it lies,
    like ``torch.distributed.all_reduce`` -- no snapshot copy, no second buffer, no
    copy back (on 4 peers x 64 MiB this saves ~20% of the CPU and a tensor's worth of
    memory per step). Meanwhile `get_tensors` in other threads waits for the step, and
    a round that fails midway may leave some parts already averaged (every element is
    still a weighted mean over contributors including this peer, or unchanged). With
    ``in_place=False``, several tensors, or ``wait=False``, a step averages a snapshot
    and writes the result back at the end, so a failed step changes nothing. Before an
    in-place step returns, parts still queued for a slow or dead peer are dropped, so bytes
    of the tensor never leave after the caller changed them.

    State sharing: ``load_state_from_peers`` fetches chunks of ``state_chunk_bytes`` from up to
    ``state_donors`` donors holding the same state at once (per-chunk SHA-256, fail-over; see
    `zgossip.state`); `publish_state` makes donors serve a versioned snapshot without the tensor
    lock and lets a peer whose state hash is outvoted repair itself (`zgossip.repair`).
    ``state_chunk_bytes`` is part of the state hash: keep it equal across a swarm.
    ``compression``: how the tensors travel during a step (`zgossip.codecs`: ``"none"``, ``"fp16"``,
    ``"bf16"``, ``"int8"``, 8 bits per value with one float32 scale per 1,024 values). One name for
    every tensor, a list (one name per tensor), a dict ``{tensor index: name}``, or a rule
    ``(index, shape, dtype) -> name`` such as ``codecs.by_size(65536, "int8")``. The default, None,
    sends fp16 tensors as fp16, bfloat16 tensors as bf16 and the rest raw. Owners decode every term and reduce in the buffer's
    float32/float64 in the fixed member order, then encode the mean once; every member (the owner
    too) applies the decoded bytes, so results stay bit-identical. The per-element error bounds are
    in `zgossip.codecs`. Peers only group with peers that compress every tensor the same way (the
    codecs are part of the layout). ``error_feedback``: what the codecs lost of this peer's data
    (and of the means it reduced) is added to its next step's data, so over many steps the losses
    cancel out (meant for gradients and parameters that change a little per step).
    ``state_compression``: the same choices, for the float tensors this peer serves to
    `load_state_from_peers` downloaders (default: raw, but bfloat16 tensors as bf16, which is exact
    for them; ``"none"`` sends those raw too).

    ``shutdown_timeout``: how long `shutdown` keeps serving what this peer still owes groupmates
    of a recent round (results they have not confirmed, sends libzmq still holds) before it stops.

    Every `step` returns within ``timeout + allreduce_timeout + 1 s`` (see README, "What a step
    guarantees"); ``result.timings["total"]`` is the caller's wall time.

    ``local_ipc``: peers on the same host (and network namespace) reach each other over Unix
    sockets instead of TCP loopback, found by the TCP endpoint they advertise; about a fifth
    faster on the 4-peer bench. ``False`` (or ``ZGOSSIP_LOCAL_IPC=0``) keeps TCP.

    ``secret_key`` (a key file written by ``zgossip keygen``, or an `identity.KeyPair`) and
    ``allowed_keys`` (an allow file, a list of Z85 public keys, or an `identity.AllowList`):
    authenticated, encrypted peers (ZeroMQ CURVE). The peer id becomes the public key (hex); only
    peers whose keys are allowed can connect, and every message's sender is checked against the
    key of its connection. Initial peers then need their key: ``tcp://HOST:PORT#KEY``, or an
    allow-file line ``KEY tcp://HOST:PORT``. Every peer of a swarm must have keys, or none
    (a mixed pair refuses each other, logged as an error). Off by default: without keys anyone
    who can reach a peer's port can join and feed values into the average, and nothing is encrypted.

    ``client_mode`` (automatic with ``listen=None``): for a peer behind NAT or a firewall. It binds
    nothing and accepts no connection; peers answer it over the connections it opened. It takes
    part in matchmaking, sends its parts, receives results and state, but reduces no span
    (bandwidth 0) and serves no state.

    ``auxiliary``: this peer brings no data (its steps have weight 0 and leave its tensors unchanged)
    but reduces a span for the others with its bandwidth; results list it in ``auxiliary``.
    Its tensors only give the layout (zeros of the right shapes will do), so it serves no state unless
    ``allow_state_sharing=True`` is passed (the default, None, means "unless auxiliary").

    ``metrics_port``: serve Prometheus metrics (steps by outcome, step durations, bytes, live peers,
    transport counters) at ``http://metrics_host:PORT/metrics``; 0 picks a free port
    (`metrics_endpoint` says which). ``metrics_host`` defaults to 127.0.0.1: use "0.0.0.0" to let
    a Prometheus on another host scrape. Every step is recorded in `step_log` either way.

    ``config``: every protocol setting as one `NodeConfig` (then the protocol keyword arguments
    above are ignored), e.g. settings they do not expose.

    ``transport``: where the node runs (a not yet started `zgossip.transport.Transport`). The
    default is a `zgossip.zmq_driver.ZmqTransport` built from ``listen``, ``announce_host``,
    ``local_ipc`` and ``max_message_bytes`` (which apply only to it); the simulator passes a
    `sim.driver.SimTransport`. The transport's clock times and bounds every wait here.
    """

    def __init__(
        self,
        tensors: Sequence[Any],
        *,
        prefix: str | None = None,
        listen: str | None = "tcp://127.0.0.1:0",
        initial_peers: Sequence[str] = (),
        target_group_size: int = 16,
        min_group_size: int = 2,
        matchmaking_time: float = 1.0,
        request_timeout: float = 0.5,
        part_size_bytes: int = 4 << 20,
        part_timeout: float = 5.0,
        allreduce_timeout: float = 60.0,
        bandwidth: float | str = 1.0,
        part_timeout_floor: float | None = 2.0,
        deadline_slack: float = 4.0,
        averaging_alpha: float = 1.0,
        grid: Sequence[int] | str = (),
        grid_coords: Sequence[int] | None = None,
        gossip_interval: float = 0.5,
        peer_timeout: float = 5.0,
        max_message_bytes: int | None = None,
        announce_host: str | None = None,
        allow_state_sharing: bool | None = None,
        state_sharing_priority: float = 0.0,
        state_chunk_bytes: int = 4 << 20,
        state_donors: int = 4,
        seed: int | None = None,
        in_place: bool = True,
        local_ipc: bool = True,
        shutdown_timeout: float = 5.0,
        transport: Transport | None = None,
        config: NodeConfig | None = None,
        secret_key: Any = None,
        allowed_keys: Any = None,
        client_mode: bool = False,
        auxiliary: bool = False,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        compression: Any = None,
        error_feedback: bool = False,
        state_compression: Any = None,
    ) -> None:
        if not 0.0 < averaging_alpha <= 1.0:
            raise ValueError("averaging_alpha must be in (0, 1]")
        if not shutdown_timeout >= 0:
            raise ValueError("shutdown_timeout must be >= 0")
        self.shutdown_timeout = float(shutdown_timeout)
        initial_peers = tuple(initial_peers) if not isinstance(initial_peers, str) else (initial_peers,)
        client_mode = bool(client_mode) or listen is None
        keys = allowed = None
        if secret_key is not None:
            keys = load_key(secret_key)
            if allowed_keys is None:
                raise ValueError("secret_key needs allowed_keys: the public keys (or an allow file) of the peers "
                                 "this one accepts")
            allowed = AllowList.of(allowed_keys)
        elif allowed_keys is not None:
            raise ValueError("allowed_keys without secret_key: give this peer a key too (zgossip keygen FILE)")
        peer_keys: dict[str, str] = {}
        split = [split_peer(p) for p in initial_peers]
        initial_peers = tuple(ep for ep, _ in split)
        for ep, key in split:
            if key is not None:
                if keys is None:
                    raise ValueError(f"initial peer {ep} is given with a public key, but this peer has no key: "
                                     "mixed swarms are refused (pass secret_key= and allowed_keys=)")
                peer_keys[ep] = peer_id_of(key)
            elif keys is not None and allowed is not None and ep not in allowed.endpoints:
                raise ValueError(f"initial peer {ep} has no public key: with keys, write tcp://HOST:PORT#KEY or add "
                                 "'KEY tcp://HOST:PORT' to the allow file")
        if transport is None:  # addresses are the ZeroMQ transport's: others name peers their own way
            if not client_mode:
                check_endpoint(listen, "listen address", listen=True)
            for ep in initial_peers:
                check_endpoint(ep, "initial peer address")
            if announce_host is not None:  # "bad host!" made an endpoint every peer drops: unreachable, silently
                try:
                    check_endpoint(f"tcp://{announce_host}:1")
                except ValueError:
                    raise ValueError(f"invalid announce_host {announce_host!r}: expected the host name or IP address "
                                     "others reach this peer at, e.g. 10.0.0.5 or peer3.example.org") from None
        self._tensors = list(tensors)
        # tensors on a device (CUDA, ...) and bfloat16 tensors (float32 mirrors) are averaged through
        # host mirrors (zgossip.staging)
        self._staging = (staging.DeviceStaging(self._tensors) if any(staging.needs_mirror(t) for t in self._tensors)
                         else None)
        host = self._staging.host_tensors(self._tensors) if self._staging is not None else self._tensors
        self._arrays = [as_array(t) for t in host]
        bf16 = [i for i, t in enumerate(self._tensors) if is_bf16(t)]
        self.layout = FlatLayout.of(host, compression, bf16=bf16)
        self.averaging_alpha = float(averaging_alpha)
        # error feedback: what the codecs lost of our data last step is added to this step's (a step
        # averages its snapshot, so the user's tensors never hold the carried error)
        self._residual = np.zeros(self.layout.numel, self.layout.dtype) if error_feedback and any(
            c != NONE for c in self.layout.codecs) else None
        self._codec = self.layout.codec_map(self._residual)
        if state_compression is not None:  # a bad spec fails here, not when serving
            if type(self).get_current_state is Averager.get_current_state:
                ids = codecs.resolve(state_compression, self.layout.shapes, self.layout.dtypes)
                lossy = [i for i in bf16 if ids[i] == codecs.INT8]
                if lossy:
                    # int8 decodes to float32 values a bfloat16 cannot hold, which `set_tensors` refuses (they
                    # look like a float32 peer's state): every download from this peer would fail
                    raise ValueError(f"state_compression int8 for bfloat16 tensor(s) {lossy}: a newcomer would refuse "
                                     "the values it decodes (a bfloat16 cannot hold them exactly). Use bf16 (the "
                                     "default for bfloat16 tensors: exact, half the bytes of float32) or fp16")
            elif isinstance(state_compression, str):
                codecs.check_name(state_compression)
            elif isinstance(state_compression, (list, tuple)):
                # a subclass serves more tensors than it averages (`get_current_state`): their count
                # is known only when it serves, so only the names are checked here
                for name in state_compression:
                    codecs.check_name(name)
        if state_compression is None and bf16 and type(self).get_current_state is Averager.get_current_state:
            # a bfloat16 tensor's state is its float32 mirror: bf16 carries those values exactly, in half the bytes
            state_compression = {i: "bf16" for i in bf16}
        self._state_compression = state_compression
        self._in_place = (bool(in_place) and len(self._arrays) == 1 and self.averaging_alpha == 1.0
                          and self._arrays[0].dtype == self.layout.dtype and self._residual is None
                          and self._staging is None)
        if config is None and prefix is None:
            raise TypeError("Averager needs a prefix (or a whole NodeConfig as config=)")
        if client_mode:
            bandwidth = 0.0  # peers cannot send a client parts of a span: it reduces none
        self.config = config if config is not None else NodeConfig(
            prefix=prefix, target_group_size=target_group_size, min_group_size=min_group_size,
            matchmaking_time=matchmaking_time, request_timeout=request_timeout,
            part_size_bytes=part_size_bytes, part_timeout=part_timeout, allreduce_timeout=allreduce_timeout,
            gossip_interval=gossip_interval, peer_timeout=peer_timeout, bandwidth=bandwidth,
            grid=() if _is_auto(grid) else _grid_shape(grid), grid_auto=_is_auto(grid),
            grid_coords=tuple(grid_coords) if grid_coords is not None else None,
            state_chunk_bytes=state_chunk_bytes, state_donors=state_donors,
            part_timeout_floor=part_timeout_floor, deadline_slack=deadline_slack,
        )
        if client_mode and self.config.bandwidth:
            self.config = dataclasses.replace(self.config, bandwidth=0.0)
        self.client_mode = client_mode
        self.auxiliary = bool(auxiliary)
        if self.auxiliary and client_mode:
            raise ValueError("an auxiliary peer lends its bandwidth to reduce spans, which a client (it accepts no "
                             "connection) cannot do")
        part_size_bytes, chunk_bytes = self.config.part_size_bytes, self.config.state_chunk_bytes
        # a state chunk travels in one frame too: past the limit, libzmq cut the connection at every
        # chunk and downloads failed as "stalled with 1 chunks owed"
        frame_limit = max_message_bytes or max(64 << 20, part_size_bytes + (1 << 16), chunk_bytes)
        if transport is None and part_size_bytes > frame_limit:
            raise ValueError("part_size_bytes exceeds max_message_bytes: peers would drop every part")
        if transport is None and chunk_bytes > frame_limit:  # only tensors past the limit fail: warned, not refused
            log.warning("state_chunk_bytes (%d) exceeds max_message_bytes (%d): a state download of a tensor larger "
                        "than %d bytes will fail (peers cut the connection at its chunks); raise max_message_bytes "
                        "or lower state_chunk_bytes (on every peer: it is part of the state hash)", chunk_bytes,
                        frame_limit, frame_limit)
        self._rng = np.random.default_rng(seed)
        self.peer_id = self._rng.bytes(8).hex() if keys is None else keys.peer_id
        #: this peer's public key (Z85) when it has keys: others name it as ``ENDPOINT#KEY``
        self.public_key: str | None = None if keys is None else keys.public
        self._allowed = allowed
        if transport is None:
            from .zmq_driver import ZmqTransport  # pyzmq is loaded only when a ZeroMQ transport is made

            transport = ZmqTransport(listen or "", limits=wire.WireLimits(max_frame_bytes=frame_limit),
                                     announce_host=announce_host, local_ipc=local_ipc, initial_peers=initial_peers,
                                     keys=keys, allowed=allowed, peer_keys=peer_keys, client_mode=client_mode)
        self._transport = transport
        self._clock = clock = transport.clock
        self._lock = clock.lock(reentrant=True)
        self._inside = clock.local()  # set while the calling thread is inside get_tensors()
        self._buffer: np.ndarray | None = None
        # step id -> (future, snapshot buffer or None when averaged in place, time step() was entered)
        self._futures: dict[str, tuple[cf.Future, np.ndarray | None, float]] = {}
        self._busy = clock.lock()  # held from step() until its result is applied
        self._seq = itertools.count(1)
        self._closed = False
        self._applier = clock.executor("zgossip-apply")
        # serving our state to a downloader copies it under the tensor lock: its own worker, so a
        # large state never delays writing back a finished round
        self._server = clock.executor("zgossip-serve")
        self._steps_begun = 0
        self._published: tuple[int, int] | None = None  # (version, steps begun) of the last publish_state
        self._downloads: dict[str, cf.Future] = {}
        # an auxiliary peer's tensors only give the layout: serving them would hand newcomers zeros
        self._allow_sharing = (not self.auxiliary) if allow_state_sharing is None else bool(allow_state_sharing)
        self._priority = float(state_sharing_priority)
        #: every finished step, for monitoring (`zgossip.steplog.StepLog`: recent records, totals, listeners)
        self.step_log = StepLog(clock.lock())
        self._metrics: Any = None
        transport.start(self.peer_id, self._make_node(tuple(initial_peers)), self)
        self.endpoint = transport.endpoint
        if self._allow_sharing:  # a node starts not sharing: nothing to declare otherwise
            self._declare_sharing()
        if metrics_port is not None:
            from .metrics import MetricsServer  # an HTTP thread: loaded only when asked for

            try:
                self._metrics = MetricsServer(self, metrics_host, int(metrics_port))
            except BaseException:
                self._shutdown(1.0, deliver=False)
                raise

    @property
    def metrics_endpoint(self) -> str | None:
        """Where the Prometheus metrics are served (``http://HOST:PORT/metrics``), or None."""
        return None if self._metrics is None else self._metrics.url

    def _make_node(self, initial_peers: tuple[str, ...]) -> Any:
        def make(endpoint: str, membership: Any = None) -> Node:
            node = Node(self.peer_id, endpoint, self.config, self._rng, initial_peers, membership=membership)
            if self._allowed is not None and membership is None:
                node.membership.admit = self._allowed.__contains__  # gossip never enters a key not allowed
            return node

        return make

    def allow(self, public_key: str) -> None:
        """Accept this public key from now on (keys only)."""
        if self._allowed is None:
            raise ValueError("this averager has no keys")
        self._allowed.allow(public_key)

    def revoke(self, public_key: str, timeout: float = 5.0) -> None:
        """Stop accepting this public key: its messages are dropped from now on, it is forgotten,
        and new connections with it are refused (keys only)."""
        if self._allowed is None:
            raise ValueError("this averager has no keys")
        self._allowed.revoke(public_key)
        pid = peer_id_of(public_key)
        if self._closed:  # shut down: no membership left to forget it from
            return

        def forget(node: Node, now: float) -> None:
            if pid in node.membership.peers:
                node.membership.forget(pid, now)

        self._transport.run_on_io(forget, timeout)

    @property
    def clock(self) -> Any:
        """The `zgossip.clock.Clock` this averager (and whatever trains on it) takes its time from."""
        return self._clock

    @property
    def transport(self) -> Transport:
        return self._transport

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list]:
        """The averaged tensors; the averager does not write them while you are inside."""
        with self._lock:
            self._inside.active = getattr(self._inside, "active", 0) + 1
            try:
                yield self._tensors
            finally:
                self._inside.active -= 1

    def step(self, weight: float = 1.0, gather: Any = None, timeout: float | None = None,
             wait: bool = True, round: int | None = None, scheduled_time: float | None = None,
             require_trigger: bool = False) -> StepResult | StepFuture:
        """Find a group and average with it once.

        ``timeout`` bounds matchmaking (default ``max(5, 3*matchmaking_time)`` seconds); the
        all-reduce itself is bounded by ``allreduce_timeout``, and the whole call returns within
        ``timeout + allreduce_timeout + 1`` seconds (`result.timings["total"]` is its wall time). Raises `GroupNotFound`
        (with what was tried), `RoundTimeout`, `StepInProgress` or `AveragerClosed`; with
        ``wait=False`` returns a `concurrent.futures.Future` that carries the same.
        ``round`` pins the swarm-wide round number (which picks the Moshpit grid axis), e.g.
        a training epoch; by default the averager follows the highest round its peers announce.

        Arguments are checked here (ValueError / TypeError, nothing queued): ``weight`` finite, > 0,
        at most ``messages.MAX_WEIGHT`` (1e30); ``timeout`` finite, in [0, `MAX_STEP_TIMEOUT`]
        seconds; ``round`` None or an int in [0, 2**62); ``gather`` as `wire.check_gather` takes
        it (msgpack scalars, lists, dicts with str keys, <= 64 KiB packed; numpy / torch scalars
        become Python ones, and ``result.gathered`` holds what the peers decoded).

        Scheduled steps (``scheduled_time`` and/or ``require_trigger``; see README, "Step control"):
        ``scheduled_time`` is a finite number on this averager's ``clock.now()`` scale (for ZeroMQ
        ``time.monotonic()``, not ``time.time()``: an hour or more ahead is refused). Matchmaking begins ``matchmaking_time`` before
        it (at once if that is past); the tensors are snapshotted and the all-reduce begins when the
        returned control is `trigger`-ed, or at ``scheduled_time`` unless ``require_trigger`` (then
        only on trigger), and never before a group formed. ``timeout`` then bounds matchmaking plus
        the wait for the trigger, from when matchmaking begins. With ``wait=True`` this returns
        the result; otherwise the `StepControl`.
        """
        clock = self._clock
        entered = clock.now()
        if self._closed:
            raise AveragerClosed("this averager was shut down")
        if wait and getattr(self._inside, "active", 0):
            raise ZGossipError("step(wait=True) inside get_tensors() would deadlock: the averaged tensors "
                               "are written under that lock; leave the block first or use wait=False")
        # every argument is checked here, in the caller: a value the wire refuses would otherwise
        # fail on the I/O thread when the round sends it, far from the call (or never end the step)
        weight = 0.0 if self.auxiliary else check_weight(weight)  # an auxiliary peer contributes no data
        gather = wire.check_gather(gather)
        timeout = self._check_timeout(timeout)
        round = _check_round(round)
        if scheduled_time is not None or require_trigger:
            return self._step_held(weight, gather, timeout, wait, round, scheduled_time, bool(require_trigger),
                                   entered)
        if not self._busy.acquire(blocking=False):
            raise StepInProgress("the previous step of this averager is still running; wait for it first")
        in_place = wait and self._in_place
        try:
            if in_place:
                # the round reads and writes the user's tensor itself: hold the tensor lock until it is over
                self._lock.acquire()
                self.layout.check(self._arrays)
                buf = self._arrays[0].reshape(-1)
            else:
                with self._lock:
                    self.layout.check(self._arrays)
                    if self._buffer is None or self._transport.sends_pending():
                        # a buffer still referenced by an unsent zero-copy frame must not be overwritten
                        self._buffer = self.layout.new_buffer()
                    self._pull()
                    buf = self.layout.snapshot(self._arrays, self._buffer)
                    if self._residual is not None:
                        buf += self._residual
            step_id = f"{self.peer_id[:8]}-{next(self._seq)}"
            self._steps_begun += 1  # the tensors may change: a repair to the published version is stale
            fut: cf.Future = StepFuture(self, step_id)
            self._futures[step_id] = (fut, None if in_place else buf, entered)
            # the node times the step from when it gets it: what the snapshot took is already spent
            left = max(0.0, float(timeout) - (clock.now() - entered))
            req = StepRequest(step_id, buf, weight, gather, left, self.layout.fingerprint,
                              round, self.layout.description, self._codec)
            self._transport.call(lambda now: self._transport.node.submit_step(req, now))
        except BaseException:
            self._busy.release()
            if in_place:
                self._lock.release()
            raise
        if not wait:
            return fut
        # The node ends the round by itself `timeout + allreduce_timeout` after the step began
        # (Node.step_deadline); this wait is only a safety net for a stuck I/O thread.
        end = entered + timeout + self.config.allreduce_timeout + _SLACK
        result = None
        try:
            result = clock.result(fut, max(0.0, end - clock.now()))
            return result
        except cf.TimeoutError:
            self._cancel(step_id, settle=in_place)
            err = RoundTimeout(f"step did not finish within {end - entered:.1f}s")
            self.step_log.record_failure(step_id, err, clock.now())
            raise err from None
        except BaseException:
            if in_place and not fut.done():
                self._cancel(step_id, settle=True)
            raise
        finally:
            if in_place:
                try:
                    # parts of the tensor still queued for a slow or dead peer must not leave after
                    # the caller changes the tensor: wait for them (at most part_timeout, and never
                    # past the step's bound), then drop them
                    t0 = clock.now()
                    self._transport.settle_sends(min(self.config.part_timeout, max(0.0, end - t0)),
                                                 release_timeout=_SLACK,
                                                 group_id=None if result is None else result.group_id)
                    if result is not None:
                        result.timings["settle"] = clock.now() - t0
                        result.timings["total"] = clock.now() - entered
                finally:
                    self._lock.release()
                if result is not None:
                    self.step_log.record_result(step_id, result, clock.now())

    def _check_timeout(self, timeout: float | None) -> float:
        """`step`'s ``timeout`` as seconds (None: the default), or ValueError."""
        if timeout is None:
            return max(5.0, 3 * self.config.matchmaking_time)
        if isinstance(timeout, (bool, str, bytes)):  # as scheduled_time: float() would take "5" or True
            raise ValueError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
        try:
            t = float(timeout)
        except (TypeError, ValueError):
            raise ValueError(f"timeout must be a number of seconds, not {type(timeout).__name__}") from None
        if not (math.isfinite(t) and 0.0 <= t <= MAX_STEP_TIMEOUT):
            raise ValueError(f"timeout must be a finite number of seconds in [0, {MAX_STEP_TIMEOUT:g}], not {t!r} "
                             "(every wait here has a deadline; pass a large number to wait long)")
        return t

    def _step_held(self, weight: float, gather: Any, timeout: float, wait: bool, round: int | None,
                   scheduled_time: float | None, require_trigger: bool, entered: float) -> Any:
        """A scheduled / triggered step (see `step`): the node holds it, this side snapshots at trigger."""
        clock = self._clock
        begin_at = None
        if scheduled_time is not None:
            if isinstance(scheduled_time, (bool, str)):
                raise ValueError(f"scheduled_time must be a number of seconds on clock.now()'s scale, not "
                                 f"{type(scheduled_time).__name__}")
            try:
                scheduled_time = float(scheduled_time)
            except (TypeError, ValueError):
                raise ValueError(f"scheduled_time must be a number of seconds on clock.now()'s scale, not "
                                 f"{type(scheduled_time).__name__}") from None
            if not math.isfinite(scheduled_time):
                raise ValueError(f"scheduled_time must be finite, not {scheduled_time!r}: pass averager.clock.now() "
                                 "+ delay (a time in the past starts matchmaking at once)")
            if not scheduled_time - entered < 3600.0:
                raise ValueError(f"scheduled_time is {scheduled_time - entered:.0f}s from now: it is read on this "
                                 "averager's clock.now() scale (monotonic), not time.time(); pass "
                                 "averager.clock.now() + delay")
            begin_at = scheduled_time - self.config.matchmaking_time
        if not self._busy.acquire(blocking=False):
            raise StepInProgress("the previous step of this averager is still running; wait for it first")
        try:
            with self._lock:
                self.layout.check(self._arrays)
            step_id = f"{self.peer_id[:8]}-{next(self._seq)}"
            fut = StepFuture(self, step_id, held=True, weight=weight, gather=gather, scheduled_time=scheduled_time,
                             waits=begin_at is not None and begin_at > clock.now())
            self._futures[step_id] = (fut, None, entered)
            req = StepRequest(step_id, None, weight, gather, timeout, self.layout.fingerprint,
                              round, self.layout.description, self._codec, held=True,
                              begin_at=begin_at, due_at=None if require_trigger else scheduled_time)
            self._transport.call(lambda now: self._transport.node.submit_step(req, now))
        except BaseException:
            self._futures.pop(locals().get("step_id", ""), None)
            self._busy.release()
            raise
        if not wait:
            return fut
        begins = max(entered, begin_at if begin_at is not None else entered)
        end = begins + timeout + self.config.allreduce_timeout + _SLACK
        try:
            return clock.result(fut, max(0.0, end - clock.now()))
        except cf.TimeoutError:
            self._cancel(step_id, settle=False)
            err = RoundTimeout(f"step did not finish within {end - entered:.1f}s")
            self.step_log.record_failure(step_id, err, clock.now())
            raise err from None

    def _trigger(self, ctl: StepFuture) -> None:
        """For `StepFuture.trigger` (under its lock): snapshot the tensors and hand them to the node."""
        step_id = ctl.step_id
        if self._closed or step_id not in self._futures:
            return
        with self._lock:
            try:
                self.layout.check(self._arrays)
            except ValueError as e:
                self._cancel(step_id, settle=False)
                _settle_future(ctl, error=ZGossipError(f"could not snapshot the tensors: {e}"))
                return
            if self._buffer is None or self._transport.sends_pending():
                self._buffer = self.layout.new_buffer()  # never overwrite bytes a zero-copy frame still lends
            self._pull()
            buf = self.layout.snapshot(self._arrays, self._buffer)
            if self._residual is not None:
                buf += self._residual
        weight = 0.0 if self.auxiliary else ctl.weight

        def hand_over(now: float) -> None:
            entry = self._futures.get(step_id)
            if entry is None:  # it ended (failed, cancelled) meanwhile: nothing to start
                return
            self._futures[step_id] = (entry[0], buf, entry[2])
            self._transport.node.trigger_step(step_id, buf, weight, ctl.gather, now)

        try:
            self._transport.call(hand_over)
        except RuntimeError:  # shut down meanwhile: the step fails with AveragerClosed
            pass

    def _fire_due(self, step_id: str) -> None:
        entry = self._futures.get(step_id)
        if entry is not None and isinstance(entry[0], StepFuture):
            entry[0].trigger()

    def _drop_matchmaking(self, step_id: str) -> bool:
        """For `StepFuture.cancel`: drop the step if it is still matchmaking; True if it was dropped
        (the future then belongs to the caller alone: nothing sets its result any more)."""
        def drop(node: Node, now: float) -> bool:
            entry = self._futures.get(step_id)
            if entry is None or not node.cancel_matchmaking(step_id, now, "cancelled by the caller"):
                return False
            del self._futures[step_id]  # the StepFailed the node emits finds no future
            self._release()
            return True

        try:
            return bool(self._transport.run_on_io(drop, 10.0))
        except (RuntimeError, cf.TimeoutError):  # shut down (or a stuck I/O thread): not cancelled
            return False

    def _cancel(self, step_id: str, settle: bool) -> None:
        """Drop the step on the I/O thread; with `settle`, wait (bounded) until it is dropped,
        after which the round writes nothing more into the tensors."""
        dropped: cf.Future = cf.Future()

        def cancel(now: float) -> None:
            try:
                self._transport.node.cancel_step(step_id, now, "caller gave up")
            finally:
                dropped.set_result(None)

        try:
            self._transport.call(cancel)
        except RuntimeError:  # transport stopped: its thread is gone, nothing runs any more
            return
        if settle:
            try:
                self._clock.result(dropped, 10.0)
            except cf.TimeoutError:
                pass

    # ------------------------------------------------------------------ state sharing
    @property
    def allow_state_sharing(self) -> bool:
        """Whether other peers may download this peer's state (`get_current_state`)."""
        return self._allow_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        self._check_open()
        self._allow_sharing = bool(value)
        self._declare_sharing()

    @property
    def state_sharing_priority(self) -> float:
        """Downloaders prefer donors with a higher priority (e.g. a newer epoch or model version)."""
        return self._priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._check_open()
        self._priority = float(value)
        self._declare_sharing()

    def _declare_sharing(self) -> None:
        prio = self._priority if self._allow_sharing else None
        self._transport.call(lambda now: self._transport.node.set_state_sharing(prio))

    def publish_state(self, version: int) -> str:
        """Serve a snapshot of the state from now on and gossip (version, its hash) for self-repair.

        Call it at a step boundary, when every peer's shared state should be bit-identical (after
        a global average and the same optimizer step), with a version all peers agree on (the
        epoch, the step count). The snapshot (`get_current_state`, copied under the tensor lock)
        is hashed here, in the caller's thread (SHA-256 in 4 MiB chunks, ~1 GB/s); downloaders
        then get it without waiting for the tensor lock. A peer whose hash a strict majority of
        the peers at its version outvote downloads their state and writes it into its tensors,
        unless it began a step since (see `zgossip.repair`; `stats["repairs"]` counts them).
        Returns the hash (the state's root digest)."""
        if self._closed:
            raise AveragerClosed("this averager was shut down")
        if type(version) is not int or version < 0:
            raise ValueError("version must be an int >= 0")
        meta, arrays = self.get_current_state()
        snap = StateSnapshot.build(meta, [_served(a) for a in arrays], self.config.state_chunk_bytes)
        self._published = (version, self._steps_begun)
        self._transport.call(lambda now: self._transport.node.publish_state(version, snap, now))
        return snap.root

    def state_verdict(self) -> Any:
        """How the (version, hash) published last compares with the live peers' (`zgossip.repair.Verdict`),
        or None before `publish_state`."""
        return self._ask_node(lambda node: node.state_verdict())

    def get_current_state(self) -> tuple[Any, list[np.ndarray]]:
        """What a peer downloading from us receives: ``(metadata, tensors)``. Override to add
        optimizer state or metadata (any msgpack-able object). Called on a worker thread. The
        tensors are served as they are at this call: torch tensors and array views (live memory,
        such as the model's parameters) are copied; a numpy array of your own that you write
        later must be returned as a copy."""
        with self._lock:
            self._pull()
            return None, [np.array(a) for a in self._arrays]

    def load_state_from_peers(self, timeout: float | None = 60.0, chunk_timeout: float = 5.0,
                              apply: bool = True, wait: bool = True, donors: int | None = None) -> Any:
        """Download ``(metadata, tensors)`` from the best-priority peer that shares its state.

        Donors are tried in priority order (random among equals); a donor that refuses,
        stalls for `chunk_timeout`, sends a bad chunk or a wrong checksum is replaced by the
        next (one slower than `chunk_timeout` to answer the first request, which may be
        snapshotting a large state, is still awaited while it gossips, and the next is asked
        meanwhile). Nothing is written until a complete, verified state arrived. With ``apply``
        the tensors are copied into this averager's tensors, after checking every shape and
        dtype (a mismatch raises and writes nothing). Raises `StateUnavailable`. With
        ``wait=False`` returns a `concurrent.futures.Future` of the same (applied when it is set).
        ``donors``: fetch from up to this many donors holding the same state at once (default
        ``state_donors``). The metadata is what most donors of the state sent (a strict majority
        where there is one: the state's hash does not cover it; see `zgossip.state`); from a
        single donor it is that donor's word.

        Arguments are checked here (ValueError, nothing started): ``timeout`` finite seconds in
        [0, `MAX_STEP_TIMEOUT`] (None: the default, 60 s -- every wait has a deadline),
        ``chunk_timeout`` finite and > 0, ``donors`` None or an int >= 1.
        """
        if self._closed:
            raise AveragerClosed("this averager was shut down")
        # checked in the caller: the download runs on the I/O thread, where a bad value used to fail
        # as an "internal error" traceback, leaving the caller a bare TypeError
        timeout = _seconds("timeout", 60.0 if timeout is None else timeout, least=0.0)
        chunk_timeout = _seconds("chunk_timeout", chunk_timeout, least=None)
        if donors is not None and (type(donors) is not int or donors < 1):
            raise ValueError(f"donors must be None or an int >= 1, not {donors!r}")
        req = f"{self.peer_id[:8]}-s{next(self._seq)}"
        fut: cf.Future = cf.Future()
        self._downloads[req] = fut
        self._transport.call(lambda now: self._transport.node.begin_download(req, now, timeout, chunk_timeout,
                                                                             max_donors=donors))
        if not wait:  # the node ends the download by itself within `timeout`
            out: cf.Future = cf.Future()

            def finish(f: cf.Future) -> None:
                self._downloads.pop(req, None)
                if f.exception() is not None:
                    out.set_exception(f.exception())
                else:  # writing the tensors takes the tensor lock: not where the node lives
                    self._applier.submit(self._finish_download, f.result(), apply, out)

            fut.add_done_callback(finish)
            return out
        try:
            meta, arrays = self._clock.result(fut, timeout + 10.0)
        except cf.TimeoutError:
            raise StateUnavailable(f"state download did not finish within {timeout + 10:.0f}s") from None
        finally:
            self._downloads.pop(req, None)
        if apply:
            self.set_tensors(arrays)
        return meta, arrays

    def _finish_download(self, state: tuple[Any, list], apply: bool, out: cf.Future) -> None:
        try:
            if apply:
                self.set_tensors(state[1])
        except Exception as e:
            out.set_exception(e)
        else:
            out.set_result(state)

    def set_tensors(self, arrays: Sequence[np.ndarray]) -> None:
        """Overwrite the averaged tensors with `arrays` (every shape and dtype is checked before any
        write: a mismatch raises `ZGossipError` and writes nothing)."""
        arrays = [_to_numpy(a) for a in arrays]
        if len(arrays) != len(self._arrays):
            raise ZGossipError(f"state holds {len(arrays)} tensors, this averager has {len(self._arrays)}")
        for i, (src, dst) in enumerate(zip(arrays, self._arrays)):
            if tuple(src.shape) != dst.shape:
                raise ZGossipError(f"tensor {i}: peer state has shape {tuple(src.shape)}, local tensor {dst.shape}")
            if np.dtype(src.dtype) != dst.dtype:  # a silent cast could overflow (float32 70000 -> float16 inf)
                raise ZGossipError(f"tensor {i}: peer state has dtype {np.dtype(src.dtype)}, local tensor {dst.dtype}; "
                                   "nothing was written (peers sharing state must hold the same dtypes)")
            if self.layout.dtypes[i] == BF16_DTYPE and not _bf16_exact(src):
                # a bfloat16 tensor's state travels as float32: values it cannot hold come from a float32 tensor
                raise ZGossipError(f"tensor {i}: peer state holds float32 values a bfloat16 cannot hold exactly, local "
                                   "tensor bfloat16; nothing was written (peers sharing state must hold the same dtypes)")
        with self._lock:
            for src, dst in zip(arrays, self._arrays):
                np.copyto(dst, src, casting="same_kind")
            if self._staging is not None:
                self._staging.push_all(self.layout.offsets)

    def publish(self, **info: Any) -> None:
        """Gossip a small public record about this peer (at most 14 scalar entries; keys starting
        with 'zg.' are reserved), e.g. training progress; others read it with `peer_infos()` within
        a few gossip intervals. Raises ValueError here, in the caller, on a record peers would refuse."""
        self._check_open()
        record = Node.check_user_info(info)
        self._transport.call(lambda now: self._transport.node.set_info(record))

    def _check_open(self) -> None:
        if self._closed:
            raise AveragerClosed("this averager was shut down")

    def _ask_node(self, fn: Any, timeout: float = 10.0) -> Any:
        """Run ``fn(node)`` where the node lives (which owns the node's state) and return its result."""
        self._check_open()
        return self._transport.run_on_io(lambda node, now: fn(node), timeout)

    def peer_infos(self) -> dict[str, dict]:
        """The latest record every live peer published (this peer's and client-mode peers' included), by
        peer id. `peers()` lists only the peers that listen."""
        return self._ask_node(lambda node: node.peer_infos())

    def link_rates(self) -> dict[str, float | None]:
        """What this peer measured of its own link (Mbit/s; None: no sample yet): ``download``,
        ``upload`` (from its span owners' receipts; uploads shorter than 0.2 s are not measured),
        and ``estimate``, the lower of the two, which it announces and gossips (see
        `zgossip.linkstats`). Measured whatever ``bandwidth`` says; with a declared number the
        plan uses that number instead."""
        def read(node: Any) -> dict[str, float | None]:
            ls = node.linkstats
            return {"download": ls.download_mbit(), "upload": ls.upload_mbit(), "estimate": ls.estimate_mbit()}

        return self._ask_node(read)

    def bandwidth_estimates(self) -> dict[str, float]:
        """Measured link rates (Mbit/s: the lower of download and upload) by peer id: this peer's own
        and what live peers gossiped (every peer that measured one, whatever its ``bandwidth``; see
        `zgossip.linkstats`)."""
        return self._ask_node(lambda node: node.peer_bandwidths())

    def peers(self) -> list[str]:
        """Peer ids this averager currently believes alive (a snapshot, for monitoring)."""
        return self._ask_node(lambda node: list(node.membership.live_ids()))

    @property
    def stats(self) -> dict[str, int]:
        """Counters: messages received/sent, invalid (failed validation), dropped (valid but refused), ..."""
        if self._closed:
            return {**self._transport.stats}
        return self._ask_node(lambda node: {**self._transport.stats, **node.stats})

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop this peer. A step still running fails with `AveragerClosed`. First, for at most
        `shutdown_timeout` seconds, what this peer still owes others is delivered: results of its
        spans that groupmates of a recent round have not confirmed (DONE), and data libzmq still
        holds for them. Then it says goodbye (BYE) to the peers it knows, so they stop counting it
        live at once; `timeout` then bounds stopping the I/O thread."""
        self._shutdown(timeout, deliver=True)

    def _shutdown(self, timeout: float, deliver: bool) -> None:
        if self._closed:
            return
        self._closed = True
        for sid in list(self._futures):
            self._transport.call(lambda now, s=sid: self._transport.node.cancel_step(
                s, now, "averager shut down", AveragerClosed("averager shut down during the step")))
        if deliver:
            self._deliver_owed(self.shutdown_timeout)
            self._say_goodbye()
        self._transport.close(timeout)
        if self._metrics is not None:
            self._metrics.close()
        self._applier.shutdown(wait=True)
        self._server.shutdown(wait=True, cancel_futures=True)
        for fut, _, _ in self._futures.values():
            if not fut.done():
                _settle_future(fut, error=AveragerClosed("averager shut down during the step"))
        self._futures.clear()
        for dfut in list(self._downloads.values()):  # failing one runs its callback, which removes it
            if not dfut.done():
                dfut.set_exception(AveragerClosed("averager shut down during a state download"))
        if self._busy.locked():
            try:
                self._busy.release()
            except RuntimeError:
                pass

    def _say_goodbye(self) -> None:
        """Tell the peers we know that we leave (BYE), so they stop counting us live at once
        instead of after ``peer_timeout``. Best effort: a peer that misses it times us out."""
        try:
            told = self._transport.run_on_io(lambda node, now: node.leave(now), 1.0)
        except (RuntimeError, cf.TimeoutError):
            return
        if told:
            # libzmq writes from its own thread, and closing (linger 0) or exiting drops what it has
            # not written yet: a moment for the small BYEs to leave
            try:
                self._clock.sleep(_GOODBYE_WAIT)
            except RuntimeError:  # a simulated clock outside a simulated thread cannot wait: nothing to flush
                pass

    def _deliver_owed(self, timeout: float) -> bool:
        """Wait (at most `timeout`) until no groupmate waits for data of ours; True if none does."""
        clock = self._clock
        end = clock.now() + timeout
        while True:
            try:
                owed = self._transport.run_on_io(lambda node, now: node.owes_others(), max(0.1, end - clock.now()))
            except (RuntimeError, cf.TimeoutError):
                return False
            if not owed and not self._transport.sends_pending():
                return True
            if clock.now() >= end:
                log.info("zgossip node %s: shutting down with data still owed to groupmates (shutdown_timeout %.1fs)",
                         self.endpoint, timeout)
                return False
            clock.sleep(0.01)

    def __enter__(self) -> "Averager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self._shutdown(0.5, deliver=False)
        except Exception:
            pass

    # ------------------------------------------------------------------ I/O-thread callbacks
    def _serve(self, act: ServeState) -> None:
        try:
            meta, arrays = self.get_current_state()
            snap = StateSnapshot.build(meta, [_served(a) for a in arrays], self.config.state_chunk_bytes,
                                       compression=self._state_compression)
            err = ""
        except TypeError as e:
            snap, err = None, str(e)
        except Exception as e:
            log.exception("get_current_state failed")
            snap, err = None, f"donor could not produce its state: {type(e).__name__}"
        try:
            self._transport.call(lambda now: self._transport.node.serve_state(act.req, act.endpoint, snap, now, err))
        except RuntimeError:
            pass  # shutting down

    # ------------------------------------------------------------------ actions.Owner (where the node lives)
    def serve_state(self, act: ServeState) -> None:
        self._server.submit(self._serve, act)

    def download_finished(self, act: DownloadDone | DownloadFailed) -> None:
        if type(act) is DownloadDone and act.repair is not None:
            self._applier.submit(self._apply_repair, act)
            return
        dfut = self._downloads.get(act.req)
        if dfut is None or dfut.done():
            return
        if type(act) is DownloadFailed:
            dfut.set_exception(act.error)
        else:
            dfut.set_result((act.meta, act.arrays))

    def step_progress(self, act: StepProgress) -> None:
        entry = self._futures.get(act.step_id)
        if entry is None:
            return
        fut = entry[0]
        if isinstance(fut, StepFuture):
            fut._set_phase(act.phase)
        if act.due:  # scheduled time reached untriggered: snapshot (under the tensor lock) off the I/O thread
            self._applier.submit(self._fire_due, act.step_id)

    def step_finished(self, act: StepDone | StepFailed) -> None:
        entry = self._futures.pop(act.step_id, None)
        if entry is None:
            return
        fut, buf, entered = entry
        if type(act) is StepFailed:
            self.step_log.record_failure(act.step_id, act.error, self._clock.now())
            self._release()
            _settle_future(fut, error=act.error)
            return
        if buf is None:  # averaged in place: nothing to write back (step() adds settle and total)
            act.result.timings.update(settle=0.0, apply=0.0, total=self._clock.now() - entered)
            self._release()
            _settle_future(fut, result=act.result)
            return
        self._applier.submit(self._apply, act.result, fut, buf, entered)

    def _apply_repair(self, act: DownloadDone) -> None:
        version, root = act.repair
        written = False
        try:
            with self._lock:
                if self._published != (version, self._steps_begun):
                    log.warning("%s: repaired state of version %d arrived after a newer step began: not applied",
                                self.peer_id[:8], version)
                    return
                try:
                    self._write_state(act.meta, act.arrays)
                except Exception as e:
                    log.error("%s: could not write the repaired state: %s", self.peer_id[:8], e)
                    return
                written = True
            log.warning("%s: wrote the swarm's state of version %d (root %s) into this peer's tensors",
                        self.peer_id[:8], version, root[:8])
        finally:
            # the node counts it and votes with it only if it was written (`Node.repair_written`)
            if not self._closed:
                with contextlib.suppress(RuntimeError):
                    self._transport.call(lambda now: self._transport.node.repair_written(version, root, written, now))

    def _write_state(self, meta: Any, arrays: Sequence[np.ndarray]) -> None:
        """Write a repaired state (what `get_current_state` of a majority peer gave). Called under the
        tensor lock; subclasses that add optimizer state to `get_current_state` override it."""
        self.set_tensors(arrays)

    def _apply(self, result: StepResult, fut: cf.Future, buf: np.ndarray, entered: float) -> None:
        t0 = self._clock.now()
        try:
            with self._lock:
                if self.averaging_alpha != 1.0:
                    self._pull()  # moving part way starts from the tensors' current values
                self.layout.apply(self._arrays, buf, result.updated, self.averaging_alpha)
                if self._staging is not None:
                    self._staging.push(result.updated, self.layout.offsets)
        except Exception as e:  # pragma: no cover - defensive
            self._release()
            _settle_future(fut, error=ZGossipError(f"could not write the averaged tensors: {e}"))
            return
        now = self._clock.now()
        result.timings.update(settle=0.0, apply=now - t0, total=now - entered)
        step_id = fut.step_id if isinstance(fut, StepFuture) else ""
        self.step_log.record_result(step_id, result, now)
        self._release()
        _settle_future(fut, result=result)

    def _pull(self) -> None:
        """Device tensors -> their host mirrors (under the tensor lock); nothing for host tensors."""
        if self._staging is not None:
            self._staging.pull()

    def _release(self) -> None:
        try:
            self._busy.release()
        except RuntimeError:
            pass
