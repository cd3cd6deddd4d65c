"""Which kernels run flex attention (``model.flex_backend``), and FlashAttention-4's first-use check.

``triton`` is torch's Triton templates of flex attention, with the tiles of ``model/flex.py``. ``flash`` is torch's
FLASH backend of flex (``kernel_options={"BACKEND": "FLASH"}``): FlashAttention-4's CuTe DSL kernels, generated
for the row's mask and block lists, from the ``flash-attn-4`` package, for 16-bit heads on Hopper / Blackwell GPUs
(a call with fp32 heads runs the Triton kernels). ``auto`` (the default) takes flash where it can run
(:func:`resolve_flex_backend`: the package, the GPU, the head dim, no Triton tiles given) and it passes its
first-use check. On an H100, tree rows of 16k / 64k tokens, 0.6B heads: forward+backward 1.20x / 1.23x faster than
the tuned Triton kernels, outputs and gradients equal to bf16 rounding; whole 0.6B steps 1.2x
(docs/benchmarks.md). Its backward accumulates dq atomically, so two runs are not bit-identical (torch refuses it
under ``torch.use_deterministic_algorithms`` on Hopper).

The first-use check (:func:`flash_problem`, ``auto`` only): torch's FLASH backend is experimental and
flash-attn-4 is a beta, so a pair that does not work together (an API either side changed, a CuTe DSL build for
another CUDA) would otherwise fail at the first training step. Before the model trains, ``auto`` runs FlashAttention-4
forward and backward on a small tree row's mask with the model's heads and compares it with the same attention
computed by SDPA with a dense mask in fp32; a failure or a mismatch is logged once with its reason and the
run goes on with the Triton kernels. ``flash`` skips the check and lets any error through. The check's row mask is
built as a training row's on CUDA (``model/flex.py`` ``row_block_mask``: the same mask function and padding).
Its first run took 32 s on an H100 (compiling FlashAttention-4's kernels for its row), so a pass is remembered in
the cache directory (``flash_check.json`` under ``paths.cache_dir``) under the exact versions of torch,
flash-attn-4 and the CuTe DSL, the GPU's name and capability and the head shape; a later run with all of them
equal skips it. A failure is not remembered: the next run checks again.

This module imports neither torch nor flash-attn-4 at import time.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

FLASH_CAPABILITIES = (9, 10, 11)
"""CUDA capability majors FlashAttention-4 runs flex attention on (Hopper, Blackwell; measured on sm90)."""
FLASH_OPTIONS = {"BACKEND": "FLASH"}
"""The ``kernel_options`` that select torch's FLASH backend of flex attention."""


def flash_installed() -> bool:
    """Whether FlashAttention-4's CuTe kernels (``flash_attn.cute``, the ``flash-attn-4`` package) can be found."""
    import importlib.util

    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):  # a flash_attn without cute, or one that fails to import
        return False


def flash_head_dim(capability: tuple[int, int], head_dim: int) -> bool:
    """Whether FlashAttention-4 has kernels for heads of ``head_dim`` on a GPU of ``capability`` (its interface's
    rule: multiples of 8 up to 256 on Hopper; up to 128, or 256, on Blackwell)."""
    if head_dim % 8 or head_dim < 8:
        return False
    return head_dim <= 256 if capability[0] == 9 else head_dim <= 128 or head_dim == 256


def resolve_flex_backend(
    choice: str,
    capability: tuple[int, int] | None,
    installed: bool,
    triton_tiles: bool = False,
    head_dim: int | None = None,
) -> str:
    """``flash`` or ``triton`` for ``model.flex_backend=choice`` on a GPU of ``capability`` (None: no CUDA
    device), with flash-attn-4 ``installed`` or not, Triton tiles set in ``model.flex_kernel_options`` or not, for
    the model's heads of ``head_dim`` (None: not known yet).

    Raises ValueError naming the key and the fix when ``flash`` was asked for and cannot run.
    """
    import torch
    from torch.nn.attention.flex_attention import FlexKernelOptions

    if choice == "triton":
        return "triton"
    torch_has = "BACKEND" in FlexKernelOptions.__optional_keys__ | FlexKernelOptions.__required_keys__
    gpu = capability is not None and capability[0] in FLASH_CAPABILITIES
    heads = gpu and (head_dim is None or flash_head_dim(capability, head_dim))
    if choice == "auto":
        return "flash" if installed and torch_has and heads and not triton_tiles else "triton"
    if not torch_has:
        raise ValueError(
            f"model.flex_backend=flash: torch {torch.__version__} has no FLASH backend of flex attention: "
            "use model.flex_backend=triton, or a newer torch"
        )
    if not installed:
        raise ValueError(
            "model.flex_backend=flash needs FlashAttention-4 (the flash-attn-4 package): pip install "
            "'asyncgrpo[flash]' (for torch's CUDA 13 builds also 'flash-attn-4[cu13]'), or use "
            "model.flex_backend=auto or triton"
        )
    if not gpu:
        where = (
            "no CUDA device" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
        )
        raise ValueError(
            f"model.flex_backend=flash: FlashAttention-4 runs on Hopper / Blackwell GPUs (compute capability "
            f"{', '.join(f'{c}.x' for c in FLASH_CAPABILITIES)}), not on {where}: use model.flex_backend=triton"
        )
    if not heads:
        raise ValueError(
            f"model.flex_backend=flash: FlashAttention-4 has no kernels for heads of dim {head_dim} on compute "
            f"capability {capability[0]}.{capability[1]}: use model.flex_backend=triton"
        )
    return "flash"


