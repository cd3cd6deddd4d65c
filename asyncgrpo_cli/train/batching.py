"""Pulling one optimizer step's micro-batches off the rollout queue: the trainer side of pacing, in one place.

The collector owns everything ``rollout.max_staleness`` decides on this side (``rollout/staleness.py``):

- it publishes the token allowance that paces generation: ``initial_allowance`` when it is built (every row of a
  step full), then ``step_allowance`` of the tokens each trained step consumed (``step_trained``);
- it drops samples older than ``max_staleness`` weight updates when it pulls them (consume time);
- it resolves prompts for resume: a prompt is done when all its samples were trained or dropped, or when the
  rollout process marks it resolved (no sample: zero-std group, filtered).

The rest go through the token-budget planner, which emits micro-batches (one row per rank). ``RolloutDone`` ends an
epoch-based run: the open rows are flushed.

Planning off the critical path: when the trainer is the bottleneck, the queue already holds the next step's samples
when a step ends, and planning them in ``collect`` would keep the GPU idle. So while a step's GPU work still runs
(after its last backward is queued, before its first host sync), the trainer calls ``prefetch`` with the version
the *next* step trains at: it plans what is queued now, without waiting, until that step is planned. Every sample
is handled exactly as ``collect`` would handle it at that version (staleness is a function of the two versions
only), so the steps are the same; ``perf/plan_s`` is the planning left on the critical path (in ``collect``,
waits excluded), ``perf/plan_overlapped_s`` the planning ``prefetch`` moved under the GPU's work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.packing.planner import MicroBatch, TokenBudgetPlanner, group_adder
from asyncgrpo_cli.rollout.staleness import initial_allowance, is_stale, step_allowance
from asyncgrpo_cli.samples import PromptResolved, RolloutDone, TrainingSequence
from asyncgrpo_cli.train.progress import PromptTracker

GET_TIMEOUT_S = 1.0


@dataclass
class StepBatch:
    microbatches: list[MicroBatch]
    wait_s: float = 0.0
    plan_s: float = 0.0
    """Seconds ``collect`` spent handling items (planning), its waits for samples excluded."""
    samples: list[TrainingSequence] = field(default_factory=list)

    @property
    def num_trained(self) -> int:
        return sum(mb.num_trained for mb in self.microbatches)


class StepCollector:
    """Rank 0's pull side of the rollout queue. ``rollout`` is the ``RolloutProcess`` handle (``get``,
    ``add_consumed``, ``set_allowance``); the planner's ``token_budget`` and ``num_ranks`` size the first allowance."""

    def __init__(
        self,
        rollout: Any,
        planner: TokenBudgetPlanner,
        tracker: PromptTracker,
        max_staleness: int,
        grad_accum: int,
        metrics: MetricWindow,
        should_stop: Any = None,
    ):
        self.rollout = rollout
        self.planner = planner
        self.tracker = tracker
        self.max_staleness = max_staleness
        self.grad_accum = grad_accum
        self.metrics = metrics
        self.should_stop = should_stop or (lambda: False)
        self.rollout_done = False
        self._add_group = group_adder(planner)
        self._carry: list[MicroBatch] = []
        # until ``collect``: the version ``prefetch`` planned samples at, and their metrics (held for that step)
        self._prefetched_for: int | None = None
        self._held: list[tuple[str, float]] | None = None
        rows_per_step = grad_accum * planner.num_ranks
        rollout.set_allowance(initial_allowance(max_staleness, planner.token_budget, rows_per_step))

    def step_trained(self, step: StepBatch) -> None:
        """A step was trained: resolve its samples' prompts and publish the allowance for the next step."""
        for s in step.samples:
            self.tracker.on_sample_done(s.prompt_seq, s.group_num_samples)
        consumed = sum(len(s) for s in step.samples)
        self.rollout.set_allowance(step_allowance(self.max_staleness, consumed))

    @property
    def exhausted(self) -> bool:
        """No more data will come: the rollout process finished and nothing is left to train."""
        return self.rollout_done and not self._carry and self.planner.num_open_samples == 0

    def prefetch(self, model_version: int) -> None:
        """Plan the samples queued now for the step that trains at ``model_version`` (the next one), never waiting:
        stops when that step is planned or the queue is empty (module docstring). The trainer calls it while the
        GPU finishes the current step; ``collect(model_version)`` then starts from what it planned."""
        self._prefetched_for = model_version
        if self._held is None:
            self._held = []
        while not self.rollout_done and len(self._carry) < self.grad_accum:
            item = self.rollout.poll(group=True)
            if item is None:
                break
            self._handle(item, model_version)

    def _metrics(self, name: str, values: list[float]) -> None:
        """Samples' metric: into the window, or held for the step that trains them (``prefetch`` runs during the
        step before, whose window would otherwise log them). Nothing when ``values`` is empty."""
        if not values:
            return
        if self._held is not None:
            self._held.extend((name, value) for value in values)
        else:
            self.metrics.extend(name, values)

    def planned_rows(self) -> list[list[TrainingSequence]]:
        """Every row of the micro-batches planned already, which ``collect`` returns next: micro-batch after
        micro-batch, rank 0's row first."""
        return [row for mb in self._carry for row in mb.rows]

    def collect(self, model_version: int) -> StepBatch | None:
        """Block (with health checks) until a full step is planned; None when the data is exhausted."""
        if self._prefetched_for is not None and self._prefetched_for != model_version:
            raise RuntimeError(
                f"samples were planned for policy version {self._prefetched_for} but the step trains at "
                f"{model_version}: their staleness was checked against the wrong version"
            )
        self._prefetched_for = None
        held, self._held = self._held or [], None
        for name, value in held:
            self.metrics.add(name, value)
        step = StepBatch(microbatches=[])
        while len(step.microbatches) < self.grad_accum:
            if self._carry:
                step.microbatches.append(self._carry.pop(0))
                continue
            if self.rollout_done:
                t0 = time.monotonic()
                mb = self.planner.flush()
                step.plan_s += time.monotonic() - t0
                if mb is None:
                    break
                step.microbatches.append(mb)
                continue
            if self.should_stop():
                return None
            t0 = time.monotonic()
            item = self.rollout.get(timeout=GET_TIMEOUT_S, group=True)
            t1 = time.monotonic()
            step.wait_s += t1 - t0
            if item is not None:
                self._handle(item, model_version)
                step.plan_s += time.monotonic() - t1
        if not step.microbatches:
            return None
        step.samples = [
            s
            for mb in step.microbatches
            for r, row in enumerate(mb.rows)
            if r not in mb.filler_ranks
            for s in row
        ]
        return step

    def _handle(self, item: Any, model_version: int) -> None:
        if isinstance(item, PromptResolved):
            self.tracker.resolve(item.prompt_seq)
            return
        if isinstance(item, RolloutDone):
            self.rollout_done = True
            return
        self._handle_group(item if isinstance(item, list) else [item], model_version)

    def _handle_group(self, samples: list[TrainingSequence], model_version: int) -> None:
        """A group's samples as the queue delivered them (what is left of the group), planned in one
        ``add_group`` call. Each is handled as if it had come alone: counted, dropped when stale or oversize,
        planned in order. When one closes a micro-batch, those after it go back to the queue's front and
        ``collect``'s loop takes them next if the step needs them, as it would take the next sample; so a step
        never takes a sample it does not need, and staleness is checked at the version that trains it."""
        now = time.time()  # when they were taken off the queue, before planning
        stale = [is_stale(model_version, s.model_version, self.max_staleness) for s in samples]
        fresh = [i for i, old in enumerate(stale) if not old]
        added = self._add_group([samples[i] for i in fresh]) if fresh else None
        if added is not None and added.batch is not None:
            used = fresh[added.taken - 1] + 1  # through the sample that closed the micro-batch
            self.rollout.put_back(samples[used:])
            samples, stale = samples[:used], stale[:used]
            self._carry.append(added.batch)
        self.rollout.add_consumed(sum(map(len, samples)))
        self._metrics("sample/time_in_queue_s", [max(0.0, now - s.enqueued_at) for s in samples])
        dropped = [s for s, old in zip(samples, stale) if old]
        if added is not None and added.dropped:  # oversize: positions among the fresh samples
            self._metrics("batch/dropped_oversize_count", [1] * len(added.dropped))
            dropped += [samples[fresh[i]] for i in added.dropped]
        self._metrics("sample/dropped_stale_count", [1] * sum(stale))
        for sample in dropped:
            self.tracker.on_sample_done(sample.prompt_seq, sample.group_num_samples)
        lags = [model_version - s.model_version for s, old in zip(samples, stale) if not old]
        self._metrics("sample/staleness_mean", lags)
        self._metrics("sample/staleness_max", lags)
