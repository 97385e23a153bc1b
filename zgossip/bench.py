"""``zgossip bench``: time zgossip on local processes, optionally against torch.distributed (gloo).

Two benchmarks, chosen by flag:

``zgossip bench --peers N --numel M [--reps R] [--part-size BYTES] [--vs gloo] [--tcp-only] [--json]``
    The all-reduce. A `LocalSwarm` of N peer processes listening on tcp loopback
    (ephemeral ports); as on any host, peers that find each other's local Unix socket
    use it for their connections (the output says which transport ran), and with
    ``--tcp-only`` they keep to TCP, like gloo does. One group of exactly N (target =
    min group size = N); the bench waits for membership, runs 2 warm-up steps, then R timed steps (default 7, at least 5).
    The peers start each step at one instant, 5 ms after the command goes out (gloo's
    ranks start after a barrier); ``start_skew`` reports how far apart they started.
    For each repetition it takes the *max over peers* of the wall time of
    ``Averager.step()`` measured inside each peer -- everything a user waits for:
    matchmaking and the all-reduce (the single tensor is averaged in place; with
    several tensors a step would also copy them in and the result back) --
    and, separately, of ``result.timings['allreduce']`` and ``['matchmaking']``;
    it reports their median, min and max, and the CPU seconds all peers spent per
    step. It checks once that a peer's tensor equals the float64 mean of all peers'
    data at float32 tolerance.

    Memory: the peak resident set of each peer over the warm-up and timed steps
    minus its resident set just before the first step (``VmHWM``/``VmRSS`` from
    /proc, the peak reset via /proc/self/clear_refs), as a multiple of the averaged
    tensor's bytes; the figure is the largest over peers, and buffers a step keeps
    for the next one count as extra memory.

    With ``--vs gloo``, N more processes (multiprocessing spawn) join a
    ``torch.distributed`` gloo group through a TCPStore held by this process on
    127.0.0.1 (its port found by binding port 0), each with the same float32 tensor,
    do 2 warm-up all-reduces, and then time ``dist.all_reduce`` once per repetition
    (after a barrier; max over ranks). Both groups stay up for the whole run and
    the repetitions alternate (zgossip, gloo, gloo, zgossip, ...) so that both see
    the same machine: on a shared machine, load from other processes moves both
    figures, and the run reports how many cores other processes used meanwhile.
    The ratio printed is zgossip's median step time / gloo's median all_reduce time
    (lower is better for zgossip).

    With ``--vs-checkout DIR`` (for developers), a second swarm runs the zgossip found in
    DIR (another checkout, its C extension built in place) on the same data, under
    another prefix, and the two step in turn; the figure is the median over
    repetitions of this step time / that one's right next to it, which cancels most
    of the drift of a shared machine that separate runs suffer from. ``--vs-env VAR=VALUE``
    (repeatable) sets environment variables in that second swarm -- on this code unless
    ``--vs-checkout`` is given too --, which pairs an optional path against its fallback:
    ``--vs-env ZGOSSIP_NATIVE=0``, ``ZGOSSIP_FAST_SEND=0``, ``ZGOSSIP_TUNE_MALLOC=0``,
    ``ZGOSSIP_STREAM_STORES=0`` or ``=1``, ``NUMPY_MADVISE_HUGEPAGE=0``. The paired ratios are given for
    the step time and for the CPU the peers spent.

    With ``--compression fp16|bf16|int8`` the timed swarm sends its tensor with that wire codec
    (`zgossip.codecs`), and a second swarm of this code, uncompressed, steps in turn with it on
    the same data: the report gives the paired ratios compressed/uncompressed of step time and
    CPU, what one encode and decode of a span cost on one core, and (with ``--vs gloo``) the
    ratio to gloo as usual. "correct" then means within the codec's documented error bound of
    the float64 mean.

    Every report starts with the machine line (CPU model, cores, kernel, transparent huge
    pages, libc) and the optional paths the peers ran (`zgossip.machine`); with ``--vs gloo``
    it gives the ratio of CPU per step beside the ratio of time: both sides are CPU-bound on a
    small machine, and CPU is the figure that carries across machines.

``zgossip bench --matchmaking [--peers 8] [--numel 1024] [--reps 10] [--target-group-size T]``
    Matchmaking latency: 8 local peers that already know each other (membership is
    awaited first), a small tensor, target group size 8, at least 10 timed steps
    after warm-up; reports the median over steps of the max over peers of
    ``result.timings['matchmaking']`` (time from ``step()`` until the group is known).
    With ``--target-group-size T`` larger than ``--peers`` (a swarm smaller than its target:
    ``--peers 3 --target-group-size 16``), the peers run the Averager's defaults
    (``min_group_size`` 2, ``matchmaking_time`` 1 s): the group forms once every live peer
    joined, or, before issue 13, when the window closed. The output names the machine.

``--json`` prints one JSON object with every figure instead of the table. Every
process started is stopped (killed if it does not stop in time), every wait has a
timeout, and everything listens on 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

from .cliargs import nonnegative_int, positive_float, positive_int
from .machine import OtherLoad, machine, machine_line, paths_line
from .swarm import LocalSwarm, peer_data

__all__ = ["add_arguments", "run", "main", "bench_allreduce", "bench_matchmaking", "GlooGroup"]

WARMUP = 2
MIN_REPS = 5
MIN_MATCHMAKING_STEPS = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=positive_int, default=None, help="local peer processes (default 4; 8 with --matchmaking)")
    p.add_argument("--numel", type=positive_int, default=None,
                   help="float32 elements per peer (default 16777216 = 64 MiB; 1024 with --matchmaking)")
    p.add_argument("--reps", type=positive_int, default=7, help=f"timed repetitions (default 7, at least {MIN_REPS})")
    p.add_argument("--part-size", type=positive_int, default=None, metavar="BYTES",
                   help="zgossip part_size_bytes (default: the Averager's default)")
    p.add_argument("--vs", choices=["gloo"], default=None, help="also time torch.distributed all_reduce on the same data")
    p.add_argument("--vs-checkout", default=None, metavar="DIR",
                   help="also time the zgossip found in DIR (another checkout, C kernels built in place) on the "
                        "same data, stepping in turn with this one, and report the paired ratio")
    p.add_argument("--vs-env", action="append", default=None, metavar="VAR=VALUE",
                   help="also time a second swarm with this environment variable set (repeatable; with "
                        "--vs-checkout, on that code), stepping in turn with this one, and report the paired ratios "
                        "of time and CPU: e.g. --vs-env ZGOSSIP_NATIVE=0 checks an optional path against its fallback")
    p.add_argument("--tcp-only", action="store_true",
                   help="zgossip peers talk over TCP loopback, like gloo, instead of finding each other's "
                        "Unix sockets (the default between peers on one host)")
    p.add_argument("--compression", choices=["none", "fp16", "bf16", "int8"], default=None,
                   help="wire codec of the averaged tensor (zgossip.codecs); other than none, an uncompressed "
                        "swarm steps side by side and the paired ratios compressed/uncompressed are reported")
    p.add_argument("--matchmaking", action="store_true", help="benchmark matchmaking latency instead of the all-reduce")
    p.add_argument("--target-group-size", type=positive_int, default=None, metavar="T",
                   help="with --matchmaking: the peers' target_group_size (default: --peers); larger than --peers "
                        "times a swarm smaller than its target")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--curve", action="store_true",
                   help="peers with CURVE keys (authenticated, encrypted); the all-reduce bench also runs the same "
                        "swarm without keys and prints the ratio")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the peers' random tensors (default 0)")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="bound on each step and each wait, in seconds (default 120)")


# ---------------------------------------------------------------------------- helpers
def _summary(xs: Sequence[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": list(xs)}


def _checked(answers: list[dict], what: str) -> list[dict]:
    bad = [a for a in answers if not a.get("ok")]
    if bad:
        raise RuntimeError(f"{what} failed on {len(bad)} process(es): {bad[0].get('type')}: {bad[0].get('error')}")
    return answers


def _thread_counters(pids: Sequence[int]) -> dict[tuple[int, int], tuple[str, int, int, int]]:
    """(pid, tid) -> (thread name, utime ticks, stime ticks, minor faults) of every thread of `pids`."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            out[(pid, int(tid))] = (name, int(fields[11]), int(fields[12]), int(fields[7]))
    return out


