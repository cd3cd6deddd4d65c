"""The startup probe: does the generation server have every capability this run needs? Ask it, before training.

``read_server`` (``server/report.py``) asks the server what it can do; ``find_problems`` compares that report with
the config, on plain data: the general checks here, the sampling-mask ones in ``mask_support.py``, the LoRA ones in
``lora_support.py``. ``probe_server`` does both and raises one ``UserError`` listing every problem with its fix,
and, for a vLLM server, the exact ``vllm serve`` command that fixes them all. ``asyncgrpo check --probe-server`` and
``train`` (right after the server is up) run it.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import replace

from asyncgrpo_cli.config.schema import RootConfig, VllmLaunchConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.server.backends import backend_class
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.server.lora_support import lora_problems
from asyncgrpo_cli.server.mask_support import mask_problems, suggest_mask_flags
from asyncgrpo_cli.server.report import Problem, ServerReport, read_server
from asyncgrpo_cli.server.vllm_launch import CPU_SERVER_MODULE, LORA_ENV, extension_pythonpath, serve_flags
from asyncgrpo_cli.vllm_ext import EXTENSION_CLS

log = logging.getLogger(__name__)

PROCESSED = "processed_logprobs"


# -- comparing with the config ----------------------------------------------------------------------------------
def find_problems(report: ServerReport, cfg: RootConfig, prompt_tokens: int | None = None) -> list[Problem]:
    """Every capability the run needs that the server lacks. ``prompt_tokens``: the longest prompt, when known."""
    s, sv = cfg.sampling, cfg.server
    backend = backend_class(sv)
    launch = backend.passes_vllm_flags
    out: list[Problem] = []
    name = cfg.model.served_model_name
    if name and name not in report.model_ids:
        out.append(
            Problem(
                f"model.served_model_name={name!r} is not served (the server lists {report.model_ids})",
                ["--served-model-name", name],
            )
        )
    if not report.dev_routes:
        out.append(
            Problem(
                "the weight-update routes (/pause, /resume, /collective_rpc, /is_paused) do not exist: the server "
                "was started without VLLM_SERVER_DEV_MODE=1",
            )
        )
    if report.logprobs_mode is not None and report.logprobs_mode != PROCESSED:
        out.append(
            Problem(
                f"--logprobs-mode is {report.logprobs_mode}: the sampler's log-probs must be those of the "
                "distribution it sampled from",
                ["--logprobs-mode", PROCESSED],
            )
        )
    need_lp = s.num_sampler_logprobs
    if report.max_logprobs is not None and report.max_logprobs != -1 and report.max_logprobs < need_lp:
        out.append(
            Problem(
                f"--max-logprobs is {report.max_logprobs}, below sampling.num_sampler_logprobs={need_lp}",
                ["--max-logprobs", str(need_lp)],
                f"server.vllm_launch.max_logprobs={need_lp}" if launch else None,
            )
        )
    need_len = (prompt_tokens or 1) + s.max_completion_length
    if report.max_model_len is not None and report.max_model_len < need_len:
        prompt = f"the longest prompt ({prompt_tokens})" if prompt_tokens else "a prompt"
        out.append(
            Problem(
                f"max_model_len is {report.max_model_len}: too short for {prompt} plus "
                f"sampling.max_completion_length={s.max_completion_length}",
                ["--max-model-len", str(need_len)],
                backend.max_model_len_fix(need_len, s.max_completion_length),
            )
        )
    if report.is_cpu_vllm and s.seed_per_request:
        out.append(
            Problem(
                "sampling.seed_per_request=true: vLLM's CPU build kills its engine on per-request seeds under "
                "concurrent load ('CPU Generator does not use offset')",
                config_fix="sampling.seed_per_request=false",
            )
        )
    if report.is_cpu_vllm and sv.weight_sync == "disk" and not report.has_extension:
        out.append(
            Problem(
                "disk weight sync on vLLM's CPU build needs asyncgrpo's worker extension: plain reload_weights "
                "leaves a tied lm_head serving the old weights",
                ["--worker-extension-cls", EXTENSION_CLS],
            )
        )
    out += mask_problems(report, cfg)
    out += lora_problems(report, cfg)
    if sv.weight_sync == "nccl" and not report.embedded:
        if report.is_cpu_vllm:
            out.append(
                Problem(
                    "server.weight_sync=nccl cannot run on vLLM's CPU build",
                    config_fix="server.weight_sync=disk",
                )
            )
        elif report.dev_routes and report.device is not None and report.weight_transfer_backend != "nccl":
            out.append(
                Problem(
                    "server.weight_sync=nccl needs the server's NCCL weight-transfer engine",
                    ["--weight-transfer-config", '{"backend": "nccl"}'],
                )
            )
    if sv.weight_sync == "nccl" and report.embedded and report.weight_transfer_backend != "nccl":
        out.append(
            Problem(
                f"server.weight_sync=nccl needs the embedded server on a GPU; it runs on {report.device or 'cpu'}",
                config_fix="server.embedded.device=cuda:N (another GPU than the trainer's)",
            )
        )
    return out


def fix_command(report: ServerReport, cfg: RootConfig, model_path: str | None = None) -> str:
    """The ``vllm serve`` command line that gives the server every capability the run needs."""
    s = cfg.sampling
    need_len = max(report.max_model_len or 0, s.max_completion_length + 1)
    need_lp = -1 if report.max_logprobs == -1 else max(report.max_logprobs or 0, s.num_sampler_logprobs, 20)
    passes_flags = backend_class(cfg.server).passes_vllm_flags
    base = cfg.server.vllm_launch if passes_flags else VllmLaunchConfig()
    launch = replace(
        base,
        max_model_len=need_len,
        max_logprobs=need_lp,
        dtype=report.dtype or cfg.model.dtype,
        gpus=[] if report.is_cpu_vllm else base.gpus,
    )
    if cfg.server.weight_sync != "nccl" and not passes_flags:
        launch = replace(launch, weight_transfer_backend=None)
    name = cfg.model.served_model_name or (report.model_ids[0] if report.model_ids else None)
    model = report.model or model_path or cfg.model.name_or_path
    if name == model:
        name = None
    lora = cfg.server.weight_sync == "lora"
    if lora:  # the limits adapter sync needs (derived by config validation when left null)
        need = cfg.server.vllm_launch
        launch = replace(launch, max_lora_rank=need.max_lora_rank, max_loras=need.max_loras)
    flags = serve_flags(
        launch,
        served_model_name=name,
        cpu=report.is_cpu_vllm,
        sampling_mask=suggest_mask_flags(report, cfg),
        lora=lora,
    )
    env = f"VLLM_SERVER_DEV_MODE=1 PYTHONPATH={shlex.quote(str(extension_pythonpath()))}"
    if lora:
        env += "".join(f" {k}={v}" for k, v in LORA_ENV.items())
    if report.is_cpu_vllm:
        head = ["python", "-m", CPU_SERVER_MODULE, "--model", model]
    else:
        head = ["vllm", "serve", model]
    return f"{env} {shlex.join(head + flags)}"


def probe_server(
    control: ServerControl,
    cfg: RootConfig,
    *,
    model_path: str | None = None,
    prompt_tokens: int | None = None,
) -> ServerReport:
    """Check the server against the run's needs; raise one ``UserError`` naming every gap and the fix."""
    report = read_server(control)
    problems = find_problems(report, cfg, prompt_tokens)
    if not problems:
        log.info(
            "server probe OK: %s serves %s (vLLM %s, %s, max_model_len %s, max_logprobs %s, worker extension %s, "
            "sampling masks %s)",
            report.base_url,
            report.model_ids[0],
            report.version or "-",
            "embedded" if report.embedded else (report.device or "?"),
            report.max_model_len,
            report.max_logprobs,
            "yes" if report.has_extension else "no",
            "yes" if report.returns_sampling_mask else "no",
        )
        return report
    lines = [f"the generation server at {report.base_url} cannot run this config:"]
    for p in problems:
        fix = p.config_fix or (shlex.join(p.flags) if p.flags else None)
        lines.append(f"  - {p.what}" + (f" (fix: {fix})" if fix else ""))
    server_side = [p for p in problems if p.config_fix is None]
    if server_side and report.embedded:
        lines.append(
            "The embedded server is configured under server.embedded (asyncgrpo check --explain server)."
        )
    elif server_side and backend_class(cfg.server).passes_vllm_flags:
        lines.append(
            "server=vllm_launch passes these flags itself: server.vllm_launch.extra_args or env override one. "
            "A command that works:"
        )
        lines.append(f"  {fix_command(report, cfg, model_path)}")
    elif server_side:
        lines.append("Restart vLLM with (every fix applied):")
        lines.append(f"  {fix_command(report, cfg, model_path)}")
    raise UserError("\n".join(lines))
