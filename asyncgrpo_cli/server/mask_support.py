"""Sampling masks at startup: does the server return each token's candidate set, and does the run use them?

Truncated sampling (``sampling.top_k`` / ``top_p`` / ``min_p``) draws every token from a candidate set, and the
server's processed log-probs are normalized over it; the trainer renormalizes over the same set when the server
returns it (reference section j), otherwise every importance ratio is biased low by the surviving mass. A server
returns the sets when ``POST /inference/v1/generate`` is served (vLLM ``--enable-scale-out``) and it records them
(``--return-sampling-mask``, vLLM >= 0.28 on Model Runner V2, GPU only); the embedded server always does.

``sampling.sampling_mask`` decides what a gap means: ``required`` makes it a probe problem (the run does not
start), ``auto`` (default) warns once at startup and trains with biased ratios, ``off`` never asks.

vLLM with ``--return-sampling-mask`` also rejects every request it could not replay: temperature 0 or top_k 0
(``vllm/v1/engine/input_processor.py``); the weight-sync probe (``server.verify_sync``) sends temperature 1 and
top_k = the vocabulary size, which it accepts.
"""

from __future__ import annotations

import logging

from asyncgrpo_cli.config.schema import RootConfig
from asyncgrpo_cli.server.backends import backend_class
from asyncgrpo_cli.server.report import Problem, ServerReport
from asyncgrpo_cli.server.vllm_launch import SAMPLING_MASK_FLAGS

log = logging.getLogger(__name__)

MASK_FLAG, SCALE_OUT_FLAG = SAMPLING_MASK_FLAGS


def _wants_masks(cfg: RootConfig) -> bool:
    return cfg.sampling.truncates and cfg.sampling.sampling_mask != "off"


def mask_gaps(report: ServerReport, cfg: RootConfig) -> list[Problem]:
    """Why the server does not return sampling masks (empty when it does), each with its fix."""
    if report.returns_sampling_mask:
        return []
    if report.is_cpu_vllm:
        return [
            Problem(
                "vLLM's CPU build cannot return sampling masks (--return-sampling-mask needs Model Runner V2, "
                "which needs Triton on a GPU)",
                config_fix="server=embedded (it returns them on CPU), or sampling.sampling_mask=auto to train with "
                "biased ratios",
            )
        ]
    launch_fix = (
        f"server.vllm_launch.extra_args=[{MASK_FLAG},{SCALE_OUT_FLAG}]"
        if backend_class(cfg.server).passes_vllm_flags
        else None
    )
    gaps = []
    if report.generate_route == "missing":
        gaps.append(
            Problem(
                "the server has no POST /inference/v1/generate: sampling masks need vLLM >= 0.28",
                config_fix="upgrade vLLM",
            )
        )
    elif report.generate_route == "disabled":
        gaps.append(
            Problem(
                "POST /inference/v1/generate answers 403: the server was started without --enable-scale-out",
                [SCALE_OUT_FLAG],
                launch_fix,
            )
        )
    elif report.generate_route is None:
        gaps.append(
            Problem(
                "POST /inference/v1/generate answered neither as served nor as disabled", [SCALE_OUT_FLAG]
            )
        )
    if report.return_sampling_mask is not True:
        said = "does not say" if report.return_sampling_mask is None else "says no"
        gaps.append(
            Problem(
                f"the server {said} it records sampling masks (/server_info model_config.return_sampling_mask): "
                "start it with --return-sampling-mask (vLLM >= 0.28; set VLLM_USE_V2_MODEL_RUNNER=1 if it "
                "rejects the flag)",
                [MASK_FLAG],
                launch_fix,
            )
        )
    return gaps


def replay_constraints(cfg: RootConfig) -> list[Problem]:
    """What vLLM with --return-sampling-mask rejects in this config (every request must be replayable)."""
    s, out = cfg.sampling, []
    if s.temperature <= 0:
        out.append(
            Problem(
                "vLLM with --return-sampling-mask rejects greedy requests (sampling.temperature=0)",
                config_fix="sampling.temperature > 0, or restart the server without --return-sampling-mask",
            )
        )
    if s.top_k <= 0:
        out.append(
            Problem(
                "vLLM with --return-sampling-mask rejects requests without top_k > 0 (it bounds each candidate "
                "set by top_k; needed with top_p < 1 or min_p > 0 too)",
                config_fix=f"sampling.top_k=N, e.g. sampling.top_k={min(512, s.max_mask_candidates)}",
            )
        )
    return out


def mask_problems(report: ServerReport, cfg: RootConfig) -> list[Problem]:
    """The probe's sampling-mask problems: the gaps when masks are required, and requests a vLLM server that
    records masks (or is being told to) would reject."""
    out = []
    required = cfg.sampling.truncates and cfg.sampling.sampling_mask == "required"
    gaps = mask_gaps(report, cfg) if required else []
    for gap in gaps:
        gap.what = f"sampling.sampling_mask=required: {gap.what}"
    out += gaps
    if not report.embedded and (report.return_sampling_mask or (gaps and not report.is_cpu_vllm)):
        out += replay_constraints(cfg)
    return out


def suggest_mask_flags(report: ServerReport, cfg: RootConfig) -> bool:
    """Whether the probe's fix command should add --return-sampling-mask --enable-scale-out: masks are wanted and
    either required or compatible with the rest of the config."""
    if not _wants_masks(cfg) or report.is_cpu_vllm:
        return False
    return cfg.sampling.sampling_mask == "required" or not replay_constraints(cfg)


def resolve_sampling_mask(report: ServerReport, cfg: RootConfig) -> bool:
    """Whether the rollout requests candidate sets. When sampling truncates without them, warn (once: this runs
    once, at startup) that importance ratios are biased, naming the fix."""
    s = cfg.sampling
    if not s.truncates:
        return False
    if s.sampling_mask != "off" and report.returns_sampling_mask:
        log.info("sampling masks: each token's candidate set comes back; the trainer renormalizes over it")
        return True
    if s.sampling_mask == "off":
        why, fix = "sampling.sampling_mask=off", "set sampling.sampling_mask=auto"
    else:
        gaps = mask_gaps(report, cfg)
        why = "the server does not return sampling masks (" + "; ".join(g.what for g in gaps) + ")"
        flags = [f for g in gaps for f in g.flags]
        fix = f"restart vLLM with {' '.join(flags)}" if flags else (gaps[0].config_fix if gaps else "")
        needs = [p.config_fix for p in replay_constraints(cfg)]
        if flags and needs:
            fix += " (which then needs: " + "; ".join(str(n) for n in needs) + ")"
    log.warning(
        "sampling.top_p/top_k/min_p truncate the sampling distribution, but %s: the trainer normalizes its "
        "log-probs over the full vocabulary, so importance ratios are biased low by the surviving mass. Fix: %s.",
        why,
        fix,
    )
    return False
