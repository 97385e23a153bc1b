"""Peer identities: CURVE key pairs, key files, allow lists, and peer ids derived from keys.

A peer with a key pair is known by the hex form of its 32-byte CURVE public key
(`peer_id_of`), so its id is whatever its key is and no peer can claim another's id: the
ZeroMQ transport checks every message's sender against the key that authenticated its
connection. Keys are written in Z85 (ZeroMQ's 40-character text form).

Files (all plain text, ``#`` starts a comment):

* key file (``zgossip keygen FILE``), readable by its owner only -- loading it warns otherwise::

      public-key = <40 Z85 characters>
      secret-key = <40 Z85 characters>

  ``FILE.pub`` beside it holds the public key alone, as one allow-file line.
* allow file: one allowed public key per line, optionally followed by the endpoint where that
  peer listens (then ``initial_peers=["tcp://h:p"]`` finds its key)::

      rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7  tcp://10.0.0.5:41000   # host a
      Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID                          # host b

* an initial peer with a key: ``tcp://HOST:PORT#<Z85 public key>``.

Nothing here imports pyzmq at import time (`KeyPair` does when one is made or generated, to check
that its public key is its secret's): ``import zgossip`` stays light.
"""
from __future__ import annotations

import logging
import os
import stat
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .endpoints import check_endpoint

__all__ = ["KeyPair", "AllowList", "peer_id_of", "public_key_of", "z85_encode", "z85_decode", "split_peer",
           "is_key", "write_key_file", "load_key", "KeyFileWarning"]

log = logging.getLogger(__name__)

_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_INDEX = {c: i for i, c in enumerate(_Z85)}


class KeyFileWarning(UserWarning):
    """A secret key file others can read."""


def z85_encode(raw: bytes) -> str:
    if len(raw) % 4:
        raise ValueError("Z85 encodes multiples of 4 bytes")
    out = []
    for i in range(0, len(raw), 4):
        v = int.from_bytes(raw[i:i + 4], "big")
        chunk = []
        for _ in range(5):
            v, r = divmod(v, 85)
            chunk.append(_Z85[r])
        out.extend(reversed(chunk))
    return "".join(out)


def z85_decode(text: str) -> bytes:
    if len(text) % 5:
        raise ValueError("Z85 text must be a multiple of 5 characters")
    out = bytearray()
    for i in range(0, len(text), 5):
        v = 0
        for c in text[i:i + 5]:
            d = _Z85_INDEX.get(c)
            if d is None:
                raise ValueError(f"{c!r} is not a Z85 character")
            v = v * 85 + d
        if v >= 1 << 32:
            raise ValueError("Z85 group out of range")
        out += v.to_bytes(4, "big")
    return bytes(out)


def is_key(text: Any) -> bool:
    """Whether `text` is a 40-character Z85 key."""
    if not isinstance(text, str) or len(text) != 40:
        return False
    try:
        z85_decode(text)
    except ValueError:
        return False
    return True


def _check_key(text: Any, what: str, secret: bool = False) -> str:
    if not is_key(text):
        # a secret is never echoed (an exception message ends up in logs and terminals): only its length
        shown = (f"({len(text)} characters)" if isinstance(text, str) else f"(a {type(text).__name__})") if secret \
            else f"{text!r:.60}"
        raise ValueError(f"invalid {what} {shown}: expected 40 Z85 characters (as `zgossip keygen` writes)")
    return text


def peer_id_of(public_key: str) -> str:
    """The peer id of a peer holding this (Z85) public key: its 32 bytes in hex."""
    return z85_decode(_check_key(public_key, "public key")).hex()


def public_key_of(peer_id: str) -> str | None:
    """The Z85 public key a key-derived peer id stands for, or None if it is not one."""
    if not isinstance(peer_id, str) or len(peer_id) != 64:
        return None
    try:
        return z85_encode(bytes.fromhex(peer_id))
    except ValueError:
        return None


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair in Z85. ``repr`` never shows the secret."""

    public: str
    secret: str = field(repr=False)

    def __post_init__(self) -> None:
        _check_key(self.public, "public key")
        _check_key(self.secret, "secret key", secret=True)
        import zmq  # only here: the public key of a secret is libzmq's curve25519

        if zmq.curve_public(self.secret.encode()).decode() != self.public:
            # else every handshake of this peer fails, and only the other end says so ("a wrong key")
            raise ValueError(f"the secret key is not the one of public key {self.public}: the two belong to "
                             "different key pairs (write a fresh pair with `zgossip keygen FILE`)")

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public)

    @classmethod
    def generate(cls) -> "KeyPair":
        import zmq  # only here: generating needs libzmq's curve25519

        pub, sec = zmq.curve_keypair()
        return cls(pub.decode(), sec.decode())


def _fields(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, eq, v = line.partition("=")
        if eq and not k.strip().startswith("#"):
            v = v.strip()
            if v.startswith('"') and '"' in v[1:]:
                v = v[1:v.index('"', 1)]  # a quoted value (as keygen writes) may be followed by a comment
            out[k.strip()] = v.strip('"')
    return out


def _caller_level() -> int:
    """The `stacklevel` that attributes a warning raised in our caller to the first frame outside this
    package: the user's line (`Averager(secret_key=...)`), not zgossip's internals."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1  # our caller, the function that calls warnings.warn, is level 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        frame, level = frame.f_back, level + 1
    return level


