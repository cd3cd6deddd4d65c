"""Adaptive concurrency (reference h.2): a live cap on rollouts in flight that follows the server's KV-cache load.

Three pieces, each testable alone:

- ``parse_prometheus`` / ``read_vllm_load``: vLLM's Prometheus text (``GET /metrics``, read with
  ``prometheus_client``'s parser) reduced to what the cap needs. Series carry ``{engine="0", model_name=...}``
  labels; with several engines KV usage is the max, running / waiting requests and the preemption counter are
  summed. The KV-cache size is the
  ``kv_cache_size_tokens`` label of ``vllm:cache_config_info`` (max across engines), else
  ``num_gpu_blocks * block_size``.
- ``ConcurrencyController``: a pure state machine on plain numbers. Initial cap = KV-cache tokens //
  ``max_model_len``; ``observe(usage, waiting)`` shrinks the cap by 30 % above 80 % usage and grows it by 25 %
  below 60 % usage when nothing waits, at most once per cap-many finished rollouts (``on_rollout_finished``);
  the cap stays in ``[1, max_concurrent_rollouts]``. Without ``/metrics`` (a 4xx such as 404, or a page that is
  not vLLM's), the cap is ``max_concurrent_rollouts``.
- ``MetricsPoller``: the async side. Polls ``/metrics`` every ``metrics_poll_interval_s`` with a timeout, feeds
  the controller and records ``rollout/vllm_*``. It never raises into the rollout loop: a failed poll keeps the
  last cap and is counted (``rollout/vllm_metrics_poll_failure_count``).

Rounding (the reference leaves it open): growth is ``max(cap + 1, cap * 5 // 4)``, shrinking ``cap * 7 // 10``,
in integers, so a cap of 1 can still grow and no float error moves a boundary.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from asyncgrpo_cli.metrics.reducer import MetricWindow

log = logging.getLogger(__name__)

GROW_BELOW = 0.60
SHRINK_ABOVE = 0.80

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"  # vLLM < 0.10 (V0 engine)
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_INFO = "vllm:cache_config_info"


# -- Prometheus text ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromSample:
    """One sample line: ``name{labels} value``."""

    name: str
    labels: dict[str, str]
    value: float


_MALFORMED = (ValueError, IndexError)  # what the parser raises on a malformed line (IndexError: rarely)


def _samples(text: str) -> list[PromSample]:
    return [
        PromSample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def parse_prometheus(text: str) -> list[PromSample]:
    """Samples of a Prometheus text exposition (format 0.0.4), read by ``prometheus_client``'s parser.

    The library rejects a whole page for one malformed line; then the page is read line by line and the
    malformed lines are skipped (the rest of the page still counts).
    """
    try:
        return _samples(text)
    except _MALFORMED:
        pass
    out: list[PromSample] = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                out += _samples(line + "\n")
            except _MALFORMED:
                continue
    return out


class MetricsFormatError(ValueError):
    """The page is not vLLM's ``/metrics`` (no KV-cache usage series)."""


@dataclass(frozen=True)
class VllmLoad:
    """Server load at one poll, reduced across engines."""

    kv_usage: float
    """KV-cache usage in [0, 1], max across engines."""
    running: float
    """Requests being decoded, summed across engines."""
    waiting: float
    """Requests accepted but not scheduled, summed across engines."""
    preemptions_total: float
    """Cumulative preemptions, summed across engines (0 when the series is absent)."""
    kv_cache_tokens: int | None
    """KV-cache capacity in tokens (max across engines), None when ``vllm:cache_config_info`` does not say."""
    num_engines: int


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        value = int(float(labels[key]))
    except (KeyError, ValueError, OverflowError):
        return None
    return value if value > 0 else None


def cache_tokens(labels: dict[str, str]) -> int | None:
    """KV-cache tokens from one ``vllm:cache_config_info`` series: ``kv_cache_size_tokens``, else blocks x size."""
    tokens = _int_label(labels, "kv_cache_size_tokens")
    if tokens is not None:
        return tokens
    blocks, size = _int_label(labels, "num_gpu_blocks"), _int_label(labels, "block_size")
    return blocks * size if blocks is not None and size is not None else None


