"""The emulated testbed (sim.testbed): real peers in network namespaces on shaped links.

Needs root and network namespaces; skipped with the reason otherwise. Everything binds
inside namespaces the test created (a private /24 with no route out). Every test checks
that no namespace, link, process or /dev/shm file of its run is left behind.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sim.scenario import HostSpec, Scenario
from sim.testbed import PREFIX, Testbed, check_support

REASON = check_support()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"testbed unavailable: {REASON}")
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def leftovers(run_id: str) -> dict:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    procs = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _cmd_has(p, run_id)]
    names = [l.split()[0] for l in ns.split("\n") if run_id in l]
    for n in names:  # processes inside the run's namespaces (e.g. `sleep`, whose command line names no run)
        procs += subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True, timeout=10).stdout.split()
    return {"namespaces": names, "links": [l for l in links.split("\n") if run_id in l],
            "processes": procs, "shm": [f.name for f in Path("/dev/shm").glob(f"{run_id}*")]}


def _cmd_has(p: Path, text: str) -> bool:
    try:
        return text.encode() in (p / "cmdline").read_bytes()
    except OSError:
        return False


def assert_clean(run_id: str, pids=()) -> None:
    left = leftovers(run_id)
    assert not any(left.values()), left
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or (Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"), pid


SCENARIO = {
    "seed": 7,
    "numel": 1 << 18,  # 1 MiB of float32
    "dtype": "float32",
    "rounds": 3,
    "grid": [],
    "step_timeout": 2.0,
    "round_gap": 1.5,
    "bootstrap_time": 2.0,
    "protocol": {"target_group_size": 3, "min_group_size": 2, "matchmaking_time": 0.5, "part_timeout": 1.5,
                 "allreduce_timeout": 10.0},
    "hosts": [{"up_mbit": 200, "down_mbit": 200, "latency_ms": 1},
              {"up_mbit": 100, "down_mbit": 100, "latency_ms": 5},
              {"up_mbit": 10, "down_mbit": 10, "latency_ms": 10, "jitter_ms": 1}],
    # round 0 (t = 2.05 .. 3.4-4.1: host 0 gives up within step_timeout) runs with host 0 cut off, healed in
    # the gap; round 1 starts at 4.9-5.6 and lasts ~1.8 s (host 2's 10 Mbit/s), so the SIGKILL at 5.9
    # lands inside it
    "faults": [{"kind": "partition", "sides": [[0], [1, 2]], "start": 1.5, "end": 4.4},
               {"kind": "crash", "peer": 2, "at": 5.9}],
}


def _subset_means(prev: dict[int, np.ndarray], slot: int) -> list[np.ndarray]:
    others = [s for s in prev if s != slot]
    out = []
    for k in range(len(others) + 1):
        for combo in itertools.combinations(others, k):
            out.append(np.mean([prev[s].astype(np.float64) for s in (slot, *combo)], axis=0))
    return out


@needs_netns
def test_three_hosts_kill_and_partition():
    from sim.testbed_run import run_testbed

    sc = Scenario.from_dict(SCENARIO)
    rng = np.random.default_rng([sc.seed, __import__("zgossip.grid", fromlist=["seed_from"]).seed_from("values")])
    initial = {i: rng.standard_normal(sc.numel).astype(sc.dtype) for i in range(3)}
    seen: dict[int, dict[int, np.ndarray]] = {}
    t0 = time.monotonic()
    res = run_testbed(sc, on_round=lambda r, ts: seen.__setitem__(r, ts))
    took = time.monotonic() - t0
    tb = res["testbed"]
    assert_clean(tb["id"])
    assert took < 60, took
    slot_of = {pid: s for s, ids in tb["peers"].items() for pid in ids}
    steps = {(st["round"], st["slot"]): st for st in tb["steps"]}
    tol = dict(rtol=1e-5, atol=1e-6)

    # round 0: host 0 is cut off and averages with nobody; 1 and 2 reach exactly their mean
    assert steps[(0, 0)]["outcome"] == "failed"
    np.testing.assert_array_equal(seen[0][0], initial[0])
    for s in (1, 2):
        assert steps[(0, s)]["outcome"] == "done" and steps[(0, s)]["group_size"] == 2
        np.testing.assert_allclose(seen[0][s], (initial[1].astype(np.float64) + initial[2]) / 2, **tol)
    # round 1: 2 is killed; every element a survivor holds is averaged over a set including it, or unchanged
    assert res["rounds"][1]["live"] == 2 and res["rounds"][2]["live"] == 2
    prev = seen[0]
    for s in (0, 1):
        cands = _subset_means(prev, s)
        ok = np.zeros(sc.numel, dtype=bool)
        for c in cands:
            ok |= np.isclose(seen[1][s], c, **tol)
        assert ok.all(), f"slot {s}: {(~ok).sum()} elements are neither averaged nor unchanged"
        st = steps[(1, s)]
        if st["outcome"] == "done" and st["complete"] and not st["lost"]:
            want = np.mean([prev[slot_of[c]].astype(np.float64) for c in st["contributors"]], axis=0)
            np.testing.assert_allclose(seen[1][s], want, **tol)
    # round 2: the survivors still average, exactly
    for s in (0, 1):
        assert steps[(2, s)]["outcome"] == "done" and steps[(2, s)]["group_size"] == 2
        np.testing.assert_allclose(seen[2][s], (seen[1][0].astype(np.float64) + seen[1][1]) / 2, **tol)
    # the metrics are the simulator's: mse against the round-0 global mean of the initial values
    truth = np.mean([initial[i].astype(np.float64) for i in range(3)], axis=0)
    np.testing.assert_allclose(res["rounds"][2]["mse"], float(((np.stack(list(seen[2].values())) - truth) ** 2).mean()),
                               rtol=1e-9)
    assert [f["fault"] for f in tb["faults"]] == ["partition", "heal", "crash"]
    assert tb["forwarder"]["cpu_seconds"] > 0 and tb["forwarder"]["ports"][2]["drop_partition"] > 0
    assert all(b[0] > sc.numel * 4 for b in res["peer_bytes"]), res["peer_bytes"]
    assert sorted(res["rounds"][0]) == sorted(["round", "t_start", "sim_seconds", "live", "participants", "succeeded",
                                               "failures", "groups", "mse", "max_abs", "spread", "bytes_sent_mean",
                                               "bytes_sent_max", "bytes_received_mean", "step_seconds", "phase_seconds"])


@needs_netns
def test_teardown_after_exception_and_shaping():
    """An exception inside the block still removes everything; a 20 Mbit link is not faster than 20 Mbit."""
    procs = []
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed([HostSpec(up_mbit=20, down_mbit=20, latency_ms=5), HostSpec(latency_ms=5)], seed=1) as tb:
            run_id = tb.id
            srv = tb.popen(1, [sys.executable, "-c", f"""
