"""Scenarios: byte-identical results from a seed, exactness on a full grid, and the CLI."""
from __future__ import annotations

import json
import math
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim.scenario import Scenario, ScenarioRun, load_scenario, run_scenario

ROOT = Path(__file__).resolve().parents[2]
FAULTY = {
    "peers": 12, "grid": [4, 3], "rounds": 4, "seed": 11, "numel": 64, "unavailability": 0.05, "round_gap": 0.2,
    "network": {"latency": {"dist": "uniform", "low": 0.001, "high": 0.02}, "bandwidth": 5e6, "loss": 0.02},
    "faults": [{"kind": "crash", "peer": 4, "at": 1.2}, {"kind": "pause", "peer": 2, "start": 1.1, "end": 1.6},
               {"kind": "partition", "sides": [[0, 1, 2], [3, 5, 6]], "start": 1.0, "end": 2.5},
               {"kind": "crash_rejoin", "peer": 7, "at": 1.3, "back": 3.0}],
    "churn": {"arrival_rate": 0.5, "departure_rate": 0.01, "until": 10.0},
}


def _run_cli(args, hashseed):
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    return subprocess.run([sys.executable, "-m", "sim", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_results_file_is_byte_identical_across_hash_seeds(tmp_path):
    scen = tmp_path / "faulty.json"
    scen.write_text(json.dumps(FAULTY))
    outs = []
    for hs in ("0", "4242"):
        out = tmp_path / f"r{hs}.json"
        p = _run_cli(["run", str(scen), "--out", str(out), "--quiet"], hs)
        assert p.returncode == 0, p.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    data = json.loads(outs[0])
    assert data["lost"] > 0 and len(data["rounds"]) == 4
    assert sum(data["rounds"][0]["failures"].values()) > 0  # the faults landed in round 0
    assert data["trace"]


def test_full_16x16_grid_exact_after_two_rounds_at_message_level():
    res = run_scenario({"peers": 256, "grid": [16, 16], "rounds": 2, "seed": 1, "numel": 4,
                        "membership": "static", "bootstrap_time": 0.0})
    assert [r["succeeded"] for r in res.rounds] == [256, 256]
    assert res.rounds[0]["groups"] == {"16": 16} and res.rounds[1]["groups"] == {"16": 16}
    assert res.rounds[0]["mse"] > 1e-3
    assert res.rounds[1]["max_abs"] < 1e-12


def test_random_groups_shrink_mse_by_about_one_over_group_size():
    """No grid: one key per round, so the rendezvous peer cuts the joiners (in arrival order, which
    random latencies shuffle) into groups of 8 (smaller where a pool with stragglers is cut evenly). Expected MSE factor
    per round: about 1/8."""
    res = run_scenario({"peers": 256, "grid": [], "rounds": 3, "seed": 2, "membership": "static",
                        "bootstrap_time": 0.0, "network": {"latency": {"dist": "uniform", "low": 0.0, "high": 0.05}},
                        "protocol": {"target_group_size": 8}})
    mse = [r["mse"] for r in res.rounds]
    for r in res.rounds:
        assert r["succeeded"] == 256
        # full groups of 8, or a pool cut evenly when stragglers came within the grace (never below 8/2)
        assert all(5 <= int(k) <= 8 for k in r["groups"]), r["groups"]
    for a, b in zip(mse, mse[1:]):
        assert 1 / 16 < b / a < 1 / 4, mse


def test_scenario_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="unknown scenario keys"):
        Scenario.from_dict({"peerz": 3})
    with pytest.raises(ValueError, match="unknown fault kind"):
        Scenario.from_dict({"faults": [{"kind": "meteor"}]})
    with pytest.raises(ValueError, match="do not fit"):
        Scenario.from_dict({"peers": 20, "grid": [4, 4]})
    with pytest.raises(ValueError, match="unknown profiles"):
        Scenario.from_dict({"profiles": {"satellite": 1.0}})


@pytest.mark.parametrize("extra, message", [
    ({"churn": {"arrival_rate": -1.0}}, "churn: arrival_rate must be a finite rate >= 0 per second, not -1.0"),
    ({"churn": {"departure_rate": -0.1}}, "churn: departure_rate must be a finite rate >= 0 per second, not -0.1"),
    ({"faults": [{"kind": "pause", "peer": 1, "start": 2.0, "end": 1.0}]}, r"pause: end \(1.0\) must come after start \(2.0\)"),
    ({"faults": [{"kind": "pause", "peer": 1, "start": 1.0, "end": 1.0}]}, r"pause: end \(1.0\) must come after start"),
    ({"faults": [{"kind": "partition", "sides": [[0], [1]], "start": 3.0, "end": 1.0}]}, "partition: end"),
    # (the inner pause's end resumed the peer, cutting the outer one short, silently)
    ({"faults": [{"kind": "pause", "peer": 1, "start": 0.5, "end": 3.0}, {"kind": "pause", "peer": 1, "start": 1.0,
                                                                         "end": 2.0}]},
     r"pause faults on peer 1 overlap \(\[0.5, 3\] and \[1, 2\]\): give one pause from 0.5 to 3"),
    ({"faults": [{"kind": "slow", "peer": 1, "start": 0.0, "end": 1.0, "factor": 0.0}]}, "slow: factor must be a number > 0"),
    # (a crash is for good: a crash_rejoin after it brought the peer back, silently)
    ({"faults": [{"kind": "crash", "peer": 2, "at": 1.0}, {"kind": "crash_rejoin", "peer": 2, "at": 2.0, "back": 3.0}]},
     r"peer 2 crashes for good at 1 s, yet a crash_rejoin fault of it comes at 2 s"),
    ({"faults": [{"kind": "pause", "peer": 2, "start": 1.5, "end": 2.0}, {"kind": "crash", "peer": 2, "at": 1.0}]},
     r"peer 2 crashes for good at 1 s, yet a pause fault of it comes at 1.5 s"),
    ({"faults": [{"kind": "crash", "peer": 1, "at": -5.0}]}, "crash: at must be a time >= 0 seconds, not -5.0"),
    ({"network": {"jitter": -0.01}}, r"\[network\] jitter must be a finite number of seconds >= 0, not -0.01"),
    ({"network": {"latency": -0.01}}, r"\[network\] latency must be a finite number of seconds >= 0"),
    ({"network": {"latency": {"dist": "uniform", "low": -1.0, "high": 0.1}}}, r"\[network\] latency low must be"),
    ({"network": {"loss": -0.5}}, r"\[network\] loss must be a probability in \[0, 1\), not -0.5"),
    ({"network": {"loss": 1.0}}, r"\[network\] loss must be a probability in \[0, 1\), not 1.0"),
    ({"network": {"bandwidth": 0}}, r"\[network\] bandwidth must be > 0 bytes/s"),
    ({"network": {"bandwidth": -5.0}}, r"\[network\] bandwidth must be > 0 bytes/s"),
    ({"profiles": {"home": -1.0, "datacenter": 2.0}}, "profiles: the fraction of home must be a number >= 0"),
    ({"step_timeout": -1.0}, r"step_timeout must be in \[0, 1e6\] seconds"),
    ({"round_gap": -1.0}, "round_gap must be a finite number of seconds >= 0"),
    ({"bootstrap_time": -1.0}, "bootstrap_time must be a finite number of seconds >= 0"),
])
def test_values_of_the_wrong_sign_or_range_are_refused_at_load(extra, message):
    """Before, these loaded: a negative arrival rate, jitter or bandwidth 0 ran as if absent, a pause
    ending before it began left the peer paused, and a negative latency failed mid-run ("Negative delay")."""
    with pytest.raises(ValueError, match=message):
        Scenario.from_dict({"peers": 4, "grid": [2, 2], **extra})


@pytest.mark.parametrize("hosts, message", [
    ([{"up_mbit": "10"}], "hosts: up_mbit must be a finite number, not '10'"),
    ([{"latency_ms": float("inf")}], "hosts: latency_ms must be a finite number, not inf"),
    ([{"latency_ms": float("nan")}], "hosts: latency_ms must be a finite number, not nan"),
    ([{"up_mbit": float("inf")}], "hosts: up_mbit must be a finite number, not inf"),
    ([{"jitter_ms": "1"}], "hosts: jitter_ms must be a finite number"),
    ([{"loss": "0.1"}], "hosts: loss must be a finite number"),
    ([{"hint": [1]}], "hosts: hint must be a number >= 0 or \"auto\", not \\[1\\]"),
    ([{"count": 2.0}], "hosts: count must be a positive integer, not 2.0"),
    (["x"], "each \\[\\[hosts\\]\\] entry is a table"),
    ({"up_mbit": 10}, r"hosts must be a list of tables \(\[\[hosts\]\]\)"),
])
def test_host_values_of_the_wrong_type_name_the_field(hosts, message):
    """A string where [[hosts]] wants a number raised "'<=' not supported between instances of 'str'
    and 'int'" (no field named); inf and nan loaded, and the testbed failed on them only after building
    its namespaces (inf: an OverflowError traceback from its tc call); `[hosts]` for `[[hosts]]`
    listed the letters of its keys as unknown keys."""
    with pytest.raises(ValueError, match=message):
        Scenario.from_dict({"grid": [], "hosts": hosts})


def test_shipped_scenario_file_loads_and_cli_prints_a_table():
    sc = load_scenario(ROOT / "sim" / "scenarios" / "flaky_home.toml")
    assert sc.peers == 64 and len(sc.faults) == 4
    p = _run_cli(["moshpit", "--peers", "64", "--grid", "8x8", "--group-size", "8", "--rounds", "2"], "0")
    assert p.returncode == 0, p.stderr
    assert "mse" in p.stdout and "8x8" in p.stdout
    p = _run_cli(["moshpit", "--peers", "4096", "--grid", "64x64", "--level", "round", "--rounds", "2", "--json"], "0")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["rounds"]) == 2


