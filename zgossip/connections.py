"""Outgoing ZeroMQ connections of one node: a DEALER per (peer endpoint, lane), and a
disconnect monitor on each lane-0 DEALER.

Messages are one-way: each node receives on its ROUTER and sends on its own DEALERs -- except
for a node in client mode, which listens nowhere and reads what peers answer on the DEALERs it
opened (`readable`; the peers' ROUTERs reply through the connection). With keys
(`zgossip.curve`) every DEALER is a CURVE client of the key expected at its endpoint. Lane 1
carries only averaged results (`wire.lane_of`): they travel on a connection of their own, so
they are not queued behind the bulk of PART data still streaming to that peer (5-9% faster on
the 4-peer bench, paired runs). To a peer's local Unix socket a node with keys connects with
PLAIN and a key proof instead (`zgossip.local_auth`: authenticated, not encrypted). Every socket has linger 0 (the default makes ``ctx.term()``
wait forever for unsent messages to dead peers) and no send high-water mark (payloads are
zero-copy: queueing costs no copy). Only the I/O thread touches these sockets.
"""
from __future__ import annotations

from typing import Callable

import zmq

from . import local_auth, wire
from .curve import HANDSHAKE_EVENTS, Curve
from .local_ipc import LocalRoutes

__all__ = ["Connections"]

# connect() errors that say the address itself is unusable (not a passing shortage): not retried
_BAD_ADDRESS = frozenset(getattr(zmq, n) for n in ("EINVAL", "EPROTONOSUPPORT", "ENOCOMPATPROTO", "ENODEV")
                         if hasattr(zmq, n))


