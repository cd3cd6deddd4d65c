"""FSDP2 on one rank: each layer's bf16 parameters cast from the fp32 shards by one ``foreach`` copy.

With a world size of 1, torch's ``FSDPParamGroup.wait_for_unshard`` skips the all-gather and, for each parameter
in turn, casts the fp32 shard to bf16 (a new tensor) and copies the cast into the unsharded parameter: two kernels
and a round of Python per parameter, in every forward and (``trainer.reshard_after_forward``) every backward, on
the compute stream. For a 1.7B model that is ~620 parameter rounds a step, and the GPU waits on them: 23.5 ms of
idle and ~18.5 ms of copies in a 0.46 s step on an H100 (``docs/benchmarks.md``, 2026-12-07 fourth). With
several ranks torch does one ``foreach`` copy-in per layer instead. Measured (``bench trainer one_rank_cast=``,
H100, ``docs/benchmarks.md``, 2026-12-08): 1.7B steps 1.01-1.05x faster in both orders, 0.6B within drift.

:func:`use_foreach_cast` gives each of a one-rank model's parameter groups one ``torch._foreach_copy_`` that casts
and copies all of its shards into the same unsharded buffers torch would fill, with torch's version-counter
handling, then lets torch build the unsharded parameters as it does. The parameters are torch's bit for bit (the
cast is the same rounding); tests compare losses, gradients and weights over several steps with torch's path.

Written here because no library does it: it is a replacement for one branch of a private torch method. It reads
FSDP2's private state, so it checks what it uses when installed and leaves torch's path (with one warning) where
anything differs. It is installed only on a one-rank process group, and at every call it takes torch's path
where the branch does not apply (CPU offload, tensor subclasses with all-gather extensions, parameters resharded
after forward to a smaller mesh).
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)

_GROUP_METHODS = ("wait_for_unshard", "_to_unsharded", "_wait_all_gather_streams_on_event")
_GROUP_FIELDS = ("fsdp_params", "device", "device_handle", "_all_gather_result")
_PARAM_METHODS = ("init_all_gather_outputs", "init_unsharded_param")
_PARAM_FIELDS = (
    "_sharded_param_data",
    "_sharded_local_tensor",
    "all_gather_outputs",
    "sharded_state",
    "offload_to_cpu",
)  # param_dtype too, set at FSDP2's lazy init (the first forward)


def _param_groups(model: torch.nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of ``model``'s ``fully_shard`` modules (one per sharded layer and the root;
    newer torch keeps a list per module, for per-parameter meshes, older torch one group)."""
    groups = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        if (listed := getattr(state, "_fsdp_param_groups", None)) is not None:
            groups.extend(listed)
        elif (group := getattr(state, "_fsdp_param_group", None)) is not None:
            groups.append(group)
    return groups


def _unsupported(group: Any) -> str | None:
    """Why this torch's FSDP2 group does not have what the foreach cast uses, or None."""
    for name in _GROUP_METHODS + _GROUP_FIELDS:
        if not hasattr(group, name):
            return f"FSDPParamGroup has no {name}"
    for param in group.fsdp_params:
        for name in (*_PARAM_METHODS, *_PARAM_FIELDS):
            if not hasattr(param, name):
                return f"FSDPParam has no {name}"
    return None


def _version_counters_unsupported() -> str | None:
    """Why autograd cannot set version counters as the cast does (FSDP2's way), or None."""
    probe = torch.zeros(1)
    try:
        torch._C._autograd._unsafe_set_version_counter((probe,), (probe._version,))
    except (AttributeError, TypeError) as e:
        return f"autograd's version counters ({e})"
    return None


def use_foreach_cast(model: torch.nn.Module) -> int:
    """Give every FSDP2 parameter group of a one-rank ``model`` the foreach cast; returns how many got it.

    Nothing changes with several ranks or where this torch's FSDP2 lacks what the cast uses (logged once)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != 1:
        return 0
    groups = _param_groups(model)
    for reason in (_version_counters_unsupported(), *map(_unsupported, groups)):
        if reason:
            logger.warning(
                "FSDP2's one-rank unshard stays torch's (one cast and copy per parameter): %s in torch %s",
                reason,
                torch.__version__,
            )
            return 0
    wait_for_unshard = _foreach_wait_for_unshard()
    for group in groups:
        group.wait_for_unshard = types.MethodType(wait_for_unshard, group)
    return len(groups)


def _foreach_wait_for_unshard() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState, alloc_storage

    def wait_for_unshard(self: Any) -> None:
        if not self._all_gather_result:
            return  # no unshard pending
        params = self.fsdp_params
        if any(
            p.offload_to_cpu
            or p.sharded_state != ShardedState.SHARDED
            or hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather")
            for p in params
        ):
            return type(self).wait_for_unshard(self)  # torch's, for this group (a copied model's too)
        outputs, shards = [], []
        for p in params:
            shard = p._sharded_param_data  # 1-D, the whole parameter on one rank
            p.init_all_gather_outputs([shard.numel()], [p.param_dtype or shard.dtype], 1, self.device)
            output = p.all_gather_outputs[0]
            alloc_storage(output)
            outputs.append(output)
            shards.append(shard)
        # Autograd saved these buffers in forward: the refill for backward must not look like an in-place change.
        versions = tuple(t._version for t in outputs)
        with torch.no_grad():
            torch._foreach_copy_(outputs, shards)  # cast and copy in one launch per dtype pair
        torch._C._autograd._unsafe_set_version_counter(tuple(outputs), versions)
        for p in params:
            p.init_unsharded_param()
        self._to_unsharded()
        done = self.device_handle.Event()
        done.record()
        self._wait_all_gather_streams_on_event(done)
        self._all_gather_result = None

    return wait_for_unshard
