"""Choice fields: config strings whose valid values are a fixed set, declared once on the schema's type.

OmegaConf 2.3 rejects ``Literal`` in a structured config ("Unexpected type annotation: Literal[...]"), so a choice
field is typed ``Annotated[str, Literal[...]]``. OmegaConf and Hydra read the schema through
``typing.get_type_hints``, which drops ``Annotated``'s extras, and see ``str``; validation (``config/checks.py``)
and ``asyncgrpo check --explain`` read the ``Literal``, so the allowed values are written in one place. A string
among the extras says why the set is what it is (it ends the error message). Example::

    sampling_mask: SamplingMask = F("auto", "...")   # sampling.sampling_mask=always is rejected:
    # sampling.sampling_mask ('always') must be one of auto, required, off.

Plugin names (loss, packer, server backend, weight sync, dataset, rollout loop, rewards) are not choices: the
registry resolves them and users extend them with ``module:object``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

Dtype = Annotated[str, Literal["auto", "bfloat16", "float16", "float32"]]
ServeDtype = Annotated[str, Literal["float32", "bfloat16", "float16"]]
AttnImplementation = Annotated[
    str,
    Literal["auto", "sdpa", "eager", "flex_attention"],
    "transformers' flash_attention kernels would ignore a packed row's attention mask; FlashAttention-4 runs "
    "under flex attention: model.flex_backend",
]
FlexBackend = Annotated[str, Literal["auto", "triton", "flash"]]
LinearAttentionKernel = Annotated[str, Literal["auto", "torch", "fla"]]
LmHeadKernel = Annotated[str, Literal["auto", "torch", "triton"]]
LoraBias = Annotated[str, Literal["none", "all", "lora_only"]]
SamplingMask = Annotated[str, Literal["auto", "required", "off"]]
LrSchedulerType = Annotated[str, Literal["constant", "constant_with_warmup", "linear", "cosine"]]
TrainDevice = Annotated[str, Literal["auto", "cpu", "cuda"]]
OneRankCast = Annotated[str, Literal["foreach", "torch"]]
MixedPrecision = Annotated[
    str, Literal["bfloat16"], "float16 would need loss scaling, which the trainer does not do"
]
ConsoleMode = Annotated[str, Literal["live", "plain", "auto"]]
SinkName = Annotated[str, Literal["console", "jsonl", "trackio"]]
ToolCallFormat = Annotated[str, Literal["hermes"]]
SamplingMismatch = Annotated[str, Literal["reject", "ignore"]]
TrainCompile = Annotated[Any, Literal["auto", True, False], "auto compiles on CUDA, not on CPU"]
"""``trainer.compile``: typed ``Any`` so YAML / Hydra booleans stay booleans next to the string ``auto``."""
Algorithm = Annotated[
    str, Literal["grpo", "distill"], "grpo runs under `asyncgrpo train`, distill under `asyncgrpo distill`"
]


@dataclasses.dataclass(frozen=True)
class Choice:
    """The values a field accepts (``optional``: null too; ``each``: a list whose items are choices)."""

    values: tuple[Any, ...]
    """Strings, or booleans (``trainer.compile``: auto, true, false)."""
    why: str = ""
    optional: bool = False
    each: bool = False

    def names(self) -> list[str]:
        return [_name(v) for v in self.values] + (["null"] if self.optional else [])

    def allowed(self) -> str:
        names = self.names()
        return f"{names[0]} or {names[1]}" if len(names) == 2 else f"one of {', '.join(names)}"

    def error(self, path: str, value: Any) -> str | None:
        """The message for a value outside the set (None when it is allowed), with a "did you mean" hint.

        Types must match too: 1 is not true, and the string 'true' is not the boolean true."""
        if any(type(value) is type(v) and value == v for v in self.values) or (
            value is None and self.optional
        ):
            return None
        why = f" ({self.why})" if self.why else ""
        if isinstance(value, str) and value.lower() in {
            _name(v) for v in self.values if not isinstance(v, str)
        }:
            return f"{path} ({value!r}) must be {self.allowed()}{why}; write {path}={value.lower()} unquoted."
        strings = [v for v in self.values if isinstance(v, str)]
        close = difflib.get_close_matches(str(value), strings, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        return f"{path} ({value!r}) must be {self.allowed()}{why}{hint}"

    def explain(self) -> str:
        return ("each: " if self.each else "") + ", ".join(self.names())


def _name(value: Any) -> str:
    """A choice as a user writes it: booleans as YAML spells them."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _strip_optional(tp: Any) -> tuple[bool, Any]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return len(args) < len(get_args(tp)), args[0]
    return False, tp


def choice_of(tp: Any) -> Choice | None:
    """The choice an annotation declares (through ``X | None`` and ``list[X]``), or None."""
    optional, tp = _strip_optional(tp)
    each = get_origin(tp) is list and len(get_args(tp)) == 1
    if each:
        tp = get_args(tp)[0]
    if get_origin(tp) is not Annotated:
        return None
    _, *extras = get_args(tp)
    literal = next((e for e in extras if get_origin(e) is Literal), None)
    if literal is None:
        return None
    why = next((e for e in extras if isinstance(e, str)), "")
    return Choice(tuple(get_args(literal)), why, optional and not each, each)


def field_choices(cls: type) -> dict[str, Choice]:
    """Field name -> choice, for the fields of a schema dataclass that have one."""
    hints = get_type_hints(cls, include_extras=True)
    found = {f.name: choice_of(hints[f.name]) for f in dataclasses.fields(cls)}
    return {name: c for name, c in found.items() if c is not None}


def choice_errors(obj: Any, path: str) -> list[str]:
    """Every choice field of ``obj`` (and its nested configs) holding a value outside its set.

    A nested config whose ``enabled`` is false is skipped: the settings of a feature that is off are not read.
    """
    errors: list[str] = []
    for name, choice in field_choices(type(obj)).items():
        value = getattr(obj, name)
        items = enumerate(value) if choice.each else [(None, value)]
        for i, item in items:
            msg = choice.error(f"{path}.{name}" + ("" if i is None else f"[{i}]"), item)
            if msg:
                errors.append(msg)
    for f in dataclasses.fields(obj):
        sub = getattr(obj, f.name)
        if dataclasses.is_dataclass(sub) and getattr(sub, "enabled", True) is not False:
            errors += choice_errors(sub, f"{path}.{f.name}")
    return errors
