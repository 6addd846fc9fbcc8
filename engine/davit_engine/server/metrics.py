"""Prometheus metrics, named as the upstream engine names them so its dashboards work unchanged.

Request-level series (token counts, latencies, finished requests) are observed here in the API
process, where requests start and end. Engine-level series (running/waiting requests, KV-cache
usage, prefix-cache counters, preemptions) are read from the core's `EngineStats` at scrape time.
`vllm:prefix_cache_*` count the GPU prefix cache alone; the KV offload tiers below it have their
own `vllm:kv_offload_*` series, labelled by tier ("cpu", "disk").
Each app gets its own registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from davit_engine.types import KV_TIER_LOAD_BUCKETS, EngineStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass(frozen=True)
class CacheConfig:
    """The KV-cache settings `vllm:cache_config_info` reports (the Gateway API Inference
    Extension's endpoint pickers read block_size and num_gpu_blocks from it)."""

    block_size: int
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True


class _EngineStatsCollector(Collector):
    """Exposes the latest `EngineStats` the server fetched from the core."""

    def __init__(self, model_name: str, cache_config: CacheConfig | None) -> None:
        self.model_name = model_name
        self.cache_config = cache_config
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats or EngineStats()
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge(
            "vllm:num_requests_running", "Requests in the running batch.", stats.num_running
        )
        yield gauge("vllm:num_requests_waiting", "Requests waiting to run.", stats.num_waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0-1).",
            stats.kv_cache_usage,
        )
        if self.cache_config is not None:
            yield _cache_config_info(self.cache_config, stats)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits,
        )
        yield counter(
            "vllm:num_preemptions",
            "Requests preempted for lack of KV blocks.",
            stats.num_preemptions,
        )
        if stats.spec_verification:
            yield from _spec_decode_metrics(self.model_name, stats)
        if stats.kv_offload:
            yield gauge(
                "vllm:num_requests_loading",
                "Requests waiting for their prompt prefix from a KV offload tier.",
                stats.num_loading,
            )
            yield from _kv_offload_metrics(self.model_name, stats)


def _cache_config_info(config: CacheConfig, stats: EngineStats) -> Metric:
    """An info gauge (always 1) whose labels carry the cache settings, as upstream's does;
    num_gpu_blocks is 0 until the model is loaded."""
    labels = {
        "block_size": str(config.block_size),
        "num_gpu_blocks": str(stats.num_total_blocks),
        "cache_dtype": config.cache_dtype,
        "enable_prefix_caching": str(config.enable_prefix_caching),
    }
    family = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the KV-cache configuration.", labels=list(labels)
    )
    family.add_metric(list(labels.values()), 1)
    return family


def _kv_offload_metrics(model_name: str, stats: EngineStats) -> Iterator[Metric]:
    """The KV offload tiers' series, one per tier ("cpu", "disk"); the byte and time counters
    carry upstream's names (`vllm:kv_offload_load_bytes`, ...) with a tier label."""
    labels = ["model_name", "tier"]
    tiers = stats.kv_offload
    for name, doc, kind, field_name in (
        (
            "vllm:kv_offload_hits",
            "Prompt tokens found in the tier past the GPU cache.",
            "c",
            "hits",
        ),
        (
            "vllm:kv_offload_misses",
            "Prompt tokens looked up in the tier and not found.",
            "c",
            "misses",
        ),
        (
            "vllm:kv_offload_load_bytes",
            "Bytes loaded from the tier into the GPU cache.",
            "c",
            "load_bytes",
        ),
        ("vllm:kv_offload_store_bytes", "Bytes stored into the tier.", "c", "store_bytes"),
        (
            "vllm:kv_offload_load_time",
            "Seconds spent loading from the tier (sum).",
            "c",
            "load_seconds",
        ),
        (
            "vllm:kv_offload_dropped_stores",
            "Blocks the tier did not store (no room).",
            "c",
            "dropped_stores",
        ),
        ("vllm:kv_offload_usage_bytes", "Bytes the tier holds.", "g", "used_bytes"),
        ("vllm:kv_offload_capacity_bytes", "Bytes the tier may hold.", "g", "capacity_bytes"),
    ):
        family: CounterMetricFamily | GaugeMetricFamily
        if kind == "c":
            family = CounterMetricFamily(name, doc, labels=labels)
        else:
            family = GaugeMetricFamily(name, doc, labels=labels)
        for tier in tiers:
            family.add_metric([model_name, tier.tier], getattr(tier, field_name))
        yield family
    latency = HistogramMetricFamily(
        "vllm:kv_offload_load_latency_seconds",
        "Time from a load's start until its blocks are in the GPU cache (by its lowest tier).",
        labels=labels,
    )
    for tier in tiers:
        cumulative, buckets = 0, []
        for bound, count in zip(
            (*KV_TIER_LOAD_BUCKETS, float("inf")), tier.load_buckets, strict=True
        ):
            cumulative += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
        latency.add_metric([model_name, tier.tier], buckets, tier.load_seconds)
    yield latency
    failures = CounterMetricFamily(
        "vllm:kv_offload_failures",
        "Blocks the tier could not serve or store, by reason (each a miss, never an error).",
        labels=[*labels, "reason"],
    )
    for tier in tiers:
        for reason, count in sorted(tier.failures.items()):
            failures.add_metric([model_name, tier.tier, reason], count)
    yield failures


