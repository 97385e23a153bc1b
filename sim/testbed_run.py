"""A scenario on the testbed: the simulator's experiment with real peer processes on emulated links.

`run_testbed(scenario)` builds a `sim.testbed.Testbed` from the scenario's ``[[hosts]]``,
starts one `sim.testbed_peer` process per host (each an `Averager` of this checkout,
configured exactly as the simulator configures its nodes), plays the scenario's faults at
their times, and steps every round from a common start instant. t = 0 is the moment every
peer process is listening; ``bootstrap_time`` passes before round 0, as in the simulator.

Its result has the simulator's shape (``scenario``, ``rounds`` with the same keys computed
by the same `sim.scenario.round_metrics`, ``peer_bytes``) plus a ``testbed`` section
(per-peer step reports, kernel byte counters per link, forwarder CPU and timing, machine).

What a replay needs to model this machine is recorded too (`sim.compare.replay_scenario`
reads it): ``testbed.tcp``, the TCP settings the host namespaces really use (read inside host
0's namespace: congestion control, buffers, slow start after idle), and ``testbed.cpu``, this
machine's calibrated cost profile (`sim.cpu`, the cached one, calibrated once) with its core
count, since every peer, the forwarder and the kernel's TCP share those cores.

Differences from the simulator, on purpose: times are wall seconds; bytes are the
kernel's counters on each host's link (TCP/IP headers included), not message sizes;
a peer that rejoins starts from the tensor it wrote after its last finished step.
Not supported (refused up front): ``churn`` and ``membership = "static"``.
"""
from __future__ import annotations

import heapq
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from zgossip.grid import MoshpitGrid, seed_from
from zgossip.machine import OtherLoad

from .faults import FaultContext, fault_from_dict
from .scenario import _FAST_PROTOCOL, Scenario, place_peers, round_metrics
from .testbed import Testbed, machine_info

__all__ = ["run_testbed", "PeerProcess", "averager_settings", "PORT"]

PORT = 41000
_AVERAGER_KEYS = {"prefix", "target_group_size", "min_group_size", "matchmaking_time", "request_timeout",
                  "part_size_bytes", "part_timeout", "allreduce_timeout", "gossip_interval", "peer_timeout",
                  "bandwidth", "part_timeout_floor", "deadline_slack", "grid", "grid_coords", "compression", "error_feedback"}


def averager_settings(sc: Scenario, coords: tuple, index: int) -> dict:
    """The Averager keyword arguments for slot `index`: the simulator's NodeConfig (ScenarioRun._config)."""
    kw = {**_FAST_PROTOCOL, "prefix": "scenario", "grid": tuple(sc.grid), **sc.protocol}
    if sc.grid:
        kw.setdefault("target_group_size", max(sc.grid))
    kw["grid_coords"] = list(coords) if sc.grid else None
    kw["grid"] = list(kw["grid"])
    hosts = sc.host_list()
    if index < len(hosts) and hosts[index].hint is not None:
        kw["bandwidth"] = hosts[index].hint if hosts[index].hint == "auto" else float(hosts[index].hint)
    if sc.compression != "none" or sc.error_feedback:  # as the simulator's peers (ScenarioRun._add)
        kw["compression"], kw["error_feedback"] = sc.compression, sc.error_feedback
    bad = set(kw) - _AVERAGER_KEYS
    if bad:
        raise ValueError(f"protocol settings {sorted(bad)} are not Averager settings: the testbed cannot apply them")
    return kw


