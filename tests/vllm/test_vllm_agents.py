"""Multi-turn rollouts and the tool loop against real vLLM (the CPU build): ``asyncgrpo train ... server=vllm_launch``
in a subprocess, two runs (each launches vLLM once).

1. ``+recipe=tiny`` with ``rollout.loop=tests.helpers.multiturn_loop:ThreeTurnLoop``: the tiny random model never
   calls a tool, so this loop makes every rollout three sampling requests of a growing ChatML conversation. Every
   turn's sampled tokens reach the extend/fork reconciliation; the loop records them (``loop_options.record``) and
   the test checks the rule on them: the template never re-renders earlier turns, and a turn extends its sample
   exactly when the previous reply's decoded text, re-tokenized and closed by ``<|im_end|>``, begins with the
   tokens sampled. The random model often writes tokens that do not: a lone byte of a multi-byte UTF-8 character
   (decoded to U+FFFD, re-encoded as EF BF BD: only a lone 0xEF still matches), a digit run BPE splits
   differently, a special token decoding drops. About half of the 4-token replies round-trip (2 of 62 of the
   recipe's 24-token ones did), so ``sampling.max_completion_length=4`` makes both extends and forks happen in
   one run.
2. ``+recipe=tools_tiny``: the built-in IncrementEnv and the calculator tool through the tool loop (whether or not
   the model writes a call), with the environment's metrics.

Both check that weight syncs took (``sync/logprob_gap``) and that no vLLM process outlives the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncgrpo_cli.rollout.sequences import common_prefix_len
from tests.vllm.common import train_on_vllm

pytestmark = pytest.mark.vllm


def with_rollout_metrics(rows: list[dict]) -> list[dict]:
    """The rows whose window holds finished rollouts: a step trained from samples already queued while the
    rollout process waited on the token allowance logs none."""
    out = [r for r in rows if "rollout/turns_mean" in r]
    assert out, rows
    return out


def transitions(record: Path) -> list[tuple[list[int], list[int], list[int]]]:
    """(previous prompt, previous reply, next prompt) of every later turn the loop recorded."""
    out = []
    for line in record.read_text().splitlines():
        turns = json.loads(line)
        assert len(turns) == 3
        for a, b in zip(turns, turns[1:]):
            out.append((a["prompt_ids"], a["output_ids"], b["prompt_ids"]))
    return out


def test_three_turn_rollouts_extend_or_fork_on_vllm(tmp_path, vllm_python, tiny_model_dir):
    from transformers import AutoTokenizer

    record = tmp_path / "turns.jsonl"
    rows = train_on_vllm(
        tmp_path / "run",
        vllm_python,
        "+recipe=tiny",
        "rollout.loop=tests.helpers.multiturn_loop:ThreeTurnLoop",
        "+rollout.loop_options.turns=3",
        f"+rollout.loop_options.record={record}",
        "server.vllm_launch.max_model_len=512",
        "packing.token_budget=1024",
        "sampling.max_completion_length=4",
    )
    generated = with_rollout_metrics(rows)
    for r in generated:
        assert r["rollout/turns_mean"] == 3 and r["rollout/turns_max"] == 3
        # Two transitions per rollout, each fork one more sample.
        assert r["rollout/samples_per_rollout"] == pytest.approx(1 + 2 * r["rollout/fork_frac"])
    print("samples_per_rollout", [r["rollout/samples_per_rollout"] for r in generated])
    print("fork_frac", [r["rollout/fork_frac"] for r in generated])

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tok.eos_token_id
    seen = transitions(record)
    assert seen
    forks = 0
    for prompt, reply, nxt in seen:
        kept = prompt + reply
        extends = len(nxt) >= len(kept) and common_prefix_len(kept, nxt) == len(kept)
        assert nxt[: len(prompt)] == prompt  # the ChatML template never re-renders earlier turns
        # The template renders the reply's decoded text and then <|im_end|> (the eos): the turn extends its
        # sample exactly when that rendering begins with the tokens sampled. A reply cut mid-character
        # (max_tokens) can still extend: its lone lead byte 0xEF decodes to U+FFFD, whose re-encoding EF BF BD
        # begins with that byte.
        rendered = tok.encode(tok.decode(reply, skip_special_tokens=True)) + [eos]
        re_renders = rendered[: len(reply)] == reply
        # A fork comes from the reply's own tokens, never from the template.
        assert extends == re_renders, (reply, nxt[len(prompt) :])
        forks += not extends
    print(f"forks {forks}/{len(seen)} transitions")
    assert 0 < forks < len(seen)  # both paths ran


def test_tools_tiny_increment_env_on_vllm(tmp_path, vllm_python):
    rows = train_on_vllm(
        tmp_path / "run",
        vllm_python,
        "+recipe=tools_tiny",
        "server.vllm_launch.max_model_len=2048",  # the tools block of the system message is ~900 tokens
    )
    generated = with_rollout_metrics(rows)
    for r in generated:
        assert r["env/reset_s"] >= 0 and r["env/reward_s"] >= 0
        assert 0 <= r["rewards/IncrementEnv/mean"] <= 1
        assert r["tools/call_frequency"] >= 0 and r["rollout/turns_mean"] >= 1
        assert 0 <= r["tools/loop_exhausted_frac"] <= 1
    print("call_frequency", [r["tools/call_frequency"] for r in generated])
    print("turns_mean", [r["rollout/turns_mean"] for r in generated])
