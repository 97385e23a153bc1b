"""A swarm of local peer processes, each running one `Averager`, driven from the parent.

Used by ``zgossip demo``, ``zgossip bench`` and the multi-process tests. Each child
builds its tensor from ``seed + index`` (so the parent can compute the true mean
without shipping data), binds tcp on loopback with an ephemeral port, bootstraps
from peer 0 (or from `initial_peers`), and then serves commands over a pipe. Every
wait is bounded; `close` stops every child it started, killing the ones that do not
stop in time.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

__all__ = ["LocalSwarm", "peer_data", "proc_memory", "start_child", "stop_children"]


@contextlib.contextmanager
def _ctrl_c_held() -> Any:
    """Block SIGINT in this thread while child processes start: they inherit the mask through
    fork and exec and keep it, so a Ctrl-C at the terminal (sent to the whole foreground process
    group) reaches only the parent, which stops its children over their pipes -- instead of every
    child printing a KeyboardInterrupt traceback from wherever it was (often still importing).
    A Ctrl-C that arrives meanwhile is delivered to the parent when the mask is restored."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_child(process: Any) -> None:
    """``process.start()`` for a peer process the parent stops itself (see `_ctrl_c_held`)."""
    with _ctrl_c_held():
        process.start()


def peer_data(seed: int, index: int, numel: int, dtype: str = "float32") -> np.ndarray:
    return np.random.default_rng([seed, index]).standard_normal(numel).astype(dtype)


def _summary(result: Any, t0: float, t1: float, cpu: float = 0.0) -> dict:
    return {
        "ok": True,
        "group_id": result.group_id,
        "group_size": len(result.members),
        "members": list(result.members),
        "contributors": list(result.contributors),
        "lost": list(result.lost),
        "complete": result.complete,
        "gathered": result.gathered,
        "timings": dict(result.timings, wall=t1 - t0, cpu=cpu, start=t0),
        "bytes_sent": result.bytes_sent,
        "bytes_received": result.bytes_received,
        "coords": list(result.coords),
        "updated": [list(r) for r in result.updated],
    }


def proc_memory(reset: bool = False) -> dict:
    """This process's resident memory from /proc/self/status, in bytes (Linux).

    ``VmHWM`` is the peak resident set. With ``reset``, the peak is first reset to the
    current RSS by writing 5 to /proc/self/clear_refs, so a later reading is the peak
    since this call (``reset`` in the answer says whether that worked).
    """
    done = False
    if reset:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            done = True
        except OSError:
            pass
    out: dict = {"reset": done}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _child(index: int, conn: Any, numel: int, seed: int, dtype: str, kwargs: dict, initial: Sequence[str]) -> None:
    import logging

    logging.basicConfig(level=os.environ.get("ZGOSSIP_LOG", "WARNING"))
    from .averager import Averager

    data = peer_data(seed, index, numel, dtype)
    avg = Averager([data], initial_peers=list(initial), seed=seed * 1000 + index, **kwargs)
    from . import kernels, machine, zmq_driver

    # which zgossip this process runs (a bench may start a swarm from another checkout), on which paths
    conn.send({"endpoint": avg.endpoint, "peer_id": avg.peer_id, "pid": os.getpid(),
               "module": os.path.dirname(os.path.abspath(__file__)), "native": kernels.NATIVE,
               "fast_send": getattr(zmq_driver, "FAST_SEND", False), "start_at": True,
               "paths": machine.optional_paths()})
    try:
        while True:
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            try:
                if cmd == "step":
                    at = args.pop("at", None)
                    if at is not None:  # a common start (time.monotonic() is one clock for every process here)
                        time.sleep(max(0.0, at - time.monotonic()))
                    c0, t0 = time.process_time(), time.perf_counter()
                    res = avg.step(**args)
                    t1 = time.perf_counter()
                    conn.send(_summary(res, t0, t1, time.process_time() - c0))
                elif cmd == "peers":
                    conn.send({"ok": True, "peers": avg.peers()})
                elif cmd == "tensor":
                    with avg.get_tensors() as ts:
                        conn.send({"ok": True, "tensor": np.array(ts[0])})
                elif cmd == "set":
                    with avg.get_tensors() as ts:
                        ts[0][...] = args["value"]
                    conn.send({"ok": True})
                elif cmd == "stats":
                    conn.send({"ok": True, "stats": avg.stats})
                elif cmd == "rss":
                    conn.send({"ok": True, **proc_memory(bool(args.get("reset")))})
                else:
                    conn.send({"ok": False, "error": f"unknown command {cmd}", "type": "ValueError"})
            except Exception as e:  # report, keep serving
                conn.send({"ok": False, "error": str(e), "type": type(e).__name__})
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        avg.shutdown()


