"""Choice fields come from the schema; value checks are one per group plus named cross-group rules;
resolved.yaml is the validated config with its derived defaults."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields

import pytest
from omegaconf import OmegaConf

from asyncgrpo_cli.config import schema
from asyncgrpo_cli.config.checks import CROSS_GROUP_RULES, GROUP_CHECKS
from asyncgrpo_cli.config.choices import field_choices
from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.config.plan import explain_group
from asyncgrpo_cli.config.store import GROUPS, resolved_yaml
from asyncgrpo_cli.config.validate import to_root_config
from asyncgrpo_cli.errors import ConfigError

LORA = ("model.lora.enabled=true", "server.weight_sync=lora")


def _errors(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        compose_config(["+recipe=tiny", *overrides])
    return info.value.errors


def test_a_choice_error_names_the_key_the_value_the_choices_and_the_closest():
    assert _errors("trainer.lr_scheduler_type=cosin") == [
        "trainer.lr_scheduler_type ('cosin') must be one of constant, constant_with_warmup, linear, cosine; "
        "did you mean 'cosine'?"
    ]
    assert _errors("sampling.sampling_mask=never") == [
        "sampling.sampling_mask ('never') must be one of auto, required, off."
    ]


def test_console_sinks_and_serving_dtype_are_checked_before_anything_starts():
    assert _errors("logging.console=fancy") == ["logging.console ('fancy') must be one of live, plain, auto."]
    assert _errors("logging.sinks=[console,jsonll]") == [
        "logging.sinks[1] ('jsonll') must be one of console, jsonl, trackio; did you mean 'jsonl'?"
    ]
    assert _errors("server.embedded.dtype=auto") == [
        "server.embedded.dtype ('auto') must be one of float32, bfloat16, float16."
    ]


def test_a_disabled_features_choices_are_not_read():
    assert compose_config(["+recipe=tiny", "model.lora.bias=some"]).model.lora.bias == "some"
    (msg,) = _errors(*LORA, "model.lora.bias=some")
    assert msg == "model.lora.bias ('some') must be one of none, all, lora_only."


def test_runtime_mirrors_of_the_choices_agree_with_the_schema():
    """Modules that check a choice again at run time hold the schema's values."""
    from asyncgrpo_cli.embedded.model import DTYPES
    from asyncgrpo_cli.metrics.console import CONSOLE_MODES
    from asyncgrpo_cli.metrics.logger import SINK_NAMES
    from asyncgrpo_cli.model.flex import ATTN_CHOICES

    assert field_choices(schema.ModelConfig)["attn_implementation"].values == ATTN_CHOICES
    assert field_choices(schema.LoggingConfig)["console"].values == CONSOLE_MODES
    assert field_choices(schema.LoggingConfig)["sinks"].values == SINK_NAMES
    assert set(field_choices(schema.EmbeddedServerConfig)["dtype"].values) == set(DTYPES)


def test_every_group_has_one_check_and_the_cross_group_rules_are_named():
    assert set(GROUP_CHECKS) == set(GROUPS)
    assert set(GROUPS) <= {f.name for f in fields(schema.RootConfig)}
    names = [rule.__name__ for rule in CROSS_GROUP_RULES]
    assert len(set(names)) == len(names) and "<lambda>" not in names
    assert compose_config(["+recipe=tiny"])  # every check passes on a shipped recipe


