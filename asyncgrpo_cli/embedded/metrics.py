"""``GET /metrics`` with vLLM's metric names and labels (``{engine="0",model_name=...}``), rendered by
``prometheus_client`` (the library vLLM itself exposes its metrics with).

``EngineCollector`` reads the engine's counters at scrape time (a custom collector, so nothing is copied into
``Counter`` objects between scrapes); each app owns a ``CollectorRegistry`` holding one (``metrics_registry``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.embedded.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text format ``generate_latest`` writes (vLLM's ``/metrics`` answers the same)."""

LABELS = ["engine", "model_name"]


class EngineCollector:
    """vLLM's gauges and counters from ``stats()`` (an ``EngineStats``), read at each scrape."""

    def __init__(
        self, stats: Callable[[], EngineStats], model_name: Callable[[], str], cfg: EmbeddedServerConfig
    ):
        self.stats = stats
        self.model_name = model_name
        self.cfg = cfg

    def collect(self) -> Iterator[Metric]:
        stats, base = self.stats(), ["0", self.model_name()]
        gauges = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(base, value)
            yield family
        counters = [
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                stats.preemptions_total,
            ),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens_total),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                stats.generation_tokens_total,
            ),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries (prompts looked up).",
                stats.prefix_cache_queries_total,
            ),
            ("vllm:prefix_cache_hits", "Prefix cache hits (prompts found).", stats.prefix_cache_hits_total),
        ]
        for name, doc, value in counters:  # exposed as NAME_total
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(base, value)
            yield family
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )
        for reason, n in stats.request_success_total.items():
            success.add_metric([*base, reason], n)
        yield success
        yield self._cache_info()

    def _cache_info(self) -> GaugeMetricFamily:
        cfg = self.cfg
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
        family = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        family.add_metric(list(info.values()), 1.0)
        return family


def metrics_registry(
    stats: Callable[[], EngineStats], model_name: Callable[[], str], cfg: EmbeddedServerConfig
) -> CollectorRegistry:
    """A registry of its own (not the process-global one) holding an ``EngineCollector``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats, model_name, cfg))
    return registry


def render(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def render_metrics(stats: EngineStats, model_name: str, cfg: EmbeddedServerConfig) -> str:
    """The ``/metrics`` page of one ``EngineStats`` snapshot."""
    return render(metrics_registry(lambda: stats, lambda: model_name, cfg))
