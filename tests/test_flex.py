"""Flex attention on CPU: the BlockMask built from a row's intervals equals ``create_block_mask`` exactly, the flex
forward (uncompiled) equals SDPA with the dense mask on tree and sequence rows, and ``model.attn_implementation``
is resolved and validated (flex refused off CUDA).
Gradients of the flex path need CUDA: tests/gpu/test_flex_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from asyncgrpo_cli.config.schema import ModelConfig, PackingConfig
from asyncgrpo_cli.errors import ConfigError, UserError
from asyncgrpo_cli.model.flex import FLEX_IMPL, register_flex, resolve_attn_implementation
from asyncgrpo_cli.model.logprobs import token_logprobs
from asyncgrpo_cli.packing.attention import flex_block_mask, flex_length, tree_mask_mod
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.packing.tree import TreePacker
from tests.test_tree_packing import random_forest, sample

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def forked_groups(rng, num_groups: int = 3, forks: int = 6, prompt: int = 100, vocab: int = 300) -> list:
    """GRPO-like groups: ``forks`` completions (10-60 tokens, a few forking late) below a shared prompt."""
    out = []
    for g in range(num_groups):
        head = rng.integers(0, vocab, size=prompt)
        for i in range(forks):
            tail = rng.integers(0, vocab, size=int(rng.integers(10, 60)))
            if i % 3 == 2:  # shares part of the previous completion: a fork below the prompt
                tail[:5] = out[-1].input_ids[prompt : prompt + 5]
            out.append(sample(np.concatenate([head, tail]), prompt, adv=i - 2.5, group=g, k=3, rng=rng))
    return out


def block_sets(num: torch.Tensor, idx: torch.Tensor) -> list[set[int]]:
    """The key blocks each query block lists (the first ``num`` entries of its index row)."""
    return [set(idx[0, 0, q, : int(num[0, 0, q])].tolist()) for q in range(num.shape[-1])]


@pytest.mark.parametrize("block", [16, 128])
def test_block_mask_from_intervals_equals_create_block_mask(block):
    """Partial and full block lists, unpadded and padded, equal flex's own T² evaluation of the mask_mod."""
    rng = np.random.default_rng(0)
    rows = [TreePacker(PackingConfig()).pack(forked_groups(rng, prompt=p)) for p in (100, 300)]
    rows += [TreePacker(PackingConfig()).pack(random_forest(rng, vocab=4)) for _ in range(3)]
    rows.append(SequencePacker(PackingConfig(kind="sequence")).pack(forked_groups(rng, num_groups=2)))
    num_full = 0
    for row in rows:
        n = row.num_forwarded
        for length in (n, n + 3 * block + 5):
            ours = flex_block_mask(row.leave, length, block)
            ref = create_block_mask(
                tree_mask_mod(row.leave, length, block),
                None,
                None,
                length,
                length,
                device="cpu",
                BLOCK_SIZE=block,
            )
            assert ours.seq_lengths == (length, length)
            assert block_sets(ours.kv_num_blocks, ours.kv_indices) == block_sets(
                ref.kv_num_blocks, ref.kv_indices
            )
            full = block_sets(ours.full_kv_num_blocks, ours.full_kv_indices)
            assert full == block_sets(ref.full_kv_num_blocks, ref.full_kv_indices)
            num_full += sum(len(f) for f in full)
    assert num_full > 0  # a long shared prompt gives blocks that skip the mask_mod


def test_flex_length_buckets():
    assert [flex_length(n) for n in (1, 1000, 1024, 1025, 8000, 16384, 16385)] == [
        1024, 1024, 1024, 2048, 8192, 16384, 32768,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    register_flex()
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )


def run_both(model, row) -> dict:
    """token_logprobs of ``row`` under SDPA (dense mask) and the registered flex attention (BlockMask)."""
    out = {}
    with torch.no_grad():  # flex has no CPU backward
        for impl in ("sdpa", FLEX_IMPL):
            model.set_attn_implementation(impl)
            out[impl] = token_logprobs(model, row, 0.7, with_topk=True)
    model.set_attn_implementation("sdpa")
    return out


