"""CUDA: fla's chunk kernels run per segment-tree level (``model/gdn/rule_fla.py``) against the pure-torch
reference (``rule_torch.py``) on a two-tree row with three levels and Qwen3.5-2B's DeltaNet head layout (16 key /
32 value heads of 128, the 4B / 9B layout; the 2B has 16 / 16): the forward whenever fla imports, the backward where fla can train (``fla_status``: not on
Hopper with Triton 3.4-3.7.0 without TileLang); and the tiny hybrid's packed log-probs and gradients through the
trainer's head on CUDA (fla where it can train, else the torch path) against the same row through the CPU torch
path in fp32 (which tests/test_gdn_packing.py holds equal to one-sample-per-row transformers forwards; on CUDA
transformers' own forward picks fla whenever it is installed, whose backward fla refuses on such hosts)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from asyncgrpo_cli.model.gdn.layer import fla_available, fla_status, install
from asyncgrpo_cli.model.gdn.plan import build_plan
from asyncgrpo_cli.model.gdn.rule_torch import tree_chunk_gated_delta_rule
from asyncgrpo_cli.packing.tree import TreePacker

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def tree_leave(rng, prompt: int, branches: int, sub: int) -> np.ndarray:
    """DFS intervals of one prompt with ``branches`` completions, each with ``sub`` sub-branches (3 levels)."""
    parts: list[list] = []  # [start, subtree end] per segment in pre-order
    lengths: list[int] = []

    def seg(n, children):
        start = sum(lengths)
        lengths.append(n)
        parts.append([start, None])
        me = len(parts) - 1
        for c in children:
            seg(*c)
        parts[me][1] = sum(lengths)

    kids = [
        (int(rng.integers(3, 200)), [(int(rng.integers(1, 150)), []) for _ in range(sub)])
        for _ in range(branches)
    ]
    seg(prompt, kids)
    leave = np.concatenate([np.full(n, end) for n, (_, end) in zip(lengths, parts, strict=True)])
    return leave


@pytest.mark.parametrize("backward", [False, True])
def test_fla_tree_rule_matches_the_torch_reference(backward):
    if importlib.util.find_spec("fla") is None:
        pytest.skip("needs fla-core")
    if backward and not fla_available():
        pytest.skip(fla_status())
    from asyncgrpo_cli.model.gdn.rule_fla import fla_tree_gated_delta_rule

    dtype, tol = torch.bfloat16, 3e-2

    rng = np.random.default_rng(0)
    first = tree_leave(
        rng, 300, 4, 2
    )  # a second tree follows: its intervals are offset by the first's length
    leave = np.concatenate([first, tree_leave(rng, 100, 3, 0) + first.shape[0]])
    n = leave.shape[0]
    plan = build_plan(torch.as_tensor(leave, device=CUDA), conv_taps=4)
    assert len(plan.segment_levels) == 3
    torch.manual_seed(0)
    hk, hv, d = 16, 32, 128
    q = torch.randn(n, hk, d, device=CUDA, dtype=dtype, requires_grad=True)
    k = torch.randn(n, hk, d, device=CUDA, dtype=dtype, requires_grad=True)
    v = torch.randn(n, hv, d, device=CUDA, dtype=dtype, requires_grad=True)
    g = (-torch.rand(n, hv, device=CUDA) * 0.5).requires_grad_()
    beta = torch.rand(n, hv, device=CUDA, dtype=dtype).requires_grad_()
    inputs = [q, k, v, g, beta]
    got = fla_tree_gated_delta_rule(q, k, v, g, beta, plan)
    ref_in = [x.detach().float().requires_grad_() for x in inputs]
    want = tree_chunk_gated_delta_rule(*ref_in, plan)
    assert (got.float() - want).abs().max() / want.abs().max() < tol
    if not backward:
        return
    weight = torch.randn_like(got, dtype=torch.float32)
    got_grads = torch.autograd.grad((got.float() * weight).sum(), inputs)
    want_grads = torch.autograd.grad((want * weight).sum(), ref_in)
    for name, a, b in zip("q k v g beta".split(), got_grads, want_grads, strict=True):
        err = float((a.float() - b).abs().max() / b.abs().max())
        assert err < 5 * tol, (name, err)


@pytest.mark.parametrize("kind", ["sequence", "tree"])
def test_tiny_hybrid_packed_on_cuda_equals_the_cpu_path(kind):
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.config.schema import PackingConfig
    from asyncgrpo_cli.model.logprobs import token_logprobs
    from asyncgrpo_cli.model.resolve import resolve_model_path
    from asyncgrpo_cli.packing.sequence import SequencePacker
    from tests.test_gdn_packing import branching_samples

    path = resolve_model_path("builtin:tiny-qwen3.5")
    packer = TreePacker(PackingConfig(kind="tree")) if kind == "tree" else SequencePacker(PackingConfig())
    row = packer.pack(branching_samples())
    results = []
    for device, kernel in ((torch.device("cpu"), "torch"), (CUDA, "fla" if fla_available() else "torch")):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        model.config.use_cache = False
        install(model.to(device), kernel)
        on = row.to(device)
        lp = token_logprobs(model, on, 1.0, False).logprobs
        (lp * on.advantages).sum().backward()
        results.append((lp.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert (got - want).abs().max() < 1e-3
    for name, w in want_grads.items():
        err = float((got_grads[name] - w).abs().max())
        assert err <= 2e-2 * float(w.abs().max()) + 1e-4, (name, err)
