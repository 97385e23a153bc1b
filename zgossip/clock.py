"""Clocks: where code above the protocol takes its time and does its waiting.

The protocol never waits: it is handed ``now`` and says when it wants to run next. The code
above it -- the `Averager`, later the training classes -- does wait (for a step, for a lock,
for a helper thread), and it does so only through a `Clock`, so that the very same code runs
on the wall clock in production and in virtual time in the simulator (`sim.clock.VirtualClock`,
where simulated user threads take turns and virtual time moves only when all of them wait).

Everything a user-level component needs from the outside world in order to wait is here:
the time (monotonic, and the wall time peers compare), sleeping, waiting for a
`concurrent.futures.Future`, locks, thread-local storage
and small worker pools (an `Executor`). `WallClock` maps them onto `time.monotonic` and
`threading`; it is the default and costs nothing beyond a method call.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Any, Callable, ContextManager, Protocol

__all__ = ["Clock", "Lock", "Executor", "WallClock", "WALL_CLOCK"]


class Lock(ContextManager, Protocol):
    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...


class Executor(Protocol):
    """A worker that runs submitted functions (in order) off the caller's thread."""

    def submit(self, fn: Callable, *args: Any) -> cf.Future: ...

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None: ...


class Clock(Protocol):
    """Time and waiting. Every wait has a bound; ``timeout=None`` means none is wanted."""

    def now(self) -> float:
        """Seconds on this clock (monotonic; the origin means nothing)."""

    def wall_time(self) -> float:
        """Seconds since the Unix epoch, comparable between hosts (up to their clock offsets): for
        what peers must agree on without talking -- timestamps in gossiped records, schedules
        aligned to a period. In simulation every host reads the same virtual time."""

    def sleep(self, seconds: float) -> None: ...

    def result(self, fut: cf.Future, timeout: float | None = None) -> Any:
        """`fut.result(timeout)`: its value, or its exception raised, or `concurrent.futures.TimeoutError`."""

    def wait(self, fut: cf.Future, timeout: float | None = None) -> bool:
        """Wait (at most `timeout`) until `fut` is settled, without raising; whether it is."""

    def lock(self, reentrant: bool = False) -> Lock: ...

    def local(self) -> Any:
        """A fresh thread-local namespace (each user thread sees its own attributes)."""

    def executor(self, name: str) -> Executor:
        """A single worker for the owner's helper work (e.g. writing results back)."""


class WallClock:
    """The real clock: `time.monotonic`, `time.sleep`, `threading` locks, one OS thread per executor."""

    def now(self) -> float:
        return time.monotonic()

    def wall_time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def result(self, fut: cf.Future, timeout: float | None = None) -> Any:
        return fut.result(timeout)

    def wait(self, fut: cf.Future, timeout: float | None = None) -> bool:
        cf.wait([fut], timeout)
        return fut.done()

    def lock(self, reentrant: bool = False) -> Lock:
        return threading.RLock() if reentrant else threading.Lock()

    def local(self) -> Any:
        return threading.local()

    def executor(self, name: str) -> Executor:
        return cf.ThreadPoolExecutor(1, thread_name_prefix=name)


#: The process's wall clock (stateless; shared).
WALL_CLOCK = WallClock()
