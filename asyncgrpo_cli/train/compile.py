"""``trainer.compile``: whether the decoder layers run compiled, compiling them, and what the compiling cost.

- **Whether** (:func:`compile_enabled`, the one place ``auto`` is resolved): ``auto`` (the default) compiles on
  CUDA, where the fused layers are the trainer's largest speed-up (docs/benchmarks.md), and not on CPU, where
  inductor builds C++ kernels first (~40 s for the tiny model on 2 cores, cold cache) to save little on small
  CPU runs; ``true`` / ``false`` force it either way. :func:`compile_plan` says the same for ``asyncgrpo check`` without importing torch.
- **How** (:func:`compile_decoder_layers`): ``torch.compile`` of each decoder layer's ``forward``; FSDP2's hooks,
  gradient checkpointing and LoRA wrap or live inside the layer, and the parameter names do not change. Packed
  rows change length every step, so each call marks the row-length dimension of the layer's inputs dynamic
  (``torch._dynamo.maybe_mark_dynamic``): the first row compiles a graph for any length, instead of one static
  graph followed by a recompile at the second length; calls without autograd (the weight-sync check) run eagerly.
  What stays static: flex attention's ``BlockMask`` carries its power-of-two bucket as Python ints
  (``model/flex.py``), so a row in a new bucket compiles once more (a handful of buckets per run); a hybrid's packed gated-DeltaNet forward runs outside the graphs
  (``model/gdn/layer.py``), and the graph after it follows dynamo's automatic dynamic shapes (static at the first
  length, dynamic from the second).
- **What it cost** (:class:`CompileMeter`): dynamo calls its compile callbacks around every graph it compiles,
  forward frames and the backward graphs it compiles lazily at the first backward; the meter adds up the wall time
  between them and counts them. The trainer logs a step that compiled and records ``perf/compile_total_s`` and
  ``perf/compiles_total`` for every step (0 once warm: a non-zero value later is a recompile). It also reports
  each new reason dynamo broke a graph for (its ``graph_break`` counter), which the trainer logs as a warning: a
  break leaves the code around it eager, so a run compiles less than it says without it (the ``kernels`` side
  effect below was such a case). Breaks at ``torch.compiler.disable`` d functions are meant and not reported.

Imports torch only inside the functions that need it (``asyncgrpo check`` imports this module for the plan).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, NamedTuple

from asyncgrpo_cli.config.compile import compile_enabled, compile_plan  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

_SEQUENCE_DIMS = {"position_ids": (-1,), "position_embeddings": (-2,), "attention_mask": (-2, -1)}
"""Row-length dimensions of a decoder layer's keyword inputs besides ``hidden_states`` [1, T, H]: position ids
[..., T], RoPE cos / sin [1, T, D], a dense packed mask [1, 1, T, T] (a flex ``BlockMask`` is no tensor)."""


def maybe_compile_decoder_layers(model: Any, setting: Any, device: Any) -> bool:
    """Compile ``model``'s decoder layers when ``trainer.compile`` resolves to on for ``device``; call before
    FSDP2's ``shard_model``. Returns whether it did, and logs what ``auto`` resolved to."""
    enabled = compile_enabled(setting, device)
    if enabled:
        compile_decoder_layers(model)
    logger.info(
        "trainer.compile=%s on %s: decoder layers %s",
        str(setting).lower(),
        device,
        "compiled (the first step pays the compilation)" if enabled else "eager",
    )
    return enabled


def compile_decoder_layers(model: Any) -> None:
    """``torch.compile`` each decoder layer's ``forward``, its row length dynamic (module docstring).

    Identical layers share one compiled graph; the recompile limit is raised because guards may still differ per
    layer (e.g. the first and last layers' inputs), and a run must never fall back to eager silently.
    """
    import torch
    import torch._dynamo.config as dynamo

    from asyncgrpo_cli.train.distributed import decoder_layers

    layers = decoder_layers(model)
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, limit, max(getattr(dynamo, limit), 8 + 2 * len(layers)))
    settings = _tracing_settings()
    for layer in layers:
        layer.forward = _dynamic_rows(torch.compile(layer.forward), layer.forward, settings)


