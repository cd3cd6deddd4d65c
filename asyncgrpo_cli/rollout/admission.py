"""Admission: may the rollout loop start the next group now? Three gates, their wait metrics, one deadline.

A group of G rollouts starts only while

1. the server link is healthy (``rollout/resync.py``): after a connection failure nothing starts until the server
   answers again, with the trained weights pushed again if it restarted;
2. the rollouts in flight stay within ``min(adaptive cap, max_concurrent_rollouts)`` (``rollout/concurrency.py``;
   a group may always start when nothing is in flight);
3. the token allowance the trainer publishes permits it (``rollout/staleness.py``).

Waits: ``rollout/server_wait_s`` (held by gate 1, recorded when the link is healthy again) and
``rollout/backpressure_s`` (held by gate 3 alone, recorded when the group starts).

Deadline: a link that stays unhealthy (lost, or back but waiting for the weights) for longer than
``server.timeout`` fails the rollout process with ``ServerLostError``, which reaches the trainer through the
process's failure event. Requests in flight have the same bound (``rollout/client.py``); this one covers the
idle case, when the loss was found by a trainer push or the server died with no request outstanding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.concurrency import ConcurrencyController
from asyncgrpo_cli.rollout.resync import LOST, ServerLink
from asyncgrpo_cli.rollout.staleness import AllowanceTracker


class ServerLostError(RuntimeError):
    """The generation server stayed unreachable (or without its weights) past ``server.timeout``."""


class Admission:
    """The rollout loop's gates. ``shared`` carries the trainer's ``token_allowance`` and ``consumed_tokens``."""

    def __init__(
        self,
        link: ServerLink,
        concurrency: ConcurrencyController,
        shared: Any,
        metrics: MetricWindow,
        num_generations: int,
        base_url: str,
        server_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.link = link
        self.concurrency = concurrency
        self.shared = shared
        self.metrics = metrics
        self.num_generations = num_generations
        self.base_url = base_url
        self.server_timeout = server_timeout
        self.clock = clock
        self.allowance = AllowanceTracker()
        self.in_flight = 0
        """Rollouts started and not yet finished generating."""
        self._held_since: float | None = None  # gate 3 alone holds
        self._server_held_since: float | None = None  # gate 1 holds

    def may_start(self) -> bool:
        """True when the next group may start now (then call ``start``); raises ``ServerLostError`` past the
        deadline."""
        server_ok = self._link_ok()
        G = self.num_generations
        slots_ok = self.in_flight == 0 or self.in_flight + G <= self.concurrency.cap
        allowed = self.allowance.can_start(
            self.shared.token_allowance.value, self.shared.consumed_tokens.value, G
        )
        if server_ok and slots_ok and allowed:
            if self._held_since is not None:
                self.metrics.add("rollout/backpressure_s", self.clock() - self._held_since)
                self._held_since = None
            return True
        if server_ok and slots_ok and self._held_since is None:
            self._held_since = self.clock()
        return False

    def start(self, group_id: int) -> None:
        """Account for a group before its task first runs, so the next check sees it."""
        self.allowance.start(group_id, self.num_generations)
        self.in_flight += self.num_generations

    def generated(self) -> None:
        """A started group's rollouts finished generating (or failed): their slots are free."""
        self.in_flight -= self.num_generations

    def finish(self, group_id: int, rollout_tokens: list[int], queued_tokens: int) -> None:
        """A group was scored: ``queued_tokens`` of its samples went on the queue (0 if it was dropped)."""
        self.allowance.finish(group_id, rollout_tokens, queued_tokens)

    def _link_ok(self) -> bool:
        now = self.clock()
        if self.link.healthy:
            if self._server_held_since is not None:
                self.metrics.add("rollout/server_wait_s", now - self._server_held_since)
                self._server_held_since = None
            return True
        if self._server_held_since is None:
            self._server_held_since = now
        waited = now - self._server_held_since
        if waited > self.server_timeout:
            raise ServerLostError(self._lost_message(waited))
        return False

    def _lost_message(self, waited: float) -> str:
        limit = f"{waited:.0f}s (server.timeout={self.server_timeout:g}s)"
        if self.link.state == LOST:
            what = f"the generation server at {self.base_url} has not answered for {limit}"
            fix = "check that it is running (its log in the run directory), or raise server.timeout"
        else:
            what = (
                f"the generation server at {self.base_url} came back without the trained weights and they were "
                f"not pushed again within {limit}"
            )
            fix = "check the trainer's weight sync, or raise server.timeout"
        return f"{what}; no group can start, so the run stops: {fix}."
