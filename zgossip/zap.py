"""ZAP: libzmq asks this handler whether a CURVE client's key may connect (ZeroMQ RFC 27).

A CURVE server socket proves to each client that it holds the key the client expected, and
learns the client's public key in the handshake; whether that key is welcome is libzmq's
question to the ZAP handler bound at ``inproc://zeromq.zap.01`` of the socket's context.
There is one such endpoint per context, and every zgossip node of a process shares one
context (`zgossip.process_tuning.context`), so this module runs one handler thread per
context and each node registers its ROUTER's ZAP domain with its own `Gate`. The thread
only answers ZAP requests (a set look-up each); node sockets stay on their I/O threads.

An allowed key gets status 200 and its peer id as the ZAP user id, which libzmq attaches to
every message of that connection ("User-Id"): the transport checks each message's sender
against it. A refused key gets 400 and never reaches the protocol: its handshake fails, it
receives nothing and nothing it sends is read. Each refused key is logged once per node and
counted every time (`stats["refused"]`).

A node with keys also listens on its local Unix socket with the PLAIN mechanism
(`zgossip.local_auth`: authenticated, not encrypted); those requests carry the client's peer
id as user name and a proof of its secret key as password, and are admitted only from a
process of this node's own user. Refusals are counted and logged the same way.
"""
from __future__ import annotations

import logging
import os
import threading

import zmq

from . import local_auth
from .droplog import OncePer
from .identity import AllowList, KeyPair

__all__ = ["Gate", "register", "unregister"]

log = logging.getLogger(__name__)

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class Gate:
    """One node's admission policy: its allow list, counters and log-once memory."""

    def __init__(self, allowed: AllowList, name: str, stats: dict, keys: KeyPair | None = None) -> None:
        self.allowed, self.name, self.stats, self.keys = allowed, name, stats, keys
        # one line per refused key, for a bounded number of keys (anyone can make fresh keys by the
        # thousand; a single cap over all of them let such a flood silence every later refusal)
        self._once = OncePer(log, f"zgossip node {name}")

    def admit(self, client_key: bytes, address: str) -> str | None:
        """The peer id for an allowed key; None (after counting, and logging once) otherwise."""
        pid = client_key.hex()
        if pid in self.allowed:
            return pid
        return self._refuse(pid, f"refused a connection from {address or 'a local socket'} with key {pid[:16]}: "
                                 "not on the allow list")

    def admit_local(self, user: bytes, password: bytes, address: str) -> str | None:
        """The peer id of a PLAIN connection to the local socket (`zgossip.local_auth`), or None."""
        uid = local_auth.peer_uid(address)
        if uid is None or uid != os.getuid():
            return self._refuse(f"uid:{uid}", f"refused a connection on the local socket from uid {uid}: only processes of this "
                                              "user may use the unencrypted local socket")
        pid = user.decode(errors="replace")
        if self.keys is None or not local_auth.verify(self.keys, pid, password):
            return self._refuse(f"proof:{pid}", f"refused a connection on the local socket claiming key {pid[:16]}: its key proof "
                                                "is wrong (it does not hold that key)")
        if pid not in self.allowed:
            return self._refuse(pid, f"refused a connection on the local socket with key {pid[:16]}: not on the allow list")
        return pid

    def _refuse(self, key: str, text: str) -> None:
        self.stats["refused"] = self.stats.get("refused", 0) + 1
        kind = f"refused connection ({key.partition(':')[0] if ':' in key else 'key'})"
        if self._once.first(key, kind, "refused"):
            log.warning("zgossip node %s: %s (further attempts are only counted in stats['refused'])",
                        self.name, text)
        return None


class _Handler:
    def __init__(self, ctx: zmq.Context) -> None:
        self.gates: dict[str, Gate] = {}
        self.lock = threading.Lock()
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(_ZAP_ENDPOINT)
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="zgossip-zap", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock = self.sock
        try:
            while not self.stop:
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                try:
                    answer = self._answer(frames)
                except Exception:
                    # a bug here must neither admit that key nor end the thread: without a handler
                    # libzmq would admit every key (and the connections' messages, with no user id,
                    # would all be dropped as unauthenticated)
                    log.exception("zgossip ZAP handler: internal error; the connection was refused")
                    answer = [frames[0] if frames else b"1.0", frames[1] if len(frames) > 1 else b"", b"500",
                              b"internal error", b"", b""]
                sock.send_multipart(answer)
        except zmq.ContextTerminated:
            pass
        finally:
            try:
                # an inproc unbind takes effect at once, a close only when libzmq's reaper gets to it: a
                # handler started right after (the next keyed node) would find the endpoint still bound
                sock.unbind(_ZAP_ENDPOINT)
            except zmq.ZMQError:
                pass
            sock.close(0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _routing_id, mechanism = frames[:6]
        creds = frames[6:]

        def reply(code: bytes, text: bytes, user: str = "") -> list[bytes]:
            return [version, request_id, code, text, user.encode(), b""]

        with self.lock:
            gate = self.gates.get(domain.decode(errors="replace"))
        if gate is None:
            return reply(b"400", b"no zgossip node for this domain")
        where = address.decode(errors="replace")
        if mechanism == local_auth.MECHANISM and len(creds) == 2:
            pid = gate.admit_local(creds[0], creds[1], where)
        elif mechanism != b"CURVE" or len(creds) != 1 or len(creds[0]) != 32:
            return reply(b"400", b"zgossip peers speak CURVE")
        else:
            pid = gate.admit(creds[0], where)
        return reply(b"200", b"OK", pid) if pid is not None else reply(b"400", b"key not allowed")


_handlers: dict[int, _Handler] = {}
_lock = threading.Lock()


def register(ctx: zmq.Context, domain: str, gate: Gate) -> None:
    """Route ZAP requests for `domain` (a ROUTER's ``ZAP_DOMAIN``) to `gate`; starts the context's
    handler on first use."""
    with _lock:
        h = _handlers.get(id(ctx))
        if h is None or h.stop or not h.thread.is_alive():
            h = _handlers[id(ctx)] = _Handler(ctx)
        with h.lock:
            h.gates[domain] = gate


def unregister(ctx: zmq.Context, domain: str) -> None:
    """Forget `domain`; the handler thread ends with the last one (and unbinds the ZAP endpoint)."""
    with _lock:
        h = _handlers.get(id(ctx))
        if h is None:
            return
        with h.lock:
            h.gates.pop(domain, None)
            last = not h.gates
        if last:
            h.stop = True
            h.thread.join(2)
            del _handlers[id(ctx)]