def read_vllm_load(text: str) -> VllmLoad:
    """Reduce a vLLM ``/metrics`` page; raises ``MetricsFormatError`` when it has no KV-cache usage series."""
    usage: list[float] = []
    legacy_usage: list[float] = []
    running = waiting = preemptions = 0.0
    capacity: list[int] = []
    engines: set[str] = set()
    for s in parse_prometheus(text):
        if s.name == KV_USAGE:
            usage.append(s.value)
            engines.add(s.labels.get("engine", ""))
        elif s.name == KV_USAGE_LEGACY:
            legacy_usage.append(s.value)
        elif s.name == RUNNING:
            running += s.value
        elif s.name == WAITING:
            waiting += s.value
        elif s.name == PREEMPTIONS:
            preemptions += s.value
        elif s.name == CACHE_INFO:
            tokens = cache_tokens(s.labels)
            if tokens is not None:
                capacity.append(tokens)
    usage = usage or legacy_usage
    if not usage:
        raise MetricsFormatError(f"no {KV_USAGE} series: not a vLLM /metrics page")
    return VllmLoad(
        kv_usage=max(usage),
        running=running,
        waiting=waiting,
        preemptions_total=preemptions,
        kv_cache_tokens=max(capacity) if capacity else None,
        num_engines=max(1, len(engines)),
    )


