"""The simulator against the testbed: the small fidelity check (root + netns), and the transport
mechanisms the replay relies on (connection set-up, the recorded machine, jitter)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import simpy

from sim import NetworkModel
from sim.compare import replay_scenario
from sim.fidelity import GOAL, MIN_ROUNDS, QUICK, CaseResult, case_scenario, format_table, run_case
from sim.network import Profile
from sim.tcp import TcpTransport
from sim.testbed import check_support


def _bare(latency: float, **tcp):
    net = NetworkModel(latency=latency, bandwidth=12.5e6, transfer="tcp", tcp=tcp)
    env = simpy.Environment()
    got: list = []
    tr = TcpTransport(net, net.tcp, env, np.random.default_rng(0), lambda tok, sent: got.append((tok, env.now)))
    return env, tr, got


def test_first_message_on_a_new_connection_pays_the_tcp_and_zmtp_handshakes():
    # measured on the testbed (160 ms RTT): the first message 3.5 RTT, the next ones 0.5 RTT
    owd = 0.04
    env, tr, got = _bare(owd)
    tr.send("a", "b", 0, 100, "first")
    env.run()
    assert got[0][1] == pytest.approx(3.5 * 2 * owd, rel=0.02)
    t0 = env.now
    tr.send("a", "b", 0, 100, "second")
    env.run()
    assert got[1][1] - t0 == pytest.approx(owd, rel=0.02)
    # the reply travels on the other side's own connection: a set-up of its own
    t0 = env.now
    tr.send("b", "a", 0, 100, "reply")
    env.run()
    assert got[2][1] - t0 == pytest.approx(3.5 * 2 * owd, rel=0.02)


def test_tracker_is_released_when_the_last_byte_left():
    env, tr, _ = _bare(0.01)
    m = tr.send("a", "b", 0, 1_250_000, "x")  # 0.1 s at 12.5 MB/s, after a 60 ms set-up
    seen = []
    tr.watch(m, lambda: seen.append(env.now))
    env.run()
    assert tr.released(m) and seen and seen[0] > 0.1


def test_host_jitter_reaches_the_simulator():
    net = NetworkModel(latency=0.0, profiles={"a": Profile("a", 1e6, 1e6, jitter=0.01),
                                              "b": Profile("b", 1e6, 1e6)})
    rng = np.random.default_rng(0)
    draws = [net.jitter_draw(rng, "a", "b") for _ in range(2000)]
    assert min(draws) == 0.0 and 0.003 < float(np.mean(draws)) < 0.005  # E[max(0, N(0, s))] = s / sqrt(2 pi)
    assert net.jitter_draw(rng, "b", "b") == 0.0


def test_replay_uses_the_machine_the_testbed_recorded():
    run = {"scenario": case_scenario(QUICK[0], rounds=1),
           "testbed": {"tcp": {"congestion_control": "bbr", "rmem_max": 1 << 25},
                       "cpu": {"costs": {"handle_msg": 1e-5}, "cores": 2}}}
    sc = replay_scenario(run)
    assert sc["network"]["tcp"]["congestion_control"] == "bbr"
    assert sc["network"]["down_queue"] == {"seconds": 0.2, "min_bytes": 512 << 10}  # the testbed's tbf
    assert sc["cpu"] == {"costs": {"handle_msg": 1e-5}, "cores": 2, "shared": True}
    # what the scenario sets itself wins
    run["scenario"]["network"] = {"tcp": {"congestion_control": "cubic"}}
    assert replay_scenario(run)["network"]["tcp"]["congestion_control"] == "cubic"


def test_replay_charges_the_forwarder_the_run_recorded_even_with_a_calibrated_profile():
    """A profile from `python -m sim calibrate` holds switch_byte 0.0 (it measures no switch): the
    replay must still charge the CPU per byte the run's forwarder spent. It used to test for the key
    only, so on a machine calibrated since the field came the forwarder was left out."""
    for costs in ({"handle_msg": 1e-5}, {"handle_msg": 1e-5, "switch_byte": 0.0}):
        run = {"scenario": case_scenario(QUICK[0], rounds=1),
               "testbed": {"cpu": {"costs": dict(costs), "cores": 2},
                           "forwarder": {"cpu_seconds": 2.0, "ports": [{"rx_bytes": 1e9}, {"rx_bytes": 1e9}]}}}
        assert replay_scenario(run)["cpu"]["costs"]["switch_byte"] == 2.0 / 2e9
    run["testbed"]["cpu"]["costs"]["switch_byte"] = 3e-9  # a cost given on purpose stands
    assert replay_scenario(run)["cpu"]["costs"]["switch_byte"] == 3e-9


def test_a_lossy_case_is_predicted_by_the_median_of_several_seeds(monkeypatch):
    """One replay of a lossy run is one draw of its losses; the prediction is the median replay of
    `LOSSY_SEEDS` seeds. The simulator's own run stands in for the testbed's here."""
    import sim.fidelity as fid
    from sim.scenario import run_scenario

    hosts = [{"up_mbit": 50, "down_mbit": 50, "latency_ms": 20, "loss": 0.02}] * 3
    sc = {"seed": 4, "rounds": 3, "numel": 1 << 16, "dtype": "float32", "grid": [], "step_timeout": 5.0,
          "round_gap": 0.2, "bootstrap_time": 1.0, "hosts": hosts,
          "protocol": {"target_group_size": 3, "min_group_size": 2, "matchmaking_time": 1.0}}
    measured = json.loads(run_scenario(sc).to_json())
    seeds, real = [], fid.replay
    monkeypatch.setattr(fid, "replay", lambda s: seeds.append(s["seed"]) or real(s))
    predicted, c = fid.predict(measured, sc)
    assert seeds == list(range(4, 4 + fid.LOSSY_SEEDS))
    medians = sorted(fid.compare_runs(measured, real({**replay_scenario({"scenario": sc, **measured}), "seed": k})).predicted
                     for k in seeds)
    assert c.predicted == medians[len(medians) // 2] and predicted["rounds"]
    seeds.clear()
    fid.predict(measured, {**sc, "hosts": [{**h, "loss": 0.0} for h in hosts]})
    assert seeds == [4]  # a case without loss is replayed once


@pytest.mark.skipif(check_support() is not None, reason=f"testbed: {check_support()}")
def test_table_marks_a_case_whose_forwarder_was_busy_and_lossy_cases_run_more_rounds():
    def case(name, cpu):
        tb = {"rounds": [{"sim_seconds": 1.0}, {"sim_seconds": 1.0}],
              "testbed": {"forwarder": {"cpu_seconds_rounds": cpu},
                          "qdiscs": [{"host": 0, "down": {"drops": 300}}, {"host": 1, "down": {"drops": 10}}]}}
        return CaseResult(name, 4, 1, 1.0, 1.0, 0.5, 10.0, tb, {"tail_drops": [4, 2], "rounds": [{}, {}]})

    busy, idle, unknown = case("busy", 1.6), case("idle", 0.2), CaseResult("old", 4, 1, 1.0, 1.0, 0.5, 1.0, {}, {})
    assert busy.forwarder_load == pytest.approx(0.8) and idle.forwarder_load == pytest.approx(0.1)
    assert unknown.forwarder_load != unknown.forwarder_load  # NaN: the run did not record it
    lines = format_table([busy, idle, unknown], []).splitlines()
    assert "forwarder-bound" in lines[1] and "forwarder-bound" not in lines[2] + lines[3]
    assert busy.drops_per_round == pytest.approx(155.0) and unknown.drops_per_round != unknown.drops_per_round
    assert busy.predicted_drops_per_round == 3.0 and unknown.predicted_drops_per_round != unknown.predicted_drops_per_round
    assert lines[0].split()[-3:] == ["drops/rnd", "sim", "drops"]
    assert lines[1].split()[-3:] == ["155", "3", "(forwarder-bound)"]
    assert all(MIN_ROUNDS[n] >= 10 for n in ("home4-loss-1m", "lat150-loss-1m"))


def test_table_marks_a_case_that_ran_while_other_processes_used_the_cpu():
    def case(name, other):
        tb = {"rounds": [{"sim_seconds": 1.0}], "testbed": {"forwarder": {"cpu_seconds_rounds": 0.1}}}
        if other is not None:
            tb["testbed"]["other_user_cores"] = other
        return CaseResult(name, 4, 1, 1.0, 1.0, 0.5, 10.0, tb, {})

    busy, idle, old = case("busy", 0.4), case("idle", 0.01), case("old", None)
    assert busy.other_load == pytest.approx(0.4) and old.other_load != old.other_load  # NaN: not recorded
    lines = format_table([busy, idle, old], []).splitlines()
    assert lines[1].endswith("(busy machine: other processes 0.40 cores)")
    assert "busy machine" not in lines[2] + lines[3]
    assert any(line.startswith("other processes used >= 0.1 cores during busy: run that case again") for line in lines)
    assert not any("other processes used" in line for line in format_table([idle, old], []).splitlines())


def test_a_process_tree_counts_the_user_cpu_of_children_it_reaped_and_of_live_ones():
    """What `run_testbed` subtracts from the machine's user CPU: this process and its children (the
    peers and the forwarder), the exited ones too."""
    import subprocess
    import sys as _sys

    from zgossip.machine import machine_user_seconds, tree_user_seconds

    # user time (a loop on time.process_time() spends most of it in the kernel)
    burn = "import resource\nwhile resource.getrusage(0).ru_utime < 0.3: sum(range(10000))\n"
    m0, t0 = machine_user_seconds(), tree_user_seconds()
    subprocess.run([_sys.executable, "-c", burn], check=True, timeout=30)  # exits, reaped
    live = subprocess.Popen([_sys.executable, "-c", burn + "import sys\nsys.stdin.read()\n"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while tree_user_seconds() - t0 < 0.55 and time.monotonic() < deadline:
            time.sleep(0.05)
        ours = tree_user_seconds() - t0
        assert ours >= 0.55  # both children's user CPU (0.3 s each, less a tick)
        assert machine_user_seconds() - m0 >= ours - 0.05
    finally:
        live.communicate(timeout=10)


def test_other_load_counts_a_process_outside_the_tree_and_not_our_children():
    """`OtherLoad(tree=True)`, what `run_testbed` records: a busy process that is not ours (a shell's
    background job, adopted by init once the shell exits) counts; a busy child of ours does not."""
    import subprocess
    import sys as _sys

    from zgossip.machine import OtherLoad

    burn = "import resource\nwhile resource.getrusage(0).ru_utime < 0.6: sum(range(10000))\n"  # user time
    # ours: a child. Whatever else runs on the machine counts too, so a neighbour's burst can make one
    # try read high; the child's own 0.6 s over a ~0.7 s run would read ~0.9 cores every time
    seen = []
    for _ in range(3):
        load = OtherLoad(tree=True)
        subprocess.run([_sys.executable, "-c", burn], check=True, timeout=30)
        seen.append(load.cores())
        if seen[-1] < 0.3:
            break
    assert min(seen) < 0.3, seen
    load, t0 = OtherLoad(tree=True), time.perf_counter()
    # not ours: sh starts it in the background and exits, and init adopts it (it stops by itself)
    subprocess.run(["sh", "-c", '"$0" -c "$1" &', _sys.executable, burn], check=True, timeout=30)
    deadline = time.monotonic() + 20
    while load.cores() * (time.perf_counter() - t0) < 0.5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load.cores() * (time.perf_counter() - t0) >= 0.5  # most of its 0.6 s of user time


def test_simulator_predicts_the_testbed_on_the_quick_case():
    """`python -m sim fidelity --quick`: predicted / measured step time of the quick case, inside
    the goal `GOAL` (0.85-1.15). Measured on this 2-core VM, nothing else running: 0.928-0.933
    over 3 runs, 0.936 under a helper's test load (23 Nov 2026, after the simulator's links were
    re-shared every 10 ms and both sides opened connections ahead of use; it was 0.58-0.84 before)."""
    r = run_case(QUICK[0], rounds=5)  # 5 rounds: the median is less at the mercy of one slow round
    assert r.measured == r.measured and r.predicted == r.predicted, "no step finished"
    held = GOAL
    assert held[0] <= r.ratio <= held[1], (f"{r.name}: measured {r.measured:.3f} s, predicted "
                                           f"{r.predicted:.3f} s, ratio {r.ratio:.2f} outside {held}")


@pytest.mark.skipif(check_support() is not None, reason=f"testbed: {check_support()}")
def test_an_out_path_that_cannot_be_written_is_refused_before_the_matrix_runs(tmp_path, monkeypatch, capsys):
    """``python -m sim fidelity --out`` used to learn that its file could not be written after every
    case had run (many minutes), and lose the table."""
    import argparse

    import sim.fidelity as fidelity

    monkeypatch.setattr(fidelity, "run_matrix", lambda *a, **k: pytest.fail("the matrix ran"))
    args = argparse.Namespace(cases="home4-1m", quick=False, rounds=1, seed=1, out=str(tmp_path / "no" / "t.json"))
    assert fidelity.main(args) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and str(tmp_path / "no" / "t.json") in err


@pytest.mark.skipif(check_support() is not None, reason=f"testbed: {check_support()}")
def test_sigterm_during_a_fidelity_case_tears_its_testbed_down():
    """``python -m sim fidelity`` (many minutes) ended at once on SIGTERM or SIGHUP (a closed ssh
    session), leaving the case's namespaces, peers, /dev/shm files and state file behind; it now
    unwinds like Ctrl-C (exit 130) and its testbed is removed."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from sim.testbed import STATE_DIR
    from test_testbed import assert_clean

    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen([sys.executable, "-m", "sim", "fidelity", "--cases", "home4-1m", "--rounds", "1"],
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    run_id = None
    try:
        deadline = time.monotonic() + 60
        while run_id is None and time.monotonic() < deadline and p.poll() is None:
            for f in STATE_DIR.glob("zgtb*.json"):
                try:
                    st = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                if st.get("owner") == p.pid and len(st.get("pids", [])) > 4:  # the forwarder and 4 peers
                    run_id = f.stem
            time.sleep(0.02)
        assert run_id, "the fidelity case did not start its testbed"
        os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=10)
    assert p.returncode == 130, err[-2000:]
    assert_clean(run_id)
    assert not (STATE_DIR / f"{run_id}.json").exists()
