"""Value checks of a typed config: one function per group, then the named rules that span groups.

A group's check sees only its own sub-config and yields one message per problem, naming the full key, the value
and the fix; choice fields (``config/choices.py``) are checked from the schema before it. A rule that reads two
groups is a named function in ``CROSS_GROUP_RULES``: a new product (a scorer, a server, an environment) adds its
rules there. Imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from asyncgrpo_cli.config import lora as lora_policy
from asyncgrpo_cli.config import teacher as teacher_policy
from asyncgrpo_cli.config.choices import choice_errors
from asyncgrpo_cli.config.harness import harness_errors
from asyncgrpo_cli.config.schema import (
    DataConfig,
    LoggingConfig,
    LossConfig,
    ModelConfig,
    PackingConfig,
    RewardsConfig,
    RolloutConfig,
    RootConfig,
    SamplingConfig,
    ServerConfig,
    TrainerConfig,
)


# -- one check per group ------------------------------------------------------------------------------------------
def sampling_errors(s: SamplingConfig) -> Iterator[str]:
    if s.num_generations < 1:
        yield f"sampling.num_generations ({s.num_generations}) must be >= 1."
    if s.max_completion_length < 1:
        yield "sampling.max_completion_length must be >= 1."
    if s.temperature < 0:
        yield f"sampling.temperature ({s.temperature}) must be >= 0."
    if not 0 < s.top_p <= 1:
        yield f"sampling.top_p ({s.top_p}) must be in (0, 1]."
    if s.top_k < 0:
        yield f"sampling.top_k ({s.top_k}) must be >= 0 (0 disables)."
    if not 0 <= s.min_p <= 1:
        yield f"sampling.min_p ({s.min_p}) must be in [0, 1]."
    if s.repetition_penalty <= 0:
        yield "sampling.repetition_penalty must be > 0 (1.0 disables)."
    if s.num_sampler_logprobs < 0:
        yield "sampling.num_sampler_logprobs must be >= 0."
    if s.max_mask_candidates < 1:
        yield (
            f"sampling.max_mask_candidates ({s.max_mask_candidates}) must be >= 1: it caps each token's "
            "candidate set."
        )


def loss_errors(lo: LossConfig) -> Iterator[str]:
    if not 0 < lo.vllm_importance_sampling_clip_min <= 1 <= lo.vllm_importance_sampling_clip_max:
        yield (
            f"loss.vllm_importance_sampling_clip_min/max ({lo.vllm_importance_sampling_clip_min}, "
            f"{lo.vllm_importance_sampling_clip_max}) must satisfy 0 < min <= 1 <= max."
        )
    if not 0 <= lo.epsilon < 1:
        yield f"loss.epsilon ({lo.epsilon}) must be in [0, 1)."
    if lo.epsilon_high is not None and lo.epsilon_high < 0:
        yield "loss.epsilon_high must be >= 0 or null."
    if not 0 <= lo.beta <= 1:
        yield (
            f"loss.beta ({lo.beta}) must be in [0, 1]: 0 is forward KL (the default), 1 reverse KL (MOPD), "
            "in between the generalized JSD."
        )
    if not lo.teacher_temperature > 0:
        yield f"loss.teacher_temperature ({lo.teacher_temperature}) must be > 0 (1.0: the teacher as served)."
    coef = lo.router_aux_loss_coef
    if coef is not None and not (math.isfinite(coef) and coef >= 0):
        yield (
            f"loss.router_aux_loss_coef ({coef}) must be a finite number >= 0 (0 disables), or null for the model "
            "config's value."
        )


def rollout_errors(ro: RolloutConfig) -> Iterator[str]:
    if ro.max_concurrent_rollouts < 1:
        yield "rollout.max_concurrent_rollouts must be >= 1."
    if ro.max_staleness < 0:
        yield "rollout.max_staleness must be >= 0."
    if ro.weight_sync_steps < 1:
        yield "rollout.weight_sync_steps must be >= 1."
    if ro.rollout_worker_timeout <= 0:
        yield "rollout.rollout_worker_timeout must be > 0 seconds."
    if ro.score_queue_maxsize < 1:
        yield "rollout.score_queue_maxsize must be >= 1."
    if ro.max_tool_calling_iterations is not None and ro.max_tool_calling_iterations < 0:
        yield "rollout.max_tool_calling_iterations must be >= 0 (or null: until a reply calls no tool)."
    if ro.tool_timeout_s <= 0:
        yield "rollout.tool_timeout_s must be > 0 seconds."
    env = ro.environment_factory
    if env is not None and not isinstance(env, str) and not hasattr(env, "keys"):
        yield (
            f"rollout.environment_factory must be a name, module:Class, or {{name: factory}}; got {env!r}."
        )
    if ro.harness.command:
        yield from harness_errors(ro.harness)
        if ro.has_agents:
            yield (
                "rollout.harness.command runs its own agent loop and tools: leave rollout.tools and "
                "rollout.environment_factory empty (the harness calls its tools itself)."
            )


def trainer_errors(tr: TrainerConfig) -> Iterator[str]:
    if bad := [s for s in tr.profile.steps if s < 1]:
        yield f"trainer.profile.steps {bad}: optimizer steps count from 1."
    if tr.max_steps > 0 and (late := [s for s in tr.profile.steps if s > tr.max_steps]):
        yield f"trainer.profile.steps {late} never run: trainer.max_steps is {tr.max_steps}."
    if tr.profile.top < 1:
        yield f"trainer.profile.top ({tr.profile.top}) must be >= 1."
    if tr.gradient_accumulation_steps < 1:
        yield "trainer.gradient_accumulation_steps must be >= 1."
    if tr.learning_rate < 0:
        yield "trainer.learning_rate must be >= 0."
    if not (tr.max_steps > 0 or tr.num_train_epochs > 0):
        yield "set trainer.max_steps > 0 or trainer.num_train_epochs > 0: otherwise training never starts."
    if tr.save_steps < 0:
        yield "trainer.save_steps must be >= 0 (0: save only at the end)."
    if tr.lr_scheduler_type not in ("constant", "constant_with_warmup") and tr.max_steps <= 0:
        yield (
            f"trainer.lr_scheduler_type={tr.lr_scheduler_type} decays over trainer.max_steps: set "
            "trainer.max_steps (the step count of an epoch-based run is unknown in advance)."
        )
    if tr.cpu_offload and tr.device == "cpu":
        yield (
            "trainer.cpu_offload=true moves FSDP2 shards off a GPU, but trainer.device=cpu: set "
            "trainer.cpu_offload=false."
        )


def model_errors(model: ModelConfig) -> Iterator[str]:
    """Nothing beyond its choices (dtype, attn_implementation, lora.bias when model.lora is on): the rest of
    model.lora reads server too (``lora_policy.config_errors``, a cross-group rule). The names of
    model.flex_kernel_options are torch's, checked where the model loads (``model/flex.py``)."""
    if model.flex_kernel_options and model.attn_implementation in ("sdpa", "eager"):
        yield (
            f"model.flex_kernel_options is set but model.attn_implementation={model.attn_implementation} does "
            "not run flex attention: use auto or flex_attention, or drop the options."
        )
    for key, value in model.flex_kernel_options.items():
        if not isinstance(value, (bool, int, str)):
            yield f"model.flex_kernel_options.{key} ({value!r}) must be an integer, a boolean or a string."
    if "BACKEND" in model.flex_kernel_options:
        yield (
            "model.flex_kernel_options.BACKEND is set: choose flex attention's kernels with model.flex_backend "
            "(auto, triton or flash) instead."
        )
    elif model.flex_kernel_options and model.flex_backend == "flash":
        yield (
            "model.flex_kernel_options are tiles of flex attention's Triton kernels, but model.flex_backend=flash "
            "runs FlashAttention-4's: drop the options or use model.flex_backend=triton."
        )


