"""Which model name a rollout request asks the server for: the group's policy version, under LoRA adapter sync.

With adapter sync every policy version is served under its own name (``policy-vN``, ``sync/lora.py``). The
version already travels to the rollout process (``SharedState.model_version``); the name is a function of it
(``RolloutSettings.versioned_model``). A group reads the version once when it starts (and is tagged with it), so
``start_group`` pins that version's name for every request the group makes, through a context variable that the
group's rollout tasks inherit; ``request_model`` is what the client puts in the payload.

A group can outlive its adapter: versions leave the server ``max_staleness + 2`` syncs later, and such a group's
samples are dropped as stale anyway. A request then answered "model does not exist" is sent again under the
current version (``retired_fallback``), exactly as a weight sync changes the weights under a request in flight
with full-weight sync, instead of stopping the run.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupModel:
    name: str
    """The name of the group's policy version."""
    current: Callable[[], str]
    """The name of the version current now."""


_GROUP: ContextVar[GroupModel | None] = ContextVar("asyncgrpo_group_model", default=None)


def model_for(template: str | None, served_model: str, version: int) -> str:
    return template.format(version=version) if template else served_model


def start_group(
    template: str | None, served_model: str, version: int, current_version: Callable[[], int]
) -> None:
    """Pin version ``version``'s name for the calling task and the tasks it starts (no-op without a template)."""
    if not template:
        return
    _GROUP.set(
        GroupModel(
            model_for(template, served_model, version),
            lambda: model_for(template, served_model, current_version()),
        )
    )


def request_model(default: str) -> str:
    group = _GROUP.get()
    return group.name if group is not None else default


def retired_fallback(name: str) -> str | None:
    """The current version's name when ``name`` is the group's (older) version; None otherwise."""
    group = _GROUP.get()
    if group is None or group.name != name:
        return None
    current = group.current()
    return current if current != name else None
