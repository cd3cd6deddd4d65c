"""Several trainer ranks (torchrun / accelerate launch): process group, FSDP2, step distribution, reductions.

Rank 0 owns the rollout process and the server connection; it plans each optimizer step, packs its rows and
scatters one packed row per rank per micro-batch (``rank_steps``, ``scatter_step``). Every collective is entered
by every rank in the same order, including ranks whose micro-batch trains no token. With one process the
collectives here are no-ops, so the same training loop serves both cases.

The loss scale: FSDP2 averages gradients over ranks, so each rank multiplies its micro-batch loss (already
divided by the step's global trained-token count) by the world size; the summed gradient is then exactly the
full-batch token mean.

On CUDA the process group is ``cpu:gloo,cuda:nccl``: NCCL carries the training collectives, gloo the object
collectives and whatever runs on CPU tensors (FSDP2 CPU offload keeps shards, gradients and the optimizer on the
CPU, so the gradient-norm reduction and the weight gathers of a sync or checkpoint run there). One process with
``trainer.mixed_precision`` or ``trainer.cpu_offload`` also goes through FSDP2, over a one-rank group, so one GPU
and many take the same numerical path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.packing.row import PackedRow
from asyncgrpo_cli.samples import TrainingSequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world() -> DistInfo:
    """Rank layout from the launcher's environment (torchrun, accelerate launch), before any process group."""
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_distributed(device: torch.device, timeout_s: float) -> DistInfo:
    info = env_world()
    if not info.enabled:
        return info
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            _backend(device),
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return info


def _backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _single_process_group(device: torch.device) -> None:
    """A one-rank process group (in-memory store) for FSDP2 in a process that was not launched with ranks."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        _backend(device),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )


def destroy_distributed(synchronize: bool = False) -> None:
    """Tear the default process group down. ``synchronize``: the run ended normally on every rank, so they meet in
    a barrier first and destroy together; rank 0 stops the server and the rollout process after the others are
    done, and a gloo rank that destroyed its group and exited meanwhile was seen (once, in CI) to abort with
    "terminate called without an active exception". A failed run skips the barrier: a peer may be stuck in a
    collective, and the launcher stops it once this rank exits."""
    if not dist.is_initialized():
        return
    if synchronize and dist.get_world_size() > 1:
        try:
            dist.barrier()
        except Exception as e:  # the run's work is done and saved: tear down anyway
            logger.warning("the ranks did not meet before the process group was destroyed: %s", e)
    dist.destroy_process_group()


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The transformer blocks FSDP2 shards one by one (``model.model.layers`` for Llama/Qwen-style models)."""
    base = getattr(model, model.base_model_prefix, None) if hasattr(model, "base_model_prefix") else None
    layers = getattr(base, "layers", None) if base is not None else None
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard with FSDP2")
    return list(layers)


def shard_model(
    model: Any,
    info: DistInfo,
    device: torch.device,
    mixed_precision: str | None,
    cpu_offload: bool,
    reshard_after_forward: bool = True,
    one_rank_cast: str = "foreach",
) -> Any:
    """``fully_shard`` every decoder layer, then the root (embeddings, final norm, head).

    Mixed precision (``trainer.mixed_precision``): fp32 master weights, parameters cast to bf16 for forward and
    backward, gradients reduced in fp32. CPU offload (``trainer.cpu_offload``): shards, gradients and optimizer
    state live in CPU memory, so build the optimizer after this call (it then steps on the CPU). A single process
    without either is returned as it is. On one rank ``one_rank_cast="foreach"`` (``trainer.one_rank_cast``) fills
    each layer's parameters with one ``foreach`` cast (``train/one_rank_cast.py``); ``"torch"``: FSDP2's own
    cast and copy per parameter.
    """
    if not (info.enabled or mixed_precision or cpu_offload):
        return model
    if mixed_precision not in (None, "bfloat16"):
        raise UserError(
            f"trainer.mixed_precision={mixed_precision!r} is not supported: use bfloat16 (fp32 master "
            "weights, bf16 compute) or null (compute in model.dtype); float16 would need loss scaling."
        )
    if mixed_precision and next(model.parameters()).dtype != torch.float32:
        raise UserError(
            f"trainer.mixed_precision={mixed_precision} keeps fp32 master weights, but the model was "
            f"loaded as {next(model.parameters()).dtype}: set model.dtype=float32 (or "
            "trainer.mixed_precision=null to train in model.dtype)."
        )
    if cpu_offload and device.type != "cuda":
        raise UserError(
            f"trainer.cpu_offload=true moves FSDP2 shards off a GPU, but the trainer runs on {device}: "
            "set trainer.cpu_offload=false (or train on a GPU with trainer.device=cuda)."
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not info.enabled:
        _single_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, mixed_precision), reduce_dtype=torch.float32
        )
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if one_rank_cast == "foreach":
        from asyncgrpo_cli.train.one_rank_cast import use_foreach_cast

        use_foreach_cast(model)
    return model