def packing_errors(pk: PackingConfig) -> Iterator[str]:
    if pk.samples_per_row < 1:
        yield f"packing.samples_per_row ({pk.samples_per_row}) must be >= 1."


def server_errors(sv: ServerConfig) -> Iterator[str]:
    if not (sv.timeout > 0 and sv.startup_timeout > 0):
        yield "server.timeout and server.startup_timeout must be > 0."
    if sv.max_retries < 0:
        yield "server.max_retries must be >= 0."
    nc, emb = sv.nccl, sv.embedded
    if not (nc.num_buffers >= 1 and nc.buffer_size_bytes >= 1):
        yield "server.nccl.num_buffers and server.nccl.buffer_size_bytes must be >= 1."
    if not (nc.timeout > 0 and nc.init_timeout > 0):
        yield "server.nccl.timeout and server.nccl.init_timeout must be > 0."
    if not 0 <= emb.port < 65536:
        yield f"server.embedded.port ({emb.port}) must be in [0, 65535] (0: a free port)."
    if not (emb.max_model_len > 0 and emb.max_num_seqs > 0):
        yield "server.embedded.max_model_len/max_num_seqs must be > 0."


def logging_errors(lg: LoggingConfig) -> Iterator[str]:
    if lg.logging_steps < 1:
        yield "logging.logging_steps must be >= 1."


