"""The ZeroMQ transport: runs one protocol `Node` on real sockets, from one I/O thread.

That thread owns every socket (zmq sockets are not thread-safe): a ROUTER bound at the node's
endpoint receives everything; outgoing connections are `zgossip.connections` (a DEALER per
peer and lane). User threads hand work in through `call`, which queues a function and pokes
an inproc PAIR socket the loop also polls. The loop sleeps until a socket is readable or the
node's next deadline, feeds the node, and carries out its actions with
`zgossip.actions.execute`. It keeps the delivery contract of `zgossip.transport`.

The ROUTER sets MAXMSGSIZE, so an oversize frame drops that connection inside libzmq before a
byte reaches Python; the ROUTER's monitor reports that, as it reports a crash or a network
failure, and a connection that closes without its peer's goodbye is counted and logged once per
source (`zgossip.cuts`). Everything else that arrives goes through `wire.decode`, and an invalid
message is logged and counted, never raised. The rest lives beside it, one concept a module:
zero-copy loans (`zgossip.zerocopy`), local Unix-socket routing (`zgossip.local_ipc`), the C
sender (`zgossip.fast_send`), process-wide settings (`zgossip.process_tuning`), CURVE keys and
who sent what (`zgossip.curve`, `zgossip.zap`).

**Client mode** (``client_mode=True``, for peers behind NAT or a firewall): nothing is bound. The
node's endpoint is ``client://<peer id>``, which peers never connect to; it opens its DEALERs
as usual and reads peers' answers on them. A peer answers a client through its ROUTER, on the
connection the client opened: the routing id of the client's latest lane-0 message (`_replies`).
Messages for a client that has not connected yet wait in a small backlog (`_backlog`, flushed
on its first message, bounded, dropped after `endpoints.CLIENT_BACKLOG_TTL` = 30 s) -- e.g. a groupmate's GATHER that beats the
client's first PART.
With keys, a client's claim to its id is checked like any other sender's.

**Local sockets with keys**: the abstract Unix socket is then a second ROUTER (`_local`) with
the PLAIN mechanism and a key proof (`zgossip.local_auth`): authenticated like CURVE, not
encrypted. It is bound only where the proof can be made; otherwise a node with keys listens on
TCP alone and local peers reach it with CURVE over TCP.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import logging
import os
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from . import fast_send, local_auth, wire
from .actions import Owner, execute
from .clock import WALL_CLOCK
from .connections import Connections
from .curve import HANDSHAKE_EVENTS, Curve, handshake_failure
from .cuts import ConnectionCuts
from .droplog import OncePer
from .endpoints import CLIENT_BACKLOG_TTL, CLIENT_SCHEME, advertised, check_endpoint, client_endpoint, reachable
from .identity import AllowList, KeyPair
from .fast_send import FAST_SEND
from .local_ipc import LocalRoutes, enabled, local_name
from .messages import MsgType, StateChunk
from .node import Node
from .process_tuning import context, name_this_thread, tune_malloc
from .state import chunk_digest
from .transport import NodeFactory
from .zerocopy import TRACK_BYTES, LentPayloads

__all__ = ["ZmqTransport", "ZmqDriver", "check_endpoint", "FAST_SEND"]

log = logging.getLogger(__name__)

_INLINE_BYTES = 1 << 12  # received frames up to this size are copied into bytes, larger ones are not
_STATS = ("received", "invalid", "sent", "send_errors", "errors", "disconnects", "connections", "local_connections",
          "unauthenticated", "refused", "handshake_failures", "unreachable", "connections_cut", "resent")
# the ROUTERs' monitors: failed handshakes (logged), and every closed connection (`zgossip.cuts`)
#: what a failed bind of the listen address means, said after libzmq's one-word reason
_BIND_HINTS = {
    errno.EADDRINUSE: " (another process listens there: pick another port, or 0 for a free one)",
    errno.EADDRNOTAVAIL: " (not an address of this host: give one of its addresses, or 0.0.0.0 for all)",
    errno.ENODEV: " (no interface or address of this host has that name: give one of its IP addresses, or 0.0.0.0 "
                "for all)",
}
_ROUTER_EVENTS = (HANDSHAKE_EVENTS | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_ACCEPTED
                  | zmq.EVENT_DISCONNECTED)
_BYE = MsgType.BYE
_BACKLOG_MESSAGES = 256  # per client that has not connected yet
_BACKLOG_CLIENTS = 64
_BACKLOG_TTL = CLIENT_BACKLOG_TTL  # (a module global, so that a test can shorten it)
_HASH_ELSEWHERE_BYTES = 1 << 16  # state chunks at least this large are hashed off the I/O thread
_MAX_HASHING = 64  # chunks handed to the hashing threads and not back yet (beyond: hashed inline)
_HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))


def _tcp_reachable(endpoint: str) -> bool:
    """A ZeroMQ node connects to ``tcp://HOST:PORT`` only (and answers ``client://`` peers on their
    own connections); ``ipc://`` and ``inproc://`` named by a peer would point into this host or process."""
    return reachable(endpoint, ("tcp",))