def _thread_kind(name: str) -> str:
    if name.startswith("ZMQbg/IO"):
        return "libzmq I/O"  # libzmq's own thread: the socket system calls (kernel TCP/Unix copies)
    if name.startswith("ZMQbg"):
        return "libzmq other"
    if name == "zgossip-io":
        return "zgossip I/O"  # zgossip's protocol thread: Python per message, the C kernels
    return name


def _cpu_by_thread(before: dict, after: dict, steps: int) -> dict[str, dict[str, float]]:
    """User and system CPU milliseconds and minor page faults per step, summed over processes by
    kind of thread."""
    tick = 1000.0 / os.sysconf("SC_CLK_TCK")
    out: dict[str, dict[str, float]] = {}
    for key, (name, u, st, flt) in after.items():
        _, u0, s0, f0 = before.get(key, (name, 0, 0, 0))
        row = out.setdefault(_thread_kind(name), {"user_ms": 0.0, "sys_ms": 0.0, "minor_faults": 0.0})
        row["user_ms"] += (u - u0) * tick / steps
        row["sys_ms"] += (st - s0) * tick / steps
        row["minor_faults"] += (flt - f0) / steps
    return {k: v for k, v in sorted(out.items(), key=lambda kv: -(kv[1]["user_ms"] + kv[1]["sys_ms"]))
            if v["user_ms"] + v["sys_ms"] + v["minor_faults"] > 0}


