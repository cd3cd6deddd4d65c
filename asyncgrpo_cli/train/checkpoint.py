"""Checkpoints: model, tokenizer, optimizer, scheduler, RNG, trainer state and ``rollout_state.json``.

Written atomically: everything goes into a temp directory that is renamed to ``checkpoints/step-NNNNNN`` only
when complete, so a crash mid-save never leaves a half checkpoint that ``resume=auto`` would pick.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncgrpo_cli.errors import UserError

STEP_PREFIX = "step-"


@dataclass
class TrainerState:
    step: int = 0
    model_version: int = 0
    num_tokens: int = 0
    """Cumulative forwarded tokens (the ``num_tokens`` metric), continued across resumes."""

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "model_version": self.model_version, "num_tokens": self.num_tokens}


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(STEP_PREFIX) and (p / "trainer_state.json").is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def save_checkpoint(
    run_dir: Path,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainerState,
    rollout_state: dict[str, Any],
    save_total_limit: int | None,
) -> Path:
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{STEP_PREFIX}{state.step:06d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state.to_dict(), indent=2))
    (tmp / "rollout_state.json").write_text(
        json.dumps({**rollout_state, "model_version": state.model_version}, indent=2)
    )
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    if save_total_limit:
        for old in list_checkpoints(run_dir)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def find_resume_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """``auto``: the newest complete checkpoint of this run dir (None if there is none); else a checkpoint path."""
    if resume is None:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if path.is_dir() and (path / "trainer_state.json").is_file():
        return path
    if path.is_dir() and list_checkpoints(path):
        return list_checkpoints(path)[-1]
    raise UserError(
        f"trainer.resume={resume!r} is neither 'auto' nor a checkpoint directory (one holding "
        "trainer_state.json) nor a run directory with checkpoints/."
    )


@dataclass
class ResumeState:
    path: Path
    trainer: TrainerState
    rollout: dict[str, Any]


def read_resume_state(path: Path) -> ResumeState:
    trainer = TrainerState(**json.loads((path / "trainer_state.json").read_text()))
    rollout_file = path / "rollout_state.json"
    rollout = json.loads(rollout_file.read_text()) if rollout_file.is_file() else {}
    return ResumeState(path=path, trainer=trainer, rollout=rollout)


def load_training_state(path: Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=False))
    rng_file = path / "rng.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
