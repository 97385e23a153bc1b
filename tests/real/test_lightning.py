"""ZGossipStrategy: Lightning's Trainer in two processes on loopback (docs/examples/lightning_collaborative.py).

Every process is a spawned child that imports Lightning and the example first (the slow part,
done in parallel), then runs the example's ``main`` each time it is told; every wait is bounded
and every child is stopped in ``finally``.
"""
from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest

# the children import Lightning; this process only checks that it is there (importing it costs seconds)
if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("needs lightning or pytorch_lightning (pip install 'zgossip[lightning]')", allow_module_level=True)

from zgossip.swarm import stop_children  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "lightning_collaborative.py"
EPOCHS = 8


def _child(conn: Any) -> None:
    spec = importlib.util.spec_from_file_location("lightning_collaborative", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # imports Lightning: seconds
    conn.send("ready")
    while True:
        try:
            argv = conn.recv()
        except EOFError:
            return
        if argv == "stop":
            return
        try:
            conn.send(("exit", example.main(argv)))
        except BaseException as e:  # reported to the test
            conn.send(("error", f"{type(e).__name__}: {e}"))


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
        time.sleep(0.05)


def test_trainer_with_zgossip_strategy_two_processes_and_a_late_joiner(tmp_path):
    """Peers A and B train together to global step 3; B leaves, and a new peer (a fresh Trainer, model and
    strategy in B's process, so that Lightning is imported only twice) joins A, which held training meanwhile:
    it downloads A's state and both train on to global step 8."""
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    outs = {k: tmp_path / f"{k}.json" for k in ("a", "b", "late")}
    try:
        for _ in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child, args=(child,), daemon=True)
            p.start()
            child.close()
            conns.append(parent)
            procs.append(p)
        for c in conns:
            assert c.poll(90), "a child did not import Lightning within 90 s"
            assert c.recv() == "ready"
        common = ["--target-batch-size", "64", "--batch-size", "16", "--fast", "--listen", "tcp://127.0.0.1:0",
                  "--matchmaking-time", "0.5", "--target-group-size", "2", "--min-peers", "2"]
        conns[0].send(common + ["--epochs", str(EPOCHS), "--seed", "0", "--out", str(outs["a"])])
        first = _wait_for(outs["a"], lambda d: d.get("endpoint"), 30, "peer A's address")["endpoint"]
        conns[1].send(common + ["--epochs", "3", "--seed", "1", "--initial-peers", first, "--out", str(outs["b"])])
        assert conns[1].poll(60), "peer B did not finish"
        assert conns[1].recv() == ("exit", 0)
        conns[1].send(common + ["--epochs", str(EPOCHS), "--seed", "2", "--initial-peers", first,
                                "--out", str(outs["late"])])
        for name, c in (("A", conns[0]), ("the late peer", conns[1])):
            assert c.poll(60), f"{name} did not finish"
            assert c.recv() == ("exit", 0)
        res = {k: _read(o) for k, o in outs.items()}
    finally:
        stop_children(conns, procs, "stop", 10.0)
    a, b, late = res["a"], res["b"], res["late"]
    assert a["epoch"] >= EPOCHS and late["epoch"] >= EPOCHS and b["epoch"] >= 3
    assert a["in_sync"] and late["in_sync"]
    # the global batch: rounds average the samples of both peers, and a global step took about
    # target_batch_size samples (the round starts when the gossiped, extrapolated count reaches it)
    for r in (a["last_round"], late["last_round"]):
        assert r["ok"] and r["group_size"] == 2 and r["samples"] >= 32, r
    per_step = 16 * (a["local_batches"] + b["local_batches"] + late["local_batches"]) / a["epoch"]
    assert 48 <= per_step <= 96, per_step
    digests = {k: {int(e): d for e, d in r["digests"].items()} for k, r in res.items()}
    # the late joiner downloaded the state: its first global step is the swarm's, not 0
    assert min(digests["late"]) >= 3, sorted(digests["late"])
    # in sync: at every global step two peers both saw, they held identical parameters
    for x, y, at_least in (("a", "b", 3), ("a", "late", 3)):
        both = set(digests[x]) & set(digests[y])
        assert len(both) >= at_least, (x, y, sorted(both))
        assert all(digests[x][e] == digests[y][e] for e in both), (x, y, digests[x], digests[y])