def _swarm_kwargs(n: int, part_size: int | None, timeout: float) -> dict:
    kw: dict = {
        "prefix": "bench",
        "target_group_size": n,
        "min_group_size": n,
        "gossip_interval": 0.1,
        "matchmaking_time": 2.0,  # the group forms as soon as all n have joined; this is only a bound
        "allreduce_timeout": timeout,
    }
    if part_size is not None:
        kw["part_size_bytes"] = part_size
    return kw


#: Peers start each timed step together, this long after the parent sends the command (gloo's ranks
#: start theirs right after a barrier): otherwise the first peer's time includes waiting for the
#: last one to receive its command.
START_LEAD = 0.005


def _step_once(swarm: LocalSwarm, timeout: float, aligned: bool = True) -> dict[str, float]:
    t0 = time.perf_counter()
    at = {"at": time.monotonic() + START_LEAD} if aligned else {}
    res = _checked(swarm.step_all(timeout=timeout, **at), "step")
    parent = time.perf_counter() - t0
    if not all(r["complete"] and r["group_size"] == swarm.n for r in res):
        raise RuntimeError(f"a step did not average over all {swarm.n} peers: {[r['group_size'] for r in res]}")
    out = {k: max(r["timings"][k] for r in res) for k in ("wall", "allreduce", "matchmaking")}
    out["cpu"] = sum(r["timings"]["cpu"] for r in res)
    out["parent"] = parent
    starts = [r["timings"].get("start") for r in res]
    out["start_skew"] = max(starts) - min(starts) if None not in starts else 0.0
    return out


def _collect(rows: list[dict[str, float]]) -> dict[str, list[float]]:
    return {k: [r[k] for r in rows] for k in rows[0]} if rows else {}


def _accuracy(got: np.ndarray, truth: np.ndarray, compression: str | None = None) -> tuple[bool, float]:
    err = float(np.max(np.abs(got.astype(np.float64) - truth))) if got.size else 0.0
    if compression in (None, "none"):
        return bool(np.allclose(got, truth, rtol=1e-5, atol=1e-5)), err
    from . import codecs

    # the members' terms and the result each lose at most the codec's bound (taken at 4x the mean's
    # magnitude, which bounds a term's: peers' data are of the same scale), plus float32 rounding
    scale = float(np.max(np.abs(truth))) * 4 if truth.size else 0.0
    tol = 2 * float(codecs.error_bound(codecs.CODECS[compression], np.array([scale]))[0]) + 1e-5
    return bool(err <= tol), err


# ---------------------------------------------------------------------------- gloo
def _gloo_child(rank: int, n: int, port: int, numel: int, seed: int, timeout: float, conn: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs listen on loopback only
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    # the untimed `t.div_(n)` below would otherwise run on an OpenMP pool whose idle threads spin
    # for a while after every call, burning a core of this 2-core machine during the next
    # zgossip repetition; gloo's all_reduce runs on gloo's own threads either way
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, n, False, timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=timeout))
        t = torch.from_numpy(peer_data(seed, rank, numel))

        def once() -> tuple[float, float]:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            dist.all_reduce(t)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            t.div_(n)  # keep values bounded and the mean checkable; not part of the timed call
            return dt, dc

        for _ in range(WARMUP):
            once()
        conn.send({"ok": True, "pid": os.getpid()})
        while True:
            cmd = conn.recv()
            if cmd == "rep":
                dt, dc = once()
                conn.send({"ok": True, "time": dt, "cpu": dc})
            elif cmd == "tensor":
                conn.send({"ok": True, "tensor": t.numpy().copy()})
            else:
                break
        dist.destroy_process_group()
    except (EOFError, KeyboardInterrupt):
        pass
    except Exception as e:
        try:
            conn.send({"ok": False, "error": str(e), "type": type(e).__name__})
        except OSError:
            pass
    finally:
        conn.close()


