"""Metric sinks that persist each logging window: ``metrics.jsonl`` in the run directory, and trackio (offline)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Sink(Protocol):
    """What ``MetricsLogger`` fans out to."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def json_safe(value: float) -> float | None:
    """NaN and +-inf have no JSON spelling: they are written as null."""
    return value if math.isfinite(value) else None


class JsonlSink:
    """One JSON object per logging window and line: ``{"step": ..., "time": unix seconds, **metrics}``.

    Opened in append mode (a resumed run continues the same file) and flushed after every line.
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: io.TextIOWrapper | None = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._file is None:
            raise RuntimeError(f"JsonlSink({self.path}) is closed")
        clash = {"step", "time"} & set(metrics)
        if clash:
            raise ValueError(
                f"metric names {sorted(clash)} clash with the fields metrics.jsonl adds to each line"
            )
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        record.update((k, json_safe(float(v))) for k, v in metrics.items())
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# TRACKIO_DIR as this module last set it; a later run of the same process (a multirun sweep) may move it.
_trackio_dir_we_set: str | None = None


def resolve_trackio_dir(run_dir: Path) -> Path:
    """The user's ``TRACKIO_DIR`` if they set one, else ``RUN_DIR/trackio``; exported for trackio to read."""
    global _trackio_dir_we_set
    user_dir = os.environ.get("TRACKIO_DIR")
    if user_dir and user_dir != _trackio_dir_we_set:
        return Path(user_dir)
    target = str(Path(run_dir).absolute() / "trackio")
    os.environ["TRACKIO_DIR"] = _trackio_dir_we_set = target
    return Path(target)


def _point_loaded_trackio_at(target: Path) -> None:
    """trackio reads TRACKIO_DIR once, at import, into module constants. When an earlier run of this process
    imported it with another directory, rebind those constants so this run's data lands in its own run dir."""
    utils = sys.modules.get("trackio.utils")
    if utils is None or Path(utils.TRACKIO_DIR) == target:
        return
    old = {
        "TRACKIO_DIR": utils.TRACKIO_DIR,
        "MEDIA_DIR": utils.MEDIA_DIR,
        "ARTIFACTS_DIR": utils.ARTIFACTS_DIR,
    }
    new = {"TRACKIO_DIR": target, "MEDIA_DIR": target / "media", "ARTIFACTS_DIR": target / "artifacts"}
    for name, module in list(sys.modules.items()):
        if name == "trackio" or name.startswith("trackio."):
            for attr, value in old.items():
                if getattr(module, attr, None) is value:
                    setattr(module, attr, new[attr])


class TrackioSink:
    """Logs each window to a local trackio project (SQLite under TRACKIO_DIR). No dashboard, no network.

    trackio is imported lazily. Any failure (import, init, log, finish) is reported once as a warning and
    disables the sink: a logger never stops training. trackio's own chatter on stdout is folded into one
    ``logging`` line so it does not tear the live console view.
    """

    def __init__(self, project: str, run_name: str, config: dict[str, Any], run_dir: Path | str):
        self.project, self.run_name = project, run_name
        self.trackio_dir = resolve_trackio_dir(Path(run_dir))
        self._run: Any = None
        self._failed = False
        self._guard("start", self._start, config)

    @property
    def active(self) -> bool:
        return self._run is not None

    def _start(self, config: dict[str, Any]) -> None:
        _point_loaded_trackio_at(self.trackio_dir)
        import trackio

        if os.environ.get("TRACKIO_SPACE_ID") or os.environ.get("TRACKIO_SERVER_URL"):
            log.warning("TRACKIO_SPACE_ID / TRACKIO_SERVER_URL is set: trackio will also send metrics there")
        with contextlib.redirect_stdout(io.StringIO()):
            self._run = trackio.init(
                project=self.project,
                name=self.run_name,
                config=config,
                resume="allow",  # a resumed run (same run dir and name) continues its trackio run
                embed=False,  # never launch the dashboard (it would in a notebook)
                auto_log_gpu=False,  # no background hardware polling threads
                auto_log_cpu=False,
            )
        log.info(
            "trackio: project %r, run %r in %s (view: TRACKIO_DIR=%s trackio show --project %s)",
            self.project,
            self.run_name,
            self.trackio_dir,
            self.trackio_dir,
            self.project,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._run is not None:
            self._guard("log", self._run.log, dict(metrics), step=int(step))

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            self._guard("finish", self._finish, run)

    @staticmethod
    def _finish(run: Any) -> None:
        import trackio

        with contextlib.redirect_stdout(io.StringIO()):
            run.finish()
        if trackio.context_vars.current_run.get() is run:
            trackio.context_vars.current_run.set(None)

    def _guard(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a logger never crashes training
            self._run = None
            if not self._failed:
                self._failed = True
                log.warning(
                    "trackio %s failed (%s: %s); continuing without trackio", what, type(e).__name__, e
                )
