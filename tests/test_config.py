"""Every shipped config composes, validates and builds its plugins; errors name the key and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo_cli import registry
from asyncgrpo_cli.config.compose import compose_config, compose_dict, precheck, with_default_recipe
from asyncgrpo_cli.config.schema import RootConfig
from asyncgrpo_cli.config.store import GROUPS
from asyncgrpo_cli.config.validate import to_root_config
from asyncgrpo_cli.errors import ConfigError, UserError
from asyncgrpo_cli.paths import conf_dir, list_recipes

CONF = conf_dir()
GROUP_FILES = sorted((g, p.stem) for g in GROUPS for p in (CONF / g).glob("*.yaml"))


def _build_plugins(cfg: RootConfig) -> None:
    """Build every named plugin of a config without starting anything."""
    from asyncgrpo_cli.rollout.rewards import load_reward_funcs

    registry.resolve("loss", cfg.loss.name)(cfg.loss)
    registry.resolve("packer", cfg.packing.kind)(cfg.packing)
    assert callable(registry.resolve("server", cfg.server.backend))
    assert callable(registry.resolve("weight_sync", cfg.server.weight_sync))
    assert callable(registry.resolve("rollout_loop", cfg.rollout.loop))
    assert callable(registry.resolve("dataset", cfg.data.source))
    assert len(load_reward_funcs(list(cfg.rewards.funcs))) == len(cfg.rewards.funcs)


@pytest.mark.parametrize("recipe", list_recipes())
def test_every_recipe_composes_validates_and_builds(recipe):
    cfg = compose_config([f"+recipe={recipe}"])
    assert cfg.recipe == recipe
    _build_plugins(cfg)


DISTILL_FILES = {("loss", "jsd"), ("rewards", "none"), ("teacher", "custom")}
"""Group options that only make sense under ``asyncgrpo distill`` (composed with its tiny recipe)."""


AGENT_FILES = {("data", "environment")}
"""Group options that need an environment (composed with the agents' tiny recipe)."""


def _recipe_for(group: str, option: str) -> str:
    if (group, option) in AGENT_FILES:
        return "tools_tiny"
    return "distill_tiny" if (group, option) in DISTILL_FILES else "tiny"


@pytest.mark.parametrize("group,option", GROUP_FILES)
def test_every_group_file_composes_validates_and_builds(group, option):
    cfg = compose_config([f"{group}={option}", f"+recipe={_recipe_for(group, option)}"])
    _build_plugins(cfg)


@pytest.mark.parametrize("group,option", sorted(set(GROUP_FILES) - AGENT_FILES))
def test_every_group_file_composes_under_distill(group, option):
    """The distillation recipes accept every group option the GRPO ones do (shared machinery)."""
    overrides = [f"{group}={option}", "+recipe=distill_tiny"]
    if (group, option) == ("teacher", "custom"):
        overrides.append("+teacher.servers.default={backend: embedded, model: 'builtin:tiny-qwen3-teacher'}")
    _build_plugins(compose_config(overrides))


def test_a_recipe_runs_under_its_own_verb():
    from asyncgrpo_cli.config.compose import algorithm_of

    assert algorithm_of(["+recipe=mopd"]) == "distill" and algorithm_of(["+recipe=tiny"]) == "grpo"
    with pytest.raises(
        UserError,
        match=r"recipe 'gsm8k_distill' is a distill recipe: run it with `asyncgrpo "
        r"distill \+recipe=gsm8k_distill`",
    ):
        algorithm_of(["+recipe=gsm8k_distill"], "grpo")
    with pytest.raises(UserError, match="recipe 'quickstart' is a grpo recipe: run it with `asyncgrpo train"):
        algorithm_of(["+recipe=quickstart"], "distill")
    assert compose_config([], algorithm="distill").recipe == "distill_quickstart"


def test_default_is_quickstart():
    assert with_default_recipe([]) == ["+recipe=quickstart"]
    assert compose_config([]).recipe == "quickstart"
    assert with_default_recipe(["+recipe=tiny"]) == ["+recipe=tiny"]


def test_overrides_reach_typed_fields():
    cfg = compose_config(
        [
            "+recipe=tiny",
            "rollout.max_staleness=2",
            "loss.epsilon=0.28",
            "trainer.max_steps=50",
            "server.embedded.max_num_seqs=4",
            "rewards.funcs=[digits,length]",
        ]
    )
    assert (cfg.rollout.max_staleness, cfg.loss.epsilon, cfg.trainer.max_steps) == (2, 0.28, 50)
    assert cfg.server.embedded.max_num_seqs == 4 and cfg.rewards.funcs == ["digits", "length"]


def test_unknown_keys_get_did_you_mean():
    with pytest.raises(
        ConfigError,
        match=r"sampling.temprature is not a field of SamplingConfig; did you mean "
        r"'sampling.temperature'\?",
    ):
        compose_config(["+recipe=tiny", "sampling.temprature=0.5"])
    with pytest.raises(ConfigError, match="sampling.temprature"):
        compose_config(["+recipe=tiny", "+sampling.temprature=0.5"])
    # a typo that reaches the composed config (e.g. from a user's yaml) is caught after composition too
    data = dict(compose_dict(["+recipe=tiny"]))
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(compose_dict(["+recipe=tiny"]), resolve=True)
    raw["trainer"]["max_stpes"] = 3
    with pytest.raises(
        ConfigError,
        match=r"trainer.max_stpes is not a field of TrainerConfig; did you mean "
        r"'max_steps'\?",
    ):
        to_root_config(raw)
    assert data


def test_every_error_is_reported_at_once_with_key_and_fix():
    with pytest.raises(ConfigError) as info:
        compose_config(
            [
                "+recipe=tiny",
                "sampling.num_generations=1",
                "sampling.top_p=1.5",
                "model.dtype=fp8",
                "packing.token_budget=16",
            ]
        )
    text = str(info.value)
    for needle in (
        "sampling.num_generations (1) must be >= 2",
        "sampling.top_p (1.5)",
        "model.dtype ('fp8')",
        "packing.token_budget (16) must exceed sampling.max_completion_length",
    ):
        assert needle in text
    assert len(info.value.errors) == 4


def test_unknown_plugin_lists_registered_names():
    with pytest.raises(
        ConfigError,
        match=r"loss.name: unknown loss 'score_centring'. Did you mean "
        r"'score_centering'\? Registered: clipped, jsd, score_centering",
    ):
        compose_config(["+recipe=tiny", "loss.name=score_centring"])
    with pytest.raises(ConfigError, match="cannot find module 'no_such_module'"):
        compose_config(["+recipe=tiny", "rewards.funcs=[no_such_module:fn]"])


def test_unknown_recipe_lists_recipes():
    with pytest.raises(
        UserError, match=r"recipe 'nope' does not exist; available recipes: .*quickstart.*tiny"
    ):
        precheck(["+recipe=nope"])
    with pytest.raises(UserError, match="recipe 'nope'"):
        precheck(["+recipe=tiny,nope"])


def test_plugins_match_config_files():
    """Every registered loss / packer / server has a config file of that name, and vice versa."""
    pairs = {
        "loss": ("loss", lambda c: c.loss.name),
        "packer": ("packing", lambda c: c.packing.kind),
        "server": ("server", lambda c: c.server.backend),
    }
    for kind, (group, select) in pairs.items():
        files = {p.stem for p in (CONF / group).glob("*.yaml")}
        chosen = {select(compose_config([f"{group}={f}", f"+recipe={_recipe_for(group, f)}"])) for f in files}
        assert chosen == set(registry.names(kind)), (kind, chosen)
    sources = {
        compose_config([f"data={p.stem}", f"+recipe={_recipe_for('data', p.stem)}"]).data.source
        for p in (CONF / "data").glob("*.yaml")
    }
    assert sources == set(registry.names("dataset"))


def _run_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncgrpo_cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_help_and_check_do_not_import_torch():
    code = (
        "import sys; from asyncgrpo_cli.cli import main\n"
        "for argv in (['--help'], ['check', '+recipe=deepmath'], ['plugins'], ['check', '--explain', 'loss']):\n"
        "    main(argv)\n"
        "bad = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Qwen/Qwen3-1.7B" in out.stdout and "http://localhost:8000" in out.stdout
    assert "score_centering" in out.stdout and "epsilon_high" in out.stdout


def test_cli_user_errors_are_one_clear_message():
    out = _run_cli("check", "+recipe=nope")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "available recipes" in out.stderr
    out = _run_cli("train", "+recipe=tiny", "trainer.max_stps=3")
    assert out.returncode == 2 and "did you mean 'trainer.max_steps'" in out.stderr
    out = _run_cli("frobnicate")
    assert out.returncode == 2 and "unknown verb" in out.stderr


def test_configs_ship_in_the_wheel(tmp_path):
    """conf/ and recipes/ work from an installed wheel (recipes become the Hydra group `recipe`)."""
    import zipfile

    pytest.importorskip("hatchling")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("asyncgrpo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "asyncgrpo_cli/_conf/config.yaml" in names
    for recipe in list_recipes():
        assert f"asyncgrpo_cli/_conf/recipe/{recipe}.yaml" in names
    # Run the composer from the unpacked wheel (not the checkout): the packaged configs must be found.
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    code = (
        "from asyncgrpo_cli.paths import conf_dir; from asyncgrpo_cli.config.compose import compose_config; "
        "assert '_conf' in str(conf_dir()), conf_dir(); print(compose_config(['+recipe=deepmath']).recipe)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(unpacked)},
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "deepmath"


def test_check_prints_the_agents_and_refuses_an_unpicklable_tool():
    ok = _run_cli("check", "+recipe=tools_tiny")
    assert ok.returncode == 0, ok.stderr
    assert "tools calculator; environment increment" in " ".join(ok.stdout.split())
    bad = _run_cli("check", "+recipe=tools_tiny", "rollout.tools=[tests.helpers.agent_tools:lambda_tool]")
    assert bad.returncode != 0 and "rollout.tools[0]" in bad.stderr and "lambda" in bad.stderr


def test_check_prints_the_harness_without_torch_and_refuses_a_missing_program():
    code = (
        "import sys; from asyncgrpo_cli.cli import main\n"
        "main(['check', '+recipe=harness_tiny'])\n"
        "bad = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    wide = {**os.environ, "COLUMNS": "400"}  # the plan table then wraps no path
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=wide)
    assert ok.returncode == 0, ok.stderr
    out = " ".join(ok.stdout.split())
    assert (
        f"python -m asyncgrpo_cli.harnesses.calculator_agent once per rollout (program {sys.executable})"
        in out
    )
    assert "at most 60s each" in out and 'the harness\'s last stdout line {"reward": ...}' in out
    assert "config OK" in out
    bad = _run_cli("check", "+recipe=harness_tiny", "rollout.harness.command=[no-such-agent-program]")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "rollout.harness.command: 'no-such-agent-program' is not an executable program" in bad.stderr
    both = _run_cli("check", "+recipe=harness_tiny", "rollout.tools=[calculator]")
    assert both.returncode == 2 and "leave rollout.tools and rollout.environment_factory empty" in both.stderr
