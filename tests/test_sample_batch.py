"""A group's samples cross the process boundary as one ``SampleBatch``: every field comes back equal (values,
dtypes, shapes, writable arrays), whatever the group holds, and the trainer's reader hands them out one by one
in order, interleaved with the queue's markers."""

from __future__ import annotations

import pickle
import queue
from dataclasses import dataclass, fields

import numpy as np
import pytest

from asyncgrpo_cli.sample_batch import QueueReader, SampleBatch
from asyncgrpo_cli.samples import (
    SAMPLER_TOPK,
    TEACHER_TOPK,
    CandidateSets,
    PromptResolved,
    RolloutDone,
    TeacherTopK,
    TopK,
    TrainingSequence,
)


@dataclass
class Scores:
    """A user's token extra: arrays of two first dimensions and a plain field."""

    values: np.ndarray
    flags: np.ndarray
    label: str = ""


@dataclass
class Tagged(TrainingSequence):
    """A user's sample subclass: its group travels as a plain list."""

    tag: str = "x"


def sample(rng: np.random.Generator, i: int, *, extras: dict | None = None, **kw) -> TrainingSequence:
    n = int(rng.integers(1, 9))
    p = int(rng.integers(1, 6))
    mask = np.zeros(p + n, bool)
    mask[p:] = True
    k = 3
    base = dict(
        input_ids=rng.integers(0, 50, p + n).astype(np.int64),
        train_mask=mask,
        sampler_logprobs=np.where(mask, -rng.random(p + n), 0).astype(np.float32),
        advantage=float(rng.normal()),
        token_extras={SAMPLER_TOPK: TopK(rng.integers(0, 50, (n, k)), -rng.random((n, k)).astype(np.float32))}
        if extras is None
        else extras,
        rollout_id=f"r{i}",
        group_id=7,
        prompt_seq=3,
        group_num_samples=4,
        model_version=2,
        enqueued_at=123.5 + i,
        reward=float(i),
        reward_group_std=0.5,
        reward_func_group_std={"acc": 0.25},
    )
    base.update(kw)
    return TrainingSequence(**base)


def assert_same(a, b) -> None:
    """Equal values, types, dtypes and shapes, field by field, recursively through dataclasses and dicts."""
    assert type(a) is type(b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif hasattr(a, "__dataclass_fields__"):
        for f in fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b)
    else:
        assert a == b


def round_trip(samples: list) -> list:
    return pickle.loads(pickle.dumps(SampleBatch(samples))).samples


def test_every_field_round_trips_as_views_of_columns():
    rng = np.random.default_rng(0)
    group = [sample(rng, i) for i in range(5)]
    group[2].sampling_mask = CandidateSets.from_lists([[1, 2]] * group[2].num_trained)
    back = round_trip(group)
    for a, b in zip(group, back, strict=True):
        assert_same(a, b)
        assert b.input_ids.flags.writeable and b.token_extras[SAMPLER_TOPK].ids.flags.writeable
    assert back[0].input_ids.base is not None and back[0].input_ids.base is back[4].input_ids.base
    back[1].input_ids[0] = 49  # a view of the column: writing one sample leaves the others as they were
    assert_same(back[0].input_ids, group[0].input_ids)


def test_columns_come_back_with_numpys_own_dtype_objects():
    """An unpickled array's dtype equals numpy's but is another object; the planner's fast paths test dtypes by
    identity, so the columns come back as views with numpy's own (values, writability and sharing unchanged)."""
    rng = np.random.default_rng(4)
    back = round_trip([sample(rng, i) for i in range(3)])
    assert pickle.loads(pickle.dumps(np.zeros(2, np.bool_))).dtype is not np.dtype(
        np.bool_
    )  # why this matters
    for s in back:
        extra = s.token_extras[SAMPLER_TOPK]
        for array in (s.input_ids, s.train_mask, s.sampler_logprobs, extra.ids, extra.logprobs):
            assert array.dtype is np.dtype(array.dtype.type) and array.flags.writeable
    assert back[0].train_mask.base is back[2].train_mask.base


def test_one_message_is_cheaper_to_send_than_its_samples():
    rng = np.random.default_rng(1)
    group = [sample(rng, i) for i in range(16)]
    assert len(pickle.dumps(SampleBatch(group))) < sum(len(pickle.dumps(s)) for s in group)