def test_the_compression_scenarios_reach_every_peer_on_both_harnesses():
    """compress100_{none,int8}.toml (README, "Wire compression") at a small size: the simulator's peers
    send int8 (about a quarter of the bytes, a nonzero error), and the testbed's get the same setting."""
    from sim.testbed_run import averager_settings

    res = {}
    for codec in ("none", "int8"):
        sc = load_scenario(ROOT / "sim" / "scenarios" / f"compress100_{codec}.toml")
        assert sc.compression == codec and len(sc.hosts) == 4 and sc.numel == 4 << 20
        assert averager_settings(sc, (), 0).get("compression", "none") == codec
        d = {**{k: getattr(sc, k) for k in ("seed", "grid", "protocol", "hosts", "compression", "dtype")},
             "numel": 20000, "rounds": 1, "round_gap": 0.1, "bootstrap_time": 1.0}
        res[codec] = run_scenario(d).rounds[0]
    assert res["none"]["max_abs"] < 1e-6 < res["int8"]["max_abs"]
    assert 0.2 < res["int8"]["bytes_sent_mean"] / res["none"]["bytes_sent_mean"] < 0.3


def test_bench_memory_run_takes_a_peer_count_that_is_no_square(capsys):
    # `python -m sim bench --memory-peers 20000` gave a 141 x 141 grid (19,881 cells) for 20,000
    # peers and reported "memory run failed: ... do not fit" after the whole speed benchmark
    from sim.bench import _memory_child

    _memory_child(10, round(10 ** 0.5))  # what main() passes: the side is the rounded square root
    out = json.loads(capsys.readouterr().out)
    assert out["peers"] == 10 and out["succeeded"] == 10


