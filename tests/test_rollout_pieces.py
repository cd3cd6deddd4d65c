"""Staleness accounting and the step collector's pacing, turn-to-sample reconciliation, prompt tracking for
resume: plain data, no processes."""

from __future__ import annotations

import numpy as np
import pytest

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.packing.planner import TokenBudgetPlanner
from asyncgrpo_cli.rollout.sequences import rollout_to_sequences
from asyncgrpo_cli.rollout.staleness import AllowanceTracker, initial_allowance, is_stale, step_allowance
from asyncgrpo_cli.samples import (
    SAMPLER_TOPK,
    PromptResolved,
    Rollout,
    RolloutDone,
    TrainingSequence,
    TurnRecord,
)
from asyncgrpo_cli.train.batching import StepCollector
from asyncgrpo_cli.train.progress import PromptTracker


def test_allowance_formulas():
    assert initial_allowance(max_staleness=4, token_budget=1000, rows_per_step=2) == 8000
    assert initial_allowance(max_staleness=0, token_budget=1000, rows_per_step=1) == 1000  # max(ms, 1)
    assert step_allowance(max_staleness=2, tokens_consumed_by_step=500) == 1000
    assert step_allowance(max_staleness=0, tokens_consumed_by_step=500) == 500


def test_stale_drop_rule():
    assert not is_stale(trainer_version=5, sample_version=1, max_staleness=4)
    assert is_stale(trainer_version=6, sample_version=1, max_staleness=4)
    assert is_stale(trainer_version=1, sample_version=0, max_staleness=0)
    assert not is_stale(trainer_version=0, sample_version=0, max_staleness=0)


def test_one_group_at_a_time_until_first_completes_then_token_paced():
    t = AllowanceTracker()
    assert t.can_start(allowance=10_000, consumed=0, num_generations=4)
    t.start(0, num_generations=4)
    assert not t.can_start(allowance=10_000, consumed=0, num_generations=4)  # first group still running
    t.finish(0, rollout_tokens=[100, 100, 100, 100], queued_tokens=400)
    assert t.estimate_group(4) == 400
    assert t.can_start(allowance=1000, consumed=0, num_generations=4)  # 400 queued + 400 expected <= 1000
    t.start(1, 4)  # +400 estimated
    assert t.outstanding(consumed=0) == 800
    assert not t.can_start(allowance=1000, consumed=0, num_generations=4)  # 800 + 400 > 1000: held
    assert t.can_start(
        allowance=1000, consumed=400, num_generations=4
    )  # the trainer consumed the first group
    t.finish(1, [50] * 4, queued_tokens=0)  # dropped group: nothing queued, estimate now 300 per group
    assert t.outstanding(consumed=400) == 0
    assert t.can_start(allowance=100, consumed=400, num_generations=4)  # nothing outstanding: never stalls


def _turn(prompt, out, lps=None, top=None, finish="stop"):
    return TurnRecord(
        prompt_ids=prompt,
        output_ids=out,
        output_log_probs=lps or [-0.5] * len(out),
        output_sampler_logprobs=top,
        finish_reason=finish,
    )


def test_single_turn_sample_layout_and_topk():
    top = [{7: -0.1, 8: -2.0, 9: -3.0}, {5: -0.2, 7: -1.5}]
    r = Rollout(completion=[], completion_ids=[7, 5], turns=[_turn([1, 2, 3], [7, 5], [-0.1, -0.2], top)])
    (s,), stats = rollout_to_sequences(r, num_topk=2)
    assert s.input_ids.tolist() == [1, 2, 3, 7, 5]
    assert s.train_mask.tolist() == [False, False, False, True, True]
    np.testing.assert_allclose(s.sampler_logprobs, [0, 0, 0, -0.1, -0.2], atol=1e-7)
    assert s.token_extras[SAMPLER_TOPK].ids.tolist() == [[7, 8], [5, 7]]
    assert np.isclose(s.token_extras[SAMPLER_TOPK].logprobs[1, 1], -1.5)
    assert stats.forks == 0 and stats.transitions == 0


