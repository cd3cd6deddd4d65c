"""The training loop: plan a step, forward/backward its micro-batches with an exact token-mean loss, step the
optimizer, push weights every ``weight_sync_steps``, log the window, checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncgrpo_cli.config.schema import RootConfig
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.model.logprobs import token_logprobs
from asyncgrpo_cli.rollout.staleness import initial_allowance, step_allowance
from asyncgrpo_cli.train.batching import StepBatch, StepCollector
from asyncgrpo_cli.train.checkpoint import TrainerState, save_checkpoint
from asyncgrpo_cli.train.losses import merge_metric_parts, metric_records
from asyncgrpo_cli.train.progress import PromptTracker

logger = logging.getLogger(__name__)


@dataclass
class TrainParts:
    """What the loop drives; assembled (and cleaned up) by ``train.run``."""

    model: Any
    tokenizer: Any
    device: torch.device
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: Any
    packer: Any
    collector: StepCollector
    rollout: Any
    weight_sync: Any
    metrics_logger: Any
    tracker: PromptTracker
    state: TrainerState
    token_budget: int
    total_prompts: int | None


class Trainer:
    def __init__(self, cfg: RootConfig, run_dir: Path, parts: TrainParts, window: MetricWindow):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.p = parts
        self.window = window
        s = cfg.sampling
        self.temperature = s.temperature if s.temperature >= 1e-5 else 1.0
        self.with_topk = bool(getattr(parts.loss_fn, "needs_sampler_topk", False))
        self.params = [q for q in parts.model.parameters() if q.requires_grad]
        self._last_save_step = -1
        self._last_logged_step = parts.state.step

    # ------------------------------------------------------------------ loop
    def train(self) -> TrainerState:
        cfg, p = self.cfg, self.p
        rows_per_step = cfg.trainer.gradient_accumulation_steps  # x world size when sharded
        p.rollout.set_allowance(initial_allowance(cfg.rollout.max_staleness, p.token_budget, rows_per_step))
        p.metrics_logger.update_progress(p.state.step, p.tracker.consumed_count)
        while not self._finished():
            t_step = time.monotonic()
            step = p.collector.collect(p.state.model_version)
            if step is None:
                break
            self._train_step(step, t_step)
            if cfg.trainer.save_steps and p.state.step % cfg.trainer.save_steps == 0:
                self.save()
        if cfg.trainer.save_final and self._last_save_step != p.state.step and p.state.step > 0:
            self.save()
        self._flush_logs(force=True)
        return p.state

    def _finished(self) -> bool:
        tr = self.cfg.trainer
        if tr.max_steps > 0:
            return self.p.state.step >= tr.max_steps
        return self.p.collector.exhausted

    # ------------------------------------------------------------------ one step
    def _train_step(self, step: StepBatch, t_step: float) -> None:
        p = self.p
        num_trained = step.num_trained
        p.model.train()
        raw_parts, loss_total, t_fwd, t_fwdbwd, forwarded, unpacked = [], 0.0, 0.0, 0.0, 0, 0
        for mb in step.microbatches:
            row = p.packer.pack(mb.rows[0]).to(p.device)
            t0 = time.monotonic()
            stats = token_logprobs(p.model, row, self.temperature, self.with_topk)
            loss, raw = p.loss_fn(stats, row, num_trained)
            t1 = time.monotonic()
            loss.backward()
            t_fwd += t1 - t0
            t_fwdbwd += time.monotonic() - t0
            loss_total += float(loss.detach())
            raw_parts.append(raw)
            forwarded += row.num_forwarded
            unpacked += row.num_unpacked
            self._record_microbatch(mb)
        t_opt = time.monotonic()
        grad_norm = self._optimizer_step()
        t_opt = time.monotonic() - t_opt
        p.state.step += 1
        p.state.num_tokens += forwarded
        for s in step.samples:
            p.tracker.on_sample_done(s.prompt_seq, s.group_num_samples)
        consumed = sum(len(s) for s in step.samples)
        p.rollout.set_allowance(step_allowance(self.cfg.rollout.max_staleness, consumed))
        if p.state.step % self.cfg.rollout.weight_sync_steps == 0:
            self.sync_weights()
        step_s = time.monotonic() - t_step
        self._record_step(
            step, raw_parts, loss_total, grad_norm, forwarded, unpacked, t_fwd, t_fwdbwd, t_opt, step_s
        )
        p.metrics_logger.update_progress(p.state.step, p.tracker.consumed_count)
        self._flush_logs()

    def _optimizer_step(self) -> float:
        p = self.p
        max_norm = self.cfg.trainer.max_grad_norm
        if max_norm and max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        else:
            grads = [q.grad.detach().norm() for q in self.params if q.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(grads)) if grads else torch.tensor(0.0)
        p.optimizer.step()
        p.scheduler.step()
        p.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def sync_weights(self) -> None:
        p = self.p
        version = p.state.model_version + 1
        timings = p.weight_sync.push(p.model, version)
        p.state.model_version = version
        p.rollout.set_model_version(version)
        for name, value in timings.items():
            self.window.add(name, value)

    # ------------------------------------------------------------------ metrics
    def _record_microbatch(self, mb: Any) -> None:
        w = self.window
        for r in range(len(mb.rows)):
            w.add("batch/samples_per_row", float(mb.samples_per_row[r]))
            w.add("batch/row_tokens_mean", float(mb.tokens_per_row[r]))
            w.add("batch/row_tokens_max", float(mb.tokens_per_row[r]))
            w.add("batch/row_fill_frac", float(mb.row_fill_frac[r]))
        w.add("batch/row_imbalance", mb.row_imbalance)

    def _record_step(
        self,
        step: StepBatch,
        raw_parts: list[dict],
        loss_total: float,
        grad_norm: float,
        forwarded: int,
        unpacked: int,
        t_fwd: float,
        t_fwdbwd: float,
        t_opt: float,
        step_s: float,
    ) -> None:
        w, p = self.window, self.p
        trained = step.num_trained
        rates, extremes = metric_records(merge_metric_parts(raw_parts))
        for name, (num, den) in rates.items():
            w.add_rate(name, num, den)
        for name, value in extremes.items():
            w.add(name, value)
        w.add("loss", loss_total)
        w.add("grad_norm", grad_norm)
        w.add("learning_rate", p.scheduler.get_last_lr()[0])
        w.add("batch/forwarded_tokens_per_step", forwarded)
        w.add("batch/trained_tokens_per_step", trained)
        w.add("batch/samples_per_step", len(step.samples))
        w.add("batch/groups_per_step", len({s.prompt_seq for s in step.samples}))
        w.add("batch/microbatches_per_step", len(step.microbatches))
        w.add_rate("batch/masked_token_frac", forwarded - trained, forwarded)
        w.add_rate("batch/packing_ratio", unpacked, forwarded)
        w.add("batch/pad_frac", 0.0)
        for s in step.samples:
            w.add("reward_kept", s.reward)
            w.add("reward_group_std", s.reward_group_std)
            for name, std in s.reward_func_group_std.items():
                w.add(f"rewards/{name}/group_std", std)
            w.add("sample/forwarded_tokens_mean", len(s))
            w.add("sample/forwarded_tokens_max", len(s))
            w.add("sample/trained_tokens_mean", s.num_trained)
        w.add("perf/step_s", step_s)
        w.add("perf/fwd_bwd_s", t_fwdbwd)
        w.add("perf/fwd_s", t_fwd)
        w.add("perf/optimizer_s", t_opt)
        w.add("perf/rollout_wait_s", step.wait_s)
        w.add_rate("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, t_fwdbwd)
        w.add_rate("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)
        w.add_rate("perf/wall_clock_trained_tokens_per_s", trained, step_s)
        w.set_gauge("num_tokens", p.state.num_tokens)
        w.set_gauge("model_version", p.state.model_version)
        w.set_gauge("rollout/queue_size", p.rollout.queue_size())
        w.set_gauge("prompts_consumed", p.tracker.consumed_count)
        if self.cfg.logging.log_completions:
            self._log_completions(step)

    def _log_completions(self, step: StepBatch) -> None:
        tok = self.p.tokenizer
        shown = []
        for s in step.samples[: self.cfg.logging.num_completions_to_print or len(step.samples)]:
            idx = np.nonzero(s.train_mask)[0]
            first = int(idx[0]) if idx.size else len(s)
            shown.append(
                {
                    "prompt": tok.decode(s.input_ids[:first].tolist(), skip_special_tokens=True),
                    "completion": tok.decode(s.input_ids[first:].tolist(), skip_special_tokens=True),
                    "reward": s.reward,
                    "advantage": s.advantage,
                }
            )
        self.p.metrics_logger.log_completions(shown, step=self.p.state.step)

    def _flush_logs(self, force: bool = False) -> None:
        """Log the window every ``logging_steps`` steps; at the end (``force``) log a last partial window."""
        p = self.p
        for payload in p.rollout.drain_metrics():
            self.window.merge(payload)
        due = p.state.step % self.cfg.logging.logging_steps == 0
        if (not force and not due) or p.state.step == self._last_logged_step or len(self.window) == 0:
            return
        p.metrics_logger.log(p.state.step, self.window.reduce())
        self._last_logged_step = p.state.step
        self.window.reset()

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        p = self.p
        path = save_checkpoint(
            self.run_dir,
            p.model,
            p.tokenizer,
            p.optimizer,
            p.scheduler,
            p.state,
            p.tracker.state(),
            self.cfg.trainer.save_total_limit,
        )
        self._last_save_step = p.state.step
        logger.info("saved checkpoint %s", path)
        return path
