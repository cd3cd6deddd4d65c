"""``asyncgrpo train``: assemble the run (server, model, rollout process, loop) and always clean up.

Order (design.md, process model): connect to or start the server; load the model (FSDP2 when launched with
several ranks); push its weights once before generation starts (so a reused server never serves a stale policy);
spawn the rollout process (rank 0); train. Everything started here is stopped in ``finally`` (by PID), so job 2
of a multirun sweep starts clean even when job 1 crashed.
"""

from __future__ import annotations

import logging
import math
import os
import random
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from asyncgrpo_cli import registry
from asyncgrpo_cli.config.schema import RootConfig
from asyncgrpo_cli.errors import UserError

logger = logging.getLogger(__name__)


def pick_device(name: str) -> Any:
    import torch

    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError(
                "trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto."
            )
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def total_prompts_for(cfg: RootConfig, num_rows: int) -> int | None:
    """Prompts an epoch-based run generates (``num_train_epochs`` passes); None when ``max_steps`` rules."""
    if cfg.trainer.max_steps > 0:
        return None
    return max(1, math.ceil(cfg.trainer.num_train_epochs * num_rows))


def run_train(cfg: RootConfig, run_dir: Path) -> Any:
    import torch

    from asyncgrpo_cli.metrics.reducer import MetricWindow
    from asyncgrpo_cli.model.loading import load_policy, load_tokenizer
    from asyncgrpo_cli.model.resolve import resolve_model_path
    from asyncgrpo_cli.model.router import resolve_router_aux
    from asyncgrpo_cli.train.checkpoint import (
        TrainerState,
        find_resume_checkpoint,
        load_training_state,
        read_resume_state,
    )
    from asyncgrpo_cli.train.compile import maybe_compile_decoder_layers
    from asyncgrpo_cli.train.distributed import (
        broadcast_object,
        destroy_distributed,
        init_distributed,
        shard_model,
    )
    from asyncgrpo_cli.train.optim import build_optimizer, build_scheduler
    from asyncgrpo_cli.train.progress import PromptTracker
    from asyncgrpo_cli.train.trainer import Trainer, TrainParts

    tr = cfg.trainer
    if tr.num_threads:
        torch.set_num_threads(tr.num_threads)
    if tr.keep_host_memory:
        from asyncgrpo_cli.host_memory import keep_freed_memory

        keep_freed_memory()
    device = pick_device(tr.device)
    with ExitStack() as stack:
        info = init_distributed(device, tr.dist_timeout)
        finished = False  # every rank reached the end: they tear the group down together
        stack.callback(lambda: destroy_distributed(synchronize=finished))
        run_dir = Path(broadcast_object(str(run_dir), info))  # ranks may have stamped different Hydra dirs
        if info.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        seed_everything(tr.seed)
        registry.load_user_plugins()
        # A harness program that does not exist fails before any server starts (a vLLM launch takes minutes).
        if cfg.rollout.harness.enabled:
            from asyncgrpo_cli.rollout.agent.startup import check_harness_command

            check_harness_command(list(cfg.rollout.harness.command), cfg.rollout.harness.cwd)

        resume_path = find_resume_checkpoint(tr.resume, run_dir)
        if tr.resume == "auto" and resume_path is None and info.is_main:
            logger.info("trainer.resume=auto: no checkpoint in %s, starting fresh", run_dir)
        resume = read_resume_state(resume_path) if resume_path else None
        if resume and info.is_main:
            _warn_if_data_changed(resume, cfg)
        state = resume.trainer if resume else TrainerState()
        if tr.max_steps > 0 and state.step >= tr.max_steps:  # a finished run: start nothing, save nothing
            if info.is_main:
                logger.info(
                    "%s is at step %d: trainer.max_steps=%d is reached", resume.path, state.step, tr.max_steps
                )
            finished = True
            return state
        tracker = PromptTracker.from_state(resume.rollout) if resume else PromptTracker()

        model_path = resolve_model_path(cfg.model.name_or_path) if info.is_main else None
        model_path = broadcast_object(model_path, info)
        main = _start_main_side(cfg, run_dir, model_path, stack) if info.is_main else None

        tokenizer = load_tokenizer(model_path, cfg.model)
        model = load_policy(model_path, cfg.model, device)
        router = resolve_router_aux(model, cfg.loss.router_aux_loss_coef)  # MoE load balancing, or None
        maybe_compile_decoder_layers(model, tr.compile, device)  # trainer.compile=auto: on CUDA
        model = shard_model(
            model,
            info,
            device,
            tr.mixed_precision,
            tr.cpu_offload,
            tr.reshard_after_forward,
            tr.one_rank_cast,
        )
        optimizer = build_optimizer(model, tr)
        scheduler = build_scheduler(optimizer, tr)
        if resume:
            load_training_state(resume.path, model, optimizer, scheduler, info)
            if info.is_main:
                logger.info(
                    "resumed from %s at step %d (prompt %d)", resume.path, state.step, tracker.low_water
                )

        sync_cls = registry.resolve("weight_sync", cfg.server.weight_sync)
        sync_dir = broadcast_object(str(cfg.server.weight_sync_dir or run_dir / "weights"), info)
        control = main.server.control if main else None
        weight_sync = sync_cls.build(cfg, control, Path(sync_dir), info)  # protocols.WeightSync
        stack.callback(weight_sync.close)
        weight_sync.push(model, state.model_version)  # before generation starts

        loss_fn = registry.resolve("loss", cfg.loss.name)(cfg.loss)
        packer = registry.resolve("packer", cfg.packing.kind)(cfg.packing)
        parts = TrainParts(
            model=model,
            tokenizer=tokenizer,
            device=device,
            optimizer=optimizer,
            scheduler=scheduler,
            loss_fn=loss_fn,
            packer=packer,
            weight_sync=weight_sync,
            state=state,
            tracker=tracker,
            info=info,
            router=router,
        )
        window = MetricWindow()
        if info.is_main:
            _start_rollout(cfg, run_dir, main, parts, window, stack)
        state = Trainer(cfg, run_dir, parts, window).train()
        finished = True
        return state


