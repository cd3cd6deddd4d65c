"""Triton kernels of the fused LM head (``model/fused_head.py`` documents the algorithm and owns the launch).

A module of its own because Triton resolves the helpers a kernel calls among the module's globals, and importing
it requires Triton: ``fused_head`` imports it only when the fused head runs.

The position count ``n_pos``, the first row ``row0`` and the backward's ``v0`` change from call to call, so the
kernels do not let Triton specialize on them: by default a Triton kernel compiles a new variant the first time an integer argument
is divisible by 16 (or equals 1), which cost a ~1.4 s recompile in a random training step when the number of
trained positions happened to be a multiple of 16 (docs/benchmarks.md). Strides and the vocabulary are fixed for
a run and stay specialized.
"""

# ruff: noqa: N803 (Triton's compile-time constants are upper case by convention)

import triton
import triton.language as tl


@triton.jit
def _transform(acc, scale, softcap, inv_temp, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    z = acc
    if HAS_SCALE:
        z = z * scale
    if HAS_SOFTCAP:  # c·tanh(z / c), tanh(u) = 1 - 2 / (e^(2u) + 1) (finite at both ends)
        z = softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))
    return z * inv_temp


@triton.jit
def _logits(
    h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, stride_h, stride_w, HIDDEN: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    # Row base pointers in 64-bit arithmetic: V x H (or N x H) passes 2^31 elements for large vocabularies.
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    for d0 in range(0, HIDDEN, BLOCK_D):
        dims = d0 + tl.arange(0, BLOCK_D)
        dim_ok = dims < HIDDEN
        h = tl.load(h_rows + dims[None, :], row_ok[:, None] & dim_ok[None, :], 0.0)
        w = tl.load(w_rows + dims[None, :], col_ok[:, None] & dim_ok[None, :], 0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, col_ok, 0.0).to(tl.float32)[None, :]
    return acc


@triton.jit(do_not_specialize=["n_pos", "v0"])
def grad_kernel(
    h_ptr, w_ptr, b_ptr, gsum_ptr, logz_ptr, dx_ptr,
    n_pos, n_vocab, stride_h, stride_w, stride_dx, v0, scale, softcap, inv_temp, slope_factor,
    HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dx[n, v - v0] = -G·p_v·∂z/∂x (the dense part of ∂L/∂x) for the tile's positions [0, n_pos) and vocabulary
    [v0, v0 + n_vocab); the caller overwrites the target and candidate columns with their exact values."""
    pid_n, pid_v = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = v0 + local
    row_ok = rows < n_pos
    col_ok = local < n_vocab
    acc = _logits(
        h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, stride_h, stride_w, HIDDEN,
        HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
    )  # fmt: skip
    z = _transform(acc, scale, softcap, inv_temp, HAS_SCALE, HAS_SOFTCAP)
    log_z = tl.load(logz_ptr + rows, row_ok, 0.0)
    g_total = tl.load(gsum_ptr + rows, row_ok, 0.0)
    grad = -g_total[:, None] * tl.exp(z - log_z[:, None])
    if HAS_SOFTCAP:  # ∂z/∂x = s/T · (1 - (z·T/c)²)
        tanh = z / (inv_temp * softcap)
        grad = grad * ((1.0 - tanh * tanh) * slope_factor)
    else:
        grad = grad * slope_factor
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(dx_ptr + rows[:, None] * stride_dx + local[None, :], grad.to(dx_ptr.dtype.element_ty), ok)


@triton.jit(do_not_specialize=["row0"])
def stats_kernel(
    z_ptr, b_ptr, ids_ptr, logz_ptr, ent_ptr, pick_ptr, row0, stride_z, scale, softcap, inv_temp,
    VOCAB: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NUM_IDS: tl.constexpr,
    IDS_P: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One row of raw fp32 logits (cuBLAS's output, ``z_ptr`` row ``r``) -> log Z, entropy and the transformed
    logits at the row's ids, written at position ``row0 + r``: an online logsumexp over the row in blocks."""
    r = tl.program_id(0)
    row = z_ptr + r.to(tl.int64) * stride_z
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.zeros((), tl.float32)
    run_dot = tl.zeros((), tl.float32)
    for v0 in range(0, VOCAB, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < VOCAB
        raw = tl.load(row + cols, ok, 0.0)
        if HAS_BIAS:
            raw += tl.load(b_ptr + cols, ok, 0.0).to(tl.float32)
        z = _transform(raw, scale, softcap, inv_temp, HAS_SCALE, HAS_SOFTCAP)
        z_in = tl.where(ok, z, float("-inf"))  # z stays finite (transformed 0) past the vocabulary
        new_max = tl.maximum(run_max, tl.max(z_in, 0))
        e = tl.exp(z_in - new_max)
        decay = tl.exp(run_max - new_max)
        run_sum = run_sum * decay + tl.sum(e, 0)
        run_dot = run_dot * decay + tl.sum(e * z, 0)
        run_max = new_max
    log_z = run_max + tl.log(run_sum)
    at = row0 + r
    tl.store(logz_ptr + at, log_z)
    tl.store(ent_ptr + at, log_z - run_dot / run_sum)
    slots = tl.arange(0, IDS_P)
    slot_ok = slots < NUM_IDS
    ids = tl.load(ids_ptr + at.to(tl.int64) * NUM_IDS + slots, slot_ok, -1)
    live = slot_ok & (ids >= 0) & (ids < VOCAB)
    raw = tl.load(row + ids, live, 0.0)
    if HAS_BIAS:
        raw += tl.load(b_ptr + ids, live, 0.0).to(tl.float32)
    z = _transform(raw, scale, softcap, inv_temp, HAS_SCALE, HAS_SOFTCAP)
    tl.store(pick_ptr + at.to(tl.int64) * NUM_IDS + slots, tl.where(live, z, float("-inf")), slot_ok)
