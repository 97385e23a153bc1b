"""Simulated training (`sim.train`, `python -m sim train`): the real training classes in virtual time.

One seed gives one run, bit for bit (loss curve, trace) across processes and PYTHONHASHSEED; with
churn, late joiners download state and every live trainer ends holding identical parameters after
the final all-hands round; the sweep kind and the CLI run it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from sim.sweep import KINDS, Sweep, read_table, run_sweep  # noqa: E402
from sim.train import TrainRun, TrainScenario, run_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

SMALL = {"seed": 4, "peers": 6, "profiles": {"home": 1.0},
         "train": {"optimizer": "moshpit", "params": 3000, "steps": 8, "step_time": 0.25, "eval_every": 2}}

CHURN = {"seed": 3, "peers": 10, "profiles": {"home": 0.5, "datacenter": 0.5},
         "churn": {"arrival_rate": 0.5, "departure_rate": 0.03, "until": 7.0},
         "train": {"optimizer": "allreduce", "params": 5000, "steps": 24, "step_time": 0.5, "eval_every": 4}}


def _run_in_processes(spec: dict, hashseeds: tuple[str, ...]) -> list[str]:
    """`spec` run once per hash seed, each in its own interpreter; the runs go side by side."""
    code = "import json, sys; from sim.train import run_train; print(run_train(json.loads(sys.argv[1])).to_json())"
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT, text=True,
                              env=dict(os.environ, PYTHONHASHSEED=h, PYTHONPATH=str(ROOT)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for h in hashseeds]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_one_seed_one_run_bit_for_bit_across_hash_seeds():
    a, b = _run_in_processes(SMALL, ("0", "977"))
    assert a == b  # every loss value, time, byte count and the network trace
    res = json.loads(a)
    assert len(res["trainers"]) == 6 and all(t["steps"] == 8 and not t["crashed"] for t in res["trainers"])
    # every trainer averaged, and the loss went down
    assert all(t["rounds"]["done"] >= 1 for t in res["trainers"])
    assert res["curve"][-1]["loss"] < res["curve"][0]["loss"]
    assert res["final"]["spread"] < 1e-3
    other = run_train({**SMALL, "seed": 5})
    assert other.trace != res["trace"] and other.loss_hash != res["loss_hash"]


def test_churn_late_joiners_download_state_and_live_trainers_end_identical():
    res = run_train(CHURN)
    run = TrainRun(TrainScenario.from_dict(CHURN))
    again = run.run()
    assert res.to_json() == again.to_json()  # the same run twice in one process: identical too
    # a departed trainer leaves neither its peer (a Departed stands in its slot) nor its model and
    # optimizer behind: the run kept them all to its end
    assert all(type(p).__name__ == "Departed" for p in run.slots if not p.alive)
    assert all(run.slots[i].alive for i in run.optimizers)
    assert not any(hasattr(o, "averager") for o in run._rec_opts)
    late = [t for t in res.trainers if t["late"]]
    crashed = [t for t in res.trainers if t["crashed"]]
    assert crashed, "the scenario should make trainers leave"
    assert any(t["downloaded"] and not t["crashed"] for t in late), "a late joiner should download the state"
    for t in late:
        if not t["crashed"] and t["started"] > 1.0 + 0.5:  # arrived after training began (bootstrap_time 1 s)
            assert t["first_step"] > 0  # it took up the swarm's step count
    fin = res.final
    assert fin["live"] == sum(1 for t in res.trainers if not t["crashed"])
    assert fin["identical"] and fin["spread"] == 0.0, fin["param_groups"]
    assert res.curve[-1]["loss"] < 0.8 * res.curve[0]["loss"]


def test_every_optimizer_kind_trains():
    for kind in ("gossip", "collaborative"):
        res = run_train({**SMALL, "train": {**SMALL["train"], "optimizer": kind}})
        assert res.curve[-1]["loss"] < res.curve[0]["loss"], kind
        assert all(t["sent"] > 0 for t in res.trainers)


def test_diloco_one_seed_one_run_and_every_outer_step_averages_the_whole_swarm():
    spec = {"seed": 4, "peers": 4, "profiles": {"home": 1.0},
            "train": {"optimizer": "diloco", "params": 2000, "steps": 6, "step_time": 0.25, "eval_every": 2,
                      "average_every": 3}}
    a, b = run_train(spec), run_train(spec)
    assert a.to_json() == b.to_json()
    assert all(t["epoch"] == 2 and t["rounds"]["done"] == 2 and t["last_round"]["group_size"] == 4
               for t in a.trainers), a.trainers
    assert a.final["identical"] and a.curve[-1]["loss"] < a.curve[0]["loss"]
    with pytest.raises(ValueError, match="multiple of average_every"):
        TrainScenario.from_dict({"train": {"optimizer": "diloco", "steps": 7, "average_every": 3}})
    with pytest.raises(ValueError, match="outer_momentum"):
        TrainScenario.from_dict({"train": {"optimizer": "diloco", "outer_momentum": 1.0}})


def test_a_crashed_trainer_ends_at_its_crash():
    """A trainer that crashed inside an outer step (its thread waiting for the round) was counted
    as ended only when that wait ran out, 0.2 s after the crash here -- and had it been the last
    initial trainer, the run's `t_end` with it. It ends at the crash."""
    spec = {"seed": 4, "peers": 4, "profiles": {"home": 1.0}, "faults": [{"kind": "crash", "peer": 1, "at": 2.2}],
            "train": {"optimizer": "diloco", "params": 2000, "steps": 6, "step_time": 0.25, "eval_every": 2,
                      "average_every": 3}}
    r = run_train(spec)
    [crashed] = [t for t in r.trainers if t["crashed"]]
    assert crashed["slot"] == 1 and crashed["ended"] == 2.2
    assert r.final["t_end"] == max(t["ended"] for t in r.trainers) > 2.2