@pytest.mark.parametrize("kind", ["tree", "sequence"])
def test_flex_forward_equals_sdpa(qwen3, kind, one_torch_thread):
    rng = np.random.default_rng(1)
    samples = forked_groups(rng, vocab=qwen3.config.vocab_size)
    packer = TreePacker(PackingConfig()) if kind == "tree" else SequencePacker(PackingConfig(kind="sequence"))
    row = packer.pack(samples)
    assert row.num_forwarded > 3 * 128  # several flex blocks
    out = run_both(qwen3, row)
    ref, flex = out["sdpa"], out[FLEX_IMPL]
    torch.testing.assert_close(flex.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex.entropy, ref.entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex.topk_logprobs, ref.topk_logprobs, atol=1e-5, rtol=1e-5)


def test_flex_forward_padded_to_its_bucket_equals_sdpa(qwen3, one_torch_thread):
    """The CUDA layout (q/k/v zero-padded to flex_length(T), padded blocks listed nowhere) on CPU."""
    row = TreePacker(PackingConfig()).pack(
        forked_groups(np.random.default_rng(2), vocab=qwen3.config.vocab_size)
    )
    decoder = qwen3.get_decoder()

    def hidden(mask):
        return decoder(
            input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=mask, use_cache=False
        ).last_hidden_state

    with torch.no_grad():
        ref = hidden(row.attention_mask)
        qwen3.set_attn_implementation(FLEX_IMPL)
        try:
            padded = hidden(flex_block_mask(row.leave, flex_length(row.num_forwarded)))
        finally:
            qwen3.set_attn_implementation("sdpa")
    torch.testing.assert_close(padded, ref, atol=1e-5, rtol=1e-5)


def test_flex_without_a_mask_is_one_causal_sequence(qwen3, one_torch_thread):
    """A plain model(input_ids) call (e.g. the weight-sync probe) gets no mask from transformers: causal."""
    ids = torch.randint(0, qwen3.config.vocab_size, (1, 70))
    with torch.no_grad():
        ref = qwen3(input_ids=ids, use_cache=False).logits
        qwen3.set_attn_implementation(FLEX_IMPL)
        try:
            got = qwen3(input_ids=ids, use_cache=False).logits
            with pytest.raises(ValueError, match="only a single sequence"):
                qwen3(input_ids=ids.repeat(2, 1), use_cache=False)
            with pytest.raises(TypeError, match="BlockMask"):
                qwen3.get_decoder()(input_ids=ids, attention_mask=torch.ones(1, 1, 70, 70, dtype=torch.bool))
        finally:
            qwen3.set_attn_implementation("sdpa")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_attn_implementation_is_resolved_per_device():
    from transformers import AttentionInterface

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attn_implementation("auto", cpu) == "sdpa"
    assert resolve_attn_implementation("eager", cuda) == "eager"
    assert resolve_attn_implementation("auto", cuda) == FLEX_IMPL
    assert resolve_attn_implementation("flex_attention", cuda) == FLEX_IMPL
    assert FLEX_IMPL in AttentionInterface._global_mapping
    with pytest.raises(ValueError, match="model.attn_implementation=flex_attention needs a CUDA device"):
        resolve_attn_implementation("flex_attention", cpu)
    with pytest.raises(ValueError, match="model.attn_implementation='flash_attention_2' is not supported"):
        resolve_attn_implementation("flash_attention_2", cuda)


