"""SimPy driver: the simulated `zgossip.transport.Transport`, in one `simpy.Environment`.

It is the simulated twin of `zgossip.zmq_driver` and keeps the same delivery contract
(`zgossip.transport`). Each simulated peer is a real `zgossip.Averager` on a `SimTransport`,
whose clock is the cluster's `sim.clock.VirtualClock`: the transport feeds the node, calls
`on_timer` at its next deadline and carries out its actions with `zgossip.actions.execute`
(the executor the ZeroMQ transport uses), sending through the `SimCluster` -- the shared
network: a `NetworkModel` (FIFO links, or TCP connections with `sim.tcp`), lanes, disconnect
notices, CPU queues. Every random draw comes from one seeded generator and events are
scheduled in a fixed order, so one seed gives one trace; `trace_hash` digests every delivery
(time, src, dst, header).

What the ZeroMQ driver does with connections is modelled too:

* **Lanes.** A message travels on the connection of its lane (`zgossip.wire.lane_of`):
  order is kept per lane, and a RESULT may overtake PART data queued before it. A PART also
  opens the lane-1 connection to its peer (`zgossip.wire.warm_lanes`), so under TCP that
  connection's handshakes run while the parts stream, as in the ZeroMQ driver.
* **Disconnect notices.** The ZeroMQ driver monitors its lane-0 DEALER to each peer it has
  sent to and calls ``node.on_peer_down`` on ``EVENT_DISCONNECTED``. A crashed process's
  kernel closes its sockets at once (FIN, or RST when unread data was waiting), which reaches
  the other end one-way latency later, and libzmq reports the disconnect on reading it: so
  each live peer that holds such a DEALER to the crashed endpoint gets the notice one-way
  latency after the crash. A paused process keeps its sockets open, and a partition breaks no
  connection within TCP's retry budget (the driver sets no ZeroMQ heartbeats, and TCP
  keepalive takes two hours), so neither produces one.
* **Disconnect actions** (the node forgot a peer) close the DEALERs to that endpoint: the
  monitor goes with them, and under TCP the connections are closed (a later message opens a
  new one, in slow start; messages not yet sent are dropped, as linger 0 does).
* **Client mode** (``add_peer(..., client=True)``; endpoint ``client://peerN``): the peer
  listens nowhere. A message to it travels only once it has sent a lane-0 message to the
  sender and that message arrived (the real ROUTER learns the route on receipt); until then it
  waits in a backlog, flushed at that arrival, as `zgossip.zmq_driver` keeps one. Replies
  share one connection (lane 0), as they do on the real client's DEALER; a client cannot reach
  another client (dropped, counted in ``unreachable``).
* **Settling sends** (TCP transfer only): `step_tensors` on one float tensor with ``alpha = 1``
  is what `Averager.step` averages in place, and that step hands the tensor back only after
  libzmq released the zero-copy parts and results it queued (``settle_sends``): it waits for
  them (at most ``part_timeout``), then closes its connections to the peers still owed data
  (what they queued is dropped). A fast peer that owes a slow one its results waits that long.
* **Departed peers.** Once a peer crashed, the cluster keeps a `Departed` in its place (its
  endpoint and identity, a few hundred bytes) instead of the peer with its node, averager and
  tables (~70 KB, found kept for every peer that ever left a long churn run): what is still
  addressed to it travels and is dropped on arrival as before, and the peer object itself lives
  on only while messages or timers in flight still refer to it.
* **CPU** (optional, `sim.cpu`): each handling of a message, timer or step start takes the
  calibrated time on a per-peer queue (and on a shared pool of cores if the scenario says so);
  the node sees the time the handling starts, as the real driver passes ``time.monotonic()``
  before calling it, and its sends leave when their encoding is done.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import gc
import hashlib
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import simpy

from zgossip import wire
from zgossip.actions import DownloadDone, DownloadFailed, StepDone, StepFailed, execute
from zgossip.averager import Averager
from zgossip.endpoints import listens, reachable
from zgossip.node import Node, NodeConfig

from .clock import VirtualClock
from .network import NetworkModel
from .tcp import TcpTransport
from .static import StaticTable, StaticView

log = logging.getLogger(__name__)


__all__ = ["SimTransport", "SimPeer", "SimCluster", "Crashed", "Departed"]


def _sim_reachable(endpoint: str) -> bool:
    """The addresses a simulated peer may be told of: ``sim://peerN``, ``client://...``, and
    ``tcp://HOST:PORT`` (some scenarios name peers so)."""
    return reachable(endpoint, ("sim", "tcp"))

