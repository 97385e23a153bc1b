"""The standard figures of a sweep, drawn from its results folder (``python -m sim plot RESULTS``).

* ``metric_vs_rounds.png`` — the metric (default MSE; ``loss`` for a train sweep) against rounds: one panel per
  combination of the other axes, one line per value of the ``lines`` axis (the sweep's
  ``[plot] lines``, else its last axis); the line is the median over seeds, the band
  the range over seeds.
* ``rounds_to_eps.png`` — a heatmap over two axes (``[plot] heatmap``, else the first
  two axes with more than one value) of the mean rounds to reach ``metric <= eps``,
  one panel per combination of the other axes; ``*`` marks cells where some seeds
  never got there (they count as their last round).
* ``bytes_vs_accuracy.png`` — message-level sweeps only: cumulative bytes sent per
  stepping peer against the metric, per point (median over seeds), one marker per round.

A figure holds at most 16 panels (``bytes_vs_accuracy``: 20 points), the first in sweep order; one
that leaves some out says so in its title. Everything here reads ``results.csv`` and ``sweep.json``;
nothing reruns a simulation.
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .sweep import canonical, read_table, rounds_to_eps

__all__ = ["plot_results", "metric_vs_rounds", "rounds_to_eps_heatmap", "bytes_vs_accuracy", "cmd_plot"]

_MAX_PANELS = 16
# the metric drawn when neither the caller nor the sweep's [plot] names one: a train sweep has no MSE
_DEFAULT_METRIC = {"train": "loss"}


def _label(v: Any) -> str:
    return canonical(v) if isinstance(v, (dict, list)) else str(v)


def _varying(desc: dict) -> list[str]:
    return [a for a, vals in desc["axes"].items() if len(vals) > 1]


def _panels(n: int):
    import matplotlib.pyplot as plt

    cols = min(n, 4) if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False, sharex=True, sharey=True)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _note_cut(fig, drawn: int, total: int, what: str) -> None:
    """Say on the figure that it shows only the first `drawn` of `total` panels or points (a sweep with
    more lost the rest from its figures without a word)."""
    if drawn < total:
        fig.suptitle(f"the first {drawn} of {total} {what} (python -m sim plot draws at most {drawn}; "
                     f"pick the axes with [plot] lines / heatmap)", fontsize=9)


def _combos(desc: dict, names: Sequence[str]) -> list[dict]:
    return [dict(zip(names, c)) for c in itertools.product(*(desc["axes"][a] for a in names))]


def _match(row: dict, fixed: dict) -> bool:
    return all(canonical(row[a]) == canonical(v) for a, v in fixed.items())


def _by_point(desc: dict, rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by point (canonical JSON of its axis values): one pass, then lookups."""
    axes = list(desc["axes"])
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(canonical([r[a] for a in axes]), []).append(r)
    return out


def _point_rows(desc: dict, groups: dict[str, list[dict]], point: dict) -> list[dict]:
    return groups.get(canonical([point[a] for a in desc["axes"]]), [])


