"""LoRA without a server process: the sync rules on plain data (names, retention, the adapter-or-merged decision,
config checks, probe findings, vLLM flags), the trainer's adapter (PEFT layout, merged weights equal PEFT's own
merge), the embedded server's per-row adapters in one forward, and the rollout side's per-group model name."""

from __future__ import annotations

import asyncio
import copy
import json
import os

import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.config.schema import LoraConfig, VllmLaunchConfig
from asyncgrpo_cli.errors import ConfigError, UserError
from asyncgrpo_cli.rollout.served_name import request_model, retired_fallback, start_group
from asyncgrpo_cli.server.probe import find_problems, fix_command
from asyncgrpo_cli.server.report import ServerReport
from asyncgrpo_cli.server.vllm_launch import serve_flags, server_env
from asyncgrpo_cli.sync.lora_policy import (
    AdapterSpec,
    ServerLora,
    adapter_name,
    decide,
    is_adapter_name,
    kept_versions,
    served_rank,
)
from asyncgrpo_cli.train.distributed import DistInfo, iter_full_state

ALL = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def tiny_cfg(*overrides: str):
    return compose_config(["+recipe=tiny", *overrides])


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """In-process forwards on one thread (see the conftest fixture)."""


# -- rules ------------------------------------------------------------------------------------------------------
def test_names_retention_and_ranks():
    assert adapter_name(7) == "policy-v7" and is_adapter_name("policy-v7")
    assert not is_adapter_name("policy-v7-x") and not is_adapter_name("tiny")
    assert kept_versions(0) == 2 and kept_versions(4) == 6
    assert [served_rank(r) for r in (1, 4, 8, 16, 17, 320, 400)] == [1, 8, 8, 16, 32, 320, 512]
    with pytest.raises(UserError, match="above vLLM's largest --max-lora-rank"):
        served_rank(513)


def test_decide_adapter_or_merged():
    spec = AdapterSpec(rank=16, targets=ALL)
    server = ServerLora(enabled=True, max_lora_rank=16, max_loras=6)
    assert decide(server, spec, max_staleness=4).adapter
    cases = {
        "use_dora=true": AdapterSpec(16, ALL, use_dora=True),
        "modules_to_save": AdapterSpec(16, ALL, modules_to_save=("o_proj",)),
        "bias=all": AdapterSpec(16, ALL, bias="all"),
        "restart it with --max-lora-rank 32": AdapterSpec(32, ALL),
    }
    for reason, unservable in cases.items():
        d = decide(server, unservable, max_staleness=4)
        assert d.mode == "merged" and reason in d.reason, (reason, d)
    assert "--enable-lora" in decide(ServerLora(enabled=False), spec, 4).reason
    dp = decide(ServerLora(enabled=True, max_lora_rank=16, data_parallel_size=2), spec, 4)
    assert dp.mode == "merged" and "data-parallel" in dp.reason
    packed = ServerLora(enabled=True, max_lora_rank=16, target_modules=("qkv_proj", "o_proj"))
    assert decide(packed, AdapterSpec(16, frozenset({"q_proj", "v_proj", "o_proj"})), 0).adapter
    outside = decide(packed, spec, 0)
    assert outside.mode == "merged" and "['down_proj', 'gate_proj', 'up_proj']" in outside.reason
    with pytest.raises(UserError, match=r"--max-loras is 3: restart it with --max-loras 6"):
        decide(ServerLora(enabled=True, max_lora_rank=16, max_loras=3), spec, max_staleness=4)


def test_server_lora_from_server_info():
    info = {
        "lora_config": {"max_lora_rank": 32, "max_loras": 4, "target_modules": None},
        "parallel_config": {"data_parallel_size": 1},
    }
    assert ServerLora.from_vllm_config(info) == ServerLora(enabled=True, max_lora_rank=32, max_loras=4)
    assert ServerLora.from_vllm_config({"lora_config": None}) == ServerLora(enabled=False)


