"""The emulated multi-host testbed: real zgossip peers in Linux network namespaces on shaped links.

This module owns the emulated network and its lifetime:

* `Testbed` -- a context manager that builds one namespace per host plus a "switch"
  namespace, a veth pair per host (host side ``zgtbXXXXXXh<i>``, switch side
  ``zgtbXXXXXXs<i>``), addresses from a private /24 that exists only on those links (no
  default route: nothing routes anywhere else), tbf rate limits on both veth ends (host
  side = uplink, switch side = downlink) and the `linkemu` forwarder (``sim/linkemu.c``,
  compiled on first use into ``~/.cache/zgossip/``) that switches frames between the
  switch-side veths, delaying them by ``latency_i + latency_j`` (+ jitter) and dropping
  them for loss and partitions. It runs commands in a host's namespace and applies faults
  (kill, stop/cont, partition on/off, rate changes); on exit everything it made is gone.
* `cleanup` -- removes what a crashed run left behind (``python -m sim testbed --cleanup``):
  every run writes a state file (owner pid, namespaces, shm files) under
  ``/run/zgossip-testbed`` before creating anything.
* `check_support` -- why a testbed cannot run here (no root, no netns, no tc), or None.

Scenario runs on it (`run_testbed`) live in `sim.testbed_run`; the peer process in
`sim.testbed_peer`; link measurements in `sim.testbed_probe`.

Where the model differs from the simulator's (`sim.network`): the whole one-way delay
``lat_i + lat_j`` is applied in the switch, between the sender's uplink tbf and the
receiver's downlink tbf (the simulator puts it between uplink and downlink too, with
cut-through); queues are finite (tbf holds 200 ms of the link's rate, at least 512 KiB,
then tail-drops, and TCP retransmits; the simulator models that where a scenario gives its
downlinks a ``down_queue``, as the replay of a testbed run does); a partition drops packets,
so TCP retries and delivers what was queued once it heals (the simulator loses those messages).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from .scenario import HostSpec

__all__ = ["TBF_QUEUE", "Testbed", "TestbedUnavailable", "check_output_paths", "check_support", "cleanup", "forwarder_binary",
           "interrupt_on_signals", "PREFIX", "STATE_DIR"]

PREFIX = "zgtb"
STATE_DIR = Path(os.environ.get("ZGOSSIP_TESTBED_STATE", "/run/zgossip-testbed"))
CACHE_DIR = Path(os.environ.get("ZGOSSIP_CACHE", Path.home() / ".cache" / "zgossip"))
_SOURCE = Path(__file__).with_name("linkemu.c")
_CMD_TIMEOUT = 10.0  # every ip/tc call is bounded
#: every tbf's queue: 200 ms of the link's rate, at least 512 KiB, then tail drop; the simulator's replay
#: of a run gives its downlinks the same ([network] down_queue, `sim.compare.replay_scenario`)
TBF_QUEUE = {"seconds": 0.2, "min_bytes": 512 << 10}
# linkemu switches at most this many ports (MAXP in linkemu.c); more hosts used to build every
# namespace and then fail with "linkemu did not start: '' at most 64 ports"
MAX_HOSTS = 64


class TestbedUnavailable(RuntimeError):
    """The testbed cannot run on this machine; str() is a one-line reason."""


def _mac(i: int) -> str:
    # the forwarder reads the output port from the destination MAC (see linkemu.c)
    return f"02:7a:74:62:{i >> 8:02x}:{i & 0xff:02x}"


def _sh(argv: Sequence[str], check: bool = True, input: str | None = None,
        timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess:
    # its own session: a Ctrl-C at the terminal goes to the whole foreground group, and an `ip netns
    # del` killed by it would leave its namespace behind (this process tears down; the call is bounded)
    p = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout,
                       start_new_session=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {p.stderr.strip() or p.stdout.strip()}")
    return p


def check_support() -> str | None:
    """None if a testbed can be built here, else a one-line reason. ``ZGOSSIP_TESTBED_PRETEND_UNPRIVILEGED=1``
    pretends not to be root (to test the refusal)."""
    if os.environ.get("ZGOSSIP_TESTBED_PRETEND_UNPRIVILEGED") == "1" or os.geteuid() != 0:
        return "the testbed needs root (network namespaces, veth links and qdiscs)"
    for tool in ("ip", "tc", "cc"):
        if shutil.which(tool) is None:
            return f"the testbed needs the '{tool}' command"
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces"
    probe = f"{PREFIX}probe{os.getpid()}"
    p = _sh(["ip", "netns", "add", probe], check=False)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    _sh(["ip", "netns", "del", probe], check=False)
    return None


def check_output_paths(paths: Iterable[str | None]) -> str | None:
    """None if every given path can be written, else a one-line reason. A testbed run (or the fidelity
    matrix) writes its results at the end: checked first, a missing folder or a read-only place
    costs no run. A file that did not exist is not left behind by the check."""
    for path in paths:
        if not path:
            continue
        existed = os.path.lexists(path)
        try:
            with open(path, "a"):
                pass
        except OSError as e:
            return f"cannot write {path}: {e.strerror or e}"
        if not existed:
            os.unlink(path)
    return None


def forwarder_binary() -> Path:
    """The compiled `linkemu`, built from this checkout's source on first use (cached by its hash)."""
    src = _SOURCE.read_bytes()
    out = CACHE_DIR / f"linkemu-{hashlib.sha256(src).hexdigest()[:16]}"
    if out.exists():
        return out
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    p = subprocess.run(["cc", "-O2", "-o", str(tmp), str(_SOURCE), "-lm"], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise TestbedUnavailable(f"cannot compile {_SOURCE.name}: {p.stderr.strip().splitlines()[-1:]}")
    os.replace(tmp, out)  # atomic: a concurrent run sees the whole binary or none
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _ns_pids(ns: str) -> list[int]:
    p = _sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _kill_ns(ns: str) -> int:
    """SIGKILL every process in `ns` (and reap what we can), then delete it; returns the number killed."""
    pids = _ns_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5.0
    while pids and time.monotonic() < deadline and any(_pid_alive(p) and not _zombie(p) for p in pids):
        time.sleep(0.02)
    _sh(["ip", "netns", "del", ns], check=False)
    return len(pids)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _netns_list() -> list[str]:
    p = _sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def cleanup(force: bool = False) -> dict:
    """Remove every ``zgtb*`` namespace, link, process and /dev/shm file whose run is over.

    A run is over when the owner pid in its state file is gone (or with `force`: then live
    runs are torn down too). Namespaces with no state file at all are orphans and go."""
    removed: dict[str, list] = {"runs": [], "namespaces": [], "links": [], "shm": [], "processes": []}
    live_ids: set[str] = set()
    if STATE_DIR.exists():
        for f in sorted(STATE_DIR.glob(f"{PREFIX}*.json")):
            try:
                st = json.loads(f.read_text())
            except (OSError, ValueError):
                st = {}
            if st.get("owner") and _pid_alive(int(st["owner"])) and not force and int(st["owner"]) != os.getpid():
                live_ids.add(f.stem)
                continue
            for pid in st.get("pids", []):
                if _pid_alive(pid) and _owned_by_run(pid, f.stem):
                    os.kill(pid, signal.SIGKILL)
                    removed["processes"].append(pid)
            removed["runs"].append(f.stem)
            f.unlink(missing_ok=True)
    for ns in _netns_list():
        run_id = ns.split("-")[0]
        if ns.startswith(PREFIX) and run_id not in live_ids and not _live_run(run_id):
            removed["processes"].extend(_ns_pids(ns))
            _kill_ns(ns)
            removed["namespaces"].append(ns)
    p = _sh(["ip", "-o", "link", "show"], check=False)
    for line in p.stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX) and name[:10] not in live_ids:
            _sh(["ip", "link", "del", name], check=False)
            removed["links"].append(name)
    shm = Path("/dev/shm")
    for f in shm.glob(f"{PREFIX}*"):
        if f.name[:10] not in live_ids:
            f.unlink(missing_ok=True)
            removed["shm"].append(f.name)
    return removed