#: the CPU queue of the testbed's forwarder (`sim.cpu.CpuCosts.switch_byte`); no peer endpoint looks like it
SWITCH = "<switch>"


class Crashed(Exception):
    """The simulated peer running this step crashed."""


class SimTransport:
    """One node on the simulated network: `zgossip.transport.Transport` in virtual time, plus the
    faults a process can suffer (`pause`, `resume`, `crash`)."""

    def __init__(self, cluster: "SimCluster", endpoint: str, known: Sequence["SimTransport"] = ()) -> None:
        self.cluster = cluster
        self.clock = cluster.clock
        self.endpoint_ = endpoint
        self._known = tuple(known)
        self.node: Node = None  # type: ignore[assignment]  # set by start()
        self.owner: Any = None
        self.alive = True
        self.closed = False
        self.stats = {"received": 0, "sent": 0, "resent": 0, "invalid": 0}
        self._timer_at: float | None = None
        self._timer_gen = 0
        self.crashed_at: float | None = None
        self.paused = False
        self._inbox: list[tuple[Any, float]] = []  # (handling, its CPU cost) held while paused
        self._missed_timer = False
        self._trackers: list = []  # zero-copy sends not yet released (sim.tcp messages; TCP model only)
        # those of them that are RESULTs: id(message) -> (message, receiver, payload, bytes, tag, group id),
        # what `_settle` sends again from a copy when an in-place step had to drop it
        self._results_lent: dict[int, tuple] = {}

    # --------------------------------------------------------------- Transport
    def start(self, peer_id: str, make_node: Any, owner: Any) -> None:
        cl = self.cluster
        view = None
        if cl.table is not None:
            cl.table.add(peer_id, self.endpoint_, cl.env.now)
            view = StaticView(cl.table, peer_id, self.endpoint_)
        self.owner = owner
        self.node = node = make_node(self.endpoint_, view)
        node.accept_endpoints(_sim_reachable)  # the simulated network's addresses (and tcp:// ones, as tests use)
        for other in self._known:  # pre-seeded membership, as after a converged gossip
            node.membership.observe(other.peer_id, other.endpoint, cl.env.now)
            other.node.membership.observe(peer_id, self.endpoint_, cl.env.now)
        node.start(cl.env.now)
        self.pump()

    def call(self, fn: Any) -> None:
        if self.closed:
            raise RuntimeError("driver is stopped")
        self._enter(fn)

    def run_on_io(self, fn: Any, timeout: float) -> Any:
        """Inline (the node lives in the event loop, and only the baton holder runs); with the CPU
        model this handling costs no CPU time."""
        if self.closed:
            raise RuntimeError("driver is stopped")
        out = fn(self.node, self.cluster.env.now)
        if self.alive and not self.paused:
            self.pump()
        return out

    def sends_pending(self) -> bool:
        """Whether array payloads the real driver would still lend to libzmq are on their way (TCP model)."""
        tcp = self.cluster.tcp
        return tcp is not None and any(not tcp.released(t) for t in self._trackers)

    def settle_sends(self, timeout: float, release_timeout: float = 5.0, group_id: str | None = None) -> int:
        return 0

    def close(self, timeout: float = 5.0) -> None:
        """Stop, as a process exits: whatever is still queued is lost (see `crash`)."""
        if not self.closed:
            self.closed = True
            if self.alive:
                self.crash()

    # --------------------------------------------------------------- actions.Carrier
    def transmit(self, endpoint: str, msg: wire.Message, batch: dict) -> None:
        self.stats["sent"] += 1
        self.cluster._transmit(self, endpoint, msg)

    def disconnect(self, endpoint: str) -> None:
        self.cluster._disconnect(self, endpoint)

    def connect(self, endpoint: str) -> None:
        self.cluster._connect(self, endpoint)

    # --------------------------------------------------------------- owner actions at the CPU cursor
    def step_finished(self, act: Any) -> None:
        self._report(self.owner.step_finished, act)

    def step_progress(self, act: Any) -> None:
        self._report(self.owner.step_progress, act)

    def serve_state(self, act: Any) -> None:
        self._report(self.owner.serve_state, act)

    def download_finished(self, act: Any) -> None:
        self._report(self.owner.download_finished, act)

    def _report(self, fn: Any, act: Any) -> None:
        cursor = self.cluster._cursor
        now = self.cluster.env.now
        if cursor is None or cursor <= now:
            fn(act)
        else:  # the handling that produced it is still running on the CPU
            t = self.cluster.env.timeout(cursor - now)
            t.callbacks.append(lambda _e: fn(act))

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    @property
    def endpoint(self) -> str:
        return self.endpoint_

    # --------------------------------------------------------------- driver loop
    def _enter(self, fn: Any, cost: float = 0.0) -> None:
        """Run ``fn(now)`` on the node, then carry out its actions: at once, or as a job on the
        peer's CPU queue when the cluster models CPU time (`cost` is the handling's own part)."""
        if not self.alive:
            return
        if self.paused:
            self._inbox.append((fn, cost))  # held (in socket buffers) until the process runs again
            return
        cpu = self.cluster.cpu_model
        if cpu is None:
            fn(self.cluster.env.now)
            self.pump()
        else:
            cpu.submit(self.endpoint, lambda now, fn=fn, cost=cost: self._job(fn, cost, now))

    def _job(self, fn: Any, cost: float, now: float) -> float:
        if not self.alive:
            return 0.0
        if self.paused:
            self._inbox.append((fn, cost))
            return 0.0
        cl = self.cluster
        cl._cursor = now + cost
        try:
            fn(now)
            self.pump()
            return cl._cursor - now
        finally:
            cl._cursor = None

    def pump(self) -> None:
        """Carry out the node's actions and (re)arm its timer."""
        env = self.cluster.env
        execute(self.node.take_actions(), self, self if self.owner is not None else None)
        dl = self.node.next_deadline()
        if dl is not None and (self._timer_at is None or dl < self._timer_at):
            self._timer_at = dl
            self._timer_gen += 1
            gen = self._timer_gen
            ev = env.timeout(max(0.0, dl - env.now))
            ev.callbacks.append(lambda _ev, g=gen: self._fire(g))

    def _fire(self, gen: int) -> None:
        if gen != self._timer_gen or not self.alive:
            return
        self._timer_at = None
        if self.paused:
            self._missed_timer = True  # a frozen process runs no timers; it catches up when it resumes
            return
        cpu = self.cluster.cpu_model
        self._enter(self.node.on_timer, cpu.costs.handle_msg if cpu is not None else 0.0)

    def deliver(self, msg: wire.Message, cost: float = 0.0) -> None:
        self.stats["received"] += 1
        self._enter(lambda now, msg=msg: self.node.on_message(msg, now), cost)

    def peer_down(self, endpoint: str) -> None:
        """The ZeroMQ driver's monitor saw the connection to `endpoint` drop."""
        self._enter(lambda now, ep=endpoint: self.node.on_peer_down(ep, now))

    # --------------------------------------------------------------- faults
    def pause(self) -> None:
        """Freeze the peer: it handles nothing and sends nothing until `resume`."""
        self.paused = True

    def resume(self) -> None:
        if not self.paused or not self.alive:
            return
        self.paused = False
        now = self.cluster.env.now
        inbox, self._inbox = self._inbox, []
        if self.cluster.cpu_model is not None:
            for fn, cost in inbox:
                self._enter(fn, cost)
            if self._missed_timer:
                self._missed_timer = False
                self._enter(self.node.on_timer, self.cluster.cpu_model.costs.handle_msg)
            return
        for fn, _cost in inbox:
            fn(now)
        if self._missed_timer:
            self._missed_timer = False
            self.node.on_timer(now)
        self.pump()

    def crash(self) -> None:
        """Kill the peer for good: queued messages are lost; its pending steps end as `Crashed`
        (so whoever waits on them in the simulation is not stuck; a real process would just vanish)."""
        self.alive = False
        self.crashed_at = self.cluster.env.now
        self._inbox.clear()
        self.cluster._on_crash(self)
        table = self.cluster.table
        if table is not None:  # a converged membership forgets the dead after peer_timeout
            ev = self.cluster.env.timeout(self.node.config.peer_timeout)
            ev.callbacks.append(lambda _e, pid=self.peer_id: table.remove(pid))
        self._on_crash()

    def _on_crash(self) -> None:
        """For subclasses: whoever waits on this peer learns it crashed."""