def test_full_placement_that_leaves_a_peer_alone_along_a_dimension_is_refused_at_load():
    """`peers = 4` on the default 4 x 4 grid put all four peers in one row: every round along the
    other dimension each peer was alone, and all four failed with GroupNotFound after the whole
    matchmaking window (4.6 s of 9), silently. Refused, naming a grid that fits."""
    from sim.scenario import Scenario

    with pytest.raises(ValueError, match=r"4 of them would be alone along dimension 0.*grid = \[2, 2\]"):
        Scenario.from_dict({"peers": 4, "numel": 4})
    with pytest.raises(ValueError, match=r"e\.g\. grid = \[5\]"):
        Scenario.from_dict({"peers": 5, "numel": 4, "grid": [3, 3]})
    # fine: every peer has a partner along both dimensions, or the cells are not filled in order
    Scenario.from_dict({"peers": 8, "numel": 4})  # rows 0 and 1 of 4 x 4
    Scenario.from_dict({"peers": 4, "numel": 4, "placement": "distinct"})
    Scenario.from_dict({"peers": 4, "numel": 4, "grid": [2, 2]})
    Scenario.from_dict({"peers": 4, "numel": 4, "grid": []})
    res = run_scenario({"peers": 4, "numel": 4, "rounds": 2, "grid": [2, 2]})
    assert [r["succeeded"] for r in res.rounds] == [4, 4]


