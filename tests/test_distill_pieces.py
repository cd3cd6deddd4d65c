"""Distillation pieces on plain data: the scorer's mapping of teacher rows, MOPD routing, the fixed-count planner,
data columns / mixtures / GSM8K, and the metric renames of the distillation logging group."""

from __future__ import annotations

import asyncio
import json
import math

import datasets
import numpy as np
import pytest

from asyncgrpo_cli.config.schema import DataConfig, LoggingConfig
from asyncgrpo_cli.data.sources import load_prompts
from asyncgrpo_cli.distill.loop import route_rows
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.packing.planner import FixedCountPlanner
from asyncgrpo_cli.rollout.scorers import ScorerContext
from asyncgrpo_cli.rollout.scorers.distill import DistillScorer, attach_teacher
from asyncgrpo_cli.samples import (
    TEACHER_TOPK,
    Rollout,
    RolloutGroup,
    TeacherTopK,
    TrainingSequence,
    TurnRecord,
)


def _sample(prompt_len: int, completion_len: int) -> TrainingSequence:
    n = prompt_len + completion_len
    mask = np.zeros(n, dtype=bool)
    mask[prompt_len:] = True
    lps = np.where(mask, -0.5, 0.0).astype(np.float32)
    return TrainingSequence(
        input_ids=np.arange(n, dtype=np.int64) + 10, train_mask=mask, sampler_logprobs=lps
    )


def _scores(n: int, k: int = 2, missing: tuple[int, ...] = (), teacher: int = 0) -> TeacherTopK:
    ids = np.arange(n * (k + 1), dtype=np.int64).reshape(n, k + 1)
    lps = np.full((n, k + 1), -1.0, dtype=np.float32)
    ids[list(missing)] = -1
    lps[list(missing)] = -np.inf
    return TeacherTopK(ids, lps, teacher=np.full(n, teacher), teacher_names=("code", "math"))


def test_teacher_rows_map_to_trained_tokens_and_unscored_positions_become_context():
    s = _sample(3, 4)
    lost = attach_teacher(s, _scores(4, missing=(1,)), start=3)
    assert lost == 1
    assert s.train_mask.tolist() == [False, False, False, True, False, True, True]
    assert s.sampler_logprobs[4] == 0.0 and s.num_trained == 3
    extra = s.token_extras[TEACHER_TOPK]
    assert len(extra) == 3 and extra.ids[:, 0].tolist() == [0, 6, 9]  # rows 0, 2, 3 of the teacher's
    assert extra.teacher_names == ("code", "math")


def test_teacher_rows_must_cover_the_trained_positions():
    with pytest.raises(RuntimeError, match="single-turn"):
        attach_teacher(_sample(3, 4), _scores(2), start=3)


def _group(rollouts, seqs) -> RolloutGroup:
    return RolloutGroup(
        prompts=[[{"role": "user", "content": "1+1"}]] * len(rollouts),
        reward_kwargs={"solution": ["2"] * len(rollouts)},
        completions=[r.completion for r in rollouts],
        completions_ids=[r.completion_ids for r in rollouts],
        completions_sequences=seqs,
        model_version=3,
        group_id=7,
        row_index=0,
        rollout_rewards=[None] * len(rollouts),
        prompt_seq=11,
        epoch=0,
        rollouts=list(rollouts),
    )


def _rollout(prompt_len: int, completion_len: int, scores: TeacherTopK | None) -> Rollout:
    turn = TurnRecord(list(range(prompt_len)), list(range(completion_len)), [-0.5] * completion_len)
    r = Rollout([{"role": "assistant", "content": "2"}], list(range(completion_len)), [turn])
    if scores is not None:
        r.extras[TEACHER_TOPK] = scores
    return r


def test_distill_scorer_stamps_one_sample_per_rollout_without_advantage():
    from asyncgrpo_cli.rollout.rewards import load_reward_funcs

    metrics = MetricWindow()
    scorer = DistillScorer(ScorerContext(load_reward_funcs(["accuracy"]), metrics, None, None))
    r = _rollout(3, 4, _scores(4, missing=(0,)))
    scored = asyncio.run(scorer.score(_group([r], [[_sample(3, 4)]])))
    (s,) = scored.samples
    assert scored.drop_reason is None
    assert (s.advantage, s.group_id, s.prompt_seq, s.model_version, s.group_num_samples) == (0.0, 7, 11, 3, 1)
    assert s.reward == 1.0  # accuracy is logged, not trained on
    out = metrics.reduce()
    assert out["reward"] == 1.0 and out["rewards/accuracy/mean"] == 1.0
    assert out["rollout/teacher_unscored_token_frac"] == pytest.approx(0.25)


def test_teacher_logprob_reads_the_sampled_tokens_column():
    from asyncgrpo_cli.rollout.scorers.distill import sampled_logprobs

    s = _sample(1, 2)  # trains tokens 11 and 12
    ids = np.array([[11, 3, -1], [4, 5, 12]])
    lps = np.array([[-0.2, -1.0, -np.inf], [-0.1, -0.3, -2.5]], np.float32)
    s.token_extras[TEACHER_TOPK] = TeacherTopK(ids, lps)
    np.testing.assert_allclose(sampled_logprobs(s), [-0.2, -2.5])