def test_clean_multi_turn_stays_one_sample_and_fork_trains_each_token_once():
    t1 = _turn([1, 2], [10, 11])
    t2 = _turn([1, 2, 10, 11, 20, 21], [12])  # extends: tool result 20 21 is context
    (s,), stats = rollout_to_sequences(Rollout([], [10, 11, 12], [t1, t2]), 0)
    assert s.input_ids.tolist() == [1, 2, 10, 11, 20, 21, 12]
    assert s.train_mask.tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert stats.forks == 0 and stats.drift_tokens == [0]
    t3 = _turn([1, 2, 99, 20, 21], [13])  # history re-rendered: fork
    samples, stats = rollout_to_sequences(Rollout([], [], [t1, t3]), 0)
    assert len(samples) == 2 and stats.forks == 1 and stats.drift_tokens == [2]
    trained = [tok for s in samples for tok, m in zip(s.input_ids.tolist(), s.train_mask.tolist()) if m]
    assert trained == [10, 11, 13]


def test_output_mask_can_leave_a_rollout_without_samples():
    t = TurnRecord(prompt_ids=[1], output_ids=[2, 3], output_log_probs=[], output_mask=[0, 0])
    samples, _ = rollout_to_sequences(Rollout([], [2, 3], [t]), 0)
    assert samples == []


def test_prompt_tracker_low_water_mark_and_resolved_above():
    t = PromptTracker()
    t.on_sample_done(1, group_num_samples=2)
    t.on_sample_done(1, group_num_samples=2)  # prompt 1 resolved, 0 not yet
    assert t.low_water == 0 and t.resolved_above == {1}
    t.resolve(3)  # e.g. a dropped zero-std group
    t.on_sample_done(0, group_num_samples=1)
    assert t.low_water == 2 and t.resolved_above == {3}
    state = t.state()
    assert state == {"prompt_index": 2, "resolved_above": [3], "trained_prompt_count": 3}
    back = PromptTracker.from_state(state)
    back.resolve(2)
    assert back.low_water == 4 and back.consumed_count == 4
    back.resolve(1)  # already resolved: ignored, never double counted
    assert back.consumed_count == 4


class _FakeRolloutQueue:
    """The trainer-side handle of the rollout process, as the step collector sees it."""

    def __init__(self, items):
        self.items = list(items)
        self.allowances: list[int] = []
        self.consumed = 0
        self.put_backs = 0
        self.waits = 0  # calls of the waiting ``get``

    def set_allowance(self, tokens: int) -> None:
        self.allowances.append(tokens)

    def add_consumed(self, tokens: int) -> None:
        self.consumed += tokens

    def get(self, timeout: float, group: bool = False):
        self.waits += 1
        return self.poll(group)

    def poll(self, group: bool = False):
        """The next item; a list item is a group's samples (``group=True``: the list, else one at a time)."""
        if not self.items:
            return None
        item = self.items.pop(0)
        if isinstance(item, list):
            if group:
                return item
            if item[1:]:
                self.items.insert(0, item[1:])
            return item[0]
        return [item] if group and isinstance(item, TrainingSequence) else item

    def put_back(self, samples: list) -> None:
        if samples:
            self.items.insert(0, list(samples))
            self.put_backs += 1


def _sample(n: int, prompt_seq: int, version: int, group_num_samples: int = 1) -> TrainingSequence:
    s = TrainingSequence(
        input_ids=np.arange(n, dtype=np.int64),
        train_mask=np.ones(n, dtype=bool),
        sampler_logprobs=np.zeros(n, dtype=np.float32),
    )
    s.prompt_seq, s.model_version, s.group_num_samples = prompt_seq, version, group_num_samples
    return s