def test_scenario_validation_names_the_problem():
    with pytest.raises(ValueError, match="optimizer"):
        TrainScenario.from_dict({"train": {"optimizer": "adamw"}})
    with pytest.raises(ValueError, match="unknown \\[train\\] keys"):
        TrainScenario.from_dict({"train": {"epochs": 3}})
    with pytest.raises(ValueError, match="unknown train scenario keys"):
        TrainScenario.from_dict({"rounds": 3})
    with pytest.raises(ValueError, match="do not fit"):
        TrainScenario.from_dict({"peers": 5, "train": {"grid": [2, 2]}})
    # the [network], [churn] and fault values of the simulator's scenarios, checked alike
    with pytest.raises(ValueError, match="churn: arrival_rate must be a finite rate >= 0"):
        TrainScenario.from_dict({"churn": {"arrival_rate": -0.5}})
    with pytest.raises(ValueError, match=r"\[network\] jitter must be a finite number of seconds >= 0"):
        TrainScenario.from_dict({"network": {"jitter": -0.01}})
    with pytest.raises(ValueError, match=r"pause: end \(1.0\) must come after start \(2.0\)"):
        TrainScenario.from_dict({"faults": [{"kind": "pause", "peer": 1, "start": 2.0, "end": 1.0}]})


def test_sweep_kind_train(tmp_path):
    assert "train" in KINDS
    base = {**SMALL, "peers": 4, "train": {**SMALL["train"], "steps": 4}}
    del base["seed"]
    sw = Sweep(name="t", kind="train", base=base, axes={"train.optimizer": ["moshpit", "gossip"]}, seeds=[0])
    out = run_sweep(sw, tmp_path / "t", workers=0, quiet=True)
    assert out.computed == 2 and not out.failures
    _, rows = read_table(tmp_path / "t")
    assert {r["train.optimizer"] for r in rows} == {"moshpit", "gossip"}
    assert all(r["live"] == 4 and r["loss"] > 0 for r in rows)
    assert [r["round"] for r in rows if r["train.optimizer"] == "gossip"] == [0, 2, 4]

    # `python -m sim plot` on it: a train sweep has no mse column, so the default metric is the loss
    # (it was mse, and plotting failed with KeyError: 'mse' unless --metric loss was given)
    pytest.importorskip("matplotlib")
    from sim.plot import plot_results

    paths = plot_results(tmp_path / "t")
    assert "metric_vs_rounds.png" in [p.name for p in paths]
    with pytest.raises(ValueError, match="no metric 'mse'.*loss"):
        plot_results(tmp_path / "t", metric="mse")


