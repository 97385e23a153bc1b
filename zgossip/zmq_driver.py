"""ZeroMQ driver: runs one protocol `Node` on real sockets, from one I/O thread.

That thread owns every socket (zmq sockets are not thread-safe): a ROUTER bound at
the node's endpoint receives everything; a DEALER per remote endpoint and lane sends to
that peer's ROUTER (messages are one-way; replies travel on the replier's own
DEALER). Lane 1 carries only averaged results (see `_LANE`), lane 0 everything else;
messages keep their order within a lane, not across lanes (the protocol needs no more).
User threads hand work in through `call`, which queues a function and pokes an
inproc PAIR socket the loop also polls. The loop sleeps until a socket is
readable or the node's next deadline.

Every socket has linger 0 so shutdown never hangs (the default linger makes
``ctx.term()`` wait forever for unsent messages to dead peers). The ROUTER sets
MAXMSGSIZE, so an oversize frame drops that connection inside libzmq before a byte
reaches Python; everything else that arrives goes through `wire.decode`, and an
invalid message is logged and counted, never raised.

Peers on the same host talk over Unix sockets (Linux): every node also listens on the abstract
socket ``@zgossip-<host>:<port>`` named after its advertised TCP endpoint, and before its first
connection to a TCP endpoint a node checks whether that abstract socket exists here; if it does,
the connection goes there instead. The protocol still knows the peer by its TCP endpoint.
Abstract sockets belong to a network namespace, exactly like the local addresses such an
endpoint names, and vanish with their process, so a name that answers is that peer's, or a
squatter's: abstract sockets have no permissions, so only a listener running as this user
(SO_PEERCRED) is used, and any other means TCP. On the 4-peer bench
that took 21% off the step (kernel TCP work); ``local_ipc=False`` or ``ZGOSSIP_LOCAL_IPC=0``
keeps everything on TCP.

Payloads of 64 KiB and more are lent to libzmq zero-copy (through `_zsend` where it is built,
else pyzmq): the node must not change those bytes until libzmq is done (`sends_pending`,
`settle_sends`).
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Sequence

import zmq

from . import wire
from .node import Disconnect, Node, Send, StepDone, StepFailed

__all__ = ["ZmqDriver", "check_endpoint", "advertised_host"]

log = logging.getLogger(__name__)

_TRACK_BYTES = 1 << 16  # payloads at least this large are sent zero-copy and tracked
_INLINE_BYTES = 1 << 12  # received frames up to this size are copied into bytes, larger ones are not


def _load_fast_send() -> Any:
    """zgossip's C sender (`_zsend`) bound to the libzmq pyzmq loaded, or None.

    pyzmq lends a buffer to libzmq zero-copy by way of its garbage-collector thread: libzmq's
    free function posts to that thread, which takes the GIL to drop the reference and set the
    tracker. `_zsend` lends the buffer with a free function that only decrements an atomic
    counter; the I/O thread releases finished buffers itself (`reap`). On the 4-peer bench
    that spared the release thread's wake-ups and GIL hand-overs, and the MessageTracker and
    events of every send (~3%). It also receives: a whole message per call, large frames as
    read-only buffers over libzmq's own memory, and None rather than an exception when nothing
    is waiting (~1 µs against pyzmq's ~6 µs per message; ~2% less CPU on the bench). Linux only (the library's path comes from /proc/self/maps);
    ``ZGOSSIP_FAST_SEND=0`` or any mismatch falls back to pyzmq.
    """
    if os.environ.get("ZGOSSIP_FAST_SEND", "1") == "0":
        return None
    try:
        from . import _zsend  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "libzmq" in line}
        paths = {p for p in paths if os.path.basename(p).startswith("libzmq") and ".so" in p}
        if len(paths) != 1:
            return None
        version = _zsend.load(paths.pop())
    except (OSError, IndexError):
        return None
    return _zsend if tuple(version) == tuple(zmq.zmq_version_info()) else None


_zsend = _load_fast_send()
#: True when zero-copy payloads go out through `_zsend` rather than pyzmq.
FAST_SEND = _zsend is not None

# Averaged parts (RESULT) travel to a peer on a connection of their own, so they are not queued
# behind the bulk of PART data still streaming to that peer: a member gets each result as soon
# as its owner has it, copies it and frees the buffer while the parts are still coming. On the
# 4-peer bench that was 5-9% faster (paired runs). Everything else shares lane 0, in order.
_LANES = wire.LANES
_LANE = wire._LANE_OF  # the mapping lives in `wire` (see `wire.lane_of`), shared with the simulator


_malloc_tuned = False
_ctx_lock = threading.Lock()
_ctx: zmq.Context | None = None


def _context() -> zmq.Context:
    """The ZeroMQ context every zgossip node in this process shares (one libzmq I/O thread).

    zgossip's own rather than pyzmq's global instance, so that its socket limit can be raised
    before any socket exists: libzmq's default of 1023 sockets per context is reached by a
    dozen nodes in one process (tests, simulations on real sockets), since a node keeps up to
    two DEALERs and a monitor per peer it talks to.
    """
    global _ctx
    with _ctx_lock:
        if _ctx is None or _ctx.closed:
            _ctx = zmq.Context()
            _ctx.set(zmq.MAX_SOCKETS, 32768)
        return _ctx


def tune_malloc() -> bool:
    """Keep freed multi-MiB receive buffers in the process instead of returning them to the OS.

    libzmq mallocs a fresh buffer for every large message it receives (on its own thread) and
    frees it when we drop the frame. glibc serves those from a per-thread arena but gives the
    memory back as soon as the arena's free top exceeds the trim threshold (twice the mmap
    threshold, by default adjusted up to 8 MiB here), so the next message faults its pages in
    again and the kernel zeroes them: per 64 MiB all-reduce that was thousands of page faults
    per peer. A fixed mmap threshold of 64 MiB and a trim threshold of 256 MiB keep those
    buffers warm. (Setting the trim threshold alone would be worse: it freezes the mmap
    threshold at 128 KiB and every buffer becomes a fresh mmap.) Process-wide and glibc-only;
    done once, when the first driver starts; ``ZGOSSIP_TUNE_MALLOC=0`` turns it off.
    Returns whether the settings were applied.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if os.environ.get("ZGOSSIP_TUNE_MALLOC", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl, Windows): nothing to tune
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    _malloc_tuned = bool(mallopt(m_mmap_threshold, 64 << 20)) and bool(mallopt(m_trim_threshold, 256 << 20))
    return _malloc_tuned