class PeerProcess:
    """One `sim.testbed_peer` child: JSON lines in over stdin, out over stdout (read by a thread)."""

    def __init__(self, tb: Testbed, slot: int, config: dict, log_path: str) -> None:
        self.slot = slot
        self.log = open(log_path, "ab")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(Path(__file__).resolve().parents[1]),
                                                                         os.environ.get("PYTHONPATH", "")] if p)}
        self.proc = tb.popen(slot, [sys.executable, "-m", "sim.testbed_peer"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.replies: queue.Queue = queue.Queue()
        self.ready: dict | None = None
        self.paused = False
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"testbed-peer-{slot}")
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.replies.put(json.loads(line))
            except ValueError:
                continue
        self.replies.put(None)  # EOF: the process is gone

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, obj: dict) -> bool:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def wait_ready(self, timeout: float) -> dict:
        """Block (bounded) until the process listens; its ready message (endpoint, peer_id, pid)."""
        try:
            msg = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"peer {self.slot} did not start within {timeout:.0f}s") from None
        if not msg or not msg.get("ready"):
            self.log.flush()
            try:
                tail = Path(self.log.name).read_text(errors="replace")[-800:]
            except OSError:
                tail = ""
            # the cause first (the exception, the last line of a traceback): "failed to start: None" and
            # 800 characters of traceback put it at the very end of the message
            lines = [ln for ln in tail.splitlines() if ln.strip()]
            cause = lines[-1].strip() if lines else ("exited" if msg is None else repr(msg))
            raise RuntimeError(f"peer {self.slot} failed to start: {cause}; its stderr ends:\n{tail}")
        self.ready = msg
        return msg

    def close(self, tb: Testbed) -> None:
        if self.alive and not self.paused:  # a frozen process (a pause still on) cannot act on "stop":
            self.send({"cmd": "stop"})      # waiting for it cost 3 s per paused peer at every teardown
            try:
                self.proc.wait(3.0)
            except subprocess.TimeoutExpired:
                pass
        tb.kill(self.proc)
        self._reader.join(2.0)
        self.log.close()


class _Net:
    """Collects what `sim.faults` installs on a network (partitions, slow links) for the scheduler."""

    def __init__(self) -> None:
        self.partitions: list = []
        self.slow_links: list = []


class _Controller(FaultContext):
    def __init__(self, sc: Scenario, tb: Testbed, say: Callable[[str], None]) -> None:
        self.sc, self.tb, self.say = sc, tb, say
        self.network = _Net()
        self.initial_count = sc.peers
        self.lock = threading.RLock()
        self.events: list = []
        self._seq = 0
        self.t0 = 0.0
        self.slots: list[PeerProcess | None] = [None] * sc.peers
        self.generation = [0] * sc.peers
        self.fault_log: list[dict] = []
        self.peer_ids: dict[int, list[str]] = {}  # slot -> peer id of each process it had
        self.grid = MoshpitGrid(tuple(sc.grid))
        self.coords = self._placement()

    # ---------------------------------------------------------------- FaultContext
    def rng(self, purpose: str) -> np.random.Generator:
        return np.random.default_rng([self.sc.seed, seed_from(purpose)])

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, fn))

    def peer(self, index: int) -> Any:
        ctl = self

        class _Handle:  # what Pause calls
            def pause(self) -> None:
                ctl._pause(index, True)

            def resume(self) -> None:
                ctl._pause(index, False)

        return _Handle()

    def endpoint(self, index: int) -> str:
        return f"tcp://{self.tb.ip(index)}:{PORT}"

    def crash(self, index: int) -> None:
        with self.lock:
            p = self.slots[index]
            if p is not None and p.alive:
                self.tb.kill(p.proc)
            self._log("crash", index)

    def rejoin(self, index: int) -> None:
        with self.lock:
            p = self.slots[index]
            if p is not None and p.alive:
                return
            self.generation[index] += 1
            self._start(index)
            self._log("rejoin", index)

    def arrive(self) -> None:  # pragma: no cover - churn is refused up front
        raise NotImplementedError

    # ---------------------------------------------------------------- setup
    def _placement(self) -> list[tuple]:
        return place_peers(self.grid, self.sc.peers, self.sc.placement, self.rng("placement"))

    def _start(self, index: int) -> PeerProcess:
        live = [i for i, p in enumerate(self.slots) if p is not None and p.alive and i != index]
        boot = [self.endpoint(live[0])] if live else ([] if index == 0 else [self.endpoint(0)])
        keys = getattr(self, "keys", None)  # CURVE: a key pair per slot (a restarted process keeps it)
        if keys is not None:
            boot = [f"{ep}#{keys[live[0] if live else 0].public}" for ep in boot]
        cfg = {"slot": index, "listen": self.endpoint(index), "initial_peers": boot,
               "curve": None if keys is None else {"public": keys[index].public, "secret": keys[index].secret,
                                                   "allowed": [k.public for k in keys]},
               "tensor": self.tb.shm_path(f"t{index}.npy"), "dtype": self.sc.dtype,
               "averager": {**averager_settings(self.sc, self.coords[index], index),
                            "seed": self.sc.seed * 1_000_003 + index * 1009 + self.generation[index]}}
        p = PeerProcess(self.tb, index, cfg, self.tb.shm_path(f"log{index}"))
        self.slots[index] = p
        return p

    def _pause(self, index: int, on: bool) -> None:
        with self.lock:
            p = self.slots[index]
            if p is None or not p.alive:
                return
            (self.tb.stop if on else self.tb.cont)(p.proc)
            p.paused = on
            self._log("pause" if on else "resume", index)

    def _log(self, what: str, *args: Any) -> None:
        self.fault_log.append({"t": round(time.monotonic() - self.t0, 4), "fault": what, "args": list(args)})

    def install_faults(self) -> None:
        for f in self.sc.faults:
            fault_from_dict(f).install(self)
        slot_of = {self.endpoint(i): i for i in range(self.sc.peers)}
        for part in self.network.partitions:
            a = sorted(slot_of[e] for e in part.side_a)
            b = sorted(slot_of[e] for e in part.side_b)
            w = part.one_way
            self.at(part.start, lambda a=a, b=b, w=w: (self.tb.partition(a, b, w), self._log("partition", a, b, w)))
            self.at(part.end, lambda a=a, b=b, w=w: (self.tb.unpartition(a, b, w), self._log("heal", a, b, w)))
        for s in self.network.slow_links:
            i = slot_of[s.endpoint]
            self.at(s.start, lambda i=i, f=s.factor: (self.tb.slow(i, f), self._log("slow", i, f)))
            self.at(s.end, lambda i=i: (self.tb.restore(i), self._log("restore", i)))

    def run_faults(self, stop: threading.Event) -> None:
        """Fire each scheduled fault at t0 + t (a thread; every wait bounded by `stop`)."""
        while not stop.is_set():
            with self.lock:
                nxt = self.events[0][0] if self.events else None
            if nxt is None:
                return
            delay = self.t0 + nxt - time.monotonic()
            if delay > 0:
                stop.wait(min(delay, 0.5))
                continue
            with self.lock:
                _, _, fn = heapq.heappop(self.events)
            try:
                fn()
            except Exception as e:  # a failed fault is reported, the run goes on
                self._log("error", repr(e))


