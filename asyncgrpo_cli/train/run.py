"""``asyncgrpo train``: assemble the run (server, model, rollout process, loop) and always clean up.

Order (design.md, process model): connect to or start the server; load the model; push its weights once
before generation starts (so a reused server never serves a stale policy); spawn the rollout process; train.
Everything started here is stopped in ``finally`` (by PID), so job 2 of a multirun sweep starts clean even when
job 1 crashed.
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

    from asyncgrpo_cli.data.sources import load_prompts
    from asyncgrpo_cli.metrics.logger import MetricsLogger
    from asyncgrpo_cli.metrics.reducer import MetricWindow
    from asyncgrpo_cli.model.loading import load_policy, load_tokenizer
    from asyncgrpo_cli.model.resolve import resolve_model_path
    from asyncgrpo_cli.packing.planner import TokenBudgetPlanner
    from asyncgrpo_cli.rollout.loop import RolloutSettings
    from asyncgrpo_cli.rollout.process import RolloutProcess, RolloutSpec
    from asyncgrpo_cli.train.batching import StepCollector
    from asyncgrpo_cli.train.checkpoint import (
        TrainerState,
        find_resume_checkpoint,
        load_training_state,
        read_resume_state,
    )
    from asyncgrpo_cli.train.optim import build_optimizer, build_scheduler
    from asyncgrpo_cli.train.progress import PromptTracker
    from asyncgrpo_cli.train.trainer import Trainer, TrainParts

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tr = cfg.trainer
    if tr.num_threads:
        torch.set_num_threads(tr.num_threads)
    seed_everything(tr.seed)
    registry.load_user_plugins()

    resume_path = find_resume_checkpoint(tr.resume, run_dir)
    if tr.resume == "auto" and resume_path is None:
        logger.info("trainer.resume=auto: no checkpoint in %s, starting fresh", run_dir)
    resume = read_resume_state(resume_path) if resume_path else None
    state = resume.trainer if resume else TrainerState()
    tracker = PromptTracker.from_state(resume.rollout) if resume else PromptTracker()

    model_path = resolve_model_path(cfg.model.name_or_path)
    dataset = load_prompts(cfg.data)
    total_prompts = total_prompts_for(cfg, len(dataset))

    with ExitStack() as stack:
        backend_cls = registry.resolve("server", cfg.server.backend)
        server = backend_cls(cfg.server, model_path, cfg.model.served_model_name, run_dir)
        stack.callback(server.stop)
        info = server.start()
        served = cfg.model.served_model_name or info.model_id
        token_budget = cfg.packing.token_budget or info.max_model_len
        if not token_budget:
            raise UserError(
                "the server does not report max_model_len in /v1/models: set packing.token_budget."
            )
        logger.info(
            "server %s serves %r (max_model_len=%s); token budget %d",
            server.base_url,
            served,
            info.max_model_len,
            token_budget,
        )

        device = pick_device(tr.device)
        weights_from = str(resume.path) if resume else model_path
        tokenizer = load_tokenizer(weights_from, cfg.model)
        model = load_policy(weights_from, cfg.model, device)
        optimizer = build_optimizer(model, tr)
        scheduler = build_scheduler(optimizer, tr)
        if resume:
            load_training_state(resume.path, optimizer, scheduler)
            logger.info("resumed from %s at step %d (prompt %d)", resume.path, state.step, tracker.low_water)

        sync_cls = registry.resolve("weight_sync", cfg.server.weight_sync)
        sync_dir = Path(cfg.server.weight_sync_dir or run_dir / "weights")
        weight_sync = sync_cls(server.control, sync_dir)
        stack.callback(weight_sync.close)
        weight_sync.push(model, state.model_version)  # before generation starts

        s = cfg.sampling
        if s.top_p < 1.0 or s.top_k > 0 or s.min_p > 0:
            logger.warning(
                "sampling.top_p/top_k/min_p truncate the sampling distribution, but the trainer normalizes its "
                "log-probs over the full vocabulary: importance ratios are biased low by the surviving mass "
                "(no sampling-mask renormalization yet)"
            )
        loss_fn = registry.resolve("loss", cfg.loss.name)(cfg.loss)
        packer = registry.resolve("packer", cfg.packing.kind)(cfg.packing)
        num_topk = cfg.sampling.num_sampler_logprobs if getattr(loss_fn, "needs_sampler_topk", False) else 0
        settings = RolloutSettings(
            sampling=cfg.sampling,
            rollout=cfg.rollout,
            base_url=server.base_url,
            served_model=served,
            max_model_len=info.max_model_len or token_budget,
            server_timeout=cfg.server.timeout,
            max_retries=cfg.server.max_retries,
            num_topk=num_topk,
            tokenizer_path=model_path,
            chat_template_kwargs=dict(cfg.model.chat_template_kwargs),
            total_prompts=total_prompts,
            dataset_start_index=tracker.low_water,
            skip_prompt_seqs=sorted(tracker.resolved_above),
            data_seed=tr.seed,
            shuffle=cfg.data.shuffle,
            seed_offset=state.step,
        )
        rollout = RolloutProcess(
            RolloutSpec(cfg.rollout.loop, settings, dataset, list(cfg.rewards.funcs)),
            worker_timeout=cfg.rollout.rollout_worker_timeout,
            start_timeout=cfg.rollout.start_timeout,
        )
        rollout.set_model_version(state.model_version)
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
        window = MetricWindow()
        planner = TokenBudgetPlanner(token_budget, num_ranks=1)
        collector = StepCollector(
            rollout, planner, tracker, cfg.rollout.max_staleness, tr.gradient_accumulation_steps, window
        )
        parts = TrainParts(
            model=model,
            tokenizer=tokenizer,
            device=device,
            optimizer=optimizer,
            scheduler=scheduler,
            loss_fn=loss_fn,
            packer=packer,
            collector=collector,
            rollout=rollout,
            weight_sync=weight_sync,
            metrics_logger=metrics_logger,
            tracker=tracker,
            state=state,
            token_budget=token_budget,
            total_prompts=total_prompts,
        )
        return Trainer(cfg, run_dir, parts, window).train()
