"""Token sampling for the embedded server: vLLM's processed-logits pipeline, vectorized over a batch.

The order follows vLLM's v1 sampler: repetition penalty -> temperature -> min_p -> top_k -> top_p, with filtered
tokens set to -inf. ``log_softmax`` of the result is vLLM's ``--logprobs-mode processed_logprobs``: the log-prob
under the distribution actually sampled from, renormalized over the surviving support. Greedy rows (temperature
below ``GREEDY_EPS``) skip temperature and the filters, so their processed log-probs are after penalties only.

The sampling mask (vLLM's ``--return-sampling-mask``) of a row is the support of that distribution: the ids
whose processed log-prob is finite, i.e. the tokens that survived every filter, ascending (:func:`candidate_sets`).
The sampled token is always in it. Rows no filter truncates (greedy, or neutral top-k / top-p / min-p) have none.

Every parameter is per row. A row with a seed samples from its own ``torch.Generator`` (one uniform draw per token,
inverse-CDF), so its tokens do not depend on the other rows of the batch; rows without a seed share one generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

GREEDY_EPS = 1e-5
"""vLLM's ``_SAMPLING_EPS``: a temperature below it means greedy sampling."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one sequence (vLLM's neutral values are the defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class BatchParams:
    """Per-row sampling parameters of a batch as tensors, plus flags that skip stages no row needs."""

    temperature: torch.Tensor  # float32 [B]; 1.0 on greedy rows
    greedy: torch.Tensor  # bool [B]
    top_k: torch.Tensor  # int64 [B]; vocab size where disabled
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]
    repetition_penalty: torch.Tensor  # float32 [B]
    all_greedy: bool
    use_temperature: bool
    use_min_p: bool
    use_top_k: bool
    use_top_p: bool
    use_penalty: bool

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab_size: int) -> BatchParams:
        greedy = [p.greedy for p in params]
        # Greedy rows skip temperature and every filter (vLLM resets top_p/top_k/min_p on greedy requests).
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [
            vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)
        ]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        penalty = [p.repetition_penalty for p in params]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32),
            greedy=torch.tensor(greedy, dtype=torch.bool),
            top_k=torch.tensor(top_k, dtype=torch.int64),
            top_p=torch.tensor(top_p, dtype=torch.float32),
            min_p=torch.tensor(min_p, dtype=torch.float32),
            repetition_penalty=torch.tensor(penalty, dtype=torch.float32),
            all_greedy=all(greedy),
            use_temperature=any(t != 1.0 for t in temperature),
            use_min_p=any(m > 0.0 for m in min_p),
            use_top_k=any(k < vocab_size for k in top_k),
            use_top_p=any(p < 1.0 for p in top_p),
            use_penalty=any(r != 1.0 for r in penalty),
        )

    def truncating(self, vocab_size: int) -> torch.Tensor:
        """bool [B]: rows whose distribution a top-k / top-p / min-p filter restricts (greedy rows never are)."""
        return ~self.greedy & ((self.top_k < vocab_size) | (self.top_p < 1.0) | (self.min_p > 0.0))


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor  # float32 [B]: processed log-prob of each sampled token
    top_ids: torch.Tensor  # int64 [B, N]: most likely tokens of the processed distribution, best first
    top_logprobs: torch.Tensor  # float32 [B, N]
    ranks: torch.Tensor | None = None
    """int64 [B]: 1 + the tokens strictly more likely than the sampled one (vLLM's rank)."""
    sampling_masks: list[np.ndarray | None] | None = None
    """Per row, its candidate set (int32 ids, ascending) where asked for and truncated, else None."""


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """vLLM's repetition penalty on tokens seen in the prompt or output: positive logits / p, others * p."""
    penalties = torch.where(seen, penalty[:, None], 1.0)
    scaling = torch.where(logits > 0, 1.0 / penalties, penalties)
    return logits * scaling


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's largest probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties with the k-th are kept, as in vLLM)."""
    vocab = logits.shape[-1]
    disabled = top_k >= vocab
    k = top_k.masked_fill(disabled, 1)
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    kth = kth.masked_fill(disabled[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter as vLLM computes it: drop the smallest tokens whose cumulative mass is <= 1 - p.

    Rows with ``top_p == 1`` are left untouched, so a row's result never depends on the rest of the batch.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p)[:, None]
    drop[:, -1] = False  # always keep the most likely token
    drop &= (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(-1, order, sorted_logits)


def processed_logprobs(
    logits: torch.Tensor, params: BatchParams, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probs of the distribution each row samples from (vLLM ``processed_logprobs``), float32 [B, V].

    ``seen`` (bool [B, V]) marks the prompt and output tokens of each row; it is needed when any row has a
    repetition penalty.
    """
    logits = logits.float()
    if params.use_penalty:
        if seen is None:
            raise ValueError("a repetition penalty needs the seen-token mask")
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if not params.all_greedy:
        if params.use_temperature:
            logits = logits / params.temperature[:, None]
        if params.use_min_p:
            logits = apply_min_p(logits, params.min_p)
        if params.use_top_k:
            logits = apply_top_k(logits, params.top_k)
        if params.use_top_p:
            logits = apply_top_p(logits, params.top_p)
    return torch.log_softmax(logits, dim=-1)


def draw_uniforms(
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None = None,
    active: Sequence[bool] | None = None,
) -> torch.Tensor:
    """One uniform in [0, 1) per row: from the row's own generator, or from ``shared`` for rows without one.

    Rows where ``active`` is False (greedy rows) draw nothing and get 0, so they leave every generator untouched.
    """
    active = [True] * len(generators) if active is None else active
    u = torch.zeros(len(generators), dtype=torch.float64)
    unseeded = [i for i, (g, a) in enumerate(zip(generators, active)) if a and g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), generator=shared, dtype=torch.float64)
    for i, (g, a) in enumerate(zip(generators, active)):
        if a and g is not None:
            u[i] = torch.rand((), generator=g, dtype=torch.float64)
    return u


def sample_from_logprobs(
    logprobs: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor, argmax: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse-CDF sampling with one uniform per row; greedy rows take the argmax (pass it if already known)."""
    if argmax is None:
        argmax = logprobs.argmax(dim=-1)
    if bool(greedy.all()):
        return argmax
    probs = logprobs.exp()
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    ids = torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp_(max=logprobs.shape[-1] - 1)
    # Rounding can land on a zero-probability token at the very end of the CDF; fall back to the argmax there.
    bad = probs.gather(1, ids[:, None]).squeeze(-1) <= 0
    ids = torch.where(bad | greedy, argmax, ids)
    return ids


def candidate_sets(
    logprobs: torch.Tensor, params: BatchParams, wanted: Sequence[bool]
) -> list[np.ndarray | None]:
    """Each wanted row's sampling mask: the ids with a finite processed log-prob (the filters' survivors), int32
    ascending, as vLLM's ``_compact_sampling_mask_kernel`` collects them; None for rows not wanted or not
    truncated (their support is the whole vocabulary)."""
    truncated = params.truncating(logprobs.shape[-1]).tolist()
    rows = [i for i, (w, t) in enumerate(zip(wanted, truncated)) if w and t]
    out: list[np.ndarray | None] = [None] * len(wanted)
    if rows:
        kept = torch.isfinite(logprobs[rows]).nonzero().cpu()  # [total, 2] (row, id), ids ascending per row
        counts = torch.bincount(kept[:, 0], minlength=len(rows)).tolist()
        ids = kept[:, 1].numpy().astype(np.int32)
        for i, part in zip(rows, np.split(ids, np.cumsum(counts)[:-1])):
            out[i] = part
    return out


def sample(
    logits: torch.Tensor,
    params: BatchParams,
    generators: Sequence[torch.Generator | None],
    *,
    shared_generator: torch.Generator | None = None,
    seen: torch.Tensor | None = None,
    num_top: int = 0,
    want_masks: Sequence[bool] | None = None,
) -> SampleOutput:
    """Sample one token per row; return it, its processed log-prob and rank, the top ``num_top`` of each row and,
    for rows in ``want_masks``, their candidate sets."""
    logprobs = processed_logprobs(logits, params, seen)
    if num_top > 0:
        top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
        argmax = top_ids[:, 0]
    else:
        top_ids = torch.empty((logprobs.shape[0], 0), dtype=torch.int64)
        top_values = torch.empty((logprobs.shape[0], 0), dtype=torch.float32)
        argmax = logprobs.argmax(dim=-1)
    if params.all_greedy:
        ids = argmax
    else:
        active = [not g for g in params.greedy.tolist()]
        uniforms = draw_uniforms(generators, shared_generator, active)
        ids = sample_from_logprobs(logprobs, uniforms, params.greedy, argmax)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(-1)
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    masks = candidate_sets(logprobs, params, want_masks) if want_masks and any(want_masks) else None
    return SampleOutput(
        token_ids=ids,
        logprobs=chosen,
        top_ids=top_ids,
        top_logprobs=top_values,
        ranks=ranks,
        sampling_masks=masks,
    )