@pytest.mark.parametrize("bad, expect", [
    ({"seed": -1}, "seed must be >= 0"),
    ({"seed": float("nan")}, "seed must be a whole number, not nan"),
    ({"numel": 2.5}, "numel must be a whole number, not 2.5"),
    ({"rounds": float("inf")}, "rounds must be a whole number, not inf"),
    ({"peers": True}, "peers must be a whole number, not True"),
])
def test_counts_and_seed_are_whole_numbers_checked_at_load(bad, expect):
    """These failed deep in numpy at run time (SeedSequence, 'slice indices must be integers'), naming
    no key of the scenario."""
    with pytest.raises(ValueError, match=re.escape(expect)):
        Scenario.from_dict({"peers": 4, "grid": [2, 2], "numel": 4, "rounds": 1, **bad})


@pytest.mark.parametrize("host, expect", [
    ({"up_mbit": float("nan")}, "hosts: up_mbit must be a finite number, not nan"),
    ({"latency_ms": float("inf")}, "hosts: latency_ms must be a finite number, not inf"),
    ({"loss": float("nan")}, "hosts: loss must be a finite number, not nan"),
    ({"hint": float("nan")}, 'hosts: hint must be a number >= 0 or "auto", not nan'),
])
def test_host_values_must_be_finite(host, expect):
    """A NaN rate passed every comparison of the checks (all false) and hung the simulator."""
    with pytest.raises(ValueError, match=re.escape(expect)):
        Scenario.from_dict({"grid": [], "numel": 4, "rounds": 1,
                            "hosts": [{"up_mbit": 10, "down_mbit": 10, **host}, {"up_mbit": 10, "down_mbit": 10}]})


def test_churn_without_an_end_schedules_arrivals_as_the_run_goes():
    """`until` defaults to forever: scheduling every arrival up front never ended (a scenario with
    churn and no `until` hung in its constructor, its memory growing)."""
    from sim.faults import Churn

    class Ctx:
        initial_count = 0

        def __init__(self) -> None:
            self.pending: list = []
            self.arrived = 0

        def rng(self, purpose: str) -> np.random.Generator:
            return np.random.default_rng(0)

        def at(self, t: float, fn) -> None:
            assert len(self.pending) < 1000, "arrivals scheduled without end"
            self.pending.append((t, fn))

        def arrive(self) -> None:
            self.arrived += 1

    ctx = Ctx()
    Churn(arrival_rate=10.0).install(ctx)
    times = []
    for _ in range(50):  # each arrival schedules the next, later one
        assert len(ctx.pending) == 1
        t, fn = ctx.pending.pop()
        times.append(t)
        fn()
    assert ctx.arrived == 50 and times == sorted(times) and 3.0 < times[-1] < 8.0
    sc = Scenario.from_dict({"seed": 1, "peers": 4, "numel": 2, "rounds": 2, "grid": [],
                             "churn": {"arrival_rate": 2.0, "departure_rate": 0.1}})
    run = ScenarioRun(sc)
    run.run_rounds()
    assert len(run.slots) > 4  # peers arrived during the rounds


