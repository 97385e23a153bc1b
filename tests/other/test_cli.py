"""The command lines as a person meets them: Ctrl-C, help texts, scenario errors, the progress bar."""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _group_state(pgid: int) -> str:
    """What every process of a process group is doing, and which signals it blocks and ignores."""
    rows = []
    for pid in sorted(int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            if os.getpgid(pid) != pgid:
                continue
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":" in line)
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        except (OSError, ValueError):
            continue
        rows.append(f"{pid} {status.get('State', '?').strip()} blk={status.get('SigBlk', '?').strip()} "
                    f"ign={status.get('SigIgn', '?').strip()} {cmd}")
    return "processes of the group: " + "; ".join(rows)


def _interrupt(args: list[str], marker: str, wait: float = 90.0) -> tuple[int, str, str]:
    """Start a command in its own process group (as a shell does), wait for `marker` on stdout, then
    press Ctrl-C: SIGINT to the whole group, parent and children alike."""
    # SIGINT at its default, as a terminal's job has it: a test run started in the background by a
    # script (`pytest &`) ignores SIGINT, and children inherit that -- the command would never see Ctrl-C
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = ""
    try:
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + wait
        while marker not in seen:
            assert time.monotonic() < deadline and p.poll() is None, f"never printed {marker!r}: {seen}"
            if sel.select(1.0):
                seen += p.stdout.readline()
        os.killpg(p.pid, signal.SIGINT)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 30 s after Ctrl-C; {_group_state(p.pid)}") from None
        return p.returncode, seen + out, err
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=30)


@pytest.mark.parametrize("args, marker", [
    (["-m", "zgossip.cli", "demo", "--rounds", "1000", "--numel", "100000"], "round axis"),  # mid-run
    (["-m", "zgossip.cli", "train-demo", "--epochs", "1000"], "zgossip train-demo:"),  # peers still importing
])
def test_ctrl_c_exits_quietly_with_130(args, marker):
    t0 = time.monotonic()
    rc, out, err = _interrupt(args, marker)
    assert rc == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert time.monotonic() - t0 < 60