def run_testbed(sc: Scenario | dict, progress: Callable[[int, int], None] | None = None,
                say: Callable[[str], None] = lambda s: None,
                on_round: Callable[[int, dict[int, np.ndarray]], None] | None = None,
                sysctls: dict[str, str] | None = None, curve: bool = False) -> dict:
    """Run the scenario on real peers in an emulated network; returns the results dict (see module doc).

    ``curve``: every peer gets a CURVE key pair and allows the others' (authenticated, encrypted links).

    ``on_round(r, {slot: tensor})`` sees every live peer's tensor after round r (e.g. for tests that
    check each peer's result against its group's inputs); ``testbed.peers`` in the result maps each
    slot to the peer ids it had (one per process generation), ``testbed.initial`` is not stored."""
    if isinstance(sc, dict):
        sc = Scenario.from_dict(sc)
    if not sc.hosts:
        raise ValueError("the testbed needs explicit [[hosts]] (rates, latency, loss per host); this scenario "
                         "has none (profiles/[network] are simulator-only)")
    if sc.churn:
        raise ValueError("the testbed does not run churn (arrivals need hosts that do not exist yet)")
    if sc.membership != "gossip":
        raise ValueError("the testbed runs membership = \"gossip\" only (real peers bootstrap from peer 0)")
    hosts = sc.host_list()
    from dataclasses import fields

    from zgossip.node import NodeConfig

    node_keys = {f.name for f in fields(NodeConfig)}
    for i in range(sc.peers):
        kw = averager_settings(sc, (), i)  # refuse unknown settings before building anything
        # and bad values (part_size_bytes = 8): else every peer process died at start, and the error
        # was 800 characters of its traceback after the namespaces had been built
        NodeConfig(**{k: v for k, v in kw.items() if k in node_keys and k not in ("grid", "grid_coords")})
    values_rng = np.random.default_rng([sc.seed, seed_from("values")])
    initial = [values_rng.standard_normal(sc.numel).astype(sc.dtype) for _ in range(sc.peers)]
    truth = np.stack(initial).astype(np.float64).mean(axis=0)
    unavail_rng = np.random.default_rng([sc.seed, seed_from("unavailability")])
    cpu = machine_cpu()
    with Testbed(hosts, seed=sc.seed, sysctls=sysctls) as tb:
        tcp = namespace_tcp(tb)
        ctl = _Controller(sc, tb, say)
        if curve:
            from zgossip.identity import KeyPair

            ctl.keys = [KeyPair.generate() for _ in range(sc.peers)]
        stop = threading.Event()
        fault_thread = None
        try:
            for i, x in enumerate(initial):
                np.save(tb.shm_path(f"t{i}.npy"), x)
            ctl.install_faults()
            for i in range(sc.peers):
                ctl._start(i)
            for i, p in enumerate(ctl.slots):
                ctl.peer_ids.setdefault(i, []).append(p.wait_ready(60.0)["peer_id"])
            ctl.t0 = time.monotonic()
            say(f"testbed {tb.id}: {sc.peers} peers listening on 10.{tb.subnet[0]}.{tb.subnet[1]}.0/24")
            fault_thread = threading.Thread(target=ctl.run_faults, args=(stop,), daemon=True, name="testbed-faults")
            fault_thread.start()
            time.sleep(sc.bootstrap_time)
            fwd0 = tb.forwarder_stats()
            # other processes' user CPU over the rounds: a run on a busy machine is not the links' figure
            other = OtherLoad(tree=True)
            rounds, steps = [], []
            limit = sc.step_timeout + float(averager_settings(sc, (), 0)["allreduce_timeout"]) + 1.0
            for r in range(sc.rounds):
                rounds.append(_round(ctl, tb, r, unavail_rng, truth, limit, steps, on_round))
                if sc.round_gap:
                    time.sleep(sc.round_gap)
                if progress:
                    progress(r + 1, sc.rounds)
            counters = tb.link_counters()
            fwd = tb.forwarder_stats()
            other_cores = other.cores()
            qdiscs = tb.qdisc_stats()
        finally:
            stop.set()
            if fault_thread is not None:
                fault_thread.join(5.0)
            for p in ctl.slots:
                if p is not None:
                    p.close(tb)
    peer_bytes = [[c["sent_bytes"], c["received_bytes"]] for c in counters]
    return {
        "scenario": sc.to_dict(),
        "rounds": rounds,
        "peer_bytes": peer_bytes,
        "testbed": {
            "id": tb.id,
            "steps": steps,
            "peers": ctl.peer_ids,
            "faults": ctl.fault_log,
            "links": counters,
            "qdiscs": qdiscs,
            "forwarder": {"cpu_seconds": fwd["cpu_seconds"],
                          "cpu_seconds_rounds": fwd["cpu_seconds"] - fwd0["cpu_seconds"],
                          "late_mean_us": fwd["late_mean_us"], "late_max_us": fwd["late_max_us"],
                          "realtime": fwd.get("realtime", False), "rx_wait_mean_us": fwd.get("rx_wait_mean_us"),
                          "ports": fwd["ports"]},
            # cores of user CPU that processes outside this run (not this process nor its children) used
            # during the rounds (`zgossip.machine.tree_user_seconds`)
            "other_user_cores": other_cores,
            "gso": tb.gso,
            "sysctls": tb.sysctls,
            "tcp": tcp,
            "cpu": cpu,
            "machine": machine_info(),
        },
    }