import socket, time
s = socket.socket(); s.bind(('{tb.ip(1)}', 5001)); s.listen(); c, _ = s.accept(); n = 0; t = None
while (d := c.recv(1 << 20)):
    t = t or time.monotonic(); n += len(d)
print(n * 8 / (time.monotonic() - t) / 1e6)
"""], stdout=subprocess.PIPE, text=True)
            procs.append(srv.pid)
            time.sleep(0.3)
            r = tb.run(0, [sys.executable, "-c", f"import socket; s = socket.create_connection(('{tb.ip(1)}', 5001)); "
                                                 "s.sendall(bytes(4 << 20)); s.close()"], timeout=30)
            assert r.returncode == 0, r.stderr
            mbit = float(srv.communicate(timeout=30)[0])
            assert 10 < mbit < 21, mbit
            procs.append(tb.popen(0, ["sleep", "30"]).pid)
            raise RuntimeError("boom")
    assert_clean(run_id, procs)


@needs_netns
def test_ctrl_c_during_teardown_still_removes_everything(monkeypatch):
    """A second Ctrl-C while the testbed tears down (after the first one, or at the end of a run) is
    held until the teardown is over, then raised: it used to interrupt `close` between two namespaces
    and leave the rest, the /dev/shm files and the state file behind."""
    import signal

    from sim import testbed as tbmod

    real, calls = tbmod._kill_ns, []

    def interrupted(ns):
        if not calls:
            calls.append(ns)
            signal.raise_signal(signal.SIGINT)  # as the terminal delivers Ctrl-C to this process
        return real(ns)

    monkeypatch.setattr(tbmod, "_kill_ns", interrupted)
    # Python's own Ctrl-C handler, as in a terminal: a suite started in the background by a script
    # (`pytest &`) has SIGINT ignored, and the signal raised above did nothing
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with Testbed([HostSpec(), HostSpec()], seed=1) as tb:
                run_id = tb.id
                open(tb.shm_path("x"), "w").close()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert calls
    assert_clean(run_id)
    assert not (tbmod.STATE_DIR / f"{run_id}.json").exists()


@needs_netns
def test_close_removes_a_half_written_tensor_of_a_killed_peer():
    """A peer writes its tensor to ``<shm_path>.tmp`` and renames it; one killed in between (a crash
    fault during the write-back) left the .tmp in /dev/shm after the run."""
    with Testbed([HostSpec(), HostSpec()], seed=1) as tb:
        run_id = tb.id
        path = tb.shm_path("t0.npy")
        r = tb.run(0, [sys.executable, "-c", f"open({path + '.tmp'!r}, 'wb').write(bytes(1024))"], timeout=30)
        assert r.returncode == 0, r.stderr
    assert_clean(run_id)


@needs_netns
def test_a_second_testbed_with_a_live_runs_id_is_refused_and_leaves_that_run_alone():
    """Two testbeds never share an id: the second used to fail on its first namespace and then, in its
    close(), delete the first run's namespaces, /dev/shm files and state file while it ran."""
    from sim.testbed import STATE_DIR

    with Testbed([HostSpec(), HostSpec()], seed=1) as tb:
        open(tb.shm_path("x"), "w").close()
        before = leftovers(tb.id)
        with pytest.raises(RuntimeError, match=f"testbed id {tb.id} is in use"):
            Testbed([HostSpec(), HostSpec()], run_id=tb.id).start()
        assert leftovers(tb.id) == before and (STATE_DIR / f"{tb.id}.json").exists()
        assert tb.forwarder_stats()["ports"]  # its forwarder still answers
        run_id = tb.id
    assert_clean(run_id)
    assert not list(STATE_DIR.glob(f"{run_id}*"))