class SimPeer(SimTransport):
    """A simulated peer: its transport and the real `zgossip.Averager` running on it.

    `step_tensors` and `load_state` are ``averager.step(wait=False)`` and
    ``averager.load_state_from_peers(wait=False)`` with their futures turned into SimPy events
    (value: `StepDone` / `StepFailed`, `DownloadDone` / `DownloadFailed`), so that scenarios and
    tests can ``env.run(until=...)`` them; a crash ends them as `Crashed` (a real process would just
    vanish, but whoever waits on them in the simulation must not be stuck). Blocking code --
    ``averager.step()`` in a training loop -- runs in a simulated thread: `SimCluster.spawn`.
    """

    def __init__(self, cluster: "SimCluster", endpoint: str, known: Sequence["SimTransport"] = (),
                 tensors: Sequence[Any] | None = None) -> None:
        super().__init__(cluster, endpoint, known)
        self._has_tensors = tensors is not None
        self._events: dict[simpy.Event, str] = {}  # pending events -> step id / download id
        self.averager: Averager = None  # type: ignore[assignment]  # set by SimCluster.add_peer

    @property
    def tensors(self) -> list | None:
        return self.averager._tensors if self._has_tensors else None

    def step_tensors(self, *, weight: float = 1.0, gather: Any = None, timeout: float = 10.0,
                     round: int | None = None, scheduled_time: float | None = None) -> simpy.Event:
        """``averager.step(wait=False)`` as an event whose value is StepDone or StepFailed
        (``scheduled_time``: a scheduled step, `Averager.step`'s, on the virtual clock)."""
        if not self._has_tensors:
            raise ValueError("this peer was created without tensors")
        fut = self.averager.step(weight=weight, gather=gather, timeout=timeout, wait=False, round=round,
                                 scheduled_time=scheduled_time)
        sid = fut.step_id
        ev = self._event_of(fut, sid, lambda r: StepDone(sid, r), lambda e: StepFailed(sid, e))
        if self.cluster.tcp is None or not self.averager._in_place or scheduled_time is not None:
            return ev  # (a scheduled step works on a snapshot, never in place: no wait for sends to leave)
        # a real blocking step on one float tensor averages in place and returns only once libzmq let
        # go of the tensor's bytes (Averager.step -> settle_sends): model that wait on the TCP model
        bound_at = self.cluster.env.now + timeout + self.node.config.allreduce_timeout + 0.5
        out = self.cluster.env.event()
        ev.callbacks.append(lambda e: self._settle(out, e.value, bound_at))
        return out

    def _settle(self, out: simpy.Event, act: Any, bound_at: float) -> None:
        """Wait (at most part_timeout, never past `bound_at`) until every zero-copy send of this peer
        left -- those to members the round lost (`Node.gone`) excepted --, then drop what is still
        queued for the peers it was stuck on, as `settle_sends` does."""
        env, tcp = self.cluster.env, self.cluster.tcp
        pending = [m for m in self._trackers if not tcp.released(m)]
        self._trackers = []
        lent, self._results_lent = self._results_lent, {}
        if not pending or not self.alive:
            out.succeed(act)
            return
        gone = self.node.gone(act.result.group_id) if isinstance(act, StepDone) else frozenset()
        waited = [m for m in pending if m.token[1].endpoint not in gone]
        state = {"left": len(waited), "over": False}

        def over(_e: Any = None) -> None:
            if state["over"]:
                return
            state["over"] = True
            left = [m for m in pending if not tcp.released(m)]
            stuck = {m.token[1].endpoint: None for m in left}
            for ep in stuck:
                if self.alive:
                    self.cluster._disconnect(self, ep)
            # the RESULTs among them go again from a copy to a groupmate still owed them (ZmqTransport)
            for m in left:
                got = lent.get(id(m))
                if got is not None and got[0] is m and self.alive and self.node.still_owes(got[1].endpoint, got[5]):
                    self.stats["resent"] += 1
                    self.cluster._launch(self, got[1], 1, got[2], got[3], got[4])
            out.succeed(act)

        def one() -> None:
            state["left"] -= 1
            if state["left"] == 0:
                over()

        if not waited:
            over()
            return
        for m in waited:
            tcp.watch(m, one)
        env.timeout(min(self.node.config.part_timeout, max(0.0, bound_at - env.now))).callbacks.append(over)

    def load_state(self, *, timeout: float = 30.0, chunk_timeout: float = 1.0) -> simpy.Event:
        """Download state from the best donor; the event's value is DownloadDone or DownloadFailed."""
        fut = self.averager.load_state_from_peers(timeout, chunk_timeout, apply=False, wait=False)
        return self._event_of(fut, "", lambda r: DownloadDone("", r[0], r[1]), lambda e: DownloadFailed("", e))

    def _event_of(self, fut: cf.Future, req: str, done: Any, failed: Any) -> simpy.Event:
        ev = self.cluster.env.event()
        self._events[ev] = req

        def settle(f: cf.Future) -> None:
            if self._events.pop(ev, None) is None:
                return  # ended as Crashed already
            err = f.exception() if not f.cancelled() else cf.CancelledError()
            ev.succeed(failed(err) if err is not None else done(f.result()))

        fut.add_done_callback(settle)
        return ev

    def shutdown(self, timeout: float = 5.0) -> simpy.Event:
        """``averager.shutdown()`` in a simulated thread: a running step is dropped, the peer keeps
        serving while groupmates of a recent round may still wait for its data (at most `timeout`),
        then stops. The event fires when the peer is gone."""
        self.averager.shutdown_timeout = float(timeout)
        return self.cluster.clock.spawn(self.averager.shutdown, name=f"shutdown-{self.peer_id[:8]}").done

    def _on_crash(self) -> None:
        events, self._events = self._events, {}
        for ev, req in events.items():
            ev.succeed(StepFailed(req, Crashed(f"peer {self.peer_id[:8]} crashed")))


