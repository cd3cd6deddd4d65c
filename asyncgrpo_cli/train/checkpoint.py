"""Checkpoints: sharded training state (torch distributed checkpointing), an HF model directory, the scheduler,
per-rank RNG, ``trainer_state.json`` and ``rollout_state.json``.

Layout of ``checkpoints/step-NNNNNN/``::

    dcp/                  model + optimizer state, sharded (DCP): resumes on the same or another world size
    model/                the policy as HF safetensors shards + config + tokenizer (``from_pretrained``-able)
    adapter/              with model.lora: the LoRA adapter (PEFT layout); model/ then holds merged weights
    scheduler.pt, rng-<rank>.pt, trainer_state.json, rollout_state.json

Written atomically: everything goes into ``.step-NNNNNN.tmp`` which rank 0 renames once every rank is done, so a
crash mid-save never leaves a half checkpoint that ``resume=auto`` would pick. Every rank calls the save and the
load (they are collectives under FSDP2).
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.train.distributed import DistInfo, barrier

STEP_PREFIX = "step-"
# A single-process run saves and loads DCP checkpoints without a process group, which is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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


def _training_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(
    run_dir: Path,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainerState,
    rollout_state: dict[str, Any],
    save_total_limit: int | None,
    info: DistInfo | None = None,
    save_hf_model: bool = True,
) -> Path:
    import torch.distributed.checkpoint as dcp

    from asyncgrpo_cli.model.lora import has_lora, save_adapter
    from asyncgrpo_cli.sync.writer import write_full_state

    info = info or DistInfo()
    root = checkpoints_dir(run_dir)
    final = root / f"{STEP_PREFIX}{state.step:06d}"
    tmp = root / f".{final.name}.tmp"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    dcp.save(_training_state(model, optimizer), checkpoint_id=str(tmp / "dcp"))
    if save_hf_model:
        write_full_state(model, info, tmp / "model")
    if has_lora(model):  # the trained adapter itself, loadable with PEFT or by a server
        save_adapter(model, info, tmp / "adapter")
    torch.save(_rng_state(), tmp / f"rng-{info.rank}.pt")
    if info.is_main:
        if save_hf_model:
            model.config.save_pretrained(tmp / "model")
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp / "model")
            tokenizer.save_pretrained(tmp / "model")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "rollout_state.json").write_text(
            json.dumps({**rollout_state, "model_version": state.model_version}, indent=2)
        )
        (tmp / "trainer_state.json").write_text(
            json.dumps({**state.to_dict(), "world_size": info.world_size}, indent=2)
        )
    barrier(info)
    if info.is_main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        if save_total_limit:
            for old in list_checkpoints(run_dir)[:-save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    barrier(info)
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
    raw = json.loads((path / "trainer_state.json").read_text())
    trainer = TrainerState(
        step=int(raw["step"]),
        model_version=int(raw["model_version"]),
        num_tokens=int(raw.get("num_tokens", 0)),
    )
    rollout_file = path / "rollout_state.json"
    rollout = json.loads(rollout_file.read_text()) if rollout_file.is_file() else {}
    return ResumeState(path=path, trainer=trainer, rollout=rollout)


def load_training_state(
    path: Path, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, info: DistInfo | None = None
) -> None:
    """Restore model, optimizer (resharded to this world size), scheduler and this rank's RNG."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    info = info or DistInfo()
    state = _training_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=False))
    rng_file = path / f"rng-{info.rank}.pt"
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
