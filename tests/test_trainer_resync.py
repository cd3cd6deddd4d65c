"""The trainer's side of a server restart (``Trainer.resync_weights_if_needed``) on a real Trainer with a recording
weight sync: a resync re-sends the weights under the version they already carry, so the server, the metrics rows
and the checkpoint all name the same version."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.resync import ServerLink
from asyncgrpo_cli.server.control import ServerControlError
from asyncgrpo_cli.train.checkpoint import TrainerState
from asyncgrpo_cli.train.distributed import DistInfo
from asyncgrpo_cli.train.trainer import Trainer, TrainParts


class RecordingSync:
    """A full-weight backend (no ``repush``) that records the versions pushed; ``down`` makes a push fail the way
    an unreachable server does."""

    repush = None

    def __init__(self) -> None:
        self.pushed: list[int] = []
        self.down = False

    def push(self, model, version: int) -> dict[str, float]:
        if self.down:
            try:
                raise httpx.ConnectError("connection refused")
            except httpx.ConnectError as e:
                raise ServerControlError("POST /pause failed") from e
        self.pushed.append(version)
        return {"perf/weight_sync_s": 0.0}


class Rollout:
    def __init__(self) -> None:
        self.server_link = ServerLink()
        self.published: list[int] = []

    def set_model_version(self, version: int) -> None:
        self.published.append(version)


class Loss:
    head_temperature = None


def trainer(tmp_path: Path, version: int) -> tuple[Trainer, RecordingSync, Rollout]:
    cfg = compose_config(["+recipe=tiny", "server.verify_sync=false"])
    model = torch.nn.Linear(2, 2)
    sync, rollout = RecordingSync(), Rollout()
    parts = TrainParts(
        model=model,
        tokenizer=None,
        device=torch.device("cpu"),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        scheduler=None,
        loss_fn=Loss(),
        packer=None,
        weight_sync=sync,
        state=TrainerState(step=version, model_version=version),
        tracker=None,
        info=DistInfo(),
        rollout=rollout,
    )
    return Trainer(cfg, tmp_path, parts, MetricWindow()), sync, rollout


def test_a_restarted_server_gets_the_current_version_again_not_a_new_one(tmp_path):
    t, sync, rollout = trainer(tmp_path, version=8)
    link = rollout.server_link
    t.resync_weights_if_needed()
    assert sync.pushed == []  # nothing owed, nothing requested: no push

    link.mark_lost()
    link.mark_back(weights_kept=False)  # the server came back with its start-up weights
    t.resync_weights_if_needed()
    assert sync.pushed == [8] and rollout.published == [8]
    assert t.p.state.model_version == 8  # the weights did not change: neither does their version
    assert link.healthy


def test_a_push_the_server_missed_is_made_under_the_version_it_was_owed(tmp_path):
    t, sync, rollout = trainer(tmp_path, version=4)
    sync.down = True
    t._sync_weights_or_defer()  # the scheduled sync after a step finds the server down
    assert sync.pushed == [] and t.p.state.model_version == 5 and rollout.server_link.lost
    t.resync_weights_if_needed()
    assert sync.pushed == []  # still lost: the rollout process reports when it is back

    sync.down = False
    rollout.server_link.mark_back(weights_kept=False)
    t.resync_weights_if_needed()
    assert sync.pushed == [5] and rollout.published == [5] and t.p.state.model_version == 5
    t.resync_weights_if_needed()
    assert sync.pushed == [5]  # the debt is paid once


@pytest.mark.parametrize("kept", [True, False])
def test_a_push_lost_again_during_the_resync_stays_owed(tmp_path, kept):
    t, sync, rollout = trainer(tmp_path, version=2)
    link = rollout.server_link
    link.mark_lost()
    link.mark_back(weights_kept=kept)
    sync.down = True
    t.resync_weights_if_needed()
    if kept:  # the weights survived a blip: nothing to push, nothing tried
        assert sync.pushed == [] and link.healthy
        return
    assert link.lost and t.p.state.model_version == 2
    sync.down = False
    link.mark_back(weights_kept=False)
    t.resync_weights_if_needed()
    assert sync.pushed == [2] and link.healthy