@pytest.mark.parametrize("bad, expect", [
    ({"unavailability": "0.1"}, "unavailability must be a number, not '0.1'"),
    ({"step_timeout": "5"}, "step_timeout must be a number, not '5'"),
    ({"round_gap": "1"}, "round_gap must be a number, not '1'"),
    ({"encode": "no"}, "encode must be true or false, not 'no'"),
    ({"error_feedback": 1}, "error_feedback must be true or false, not 1"),
    ({"grid": "4x4"}, "grid must be a list of whole numbers, e.g. [4, 4], or [] for no grid, not '4x4'"),
    ({"grid": [2.5, 2]}, "grid must be a list of whole numbers"),
    ({"grid": [1, 4]}, "grid = [1, 4] has a dimension of size 1: every peer is alone along it, so every round "
                       "along it fails; leave it out (grid = [4])"),
    ({"profiles": "home"}, "profiles must be a table of fractions"),
    ({"faults": {"kind": "crash", "peer": 1, "at": 1.0}}, "faults must be a list of tables ([[faults]])"),
    ({"faults": [3]}, "each [[faults]] entry is a table with a kind"),
    ({"faults": [{"kind": "crash", "peer": 1, "at": "soon"}]}, "crash: at must be a time >= 0 seconds, not 'soon'"),
    ({"faults": [{"kind": "crash", "peer": 1.7, "at": 1.0}]}, "crash: peer must be a peer index (a whole number >= 0), not 1.7"),
    ({"faults": [{"kind": "partition", "sides": [[0, 1]], "start": 1.0, "end": 2.0}]},
     "partition: sides must be two lists of peer indices"),
    ({"faults": [{"kind": "partition", "sides": [[0, 1], []], "start": 1.0, "end": 2.0}]},
     "partition: sides must be two non-empty lists with no peer on both"),
    ({"faults": [{"kind": "partition", "sides": [[0, 1], [1, 2]], "start": 1.0, "end": 2.0}]},
     "partition: sides must be two non-empty lists with no peer on both"),
    ({"churn": {"arrival_rate": "1"}}, "churn: arrival_rate must be a finite rate >= 0 per second, not '1'"),
    ({"network": {"loss": "0.1"}}, "[network] loss must be a probability in [0, 1), not '0.1'"),
    ({"network": {"bandwidth": "1G"}}, "[network] bandwidth must be > 0 bytes/s (leave it out for unlimited), not '1G'"),
    ({"network": {"latency": {"dist": "lognormal", "median": 0.02}}},
     '[network] latency {dist = "lognormal"} needs median and sigma; sigma missing'),
    ({"network": {"latency": {"dist": "pareto"}}}, "[network] unknown latency distribution 'pareto'"),
])
def test_values_of_the_wrong_type_are_refused_at_load_naming_the_field(bad, expect):
    """A string where a number goes raised "'<=' not supported between instances of 'float' and 'str'"
    or "could not convert string to float: 'soon'" (no key named); `[faults]` for `[[faults]]` ended
    `python -m sim run` in an AttributeError traceback; encode = "no" ran with the codec on and a fault's
    peer = 1.7 crashed peer 1 (both silently); grid = [1, 4] failed every other round, every peer."""
    with pytest.raises(ValueError, match=re.escape(expect)):
        Scenario.from_dict({"peers": 4, "grid": [], "numel": 4, "rounds": 1, **bad})