class Departed:
    """What the cluster keeps of a crashed peer: its endpoint and identity.

    A long churn run used to keep every departed `SimPeer` -- its node, averager, membership table
    and plans, ~70 KB each -- in `SimCluster.peers` and in the run's slots, for nothing but what may
    still be addressed to it. This stands in for it there (see the module docstring): it is never
    alive, so a message to its endpoint goes through the network model as before and is dropped on
    arrival; pausing or resuming it does nothing, as it did to the dead peer; crashing it again does
    what crashing the dead peer again did -- the disconnect notices, the static table's removal,
    and a later crash time for its messages still in flight, through a weak reference to the peer,
    which exists as long as something in flight refers to it."""

    __slots__ = ("cluster", "endpoint", "peer_id", "crashed_at", "peer_timeout", "_peer")
    alive = False
    paused = False

    def __init__(self, peer: SimTransport) -> None:
        self.cluster = peer.cluster
        self.endpoint = peer.endpoint
        self.peer_id = peer.peer_id
        self.crashed_at = peer.crashed_at
        self.peer_timeout = peer.node.config.peer_timeout
        self._peer = weakref.ref(peer)

    def pause(self) -> None:
        """A dead process does not freeze (`SimTransport.pause` on it changed nothing that is read)."""

    def resume(self) -> None:
        """Nothing to resume (`SimTransport.resume` returns at once for a dead peer)."""

    def crash(self) -> None:
        """`SimTransport.crash` of the dead peer, again (a churn departure of a slot a fault crashed)."""
        cl = self.cluster
        self.crashed_at = cl.env.now
        peer = self._peer()
        if peer is not None:  # what it sent and is still in flight is judged by its latest crash time
            peer.crashed_at = self.crashed_at
        cl._on_crash(self)
        table = cl.table
        if table is not None:
            ev = cl.env.timeout(self.peer_timeout)
            ev.callbacks.append(lambda _e, pid=self.peer_id: table.remove(pid))

    def __repr__(self) -> str:
        return f"Departed({self.endpoint}, {self.peer_id[:8]}, crashed at {self.crashed_at})"


