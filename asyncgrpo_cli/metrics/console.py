"""The training console view: a rich progress bar with the latest window's headline metrics, or plain lines.

Modes: ``live`` (a rich Live display that refreshes itself), ``plain`` (one line per logging window, for logs
and CI), ``auto`` (live on a terminal, plain otherwise). Progress counts optimizer steps when ``max_steps`` is
known, else prompts consumed out of the epoch-based total, else an indeterminate bar.

While the live display runs, log records reach the terminal only through a ``RichHandler`` on the display's own
console (the root logger's terminal handlers are swapped out, and restored on ``close()``): rich then prints each
record above the live region instead of the record overwriting it and the region re-printing below. File
handlers (Hydra's ``train.log``) are left alone. The headline metrics wrap between cells at the console width.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

CONSOLE_MODES = ("live", "plain", "auto")


def fmt_num(value: float | None) -> str:
    """Compact number: 4 significant digits, k/M suffixes for large values."""
    if value is None or math.isnan(value):
        return "nan"
    a = abs(value)
    if a >= 1e6:
        return f"{value / 1e6:.2f}M"
    if a >= 1e4:
        return f"{value / 1e3:.1f}k"
    if a >= 100:
        return f"{value:.0f}"
    return f"{value:.4g}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _get(*names: str) -> Callable[[Mapping[str, float]], str | None]:
    """The first of ``names`` in the window (a metric may be logged under another name: ``logging.rename``)."""

    def read(m: Mapping[str, float]) -> str | None:
        return next((fmt_num(m[n]) for n in names if n in m), None)

    return read


def _kept(m: Mapping[str, float]) -> str | None:
    """Share of groups kept for training: the others had zero reward std (or < 2 scorable completions)."""
    return f"{fmt_num(100 * (1 - m['frac_reward_zero_std']))}%" if "frac_reward_zero_std" in m else None


# (label, how to read it from the window); absent metrics are skipped.
HEADLINE: list[tuple[str, Callable[[Mapping[str, float]], str | None]]] = [
    ("reward", _get("reward")),
    ("groups kept", _kept),
    ("stale-dropped", _get("sample/dropped_stale_count", "sample/dropped_stale_total")),
    ("loss", _get("loss")),
    ("jsd", _get("jsd")),
    ("staleness", _get("sample/staleness_mean")),
    ("queue", _get("rollout/queue_size", "sample/rollout_queue_size")),
    ("train tok/s", _get("perf/wall_clock_trained_tokens_per_s", "perf/trained_tok_s_wall_clock")),
    ("gen tok/s", _get("rollout/generated_tokens_per_s", "rollout/generated_tok_s")),
    ("entropy", _get("entropy")),
    ("teacher logp", _get("teacher_logprob")),
    ("is_ratio", _get("sampling/importance_sampling_ratio/mean")),
    ("step_s", _get("perf/step_s")),
]


def headline(metrics: Mapping[str, float]) -> list[tuple[str, str]]:
    """The (label, value) pairs shown for a window."""
    return [(label, v) for label, read in HEADLINE if (v := read(metrics)) is not None]


class _Cells:
    """Headline cells laid out in as many lines as the width needs; a line breaks only between cells."""

    def __init__(self, cells: Sequence[Text], gap: int = 3):
        self.cells, self.gap = list(cells), gap

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        line = Text()
        for cell in self.cells:
            cell = cell.copy()
            cell.truncate(width, overflow="ellipsis")  # a cell wider than the console alone
            if line and line.cell_len + self.gap + cell.cell_len > width:
                yield line
                line = Text()
            if line:
                line.append(" " * self.gap)
            line.append_text(cell)
        if line:
            yield line


def _is_terminal_stream(stream: Any) -> bool:
    return stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) or bool(
        getattr(stream, "isatty", lambda: False)()
    )


def _is_terminal_handler(handler: logging.Handler) -> bool:
    """A handler that writes to the process's stdout/stderr (not a file): it would print through a live region."""
    if isinstance(handler, RichHandler):
        return _is_terminal_stream(handler.console.file)
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return False
    return _is_terminal_stream(getattr(handler, "stream", None))


_SHARED: Console | None = None


def shared_console() -> Console:
    """The process's console on stdout: routed logging and the live view must print through the same one."""
    global _SHARED
    if _SHARED is None:
        _SHARED = Console()
    return _SHARED


class LiveLogging:
    """Route the root logger's terminal output through ``console`` (a RichHandler) until ``restore()``.

    The RichHandler takes the level of the handlers it replaces; with none (Python's last-resort handler prints
    warnings to stderr), WARNING. When the root logger already prints through ``console``, nothing changes.
    """

    def __init__(self, console: Console):
        root = logging.getLogger()
        self.handler: RichHandler | None = None
        self.replaced: list[logging.Handler] = []
        if any(isinstance(h, RichHandler) and h.console is console for h in root.handlers):
            return
        self.replaced = [h for h in root.handlers if _is_terminal_handler(h)]
        level = min((h.level for h in self.replaced), default=logging.WARNING)
        self.handler = RichHandler(
            level=level, console=console, show_path=False, markup=False, log_time_format="[%X]"
        )
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        for h in self.replaced:
            root.removeHandler(h)
        root.addHandler(self.handler)

    def restore(self) -> None:
        """Put the replaced handlers back (idempotent)."""
        root = logging.getLogger()
        if self.handler is not None and self.handler in root.handlers:
            root.removeHandler(self.handler)
            for h in self.replaced:
                root.addHandler(h)


