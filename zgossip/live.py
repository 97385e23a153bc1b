"""What ``zgossip peer`` shows while it runs: a live table, or one plain line per step.

With `rich` installed (``pip install 'zgossip[live]'``) and a terminal on stdout, `LiveTable`
keeps one table on screen, redrawn every second: this peer, how many peers it knows alive,
step counts and throughput, and the last steps. Without rich, when stdout is not a terminal
(a pipe, a log file, CI) or with ``--plain``, `PlainLines` prints one line per step instead.
Both read the averager's `step_log` (`zgossip.steplog`).

"Live peers" are the *other* peers this one believes alive (its membership table); this peer
is not counted, so with 3 peers it reads 2 -- every line says so.
"""
from __future__ import annotations

import sys
from typing import IO, Any, Sequence

from .steplog import StepRecord

__all__ = ["PlainLines", "LiveTable", "make_display", "rich_available", "describe_step", "throughput"]


def rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def throughput(rec: StepRecord) -> float:
    """Tensor bytes this peer sent and received in the step, per second of the step (MB/s)."""
    total = float(rec.timings.get("total", 0.0))
    return (rec.bytes_sent + rec.bytes_received) / total / 1e6 if total > 0 else 0.0


def peers_phrase(live: int | None) -> str:
    if live is None:
        return "peers: unknown"
    return f"knows {live} other live peer{'s' * (live != 1)} ({live + 1} with this one)"


def describe_step(rec: StepRecord, mean: float | None = None) -> str:
    if not rec.ok:
        return f"step {rec.index}: {rec.error}: {rec.message}"
    lost = f", lost {len(rec.lost)}" if rec.lost else ""
    odd = f", {len(rec.left_out)} left out (different tensors)" if rec.left_out else ""
    tail = f", mean {mean:+.6f}" if mean is not None else ""
    return (f"step {rec.index}: group of {len(rec.members)}, {len(rec.contributors)} contributed{lost}{odd}, "
            f"{rec.timings.get('total', 0.0):.3f}s, {throughput(rec):.1f} MB/s{tail}")


class PlainLines:
    """One line per step on `stream` (what ``zgossip peer`` printed before, with clearer counts)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stdout

    def __enter__(self) -> "PlainLines":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def note(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def step(self, rec: StepRecord, live: int | None, mean: float | None = None) -> None:
        print(f"{describe_step(rec, mean)}; {peers_phrase(live)}", file=self.stream, flush=True)

    def refresh(self, live: int | None) -> None:
        pass


class LiveTable:
    """A rich table kept on screen (rich's `Live`), redrawn on every step and `refresh`."""

    def __init__(self, title: str, info: Sequence[str], keep: int = 10, console: Any = None) -> None:
        from rich.console import Console

        self.console = console or Console()
        self.title = title
        self.info = list(info)
        self.keep = keep
        self.rows: list[tuple[StepRecord, float | None]] = []
        self.notes: list[str] = []
        self.live_peers: int | None = None
        self.totals = {"ok": 0, "failed": 0, "bytes": 0, "seconds": 0.0}
        self._live: Any = None

    def __enter__(self) -> "LiveTable":
        from rich.live import Live

        self._live = Live(self.render(), console=self.console, refresh_per_second=4, transient=False)
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.update(self.render(), refresh=True)
            self._live.__exit__(*exc)
            self._live = None

    def note(self, text: str) -> None:
        self.notes = (self.notes + [text])[-3:]
        self._redraw()

    def step(self, rec: StepRecord, live: int | None, mean: float | None = None) -> None:
        self.live_peers = live
        self.rows = (self.rows + [(rec, mean)])[-self.keep:]
        if rec.ok:
            self.totals["ok"] += 1
            self.totals["bytes"] += rec.bytes_sent + rec.bytes_received
            self.totals["seconds"] += float(rec.timings.get("total", 0.0))
        else:
            self.totals["failed"] += 1
            self.notes = (self.notes + [f"step {rec.index}: {rec.error}: {rec.message[:400]}"])[-3:]
        self._redraw()

    def refresh(self, live: int | None) -> None:
        self.live_peers = live
        self._redraw()

    def _redraw(self) -> None:
        if self._live is not None:
            self._live.update(self.render())

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        t = self.totals
        rate = t["bytes"] / t["seconds"] / 1e6 if t["seconds"] > 0 else 0.0
        head = [Text(self.title, style="bold"), *(Text(x) for x in self.info),
                Text(f"live peers: {peers_phrase(self.live_peers)}"),
                Text(f"steps: {t['ok']} averaged, {t['failed']} failed; throughput {rate:.1f} MB/s "
                     "(tensor bytes sent + received per second of step)")]
        table = Table(title=f"last {self.keep} steps", title_justify="left", expand=False)
        for col, just in (("step", "right"), ("result", "left"), ("group", "right"), ("contributed", "right"),
                          ("lost", "right"), ("seconds", "right"), ("MB/s", "right"), ("mean", "right")):
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        for rec, mean in self.rows:
            m = "" if mean is None else f"{mean:+.6f}"
            if rec.ok:
                result = "ok" + (f" ({len(rec.left_out)} left out: other tensors)" if rec.left_out else "")
                table.add_row(str(rec.index), result, str(len(rec.members)), str(len(rec.contributors)),
                              str(len(rec.lost)), f"{rec.timings.get('total', 0.0):.3f}", f"{throughput(rec):.1f}", m)
            else:
                table.add_row(str(rec.index), Text(rec.error, style="red"), "", "", "", "", "", m)
        parts: list[Any] = [*head, table]
        parts += [Text(n, style="dim") for n in self.notes]
        return Group(*parts)


def make_display(title: str, info: Sequence[str], *, plain: bool = False, stream: IO[str] | None = None) -> Any:
    """A `LiveTable` when rich is installed and stdout is a terminal (and not `plain`), else `PlainLines`."""
    out = stream or sys.stdout
    if not plain and rich_available() and out.isatty():
        return LiveTable(title, info)
    return PlainLines(out)
