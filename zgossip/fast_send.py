"""Loading zgossip's C sender (`zgossip._zsend`), bound to the libzmq that pyzmq loaded.

pyzmq lends a buffer to libzmq zero-copy by way of its garbage-collector thread: libzmq's
free function posts to that thread, which takes the GIL to drop the reference and set the
tracker. `_zsend` lends the buffer with a free function that only decrements an atomic
counter; the I/O thread releases finished buffers itself (`reap`). On the 4-peer bench
that spared the release thread's wake-ups and GIL hand-overs, and the MessageTracker and
events of every send (~3%). It also receives: a whole message per call, large frames as
read-only buffers over libzmq's own memory, and None rather than an exception when nothing
is waiting (~1 µs against pyzmq's ~6 µs per message; ~2% less CPU on the bench).

Linux only (the library's path comes from /proc/self/maps); ``ZGOSSIP_FAST_SEND=0`` or any
mismatch (no build, another libzmq version) falls back to pyzmq. Imported only when a ZeroMQ
transport is created: ``import zgossip`` loads neither pyzmq nor the C sender.
"""
from __future__ import annotations

import os
from typing import Any

import zmq

__all__ = ["zsend", "FAST_SEND", "load"]

_API = 2  # the `_zsend.API` this module needs (2: recv reads two message properties)


def load() -> Any:
    """The `_zsend` module, loaded against pyzmq's libzmq, or None (then pyzmq sends)."""
    if os.environ.get("ZGOSSIP_FAST_SEND", "1") == "0":
        return None
    try:
        from . import _zsend  # type: ignore[attr-defined]
    except ImportError:
        return None
    if getattr(_zsend, "API", 0) < _API:  # a stale build (rebuild with setup.py build_ext): pyzmq instead
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


#: The C sender, or None. Transports read it when they start (tests set it to None to force pyzmq).
zsend = load()
#: True when zero-copy payloads go out through `_zsend` rather than pyzmq.
FAST_SEND = zsend is not None