_TCP_SYSCTLS = ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.ipv4.tcp_adv_win_scale",
                "net.ipv4.tcp_slow_start_after_idle", "net.ipv4.tcp_congestion_control")


def namespace_tcp(tb: Testbed, slot: int = 0) -> dict:
    """`sim.tcp.TcpParams` as host `slot`'s namespace has them (a namespace need not inherit the
    machine's settings, and ``--sysctl`` changes them)."""
    from .tcp import TcpParams

    p = subprocess.run(["ip", "netns", "exec", tb.ns(slot), "sysctl", "-n", *_TCP_SYSCTLS],
                       capture_output=True, text=True, timeout=10)
    vals = p.stdout.splitlines()
    if p.returncode != 0 or len(vals) != len(_TCP_SYSCTLS):
        return TcpParams.from_sysctl().to_dict()
    rmem, wmem, scale, ssai, cc = vals
    return TcpParams(rmem_max=int(rmem.split()[2]), wmem_max=int(wmem.split()[2]), adv_win_scale=int(scale),
                     slow_start_after_idle=ssai.strip() != "0", congestion_control=cc.strip()).to_dict()


def machine_cpu() -> dict:
    """This machine's CPU cost profile (`sim.cpu`, cached; calibrated on first use) and cores."""
    from .cpu import default_profile_path, load_profile

    prof = load_profile(default_profile_path(create=True))
    return {"costs": prof["cpu"], "cores": os.cpu_count() or 1, "machine": prof.get("machine", {})}


