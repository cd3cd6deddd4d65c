"""The MoE router aux loss (``model/router.py``): equal to transformers' on the same samples forwarded unpacked
(sequence and tree packing, shared prompts), its gradient and step normalization, how the coefficient resolves,
the config key, and a run end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.schema import LossConfig, ModelConfig, PackingConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.model.logprobs import token_logprobs
from asyncgrpo_cli.model.router import RouterAux, is_moe, moe_shape, resolve_router_aux
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.packing.tree import TreePacker
from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK, TrainingSequence

PACKERS = {"sequence": SequencePacker, "tree": TreePacker}


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    from asyncgrpo_cli.model.resolve import resolve_model_path

    return Path(resolve_model_path("builtin:tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def moe(moe_dir, one_torch_thread):
    """The tiny Qwen3-MoE as the trainer loads it (fp32, SDPA, gradient checkpointing), routers sharpened so that
    no token's top-2 is a near-tie (a 1e-7 difference between two forwards must not flip an expert choice)."""
    from asyncgrpo_cli.model.loading import load_policy

    torch.manual_seed(0)
    model = load_policy(str(moe_dir), ModelConfig(name_or_path=str(moe_dir)), torch.device("cpu"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def mixtral(one_torch_thread):
    """A tiny random Mixtral (``num_local_experts``): another family through the same path."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    model = MixtralForCausalLM(cfg).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(10.0)
    return model


def sample(ids, prompt_len: int, group: int, adv: float = 1.0, rng=None) -> TrainingSequence:
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.zeros(ids.shape[0], dtype=bool)
    mask[prompt_len:] = True
    rng = rng or np.random.default_rng(0)
    n = int(mask.sum())
    return TrainingSequence(
        input_ids=ids,
        train_mask=mask,
        sampler_logprobs=(rng.normal(-5, 0.3, ids.shape[0]) * mask).astype(np.float32),
        advantage=adv,
        token_extras={
            SAMPLER_TOPK: TopK(rng.integers(0, 300, (n, 3)), rng.normal(-5, 1, (n, 3)).astype(np.float32))
        },
        group_id=group,
        prompt_seq=group,
    )


def shared_prompt_samples(rng, vocab: int = 300) -> list[TrainingSequence]:
    """Two groups with a shared prompt each: forks at different depths, an identical pair, and a sample that is
    a prefix of another (all of which the tree packer forwards once)."""
    out = []
    for group in range(2):
        prompt = rng.integers(0, vocab, 9 + 3 * group).tolist()
        completions = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(3, 9, 3)]
        completions.append(completions[0])  # identical to the first
        completions.append(completions[1][:2])  # a prefix of the second
        completions.append(completions[2][:1] + rng.integers(0, vocab, 4).tolist())  # forks one token in
        for c in completions:
            out.append(sample(prompt + c, len(prompt), group, adv=float(rng.normal()), rng=rng))
    return out


def transformers_aux(model, samples: list[TrainingSequence]) -> torch.Tensor:
    """transformers' own aux loss: the CausalLM forward of the samples as one right-padded batch."""
    length = max(len(s) for s in samples)
    ids = torch.zeros((len(samples), length), dtype=torch.long)
    mask = torch.zeros((len(samples), length), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = torch.from_numpy(s.input_ids)
        mask[i, : len(s)] = 1
    return model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss


def router_of(model, coef: float = 0.01) -> RouterAux:
    router = resolve_router_aux(model, coef)
    assert router is not None
    return router


# ---------------------------------------------------------------- detection and the coefficient


def test_is_moe_reads_every_expert_key_and_text_configs():
    from transformers import (
        DeepseekV3Config,
        MixtralConfig,
        Qwen3_5MoeConfig,
        Qwen3_5MoeTextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    shapes = [
        (Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2), (8, 2)),
        (Qwen3_5MoeTextConfig(num_experts=16, num_experts_per_tok=4), (16, 4)),
        (Qwen3_5MoeConfig(text_config={"num_experts": 16, "num_experts_per_tok": 4}), (16, 4)),  # composite
        (Qwen3NextConfig(num_experts=32, num_experts_per_tok=8), (32, 8)),
        (MixtralConfig(num_local_experts=4, num_experts_per_tok=2), (4, 2)),
        (DeepseekV3Config(n_routed_experts=64, num_experts_per_tok=6), (64, 6)),
    ]
    for cfg, shape in shapes:
        assert is_moe(cfg) and moe_shape(cfg) == shape, type(cfg).__name__
    assert not is_moe(Qwen3Config())
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        moe_shape(Qwen3Config())


def test_coefficient_unset_is_the_model_configs_and_zero_disables(moe):
    assert moe.config.router_aux_loss_coef == 0.01
    unset = resolve_router_aux(moe, None)
    assert unset is not None and unset.coef == 0.01 and (unset.num_experts, unset.top_k) == (8, 2)
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    assert unset.loss_func is modeling_qwen3_moe.load_balancing_loss_func  # transformers' own
    assert resolve_router_aux(moe, 0.05).coef == 0.05
    assert resolve_router_aux(moe, 0.0) is None


def test_a_coefficient_on_a_dense_model_fails_naming_the_key(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert resolve_router_aux(dense, None) is None  # unset: nothing to do
    for coef in (0.01, 0.0):
        with pytest.raises(
            UserError, match=r"loss.router_aux_loss_coef=0\.0?1? is set, but .* not a mixture"
        ):
            resolve_router_aux(dense, coef)


def test_an_moe_model_without_a_transformers_aux_loss_is_refused_or_skipped(caplog):
    """DeepSeek-V3 (sigmoid routing, bias balancing): transformers defines no load-balancing loss for it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    )
    model = DeepseekV3ForCausalLM(cfg)
    with pytest.raises(UserError, match=r"loss.router_aux_loss_coef=0.01: transformers has no router"):
        resolve_router_aux(model, 0.01)
    assert resolve_router_aux(model, None) is None  # its config has no coefficient
    model.config.router_aux_loss_coef = 0.01
    with caplog.at_level("WARNING", logger="asyncgrpo_cli.model.router"):
        assert resolve_router_aux(model, None) is None
    assert "training without it" in caplog.text


def test_the_config_key_composes_and_is_checked():
    from asyncgrpo_cli.config.compose import compose_config
    from asyncgrpo_cli.errors import ConfigError

    assert LossConfig().router_aux_loss_coef is None
    cfg = compose_config(["+recipe=tiny", "model=tiny_moe", "loss.router_aux_loss_coef=0.02"])
    assert cfg.loss.router_aux_loss_coef == 0.02 and cfg.model.name_or_path == "builtin:tiny-qwen3-moe"
    zero = compose_config(["+recipe=tiny", "loss=clipped", "loss.router_aux_loss_coef=0"])
    assert zero.loss.router_aux_loss_coef == 0
    with pytest.raises(ConfigError, match=r"loss.router_aux_loss_coef \(-0.1\) must be a finite number >= 0"):
        compose_config(["+recipe=tiny", "loss.router_aux_loss_coef=-0.1"])


# ---------------------------------------------------------------- exact against transformers


@pytest.mark.parametrize("packer", list(PACKERS))
def test_row_aux_loss_equals_transformers_unpacked(moe, packer):
    samples = shared_prompt_samples(np.random.default_rng(1), vocab=moe.config.vocab_size)
    row = PACKERS[packer](PackingConfig(kind=packer)).pack(samples)
    assert int(row.multiplicity.sum()) == row.num_unpacked == sum(len(s) for s in samples)
    if packer == "tree":
        assert row.num_forwarded < row.num_unpacked and int(row.multiplicity.max()) == 6  # shared prompts
    stats = token_logprobs(moe, row, 1.0, with_topk=True, router=router_of(moe))
    want = transformers_aux(moe, samples)
    assert stats.aux_loss.dtype == torch.float32 and stats.aux_loss.requires_grad
    torch.testing.assert_close(stats.aux_loss, want, atol=1e-6, rtol=1e-6)
    if packer == "tree":  # the multiplicity is what makes it exact: unweighted, shared tokens count once
        out = moe.model(
            input_ids=row.input_ids,
            position_ids=row.position_ids,
            attention_mask=row.attention_mask,
            use_cache=False,
            output_router_logits=True,
        )
        unweighted = router_of(moe).loss_func(out.router_logits, 8, 2, None)
        assert abs(float(unweighted.detach()) - float(want.detach())) > 1e-3


def test_mixtral_rows_equal_transformers_unpacked(mixtral):
    router = resolve_router_aux(mixtral, None)  # the config's 0.02
    assert (router.coef, router.num_experts, router.top_k) == (0.02, 4, 2)
    samples = shared_prompt_samples(np.random.default_rng(2), vocab=mixtral.config.vocab_size)
    row = TreePacker(PackingConfig(kind="tree")).pack(samples)
    stats = token_logprobs(mixtral, row, 1.0, with_topk=False, router=router)
    torch.testing.assert_close(stats.aux_loss, transformers_aux(mixtral, samples), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- gradient and step normalization


def _router_grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and ".mlp.gate." in n}
    model.zero_grad(set_to_none=True)
    return out


def test_step_adds_coef_times_the_mean_row_aux_and_its_gradient_reaches_the_routers(moe):
    from asyncgrpo_cli.train.losses import ScoreCenteringLoss
    from asyncgrpo_cli.train.step import forward_backward

    rng = np.random.default_rng(3)
    rows = [shared_prompt_samples(rng, vocab=moe.config.vocab_size)[:6], shared_prompt_samples(rng)[6:]]
    num_trained = sum(s.num_trained for r in rows for s in r)
    packer, loss_fn = TreePacker(PackingConfig(kind="tree")), ScoreCenteringLoss(LossConfig())
    router = router_of(moe, 0.5)  # large, so the aux share of the gradient is well above rounding
    moe.zero_grad(set_to_none=True)

    def run(r):
        return forward_backward(moe, rows, num_trained, packer, loss_fn, torch.device("cpu"), 1.0, router=r)

    plain = run(None)
    g_plain = _router_grads(moe)
    with_aux = run(router)
    g_with = _router_grads(moe)
    assert plain.aux_rows == 0 and with_aux.aux_rows == 2

    auxes = [token_logprobs(moe, packer.pack(r), 1.0, True, router=router).aux_loss for r in rows]
    mean_aux = torch.stack(auxes).mean()
    (router.coef * mean_aux).backward()
    mean_aux = float(mean_aux.detach())
    g_aux = _router_grads(moe)

    assert with_aux.aux_sum / with_aux.aux_rows == pytest.approx(mean_aux, abs=1e-6)
    assert with_aux.loss - plain.loss == pytest.approx(router.coef * mean_aux, abs=1e-6)
    # both layers' routers get a gradient from the aux term
    assert len(g_aux) == 2 and all(float(g.abs().max()) > 1e-4 for g in g_aux.values())
    for name, g in g_aux.items():
        torch.testing.assert_close(g_with[name] - g_plain[name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_the_metric_is_logged_only_with_an_aux_loss():
    from asyncgrpo_cli.metrics.reducer import MetricWindow
    from asyncgrpo_cli.train.batching import StepBatch
    from asyncgrpo_cli.train.step_metrics import StepTimes, record_step

    step = StepBatch(microbatches=[])
    times = StepTimes(1.0, 0.5, 0.8, 0.1)
    for aux, want in ((None, None), ((3.0, 4.0), 0.75)):
        w = MetricWindow()
        record_step(w, step, ({}, {}), 1.0, 1.0, 1e-3, 10, 10, times, aux_loss=aux)
        assert w.reduce().get("aux_loss") == want


# ---------------------------------------------------------------- end to end


def _read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("coef", [None, 0.0])
def test_train_tiny_moe_logs_aux_loss_and_syncs_weights(tmp_path, coef):
    """`asyncgrpo train +recipe=tiny model=tiny_moe`: the embedded server serves the MoE model and the weight-sync
    check (server.verify_sync, on by default) passes after every push; with the coefficient unset (the model
    config's 0.01) every step logs a finite aux_loss, with loss.router_aux_loss_coef=0 none does."""
    run = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncgrpo_cli",
            "train",
            "+recipe=tiny",
            "model=tiny_moe",
            "logging.console=plain",
            "trainer.max_steps=3",
            "trainer.save_steps=0",
            f"hydra.run.dir={run}",
            *([] if coef is None else [f"loss.router_aux_loss_coef={coef}"]),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["model_version"] == 3
    gaps = [r["sync/logprob_gap"] for r in rows]
    assert all(g < 1e-3 for g in gaps), gaps
    if coef is None:
        aux = [r["aux_loss"] for r in rows]
        assert all(math.isfinite(a) and a > 0 for a in aux), aux  # E Σ f P: top_k (2) when balanced
        assert "router aux loss x 0.01 (from the model config)" in out.stderr + out.stdout
    else:
        assert not any("aux_loss" in r for r in rows)
        said = "no router aux loss (coefficient 0.0 from loss.router_aux_loss_coef)"
        assert said in out.stderr + out.stdout


@pytest.mark.dist
@pytest.mark.slow
def test_two_fsdp2_ranks_train_the_moe_like_one_process(moe_dir, tmp_path):
    """FSDP2 on 2 CPU ranks (gloo; the experts' fused 3D weights sharded over their first dimension) with the router
    aux loss: two steps equal the same rows as micro-batches of one process (losses, mean aux losses, every
    parameter), so the term's 1/R normalization holds across ranks, and the routers and experts did train."""
    script = str(Path(__file__).parent / "helpers" / "dist_equivalence.py")
    args = [script, "--model", str(moe_dir), "--router-aux-coef", "0.5", "--rows", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    one = subprocess.run(
        [sys.executable, *args, "--out", str(tmp_path / "1.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [*args, "--out", str(tmp_path / "2.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert b["world_size"] == 2 and len(a["aux_means"]) == 2
    assert all(math.isfinite(x) and x > 0 for x in a["aux_means"])
    assert a["aux_means"] == pytest.approx(b["aux_means"], abs=1e-6)
    assert a["losses"] == pytest.approx(b["losses"], abs=1e-6)
    from transformers import AutoModelForCausalLM

    # the model's own parameters: the checkpoint on disk stores the experts one by one
    init = AutoModelForCausalLM.from_pretrained(moe_dir).state_dict()
    experts = [k for k in init if ".mlp.experts." in k]
    assert experts and all(init[k].dim() == 3 for k in experts)  # fused [experts, out, in] parameters
    for key in [*experts, "model.layers.0.mlp.gate.weight"]:
        assert float((a["params"][key] - init[key]).abs().max()) > 1e-4, key  # trained
    assert set(a["params"]) == set(b["params"])
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name], atol=5e-5, rtol=1e-4, msg=name)


def test_qwen3_next_hybrid_moe_rows_equal_transformers_unpacked(tmp_path):
    """Qwen3-Next: gated-DeltaNet layers (their packed forward) and MoE blocks with a shared expert in one model;
    the tree-packed row's aux loss equals transformers' on the right-padded batch."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.model.gdn.layer import install
    from tests.test_gdn_packing import tiny_qwen3_next

    model = AutoModelForCausalLM.from_pretrained(
        tiny_qwen3_next(tmp_path), dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    install(model, "torch")
    samples = shared_prompt_samples(np.random.default_rng(3), vocab=model.config.vocab_size)
    row = TreePacker(PackingConfig(kind="tree")).pack(samples)
    router = router_of(model)
    assert (router.num_experts, router.top_k) == (4, 2)
    stats = token_logprobs(model, row, 1.0, with_topk=False, router=router)
    torch.testing.assert_close(stats.aux_loss, transformers_aux(model, samples), atol=1e-6, rtol=1e-6)
