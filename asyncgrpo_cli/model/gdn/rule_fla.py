"""The gated delta rule of a packed row on CUDA: fla's Triton chunk kernels, run per level of the segment tree.

fla's ``chunk_gated_delta_rule`` (package ``fla-core``, MIT; the kernels transformers and vLLM use for these
layers) takes varlen rows (``cu_seqlens``), an initial state per sequence and returns each sequence's final
state, with gradients for all of them. That is what a tree needs, one level at a time (``plan.segment_levels``):

- level 0 (the roots: every sample under sequence packing, every group's prompt under tree packing) is one call,
  starting from zeros; under sequence packing the roots tile the row, so nothing is gathered;
- level ``d`` gathers its segments' tokens into one varlen batch and starts each from its parent segment's final
  state (level ``d - 1``'s output); a parent's state feeding several branches receives the sum of their
  gradients through autograd.

So a row costs ``depth`` kernel calls (2-4 for GRPO trees), not one per segment, and no path is rescanned.
Considered and not used: ``tree-recurrence`` (Axolotl; hooks transformers' modeling modules globally and reads
TRL's row format; 0.1.x) and TRL's vendored kernels (not a library). The per-token work around the kernel (conv,
gates, norm) is ``gdn/layer.py``'s; the pure-torch rule (``gdn/rule_torch.py``) is the reference in GPU tests.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncgrpo_cli.device_copy import to_device
from asyncgrpo_cli.model.gdn.plan import RecurrencePlan


def _cu(lengths: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    cu = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    cpu = torch.from_numpy(cu)
    return to_device(cpu, device), cpu


def fla_tree_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: RecurrencePlan,
    *,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Same contract as :func:`~asyncgrpo_cli.model.gdn.rule_torch.tree_chunk_gated_delta_rule` (CUDA tensors)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    device = query.device
    levels = plan.segment_levels
    lengths = plan.seg_end - plan.seg_start
    final_row = np.full(plan.num_segments, -1, dtype=np.int64)  # segment -> row of its level's final states
    outs, token_order = [], []
    prev_final = None
    for depth, members in enumerate(levels):
        more = depth + 1 < len(levels)
        cu, cu_cpu = _cu(lengths[members], device)
        if depth == 0 and members.shape[0] == plan.num_segments:
            idx = None  # only roots: the row itself, in order
            parts = (query, key, value, g, beta)
        else:
            tokens = np.concatenate([np.arange(plan.seg_start[s], plan.seg_end[s]) for s in members])
            idx = to_device(torch.from_numpy(tokens), device)
            parts = tuple(x.index_select(0, idx) for x in (query, key, value, g, beta))
        h0 = None
        if depth > 0:
            h0 = prev_final.index_select(
                0, to_device(torch.from_numpy(final_row[plan.seg_parent[members]]), device)
            )
        out, final = chunk_gated_delta_rule(
            *(x[None] for x in parts),
            initial_state=h0,
            output_final_state=more,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )
        if idx is None:
            return out[0]
        outs.append(out[0])
        token_order.append(idx)
        final_row[members] = np.arange(members.shape[0])
        prev_final = final
    out = torch.cat(outs)
    inverse = torch.empty_like(torch.cat(token_order))
    inverse[torch.cat(token_order)] = torch.arange(out.shape[0], device=device)
    return out.index_select(0, inverse)
