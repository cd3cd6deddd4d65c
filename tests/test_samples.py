"""The shared vocabulary (``asyncgrpo_cli/samples.py``): its docstring examples run, and named per-token extras
travel through both packers aligned with the loss terms, exactly as sampler log-probs do."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

from asyncgrpo_cli import samples as samples_mod
from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.packing.tree import TreePacker
from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK, TrainingSequence

TEACHER = "teacher_topk"  # a second extra, as the distillation loss will add it


def test_docstring_examples_run():
    result = doctest.testmod(samples_mod)
    assert result.attempted >= 8 and result.failed == 0


def _sample(s: int, ids: list[int], n_prompt: int, group: int, teacher: bool) -> TrainingSequence:
    """Extras that name their owner: the teacher's id is 100 * sample + trained index, its log-prob the sampler's."""
    ids_arr = np.asarray(ids, dtype=np.int64)
    mask = np.arange(len(ids)) >= n_prompt
    lps = np.where(mask, -0.01 * (np.arange(len(ids)) + 10 * s), 0.0).astype(np.float32)
    n = int(mask.sum())
    extras = {SAMPLER_TOPK: TopK(np.tile([[3, 4]], (n, 1)), np.full((n, 2), -1.0, np.float32))}
    if teacher:
        extras[TEACHER] = TopK(100 * s + np.arange(n)[:, None], lps[mask][:, None])
    return TrainingSequence(
        ids_arr, mask, lps, advantage=float(s), token_extras=extras, group_id=group, prompt_seq=group
    )


def _row_samples() -> list[TrainingSequence]:
    # group 0 shares a prompt (and two identical samples, one without the teacher extra); group 1 alone
    return [
        _sample(0, [1, 2, 3, 4, 5], 3, 0, True),
        _sample(1, [1, 2, 3, 4, 6], 3, 0, True),
        _sample(2, [1, 2, 3, 4, 5], 3, 0, False),
        _sample(3, [9, 8, 7], 1, 1, True),
    ]


@pytest.mark.parametrize("packer", [SequencePacker, TreePacker])
def test_extras_are_gathered_by_name_aligned_with_the_loss_terms(packer):
    row = packer(PackingConfig()).pack(_row_samples())
    assert list(row.extras) == [SAMPLER_TOPK, TEACHER]
    teacher = row.extras[TEACHER]
    assert isinstance(teacher, TopK) and teacher.ids.dtype == torch.int64
    has = row.sample_index != 2  # sample 2 carries no teacher extra: empty rows (id -1, -inf)
    assert torch.equal(teacher.ids[has, 0] // 100, row.sample_index[has])
    assert torch.equal(teacher.logprobs[has, 0], row.sampler_logprobs[has])  # bit for bit, as the log-probs
    assert (teacher.ids[~has] == -1).all() and torch.isinf(teacher.logprobs[~has]).all()
    expected = [100 * s + j for s, n in [(0, 2), (1, 2), (3, 2)] for j in range(n)]
    assert teacher.ids[has, 0].tolist() == expected
    # the head scores the ids of every top-k extra, side by side
    assert row.candidate_ids.shape == (row.num_trained, 3)
    moved = row.to("meta")
    assert moved.extras[TEACHER].ids.device.type == "meta" and row.extras[TEACHER].ids.device.type == "cpu"
    if packer is TreePacker:
        assert row.num_forwarded < row.num_unpacked  # shared prefixes, yet one extra row per loss term


def test_misaligned_extra_is_named():
    bad = _sample(0, [1, 2, 3, 4], 1, 0, False)
    bad.token_extras[TEACHER] = TopK.empty(2)  # 3 trained tokens
    with pytest.raises(ValueError, match=r"3 trained tokens but 2 rows in token_extras\['teacher_topk'\]"):
        SequencePacker(PackingConfig()).pack([bad])
    with pytest.raises(ValueError, match="one shape"):
        TopK.concat([TopK(np.zeros((2, 3), np.int64), np.zeros((2, 2), np.float32))])