def test_config_validates_attn_implementation():
    pytest.importorskip("hydra")  # absent on the GPU hosts
    from asyncgrpo_cli.config.compose import compose_config

    assert compose_config(["+recipe=tiny"]).model.attn_implementation == "auto"
    assert compose_config(["+recipe=tiny"]).packing.kind == "tree"
    with pytest.raises(ConfigError, match="model.attn_implementation .'flash_attention_2'. must be one of"):
        compose_config(["+recipe=tiny", "model.attn_implementation=flash_attention_2"])
    with pytest.raises(ConfigError, match="flex_attention needs trainer.device=cuda"):
        compose_config(["+recipe=tiny", "model.attn_implementation=flex_attention", "trainer.device=cpu"])


def test_loader_refuses_flex_on_cpu(tiny_model_dir):
    from asyncgrpo_cli.model.loading import load_policy

    cfg = ModelConfig(name_or_path=str(tiny_model_dir), attn_implementation="flex_attention")
    with pytest.raises(UserError, match="needs a CUDA device"):
        load_policy(str(tiny_model_dir), cfg, torch.device("cpu"))


def test_kernel_options_are_checked_against_torch_and_reach_every_flex_call(qwen3, one_torch_thread):
    from asyncgrpo_cli.model import flex

    with pytest.raises(ValueError, match="model.flex_kernel_options: fwd_BLOCK_Q not among"):
        flex.set_kernel_options({"fwd_BLOCK_Q": 64})
    row = TreePacker(PackingConfig()).pack(
        forked_groups(np.random.default_rng(3), vocab=qwen3.config.vocab_size)
    )
    try:
        flex.set_kernel_options({"fwd_BLOCK_M": 64, "bwd_num_warps": 4})  # prefixed names are accepted
        assert flex._KERNEL_OPTIONS == {"fwd_BLOCK_M": 64, "bwd_num_warps": 4}
        # a value torch itself refuses proves the options reach the call (eager CPU flex ignores block sizes)
        flex.set_kernel_options({"BACKEND": "NO_SUCH_BACKEND"})
        with pytest.raises(ValueError, match="Invalid BACKEND value 'NO_SUCH_BACKEND'"):
            run_both(qwen3, row)
    finally:
        flex.set_kernel_options({})
        qwen3.set_attn_implementation("sdpa")
    assert flex._KERNEL_OPTIONS == {}


def test_tuned_options_reach_16_bit_heads_of_their_size_on_their_gpu_unless_options_are_given(monkeypatch):
    from asyncgrpo_cli.model import flex

    tuned = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4}
    bf16 = torch.bfloat16
    assert flex.tuned_options((9, 0), 128, bf16) == tuned
    assert flex.tuned_options((8, 0), 128, bf16) == {} and flex.tuned_options((9, 0), 64, bf16) == {}
    assert flex.tuned_options(None, 128, bf16) == {} and flex.tuned_options((9, 0), 128, torch.float32) == {}

    def q(dtype, head_dim):
        return torch.empty(1, 2, 4, head_dim, dtype=dtype)

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    try:
        flex.set_kernel_options({}, tuned_for=torch.device("cuda", 0))
        assert flex.call_options(q(torch.bfloat16, 128)) == tuned
        assert flex.call_options(q(torch.float16, 128)) == tuned
        assert flex.call_options(q(torch.float32, 128)) is None  # measured for 16-bit tiles only
        assert flex.call_options(q(torch.bfloat16, 64)) is None
        # it runs inside compiled layers: dynamo traces it without a graph break
        traced = torch.compile(
            lambda x: x * 1 if flex.call_options(x) else x * 2, backend="eager", fullgraph=True
        )
        assert torch.equal(traced(torch.ones(1, 2, 4, 128, dtype=torch.bfloat16)), torch.ones(1, 2, 4, 128))
        assert "tuned for this GPU and head dim 128" in flex.describe_options(128)
        assert flex.describe_options(64) == "torch's table for the GPU"
        flex.set_kernel_options({"bwd_num_warps": 4}, tuned_for=torch.device("cuda", 0))  # given: only those
        assert flex.call_options(q(torch.bfloat16, 128)) == {"bwd_num_warps": 4}
        flex.set_kernel_options({}, tuned_for=None)  # model.flex_tuned_options=false
        assert flex.call_options(q(torch.bfloat16, 128)) is None
        flex.set_kernel_options({}, tuned_for=torch.device("cpu"))
        assert flex.call_options(q(torch.bfloat16, 128)) is None
    finally:
        flex.set_kernel_options({})


