"""What the LM heads share: the logit transform and their outputs (``model/chunked_head.py``, ``model/fused_head.py``).

A leaf module so that the chunked head can dispatch to the fused one without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class LogitTransform:
    """z = softcap · tanh(scale · x / softcap) / temperature, in fp32 (each factor only where set)."""

    temperature: float = 1.0
    scale: float | None = None
    """Cohere's ``logit_scale``: multiplies the raw logits first."""
    softcap: float | None = None
    """Gemma's ``final_logit_softcapping``: c·tanh(x / c), after the scale and before the temperature."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        z = x.float()
        if self.scale is not None:
            z = z * self.scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z / self.temperature

    def slope(self, z: torch.Tensor) -> torch.Tensor | float:
        """∂z/∂x as a function of the transformed logits z (a scalar without soft-capping)."""
        factor = (1.0 if self.scale is None else self.scale) / self.temperature
        if self.softcap is None:
            return factor
        tanh = z * (self.temperature / self.softcap)
        return (1.0 - tanh * tanh) * factor


class HeadStats(NamedTuple):
    """Per position: ``logprobs`` fp32 [N] and ``candidate_logprobs`` fp32 [N, K] (or None) are differentiable;
    ``entropy`` fp32 [N] is not."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    candidate_logprobs: torch.Tensor | None
