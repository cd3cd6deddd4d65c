"""The fused Triton LM head (``model/fused_head.py``) against the chunked torch head it replaces on CUDA.

On CPU its kernels run under Triton's interpreter, in a child pytest of ``tests/fused_head_interpreted.py`` (the
interpreter must be switched on before Triton is imported). The bf16 comparison at real shapes is
``tests/gpu/test_fused_head_gpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncgrpo_cli.model import fused_head, head
from asyncgrpo_cli.model.chunked_head import chunked_token_stats
from asyncgrpo_cli.model.head import token_stats

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_under_the_interpreter_match_the_chunked_head():
    pytest.importorskip("triton", reason="the fused head's kernels need Triton (its interpreter runs on CPU)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/fused_head_interpreted.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


def inputs(n=37, hidden=48, vocab=300, k=3):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * 0.3
    return h, w, torch.randint(0, vocab, (n,), generator=gen), torch.randint(-1, vocab, (n, k), generator=gen)


def test_without_a_gpu_auto_runs_chunked_and_triton_names_the_key(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, targets, cands = inputs()
    auto = token_stats(h, w, targets, candidate_ids=cands, kernel="auto")
    ref = chunked_token_stats(h, w, targets, candidate_ids=cands)
    assert torch.equal(auto.logprobs, ref.logprobs) and torch.equal(
        auto.candidate_logprobs, ref.candidate_logprobs
    )
    with pytest.raises(
        ValueError, match=r"model.lm_head_kernel=triton cannot run: the fused head runs on CUDA"
    ):
        token_stats(h, w, targets, kernel="triton")
    with pytest.raises(ValueError, match=r"model.lm_head_kernel='cuda': use one of auto, torch, triton"):
        token_stats(h, w, targets, kernel="cuda")


@pytest.mark.parametrize("failure", ["raises", "wrong"])
def test_auto_falls_back_to_the_chunked_head_when_the_first_use_check_fails(monkeypatch, caplog, failure):
    """A Triton build that cannot compile the kernels, or computes them wrong, is caught by auto's check once:
    one warning naming the key, then every call runs the chunked head."""
    calls = []

    class Broken:
        @staticmethod
        def apply(hidden, weight, bias, targets, cands, transform):
            calls.append(hidden.shape[0])
            if failure == "raises":
                raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 101376")
            wrong = (hidden.sum(1) + weight.sum()) * 0 + 1.0  # differentiable, far from any log-prob
            return wrong, wrong.detach(), wrong[:, None].expand(-1, cands.shape[1])

    monkeypatch.setattr(fused_head, "unsupported", lambda hidden, interpreter=False: None)
    monkeypatch.setattr(fused_head, "FusedHeadFunction", Broken)
    monkeypatch.setattr(head, "_checked", {})
    h, w, targets, cands = inputs()
    with caplog.at_level("WARNING", logger="asyncgrpo_cli.model.head"):
        first = token_stats(h, w, targets, candidate_ids=cands, kernel="auto")
        second = token_stats(h, w, targets, candidate_ids=cands, kernel="auto")
    ref = chunked_token_stats(h, w, targets, candidate_ids=cands)
    assert torch.equal(first.logprobs, ref.logprobs) and torch.equal(second.logprobs, ref.logprobs)
    assert calls == [64]  # the check alone (64 positions), once
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "model.lm_head_kernel=torch" in warnings[0]
    assert ("out of resource" if failure == "raises" else "log-probs differ") in warnings[0]


def test_the_first_use_check_runs_under_no_grad_and_inference_mode(monkeypatch):
    """The trainer's first head call may come from a no-grad probe: the check still differentiates (here with the
    chunked head standing in for the kernels, which agree with themselves)."""
    from asyncgrpo_cli.model.chunked_head import ChunkedHeadFunction
    from asyncgrpo_cli.model.head_types import LogitTransform

    class Chunked:
        @staticmethod
        def apply(h, w, b, t, c, transform):
            return ChunkedHeadFunction.apply(h, w, b, t, c, None, transform, 64, 16)

    monkeypatch.setattr(fused_head, "FusedHeadFunction", Chunked)
    monkeypatch.setattr(head, "_checked", {})
    cpu, t = torch.device("cpu"), LogitTransform(0.7, softcap=3.0)
    with torch.inference_mode():
        assert head.fused_problem(cpu, torch.bfloat16, 32, torch.zeros(1), t, 5) is None
    with torch.no_grad():
        assert head.fused_problem(cpu, torch.float32, 32, None, LogitTransform(0.9), 1) is None
    assert len(head._checked) == 2
