"""Every notebook in notebooks/ runs headless, top to bottom, without a cell error — so notebooks never rot.

Needs nbclient, nbformat, ipykernel and matplotlib (the notebooks plot): they belong in the `dev`
extra; until they are there, this test skips with the name of what is missing.
"""
from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_without_errors(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("MPLBACKEND", "Agg")  # no display; %matplotlib inline still renders into the notebook
    monkeypatch.setenv("ZGOSSIP_NOTEBOOK_QUICK", "1")  # notebooks that simulate training run a smaller sweep
    committed = _figures(nbformat.read(path, as_version=4))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, naming the cell and the traceback, on any error
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
