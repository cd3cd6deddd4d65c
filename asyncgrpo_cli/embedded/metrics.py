"""Prometheus text for ``GET /metrics`` with vLLM's metric names and labels (``{engine="0",model_name=...}``)."""

from __future__ import annotations

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.embedded.engine import EngineStats


def _labels(pairs: dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs.items()) + "}"


def _family(
    lines: list[str], name: str, kind: str, doc: str, samples: list[tuple[dict[str, str], float]]
) -> None:
    lines.append(f"# HELP {name} {doc}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lines.append(f"{name}{_labels(labels)} {float(value)!r}")


def render_metrics(stats: EngineStats, model_name: str, cfg: EmbeddedServerConfig) -> str:
    base = {"engine": "0", "model_name": model_name}
    lines: list[str] = []
    gauges = [
        ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage),
    ]
    for name, doc, value in gauges:
        _family(lines, name, "gauge", doc, [(base, value)])
    counters = [
        (
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            stats.preemptions_total,
        ),
        ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", stats.prompt_tokens_total),
        (
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            stats.generation_tokens_total,
        ),
        (
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries (prompts looked up).",
            stats.prefix_cache_queries_total,
        ),
        ("vllm:prefix_cache_hits_total", "Prefix cache hits (prompts found).", stats.prefix_cache_hits_total),
    ]
    for name, doc, value in counters:
        _family(lines, name, "counter", doc, [(base, value)])
    _family(
        lines,
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        [({**base, "finished_reason": r}, n) for r, n in stats.request_success_total.items()],
    )
    info = {
        "block_size": "1",
        "cache_dtype": "auto",
        "enable_prefix_caching": str(cfg.prefix_cache_size > 0),
        "engine": "0",
        "kv_cache_max_concurrency": str(cfg.kv_cache_tokens / cfg.max_model_len),
        "kv_cache_size_tokens": str(cfg.kv_cache_tokens),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(cfg.kv_cache_tokens),
    }
    _family(
        lines, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [(info, 1.0)]
    )
    return "\n".join(lines) + "\n"