def _curves(rows: list[dict], metric: str, x: str = "round") -> tuple[np.ndarray, np.ndarray]:
    """(x values, array seeds × x) of one point's rows; missing cells are NaN."""
    xs = sorted({r[x] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    grid = np.full((len(seeds), len(xs)), np.nan)
    si, xi = {s: i for i, s in enumerate(seeds)}, {v: i for i, v in enumerate(xs)}
    for r in rows:
        if r[metric] is not None:
            grid[si[r["seed"]], xi[r[x]]] = r[metric]
    return np.asarray(xs, dtype=float), grid


def _floor(metric: str, y: np.ndarray) -> np.ndarray:
    # an exact mean gives an MSE of 0: keep it on the log scale just below float64 rounding
    return np.maximum(y, 1e-33) if metric in ("mse", "max_abs", "spread") else y


def metric_vs_rounds(desc: dict, rows: list[dict], metric: str = "mse", lines: str | None = None):
    axes = list(desc["axes"])
    lines = lines or desc.get("plot", {}).get("lines") or (axes[-1] if axes else None)
    others = [a for a in axes if a != lines]
    combos = _combos(desc, others)
    panels = combos[:_MAX_PANELS]
    fig, axs = _panels(len(panels))
    _note_cut(fig, len(panels), len(combos), "panels")
    groups = _by_point(desc, rows)
    log = metric in ("mse", "max_abs", "spread")
    for ax, fixed in zip(axs, panels):
        for i, value in enumerate(desc["axes"][lines] if lines else [None]):
            sel = {**fixed, lines: value} if lines else fixed
            pr = _point_rows(desc, groups, sel)
            if not pr:
                continue
            x, y = _curves(pr, metric)
            if not np.isfinite(y).any():  # no value at all (e.g. no live peer): nothing to draw on a log scale
                continue
            y = _floor(metric, y)
            color = f"C{i % 10}"
            # a curve of one round is one point: a line alone draws nothing there (a 1-round sweep
            # plotted empty panels under a legend), so it gets a marker
            ax.plot(x, np.nanmedian(y, axis=0), color=color, label=_label(value) if lines else None,
                    marker="o" if len(x) == 1 else None)
            ax.fill_between(x, np.nanmin(y, axis=0), np.nanmax(y, axis=0), color=color, alpha=0.15, lw=0)
        if log:
            ax.set_yscale("log")
        ax.set_title(", ".join(f"{a}={_label(v)}" for a, v in fixed.items()) or desc["name"], fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axs:
        ax.set_xlabel("round")
    axs[0].set_ylabel(f"{metric} (median, range over {len(desc['seeds'])} seeds)")
    if lines and axs[0].get_legend_handles_labels()[0]:  # (no curve drawn: no legend, and no warning)
        axs[0].legend(title=lines, fontsize=8)
    fig.tight_layout()
    return fig


def rounds_to_eps_heatmap(desc: dict, rows: list[dict], metric: str = "mse", eps: float = 1e-9,
                          xy: Sequence[str] | None = None):
    varying = _varying(desc)
    xy = list(xy or desc.get("plot", {}).get("heatmap") or varying[:2])
    if len(xy) != 2:
        raise ValueError(f"a heatmap needs two axes with several values; this sweep varies {varying}")
    # (a name that is no axis raised a bare KeyError naming it; one axis twice drew a misplaced grid)
    bad = [a for a in xy if a not in desc["axes"]]
    if bad or xy[0] == xy[1]:
        raise ValueError(f"the heatmap's axes must be two different axes of the sweep, not {xy}; its axes: "
                         f"{', '.join(desc['axes']) or 'none'}")
    xa, ya = xy
    axes = list(desc["axes"])
    summary = rounds_to_eps(rows, axes, eps, metric)
    others = [a for a in axes if a not in xy]
    combos = _combos(desc, others)
    panels = combos[:_MAX_PANELS]
    xs, ys = desc["axes"][xa], desc["axes"][ya]
    fig, axs = _panels(len(panels))
    vmax = max((s["rounds"] for s in summary), default=1.0)
    im = None
    for ax, fixed in zip(axs, panels):
        grid = np.full((len(ys), len(xs)), np.nan)
        marks = {}
        for s in summary:
            if not _match(s, fixed):
                continue
            i = [canonical(v) for v in ys].index(canonical(s[ya]))
            j = [canonical(v) for v in xs].index(canonical(s[xa]))
            grid[i, j] = s["rounds"]
            marks[i, j] = s["reached"] < 1.0
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
        for (i, j), partial in marks.items():
            ax.text(j, i, f"{grid[i, j]:.1f}{'*' if partial else ''}", ha="center", va="center", fontsize=8,
                    color="white" if grid[i, j] < 0.6 * vmax else "black")
        ax.set_xticks(range(len(xs)), [_label(v) for v in xs], fontsize=8)
        ax.set_yticks(range(len(ys)), [_label(v) for v in ys], fontsize=8)
        ax.set_xlabel(xa)
        ax.set_ylabel(ya)
        ax.set_title(", ".join(f"{a}={_label(v)}" for a, v in fixed.items()) or desc["name"], fontsize=9)
    cut = f"\nthe first {len(panels)} of {len(combos)} panels" if len(panels) < len(combos) else ""
    fig.suptitle(f"mean rounds to {metric} <= {eps:g} (* = some seeds never got there){cut}", fontsize=10)
    fig.tight_layout()
    if im is not None:
        fig.colorbar(im, ax=axs, shrink=0.8)
    return fig


def bytes_vs_accuracy(desc: dict, rows: list[dict], metric: str = "mse"):
    import matplotlib.pyplot as plt

    axes = list(desc["axes"])
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    groups = _by_point(desc, rows)
    points = _combos(desc, axes)
    _note_cut(fig, min(20, len(points)), len(points), "points")
    for i, point in enumerate(points[:20]):
        pr = _point_rows(desc, groups, point)
        if not pr:
            continue
        _, b = _curves(pr, "bytes_sent_cum")
        _, y = _curves(pr, metric)
        ax.plot(np.nanmedian(b, axis=0), _floor(metric, np.nanmedian(y, axis=0)), marker="o", ms=3,
                color=f"C{i % 10}", label=", ".join(f"{a}={_label(v)}" for a, v in point.items()) or desc["name"])
    ax.set_xscale("symlog")
    ax.set_yscale("log")
    ax.set_xlabel("bytes sent per stepping peer, cumulative (median over seeds)")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_results(results: str | Path, out: str | Path | None = None, *, metric: str | None = None,
                 eps: float | None = None, heatmap: Sequence[str] | None = None) -> list[Path]:
    """Draw the standard figures of a sweep's results folder into ``out`` (default RESULTS/plots)."""
    import sys

    results = Path(results)
    if not (results / "sweep.json").is_file():  # (before anything is created under it)
        if (results / "runs").is_dir():  # the tables are written at the end: an interrupted sweep has none
            raise ValueError(f"{results} holds runs but no sweep.json: its sweep has not finished (interrupted?); "
                             "run `python -m sim sweep FILE --out FOLDER` again to finish it and write its tables")
        raise ValueError(f"{results} is not a sweep's results folder (it holds no sweep.json): give the --out "
                         "folder of `python -m sim sweep FILE --out FOLDER`")
    desc, rows = read_table(results)
    if not rows:  # every figure would be empty axes, written without a word
        failed = json.loads((results / "failures.json").read_text()) if (results / "failures.json").is_file() else []
        raise ValueError(f"{results}: results.csv holds no rows, nothing to draw: "
                         + (f"{len(failed)} of its runs failed (see failures.json)" if failed
                            else "no run has finished (or every run has 0 rounds)"))
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # files only: no display needed
    # else (a notebook, a session drawing figures of its own) its backend stays: switching left a
    # notebook on Agg, where the user's later figures no longer showed inline
    import matplotlib.pyplot as plt

    cfg = desc.get("plot", {})
    metric = metric or cfg.get("metric") or _DEFAULT_METRIC.get(desc.get("kind"), "mse")
    if metric not in rows[0]:
        columns = [c for c in rows[0] if c not in (*desc["axes"], "seed", "run_seed", "key", "round")]
        raise ValueError(f"{results}: no metric {metric!r} in results.csv; its metrics: {', '.join(columns)}")
    eps = eps if eps is not None else float(cfg.get("eps", 1e-9))
    if math.isnan(eps):  # no metric is <= nan: every cell "never got there"
        raise ValueError("eps must be a number, not nan")
    figs = {}
    try:  # a figure left open when a later one fails stays in pyplot (a notebook shows it)
        figs["metric_vs_rounds.png"] = metric_vs_rounds(desc, rows, metric)
        if len(heatmap or cfg.get("heatmap") or _varying(desc)) >= 2:
            figs["rounds_to_eps.png"] = rounds_to_eps_heatmap(desc, rows, metric, eps, heatmap)
        if "bytes_sent_cum" in rows[0]:
            figs["bytes_vs_accuracy.png"] = bytes_vs_accuracy(desc, rows, metric)
        out = Path(out) if out else results / "plots"
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, fig in figs.items():
            path = out / name
            # no timestamp in the PNG metadata: the same results draw the same file
            fig.savefig(path, dpi=110, metadata={"Software": None})
            paths.append(path)
    finally:
        for fig in figs.values():
            plt.close(fig)
    return paths


def cmd_plot(args) -> int:
    import sys

    for path in plot_results(args.results, args.out, metric=args.metric, eps=args.eps, heatmap=args.heatmap):
        sys.stdout.write(f"{path}\n")
    return 0