def test_cli_train(tmp_path):
    sc = tmp_path / "s.json"
    sc.write_text(json.dumps({**SMALL, "peers": 3}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "sim", "train", str(sc), "--out", str(tmp_path / "r.json")],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out loss" in out.stdout and "trace" in out.stdout
    assert json.loads((tmp_path / "r.json").read_text())["final"]["live"] == 3


def test_a_lone_trainer_trains_and_non_finite_values_are_refused():
    """A Moshpit scenario of one trainer asked for groups of one (its 1 x 1 grid), below the averager's
    least group of two, and failed with a ValueError about group sizes; lr = nan or step_time = inf
    passed the checks (NaN compares false with everything) and trained into a nan spread."""
    res = run_train({"peers": 1, "train": {"params": 100, "steps": 2}})
    assert len(res.trainers) == 1 and res.curve[-1]["loss"] == res.curve[-1]["loss"]  # trained, finite
    for bad in ({"lr": float("nan")}, {"step_time": float("inf")}, {"noise": float("nan")}):
        with pytest.raises(ValueError, match=r"needs finite steps >= 0"):
            TrainScenario.from_dict({"train": {"params": 100, **bad}})


@pytest.mark.parametrize("peers", [2, 3])
def test_two_or_three_moshpit_trainers_on_the_default_grid_average_every_round(peers):
    """The default grid for 2 trainers was (1, 2): each was alone along the first axis, each failed
    round waited out the matchmaking window while the steps skipped theirs, and the two never averaged
    (0 rounds done, 2 distinct parameter sets); 3 trainers got (2, 2), one alone along each axis."""
    res = run_train({"seed": 1, "peers": peers, "train": {"optimizer": "moshpit", "params": 200, "steps": 4,
                                                          "step_time": 0.2, "eval_every": 2}})
    assert all(t["rounds"]["failed"] == 0 and t["rounds"]["done"] >= 4 for t in res.trainers), res.trainers
    assert res.final["identical"], res.final


@pytest.mark.parametrize("extra, expect", [
    ({"seed": "x"}, "seed must be a whole number, not 'x'"),
    ({"peers": 2.5}, "peers must be a whole number, not 2.5"),
    ({"bootstrap_time": -1.0}, "bootstrap_time must be a finite number of seconds >= 0, not -1.0"),
    ({"encode": "no"}, "encode must be true or false, not 'no'"),
    ({"train": {"params": 2.5}}, "[train] params must be a whole number, not 2.5"),
    ({"train": {"steps": "x"}}, "[train] steps must be a whole number, not 'x'"),
    ({"train": {"lr": "0.1"}}, "[train] lr must be a number, not '0.1'"),
    ({"train": {"grid": "4x4"}}, "grid must be a list of whole numbers"),
    ({"train": 3}, "[train] must be a table of settings, not 3"),
])
def test_train_scenario_values_of_the_wrong_type_are_refused_naming_the_key(extra, expect):
    """seed = "x", peers = 2.5, encode = "no", bootstrap_time = -1 and params = 2.5 loaded (encode = "no"
    ran with the codec on); steps = "x" said "could not convert string to float: 'x'", naming no key."""
    with pytest.raises(ValueError, match=re.escape(expect)):
        TrainScenario.from_dict({"peers": 4, **extra})


@pytest.mark.parametrize("extra, expect", [
    ({"faults": [{"kind": "crash", "peer": 7, "at": 1.0}]}, "a crash fault names peer 7, but the scenario has peers 0..3"),
    ({"faults": [{"kind": "partition", "sides": [[0], [7]], "start": 1.0, "end": 2.0}]},
     "a partition fault names peer 7, but the scenario has peers 0..3"),
    ({"network": {"bandwidth": {"peer0": 1e6}}}, "[network] bandwidth is per peer endpoint"),
    ({"network": {"bandwidth": 1e6}, "profiles": {"home": 1.0}}, "[network] bandwidth is the rate of peers without"),
])
def test_train_scenario_faults_and_rates_no_trainer_would_see_are_refused(extra, expect):
    """A crash or partition naming a trainer the run never has did nothing, silently (a pause there failed
    at its time as "list index out of range"); a per-peer bandwidth keyed "peer0", or one beside profiles,
    was never used."""
    with pytest.raises(ValueError, match=re.escape(expect)):
        TrainScenario.from_dict({"peers": 4, **extra})


def test_a_fault_timed_past_the_end_of_a_training_run_is_warned_of(caplog):
    """A crash at t = 100 s in a run over at 1.3 s gave the results of a run without it, without a word."""
    sc = {"peers": 3, "bootstrap_time": 0.5, "train": {"params": 200, "steps": 2, "eval_every": 2, "eval_samples": 16},
          "faults": [{"kind": "crash", "peer": 2, "at": 100.0}]}
    with caplog.at_level("WARNING", logger="sim.faults"):
        res = run_train(sc)
    said = [r.getMessage() for r in caplog.records if r.name == "sim.faults"]
    assert res.final["live"] == 3
    assert len(said) == 1 and said[0].startswith("the crash fault at t = 100 s never took effect: the run ended"), said


def test_a_crash_on_a_slot_churn_has_not_filled_is_named_when_it_fires():
    """With churn arrivals a fault may name a later slot; a crash there before anyone joined it was
    skipped silently (a pause there was refused by name)."""
    sc = {"peers": 2, "bootstrap_time": 0.5, "train": {"params": 200, "steps": 2, "eval_every": 2, "eval_samples": 16},
          "churn": {"arrival_rate": 0.01},
          "faults": [{"kind": "crash", "peer": 5, "at": 0.2}]}
    with pytest.raises(ValueError, match=re.escape("a fault names peer 5, but at t = 0.200 s only peers 0..1 have joined")):
        run_train(sc)
