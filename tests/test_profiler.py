"""``trainer.profile``: kernel kinds from real H200 kernel names, the summary's per-step arithmetic, and the
profiler writing one trace and summary per run of consecutive steps (CPU)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from asyncgrpo_cli.config.schema import ProfileConfig
from asyncgrpo_cli.train.profiler import StepProfiler, kind_of, summary

H200_KERNELS = {  # names from a torch.profiler trace of a bench trainer step (torch 2.11, 0.6B shape)
    "triton_tem_fused_flex_attention_backward_transpose_view_3": "attention",
    "triton_tem_fused_flex_attention_4": "attention",
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
    "grad_kernel": "LM head (fused)",
    "stats_kernel": "LM head (fused)",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)"
    "::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor>": "optimizer",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "Memcpy DtoD (Device -> Device)": "copies",
    "void at::native::detail::chunk_cat_cuda_kernel<float, c10::BFloat16>": "copies",
    "triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0": "fused element-wise (Inductor)",
    "aten::mm": "matmul",
    "cudaStreamIsCapturing": "other",
}


@pytest.mark.parametrize("name", list(H200_KERNELS))
def test_kernel_kinds_from_real_kernel_names(name):
    assert kind_of(name) == H200_KERNELS[name]


def test_summary_is_per_step_by_kind_and_lists_the_top_kernels():
    rows = [
        ("nvjet_a", 6000.0, 20),
        ("triton_tem_fused_flex_attention_1", 3000.0, 4),
        ("triton_poi_x", 1000.0, 2),
    ]
    text = summary(rows, (5, 6), wall_s=0.02, top=2, device="cuda:0")
    first, *rest = text.splitlines()
    assert first == "steps 5-6 on cuda:0: wall 10.0 ms per step, kernel time 5.0 ms per step (50% of wall)"
    assert "| matmul | 3.00 | 60.0% |" in rest and "| attention | 1.50 | 30.0% |" in rest
    top = rest[rest.index("top 2:") + 3 :]
    assert top == [
        "| 3.00 | 10 | matmul | nvjet_a |",
        "| 1.50 | 2 | attention | triton_tem_fused_flex_attention_1 |",
    ]
    with_idle = summary(
        rows, (5, 6), wall_s=0.02, top=2, device="cuda:0", idle=["GPU idle 1.0 ms"]
    ).splitlines()
    assert with_idle.index("GPU idle 1.0 ms") < with_idle.index("top 2:")


def test_consecutive_steps_share_one_trace_and_an_open_recording_is_written_on_close(tmp_path):
    prof = StepProfiler(
        ProfileConfig(steps=[2, 3, 5, 6], top=5), tmp_path, rank=0, device=torch.device("cpu")
    )
    a = torch.randn(64, 64)
    for step in range(1, 6):  # the loop ends inside the run 5-6
        prof.before(step)
        for _ in range(3):
            a = torch.tanh(a @ a)
        prof.after(step)
    prof.close()
    names = sorted(p.name for p in prof.written)
    assert names == [
        "steps-2-3-rank-0.json.gz", "steps-2-3-rank-0.txt", "steps-5-5-rank-0.json.gz", "steps-5-5-rank-0.txt",
    ]  # fmt: skip
    trace = json.loads(gzip.decompress((tmp_path / "steps-2-3-rank-0.json.gz").read_bytes()))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    text = (tmp_path / "steps-2-3-rank-0.txt").read_text()
    assert text.startswith("steps 2-3 on cpu: wall ") and "operator self time" in text
    assert "| matmul |" in text and "| 3 | matmul | aten::mm |" in text  # 3 matmuls per step


def test_profile_settings_are_checked():
    pytest.importorskip("hydra")
    from asyncgrpo_cli.config.compose import compose_config
    from asyncgrpo_cli.errors import ConfigError

    assert compose_config(["+recipe=tiny", "trainer.profile.steps=[2,3]"]).trainer.profile.steps == [2, 3]
    with pytest.raises(ConfigError, match=r"trainer.profile.steps \[0\]: optimizer steps count from 1"):
        compose_config(["+recipe=tiny", "trainer.profile.steps=[0,1]"])
    with pytest.raises(ConfigError, match=r"trainer.profile.steps \[9\] never run: trainer.max_steps is 4"):
        compose_config(["+recipe=tiny", "trainer.max_steps=4", "trainer.profile.steps=[3,9]"])