def test_config_checks_flex_kernel_options():
    pytest.importorskip("hydra")  # absent on the GPU hosts
    from asyncgrpo_cli.config.compose import compose_config

    cfg = compose_config(["+recipe=tiny", "+model.flex_kernel_options={fwd_BLOCK_M:64,fwd_num_warps:4}"])
    assert cfg.model.flex_kernel_options == {"fwd_BLOCK_M": 64, "fwd_num_warps": 4}
    with pytest.raises(
        ConfigError, match="model.flex_kernel_options is set but model.attn_implementation=sdpa"
    ):
        compose_config(
            ["+recipe=tiny", "model.attn_implementation=sdpa", "+model.flex_kernel_options={BLOCK_M:64}"]
        )
    with pytest.raises(ConfigError, match=r"model.flex_kernel_options.BLOCK_M \(\[64\]\) must be an integer"):
        compose_config(["+recipe=tiny", "+model.flex_kernel_options={BLOCK_M:[64]}"])


def test_the_loader_refuses_an_unknown_kernel_option_naming_the_key(tiny_model_dir):
    from asyncgrpo_cli.model.loading import load_policy

    cfg = ModelConfig(name_or_path=str(tiny_model_dir), flex_kernel_options={"BLOCK_Q": 64})
    with pytest.raises(UserError, match="model.flex_kernel_options: BLOCK_Q not among"):
        load_policy(str(tiny_model_dir), cfg, torch.device("cuda"))


def test_flex_backend_is_resolved_from_the_gpu_and_flash_attn_4():
    from asyncgrpo_cli.model.flex_backend import resolve_flex_backend

    hopper, ampere = (9, 0), (8, 0)
    assert resolve_flex_backend("auto", hopper, installed=True) == "flash"
    assert resolve_flex_backend("auto", (10, 0), installed=True) == "flash"
    assert resolve_flex_backend("auto", hopper, installed=False) == "triton"
    assert resolve_flex_backend("auto", ampere, installed=True) == "triton"
    assert resolve_flex_backend("auto", None, installed=True) == "triton"
    assert resolve_flex_backend("auto", hopper, installed=True, triton_tiles=True) == "triton"  # tiles given
    assert resolve_flex_backend("triton", hopper, installed=True) == "triton"
    assert resolve_flex_backend("flash", hopper, installed=True) == "flash"
    with pytest.raises(
        ValueError, match=r"model.flex_backend=flash needs FlashAttention-4 .*asyncgrpo\[flash\]"
    ):
        resolve_flex_backend("flash", hopper, installed=False)
    with pytest.raises(
        ValueError, match="model.flex_backend=flash: .* not on compute capability 8.0: use model"
    ):
        resolve_flex_backend("flash", ampere, installed=True)
    with pytest.raises(ValueError, match="not on no CUDA device"):
        resolve_flex_backend("flash", None, installed=True)
    # head dims FlashAttention-4 has kernels for: multiples of 8 up to 256 on Hopper, up to 128 or 256 on Blackwell
    for capability, head_dim, want in [
        (hopper, 128, "flash"), (hopper, 256, "flash"), (hopper, 80, "flash"), (hopper, 100, "triton"),
        (hopper, 512, "triton"), ((10, 0), 128, "flash"), ((10, 0), 192, "triton"), ((10, 0), 256, "flash"),
    ]:  # fmt: skip
        assert resolve_flex_backend("auto", capability, True, head_dim=head_dim) == want, (
            capability,
            head_dim,
        )
    with pytest.raises(
        ValueError, match="no kernels for heads of dim 100 on compute capability 9.0: use model"
    ):
        resolve_flex_backend("flash", hopper, installed=True, head_dim=100)


