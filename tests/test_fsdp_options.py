"""Trainer precision / offload / compile options: config validation, shard_model's checks, and bf16 mixed
precision in one process (FSDP2 over a one-rank gloo group) training like fp32 within bf16 tolerance."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.config.schema import LossConfig, ModelConfig, PackingConfig, TrainerConfig
from asyncgrpo_cli.errors import ConfigError, UserError
from asyncgrpo_cli.model.loading import load_policy
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.train.compile import compile_decoder_layers
from asyncgrpo_cli.train.distributed import (
    DistInfo,
    destroy_distributed,
    iter_full_state,
    shard_model,
)
from asyncgrpo_cli.train.losses import ClippedLoss
from asyncgrpo_cli.train.optim import build_optimizer, build_scheduler
from asyncgrpo_cli.train.step import clip_and_step, forward_backward

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["trainer.mixed_precision=float16"], "trainer.mixed_precision ('float16') must be bfloat16 or null"),
        (["trainer.mixed_precision=bfloat16", "model.dtype=bfloat16"], "set model.dtype=float32"),
        (["trainer.cpu_offload=true", "trainer.device=cpu"], "set trainer.cpu_offload=false"),
    ],
)
def test_invalid_precision_and_offload_combinations_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        compose_config(["+recipe=tiny", *overrides])


def test_valid_speed_options_compose():
    cfg = compose_config(
        [
            "+recipe=tiny",
            "trainer.mixed_precision=bfloat16",
            "trainer.compile=true",
            "trainer.reshard_after_forward=false",
        ]
    )
    assert (cfg.trainer.mixed_precision, cfg.trainer.compile, cfg.trainer.reshard_after_forward) == (
        "bfloat16",
        True,
        False,
    )


def _tiny(tiny_model_dir, dtype: str = "float32"):
    torch.manual_seed(0)
    cfg = ModelConfig(
        name_or_path=str(tiny_model_dir),
        dtype=dtype,
        gradient_checkpointing=False,
        attn_implementation="sdpa",
    )
    return load_policy(str(tiny_model_dir), cfg, CPU)


def test_shard_model_refuses_what_it_cannot_do(tiny_model_dir):
    with pytest.raises(UserError, match="trainer.cpu_offload=true .* set trainer.cpu_offload=false"):
        shard_model(_tiny(tiny_model_dir), DistInfo(), CPU, mixed_precision=None, cpu_offload=True)
    with pytest.raises(UserError, match="trainer.mixed_precision='float16' is not supported"):
        shard_model(_tiny(tiny_model_dir), DistInfo(), CPU, mixed_precision="float16", cpu_offload=False)
    with pytest.raises(UserError, match="set model.dtype=float32"):
        shard_model(
            _tiny(tiny_model_dir, "bfloat16"), DistInfo(), CPU, mixed_precision="bfloat16", cpu_offload=False
        )
    model = _tiny(tiny_model_dir)
    assert shard_model(model, DistInfo(), CPU, mixed_precision=None, cpu_offload=False) is model  # left as is
    assert not torch.distributed.is_initialized()


def test_compile_keeps_parameter_names(tiny_model_dir):
    model = _tiny(tiny_model_dir)
    before = list(model.state_dict())
    compile_decoder_layers(model)  # lazy: nothing compiles until a forward
    assert list(model.state_dict()) == before
    assert all("forward" in vars(layer) for layer in model.model.layers)


def _step_losses(model, rows, steps: int = 2) -> list[float]:
    cfg = TrainerConfig(learning_rate=1e-3)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    packer, loss_fn = SequencePacker(PackingConfig(kind="sequence")), ClippedLoss(LossConfig())
    losses = []
    for _ in range(steps):
        res = forward_backward(
            model, rows, sum(s.num_trained for r in rows for s in r), packer, loss_fn, CPU, 1.0
        )
        losses.append(res.loss)
        clip_and_step(model, optimizer, scheduler, cfg.max_grad_norm)
    return losses


def test_one_process_mixed_precision_runs_fsdp2_and_tracks_fp32(tiny_model_dir):
    from asyncgrpo_cli.bench.trainer_overhead import synthetic_groups

    vocab = _tiny(tiny_model_dir).config.vocab_size
    samples = synthetic_groups(
        np.random.default_rng(0), 2, 2, prompt_len=8, completion_len=16, vocab=vocab, num_topk=0
    )
    for s in samples:
        s.sampler_logprobs[s.train_mask] = -math.log(vocab)
    rows = [samples[:2], samples[2:]]
    fp32 = _step_losses(_tiny(tiny_model_dir), rows)
    try:
        model = shard_model(
            _tiny(tiny_model_dir), DistInfo(), CPU, mixed_precision="bfloat16", cpu_offload=False
        )
        assert torch.distributed.get_world_size() == 1
        mixed = _step_losses(model, rows)
        full = dict(iter_full_state(model, DistInfo()))
    finally:
        destroy_distributed()
    assert type(model.model.embed_tokens.weight).__name__ == "DTensor"
    assert mixed != fp32  # computed in bf16 ...
    assert mixed == pytest.approx(fp32, abs=0.02)  # ... close to fp32
    assert {t.dtype for t in full.values()} == {torch.float32}  # fp32 master weights, gathered full
    assert full["model.embed_tokens.weight"].shape == (vocab, model.config.hidden_size)


def test_a_prepacked_first_row_and_the_overlap_hook_leave_the_step_unchanged(tiny_model_dir):
    """The trainer packs the next step's first row under this step's GPU work (``first_row``) and plans in
    ``overlap``; with several ranks every row arrives packed, pickled through the scatter (``rank_steps``): the
    loss and every gradient are those of packing each row in the loop."""
    import pickle

    from asyncgrpo_cli.bench.trainer_overhead import synthetic_groups
    from asyncgrpo_cli.train.distributed import rank_steps

    vocab = _tiny(tiny_model_dir).config.vocab_size
    samples = synthetic_groups(
        np.random.default_rng(1), 2, 2, prompt_len=8, completion_len=16, vocab=vocab, num_topk=0
    )
    rows = [samples[:2], samples[2:]]
    num_trained = sum(s.num_trained for s in samples)
    packer, loss_fn = SequencePacker(PackingConfig(kind="sequence")), ClippedLoss(LossConfig())
    scattered = pickle.loads(pickle.dumps(rank_steps([rows], num_trained, packer.pack)[0])).rows
    assert [type(r).__name__ for r in scattered] == ["PackedRow", "PackedRow"]
    results, calls = [], []
    for first, given in ((None, rows), (packer.pack(rows[0]), rows), (None, scattered)):
        model = _tiny(tiny_model_dir)
        res = forward_backward(
            model,
            given,
            num_trained,
            packer,
            loss_fn,
            CPU,
            1.0,
            overlap=lambda: calls.append(1),
            first_row=first,
        )
        results.append((res.loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert calls == [1, 1, 1]  # once per step, after the last backward
    for loss, grads in results[1:]:
        assert loss == results[0][0]
        for name, grad in results[0][1].items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)


def test_the_optimizer_step_queued_behind_the_backward_trains_like_stepping_after_the_read(tiny_model_dir):
    """``forward_backward(optimizer=...)`` queues clip + AdamW + scheduler behind the last backward, before the
    ``overlap`` hook and the loss read: two steps give the losses, gradient norms and weights of stepping after
    ``forward_backward`` returned (``clip_and_step``), bit for bit."""
    from asyncgrpo_cli.bench.trainer_overhead import synthetic_groups
    from asyncgrpo_cli.train.step import OptimizerStep

    vocab = _tiny(tiny_model_dir).config.vocab_size
    samples = synthetic_groups(
        np.random.default_rng(3), 2, 2, prompt_len=8, completion_len=16, vocab=vocab, num_topk=0
    )
    for s in samples:  # a random policy's log-probs: importance ratios near 1, no token masked
        s.sampler_logprobs[s.train_mask] = -math.log(vocab)
    rows = [samples[:2], samples[2:]]
    num_trained = sum(s.num_trained for s in samples)
    packer, loss_fn = SequencePacker(PackingConfig(kind="sequence")), ClippedLoss(LossConfig())
    cfg = TrainerConfig(learning_rate=1e-3, max_grad_norm=0.05)  # small: the clip acts
    runs, events = [], []
    for queued in (False, True):
        model = _tiny(tiny_model_dir)
        optimizer = build_optimizer(model, cfg)
        scheduler = build_scheduler(optimizer, cfg)
        optimizer.register_step_post_hook(lambda *_: events.append("step"))
        step = OptimizerStep(model, optimizer, scheduler, cfg.max_grad_norm) if queued else None
        losses, norms = [], []
        for _ in range(2):
            res = forward_backward(
                model, rows, num_trained, packer, loss_fn, CPU, 1.0,
                overlap=lambda: events.append("overlap"), optimizer=step,
            )  # fmt: skip
            losses.append(res.loss)
            if queued:
                assert res.optimizer_s > 0
                norms.append(res.grad_norm)
            else:
                assert res.grad_norm is None
                norms.append(clip_and_step(model, optimizer, scheduler, cfg.max_grad_norm))
        runs.append((losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}))
    assert events == ["overlap", "step"] * 2 + ["step", "overlap"] * 2
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert all(n > cfg.max_grad_norm for n in runs[0][1]), runs[0][1]
    for name, weight in runs[0][2].items():
        torch.testing.assert_close(runs[1][2][name], weight, rtol=0, atol=0)


def test_a_row_with_an_id_outside_the_vocabulary_is_refused_before_its_forward(tiny_model_dir):
    """The LM head's id checks run on each packed row's host copies (no device sync mid-forward): a bad id still
    stops the step with the head's message, before anything reaches the model."""
    from asyncgrpo_cli.bench.trainer_overhead import synthetic_groups

    model = _tiny(tiny_model_dir)
    vocab = model.config.vocab_size
    samples = synthetic_groups(
        np.random.default_rng(2), 1, 2, prompt_len=8, completion_len=8, vocab=vocab, num_topk=0
    )
    samples[1].input_ids[-1] = vocab + 5  # a trained token: a target id past the vocabulary
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    packer, loss_fn = SequencePacker(PackingConfig(kind="sequence")), ClippedLoss(LossConfig())
    with pytest.raises(ValueError, match=rf"a target id is outside the vocabulary \[0, {vocab}\)"):
        forward_backward(model, [samples], sum(s.num_trained for s in samples), packer, loss_fn, CPU, 1.0)
    assert calls == []
