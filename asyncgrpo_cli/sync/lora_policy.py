"""The rules of LoRA weight sync, on plain data (no torch): names, retention and the adapter-or-merged decision. The
limits, the retention count and the config checks are ``config/lora.py`` (``config/`` imports nothing from here).

- **Names.** Version ``N`` is served as ``policy-vN``. A new name per version gives the server a fresh prefix-cache
  namespace (vLLM keys its prefix cache on the adapter name), so no cache reset and no pause is needed.
- **Retention.** ``max_staleness + 2`` versions stay loaded: every version a trainable sample can come from
  (``max_staleness + 1``) plus one, so a group that read the version counter just before a sync finishes under
  the policy it started with. Older versions are unloaded; their directories are deleted one sync later, because
  a server resolves an adapter's path lazily.
- **Decision** (``decide``, prior art: TRL ``select_adapter_sync``): the adapter is pushed when the server can
  serve it; otherwise merged full weights go through the disk path (the fallback). Not servable: DoRA,
  ``modules_to_save``, trained biases, targets outside the server's ``--lora-target-modules``, a rank above its
  ``--max-lora-rank``, or several data-parallel replicas (an adapter load reaches one of them only). Too small a
  ``--max-loras`` for the retention is an error with the fix: adapter sync would thrash, not fail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.config.lora import (
    NAME_TEMPLATE,
    AdapterSpec,
    int_or_none,
    kept_versions,
    served_rank,
    unservable_reasons,
)
from asyncgrpo_cli.errors import UserError

_NAME = re.compile(r"^policy-v\d+$")
PACKED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
"""vLLM serves these projections fused; its ``--lora-target-modules`` may name either form."""


def adapter_name(version: int) -> str:
    return NAME_TEMPLATE.format(version=version)


def is_adapter_name(name: str) -> bool:
    """A name this backend gives adapters (``policy-vN``): a leftover of an earlier run on a reused server."""
    return bool(_NAME.match(name))


@dataclass(frozen=True)
class ServerLora:
    """The server's LoRA serving settings, from ``/server_info`` (``lora_config``, ``parallel_config``)."""

    enabled: bool
    max_lora_rank: int | None = None
    max_loras: int | None = None
    target_modules: tuple[str, ...] | None = None
    data_parallel_size: int = 1

    @classmethod
    def from_vllm_config(cls, config: dict[str, Any]) -> ServerLora:
        lora = config.get("lora_config")
        parallel = config.get("parallel_config") if isinstance(config.get("parallel_config"), dict) else {}
        dp = int(parallel.get("data_parallel_size") or 1)
        if not isinstance(lora, dict):
            return cls(enabled=False, data_parallel_size=dp)
        targets = lora.get("target_modules")
        return cls(
            enabled=True,
            max_lora_rank=int_or_none(lora.get("max_lora_rank")),
            max_loras=int_or_none(lora.get("max_loras")),
            target_modules=tuple(targets) if targets else None,
            data_parallel_size=dp,
        )


@dataclass(frozen=True)
class SyncDecision:
    mode: str
    """``adapter`` or ``merged``."""
    reason: str = ""
    """Why merged weights are pushed (empty for ``adapter``)."""

    @property
    def adapter(self) -> bool:
        return self.mode == "adapter"


def _outside(targets: frozenset[str], allowed: tuple[str, ...]) -> list[str]:
    allowed_set = set(allowed)
    return sorted(t for t in targets if t not in allowed_set and PACKED.get(t) not in allowed_set)


def decide(server: ServerLora, spec: AdapterSpec, max_staleness: int) -> SyncDecision:
    """Push the adapter, or merged weights (with the reason); raise when adapter sync would thrash the server."""
    reasons = unservable_reasons(spec)
    if not server.enabled:
        reasons.append("the server serves no LoRA adapters (restart it with --enable-lora)")
    if server.data_parallel_size > 1:
        reasons.append(
            f"the server runs {server.data_parallel_size} data-parallel replicas (an adapter load "
            "reaches one of them only)"
        )
    if server.enabled and server.max_lora_rank is not None and spec.rank > server.max_lora_rank:
        reasons.append(
            f"model.lora.r ({spec.rank}) is above the server's --max-lora-rank "
            f"({server.max_lora_rank}; restart it with --max-lora-rank {served_rank(spec.rank)})"
        )
    if server.enabled and server.target_modules:
        outside = _outside(spec.targets, server.target_modules)
        if outside:
            reasons.append(
                f"the server's --lora-target-modules {list(server.target_modules)} leave out {outside}"
            )
    if reasons:
        return SyncDecision("merged", "; ".join(reasons))
    need = kept_versions(max_staleness)
    if server.max_loras is not None and server.max_loras < need:
        raise UserError(
            f"server.weight_sync=lora keeps rollout.max_staleness + 2 = {need} adapter versions loaded, but the "
            f"server's --max-loras is {server.max_loras}: restart it with --max-loras {need} (or lower "
            "rollout.max_staleness)."
        )
    return SyncDecision("adapter")
