"""Entering a Linux network namespace from inside a process (for benchmarks whose processes each run
on one emulated host of `sim.testbed`; the library itself never changes namespace)."""
from __future__ import annotations

import os

__all__ = ["enter_netns"]

_CLONE_NEWNET = 0x40000000


def enter_netns(name: str) -> None:
    """Move this process into the network namespace `name` (``/var/run/netns/NAME``, as ``ip netns``
    makes them). Call it before anything starts a thread: a namespace belongs to the calling thread,
    and only threads started afterwards inherit it."""
    path = f"/var/run/netns/{name}"
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, _CLONE_NEWNET)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)