def _hash_and_place(data: np.ndarray, buf: np.ndarray, off: int, length: int, want: bytes) -> tuple[bytes, Any]:
    """On a hashing thread: the chunk's digest, and `buf` if the chunk matched `want` and was written there."""
    digest = chunk_digest(data)
    if digest != want:
        return digest, None
    buf[off: off + length] = data
    return digest, buf


class ZmqTransport:
    """`zgossip.transport.Transport` on ZeroMQ sockets; binds and starts its thread in `start`."""

    clock = WALL_CLOCK

    def __init__(self, listen: str = "tcp://127.0.0.1:0", *, limits: wire.WireLimits = wire.WireLimits(),
                 announce_host: str | None = None, name: str | None = None, local_ipc: bool = True,
                 initial_peers: Sequence[str] = (), keys: KeyPair | None = None, allowed: AllowList | None = None,
                 peer_keys: dict[str, str] | None = None, client_mode: bool = False) -> None:
        """`keys` turns CURVE on: `allowed` (required then) lists who may connect, `peer_keys` maps
        endpoints to the peer ids (keys) expected there (initial peers given with ``#KEY``).
        `client_mode`: bind nothing, receive on the connections this node opens (see above)."""
        self.listen, self.limits, self.announce_host, self.name = listen, limits, announce_host, name
        self.local_ipc, self.initial_peers = enabled(local_ipc), tuple(initial_peers)
        self.local_address: str | None = None  # the abstract socket this node listens on as well
        self.stats = dict.fromkeys(_STATS, 0)
        self._stopping = False
        if keys is not None and allowed is None:
            raise ValueError("a node with keys needs an allow list (allowed_keys=...)")
        self.keys, self.allowed, self.client_mode = keys, allowed, bool(client_mode)
        self._peer_keys = dict(peer_keys or {})
        self.curve: Curve | None = None
        self._replies: dict[str, bytes] = {}  # client peer id -> routing id of its connection to our ROUTER
        self._backlog: dict[str, collections.deque] = {}  # client peer id -> (queued at, message) waiting for it
        self._backlog_check_at = 0.0  # when the I/O loop next drops expired backlog entries
        # (where, kind) of failed handshakes and sends already logged (a bounded number per kind)
        self._refusals = OncePer(log, "zgossip node")

    def start(self, peer_id: str, make_node: NodeFactory, owner: Owner) -> None:
        tune_malloc()
        self._owner, self._zsend, self._ctx = owner, fast_send.zsend, context()
        self._lent = LentPayloads(self._zsend)
        self._max_msg = max(self.limits.max_frame_bytes, self.limits.max_header_bytes)
        if self.keys is not None:
            if self.keys.peer_id != peer_id:
                raise ValueError("with keys, the peer id must be the public key's (identity.peer_id_of)")
            self.curve = Curve(self.keys, self.allowed, self._peer_keys, self.stats,  # type: ignore[arg-type]
                               self.name or peer_id[:8])
        self._router = self._router_monitor = None
        self._local = self._local_monitor = None  # with keys: the PLAIN router on the local socket
        self._zap_domain = None
        self._thread: threading.Thread | None = None
        try:
            if self.client_mode:
                self.endpoint = client_endpoint(peer_id)
            else:
                self._bind()
            self._make_rest(peer_id, make_node)
        except BaseException:
            if self._thread is None:  # (once it runs, the I/O thread closes everything as it ends)
                self._abandon_start()
            raise

    def _abandon_start(self) -> None:
        """Close what a start that failed before its I/O thread ran had opened (the listen address
        taken, say): its sockets, and its ZAP domain, which kept the ZAP handler thread and its
        gate for ever (each failed Averager(...) left one to two descriptors open)."""
        for r, m in ((self._router, self._router_monitor), (self._local, self._local_monitor)):
            if r is not None:
                if m is not None:
                    r.disable_monitor()
                    m.close(0)
                r.close(0)
        for name in ("_wake_in", "_wake_out"):
            sock = self.__dict__.get(name)
            if sock is not None:
                sock.close(0)
        if self._zap_domain is not None:
            from . import zap

            zap.unregister(self._ctx, self._zap_domain)
            self._zap_domain = None

    def _new_router(self) -> zmq.Socket:
        r = self._ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.setsockopt(zmq.MAXMSGSIZE, self._max_msg)
        r.setsockopt(zmq.RCVHWM, 0)
        r.setsockopt(zmq.ROUTER_MANDATORY, 1)  # replies to a client that left raise, rather than vanish
        return r

    def _uses_local_sockets(self) -> bool:
        """Whether this node listens on and connects to local Unix sockets (with keys: only where
        the PLAIN key proof works, and never in client mode, whose answers need a server proof)."""
        return self.local_ipc and (self.curve is None or (local_auth.available() and not self.client_mode))

    def _bind(self) -> None:
        self._router = r = self._new_router()
        if self.curve is not None:
            from . import zap

            self._zap_domain = f"zgossip-{id(self):x}"
            zap.register(self._ctx, self._zap_domain,
                         zap.Gate(self.curve.allowed, self.name or "?", self.stats, self.curve.keys))
            self.curve.server(r, self._zap_domain)
        # failed handshakes (a key not allowed, a peer with/without keys) are logged once per kind
        self._router_monitor = r.get_monitor_socket(_ROUTER_EVENTS)
        self._router_address = r.underlying
        listen = self.listen[:-2] + ":*" if self.listen.startswith("tcp://") and self.listen.endswith(":0") else self.listen
        try:
            r.bind(listen)
        except zmq.ZMQError as e:  # "No such device (addr='tcp://h:*')" named neither the cause nor the fix
            raise zmq.ZMQError(e.errno, f"cannot listen at {self.listen}: {zmq.strerror(e.errno)}"
                                        f"{_BIND_HINTS.get(e.errno, '')}") from None
        self.endpoint = advertised(r.getsockopt(zmq.LAST_ENDPOINT).decode(), self.announce_host, self.initial_peers)
        local = local_name(self.endpoint) if self._uses_local_sockets() else None
        if local is not None:
            if self.curve is not None:  # authenticated, unencrypted (zgossip.local_auth)
                self._local = r = self._new_router()
                r.setsockopt(zmq.PLAIN_SERVER, 1)
                r.setsockopt(zmq.ZAP_DOMAIN, self._zap_domain.encode())  # type: ignore[union-attr]
                r.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # (as `curve.Curve.server`)
                self._local_monitor = r.get_monitor_socket(_ROUTER_EVENTS)
            try:
                r.bind("ipc://@" + local)
                self.local_address = "ipc://@" + local
            except zmq.ZMQError as e:  # taken: peers on this host that find it would reach its owner
                log.warning("zgossip node %s: could not listen on the local socket @%s (%s); "
                            "peers on this host will connect over TCP only if they do not find it",
                            self.endpoint, local, e)
                if self._local is not None:
                    self._local.disable_monitor()
                    self._local_monitor.close(0)  # type: ignore[union-attr]
                    self._local.close(0)
                    self._local = self._local_monitor = None

    def _make_rest(self, peer_id: str, make_node: NodeFactory) -> None:
        self.node = make_node(self.endpoint, None)
        self._refusals.owner = f"zgossip node {self.endpoint}"
        self.node.accept_endpoints(_tcp_reachable)  # what peers name must be an address we can connect to
        self._cuts = ConnectionCuts(self.stats, self.node.drops, log, self._max_msg)
        self._poller = zmq.Poller()
        self.routes = LocalRoutes(self.endpoint, self._uses_local_sockets())
        self.connections = Connections(self._ctx, self._poller, self.routes, self.stats, curve=self.curve,
                                       server_id=self._server_id, readable=self.client_mode,
                                       max_msg_bytes=self._max_msg)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        wake = f"inproc://zgossip-wake-{id(self)}"
        self._wake_in, self._wake_out = self._ctx.socket(zmq.PAIR), self._ctx.socket(zmq.PAIR)
        for s in (self._wake_in, self._wake_out):
            s.setsockopt(zmq.LINGER, 0)
        self._wake_in.bind(wake)
        self._wake_out.connect(wake)
        self._wake_lock = threading.Lock()
        self._woken = False  # a wake-up byte was sent and the loop has not read it yet
        self._hasher: cf.ThreadPoolExecutor | None = None  # started by the first large state chunk
        self._hashing = 0
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
        # one wake-up byte in flight is enough: the loop drains the whole queue after clearing the
        # flag (`_drain_commands`), so a command queued while the flag is up is run by that drain.
        # Every send releases and retakes the GIL, which costs up to a switch interval (5 ms) when
        # the I/O thread is busy in Python: a training step makes several calls in a row.
        if self._woken:
            return
        with self._wake_lock:
            if not self._woken:
                self._woken = True
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

    def settle_sends(self, timeout: float, release_timeout: float = 5.0, group_id: str | None = None) -> int:
        """See `zgossip.zerocopy.LentPayloads.settle`: stuck loans are dropped by closing the
        connections to their peers on the I/O thread (linger 0 discards their queues), and the
        stuck RESULTs that a groupmate is still owed (`Node.still_owes`) are sent again from a copy."""
        def drop(stuck: list[str], resend: list) -> None:
            if self._stopping:
                raise RuntimeError("driver is stopped")

            def run(node: Node, now: float) -> None:
                for ep in stuck:
                    self.connections.close(ep)
                copies: dict[int, wire.Message] = {}  # one copy of a RESULT stuck for several members
                for ep, msg in resend:
                    if node.still_owes(ep, msg.group_id):
                        copy = copies.get(id(msg))
                        if copy is None:
                            copy = copies[id(msg)] = msg.detached()
                        self.transmit(ep, copy, private=True)
                        self.stats["resent"] += 1

            self.run_on_io(run, release_timeout)

        gone: frozenset[str] = frozenset()
        if group_id is not None and self._lent.pending():
            try:
                gone = self.run_on_io(lambda node, now: node.gone(group_id), release_timeout)
            except (RuntimeError, cf.TimeoutError):  # stopping, or a busy I/O thread: wait for all
                pass
        return self._lent.settle(timeout, release_timeout, drop, self.endpoint, gone)

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
        name_this_thread("zgossip-io")
        poller, now, node, cuts = self._poller, self.clock.now, self.node, self._cuts
        router, mon = self._router, self._router_monitor
        local, local_mon = self._local, self._local_monitor
        for sock in (router, mon, local, local_mon):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        try:
            self._guard(node.start, now())
            self._started.set()
            while not self._stopping:
                dl = node.next_deadline()
                cut_dl = cuts.next_deadline()
                if cut_dl is not None and (dl is None or cut_dl < dl):
                    dl = cut_dl
                wait_ms = 1000 if dl is None else min(1000, max(0, int((dl - now()) * 1000) + 1))
                events = dict(poller.poll(wait_ms))
                handled = (self._wake_in in events)
                if handled or not self._commands.empty():  # a call queued just after a drain runs now too
                    self._drain_commands()
                if router is not None and router in events:
                    self._drain(router, None)
                    handled += 1
                if mon is not None and mon in events:
                    self._drain_router_monitor(mon)
                    handled += 1
                if local is not None:
                    if local in events:
                        self._drain(local, None)
                        handled += 1
                    if local_mon in events:
                        self._drain_router_monitor(local_mon)
                        handled += 1
                if len(events) > handled:
                    for sock, (ep, pid) in list(self.connections.inbound.items()):
                        if sock in events:
                            self._drain(sock, (ep, pid))
                    self.connections.drain_monitors(events, self._peer_down, self._handshake_failed)
                if cuts.next_deadline() is not None:
                    self._cut_event(cuts.on_timer, now(), not node.membership.said_goodbye)
                dl = node.next_deadline()
                if dl is not None and now() >= dl:
                    self._guard(node.on_timer, now())
                self._lent.reap()  # buffers libzmq finished with, whose senders already let go
                if self._backlog and now() >= self._backlog_check_at:  # (once a second at most)
                    self._expire_backlog(now())
                    self._backlog_check_at = now() + 1.0
        finally:
            self._started.set()
            if self._hasher is not None:
                self._hasher.shutdown(wait=False, cancel_futures=True)
            self.connections.close_all()
            for r, m in ((router, mon), (local, local_mon)):
                if r is not None:
                    r.disable_monitor()
                    m.close(0)
                    r.close(0)
            if self._zap_domain is not None:
                from . import zap

                zap.unregister(self._ctx, self._zap_domain)
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
        try:
            execute(self.node.take_actions(), self, self._owner, self._owner_error)
        except Exception:  # a carrier bug: the actions after it are lost, the I/O thread must live on
            self.stats["errors"] += 1
            log.exception("zgossip node %s: internal error carrying out the node's actions", self.endpoint)

    def _owner_error(self, e: BaseException) -> None:
        log.error("zgossip: result callback failed", exc_info=e)

    def _drain_commands(self) -> None:
        while True:
            try:
                self._wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        self._woken = False  # after the bytes are read, before the queue is: see `call`
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                break
            self._guard(fn, self.clock.now())

    def _next_frames(self, sock: zmq.Socket, routed: bool) -> Any:
        """(routing id or None, frames, the connection's ZAP user id or None, its descriptor or None)
        of the next message on `sock` (`routed`: a ROUTER), or None when none is waiting."""
        want_user = self.curve is not None and routed
        user = fd = None
        if self._zsend is not None:  # no zmq.Frame objects, no zmq.Again raised when the queue is empty
            addr = self._router_address if sock is self._router else sock.underlying
            if want_user:
                got = self._zsend.recv(addr, _INLINE_BYTES, "__fd", "User-Id")
                if got is None:
                    return None
                frames, fd, user = got
            elif routed:
                got = self._zsend.recv(addr, _INLINE_BYTES, "__fd")
                if got is None:
                    return None
                frames, fd = got
            else:
                frames = self._zsend.recv(addr, _INLINE_BYTES)
                if frames is None:
                    return None
        else:
            try:
                raw = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            if routed and len(raw) > 1:
                for prop in ("__fd", "User-Id") if want_user else ("__fd",):
                    try:
                        value = raw[1].get(prop)
                    except zmq.ZMQError:  # the message has no such property
                        continue
                    if prop == "__fd":
                        fd = value
                    else:
                        user = value
            frames = [bytes(f.buffer) if i == 0 and routed else f.buffer for i, f in enumerate(raw)]
        if routed:
            return bytes(frames[0]), frames[1:], user, fd
        return None, list(frames), user, None

    def _drain(self, sock: zmq.Socket, dealer: tuple[str, str | None] | None) -> None:
        """Messages on our ROUTER (`dealer` None) or, in client mode, on the DEALER to `dealer`
        = (endpoint, peer id expected there)."""
        routed = dealer is None
        conns = self._cuts.conns
        for _ in range(256):  # bounded, so timers and commands still get their turn
            got = self._next_frames(sock, routed)
            if got is None:
                return
            rid, frames, user, fd = got
            self.stats["received"] += 1
            # the first message of a connection into a ROUTER names its source (zgossip.cuts)
            fresh = fd is not None and ((rec := conns.get(fd)) is None or rec[0] != rid or rec[1] is None)
            if fresh:  # the monitor's news first: this connection's ACCEPTED, and all before it
                self._drain_router_monitors()
                if user is not None:  # the connection's key: its peer id
                    self._cut_event(self._cuts.opened, fd, rid, user, f"peer {user}")
                    fresh = False
            try:
                msg = wire.decode(frames, self.limits)
            except wire.InvalidMessage as e:
                self.stats["invalid"] += 1
                if fresh:
                    self._cut_event(self._cuts.opened, fd, rid, None, "a sender without keys")
                if user is not None:
                    source = f"peer {user}"
                elif dealer is not None:
                    source = f"{dealer[0]} (answering on our connection)"
                else:  # a connection without keys does not say who is at its other end
                    source = "a sender without keys"
                self.node.drops.note(log, source, "an invalid message", str(e)[:200], counter="invalid")
                continue
            if self.curve is not None:
                source = dealer[0] if dealer is not None else f"{msg.endpoint} (claimed)"
                if not self.curve.check(msg.sender, user if routed else dealer[1], source):  # type: ignore[index]
                    continue
                if routed and not msg.endpoint.startswith(CLIENT_SCHEME):
                    owner = self.curve.disproves(msg.sender, msg.endpoint)
                    if owner is not None:  # another key's handshake proved it is there (`zgossip.curve`)
                        self.stats["unauthenticated"] += 1
                        self.curve.once(("endpoint", msg.sender),
                                        f"dropped a message from {msg.sender[:16]} claiming {msg.endpoint}, where "
                                        f"peer {owner[:16]} completed our handshake (later ones are only counted)",
                                        counter="unauthenticated")
                        continue
                    if self.curve.heard(msg.sender, msg.endpoint):
                        self.connections.close(msg.endpoint)  # opened with the key of whoever was there before
                self.curve.vouched(msg)
            if sock is self._router and msg.endpoint.startswith(CLIENT_SCHEME) and wire.lane_of(msg.type) == 0:
                if msg.endpoint != client_endpoint(msg.sender):
                    self.stats["invalid"] += 1
                    self.node.drops.note(log, msg.sender, "a message whose client endpoint is not its sender's",
                                         f"{msg.endpoint[:80]!r}", counter="invalid")
                    continue
                self._client_seen(msg.sender, rid)
            if fresh:  # without keys: the peer id and endpoint it claims
                self._cut_event(self._cuts.opened, fd, rid, msg.sender,
                                f"{msg.sender} at {msg.endpoint} (as it claimed: no keys)")
            if msg.type is _BYE:
                self._cut_event(self._cuts.said_goodbye, msg.sender, self.clock.now())
            if type(msg) is StateChunk and self._hash_elsewhere(msg):
                continue
            self._guard(self.node.on_message, msg, self.clock.now())

    def _hash_elsewhere(self, msg: StateChunk) -> bool:
        """Hash a state chunk a download waits for on a hashing thread (hashlib and numpy's copy let
        go of the GIL), which also writes it into the download's buffer if, and only if, its digest
        is the one wanted; this thread receives the next chunks meanwhile, and the node gets the
        chunk with its digest when done. Unwanted chunks, small ones and any beyond `_MAX_HASHING`
        waiting are handed in as usual (the node hashes or drops them here)."""
        if msg.data.nbytes < _HASH_ELSEWHERE_BYTES or self._hashing >= _MAX_HASHING:
            return False
        target = self.node.chunk_target(msg)
        if target is None:
            return False
        if self._hasher is None:
            self._hasher = cf.ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="zgossip-hash",
                                                 initializer=name_this_thread, initargs=("zgossip-hash",))
        try:
            fut = self._hasher.submit(_hash_and_place, msg.data.view(np.uint8), *target)
        except RuntimeError:  # shut down: hashed here (the download waits for every chunk handed out)
            self._guard(self.node.on_hashed_chunk, msg, None, None, self.clock.now())
            return True
        self._hashing += 1

        def hashed(now: float) -> None:
            self._hashing -= 1
            try:
                digest, placed_in = fut.result()
            except Exception:
                digest, placed_in = None, None  # the node hashes it itself
            self.node.on_hashed_chunk(msg, digest, placed_in, now)

        def post(_: cf.Future) -> None:
            try:
                self.call(hashed)
            except (RuntimeError, zmq.ZMQError):
                pass  # stopping: the download dies with the node

        fut.add_done_callback(post)
        return True

    def _server_id(self, endpoint: str) -> str | None:
        """The peer id (key) expected at `endpoint`, for a CURVE client connection."""
        assert self.curve is not None

        def from_membership(ep: str) -> str | None:
            for pid, rec in self.node.membership.peers.items():
                if rec.endpoint == ep:
                    return pid
            return None

        return self.curve.peer_at(endpoint, from_membership)

    def _client_seen(self, peer_id: str, rid: bytes) -> None:
        self._replies[peer_id] = rid
        self._expire_backlog(self.clock.now())
        waiting = self._backlog.pop(peer_id, None)
        if waiting:
            batch: dict = {}
            for _, msg in waiting:
                self.transmit(client_endpoint(peer_id), msg, batch)

    def _expire_backlog(self, now: float) -> None:
        """Drop what waited longer than `_BACKLOG_TTL` for a client that never connected (counted in
        stats["unreachable"], as every message a client could not be given)."""
        cutoff = now - _BACKLOG_TTL
        for pid in list(self._backlog):
            q = self._backlog[pid]
            while q and q[0][0] < cutoff:
                q.popleft()
                self.stats["unreachable"] += 1
            if not q:
                del self._backlog[pid]

    def _drain_router_monitor(self, mon: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_ACCEPTED:
                self._cut_event(self._cuts.accepted, str(int(event["value"])))
            elif kind == zmq.EVENT_DISCONNECTED:
                self._cut_event(self._cuts.closed, str(int(event["value"])), self.clock.now())
            else:
                self._cut_event(self._cuts.handshake_failed)  # a connection that will close having said nothing
                if kind != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # (a port probe, a peer gone mid-handshake)
                    self._handshake_failed("a connecting peer", event)

    def _cut_event(self, fn: Callable, *args: Any) -> None:
        """Feed `zgossip.cuts`; a bug there is logged and counted, and must not stop the I/O thread."""
        try:
            fn(*args)
        except Exception:
            self.stats["errors"] += 1
            log.exception("zgossip node %s: internal error in the bookkeeping of connections", self.endpoint)

    def _drain_router_monitors(self) -> None:
        for mon in (self._router_monitor, self._local_monitor):
            if mon is not None:
                self._drain_router_monitor(mon)

    def _handshake_failed(self, where: str, event: dict) -> None:
        self.stats["handshake_failures"] += 1
        kind, text = handshake_failure(event, self.curve is not None)
        if not self._refusals.first(where, kind, "handshake_failures"):
            return
        log.error("zgossip node %s: connection with %s refused: %s (logged once; counted in "
                  "stats['handshake_failures'])", self.endpoint, where, text)

    def _peer_down(self, endpoint: str) -> None:
        self.stats["disconnects"] += 1
        self._guard(self.node.on_peer_down, endpoint, self.clock.now())

    # ---------------------------------------------------------------- actions.Carrier
    def transmit(self, endpoint: str, msg: wire.Message, batch: dict | None = None, private: bool = False) -> None:
        """Send `msg` (its payload lent to libzmq, tracked unless `private`: a copy nobody else holds)."""
        if endpoint.startswith(CLIENT_SCHEME):
            return self._to_client(endpoint, msg, batch)
        frames = self._encode(msg, endpoint, batch)
        if frames is None:
            return
        frames, big = frames
        try:
            sock = self.connections.dealer(endpoint, wire.lane_of(msg.type))
            try:
                self._lent.send(sock, frames, big, endpoint, msg, track=not private)
            except OSError:
                self.connections.close(endpoint)  # a multipart message may be cut short on that socket
                raise
            self.stats["sent"] += 1
            for lane in wire.warm_lanes(msg.type):  # handshakes now, while this data streams
                self.connections.dealer(endpoint, lane)
        except (zmq.ZMQError, ValueError, OSError) as e:
            self.stats["send_errors"] += 1
            if self.curve is not None and isinstance(e, ValueError) and (
                    "no public key" in str(e) or "not on the allow list" in str(e)):
                self.curve.once(("nokey", endpoint), f"could not send to {endpoint}: {e}")
                return
            if "temporarily unavailable" in str(e) or getattr(e, "errno", None) == zmq.EAGAIN:
                # no connection came up (e.g. the peer refuses our key, or speaks no CURVE): once per peer
                if self._refusals.first(endpoint, "eagain", "send_errors"):
                    log.warning("zgossip node %s: could not send to %s: no connection could be set up (later "
                                "failures are only counted in stats['send_errors'])", self.endpoint, endpoint)
                return
            # once per endpoint and kind of failure (a peer may name unreachable endpoints by the
            # thousand, or one may fail every send): the rest only counted in stats["send_errors"]
            kind = f"send:{getattr(e, 'errno', None) or type(e).__name__}"
            if not self._refusals.first(endpoint, kind, "send_errors"):
                log.debug("zgossip node %s: could not send %s to %s: %s", self.endpoint, msg.type.name, endpoint, e)
                return
            log.warning("zgossip node %s: could not send %s to %s: %s (logged once per endpoint and error; later "
                        "failures are only counted in stats['send_errors'])", self.endpoint, msg.type.name, endpoint, e)

    def _encode(self, msg: wire.Message, endpoint: str, batch: dict | None) -> tuple[Any, bool] | None:
        """`msg`'s frames (`LentPayloads.encode`), or None when it cannot be encoded: a message the
        node built that msgpack refuses is a bug of ours (user values are checked at the call, e.g.
        `wire.check_gather`); it is dropped and counted in stats['send_errors'], logged once per
        message type and error, and never takes the I/O thread down."""
        try:
            return self._lent.encode(msg, {} if batch is None else batch)
        except Exception as e:
            self.stats["send_errors"] += 1
            key = (msg.type.name, f"encode {type(e).__name__}")
            if self._refusals.first(*key, "send_errors"):
                log.error("zgossip node %s: could not encode %s for %s, dropped (%s: %s; later such drops are "
                          "only counted in stats['send_errors'])", self.endpoint, msg.type.name, endpoint,
                          type(e).__name__, e)
            return None

    def _to_client(self, endpoint: str, msg: wire.Message, batch: dict | None) -> None:
        """Answer a client through our ROUTER, on the connection it opened; queue (bounded) until it
        connects. A client cannot reach another client: that is dropped and counted."""
        pid = endpoint[len(CLIENT_SCHEME):]
        rid = self._replies.get(pid)
        if self._router is None:
            self.stats["unreachable"] += 1
            return
        if self.curve is not None and pid not in self.curve.allowed:
            # a key off the list gets nothing (`connections`), and could never connect to collect it:
            # nothing is queued for it either (a lying GROUP could name many such clients)
            self.stats["send_errors"] += 1
            self.curve.once(("nokey", endpoint), f"could not send to {endpoint[:80]}: that client's key is not on "
                                                 "the allow list: nothing is sent there")
            return
        if rid is None:
            q = self._backlog.get(pid)
            if q is None:
                if len(self._backlog) >= _BACKLOG_CLIENTS:
                    self._expire_backlog(self.clock.now())
                if len(self._backlog) >= _BACKLOG_CLIENTS:
                    self.stats["unreachable"] += 1
                    return
                q = self._backlog[pid] = collections.deque(maxlen=_BACKLOG_MESSAGES)
            if len(q) == q.maxlen:
                self.stats["unreachable"] += 1
            # payload views of a tensor may change before the client connects: keep a copy
            q.append((self.clock.now(), msg.detached()))
            return
        try:
            # a client's messages wait in our ROUTER's queue, which cannot be dropped for one peer: an
            # in-place step could not take a stuck loan back (settle_sends closes DEALERs), so a client
            # gets its payloads from a copy, never lent from the tensor
            copied = bool(msg.payload) and msg.payload[-1].nbytes >= TRACK_BYTES
            if copied:
                msg, batch = msg.detached(), None
            encoded = self._encode(msg, endpoint, batch)
            if encoded is None:
                return
            frames, big = encoded
            frames = (rid, *frames) if isinstance(frames, tuple) else [rid, *frames]
            self._lent.send(self._router, frames, big, endpoint, track=not copied)
            self.stats["sent"] += 1
        except (zmq.ZMQError, OSError) as e:  # the client's connection is gone (ROUTER_MANDATORY)
            self._replies.pop(pid, None)
            self.stats["unreachable"] += 1
            log.debug("zgossip node %s: could not answer client %s: %s", self.endpoint, pid[:8], e)

    def disconnect(self, endpoint: str) -> None:
        if endpoint.startswith(CLIENT_SCHEME):
            pid = endpoint[len(CLIENT_SCHEME):]
            self._replies.pop(pid, None)
            self._backlog.pop(pid, None)
            return
        self.connections.close(endpoint)

    def connect(self, endpoint: str) -> None:
        """Open the lane-0 connection to a peer just met (`actions.Connect`), ahead of its first message."""
        if endpoint.startswith(CLIENT_SCHEME):
            return
        try:
            self.connections.dealer(endpoint, 0)
        except (zmq.ZMQError, ValueError, OSError):
            pass  # no key known for it yet, say: the first message will try again, and log what fails

    def route(self, endpoint: str) -> str | None:
        """The address this node connected to for `endpoint` (None before the first message)."""
        return self.routes.get(endpoint)


ZmqDriver = ZmqTransport  # the name it had before transports were pluggable
