"""The ZeroMQ transport: runs one protocol `Node` on real sockets, from one I/O thread.

That thread owns every socket (zmq sockets are not thread-safe): a ROUTER bound at the node's
endpoint receives everything; outgoing connections are `zgossip.connections` (a DEALER per
peer and lane). User threads hand work in through `call`, which queues a function and pokes
an inproc PAIR socket the loop also polls. The loop sleeps until a socket is readable or the
node's next deadline, feeds the node, and carries out its actions with
`zgossip.actions.execute`. It keeps the delivery contract of `zgossip.transport`.

The ROUTER sets MAXMSGSIZE, so an oversize frame drops that connection inside libzmq before a
byte reaches Python; everything else that arrives goes through `wire.decode`, and an invalid
message is logged and counted, never raised. The rest lives beside it, one concept a module:
zero-copy loans (`zgossip.zerocopy`), local Unix-socket routing (`zgossip.local_ipc`), the C
sender (`zgossip.fast_send`), process-wide settings (`zgossip.process_tuning`).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
from typing import Any, Callable, Sequence

import zmq

from . import fast_send, wire
from .actions import Owner, execute
from .clock import WALL_CLOCK
from .connections import Connections
from .endpoints import advertised, check_endpoint
from .fast_send import FAST_SEND
from .local_ipc import LocalRoutes, enabled, local_name
from .node import Node
from .process_tuning import context, tune_malloc
from .transport import NodeFactory
from .zerocopy import LentPayloads

__all__ = ["ZmqTransport", "ZmqDriver", "check_endpoint", "FAST_SEND"]

log = logging.getLogger(__name__)

_INLINE_BYTES = 1 << 12  # received frames up to this size are copied into bytes, larger ones are not
_STATS = ("received", "invalid", "sent", "send_errors", "errors", "disconnects", "connections", "local_connections")


class ZmqTransport:
    """`zgossip.transport.Transport` on ZeroMQ sockets; binds and starts its thread in `start`."""

    clock = WALL_CLOCK

    def __init__(self, listen: str = "tcp://127.0.0.1:0", *, limits: wire.WireLimits = wire.WireLimits(),
                 announce_host: str | None = None, name: str | None = None, local_ipc: bool = True,
                 initial_peers: Sequence[str] = ()) -> None:
        self.listen, self.limits, self.announce_host, self.name = listen, limits, announce_host, name
        self.local_ipc, self.initial_peers = enabled(local_ipc), tuple(initial_peers)
        self.local_address: str | None = None  # the abstract socket this node listens on as well
        self.stats = dict.fromkeys(_STATS, 0)
        self._stopping = False

    def start(self, peer_id: str, make_node: NodeFactory, owner: Owner) -> None:
        tune_malloc()
        self._owner, self._zsend, self._ctx = owner, fast_send.zsend, context()
        self._lent = LentPayloads(self._zsend)
        self._router = r = self._ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.setsockopt(zmq.MAXMSGSIZE, max(self.limits.max_frame_bytes, self.limits.max_header_bytes))
        r.setsockopt(zmq.RCVHWM, 0)
        self._router_address = r.underlying
        listen = self.listen[:-2] + ":*" if self.listen.startswith("tcp://") and self.listen.endswith(":0") else self.listen
        r.bind(listen)
        self.endpoint = advertised(r.getsockopt(zmq.LAST_ENDPOINT).decode(), self.announce_host, self.initial_peers)
        local = local_name(self.endpoint) if self.local_ipc else None
        if local is not None:
            try:
                r.bind("ipc://@" + local)
                self.local_address = "ipc://@" + local
            except zmq.ZMQError as e:  # taken: peers on this host that find it would reach its owner
                log.warning("zgossip node %s: could not listen on the local socket @%s (%s); "
                            "peers on this host will connect over TCP only if they do not find it",
                            self.endpoint, local, e)
        self.node = make_node(self.endpoint, None)
        self._poller = zmq.Poller()
        self.routes = LocalRoutes(self.endpoint, self.local_ipc)
        self.connections = Connections(self._ctx, self._poller, self.routes, self.stats)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        wake = f"inproc://zgossip-wake-{id(self)}"
        self._wake_in, self._wake_out = self._ctx.socket(zmq.PAIR), self._ctx.socket(zmq.PAIR)
        for s in (self._wake_in, self._wake_out):
            s.setsockopt(zmq.LINGER, 0)
        self._wake_in.bind(wake)
        self._wake_out.connect(wake)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"{self.name or 'zgossip-' + peer_id[:8]}-io",
                                        daemon=True)
        self._started = threading.Event()
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("zgossip I/O thread did not start")

    # ---------------------------------------------------------------- user-thread side
    def call(self, fn: Callable[[float], Any]) -> None:
        if self._stopping:
            raise RuntimeError("driver is stopped")
        self._commands.put(fn)
        with self._wake_lock:
            self._wake_out.send(b"", zmq.NOBLOCK)

    def run_on_io(self, fn: Callable[[Node, float], Any], timeout: float) -> Any:
        if threading.current_thread() is self._thread:
            return fn(self.node, self.clock.now())
        done: cf.Future = cf.Future()

        def run(now: float) -> None:
            try:
                done.set_result(fn(self.node, now))
            except BaseException as e:
                done.set_exception(e)

        self.call(run)
        return done.result(timeout)

    def sends_pending(self) -> bool:
        return bool(self._lent.pending())

    def settle_sends(self, timeout: float, release_timeout: float = 5.0) -> int:
        """See `zgossip.zerocopy.LentPayloads.settle`: stuck loans are dropped by closing the
        connections to their peers on the I/O thread (linger 0 discards their queues)."""
        def drop(stuck: list[str]) -> None:
            if self._stopping:
                raise RuntimeError("driver is stopped")
            self.run_on_io(lambda node, now: [self.connections.close(ep) for ep in stuck], release_timeout)

        return self._lent.settle(timeout, release_timeout, drop, self.endpoint)

    def close(self, timeout: float = 5.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        with self._wake_lock:
            try:
                self._wake_out.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._thread.join(timeout)
        self._wake_out.close(0)

    # ---------------------------------------------------------------- I/O thread
    def _run(self) -> None:
        poller, now, node = self._poller, self.clock.now, self.node
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        try:
            self._guard(node.start, now())
            self._started.set()
            while not self._stopping:
                dl = node.next_deadline()
                wait_ms = 1000 if dl is None else min(1000, max(0, int((dl - now()) * 1000) + 1))
                events = dict(poller.poll(wait_ms))
                if self._wake_in in events:
                    self._drain_commands()
                if self._router in events:
                    self._drain_router()
                if len(events) > (self._wake_in in events) + (self._router in events):
                    self.connections.drain_monitors(events, self._peer_down)
                dl = node.next_deadline()
                if dl is not None and now() >= dl:
                    self._guard(node.on_timer, now())
                self._lent.reap()  # buffers libzmq finished with, whose senders already let go
        finally:
            self._started.set()
            self.connections.close_all()
            self._router.close(0)
            self._wake_in.close(0)
            self._lent.reap()

    def _guard(self, fn: Callable, *args: Any) -> None:
        """Run a node entry point, then carry out its actions. A bug must not take the node down:
        it is logged loudly and the node keeps serving."""
        try:
            fn(*args)
        except Exception:
            self.stats["errors"] += 1
            log.exception("zgossip node %s: internal error", self.endpoint)
        execute(self.node.take_actions(), self, self._owner, self._owner_error)

    def _owner_error(self, e: BaseException) -> None:
        log.error("zgossip: result callback failed", exc_info=e)

    def _drain_commands(self) -> None:
        while True:
            try:
                self._wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                break
            self._guard(fn, self.clock.now())

    def _next_frames(self) -> Any:
        """The next message on the ROUTER without its routing id, or None when none is waiting."""
        if self._zsend is not None:  # no zmq.Frame objects, no zmq.Again raised when the queue is empty
            frames = self._zsend.recv(self._router_address, _INLINE_BYTES)
            return None if frames is None else frames[1:]
        try:
            frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return [f.buffer for f in frames[1:]]

    def _drain_router(self) -> None:
        for _ in range(256):  # bounded, so timers and commands still get their turn
            frames = self._next_frames()
            if frames is None:
                return
            self.stats["received"] += 1
            try:
                msg = wire.decode(frames, self.limits)
            except wire.InvalidMessage as e:
                self.stats["invalid"] += 1
                log.warning("zgossip node %s: dropped invalid message: %s", self.endpoint, e)
                continue
            self._guard(self.node.on_message, msg, self.clock.now())

    def _peer_down(self, endpoint: str) -> None:
        self.stats["disconnects"] += 1
        self._guard(self.node.on_peer_down, endpoint, self.clock.now())

    # ---------------------------------------------------------------- actions.Carrier
    def transmit(self, endpoint: str, msg: wire.Message, batch: dict | None = None) -> None:
        try:
            frames, big = self._lent.encode(msg, {} if batch is None else batch)
            sock = self.connections.dealer(endpoint, wire.lane_of(msg.type))
            try:
                self._lent.send(sock, frames, big, endpoint)
            except OSError:
                self.connections.close(endpoint)  # a multipart message may be cut short on that socket
                raise
            self.stats["sent"] += 1
        except (zmq.ZMQError, ValueError, OSError) as e:
            self.stats["send_errors"] += 1
            log.warning("zgossip node %s: could not send %s to %s: %s", self.endpoint, msg.type.name, endpoint, e)

    def disconnect(self, endpoint: str) -> None:
        self.connections.close(endpoint)

    def route(self, endpoint: str) -> str | None:
        """The address this node connected to for `endpoint` (None before the first message)."""
        return self.routes.get(endpoint)


ZmqDriver = ZmqTransport  # the name it had before transports were pluggable