# -- the state machine ----------------------------------------------------------------------------------------
class ConcurrencyController:
    """The adaptive cap on rollouts in flight, on plain data (no I/O, no clock).

    ``cap`` is always in ``[1, max_concurrent]``. Until ``initialize`` or ``fallback`` is called it is
    ``max_concurrent``; with ``adaptive=False`` it stays ``max_concurrent`` whatever is observed.
    """

    def __init__(self, max_concurrent: int, adaptive: bool = True):
        if max_concurrent < 1:
            raise ValueError(f"rollout.max_concurrent_rollouts must be >= 1, got {max_concurrent}")
        self.max_concurrent = int(max_concurrent)
        self.adaptive = adaptive
        self.mode = "unknown"
        """``unknown`` (no poll answered yet), ``adaptive`` (following /metrics) or ``fallback`` (no /metrics)."""
        self._cap = self.max_concurrent
        self.completed_since_raise = 0

    @property
    def cap(self) -> int:
        return self._cap if self.adaptive else self.max_concurrent

    def _clamp(self, value: int) -> int:
        return max(1, min(self.max_concurrent, int(value)))

    def initialize(self, kv_cache_tokens: int | None, max_model_len: int) -> None:
        """Start from the number of maximum-length requests the KV cache holds (``max_concurrent`` if unknown)."""
        self.mode = "adaptive"
        if kv_cache_tokens and max_model_len > 0:
            self._cap = self._clamp(kv_cache_tokens // max_model_len)
        else:
            self._cap = self.max_concurrent
        self.completed_since_raise = 0

    def fallback(self) -> None:
        """The server has no usable ``/metrics``: the cap is ``max_concurrent`` from now on."""
        self.mode = "fallback"
        self._cap = self.max_concurrent

    def on_rollout_finished(self, count: int = 1) -> None:
        self.completed_since_raise += count

    def observe(self, kv_usage: float, waiting: float) -> str:
        """Apply one poll; returns ``"shrink"``, ``"grow"`` or ``"hold"``."""
        if self.mode != "adaptive":
            return "hold"
        if kv_usage > SHRINK_ABOVE:
            self._cap = self._clamp(self._cap * 7 // 10)
            return "shrink"
        if kv_usage < GROW_BELOW and waiting <= 0 and self.completed_since_raise >= self._cap:
            if self._cap >= self.max_concurrent:
                return "hold"
            self._cap = self._clamp(max(self._cap + 1, self._cap * 5 // 4))
            self.completed_since_raise = 0
            return "grow"
        return "hold"


# -- the async poller -----------------------------------------------------------------------------------------
class MetricsPoller:
    """Polls ``GET /metrics``, drives a ``ConcurrencyController`` and records the ``rollout/vllm_*`` metrics.

    Create it on the loop that runs it; ``start()`` polls once (so the initial cap is known before the first
    group starts) and then keeps polling in a task until ``close()``.
    """

    def __init__(
        self,
        base_url: str,
        controller: ConcurrencyController,
        metrics: MetricWindow,
        max_model_len: int,
        interval_s: float = 5.0,
        timeout_s: float | None = None,
    ):
        if not interval_s > 0:
            raise ValueError(f"rollout.metrics_poll_interval_s must be > 0, got {interval_s}")
        self.base_url = base_url.rstrip("/")
        self.controller = controller
        self.metrics = metrics
        self.max_model_len = int(max_model_len)
        self.interval_s = float(interval_s)
        timeout = timeout_s if timeout_s is not None else min(10.0, max(1.0, self.interval_s))
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout)
        self._task: asyncio.Task | None = None
        self._last_preemptions: float | None = None
        self.polls = 0
        self.failures = 0
        self.last_error: str | None = None

    async def start(self) -> None:
        await self.poll_once()
        if self.controller.mode != "fallback":
            self._task = asyncio.create_task(self._run(), name="metrics-poller")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self._http.aclose()

    async def _run(self) -> None:
        while self.controller.mode != "fallback":
            await asyncio.sleep(self.interval_s)
            await self.poll_once()

    async def poll_once(self) -> str:
        """One poll; returns ``"ok"``, ``"failed"`` or ``"fallback"``. Never raises (cancellation aside)."""
        try:
            return self._apply(await self._http.get("/metrics"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a poll must never take the rollout loop down
            return self._failed(f"{type(e).__name__}: {e}")

    def _apply(self, resp: httpx.Response) -> str:
        if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):  # 404: no such route
            return self._fallback(f"GET {self.base_url}/metrics answered HTTP {resp.status_code}")
        if resp.status_code != 200:
            return self._failed(f"HTTP {resp.status_code}")
        try:
            load = read_vllm_load(resp.text)
        except MetricsFormatError as e:
            return self._fallback(f"GET {self.base_url}/metrics: {e}")
        if self.controller.mode != "adaptive":
            self.controller.initialize(load.kv_cache_tokens, self.max_model_len)
            log.info(
                "adaptive concurrency: KV cache %s tokens / max_model_len %d -> initial cap %d",
                load.kv_cache_tokens,
                self.max_model_len,
                self.controller.cap,
            )
        self.controller.observe(load.kv_usage, load.waiting)
        self._record(load)
        self.polls += 1
        return "ok"

    def _record(self, load: VllmLoad) -> None:
        m = self.metrics
        m.add("rollout/vllm_kv_cache_usage_frac", load.kv_usage)
        m.add("rollout/vllm_running_requests", load.running)
        m.add("rollout/vllm_queued_requests", load.waiting)
        last, self._last_preemptions = self._last_preemptions, load.preemptions_total
        if last is not None:
            # A counter that went down was reset (server restart): everything since the reset is new.
            delta = (
                load.preemptions_total - last if load.preemptions_total >= last else load.preemptions_total
            )
            m.add("rollout/vllm_preemption_count", delta)

    def _failed(self, err: str) -> str:
        self.failures += 1
        self.last_error = err
        self.metrics.add("rollout/vllm_metrics_poll_failure_count", 1)
        log.debug("GET %s/metrics failed (%s); keeping cap %d", self.base_url, err, self.controller.cap)
        return "failed"

    def _fallback(self, why: str) -> str:
        log.warning(
            "%s: adaptive concurrency is off, the cap is rollout.max_concurrent_rollouts=%d",
            why,
            self.controller.max_concurrent,
        )
        self.controller.fallback()
        self.last_error = why
        return "fallback"
