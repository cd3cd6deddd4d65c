"""Harness training against real vLLM (the CPU build): ``asyncgrpo train +recipe=tiny server=vllm_launch
rollout.harness.command=[python, -m, asyncgrpo_cli.harnesses.calculator_agent]`` in a subprocess, one run that
launches vLLM once.

Every rollout runs the built-in calculator agent as its own process; it speaks ``/v1/chat/completions`` with the
calculator tool to the recording proxy, which renders the conversation with the run's template and samples
through vLLM (token ids in, sampled ids with their log-probs out). The run must finish with trained tokens, the
harness metrics must show every agent exiting cleanly and scored, and the trainer's log-probs of the proxy's
recorded tokens must match vLLM's sampler log-probs of them: on the first step (samples of the version trained)
the importance ratios are 1 within 1e-3 (a trace whose log-probs were shifted against their tokens, or taken from
another distribution, gives ratios far from it); later steps' ratios also carry the policy lag, so only their mean
is bounded loosely.

The sampling-mask path is not run here: ``--return-sampling-mask`` needs vLLM's Model Runner V2, which the CPU
build lacks (``test_vllm_sampling_mask.py``), so on this host that path runs only against the embedded server.
"""

from __future__ import annotations

import pytest

from tests.vllm.common import train_on_vllm

pytestmark = pytest.mark.vllm

STEPS = 3


def test_calculator_harness_trains_on_vllm(tmp_path, vllm_python):
    rows = train_on_vllm(
        tmp_path / "run",
        vllm_python,
        "+recipe=tiny",
        "rollout.harness.command=[python,-m,asyncgrpo_cli.harnesses.calculator_agent]",
        "rollout.harness.timeout=300",
        "server.vllm_launch.max_model_len=2048",  # the tools block of the rendered prompt is ~900 tokens
        "packing.token_budget=4096",
        steps=STEPS,
    )
    for r in rows:
        assert 0.8 < r["sampling/importance_sampling_ratio/mean"] < 1.25, r
    # Samples of the version being trained: the trainer's log-probs of the recorded tokens are vLLM's sampler
    # log-probs of them (float32 on both sides). Later steps train on samples one or two versions old, whose
    # ratios carry the policy lag too (about 0.15 nats per token at this learning rate), so only their mean is
    # bounded above.
    fresh = [r for r in rows if r["sample/staleness_max"] == 0]
    assert fresh and fresh[0]["step"] == 1, rows
    for r in fresh:
        assert r["sampling/sampling_logp_difference/max"] < 1e-3, r
        assert abs(r["sampling/importance_sampling_ratio/min"] - 1) < 1e-3, r
        assert abs(r["sampling/importance_sampling_ratio/max"] - 1) < 1e-3, r
    generated = [r for r in rows if "harness/duration_s" in r]
    assert generated, rows
    for r in generated:
        for name in (
            "harness/exit_failure_count",
            "harness/timeout_count",
            "harness/late_request_count",
            "harness/bad_output_count",
            "harness/unscored_count",
        ):
            assert r.get(name, 0) == 0, (name, r)
        assert r.get("harness/unauthorized_count", 0) == 0 and r.get("harness/rejected_request_count", 0) == 0
        assert r["harness/duration_s"] > 0
        assert r["rollout/turns_mean"] >= 1 and r["rollout/samples_per_rollout"] >= 1
    print("is_ratio", [r["sampling/importance_sampling_ratio/mean"] for r in rows])
    print("logp_diff", [r["sampling/sampling_logp_difference/mean"] for r in rows])
    print("turns_mean", [r["rollout/turns_mean"] for r in generated])
    print("duration_s", [r["harness/duration_s"] for r in generated])