@pytest.mark.parametrize(
    "case",
    ["teacher", "user_extra", "mixed_extras", "extra_missing", "mixed_dtypes", "lists", "one", "subclass"],
)
def test_any_group_comes_back_equal(case):
    rng = np.random.default_rng(2)
    group = [sample(rng, i) for i in range(4)]
    if case == "teacher":
        for s in group:
            n = s.num_trained
            s.token_extras[TEACHER_TOPK] = TeacherTopK(
                rng.integers(0, 50, (n, 4)), -rng.random((n, 4)).astype(np.float32),
                teacher=rng.integers(0, 2, n), teacher_names=("a", "b"),
            )  # fmt: skip
    elif case == "user_extra":
        for i, s in enumerate(group):
            s.token_extras["scores"] = Scores(rng.random((s.num_trained, 2)), np.ones(i + 1, bool), f"s{i}")
    elif case == "mixed_extras":  # one extra of two classes in a group: sent per sample
        group[1].token_extras[SAMPLER_TOPK] = TeacherTopK.empty(group[1].num_trained)
    elif case == "extra_missing":
        group[3].token_extras = {}
    elif case == "mixed_dtypes":  # nothing is converted: such a group travels as a plain list
        group[2].sampler_logprobs = group[2].sampler_logprobs.astype(np.float64)
    elif case == "lists":
        group[0].input_ids = group[0].input_ids.tolist()
    elif case == "one":
        group = group[:1]
    elif case == "subclass":
        group[1] = Tagged(**{f.name: getattr(group[1], f.name) for f in fields(TrainingSequence)}, tag="y")
    back = round_trip(group)
    for a, b in zip(group, back, strict=True):
        assert_same(a, b)
    columns = case not in ("mixed_dtypes", "lists", "subclass")
    assert (back[-1].input_ids.base is not None) == columns  # views of the columns, or the arrays as sent


def test_the_reader_hands_out_samples_in_order_between_markers():
    rng = np.random.default_rng(3)
    q: queue.Queue = queue.Queue()
    first, second = [sample(rng, i) for i in range(3)], [sample(rng, i) for i in range(2)]
    loose = sample(rng, 9)
    for item in (
        SampleBatch(first),
        PromptResolved(5, "filtered"),
        loose,
        SampleBatch([]),
        SampleBatch(second),
    ):
        q.put(pickle.loads(pickle.dumps(item)))
    q.put(RolloutDone(num_prompts=2))
    reader, got = QueueReader(q), []
    while True:
        try:
            got.append(reader.get(timeout=0.01))
        except queue.Empty:
            if not q.qsize():
                break
    assert [type(x).__name__ for x in got] == ["TrainingSequence"] * 3 + [
        "PromptResolved", "TrainingSequence", "TrainingSequence", "TrainingSequence", "RolloutDone",
    ]  # fmt: skip
    for a, b in zip(
        [*first, loose, *second], [x for x in got if isinstance(x, TrainingSequence)], strict=True
    ):
        assert_same(a, b)
    assert reader.taken == 6
    with pytest.raises(queue.Empty):
        reader.get_nowait()


def test_the_reader_hands_out_groups_and_takes_back_what_was_not_used():
    """``group=True``: what is left of a batch as one list (a lone sample: a list of one); ``put_back`` returns
    samples to the front, for either way of reading next, and they count as not taken."""
    rng = np.random.default_rng(4)
    q: queue.Queue = queue.Queue()
    group, loose = [sample(rng, i) for i in range(4)], sample(rng, 9)
    for item in (SampleBatch(group), PromptResolved(5, "filtered"), loose):
        q.put(pickle.loads(pickle.dumps(item)))
    reader = QueueReader(q)
    got = reader.get(timeout=0.01, group=True)
    assert isinstance(got, list) and len(got) == 4 and reader.taken == 4
    for a, b in zip(group, got, strict=True):
        assert_same(a, b)
    reader.put_back(got[1:])  # the first closed a micro-batch: the rest come back
    assert reader.taken == 1
    assert reader.get_nowait() is got[1]  # one at a time from the front
    assert reader.get_nowait(group=True) == got[2:]  # the rest of the group
    assert reader.taken == 4
    assert isinstance(reader.get_nowait(group=True), PromptResolved)
    last = reader.get_nowait(group=True)
    assert len(last) == 1 and reader.taken == 5
    assert_same(loose, last[0])
    with pytest.raises(queue.Empty):
        reader.get_nowait(group=True)


@pytest.mark.slow
def test_bench_transport_takes_every_sample_both_ways(capsys):
    """The benchmark's spawned producer sends a small step per sample and per group; every round delivers it."""
    from asyncgrpo_cli.bench.transport import main
    from asyncgrpo_cli.errors import UserError

    main(["samples=40", "group_size=8", "prompt_len=8", "rounds=2"])
    out = capsys.readouterr().out
    assert "40 samples in groups of 8" in out and "| per sample |" in out and "| per group |" in out
    assert "trainer CPU" in out.splitlines()[-1]
    with pytest.raises(UserError, match="bench.rounds"):
        main(["rounds=x"])
