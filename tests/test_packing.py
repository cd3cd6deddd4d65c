"""Sequence packing: exact layout, and packed log-probs / gradients equal to per-sample unpacked forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.model import chunked_head as chunked_head_mod
from asyncgrpo_cli.model.logprobs import token_logprobs
from asyncgrpo_cli.packing.planner import context_only
from asyncgrpo_cli.packing.row import PackedRow
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK, TrainingSequence

NEG_INF = float("-inf")


def sample(ids, mask, lps, adv=0.0, topk_ids=None, topk_lps=None) -> TrainingSequence:
    return TrainingSequence(
        input_ids=np.array(ids, dtype=np.int64),
        train_mask=np.array(mask, dtype=bool),
        sampler_logprobs=np.array(lps, dtype=np.float32),
        advantage=adv,
        token_extras={}
        if topk_ids is None
        else {SAMPLER_TOPK: TopK(np.array(topk_ids, dtype=np.int64), np.array(topk_lps, dtype=np.float32))},
    )


def pack(samples: list[TrainingSequence]) -> PackedRow:
    return SequencePacker(PackingConfig()).pack(samples)


def test_layout_hand_made():
    s0 = sample(
        [10, 11, 12, 13],
        [0, 0, 1, 1],
        [0, 0, -0.5, -0.6],
        adv=1.5,
        topk_ids=[[12, 7], [5, -1]],
        topk_lps=[[-0.5, -1.0], [-0.2, NEG_INF]],
    )
    s1 = sample([20, 21, 22], [0, 1, 1], [0, -0.1, -0.2], adv=-0.5)
    s2 = sample([30, 31, 32], [0, 0, 1], [0, 0, -0.3], adv=2.0, topk_ids=[[1, 2, 3]], topk_lps=[[-1, -2, -3]])
    row = pack([s0, s1, s2])
    assert row.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22, 30, 31, 32]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]
    seg = [0] * 4 + [1] * 3 + [2] * 3
    expected = [[seg[q] == seg[k] and k <= q for k in range(10)] for q in range(10)]
    assert row.attention_mask.shape == (1, 1, 10, 10) and row.attention_mask.dtype == torch.bool
    assert row.attention_mask[0, 0].tolist() == expected
    assert row.pred_index.tolist() == [1, 2, 4, 5, 8]
    assert row.target_ids.tolist() == [12, 13, 21, 22, 32]
    assert row.sample_index.tolist() == [0, 0, 1, 1, 2]
    assert row.advantages.tolist() == [1.5, 1.5, -0.5, -0.5, 2.0]
    assert row.sampler_logprobs.tolist() == pytest.approx([-0.5, -0.6, -0.1, -0.2, -0.3])
    topk = row.extras[SAMPLER_TOPK]
    assert topk.ids.tolist() == [[12, 7, -1], [5, -1, -1], [-1, -1, -1], [-1, -1, -1], [1, 2, 3]]
    inf = float("-inf")
    expected_lps = [[-0.5, -1.0, inf], [-0.2, inf, inf], [inf] * 3, [inf] * 3, [-1, -2, -3]]
    torch.testing.assert_close(topk.logprobs, torch.tensor(expected_lps))
    assert (row.num_forwarded, row.num_trained, row.num_samples, row.num_unpacked) == (10, 5, 3, 10)
    assert row.pred_index.dtype == row.target_ids.dtype == torch.int64
    assert row.sampler_logprobs.dtype == row.advantages.dtype == topk.logprobs.dtype == torch.float32
    assert topk.ids.dtype == torch.int64 and row.candidate_ids is topk.ids


def test_layout_without_topk_and_without_trained_tokens():
    row = pack([context_only(sample([1, 2, 3], [0, 1, 1], [0, -1, -1]))])
    assert row.num_trained == 0 and row.num_forwarded == 3
    assert row.pred_index.shape == (0,) and row.extras == {} and row.candidate_ids is None


def test_rejects_bad_samples():
    with pytest.raises(ValueError, match="no predecessor"):
        pack([sample([1, 2], [1, 1], [0, 0])])
    with pytest.raises(ValueError, match="1 rows in token_extras.'sampler_topk'."):
        pack([sample([1, 2, 3], [0, 1, 1], [0, 0, 0], topk_ids=[[1]], topk_lps=[[0.0]])])
    with pytest.raises(ValueError, match="empty row"):
        pack([])


@pytest.mark.parametrize("non_blocking", [False, True])
def test_to_device_moves_every_tensor(non_blocking):
    """(``non_blocking`` pins only host-to-GPU copies, ``tests/gpu/test_device_copy_gpu.py``; others are torch's.)"""
    row = pack([sample([1, 2, 3], [0, 1, 1], [0, -1, -1], topk_ids=[[1], [2]], topk_lps=[[-1], [-2]])]).to(
        "meta", non_blocking=non_blocking
    )
    tensors = [v for k, v in vars(row).items() if isinstance(v, torch.Tensor) and k != "host_leave"]
    tensors += [v for v in vars(row.extras[SAMPLER_TOPK]).values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 11 and all(t.device.type == "meta" for t in tensors)
    assert row.host_leave.device.type == "cpu" and row.host_leave.tolist() == [3, 3, 3]  # kept for the plan
    assert (row.num_forwarded, row.num_trained, row.num_samples) == (3, 2, 1)


@pytest.mark.parametrize("kind", ["tree", "sequence"])
def test_a_pickled_row_comes_back_with_every_tensor_equal(kind):
    """Rank 0 scatters packed rows (``train/distributed.rank_steps``): they pickle as numpy arrays and come back
    as tensors equal in dtype, shape and values, the extras' and the row's class included; a tensor numpy has no
    dtype for (bfloat16) pickles as torch pickles it. A sequence-packed row sends its samples' lengths instead of
    its positions, intervals and multiplicity, and rebuilds them."""
    import pickle
    from dataclasses import fields, replace

    from asyncgrpo_cli.config.schema import PackingConfig
    from asyncgrpo_cli.packing.tree import TreePacker
    from asyncgrpo_cli.samples import CandidateSets, TeacherTopK

    samples = [
        sample(
            [1, 2, 3, 4], [0, 1, 1, 1], [0, -1, -1, -2], topk_ids=[[1], [2], [3]], topk_lps=[[-1], [-2], [-3]]
        ),
        sample([1, 2, 5], [0, 1, 1], [0, -1, -1], topk_ids=[[2], [5]], topk_lps=[[-2], [-5]]),
    ]
    samples[0].sampling_mask = CandidateSets.from_lists([[2, 3], [3], [4, 1]])
    for s in samples:
        n = s.num_trained
        s.token_extras["teacher"] = TeacherTopK(
            np.arange(2 * n).reshape(n, 2),
            -np.ones((n, 2), np.float32),
            teacher=np.zeros(n),
            teacher_names=("t",),
        )
    packer = TreePacker(PackingConfig(kind="tree")) if kind == "tree" else SequencePacker(PackingConfig())
    row = packer.pack(samples)
    row.extras["teacher"].logprobs = row.extras["teacher"].logprobs.to(torch.bfloat16)
    moved = row.to("meta")
    if kind == "sequence":  # the lengths stand for three per-token arrays; a copy pickles them in full
        assert row.segment_lengths.tolist() == [4, 3] and moved.segment_lengths is None
        in_full = replace(row)
        assert (
            in_full.segment_lengths is None
            and len(pickle.dumps(row)) < len(pickle.dumps(in_full)) - 3 * 7 * 8
        )
        assert pickle.loads(pickle.dumps(row)).segment_lengths.tolist() == [4, 3]
    for original, back in (
        (row, pickle.loads(pickle.dumps(row))),
        (moved, pickle.loads(pickle.dumps(moved))),
    ):
        assert type(back) is type(original)
        pairs = [
            (getattr(original, f.name), getattr(back, f.name)) for f in fields(original) if f.name != "extras"
        ]
        for name, extra in original.extras.items():
            assert type(back.extras[name]) is type(extra)
            pairs += [(getattr(extra, f.name), getattr(back.extras[name], f.name)) for f in fields(extra)]
        for a, b in pairs:
            if isinstance(a, torch.Tensor):
                assert type(b) is torch.Tensor and (a.dtype, a.shape, a.device) == (
                    b.dtype,
                    b.shape,
                    b.device,
                )
                if a.device.type == "cpu":
                    assert torch.equal(a, b)
            else:
                assert a == b
    assert row.support_ids is not None and back.host_leave.tolist() == row.leave.tolist()


# ---------------------------------------------------------------- model equivalence


def random_samples(vocab: int, lengths=(9, 14, 6), k: int = 4, seed: int = 0) -> list[TrainingSequence]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        prompt = n // 3
        mask = np.arange(n) >= prompt
        n_trained = int(mask.sum())
        topk = rng.integers(0, vocab, size=(n_trained, k))
        topk[0, -1] = -1  # some padding
        out.append(
            sample(
                rng.integers(0, vocab, size=n),
                mask,
                rng.normal(-2, 0.5, size=n) * mask,
                adv=(-1.0) ** i * (i + 1) * 0.5,
                topk_ids=topk,
                topk_lps=rng.normal(-3, 1, size=topk.shape),
            )
        )
    return out


def unpacked_reference(model, samples, temperature: float):
    """Per-sample stock forwards (full logits): target log-probs, entropies, top-k log-probs at trained tokens."""
    lps, ents, topks = [], [], []
    for s in samples:
        logits = model(input_ids=torch.from_numpy(s.input_ids)[None], use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        t = torch.from_numpy(np.flatnonzero(s.train_mask))
        rows = logp[t - 1]
        lps.append(rows.gather(-1, torch.from_numpy(s.input_ids)[t][:, None]).squeeze(-1))
        ents.append(-(rows.exp() * rows).sum(-1).detach())
        ids = torch.from_numpy(s.token_extras[SAMPLER_TOPK].ids)
        topks.append(rows.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, NEG_INF))
    return torch.cat(lps), torch.cat(ents), torch.cat(topks)


def objective(lps: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """A fixed scalar function of every log-prob, so gradients cover targets and top-k ids."""
    w = torch.linspace(-1, 1, lps.shape[0])
    return (w * lps).sum() + torch.where(topk.isfinite(), topk.exp(), 0.0).sum()


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_packed_equals_unpacked(model, samples, temperature: float = 0.7, gc: bool = False):
    model.train()
    if gc:
        model.activation_checkpointing_enable()
    else:
        model.activation_checkpointing_disable()
    ref_lp, ref_ent, ref_topk = unpacked_reference(model, samples, temperature)
    objective(ref_lp, ref_topk).backward()
    ref_grads = grads(model)

    stats = token_logprobs(model, pack(samples), temperature, with_topk=True)
    torch.testing.assert_close(stats.logprobs, ref_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.entropy, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.topk_logprobs, ref_topk.detach(), atol=1e-5, rtol=1e-5)
    assert not stats.entropy.requires_grad
    objective(stats.logprobs, stats.topk_logprobs).backward()
    packed_grads = grads(model)
    assert packed_grads.keys() == ref_grads.keys() and len(ref_grads) > 0
    for name, g in ref_grads.items():
        torch.testing.assert_close(packed_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).float()


def tiny_gemma2(sliding_window: int = 64):
    """Final logit soft-capping, sliding-window layers, eager attention (Gemma2 has no SDPA)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        final_logit_softcapping=2.0,
        attn_logit_softcapping=None,
        sliding_window=sliding_window,
        eos_token_id=1,
        attn_implementation="eager",
    )
    return Gemma2ForCausalLM(cfg).float()


def tiny_cohere():
    """A logit scale on the LM head."""
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    cfg = CohereConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        logit_scale=0.5,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    return CohereForCausalLM(cfg).float()


@pytest.mark.parametrize("build", [tiny_gemma2, tiny_cohere], ids=["gemma2_softcap", "cohere_logit_scale"])
def test_head_transforms_match_stock_forward(build):
    assert_packed_equals_unpacked(build(), random_samples(300))


def test_sliding_window_guard():
    model = tiny_gemma2(sliding_window=8)
    with pytest.raises(ValueError, match="sliding window"):
        token_logprobs(model, pack(random_samples(300, lengths=(9, 5))), 1.0, with_topk=False)


def test_eager_attention_gets_an_additive_mask(qwen3):
    """Eager attention adds the mask to the scores: a bool mask is silently wrong there, so the head converts it."""
    samples = random_samples(qwen3.config.vocab_size)
    row = pack(samples)
    qwen3.set_attn_implementation("eager")
    try:
        qwen3.eval()
        decoder = qwen3.get_decoder()
        with torch.no_grad():
            ref = torch.cat(
                [decoder(input_ids=torch.from_numpy(s.input_ids)[None]).last_hidden_state[0] for s in samples]
            )
            raw = decoder(
                input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=row.attention_mask
            ).last_hidden_state[0]
        assert (raw - ref).abs().max() > 1e-2
        assert_packed_equals_unpacked(qwen3, samples)
    finally:
        qwen3.set_attn_implementation("sdpa")


@pytest.mark.parametrize("gc", [False, True], ids=["plain", "grad_ckpt"])
def test_qwen3_packed_equals_unpacked(qwen3, gc):
    assert qwen3.config.tie_word_embeddings
    assert_packed_equals_unpacked(qwen3, random_samples(qwen3.config.vocab_size), gc=gc)


@pytest.mark.parametrize("gc", [False, True], ids=["plain", "grad_ckpt"])
def test_llama_packed_equals_unpacked(llama, gc):
    assert not llama.config.tie_word_embeddings
    assert_packed_equals_unpacked(
        llama, random_samples(llama.config.vocab_size, lengths=(7, 12, 5, 10)), gc=gc
    )


def test_chunked_head_matches(qwen3, monkeypatch):
    qwen3.activation_checkpointing_disable()
    samples = random_samples(qwen3.config.vocab_size)
    row = pack(samples)
    full = token_logprobs(qwen3, row, 1.0, with_topk=True)
    objective(full.logprobs, full.topk_logprobs).backward()
    ref_grads = grads(qwen3)
    monkeypatch.setattr(chunked_head_mod, "POSITION_CHUNK", 3)
    chunked = token_logprobs(qwen3, row, 1.0, with_topk=True)
    torch.testing.assert_close(chunked.logprobs, full.logprobs)
    objective(chunked.logprobs, chunked.topk_logprobs).backward()
    for name, g in grads(qwen3).items():
        torch.testing.assert_close(g, ref_grads[name], msg=name)


def test_zero_trained_row_stays_in_graph(qwen3):
    qwen3.activation_checkpointing_disable()
    row = pack([context_only(s) for s in random_samples(qwen3.config.vocab_size)])
    stats = token_logprobs(qwen3, row, 1.0, with_topk=False)
    assert stats.logprobs.shape == (0,) and stats.topk_logprobs is None
    assert stats.logprobs.grad_fn is not None
    stats.logprobs.sum().backward()
    g = grads(qwen3)
    assert g and all(bool((v == 0).all()) for v in g.values())


def test_transformers_mask_semantics(qwen3):
    """What transformers 5.24 does with a packed row (why the packer always sends the explicit 4D mask).

    - A 4D bool ``attention_mask`` is used as-is by SDPA with True = attend (the inverted mask is wrong).
    - ``position_ids`` resets alone are right only with ``use_cache=False``: with the config default
      (use_cache=True) a cache is created and transformers falls back to plain causal attention across samples.
    """
    qwen3.eval()
    samples = random_samples(qwen3.config.vocab_size)
    row = pack(samples)
    decoder = qwen3.get_decoder()
    with torch.no_grad():
        ref = torch.cat(
            [decoder(input_ids=torch.from_numpy(s.input_ids)[None]).last_hidden_state[0] for s in samples]
        )

        def hidden(**kw):
            return decoder(input_ids=row.input_ids, position_ids=row.position_ids, **kw).last_hidden_state[0]

        def err(h):
            return (h - ref).abs().max().item()

        assert err(hidden(attention_mask=row.attention_mask)) < 1e-5
        assert err(hidden(attention_mask=row.attention_mask, use_cache=True)) < 1e-5
        assert err(hidden(attention_mask=~row.attention_mask)) > 1e-2
        assert err(hidden(use_cache=False)) < 1e-5
        assert err(hidden()) > 1e-2, (
            "position_ids alone now isolate samples with a cache too: update the docs"
        )


def test_rejects_flash_attention(qwen3, monkeypatch):
    row = pack(random_samples(qwen3.config.vocab_size))
    monkeypatch.setattr(qwen3.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(ValueError, match="use auto, sdpa, eager or flex_attention"):
        token_logprobs(qwen3, row, 1.0, with_topk=False)


def test_sliding_window_guard_runs_on_the_host_copies_before_the_forward():
    """``check_row`` (the trainer runs it before each row goes to the device) refuses the row with the same
    message, so ``token_logprobs(row_checked=True)`` can skip its own device-side check."""
    from asyncgrpo_cli.model.logprobs import check_row

    model = tiny_gemma2(sliding_window=8)
    with pytest.raises(ValueError, match="longer than the model's sliding window"):
        check_row(model, pack(random_samples(300, lengths=(9, 5))), with_topk=False)
    fits = pack(random_samples(300, lengths=(8, 5)))
    check_row(model, fits, with_topk=False)
    checked = token_logprobs(model, fits, 1.0, with_topk=False, row_checked=True)
    torch.testing.assert_close(checked.logprobs, token_logprobs(model, fits, 1.0, with_topk=False).logprobs)