def _dynamic_rows(compiled: Any, eager: Any, settings: dict[str, Any] | None = None) -> Any:
    """The layer's forward: training calls run ``compiled`` with the row length marked dynamic; calls without
    autograd (the weight-sync check's probe, ``sync/verify.py``) run ``eager``: a few short forwards per sync are
    not worth another graph per layer, nor compiling a flex mask built inside the layer. ``settings``: the dynamo
    config the compiled calls run under (:func:`_tracing_settings`)."""
    import torch
    import torch._dynamo.config as dynamo

    settings = settings or {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return eager(*args, **kwargs)
        mark_row_length_dynamic(args, kwargs)
        with dynamo.patch(settings):
            return compiled(*args, **kwargs)

    return forward


def _tracing_settings() -> dict[str, Any]:
    """Dynamo settings the layers compile under. With the ``kernels`` package installed (transformers 5.25
    requires it), its ``use_kernelized_func`` wraps every attention module's forward in a set / reset of a
    module-level variable. Inside a gradient-checkpointed layer dynamo refuses that side effect (it could not be
    replayed when the backward recomputes the layer), breaks the graph, and the whole layer runs eagerly: nothing
    compiles. The set / reset pair leaves nothing behind, so the recomputation need not replay it: dynamo's
    ``skip_fwd_side_effects_in_bwd_under_checkpoint`` says so, for these calls only (a torch without the flag
    gets nothing)."""
    import torch._dynamo.config as dynamo

    name = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    return {name: True} if hasattr(dynamo, name) else {}


def mark_row_length_dynamic(args: tuple, kwargs: dict[str, Any]) -> None:
    """Mark the row-length dimension of a decoder layer's inputs dynamic for the compiler (a hint: a dimension the
    graph has to specialize stays static, without an error)."""
    import torch
    from torch._dynamo import maybe_mark_dynamic

    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return
    n = hidden.shape[1]
    maybe_mark_dynamic(hidden, 1)
    for name, dims in _SEQUENCE_DIMS.items():
        value = kwargs.get(name)
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and t.dim() >= len(dims):
                for d in dims:
                    if t.shape[d] == n:
                        maybe_mark_dynamic(t, d % t.dim())


class CompileCost(NamedTuple):
    """What compiled in one interval of :class:`CompileMeter`."""

    seconds: float
    count: int
    graph_breaks: tuple[str, ...] = ()
    """Reasons dynamo broke a graph for that it had not given before in this process (first line of each)."""


_MEANT_BREAK = "torch.compiler.disable()"
"""A break at a function wrapped in ``torch.compiler.disable`` (``model/gdn/layer.py``) is intended."""


class CompileMeter:
    """Wall time spent compiling in this process, how many compiles, and new graph-break reasons, since the last
    :meth:`take`.

    Fed by dynamo's compile start / end callbacks, which fire around each frame compile and each lazy backward
    compile (nested compiles report once, at the outermost). ``torch._dynamo.reset()`` clears the callbacks, so
    :meth:`take` registers them again when they are gone. Use :func:`compile_meter` (one per process).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._count = 0
        self._started: float | None = None
        self._breaks_seen: set[str] = set()
        self._install()

    def _install(self) -> None:
        from torch._dynamo.callback import callback_handler

        if self._on_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._on_start)
        if self._on_end not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(self._on_end)

    def _on_start(self, *_args: Any) -> None:
        self._started = time.perf_counter()

    def _on_end(self, *_args: Any) -> None:
        if self._started is None:
            return
        with self._lock:
            self._seconds += time.perf_counter() - self._started
            self._count += 1
        self._started = None

    def take(self) -> CompileCost:
        """What compiled since the previous call; starts the next interval."""
        from torch._dynamo.utils import counters

        self._install()
        new = [r for r in counters["graph_break"] if r not in self._breaks_seen]
        self._breaks_seen.update(new)
        firsts = (
            (r.strip().splitlines() or [""])[0] for r in new
        )  # the break's kind (hints may name disable)
        breaks = tuple(line for line in firsts if _MEANT_BREAK not in line)
        with self._lock:
            out = CompileCost(self._seconds, self._count, breaks)
            self._seconds, self._count = 0.0, 0
        return out


@functools.cache
def compile_meter() -> CompileMeter:
    """The process's :class:`CompileMeter` (its callbacks are registered once)."""
    return CompileMeter()