def local_name(endpoint: str) -> str | None:
    """The abstract Unix socket name a node advertised at tcp `endpoint` also listens on, or None
    (not TCP, not Linux, or too long for a socket address)."""
    if not (sys.platform.startswith("linux") and endpoint.startswith("tcp://")):
        return None
    name = "zgossip-" + endpoint[6:]
    return name if len(name.encode()) <= 100 else None


def _wait_released(tracker: Any, timeout: float) -> bool:
    """Wait up to `timeout` until libzmq released a zero-copy payload (a pyzmq MessageTracker or
    a `_zsend.Payload`); True if it did."""
    if tracker.done:
        return True
    if timeout <= 0:
        return False
    if _zsend is not None and isinstance(tracker, _zsend.Payload):
        return bool(tracker.wait(timeout))
    try:
        tracker.wait(timeout)
    except zmq.NotDone:
        return False
    return True


def _listener_uid(name: str) -> int | None:
    """The user id of the process listening on abstract Unix socket `name`, or None if nobody
    does (or it cannot be told: a full backlog counts as unknown)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect("\0" + name)
        _pid, uid, _gid = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
        return uid
    except OSError:
        return None
    finally:
        probe.close()


def check_endpoint(address: Any, what: str = "peer address", listen: bool = False) -> tuple[str, int]:
    """(host, port) of a ``tcp://HOST:PORT`` address, or a ValueError that names the address and the
    expected form. A peer address needs a port in 1..65535; a `listen` address may also use port 0
    or ``*`` (any free port) and the host ``*`` (every interface)."""
    form = "tcp://HOST:PORT, e.g. tcp://10.0.0.5:41000" + (" (port 0 = any free port)" if listen else "")
    if not isinstance(address, str):
        raise ValueError(f"invalid {what} {address!r}: expected a string of the form {form}")
    if not address.startswith("tcp://"):
        hint = f" (did you mean 'tcp://{address}'?)" if "://" not in address and ":" in address else ""
        raise ValueError(f"invalid {what} {address!r}: expected {form}{hint}")
    host, sep, port = address[6:].rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host_ok = len(host) > 2
    else:
        host_ok = bool(host) and not any(c in host for c in "/[]: \t") and (listen or host != "*")
    port_ok = port.isdigit() and (0 if listen else 1) <= int(port) <= 65535 or (listen and port == "*")
    if not sep or not host_ok or not port_ok:
        raise ValueError(f"invalid {what} {address!r}: expected {form}")
    return host, (0 if port == "*" else int(port))


def _interface_addresses() -> list[str]:
    """IPv4 addresses of this host's interfaces (Linux: from the routing table's local entries;
    elsewhere what the host name resolves to)."""
    out: list[str] = []
    try:
        with open("/proc/net/fib_trie") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            if "/32 host LOCAL" in line and i > 0:
                addr = lines[i - 1].split()[-1]
                if addr not in out:
                    out.append(addr)
    except OSError:
        pass
    if not out:
        try:
            out = [a for a in socket.gethostbyname_ex(socket.gethostname())[2] if a not in out]
        except OSError:
            pass
    return out


def _route_source(host: str) -> str | None:
    """The local address the kernel would send from to reach `host` (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    for *_, addr in infos:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect(addr)
            return probe.getsockname()[0]
        except OSError:
            continue
        finally:
            probe.close()
    return None


def advertised_host(initial_peers: Sequence[str] = (), *, route: Callable[[str], str | None] = _route_source,
                    interfaces: Callable[[], list[str]] = _interface_addresses) -> str:
    """The address a node bound to every interface tells others: the one that routes to its first
    reachable initial peer, else the first non-loopback interface address, else 127.0.0.1 with a
    warning (others on other hosts could not reach it)."""
    for ep in initial_peers:
        try:
            host, _ = check_endpoint(ep)
        except ValueError:
            continue
        src = route(host.strip("[]"))
        if src and src != "0.0.0.0":
            return src
    addrs = interfaces()
    for a in addrs:
        if not a.startswith("127."):
            return a
    log.warning("zgossip: listening on every interface, but this host has no address other than loopback: "
                "advertising 127.0.0.1, which only peers on this host can reach (set announce_host)")
    return "127.0.0.1"


def _advertised(endpoint: str, announce_host: str | None, initial_peers: Sequence[str] = ()) -> str:
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, port = endpoint[6:].rsplit(":", 1)
    if announce_host:
        host = announce_host
    elif host in ("0.0.0.0", "*"):
        host = advertised_host(initial_peers)
    return f"tcp://{host}:{port}"


class ZmqDriver:
    def __init__(
        self,
        make_node: Callable[[str], Node],
        listen: str,
        on_result: Callable[[StepDone | StepFailed], None],
        *,
        limits: wire.WireLimits = wire.WireLimits(),
        announce_host: str | None = None,
        name: str = "zgossip",
        local_ipc: bool = True,
        initial_peers: Sequence[str] = (),
    ) -> None:
        self.limits = limits
        self._on_result = on_result
        tune_malloc()
        self._ctx = _context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max(limits.max_frame_bytes, limits.max_header_bytes))
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router_address = self._router.underlying
        bind_to = listen
        if listen.startswith("tcp://") and listen.endswith(":0"):
            bind_to = listen[:-2] + ":*"
        self._router.bind(bind_to)
        bound = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.endpoint = _advertised(bound, announce_host, initial_peers)
        self.local_ipc = bool(local_ipc) and os.environ.get("ZGOSSIP_LOCAL_IPC", "1") != "0"
        self._routes: dict[str, str] = {}  # endpoint -> address connected (ipc://@... for peers on this host)
        self.local_address: str | None = None  # the abstract socket this node listens on as well
        local = local_name(self.endpoint) if self.local_ipc else None
        if local is not None:
            try:
                self._router.bind("ipc://@" + local)
                self.local_address = "ipc://@" + local
            except zmq.ZMQError as e:  # taken: peers on this host that find it would reach its owner
                log.warning("zgossip node %s: could not listen on the local socket @%s (%s); "
                            "peers on this host will connect over TCP only if they do not find it",
                            self.endpoint, local, e)
        self.node = make_node(self.endpoint)
        self._dealers: dict[tuple[str, int], tuple[zmq.Socket, zmq.Socket | None]] = {}  # (endpoint, lane) -> dealer, monitor
        self._monitors: dict[zmq.Socket, str] = {}  # monitor PAIR socket -> the dealer's endpoint
        self._poller = zmq.Poller()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        wake_addr = f"inproc://zgossip-wake-{id(self)}"
        self._wake_in = self._ctx.socket(zmq.PAIR)
        self._wake_in.setsockopt(zmq.LINGER, 0)
        self._wake_in.bind(wake_addr)
        self._wake_out = self._ctx.socket(zmq.PAIR)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(wake_addr)
        self._wake_lock = threading.Lock()
        self._trackers: list[tuple[Any, str]] = []  # zero-copy sends in flight (MessageTracker or _zsend.Payload), by endpoint
        self._trackers_lock = threading.Lock()
        self._prune_at = 64
        self._stopping = False
        self.stats = {"received": 0, "invalid": 0, "sent": 0, "send_errors": 0, "errors": 0, "disconnects": 0,
                      "connections": 0, "local_connections": 0}
        self._thread = threading.Thread(target=self._run, name=f"{name}-io", daemon=True)
        self._started = threading.Event()
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("zgossip I/O thread did not start")

    # ---------------------------------------------------------------- user-thread side
    def call(self, fn: Callable[[float], Any]) -> None:
        """Run ``fn(now)`` on the I/O thread (where the node lives)."""
        if self._stopping:
            raise RuntimeError("driver is stopped")
        self._commands.put(fn)
        with self._wake_lock:
            self._wake_out.send(b"", zmq.NOBLOCK)

    def run_on_io(self, fn: Callable[[Node, float], Any], timeout: float) -> Any:
        """Run ``fn(node, now)`` on the I/O thread and return its result (inline when called from
        that thread, e.g. from a result callback). Raises RuntimeError when the driver is stopped,
        concurrent.futures.TimeoutError after `timeout`."""
        if threading.current_thread() is self._thread:
            return fn(self.node, time.monotonic())
        import concurrent.futures as cf

        done: cf.Future = cf.Future()

        def run(now: float) -> None:
            try:
                done.set_result(fn(self.node, now))
            except BaseException as e:
                done.set_exception(e)

        self.call(run)
        return done.result(timeout)

    def sends_pending(self) -> bool:
        """True while a zero-copy payload handed to libzmq has not been transmitted yet."""
        with self._trackers_lock:
            self._trackers = [(t, ep) for t, ep in self._trackers if not t.done]
            return bool(self._trackers)

    def settle_sends(self, timeout: float, release_timeout: float = 5.0) -> int:
        """Wait (at most `timeout`) until libzmq released every zero-copy payload; then drop what is
        still queued by resetting the sockets to those peers (linger 0 discards their queues).

        A step that averaged the user's tensor in place calls this before handing the tensor back:
        bytes still waiting for a slow or dead peer must never leave later, after the user changed
        them. Such a peer simply misses those parts and, by the protocol's rules, leaves us out.
        `release_timeout` bounds the wait for libzmq to let go of the dropped payloads.
        Returns the number of sockets reset.
        """
        deadline = time.monotonic() + timeout
        with self._trackers_lock:
            pending = [(t, ep) for t, ep in self._trackers if not t.done]
        for t, _ in pending:
            if not _wait_released(t, deadline - time.monotonic()):
                break
        stuck = sorted({ep for t, ep in pending if not t.done})
        if not stuck or self._stopping:
            return 0
        done = threading.Event()

        def reset(now: float) -> None:
            try:
                for ep in stuck:
                    self._close_dealer(ep)
                    log.warning("zgossip node %s: dropped unsent data for %s (the step is over)", self.endpoint, ep)
            finally:
                done.set()

        self.call(reset)
        until = time.monotonic() + release_timeout
        done.wait(release_timeout)
        # closing is asynchronous in libzmq: only once it released the payloads has it stopped
        # reading them, so that the caller may change the tensor
        if not all(_wait_released(t, until - time.monotonic()) for t, _ in pending):
            log.warning("zgossip node %s: libzmq still holds parts of the tensor %.1f s after their "
                        "connections were closed", self.endpoint, release_timeout)
        return len(stuck)

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
        poller = self._poller
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        try:
            self._guard(self.node.start, time.monotonic())
            self._execute()
            self._started.set()
            while not self._stopping:
                now = time.monotonic()
                dl = self.node.next_deadline()
                wait_ms = 1000 if dl is None else min(1000, max(0, int((dl - now) * 1000) + 1))
                events = dict(poller.poll(wait_ms))
                if self._wake_in in events:
                    self._drain_commands()
                if self._router in events:
                    self._drain_router()
                if len(events) > (self._wake_in in events) + (self._router in events):
                    self._drain_monitors(events)
                now = time.monotonic()
                dl = self.node.next_deadline()
                if dl is not None and now >= dl:
                    self._guard(self.node.on_timer, now)
                self._execute()
                if _zsend is not None:
                    _zsend.reap()  # buffers libzmq finished with, whose senders already let go
        finally:
            self._started.set()
            for ep in {ep for ep, _ in self._dealers}:
                self._close_dealer(ep)
            self._router.close(0)
            self._wake_in.close(0)
            if _zsend is not None:
                _zsend.reap()

    def _guard(self, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # a bug must not take the node down: log it loudly and keep serving
            self.stats["errors"] += 1
            log.exception("zgossip node %s: internal error", self.endpoint)

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
            self._guard(fn, time.monotonic())
            self._execute()

    def _next_frames(self) -> Any:
        """The next message on the ROUTER without its routing id, or None when none is waiting."""
        if _zsend is not None:  # no zmq.Frame objects, no zmq.Again raised when the queue is empty
            frames = _zsend.recv(self._router_address, _INLINE_BYTES)
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
            self._guard(self.node.on_message, msg, time.monotonic())
            self._execute()

    def _dealer(self, endpoint: str, lane: int = 0) -> zmq.Socket:
        got = self._dealers.get((endpoint, lane))
        if got is not None:
            return got[0]
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop: payloads are zero-copy, queueing costs no copy
        mon = None
        if lane == 0:
            # a dropped connection (the peer's process died) is reported at once, so the protocol
            # need not wait out its timeouts: messages queued on a dropped connection may be lost.
            # (Lane 0 is the one every groupmate has; one report per peer is enough.)
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors[mon] = endpoint
            self._poller.register(mon, zmq.POLLIN)
        route = self._routes.get(endpoint)
        if route is None:
            route = self._routes[endpoint] = self._route(endpoint)
        sock.connect(route)
        self.stats["connections"] += 1
        if route != endpoint:
            self.stats["local_connections"] += 1
        self._dealers[(endpoint, lane)] = (sock, mon)
        return sock

    def _route(self, endpoint: str) -> str:
        """Where to connect for `endpoint`: the peer's local socket when it has one on this host."""
        name = local_name(endpoint) if self.local_ipc else None
        if name is None:
            return endpoint
        uid = _listener_uid(name)
        if uid is None:  # nobody listens under that name here: the peer is elsewhere (or older)
            return endpoint
        if uid != os.getuid():
            # abstract sockets have no permissions: only a listener of our own user is trusted
            # with the data (another user's could be squatting the name); TCP reaches the port's owner
            log.warning("zgossip node %s: local socket @%s belongs to uid %d, not to this user: using TCP",
                        self.endpoint, name, uid)
            return endpoint
        return "ipc://@" + name

    def route(self, endpoint: str) -> str | None:
        """The address this node connected to for `endpoint` (None before the first message)."""
        return self._routes.get(endpoint)

    def _close_dealer(self, endpoint: str) -> None:
        """Close every connection to `endpoint` (all lanes); whatever they still queued is dropped.
        The next connection looks for a local socket again (the peer may have restarted)."""
        self._routes.pop(endpoint, None)
        for lane in range(_LANES):
            got = self._dealers.pop((endpoint, lane), None)
            if got is None:
                continue
            sock, mon = got
            if mon is not None:
                self._poller.unregister(mon)
                self._monitors.pop(mon, None)
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
                mon.close(0)
            sock.close(0)

    def _drain_monitors(self, ready: dict) -> None:
        from zmq.utils.monitor import recv_monitor_message

        for mon, endpoint in list(self._monitors.items()):
            if mon not in ready:
                continue
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self.stats["disconnects"] += 1
                    self._guard(self.node.on_peer_down, endpoint, time.monotonic())
            self._execute()

    def _execute(self) -> None:
        shared: dict = {}  # one batch's encodings, by message object: see _transmit
        for act in self.node.take_actions():
            if isinstance(act, Send):
                self._transmit(act.endpoint, act.msg, shared)
            elif not isinstance(act, Disconnect):  # StepDone, StepFailed, ServeState, Download*: for the owner
                try:
                    self._on_result(act)
                except Exception:
                    log.exception("zgossip: result callback failed")
            elif isinstance(act, Disconnect):
                self._close_dealer(act.endpoint)

    def _encode(self, msg: wire.Message, shared: dict) -> tuple[list, bool]:
        """Frames for `msg`, and whether its payload goes zero-copy and tracked.

        The protocol sends one message object to several peers in a row (a RESULT to every
        contributor, a GROUP to every member): it is encoded once per batch, and its payload
        becomes one `zmq.Frame` that every send shares by reference count, so libzmq releases
        it once -- one wake-up of pyzmq's garbage-collector thread instead of one per peer.
        The batch's frames are dropped when the batch is done, so a tracker finishes as soon
        as libzmq has sent the last copy.
        """
        hit = shared.get(id(msg))
        if hit is not None and hit[0] is msg:
            return hit[1], hit[2]
        frames = wire.encode(msg)
        big = bool(msg.payload) and msg.payload[-1].nbytes >= _TRACK_BYTES
        if _zsend is not None:
            frames = tuple(f if isinstance(f, bytes) else _zsend.Payload(f) if f.nbytes >= _TRACK_BYTES
                           else f.tobytes() for f in frames)
        elif big:
            frames = [frames[0], *(zmq.Frame(a, copy=False, track=True) for a in frames[1:])]
        shared[id(msg)] = (msg, frames, big)
        return frames, big

    def _track(self, lent: list[tuple[Any, str]]) -> None:
        """Remember zero-copy payloads in flight (tracker, endpoint) until libzmq releases them."""
        if not lent:
            return
        with self._trackers_lock:
            self._trackers.extend(lent)
            if len(self._trackers) >= self._prune_at:
                # nobody may ask `sends_pending` for a long time (in-place steps never do):
                # drop finished trackers here so the list stays as short as what is in flight
                self._trackers = [(t, ep) for t, ep in self._trackers if not t.done]
                self._prune_at = max(64, 2 * len(self._trackers))

    def _transmit(self, endpoint: str, msg: wire.Message, shared: dict | None = None) -> None:
        try:
            frames, big = self._encode(msg, {} if shared is None else shared)
            sock = self._dealer(endpoint, _LANE.get(msg.type, 0))
            if _zsend is not None:
                try:
                    _zsend.send(sock.underlying, frames)
                except OSError:
                    self._close_dealer(endpoint)  # a multipart message may be cut short on that socket
                    raise
                self._track([(f, endpoint) for f in frames if isinstance(f, _zsend.Payload)])
            elif big:
                tracker = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False, track=True)
                if len(frames) > 2:  # several payload frames: pending until libzmq released them all
                    tracker = zmq.MessageTracker(*frames[1:])
                self._track([(tracker, endpoint)])
            else:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=len(frames) == 1)
            self.stats["sent"] += 1
        except (zmq.ZMQError, ValueError, OSError) as e:
            self.stats["send_errors"] += 1
            log.warning("zgossip node %s: could not send %s to %s: %s", self.endpoint, msg.type.name, endpoint, e)
