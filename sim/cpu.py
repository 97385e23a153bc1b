"""CPU time for simulated peers: a measured cost profile of this machine, and per-peer CPU queues.

``python -m sim calibrate [--out PROFILE.json]`` measures, in a few seconds, what handling a
message costs here: the wire codec per message and per byte, the node's Python work per
message (`Node.on_message` on a gossip digest), the all-reduce's arithmetic per byte of term
(`zgossip.kernels.accumulate` as an owner sums a 4-member part), the copy of an averaged
result per byte (`kernels.copy_finite`), and the kernel's TCP work per byte (a loopback
connection, both ends). It writes them with the CPU model, the kernel and this machine's TCP
sysctls (`sim.tcp.TcpParams.from_sysctl`), so a scenario can replay them. Calibrated numbers
enter a simulation only through that file: a scenario with the same profile gives the same trace.

With a profile, each peer runs its node one handling at a time (the ZeroMQ driver's one I/O
thread): a message, a timer or a step start waits for the peer's previous handling and, if
the scenario says ``cores = N, shared = true`` (all hosts on one machine, as on the testbed),
for one of N cores shared by every peer, taken in the order jobs ask for one. A handling
costs the receive side of its message (codec, transport and node per message and per byte,
plus the arithmetic for a PART and the copy for a RESULT) and the send side of each message
it sends (encode and transport per message and per byte); each send leaves when its encoding
is done. A testbed replay adds the forwarder (`switch_byte`, from the run's own record): each
message waits for it in one serial queue that also takes a shared core. Not modelled: libzmq's
I/O thread as a separate thread (its work is charged to the handling), page faults, cache
effects across peers, the GIL of peers in one process.
"""
from __future__ import annotations

import json
import math
import os
import platform
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np

from zgossip.machine import cpu_model

__all__ = ["CpuCosts", "CpuSpec", "CpuModel", "calibrate", "load_profile", "default_profile_path"]


@dataclass(frozen=True)
class CpuCosts:
    """Seconds per message and per byte of what a peer's CPU does."""

    encode_msg: float = 0.0
    encode_byte: float = 0.0
    decode_msg: float = 0.0
    decode_byte: float = 0.0
    handle_msg: float = 0.0  # the node's Python work for one message (dispatch, membership, matchmaking)
    accumulate_byte: float = 0.0  # per byte of a term an owner adds
    copy_byte: float = 0.0  # per byte of an averaged result copied into the buffer
    transport_byte: float = 0.0  # kernel TCP work per byte, both ends together
    # the testbed's forwarder (one process on the shared cores) per byte it moves; 0 for real links,
    # where switches have hardware of their own. Charged to a single serial queue, so it also caps
    # the switch's throughput at 1 / switch_byte
    switch_byte: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "CpuCosts":
        known = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in d.items() if k in known})

    def receive(self, mtype: Any, payload_bytes: int, nbytes: int) -> float:
        from zgossip.wire import MsgType

        c = self.decode_msg + self.handle_msg + nbytes * (self.decode_byte + self.transport_byte / 2)
        if mtype is MsgType.PART:
            c += payload_bytes * self.accumulate_byte
        elif mtype is MsgType.RESULT:
            c += payload_bytes * self.copy_byte
        return c

    def send(self, nbytes: int) -> float:
        return self.encode_msg + nbytes * (self.encode_byte + self.transport_byte / 2)


@dataclass(frozen=True)
class CpuSpec:
    """What a scenario asks for: the costs, and the cores (None: every peer has a core of its own)."""

    costs: CpuCosts
    cores: int | None = None
    shared: bool = True

    @staticmethod
    def check(value: Any) -> None:
        """The scenario's ``cpu`` value by its keys and types, without reading a profile (so at load):
        shared = "no" ran shared (any string is true), cores = "x" said "invalid literal for int()",
        and inline costs with a misspelt name (handle_mgs) or a string ran without that cost or failed
        at the run's start."""
        if value is None or value is False or isinstance(value, str):
            return
        if not isinstance(value, dict):
            raise ValueError("cpu must be 'auto', a profile path or {profile=..., cores=N, shared=bool}")
        bad = set(value) - {"profile", "cores", "shared", "costs"}
        if bad:
            raise ValueError(f"unknown cpu keys {sorted(bad)} (known: costs, cores, profile, shared)")
        if "profile" in value and not isinstance(value["profile"], str):
            raise ValueError(f"cpu.profile must be a file path or \"auto\", not {value['profile']!r}")
        cores = value.get("cores")
        if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
            raise ValueError(f"cpu.cores must be a positive integer, not {cores!r}")
        if "shared" in value and not isinstance(value["shared"], bool):
            raise ValueError(f"cpu.shared must be true or false, not {value['shared']!r}")
        costs = value.get("costs")
        if costs is not None:
            known = {f.name for f in fields(CpuCosts)}
            if not isinstance(costs, dict) or set(costs) - known:
                unknown = sorted(set(costs) - known) if isinstance(costs, dict) else costs
                raise ValueError(f"cpu.costs must be a table of {', '.join(sorted(known))} (seconds), not {unknown!r}")
            for k, v in costs.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                    raise ValueError(f"cpu.costs.{k} must be a finite number of seconds >= 0, not {v!r}")

    @classmethod
    def from_value(cls, value: Any) -> "CpuSpec | None":
        """``"auto"`` (this machine's cached profile, calibrated once), a profile path, or
        ``{profile = ..., cores = N, shared = true}`` (``costs = {...}`` in place of ``profile``: the
        profile's ``cpu`` section inline, as a testbed run records it); None or false: no CPU model."""
        cls.check(value)
        if value is None or value is False:
            return None
        if isinstance(value, str):
            value = {"profile": value}
        if "costs" in value:
            data = {"cpu": dict(value["costs"])}
        else:
            prof = value.get("profile", "auto")
            data = load_profile(default_profile_path(create=True) if prof == "auto" else prof)
        cores = value.get("cores")
        return cls(CpuCosts.from_dict(data["cpu"]), None if cores is None else int(cores), bool(value.get("shared", True)))