def _note_ready(ctl: _Controller, slot: int, msg: dict | None) -> None:
    if msg and msg.get("ready"):
        ctl.slots[slot].ready = msg
        ctl.peer_ids.setdefault(slot, []).append(msg["peer_id"])


def _round(ctl: _Controller, tb: Testbed, r: int, unavail_rng: np.random.Generator, truth: np.ndarray,
           limit: float, steps: list, on_round: Callable | None = None) -> dict:
    sc = ctl.sc
    with ctl.lock:
        draws = unavail_rng.random(len(ctl.slots))  # one draw per slot, alive or not, as the simulator
        live = [i for i, p in enumerate(ctl.slots) if p is not None and p.alive]
        steppers = [i for i in live if draws[i] >= sc.unavailability and not ctl.slots[i].paused]
        procs = {i: ctl.slots[i] for i in steppers}
    before = {c["host"]: c for c in tb.link_counters()}
    # a common start a little ahead, like the bench's aligned starts (scheduled steps: the all-reduce's)
    at = time.monotonic() + 0.05 + sc.step_ahead
    t_start = at - ctl.t0
    for i, p in procs.items():
        while not p.replies.empty():  # answers to earlier rounds that came too late, or a rejoiner's hello
            _note_ready(ctl, i, p.replies.get_nowait())
        p.send({"cmd": "step", "round": r, "at": at, "timeout": sc.step_timeout, "ahead": sc.step_ahead})
    replies: dict[int, dict] = {}
    gone: set[int] = set()  # processes that died before answering
    deadline = at + limit + 5.0  # +5 s: the peer's own bound also covers writing its tensor back
    while len(replies) < len(procs) and time.monotonic() < deadline:
        for i, p in procs.items():
            if i in replies:
                continue
            try:
                msg = p.replies.get(timeout=0.02)
            except queue.Empty:
                continue
            if msg is None:  # killed mid-step: the simulator ends such a step at once as `Crashed`
                gone.add(i)
                replies[i] = {"round": r, "slot": i, "outcome": "failed", "error": "Crashed",
                              "seconds": time.monotonic() - at}
            elif msg.get("round") == r:
                replies[i] = msg
            else:
                _note_ready(ctl, i, msg)
    # the round lasts until its last step ended (or until the bound, if one never did), as in the simulator
    end = max([at + m["seconds"] for m in replies.values()], default=at) if len(replies) == len(procs) \
        else time.monotonic()
    after = {c["host"]: c for c in tb.link_counters()}
    with ctl.lock:
        live_now = [i for i, p in enumerate(ctl.slots) if p is not None and p.alive]
    tensors = [np.load(tb.shm_path(f"t{i}.npy")) for i in live_now]
    if on_round is not None:
        on_round(r, dict(zip(live_now, tensors)))
    outcomes = []
    for i in steppers:
        m = replies.get(i)
        if m is None:
            outcomes.append(("unfinished",))
        elif m["outcome"] == "done":
            outcomes.append(("done", m["group_id"], m["group_size"]))
        else:
            outcomes.append(("failed", m["error"]))
        steps.append({"round": r, "slot": i, **(m or {"outcome": "unfinished"})})
    sent = [after[i]["sent_bytes"] - before[i]["sent_bytes"] for i in steppers]
    recv = [after[i]["received_bytes"] - before[i]["received_bytes"] for i in steppers]
    out = round_metrics(r, t_start, max(0.0, end - at), tensors, truth, sc.numel, len(steppers), outcomes, sent, recv)
    out["step_seconds"] = [[i, replies[i]["seconds"]] for i in sorted(replies)]
    out["phase_seconds"] = [[i, replies[i]["timings"].get("matchmaking", 0.0), replies[i]["timings"].get("allreduce", 0.0)]
                            for i in sorted(replies) if replies[i].get("timings")]
    return out