@needs_netns
def test_cleanup_removes_what_a_crashed_run_left():
    # a run whose controller dies without tearing down (os._exit): namespaces, forwarder and a process stay
    code = ("import os, sys; from sim.testbed import Testbed; from sim.scenario import HostSpec\n"
            "tb = Testbed([HostSpec(), HostSpec()]); tb.start(); tb.popen(0, ['sleep', '60'], stdout=-3, stderr=-3)\n"
            "open(tb.shm_path('x'), 'w').write('x'); print(tb.id, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT)
    run_id = out.stdout.strip()
    assert run_id.startswith(PREFIX), out.stderr
    assert leftovers(run_id)["namespaces"] and leftovers(run_id)["processes"] and leftovers(run_id)["shm"]
    p = subprocess.run([sys.executable, "-m", "sim", "testbed", "--cleanup"], capture_output=True, text=True,
                       timeout=60, env=ENV, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert run_id in json.loads(p.stdout)["runs"]
    assert_clean(run_id)


def test_refuses_in_one_line_without_privileges(tmp_path):
    sc = tmp_path / "s.toml"
    sc.write_text("grid = []\n[[hosts]]\nup_mbit = 10\n[[hosts]]\nup_mbit = 10\n")
    p = subprocess.run([sys.executable, "-m", "sim", "testbed", str(sc)], capture_output=True, text=True, timeout=60,
                       env={**ENV, "ZGOSSIP_TESTBED_PRETEND_UNPRIVILEGED": "1"}, cwd=ROOT)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "root" in p.stderr, p.stderr


@needs_netns
def test_refuses_an_out_path_it_cannot_write_before_running(tmp_path):
    """--out/--csv in a missing folder, or naming a folder: refused in one line before any namespace
    exists (it used to run the whole experiment, then fail to write its results)."""
    sc = tmp_path / "s.toml"
    sc.write_text("rounds = 0\nbootstrap_time = 0.0\ngrid = []\n[[hosts]]\nup_mbit = 10\n[[hosts]]\nup_mbit = 10\n")
    for opt, path in (("--out", tmp_path / "missing" / "run.json"), ("--csv", tmp_path)):
        p = subprocess.run([sys.executable, "-m", "sim", "testbed", str(sc), opt, str(path)], capture_output=True,
                           text=True, timeout=60, env=ENV, cwd=ROOT)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().count("\n") == 0 and "cannot write" in p.stderr and str(path) in p.stderr, p.stderr


@pytest.mark.parametrize("value", ["net.ipv4.tcp_slow_start_after_idle", "=0"])
def test_a_sysctl_without_key_or_value_is_refused_in_one_line(tmp_path, value):
    sc = tmp_path / "s.toml"
    sc.write_text("grid = []\n[[hosts]]\nup_mbit = 10\n[[hosts]]\nup_mbit = 10\n")
    p = subprocess.run([sys.executable, "-m", "sim", "testbed", str(sc), "--sysctl", value], capture_output=True,
                       text=True, timeout=60, env=ENV, cwd=ROOT)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "--sysctl takes KEY=VALUE" in p.stderr and value in p.stderr, p.stderr


def test_output_path_check_leaves_no_file(tmp_path):
    from sim.testbed import check_output_paths

    assert check_output_paths([None, str(tmp_path / "new.json")]) is None
    assert not (tmp_path / "new.json").exists()
    (tmp_path / "old.json").write_text("keep")
    assert check_output_paths([str(tmp_path / "old.json")]) is None
    assert (tmp_path / "old.json").read_text() == "keep"
    assert "cannot write" in check_output_paths([str(tmp_path / "no" / "x.json")])


def test_more_hosts_than_the_forwarder_switches_are_refused_before_building():
    """The forwarder (linkemu.c, MAXP) has 64 ports; a testbed of 65-250 hosts passed the check, built
    every namespace and then failed with "linkemu did not start: '' at most 64 ports"."""
    import re

    src = (ROOT / "sim" / "linkemu.c").read_text()
    from sim.testbed import MAX_HOSTS

    assert int(re.search(r"#define MAXP (\d+)", src).group(1)) == MAX_HOSTS == 64
    with pytest.raises(ValueError, match="at most 64 hosts, not 65"):
        Testbed([HostSpec()] * 65)
    Testbed([HostSpec()] * 64)  # builds nothing until start()


def test_refuses_a_scenario_without_hosts(tmp_path):
    sc = tmp_path / "s.toml"
    sc.write_text("peers = 4\ngrid = []\n")
    p = subprocess.run([sys.executable, "-m", "sim", "testbed", str(sc)], capture_output=True, text=True, timeout=60,
                       env=ENV, cwd=ROOT)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "[[hosts]]" in p.stderr, p.stderr


@needs_netns
def test_overlap_bench_runs_each_process_on_its_own_shaped_host():
    """`python -m sim overlap`: the overlap benchmark's processes enter their testbed hosts' namespaces
    and average across the shaped links (not over this host's loopback or a Unix socket)."""
    from sim.testbed_bench import overlap_on_testbed

    res = overlap_on_testbed(peers=2, mbit=50, latency_ms=2, reps=1, epochs=3, hidden=64, batch=8, accel_ms=0,
                             timeout=60)
    # the bench raises unless every round of both modes averaged over both processes
    assert len(res["sync"]["steps_per_s"]) == len(res["overlap"]["steps_per_s"]) == 1
    # per global step each process sends its part and the result of its span: about the model's bytes;
    # (1 warm-up + 1 rep) x 2 modes x 3 steps crossed each host's link
    steps = 2 * 2 * 3
    for link in res["link_bytes"]:
        assert link["sent"] >= 0.9 * steps * res["params"] * 4, res["link_bytes"]
        assert link["received"] >= 0.9 * steps * res["params"] * 4, res["link_bytes"]
    assert leftovers(res["testbed_id"]) == {"namespaces": [], "links": [], "processes": [], "shm": []}


@needs_netns
def test_state_bench_downloads_from_donors_on_their_own_shaped_hosts():
    """`python -m sim state`: donors and downloader each in a testbed host; the chunks cross the links,
    from both donors."""
    from sim.testbed_bench import state_on_testbed

    # 32 chunks of 256 KiB: a donor keeps two windows of 4 chunks in flight, so a state of 8 chunks would
    # all go to the donor that answered first (the other's answer came a few ms later: 1 run in 4)
    size = 8 << 20
    res = state_on_testbed(size_mib=8, donors=2, donor_mbit=100, downloader_mbit=400, latency_ms=2, reps=1,
                           chunk_bytes=256 << 10, timeout=60)
    assert res["median_seconds"][1] > 0 and res["median_seconds"][2] > 0  # complete, verified downloads
    donors, downloader = res["link_bytes"][:2], res["link_bytes"][2]
    # three downloads (the untimed warm-up from 2 donors, then 1 donor and 2 donors) reached the downloader
    assert downloader["received"] >= 3 * size, res["link_bytes"]
    # both donors served chunks of the parallel downloads over their own links
    assert all(d["sent"] >= 0.25 * size for d in donors), res["link_bytes"]
    assert sum(d["sent"] for d in donors) >= 3 * size, res["link_bytes"]
    assert leftovers(res["testbed_id"]) == {"namespaces": [], "links": [], "processes": [], "shm": []}
