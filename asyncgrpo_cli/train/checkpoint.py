"""Checkpoints: sharded training state (torch distributed checkpointing), an HF model directory, the scheduler,
per-rank RNG, ``trainer_state.json`` and ``rollout_state.json``.

Layout of ``checkpoints/step-NNNNNN/``::

    dcp/                  model + optimizer state, sharded (DCP): resumes on the same or another world size
    model/                the policy as HF safetensors shards + config + tokenizer (``from_pretrained``-able)
    adapter/              with model.lora: the LoRA adapter (PEFT layout); model/ then holds merged weights
    scheduler.pt, rng-<rank>.pt, trainer_state.json, rollout_state.json

Published atomically: everything goes into ``.step-NNNNNN.tmp``; once every rank is done, rank 0 writes
``trainer_state.json`` last and renames the directory into place. A checkpoint of the same step that already
exists is swapped out in one ``renameat2(RENAME_EXCHANGE)`` (where the system has it; elsewhere it is first
renamed away, so a kill between the two renames leaves the previous step as the newest) and deleted only then;
``save_total_limit`` renames a checkpoint away before deleting it. So a kill at any moment leaves hidden
(dot-named) leftovers, which the next save removes, and never a half checkpoint under a ``step-`` name.

A checkpoint is *complete* when it holds ``trainer_state.json``, ``rollout_state.json``, ``scheduler.pt`` and
``dcp/.metadata``; ``resume=auto`` skips an incomplete one with a warning (older versions could leave one).
A complete checkpoint whose files are truncated or corrupt fails the resume with the directory, the file and the
fix. Every rank calls the save and the load (they are collectives under FSDP2).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.train.distributed import DistInfo, barrier

logger = logging.getLogger(__name__)
STEP_PREFIX = "step-"
REQUIRED_FILES = ("trainer_state.json", "rollout_state.json", "scheduler.pt", "dcp/.metadata")
"""What a complete checkpoint holds (``trainer_state.json`` is written last)."""
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


def _step_dirs(root: Path) -> list[Path]:
    """``step-N`` directories under ``root``, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX) :].isdigit()
    ]
    return sorted(found, key=_step_number)


def _step_number(path: Path) -> int:
    name = path.name if path.name.startswith(STEP_PREFIX) else _step_name(path)
    return int(name[len(STEP_PREFIX) :])


