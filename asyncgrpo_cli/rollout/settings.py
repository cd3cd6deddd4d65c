"""``RolloutSettings``: everything the rollout process needs, resolved by the trainer before the spawn (picklable,
no argv re-parsing). Built by ``train/run.py``, read by ``AsyncRolloutLoop`` and its hooks as ``self.settings``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncgrpo_cli.config.schema import RolloutConfig, SamplingConfig


@dataclass
class RolloutSettings:
    """Everything the rollout process needs, resolved by the trainer (picklable, no argv re-parsing)."""

    sampling: SamplingConfig
    rollout: RolloutConfig
    base_url: str
    served_model: str
    max_model_len: int
    server_timeout: float
    max_retries: int
    num_topk: int
    """Top log-probs requested per token (0 when the loss needs none)."""
    tokenizer_path: str
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    total_prompts: int | None = None
    """Prompts to generate in all (epoch-based runs); None: cycle over the data until stopped."""
    dataset_start_index: int = 0
    skip_prompt_seqs: list[int] = field(default_factory=list)
    """Prompt positions at or after ``dataset_start_index`` already trained before a resume."""
    data_seed: int = 0
    shuffle: bool = True
    seed_offset: int = 0
    sampling_mask: bool = False
    """Request each token's candidate set (``/inference/v1/generate``): truncated sampling on a server that
    returns sampling masks (resolved at startup by ``server.mask_support.resolve_sampling_mask``)."""
    prepared: dict[str, Any] = field(default_factory=dict)
    """What the loop class's ``prepare`` resolved in the trainer process before the spawn (e.g. the teacher
    endpoints of the distillation loop); empty for the default loop."""
    versioned_model: str | None = None
    """The model name of each policy version, with ``{version}`` (LoRA adapter sync: ``policy-v{version}``): a
    group requests the version current when it starts, the one its samples are tagged with. None: every
    request names ``served_model``."""