def _warn_if_data_changed(resume: Any, cfg: RootConfig) -> None:
    from asyncgrpo_cli.train.checkpoint import data_changes

    changes = data_changes(resume.data, cfg.data)
    if changes:
        logger.warning(
            "resuming from %s with other prompts than it trained on (%s): its progress (rollout_state.json) "
            "counts rows of the old data, so rows of the new data may be skipped or trained twice; resume with "
            "the old data, or start a fresh run in another hydra.run.dir",
            resume.path,
            "; ".join(changes),
        )


class _MainSide:
    """Rank 0's resources: the server backend and the prompt dataset."""

    def __init__(
        self, server: Any, info: Any, dataset: Any, token_budget: int, served: str, sampling_mask: bool
    ):
        self.server, self.info, self.dataset = server, info, dataset
        self.token_budget, self.served = token_budget, served
        self.sampling_mask = sampling_mask
        """Request each token's candidate set (truncated sampling on a server that returns them)."""


def _start_main_side(cfg: RootConfig, run_dir: Path, model_path: str, stack: ExitStack) -> _MainSide:
    from asyncgrpo_cli.data.sources import load_prompts

    dataset = load_prompts(cfg.data, prompt_optional=bool(cfg.rollout.environment_factory))
    backend_cls = registry.resolve("server", cfg.server.backend)
    server = backend_cls(cfg.server, model_path, cfg.model.served_model_name, run_dir)
    stack.callback(server.stop)
    info = server.start()
    from asyncgrpo_cli.server.probe import probe_server

    report = probe_server(
        server.control, cfg, model_path=model_path
    )  # every capability the run needs, or the fix
    served = cfg.model.served_model_name or info.model_id
    token_budget = cfg.packing.token_budget if cfg.packing.token_budget is not None else info.max_model_len
    if token_budget is None or (token_budget <= 0 and not info.max_model_len):
        raise UserError("the server does not report max_model_len in /v1/models: set packing.token_budget.")
    logger.info(
        "server %s serves %r (max_model_len=%s); token budget %d",
        server.base_url,
        served,
        info.max_model_len,
        token_budget,
    )
    from asyncgrpo_cli.server.mask_support import resolve_sampling_mask

    sampling_mask = resolve_sampling_mask(report, cfg)  # warns once when truncated sampling goes without
    return _MainSide(server, info, dataset, token_budget, served, sampling_mask)


