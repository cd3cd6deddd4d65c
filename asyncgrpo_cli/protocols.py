"""The plugin contracts as typing Protocols: what the trainer hands a plugin, and what it expects back.

Typing only: nothing here runs at import, and torch types are imported for type checkers alone, so the config
layer and the rollout process may import this module. Plugins conform structurally (no base class needed);
``tests/test_protocols.py`` checks that every registered plugin of a kind conforms to its protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

if TYPE_CHECKING:
    import torch

    from asyncgrpo_cli.model.logprobs import TokenStats
    from asyncgrpo_cli.packing.planner import MicroBatch
    from asyncgrpo_cli.packing.row import PackedRow
    from asyncgrpo_cli.samples import TrainingSequence


# ================================================================ losses, packers and the per-token extras


@runtime_checkable
class TokenExtra(Protocol):
    """Per-token data a sample carries for a loss, beyond tokens, sampler log-probs and the advantage.

    Stored as ``TrainingSequence.token_extras[name]`` with one row per trained token (row ``j``: the ``j``-th
    trained token), and gathered by name into ``PackedRow.extras[name]`` by every packer, one row per loss term,
    in ``target_ids`` order (a tree packer maps it exactly as it maps sampler log-probs). A dataclass whose array
    fields are numpy on the sample; the packer turns each numpy field into a torch tensor of the same layout.
    ``samples.TopK`` is one (the ``sampler_topk`` extra).
    """

    def __len__(self) -> int:
        """Rows: the sample's trained tokens."""
        ...

    @classmethod
    def empty(cls, n: int) -> Self:
        """``n`` rows carrying nothing: stands in for a sample of the row that lacks this extra."""
        ...

    @staticmethod
    def concat(parts: Sequence[Self]) -> Self:
        """The rows of ``parts`` one after another (padded to a common width where rows have one)."""
        ...


@runtime_checkable
class Loss(Protocol):
    """A policy loss (registry kind ``loss``, picked by ``loss.name``), built as ``cls(cfg: LossConfig)``.

    Called once per packed row (micro-batch) with the trainer's statistics of the row's trained tokens and the
    row itself; returns the row's share of the step's loss and raw metric material. The trainer stays
    algorithm-blind: it reads nothing but ``needs``.
    """

    needs: tuple[str, ...]
    """Names of the token extras the loss reads from ``row.extras`` (``samples.SAMPLER_TOPK``, ...). The run asks
    the producers for them (the rollout requests the sampler's top-k only when needed), and with any need the
    head also scores the ids of the row's ``TopK`` extras (``stats.topk_logprobs``, ``PackedRow.candidate_ids``).
    A row none of whose samples carries a needed extra has no entry for it (a context-only filler row)."""

    def __call__(
        self, stats: TokenStats, row: PackedRow, num_trained_step: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, raw metrics) of one row.

        ``stats``: ``logprobs`` [N] (differentiable), ``entropy`` [N], ``topk_logprobs`` [N, K] or None, aligned
        with the row's loss terms (``row.target_ids`` [N], ``row.sampler_logprobs``, ``row.advantages``, ...).
        ``num_trained_step``: the trained tokens of the whole optimizer step (all micro-batches and ranks), the
        normalizer, so accumulated micro-batches sum to the full-batch token mean. The loss is a 0-d tensor; the
        metrics are 0-d detached tensors named ``*_sum`` / ``*_count`` / ``*_min`` / ``*_max``
        (``train/losses.py`` merges and finalizes them).
        """
        ...


@runtime_checkable
class Planner(Protocol):
    """Streams samples into micro-batches (one row per rank), built as ``cls(token_budget, num_ranks=...)``."""

    dropped_oversize_count: int
    """Samples dropped because they exceed the token budget."""

    @property
    def num_open_samples(self) -> int:
        """Samples placed in the open micro-batch."""
        ...

    def add(self, sample: TrainingSequence) -> MicroBatch | None:
        """Place ``sample``; the ``MicroBatch`` it closed, if any (the sample then opens the next one)."""
        ...

    def flush(self, allow_filler: bool = True) -> MicroBatch | None:
        """Emit the open micro-batch (end of data); None when nothing is open."""
        ...


@runtime_checkable
class Packer(Protocol):
    """Lays one rank's samples out as a packed row (registry kind ``packer``, ``packing.kind``), built as
    ``cls(cfg: PackingConfig)``."""

    planner: str
    """``"module:Class"`` of the :class:`Planner` whose cost model matches the rows this packer builds
    (``packing.planner_for`` imports it): the planner must never let a row exceed the budget as packed."""

    def pack(self, samples: Sequence[TrainingSequence]) -> PackedRow:
        """The packed row of ``samples`` (at least one, each non-empty): forward inputs, the attention as DFS
        intervals, and one loss term per trained token (``packing/row.py``), its extras in ``row.extras``."""
        ...
