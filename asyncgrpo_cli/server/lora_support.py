"""The startup probe's LoRA checks: what ``server.weight_sync=lora`` needs of the server.

The adapter policy itself (names, kept versions, servable ranks) is ``sync/lora_policy.py``.
"""

from __future__ import annotations

from asyncgrpo_cli.config.schema import RootConfig
from asyncgrpo_cli.server.backends import backend_class
from asyncgrpo_cli.server.report import Problem, ServerReport
from asyncgrpo_cli.sync.lora_policy import kept_versions, served_rank


def lora_problems(report: ServerReport, cfg: RootConfig) -> list[Problem]:
    """The startup probe's LoRA checks (run by ``server.probe.find_problems``): what adapter sync needs of the server.

    A rank above the server's ``--max-lora-rank`` is not among them: the adapter is then not servable and merged
    weights are pushed (``decide``), with the fix in the warning.
    """
    sv = cfg.server
    if sv.weight_sync != "lora" or not cfg.model.lora.enabled:
        return []
    launch_fix = backend_class(sv).passes_vllm_flags
    keep = kept_versions(cfg.rollout.max_staleness)
    rank = served_rank(cfg.model.lora.r)
    out = []
    lora = report.lora
    if lora is None or not lora.enabled:
        out.append(
            Problem(
                "server.weight_sync=lora: the server serves no LoRA adapters (started without --enable-lora)",
                ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(keep)],
                "server.embedded.enable_lora=true" if report.embedded else None,
            )
        )
    elif lora.max_loras is not None and lora.max_loras < keep:
        out.append(
            Problem(
                f"--max-loras is {lora.max_loras}: server.weight_sync=lora keeps rollout.max_staleness + 2 = {keep} "
                "adapter versions loaded",
                ["--max-loras", str(keep)],
                f"server.vllm_launch.max_loras={keep}" if launch_fix else None,
            )
        )
    if report.lora_loading is False and not report.embedded:
        out.append(
            Problem(
                "/v1/load_lora_adapter does not exist: start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                "(server.weight_sync=lora loads each version at runtime)",
            )
        )
    if report.api_server_count is not None and report.api_server_count > 1:
        out.append(
            Problem(
                f"--api-server-count is {report.api_server_count}: runtime LoRA loading "
                "(VLLM_ALLOW_RUNTIME_LORA_UPDATING) needs a single API server",
                ["--api-server-count", "1"],
            )
        )
    return out