class Connections:
    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, routes: LocalRoutes, stats: dict,
                 curve: Curve | None = None, server_id: Callable[[str], str | None] | None = None,
                 readable: bool = False, max_msg_bytes: int = -1) -> None:
        self._ctx = ctx
        self._poller = poller
        self.routes = routes
        self._stats = stats
        self._curve = curve
        self._server_id = server_id  # endpoint -> the peer id (key) expected there (with curve)
        self._readable = readable  # client mode: peers answer on these connections
        self._max_msg = max_msg_bytes
        self._dealers: dict[tuple[str, int], tuple[zmq.Socket, zmq.Socket | None]] = {}  # -> dealer, monitor
        self.monitors: dict[zmq.Socket, str] = {}  # monitor PAIR socket -> the dealer's endpoint
        self.inbound: dict[zmq.Socket, tuple[str, str | None]] = {}  # readable dealer -> (endpoint, peer id)
        self.refused: dict[str, int] = {}  # endpoint -> errno: addresses libzmq refused (bounded)
        self.servers: dict[str, str] = {}  # endpoint -> the key our CURVE connections there expect

    def dealer(self, endpoint: str, lane: int = 0) -> zmq.Socket:
        """The DEALER to `endpoint` on `lane`, opened on first use. Raises ValueError (no key known
        for it) or zmq.ZMQError (libzmq refused the address); then nothing stays open, and an
        address libzmq refused for what it is (not for a passing shortage, such as file
        descriptors) is remembered: later sends to it fail at once, opening nothing."""
        got = self._dealers.get((endpoint, lane))
        if got is not None:
            return got[0]
        refused = self.refused.get(endpoint)
        if refused is not None:
            raise zmq.ZMQError(refused, f"{zmq.strerror(refused)} (refused before: not tried again)")
        server = None
        if self._curve is not None:
            server = self._server_id(endpoint) if self._server_id is not None else None
            if server is None:
                raise ValueError(f"no public key known for {endpoint}: give it as tcp://HOST:PORT#KEY or in the "
                                 "allow file (KEY tcp://HOST:PORT)")
            if server not in self._curve.allowed:
                # a key not on the list gets nothing, whoever names it (a lying GROUP or REDIRECT, a
                # revoked groupmate): CURVE would encrypt our tensors for that key alone
                raise ValueError(f"the key expected at {endpoint} ({server[:16]}) is not on the allow list: "
                                 "nothing is sent there")
        sock = self._ctx.socket(zmq.DEALER)
        mon = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop: payloads are zero-copy, queueing costs no copy
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_msg)
            if not self._readable:
                sock.setsockopt(zmq.RCVHWM, 1)  # nobody reads it: a peer that writes back cannot pile up memory
            route = self.routes.connect_to(endpoint)
            if server is not None:
                if route != endpoint:  # a local Unix socket: authenticated, not encrypted (zgossip.local_auth)
                    sock.setsockopt(zmq.PLAIN_USERNAME, self._curve.keys.peer_id.encode())  # type: ignore[union-attr]
                    sock.setsockopt(zmq.PLAIN_PASSWORD, local_auth.proof(self._curve.keys, server))  # type: ignore[union-attr]
                else:
                    self._curve.client(sock, server)  # type: ignore[union-attr]
            if lane == 0:
                # a dropped connection (the peer's process died) is reported at once, so the protocol
                # need not wait out its timeouts: messages queued on a dropped connection may be lost.
                # (Lane 0 is the one every groupmate has; one report per peer is enough.) Failed
                # handshakes (a refused key, a peer without keys) are reported once in the log.
                events = zmq.EVENT_DISCONNECTED | HANDSHAKE_EVENTS
                if server is not None and route == endpoint:
                    # over CURVE, a server that hangs up mid-handshake could not open our HELLO: it
                    # holds another key than the one we were given for it (`curve.handshake_failure`);
                    # one that completes it holds that key (`Curve.handshake_done`)
                    events |= zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED
                mon = sock.get_monitor_socket(events)
                self._poller.register(mon, zmq.POLLIN)
                self.monitors[mon] = endpoint
            if self._readable:
                self._poller.register(sock, zmq.POLLIN)
                self.inbound[sock] = (endpoint, server)
            sock.connect(route)
        except BaseException as e:
            # nothing may stay open for an address we could not connect to: every send to it would
            # leak a DEALER and its monitor (file descriptors) until libzmq aborts the process
            self._discard(sock, mon)
            if isinstance(e, zmq.ZMQError) and e.errno in _BAD_ADDRESS:
                if len(self.refused) >= 4096:
                    self.refused.pop(next(iter(self.refused)))
                self.refused[endpoint] = e.errno
            raise
        self._stats["connections"] += 1
        if route != endpoint:
            self._stats["local_connections"] += 1
        self._dealers[(endpoint, lane)] = (sock, mon)
        if server is not None and route == endpoint:
            self.servers[endpoint] = server
        return sock

    def _discard(self, sock: zmq.Socket, mon: zmq.Socket | None) -> None:
        if sock in self.inbound:
            self._poller.unregister(sock)
            del self.inbound[sock]
        if mon is not None:
            if mon in self.monitors:
                self._poller.unregister(mon)
                del self.monitors[mon]
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(0)
        sock.close(0)

    def close(self, endpoint: str) -> None:
        """Close every connection to `endpoint` (all lanes); whatever they still queued is dropped.
        The next connection looks for a local socket again (the peer may have restarted)."""
        self.routes.forget(endpoint)
        self.refused.pop(endpoint, None)  # (a host name that did not resolve may resolve later)
        self.servers.pop(endpoint, None)
        if self._curve is not None:
            self._curve.closed(endpoint)
        for lane in range(wire.LANES):
            got = self._dealers.pop((endpoint, lane), None)
            if got is None:
                continue
            self._discard(*got)

    def close_all(self) -> None:
        for ep in {ep for ep, _ in self._dealers}:
            self.close(ep)

    def drain_monitors(self, ready: dict, on_down: Callable[[str], None],
                       on_handshake: Callable[[str, dict], None] | None = None) -> None:
        """Read the monitors that are ready; call ``on_down(endpoint)`` per dropped connection and
        ``on_handshake(endpoint, event)`` per failed handshake."""
        from zmq.utils.monitor import recv_monitor_message

        for mon, endpoint in list(self.monitors.items()):
            if mon not in ready:
                continue
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    if self._curve is not None:
                        self._curve.closed(endpoint)  # (the peer may be gone, and its address taken next)
                    on_down(endpoint)
                elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    if self._curve is not None:
                        self._curve.handshake_done(endpoint, self.servers.get(endpoint), True)
                else:
                    if self._curve is not None and endpoint in self.servers:
                        self._curve.handshake_done(endpoint, self.servers[endpoint], False)
                    if on_handshake is not None:
                        on_handshake(endpoint, event)