@dataclass
class RankStep:
    """One rank's share of an optimizer step: its row for each micro-batch, as samples or packed already."""

    done: bool
    rows: list[list[TrainingSequence] | PackedRow] = field(default_factory=list)
    num_trained: int = 0
    """Trained tokens of the whole step across all ranks (the loss normalizer)."""


def rank_steps(
    rows_by_rank: list[list[list[TrainingSequence]]],
    num_trained: int,
    pack: Callable[[list[TrainingSequence]], PackedRow] | None = None,
) -> list[RankStep]:
    """Rank 0's hand-out of a step: ``rows_by_rank[r]`` is rank r's row (samples) for each micro-batch.

    With ``pack`` (several ranks) every row is packed here, before the scatter pickles it: the scatter is on every
    rank's critical path, and a row's samples pickle at ~19 us a sample (each of their arrays, dataclasses and
    fields on its own) where the packed row's few large arrays take ~1 us a sample (``PackedRow.__reduce__``),
    packing included ~5 (``asyncgrpo bench scatter``). Without it (one process) the rows stay samples, packed
    under the GPU's work inside the step."""
    return [
        RankStep(done=False, rows=[pack(row) for row in rows] if pack else rows, num_trained=num_trained)
        for rows in rows_by_rank
    ]


def scatter_step(per_rank: list[RankStep] | None, info: DistInfo) -> RankStep:
    """Rank 0 gives each rank its ``RankStep``; the others receive theirs."""
    if not info.enabled:
        assert per_rank is not None
        return per_rank[0]
    out: list[Any] = [None]
    dist.scatter_object_list(out, per_rank if info.is_main else None, src=0)
    return out[0]


def reduce_raw_metrics(raw: dict[str, torch.Tensor], info: DistInfo) -> dict[str, torch.Tensor]:
    """Combine the loss's raw metric material over ranks: ``*_min`` by min, ``*_max`` by max, others summed."""
    if not info.enabled:
        return raw
    keys: list[Any] = [None] * info.world_size
    dist.all_gather_object(keys, sorted(raw))
    union = sorted(set().union(*keys))
    device = next(iter(raw.values())).device if raw else torch.device("cpu")
    out: dict[str, torch.Tensor] = {}
    for key in union:
        if key.endswith("_min"):
            value, op = raw.get(key, torch.tensor(float("inf"))), dist.ReduceOp.MIN
        elif key.endswith("_max"):
            value, op = raw.get(key, torch.tensor(float("-inf"))), dist.ReduceOp.MAX
        else:
            value, op = raw.get(key, torch.tensor(0.0)), dist.ReduceOp.SUM
        value = value.detach().to(device=device, dtype=torch.float64).clone()
        dist.all_reduce(value, op=op)
        out[key] = value
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    if not info.enabled:
        return obj
    box = [obj if info.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def iter_full_state(model: Any, info: DistInfo, skip: set[str] | None = None):
    """Yield ``(name, full CPU tensor)`` on rank 0, one tensor at a time, in state-dict order.

    Under FSDP2 every rank must run this generator to the end: each sharded tensor is all-gathered
    (``full_tensor()``, a collective) in lockstep on every rank; non-zero ranks yield nothing and drop each
    gathered tensor at once. Peak extra memory is one full tensor per rank plus what the consumer holds. With CPU
    offload the shards are CPU tensors and gather over the process group's gloo side.
    """
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():
        if skip and name in skip:
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if info.is_main:
            yield name, full.detach().to("cpu").contiguous()
        del full