def test_the_step_collector_owns_trainer_side_pacing():
    """It publishes the allowances, drops stale samples and resolves prompts; the trainer only reports steps."""
    items = [
        _sample(30, prompt_seq=0, version=0),  # stale at trainer version 3 with max_staleness 2
        PromptResolved(1, "zero_std"),
        _sample(40, prompt_seq=2, version=2, group_num_samples=2),
        _sample(50, prompt_seq=2, version=3, group_num_samples=2),
        RolloutDone(num_prompts=3),
    ]
    rollout, tracker, window = _FakeRolloutQueue(items), PromptTracker(), MetricWindow()
    planner = TokenBudgetPlanner(token_budget=100, num_ranks=2)
    collector = StepCollector(rollout, planner, tracker, max_staleness=2, grad_accum=3, metrics=window)
    assert rollout.allowances == [initial_allowance(2, token_budget=100, rows_per_step=6)] == [1200]
    step = collector.collect(model_version=3)
    assert step is not None and sorted(len(s) for s in step.samples) == [40, 50]
    assert rollout.consumed == 120  # every pulled sample counts, the stale one too
    assert tracker.state()["prompt_index"] == 2  # 0 (stale) and 1 (marker) resolved; 2 awaits its training
    collector.step_trained(step)
    assert tracker.state() == {"prompt_index": 3, "resolved_above": [], "trained_prompt_count": 3}
    assert rollout.allowances[-1] == step_allowance(2, tokens_consumed_by_step=90) == 180
    assert window.reduce()["sample/dropped_stale_count"] == 1
    assert collector.exhausted


def _queued_step(version: int) -> list:
    """Three prompts' samples as the rollout queue holds them: a stale one, a resolved prompt, then two groups."""
    return [
        _sample(30, prompt_seq=0, version=version - 3),
        PromptResolved(1, "zero_std"),
        _sample(40, prompt_seq=2, version=version - 1, group_num_samples=2),
        _sample(50, prompt_seq=2, version=version, group_num_samples=2),
        _sample(60, prompt_seq=3, version=version),
        _sample(70, prompt_seq=4, version=version),
        _sample(80, prompt_seq=5, version=version),
    ]


def _collector(items: list) -> tuple[StepCollector, _FakeRolloutQueue, PromptTracker, MetricWindow]:
    rollout, tracker, window = _FakeRolloutQueue(items), PromptTracker(), MetricWindow()
    planner = TokenBudgetPlanner(token_budget=100, num_ranks=1)
    collector = StepCollector(rollout, planner, tracker, max_staleness=2, grad_accum=2, metrics=window)
    return collector, rollout, tracker, window


def test_prefetch_plans_what_is_queued_without_waiting_and_collect_gets_the_same_step():
    """Planning under the GPU's work (``prefetch`` at the next step's version) changes no step."""
    plain, _, plain_tracker, _ = _collector(_queued_step(version=3))
    expected = plain.collect(model_version=3)
    ahead, rollout, tracker, window = _collector(_queued_step(version=3))
    ahead.prefetch(model_version=3)
    assert rollout.waits == 0  # never waited on the queue
    assert len(rollout.items) == 1  # stopped once the step was planned: two micro-batches, one sample left
    assert (
        "sample/dropped_stale_count" not in window.reduce()
    )  # held for the step it belongs to, not this one
    step = ahead.collect(model_version=3)
    got = window.reduce()
    assert got["sample/dropped_stale_count"] == 1  # dropped at the version it was planned for, logged now
    assert got["sample/staleness_max"] == 1  # the 40-token sample, one version behind the step that trains it
    assert rollout.waits == 0  # collect needed nothing more
    assert step is not None and expected is not None
    assert [[len(s) for s in mb.rows[0]] for mb in step.microbatches] == [
        [len(s) for s in mb.rows[0]] for mb in expected.microbatches
    ]
    assert tracker.state() == plain_tracker.state()
    assert step.plan_s == 0.0 and expected.plan_s > 0.0  # the planning was done ahead


def test_the_planned_rows_are_the_ones_collect_returns():
    collector, _, _, _ = _collector(_queued_step(version=3))
    assert collector.planned_rows() == []  # nothing planned yet
    collector.prefetch(model_version=3)
    planned = collector.planned_rows()
    step = collector.collect(model_version=3)
    assert step is not None and planned
    returned = [row for mb in step.microbatches for row in mb.rows]
    assert all(a is b for a, b in zip(planned, returned[: len(planned)], strict=True))