def data_errors(data: DataConfig) -> Iterator[str]:
    if data.num_examples is not None and data.num_examples <= 0:
        yield "data.num_examples must be > 0 or null."


def rewards_errors(rw: RewardsConfig) -> Iterator[str]:
    """Nothing on its own: whether an empty list is allowed depends on the algorithm (``grpo_needs_groups``)."""
    yield from ()


GROUP_CHECKS: dict[str, Callable[[Any], Iterable[str]]] = {
    "sampling": sampling_errors,
    "loss": loss_errors,
    "rollout": rollout_errors,
    "trainer": trainer_errors,
    "model": model_errors,
    "packing": packing_errors,
    "server": server_errors,
    "logging": logging_errors,
    "data": data_errors,
    "rewards": rewards_errors,
    "teacher": teacher_policy.teacher_errors,
}
"""Group name (a ``RootConfig`` field) -> its check; every group has one (a test holds them in step)."""


# -- rules across groups ------------------------------------------------------------------------------------------
def mixed_precision_keeps_fp32_master(cfg: RootConfig) -> Iterator[str]:
    tr = cfg.trainer
    if tr.mixed_precision is not None and cfg.model.dtype != "float32":
        yield (
            f"trainer.mixed_precision={tr.mixed_precision} keeps fp32 master weights: set model.dtype=float32 "
            f"(not {cfg.model.dtype!r}), or trainer.mixed_precision=null to train in model.dtype."
        )


def flex_attention_needs_cuda(cfg: RootConfig) -> Iterator[str]:
    if cfg.model.attn_implementation == "flex_attention" and cfg.trainer.device == "cpu":
        yield (
            "model.attn_implementation=flex_attention needs trainer.device=cuda (flex attention has no CPU "
            "backward): use model.attn_implementation=auto or sdpa on CPU."
        )


def triton_head_needs_cuda(cfg: RootConfig) -> Iterator[str]:
    if cfg.model.lm_head_kernel == "triton" and cfg.trainer.device == "cpu":
        yield (
            "model.lm_head_kernel=triton needs trainer.device=cuda (the fused head's kernels run on GPUs): use "
            "model.lm_head_kernel=auto or torch on CPU."
        )


def nccl_sync_needs_gpus(cfg: RootConfig) -> Iterator[str]:
    sv = cfg.server
    if sv.weight_sync != "nccl":
        return
    if cfg.trainer.device == "cpu":
        yield (
            "server.weight_sync=nccl broadcasts from the trainer's GPU: set trainer.device=cuda (or auto), or "
            "server.weight_sync=disk."
        )
    if sv.backend == "embedded" and not sv.embedded.device.startswith("cuda"):
        yield (
            f"server.weight_sync=nccl needs the embedded server on a GPU (server.embedded.device is "
            f"{sv.embedded.device!r}): set server.embedded.device=cuda:1 (another GPU than the trainer's), or "
            "server.weight_sync=disk."
        )


def completion_fits_embedded_server(cfg: RootConfig) -> Iterator[str]:
    s, sv = cfg.sampling, cfg.server
    if sv.backend == "embedded" and s.max_completion_length >= sv.embedded.max_model_len:
        yield (
            f"sampling.max_completion_length ({s.max_completion_length}) must be below "
            f"server.embedded.max_model_len ({sv.embedded.max_model_len}) to leave room for the prompt."
        )


def token_budget_fits_completion(cfg: RootConfig) -> Iterator[str]:
    pk, s = cfg.packing, cfg.sampling
    if pk.token_budget is not None and 0 < pk.token_budget <= s.max_completion_length:
        yield (
            f"packing.token_budget ({pk.token_budget}) must exceed sampling.max_completion_length "
            f"({s.max_completion_length}) plus the prompt: raise packing.token_budget or lower "
            "sampling.max_completion_length."
        )


def grpo_needs_groups(cfg: RootConfig) -> Iterator[str]:
    """GRPO normalizes rewards within a group: it needs G >= 2 and a reward (distillation needs neither)."""
    if cfg.algorithm != "grpo":
        return
    if cfg.sampling.num_generations < 2:
        yield (
            f"sampling.num_generations ({cfg.sampling.num_generations}) must be >= 2: GRPO normalizes rewards "
            "within a group."
        )
    if not cfg.rewards.funcs and not cfg.rollout.environment_factory and not cfg.rollout.harness.enabled:
        yield (
            "rewards.funcs is empty: give at least one reward function (or an environment with get_reward, "
            'rollout.environment_factory, or a harness that prints {"reward": ...}, rollout.harness.command).'
        )


