"""Triton kernels of the fused LM head (``model/fused_head.py`` documents the algorithm and owns the launch).

A module of its own because Triton resolves the helpers a kernel calls among the module's globals, and importing
it requires Triton: ``fused_head`` imports it only when the fused head runs.

The position count ``n_pos`` (and the backward's ``v0``) change from call to call, so the kernels do not let
Triton specialize on them: by default a Triton kernel compiles a new variant the first time an integer argument
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


@triton.jit(do_not_specialize=["n_pos"])
def forward_kernel(
    h_ptr, w_ptr, b_ptr, ids_ptr, m_ptr, s_ptr, a_ptr, pick_ptr,
    n_pos, vocab, stride_h, stride_w, scale, softcap, inv_temp, HIDDEN: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NUM_IDS: tl.constexpr,
    IDS_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_pos
    slots = tl.arange(0, IDS_P)
    v_lo = split * (SPLIT_BLOCKS * BLOCK_V)  # the last slice's blocks may overrun the vocabulary
    run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_N,), tl.float32)
    run_dot = tl.zeros((BLOCK_N,), tl.float32)
    picked = tl.full((BLOCK_N, IDS_P), float("-inf"), tl.float32)
    for block in range(0, SPLIT_BLOCKS):
        cols = v_lo + block * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        acc = _logits(
            h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, stride_h, stride_w, HIDDEN,
            HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
        )  # fmt: skip
        z = _transform(acc, scale, softcap, inv_temp, HAS_SCALE, HAS_SOFTCAP)
        z_in = tl.where(col_ok[None, :], z, float("-inf"))  # z stays finite (0) past the vocabulary
        new_max = tl.maximum(run_max, tl.max(z_in, 1))  # finite: a slice's first block has a valid column
        e = tl.exp(z_in - new_max[:, None])
        decay = tl.exp(run_max - new_max)
        run_sum = run_sum * decay + tl.sum(e, 1)
        run_dot = run_dot * decay + tl.sum(e * z, 1)
        run_max = new_max
        for j in tl.static_range(NUM_IDS):  # a compare-and-select per id: cheaper than tl.gather on an H200
            ids = tl.load(ids_ptr + rows * NUM_IDS + j, row_ok, -1)
            hit = tl.max(tl.where(cols[None, :] == ids[:, None], z_in, float("-inf")), 1)
            picked = tl.where(slots[None, :] == j, tl.maximum(picked, hit[:, None]), picked)
    out = split * n_pos + rows
    tl.store(m_ptr + out, run_max, row_ok)
    tl.store(s_ptr + out, run_sum, row_ok)
    tl.store(a_ptr + out, run_dot, row_ok)
    pick_at = pick_ptr + out[:, None] * IDS_P + slots[None, :]
    tl.store(pick_at, picked, row_ok[:, None] & (slots[None, :] < NUM_IDS))


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
