"""``asyncgrpo bench attention`` on CPU (the smoke path: eager forward of ``default``): its rows and masks are the
packers' and the training step's, the block density it reports is the dense mask's, and argument errors name
the key."""

from __future__ import annotations

import json

import pytest

from asyncgrpo_cli.bench.attention import KERNEL_OPTIONS, main, packed_mask, parse_args
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.packing.attention import FLEX_BLOCK_SIZE

TINY = ["shapes=tiny", "device=cpu", "prompt_len=64", "completion_len=128", "repeats=1", "warmup=0"]


@pytest.mark.parametrize("packing", ["tree", "sequence"])
def test_the_reported_block_density_is_the_dense_masks(packing):
    import numpy as np
    import torch

    from asyncgrpo_cli import registry
    from asyncgrpo_cli.bench.attention import _RowSpec
    from asyncgrpo_cli.bench.rows import synthetic_row
    from asyncgrpo_cli.config.schema import PackingConfig
    from asyncgrpo_cli.packing.attention import dense_mask

    cfg = parse_args([*TINY, f"packing={packing}", "token_budget=2048"])
    mask, row = packed_mask(cfg, 2048, 1024, torch.device("cpu"))
    assert row["forwarded"] == 2048 and row["padded_length"] == 2048
    # the same row again, its dense mask counted block by block
    plan = synthetic_row(
        np.random.default_rng(cfg.seed), _RowSpec(2048, 64, 128, 8, 0), 1024, packing == "tree", 0
    )
    packed = registry.resolve("packer", packing)(PackingConfig(kind=packing)).pack(plan.samples)
    dense = dense_mask(packed.leave)[0, 0]
    n = dense.shape[0] // FLEX_BLOCK_SIZE
    attended = dense.view(n, FLEX_BLOCK_SIZE, n, FLEX_BLOCK_SIZE).any(dim=(1, 3))
    assert row["block_density"] == attended.sum().item() / n**2
    assert 0 < row["block_density"] < 1


def test_cpu_run_times_the_default_forward_and_writes_json(tmp_path, capsys):
    out = tmp_path / "attention.json"
    main([*TINY, "token_budget=1024,2048", f"out={out}"])
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [(r["forwarded"], r["options"]) for r in rows] == [(1024, "default"), (2048, "default")]
    for r in rows:
        assert r["forward_ms"] > 0 and r["forward_backward_ms"] is None and "error" not in r
        assert r["forward_speedup"] == 1.0 and r["heads"] == "4/2x32"
    printed = capsys.readouterr().out
    assert "| tiny | 2048 | default |" in printed and "of the mask's blocks attended" in printed


@pytest.mark.parametrize(
    "arg,names",
    [
        ("options=default,fast", "bench.options ['fast']"),
        ("packing=dense", "bench.packing (dense)"),
        ("token_budget=16k", "bench.token_budget[0] must be an integer"),
        ("shapes=7b", "bench.shapes"),
    ],
)
def test_argument_errors_name_the_key(arg, names):
    with pytest.raises(UserError, match="asyncgrpo bench attention") as e:
        parse_args([*TINY, arg])
    assert names in str(e.value)


def test_every_candidate_keeps_the_masks_block_size_divisible():
    """A candidate's block sizes must divide the BlockMask's (else torch refuses it before any kernel runs)."""
    for name, options in KERNEL_OPTIONS.items():
        for key, value in options.items():
            if "BLOCK_" in key:
                assert FLEX_BLOCK_SIZE % value == 0, (name, key)
