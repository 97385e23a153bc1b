"""Process-wide settings a ZeroMQ node needs: the shared ZeroMQ context and malloc tuning.

Both act on the whole process, not on one node, so they live here rather than in the
transport; both are applied once, when the first ZeroMQ transport starts. Also the OS name of
the transport's I/O thread (`name_this_thread`), so that per-thread CPU counters, perf and
``top -H`` tell it from the user's threads.
"""
from __future__ import annotations

import ctypes
import os
import threading

import zmq

__all__ = ["context", "tune_malloc", "malloc_tuned", "name_this_thread"]

_malloc_tuned = False
_ctx_lock = threading.Lock()
_ctx: zmq.Context | None = None


def context() -> zmq.Context:
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
    done once, when the first transport starts; ``ZGOSSIP_TUNE_MALLOC=0`` turns it off.
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


def malloc_tuned() -> bool:
    """Whether `tune_malloc` changed this process's malloc settings."""
    return _malloc_tuned


def name_this_thread(name: str) -> bool:
    """Give the calling thread an OS-level name (Linux: at most 15 bytes, shown by /proc/PID/task/
    TID/comm, perf and top). Python's thread names stay inside the interpreter; without this the
    I/O thread reads "python" like the user's. Returns whether the name was set."""
    try:
        libc = ctypes.CDLL(None)
        pr_set_name = 15  # from linux/prctl.h
        return libc.prctl(pr_set_name, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux, or no prctl: the counters just say "python"
        return False
