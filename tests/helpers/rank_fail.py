"""A loss that fails on rank 1 at its second call: one rank's error must stop every rank promptly."""

from __future__ import annotations

import os

from asyncgrpo_cli.train.losses import ClippedLoss


class FailsOnRankOne(ClippedLoss):
    calls = 0

    def __call__(self, stats, row, num_trained_step):
        FailsOnRankOne.calls += 1
        if os.environ.get("RANK") == "1" and FailsOnRankOne.calls >= 2:
            raise RuntimeError("rank 1 failed on purpose")
        return super().__call__(stats, row, num_trained_step)