def stop_children(conns: Sequence[Any], procs: Sequence[Any], stop_message: Any, timeout: float = 10.0) -> None:
    """Ask every live child to stop over its pipe, wait (bounded) and kill the ones that do not."""
    for conn, p in zip(conns, procs):
        if p.is_alive():
            try:
                conn.send(stop_message)
            except (OSError, BrokenPipeError):
                pass
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
    for conn in conns:
        conn.close()


@dataclass
class LocalSwarm:
    n: int
    numel: int
    seed: int = 0
    dtype: str = "float32"
    averager_kwargs: dict = field(default_factory=dict)
    per_peer_kwargs: Sequence[dict] | None = None
    initial_peers: Sequence[str] = ()
    start_timeout: float = 60.0
    import_path: str | None = None  # run the peers on the zgossip found there (another checkout)
    env: dict | None = None  # extra environment variables for the peer processes

    def __post_init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.info: list[dict] = []
        # spawned children take this process's environment and sys.path: set them while spawning
        extra = dict(self.env or {})
        saved_path = list(sys.path)
        if self.import_path is not None:  # put the other checkout first
            sys.path.insert(0, os.path.abspath(self.import_path))
            extra["PYTHONPATH"] = os.path.abspath(self.import_path)
        saved_env = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            # peer 0 first (the others bootstrap from it), then the rest in parallel
            self._spawn(ctx, 0, list(self.initial_peers))
            self._hello(0)
            first = list(self.initial_peers) or [self.info[0]["endpoint"]]
            key0 = (self.per_peer_kwargs or [{}])[0].get("secret_key")
            if key0 is not None and not self.initial_peers:  # with keys, peers need peer 0's key too
                first = [first[0] + "#" + key0.public]
            for i in range(1, self.n):
                self._spawn(ctx, i, first)
            for i in range(1, self.n):
                self._hello(i)
        except BaseException:
            self.close()
            raise
        finally:
            sys.path[:] = saved_path
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _spawn(self, ctx: Any, i: int, initial: list) -> None:
        kw = dict(self.averager_kwargs)
        if self.per_peer_kwargs is not None:
            kw.update(self.per_peer_kwargs[i])
        kw.setdefault("prefix", "swarm")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child, args=(i, child, self.numel, self.seed, self.dtype, kw, initial), daemon=True)
        start_child(p)
        child.close()
        self.procs.append(p)
        self.conns.append(parent)

    def _hello(self, i: int) -> None:
        if not self.conns[i].poll(self.start_timeout):
            raise TimeoutError(f"peer {i} did not start within {self.start_timeout}s")
        try:
            self.info.append(self.conns[i].recv())
        except EOFError:
            raise RuntimeError(f"peer {i} exited during start-up (exit code {self.procs[i].exitcode})") from None

    @property
    def endpoints(self) -> list[str]:
        return [i["endpoint"] for i in self.info]

    def truth(self, indices: Sequence[int] | None = None, weights: Sequence[float] | None = None) -> np.ndarray:
        idx = list(range(self.n)) if indices is None else list(indices)
        w = np.ones(len(idx)) if weights is None else np.asarray(weights, dtype=np.float64)
        acc = np.zeros(self.numel, dtype=np.float64)
        for k, i in enumerate(idx):
            acc += w[k] * peer_data(self.seed, i, self.numel, self.dtype)
        return acc / w.sum()

    def send(self, i: int, cmd: str, **args: Any) -> None:
        self.conns[i].send((cmd, args))

    def recv(self, i: int, timeout: float) -> dict:
        try:
            if not self.conns[i].poll(timeout):
                raise TimeoutError(f"peer {i} did not answer within {timeout}s")
            return self.conns[i].recv()
        except (EOFError, OSError):
            return {"ok": False, "error": f"peer {i} is gone", "type": "PeerGone"}

    def call(self, i: int, cmd: str, timeout: float = 30.0, **args: Any) -> dict:
        self.send(i, cmd, **args)
        return self.recv(i, timeout)

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.is_alive()]

    def wait_membership(self, timeout: float = 20.0) -> None:
        """Until every live peer knows every other live peer."""
        deadline = time.monotonic() + timeout
        while True:
            live = self.alive()
            counts = [len(self.call(i, "peers", timeout=5)["peers"]) for i in live]
            if all(c >= len(live) - 1 for c in counts):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"membership did not converge: {counts}")
            time.sleep(0.05)

    def step_all(self, timeout: float = 60.0, indices: Sequence[int] | None = None, **step_args: Any) -> list[dict]:
        idx = self.alive() if indices is None else list(indices)
        for i in idx:
            self.send(i, "step", **step_args)
        return [self.recv(i, timeout) for i in idx]

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)

    def close(self, timeout: float = 10.0) -> None:
        stop_children(self.conns, self.procs, ("stop", {}), timeout)

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # after Ctrl-C the user waits: a peer blocked mid-answer (a tensor half through its pipe) is
        # killed after 2 s instead of 10
        self.close(2.0 if exc_type is KeyboardInterrupt else 10.0)