def test_prefetch_on_an_empty_queue_returns_at_once_and_a_version_mismatch_is_refused():
    collector, rollout, _, _ = _collector([])
    collector.prefetch(model_version=5)
    assert rollout.waits == 0
    with pytest.raises(RuntimeError, match="planned for policy version 5 but the step trains at 4"):
        collector.collect(model_version=4)


def _group_stream(rng, groups: int) -> list:
    """Groups of GRPO-like samples (a shared prompt, then a completion), some stale, some longer than the budget,
    now and then a resolved prompt between them."""
    out = []
    for g in range(groups):
        prompt = rng.integers(0, 50, size=int(rng.integers(4, 30)))
        samples = []
        for _ in range(int(rng.integers(1, 9))):
            n = int(rng.integers(1, 25)) if rng.random() > 0.05 else 200
            ids = np.concatenate([prompt, rng.integers(0, 50, size=n)]).astype(np.int64)
            s = TrainingSequence(ids, np.arange(len(ids)) >= len(prompt), np.zeros(len(ids), np.float32))
            s.prompt_seq, s.group_id = g, g
            s.model_version = 10 + g // 6 - int(rng.integers(0, 5))  # against the trainer's, some stale
            s.enqueued_at = float("inf")  # queue time: 0
            samples.append(s)
        for s in samples:
            s.group_num_samples = len(samples)
        out.append(samples)
        if rng.random() < 0.1:
            out.append(PromptResolved(1000 + g, "zero_std"))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_group_planned_at_once_makes_the_steps_of_its_samples_one_by_one(seed, monkeypatch):
    """The collector hands the planner a group's samples in one call (``add_group``), putting those after a
    closing sample back. Against the same stream with every sample its own item: the same steps (rows of the
    same samples), metrics, prompt tracking and consumed tokens, over collects and prefetches of tight rows."""
    from asyncgrpo_cli.packing.tree_planner import TreeBudgetPlanner

    # these groups of 1-8 through the compiled call, not add's deferral
    monkeypatch.setattr(TreeBudgetPlanner, "min_group_run", 1)
    rng = np.random.default_rng(seed)
    stream = _group_stream(rng, 40) + [RolloutDone(num_prompts=40)]
    flat = [s for item in stream for s in (item if isinstance(item, list) else [item])]
    budget, ranks, accum = int(rng.choice([80, 150])), int(rng.integers(1, 4)), int(rng.integers(1, 3))
    runs, put_backs = [], 0
    for items in (stream, flat):
        rollout, tracker, window = _FakeRolloutQueue(items), PromptTracker(), MetricWindow()
        collector = StepCollector(
            rollout,
            TreeBudgetPlanner(budget, ranks),
            tracker,
            max_staleness=2,
            grad_accum=accum,
            metrics=window,
        )
        # the same prefetches and versions for both; a sample put back is checked again at a later version
        steps, version, order = [], 10, np.random.default_rng(seed)
        while not collector.exhausted:
            if order.random() < 0.5:
                collector.prefetch(model_version=version)
            step = collector.collect(model_version=version)
            if step is None:
                break
            rows = [  # a filler row (end of data) holds a context-only copy, made anew by each planner
                [[len(s) if r in mb.filler_ranks else id(s) for s in row] for r, row in enumerate(mb.rows)]
                for mb in step.microbatches
            ]
            steps.append((rows, sorted(window.reduce().items())))
            collector.step_trained(step)
            version += int(order.random() < 0.4)
        runs.append((steps, tracker.state(), rollout.consumed, collector.planner.dropped_oversize_count))
        put_backs = put_backs if items is flat else rollout.put_backs
    (got, got_state, got_consumed, got_oversize), want = runs[0], runs[1]
    assert (got_state, got_consumed, got_oversize) == want[1:]
    assert got_oversize > 0 and got_state["prompt_index"] > 20  # prompts resolve as their samples are done
    assert len(got) == len(want[0]) > 2
    assert put_backs > 0  # groups closed micro-batches and went on later
    assert any(dict(metrics).get("sample/dropped_stale_count") for _, metrics in got)
    for (rows, metrics), (want_rows, want_metrics) in zip(got, want[0], strict=True):
        assert rows == want_rows
        assert metrics == want_metrics
