"""Sampling candidate sets (top-k / top-p / min-p "sampling masks"), stored compactly, one set per token.

With truncated sampling the server draws each token from a candidate set S (the tokens that survive top-k /
top-p / min-p) and its processed log-probs are normalized over S, so the trainer renormalizes its own log-probs
over the same S (reference section j). The server returns S for every generated token (vLLM's
``--return-sampling-mask``; the embedded server always can).

Representation (the layout vLLM itself uses internally, ``SamplingMaskLists``): CSR, two numpy arrays

    ids      int32 [total]   the candidate ids of every token, concatenated
    offsets  int64 [n + 1]   set i is ids[offsets[i] : offsets[i + 1]]

An **empty set means "not truncated"**: the token is normalized over the full vocabulary (greedy rows, requests
without a filter, a set the server did not return, or a set dropped by the cap below). Memory is 4 bytes per
candidate plus 8 per token, instead of ~36 bytes per candidate for nested Python lists.

Limits. A set is bounded by ``top_k`` on vLLM (which refuses masks without top_k > 0) but can reach the whole
vocabulary with top_p / min_p alone (e.g. top_p = 0.95 on a flat distribution over a 150k vocabulary). Sets larger
than ``sampling.max_mask_candidates`` are dropped when the response is parsed: the token is then treated as
un-truncated (its ratio keeps the full-vocabulary bias) and counted in ``rollout/sampling_mask_overflow_frac``.
On the trainer the sets of one packed row become a padded [N, C] int64 tensor (C = the row's largest set), so
the cap also bounds that tensor at N x max_mask_candidates x 8 bytes.

Numpy only: this crosses the process boundary by pickling and imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class CandidateSets:
    """``len(self)`` candidate sets in CSR form (see the module doc); an empty set means the full vocabulary.

    ``num_overflow`` / ``num_invalid`` count the sets dropped (emptied) when built by :meth:`from_lists`: larger
    than the cap, or not containing the token actually sampled (a server that does not follow its own mask).
    """

    ids: np.ndarray
    offsets: np.ndarray
    num_overflow: int = 0
    num_invalid: int = 0

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int32)
        self.offsets = np.asarray(self.offsets, dtype=np.int64)
        if self.offsets.ndim != 1 or self.offsets.shape[0] < 1 or self.offsets[0] != 0:
            raise ValueError(f"offsets must be a 1-D array starting at 0, got {self.offsets[:4]}...")
        if self.offsets[-1] != self.ids.shape[0] or (np.diff(self.offsets) < 0).any():
            raise ValueError(
                f"offsets must be non-decreasing and end at len(ids)={self.ids.shape[0]}, got {self.offsets[-1]}"
            )

    # -- building ---------------------------------------------------------------------------------------------
    @classmethod
    def empty(cls, n: int) -> CandidateSets:
        """``n`` empty sets (every token normalized over the full vocabulary)."""
        return cls(np.zeros(0, np.int32), np.zeros(n + 1, np.int64))

    @classmethod
    def from_lists(
        cls,
        sets: Sequence[Sequence[int] | None],
        max_size: int | None = None,
        sampled: Sequence[int] | None = None,
    ) -> CandidateSets:
        """Sets given as lists (a server's ``sampling_mask``; None = no set). Sets over ``max_size`` are emptied
        and counted in ``num_overflow``; with ``sampled`` (the token drawn at each position), sets that do not
        contain it are emptied and counted in ``num_invalid``."""
        sizes = np.fromiter((0 if s is None else len(s) for s in sets), dtype=np.int64, count=len(sets))
        overflow = sizes > max_size if max_size is not None else np.zeros(len(sets), bool)
        keep = (sizes > 0) & ~overflow
        parts = [np.asarray(s, dtype=np.int64) for s, k in zip(sets, keep) if k]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        kept_sizes = np.where(keep, sizes, 0)
        invalid = np.zeros(len(sets), bool)
        if sampled is not None:
            if len(sampled) != len(sets):
                raise ValueError(f"{len(sets)} candidate sets for {len(sampled)} sampled tokens")
            owner = np.repeat(np.arange(len(sets)), kept_sizes)
            hit = ids == np.asarray(sampled, dtype=np.int64)[owner]
            invalid = keep & (np.bincount(owner[hit], minlength=len(sets)) == 0)
            if invalid.any():
                ids = ids[~invalid[owner]]
                kept_sizes = np.where(invalid, 0, kept_sizes)
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise ValueError("candidate token ids must be in [0, 2**31)")
        offsets = np.concatenate([[0], np.cumsum(kept_sizes)])
        return cls(ids, offsets, int(overflow.sum()), int(invalid.sum()))

    @classmethod
    def coerce(cls, value: CandidateSets | Sequence[Sequence[int] | None]) -> CandidateSets:
        """A ``CandidateSets`` as is; nested lists (what a custom rollout loop may record) converted."""
        return value if isinstance(value, CandidateSets) else cls.from_lists(value)

    @staticmethod
    def concat(parts: Sequence[CandidateSets]) -> CandidateSets:
        """The sets of ``parts`` one after another."""
        if not parts:
            return CandidateSets.empty(0)
        shifts = np.cumsum([0] + [p.ids.shape[0] for p in parts[:-1]])
        offsets = [np.zeros(1, np.int64)] + [p.offsets[1:] + s for p, s in zip(parts, shifts)]
        return CandidateSets(
            np.concatenate([p.ids for p in parts]),
            np.concatenate(offsets),
            sum(p.num_overflow for p in parts),
            sum(p.num_invalid for p in parts),
        )

    def take(self, index: np.ndarray | Sequence[int]) -> CandidateSets:
        """The sets at ``index`` (in that order), e.g. a turn's trained tokens."""
        index = np.asarray(index, dtype=np.int64)
        sizes = self.sizes[index]
        starts = np.repeat(self.offsets[:-1][index], sizes)
        within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        return CandidateSets(self.ids[starts + within], np.concatenate([[0], np.cumsum(sizes)]))

    # -- reading ----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def sizes(self) -> np.ndarray:
        """int64 [n]: the size of each set (0 = not truncated)."""
        return np.diff(self.offsets)

    @property
    def num_with_set(self) -> int:
        """Tokens that carry a candidate set."""
        return int((self.sizes > 0).sum())

    def to_lists(self) -> list[list[int]]:
        return [self[i].tolist() for i in range(len(self))]

    def padded(self) -> np.ndarray:
        """int64 [n, C] with -1 padding (C = the largest set; an empty set is a row of -1): ``support_ids``."""
        sizes = self.sizes
        out = np.full((len(self), int(sizes.max(initial=0))), -1, dtype=np.int64)
        rows = np.repeat(np.arange(len(self)), sizes)
        cols = np.arange(self.ids.shape[0]) - np.repeat(self.offsets[:-1], sizes)
        out[rows, cols] = self.ids
        return out