def test_config_errors_name_the_keys():
    with pytest.raises(
        ConfigError, match=r"server.weight_sync=lora syncs a LoRA adapter, but model.lora.enabled"
    ):
        tiny_cfg("server.weight_sync=lora")
    bad = [
        ("model.lora.target_modules=[q_proj,lm_head]", r"model.lora.target_modules names \['lm_head'\]"),
        ("model.lora.modules_to_save=[embed_tokens]", r"model.lora.modules_to_save names \['embed_tokens'\]"),
        ("model.lora.r=0", r"model.lora.r \(0\) must be >= 1"),
        ("model.lora.bias=some", r"model.lora.bias \('some'\) must be one of none, all, lora_only"),
        (
            "server.embedded.enable_lora=false",
            r"server.embedded.enable_lora=false, but server.weight_sync=lora",
        ),
        ("server.weight_sync=nccl", r"server.weight_sync=nccl sends the model's tensors as they are"),
    ]
    for override, message in bad:
        with pytest.raises(ConfigError, match=message):
            tiny_cfg("model.lora.enabled=true", "server.weight_sync=lora", override)
    launch = ["model.lora.enabled=true", "server.weight_sync=lora", "server=vllm_launch"]
    for override, message in [
        ("server.vllm_launch.max_lora_rank=12", r"max_lora_rank \(12\) must be one of 1, 8, 16"),
        (
            "server.vllm_launch.max_lora_rank=8",
            r"max_lora_rank \(8\) is below model.lora.r \(16\): raise it to 16",
        ),
        ("server.vllm_launch.max_loras=3", r"max_loras \(3\) is below rollout.max_staleness \+ 2 \(6\)"),
        ("server.vllm_launch.extra_args=[--api-server-count,2]", r"sets --api-server-count 2: vLLM refuses"),
    ]:
        with pytest.raises(ConfigError, match=message):
            tiny_cfg(*launch, override)


def test_derived_defaults_and_the_merged_combination():
    cfg = tiny_cfg(
        "model.lora.enabled=true",
        "model.lora.r=4",
        "server.weight_sync=lora",
        "server=vllm_launch",
        "rollout.max_staleness=1",
    )
    assert (cfg.server.vllm_launch.max_lora_rank, cfg.server.vllm_launch.max_loras) == (8, 3)
    assert cfg.server.embedded.enable_lora is True
    merged = tiny_cfg("model.lora.enabled=true")  # LoRA trained, full (merged) weights synced: valid
    assert merged.server.weight_sync == "disk" and merged.server.embedded.enable_lora is None
    from asyncgrpo_cli.config.plan import plan_lines

    lines = dict(plan_lines(merged))
    assert "merged full weights are pushed (server.weight_sync=disk)" in lines["lora"]
    dora = dict(
        plan_lines(tiny_cfg("model.lora.enabled=true", "server.weight_sync=lora", "model.lora.use_dora=true"))
    )
    assert "not servable as an adapter (model.lora.use_dora=true" in dora["lora"]
    assert (
        "policy-vN per version, 6 kept"
        in dict(plan_lines(tiny_cfg("model.lora.enabled=true", "server.weight_sync=lora")))["lora"]
    )