def test_distill_scorer_drops_a_rollout_the_teacher_scored_nowhere_and_needs_the_distill_loop():
    scorer = DistillScorer(ScorerContext([], MetricWindow(), None, None))
    r = _rollout(2, 2, _scores(2, missing=(0, 1)))
    scored = asyncio.run(scorer.score(_group([r], [[_sample(2, 2)]])))
    assert scored.samples == [] and scored.drop_reason == "no_samples"
    with pytest.raises(RuntimeError, match="rollout.loop=distill"):
        asyncio.run(scorer.score(_group([_rollout(2, 2, None)], [[_sample(2, 2)]])))


def test_mopd_routing_names_the_row_and_the_known_ids():
    ds = datasets.Dataset.from_list(
        [{"prompt": "a", "teacher_id": "math"}, {"prompt": "b", "teacher_id": "chem"}]
    )
    with pytest.raises(UserError, match=r"row 1 of the dataset has teacher_id='chem'.*known ids: code, math"):
        route_rows(ds, ("code", "math"), "teacher_id")
    with pytest.raises(UserError, match=r"no 'teacher_id' column \(teacher.id_column\)"):
        route_rows(ds.remove_columns("teacher_id"), ("code", "math"), "teacher_id")
    route_rows(ds.remove_columns("teacher_id"), ("default",), "teacher_id")  # one teacher: no column needed
    route_rows(ds.select([0]), ("code", "math"), "teacher_id")


def test_fixed_count_planner_takes_n_samples_per_row_balanced_by_cost():
    p = FixedCountPlanner(samples_per_row=2, num_ranks=2, max_len=100)
    lengths = [10, 40, 12, 30]
    out = [p.add(_sample(L - 2, 2)) for L in lengths]
    assert out[:3] == [None, None, None]
    mb = out[3]
    assert mb.samples_per_row.sum() == 4  # samples_per_row x num_ranks, split by attention cost, not by count
    assert sorted(sorted(len(s) for s in row) for row in mb.rows) == [[10, 12, 30], [40]]  # 1144 vs 1600
    assert mb.token_budget == 200 and p.num_open_samples == 0
    p.add(_sample(3, 2))
    assert p.flush(allow_filler=False) is None  # one sample, two ranks: wait for more
    last = p.flush()
    assert last.filler_ranks and last.num_trained == 2


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_data_columns_and_mix_concatenate_the_shared_columns(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"question": "1+1?", "solution": "2"}] * 3)
    b = _jsonl(tmp_path / "b.jsonl", [{"instruction": "write code", "output": "x"}] * 2)
    cfg = DataConfig(
        source="hf",
        path=a,
        prompt_column="question",
        columns={"teacher_id": "math"},
        mix=[{"path": b, "prompt_column": "instruction", "columns": {"teacher_id": "code"}}],
    )
    ds = load_prompts(cfg)
    assert sorted(ds.column_names) == ["prompt", "teacher_id"]
    assert ds["teacher_id"] == ["math"] * 3 + ["code"] * 2
    assert ds[4]["prompt"] == [{"role": "user", "content": "write code"}]
    with pytest.raises(
        UserError, match=r"data.mix\[0\].promt_column is not a data setting; did you mean 'prompt_column'"
    ):
        load_prompts(DataConfig(source="hf", path=a, mix=[{"promt_column": "x"}]))


def test_gsm8k_takes_the_number_after_the_hashes(tmp_path):
    path = _jsonl(
        tmp_path / "gsm8k.jsonl", [{"question": "Sam has 3 ...", "answer": "3 + 4 = 7\n#### 1,007"}]
    )
    ds = load_prompts(DataConfig(source="gsm8k", path=path))
    assert ds[0]["solution"] == "1007" and ds[0]["prompt"][0]["content"] == "Sam has 3 ..."


def test_the_distill_logging_group_renames_counters_to_total(tmp_path):
    from asyncgrpo_cli.config.compose import compose_config
    from asyncgrpo_cli.metrics.logger import MetricsLogger

    cfg = compose_config(["+recipe=distill_tiny"]).logging
    assert cfg.rename["sample/dropped_stale_count"] == "sample/dropped_stale_total"
    w = MetricWindow()
    for _ in range(3):
        w.add("sample/dropped_stale_count", 1)
    w.set_gauge("rollout/concurrency", 5)
    with MetricsLogger(LoggingConfig(sinks=["jsonl"], rename=cfg.rename), tmp_path, {}, None, None) as logger:
        logger.log(1, w.reduce())
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["sample/dropped_stale_total"] == 3 and row["rollout/inflight"] == 5
    assert "sample/dropped_stale_count" not in row and not math.isnan(row["sample/dropped_stale_total"])