def test_flash_reaches_16_bit_heads_and_fp32_heads_keep_triton(monkeypatch):
    from asyncgrpo_cli.model import flex

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    try:
        flex.set_kernel_options({}, tuned_for=torch.device("cuda", 0), flash=True)
        for dtype in (torch.bfloat16, torch.float16):
            assert flex.call_options(torch.empty(1, 2, 4, 128, dtype=dtype)) == {"BACKEND": "FLASH"}
        # FlashAttention-4 has no fp32 kernels: those calls get the Triton options they had
        assert flex.call_options(torch.empty(1, 2, 4, 128)) is None
        assert flex.describe_options(128).startswith("FlashAttention-4")
        flex.set_kernel_options({}, tuned_for=torch.device("cuda", 0))
        assert (
            flex.call_options(torch.empty(1, 2, 4, 128, dtype=torch.bfloat16))
            == flex.TUNED_OPTIONS[(9, 0)][128]
        )
    finally:
        flex.set_kernel_options({})
    assert not flex._FLASH


def test_config_checks_flex_backend():
    pytest.importorskip("hydra")  # absent on the GPU hosts
    from asyncgrpo_cli.config.compose import compose_config

    assert compose_config(["+recipe=tiny"]).model.flex_backend == "auto"
    assert compose_config(["+recipe=tiny", "model.flex_backend=flash"]).model.flex_backend == "flash"
    with pytest.raises(ConfigError, match=r"model.flex_backend \('fa4'\) must be one of auto, triton, flash"):
        compose_config(["+recipe=tiny", "model.flex_backend=fa4"])
    with pytest.raises(
        ConfigError, match="model.flex_kernel_options.BACKEND is set: choose .* model.flex_backend"
    ):
        compose_config(["+recipe=tiny", "+model.flex_kernel_options={BACKEND:FLASH}"])
    with pytest.raises(
        ConfigError, match="tiles of flex attention's Triton kernels, but model.flex_backend=flash"
    ):
        compose_config(
            ["+recipe=tiny", "model.flex_backend=flash", "+model.flex_kernel_options={fwd_BLOCK_M:64}"]
        )


def test_the_loader_refuses_flash_without_flash_attn_4_naming_the_key(tiny_model_dir, monkeypatch):
    from asyncgrpo_cli.model import flex_backend
    from asyncgrpo_cli.model.loading import load_policy

    monkeypatch.setattr(flex_backend, "flash_installed", lambda: False)
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), flex_backend="flash")
    with pytest.raises(UserError, match="model.flex_backend=flash needs FlashAttention-4"):
        load_policy(str(tiny_model_dir), cfg, torch.device("cuda"))


def test_flash_first_use_check_tolerates_bf16_and_catches_a_wrong_mask_or_a_failure():
    """The check's comparison (model/flex_backend.py): bf16 attention on its tree row passes against fp32; the same
    attention with the completions' intervals dropped (every token sees the whole row before it) does not; a
    backend that cannot run at all (FLASH on CPU) is reported as the error's first line, never raised."""
    from asyncgrpo_cli.model import flex_backend as fb
    from asyncgrpo_cli.packing.attention import dense_mask

    leave = fb.check_row("cpu")
    q, k, v, grad = fb.check_inputs("cpu", 4, 2, 32, leave.shape[0])
    fp32 = [x.float() for x in (q, k, v, grad)]
    want = fb.attention_and_grads(fb.dense_attend, *fp32, dense_mask(leave))
    bf16 = fb.attention_and_grads(fb.dense_attend, q, k, v, grad, dense_mask(leave))
    assert fb.compare(bf16, want) is None
    causal = fb.attention_and_grads(
        fb.dense_attend, *fp32, dense_mask(torch.full_like(leave, leave.shape[0]))
    )
    assert fb.compare(causal, want).startswith("its output differs from SDPA's by")
    assert fb.compare([want[0], want[1] * 2, *want[2:]], want).startswith("its dq differs from SDPA's by")
    # the check's flex side (padding to the compiled length, the row's BlockMask, cropping) computes SDPA's
    # attention: compiled flex on CPU, forward only (no CPU backward; its CPU kernel has no FLASH backend)
    from asyncgrpo_cli.packing.attention import flex_block_mask, flex_length

    with torch.no_grad():
        flexed = fb.flash_attend(*fp32[:3], flex_block_mask(leave, flex_length(leave.shape[0])))
    torch.testing.assert_close(flexed, want[0], atol=1e-5, rtol=1e-5)
    fb._checked.clear()
    try:
        problem = fb.flash_problem(torch.device("cpu"), 4, 2, 32)
        assert isinstance(problem, str) and problem and problem.split(":")[0].isidentifier(), problem
        assert fb.flash_problem(torch.device("cpu"), 4, 2, 32) is problem  # checked once
    finally:
        fb._checked.clear()