def test_ctrl_c_before_the_command_runs_exits_quietly_with_130(monkeypatch, capsys):
    """Ctrl-C in the first half second of `zgossip peer` -- while the parser was built and the commands'
    modules (numpy, pyzmq) loaded, outside the KeyboardInterrupt handler -- ended in a traceback."""
    from zgossip import cli

    def interrupted() -> str:  # the parser's --version line imports zmq: Ctrl-C lands there
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_version", interrupted)
    assert cli.main(["peer", "--plain"]) == 130
    assert capsys.readouterr().err == "\n"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every argparse parser the two command lines build (caught at parse_args)."""
    import sim.__main__ as sim_main
    import zgossip.cli as zcli
    from sim import bench as sim_bench
    from sim import testbed_bench

    found: dict[str, argparse.ArgumentParser] = {}

    def grab(self, *a, **k):
        found[self.prog] = self
        raise SystemExit(0)

    orig = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab
    try:
        for main, argv in ((zcli.main, ["x"]), (sim_main.main, ["x"]), (sim_bench.main, []),
                           (testbed_bench.main, []), (testbed_bench.state_main, [])):
            try:
                main(argv)
            except SystemExit:
                pass
    finally:
        argparse.ArgumentParser.parse_args = orig
    return found


def _missing_help(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += _missing_help(sub, f"{prefix} {name}")
        elif not isinstance(a, argparse._HelpAction) and not a.help:
            out.append(f"{prefix} {'/'.join(a.option_strings) or a.dest}")
    return out


def test_every_command_line_option_has_help():
    parsers = _parsers()
    assert {"zgossip", "python -m sim", "python -m sim bench", "python -m sim overlap", "python -m sim state"} <= set(parsers)
    missing = [m for prog, p in parsers.items() for m in _missing_help(p, prog)]
    assert not missing, f"options without help text: {missing}"


def _unnamed_defaults(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += _unnamed_defaults(sub, f"{prefix} {name}")
        elif (a.option_strings and a.default not in (None, False, [], argparse.SUPPRESS)
              and "default" not in (a.help or "")):
            out.append(f"{prefix} {a.option_strings[-1]} (default {a.default!r})")
    return out


def test_every_option_with_a_default_says_it_in_its_help():
    """A user reads a default in --help; nine options (timeouts, latencies, the moshpit grid) had one unsaid."""
    unsaid = [m for prog, p in _parsers().items() for m in _unnamed_defaults(p, prog)]
    assert not unsaid, f"options whose help does not name their default: {unsaid}"


@pytest.mark.parametrize("text, expect", [
    (None, "cannot read scenario"),
    ("peers = 4\ngrid = [2 2]\n", "Unclosed array"),
    ("peerz = 4\n", "unknown scenario keys: ['peerz']"),
    ("peers = 4\ngrid = [2, 2]\n[network]\nlatencyy = 0.01\n", "unknown [network] setting latencyy (valid: bandwidth,"),
    ("peers = 4\ngrid = [2, 2]\n[churn]\narival_rate = 1.0\n", "unknown [churn] setting arival_rate (valid: arrival_rate,"),
    ("peers = 4\ngrid = [2, 2]\n[protocol]\ntarget_group = 3\n", "unknown [protocol] setting target_group (valid:"),
    ("peers = 4\ngrid = [2, 2]\n[[faults]]\nkind = \"crash\"\npeer = 1\natt = 1.0\n",
     "unknown field att in a 'crash' fault (valid: kind, peer, at)"),
    ("peers = 4\ngrid = [2, 2]\n[[faults]]\nkind = \"crash\"\npeer = 99\nat = 1.0\n",
     "a crash fault names peer 99, but the scenario has peers 0..3"),
    ("peers = 4\ngrid = [2, 2]\n[network]\nloss = 2.0\n", "[network] loss must be a probability in [0, 1), not 2.0"),
    ("peers = 4\ngrid = [2, 2]\n[churn]\narrival_rate = -1.0\n", "churn: arrival_rate must be a finite rate >= 0"),
    ("peers = 4\ngrid = [2, 2]\n[[faults]]\nkind = \"pause\"\npeer = 1\nstart = 2.0\nend = 1.0\n",
     "pause: end (1.0) must come after start (2.0)"),
    ("peers = 4\ngrid = [2, 2]\n[network]\njitter = -0.01\n", "[network] jitter must be a finite number of seconds >= 0"),
])
def test_scenario_errors_are_one_line(tmp_path, text, expect):
    path = tmp_path / "sc.toml"
    if text is not None:
        path.write_text(text)
    p = subprocess.run([sys.executable, "-m", "sim", "run", "--quiet", str(path)], capture_output=True, text=True,
                       env=ENV, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m sim run: error:"), p.stderr
    assert expect in lines[0], lines[0]


@pytest.mark.parametrize("args, text, expect", [
    (["run"], "peers = 4\ngrid = [2, 2]\n[network]\ntransfer = \"udp\"\n", "transfer must be 'fifo' or 'tcp'"),
    (["run"], "peers = 4\ngrid = [2, 2]\n[network]\nlatency = \"abc\"\n", "[network] latency must be"),
    (["run"], "peers = 4\ngrid = [2, 2]\n[network]\nlatency = {dist = \"regions\", region_of = {}, matrix = {}}\n",
     "[network] latency region_of places no region for sim://peer0"),
    (["sweep", "--serial", "--quiet", "--out", "OUT"], "kind = \"blah\"\n", "python -m sim sweep:"),
    (["compare"], "{truncated", "python -m sim compare:"),
])
def test_bad_values_found_after_loading_are_one_line_too(tmp_path, args, text, expect):
    """Values that pass the loader's checks and fail later (a wrong type or range deep in the
    simulator) end in one line and exit 2, not a traceback (found by a probe of every subcommand)."""
    path = tmp_path / "in.toml"
    path.write_text(text)
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    p = subprocess.run([sys.executable, "-m", "sim", *argv, str(path)], capture_output=True, text=True,
                       env=ENV, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert lines and "Traceback" not in p.stderr and expect in lines[-1], p.stderr[-2000:]


def test_compare_refuses_a_simulator_run_and_says_it_wants_a_testbed_run(tmp_path, capsys):
    """A `python -m sim run --out` file has 'scenario' and 'rounds' like a testbed run; before, compare
    replayed it against itself and printed ratios of 1.00 as if something had been measured."""
    import json

    from sim.__main__ import main
    from sim.scenario import run_scenario

    sim_run = json.loads(run_scenario({"peers": 4, "grid": [2, 2], "rounds": 2, "numel": 16}).to_json())
    path = tmp_path / "sim_run.json"
    path.write_text(json.dumps(sim_run))
    assert main(["compare", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        f"python -m sim compare: error: {path} is a simulator run (python -m sim run), not a testbed run; "
        "expected the testbed run JSON that python -m sim testbed SCENARIO --out RUN.json writes"]
    # the same rounds with the section a testbed run carries are compared
    path.write_text(json.dumps({"scenario": sim_run["scenario"], "rounds": sim_run["rounds"],
                                "peer_bytes": sim_run["peer_bytes"], "testbed": {"steps": []}}))
    assert main(["compare", str(path)]) == 0
    assert "overall: measured median step" in capsys.readouterr().out


@pytest.mark.parametrize("text, expect", [
    ('{"scenario": {"hosts": "x"}, "rounds": [1], "testbed": 3}', "'testbed' is int, not a table"),
    ('{"scenario": [], "rounds": [], "testbed": {}}', "'scenario' is list, not a table"),
    ('{"scenario": {}, "rounds": {"0": 1}, "testbed": {}}', "'rounds' is dict, not a list"),
    ('{"scenario": {}, "rounds": [{"mse": 1}], "testbed": {}}', "round entry 0 is not a round's metrics"),
    ('{"scenario": {}, "rounds": [], "testb', "is not JSON"),
    (b"\xff\xfe{", "is not JSON"),
])
def test_compare_names_the_file_and_the_problem_of_a_damaged_run(tmp_path, capsys, text, expect):
    """A run file cut short or edited by hand: one line naming the file and what is wrong with it (a
    wrong-typed section crashed the replay with an AttributeError traceback; a cut-off file said
    only "JSONDecodeError: Expecting ..." without the file)."""
    from sim.__main__ import main

    path = tmp_path / "run.json"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    assert main(["compare", str(path)]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith(f"python -m sim compare: error: {path} "), err
    assert expect in lines[0], lines[0]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_records_print_above_the_progress_bar_not_into_it():
    from sim.__main__ import _progress

    stream = _Tty()
    root = logging.getLogger()
    saved = list(root.handlers)
    try:
        bar = _progress(stream)
        bar(1, 4)
        logging.getLogger("zgossip.allreduce").warning("dropped PART from x")
        bar(2, 4)
        bar(4, 4)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
    screen = stream.getvalue()
    # what a terminal shows: each \r returns to column 0, ESC[K clears the line
    lines = [seg.split("\r")[-1].replace("\x1b[K", "") for seg in screen.split("\n")]
    warn = [ln for ln in lines if "dropped PART" in ln]
    assert warn == ["WARNING zgossip.allreduce: dropped PART from x"], lines
    assert lines[-2].startswith("[" + "#" * 30 + "] 4/4 rounds")


@pytest.mark.parametrize("args, expect", [
    (["--peers", "0"], "--peers must be at least 2"),
    (["--peers", "-3"], "--peers must be at least 2"),
    (["--numel", "0"], "--numel must be at least 1, not 0"),
    (["--numel", "-5"], "--numel must be at least 1, not -5"),
    (["--rounds", "-1"], "--rounds must be >= 0, not -1"),
    (["--grid", "4x4"], "--grid 4x4 has 16 cells but --peers is 8"),
    (["--grid", "4x"], "--grid takes sizes separated by x, such as 4x2, not '4x'"),
    (["--grid", "0x4"], "--grid sizes must be at least 1, not '0x4'"),
    (["--grid=-2x-4"], "--grid sizes must be at least 1, not '-2x-4'"),
])
def test_demo_refuses_bad_sizes_in_one_line_before_starting_anything(capsys, args, expect):
    """Before, these ended in a traceback (a peer process dying at start-up, an IndexError, int('')),
    or with --rounds -1 in a run of no rounds and exit status 0."""
    from zgossip import cli

    assert cli.main(["demo", *args]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zgossip demo: error: ") and expect in lines[0], err
    assert out == ""  # refused before any peer process started


@pytest.mark.parametrize("peers, grid", [(8, (4, 2)), (4, (2, 2)), (6, (3, 2)), (9, (3, 3)), (12, (4, 3)),
                                         (7, (7,)), (2, (2,))])
def test_demo_with_peers_alone_picks_a_grid_that_fits(peers, grid):
    """`zgossip demo --peers 4` used to stop with "--grid 4x2 has 8 cells but --peers is 4": the
    default grid fitted only the default 8 peers, so --peers could not be changed alone."""
    from zgossip import demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert demo._grid_shape(p.parse_args(["--peers", str(peers)])) == grid
    assert demo._grid_shape(p.parse_args(["--peers", "4", "--grid", "2x2"])) == (2, 2)  # a grid given is kept
    with pytest.raises(ValueError, match=r"--grid 4x1 has a dimension of size 1.*leave it out \(--grid 4\)"):
        demo._grid_shape(p.parse_args(["--peers", "4", "--grid", "4x1"]))  # every other round failed


@pytest.mark.parametrize("args, expect", [
    (["--metrics-port", "70000"], "--metrics-port must be in 0..65535 (0 = a free port), not 70000"),
    (["--metrics-port", "-1"], "--metrics-port must be in 0..65535 (0 = a free port), not -1"),
    (["--numel", "-5"], "--numel must be at least 1, not -5"),
    (["--rounds", "-1"], "--rounds must be >= 0 (0 = run until Ctrl-C), not -1"),
    (["--interval", "-1"], "--interval must be a number of seconds in [0, 1e+06], not -1.0"),
    (["--interval", "nan"], "--interval must be a number of seconds in [0, 1e+06], not nan"),
    (["--interval", "1e308"], "--interval must be a number of seconds in [0, 1e+06], not 1e+308"),  # a traceback
    # each step (its timeout is the interval), and the peer ran on
    (["--client"], "--client needs --initial-peers: a client listens nowhere, so it only ever meets the peers it "
                   "is told of"),  # it used to run, failing every step
    (["--seed", "-1"], "--seed must be a whole number >= 0, not -1"),  # numpy's ValueError, a traceback
    (["--numel", "100000000000000"], "--numel 100000000000000 is more than this host's memory holds "
                                     "(3.73e+05 GiB of float32); give a smaller --numel"),  # a MemoryError traceback
    (["--announce-host", "bad host!"], "invalid announce_host 'bad host!': expected the host name or IP address "
                                       "others reach this peer at, e.g. 10.0.0.5 or peer3.example.org"),
    (["--log-json", "/"], "cannot open --log-json file /: Is a directory"),  # a traceback, after the peer started
])
def test_peer_refuses_bad_numbers_in_one_line_before_starting(capsys, args, expect):
    """Before, a bad metrics port or --numel -5 ended in a traceback (OverflowError from bind, numpy's
    ValueError), --rounds -1 in exit 0 without a step and a negative --interval in steps back to back."""
    from zgossip import cli

    assert cli.main(["peer", "--listen", "tcp://127.0.0.1:0", "--plain", *args]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"zgossip peer: error: {expect}"], err
    assert out == ""  # refused before the peer started


def test_peer_bandwidth_option():
    import argparse as ap

    from zgossip import peer

    p = ap.ArgumentParser()
    peer.add_arguments(p)
    assert p.parse_args([]).bandwidth == "auto"
    assert p.parse_args(["--bandwidth", "250"]).bandwidth == 250.0
    for bad in ("fast", "-1", "inf"):
        with pytest.raises(SystemExit):
            p.parse_args(["--bandwidth", bad])


def test_testbed_benchmarks_check_where_each_process_goes_before_starting_any():
    from zgossip.bench_overlap import bench_overlap
    from zgossip.bench_state import bench_state_download

    with pytest.raises(ValueError, match="netns and listen go together, one per peer"):
        bench_overlap(peers=2, netns=["a", "b"])
    with pytest.raises(ValueError, match="netns and listen go together, one per peer"):
        bench_overlap(peers=2, netns=["a"], listen=["tcp://10.0.0.1:0"])
    with pytest.raises(ValueError, match=r"one per donor and one for the downloader \(3\), not 2"):
        bench_state_download(8, 2, 1, hosts=[{"netns": "a", "listen": "tcp://10.0.0.1:0"}] * 2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_peer_stops_at_once_on_ctrl_c_or_sigterm_mid_step(sig, tmp_path):
    """`zgossip peer` turns Ctrl-C, SIGTERM and SIGHUP into a stop flag; it used to notice it only once
    its blocking step() returned: a lone peer with --interval 30 (matchmaking timeout 30 s) took 27 s
    to exit, and a step in an all-reduce up to allreduce_timeout more. Now the step is dropped (or
    failed by the shutdown) and the peer exits at once, status 0, without a traceback. SIGHUP (the
    terminal or ssh session closed) killed it outright, status -1, skipping the shutdown that
    delivers what it owes its groupmates. The step it interrupts still gets its --log-json line
    (AveragerClosed): the log was closed before the shutdown that fails the step, so a peer
    stopped mid-step on the testbed left no line for it."""
    log_json = tmp_path / "steps.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "zgossip.cli", "peer", "--listen", "tcp://127.0.0.1:0", "--plain",
                          "--numel", "100", "--interval", "30", "--log-level", "WARNING", "--log-json", str(log_json)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    try:
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        seen, deadline = "", time.monotonic() + 60
        while "others can join" not in seen:
            assert time.monotonic() < deadline and p.poll() is None, f"never started: {seen}"
            if sel.select(1.0):
                seen += p.stdout.readline()
        time.sleep(1.0)  # its first step is matchmaking now (alone: until its 30 s timeout)
        t0 = time.monotonic()
        p.send_signal(sig)
        out, err = p.communicate(timeout=40)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=30)
    assert p.returncode == 0, (out, err)
    assert "Traceback" not in err, err
    assert took < 5.0, f"exited {took:.1f}s after the signal"
    recs = [json.loads(ln) for ln in log_json.read_text().splitlines()]
    assert [(r["ok"], r["error"]) for r in recs] == [(False, "AveragerClosed")], recs


def test_version_names_zgossip_and_what_it_runs_on_and_python_m_runs_the_command():
    import zmq

    import zgossip

    out = subprocess.run([sys.executable, "-m", "zgossip", "--version"], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"zgossip {zgossip.__version__} ("), line
    assert f"pyzmq {zmq.pyzmq_version()}" in line and f"libzmq {zmq.zmq_version()}" in line, line


@pytest.mark.parametrize("argv, expect", [
    (["bench", "--timeout", "0"], "argument --timeout: must be a finite number > 0, got '0'"),
    (["bench", "--timeout", "nan"], "argument --timeout: must be a finite number > 0, got 'nan'"),
    (["bench", "--part-size", "0"], "argument --part-size: must be a whole number >= 1, got '0'"),
    (["bench", "--seed", "-1"], "argument --seed: must be a whole number >= 0, got '-1'"),
    (["bench-state", "--chunk-mib", "0"], "argument --chunk-mib: must be a finite number > 0, got '0'"),
    (["bench-state", "--donor-uplink-mbps", "-1"], "argument --donor-uplink-mbps: must be a finite number >= 0, got '-1'"),
    (["bench-state", "--timeout", "-1"], "argument --timeout: must be a finite number > 0, got '-1'"),
    (["bench-train", "--batch", "0"], "argument --batch: must be a whole number >= 1, got '0'"),
    (["bench-train", "--timeout", "inf"], "argument --timeout: must be a finite number > 0, got 'inf'"),
    (["bench-train", "--accel-ms", "-5"], "argument --accel-ms: must be a finite number >= 0, got '-5'"),
    (["bench-train", "--overlap-epochs", "0"], "argument --overlap-epochs: must be a whole number >= 1, got '0'"),
])
def test_benchmarks_refuse_bad_numbers_in_one_line_before_starting(capsys, argv, expect):
    """Before, a zero or negative --timeout ended in a TimeoutError traceback from the start-up wait,
    --batch 0 in one from a dying child process, and --chunk-mib 0, a negative --donor-uplink-mbps or
    --accel-ms ran as if they meant something."""
    from zgossip import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == f"zgossip {argv[0]}: error: {expect}", err
    assert out == ""


def test_bench_train_overlap_refuses_a_single_process(capsys):
    """Before, --overlap --peers 1 ran a repetition and failed with a RuntimeError traceback."""
    from zgossip import cli

    assert cli.main(["bench-train", "--overlap", "--peers", "1"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == ["zgossip bench-train --overlap: need --peers >= 2 (processes that average together)"]
    assert out == ""


@pytest.mark.parametrize("argv, expect", [
    (["compare", "--skip", "-1", "run.json"], "python -m sim compare: error: argument --skip: must be a whole number >= 0, got '-1'"),
    (["fidelity", "--rounds", "0"], "python -m sim fidelity: error: argument --rounds: must be a whole number >= 1, got '0'"),
    (["state", "--timeout", "0"], "python -m sim state: error: argument --timeout: must be a finite number > 0, got '0'"),
    (["state", "--chunk-mib", "0"], "python -m sim state: error: argument --chunk-mib: must be a finite number > 0, got '0'"),
    (["overlap", "--peers", "1"], "python -m sim overlap: error: need --peers >= 2 (processes that average together)"),
    (["overlap", "--batch", "0"], "python -m sim overlap: error: argument --batch: must be a whole number >= 1, got '0'"),
    (["overlap", "--latency-ms", "-1"], "python -m sim overlap: error: argument --latency-ms: must be a finite number >= 0, got '-1'"),
])
def test_simulator_commands_refuse_bad_numbers_before_building_a_testbed(capsys, argv, expect):
    """Before, compare --skip -1 printed figures for 'rounds -1+', fidelity --rounds 0 measured nothing
    and reported '0 of 1 cases', and state/overlap built a testbed and then failed with a TimeoutError
    or RuntimeError (a zero timeout, one process, an empty batch)."""
    from sim.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == expect, err
    assert out == ""


@pytest.mark.parametrize("args, expect", [
    (["--target-batch-size", "0"], "argument --target-batch-size: must be a whole number >= 1, got '0'"),
    (["--batch-size", "0"], "argument --batch-size: must be a whole number >= 1, got '0'"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
    (["--step-delay", "-1"], "argument --step-delay: must be a finite number >= 0, got '-1'"),
    (["--late-at", "-5"], "argument --late-at: must be an epoch >= 0, or -1 for no late joiner, got '-5'"),
    (["--log-level", "FOO"], "argument --log-level: 'FOO' is no logging level (DEBUG, INFO, WARNING, ERROR or CRITICAL)"),
])
def test_train_demo_refuses_bad_values_in_one_line(capsys, args, expect):
    """Before, --target-batch-size 0 and --lr nan killed the peer processes and the command ended in an
    EOFError traceback, --batch-size 0 hung for minutes (no batch ever counted), and --log-level FOO
    ended in a ValueError traceback (the same for `zgossip peer` and `zgossip demo`)."""
    from zgossip import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["train-demo", *args])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == f"zgossip train-demo: error: {expect}", err
    assert out == ""


def test_train_demo_runs_with_one_peer_and_names_a_peer_process_that_died():
    """`train-demo --peers 1` asked for groups of one, below the averager's minimum of two: the peer
    process died at start-up (ValueError) and the command ended in an EOFError traceback."""
    p = subprocess.run([sys.executable, "-m", "zgossip", "train-demo", "--peers", "1", "--epochs", "1", "--late-at", "-1"],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "all peers hold identical parameters" in p.stdout and "Traceback" not in p.stderr
    # and a peer process that dies is named in one line, not met with EOFError
    import multiprocessing as mp

    from zgossip.train_demo import _Peers

    peers = _Peers()
    parent, child = peers.ctx.Pipe()
    proc = peers.ctx.Process(target=sys.exit, args=(3,))
    proc.start()
    child.close()
    peers.procs.append(proc)
    peers.conns.append(parent)
    try:
        with pytest.raises(RuntimeError, match=r"peer process 0 exited \(exit code 3\)"):
            peers.recv(0, 30)
    finally:
        proc.join(5)
        assert not proc.is_alive() and isinstance(proc, mp.process.BaseProcess)


@pytest.mark.parametrize("argv, expect", [
    (["sweep", "sim/sweeps/message_level.toml", "--workers", "0"], "python -m sim sweep: error: argument --workers: must be a whole number >= 1, got '0'"),
    (["sweep", "sim/sweeps/message_level.toml", "--bench", "0"], "python -m sim sweep: error: argument --bench: must be a whole number >= 1, got '0'"),
    (["sweep", "sim/sweeps/message_level.toml", "--bench", "-1"], "python -m sim sweep: error: argument --bench: must be a whole number >= 1, got '-1'"),
    (["bench", "--memory-peers", "0"], "python -m sim bench: error: argument --memory-peers: must be a whole number >= 1, got '0'"),
    (["table", "--workers", "0"], "python -m sim table: error: argument --workers: must be a whole number >= 1, got '0'"),
])
def test_sweep_table_and_bench_refuse_counts_below_one(capsys, argv, expect):
    """Before, sweep --bench 0 ran the whole sweep instead of a benchmark (0 read as 'not given'),
    --bench -1 ended in an IndexError, --workers 0 silently meant the default, and
    bench --memory-peers 0 printed a ZeroDivisionError and exited 0."""
    from sim.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == expect


@pytest.mark.parametrize("argv, expect", [
    (["--cap", "0"], "argument --cap: must be a whole number >= 1, got '0'"),
    (["--restarts", "0"], "argument --restarts: must be a whole number >= 1, got '0'"),
])
def test_moshpit_table_refuses_an_empty_experiment(capsys, argv, expect):
    """Before, --cap 0 ended in numpy's 'argmax of an empty sequence' traceback and --restarts 0
    printed a table of nan."""
    from sim.moshpit import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"python -m sim.moshpit: error: {expect}"
def test_a_client_peer_does_not_offer_its_client_address_to_join_through(capsys):
    """`zgossip peer --client` printed "others can join with: zgossip peer --initial-peers client://<id>",
    an address nobody can connect to (and --initial-peers refuses). It now says it is a client."""
    import signal
    import threading

    import numpy as np

    import zgossip
    from zgossip import cli

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    host = zgossip.Averager([np.zeros(8, np.float32)], prefix="zgossip-peer", listen="tcp://127.0.0.1:0")
    stepped = threading.Thread(target=lambda: host.step(timeout=20), daemon=True)
    stepped.start()
    try:
        rc = cli.main(["peer", "--client", "--initial-peers", host.endpoint, "--numel", "8", "--rounds", "1",
                       "--interval", "0", "--plain", "--log-level", "WARNING"])
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        stepped.join(20)
        host.shutdown()
    out = capsys.readouterr().out
    assert rc == 0
    assert "client://" not in out and "others can join" not in out, out
    assert "client mode (listens nowhere; others cannot join through it)" in out
    assert "step 0: group of 2" in out, out


@pytest.mark.parametrize("command", ["demo", "peer", "train-demo", "sim run"])
def test_log_level_takes_any_case_and_refuses_a_typo_in_one_line(command, capsys):
    """`--log-level debug` (lower case) or a typo ended in a traceback from logging.basicConfig (in
    demo and train-demo, in every peer process too); now 'debug' is DEBUG and a typo is a usage error."""
    import sim.__main__ as sim_main
    from zgossip import cli

    main, argv = (sim_main.main, ["run"]) if command == "sim run" else (cli.main, [command])
    with pytest.raises(SystemExit) as e:
        main([*argv, "--log-level", "LOUD", *(["x.toml"] if command == "sim run" else [])])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("argument --log-level: 'LOUD' is no logging level (DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    assert cli.log_level("debug") == "DEBUG" and cli.log_level("Warning") == "WARNING"


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_keygen_into_a_directory_says_so(tmp_path, capsys, force):
    """`zgossip keygen DIR` said "DIR exists; not overwriting a key" (and with --force, "Is a directory")."""
    from zgossip import cli

    assert cli.main(["keygen", *force, str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"zgossip keygen: error: {str(tmp_path)!r} is a directory: give the path of the key file to write, " \
                  f"e.g. {tmp_path / 'peer.key'}", err
    assert list(tmp_path.iterdir()) == []


def test_peer_run_in_process_gives_the_signal_handlers_back():
    """`zgossip peer` installs Ctrl-C/SIGTERM handlers that set its stop flag. Run in-process (cli.main
    from a test or a notebook), an early error -- a bad key file -- returned with them still installed:
    Ctrl-C in that process then set a flag nobody read (a later test expecting KeyboardInterrupt got
    none)."""
    from zgossip import cli

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert cli.main(["peer", "--key", "/nonexistent/key", "--allow", "/nonexistent/allow",
                     "--listen", "tcp://127.0.0.1:0", "--plain"]) == 2
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