def _live_run(run_id: str) -> bool:
    """Re-read: a run that started after the state files were scanned must not be taken for an orphan."""
    try:
        owner = int(json.loads((STATE_DIR / f"{run_id}.json").read_text())["owner"])
    except (OSError, ValueError, KeyError):
        return False
    return _pid_alive(owner) and owner != os.getpid()


def _owned_by_run(pid: int, run_id: str) -> bool:
    """Whether `pid` still is a process of run `run_id` (pids are reused: check its netns or its command line)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if run_id.encode() in cmd:
        return True
    try:
        target = os.readlink(f"/proc/{pid}/ns/net")
        for ns in _netns_list():
            if ns.startswith(run_id) and os.stat(f"/run/netns/{ns}").st_ino == int(target.split("[")[1].rstrip("]")):
                return True
    except (OSError, IndexError, ValueError):
        pass
    return False


_TEARDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def interrupt_on_signals() -> None:
    """Make SIGTERM and SIGHUP (and SIGINT, also when started with it ignored, as `cmd &` in a script
    does) raise KeyboardInterrupt in the main thread, so that every ``finally`` and `Testbed.close`
    runs. A command-line entry point that builds testbeds calls it first: Python's default for
    SIGTERM and SIGHUP ends the process at once, leaving the namespaces, the /dev/shm files and the
    state file of the run in progress behind (a closed terminal or ssh session sends SIGHUP)."""
    def _interrupt(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for s in _TEARDOWN_SIGNALS:
        signal.signal(s, _interrupt)


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT/SIGTERM/SIGHUP while a teardown runs, and deliver the first one after it.

    A second Ctrl-C (users press it again when teardown takes a few seconds) raised
    KeyboardInterrupt inside `Testbed.close`, which then left the rest of the namespaces, the
    /dev/shm files and the state file behind. Python handles signals in the main thread only, so
    elsewhere there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old: dict[int, Any] = {}
    for s in _TEARDOWN_SIGNALS:
        h = signal.getsignal(s)
        if h is None:  # installed outside Python: leave it alone
            continue
        old[s] = signal.signal(s, lambda n, _f: got.append(n))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            signal.raise_signal(got[0])  # its own handler now runs (KeyboardInterrupt for Ctrl-C)


def _pick_subnet(rng: random.Random) -> tuple[int, int]:
    """10.a.b.0/24 that no route or address on this machine touches."""
    used = _sh(["ip", "-4", "route", "show", "table", "all"], check=False).stdout + \
        _sh(["ip", "-4", "addr"], check=False).stdout
    for _ in range(200):
        a, b = rng.randrange(1, 255), rng.randrange(0, 255)
        if f"10.{a}.{b}." not in used and f"10.{a}.0.0" not in used and "10.0.0.0/8" not in used:
            return a, b
    raise TestbedUnavailable("no free 10.x.y.0/24 subnet for the testbed")


class Testbed:
    """N emulated hosts on one switch. Use as a context manager; `close` undoes everything.

        with Testbed([HostSpec(up_mbit=100, latency_ms=10), HostSpec(...)], seed=0) as tb:
            p = tb.popen(0, ["python", "-c", "..."])   # a process in host 0's namespace
            tb.partition([0], [1]); tb.heal()
            tb.slow(1, factor=4); tb.restore(1)
            tb.stop(p); tb.cont(p); tb.kill(p)
            tb.link_counters(); tb.forwarder_stats()

    Host i's address is `ip(i)`; its namespace `ns(i)`. Processes started with `popen` are
    killed and reaped on `close`, as is anything else found in the namespaces.
    """

    __test__ = False  # not a pytest class, despite the name

    def __init__(self, hosts: Sequence[HostSpec], seed: int = 0, gso: bool | None = None,
                 run_id: str | None = None, sysctls: dict[str, str] | None = None) -> None:
        if not hosts:
            raise ValueError("a testbed needs at least one host")
        if len(hosts) > MAX_HOSTS:  # the forwarder's port table (MAXP in linkemu.c)
            raise ValueError(f"the testbed emulates at most {MAX_HOSTS} hosts, not {len(hosts)}")
        self.hosts = list(hosts)
        self.n = len(self.hosts)
        self.seed = int(seed)
        # GSO super-frames keep the forwarder's packet rate low, but a lost super-frame is a burst:
        # with any loss configured, every link sends single segments
        self.gso = all(h.loss == 0 for h in self.hosts) if gso is None else bool(gso)
        # per-namespace kernel settings for every host, e.g. {"net.ipv4.tcp_slow_start_after_idle": "0"}
        self.sysctls = dict(sysctls or {})
        self.id = run_id or f"{PREFIX}{secrets.token_hex(3)}"
        assert len(self.id) == 10 and self.id.startswith(PREFIX)
        self.switch_ns = f"{self.id}-sw"
        self.rates = [(h.up_mbit, h.down_mbit) for h in self.hosts]
        self._procs: list[subprocess.Popen] = []
        self._shm: list[str] = []
        self._fwd: subprocess.Popen | None = None
        self._fwd_lock = threading.Lock()
        self._fwd_cpu = 0.0
        self._blocked: dict[tuple[int, int], int] = {}
        self._blocked_data: dict[tuple[int, int], int] = {}  # one-way partitions (`partition`)
        self._state_file = STATE_DIR / f"{self.id}.json"
        self._up = False
        self.subnet = (0, 0)

    # ------------------------------------------------------------------ names
    def ns(self, i: int) -> str:
        return f"{self.id}-h{i}"

    def host_if(self, i: int) -> str:
        return f"{self.id}h{i}"

    def switch_if(self, i: int) -> str:
        return f"{self.id}s{i}"

    def ip(self, i: int) -> str:
        return f"10.{self.subnet[0]}.{self.subnet[1]}.{i + 1}"

    def shm_path(self, name: str) -> str:
        """A /dev/shm path owned by this testbed (removed on close)."""
        path = f"/dev/shm/{self.id}-{name}"
        if path not in self._shm:
            self._shm.append(path)
            self._save_state()
        return path

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> "Testbed":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        reason = check_support()
        if reason:
            raise TestbedUnavailable(reason)
        binary = forwarder_binary()
        self._claim()  # before anything exists: a crash from here on is cleanable
        self._up = True
        try:
            self._build(binary)
        except BaseException:
            self.close()
            raise

    def _build(self, binary: Path) -> None:
        self.subnet = _pick_subnet(random.Random(f"{self.id}"))
        _sh(["ip", "netns", "add", self.switch_ns])
        _sh(["ip", "-n", self.switch_ns, "link", "set", "lo", "up"])
        for i, h in enumerate(self.hosts):
            ns = self.ns(i)
            _sh(["ip", "netns", "add", ns])
            # created straight inside the namespaces: nothing ever appears in the root namespace
            _sh(["ip", "link", "add", self.host_if(i), "netns", ns, "address", _mac(i), "type", "veth",
                 "peer", "name", self.switch_if(i), "netns", self.switch_ns])
            batch = ["link set lo up", f"addr add {self.ip(i)}/24 dev {self.host_if(i)}",
                     f"link set {self.host_if(i)} up"]
            if not self.gso:
                batch.append(f"link set {self.host_if(i)} gso_max_segs 1")
            for j in range(self.n):
                if j != i:  # static neighbours: no ARP, and the forwarder switches on the MAC
                    batch.append(f"neigh replace {self.ip(j)} lladdr {_mac(j)} dev {self.host_if(i)} nud permanent")
            _sh(["ip", "-n", ns, "-batch", "-"], input="\n".join(batch) + "\n")
            if self.sysctls:
                _sh(["ip", "netns", "exec", ns, "sysctl", "-qw", *(f"{k}={v}" for k, v in self.sysctls.items())])
            _sh(["ip", "-n", self.switch_ns, "link", "set", self.switch_if(i), "up"])
            if not self.gso:
                _sh(["ip", "-n", self.switch_ns, "link", "set", self.switch_if(i), "gso_max_segs", "1"])
            self._set_tbf(i, h.up_mbit, h.down_mbit, "add")
        specs = [f"{self.switch_if(i)}:{int(h.latency_ms * 1000)}:{int(h.jitter_ms * 1000)}:{h.loss!r}"
                 for i, h in enumerate(self.hosts)]
        self._fwd = subprocess.Popen(["ip", "netns", "exec", self.switch_ns, str(binary), str(self.seed), *specs],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self._procs.append(self._fwd)
        self._save_state()
        line = self._read_line(self._fwd, 10.0)
        if not line or "ready" not in line:
            err = self._fwd.stderr.read() if self._fwd.poll() is not None else ""
            raise RuntimeError(f"linkemu did not start: {line!r} {err.strip()}")

    def close(self) -> None:
        """Kill and reap every process, delete the namespaces (their veths go with them), shm files and state."""
        if not self._up:
            return
        with _signals_held():
            self._teardown()

    def _teardown(self) -> None:
        self._up = False
        if self._fwd is not None and self._fwd.poll() is None:
            try:
                self._fwd_cpu = self.forwarder_stats(timeout=2.0).get("cpu_seconds", self._fwd_cpu)
            except Exception:
                pass
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    try:
                        p.kill()
                    except ProcessLookupError:
                        pass
        for p in self._procs:
            try:
                p.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
            for s in (p.stdin, p.stdout, p.stderr):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
        for ns in [self.switch_ns] + [self.ns(i) for i in range(self.n)]:
            if Path(f"/run/netns/{ns}").exists():
                _kill_ns(ns)
        for f in self._shm:
            Path(f).unlink(missing_ok=True)
        # and what the run's processes made beside them: a peer killed (a crash fault) while it wrote
        # its tensor back leaves the half-written ``<shm_path>.tmp`` (sim.testbed_peer._write_tensor)
        for f in Path("/dev/shm").glob(f"{self.id}-*"):
            f.unlink(missing_ok=True)
        self._state_file.unlink(missing_ok=True)

    def _state(self) -> dict:
        return {"owner": os.getpid(), "id": self.id, "namespaces": [self.switch_ns] + [self.ns(i) for i in range(self.n)],
                "pids": [p.pid for p in self._procs], "shm": self._shm}

    def _claim(self) -> None:
        """Write the first state file, atomically and only if no run has this id: a second Testbed with
        a live run's id (``run_id=``, or a random one drawn twice) failed on its first namespace, and its
        close() then deleted the live run's namespaces, /dev/shm files and state file."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = STATE_DIR / f"{self.id}.claim{os.getpid()}"  # not *.json: cleanup never reads it
        tmp.write_text(json.dumps(self._state()))
        try:
            os.link(tmp, self._state_file)  # fails if the file exists; readers see all of it or nothing
        except FileExistsError:
            raise RuntimeError(f"testbed id {self.id} is in use ({self._state_file} exists): another run has "
                               "it, or a crashed one left it (python -m sim testbed --cleanup)") from None
        finally:
            tmp.unlink(missing_ok=True)

    def _save_state(self) -> None:
        if not self._up:
            return
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = self._state_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self._state()))
        os.replace(tmp, self._state_file)

    # ------------------------------------------------------------------ processes
    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start `argv` in host i's namespace (its own session, so `kill` takes its children too)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], start_new_session=True, **kw)
        self._procs.append(p)
        self._save_state()
        return p

    def run(self, i: int, argv: Sequence[str], timeout: float = 60.0, **kw: Any) -> subprocess.CompletedProcess:
        """Run `argv` in host i's namespace to completion (killed after `timeout`)."""
        p = self.popen(i, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(p)
            out, err = p.communicate(timeout=5.0)
            raise RuntimeError(f"{argv[0]} in host {i} ran past {timeout}s: {err.strip()[-500:]}")
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def kill(self, p: subprocess.Popen, timeout: float = 5.0) -> None:
        """SIGKILL the process (its whole session) and reap it."""
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, p: subprocess.Popen) -> None:
        """Freeze the process (SIGSTOP): it handles and sends nothing; the kernel still ACKs its TCP."""
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGSTOP)

    def cont(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGCONT)

    # ------------------------------------------------------------------ network faults
    def _fwd_cmd(self, line: str, timeout: float = 5.0) -> dict:
        with self._fwd_lock:
            if self._fwd is None or self._fwd.poll() is not None:
                raise RuntimeError("the forwarder is not running")
            self._fwd.stdin.write(line + "\n")
            self._fwd.stdin.flush()
            reply = self._read_line(self._fwd, timeout)
        if not reply:
            raise RuntimeError(f"no answer from the forwarder to {line!r}")
        return json.loads(reply)

    @staticmethod
    def _read_line(p: subprocess.Popen, timeout: float) -> str:
        # bounded: select on the pipe (the forwarder writes whole lines and flushes)
        r, _, _ = select.select([p.stdout], [], [], timeout)
        return p.stdout.readline().strip() if r else ""

    def partition(self, side_a: Iterable[int], side_b: Iterable[int], one_way: bool = False) -> None:
        """Drop every frame between the two sides (both directions) until `unpartition`/`heal`; with
        `one_way`, only the frames that carry data from side_a to side_b (TCP's bare acknowledgements
        pass, so side_b's transfers to side_a keep flowing while side_a's stall: a cut that TCP does
        not turn into a two-way one). Overlapping partitions nest: a pair flows again when every
        partition that cut it is lifted."""
        verb, count = ("blockdata", self._blocked_data) if one_way else ("block", self._blocked)
        for a in side_a:
            for b in side_b:
                for s, d in ((a, b),) if one_way else ((a, b), (b, a)):
                    count[(s, d)] = count.get((s, d), 0) + 1
                    if count[(s, d)] == 1:
                        self._fwd_cmd(f"{verb} {s} {d}")

    def unpartition(self, side_a: Iterable[int], side_b: Iterable[int], one_way: bool = False) -> None:
        verb, count = ("unblockdata", self._blocked_data) if one_way else ("unblock", self._blocked)
        for a in side_a:
            for b in side_b:
                for s, d in ((a, b),) if one_way else ((a, b), (b, a)):
                    left = count.get((s, d), 0) - 1
                    if left <= 0:
                        count.pop((s, d), None)
                        self._fwd_cmd(f"{verb} {s} {d}")
                    else:
                        count[(s, d)] = left

    def heal(self) -> None:
        self._blocked.clear()
        self._blocked_data.clear()
        self._fwd_cmd("heal")

    def set_link(self, i: int, latency_ms: float, jitter_ms: float, loss: float) -> None:
        """Change host i's one-way latency, jitter and loss at run time."""
        self._fwd_cmd(f"link {i} {int(latency_ms * 1000)} {int(jitter_ms * 1000)} {float(loss)!r}")

    def _set_tbf(self, i: int, up_mbit: float, down_mbit: float, verb: str = "change") -> None:
        for ns, dev, mbit in ((self.ns(i), self.host_if(i), up_mbit), (self.switch_ns, self.switch_if(i), down_mbit)):
            rate = mbit * 125_000.0  # bytes/s
            # burst: 2 ms at line rate (>= 32 KiB so a GSO frame is not cut into many); queue: 200 ms
            burst = int(max(32 << 10, rate * 0.002))
            limit = int(max(TBF_QUEUE["min_bytes"], rate * TBF_QUEUE["seconds"]))
            _sh(["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "tbf", "rate", f"{int(mbit * 1e6)}bit",
                 "burst", str(burst), "limit", str(limit)])

    def set_rate(self, i: int, up_mbit: float, down_mbit: float) -> None:
        """Change host i's uplink and downlink rates (Mbit/s) at run time."""
        self._set_tbf(i, up_mbit, down_mbit)
        self.rates[i] = (up_mbit, down_mbit)

    def slow(self, i: int, factor: float) -> None:
        """Host i's links run `factor` times slower than configured (the scenario's ``slow`` fault)."""
        h = self.hosts[i]
        self.set_rate(i, h.up_mbit / factor, h.down_mbit / factor)

    def restore(self, i: int) -> None:
        h = self.hosts[i]
        self.set_rate(i, h.up_mbit, h.down_mbit)

    # ------------------------------------------------------------------ measurements
    def link_counters(self) -> list[dict]:
        """Kernel counters of each host's switch-side veth: rx = what the host sent, tx = what it was delivered."""
        p = _sh(["ip", "-n", self.switch_ns, "-s", "-j", "link", "show"])
        by_name = {d["ifname"]: d.get("stats64", {}) for d in json.loads(p.stdout)}
        out = []
        for i in range(self.n):
            s = by_name.get(self.switch_if(i), {})
            out.append({"host": i, "sent_bytes": s.get("rx", {}).get("bytes", 0),
                        "sent_packets": s.get("rx", {}).get("packets", 0),
                        "received_bytes": s.get("tx", {}).get("bytes", 0),
                        "received_packets": s.get("tx", {}).get("packets", 0)})
        return out

    def qdisc_stats(self) -> list[dict]:
        """tbf drops and overlimits per host link (uplink on the host side, downlink on the switch side)."""
        out = []
        for i in range(self.n):
            row: dict = {"host": i}
            for key, ns, dev in (("up", self.ns(i), self.host_if(i)), ("down", self.switch_ns, self.switch_if(i))):
                p = _sh(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev], check=False)
                try:
                    q = json.loads(p.stdout)[0]
                    row[key] = {"bytes": q.get("bytes", 0), "drops": q.get("drops", 0),
                                "overlimits": q.get("overlimits", 0)}
                except (ValueError, IndexError):
                    row[key] = {}
            out.append(row)
        return out

    def forwarder_stats(self, timeout: float = 5.0) -> dict:
        """The forwarder's counters per port, its CPU seconds and how late it released frames."""
        st = self._fwd_cmd("stats", timeout)
        self._fwd_cpu = st.get("cpu_seconds", self._fwd_cpu)
        return st

    @property
    def forwarder_cpu_seconds(self) -> float:
        """CPU the forwarder used (last reading; taken once more on close)."""
        return self._fwd_cpu


def machine_info() -> dict:
    """What ran the testbed: CPU model, core count, kernel, load."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    u = os.uname()
    return {"cpu": model, "cores": os.cpu_count(), "kernel": f"{u.sysname} {u.release}",
            "loadavg": list(os.getloadavg()), "python": sys.version.split()[0]}
