"""Tiny randomly initialised models with a locally trained byte-level BPE tokenizer, built offline and cached.

- ``tiny-qwen3``: a Qwen3 (hidden 128, 2 layers); tests and ``+recipe=tiny`` use it.
- ``tiny-qwen3.5``: a Qwen3.5-style hybrid (``Qwen3_5ForCausalLM``): gated-DeltaNet (linear attention) layers and
  full-attention layers, 3:1 as in the released models (``model=tiny_hybrid``).
- ``tiny-qwen3-moe``: a Qwen3-MoE (8 experts, top 2, router aux-loss coefficient 0.01; ``model=tiny_moe``).

head_dim is 32 (vLLM's CPU attention supports 32/64/...), vocab 1024, tied embeddings, ChatML chat template.
"""

from __future__ import annotations

import random
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the a one two three four five six seven eight nine ten plus minus times add sum of what is how many "
    "apples pears has gives takes left total answer boxed think user assistant system number result please "
    "count letters word repeat say hello world yes no and then from to with each more less equal"
).split()


def _corpus(n: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        nums = [str(rng.randint(0, 999)) for _ in range(rng.randint(0, 3))]
        toks = words + nums
        rng.shuffle(toks)
        lines.append(" ".join(toks) + rng.choice([".", "?", "!", ""]))
    return lines


def build_tiny_tokenizer(vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        padding_side="left",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_qwen3(dest: Path, *, seed: int = 0, hidden_size: int = 128, num_layers: int = 2) -> Path:
    """Write a tiny Qwen3 model + tokenizer to ``dest`` (a normal save_pretrained directory)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer()
    vocab = len(tokenizer)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    return _save(Qwen3ForCausalLM(config), tokenizer, dest)


def build_tiny_qwen3_teacher(dest: Path) -> Path:
    """The tiny Qwen3 with other random weights (seed 1) and the same tokenizer: a teacher that disagrees with
    ``tiny-qwen3`` for distillation tests and the ``distill_tiny`` recipe."""
    return build_tiny_qwen3(dest, seed=1)


def _save(model, tokenizer, dest: Path) -> Path:
    from transformers import GenerationConfig

    config = model.config
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=True
    )
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def _special_ids(tokenizer) -> dict:
    return {
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "bos_token_id": None,
    }


HYBRID_LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")


def build_tiny_qwen3_5(dest: Path, *, seed: int = 0, hidden_size: int = 128) -> Path:
    """Write a tiny Qwen3.5 hybrid (3 gated-DeltaNet layers then 1 attention layer) + tokenizer to ``dest``.

    The DeltaNet layers have 2 key heads and 4 value heads (grouped value heads, as the larger Qwen3.5 models' 16 / 32) of dim
    64 and the short convolution of the released models (kernel 4); attention has 4 query / 2 KV heads of dim 32
    with the output gate and partial rotary embedding of the family.
    """
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    tokenizer = build_tiny_tokenizer()
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=len(HYBRID_LAYER_TYPES),
        layer_types=list(HYBRID_LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,  # vLLM's CPU gated-DeltaNet kernels take 64 or 128, equal for keys and values
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        **_special_ids(tokenizer),
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)
    with (
        torch.no_grad()
    ):  # slow decays (A in [0.005, 0.05]): the state carries tens of tokens, so a state that
        for layer in (
            model.model.layers
        ):  # leaks across samples or branches shows in tests (the init forgets in a few)
            if (deltanet := getattr(layer, "linear_attn", None)) is not None:
                deltanet.A_log.copy_(torch.empty(deltanet.A_log.shape).uniform_(0.005, 0.05).log())
    return _save(model, tokenizer, dest)


def build_tiny_qwen3_moe(dest: Path, *, seed: int = 0, hidden_size: int = 128) -> Path:
    """Write a tiny Qwen3-MoE (2 layers, 8 experts of width 64, top 2, router aux-loss coefficient 0.01)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        **_special_ids(tokenizer),
    )
    torch.manual_seed(seed)
    return _save(Qwen3MoeForCausalLM(config), tokenizer, dest)