@dataclass
class SimCluster:
    """A set of simulated peers sharing one environment, network and seed."""

    seed: int = 0
    network: NetworkModel = field(default_factory=NetworkModel)
    encode: bool = True  # pass every message through wire.encode/decode, as the real transport does
    membership: str = "gossip"  # or "static": one converged table shared by all nodes (sim.static)
    cpu: Any = None  # sim.cpu.CpuSpec: model CPU time per handling (None: handlings take no time)

    def __post_init__(self) -> None:
        self.env = simpy.Environment()
        self.clock = VirtualClock(self.env)
        self.rng = np.random.default_rng(self.seed)
        self.tcp = (TcpTransport(self.network, self.network.tcp, self.env, self.rng, self._tcp_arrive)
                    if self.network.transfer == "tcp" else None)
        self.cpu_model = None
        if self.cpu is not None:
            from .cpu import CpuModel

            self.cpu_model = CpuModel(self.env, self.cpu)
        self._cursor: float | None = None  # while a CPU job runs: when its next send is encoded
        # lane-0 DEALERs (src, dst endpoint) the ZeroMQ driver would hold, each with a disconnect
        # monitor; insertion-ordered, so notices go out in a fixed order
        self._dealers: dict[tuple[str, str], None] = {}
        # client mode: (peer, client) pairs whose reply route exists, and what waits for one
        self._routes: set[tuple[str, str]] = set()
        # (queued at, message) per (server, client): what waits for a client's first connection; it
        # expires after `endpoints.CLIENT_BACKLOG_TTL`, as in the ZeroMQ driver (counted in `unreachable`)
        self._backlog: dict[tuple[str, str], list[tuple[float, wire.Message]]] = {}
        self.unreachable = 0
        self.notices = 0
        self.peers: dict[str, SimPeer | Departed] = {}  # by endpoint; a crashed one's is a Departed
        self._trace = hashlib.blake2b(digest_size=16)
        self.delivered = 0
        self.lost = 0
        self._created = 0
        if self.membership not in ("gossip", "static"):
            raise ValueError("membership must be 'gossip' or 'static'")
        self.table = StaticTable() if self.membership == "static" else None

    def add_peer(self, config: NodeConfig, *, initial_peers: Sequence[str] = (), tensors: Sequence[Any] | None = None,
                 known: Sequence["SimPeer"] = (), endpoint: str | None = None, client: bool = False,
                 auxiliary: bool = False, compression: Any = None, error_feedback: bool = False,
                 state_compression: Any = None) -> SimPeer:
        """Start a peer. Reusing the endpoint of a crashed peer models a restarted process (a new identity).
        `client`: it accepts no connection (client mode; it reduces nothing). `compression`,
        `error_feedback`: the Averager's wire codecs (`zgossip.codecs`)."""
        idx = self._created
        self._created += 1
        endpoint = endpoint or (f"client://peer{idx}" if client else f"sim://peer{idx}")
        if not listens(endpoint):
            if self.table is not None:
                raise ValueError("client-mode peers need gossip membership, not the static table")
            import dataclasses

            config = dataclasses.replace(config, bandwidth=0.0)
        if endpoint in self.peers and self.peers[endpoint].alive:
            raise ValueError(f"{endpoint} is taken by a live peer")
        peer = SimPeer(self, endpoint, known, tensors)
        self.peers[endpoint] = peer
        # the peer's identity and protocol randomness come from (seed, idx), whatever else ran;
        # a peer without tensors (it only downloads state) gets a one-element placeholder (an averager
        # refuses tensors without elements); it never steps (`step_tensors` refuses)
        peer.averager = Averager(list(tensors) if tensors is not None else [np.zeros(1)], config=config,
                                 initial_peers=tuple(initial_peers), seed=[self.seed, idx], transport=peer,
                                 allow_state_sharing=False, auxiliary=auxiliary, compression=compression,
                                 error_feedback=error_feedback, state_compression=state_compression)
        return peer

    def spawn(self, fn: Any, *args: Any, name: str = "sim-thread") -> Any:
        """Run blocking user code (e.g. a training loop calling ``averager.step()``) as a simulated
        thread, in virtual time (`sim.clock.VirtualClock.spawn`)."""
        return self.clock.spawn(fn, *args, name=name)

    def _transmit(self, src: SimPeer, endpoint: str, msg: wire.Message) -> None:
        dst = self.peers.get(endpoint)
        if dst is None or not src.alive or src.paused:
            return
        lane = wire.lane_of(msg.type)
        gid = getattr(msg, "group_id", None) if lane == 1 else None
        warm = wire.warm_lanes(msg.type) if listens(endpoint) else ()
        if not listens(endpoint):  # a client: only on the connection it opened to src
            if not listens(src.endpoint):
                self.unreachable += 1
                return
            if (src.endpoint, endpoint) not in self._routes:
                q = self._backlog.setdefault((src.endpoint, endpoint), [])
                self._expire(q)
                if len(q) < 256:
                    q.append((self.env.now, msg.detached()))
                else:
                    self.unreachable += 1
                return
            lane = 0
        elif lane == 0:
            self._dealers[(src.endpoint, endpoint)] = None
        if self.encode:
            frames = wire.encode(msg)
            frames = [frames[0]] + [bytes(memoryview(a)) for a in frames[1:]]
            nbytes = sum(len(f) for f in frames)
            payload: Any = frames
            tag = frames[0]  # the packed header: what the trace digests
        else:
            nbytes = wire.message_nbytes(msg)
            payload = msg.detached()
            tag = repr(sorted(msg.body().items())).encode()
        if self._cursor is not None:  # CPU model: the message leaves once it is encoded
            self._cursor += self.cpu_model.costs.send(nbytes)
            if self._cursor > self.env.now:
                ev = self.env.timeout(self._cursor - self.env.now)
                ev.callbacks.append(lambda _e: self._launch(src, dst, lane, payload, nbytes, tag, bool(msg.payload),
                                                            warm, gid))
                return
        self._launch(src, dst, lane, payload, nbytes, tag, bool(msg.payload), warm, gid)

    def _expire(self, q: list) -> None:
        """Drop from a client's backlog what waited longer than the ZeroMQ driver keeps it."""
        from zgossip.endpoints import CLIENT_BACKLOG_TTL

        cutoff = self.env.now - CLIENT_BACKLOG_TTL
        k = 0
        while k < len(q) and q[k][0] < cutoff:
            k += 1
        if k:
            del q[:k]
            self.unreachable += k

    def _launch(self, src: SimPeer, dst: SimPeer, lane: int, payload: Any, nbytes: int, tag: bytes,
                zero_copy: bool = False, warm: tuple[int, ...] = (), gid: str | None = None) -> None:
        if not src.alive:
            return
        endpoint = dst.endpoint
        if self.tcp is not None:
            sb = self.network.sent_bytes
            sb[src.endpoint] = sb.get(src.endpoint, 0) + nbytes
            m = self.tcp.send(src.endpoint, endpoint, lane, nbytes, (src, dst, payload, nbytes, tag))
            if warm:
                for w in warm:  # as the ZeroMQ driver: the lanes a message of this type opens too
                    self.tcp.open(src.endpoint, endpoint, w)
            if zero_copy:  # the real driver sends array payloads zero-copy and tracks their release
                if len(src._trackers) > 256:
                    src._trackers = [t for t in src._trackers if not self.tcp.released(t)]
                    src._results_lent = {k: v for k, v in src._results_lent.items() if not self.tcp.released(v[0])}
                src._trackers.append(m)
                if lane == 1 and gid is not None:
                    src._results_lent[id(m)] = (m, dst, payload, nbytes, tag, gid)
            return
        t = self.network.send(src.endpoint, endpoint, nbytes, self.env.now, self.rng, lane)
        if t.lost:
            self.lost += 1
            return
        # two stages: the first byte reaches the receiver's downlink, which is shared in order of
        # arrival (not of sending); then the message is delivered when its last byte is in
        ev = self.env.timeout(t.first - self.env.now)
        ev.callbacks.append(lambda _e: self._at_downlink(src, dst, payload, t, nbytes, tag, lane))

    def _at_downlink(self, src: SimPeer, dst: SimPeer, payload: Any, t: Any, nbytes: int, tag: bytes,
                     lane: int = 0) -> None:
        at = self.network.receive(src.endpoint, dst.endpoint, nbytes, t, lane)
        if at <= self.env.now:
            self._arrive(src, dst, payload, t.sent, nbytes, tag)
            return
        ev = self.env.timeout(at - self.env.now)
        ev.callbacks.append(lambda _e: self._arrive(src, dst, payload, t.sent, nbytes, tag))

    def _arrive(self, src: SimPeer, dst: SimPeer, payload: Any, sent: float, nbytes: int, tag: bytes) -> None:
        if not dst.alive:
            return
        if src.crashed_at is not None and src.crashed_at < sent:
            return  # the sender died while this message still sat in its uplink queue
        if self.tcp is None and self.network.cut(src.endpoint, dst.endpoint, self.env.now):
            self.lost += 1  # a partition began while it was in flight (TCP would retransmit: see sim.tcp)
            return
        try:
            msg = wire.decode(payload) if self.encode else payload
        except wire.InvalidMessage as e:  # as the ZeroMQ driver does: counted, logged once per source, dropped
            dst.stats["invalid"] += 1
            dst.node.drops.note(log, src.endpoint, "an invalid message", str(e)[:200], counter="invalid")
            return
        if not listens(src.endpoint) and wire.lane_of(msg.type) == 0 and (dst.endpoint, src.endpoint) not in self._routes:
            self._routes.add((dst.endpoint, src.endpoint))  # dst's ROUTER now knows how to answer the client
            waiting = self._backlog.pop((dst.endpoint, src.endpoint), [])
            self._expire(waiting)
            for _, m in waiting:
                self._transmit(dst, src.endpoint, m)
        self.delivered += 1
        rb = self.network.received_bytes
        rb[dst.endpoint] = rb.get(dst.endpoint, 0) + nbytes
        self._trace.update(f"{self.env.now!r}|{src.endpoint}|{dst.endpoint}|".encode())
        self._trace.update(tag)
        cost = 0.0
        cpu = self.cpu_model
        if cpu is not None:
            cost = cpu.costs.receive(msg.type, sum(a.nbytes for a in msg.payload), nbytes)
            if cpu.costs.switch_byte > 0.0:
                # the testbed's forwarder moves the message first: one serial queue on the shared cores
                cpu.submit(SWITCH, lambda now, d=nbytes * cpu.costs.switch_byte, m=msg, c=cost: self._switched(dst, m, c, d))
                return
        dst.deliver(msg, cost)

    def _switched(self, dst: "SimPeer", msg: wire.Message, cost: float, d: float) -> float:
        self.env.timeout(d).callbacks.append(lambda _e: dst.deliver(msg, cost))
        return d

    def _tcp_arrive(self, token: Any, sent: float) -> None:
        src, dst, payload, nbytes, tag = token
        self._arrive(src, dst, payload, sent, nbytes, tag)

    # --------------------------------------------------------------- connections
    def _on_crash(self, peer: "SimPeer | Departed") -> None:
        """A process died: its kernel resets its connections, and every live peer that monitors a
        lane-0 DEALER to it hears of it one-way latency later (see the module docstring)."""
        ep = peer.endpoint
        if isinstance(peer, SimTransport) and self.peers.get(ep) is peer:
            self.peers[ep] = Departed(peer)  # what a message to it needs, not the whole peer (see Departed)
        if self.tcp is not None:
            self.tcp.reset(ep)
        for key in [k for k in self._routes if ep in k]:  # client routes die with either end's sockets
            self._routes.discard(key)
        for key in [k for k in self._backlog if ep in k]:
            del self._backlog[key]
        for key in list(self._dealers):
            src, dst = key
            if src == ep:
                del self._dealers[key]  # its own sockets died with it
            elif dst == ep:
                obs = self.peers.get(src)
                if obs is None or not obs.alive:
                    continue
                delay = self.network.base_latency(ep, src, self.rng)
                ev = self.env.timeout(delay)
                ev.callbacks.append(lambda _e, obs=obs: self._notice(obs, ep))

    def _notice(self, obs: SimPeer, endpoint: str) -> None:
        if obs.alive and self.peers.get(obs.endpoint) is obs:
            self.notices += 1
            obs.peer_down(endpoint)

    def _connect(self, src: SimPeer, endpoint: str) -> None:
        """The node met `endpoint` (`Connect`): the driver opens its lane-0 DEALER (with its disconnect
        monitor) now; under TCP the connection's handshakes start."""
        dst = self.peers.get(endpoint)
        if dst is None or not src.alive or src.paused or not listens(endpoint):
            return
        self._dealers[(src.endpoint, endpoint)] = None
        if self.tcp is not None:
            self.tcp.open(src.endpoint, endpoint, 0)

    def _disconnect(self, src: SimPeer, endpoint: str) -> None:
        """The node forgot `endpoint`: the driver closes its DEALERs (and their monitor) to it."""
        self._dealers.pop((src.endpoint, endpoint), None)
        if self.tcp is not None:
            self.tcp.close(src.endpoint, endpoint)

    @property
    def trace_hash(self) -> str:
        return self._trace.hexdigest()

    def run(self, until: float | simpy.Event | None = None) -> None:
        with gc_frozen():
            self.env.run(until=until)

    def close(self) -> None:
        """Done with this simulation: end the OS threads its simulated threads ran on (`VirtualClock.close`),
        which otherwise keep every peer and tensor of it in memory for the life of the process."""
        self.clock.close()


_gc_lock = threading.Lock()
_gc_users = 0  # simulations running now, in any thread (a sweep may run several at once)
_gc_froze = False  # whether the first of them froze (and the last must unfreeze)


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """While simulations run, keep what existed before out of the cyclic collector's sight.

    A large simulation holds hundreds of thousands of long-lived objects (peers, tables, plans), and
    CPython's full collections, triggered by the allocations of every message, scan them all: 20 full
    collections cost 4.8 s of a 15 s three-round run of the 1,024-peer bench. `gc.freeze` moves the
    objects alive now to the permanent generation (O(1)), so collections meanwhile scan only what was
    created since (cycles among those are collected as usual); `gc.unfreeze` hands them back when the
    last simulation running ends. Left alone when the collector is off, or when someone else froze
    objects already (a forking server, say): their freeze is theirs to undo."""
    global _gc_users, _gc_froze
    with _gc_lock:
        _gc_users += 1
        if _gc_users == 1:
            _gc_froze = gc.isenabled() and gc.get_freeze_count() == 0
            if _gc_froze:
                gc.freeze()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0 and _gc_froze:
                _gc_froze = False
                gc.unfreeze()
