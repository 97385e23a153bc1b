"""ZGossipStrategy: Lightning's Trainer in three processes on loopback (docs/examples/lightning_collaborative.py).

Importing Lightning costs seconds of CPU, so it is done once: a spawned "zygote" process imports
the example (and with it Lightning), then forks one process per peer, which start at once. Every
wait is bounded; the zygote kills its children when it stops, and a child whose zygote died
exits by itself.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing as mp
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

# the zygote imports Lightning; this process only checks that it is there (importing it costs seconds)
if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("needs lightning or pytorch_lightning (pip install 'zgossip[lightning]')", allow_module_level=True)

from zgossip.swarm import stop_children  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "lightning_collaborative.py"
EPOCHS = 6


def _peer(example: Any, argv: list[str], log_path: str) -> None:
    """A forked peer: the example's main; its zgossip log goes to `log_path` (printed if the test fails)."""
    zygote = os.getppid()

    def orphaned() -> None:  # the zygote was killed: do not outlive it
        while os.getppid() == zygote:
            time.sleep(0.2)
        os._exit(3)

    threading.Thread(target=orphaned, daemon=True).start()
    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(relativeCreated)7.0f %(name)s %(levelname)s %(message)s")
    logging.getLogger("zgossip.collaborative").setLevel(logging.DEBUG)  # one line per global step
    try:
        code = example.main(argv)
    except BaseException:
        logging.getLogger("test").error("main raised:\n%s", traceback.format_exc())
        code = 1
    logging.shutdown()
    os._exit(code)


def _zygote(conn: Any) -> None:
    spec = importlib.util.spec_from_file_location("lightning_collaborative", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # imports Lightning: seconds, once
    fork = mp.get_context("fork")
    procs: dict[str, Any] = {}
    conn.send("ready")
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg == "stop":
                return
            op, name, arg = msg
            if op == "start":
                argv, log_path = arg
                procs[name] = fork.Process(target=_peer, args=(example, argv, log_path))
                procs[name].start()
            else:  # ("join", name, timeout): its exit code, None if still running
                procs[name].join(arg)
                conn.send(procs[name].exitcode)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wait_for(path: Path, cond: Any, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got = _read(path)
        if got is not None and cond(got):
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what} (last: {got})"
        time.sleep(0.02)


def test_trainer_with_zgossip_strategy_three_processes_and_a_late_joiner(tmp_path):
    """Peers A and B train together to global step 2; B leaves, and peer C joins A, which held training
    meanwhile (fewer than 2 peers): C downloads A's state, and both train on to global step EPOCHS.
    Checks: rounds average both peers' samples, a global step takes about target_batch_size samples,
    in-sync peers hold identical parameters at every global step, and C starts from the swarm's step."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    zygote = ctx.Process(target=_zygote, args=(child,))  # not a daemon: it forks the peers
    outs = {k: tmp_path / f"{k}.json" for k in ("a", "b", "c")}
    logs = {k: tmp_path / f"{k}.log" for k in outs}

    def start(name: str, argv: list[str]) -> None:
        parent.send(("start", name, (argv + ["--out", str(outs[name])], str(logs[name]))))

    def join(name: str, timeout: float) -> int | None:
        parent.send(("join", name, timeout))
        assert parent.poll(timeout + 10), "the zygote did not answer"
        return parent.recv()

    try:
        zygote.start()
        child.close()
        assert parent.poll(120), "the zygote did not import Lightning within 120 s"
        assert parent.recv() == "ready"
        common = ["--target-batch-size", "64", "--batch-size", "16", "--fast", "--listen", "tcp://127.0.0.1:0",
                  "--matchmaking-time", "0.5", "--target-group-size", "2", "--min-peers", "2"]
        start("a", common + ["--epochs", str(EPOCHS), "--seed", "0"])
        first = _wait_for(outs["a"], lambda d: d.get("endpoint"), 30, "peer A's address")["endpoint"]
        start("b", common + ["--epochs", "2", "--seed", "1", "--initial-peers", first])
        assert join("b", 40) == 0, "peer B did not finish"
        start("c", common + ["--epochs", str(EPOCHS), "--seed", "2", "--initial-peers", first])
        assert join("a", 40) == 0, "peer A did not finish"
        assert join("c", 20) == 0, "peer C did not finish"
        res = {k: _read(o) for k, o in outs.items()}
    except BaseException:
        for k, p in logs.items():  # the peers' own account of what went wrong
            print(f"---- peer {k}'s log\n" + (p.read_text() if p.exists() else "(none)"))
        raise
    finally:
        stop_children([parent], [zygote], "stop", 10.0)
    a, b, c = res["a"], res["b"], res["c"]
    assert a["epoch"] >= EPOCHS and c["epoch"] >= EPOCHS and b["epoch"] >= 2
    assert a["in_sync"] and c["in_sync"]
    # the global batch: rounds average the samples of both peers, and a global step took about
    # target_batch_size samples (the round starts when the gossiped, extrapolated count reaches it)
    for r in (a["last_round"], c["last_round"]):
        assert r["ok"] and r["group_size"] == 2 and r["samples"] >= 32, r
    per_step = 16 * (a["local_batches"] + b["local_batches"] + c["local_batches"]) / a["epoch"]
    assert 48 <= per_step <= 96, per_step
    digests = {k: {int(e): d for e, d in r["digests"].items()} for k, r in res.items()}
    # the late joiner downloaded the state: its first global step is the swarm's, not 0
    assert min(digests["c"]) >= 2, sorted(digests["c"])
    # in sync: at every global step two peers both saw, they held identical parameters
    for x, y, at_least in (("a", "b", 2), ("a", "c", 3)):
        both = set(digests[x]) & set(digests[y])
        assert len(both) >= at_least, (x, y, sorted(both))
        assert all(digests[x][e] == digests[y][e] for e in both), (x, y, digests[x], digests[y])