def backend_for(
    choice: str, device: Any, heads: int, kv_heads: int, head_dim: int, triton_tiles: bool
) -> str:
    """``flash`` or ``triton``: the kernels flex attention runs for ``model.flex_backend=choice`` on ``device`` for
    the model's heads (query and key / value heads of ``head_dim``); under ``auto``, flash only once it passed its
    first-use check (a failure is logged once, with its reason, and Triton's kernels run).

    Raises ValueError naming the key and the fix when ``flash`` was asked for and cannot run.
    """
    import torch

    dev = torch.device(device)
    gpu = dev.type == "cuda" and torch.cuda.is_available()
    capability = torch.cuda.get_device_capability(dev) if gpu else None
    backend = resolve_flex_backend(choice, capability, flash_installed(), triton_tiles, head_dim)
    if backend == "flash" and choice == "auto":
        problem = flash_problem(dev, heads, kv_heads, head_dim)
        if problem is not None:
            logger.warning(
                "model.flex_backend=auto: FlashAttention-4 failed its first-use check on %s (%s). Using flex "
                "attention's Triton kernels; model.flex_backend=triton skips the check.",
                dev,
                problem,
            )
            return "triton"
    return backend


CHECK_TOLERANCE = 5e-2
"""Largest output difference and relative gradient error the first-use check accepts (SDPA in bf16 against fp32
on the check's row: output 0.004-0.007, gradients 0.002-0.005 relative; a kernel computing the wrong mask is off
by far more: plain causal attention on that row, 0.48)."""

_checked: dict[tuple, str | None] = {}


PASSES_FILE = "flash_check.json"
"""The cache directory's record of passed first-use checks (module docstring)."""


