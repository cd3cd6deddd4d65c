"""The short causal convolution of a gated-DeltaNet layer over path ancestors instead of packed neighbours.

transformers' ``causal_conv1d_fn`` is a depthwise ``conv1d`` over the whole row, so under packing a sample's first
taps read the previous sample's last tokens, and a tree branch reads its sibling. Here output ``t`` is

    act( Σ_{j=0}^{K-1} w[:, K-1-j] · x[a_j(t)] + bias )      a_0(t) = t, a_j = the j-th path ancestor (plan)

with zeros where the path is shorter than ``K`` (as the unpacked conv's left padding). The taps are accumulated
in fp32 and rounded to the weight dtype before the activation, as a ``conv1d`` in that dtype does, so an unpacked
sample gets transformers' values (bitwise in fp32 up to summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncgrpo_cli.model.gdn.plan import RecurrencePlan

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, None: None}


def path_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    plan: RecurrencePlan,
) -> torch.Tensor:
    """``x`` [T, C], ``weight`` [C, K] (``conv1d.weight.squeeze(1)``) -> [T, C] in ``x``'s dtype."""
    if activation not in _ACTIVATIONS:
        raise NotImplementedError(f"gated-DeltaNet conv activation {activation!r}: only silu is implemented")
    taps = int(weight.shape[1])
    if plan.ancestors.shape[0] != taps - 1:
        raise ValueError(
            f"the recurrence plan was built for {plan.ancestors.shape[0] + 1} conv taps, the layer has {taps}"
        )
    w = weight.float()
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])  # index T reads zeros
    acc = x.float() * w[:, taps - 1]
    for j in range(1, taps):
        acc = acc + padded.index_select(0, plan.ancestors[j - 1]).float() * w[:, taps - 1 - j]
    if bias is not None:
        acc = acc + bias.float()
    out = acc.to(weight.dtype)
    act = _ACTIVATIONS[activation]
    if act is not None:
        out = act(out)
    return out.to(x.dtype)
