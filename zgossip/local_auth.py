"""Authentication without encryption on the local Unix sockets of peers with keys.

Between peers on one host (`zgossip.local_ipc`) CURVE's encryption protects nothing: the only
parties that can read a Unix socket's traffic are its two ends, root, and processes that may
ptrace one end (the same user) -- and each of those can read the secret key file or the
process memory directly. It cost a lot (the 4-peer bench took 4.3x the plain step with CURVE
on, most of it encrypting loopback bytes). What must still hold is *authentication*: a
connection speaks for exactly one allowed key, so revocation and "ids are keys" stay true
on the local path. So, on a node with keys, the local socket is a separate ROUTER with
ZeroMQ's PLAIN mechanism, and each connection is admitted by the node's ZAP handler when

1. the connecting process runs as the node's own user (SO_PEERCRED, which libzmq puts in the
   ZAP request's address as ``:uid:gid:pid``) -- the client checks the same of the listener
   before it connects (`local_ipc.LocalRoutes.route`), so plaintext only ever flows between
   two processes of one user;
2. its PLAIN user name is its peer id (its public key) and that key is on the allow list;
3. its PLAIN password proves it holds that key's secret: an HMAC-SHA256, under the X25519
   shared secret of the client's and the server's keys, of both public keys (`proof`). Only
   the two key holders can compute that secret; the proof names the server, so it is worth
   nothing to any other peer, and the only process that ever receives it is the listener the
   client already verified as its own user.

The proof is static per pair of keys (ZeroMQ reconnects with the same credentials, so it
cannot carry a timestamp): replaying it needs a copy of it, i.e. root or the same user, who
could read the key instead. The server does not prove its key to the client: the client only
*sends* on such a connection (what it receives comes through its own ROUTER, authenticated
there), except in client mode, where answers come back on the client's connections -- so a
client-mode node with keys never takes the local path (CURVE over TCP).

X25519 comes from the libsodium that pyzmq's wheel bundles (the same code libzmq's CURVE
runs), loaded with ctypes; where it cannot be found, `available` is False and peers with keys
use CURVE over TCP between local peers, as before.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import hashlib
import hmac
import os
from pathlib import Path

from .identity import KeyPair, public_key_of, z85_decode

__all__ = ["available", "proof", "verify", "peer_uid", "MECHANISM"]

MECHANISM = b"PLAIN"
_LABEL = b"zgossip local-ipc key proof v1"


@functools.lru_cache(maxsize=1)
def _sodium() -> ctypes.CDLL | None:
    try:
        import zmq
    except ImportError:  # pragma: no cover - zgossip's transport needs pyzmq anyway
        return None
    here = Path(zmq.__file__).resolve().parent.parent
    candidates = sorted(glob.glob(str(here / "pyzmq.libs" / "libsodium*.so*")))
    found = ctypes.util.find_library("sodium")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            if lib.sodium_init() < 0:
                continue
            lib.crypto_scalarmult.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]
            lib.crypto_scalarmult.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def available() -> bool:
    """Whether key proofs can be made here (libsodium found) and local ipc may go unencrypted."""
    return os.environ.get("ZGOSSIP_LOCAL_PLAIN", "1") != "0" and _sodium() is not None


def _shared(secret: bytes, public: bytes) -> bytes | None:
    lib = _sodium()
    if lib is None or len(secret) != 32 or len(public) != 32:
        return None
    out = ctypes.create_string_buffer(32)
    # non-zero for a low-order public key (an all-zero shared secret): such a key proves nothing
    if lib.crypto_scalarmult(out, secret, public) != 0:
        return None
    return out.raw


def _tag(shared: bytes, client_pub: bytes, server_pub: bytes) -> bytes:
    return hmac.new(shared, _LABEL + client_pub + server_pub, hashlib.sha256).hexdigest().encode()


def proof(keys: KeyPair, server_id: str) -> bytes:
    """The PLAIN password with which `keys` connects to the peer `server_id` over its local socket."""
    server_pub = bytes.fromhex(server_id)
    shared = _shared(z85_decode(keys.secret), server_pub)
    if shared is None:
        raise ValueError(f"cannot make a key proof for {server_id[:16]}")
    return _tag(shared, z85_decode(keys.public), server_pub)


def verify(keys: KeyPair, client_id: str, password: bytes) -> bool:
    """Whether `password` proves that whoever sent it holds the secret of `client_id`."""
    if public_key_of(client_id) is None:
        return False
    client_pub = bytes.fromhex(client_id)
    shared = _shared(z85_decode(keys.secret), client_pub)
    if shared is None:
        return False
    return hmac.compare_digest(_tag(shared, client_pub, z85_decode(keys.public)), password)


def peer_uid(zap_address: str) -> int | None:
    """The uid libzmq put in a ZAP request's address for a Unix socket (``host:uid:gid:pid``), or
    None when it carries none (not a Unix socket, or no SO_PEERCRED)."""
    parts = zap_address.split(":")
    if len(parts) < 4:
        return None
    try:
        return int(parts[-3])
    except ValueError:
        return None
