"""`VirtualClock`: blocking user code in virtual time, deterministically.

User code blocks: a training loop calls ``avg.step()``, which waits for the round. To run that
code unchanged in the simulator, each simulated user thread is a real OS thread, but only one
of them runs at a time: it holds the *baton*. Everything else -- the SimPy event loop (the
*scheduler*, in whatever thread calls ``env.run``) and every other simulated thread -- waits
on its own semaphore until the baton is handed to it. So:

* A simulated thread runs until it waits on the clock (`result`, `sleep`, a contended `lock`)
  or ends; then it hands the baton back to whoever handed it over. Nothing else runs meanwhile,
  so there are no races, and virtual time does not move while it runs.
* A wait registers its wake-up as a SimPy event (a timeout, or a zero-delay event when the
  awaited future is settled), so wake-ups are ordered by (virtual time, event sequence), the
  same order SimPy gives everything else: one seed gives one trace.
* Virtual time advances only when every simulated thread is blocked in a clock wait -- that is
  the only time the scheduler holds the baton and SimPy can pop the next event.

When a simulation is done with, `VirtualClock.close` ends every OS thread it made: idle pooled
ones, and threads still parked in a clock wait (a worker waiting for work, a user thread the run
left blocked), whose wait then raises `SimulationClosed` so their code unwinds. Each parked thread
held the whole simulation (its clock, the environment, every peer and tensor) for the life of
the process: a notebook running scenario after scenario grew by every run's peers.

`spawn` starts a user thread at the current virtual time (in event order); an `executor`
(the `Averager`'s apply and serve workers) runs each task at once on a pooled thread, which
returns the baton when the task ends -- so a task that never waits costs no virtual time and
behaves exactly as if run inline, and one that waits (a contended lock) waits in virtual time.
OS threads are pooled: a simulation needs as many as simulated threads are blocked at once.

Waiting from the scheduler itself (e.g. ``avg.step()`` called between two ``env.run`` calls,
outside any simulated thread) cannot work -- nothing would ever advance time -- and raises
`WouldBlock`; non-blocking calls (``step(wait=False)``, futures that are already settled) work
from anywhere.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import threading
from collections import deque
from typing import Any, Callable

import simpy

__all__ = ["VirtualClock", "SimThread", "WouldBlock", "SimulationClosed"]

log = logging.getLogger(__name__)


class WouldBlock(RuntimeError):
    """A clock wait outside a simulated thread: it would block the simulation itself."""


class SimulationClosed(BaseException):
    """Raised in a simulated thread's clock wait when its simulation was closed (`VirtualClock.close`):
    nothing will ever wake it. A BaseException, like SystemExit, so that code catching Exception
    unwinds instead of waiting again."""


class _Runner:
    """One OS thread that runs simulated work only while it holds the baton."""

    def __init__(self, clock: "VirtualClock | None", name: str) -> None:
        self.clock = clock
        self.name = name
        self.sem = threading.Semaphore(0)
        self.resumer: _Runner | None = None  # who handed us the baton: we hand it back there
        self.job: Callable[[], None] | None = None
        self.token: object | None = None  # the wait in progress; a wake-up with another token is stale
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        clock = self.clock
        assert clock is not None
        clock._tls.runner = self
        while True:
            self.sem.acquire()
            job, self.job = self.job, None
            if job is None:
                return
            try:
                job()
            except SimulationClosed:
                pass  # (its simulation was closed while it waited: `VirtualClock.close`)
            finally:
                clock._job_done(self)
            if clock._closed:
                return


class SimThread:
    """A simulated user thread: `future` holds its return value (or exception); `done` is a SimPy
    event that succeeds with it (or fails: an exception nobody waits for stops the simulation)."""

    def __init__(self, env: simpy.Environment, name: str) -> None:
        self.name = name
        self.future: cf.Future = cf.Future()
        self.done = env.event()


class _Lock:
    """A lock whose contended `acquire` waits in virtual time."""

    def __init__(self, clock: "VirtualClock", reentrant: bool) -> None:
        self._clock = clock
        self._reentrant = reentrant
        self._owner: _Runner | None = None
        self._count = 0
        self._waiters: deque[cf.Future] = deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = self._clock._holder
        if self._owner is None:
            self._owner, self._count = me, 1
            return True
        if self._reentrant and self._owner is me:
            self._count += 1
            return True
        if not blocking:
            return False
        end = None if timeout is None or timeout < 0 else self._clock.now() + timeout
        while self._owner is not None:
            turn: cf.Future = cf.Future()
            self._waiters.append(turn)
            try:
                self._clock.result(turn, None if end is None else max(0.0, end - self._clock.now()))
            except cf.TimeoutError:
                if turn in self._waiters:
                    self._waiters.remove(turn)
                return False
        self._owner, self._count = me, 1
        return True

    def release(self) -> None:
        if self._owner is None:
            raise RuntimeError("release unlocked lock")
        self._count -= 1
        if self._count:
            return
        self._owner = None
        if self._waiters:
            self._waiters.popleft().set_result(None)  # the first waiter tries again (FIFO)

    def locked(self) -> bool:
        return self._owner is not None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class _Executor:
    """One worker, as `ThreadPoolExecutor(1)`: tasks run in order, each at once when the worker is free."""

    def __init__(self, clock: "VirtualClock", name: str) -> None:
        self._clock = clock
        self._name = name
        self._queue: deque[tuple[cf.Future, Callable, tuple]] = deque()
        self._busy = False
        self._closed = False

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> cf.Future:
        if self._closed:
            raise RuntimeError("cannot schedule new futures after shutdown")
        fut: cf.Future = cf.Future()
        self._queue.append((fut, functools.partial(fn, **kwargs) if kwargs else fn, args))
        if not self._busy:
            self._busy = True
            self._clock._run_now(self._drain, self._name)
        return fut

    def _drain(self) -> None:
        try:
            while self._queue:
                fut, fn, args = self._queue.popleft()
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:
                    fut.set_exception(e)
        finally:
            self._busy = False

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self._closed = True
        if cancel_futures:
            while self._queue:
                self._queue.popleft()[0].cancel()


class VirtualClock:
    """A `zgossip.clock.Clock` in the virtual time of `env` (see the module docstring)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self._scheduler = _Runner(None, "scheduler")  # whatever thread runs env.run
        self._holder = self._scheduler  # who holds the baton
        self._idle: list[_Runner] = []
        self._runners: list[_Runner] = []  # every OS thread made (pooled: a few per simulation)
        self._closed = False
        self._tls = threading.local()
        self._made = 0
        self.switches = 0

    # ------------------------------------------------------------------ Clock
    def now(self) -> float:
        return self.env.now

    def wall_time(self) -> float:
        """Every simulated host reads the same clock: no offsets between hosts."""
        return self.env.now

    def sleep(self, seconds: float) -> None:
        me = self._me("sleep")
        token = me.token = object()
        self._wake_after(me, token, max(0.0, seconds))
        self._park(me)

    def result(self, fut: cf.Future, timeout: float | None = None) -> Any:
        if fut.done():
            return fut.result()
        me = self._me("wait for a future")
        token = me.token = object()
        fut.add_done_callback(lambda _f: self._wake_after(me, token, 0.0))
        if timeout is not None:
            self._wake_after(me, token, max(0.0, timeout))
        self._park(me)
        if fut.done():
            return fut.result()
        raise cf.TimeoutError()

    def wait(self, fut: cf.Future, timeout: float | None = None) -> bool:
        if fut.done():
            return True
        me = self._me("wait for a future")
        token = me.token = object()
        fut.add_done_callback(lambda _f: self._wake_after(me, token, 0.0))
        if timeout is not None:
            self._wake_after(me, token, max(0.0, timeout))
        self._park(me)
        return fut.done()

    def lock(self, reentrant: bool = False) -> _Lock:
        return _Lock(self, reentrant)

    def local(self) -> Any:
        return threading.local()

    def executor(self, name: str) -> _Executor:
        return _Executor(self, name)

    # ------------------------------------------------------------------ simulated threads
    def spawn(self, fn: Callable, *args: Any, name: str = "sim-thread") -> SimThread:
        """Start ``fn(*args)`` as a simulated user thread at the current virtual time."""
        if self._closed:
            raise SimulationClosed(f"cannot spawn {name}: the simulation was closed")
        th = SimThread(self.env, name)

        def body() -> None:
            try:
                value = fn(*args)
            except BaseException as e:
                th.future.set_exception(e)
                th.done.fail(e)
            else:
                th.future.set_result(value)
                th.done.succeed(value)

        start = self.env.timeout(0)
        start.callbacks.append(lambda _e: self._run_now(body, name))
        return th

    def in_simulated_thread(self) -> bool:
        return getattr(self._tls, "runner", None) is not None

    def close(self, timeout: float = 5.0) -> None:
        """End every OS thread this clock made: the idle ones stop; one still parked in a clock wait
        gets `SimulationClosed` raised there, one at a time (no two run at once, as in the simulation),
        and each is waited for (up to `timeout` seconds; one that does not end is logged and left).
        Only once nothing runs the simulation any more: after its last ``env.run``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._idle = []
        for r in self._runners:
            if r.thread is None or not r.thread.is_alive():
                continue
            r.job = None  # (an idle runner ends; a parked one raises in its wait)
            r.sem.release()
            r.thread.join(timeout)
            if r.thread.is_alive():
                log.warning("simulated thread %s did not end within %.0f s of its simulation's close: left running "
                            "(it keeps that simulation in memory)", r.name, timeout)
        self._runners = []

    # ------------------------------------------------------------------ the baton
    def _me(self, what: str) -> _Runner:
        if self._closed:
            raise SimulationClosed(f"cannot {what}: the simulation was closed")
        me = getattr(self._tls, "runner", None)
        if me is None:
            raise WouldBlock(f"cannot {what} outside a simulated thread: that would block the simulation "
                             "(run the blocking code in VirtualClock.spawn)")
        return me

    def _switch(self, target: _Runner) -> None:
        """Hand the baton to `target` and wait until it comes back to us."""
        me = self._holder
        target.resumer = me
        self._holder = target
        self.switches += 1
        target.sem.release()
        me.sem.acquire()

    def _park(self, me: _Runner) -> None:
        """Give the baton back to whoever handed it to us; return when a wake-up hands it over again."""
        back = me.resumer
        assert back is not None and self._holder is me
        self._holder = back
        back.sem.release()
        me.sem.acquire()
        if self._closed:
            raise SimulationClosed("the simulation was closed while this simulated thread waited")

    def _wake_after(self, me: _Runner, token: object, delay: float) -> None:
        ev = self.env.timeout(delay)
        ev.callbacks.append(lambda _e: self._wake(me, token))

    def _wake(self, me: _Runner, token: object) -> None:
        if me.token is not token:
            return  # woken already (the future settled before the timeout, or the other way round)
        me.token = None
        self._switch(me)

    def _run_now(self, job: Callable[[], None], name: str) -> None:
        """Run `job` on a pooled thread now, until it ends or waits."""
        if self._closed:
            raise SimulationClosed(f"cannot start {name}: the simulation was closed")
        runner = self._idle.pop() if self._idle else None
        if runner is None:
            self._made += 1
            runner = _Runner(self, f"{name}-{self._made}")
            self._runners.append(runner)
            runner.start()
        runner.job = job
        self._switch(runner)

    def _job_done(self, runner: _Runner) -> None:
        if self._closed:
            return  # unwound by `close`: no baton to hand back, nobody to resume
        back = runner.resumer
        assert back is not None and self._holder is runner
        self._idle.append(runner)
        self._holder = back
        back.sem.release()
