"""``asyncgrpo bench trainer``: synthetic rows fill the budget exactly and are counted as the packers count them,
the FLOP formula, argument errors, and the bench itself on CPU with the tiny shape (one process and two ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from asyncgrpo_cli.bench.rows import synthetic_row
from asyncgrpo_cli.bench.trainer import (
    SHAPES,
    TrainerBenchConfig,
    load_baseline,
    main,
    parse_args,
    step_flops,
)
from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.packing.tree import TreePacker

TINY = [
    "shapes=tiny",
    "device=cpu",
    "steps=2",
    "warmup=1",
    "token_budget=1024",
    "prompt_len=64",
    "completion_len=128",
]


@pytest.mark.parametrize("packer", [TreePacker, SequencePacker])
@pytest.mark.parametrize("budget,prompt,completion", [(1024, 64, 128), (2048, 300, 1500), (600, 512, 64)])
def test_rows_fill_the_budget_and_count_like_the_packer(packer, budget, prompt, completion):
    cfg = TrainerBenchConfig(token_budget=budget, prompt_len=prompt, completion_len=completion)
    for seed in range(5):
        plan = synthetic_row(np.random.default_rng(seed), cfg, 1024, packer is TreePacker, first_group=0)
        row = packer(PackingConfig()).pack(plan.samples)
        assert plan.forwarded == row.num_forwarded == budget
        assert plan.trained == row.num_trained
        # each token sees its root-to-token path: depth + 1 keys
        assert plan.attn_pairs == int((row.position_ids + 1).sum())


def _plan():
    cfg = TrainerBenchConfig(token_budget=1024, prompt_len=64, completion_len=128)
    return synthetic_row(np.random.default_rng(0), cfg, 1024, False, 0)


def test_step_flops_by_hand():
    import torch
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.bench.shapes import shape_config
    from asyncgrpo_cli.train.flops import StepFlops

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(SHAPES["tiny"]))
    f, plan = StepFlops(model), _plan()
    flops = step_flops(f, plans=[plan])
    assert f.body == sum(p.numel() for p in model.parameters()) - 1024 * 128  # tied: one matrix
    assert flops["dense"] == 6 * f.body * 1024
    assert flops["head"] == 6 * 1024 * 128 * plan.trained
    assert flops["attention"] == 12 * 2 * 4 * 32 * plan.attn_pairs
    assert flops["linear"] == 0
    assert flops["total"] == flops["dense"] + flops["head"] + flops["attention"]


def test_the_hybrid_shape_is_qwen3_5_2b_and_counts_its_delta_rule():
    import torch
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.bench.shapes import shape_config
    from asyncgrpo_cli.train.flops import StepFlops

    config = shape_config(SHAPES["qwen3.5-2b"])
    assert type(config).__name__ == "Qwen3_5TextConfig" and config.layer_types.count("full_attention") == 6
    with torch.device("meta"):  # 1.9B parameters: shapes only
        model = AutoModelForCausalLM.from_config(config)
    f, plan = StepFlops(model), _plan()
    flops = step_flops(f, plans=[plan])
    assert flops["attention"] == 12 * 6 * 8 * 256 * plan.attn_pairs  # the 6 gated-attention layers only
    assert flops["linear"] == 3 * 18 * 16 * (64 * 8 * 128 + 6 * 128 * 128) * 1024
    assert f.head == 248320 * 2048 and f.body == f.total_body


def test_bad_arguments_name_the_key():
    with pytest.raises(UserError, match="did you mean 'token_budget'"):
        parse_args(["token_budgt=1024"])
    with pytest.raises(
        UserError, match=r"bench.shapes \(7b\): pick from 0.6b, 1.7b, qwen3.5-2b, tiny-qwen3.5, tiny"
    ):
        parse_args(["shapes=7b"])
    assert parse_args(["precision=bf16", "compile=true"]).compile is True
    with pytest.raises(
        UserError, match=r"bench.linear_attention_kernel \(triton\) must be auto, torch or fla"
    ):
        parse_args(["linear_attention_kernel=triton"])
    assert parse_args(["flex_options=fwd_64x64_w4+bwd_64_w4"]).flex_options == "fwd_64x64_w4+bwd_64_w4"
    with pytest.raises(UserError, match=r"bench.flex_options \(fwd_64x64_w4\+fast\): names among default"):
        parse_args(["flex_options=fwd_64x64_w4+fast"])
    assert parse_args(["one_rank_cast=foreach"]).one_rank_cast == "foreach"
    with pytest.raises(UserError, match=r"bench.one_rank_cast \(fast\) must be torch or foreach"):
        parse_args(["one_rank_cast=fast"])


def test_flex_options_merge_a_forward_and_a_backward_candidate():
    from asyncgrpo_cli.bench.attention import KERNEL_OPTIONS, merged_options

    merged = merged_options("fwd_64x64_w4+bwd_64_w4")
    assert merged == {**KERNEL_OPTIONS["fwd_64x64_w4"], **KERNEL_OPTIONS["bwd_64_w4"]}
    assert merged["fwd_BLOCK_M"] == 64 and merged["bwd_num_warps"] == 4 and merged_options("default") == {}


def test_flex_options_torch_turns_the_tuned_options_off():
    from asyncgrpo_cli.bench.attention import KERNEL_OPTIONS, use_candidates
    from asyncgrpo_cli.config.schema import ModelConfig

    cfg = ModelConfig()
    use_candidates(cfg, "torch")
    assert cfg.flex_kernel_options == {} and cfg.flex_tuned_options is False
    use_candidates(cfg, "bwd_64_w4")
    assert cfg.flex_kernel_options == KERNEL_OPTIONS["bwd_64_w4"] and cfg.flex_tuned_options is True


def test_a_baseline_of_other_work_is_flagged(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"config": {"token_budget": 8192}, "results": [{"shape": "0.6b"}]}))
    by_shape, differs = load_baseline(str(path), TrainerBenchConfig())
    assert set(by_shape) == {"0.6b"} and "token_budget" in differs and "precision" in differs
    path.write_text("{}")
    with pytest.raises(UserError, match="bench.baseline=.* is not a JSON written by out="):
        load_baseline(str(path), TrainerBenchConfig())


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_bench_on_cpu_writes_json_and_scales_against_a_baseline(tmp_path, capsys, precision):
    base, again = tmp_path / "base.json", tmp_path / "again.json"
    main([*TINY, f"precision={precision}", f"out={base}"])
    main([*TINY, f"precision={precision}", f"out={again}", f"baseline={base}"])
    out = capsys.readouterr().out
    assert "MFU" in out and "6·N·T" in out
    r = json.loads(again.read_text())["results"][0]
    assert r["shape"] == "tiny" and r["world_size"] == 1 and r["tokens_per_step"] == 1024
    assert r["tokens_per_s"] > 0 and r["model_tflops_per_gpu"] > 0 and r["mfu"] is None  # no peak on CPU
    assert r["scaling_efficiency"] > 0
    assert r["flex_kernels"] is None  # SDPA on CPU: no flex kernels to name


def test_the_table_names_the_flex_kernels_that_ran():
    from asyncgrpo_cli.bench.trainer_report import table_row

    r = dict(shape="0.6b", world_size=1, tokens_per_step=16384, step_s=0.25, optimizer_s=0.01, tokens_per_s=6e4,
             tokens_per_s_per_gpu=6e4, model_tflops_per_gpu=300.0, mfu=0.3, peak_allocated_gib=29.0,
             attn_implementation="asyncgrpo_flex", flex_options="default", flex_kernels="flash")  # fmt: skip
    assert table_row(r).endswith("asyncgrpo_flex, flash kernels")
    assert table_row({**r, "flex_options": "triton", "flex_kernels": "triton"}).endswith(
        "asyncgrpo_flex (triton), triton kernels"
    )


def test_profile_records_untimed_steps_after_the_timed_ones(tmp_path, capsys):
    out = tmp_path / "prof.json"
    main([*TINY, "profile=2", f"out={out}"])  # warm-up 1, timed 2-3, profiled 4-5
    printed = capsys.readouterr().out
    assert "steps 4-5 on cpu: wall " in printed and "| matmul |" in printed
    r = json.loads(out.read_text())["results"][0]
    assert r["profile_summary"].startswith("steps 4-5 on cpu") and r["step_s"] > 0
    traces = sorted(p.name for p in (tmp_path / "prof-profile" / "tiny").iterdir())
    assert traces == ["steps-4-5-rank-0.json.gz", "steps-4-5-rank-0.txt"]


@pytest.mark.parametrize("packing", ["tree", "sequence"])
def test_bench_runs_the_tiny_hybrid_through_load_policy_on_cpu(tmp_path, capsys, packing):
    out = tmp_path / "hybrid.json"
    args = [a for a in TINY if not a.startswith("shapes=")]
    main([*args, "shapes=tiny-qwen3.5", "steps=1", f"packing={packing}", f"out={out}"])
    assert "gated DeltaNet: torch" in capsys.readouterr().out  # the kernel that ran: pure torch on CPU
    r = json.loads(out.read_text())["results"][0]
    assert r["shape"] == "tiny-qwen3.5" and r["linear_attention_kernel"] == "torch"
    assert r["tokens_per_step"] == 1024 and r["model_tflops_per_gpu"] > 0 and r["mfu"] is None


@pytest.mark.dist
@pytest.mark.slow
def test_bench_under_torchrun_on_two_cpu_ranks(tmp_path):
    base, two = tmp_path / "base.json", tmp_path / "two.json"
    main([*TINY, f"out={base}"])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "asyncgrpo_cli",
        "bench",
        "trainer",
        *TINY,
        f"out={two}",
        f"baseline={base}",
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(two.read_text())["results"][0]
    assert r["world_size"] == 2 and r["tokens_per_step"] == 2048 and r["baseline_world_size"] == 1
    assert r["scaling_efficiency"] > 0


def test_one_process_packs_the_next_first_row_under_the_step(tmp_path, monkeypatch):
    """As the trainer in one process: every step after the first gets its first row packed in the previous step's
    ``overlap``, and it is the row the packer makes of that step's own first sample list."""
    import torch

    from asyncgrpo_cli.bench import trainer as bench
    from asyncgrpo_cli.train import step as step_mod
    from asyncgrpo_cli.train.distributed import destroy_distributed, init_distributed

    seen = []
    real = step_mod.forward_backward

    def recording(model, rows, *args, first_row=None, overlap=None, **kwargs):
        seen.append((rows[0], first_row, overlap is not None))
        return real(model, rows, *args, first_row=first_row, overlap=overlap, **kwargs)

    monkeypatch.setattr(step_mod, "forward_backward", recording)
    cfg = parse_args([*TINY, "steps=2", "warmup=1"])
    device = torch.device("cpu")
    info = init_distributed(device, 60.0)
    try:  # FSDP2 starts a one-rank process group; the next test must not find it
        t = bench.build_trainer("tiny", cfg, info, device, tmp_path)
        step_s, _, flops = bench.timed_steps(t, cfg, info, device)
    finally:
        destroy_distributed()
    assert len(seen) == 3 and len(step_s) == 2 and flops > 0
    assert seen[0][1] is None and all(overlapped for *_, overlapped in seen)
    for samples, first_row, _ in seen[1:]:
        again = t.packer.pack(samples)
        assert first_row is not None and torch.equal(first_row.input_ids, again.input_ids)
        assert torch.equal(first_row.pred_index, again.pred_index) and torch.equal(
            first_row.leave, again.leave
        )


def test_flex_options_flash_sets_the_flash_backend():
    from asyncgrpo_cli.bench.attention import use_candidates
    from asyncgrpo_cli.config.schema import ModelConfig

    cfg = ModelConfig()
    use_candidates(cfg, "flash")
    assert cfg.flex_backend == "flash" and cfg.flex_kernel_options == {}
    use_candidates(cfg, "fwd_64x64_w4")  # Triton tiles: the Triton kernels, whatever is installed
    assert cfg.flex_backend == "triton" and cfg.flex_kernel_options["fwd_BLOCK_M"] == 64
    use_candidates(cfg, "default")
    assert cfg.flex_backend == "auto" and cfg.flex_kernel_options == {}