def environment_rows_need_an_environment(cfg: RootConfig) -> Iterator[str]:
    """``data.source=environment`` rows carry no task: an environment's ``reset`` must supply it, and the
    stream cycles over them, so the run's length must be set."""
    sources = [
        cfg.data.source,
        *(p.get("source", cfg.data.source) for p in cfg.data.mix if hasattr(p, "get")),
    ]
    if "environment" not in sources:
        return
    if not cfg.rollout.environment_factory:
        yield (
            "data.source=environment has no prompts: set rollout.environment_factory to an environment whose "
            "reset() returns the task (e.g. rollout.environment_factory=increment)."
        )
    if cfg.trainer.max_steps <= 0:
        yield (
            "data.source=environment: the environment owns the data, so epochs have no meaning; set "
            "trainer.max_steps."
        )


def tools_need_grpo(cfg: RootConfig) -> Iterator[str]:
    if cfg.algorithm == "distill" and cfg.rollout.harness.enabled:
        yield (
            "rollout.harness.command is not supported by asyncgrpo distill (its rollouts are single completions "
            "scored by a teacher); train harnesses with asyncgrpo train."
        )
    if cfg.algorithm == "distill" and cfg.rollout.has_agents:
        yield (
            "rollout.tools / rollout.environment_factory are not supported by asyncgrpo distill (its rollouts "
            "are single completions scored by a teacher); train agents with asyncgrpo train."
        )


def distill_needs_teachers(cfg: RootConfig) -> Iterator[str]:
    if cfg.algorithm == "distill" and not cfg.teacher.servers:
        yield (
            "teacher.servers is empty: name at least one teacher, e.g. teacher=default (a server at "
            "localhost:8001) or +teacher.servers.math=http://localhost:8001."
        )


def jsd_runs_under_distill(cfg: RootConfig) -> Iterator[str]:
    """The JSD loss reads teacher scores that only the distillation loop produces, over the full vocabulary."""
    lo, s = cfg.loss, cfg.sampling
    if lo.name != "jsd":
        return
    if cfg.algorithm != "distill":
        yield (
            "loss.name=jsd is the distillation loss: it needs teacher scores, which only `asyncgrpo distill` "
            "produces; run asyncgrpo distill, or pick a GRPO loss (score_centering, clipped)."
        )
    if s.truncates and s.sampling_mask != "off":
        yield (
            f"loss.name=jsd compares the student's full-vocabulary distribution with the teacher's, but "
            f"sampling.sampling_mask={s.sampling_mask} would renormalize it over truncated sampling's candidate "
            "sets: set sampling.sampling_mask=off (or sample without top_k / top_p / min_p)."
        )
    if lo.beta == 1 and not lo.add_tail_bucket:
        yield (
            "loss.beta=1 with loss.add_tail_bucket=false leaves the sampled token alone on the support, with "
            "probability 1 on both sides: the loss is 0. Keep loss.add_tail_bucket=true."
        )


def embedded_teachers_serve_top_k(cfg: RootConfig) -> Iterator[str]:
    """An embedded teacher caps prompt_logprobs like vLLM's default --max-logprobs (20)."""
    if cfg.algorithm != "distill":
        return
    try:
        servers = teacher_policy.teacher_servers(cfg.teacher)
    except ValueError:
        return  # reported by the teacher group's check
    if cfg.teacher.top_k > 20 and any(t.backend == "embedded" for t in servers):
        yield (
            f"teacher.top_k ({cfg.teacher.top_k}) is above the embedded teacher's 20 log-probs per position: "
            "lower teacher.top_k to 20 or less."
        )


CROSS_GROUP_RULES: tuple[Callable[[RootConfig], Iterable[str]], ...] = (
    mixed_precision_keeps_fp32_master,
    flex_attention_needs_cuda,
    triton_head_needs_cuda,
    nccl_sync_needs_gpus,
    completion_fits_embedded_server,
    token_budget_fits_completion,
    lora_policy.config_errors,  # model.lora with server.weight_sync and the server's adapter limits
    grpo_needs_groups,
    environment_rows_need_an_environment,
    tools_need_grpo,
    distill_needs_teachers,
    jsd_runs_under_distill,
    embedded_teachers_serve_top_k,
)
"""Rules that read more than one group, each a named function of the whole config."""


def value_errors(cfg: RootConfig) -> list[str]:
    """Every value problem of a typed config: each group's choices and check, then the cross-group rules."""
    errors: list[str] = []
    for group, check in GROUP_CHECKS.items():
        sub = getattr(cfg, group)
        errors += choice_errors(sub, group)
        errors += check(sub)
    for rule in CROSS_GROUP_RULES:
        errors += rule(cfg)
    return errors
