"""The plugin contracts: what a registered plugin of each kind provides (``registry.py`` names them), what the
trainer hands it and what it expects back.

Typing only: this module imports no torch and nothing heavy at runtime (the types it names are imported under
``TYPE_CHECKING``), so the config layer and the rollout process may import it. A plugin conforms by shape;
``tests/test_protocols.py`` (server backends, weight syncs: checked as classes) and
``tests/test_protocols_built.py`` (losses, packers: built from their default sub-config) check every registered
one. The built-ins inherit optional hooks' defaults from a small base class beside them. The rollout scorer's
contract lives with its context types in ``rollout/scorers/base.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from asyncgrpo_cli.config.schema import RootConfig, ServerConfig
    from asyncgrpo_cli.model.logprobs import TokenStats
    from asyncgrpo_cli.packing.planner import MicroBatch
    from asyncgrpo_cli.packing.row import PackedRow
    from asyncgrpo_cli.samples import TrainingSequence
    from asyncgrpo_cli.server.control import ServerControl, ServerInfo
    from asyncgrpo_cli.train.distributed import DistInfo


# ================================================================================================================
# Server backends (kind ``server``, ``server.backend``): where the generation server comes from.
# ================================================================================================================
@runtime_checkable
class ServerBackend(Protocol):
    """A generation server the run talks to: an external one, or one that ``train`` starts and stops.

    ``train`` builds it as ``cls(cfg.server, model_path, served_model_name, run_dir)``, calls ``start()`` (returns
    once the server answers ``/health`` and lists its model) and, on exit, ``stop()`` (idempotent; ends only what
    ``start()`` began, by PID). The class-level members answer, before anything is built, what the startup probe
    (``server/probe.py``) and ``asyncgrpo check`` ask of the backend, so neither compares backend names.
    ``server/backends.py:BaseServerBackend`` holds the defaults (an external server).

    Example::

        class MyBackend(BaseServerBackend):
            def __init__(self, cfg, model_path, served_model_name, run_dir):
                self.cfg, self.base_url = cfg, "http://gpu-box:8000"

            def start(self):
                return self._connect(self.cfg)  # waits for /health, reads /v1/models

            def stop(self):
                if self.control is not None:
                    self.control.close()
    """

    passes_vllm_flags: ClassVar[bool]
    """True when the backend starts vLLM itself with the flags of ``server.vllm_launch``: a missing server flag is
    then fixed by a ``server.vllm_launch.*`` key, not by restarting a server by hand."""
    base_url: str
    """The server's root URL (known once ``start()`` returned)."""
    control: ServerControl | None
    """The control client (pause/resume, ``collective_rpc``, ``/server_info``) once started; None before."""

    def start(self) -> ServerInfo: ...

    def stop(self) -> None: ...

    def check_alive(self) -> None:
        """Raise a ``UserError`` (pid, exit status, log tail) once a server process this backend started has
        exited; a no-op for a server it does not own. The trainer calls it while it waits for samples."""
        ...

    @classmethod
    def plan(cls, cfg: ServerConfig) -> tuple[str, int | None]:
        """``asyncgrpo check``'s server line, and the server's ``max_model_len`` when the config sets it (None:
        queried at start)."""
        ...

    @classmethod
    def probe_preview(cls, cfg: RootConfig) -> str | None:
        """What ``asyncgrpo check --probe-server`` prints instead of probing (the server does not run yet); None:
        probe the running server at ``server.base_url``."""
        ...

    @classmethod
    def max_model_len_fix(cls, need_len: int, completion: int) -> str:
        """The config fix the probe names when the server's ``max_model_len`` is below ``need_len`` (the longest
        prompt plus ``sampling.max_completion_length``, which is ``completion``)."""
        ...


# ================================================================================================================
# Weight-sync backends (kind ``weight_sync``, ``server.weight_sync``): how trained weights reach the server.
# ================================================================================================================
@runtime_checkable
class WeightSync(Protocol):
    """Pushes the trainer's weights to the generation server, every ``rollout.weight_sync_steps`` steps.

    Every trainer rank builds one (``build``) and calls ``push`` in lockstep (FSDP2 gathers are collectives); rank
    0 holds ``control`` and drives the server, the other ranks get ``control=None``. The optional hooks are
    declared attributes with a ``None`` default, so callers test ``ws.repush is not None`` rather than probing;
    ``sync/base.py:BaseWeightSync`` holds the defaults.

    Example::

        class MyWeightSync(BaseWeightSync):
            def __init__(self, control, directory, info):
                self.control, self.directory, self.info = control, directory, info

            def push(self, model, version):
                ...  # every rank: gather; rank 0: send, then control.update_weight_version(f"v{version}")
                return {"perf/weight_sync_s": elapsed}

            def close(self):
                ...
    """

    control: ServerControl | None
    """Rank 0's control client of the server; None on the other ranks."""
    directory: Path | None
    """Where versions are written when the server reads them from disk (named in the weight-sync check's error);
    None for a backend that sends tensors over the wire."""
    served_name_template: str | None
    """The model name version ``{version}`` is served under (e.g. ``policy-v{version}``, a LoRA adapter per
    version): the rollout process names each group's model from it. None: the base model's name serves every
    version."""
    repush: Callable[[int], dict[str, float]] | None
    """Re-send an already pushed version from rank 0 alone (after a server restart), returning timings; None: the
    trainer pushes again through ``push`` (possible with one rank only)."""

    @classmethod
    def build(
        cls, cfg: RootConfig, control: ServerControl | None, directory: Path, info: DistInfo
    ) -> WeightSync:
        """Built by ``train`` from the run's config: ``directory`` is ``server.weight_sync_dir`` (default
        ``RUN_DIR/weights``); a backend with settings reads them from ``cfg``."""
        ...

    def push(self, model: Any, version: int) -> dict[str, float]:
        """Send ``model``'s weights as ``version``; returns the phase timings (rank 0; ``{}`` elsewhere)."""
        ...

    def served_name(self, version: int) -> str | None:
        """The name the weight-sync check scores ``version`` under (None: the base model's)."""
        ...

    def close(self) -> None:
        """Release what ``push`` set up (groups, clients, serving copies); idempotent."""
        ...


# ================================================================ losses, packers and the per-token extras


@runtime_checkable
class Loss(Protocol):
    """A policy loss (registry kind ``loss``, picked by ``loss.name``), built as ``cls(cfg: LossConfig)``.

    Called once per packed row (micro-batch) with the trainer's statistics of the row's trained tokens and the
    row itself; returns the row's share of the step's loss and raw metric material. The trainer stays
    algorithm-blind: it reads nothing but ``needs``. Model-specific terms are the trainer's, not the loss's: it adds
    the MoE router aux loss to the returned loss itself (``train/step.py``, ``model/router.py``).
    """

    head_temperature: float | None
    """The temperature the trainer's head divides the logits by for this loss (the JSD loss: its teacher
    temperature); None: the sampling temperature (``sampling.temperature``), as a policy-gradient loss needs."""
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
        (``train/losses.py`` merges them over micro-batches and ranks).
        """
        ...

    def metric_records(
        self, raw: dict[str, torch.Tensor]
    ) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
        """The step's merged raw material as window records: ``{name: (sum, count)}`` token means (reduced as
        Σ sums / Σ counts over the logging window, so they stay exact) and ``{name: value}`` extremes / items."""
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