def test_vllm_flags_and_environment(tmp_path):
    launch = VllmLaunchConfig(max_lora_rank=16, max_loras=6)
    flags = serve_flags(launch, served_model_name=None, cpu=True, lora=True)
    i = flags.index("--enable-lora")
    assert flags[i : i + 5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "6"]
    assert "--enable-lora" not in serve_flags(launch, served_model_name=None, cpu=True)
    assert server_env(launch, tmp_path, lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    inherited = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert server_env(launch, tmp_path).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == inherited


def lora_report(**changes) -> ServerReport:
    """A CPU vLLM started with the flags adapter sync needs (tests/vllm measures the real one)."""
    base = dict(
        base_url="http://127.0.0.1:8000",
        model_ids=["/models/tiny"],
        max_model_len=512,
        dev_routes=True,
        model="/models/tiny",
        logprobs_mode="processed_logprobs",
        max_logprobs=20,
        dtype="float32",
        device="cpu",
        worker_extension="asyncgrpo_cli.vllm_ext.WorkerExtension",
        version="0.32.0",
        lora=ServerLora(enabled=True, max_lora_rank=16, max_loras=6),
        lora_loading=True,
        api_server_count=1,
    )
    return ServerReport(**{**base, **changes})


def test_probe_checks_lora_serving():
    cfg = tiny_cfg(
        "server=vllm", "sampling.seed_per_request=false", "model.lora.enabled=true", "server.weight_sync=lora"
    )
    assert find_problems(lora_report(), cfg) == []
    (off,) = find_problems(lora_report(lora=ServerLora(enabled=False), lora_loading=False), cfg)[:1]
    assert "started without --enable-lora" in off.what
    assert off.flags == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "6"]
    whats = [
        p.what
        for p in find_problems(
            lora_report(lora_loading=False, api_server_count=2, lora=ServerLora(True, 16, 2)), cfg
        )
    ]
    assert any("--max-loras is 2" in w for w in whats)
    assert any("VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in w for w in whats)
    assert any("--api-server-count is 2" in w for w in whats)
    rank = find_problems(lora_report(lora=ServerLora(True, 8, 6)), cfg)
    assert rank == []  # a rank above the server's limit falls back to merged weights (decide), not an error
    cmd = fix_command(lora_report(lora=ServerLora(enabled=False)), cfg)
    assert (
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in cmd
        and "--enable-lora --max-lora-rank 16 --max-loras 6" in cmd
    )
    assert (
        find_problems(
            lora_report(lora=ServerLora(enabled=False)),
            tiny_cfg("server=vllm", "sampling.seed_per_request=false"),
        )
        == []
    )  # lora sync off: nothing asked


# -- the trainer's adapter --------------------------------------------------------------------------------------
def lora_model(tiny_model_dir, seed: int = 0, **lora):
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.model.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = apply_lora(model, LoraConfig(enabled=True, **{"r": 8, "alpha": 16.0, **lora}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a trained-looking adapter: B is zero at init
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(
                    torch.randn(p.shape, generator=g) * (0.5 if "magnitude" not in name else 0.1)
                    + (p if "magnitude" in name or "modules_to_save" in name else 0)
                )
    return model.eval()


def test_only_adapter_parameters_train(tiny_model_dir):
    from asyncgrpo_cli.config.schema import TrainerConfig
    from asyncgrpo_cli.model.lora import adapter_spec
    from asyncgrpo_cli.train.optim import build_optimizer

    model = lora_model(tiny_model_dir)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    opt = build_optimizer(model, TrainerConfig())
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable) == 2 * 7 * 2
    spec = adapter_spec(model)
    assert spec == AdapterSpec(rank=8, targets=ALL)
    assert (
        type(model).__name__ == "Qwen3ForCausalLM"
    )  # injected in place: FSDP2 and the LM head see the model


def test_adapter_files_are_peft_format(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.model.lora import gather_adapter, write_adapter

    model = lora_model(tiny_model_dir)
    tensors = gather_adapter(model, DistInfo())
    assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    write_adapter(model, tensors, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "a")).eval()
    ids = torch.tensor([[17, 250, 31, 999, 4, 86]])
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"use_rslora": True},
        {"use_dora": True},
        {"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["o_proj"]},
    ],
)
def test_merged_weights_equal_peft_merge(tiny_model_dir, variant):
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.model.lora import lora_layers, merged_items

    model = lora_model(tiny_model_dir, **variant)
    merged = dict(merged_items(model, iter_full_state(model, DistInfo())))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert set(merged) == set(plain.state_dict())
    reference = copy.deepcopy(model)
    for layer in lora_layers(reference).values():
        layer.merge(safe_merge=True)
    ref_state = {
        k.replace(".base_layer.", ".").replace(".modules_to_save.default.", "."): v
        for k, v in reference.state_dict().items()
        if "lora_" not in k and ".original_module." not in k
    }
    for name, tensor in merged.items():
        assert torch.allclose(tensor, ref_state[name], atol=1e-6), name
    plain.load_state_dict(merged)
    ids = torch.tensor([[17, 250, 31, 999, 4, 86]])
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-4)


# -- the embedded server's adapters, in process ------------------------------------------------------------------
def write_version(model, path):
    from asyncgrpo_cli.model.lora import gather_adapter, write_adapter

    write_adapter(model, gather_adapter(model, DistInfo()), path)
    return str(path)


