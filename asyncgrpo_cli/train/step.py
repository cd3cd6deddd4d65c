"""Forward+backward of one rank's rows for one optimizer step, with the exact token-mean normalization.

Each micro-batch's loss is its summed per-token loss divided by ``num_trained`` (the trained tokens of the whole
step, across micro-batches and ranks) and multiplied by the world size (FSDP2 averages gradients over ranks), so
the accumulated gradient equals the full-batch token mean. A row with no trained token still runs forward and
backward: its loss is connected to the graph with zero gradient, so every rank enters every collective.

Algorithm-blind: the loss (a :class:`~asyncgrpo_cli.protocols.Loss`) declares the token extras it reads
(``loss_fn.needs``); with any, the head also scores the ids of the row's top-k extras (``row.candidate_ids``).

Model-specific terms are added here, not by the loss plugins: for an MoE model with a router aux-loss coefficient
(``router``, ``model/router.py``) each row's loss also gets ``coef * aux_row / R`` after the world-size
multiplication, R = this rank's rows in the step (the same on every rank: one per micro-batch). FSDP2's average
over the W ranks turns the sum over rows into ``coef`` times the mean aux loss over all the step's W x R rows:
``(1/W) Σ_ranks Σ_rows coef ∇aux_row / R = coef ∇ mean_rows(aux_row)``. The raw aux losses are summed in
``StepResult.aux_sum`` (and counted in ``aux_rows``) for the ``aux_loss`` metric.

No host sync until the step's loss is read: each packed row's ids are checked on the host (the LM head would
otherwise read a device-side check back in the middle of the forward), rows go to the device with
``non_blocking`` copies through pinned memory (from pageable memory such a copy waits until the GPU reaches it:
``device_copy.py``), and the CPU runs ahead of the GPU, packing the next row while the previous one computes.
Once the last backward is queued, ``optimizer`` (an :class:`OptimizerStep`: the gradient clip, the optimizer and
scheduler steps) is queued behind it, so the GPU goes from the backward straight into the optimizer instead of
idling while the host reads the loss and reduces the metrics first; then ``overlap`` runs, before that read: CPU
work of the trainer (planning the next step, ``StepCollector.prefetch``) that then runs under the GPU's work
instead of after it. ``fwd_s`` / ``fwd_bwd_s`` / ``optimizer_s`` are GPU time on CUDA (events, read after the
sync), wall time on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from asyncgrpo_cli.model.logprobs import TokenStats, check_row, token_logprobs
from asyncgrpo_cli.packing.row import PackedRow
from asyncgrpo_cli.samples import TrainingSequence
from asyncgrpo_cli.train.flops import attended_pairs
from asyncgrpo_cli.train.optim import clip_grad_norm

if TYPE_CHECKING:
    from asyncgrpo_cli.model.router import RouterAux
    from asyncgrpo_cli.protocols import Loss, Packer


@dataclass
class StepResult:
    loss: float = 0.0
    raw_parts: list[dict] = field(default_factory=list)
    forwarded: int = 0
    unpacked: int = 0
    fwd_s: float = 0.0
    fwd_bwd_s: float = 0.0
    attn_pairs: int = 0
    """(query, key) pairs the rows attended (``train/flops.py``)."""
    aux_sum: float = 0.0
    """Σ of the rows' raw router aux losses (MoE with a coefficient; else 0)."""
    aux_rows: int = 0
    """Rows whose aux loss is in ``aux_sum`` (0 without a router aux loss)."""
    grad_norm: float | None = None
    """The pre-clip gradient norm of the queued :class:`OptimizerStep` (None without one)."""
    optimizer_s: float = 0.0
    """Time of the queued :class:`OptimizerStep` (clip, optimizer and scheduler steps, zeroing the gradients)."""