def route_terminal_logging() -> None:
    """On a terminal, print the process's log records through :func:`shared_console` for good (train calls
    this once logging is configured), so lines before, during and after the live view fit the width."""
    console = shared_console()
    if console.is_terminal and not console.is_dumb_terminal:
        LiveLogging(console)


class _Clock:
    """Elapsed time and an ETA from the average pace since the first unit was done (startup excluded)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self._first: tuple[float, float] | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def observe(self, done: float) -> None:
        if self._first is None and done > 0:
            self._first = (time.monotonic(), done)

    def eta(self, done: float, total: float | None) -> float | None:
        if total is None or self._first is None or done <= self._first[1]:
            return None
        t0, d0 = self._first
        return max(0.0, (total - done) * (time.monotonic() - t0) / (done - d0))


class _EtaColumn(ProgressColumn):
    def __init__(self, clock: _Clock):
        super().__init__()
        self.clock = clock

    def render(self, task: Task) -> Text:
        return Text(
            f"eta {fmt_duration(self.clock.eta(task.completed, task.total))}", style="progress.remaining"
        )


def _as_text(x: Any) -> str:
    """A prompt or completion as text: chat messages become 'role: content' lines."""
    if isinstance(x, str):
        return x
    if isinstance(x, Sequence) and all(isinstance(m, Mapping) and "content" in m for m in x):
        return "\n".join(f"{m.get('role', '?')}: {m['content']}" for m in x)
    return str(x)


class ConsoleView:
    """Progress and headline metrics on the terminal. Use as a context manager, or call ``close()``."""

    def __init__(
        self,
        mode: str = "auto",
        total_steps: int | None = None,
        total_prompts: int | None = None,
        console: Console | None = None,
    ):
        if mode not in CONSOLE_MODES:
            raise ValueError(f"logging.console must be one of {', '.join(CONSOLE_MODES)}, got {mode!r}")
        self.console = console or shared_console()
        if mode == "auto":
            mode = "live" if self.console.is_terminal and not self.console.is_dumb_terminal else "plain"
        self.mode = mode
        self.total_steps = total_steps if total_steps and total_steps > 0 else None
        self.total_prompts = total_prompts if total_prompts and total_prompts > 0 else None
        self.step, self.prompts_done = 0, 0
        self.latest: dict[str, float] = {}
        self._clock = _Clock()
        self._live: Live | None = None
        self._logging: LiveLogging | None = None
        if mode == "live":
            self._start_live()

    # -- progress units: steps when max_steps is known, else prompts, else indeterminate ----------------------
    def _progress_unit(self) -> tuple[str, int, int | None]:
        if self.total_steps is not None or self.total_prompts is None:
            return "step", self.step, self.total_steps
        return "prompts", self.prompts_done, self.total_prompts

    def _start_live(self) -> None:
        unit, done, total = self._progress_unit()
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            _EtaColumn(self._clock),
            TextColumn("{task.fields[extra]}"),
            console=self.console,
        )
        self._task = self._progress.add_task(unit, total=total, completed=done, extra="")
        self._live = Live(console=self.console, get_renderable=self._render, refresh_per_second=2)
        self._logging = LiveLogging(self.console)
        self._live.start()

    def _render(self) -> RenderableType:
        cells = [
            Text.assemble((f"{label} ", "dim"), (value, "bold")) for label, value in headline(self.latest)
        ]
        return Group(self._progress, _Cells(cells))

    def update_progress(self, step: int, prompts_done: int | None = None) -> None:
        """Record progress (optimizer steps done; prompts consumed, when known)."""
        self.step = step
        if prompts_done is not None:
            self.prompts_done = prompts_done
        unit, done, _ = self._progress_unit()
        self._clock.observe(done)
        if self._live is not None:
            extra = f"step {self.step}" if unit == "prompts" else ""
            self._progress.update(self._task, completed=done, extra=extra)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Show one logging window."""
        self.latest = dict(metrics)
        self.update_progress(step)
        if self._live is None:
            self.console.print(self.plain_line(), markup=False, highlight=False, soft_wrap=True)

    def plain_line(self) -> str:
        """The latest window in one line: progress, elapsed, ETA and headline metrics."""
        unit, done, total = self._progress_unit()
        where = f"step {self.step}" + (f"/{self.total_steps}" if unit == "step" and total else "")
        if unit == "prompts":
            where += f" prompts {done}/{total}"
        times = f"[{fmt_duration(self._clock.elapsed())} < {fmt_duration(self._clock.eta(done, total))}]"
        metrics = " | ".join(f"{label} {value}" for label, value in headline(self.latest))
        return f"{where} {times}" + (f" {metrics}" if metrics else "")

    def print_completions(self, samples: Sequence[Mapping[str, Any]], step: int | None = None) -> None:
        """Print (prompt, completion, reward) samples: mappings with those keys."""
        table = Table(
            title=f"completions at step {step}" if step is not None else "completions", show_lines=True
        )
        table.add_column("prompt", overflow="fold")
        table.add_column("completion", overflow="fold")
        table.add_column("reward", justify="right")
        for s in samples:
            reward = s.get("reward")
            table.add_row(  # Text cells: model output is never parsed as rich markup
                Text(_as_text(s.get("prompt", ""))),
                Text(_as_text(s.get("completion", ""))),
                Text(fmt_num(float(reward)) if reward is not None else ""),
            )
        self.console.print(table)

    def close(self) -> None:
        """Stop the live display (idempotent); the last frame stays on screen."""
        live, self._live = self._live, None
        routed, self._logging = self._logging, None
        try:
            if live is not None:
                live.stop()
        finally:
            if routed is not None:
                routed.restore()

    def __enter__(self) -> ConsoleView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
