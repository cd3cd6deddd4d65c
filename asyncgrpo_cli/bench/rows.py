"""Synthetic GRPO rows for the GPU benchmarks (``bench trainer``, ``bench attention``): groups of completions of one
prompt filling exactly ``token_budget`` forwarded tokens, counted as the packers count them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

MIN_COMPLETION = 16
"""The shortest completion a row is filled with (a shorter rest stretches the row's last completion)."""


class RowSpec(Protocol):
    """What a row is built from (a benchmark's config): forwarded tokens per row, prompt length, completions drawn
    uniformly from [completion_len / 2, completion_len], completions per prompt, sampler top-k width."""

    token_budget: int
    prompt_len: int
    completion_len: int
    group_size: int
    num_topk: int


@dataclass
class RowPlan:
    """One rank's row for one micro-batch and the counts the FLOP formula needs."""

    samples: list[Any]
    forwarded: int = 0
    trained: int = 0
    attn_pairs: int = 0


def synthetic_row(
    rng: np.random.Generator, cfg: RowSpec, vocab: int, shared_prompt: bool, first_group: int
) -> RowPlan:
    """GRPO-like groups (``group_size`` completions of one prompt) filling exactly ``token_budget`` forwarded tokens.

    Under tree packing (``shared_prompt``) each sample's forwarded tokens and attention pairs are what the packer's
    own group trie adds for it; otherwise a sample forwards all its tokens. When the rest of the row could not hold
    another sample, the current completion is stretched (or cut) to take the rest.
    """
    from asyncgrpo_cli.packing.trie import GroupTrie
    from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK, TrainingSequence

    plan, p, k = RowPlan(samples=[]), cfg.prompt_len, cfg.num_topk
    base = -math.log(vocab)  # a random model is near uniform: importance ratios near 1
    left, group, trie = cfg.token_budget, first_group - 1, None
    while left > 0:
        if trie is None or len(trie) == cfg.group_size:
            group, trie = group + 1, GroupTrie()
            prompt = rng.integers(10, vocab, size=p)
            # every completion of a group starts with its own token: the branches part right after the prompt
            firsts = rng.choice(np.arange(10, vocab), size=cfg.group_size, replace=False)
        c = int(rng.integers(cfg.completion_len // 2, cfg.completion_len + 1))
        ids = np.concatenate([prompt, firsts[len(trie) : len(trie) + 1], rng.integers(10, vocab, size=c - 1)])
        # tokens the sample forwards beyond its completion (its prompt, or the shared token heading its branch)
        extra = (trie.probe(ids).new_tokens if shared_prompt else p + c) - c
        if left - extra - c < p + MIN_COMPLETION:  # no room for another sample: this one takes the rest
            c = left - extra
            ids = np.concatenate([ids, rng.integers(10, vocab, size=max(0, p + c - len(ids)))])[: p + c]
        att = trie.insert(ids)
        left -= extra + c
        plan.forwarded += extra + c
        plan.attn_pairs += att.new_pairs if shared_prompt else (p + c) * (p + c + 1) // 2
        plan.trained += c
        mask = np.arange(p + c) >= p
        plan.samples.append(
            TrainingSequence(
                input_ids=ids.astype(np.int64),
                train_mask=mask,
                sampler_logprobs=np.where(mask, base + rng.normal(0, 0.2, p + c), 0.0).astype(np.float32),
                advantage=float(rng.normal()),
                token_extras={
                    SAMPLER_TOPK: TopK(
                        rng.integers(10, vocab, size=(c, k)),
                        np.ascontiguousarray(
                            np.sort(base + rng.normal(0, 0.2, (c, k)), axis=1)[:, ::-1], dtype=np.float32
                        ),
                    )
                }
                if k
                else {},
                group_id=group,
                prompt_seq=group,
                group_num_samples=cfg.group_size,
            )
        )
    return plan