def test_a_faults_table_for_an_array_of_tables_ends_the_cli_in_one_line(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('peers = 4\ngrid = []\n[faults]\nkind = "crash"\npeer = 1\nat = 1.0\n')
    p = _run_cli(["run", str(path), "--quiet"], "0")
    assert p.returncode == 2, p.stderr
    assert "faults must be a list of tables ([[faults]])" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("args, expect", [
    (["--peers", "0", "--level", "round"], "argument --peers: must be a whole number >= 1, got '0'"),
    (["--grid", "abc"], "argument --grid: must be sizes >= 1 joined by x (e.g. 32x32), or empty for no grid, got 'abc'"),
    (["--grid", "4x0", "--level", "round"], "argument --grid: must be sizes >= 1"),
])
def test_moshpit_cli_refuses_counts_and_grids_that_mean_nothing(args, expect, capsys):
    """--peers 0 at the round level ran into numpy's empty-slice warnings and "cannot reshape array of
    size 0"; --grid abc said "invalid literal for int() with base 10", naming no option."""
    from sim.__main__ import main

    with pytest.raises(SystemExit) as stop:  # argparse's error: one line, exit status 2
        main(["moshpit", "--rounds", "1", *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert expect in err and "Warning" not in err, err
    assert main(["moshpit", "--peers", "16", "--rounds", "1", "--level", "round", "--json"]) == 0  # default grid 32x32
    assert json.loads(capsys.readouterr().out)["rounds"][0]["participants"] > 0


def test_a_slow_fault_on_a_peer_without_a_rate_is_refused_and_with_one_slows_its_rounds():
    """With no bandwidth limit (the default) a slow fault divided an unlimited rate: factor 1e9 left
    every round as fast as without it, silently."""
    slow = {"kind": "slow", "peer": 1, "start": 0.0, "end": 100.0, "factor": 10.0}
    base = {"peers": 4, "grid": [], "rounds": 1, "numel": 20000, "bootstrap_time": 0.5}
    with pytest.raises(ValueError, match=r"a slow fault on peer 1 would do nothing: that peer's links have no "
                                         r"bandwidth limit to divide"):
        Scenario.from_dict({**base, "faults": [slow]})
    net = {"bandwidth": 1e7}
    fast = run_scenario({**base, "network": net}).rounds[0]
    slowed = run_scenario({**base, "network": net, "faults": [slow]}).rounds[0]
    assert fast["succeeded"] == slowed["succeeded"] == 4
    assert slowed["sim_seconds"] > 3 * fast["sim_seconds"], (fast["sim_seconds"], slowed["sim_seconds"])


def test_run_checks_its_output_paths_before_simulating(tmp_path, capsys, monkeypatch):
    """--out in a missing folder (or --csv naming a folder) failed only when the results were written,
    after the whole simulation, which was lost."""
    import sim.scenario
    from sim.__main__ import main

    path = tmp_path / "s.toml"
    path.write_text("peers = 2\ngrid = []\nrounds = 1\n")
    ran = []
    monkeypatch.setattr(sim.scenario, "run_scenario", lambda *a, **k: ran.append(1))
    assert main(["run", str(path), "--quiet", "--out", str(tmp_path / "no" / "r.json")]) == 2
    assert main(["run", str(path), "--quiet", "--csv", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("python -m sim run: error: cannot write") for line in err), err
    assert not ran and sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]


@pytest.mark.parametrize("protocol, expect", [
    ({"target_group_size": "x"}, "[protocol] target_group_size must be an int, not 'x'"),
    ({"part_timeout": -1}, "[protocol] part_timeout and allreduce_timeout must be > 0 seconds, not -1"),
    ({"prefix": 5}, "[protocol] prefix must be a string of 1..200 characters, not 5"),
    ({"grid_coords": [0, 0]}, "[protocol] grid_coords is set by the scenario (use placement instead)"),
    ({"grid": [4]}, "[protocol] grid is set by the scenario (use the scenario's grid instead)"),
])
def test_protocol_settings_are_checked_at_load(protocol, expect):
    """[protocol] values reached NodeConfig only when the first peer was built (a sweep then failed every
    run instead of refusing the file; prefix = 5 said "object of type 'int' has no len()"); grid_coords
    there was overridden by the placement, silently, and grid contradicted the scenario's."""
    with pytest.raises(ValueError, match=re.escape(expect)):
        Scenario.from_dict({"peers": 4, "grid": [2, 2], "rounds": 1, "protocol": protocol})


@pytest.mark.parametrize("network, extra, expect", [
    ({"bandwidth": {"peer0": 1e6}}, {}, "[network] bandwidth is per peer endpoint, e.g. {\"sim://peer0\" = 1e6}; "
                                        "'peer0' names none"),
    ({"bandwidth": 1e6}, {"profiles": {"home": 1.0}}, "[network] bandwidth is the rate of peers without a profile"),
    ({"bandwidth": 1e6}, {"hosts": [{"count": 4}]}, "every peer has one ([[hosts]]): it would do nothing"),
    ({"latency": {"dist": "regions", "region_of": {"sim://peer0": "eu"}, "matrix": {"eu": {"eu": 0.01}}}}, {},
     "[network] latency region_of places no region for sim://peer1"),
    ({"latency": {"dist": "regions", "region_of": {f"sim://peer{i}": "eu" if i else "us" for i in range(4)},
                  "matrix": {"eu": {"eu": 0.01, "us": 0.05}, "us": {"us": 0.01}}}}, {},
     "[network] latency matrix has no entry from region 'us' to 'eu'"),
])
def test_network_settings_every_peer_would_miss_are_refused_at_load(network, extra, expect):
    """A per-peer bandwidth keyed "peer0" (not "sim://peer0"), or a bandwidth beside profiles or [[hosts]]
    that give every peer its rates, ran without it, silently; a regions latency missing a peer or a
    pair of regions failed at the first message with a bare KeyError ('sim://peer1')."""
    with pytest.raises(ValueError, match=re.escape(expect)):
        Scenario.from_dict({"peers": 4, "grid": [2, 2], "rounds": 1, "network": network, **extra})


def test_a_fault_on_a_slot_churn_has_not_filled_is_named_when_it_fires():
    """With churn, a fault may name a later arrival's slot; one that fired before that slot was filled
    ended the run in a bare IndexError ("list index out of range"). Churn with departures only adds no
    slot, so there the fault is refused at load, as without churn."""
    base = {"peers": 4, "grid": [], "rounds": 1, "bootstrap_time": 0.5}
    with pytest.raises(ValueError, match=re.escape("a crash fault names peer 9, but the scenario has peers 0..3")):
        Scenario.from_dict({**base, "churn": {"departure_rate": 0.01},
                            "faults": [{"kind": "crash", "peer": 9, "at": 0.2}]})
    for fault in ({"kind": "crash", "peer": 9, "at": 0.2}, {"kind": "pause", "peer": 9, "start": 0.2, "end": 0.3}):
        with pytest.raises(ValueError, match=re.escape("a fault names peer 9, but at t = 0.200 s only peers 0..3 "
                                                       "have joined")):
            run_scenario({**base, "churn": {"arrival_rate": 1e-6}, "faults": [fault]})


def test_a_fault_timed_past_the_end_of_the_run_is_warned_of(caplog):
    """A crash at t = 100 s in a run over after ~1.5 s gave the results of a run without it, without a word."""
    base = {"peers": 4, "grid": [], "rounds": 1, "bootstrap_time": 0.5}
    with caplog.at_level("WARNING", logger="sim.faults"):
        run_scenario({**base, "faults": [{"kind": "crash", "peer": 1, "at": 0.2},
                                         {"kind": "crash", "peer": 2, "at": 100.0}]})
    said = [r.getMessage() for r in caplog.records if r.name == "sim.faults"]
    assert len(said) == 1 and said[0].startswith("the crash fault at t = 100 s never took effect: the run ended at t = "), said


@pytest.mark.parametrize("cpu, expect", [
    ({"costs": {"handle_msg": 1e-4}, "shared": "no"}, "cpu.shared must be true or false, not 'no'"),
    ({"costs": {"handle_msg": 1e-4}, "cores": "x"}, "cpu.cores must be a positive integer, not 'x'"),
    ({"costs": {"handle_mgs": 1e-4}}, "cpu.costs must be a table of accumulate_byte, "),
    ({"costs": {"handle_msg": "1e-4"}}, "cpu.costs.handle_msg must be a finite number of seconds >= 0, not '1e-4'"),
    ({"profile": 3}, "cpu.profile must be a file path or \"auto\", not 3"),
])
def test_cpu_settings_are_checked_at_load(cpu, expect):
    """cpu.shared = "no" ran with shared cores (any string is true); a misspelt inline cost (handle_mgs)
    ran without it, silently; cores = "x" said "invalid literal for int()", and all of it only at the run."""
    with pytest.raises(ValueError, match=re.escape(expect)):
        Scenario.from_dict({"peers": 4, "grid": [2, 2], "rounds": 1, "cpu": cpu})


def test_a_json_file_named_in_upper_case_is_read_as_json(tmp_path):
    # `.JSON` was read as TOML and failed on its first brace (found by the simulator probe)
    from sim.scenario import load_scenario, read_file
    from sim.sweep import load_sweep

    p = tmp_path / "SC.JSON"
    p.write_text('{"seed": 3, "peers": 4, "numel": 8, "rounds": 1, "grid": []}')
    assert read_file(p)["seed"] == 3 and load_scenario(p).peers == 4
    sw = tmp_path / "SW.Json"
    sw.write_text('{"name": "x", "scenario": "SC.JSON", "axes": {"rounds": [1, 2]}}')
    assert load_sweep(sw).name == "x"


_ALL_CRASH = """
seed = 1
peers = 2
numel = 64
rounds = 2
grid = []
step_timeout = 1.0
round_gap = 0.2
[protocol]
target_group_size = 2
[[faults]]
kind = "crash"
peer = 0
at = 0.1
[[faults]]
kind = "crash"
peer = 1
at = 0.1
"""


def _strict_json(text: str):
    """JSON as every other reader takes it: a bare NaN or Infinity (Python's own extension) is refused."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_results_with_no_peer_live_are_json_every_reader_takes(tmp_path, capsys):
    """A round with no live peer has no mse: it was written as a bare NaN, which jq, JavaScript and
    most JSON readers refuse (the whole file). It is null now, in --out and --json alike, and a sweep
    over such a scenario still tabulates it as NaN."""
    from sim.__main__ import main

    path = tmp_path / "crash.toml"
    path.write_text(_ALL_CRASH)
    out = tmp_path / "r.json"
    assert main(["run", str(path), "--quiet", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--quiet", "--json"]) == 0
    for text in (out.read_text(), capsys.readouterr().out):
        rounds = _strict_json(text)["rounds"]
        assert [r["live"] for r in rounds] == [0, 0]
        assert all(r["mse"] is None and r["max_abs"] is None and r["spread"] is None for r in rounds), rounds

    from sim.sweep import load_sweep, read_table, run_sweep

    spec = tmp_path / "sw.toml"
    spec.write_text('name = "crash"\nkind = "scenario"\nseeds = 1\n[axes]\nnumel = [64]\n[base]\n'
                    + _ALL_CRASH.replace("numel = 64\n", "").replace("[protocol]", "[base.protocol]")
                    .replace("[[faults]]", "[[base.faults]]"))
    run_sweep(load_sweep(spec), tmp_path / "sw", workers=0, quiet=True)
    rows = read_table(tmp_path / "sw")[1]
    assert len(rows) == 2 and all(math.isnan(float(r["mse"])) for r in rows), rows


def test_json_ready_turns_every_non_finite_float_into_null():
    from sim.scenario import json_ready, json_text

    obj = {"a": [1.0, float("nan"), (float("inf"), -float("inf"))], "b": {"c": 2, "d": "nan"}, "e": None}
    assert json_ready(obj) == {"a": [1.0, None, [None, None]], "b": {"c": 2, "d": "nan"}, "e": None}
    assert _strict_json(json_text(obj)) == json_ready(obj)
    with pytest.raises(ValueError):
        json.dumps(obj, allow_nan=False)  # what json_text guards against