def _start_rollout(
    cfg: RootConfig, run_dir: Path, main: _MainSide, parts: Any, window: Any, stack: ExitStack
) -> None:
    """Rank 0: spawn the rollout process, the metrics sinks and the step planner."""
    from asyncgrpo_cli.metrics.logger import MetricsLogger
    from asyncgrpo_cli.packing import planner_for
    from asyncgrpo_cli.rollout.process import RolloutProcess, RolloutSpec
    from asyncgrpo_cli.rollout.settings import RolloutSettings
    from asyncgrpo_cli.samples import SAMPLER_TOPK
    from asyncgrpo_cli.train.batching import StepCollector

    tr, state, tracker = cfg.trainer, parts.state, parts.tracker
    total_prompts = total_prompts_for(cfg, len(main.dataset))
    num_topk = cfg.sampling.num_sampler_logprobs if SAMPLER_TOPK in parts.loss_fn.needs else 0
    loop_cls = registry.resolve("rollout_loop", cfg.rollout.loop)
    prepared = loop_cls.prepare(  # e.g. the distillation loop starts and probes its teachers
        cfg,
        run_dir,
        stack,
        main.dataset,
        str(parts.tokenizer.name_or_path),
        main.info.max_model_len or max(main.token_budget, 1),
    )
    settings = RolloutSettings(
        sampling=cfg.sampling,
        rollout=cfg.rollout,
        base_url=main.server.base_url,
        served_model=main.served,
        max_model_len=main.info.max_model_len or max(main.token_budget, 1),
        server_timeout=cfg.server.timeout,
        max_retries=cfg.server.max_retries,
        num_topk=num_topk,
        tokenizer_path=str(parts.tokenizer.name_or_path),
        chat_template_kwargs=dict(cfg.model.chat_template_kwargs),
        total_prompts=total_prompts,
        dataset_start_index=tracker.low_water,
        skip_prompt_seqs=sorted(tracker.resolved_above),
        data_seed=tr.seed,
        shuffle=cfg.data.shuffle,
        seed_offset=state.step,
        sampling_mask=main.sampling_mask,
        versioned_model=parts.weight_sync.served_name_template,  # lora: policy-v{version}
        prepared=prepared,
    )
    rollout = RolloutProcess(
        RolloutSpec(cfg.rollout.loop, settings, main.dataset, list(cfg.rewards.funcs)),
        worker_timeout=cfg.rollout.rollout_worker_timeout,
        start_timeout=cfg.rollout.start_timeout,
    )
    rollout.set_model_version(state.model_version)
    rollout.server_check = main.server.check_alive  # an owned server that exits: fail now
    stack.callback(rollout.stop)
    rollout.start()
    metrics_logger = MetricsLogger(
        cfg.logging,
        run_dir,
        asdict(cfg),
        total_steps=tr.max_steps if tr.max_steps > 0 else None,
        total_prompts=total_prompts,
    )
    stack.callback(metrics_logger.close)
    if main.token_budget > 0:
        planner = planner_for(parts.packer)(main.token_budget, num_ranks=parts.info.world_size)
    else:  # packing.token_budget <= 0: a fixed number of samples per row
        from asyncgrpo_cli.packing.planner import FixedCountPlanner

        planner = FixedCountPlanner(
            cfg.packing.samples_per_row, parts.info.world_size, main.info.max_model_len or 1
        )
    parts.collector = StepCollector(
        rollout, planner, tracker, cfg.rollout.max_staleness, tr.gradient_accumulation_steps, window
    )
    parts.rollout, parts.metrics_logger = rollout, metrics_logger
    parts.total_prompts = total_prompts