def test_a_passed_first_use_check_is_remembered_and_a_failed_one_is_not(tmp_path, monkeypatch):
    """A pass is recorded in the cache directory under its stamp (versions, GPU, heads) and a later process with
    the same stamp skips the check; a failure is checked again; an unreadable record counts as none."""
    from asyncgrpo_cli.model import flex_backend as fb

    monkeypatch.setenv("ASYNCGRPO_CACHE", str(tmp_path))
    assert fb.check_stamp(torch.device("cpu"), 4, 2, 32) is None  # off CUDA: never remembered
    stamp = "torch 2.11.0, flash-attn-4 4.0.0b40, nvidia-cutlass-dsl 4.8.1, NVIDIA H100 sm90, heads 4/2/32"
    stamps, verdicts, runs = [stamp], [None], []
    monkeypatch.setattr(fb, "check_stamp", lambda *a: stamps[0])
    monkeypatch.setattr(fb, "_check", lambda *a: runs.append(a) or verdicts[0])
    fb._checked.clear()
    try:
        assert fb.flash_problem("cuda:0", 4, 2, 32) is None and len(runs) == 1
        assert fb.passed_before() == {stamp}
        fb._checked.clear()  # as a new process
        assert fb.flash_problem("cuda:0", 4, 2, 32) is None and len(runs) == 1  # remembered: not run
        stamps[0], verdicts[0] = stamp.replace("4.8.1", "4.9.0"), "CuteDSLError: no such kernel"
        for _ in range(2):  # another DSL version: checked, failed, not remembered, checked again
            fb._checked.clear()
            assert fb.flash_problem("cuda:0", 4, 2, 32) == "CuteDSLError: no such kernel"
        assert len(runs) == 3 and fb.passed_before() == {stamp}
        (tmp_path / fb.PASSES_FILE).write_text("not json")
        assert fb.passed_before() == set()
    finally:
        fb._checked.clear()


def test_the_loader_falls_back_to_triton_when_flash_fails_its_check(tiny_model_dir, monkeypatch, caplog):
    """model.flex_backend=auto where flash would run but fails its first-use check: one warning, Triton kernels."""
    import logging

    from asyncgrpo_cli.model import flex, flex_backend, loading

    monkeypatch.setattr(flex_backend, "flash_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flex_backend, "flash_problem", lambda *a: "CuteDSLError: no such kernel")
    stop = RuntimeError("stop after the kernels were chosen")

    def chosen(options, tuned_for=None, flash=False):
        assert flash is False and options == {}
        raise stop

    monkeypatch.setattr(flex, "set_kernel_options", chosen)
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="stop after"):
        loading.load_policy(
            str(tiny_model_dir), ModelConfig(name_or_path=str(tiny_model_dir)), torch.device("cuda")
        )
    assert "FlashAttention-4 failed its first-use check on cuda (CuteDSLError: no such kernel)" in caplog.text
