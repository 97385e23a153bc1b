"""SimPy driver: runs `zgossip.node.Node` objects in one `simpy.Environment`, in virtual time.

It is the simulated twin of `zgossip.zmq_driver`: it carries out the node's `Send`
actions through a `NetworkModel` (FIFO links, or TCP connections with `sim.tcp`), calls
`on_timer` at the node's next deadline and collects `StepDone` / `StepFailed`. Every
random draw comes from one seeded generator and events are scheduled in a fixed order, so
one seed gives one trace; `trace_hash` digests every delivery (time, src, dst, header).

What the ZeroMQ driver does with connections is modelled too:

* **Lanes.** A message travels on the connection of its lane (`zgossip.wire.lane_of`):
  order is kept per lane, and a RESULT may overtake PART data queued before it.
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
* **Settling sends** (TCP transfer only): `step_tensors` on one float tensor with ``alpha = 1``
  is what `Averager.step` averages in place, and that step hands the tensor back only after
  libzmq released the zero-copy parts and results it queued (``settle_sends``): it waits for
  them (at most ``part_timeout``), then closes its connections to the peers still owed data
  (what they queued is dropped). A fast peer that owes a slow one its results waits that long.
* **CPU** (optional, `sim.cpu`): each handling of a message, timer or step start takes the
  calibrated time on a per-peer queue (and on a shared pool of cores if the scenario says so);
  the node sees the time the handling starts, as the real driver passes ``time.monotonic()``
  before calling it, and its sends leave when their encoding is done.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import simpy

from zgossip import wire
from zgossip.node import (Disconnect, DownloadDone, DownloadFailed, Node, NodeConfig, Send, ServeState, StepDone,
                          StepFailed, StepRequest, StepResult)
from zgossip.tensors import FlatLayout

from .network import NetworkModel
from .tcp import TcpTransport
from .static import StaticTable, StaticView

__all__ = ["SimPeer", "SimCluster", "Crashed"]


class Crashed(Exception):
    """The simulated peer running this step crashed."""


class SimPeer:
    """One simulated peer: a protocol node plus its tensors."""

    def __init__(self, cluster: "SimCluster", node: Node, tensors: Sequence[Any] | None) -> None:
        self.cluster = cluster
        self.node = node
        self.alive = True
        self.tensors = list(tensors) if tensors is not None else None
        self._timer_at: float | None = None
        self._timer_gen = 0
        self._waiters: dict[str, simpy.Event] = {}
        self._step_seq = 0
        self.crashed_at: float | None = None
        self.paused = False
        self._inbox: list[tuple[Any, float]] = []  # (handling, its CPU cost) held while paused
        self._missed_timer = False
        self.state_provider: Any = None  # callable -> (metadata, arrays); default: copies of `tensors`
        self._trackers: list = []  # zero-copy sends not yet released (sim.tcp trackers)
        self._inplace: dict[str, float] = {}  # step id -> the Averager's bound on the step (for settling)

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    @property
    def endpoint(self) -> str:
        return self.node.endpoint

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

    def _finish(self, ev: simpy.Event, act: Any) -> None:
        cursor = self.cluster._cursor
        now = self.cluster.env.now
        end = self._inplace.pop(getattr(act, "step_id", None), None)
        if end is not None and self.cluster.tcp is not None:
            done = lambda: self._settle(ev, act, end)  # noqa: E731
        else:
            done = lambda: ev.succeed(act)  # noqa: E731
        if cursor is None or cursor <= now:
            done()
        else:  # the handling that ended the step is still running on the CPU
            t = self.cluster.env.timeout(cursor - now)
            t.callbacks.append(lambda _e: done())

    def _settle(self, ev: simpy.Event, act: Any, end: float) -> None:
        """`Averager.step` in place: wait (at most part_timeout, never past `end`) until every
        zero-copy send is released, then drop what is still queued (see the module docstring)."""
        env = self.cluster.env
        tcp = self.cluster.tcp
        pending = [m for m in self._trackers if not tcp.released(m)]
        self._trackers = []
        if not pending:
            ev.succeed(act)
            return
        state = {"left": len(pending), "over": False}

        def over(_e: Any = None) -> None:
            if state["over"]:
                return
            state["over"] = True
            stuck = {m.token[1].endpoint: None for m in pending if not tcp.released(m)}
            for ep in stuck:
                if self.alive:
                    self.cluster._disconnect(self, ep)
            ev.succeed(act)

        def one() -> None:
            state["left"] -= 1
            if state["left"] == 0:
                over()

        for m in pending:
            tcp.watch(m, one)
        bound = min(self.node.config.part_timeout, max(0.0, end - env.now))
        env.timeout(bound).callbacks.append(over)

    def pump(self) -> None:
        """Carry out the node's actions and (re)arm its timer."""
        env = self.cluster.env
        for act in self.node.take_actions():
            if isinstance(act, Send):
                self.cluster._transmit(self, act.endpoint, act.msg)
            elif isinstance(act, (StepDone, StepFailed)):
                ev = self._waiters.pop(act.step_id, None)
                if ev is not None:
                    self._finish(ev, act)
            elif isinstance(act, (DownloadDone, DownloadFailed)):
                ev = self._waiters.pop(act.req, None)
                if ev is not None:
                    self._finish(ev, act)
            elif isinstance(act, ServeState):
                # a donor answers from its current tensors (or `state_provider`), like Averager.get_current_state
                if self.state_provider is not None:
                    meta, arrays = self.state_provider()
                else:
                    meta, arrays = None, [np.array(t) for t in (self.tensors or [])]
                self.node.serve_state(act.req, act.endpoint, meta, arrays, env.now)
                self.pump()
            elif isinstance(act, Disconnect):
                self.cluster._disconnect(self, act.endpoint)
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

    # --------------------------------------------------------------- user side
    def step(self, buffer: np.ndarray, *, weight: float = 1.0, gather: Any = None,
             timeout: float = 10.0, layout: str = "", round: int | None = None) -> simpy.Event:
        """Start a step on a flat buffer; the returned event's value is StepDone or StepFailed."""
        self._step_seq += 1
        step_id = f"{self.peer_id[:8]}-{self._step_seq}"
        ev = self.cluster.env.event()
        self._waiters[step_id] = ev
        layout = layout or f"{buffer.size}:{buffer.dtype.str}"
        req = StepRequest(step_id, buffer, weight, gather, timeout, layout, round)
        self._enter(lambda now: self.node.submit_step(req, now))
        return ev

    def step_tensors(self, *, weight: float = 1.0, gather: Any = None, timeout: float = 10.0,
                     alpha: float = 1.0, round: int | None = None) -> simpy.Event:
        """Like `zgossip.Averager.step`: snapshot this peer's tensors, average, write back the averaged ranges."""
        if self.tensors is None:
            raise ValueError("this peer was created without tensors")
        layout = FlatLayout.of(self.tensors)
        arrays = [np.asarray(t) for t in self.tensors]
        buf = layout.snapshot(arrays, layout.new_buffer())
        ev = self.step(buf, weight=weight, gather=gather, timeout=timeout, layout=layout.fingerprint, round=round)
        if len(arrays) == 1 and alpha == 1.0 and arrays[0].dtype.kind == "f":  # Averager.step in place
            self._inplace[f"{self.peer_id[:8]}-{self._step_seq}"] = (
                self.cluster.env.now + timeout + self.node.config.allreduce_timeout + 0.5)

        def apply(e: simpy.Event) -> None:
            if isinstance(e.value, StepDone):
                layout.apply(arrays, buf, e.value.result.updated, alpha)

        ev.callbacks.insert(0, apply)
        return ev

    def load_state(self, *, timeout: float = 30.0, chunk_timeout: float = 1.0) -> simpy.Event:
        """Download state from the best donor; the event's value is DownloadDone or DownloadFailed."""
        self._step_seq += 1
        req = f"{self.peer_id[:8]}-s{self._step_seq}"
        ev = self.cluster.env.event()
        self._waiters[req] = ev
        self._enter(lambda now: self.node.begin_download(req, now, timeout, chunk_timeout))
        return ev

    def shutdown(self, timeout: float = 5.0, poll: float = 0.001) -> simpy.Event:
        """Like `zgossip.Averager.shutdown`: drop a running step, keep running while groupmates of a
        recent round may still wait for our data (`Node.owes_others`, at most `timeout`), then stop
        (as `crash` does: whatever is still queued is lost). The event fires when the peer is gone."""
        env = self.cluster.env
        st = self.node.step
        if st is not None:
            self.node.cancel_step(st.req.step_id, env.now, "peer shut down")
            self.pump()

        def run() -> Any:
            end = env.now + timeout
            while self.alive and self.node.owes_others() and env.now < end:
                yield env.timeout(min(poll, end - env.now))
            self.crash()

        return env.process(run())

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
        waiters, self._waiters = self._waiters, {}
        for req, ev in waiters.items():
            ev.succeed(StepFailed(req, Crashed(f"peer {self.peer_id[:8]} crashed")))


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
        self.notices = 0
        self.peers: dict[str, SimPeer] = {}
        self._trace = hashlib.blake2b(digest_size=16)
        self.delivered = 0
        self.lost = 0
        self._created = 0
        if self.membership not in ("gossip", "static"):
            raise ValueError("membership must be 'gossip' or 'static'")
        self.table = StaticTable() if self.membership == "static" else None

    def add_peer(self, config: NodeConfig, *, initial_peers: Sequence[str] = (), tensors: Sequence[Any] | None = None,
                 known: Sequence["SimPeer"] = (), endpoint: str | None = None) -> SimPeer:
        """Start a peer. Reusing the endpoint of a crashed peer models a restarted process (a new identity)."""
        idx = self._created
        self._created += 1
        endpoint = endpoint or f"sim://peer{idx}"
        if endpoint in self.peers and self.peers[endpoint].alive:
            raise ValueError(f"{endpoint} is taken by a live peer")
        peer_rng = np.random.default_rng([self.seed, idx])
        peer_id = peer_rng.bytes(8).hex()
        view = None
        if self.table is not None:
            self.table.add(peer_id, endpoint, self.env.now)
            view = StaticView(self.table, peer_id, endpoint)
        node = Node(peer_id, endpoint, config, peer_rng, tuple(initial_peers), membership=view)
        for other in known:  # pre-seeded membership, as after a converged gossip
            node.membership.observe(other.peer_id, other.endpoint, self.env.now)
            other.node.membership.observe(peer_id, endpoint, self.env.now)
        peer = SimPeer(self, node, tensors)
        self.peers[endpoint] = peer
        node.start(self.env.now)
        peer.pump()
        return peer

    def _transmit(self, src: SimPeer, endpoint: str, msg: wire.Message) -> None:
        dst = self.peers.get(endpoint)
        if dst is None or not src.alive or src.paused:
            return
        lane = wire.lane_of(msg.type)
        if lane == 0:
            self._dealers[(src.endpoint, endpoint)] = None
        if self.encode:
            frames = wire.encode(msg)
            frames = [frames[0]] + [bytes(memoryview(a)) for a in frames[1:]]
            nbytes = sum(len(f) for f in frames)
            payload: Any = frames
            tag = frames[0]  # the packed header: what the trace digests
        else:
            nbytes = wire.message_nbytes(msg)
            payload = wire.Message._trusted(msg.type, msg.sender, msg.endpoint, msg.body,
                                            tuple(a.copy() for a in msg.payload))
            tag = repr(sorted(msg.body.items())).encode()
        if self._cursor is not None:  # CPU model: the message leaves once it is encoded
            self._cursor += self.cpu_model.costs.send(nbytes)
            if self._cursor > self.env.now:
                ev = self.env.timeout(self._cursor - self.env.now)
                ev.callbacks.append(lambda _e: self._launch(src, dst, lane, payload, nbytes, tag, bool(msg.payload)))
                return
        self._launch(src, dst, lane, payload, nbytes, tag, bool(msg.payload))

    def _launch(self, src: SimPeer, dst: SimPeer, lane: int, payload: Any, nbytes: int, tag: bytes,
                zero_copy: bool = False) -> None:
        if not src.alive:
            return
        endpoint = dst.endpoint
        if self.tcp is not None:
            sb = self.network.sent_bytes
            sb[src.endpoint] = sb.get(src.endpoint, 0) + nbytes
            m = self.tcp.send(src.endpoint, endpoint, lane, nbytes, (src, dst, payload, nbytes, tag))
            if zero_copy:  # the real driver sends array payloads zero-copy and tracks their release
                src._trackers = [t for t in src._trackers if not self.tcp.released(t)] if len(src._trackers) > 256 \
                    else src._trackers
                src._trackers.append(m)
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
        msg = wire.decode(payload) if self.encode else payload
        self.delivered += 1
        rb = self.network.received_bytes
        rb[dst.endpoint] = rb.get(dst.endpoint, 0) + nbytes
        self._trace.update(f"{self.env.now!r}|{src.endpoint}|{dst.endpoint}|".encode())
        self._trace.update(tag)
        cost = 0.0
        if self.cpu_model is not None:
            cost = self.cpu_model.costs.receive(msg.type, sum(a.nbytes for a in msg.payload), nbytes)
        dst.deliver(msg, cost)

    def _tcp_arrive(self, token: Any, sent: float) -> None:
        src, dst, payload, nbytes, tag = token
        self._arrive(src, dst, payload, sent, nbytes, tag)

    # --------------------------------------------------------------- connections
    def _on_crash(self, peer: SimPeer) -> None:
        """A process died: its kernel resets its connections, and every live peer that monitors a
        lane-0 DEALER to it hears of it one-way latency later (see the module docstring)."""
        ep = peer.endpoint
        if self.tcp is not None:
            self.tcp.reset(ep)
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

    def _disconnect(self, src: SimPeer, endpoint: str) -> None:
        """The node forgot `endpoint`: the driver closes its DEALERs (and their monitor) to it."""
        self._dealers.pop((src.endpoint, endpoint), None)
        if self.tcp is not None:
            self.tcp.close(src.endpoint, endpoint)

    @property
    def trace_hash(self) -> str:
        return self._trace.hexdigest()

    def run(self, until: float | simpy.Event | None = None) -> None:
        self.env.run(until=until)