class _PeerQueue:
    __slots__ = ("jobs", "running", "waiting")

    def __init__(self) -> None:
        self.jobs: deque[Callable[[float], float]] = deque()
        self.running = False
        self.waiting = False


class CpuModel:
    """Per-peer job queues on a SimPy clock, optionally over a pool of shared cores.

    A job is ``fn(now) -> seconds``: it runs (changes the node) when it starts and holds the
    peer (and a core) for the seconds it returns.
    """

    #: the fewest per-peer queues worth a pruning (`_prune`); a class constant
    prune_min = 256

    def __init__(self, env: Any, spec: CpuSpec) -> None:
        self.env = env
        self.spec = spec
        self.costs = spec.costs
        self.pool = spec.cores if spec.cores is not None and spec.shared else None
        self.free = self.pool or 0
        self._peers: dict[str, _PeerQueue] = {}
        self._prune_at = 0  # drop idle queues once there are this many and prune_min (a departed peer's stays idle)
        self._wait: deque[_PeerQueue] = deque()  # peers waiting for a shared core, first come first served
        self.busy_seconds = 0.0

    def submit(self, key: str, job: Callable[[float], float]) -> None:
        q = self._peers.get(key)
        if q is None:
            n = len(self._peers)
            if n >= self._prune_at and n >= self.prune_min:
                self._prune()
            q = self._peers[key] = _PeerQueue()
        q.jobs.append(job)
        self._kick(q)

    def _prune(self) -> None:
        """Forget the idle queues (no job, none running, not waiting for a core): a new one is the same.
        Amortized O(1) per new queue: the next pruning waits until the table has doubled."""
        for key in [k for k, q in self._peers.items() if not (q.jobs or q.running or q.waiting)]:
            del self._peers[key]
        self._prune_at = 2 * len(self._peers)

    def _kick(self, q: _PeerQueue) -> None:
        if q.running or q.waiting or not q.jobs:
            return
        if self.pool is not None:
            if self.free == 0:
                q.waiting = True
                self._wait.append(q)
                return
            self.free -= 1
        self._start(q)

    def _start(self, q: _PeerQueue) -> None:
        q.running = True
        job = q.jobs.popleft()
        d = max(0.0, float(job(self.env.now)))
        self.busy_seconds += d
        ev = self.env.timeout(d)
        ev.callbacks.append(lambda _e, q=q: self._finish(q))

    def _finish(self, q: _PeerQueue) -> None:
        q.running = False
        if self.pool is not None:
            self.free += 1
            while self._wait and self.free > 0:
                w = self._wait.popleft()
                w.waiting = False
                if w.jobs:
                    self.free -= 1
                    self._start(w)
        self._kick(q)


# ---------------------------------------------------------------------- calibration
def default_profile_path(create: bool = False) -> Path:
    """Where ``cpu = "auto"`` keeps this machine's profile; `create` calibrates it if missing."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zgossip"
    path = base / "cpu_profile.json"
    if create and not path.exists():
        base.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(calibrate(), indent=1, sort_keys=True))
    return path


def load_profile(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    if "cpu" not in data:
        raise ValueError(f"{path}: not a CPU profile (no 'cpu' section); write one with python -m sim calibrate")
    return data


def _best(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of `fn` over `reps` runs (the median, not the minimum: the simulator should
    predict typical handlings, not the luckiest)."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _transport_per_byte(total: int = 64 << 20, chunk: int = 1 << 20) -> float:
    """CPU seconds per byte to move bytes through a loopback TCP connection (both ends)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    buf = bytearray(chunk)

    def reader() -> None:
        view, got = memoryview(buf), 0
        while got < total:
            n = conn.recv_into(view)
            if n == 0:
                break
            got += n

    data = bytes(chunk)
    th = threading.Thread(target=reader)
    c0 = time.process_time()
    th.start()
    sent = 0
    while sent < total:
        cli.sendall(data)
        sent += chunk
    th.join()
    c1 = time.process_time()
    for s in (cli, conn, srv):
        s.close()
    return (c1 - c0) / total


