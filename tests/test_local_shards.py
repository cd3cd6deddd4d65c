"""The gradient clip and the AdamW step on FSDP2's local shards (``train/optim``) against torch's on the
DTensors: the same norm, clipped gradients, parameters and moments, bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.schema import LossConfig, ModelConfig, PackingConfig
from asyncgrpo_cli.model.loading import load_policy
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.train.distributed import DistInfo, destroy_distributed, shard_model
from asyncgrpo_cli.train.losses import ClippedLoss
from asyncgrpo_cli.train.optim import AdamW, _local_shards, clip_grad_norm
from asyncgrpo_cli.train.step import forward_backward

CPU = torch.device("cpu")


def _model_with_grads(tiny_model_dir, sharded: bool):
    from asyncgrpo_cli.bench.trainer_overhead import synthetic_groups

    torch.manual_seed(0)
    cfg = ModelConfig(
        name_or_path=str(tiny_model_dir),
        dtype="float32",
        gradient_checkpointing=False,
        attn_implementation="sdpa",
    )
    model = load_policy(str(tiny_model_dir), cfg, CPU)
    if sharded:
        model = shard_model(model, DistInfo(), CPU, mixed_precision="bfloat16", cpu_offload=False)
    vocab = model.config.vocab_size
    samples = synthetic_groups(
        np.random.default_rng(0), 2, 2, prompt_len=8, completion_len=16, vocab=vocab, num_topk=0
    )
    for s in samples:
        s.sampler_logprobs[s.train_mask] = -math.log(vocab)
    packer, loss_fn = SequencePacker(PackingConfig(kind="sequence")), ClippedLoss(LossConfig())
    forward_backward(model, [samples], sum(s.num_trained for s in samples), packer, loss_fn, CPU, 1.0)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _both_ways(model, max_norm: float):
    """(norm, grads) of torch's clip and of ours, each from the same starting gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    start = [_local(p.grad).clone() for p in params]
    results = []
    for ours in (False, True):
        for p, g in zip(params, start):
            _local(p.grad).copy_(g)
        if ours:
            norm = clip_grad_norm(params, max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        results.append((norm.clone(), [_local(p.grad).clone() for p in params]))
    return start, results


@pytest.mark.parametrize(
    "max_norm", [0.05, 1e9, math.inf], ids=["clipping", "under_the_limit", "measure_only"]
)
def test_the_clip_of_fsdp2_shards_is_torchs_clip_bit_for_bit(tiny_model_dir, max_norm):
    try:
        model = _model_with_grads(tiny_model_dir, sharded=True)
        grads = [p.grad for p in model.parameters()]
        assert type(grads[0]).__name__ == "DTensor"
        assert _local_shards(grads) is not None  # the local path, not the fallback
        start, ((norm_t, grads_t), (norm_o, grads_o)) = _both_ways(model, max_norm)
    finally:
        destroy_distributed()
    assert norm_o.dtype == norm_t.dtype and norm_o.shape == norm_t.shape == ()
    assert norm_o.item() == norm_t.item() > 0.05
    for ref, got in zip(grads_t, grads_o):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    changed = any(not torch.equal(g, s) for g, s in zip(grads_o, start))
    assert changed == (max_norm == 0.05)  # scaled only when the norm is over the limit


def test_the_clip_of_plain_gradients_is_torchs_clip_bit_for_bit(tiny_model_dir):
    model = _model_with_grads(tiny_model_dir, sharded=False)
    _, ((norm_t, grads_t), (norm_o, grads_o)) = _both_ways(model, 0.05)
    assert norm_o.item() == norm_t.item()
    for ref, got in zip(grads_t, grads_o):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_gradients_the_local_path_cannot_read_take_torchs_clip(tiny_model_dir):
    try:
        model = _model_with_grads(tiny_model_dir, sharded=True)
        params = [p for p in model.parameters()]
        mixed = [params[0].grad, torch.ones(3)]  # a DTensor beside a plain tensor
        assert _local_shards(mixed) is None
        assert _local_shards([torch.ones(3)]) is not None
        assert clip_grad_norm([], 1.0).item() == 0.0
    finally:
        destroy_distributed()


def _adamw_steps(model, cls, impl: str, amsgrad: bool, grads: list[torch.Tensor]):
    """Three steps of ``cls`` from the model's current weights with ``grads`` (halved after each step): the final
    local parameters, moments and step counts, and (ours only) whether each step took the local path."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p, g in zip(params, grads):
        _local(p.grad).copy_(g)
    groups = [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2], "weight_decay": 0.0}]
    opt = cls(groups, lr=1e-2, amsgrad=amsgrad, **{impl: True})
    local = []
    for _ in range(3):
        if isinstance(opt, AdamW):
            local.append(opt.local_groups() is not None)
        opt.step()
        with torch.no_grad():
            for p in params:
                _local(p.grad).mul_(0.5)
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    state = [[_local(opt.state[p][k]).clone() for k in keys] + [opt.state[p]["step"].clone()] for p in params]
    return [_local(p).detach().clone() for p in params], state, local


def _adamw_both_ways(model, impl: str, amsgrad: bool):
    """torch's AdamW, then ours, each for ``_adamw_steps`` from the model's current weights and gradients: the
    starting weights and the two runs."""
    params = [p for p in model.parameters() if p.requires_grad]
    start = [_local(p).detach().clone() for p in params]
    grads = [_local(p.grad).clone() for p in params]
    runs = []
    for cls in (torch.optim.AdamW, AdamW):
        with torch.no_grad():
            for p, s in zip(params, start):
                _local(p).copy_(s)
        runs.append(_adamw_steps(model, cls, impl, amsgrad, grads))
    return start, runs


def _assert_the_same_steps(runs) -> None:
    (params_t, state_t, _), (params_o, state_o, local) = runs
    assert local == [False, True, True]  # the first step creates the state through torch's step
    for ref, got in zip(params_t + sum(state_t, []), params_o + sum(state_o, [])):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize(("impl", "amsgrad"), [("fused", False), ("foreach", True)])
def test_adamw_on_fsdp2_shards_is_torchs_adamw_bit_for_bit(tiny_model_dir, impl, amsgrad):
    try:
        model = _model_with_grads(tiny_model_dir, sharded=True)
        assert type(next(model.parameters())).__name__ == "DTensor"
        start, runs = _adamw_both_ways(model, impl, amsgrad)
    finally:
        destroy_distributed()
    _assert_the_same_steps(runs)
    assert any(not torch.equal(p, s) for p, s in zip(runs[1][0], start))


def test_adamw_takes_torchs_step_where_it_cannot_unwrap(tiny_model_dir):
    plain = _model_with_grads(tiny_model_dir, sharded=False)
    opt = AdamW(plain.parameters(), lr=1e-2, fused=True)
    opt.step()
    assert opt.local_groups() is None  # nothing to unwrap: torch's step is the same kernels
    try:
        model = _model_with_grads(tiny_model_dir, sharded=True)
        chosen = AdamW(model.parameters(), lr=1e-2)  # neither fused nor foreach: torch picks the kernel
        chosen.step()
        assert chosen.local_groups() is None
        fused = AdamW(model.parameters(), lr=1e-2, fused=True)
        fused.step()
        assert fused.local_groups() is not None
        before = [_local(p).detach().clone() for p in model.parameters()]
        fused.step(closure=lambda: 0.0)  # a closure takes torch's step, which still updates
        assert any(not torch.equal(_local(p), b) for p, b in zip(model.parameters(), before))
    finally:
        destroy_distributed()


def test_adamw_resumed_from_a_checkpoint_steps_on_local_shards_as_the_saved_one(tiny_model_dir, tmp_path):
    """Moments loaded through torch.distributed.checkpoint (as resuming does) are DTensors again, and the step after
    the resume is the saved optimizer's next step, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from asyncgrpo_cli.train.checkpoint import _training_state

    try:
        saved = _model_with_grads(tiny_model_dir, sharded=True)
        resumed = _model_with_grads(tiny_model_dir, sharded=True)
        opt_saved = AdamW(saved.parameters(), lr=1e-2, fused=True)
        opt_saved.step()
        dcp.save(_training_state(saved, opt_saved), checkpoint_id=str(tmp_path / "dcp"))
        opt_resumed = AdamW(resumed.parameters(), lr=1e-2, fused=True)
        grads = [p.grad for p in resumed.parameters()]
        opt_resumed.zero_grad(set_to_none=True)  # a run resumes before any backward
        state = _training_state(resumed, opt_resumed)
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
        set_state_dict(resumed, opt_resumed, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for p, g in zip(resumed.parameters(), grads):
            p.grad = g
        assert opt_resumed.local_groups() is not None
        for opt in (opt_saved, opt_resumed):
            opt.step()
        pairs = list(zip(saved.parameters(), resumed.parameters()))
        for a, b in pairs:
            torch.testing.assert_close(_local(b), _local(a), rtol=0, atol=0)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(
                    _local(opt_resumed.state[b][k]), _local(opt_saved.state[a][k]), rtol=0, atol=0
                )
    finally:
        destroy_distributed()


def test_adamw_runs_step_hooks_once_when_it_takes_torchs_step(tiny_model_dir):
    """torch wraps an optimizer class's ``step`` once with its hooks; falling back to torch's step (hooked too once
    a torch AdamW exists) must not run them twice."""
    model = _model_with_grads(tiny_model_dir, sharded=False)
    torch.optim.AdamW(model.parameters(), lr=1e-2)  # hooks torch's AdamW.step
    opt = AdamW(model.parameters(), lr=1e-2)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert calls == ["pre", "post"]
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
