"""Every notebook in notebooks/ runs headless, top to bottom, without a cell error — so notebooks never rot.

Needs nbclient, nbformat, ipykernel and matplotlib (the notebooks plot): they belong in the `dev`
extra; until they are there, this test skips with the name of what is missing.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))

# The notebooks run side by side, each in its own kernel process: much of a notebook's time is
# not its own CPU (a kernel's start-up, imports), so the four take ~19 s together on 2 cores
# instead of ~49 s one after the other. The first test to ask starts them all.
_runs: dict[str, Future] = {}
_lock = threading.Lock()


def _execute(path: Path):
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, naming the cell and the traceback, on any error
    return nb


def _started() -> dict[str, Future]:
    with _lock:
        if not _runs:
            # the kernels inherit these (set before any starts; the suite's other tests set neither)
            os.environ["MPLBACKEND"] = "Agg"  # no display; %matplotlib inline still renders into the notebook
            os.environ["ZGOSSIP_NOTEBOOK_QUICK"] = "1"  # notebooks that simulate training run a smaller sweep
            pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="notebook")
            # longest first (churn_training, uneven_links), so the pairs finish close together
            order = sorted(NOTEBOOKS, key=lambda p: (p.name not in ("churn_training.ipynb", "uneven_links.ipynb"), p.name))
            for path in order:
                _runs[path.name] = pool.submit(_execute, path)
            pool.shutdown(wait=False)
    return _runs


@pytest.fixture(scope="module", autouse=True)
def _restore_env():
    saved = {k: os.environ.get(k) for k in ("MPLBACKEND", "ZGOSSIP_NOTEBOOK_QUICK")}
    yield
    for fut in _runs.values():
        fut.exception(900)  # (each test waited for its own; a test that failed early may have left some)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_without_errors(path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    committed = _figures(nbformat.read(path, as_version=4))
    nb = _started()[path.name].result(900)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    # the committed notebook shows its plots, and running it still draws every one of them
    assert committed > 0, f"{path.name} is committed without its figures: run it and commit it with outputs"
    assert _figures(nb) == committed, f"{path.name} drew {_figures(nb)} figures, its committed outputs show {committed}"


def _figures(nb) -> int:
    return sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {}))


def test_there_is_a_notebook():
    assert any(p.name == "moshpit_convergence.ipynb" for p in NOTEBOOKS)
    assert any(p.name == "churn_training.ipynb" for p in NOTEBOOKS)