class GlooGroup:
    """N processes in a torch.distributed gloo group, each doing one timed all_reduce per `rep()`."""

    def __init__(self, n: int, numel: int, seed: int = 0, timeout: float = 120.0) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.n, self.timeout = n, timeout
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        ctx = mp.get_context("spawn")
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lsock.bind(("127.0.0.1", 0))
            lsock.listen(128)
            port = lsock.getsockname()[1]
            # this process holds the store, listening on the socket bound above (so on 127.0.0.1
            # only, with no race for the port); the store takes the descriptor over and closes it
            self._store = dist.TCPStore("127.0.0.1", port, n, True, timeout=timedelta(seconds=timeout),
                                        wait_for_workers=False, master_listen_fd=lsock.fileno())
            lsock.detach()
            for r in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_gloo_child, args=(r, n, port, numel, seed, timeout, child), daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self.pids = [a["pid"] for a in _checked(self._recv_all(timeout + 60.0), "gloo start-up")]
        except BaseException:
            lsock.close()
            self.close()
            raise

    def _recv_all(self, timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        out = []
        for r, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"gloo rank {r} did not answer within {timeout:.0f}s")
            try:
                out.append(c.recv())
            except (EOFError, OSError):
                raise RuntimeError(f"gloo rank {r} exited (code {self.procs[r].exitcode})") from None
        return out

    def rep(self) -> dict[str, float]:
        for c in self.conns:
            c.send("rep")
        ans = _checked(self._recv_all(self.timeout), "gloo all_reduce")
        return {"time": max(a["time"] for a in ans), "cpu": sum(a["cpu"] for a in ans)}

    def tensor(self) -> np.ndarray:
        self.conns[0].send("tensor")
        ans = self.conns[0].recv() if self.conns[0].poll(self.timeout) else {"ok": False, "error": "timeout"}
        return _checked([ans], "gloo tensor")[0]["tensor"]

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    c.send("stop")
                except OSError:
                    pass
        deadline = time.monotonic() + 10.0
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()
        self._store = None

    def __enter__(self) -> "GlooGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------- all-reduce
def _paths(info: list[dict]) -> dict | None:
    """The optional paths the peers of a swarm ran (see `zgossip.machine.optional_paths`); a path
    counts as on only where every peer ran it. None from older code that does not say."""
    got = [i.get("paths") for i in info]
    if not got or None in got:
        return None
    return {k: (all(g.get(k) for g in got) if isinstance(got[0].get(k), bool) else got[0].get(k)) for k in got[0]}


