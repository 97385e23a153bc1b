"""Endpoint addresses: checking what users type, and choosing the address a node advertises.

Pure address logic (plus two read-only look-ups of this host's routes and interfaces); it
opens no connection and does not import pyzmq, so the `Averager` can validate its arguments
before any transport exists.
"""
from __future__ import annotations

import functools
import logging
import re
import socket
from typing import Any, Callable, Collection, Sequence

__all__ = ["check_endpoint", "advertised_host", "advertised", "CLIENT_SCHEME", "client_endpoint", "listens",
           "reachable", "peer_check"]

#: The endpoint of a peer in client mode (it listens nowhere): ``client://<peer id>``. Peers never
#: connect to it; they answer such a peer on the connection it opened (`zgossip.zmq_driver`).
CLIENT_SCHEME = "client://"
#: seconds a message waits for a client (`CLIENT_SCHEME`) that has not opened a connection yet before
#: it is dropped (counted in stats["unreachable"]): a client silent that long is not coming for it (a
#: lying GROUP can name clients that never will). Both drivers apply it.
CLIENT_BACKLOG_TTL = 30.0


def client_endpoint(peer_id: str) -> str:
    return CLIENT_SCHEME + peer_id


def listens(endpoint: str) -> bool:
    """Whether peers can connect to `endpoint` (False for a client-mode peer)."""
    return not endpoint.startswith(CLIENT_SCHEME)

log = logging.getLogger(__name__)


def _plain_name(text: str, max_len: int = 200) -> bool:
    # isprintable() refuses every Unicode separator but the ASCII space
    return 0 < len(text) <= max_len and text.isprintable() and " " not in text


def reachable(endpoint: Any, schemes: Collection[str] = ("tcp",)) -> bool:
    """Whether `endpoint`, as a peer sent it, names a place a node may send to: ``client://ID``
    (answered on the connection that client opened), ``tcp://HOST:PORT`` in `check_endpoint`'s
    peer form, or ``SCHEME://NAME`` for another scheme `schemes` lists (the simulator's
    ``sim://peerN``). Anything else -- "nonsense", a port out of range, ``ipc://`` or
    ``inproc://`` (which would make this process connect to its own sockets) -- is refused: an
    endpoint comes from the network, and nothing should be opened for it (each connection costs
    file descriptors)."""
    if not isinstance(endpoint, str):
        return False
    return _reachable(endpoint, schemes if type(schemes) is tuple else tuple(schemes))


@functools.lru_cache(maxsize=1 << 14)
def _reachable(endpoint: str, schemes: tuple[str, ...]) -> bool:
    """`reachable`, remembered: every node checks each endpoint it hears of, and the simulator's
    thousand nodes share one process (bounded: a flood of made-up endpoints only evicts)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme == "client":
        return _plain_name(rest, 64)
    if scheme not in schemes:
        return False
    if scheme == "tcp":
        try:
            check_endpoint(endpoint)
        except ValueError:
            return False
        return True
    return _plain_name(rest)


def peer_check(own: str, initial_peers: Sequence[str] = ()) -> Callable[[str], bool]:
    """`reachable` for a node at `own`: TCP, and the schemes it listens on and its initial peers use."""
    schemes = {"tcp"} | {ep.partition("://")[0] for ep in (own, *initial_peers) if "://" in ep and listens(ep)}
    frozen = tuple(sorted(schemes))
    return lambda endpoint: reachable(endpoint, frozen)


_HOST = re.compile(r"[A-Za-z0-9._-]+")
_IPV6_HOST = re.compile(r"\[[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?\]")


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
        host_ok = _IPV6_HOST.fullmatch(host) is not None
    else:
        # a host name, an IPv4 address or (to listen) an interface name or "*": nothing else. A "#"
        # (it starts the key in HOST:PORT#KEY), a newline or other control character was accepted
        host_ok = _HOST.fullmatch(host) is not None or (listen and host == "*")
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


def advertised(endpoint: str, announce_host: str | None, initial_peers: Sequence[str] = ()) -> str:
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, port = endpoint[6:].rsplit(":", 1)
    if announce_host:
        host = announce_host
    elif host in ("0.0.0.0", "*"):
        host = advertised_host(initial_peers)
    return f"tcp://{host}:{port}"
