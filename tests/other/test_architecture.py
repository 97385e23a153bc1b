"""House rules, checked on the source.

* Protocol modules and the seam never touch sockets, threads, clocks or the global RNG.
* The user layer (`Averager`) and the training layer take their time and waits from a
  `zgossip.clock.Clock` only; only drivers (transports) and clocks may import what waits.
* Nothing pickles.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "zgossip"
PROTOCOL_MODULES = ["wire", "messages", "membership", "matchmaking", "grid", "partition", "allreduce", "numeric", "node",
                    "codecs",
                    "tensors", "errors", "rendezvous", "state", "repair", "layouts", "announce", "autogrid",
                    "linkstats",
                    "ratelimit", "droplog"]
SEAM_MODULES = ["actions", "transport", "view"]  # the interfaces between protocol, transports and users
USER_MODULES = ["averager", "training_state", "progress", "steplog", "step_control", "staging"]  # above the seam: time and waits from the Clock
# the training layer: also above the seam, on the averager's clock (so `python -m sim train` runs it)
TRAINING_MODULES = ["optim", "collaborative", "accumulator", "trainer", "overlap", "lightning", "checkpoint", "diloco"]
# Training classes that still wait on the wall clock or on threads of their own. Phase 2 of the seam
# moved them all onto the averager's clock; the list may only shrink (see test_training_layer_ratchet).
TRAINING_NOT_YET_ON_THE_CLOCK: list[str] = []
# Drivers and clocks: the only modules that may wait, read the time, or open sockets.
DRIVERS_AND_CLOCKS = ["clock", "zmq_driver", "connections", "zerocopy", "local_ipc", "fast_send", "process_tuning",
                      "endpoints", "curve", "zap", "identity", "local_auth",
                      "cuts"]  # (cuts: the ZeroMQ driver's bookkeeping of closed connections; itself sans-IO)
# Monitoring: the Prometheus endpoint serves from a thread of its own and the live table reads the wall
# clock; neither is protocol code, and the Averager loads them only when asked for (metrics_port=).
OPS_MODULES = ["metrics", "live"]
FORBIDDEN = {"zmq", "simpy", "threading", "socket", "time", "random", "asyncio", "multiprocessing", "select", "selectors"}
# the user layer may hold concurrent.futures.Future values (plain data with callbacks), never run threads
USER_FORBIDDEN = FORBIDDEN


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _global_random(path: Path) -> list[str]:
    """Calls of numpy's global RNG (np.random.rand(...), np.random.seed(...)); a seeded
    Generator passed in (np.random.default_rng(seed)) is the allowed way."""
    allowed = {"default_rng", "Generator", "SeedSequence", "PCG64", "BitGenerator"}
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "random" \
                and isinstance(node.value.value, ast.Name) and node.value.value.id in ("np", "numpy") \
                and node.attr not in allowed:
            bad.append(f"np.random.{node.attr}")
    return bad


def _thread_pools(path: Path) -> list[str]:
    """Thread pools started directly (concurrent.futures.ThreadPoolExecutor) instead of `Clock.executor`."""
    return [n.attr for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and n.attr in ("ThreadPoolExecutor", "ProcessPoolExecutor")]


@pytest.mark.parametrize("module", PROTOCOL_MODULES + SEAM_MODULES)
def test_protocol_module_imports_no_io(module):
    bad = _imports(PKG / f"{module}.py") & FORBIDDEN
    assert not bad, f"zgossip/{module}.py imports {sorted(bad)}: protocol code must stay sans-IO"


@pytest.mark.parametrize("module", [m for m in PROTOCOL_MODULES if m != "wire"])
def test_only_wire_knows_bytes(module):
    """Messages are typed values everywhere but in `wire`, which alone packs and parses headers."""
    assert "msgpack" not in _imports(PKG / f"{module}.py"), f"zgossip/{module}.py imports msgpack: only wire knows bytes"


@pytest.mark.parametrize("module", PROTOCOL_MODULES + SEAM_MODULES + USER_MODULES + TRAINING_MODULES)
def test_no_global_random_and_no_own_threads(module):
    path = PKG / f"{module}.py"
    assert not _global_random(path), f"zgossip/{module}.py draws from the global RNG: {_global_random(path)}"
    assert not _thread_pools(path), f"zgossip/{module}.py starts threads itself: use Clock.executor"


@pytest.mark.parametrize("module", USER_MODULES + TRAINING_MODULES)
def test_user_layer_waits_only_through_the_clock(module):
    bad = _imports(PKG / f"{module}.py") & USER_FORBIDDEN
    assert not bad, (f"zgossip/{module}.py imports {sorted(bad)}: code above the seam takes its time and waits "
                     "from its transport's Clock (zgossip.clock), so it runs in virtual time in the simulator")


def test_training_layer_ratchet():
    """Every module is classified, and the training modules still off the clock are exactly the listed ones."""
    classified = set(PROTOCOL_MODULES + SEAM_MODULES + USER_MODULES + TRAINING_MODULES + DRIVERS_AND_CLOCKS
                     + OPS_MODULES)
    tools = {"__init__", "bench", "bench_state", "bench_train", "cli", "demo", "peer", "swarm", "train_demo", "kernels",
             "machine", "bench_overlap", "netns", "cliargs", "__main__"}  # CLIs, demos, what a benchmark ran on (and where)
    present = {p.stem for p in PKG.glob("*.py")}
    assert present - classified - tools == set(), "classify new modules in tests/other/test_architecture.py"
    assert not TRAINING_NOT_YET_ON_THE_CLOCK, "the ratchet is empty: every training module is on the clock"
    assert set(TRAINING_MODULES) <= classified


def test_checker_sees_forbidden_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import time\nfrom zmq import Socket\nimport numpy as np\nx = np.random.rand(3)\n"
                 "import concurrent.futures as cf\np = cf.ThreadPoolExecutor(1)\n")
    assert _imports(f) & FORBIDDEN == {"time", "zmq"}
    assert _global_random(f) == ["np.random.rand"]
    assert _thread_pools(f) == ["ThreadPoolExecutor"]


def test_no_pickle_anywhere():
    for path in PKG.glob("*.py"):
        assert "pickle" not in _imports(path), f"{path.name} imports pickle"