def _spec_decode_metrics(model_name: str, stats: EngineStats) -> Iterator[Metric]:
    """Upstream's speculative-decoding counters, labelled with the verification policy
    (strict, or the lossy fly / synthetic) so a lossy configuration shows on every series."""
    labels = ["model_name", "verification"]
    values = [model_name, stats.spec_verification]
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Verification steps with drafts.", stats.spec_num_drafts),
        (
            "vllm:spec_decode_num_draft_tokens",
            "Draft tokens proposed.",
            stats.spec_num_draft_tokens,
        ),
        (
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            stats.spec_num_accepted_tokens,
        ),
    ):
        family = CounterMetricFamily(name, doc, labels=labels)
        family.add_metric(values, value)
        yield family
    per_position = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0-based).",
        labels=[*labels, "position"],
    )
    for position, value in enumerate(stats.spec_accepted_per_position):
        per_position.add_metric([*values, str(position)], value)
    yield per_position


class ServerMetrics:
    """The app's registry and the series the request handlers observe."""

    def __init__(self, model_name: str, cache_config: CacheConfig | None = None) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineStatsCollector(model_name, cache_config)
        self.registry.register(self._engine)
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefilled prompt tokens.", labels, registry=self.registry
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", labels, registry=self.registry
        ).labels(model_name)
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two consecutive outputs of one request.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last output of a finished request.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # Upstream servers export the same family (from an instrumentation middleware); rollout
        # analysis divides the non-2xx answers by all answers of the generation routes.
        self._http_requests = Counter(
            "http_requests",
            "HTTP responses, by route, method and status code.",
            ["handler", "method", "status"],
            registry=self.registry,
        )
        self.model_name = model_name

    def http_response(self, handler: str, method: str, status: int) -> None:
        self._http_requests.labels(handler, method, str(status)).inc()

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def set_engine_stats(self, stats: EngineStats) -> None:
        self._engine.stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)


Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

# The handler label of a path that is none of the app's routes: a label per arbitrary path
# would let clients grow the series.
UNKNOWN_ROUTE = "none"


class HTTPStatusMiddleware:
    """Plain ASGI middleware counting the status every HTTP request was answered with.

    The outermost of the app's own middleware, so refusals by the others (401, 408, 413) and
    the 500s of unexpected errors are counted too. The handler label is the route's path when
    it is one of `routes`, else UNKNOWN_ROUTE. It reads the status from the
    `http.response.start` message, so streamed responses are counted once, when their headers
    go out, and nothing is buffered; an exception before that counts as 500.
    """

    def __init__(
        self, app: Any, metrics: Callable[[], ServerMetrics], routes: frozenset[str]
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        handler = path if path in self.routes else UNKNOWN_ROUTE
        method = scope.get("method", "")
        counted = False

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal counted
            if message.get("type") == "http.response.start" and not counted:
                counted = True
                self.metrics().http_response(handler, method, int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not counted:
                self.metrics().http_response(handler, method, 500)
            raise
