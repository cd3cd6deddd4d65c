"""What a caller hands the engine and gets back: ``GenerationRequest`` -> ``RequestHandle`` of ``Completion`` s.

The route modules (completions, generate) build requests and read completions; ``engine.py`` fills them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from asyncgrpo_cli.embedded.lora import LoadedAdapter
from asyncgrpo_cli.embedded.prompt_logprobs import PromptScores
from asyncgrpo_cli.embedded.sampling import SamplingParams


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    seed: int | None = None
    """Choice ``i`` samples from a generator seeded with ``seed + i`` (vLLM's child seeds)."""
    num_logprobs: int = 0
    """Top log-probs returned per token (besides the sampled token's own)."""
    return_sampling_mask: bool = False
    """Record each token's candidate set (``sampling.candidate_sets``; ``/inference/v1/generate``)."""
    prompt_logprobs: int | None = None
    """Score every prompt token with the top N of each position (``prompt_logprobs.py``); None: off. Such a
    request is prefilled on its own, never from the prefix cache (vLLM's ``skip_reading_prefix_cache``)."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    adapter: LoadedAdapter | None = None
    """The LoRA adapter this request is served with (``embedded/lora.py``); None: the base model."""


@dataclass
class Completion:
    """One choice: sampled tokens with their processed log-probs and the top-N per token."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    """vLLM rank of each sampled token (1 = the most likely)."""
    sampling_mask: list[np.ndarray | None] | None = None
    """Per token, its candidate set (int32 ids) when the request asked for them; None entries: not truncated."""
    finish_reason: str | None = None
    stop_reason: int | None = None
    """The stop token when a ``stop_token_ids`` entry (not EOS) ended the choice, as vLLM reports it."""
    prompt_scores: PromptScores | None = None
    """The request's prompt log-probs (the same object in every choice) when it asked for them."""


class RequestHandle:
    """What ``submit`` returns: completes when every choice has finished."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.completions = [Completion() for _ in range(request.n)]
        self.error: str | None = None
        self._remaining = request.n
        self._done = threading.Event()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _finish_choice(self) -> None:
        self._remaining -= 1
        if self._remaining <= 0:
            self._done.set()

    def _fail(self, message: str) -> None:
        self.error = message
        self._done.set()