@dataclass
class OptimizerStep:
    """The step ``forward_backward`` queues behind the last backward, before its one host read (module docstring):
    the gradient clip to ``max_grad_norm`` (0: no clipping, the norm still measured), ``optimizer.step()``,
    ``scheduler.step()`` and ``zero_grad``."""

    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    max_grad_norm: float

    def queue(self) -> torch.Tensor:
        """Clip (FSDP2's shards, the norm reduced over ranks: ``optim.clip_grad_norm``), step, zero; the pre-clip
        norm, not read back."""
        params = [q for q in self.model.parameters() if q.requires_grad]
        limit = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        norm = clip_grad_norm(params, limit)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def forward_backward(
    model: Any,
    rows: list[list[TrainingSequence] | PackedRow],
    num_trained: int,
    packer: Packer,
    loss_fn: Loss,
    device: torch.device,
    temperature: float,
    world_size: int = 1,
    router: RouterAux | None = None,
    head_kernel: str = "auto",
    overlap: Callable[[], None] | None = None,
    first_row: PackedRow | None = None,
    optimizer: OptimizerStep | None = None,
) -> StepResult:
    """Run every micro-batch row of this rank; gradients accumulate in the parameters, and with ``optimizer`` the
    step is taken (``StepResult.grad_norm``). ``router``: add the MoE router aux loss (module docstring);
    ``head_kernel``: ``model.lm_head_kernel``; ``overlap``: CPU work to run while the GPU finishes (module
    docstring); ``first_row``: ``rows[0]`` already packed (by the previous step's ``overlap``)."""
    with_topk = bool(loss_fn.needs)
    out = StepResult()
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # read once, after every row is queued
    aux_sum = torch.zeros((), dtype=torch.float64, device=device)
    clock = _Clock(device)
    spans = []
    for i, samples in enumerate(rows):
        if isinstance(samples, PackedRow):  # packed by rank 0 before the scatter
            packed = samples
        else:
            packed = first_row if i == 0 and first_row is not None else packer.pack(samples)
        check_row(model, packed, with_topk)  # on the host copies: token_logprobs then skips its device checks
        out.attn_pairs += attended_pairs(packed.leave)
        row = packed.to(device, non_blocking=True)
        t0 = clock.mark()
        stats = _through_root(model, row, temperature, with_topk, router, head_kernel)
        loss, raw = loss_fn(stats, row, num_trained)
        if world_size > 1:
            loss = loss * world_size
        if router is not None:
            loss = loss + router.coef * stats.aux_loss / len(rows)
            aux_sum += stats.aux_loss.detach()
            out.aux_rows += 1
        t1 = clock.mark()
        loss.backward()
        spans.append((t0, t1, clock.mark()))
        loss_sum += loss.detach()
        out.raw_parts.append(raw)
        out.forwarded += row.num_forwarded
        out.unpacked += row.num_unpacked
    if optimizer is not None:
        t_opt = clock.mark()
        norm = optimizer.queue()
        opt_span = (t_opt, clock.mark())
    if overlap is not None:
        overlap()
    out.loss = float(loss_sum) / world_size  # the step's one host sync
    out.aux_sum = float(aux_sum)
    if optimizer is not None:
        out.grad_norm = float(norm)
        out.optimizer_s = clock.seconds(*opt_span)
    for t0, t1, t2 in spans:
        out.fwd_s += clock.seconds(t0, t1)
        out.fwd_bwd_s += clock.seconds(t0, t2)
    return out


class _Clock:
    """Marks on the device's timeline: CUDA events on the current stream (read after the step's sync), else the
    wall clock (CPU ops run synchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.monotonic()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start


def _through_root(
    model: Any,
    row: Any,
    temperature: float,
    with_topk: bool,
    router: RouterAux | None = None,
    head_kernel: str = "auto",
) -> TokenStats:
    """Compute the head's statistics *inside* the root module's call.

    The head runs the decoder body and the LM head itself (never the full-vocabulary forward); with the row's
    sampling candidate sets (``row.support_ids``, top-k / top-p / min-p masks from the server) the log-probs,
    entropies and top-k log-probs (``row.candidate_ids``) are renormalized over each token's set. Under FSDP2 the
    root module's hooks unshard the parameters it owns (embeddings, final norm, LM head) and schedule their
    gradient reduction, so the computation is redirected through ``model(...)`` with a one-shot ``forward``.
    """
    own = model.__dict__.get("forward")  # an instance-level forward (e.g. a hook library) to put back

    def restore() -> None:
        if own is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = own

    def redirected(*_args: Any, **_kwargs: Any) -> tuple:
        restore()
        stats = token_logprobs(
            model,
            row,
            temperature,
            with_topk,
            support_ids=row.support_ids,
            router=router,
            head_kernel=head_kernel,
            row_checked=True,
        )
        # FSDP2 hooks the root's outputs for backward; a view output would lose that hook on in-place use.
        return tuple(
            t.clone() if t is not None and t._is_view() else t
            for t in (stats.logprobs, stats.entropy, stats.topk_logprobs, stats.aux_loss)
        )

    model.forward = redirected
    try:
        # A keyword argument: torch 2.11's FSDP2 root pre-forward indexes the moved (args, kwargs) tuples, which
        # are empty for a call without any.
        logprobs, entropy, topk, aux_loss = model(asyncgrpo_row=None)
    finally:
        restore()
    return TokenStats(logprobs=logprobs, entropy=entropy, topk_logprobs=topk, aux_loss=aux_loss)


def clip_and_step(
    model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, max_grad_norm: float
) -> float:
    """:class:`OptimizerStep` on its own (after ``forward_backward`` returned); returns the pre-clip norm."""
    return float(OptimizerStep(model, optimizer, scheduler, max_grad_norm).queue())
