"""Shared by the real-vLLM tests: the server environment and process bookkeeping."""

from __future__ import annotations

import re
from pathlib import Path

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
"""1 GiB of KV cache (plenty for the tiny model) and no hub lookups."""


def vllm_pids(log_path: Path) -> set[int]:
    """The API server's, engine's and worker's process ids, as vLLM prints them in its log."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    return {
        int(p) for p in re.findall(r"\((?:APIServer|EngineCore|VllmWorker|Worker)[^)]*? pid=(\d+)\)", text)
    }


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited process nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
