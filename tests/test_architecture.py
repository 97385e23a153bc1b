"""House rule: protocol modules never touch sockets, threads, clocks or the global RNG."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "zgossip"
PROTOCOL_MODULES = ["wire", "membership", "matchmaking", "grid", "partition", "allreduce", "node", "tensors", "errors", "rendezvous", "state"]
FORBIDDEN = {"zmq", "simpy", "threading", "socket", "time", "random", "asyncio", "multiprocessing", "select", "selectors"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", PROTOCOL_MODULES)
def test_protocol_module_imports_no_io(module):
    bad = _imports(PKG / f"{module}.py") & FORBIDDEN
    assert not bad, f"zgossip/{module}.py imports {sorted(bad)}: protocol code must stay sans-IO"


def test_checker_sees_forbidden_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import time\nfrom zmq import Socket\nimport numpy as np\n")
    assert _imports(f) & FORBIDDEN == {"time", "zmq"}


def test_no_pickle_anywhere():
    for path in PKG.glob("*.py"):
        assert "pickle" not in _imports(path), f"{path.name} imports pickle"
