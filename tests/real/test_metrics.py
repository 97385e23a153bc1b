"""Monitoring: the step log, the Prometheus endpoint (checked with prometheus_client's parser),
the JSON-lines log and the live table / plain lines of ``zgossip peer``."""
from __future__ import annotations

import io
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import zgossip
from zgossip import live
from zgossip.metrics import JsonLinesLog, MetricsServer
from zgossip.steplog import StepLog, StepRecord

from harness import FAST

ROOT = Path(__file__).resolve().parents[2]


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _pair(**extra):
    kw = dict(FAST, prefix="metrics", target_group_size=2)
    a = zgossip.Averager([np.ones(1000, np.float32)], **kw, **extra)
    b = zgossip.Averager([np.zeros(1000, np.float32)], initial_peers=[a.endpoint], **kw)
    deadline = time.monotonic() + 10
    while not a.peers() or not b.peers():
        assert time.monotonic() < deadline, "membership did not converge"
        time.sleep(0.01)
    return a, b


def test_prometheus_endpoint_reports_the_steps():
    a, b = _pair(metrics_port=0)
    try:
        assert a.metrics_endpoint.startswith("http://127.0.0.1:") and b.metrics_endpoint is None
        for _ in range(2):
            futs = [x.step(wait=False, timeout=5) for x in (a, b)]
            res = [f.result(30) for f in futs]
        with pytest.raises(zgossip.GroupNotFound):  # b does not step: a fails, and that is counted too
            a.step(timeout=0.6)
        with urllib.request.urlopen(a.metrics_endpoint, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = r.read().decode()
        s = _samples(text)  # parses: the exposition format is valid
        assert s[("zgossip_steps_total", (("outcome", "ok"),))] == 2
        assert s[("zgossip_steps_total", (("outcome", "GroupNotFound"),))] == 1
        assert s[("zgossip_step_duration_seconds_count", ())] == 2
        assert s[("zgossip_step_duration_seconds_bucket", (("le", "+Inf"),))] == 2
        tot = a.step_log.totals()
        assert s[("zgossip_step_sent_bytes_total", ())] == tot["bytes_sent"] > 0
        assert tot["bytes_sent"] == sum(r.bytes_sent for r in a.step_log.recent() if r.ok)
        assert s[("zgossip_live_peers", ())] == 1
        assert s[("zgossip_last_step_group_size", ())] == len(res[0].members) == 2
        assert s[("zgossip_info", (("endpoint", a.endpoint), ("peer_id", a.peer_id), ("prefix", "metrics")))] == 1
        assert 0 < s[("zgossip_received_total", ())] <= a.stats["received"]
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(a.metrics_endpoint.replace("/metrics", "/other"), timeout=10)
        url = a.metrics_endpoint
    finally:
        a.shutdown()
        b.shutdown()
    with pytest.raises(OSError):  # the endpoint stops with the averager
        urllib.request.urlopen(url, timeout=2)


def test_metrics_endpoint_drops_silent_connections_and_serves_a_bounded_number_at_once():
    """Each connection to the endpoint holds a thread and a descriptor of the averager's process.
    They used to be held as long as the client kept the connection silent: ~1,000 idle ones (a
    port scanner, a stuck client, anyone on metrics_host) left a 1,024-descriptor process unable
    to open a socket (a new Averager there: ZMQError "Too many open files"). Now a silent one is
    closed after idle_timeout, and over max_connections they are closed at once, counted."""
    a = zgossip.Averager([np.ones(10, np.float32)], **dict(FAST, prefix="idle"))
    srv = MetricsServer(a, idle_timeout=0.5, max_connections=4)
    socks: list[socket.socket] = []
    try:
        base = threading.active_count()
        socks = [socket.create_connection((srv.host, srv.port), timeout=5) for _ in range(12)]
        time.sleep(0.2)
        assert threading.active_count() - base <= 4
        t0 = time.monotonic()
        for s in socks:
            assert s.recv(1) == b""  # closed by the endpoint: over the limit at once, else after 0.5 s
        assert time.monotonic() - t0 < 3
        with urllib.request.urlopen(srv.url, timeout=10) as r:  # and scrapes are served again
            refused = _samples(r.read().decode())[("zgossip_metrics_refused_connections_total", ())]
        assert 1 <= refused <= 8 and refused == srv._server.refused
    finally:
        for s in socks:
            s.close()
        srv.close()
        a.shutdown()


def test_step_log_records_failures_and_listeners_see_every_step():
    lock = threading.RLock()
    log = StepLog(lock, keep=3)
    seen = []
    log.subscribe(seen.append)
    log.subscribe(lambda rec: 1 / 0)  # a broken listener does not break recording
    log.record_failure("s1", zgossip.RoundTimeout("slow"), 1.0)
    for i in range(4):
        res = zgossip.StepResult(group_id="g", key="k", members=("a", "b"), gathered={}, weights={}, contributors=("a",),
                                 lost=("b",), complete=False, spans=(), updated=[], bytes_sent=10, bytes_received=5,
                                 timings={"matchmaking": 0.1, "allreduce": 0.2, "total": 0.3 + i * 10}, coords=())
        log.record_result(f"s{i + 2}", res, 2.0 + i)
    assert [r.index for r in seen] == [0, 1, 2, 3, 4] and not seen[0].ok and seen[0].error == "RoundTimeout"
    assert [r.index for r in log.recent()] == [2, 3, 4]
    t = log.totals()
    assert t["outcomes"] == {"RoundTimeout": 1, "ok": 4} and t["bytes_sent"] == 40 and t["peers_lost"] == 4
    assert sum(t["duration_counts"]) == 4 and t["duration_counts"][-1] == 0  # 30.3 s fits the 60 s bucket
    assert json.loads(json.dumps(seen[1].as_dict()))["group_size"] == 2


def test_metrics_endpoint_stays_quiet_about_clients_that_reset_their_connection(capfd):
    """Each scraper that timed out, port scanner or health check that reset its connection made the
    endpoint print a multi-line ConnectionResetError traceback to the peer's stderr (through its
    live table, into its logs)."""
    with zgossip.Averager([np.zeros(4, np.float32)], prefix="rst", listen="tcp://127.0.0.1:0", metrics_port=0,
                          **FAST) as a:
        url = urllib.parse.urlsplit(a.metrics_endpoint)
        for junk in (b"", b"GET /metrics HTTP/1.0\r\n\r\n", b"\x00\xff garbage\r\n\r\n"):
            s = socket.create_connection((url.hostname, url.port), timeout=5)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends a RST
            s.sendall(junk)
            s.close()
        with urllib.request.urlopen(a.metrics_endpoint, timeout=5) as r:  # still serving
            assert r.status == 200
        deadline = time.monotonic() + 5  # the reset connections' threads are done (and would have printed)
        while any("process_request" in t.name for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.01)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err


def test_metrics_endpoint_binds_an_ipv6_host():
    """`metrics_host="::1"` failed with "Address family for hostname not supported": the server always
    made an IPv4 socket, though it writes IPv6 hosts in brackets in its URL."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    with zgossip.Averager([np.zeros(4, np.float32)], prefix="v6", listen="tcp://127.0.0.1:0", metrics_port=0,
                          metrics_host="::1", **FAST) as a:
        assert a.metrics_endpoint.startswith("http://[::1]:")
        with urllib.request.urlopen(a.metrics_endpoint, timeout=5) as r:
            assert r.status == 200 and b"zgossip_steps_total" in r.read()


def test_a_metrics_port_in_use_is_named_as_the_metrics_port(capsys):
    """`zgossip peer --metrics-port P` with P taken said only "[Errno 98] Address already in use", which
    reads as the --listen address."""
    from zgossip import cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["peer", "--listen", "tcp://127.0.0.1:0", "--plain", "--metrics-port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        f"zgossip peer: error: [Errno 98] cannot serve metrics at 127.0.0.1:{port}: Address already in use (pick "
        "another metrics port, or 0 for a free one, and a metrics host this machine has)"], err


def test_json_lines_log_says_once_that_it_cannot_write_and_again_when_it_can(caplog):
    """Every write error (disk full, a read-only file system) was swallowed by the step log, so a peer
    ran for days logging nothing and saying nothing."""

    class Disk(io.StringIO):
        full = True

        def flush(self) -> None:
            if self.full:
                raise OSError(28, "No space left on device")

    disk = Disk()
    log = StepLog(threading.RLock())
    jl = JsonLinesLog(disk)
    log.subscribe(jl)
    with caplog.at_level(logging.WARNING, logger="zgossip.metrics"):
        for i in range(3):
            log.record_failure(f"s{i}", zgossip.RoundTimeout("slow"), 1.0)
        assert jl.failed == 3
        assert [r.levelname for r in caplog.records] == ["ERROR"]
        assert "cannot write step 0 (No space left on device)" in caplog.records[0].getMessage()
        disk.full = False
        log.record_failure("s3", zgossip.RoundTimeout("slow"), 1.0)
    assert [r.levelname for r in caplog.records] == ["ERROR", "WARNING"]
    assert "written again, after 3 step(s) whose line could not be written" in caplog.records[1].getMessage()
    assert json.loads(disk.getvalue().splitlines()[-1])["index"] == 3


def _peer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "zgossip.cli", "peer", "--listen", "tcp://127.0.0.1:0", "--numel", "1000",
            "--interval", "0.3", "--log-level", "WARNING", *args]


def test_peer_command_writes_a_json_line_per_step_and_says_what_live_peers_counts(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log_a = tmp_path / "a.jsonl"
    a = subprocess.Popen(_peer_cmd("--rounds", "40", "--log-json", str(log_a)), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    procs = [a]
    try:
        first = a.stdout.readline() + a.stdout.readline()
        ep = first.split("--initial-peers ")[1].split()[0]
        for _ in range(2):
            procs.append(subprocess.Popen(_peer_cmd("--rounds", "4", "--initial-peers", ep), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env))
        outs = [p.communicate(timeout=60)[0] for p in procs[1:]]
        assert all(p.returncode == 0 for p in procs[1:])
        lines = [ln for ln in outs[0].splitlines() if ln.startswith("step ")]
        assert len(lines) == 4
        full = [ln for ln in lines if "group of 3" in ln]
        assert full, outs[0]
        # in a group of 3 a peer knows 2 *other* live peers: the line says so instead of "live peers 2"
        assert all("knows 2 other live peers (3 with this one)" in ln for ln in full)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.communicate(timeout=30)
    recs = [json.loads(ln) for ln in log_a.read_text().splitlines()]
    assert recs, "no JSON lines"
    keys = {"group", "members", "contributors", "lost", "bytes_sent", "bytes_received", "timings", "ok", "wall", "peer"}
    assert all(keys <= set(r) for r in recs)
    ok = [r for r in recs if r["ok"]]
    assert ok and all(r["group_size"] == len(r["members"]) and r["bytes_sent"] > 0 for r in ok)
    assert [r["index"] for r in recs] == list(range(len(recs)))


def test_live_table_shows_peers_steps_and_throughput():
    from rich.console import Console

    console = Console(record=True, width=140, force_terminal=False)
    table = live.LiveTable("zgossip peer abc", ["metrics: http://x"], console=console)
    ok = StepRecord(0, "s", 1.0, members=("a", "b", "c"), contributors=("a", "b", "c"), bytes_sent=2_000_000,
                    bytes_received=2_000_000, timings={"total": 0.5})
    bad = StepRecord(1, "t", 2.0, error="GroupNotFound", message="no group for key 'k'")
    table.step(ok, 2, 0.25)
    table.step(bad, 2, 0.25)
    console.print(table.render())
    text = console.export_text()
    assert "knows 2 other live peers (3 with this one)" in text
    assert "1 averaged, 1 failed" in text and "8.0 MB/s" in text
    assert "GroupNotFound" in text and "no group for key 'k'" in text


def test_plain_lines_when_not_a_terminal_or_without_rich(monkeypatch):
    out = io.StringIO()  # not a terminal
    assert isinstance(live.make_display("t", [], stream=out), live.PlainLines)
    monkeypatch.setattr(live, "rich_available", lambda: False)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(live.make_display("t", [], stream=Tty()), live.PlainLines)
    monkeypatch.undo()
    assert isinstance(live.make_display("t", [], stream=Tty()), live.LiveTable)
    assert isinstance(live.make_display("t", [], stream=Tty(), plain=True), live.PlainLines)
    d = live.PlainLines(out)
    d.step(StepRecord(3, "s", 1.0, members=("a", "b"), contributors=("a", "b"), timings={"total": 0.1}), 1)
    assert out.getvalue().startswith("step 3: group of 2") and "knows 1 other live peer (2 with this one)" in out.getvalue()
