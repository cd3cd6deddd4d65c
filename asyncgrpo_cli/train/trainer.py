"""The training loop: plan a step (rank 0), give every rank its rows, forward/backward with an exact token-mean
loss, step the optimizer, push weights every ``weight_sync_steps``, log the window, checkpoint.

With several ranks, rank 0 owns the rollout process, the planner, the metrics and the server; the others only
train. Every rank enters the same collectives in the same order: the step scatter, the metric reduction, the
weight gathers of a sync, and the checkpoint.
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
from asyncgrpo_cli.packing.row import PackedRow
from asyncgrpo_cli.rollout.resync import server_unreachable, settle_when_back
from asyncgrpo_cli.train.batching import StepBatch, StepCollector
from asyncgrpo_cli.train.checkpoint import TrainerState, data_identity, save_checkpoint
from asyncgrpo_cli.train.compile import compile_meter
from asyncgrpo_cli.train.distributed import DistInfo, RankStep, rank_steps, reduce_raw_metrics, scatter_step
from asyncgrpo_cli.train.losses import merge_metric_parts
from asyncgrpo_cli.train.profiler import StepProfiler
from asyncgrpo_cli.train.progress import PromptTracker
from asyncgrpo_cli.train.step import OptimizerStep, forward_backward
from asyncgrpo_cli.train.step_metrics import StepTimes, record_step

logger = logging.getLogger(__name__)


@dataclass
class TrainParts:
    """What the loop drives; assembled (and cleaned up) by ``train.run``. Rank-0-only parts are None elsewhere."""

    model: Any
    tokenizer: Any
    device: torch.device
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: Any
    packer: Any
    weight_sync: Any
    state: TrainerState
    tracker: PromptTracker
    info: DistInfo
    collector: StepCollector | None = None
    rollout: Any = None
    metrics_logger: Any = None
    total_prompts: int | None = None
    router: Any = None
    """The MoE router aux loss (``model/router.RouterAux``), or None: no aux term, no ``aux_loss`` metric."""


class Trainer:
    def __init__(self, cfg: RootConfig, run_dir: Path, parts: TrainParts, window: MetricWindow):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.p = parts
        self.info = parts.info
        self.window = window
        s = cfg.sampling
        sampling_t = s.temperature if s.temperature >= 1e-5 else 1.0
        head_t = parts.loss_fn.head_temperature  # protocols.Loss: None = the sampling temperature
        self.temperature = sampling_t if head_t is None else head_t
        self._last_save_step = parts.state.step if parts.state.step > 0 else -1  # resumed: that step is saved
        self._last_logged_step = parts.state.step
        self._push_owed = False  # a scheduled weight push did not reach the server (rollout.resync)
        # rows packed in the overlap, by id: (the row's samples, its packed row), until a step takes them
        self._ready: dict[int, tuple[list, PackedRow]] = {}
        from asyncgrpo_cli.train.flops import StepFlops, peak_tflops

        compute = cfg.trainer.mixed_precision or cfg.model.dtype
        self._peak = peak_tflops(parts.device, compute)
        self._flops = StepFlops(parts.model) if self._peak is not None else None
        self._compile_meter = compile_meter() if self.info.is_main else None
        prof = cfg.trainer.profile
        self._profiler = (
            StepProfiler(prof, self.run_dir / "profile", self.info.rank, parts.device) if prof.steps else None
        )
        if self._compile_meter is not None:
            self._compile_meter.take()  # from here on: what the steps compile

    # ------------------------------------------------------------------ loop
    def train(self) -> TrainerState:
        cfg, p = self.cfg, self.p
        if self.info.is_main:
            p.metrics_logger.update_progress(p.state.step, p.tracker.consumed_count)
            p.rollout.on_idle = self.resync_weights_if_needed  # also while waiting for samples
        try:
            while True:
                if self.info.is_main:
                    self.resync_weights_if_needed()
                if self._profiler is not None:
                    self._profiler.before(p.state.step + 1)
                t_step = time.monotonic()
                step = self._next_step() if self.info.is_main else None
                t_handout = time.monotonic()
                mine = scatter_step(self._split(step) if self.info.is_main else None, self.info)
                if mine.done:
                    break
                if self.info.is_main:  # packing rows not packed ahead, and the scatter: every rank waits
                    self.window.add("perf/handout_s", time.monotonic() - t_handout)
                self._train_step(mine, step, t_step)
                if self._profiler is not None:
                    self._profiler.after(p.state.step)
                if cfg.trainer.save_steps and p.state.step % cfg.trainer.save_steps == 0:
                    self.save()
        finally:
            if self._profiler is not None:
                self._profiler.close()
        if cfg.trainer.save_final and self._last_save_step != p.state.step and p.state.step > 0:
            self.save()
        if self.info.is_main:
            if p.rollout is not None:
                self._publish_owed_weights()
            self._flush_logs(force=True)
        return p.state

    def _next_step(self) -> StepBatch | None:
        tr = self.cfg.trainer
        if tr.max_steps > 0 and self.p.state.step >= tr.max_steps:
            return None
        if tr.max_steps <= 0 and self.p.collector.exhausted:
            return None
        return self.p.collector.collect(self.p.state.model_version)

    def _prefetch_next(self) -> None:
        """Rank 0, while the GPU finishes this step: plan the queued samples of the next one, at the version it will
        train at (this step's scheduled weight sync, deferred or not, advances it by one), and pack the rows
        planned: with several ranks every one (rank 0 packs every rank's rows before the scatter, ``rank_steps``),
        in one process the first (``forward_backward``'s ``first_row``; it packs the others under the GPU's
        work)."""
        p = self.p
        t0 = time.monotonic()
        synced = (p.state.step + 1) % self.cfg.rollout.weight_sync_steps == 0
        p.collector.prefetch(p.state.model_version + int(synced))
        rows = p.collector.planned_rows()
        for row in rows if self.info.enabled else rows[:1]:
            if id(row) not in self._ready:
                self._ready[id(row)] = (row, p.packer.pack(row))
        self.window.add("perf/plan_overlapped_s", time.monotonic() - t0)

    def _take_ready(self, row: Any) -> PackedRow | None:
        """``row`` as ``_prefetch_next`` packed it (that very sample list), else None."""
        ready = self._ready.pop(id(row), None)
        return ready[1] if ready is not None and ready[0] is row else None

    def _pack(self, row: list) -> PackedRow:
        ready = self._take_ready(row)
        return ready if ready is not None else self.p.packer.pack(row)

    def _split(self, step: StepBatch | None) -> list[RankStep]:
        world = self.info.world_size
        if step is None:
            return [RankStep(done=True) for _ in range(world)]
        rows_by_rank = [[mb.rows[r] for mb in step.microbatches] for r in range(world)]
        return rank_steps(rows_by_rank, step.num_trained, self._pack if self.info.enabled else None)

    # ------------------------------------------------------------------ one step
    def _train_step(self, mine: RankStep, step: StepBatch | None, t_step: float) -> None:
        p = self.p
        res = forward_backward(
            p.model,
            mine.rows,
            mine.num_trained,
            p.packer,
            p.loss_fn,
            p.device,
            self.temperature,
            self.info.world_size,
            router=p.router,
            head_kernel=self.cfg.model.lm_head_kernel,
            overlap=self._prefetch_next if self.info.is_main else None,
            first_row=None if self.info.enabled or not mine.rows else self._take_ready(mine.rows[0]),
            optimizer=OptimizerStep(p.model, p.optimizer, p.scheduler, self.cfg.trainer.max_grad_norm),
        )
        raw = reduce_raw_metrics(merge_metric_parts(res.raw_parts), self.info)
        records = p.loss_fn.metric_records(raw)
        totals = self._sum_over_ranks(
            [res.loss, res.forwarded, res.unpacked, res.attn_pairs, res.aux_sum, res.aux_rows]
        )
        grad_norm = res.grad_norm
        p.state.step += 1
        forwarded, unpacked = int(totals[1]), int(totals[2])
        p.state.num_tokens += forwarded
        if self.info.is_main:
            p.collector.step_trained(step)  # resolves the step's prompts, publishes the next allowance
        if p.state.step % self.cfg.rollout.weight_sync_steps == 0:
            self._sync_weights_or_defer()
        if not self.info.is_main:
            return
        times = StepTimes(
            step_s=time.monotonic() - t_step,
            fwd_s=res.fwd_s,
            fwd_bwd_s=res.fwd_bwd_s,
            optimizer_s=res.optimizer_s,
        )
        if self._peak is not None:  # MFU where the device's peak at the compute dtype is known
            flops = self._flops(forwarded, step.num_trained, int(totals[3]))
            per_gpu = flops / self.info.world_size / (self._peak * 1e12)
            self.window.add_rate("perf/mfu_fwd_bwd", per_gpu, times.fwd_bwd_s)
            self.window.add_rate("perf/mfu_wall_clock", per_gpu, times.step_s)
        record_step(
            self.window,
            step,
            records,
            float(totals[0]),
            grad_norm,
            p.scheduler.get_last_lr()[0],
            forwarded,
            unpacked,
            times,
            aux_loss=(totals[4], totals[5]) if p.router is not None else None,
        )
        self._record_compile(times.step_s)
        self._record_gauges()
        if self.cfg.logging.log_completions:
            self._log_completions(step)
        p.metrics_logger.update_progress(p.state.step, p.tracker.consumed_count)
        self._flush_logs()

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        if not self.info.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.p.device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def sync_weights(self) -> None:
        """Every rank gathers; rank 0 writes and drives the server, then publishes the new policy version."""
        self._push(self.p.state.model_version + 1)

    def _push(self, version: int) -> None:
        """Push the model's weights as ``version`` (verified when ``server.verify_sync``), then publish it: the
        scheduled sync's next version, or a resync's current one (the weights have not changed since it)."""
        p = self.p
        timings = p.weight_sync.push(p.model, version)
        if self.cfg.server.verify_sync:  # the server now serves these weights, or the run stops here
            from asyncgrpo_cli.sync.verify import verify_weight_sync

            timings.update(
                verify_weight_sync(
                    self.cfg.server,
                    p.weight_sync,
                    p.model,
                    p.tokenizer,
                    version,
                    compute_dtype=self.cfg.trainer.mixed_precision,
                )
            )
        p.state.model_version = version
        if p.rollout is not None:
            p.rollout.set_model_version(version)
        for name, value in timings.items():
            self.window.add(name, value)

    # ------------------------------------------------------------------ server restarts (rollout.resync)
    def _sync_weights_or_defer(self) -> None:
        """The scheduled sync. When the server cannot be reached, every rank still advances the version (they stay
        in lockstep) but it is not published; ``resync_weights_if_needed`` pushes once the server is back."""
        try:
            self.sync_weights()
            self._push_owed = False  # this push reached the server: nothing older is owed
        except Exception as e:
            if not server_unreachable(e) or self.p.rollout is None:
                raise
            self.p.state.model_version += 1
            self._push_owed = True
            self.p.rollout.server_link.mark_lost()
            logger.warning("weight sync could not reach the server (%s); pushing again once it is back", e)

    def resync_weights_if_needed(self) -> None:
        """Rank 0, between steps and while waiting for samples: push the weights again when the rollout process
        found the server back without them (a restart; it holds generation until then) or a push did not reach
        it. Cheap when nothing is owed: one read of the shared link state."""
        p = self.p
        link = p.rollout.server_link
        if link.lost or not (self._push_owed or link.resync_requested):
            return
        token = link.resync_token()
        repush = p.weight_sync.repush  # rank-0-only re-send of a version already written (None: push again)
        try:
            if repush is not None:
                for name, value in repush(p.state.model_version).items():
                    self.window.add(name, value)
                p.rollout.set_model_version(p.state.model_version)
            elif self.info.world_size == 1:
                self._push(p.state.model_version)  # the same weights under the same version, as repush does
            else:
                raise RuntimeError(
                    "the generation server lost the trained weights (restart) or a weight push did not reach it, "
                    f"and the weight-sync backend {type(p.weight_sync).__name__} cannot re-send them from rank 0 "
                    "alone (no repush()); restart the run with trainer.resume=auto."
                )
        except Exception as e:
            if not server_unreachable(e):
                raise
            link.mark_lost()
            self._push_owed = True
            logger.warning("weight resync could not reach the server (%s); trying again once it is back", e)
            return
        self._push_owed = False
        link.finish_resync(token)
        self.window.add("perf/weight_resync_count", 1)
        logger.warning("pushed weights v%d again to the generation server", p.state.model_version)

    def _publish_owed_weights(self) -> None:
        """Rank 0, after the final checkpoint: a push the server missed (it was down at a scheduled sync, or came
        back without the weights once the rollout process had finished and stopped watching it) is made as soon
        as the server answers again, within ``server.timeout``; a server that stays down costs that wait and a
        warning, never the run (its weights are in the checkpoint)."""
        p = self.p
        link = p.rollout.server_link
        if link.healthy and not self._push_owed:
            return
        if p.weight_sync.repush is None and self.info.world_size > 1:
            logger.warning(
                "the generation server does not hold the final weights v%d (it was lost at the last sync) and "
                "%s cannot re-send them from rank 0 alone; they are in the final checkpoint",
                p.state.model_version,
                type(p.weight_sync).__name__,
            )
            return
        timeout = self.cfg.server.timeout
        if not settle_when_back(
            link,
            p.rollout.spec.settings.base_url,
            self.resync_weights_if_needed,
            lambda: link.healthy and not self._push_owed,
            timeout,
        ):
            logger.warning(
                "the generation server did not come back within server.timeout=%.0fs after training ended: it "
                "does not serve the final weights v%d (they are in the final checkpoint)",
                timeout,
                p.state.model_version,
            )

    # ------------------------------------------------------------------ metrics (rank 0)
    def _record_compile(self, step_s: float) -> None:
        """What torch.compile spent in this step (``train/compile.py``): 0 once warm; a step that compiled is logged."""
        seconds, count, breaks = self._compile_meter.take()
        self.window.add("perf/compile_total_s", seconds)
        self.window.add("perf/compiles_total", count)
        for reason in breaks:
            logger.warning(
                "trainer.compile: step %d: torch.compile broke a graph (%s); the code around the break runs "
                "eagerly. Run with TORCH_LOGS=graph_breaks to see where.",
                self.p.state.step,
                reason,
            )
        if count:
            logger.info(
                "trainer.compile=%s: step %d took %.1f s, %.1f s of it compiling (%d compile(s))",
                str(self.cfg.trainer.compile).lower(),
                self.p.state.step,
                step_s,
                seconds,
                count,
            )

    def _record_gauges(self) -> None:
        w, p = self.window, self.p
        w.set_gauge("num_tokens", p.state.num_tokens)
        w.set_gauge("model_version", p.state.model_version)
        w.set_gauge("rollout/queue_size", p.rollout.queue_size())
        w.set_gauge("prompts_consumed", p.tracker.consumed_count)

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
        rollout_state = p.tracker.state() if self.info.is_main else {}
        path = save_checkpoint(
            self.run_dir,
            p.model,
            p.tokenizer,
            p.optimizer,
            p.scheduler,
            p.state,
            rollout_state,
            self.cfg.trainer.save_total_limit,
            self.info,
            save_hf_model=self.cfg.trainer.save_hf_model,
            data=data_identity(self.cfg.data),
        )
        self._last_save_step = p.state.step
        if self.info.is_main:
            logger.info("saved checkpoint %s", path)
        return path