def _parse_env(pairs: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for pair in pairs or ():
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise ValueError(f"--vs-env {pair!r}: expected VAR=VALUE")
        out[name] = value
    return out


def codec_cost(codec: str, numel: int, reps: int = 3, seed: int = 0) -> dict:
    """Seconds one process spends to encode and to decode `numel` float32 values (best of `reps`)."""
    from . import codecs

    cid = codecs.CODECS[codec]
    x = peer_data(seed, 0, numel)
    enc = np.empty(codecs.encoded_nbytes(cid, numel), np.uint8)
    y = np.empty_like(x)
    e, d = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        codecs.encode(cid, x, enc)
        t1 = time.perf_counter()
        codecs.decode(cid, enc, y)
        e.append(t1 - t0)
        d.append(time.perf_counter() - t1)
    return {"encode_seconds": min(e), "decode_seconds": min(d), "bytes_ratio": enc.nbytes / x.nbytes,
            "max_abs_error": float(np.max(np.abs(y - x))) if numel else 0.0}


def bench_allreduce(peers: int, numel: int, reps: int, part_size: int | None = None, seed: int = 0,
                    timeout: float = 120.0, vs_gloo: bool = False, vs_checkout: str | None = None,
                    tcp_only: bool = False, curve: bool = False, vs_env: dict[str, str] | None = None,
                    compression: str | None = None) -> dict:
    truth = _mean_of_peers(seed, peers, numel)
    per_peer = curve_kwargs(peers) if curve else None
    gloo = GlooGroup(peers, numel, seed, timeout) if vs_gloo else None
    other = None
    # with tcp_only, both zgossip swarms (this code and --vs-checkout's) keep to TCP loopback
    env = {"ZGOSSIP_LOCAL_IPC": "0"} if tcp_only else None
    aligned = True  # a common start for every step (older --vs-checkout code starts on receipt: then nobody does)
    try:
        kw = _swarm_kwargs(peers, part_size, timeout)
        compressed = compression not in (None, "none")
        if compressed and (vs_checkout is not None or vs_env):
            raise ValueError("--compression compares with an uncompressed swarm of this code: "
                             "not with --vs-checkout or --vs-env")
        if compressed:
            # the yardstick: the same code, uncompressed, under its own prefix (the two swarms never meet)
            other = LocalSwarm(peers, numel, seed=seed, averager_kwargs={**kw, "prefix": "bench-raw"},
                               start_timeout=timeout, env=env)
            other.wait_membership(timeout=min(timeout, 30.0))
            for _ in range(WARMUP):
                _step_once(other, timeout, aligned)
            kw["compression"] = compression
        if vs_checkout is not None or vs_env:
            # a second swarm on the other checkout's code (or this code with other settings), under its
            # own prefix (the two never meet)
            other = LocalSwarm(peers, numel, seed=seed, averager_kwargs={**kw, "prefix": "bench-other"},
                               start_timeout=timeout, import_path=vs_checkout, env={**(env or {}), **(vs_env or {})})
            here = os.path.dirname(os.path.abspath(__file__))
            if vs_checkout is not None and any(i.get("module") and os.path.samefile(i["module"], here)
                                               for i in other.info):
                raise RuntimeError(f"--vs-checkout {vs_checkout}: its peers imported this zgossip ({here}), "
                                   "not the one in that directory")
            aligned = all(i.get("start_at") for i in other.info)
            other.wait_membership(timeout=min(timeout, 30.0))
            for _ in range(WARMUP):
                _step_once(other, timeout, aligned)
        with LocalSwarm(peers, numel, seed=seed, averager_kwargs=kw, start_timeout=timeout, env=env,
                        per_peer_kwargs=per_peer) as swarm:
            swarm.wait_membership(timeout=min(timeout, 30.0))
            build = {"native_kernels": all(i.get("native", False) for i in swarm.info),
                     "fast_send": all(i.get("fast_send", False) for i in swarm.info),
                     "paths": _paths(swarm.info)}
            before = _checked([swarm.call(i, "rss", timeout=timeout, reset=True) for i in range(peers)], "rss")
            for _ in range(WARMUP):
                _step_once(swarm, timeout, aligned)
            load = OtherLoad([i["pid"] for i in swarm.info] + (gloo.pids if gloo else [])
                                + ([i["pid"] for i in other.info] if other else []))
            zg_rows, gl_rows, ot_rows = [], [], []
            zg_pids, gl_pids = [i["pid"] for i in swarm.info], (gloo.pids if gloo else [])
            zg_t0, gl_t0 = _thread_counters(zg_pids), _thread_counters(gl_pids)
            for k in range(reps):
                # alternate the order so that neither side always runs right after the other
                if gloo is not None and k % 2:
                    gl_rows.append(gloo.rep())
                if other is not None and k % 2:
                    ot_rows.append(_step_once(other, timeout, aligned))
                zg_rows.append(_step_once(swarm, timeout, aligned))
                if gloo is not None and not k % 2:
                    gl_rows.append(gloo.rep())
                if other is not None and not k % 2:
                    ot_rows.append(_step_once(other, timeout, aligned))
            foreign = load.cores()
            zg_threads = _cpu_by_thread(zg_t0, _thread_counters(zg_pids), reps)
            gl_threads = _cpu_by_thread(gl_t0, _thread_counters(gl_pids), reps)
            stats = _checked([swarm.call(i, "stats", timeout=timeout) for i in range(peers)], "stats")
            local = [a["stats"].get("local_connections", 0) for a in stats]
            build["transport"] = "unix sockets" if all(local) else "tcp" if not any(local) else "mixed"
            after = _checked([swarm.call(i, "rss", timeout=timeout) for i in range(peers)], "rss")
            got = _checked([swarm.call(0, "tensor", timeout=timeout)], "tensor")[0]["tensor"]
        gl_tensor = gloo.tensor() if gloo is not None else None
        ot_tensor = _checked([other.call(0, "tensor", timeout=timeout)], "tensor")[0]["tensor"] if other else None
    finally:
        if gloo is not None:
            gloo.close()
        if other is not None:
            other.close()
    times = _collect(zg_rows)
    tensor_bytes = numel * 4
    extra = [a["VmHWM"] - b["VmRSS"] for b, a in zip(before, after)
             if b.get("reset") and "VmHWM" in a and "VmRSS" in b]
    correct, err = _accuracy(got, truth, compression)
    zg = {
        "step": _summary(times["wall"]),
        "allreduce": _summary(times["allreduce"]),
        "matchmaking": _summary(times["matchmaking"]),
        "parent_round_trip": _summary(times["parent"]),
        "start_skew": _summary(times["start_skew"]),
        "cpu_seconds_all_peers": _summary(times["cpu"]),
        "cpu_by_thread": zg_threads,
        "correct": correct,
        "max_abs_error": err,
        **build,
        "memory": {
            "tensor_bytes": tensor_bytes,
            "extra_peak_bytes_per_peer": extra,
            "extra_peak_ratio": (max(extra) / tensor_bytes) if extra and tensor_bytes else None,
        },
    }
    out: dict = {
        "benchmark": "allreduce",
        "peers": peers,
        "numel": numel,
        "reps": reps,
        "warmup": WARMUP,
        "part_size_bytes": part_size,
        "other_load_cores": foreign,
        "machine": machine(),
        "zgossip": zg,
    }
    if gloo is not None and gl_tensor is not None:
        g = _collect(gl_rows)
        g_correct, g_err = _accuracy(gl_tensor, truth)
        out["gloo"] = {
            "all_reduce": _summary(g["time"]),
            "cpu_seconds_all_peers": _summary(g["cpu"]),
            "cpu_by_thread": gl_threads,
            "correct": g_correct,
            "max_abs_error": g_err,
        }
        out["ratio"] = zg["step"]["median"] / out["gloo"]["all_reduce"]["median"]
        # CPU is what carries across machines (both sides are CPU-bound on a small one)
        out["cpu_ratio"] = zg["cpu_seconds_all_peers"]["median"] / out["gloo"]["cpu_seconds_all_peers"]["median"]
        # the all-reduce phase alone (without matchmaking, which gloo's fixed group does not need)
        out["ratio_allreduce_phase"] = zg["allreduce"]["median"] / out["gloo"]["all_reduce"]["median"]
    if compressed and ot_tensor is not None:
        o = _collect(ot_rows)
        out["compression"] = compression
        out["uncompressed"] = {"step": _summary(o["wall"]), "allreduce": _summary(o["allreduce"]),
                               "cpu_seconds_all_peers": _summary(o["cpu"]),
                               "correct": _accuracy(ot_tensor, truth)[0]}
        # each compressed repetition against the uncompressed one right next to it in time
        out["paired_ratio_vs_uncompressed"] = statistics.median(a["wall"] / b["wall"] for a, b in zip(zg_rows, ot_rows))
        out["paired_cpu_ratio_vs_uncompressed"] = statistics.median(a["cpu"] / b["cpu"]
                                                                    for a, b in zip(zg_rows, ot_rows))
        out["codec_cost"] = codec_cost(compression, numel // peers, seed=seed)
    elif other is not None and ot_tensor is not None:
        o = _collect(ot_rows)
        o_correct, o_err = _accuracy(ot_tensor, truth)
        out["checkout"] = {
            "path": os.path.abspath(vs_checkout) if vs_checkout is not None else None,
            "env": dict(vs_env or {}),
            "paths": _paths(other.info),
            "native_kernels": all(i.get("native", True) for i in other.info),  # older versions do not say
            "fast_send": all(i.get("fast_send", False) for i in other.info),
            "step": _summary(o["wall"]),
            "allreduce": _summary(o["allreduce"]),
            "cpu_seconds_all_peers": _summary(o["cpu"]),
            "correct": o_correct,
            "max_abs_error": o_err,
        }
        # each repetition of this code against the other code's repetition next to it in time
        out["paired_ratio_vs_checkout"] = statistics.median(a["wall"] / b["wall"] for a, b in zip(zg_rows, ot_rows))
        out["paired_cpu_ratio_vs_checkout"] = statistics.median(a["cpu"] / b["cpu"] for a, b in zip(zg_rows, ot_rows))
    return out


def _mean_of_peers(seed: int, peers: int, numel: int) -> np.ndarray:
    acc = np.zeros(numel, dtype=np.float64)
    for i in range(peers):
        acc += peer_data(seed, i, numel)
    return acc / peers


# ---------------------------------------------------------------------------- matchmaking
def curve_kwargs(peers: int) -> list[dict]:
    """Per-peer Averager arguments for a swarm with CURVE keys where every peer allows every other."""
    from .identity import KeyPair

    keys = [KeyPair.generate() for _ in range(peers)]
    return [{"secret_key": k, "allowed_keys": [x.public for x in keys]} for k in keys]


def bench_matchmaking(peers: int = 8, numel: int = 1024, steps: int = MIN_MATCHMAKING_STEPS, seed: int = 0,
                      timeout: float = 60.0, curve: bool = False, target_group_size: int | None = None) -> dict:
    kw = _swarm_kwargs(peers, None, timeout)
    if target_group_size is not None and target_group_size != peers:
        # a swarm smaller (or larger) than its target, on the Averager's defaults otherwise
        kw.update(target_group_size=target_group_size, min_group_size=min(2, target_group_size))
        kw.pop("matchmaking_time")
    with LocalSwarm(peers, numel, seed=seed, averager_kwargs=kw, start_timeout=timeout,
                    per_peer_kwargs=curve_kwargs(peers) if curve else None) as swarm:
        swarm.wait_membership(timeout=min(timeout, 30.0))
        for _ in range(WARMUP):
            _step_once(swarm, timeout)
        load = OtherLoad([i["pid"] for i in swarm.info])
        times = _collect([_step_once(swarm, timeout) for _ in range(steps)])
        foreign = load.cores()
    return {
        "benchmark": "matchmaking",
        "curve": curve,
        "peers": peers,
        "numel": numel,
        "steps": steps,
        "other_load_cores": foreign,
        "target_group_size": kw["target_group_size"],
        "matchmaking": _summary(times["matchmaking"]),
        "step": _summary(times["wall"]),
        "machine": machine(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


# ---------------------------------------------------------------------------- CLI
def _ms(s: float) -> str:
    return f"{s * 1000:8.1f} ms"


def _thread_lines(rows: dict[str, dict[str, float]]) -> list[str]:
    return [f"      {kind:<22}user {r['user_ms']:6.1f} ms  sys {r['sys_ms']:6.1f} ms  minor faults {r['minor_faults']:7.0f}"
            for kind, r in rows.items()]


def _line(name: str, s: dict) -> str:
    return f"  {name:<24}median {_ms(s['median'])}   min {_ms(s['min'])}   max {_ms(s['max'])}"


def run(args: argparse.Namespace) -> int:
    if args.reps < MIN_REPS:
        print(f"zgossip bench: --reps must be at least {MIN_REPS}", file=sys.stderr)
        return 2
    if args.matchmaking:
        peers = args.peers or 8
        numel = 1024 if args.numel is None else args.numel
        res = bench_matchmaking(peers, numel, max(args.reps, MIN_MATCHMAKING_STEPS), args.seed, args.timeout,
                                args.curve, args.target_group_size)
        if args.json:
            print(json.dumps(res))
        else:
            print(f"zgossip bench --matchmaking{' --curve' if args.curve else ''}: {peers} peers that know each other, {numel} floats, "
                  f"target group size {res['target_group_size']}, {res['steps']} steps (max over peers per step)")
            print(f"  {machine_line(res['machine'])}, load {res['loadavg'][0]:.2f}")
            print(_line("matchmaking", res["matchmaking"]))
            print(_line("whole step", res["step"]))
            print(f"  other processes kept {res['other_load_cores']:.2f} cores busy meanwhile")
        return 0

    peers = args.peers or 4
    numel = 16777216 if args.numel is None else args.numel
    if peers < 2 or numel < 1:
        print("zgossip bench: need --peers >= 2 and --numel >= 1", file=sys.stderr)
        return 2
    if args.curve:
        return _run_curve(args, peers, numel)
    try:
        vs_env = _parse_env(args.vs_env)
    except ValueError as e:
        print(f"zgossip bench: {e}", file=sys.stderr)
        return 2
    out = bench_allreduce(peers, numel, args.reps, args.part_size, args.seed, args.timeout, args.vs == "gloo",
                          args.vs_checkout, args.tcp_only, vs_env=vs_env, compression=args.compression)
    zg = out["zgossip"]
    if args.json:
        print(json.dumps(out))
        return 0 if zg["correct"] else 1
    part = "default" if args.part_size is None else f"{args.part_size / 2**20:g} MiB"
    print(f"zgossip bench: {peers} peers x {numel} float32 ({numel * 4 / 2**20:.1f} MiB), {args.reps} reps "
          f"after {WARMUP} warm-up, part size {part}; max over peers per rep")
    print(f"  {machine_line(out['machine'])}")
    if args.compression:
        print(f"  wire compression: {args.compression}")
    print(f"  between peers: {zg['transport']}; C kernels: {'yes' if zg['native_kernels'] else 'no (numpy)'}; "
          f"zero-copy sends: {'zgossip._zsend' if zg['fast_send'] else 'pyzmq'}")
    if zg["paths"] is not None:
        print(f"  {paths_line(zg['paths'])}")
    print(_line("zgossip step()", zg["step"]))
    print(_line("  of which all-reduce", zg["allreduce"]))
    print(_line("  of which matchmaking", zg["matchmaking"]))
    print(_line("  CPU, all peers", zg["cpu_seconds_all_peers"]))
    if zg["cpu_by_thread"]:
        print("    by thread, per step (/proc counters, all peers):")
        print("\n".join(_thread_lines(zg["cpu_by_thread"])))
    print(f"  correct: {'yes' if zg['correct'] else 'NO'} (max |error| vs float64 mean {zg['max_abs_error']:.2e})")
    ratio = zg["memory"]["extra_peak_ratio"]
    if ratio is not None:
        print(f"  extra peak memory per peer: {max(zg['memory']['extra_peak_bytes_per_peer']) / 2**20:.1f} MiB "
              f"= {ratio:.2f}x the averaged tensor")
    if "gloo" in out:
        gl = out["gloo"]
        print(_line("gloo all_reduce", gl["all_reduce"]))
        print(_line("  CPU, all ranks", gl["cpu_seconds_all_peers"]))
        if gl["cpu_by_thread"]:
            print("    by thread, per step (/proc counters, all ranks):")
            print("\n".join(_thread_lines(gl["cpu_by_thread"])))
        print(f"  gloo correct: {'yes' if gl['correct'] else 'NO'}")
        print(f"  ratio zgossip/gloo (medians): time {out['ratio']:.2f}x, CPU {out['cpu_ratio']:.2f}x "
              "(lower is better for zgossip)")
        print(f"    all-reduce phase alone (no matchmaking): {out['ratio_allreduce_phase']:.2f}x")
    if "uncompressed" in out:
        un, cc = out["uncompressed"], out["codec_cost"]
        print(_line("uncompressed step()", un["step"]) + "   (same code, compression none, side by side)")
        print(_line("  CPU, all peers", un["cpu_seconds_all_peers"]))
        print(f"  paired ratio {out['compression']}/uncompressed (median over repetitions side by side): time "
              f"{out['paired_ratio_vs_uncompressed']:.3f}x, CPU {out['paired_cpu_ratio_vs_uncompressed']:.3f}x")
        print(f"  codec cost on one core, one span ({numel // peers} values): encode "
              f"{cc['encode_seconds'] * 1000:.1f} ms, decode {cc['decode_seconds'] * 1000:.1f} ms; "
              f"{cc['bytes_ratio']:.3f}x the bytes")
    if "checkout" in out:
        ck = out["checkout"]
        what = " ".join([*([ck["path"]] if ck["path"] else ["this code"]), *(f"{k}={v}" for k, v in ck["env"].items())])
        print(_line("other step()", ck["step"]) + f"   ({what}"
              + ("" if ck["native_kernels"] else ", numpy kernels") + ")")
        if ck["paths"] is not None:
            print(f"    {paths_line(ck['paths'])}")
        print(_line("  CPU, all peers", ck["cpu_seconds_all_peers"]))
        print(f"  other correct: {'yes' if ck['correct'] else 'NO'}")
        print(f"  paired ratio this/other (median over repetitions side by side): time "
              f"{out['paired_ratio_vs_checkout']:.3f}x, CPU {out['paired_cpu_ratio_vs_checkout']:.3f}x")
    print(f"  other processes kept {out['other_load_cores']:.2f} cores busy meanwhile")
    return 0 if zg["correct"] else 1


def _run_curve(args: argparse.Namespace, peers: int, numel: int) -> int:
    """The same swarm without keys and with CURVE keys, run in the order plain, CURVE, CURVE,
    plain (the load on a shared machine drifts: one pass of each, plain first, once read 1.8x
    where these paired passes read 1.0x); the ratio of the medians over both passes of each."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    load = []
    for curve in (False, True, True, False):
        r = bench_allreduce(peers, numel, args.reps, args.part_size, args.seed, args.timeout, tcp_only=args.tcp_only,
                            curve=curve)
        runs[curve].append(r["zgossip"])
        load.append(r["other_load_cores"])
        mach = r["machine"]

    def pooled(curve: bool) -> dict:
        rs = runs[curve]
        return {"step": _summary([x for r in rs for x in r["step"]["all"]]),
                "cpu_seconds_all_peers": _summary([x for r in rs for x in r["cpu_seconds_all_peers"]["all"]]),
                "correct": all(r["correct"] for r in rs), "transport": rs[0]["transport"],
                "pass_medians": [r["step"]["median"] for r in rs]}

    plain, cur = pooled(False), pooled(True)
    out = {"benchmark": "allreduce-curve", "peers": peers, "numel": numel, "order": "plain, CURVE, CURVE, plain",
           "plain": plain, "curve": cur, "ratio": cur["step"]["median"] / plain["step"]["median"],
           "cpu_ratio": cur["cpu_seconds_all_peers"]["median"] / plain["cpu_seconds_all_peers"]["median"],
           "other_load_cores": max(load), "machine": mach}
    ok = plain["correct"] and cur["correct"]
    if args.json:
        print(json.dumps(out))
        return 0 if ok else 1
    print(f"zgossip bench --curve: {peers} peers x {numel} float32 ({numel * 4 / 2**20:.1f} MiB), {args.reps} reps "
          f"per pass, passes plain, CURVE, CURVE, plain; between peers: {cur['transport']}"
          + ("" if cur["transport"] != "unix sockets" else " (authenticated by key proof, not encrypted)"))
    print(f"  {machine_line(out['machine'])}")
    for name, r in (("plain", plain), ("CURVE", cur)):
        print(_line(f"{name} step()", r["step"]) + "   (pass medians "
              + ", ".join(f"{m * 1000:.0f}" for m in r["pass_medians"]) + " ms)")
        print(_line(f"  {name} CPU, all peers", r["cpu_seconds_all_peers"]))
    print(f"  ratio CURVE/plain (medians): step {out['ratio']:.2f}x, CPU {out['cpu_ratio']:.2f}x; "
          f"correct: {'yes' if ok else 'NO'}")
    print(f"  other processes kept {out['other_load_cores']:.2f} cores busy meanwhile (most in one pass)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zgossip bench", description=(__doc__ or "").splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
