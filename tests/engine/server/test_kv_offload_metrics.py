"""The KV offload tiers on /metrics: per-tier series beside the GPU prefix cache's."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from davit_engine.server.metrics import ServerMetrics
from davit_engine.types import EngineStats, KvTierStats


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_each_tier_has_its_series() -> None:
    metrics = ServerMetrics("m")
    cpu = KvTierStats("cpu", capacity_bytes=100, used_bytes=40, hits=32, misses=16, load_bytes=7)
    disk = KvTierStats("disk", capacity_bytes=1000, hits=16, load_seconds=0.5, load_count=2)
    disk.load_buckets[3] = 1  # <= 10 ms
    disk.load_buckets[-1] = 1  # above every bound
    disk.failures = {"corrupt": 2, "disk_full": 1}
    metrics.set_engine_stats(
        EngineStats(
            prefix_cache_hits=64, prefix_cache_queries=128, kv_offload=[cpu, disk], num_loading=3
        )
    )
    got = samples(metrics)
    m = ("model_name", "m")
    assert got[("vllm:prefix_cache_hits_total", (m,))] == 64  # the GPU tier's, unchanged
    assert got[("vllm:kv_offload_hits_total", (m, ("tier", "cpu")))] == 32
    assert got[("vllm:kv_offload_misses_total", (m, ("tier", "cpu")))] == 16
    assert got[("vllm:kv_offload_hits_total", (m, ("tier", "disk")))] == 16
    assert got[("vllm:kv_offload_load_bytes_total", (m, ("tier", "cpu")))] == 7
    assert got[("vllm:kv_offload_usage_bytes", (m, ("tier", "cpu")))] == 40
    assert got[("vllm:kv_offload_capacity_bytes", (m, ("tier", "disk")))] == 1000
    assert (
        got[("vllm:kv_offload_load_latency_seconds_bucket", (("le", "0.01"), m, ("tier", "disk")))]
        == 1
    )
    assert (
        got[("vllm:kv_offload_load_latency_seconds_bucket", (("le", "+Inf"), m, ("tier", "disk")))]
        == 2
    )
    assert got[("vllm:kv_offload_load_latency_seconds_sum", (m, ("tier", "disk")))] == 0.5
    assert (
        got[("vllm:kv_offload_failures_total", (m, ("reason", "corrupt"), ("tier", "disk")))] == 2
    )
    assert got[("vllm:num_requests_loading", (m,))] == 3


def test_no_series_without_tiers() -> None:
    metrics = ServerMetrics("m")
    metrics.set_engine_stats(EngineStats())
    assert not any(name.startswith("vllm:kv_offload") for name, _ in samples(metrics))
