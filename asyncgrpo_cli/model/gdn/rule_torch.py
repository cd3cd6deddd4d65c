"""The chunked gated delta rule over a packed row's segment tree, in pure torch (fp32): the CPU path and the
reference the GPU kernels are tested against.

The algebra is transformers' ``torch_chunk_gated_delta_rule`` (the WY / UT-transform form of DeltaNet): within a
chunk of 64 tokens everything is a few batched matmuls and one triangular solve; across chunks a state
``S [H, Dk, Dv]`` is carried. Three changes make it exact for packed rows:

- chunks are laid on the plan's *chunk grid* (``gdn/plan.py``): every segment padded to whole chunks, so no chunk
  mixes two samples or two branches. Padding has ``k = v = beta = 0`` and ``g = 0``: it neither writes nor decays
  the state, so it is exact (transformers pads a sequence's tail the same way);
- the intra-chunk phase runs on all chunks of the row at once (batch = chunks);
- the state scan follows the plan's levels: a chunk starts from its predecessor's end state (the previous chunk of
  its segment, or the last chunk of its parent segment, or zeros at a root). All chunks of a level run as one
  batched step, and autograd sums the gradients a parent state receives from its branches.

Computation is in fp32 (float64 for float64 inputs, for reference checks). Nothing here is approximate: per sample, the values equal an unpacked transformers forward up to fp32 rounding.
"""

from __future__ import annotations

import torch

from asyncgrpo_cli.model.gdn.plan import RecurrencePlan


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' / fla's ``l2norm``: ``x / sqrt(Σ x² + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def tree_chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: RecurrencePlan,
    *,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """q / k [T, Hk, Dk], v [T, Hv, Dv], g / beta [T, Hv] (g: log decay <= 0) -> output [T, Hv, Dv] in q's dtype.

    Query / key heads serve ``Hv // Hk`` consecutive value heads (grouped value attention), as in transformers.
    """
    dtype = query.dtype
    n, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    if hv != hk:
        query = query.repeat_interleave(hv // hk, dim=1)
        key = key.repeat_interleave(hv // hk, dim=1)
    work = torch.float64 if dtype == torch.float64 else torch.float32  # float64 only for reference checks
    query, key, value, g, beta = (x.to(work) for x in (query, key, value, g, beta))
    if use_qk_l2norm:
        query, key = l2norm(query), l2norm(key)
    query = query * dk**-0.5

    c = plan.chunk
    chunks = plan.num_chunks

    def to_grid(x: torch.Tensor) -> torch.Tensor:
        """[T, H, ...] -> [chunks, H, c, ...] on the chunk grid (zeros at padding)."""
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        grid = padded.index_select(0, plan.grid_index).reshape(chunks, c, *x.shape[1:])
        return grid.transpose(1, 2)

    q, k, v = to_grid(query), to_grid(key), to_grid(value)  # [C, H, c, D]
    b, decay = to_grid(beta), to_grid(g)  # [C, H, c]
    v_beta = v * b.unsqueeze(-1)
    k_beta = k * b.unsqueeze(-1)
    cum = decay.cumsum(dim=-1)
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_decayed = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [C, H, 1, 1]

    outs, order = [], []
    prev_end = None
    for members, inputs in zip(plan.levels, plan.level_inputs, strict=True):
        zero = new_values.new_zeros(1, hv, dk, dv)
        bank = zero if prev_end is None else torch.cat([prev_end, zero])
        state = bank.index_select(0, inputs)  # [m, H, Dk, Dv]
        v_new = new_values.index_select(0, members) - k_cumdecay.index_select(0, members) @ state
        outs.append(q_decayed.index_select(0, members) @ state + intra.index_select(0, members) @ v_new)
        order.append(members)
        prev_end = (
            state * chunk_decay.index_select(0, members)
            + k_decayed.index_select(0, members).transpose(-1, -2) @ v_new
        )
    out = torch.cat(outs)  # [C, H, c, Dv] in level order
    inverse = torch.empty_like(plan.grid_index[:chunks])
    inverse[torch.cat(order)] = torch.arange(chunks, device=out.device)
    out = out.index_select(0, inverse).transpose(1, 2).reshape(chunks * c, hv, dv)
    return out.index_select(0, plan.token_slot).to(dtype)