def test_explain_lists_each_fields_choices():
    rows = {key: (default, choices) for key, default, choices, _ in explain_group("trainer")}
    assert rows["trainer.mixed_precision"] == ("None", "bfloat16, null")
    assert rows["trainer.device"] == ("'auto'", "auto, cpu, cuda")
    assert rows["trainer.max_steps"][1] == ""
    model = {key: choices for key, _, choices, _ in explain_group("model")}
    assert model["model.lora.bias"] == "none, all, lora_only"
    out = subprocess.run(
        [sys.executable, "-m", "asyncgrpo_cli", "check", "--explain", "logging"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert "choices" in out.stdout and "each: console, jsonl, trackio" in out.stdout
    assert "live, plain, auto" in out.stdout


def test_resolved_yaml_is_the_validated_config_with_derived_defaults():
    cfg = compose_config(["+recipe=tiny", *LORA])
    text = resolved_yaml(cfg)
    data = OmegaConf.to_container(OmegaConf.create(text))
    assert data["server"]["embedded"]["enable_lora"] is True  # derived (null in the composed config)
    assert (data["server"]["vllm_launch"]["max_lora_rank"], data["server"]["vllm_launch"]["max_loras"]) == (
        16,
        6,
    )
    assert to_root_config(data) == cfg  # it validates back to exactly the config that ran


def test_train_writes_resolved_yaml_after_validation(tmp_path):
    """The run directory's resolved.yaml carries the derived defaults (the run then stops on its empty data)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    run = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncgrpo_cli",
            "train",
            "+recipe=tiny",
            *LORA,
            "data.source=hf",
            f"data.path={empty}",
            "logging.console=plain",
            f"hydra.run.dir={run}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode != 0 and f"data.path '{empty}' is an empty file" in out.stderr, out.stderr[-3000:]
    resolved = OmegaConf.load(run / "resolved.yaml")
    assert resolved.server.embedded.enable_lora is True and resolved.server.vllm_launch.max_loras == 6
    assert resolved.recipe == "tiny" and resolved.data.path == str(empty)


def _distill_errors(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        compose_config(["+recipe=distill_tiny", *overrides])
    return info.value.errors


def test_distillation_settings_are_checked_before_anything_starts():
    assert _distill_errors("loss.beta=-0.1") == [
        "loss.beta (-0.1) must be in [0, 1]: 0 is forward KL (the default), 1 reverse KL (MOPD), in between the "
        "generalized JSD."
    ]
    assert _distill_errors("loss.teacher_temperature=0")[0].startswith(
        "loss.teacher_temperature (0.0) must be > 0"
    )
    assert _distill_errors("teacher.top_k=0")[0].startswith("teacher.top_k (0) must be >= 1")
    assert "above the embedded teacher's 20 log-probs" in _distill_errors("teacher.top_k=32")[0]
    assert (
        "the loss is 0. Keep loss.add_tail_bucket=true"
        in _distill_errors("loss.beta=1", "loss.add_tail_bucket=false")[0]
    )
    assert (
        "set sampling.sampling_mask=off"
        in _distill_errors("sampling.top_k=5", "sampling.sampling_mask=auto")[0]
    )
    assert _distill_errors("teacher.servers.default=localhost:8001") == [
        "teacher.servers.default ('localhost:8001') must start with http:// or https://."
    ]
    assert _distill_errors("~teacher.servers.default", "+teacher.servers.math={backend: embedded}") == [
        "teacher.servers.math: backend embedded needs model (a hub id, a local directory or builtin:NAME)."
    ]
    assert _distill_errors(
        "~teacher.servers.default", "+teacher.servers.math={backend: embedded, modle: x}"
    ) == ["teacher.servers.math.modle is not a teacher server setting; did you mean 'model'?"]
    assert "teacher.servers is empty" in _distill_errors("~teacher.servers.default")[0]


def test_grpo_keeps_its_group_rules_and_refuses_the_distillation_loss():
    assert _errors("sampling.num_generations=1") == [
        "sampling.num_generations (1) must be >= 2: GRPO normalizes rewards within a group."
    ]
    assert _errors("rewards=none") == [
        "rewards.funcs is empty: give at least one reward function (or an environment with get_reward, "
        'rollout.environment_factory, or a harness that prints {"reward": ...}, rollout.harness.command).'
    ]
    assert compose_config(
        ["+recipe=tiny", "rewards=none", "rollout.environment_factory=increment"]
    )  # get_reward
    assert "loss.name=jsd is the distillation loss" in _errors("loss=jsd")[0]
    assert compose_config(["+recipe=distill_tiny", "sampling.num_generations=1"]).rewards.funcs == []


def test_check_plans_a_distillation_run_without_a_server_or_torch():
    import os
    import subprocess
    import sys

    code = (
        "import sys; from asyncgrpo_cli.cli import main\n"
        "main(['check', '+recipe=gsm8k_distill', 'loss.beta=0.5', 'teacher.top_k=32'])\n"
        "assert 'torch' not in sys.modules, 'check imported torch'\n"
    )
    env = {**os.environ, "COLUMNS": "400"}  # one table line per plan line
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    for part in (
        "teacher default",
        "http://localhost:8001",
        "generalized JSD (beta=0.5) over the teacher's top-1 + the sampled token, with the tail bucket",
        "teacher top_k=32",
        "vllm server at http://localhost:8000",
        "the server's max_model_len",
        "config OK",
    ):
        assert part in text, (part, text)


def test_agent_settings_are_checked_with_their_keys():
    assert _errors("rollout.max_tool_calling_iterations=-1") == [
        "rollout.max_tool_calling_iterations must be >= 0 (or null: until a reply calls no tool)."
    ]
    assert _errors("rollout.tool_timeout_s=0") == ["rollout.tool_timeout_s must be > 0 seconds."]
    assert "rollout.tool_call_format" in _errors("rollout.tool_call_format=json")[0]
    env_errors = _errors("data=environment")
    assert env_errors[0].startswith("data.source=environment has no prompts: set rollout.environment_factory")
    assert (
        "set trainer.max_steps"
        in _errors("data=environment", "rollout.environment_factory=increment", "trainer.max_steps=-1")[0]
    )
    assert "not supported by asyncgrpo distill" in _distill_errors("rollout.tools=[calculator]")[0]


def test_check_names_the_linear_attention_layers_and_kernel_without_torch(tmp_path):
    """``asyncgrpo check`` reads config.json where it is on disk (a built-in in the cache, a local directory) and
    says which layers are gated DeltaNet and which kernel loading will pick; torch is never imported."""
    import json

    from asyncgrpo_cli.bench.shapes import QWEN3_5_SHAPES
    from asyncgrpo_cli.model.resolve import resolve_model_path

    resolve_model_path("builtin:tiny-qwen3.5")  # in the cache, as after a first run
    local = tmp_path / "qwen3.5-2b"
    local.mkdir()
    layer_types = QWEN3_5_SHAPES["qwen3.5-2b"]["layer_types"]
    (local / "config.json").write_text(json.dumps({"text_config": {"layer_types": layer_types}}))
    code = (
        "import sys; from asyncgrpo_cli.cli import main\n"
        "for args in sys.argv[1:]:\n"
        "    main(['check', '+recipe=tiny', *args.split()])\n"
        "    print('=====')\n"
        "assert 'torch' not in sys.modules, 'check imported torch'\n"
    )
    runs = [
        "model.name_or_path=builtin:tiny-qwen3.5 trainer.device=cpu",
        f"model.name_or_path={local} trainer.device=cuda model.linear_attention_kernel=torch",
        "model.name_or_path=someone/not-downloaded-hybrid trainer.device=cpu",
        "model.name_or_path=builtin:tiny-qwen3",
    ]
    env = {**os.environ, "COLUMNS": "400"}  # one table line per plan line
    out = subprocess.run(
        [sys.executable, "-c", code, *runs],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    tiny, big, hub, dense = (" ".join(part.split()) for part in out.stdout.split("=====")[:4])
    assert (
        "gated DeltaNet in 3 of 4 decoder layers (0-2); full attention in 3; packed exactly per sample / branch; "
        "kernel: torch (pure-torch chunked; model.linear_attention_kernel=auto, trainer.device=cpu)" in tiny
    )
    assert "gated DeltaNet in 18 of 24 decoder layers (0-2, 4-6, 8-10, 12-14, 16-18, 20-22)" in big
    assert "full attention in 3, 7, 11, 15, 19, 23" in big and "kernel: torch (pure-torch chunked" in big
    assert "decided at load (someone/not-downloaded-hybrid has no local copy)" in hub
    assert "linear attention" not in dense and all("config OK" in t for t in (tiny, big, hub, dense))


def test_the_kernel_check_predicts_follows_the_loaders_rule():
    from asyncgrpo_cli.model.layers_plan import layer_types, planned_kernel

    assert planned_kernel("auto", "cuda", True).startswith("fla (Triton chunk kernels")
    assert planned_kernel("auto", "cuda", False).startswith(
        "torch (pure-torch chunked, exact but slow on CUDA"
    )
    assert planned_kernel("auto", "cpu", True).startswith("torch")
    assert planned_kernel("auto", "auto", True).startswith("fla on CUDA, torch on CPU")
    assert planned_kernel("fla", "cpu", True).startswith("none: loading refuses it, fla needs CUDA")
    assert planned_kernel("fla", "cuda", False).startswith("none: loading refuses it, fla-core not installed")
    assert planned_kernel("torch", "cuda", True).startswith("torch")
    # a Qwen3-Next config.json lists no layer_types: transformers derives them from full_attention_interval
    derived = layer_types({"model_type": "qwen3_next", "num_hidden_layers": 8, "full_attention_interval": 4})
    assert derived == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert layer_types({"model_type": "qwen3", "num_hidden_layers": 8}) == []
