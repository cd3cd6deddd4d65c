"""``asyncgrpo bench distill-loss`` on tiny CPU shapes: one table row per teacher top-k, both paths measured, their
losses equal; the synthetic teacher follows the TeacherTopK layout; bad options name the key."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo_cli.bench.distill_loss import HEADER, parse_args, teacher_topk
from asyncgrpo_cli.errors import UserError


def test_bench_distill_loss_table(capsys, one_torch_thread):
    from asyncgrpo_cli.bench.distill_loss import main

    main(["device=cpu", "tokens=48", "vocab=512", "hidden=32", "top_k=4,16", "repeats=1", "beta=0.5"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert lines[0] == "| " + " | ".join(HEADER) + " |"
    rows = [
        dict(zip(HEADER, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[1:]
    ]
    assert [r["top-k"] for r in rows] == ["4", "16"]
    for r in rows:
        assert r["T x H x V"] == "48 x 32 x 512" and r["dtype"] == "fp32"
        assert float(r["naive ms"]) >= 0 and float(r["chunked ms"]) >= 0
        assert float(r["naive peak MiB"]) >= 0 and r["memory naive/chunked"].endswith("x")
        assert float(r["loss (chunked)"]) > 0 and float(r["|Δ loss|"]) < 1e-4


def test_synthetic_teacher_layout():
    targets, ids, lps = teacher_topk(200, 64, 8, torch.Generator().manual_seed(0))
    top = ids[:, :8]
    assert all(len(set(r)) == 8 for r in top.tolist())  # distinct top-K ids
    assert (lps[:, :8].diff(dim=1) <= 0).all()  # by rank
    outside = ids[:, 8] >= 0
    assert 0.3 < outside.float().mean() < 0.7
    assert (ids[outside, 8] == targets[outside]).all() and not (top[outside] == targets[outside, None]).any()
    assert (top[~outside] == targets[~outside, None]).any(1).all() and torch.isneginf(lps[~outside, 8]).all()
    mass = torch.where(ids >= 0, lps.exp(), 0.0).sum(1)
    assert (mass < 1).all() and (lps[outside, 8] <= lps[outside, 7]).all()


def test_bench_options():
    cfg = parse_args(["tokens=128", "top_k=8", "dtype=bf16", "beta=1"])
    assert cfg.tokens == 128 and cfg.top_k == [8] and cfg.dtype == "bf16" and cfg.beta == 1.0
    assert parse_args([]).top_k == [8, 64] and parse_args(["top_k=[2,3]"]).top_k == [2, 3]
    with pytest.raises(UserError, match="bench.tokn is not a field .*did you mean 'tokens'"):
        parse_args(["tokn=3"])
    with pytest.raises(UserError, match=r"bench.dtype \(fp16\) must be fp32 or bf16"):
        parse_args(["dtype=fp16"])
    with pytest.raises(UserError, match="'cpu' is not KEY=VALUE"):
        parse_args(["cpu"])
    with pytest.raises(UserError, match=r"bench.vocab \(16\) must be at least"):
        parse_args(["vocab=16", "top_k=8"])