def load_key(source: Any) -> KeyPair:
    """A `KeyPair` from a key file path (or a KeyPair). Warns (`KeyFileWarning`) when the file
    is readable by anyone but its owner."""
    if isinstance(source, KeyPair):
        return source
    path = Path(source)
    try:
        mode = path.stat().st_mode
    except OSError as e:
        if isinstance(source, str) and is_key(source):
            # a key itself (a secret key, most likely) where a file was expected: never echo it
            raise ValueError("the key file given is 40 Z85 characters, a key itself rather than a path: pass the "
                             "path of a key file (`zgossip keygen FILE`) or identity.KeyPair(public, secret)") from None
        raise ValueError(f"cannot read key file {path}: {e}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"cannot read key file {path}: not a file (write one with `zgossip keygen FILE`)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read key file {path}: {e}") from None
    f = _fields(text)
    if "secret-key" not in f or "public-key" not in f:
        raise ValueError(f"{path} is not a zgossip key file (needs 'public-key = ...' and 'secret-key = ...' lines; "
                         "write one with `zgossip keygen FILE`)")
    try:
        keys = KeyPair(f["public-key"], f["secret-key"])
    except ValueError as e:
        raise ValueError(f"key file {path}: {e}") from None
    # only a file that holds a secret is worth the warning (not FILE.pub given by mistake, not a directory)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.warn(f"key file {path} is readable by others (mode {stat.S_IMODE(mode):o}): anyone who reads it can "
                      f"join the swarm as this peer; run `chmod 600 {path}`", KeyFileWarning,
                      stacklevel=_caller_level())
    return keys


def write_key_file(path: Any, keys: KeyPair | None = None, overwrite: bool = False) -> KeyPair:
    """Write a key file readable by its owner only (created with mode 600, never widened), and
    ``PATH.pub`` with the public key as an allow-file line. Returns the key pair."""
    keys = keys or KeyPair.generate()
    path = Path(path)
    if path.is_dir():  # else "exists; not overwriting" (or with --force, EISDIR): neither says what to do
        raise ValueError(f"{str(path)!r} is a directory: give the path of the key file to write, e.g. "
                         f"{path / 'peer.key'}")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ValueError(f"{path} exists; not overwriting a key") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write("# zgossip key pair: keep this file private (mode 600)\n"
                f'public-key = "{keys.public}"\nsecret-key = "{keys.secret}"\n')
    Path(str(path) + ".pub").write_text(f"{keys.public}\n")
    return keys


def _is_peer_endpoint(text: str) -> bool:
    try:
        check_endpoint(text)
    except ValueError:
        return False
    return True


def split_peer(spec: str) -> tuple[str, str | None]:
    """``tcp://h:p#KEY`` -> (``tcp://h:p``, KEY); an address without ``#`` -> (address, None)."""
    if not isinstance(spec, str) or "#" not in spec:
        return spec, None
    ep, _, key = spec.partition("#")  # an address never holds "#"; a Z85 key may
    return ep, _check_key(key, f"public key in {spec!r:.80}")


class AllowList:
    """The public keys a peer accepts connections and messages from, by peer id; optionally the
    endpoints some of them listen at. Changing it at run time (`allow`, `revoke`) takes effect
    for the next message: a revoked peer's messages are dropped from then on."""

    def __init__(self, keys: Iterable[str] = (), endpoints: dict[str, str] | None = None) -> None:
        self.ids: set[str] = {peer_id_of(k) for k in keys}
        self.endpoints: dict[str, str] = dict(endpoints or {})  # endpoint -> peer id
        self.version = 0

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def allow(self, public_key: str) -> None:
        self.ids.add(peer_id_of(public_key))
        self.version += 1

    def revoke(self, public_key: str) -> None:
        self.ids.discard(peer_id_of(public_key))
        self.version += 1

    @classmethod
    def parse(cls, text: str, where: str = "allow list") -> "AllowList":
        keys, eps = [], {}
        for n, raw in enumerate(text.splitlines(), 1):
            fields = raw.split()
            if not fields or (fields[0].startswith("#") and not is_key(fields[0])):
                continue  # blank or a comment line (a key may itself hold '#': Z85 has it)
            key, rest = fields[0], []
            for f in fields[1:]:
                if f.startswith("#"):
                    break
                rest.append(f)
            if not is_key(key):
                raise ValueError(f"{where}, line {n}: {key!r:.60} is not a public key (40 Z85 characters)")
            keys.append(key)
            if rest:
                if len(rest) > 1 or not _is_peer_endpoint(rest[0]):  # "tcp://h" was kept, matching no peer
                    raise ValueError(f"{where}, line {n}: after the key, expected one endpoint tcp://HOST:PORT, "
                                     f"e.g. tcp://10.0.0.5:41000, not {' '.join(rest)!r:.80}")
                eps[rest[0]] = peer_id_of(key)
        return cls(keys, eps)

    @classmethod
    def of(cls, spec: Any) -> "AllowList":
        """From an `AllowList`, a path to an allow file, or an iterable of Z85 keys (each may
        carry an endpoint as ``KEY tcp://h:p``)."""
        if isinstance(spec, AllowList):
            return spec
        if isinstance(spec, (str, os.PathLike)) and not is_key(spec):
            path = Path(spec)
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read allow file {path}: {e}") from None
            return cls.parse(text, str(path))
        if isinstance(spec, str):
            spec = [spec]
        return cls.parse("\n".join(spec))
