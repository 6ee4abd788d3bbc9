"""How a run shows itself: a rich live table with progress bars on a terminal, plain lines in CI.

The runner calls ``status``/``log``/``task`` from any thread; both reporters are thread-safe.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

STYLES = {
    "pending": "dim",
    "running": "cyan",
    "cached": "blue",
    "done": "green",
    "failed": "bold red",
    "skipped": "yellow",
}


class Reporter:
    """No output at all (library use); the base of the two real reporters."""

    def start(self, stages: dict[str, str]) -> None:
        """``stages``: id -> type, in execution order."""

    def status(self, stage: str, status: str, detail: str = "") -> None:
        """A stage changed state (running, cached, done, failed, skipped)."""

    def log(self, stage: str, message: str) -> None:
        """A message from a stage (``ctx.log``) or about it."""

    def task(self, stage: str, description: str, total: float | None) -> Any:
        """A progress bar (``ctx.task``) with ``advance``/``update``."""
        return _PlainTask(self, stage, description, total)

    def stop(self) -> None:
        """The run is over."""


class PlainReporter(Reporter):
    """Timestamped lines, for logs that are not a terminal."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()

    def _line(self, text: str) -> None:
        with self._lock:
            self.stream.write(f"[{time.strftime('%H:%M:%S')}] {text}\n")
            self.stream.flush()

    def status(self, stage: str, status: str, detail: str = "") -> None:
        self._line(f"{stage}: {status}" + (f" ({detail})" if detail else ""))

    def log(self, stage: str, message: str) -> None:
        self._line(f"{stage}: {message}")


class _PlainTask:
    """Reports at 25 % steps so CI logs show movement without flooding."""

    def __init__(self, reporter: Reporter, stage: str, description: str, total: float | None):
        self.reporter, self.stage, self.description, self.total = reporter, stage, description, total
        self.completed = 0.0
        self._shown = 0  # first line at 25 %

    def advance(self, n: float = 1) -> None:
        self.update(completed=self.completed + n)

    def update(
        self, *, total: float | None = None, completed: float | None = None, description: str | None = None
    ) -> None:
        self.total = total if total is not None else self.total
        self.completed = completed if completed is not None else self.completed
        self.description = description or self.description
        if self.total:
            quarter = int(4 * self.completed / self.total)
            if quarter != self._shown:
                self._shown = quarter
                self.reporter.log(self.stage, f"{self.description}: {self.completed:g}/{self.total:g}")


class RichReporter(Reporter):
    """A live table of stages plus one progress bar per stage task."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self._lock = threading.Lock()
        self._states: dict[str, list[str]] = {}
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._live = Live(console=self.console, refresh_per_second=8, get_renderable=self._render)

    def _render(self) -> Group:
        table = Table(show_header=True, header_style="bold", box=None)
        for col in ("stage", "type", "status", ""):
            table.add_column(col)
        with self._lock:
            for sid, (stype, status, detail) in self._states.items():
                table.add_row(sid, stype, f"[{STYLES.get(status, '')}]{status}", detail)
        return Group(table, self._progress)

    def start(self, stages: dict[str, str]) -> None:
        self._states = {sid: [stype, "pending", ""] for sid, stype in stages.items()}
        self._live.start()

    def status(self, stage: str, status: str, detail: str = "") -> None:
        with self._lock:
            self._states.setdefault(stage, ["", "", ""])[1:] = [status, detail]

    def log(self, stage: str, message: str) -> None:
        self.console.print(f"[dim]{stage}:[/dim] {message}", highlight=False)

    def task(self, stage: str, description: str, total: float | None) -> Any:
        return _RichTask(
            self._progress, self._progress.add_task(f"{stage}: {description}", total=total), stage
        )

    def stop(self) -> None:
        self._live.stop()


class _RichTask:
    def __init__(self, progress: Progress, task_id: Any, stage: str):
        self.progress, self.task_id, self.stage = progress, task_id, stage

    def advance(self, n: float = 1) -> None:
        self.progress.advance(self.task_id, n)

    def update(
        self, *, total: float | None = None, completed: float | None = None, description: str | None = None
    ) -> None:
        kw: dict[str, Any] = {}
        if total is not None:
            kw["total"] = total
        if completed is not None:
            kw["completed"] = completed
        if description is not None:
            kw["description"] = f"{self.stage}: {description}"
        self.progress.update(self.task_id, **kw)


def default_reporter() -> Reporter:
    """Rich live display on a terminal, plain lines otherwise."""
    return RichReporter() if sys.stdout.isatty() else PlainReporter()
