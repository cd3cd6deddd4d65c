"""Models load without the Hugging Face Hub's kernels: transformers 5.25 turned ``use_kernels`` on by default
(``model/loading.py`` NO_HUB_KERNELS), which on CUDA swaps layers for kernels fetched from the Hub at load time."""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version

from asyncgrpo_cli.config.schema import ModelConfig


def test_the_policy_and_the_embedded_servers_model_load_without_hub_kernels(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.embedded.model import load_model
    from asyncgrpo_cli.model.loading import load_policy

    cfg = ModelConfig(name_or_path=str(tiny_model_dir), attn_implementation="sdpa")
    policy = load_policy(str(tiny_model_dir), cfg, torch.device("cpu"))
    served = load_model(tiny_model_dir)
    assert getattr(policy, "use_kernels", False) is False
    assert getattr(served, "use_kernels", False) is False
    # the check can fail: from 5.25 on, transformers' own default kernelizes
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert getattr(plain, "use_kernels", False) is (Version(transformers.__version__) >= Version("5.25"))