def flash_problem(device: Any, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why FlashAttention-4 must not run this process's flex attention (None: it passed its check), checked once
    per device and head shape, and not again where a run of the same versions, GPU and heads passed it (module
    docstring)."""
    key = (str(device), heads, kv_heads, head_dim)
    if key not in _checked:
        stamp = check_stamp(device, heads, kv_heads, head_dim)
        if stamp is not None and stamp in passed_before():
            _checked[key] = None
        else:
            _checked[key] = _check(device, heads, kv_heads, head_dim)
            if _checked[key] is None and stamp is not None:
                remember_pass(stamp)
    return _checked[key]


def check_stamp(device: Any, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """What a remembered pass must match: torch, flash-attn-4 and CuTe DSL versions, the GPU and the heads (None
    off CUDA, or where a version is unknown: such a check is never remembered)."""
    import importlib.metadata

    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        versions = [importlib.metadata.version(d) for d in ("flash-attn-4", "nvidia-cutlass-dsl")]
    except importlib.metadata.PackageNotFoundError:
        return None
    major, minor = torch.cuda.get_device_capability(dev)
    return (
        f"torch {torch.__version__}, flash-attn-4 {versions[0]}, nvidia-cutlass-dsl {versions[1]}, "
        f"{torch.cuda.get_device_name(dev)} sm{major}{minor}, heads {heads}/{kv_heads}/{head_dim}"
    )


def passed_before() -> set[str]:
    """The stamps of the checks runs passed before (an unreadable record counts as none)."""
    import json

    from asyncgrpo_cli.paths import cache_dir

    try:
        passed = json.loads((cache_dir() / PASSES_FILE).read_text()).get("passed", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {p for p in passed if isinstance(p, str)}


def remember_pass(stamp: str) -> None:
    """Add ``stamp`` to the record, replaced whole (ranks writing at once lose an entry, never the file); a cache
    directory that cannot be written only costs the next run its check."""
    import json
    import os
    import tempfile

    from asyncgrpo_cli.paths import cache_dir

    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{PASSES_FILE}.")
        with os.fdopen(fd, "w") as f:
            json.dump({"passed": sorted(passed_before() | {stamp})}, f, indent=1)
        os.replace(tmp, root / PASSES_FILE)
    except OSError as exc:
        logger.debug("could not record the FlashAttention-4 check in %s: %s", root, exc)


def _check(device: Any, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """FlashAttention-4 (bf16) against SDPA with the dense mask (fp32) on :func:`check_row`; None when they agree."""
    import torch

    from asyncgrpo_cli.packing.attention import dense_mask, flex_block_mask, flex_length

    with torch.inference_mode(False), torch.enable_grad():  # the loader may run under no_grad
        try:
            leave = check_row(device)
            q, k, v, grad = check_inputs(device, heads, kv_heads, head_dim, leave.shape[0])
            mask = flex_block_mask(leave, flex_length(leave.shape[0]))  # as model/flex.py's row_block_mask
            got = attention_and_grads(flash_attend, q, k, v, grad, mask)
            fp32 = (x.float() for x in (q, k, v, grad))
            want = attention_and_grads(dense_attend, *fp32, dense_mask(leave))
        except Exception as exc:  # a compile or launch failure of this torch / flash-attn-4 pair: reported
            text = str(exc).strip().splitlines()
            return f"{type(exc).__name__}: {text[0][:200].rstrip('.') if text else ''}"
    return compare(got, want)


def compare(got: list[Any], want: list[Any]) -> str | None:
    """None when the outputs (first) agree within :data:`CHECK_TOLERANCE` and each gradient does, relatively."""
    err = float((got[0].float() - want[0].float()).abs().max())
    if not err <= CHECK_TOLERANCE:
        return f"its output differs from SDPA's by {err:.3g}"
    for name, g, w in zip(("dq", "dk", "dv"), got[1:], want[1:], strict=True):
        rel = float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30))
        if not rel <= CHECK_TOLERANCE:
            return f"its {name} differs from SDPA's by {rel:.3g} (relative)"
    return None


def check_row(device: Any) -> Any:
    """A small tree row's intervals (int64 [384]): a 128-token prompt, then two completions below it (96 and 160
    tokens); a prompt token's interval covers the row, a completion token's its own completion."""
    import torch

    leave = torch.full((384,), 384, dtype=torch.int64)
    leave[128:224] = 224
    return leave.to(device)


def check_inputs(device: Any, heads: int, kv_heads: int, head_dim: int, n: int) -> tuple[Any, ...]:
    """Random bf16 q [1, heads, n, D], k / v [1, kv_heads, n, D] and an output gradient like q."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)

    def rand(h: int) -> Any:
        return torch.randn(1, h, n, head_dim, device=device, generator=gen).to(torch.bfloat16)

    return rand(heads), rand(kv_heads), rand(kv_heads), rand(heads)


def attention_and_grads(attend: Any, q: Any, k: Any, v: Any, grad: Any, mask: Any) -> list[Any]:
    """[output, dq, dk, dv] of ``attend(q, k, v, mask)`` on leaves copied from q / k / v."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = attend(*leaves, mask)
    out.backward(grad)
    return [out.detach(), *(x.grad for x in leaves)]


def dense_attend(q: Any, k: Any, v: Any, mask: Any) -> Any:
    """SDPA with a dense bool mask (True: attend), GQA heads expanded."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def flash_attend(q: Any, k: Any, v: Any, mask: Any) -> Any:
    """Compiled flex attention on FlashAttention-4's kernels: q / k / v zero-padded to the BlockMask's length as a
    training row's are (``model/flex.py``), the output cropped back."""
    import torch.nn.functional as F

    n, length = q.shape[-2], mask.seq_lengths[0]
    padded = [F.pad(x, (0, 0, 0, length - n)) for x in (q, k, v)]
    return _compiled_flash()(*padded, mask)[:, :, :n]


@functools.cache
def _compiled_flash() -> Any:
    """``torch.compile`` of a function of its own, so the check's graph counts against no limit of the training
    path's compiled ``flex_attention``."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    def attend(q: Any, k: Any, v: Any, mask: Any) -> Any:
        gqa = q.shape[1] != k.shape[1]
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=dict(FLASH_OPTIONS))

    return torch.compile(attend, dynamic=False)