def test_one_forward_serves_base_and_several_adapters(tiny_model_dir, tmp_path):
    from asyncgrpo_cli.embedded.lora import AdapterSet, lora_batch
    from asyncgrpo_cli.embedded.model import load_model

    a, b = lora_model(tiny_model_dir, seed=1), lora_model(tiny_model_dir, seed=2)
    base = load_model(tiny_model_dir)
    adapters = AdapterSet(base, "tiny")
    adapters.load({"lora_name": "a", "lora_path": write_version(a, tmp_path / "a")})
    adapters.load({"lora_name": "b", "lora_path": write_version(b, tmp_path / "b")})
    ids = torch.tensor([[17, 250, 31, 999, 4, 86]] * 4)
    rows = [adapters.get("a"), None, adapters.get("b"), adapters.get("a")]
    with torch.no_grad(), lora_batch(base, rows):
        mixed = base(input_ids=ids).logits
        reference = [a(input_ids=ids[:1]).logits[0], None, b(input_ids=ids[:1]).logits[0], None]
    with torch.no_grad():
        plain = base(input_ids=ids[:1]).logits[0]  # outside the context: the base model again
    for i, ref in enumerate([reference[0], plain, reference[2], reference[0]]):
        assert torch.allclose(mixed[i], ref, atol=1e-5), i


def test_engine_serves_each_request_with_its_adapter(tiny_model_dir, tmp_path):
    from asyncgrpo_cli.embedded.engine import GenerationEngine
    from asyncgrpo_cli.embedded.lora import AdapterSet
    from asyncgrpo_cli.embedded.model import load_model
    from asyncgrpo_cli.embedded.requests import GenerationRequest
    from asyncgrpo_cli.embedded.sampling import SamplingParams

    trained = lora_model(tiny_model_dir, seed=3)
    base = load_model(tiny_model_dir)
    adapters = AdapterSet(base, "tiny")
    adapters.load({"lora_name": "policy-v1", "lora_path": write_version(trained, tmp_path / "v1")})
    engine = GenerationEngine(base, eos_token_ids=[], max_model_len=256)
    prompt, greedy = [17, 250, 31, 999, 4, 86], SamplingParams(temperature=0.0)
    first = [
        engine.submit(GenerationRequest(prompt, 6, greedy, adapter=adapters.get("policy-v1"))),
        engine.submit(GenerationRequest(prompt, 6, greedy)),
    ]
    for _ in range(50):
        if all(h.done for h in first):
            break
        engine.step()
    cached = engine.submit(GenerationRequest(prompt, 6, greedy, adapter=adapters.get("policy-v1")))
    while not cached.done:
        engine.step()  # same prompt and adapter: served from the prefix cache, still with the adapter
    for handle, model in ((first[0], trained), (first[1], None), (cached, trained)):
        out = handle.completions[0]
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = (model or base)(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        ref = (
            torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        )
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4)
    assert first[0].completions[0].logprobs != first[1].completions[0].logprobs
    assert engine.stats().prefix_cache_hits_total >= 1


# -- the rollout side -------------------------------------------------------------------------------------------
def test_groups_request_their_version_and_fall_back_once_it_is_retired():
    current = {"version": 3}

    async def group(version: int) -> tuple[str, str | None]:
        start_group("policy-v{version}", "base", version, lambda: current["version"])
        seen = await asyncio.gather(*(asyncio.sleep(0, result=request_model("base")) for _ in range(2)))
        assert seen[0] == seen[1]
        return seen[0], retired_fallback(seen[0])

    async def main():
        return await asyncio.gather(asyncio.create_task(group(3)), asyncio.create_task(group(1)))

    (name3, fb3), (name1, fb1) = asyncio.run(main())
    assert (name3, fb3) == ("policy-v3", None)  # current: nothing to fall back to
    assert (name1, fb1) == ("policy-v1", "policy-v3")  # retired: the current version
    assert request_model("base") == "base"  # outside any group
    start_group(None, "base", 5, lambda: 5)
    assert request_model("base") == "base"  # no template (full-weight sync): the served model
