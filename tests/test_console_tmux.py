"""The live console view as a person sees it: `asyncgrpo train +recipe=tiny` in a real terminal (tmux, 120x40).

Log lines (checkpoint saves) must print above the live region, which must appear once (not re-printed below
every log line), and nothing may be wider than the terminal (``capture-pane -J`` joins lines the terminal
wrapped, so a too-long line shows as one line longer than the width). Skipped when tmux is not installed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

WIDTH, HEIGHT = 120, 40
DONE = "__ASYNCGRPO_EXIT__"
REPO = Path(__file__).resolve().parents[1]


def _tmux(socket: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    # -L: a tmux server of our own, so the user's sessions are never touched; -f /dev/null: no user config
    return subprocess.run(
        ["tmux", "-L", socket, "-f", "/dev/null", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )


def _screen(socket: str, session: str) -> str:
    """The whole pane, scrollback included, with wrapped lines joined."""
    return _tmux(socket, "capture-pane", "-p", "-J", "-S", "-", "-t", session).stdout


def test_live_view_in_a_terminal_stays_one_block_within_the_width(tmp_path):
    socket, session = f"asyncgrpo-test-{os.getpid()}", "live-view"
    train = [
        sys.executable,
        "-m",
        "asyncgrpo_cli",
        "train",
        "+recipe=tiny",
        "trainer.max_steps=4",
        "trainer.save_steps=2",
        "logging.sinks=[console,jsonl]",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = f"PYTHONPATH={shlex.quote(os.environ.get('PYTHONPATH', str(REPO)))}"
    shell = f"cd {shlex.quote(str(REPO))} && env {env} {shlex.join(train)}; echo {DONE} $?; sleep 600"
    _tmux(socket, "new-session", "-d", "-s", session, "-x", str(WIDTH), "-y", str(HEIGHT), shell)
    try:
        deadline = time.monotonic() + 420
        screen = _screen(socket, session)
        while DONE not in screen and time.monotonic() < deadline:
            time.sleep(1)
            screen = _screen(socket, session)
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-session", "-t", session], capture_output=True, timeout=30)
    lines = [line.rstrip() for line in screen.splitlines()]
    text = "\n".join(lines)
    assert re.search(rf"^{DONE} 0$", text, re.M), f"train did not finish with status 0:\n{text}"

    progress = [i for i, line in enumerate(lines) if re.match(r"^step\b.*\d+/4\b", line)]
    stats = [i for i, line in enumerate(lines) if "groups kept" in line or "train tok/s" in line]
    assert len(progress) == 1, f"{len(progress)} progress bars on screen:\n{text}"
    assert 1 <= len(stats) <= 2 and all(progress[0] < i <= progress[0] + 3 for i in stats), text
    too_wide = [line for line in lines if len(line) > WIDTH]
    assert not too_wide, f"lines wider than {WIDTH} columns: {too_wide}"
    saves = [i for i, line in enumerate(lines) if "saved checkpoint" in line]
    assert len(saves) == 2 and max(saves) < progress[0], f"checkpoint lines not above the live view:\n{text}"
