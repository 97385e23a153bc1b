"""`zgossip bench` end to end at a tiny size: it runs, reports every figure, and is correct.

Functional only: no timing is asserted (timings on a shared 2-core machine are not a
test). Each run starts and stops its own processes; a run takes a few seconds.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from zgossip import bench

STATS = {"median", "min", "max", "all"}


def run_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    rc = bench.main([*argv, "--json", "--timeout", "60"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out, "bench printed nothing"
    report = json.loads(out[-1])
    assert rc == 0, report
    return report


def check_stats(s: dict, reps: int) -> None:
    assert STATS <= set(s)
    assert len(s["all"]) == reps
    assert 0 <= s["min"] <= s["median"] <= s["max"]


def check_zgossip(report: dict, peers: int, numel: int, reps: int) -> None:
    assert report["benchmark"] == "allreduce"
    assert (report["peers"], report["numel"], report["reps"]) == (peers, numel, reps)
    zg = report["zgossip"]
    for key in ("step", "allreduce", "matchmaking", "cpu_seconds_all_peers", "start_skew"):
        check_stats(zg[key], reps)
    assert zg["correct"] is True
    assert zg["max_abs_error"] < 1e-5
    mem = zg["memory"]
    assert mem["tensor_bytes"] == numel * 4
    assert len(mem["extra_peak_bytes_per_peer"]) in (0, peers)  # 0 where /proc/self/clear_refs is not writable
    assert report["other_load_cores"] >= 0


def test_bench_zgossip_alone(capsys: pytest.CaptureFixture) -> None:
    report = run_json(capsys, "--peers", "2", "--numel", "4096", "--reps", "5")
    check_zgossip(report, 2, 4096, 5)
    assert "gloo" not in report and "ratio" not in report


@pytest.mark.parametrize("tcp_only", [False, True])
def test_bench_reports_the_transport_it_ran(capsys: pytest.CaptureFixture, tcp_only: bool) -> None:
    before = os.environ.get("ZGOSSIP_LOCAL_IPC")
    report = run_json(capsys, "--peers", "2", "--numel", "4096", "--reps", "5", *(["--tcp-only"] if tcp_only else []))
    check_zgossip(report, 2, 4096, 5)
    local = sys.platform.startswith("linux") and not tcp_only and before != "0"
    assert report["zgossip"]["transport"] == ("unix sockets" if local else "tcp")
    assert os.environ.get("ZGOSSIP_LOCAL_IPC") == before  # --tcp-only leaves the environment as it was


def test_bench_vs_gloo(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("torch.distributed")
    report = run_json(capsys, "--peers", "2", "--numel", "4096", "--reps", "5", "--vs", "gloo")
    check_zgossip(report, 2, 4096, 5)
    gloo = report["gloo"]
    check_stats(gloo["all_reduce"], 5)
    check_stats(gloo["cpu_seconds_all_peers"], 5)
    assert gloo["correct"] is True
    assert report["ratio"] == pytest.approx(report["zgossip"]["step"]["median"] / gloo["all_reduce"]["median"])
    assert report["ratio_allreduce_phase"] == pytest.approx(
        report["zgossip"]["allreduce"]["median"] / gloo["all_reduce"]["median"])
    assert report["cpu_ratio"] == pytest.approx(
        report["zgossip"]["cpu_seconds_all_peers"]["median"] / gloo["cpu_seconds_all_peers"]["median"])
    # the machine line and the optional paths come with every figure
    assert {"cpu_model", "cores", "kernel", "thp"} <= set(report["machine"])
    assert {"native_kernels", "kernels_isa", "stream_stores", "fast_send", "malloc_tuned"} <= set(
        report["zgossip"]["paths"])
    # per-thread CPU: the peers' protocol thread carries its OS name
    assert "zgossip I/O" in report["zgossip"]["cpu_by_thread"] or not sys.platform.startswith("linux")


def test_bench_vs_env_runs_the_fallbacks_side_by_side(capsys: pytest.CaptureFixture) -> None:
    """--vs-env: a second swarm of this code with the optional C paths switched off steps in turn
    with the first; both average correctly and the report says which paths each ran."""
    report = run_json(capsys, "--peers", "2", "--numel", "4096", "--reps", "5", "--vs-env", "ZGOSSIP_NATIVE=0",
                      "--vs-env", "ZGOSSIP_FAST_SEND=0", "--vs-env", "ZGOSSIP_TUNE_MALLOC=0")
    check_zgossip(report, 2, 4096, 5)
    ck = report["checkout"]
    assert ck["path"] is None and ck["correct"] is True
    assert ck["env"] == {"ZGOSSIP_NATIVE": "0", "ZGOSSIP_FAST_SEND": "0", "ZGOSSIP_TUNE_MALLOC": "0"}
    other = ck["paths"]
    assert not other["native_kernels"] and not other["fast_send"] and not other["malloc_tuned"]
    assert other["kernels_isa"] is None and other["stream_stores"] == "off"
    from zgossip import kernels
    assert report["zgossip"]["paths"]["native_kernels"] == kernels.NATIVE  # ours kept the environment
    cpus = [a / b for a, b in zip(report["zgossip"]["cpu_seconds_all_peers"]["all"], ck["cpu_seconds_all_peers"]["all"])]
    assert report["paired_cpu_ratio_vs_checkout"] == pytest.approx(sorted(cpus)[2])


def test_bench_rejects_a_malformed_vs_env(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--reps", "5", "--vs-env", "NOEQUALS"]) == 2
    assert "VAR=VALUE" in capsys.readouterr().err


def test_bench_matchmaking(capsys: pytest.CaptureFixture) -> None:
    report = run_json(capsys, "--matchmaking", "--peers", "3", "--reps", "5")
    assert report["benchmark"] == "matchmaking"
    assert report["peers"] == 3 and report["steps"] == 10  # at least 10 steps whatever --reps says
    check_stats(report["matchmaking"], 10)


def test_bench_rejects_too_few_reps(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--reps", "3"]) == 2
    assert "at least 5" in capsys.readouterr().err


def test_bench_vs_checkout_runs_the_other_code(capsys: pytest.CaptureFixture, tmp_path) -> None:
    import os
    import shutil

    import zgossip

    # "another checkout": a copy of this package, with its built extension, in a fresh directory
    shutil.copytree(os.path.dirname(zgossip.__file__), tmp_path / "zgossip",
                    ignore=shutil.ignore_patterns("__pycache__"))
    report = run_json(capsys, "--peers", "2", "--numel", "4096", "--reps", "5", "--vs-checkout", str(tmp_path))
    check_zgossip(report, 2, 4096, 5)
    ck = report["checkout"]
    assert ck["path"] == str(tmp_path)
    check_stats(ck["step"], 5)
    assert ck["correct"] is True
    ratios = [a / b for a, b in zip(report["zgossip"]["step"]["all"], ck["step"]["all"])]
    assert report["paired_ratio_vs_checkout"] == pytest.approx(sorted(ratios)[2])


def test_bench_vs_checkout_refuses_this_very_code(capsys: pytest.CaptureFixture) -> None:
    import os

    import zgossip

    with pytest.raises(RuntimeError, match="imported this zgossip"):
        bench.main(["--peers", "2", "--numel", "1024", "--reps", "5", "--timeout", "60",
                    "--vs-checkout", os.path.dirname(os.path.dirname(zgossip.__file__))])


def test_bench_compression_pairs_with_an_uncompressed_swarm(capsys: pytest.CaptureFixture) -> None:
    # (with --vs gloo the ratio to gloo is computed as in test_bench_vs_gloo; gloo's start-up is left out here)
    report = run_json(capsys, "--peers", "2", "--numel", "4096", "--reps", "5", "--compression", "int8")
    assert report["compression"] == "int8"
    zg, un = report["zgossip"], report["uncompressed"]
    check_stats(zg["step"], 5)
    check_stats(un["step"], 5)
    assert zg["correct"] is True and un["correct"] is True
    assert 0 < zg["max_abs_error"] < 0.05  # it did travel as int8, within the codec's bound
    assert report["paired_ratio_vs_uncompressed"] > 0 and report["paired_cpu_ratio_vs_uncompressed"] > 0
    assert report["codec_cost"]["bytes_ratio"] == pytest.approx((4096 // 2 + 4 * 2) / (4 * 4096 // 2))