def missing_files(path: Path) -> list[str]:
    """The files of ``REQUIRED_FILES`` that checkpoint ``path`` lacks (empty: complete)."""
    return [f for f in REQUIRED_FILES if not (Path(path) / f).is_file()]


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run directory, oldest first."""
    return [p for p in _step_dirs(checkpoints_dir(run_dir)) if not missing_files(p)]


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
    data: dict[str, Any] | None = None,
) -> Path:
    """``data``: what identifies the prompts (``data_identity``), kept to warn when a resume changes them."""
    import torch.distributed.checkpoint as dcp

    from asyncgrpo_cli.model.lora import has_lora, save_adapter
    from asyncgrpo_cli.sync.writer import write_full_state

    info = info or DistInfo()
    root = checkpoints_dir(run_dir)
    final = root / f"{STEP_PREFIX}{state.step:06d}"
    tmp = root / f".{final.name}.tmp"
    if info.is_main:
        _remove_leftovers(root)
        tmp.mkdir(parents=True)
    barrier(info)
    try:
        dcp.save(_training_state(model, optimizer), checkpoint_id=str(tmp / "dcp"))
    except CheckpointException as e:
        raise _unwrapped(e, f"saving the checkpoint {final}") from None
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
    barrier(info)
    if info.is_main:
        meta = {**state.to_dict(), "world_size": info.world_size}
        if data is not None:
            meta["data"] = data
        (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=2))  # last: it marks the dir complete
        _publish(tmp, final)
        if save_total_limit:
            for old in list_checkpoints(run_dir)[:-save_total_limit]:
                _delete(old)
    barrier(info)
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Make ``tmp`` visible as ``final``; a kill at any moment leaves one complete ``final`` or the old one."""
    if not final.exists():
        tmp.rename(final)
        return
    if _exchange(tmp, final):  # ``final`` now holds the new checkpoint, ``tmp`` the old one
        shutil.rmtree(tmp, ignore_errors=True)
        return
    aside = final.with_name(f".{final.name}.old")
    shutil.rmtree(aside, ignore_errors=True)
    final.rename(aside)
    tmp.rename(final)
    shutil.rmtree(aside, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _delete(path: Path) -> None:
    """Delete a published checkpoint: rename it out of sight first, so a kill mid-delete leaves no half of it."""
    aside = path.with_name(f".{path.name}.del")
    shutil.rmtree(aside, ignore_errors=True)
    path.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Hidden directories a killed save or delete left behind (one run writes here: ``train/lock.py``), except
    a complete ``.step-N.old`` with no ``step-N``: a publish without ``renameat2`` was cut between its two
    renames, so that is the checkpoint of step N, and it gets its name back."""
    for aside in _orphaned_asides(root):
        aside.rename(root / _step_name(aside))
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(f".{STEP_PREFIX}") and p.name.endswith((".tmp", ".old", ".del")):
            shutil.rmtree(p, ignore_errors=True)


def _step_name(aside: Path) -> str:
    return aside.name[1 : -len(".old")]


def _orphaned_asides(root: Path) -> list[Path]:
    """Complete ``.step-N.old`` directories whose ``step-N`` does not exist (see ``_publish``)."""
    if not root.is_dir():
        return []
    return [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(f".{STEP_PREFIX}")
        and p.name.endswith(".old")
        and _step_name(p)[len(STEP_PREFIX) :].isdigit()
        and not (root / _step_name(p)).exists()
        and not missing_files(p)
    ]


def _unwrapped(e: CheckpointException, what: str) -> BaseException:
    """torch wraps every failure of a save or load, Ctrl-C included, in a ``CheckpointException`` (a
    ``BaseException``): hand back an interrupt as itself, anything else as one RuntimeError."""
    inner = [exc for exc, _trace in e.failures.values()]
    for exc in inner:
        if isinstance(exc, BaseException) and not isinstance(exc, Exception):  # KeyboardInterrupt, SIGTERM
            return exc
    first = inner[0] if inner else e
    return RuntimeError(f"{what} failed: {type(first).__name__}: {first}")


def find_resume_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """``auto``: the newest complete checkpoint of this run dir (None if there is none); else a checkpoint path
    or a run directory (its newest complete checkpoint). Incomplete ones are skipped with a warning."""
    if resume is None:
        return None
    if resume == "auto":
        return _newest_complete(run_dir)
    path = Path(resume).expanduser()
    if path.is_dir() and (path / "trainer_state.json").is_file():
        missing = missing_files(path)
        if missing:
            raise UserError(
                f"trainer.resume={resume!r}: the checkpoint {path} is incomplete (no {', '.join(missing)}); "
                "pick another checkpoint directory or the run directory (its newest complete checkpoint)."
            )
        return path
    if path.is_dir() and checkpoints_dir(path).is_dir():
        found = _newest_complete(path)
        if found is not None:
            return found
    raise UserError(
        f"trainer.resume={resume!r} is neither 'auto' nor a checkpoint directory (one holding "
        "trainer_state.json) nor a run directory with complete checkpoints in checkpoints/."
    )


def _newest_complete(run_dir: Path) -> Path | None:
    root = checkpoints_dir(run_dir)
    candidates = _step_dirs(root) + _orphaned_asides(root)  # the latter: see ``_remove_leftovers``
    for path in sorted(candidates, key=_step_number, reverse=True):
        missing = missing_files(path)
        if not missing:
            return path
        logger.warning(
            "skipping the incomplete checkpoint %s (no %s; a save or delete was cut short): delete it",
            path,
            ", ".join(missing),
        )
    return None


@dataclass
class ResumeState:
    path: Path
    trainer: TrainerState
    rollout: dict[str, Any]
    data: dict[str, Any] | None = None
    """The prompt source the checkpoint's run trained on (``data_identity``); None for older checkpoints."""


def unreadable(path: Path, name: str, detail: str) -> UserError:
    """The error for a checkpoint file that cannot be read: the directory, the file and the fix."""
    return UserError(
        f"the checkpoint {path} cannot be resumed: {name} {detail}. Resume from another checkpoint with "
        f"trainer.resume=PATH (a checkpoint directory), or delete {path} (trainer.resume=auto then takes the "
        "previous one)."
    )


def _read_json(path: Path, name: str) -> dict[str, Any]:
    try:
        data = json.loads((path / name).read_text())
    except OSError as e:
        raise unreadable(path, name, f"cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise unreadable(path, name, f"is truncated or not JSON ({e})") from None
    if not isinstance(data, dict):
        raise unreadable(path, name, "does not hold a JSON object")
    return data


def read_resume_state(path: Path) -> ResumeState:
    raw = _read_json(path, "trainer_state.json")
    try:
        trainer = TrainerState(
            step=int(raw["step"]),
            model_version=int(raw["model_version"]),
            num_tokens=int(raw.get("num_tokens", 0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise unreadable(path, "trainer_state.json", f"lacks a valid {e} field") from None
    rollout = _read_json(path, "rollout_state.json") if (path / "rollout_state.json").is_file() else {}
    data = raw.get("data") if isinstance(raw.get("data"), dict) else None
    return ResumeState(path=path, trainer=trainer, rollout=rollout, data=data)


DATA_KEYS = ("source", "path", "name", "split")


def data_identity(data_cfg: Any) -> dict[str, Any]:
    """The ``data.*`` keys that say which prompts a run trains on (saved in ``trainer_state.json``)."""
    return {k: getattr(data_cfg, k) for k in DATA_KEYS}


def data_changes(saved: dict[str, Any] | None, data_cfg: Any) -> list[str]:
    """``data.KEY: 'old' -> 'new'`` for each prompt-source key a resume changes (none for older checkpoints)."""
    if not saved:
        return []
    now = data_identity(data_cfg)
    return [f"data.{k}: {saved[k]!r} -> {now[k]!r}" for k in DATA_KEYS if k in saved and saved[k] != now[k]]


def load_training_state(
    path: Path, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, info: DistInfo | None = None
) -> None:
    """Restore model, optimizer (resharded to this world size), scheduler and this rank's RNG."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    info = info or DistInfo()
    _check_dcp_files(path)
    state = _training_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path / "dcp"))
    except CheckpointException as e:
        err = _unwrapped(e, "loading")
        if not isinstance(err, RuntimeError):
            raise err from None
        raise unreadable(path, "dcp/ (model and optimizer shards)", f"is unreadable: {err}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(_torch_load(path, "scheduler.pt"))
    rng_name = f"rng-{info.rank}.pt"
    if (path / rng_name).is_file():
        _set_rng_state(_torch_load(path, rng_name))


def _check_dcp_files(path: Path) -> None:
    """Name the broken file before DCP fails on it: ``.metadata`` must load, every shard must hold its bytes."""
    from torch.distributed.checkpoint import FileSystemReader

    dcp_dir = path / "dcp"
    try:
        metadata = FileSystemReader(str(dcp_dir)).read_metadata()
    except Exception as e:
        raise unreadable(
            path, "dcp/.metadata", f"is truncated or corrupt ({type(e).__name__}: {e})"
        ) from None
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        end = int(item.offset) + int(item.length)
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    for rel, size in sorted(needed.items()):
        shard = dcp_dir / rel
        if not shard.is_file():
            raise unreadable(path, f"dcp/{rel}", "is missing")
        have = shard.stat().st_size
        if have < size:
            raise unreadable(path, f"dcp/{rel}", f"is truncated ({have} of {size} bytes)")


def _torch_load(path: Path, name: str) -> Any:
    try:
        return torch.load(path / name, map_location="cpu", weights_only=False)
    except Exception as e:
        raise unreadable(path, name, f"is truncated or corrupt ({type(e).__name__}: {e})") from None


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