def calibrate(quick: bool = False) -> dict:
    """Measure this machine (a few seconds); returns the profile as a dict."""
    from zgossip import kernels, wire
    from zgossip.node import Node, NodeConfig
    from .tcp import TcpParams

    t_start = time.perf_counter()
    reps = 5 if quick else 15
    rng = np.random.default_rng(0)
    big = rng.standard_normal(1 << 18).astype(np.float32)  # 1 MiB
    small_body = {"gid": "g" * 16, "owner": 1, "part": 0, "w": 1.0, "resc": 0}
    m_small = wire.make_message(wire.MsgType.PART, "a" * 16, "tcp://10.0.0.1:5555", small_body, (big[:16],))
    m_big = wire.make_message(wire.MsgType.PART, "a" * 16, "tcp://10.0.0.1:5555", small_body, (big,))

    def per(fn: Callable[[], Any], n: int) -> float:
        return _best(lambda: [fn() for _ in range(n)], reps) / n

    enc_s = per(lambda: wire.encode(m_small), 200)
    enc_b = per(lambda: wire.encode(m_big), 200)
    f_small = [bytes(f) if isinstance(f, bytes) else memoryview(f).tobytes() for f in wire.encode(m_small)]
    f_big = [wire.encode(m_big)[0], memoryview(big)]
    dec_s = per(lambda: wire.decode(f_small), 200)
    dec_b = per(lambda: wire.decode(f_big), 200)
    nb_small, nb_big = sum(memoryview(f).nbytes for f in f_small), len(f_big[0]) + big.nbytes
    span = nb_big - nb_small

    # the node's own work per message: a gossip digest of 8 peers (the commonest message). One source
    # sends them all, faster than the flood limit lets through: without raising it, most calls timed
    # the cheap drop (9.3 us a message against 13.6 us handled, measured by a probe)
    node = Node("n" * 16, "tcp://10.0.0.2:5555", NodeConfig(control_rate=1e9, control_burst=1 << 30),
                np.random.default_rng(1))
    node.start(0.0)
    peers = [[f"{i:016x}", f"tcp://10.0.1.{i}:5555", 1, None, {}] for i in range(8)]
    hb = iter(range(1, 1 << 30))
    now = [0.0]

    def handle() -> None:
        now[0] += 1e-3
        node.on_message(wire.make_message(wire.MsgType.GOSSIP_REPLY, "p" * 16, "tcp://10.0.0.3:5555",
                                     {"hb": next(hb), "peers": peers}), now[0])
        node.take_actions()

    handle_msg = per(handle, 200)

    terms = [rng.standard_normal(1 << 18).astype(np.float32) for _ in range(4)]
    out = np.empty_like(terms[0])
    acc = _best(lambda: kernels.accumulate(out, terms, [1.0] * 4, True, 4.0), reps) / sum(t.nbytes for t in terms)
    dst = np.empty(1 << 20, dtype=np.float32)
    src = rng.standard_normal(1 << 20).astype(np.float32)
    copy = _best(lambda: kernels.copy_finite(dst, src), reps) / src.nbytes
    transport = float(np.median([_transport_per_byte(16 << 20 if quick else 64 << 20) for _ in range(3)]))

    costs = CpuCosts(
        encode_msg=enc_s, encode_byte=max(0.0, (enc_b - enc_s) / span),
        decode_msg=dec_s, decode_byte=max(0.0, (dec_b - dec_s) / span),
        handle_msg=handle_msg, accumulate_byte=acc, copy_byte=copy, transport_byte=transport,
    )
    return {
        "machine": {"cpu_model": cpu_model(), "kernel": platform.release(), "system": platform.system(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "native_kernels": bool(kernels.NATIVE)},
        "cpu": asdict(costs),
        "tcp": TcpParams.from_sysctl().to_dict(),
        "calibration_seconds": time.perf_counter() - t_start,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sim calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the profile here (default: print it)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (~1 s)")
    args = ap.parse_args(argv)
    prof = calibrate(quick=args.quick)
    text = json.dumps(prof, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out} ({prof['calibration_seconds']:.1f} s)")
    else:
        print(text)
    return 0
