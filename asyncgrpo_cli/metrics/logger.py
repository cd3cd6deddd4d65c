"""``MetricsLogger``: fans each logging window out to the sinks named in ``logging.sinks``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from asyncgrpo_cli.config.schema import LoggingConfig
from asyncgrpo_cli.metrics.console import ConsoleView
from asyncgrpo_cli.metrics.sinks import JsonlSink, Sink, TrackioSink

log = logging.getLogger(__name__)

SINK_NAMES = ("console", "jsonl", "trackio")


def validate_sinks(sinks: Sequence[str]) -> list[str]:
    """The sink names in order without duplicates; ValueError naming ``logging.sinks`` for an unknown one."""
    unknown = [s for s in sinks if s not in SINK_NAMES]
    if unknown:
        raise ValueError(
            f"logging.sinks has unknown sink(s) {', '.join(map(repr, unknown))}; valid sinks: {', '.join(SINK_NAMES)}"
        )
    return list(dict.fromkeys(sinks))


class MetricsLogger:
    """Writes each reduced window to the console view, ``RUN_DIR/metrics.jsonl`` and trackio, as configured.

    ``close()`` is idempotent and runs on exit from a ``with`` block, so a crash never leaves a live display.
    """

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        run_config: dict[str, Any],
        total_steps: int | None,
        total_prompts: int | None,
        *,
        console: Console | None = None,
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self._rename = {str(k): str(v) for k, v in cfg.rename.items()}
        self.view: ConsoleView | None = None
        self._sinks: list[Sink] = []
        try:
            for name in validate_sinks(cfg.sinks):
                if name == "console":
                    self.view = ConsoleView(cfg.console, total_steps, total_prompts, console=console)
                    self._sinks.append(self.view)
                elif name == "jsonl":
                    self._sinks.append(JsonlSink(self.run_dir / "metrics.jsonl"))
                else:
                    run_name = cfg.run_name or self.run_dir.absolute().name
                    self._sinks.append(TrackioSink(cfg.project, run_name, run_config, self.run_dir))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write one logging window (the output of ``MetricWindow.reduce()``) at optimizer step ``step``, its
        names mapped through ``logging.rename`` (already reduced: a renamed counter was summed as a counter)."""
        rename = self._rename
        window = dict(sorted((rename.get(k, k), v) for k, v in metrics.items()))
        for sink in self._sinks:
            sink.log(step, window)

    def update_progress(self, step: int, prompts_done: int | None = None) -> None:
        """Advance the console progress between logging windows."""
        if self.view is not None:
            self.view.update_progress(step, prompts_done)

    def log_completions(self, samples: Sequence[Mapping[str, Any]], step: int | None = None) -> None:
        """Print up to ``logging.num_completions_to_print`` (prompt, completion, reward) samples, when
        ``logging.log_completions`` is on and the console sink is used."""
        if not self.cfg.log_completions or self.view is None or not samples:
            return
        n = self.cfg.num_completions_to_print
        self.view.print_completions(samples if n is None else samples[:n], step=step)

    def close(self) -> None:
        """Close every sink (idempotent); one failing sink does not keep the others open."""
        sinks, self._sinks = self._sinks, []
        errors = []
        for sink in reversed(sinks):
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - close the rest, then report
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already propagating: report close failures without masking it
            self.close()
        except Exception as e:  # noqa: BLE001
            log.warning("closing metric sinks failed: %s: %s", type(e).__name__, e)
