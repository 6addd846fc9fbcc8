"""The series the Gateway API Inference Extension's endpoint pickers read from /metrics (its
model-server protocol for vLLM-compatible servers): queue length, running requests, KV-cache
usage, and the cache configuration's block size and block count."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from davit_engine.server.metrics import CacheConfig, ServerMetrics
from davit_engine.types import EngineStats

from .conftest import MODEL, FakeServer


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_protocol_series_on_the_served_metrics(fake_server: FakeServer) -> None:
    fake_server.client().completions.create(model=MODEL, prompt="hello", max_tokens=3)
    with fake_server.http() as http:
        got = _samples(http.get("/metrics").text)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        ((labels, value),) = got[name]
        assert labels == {"model_name": MODEL}
        assert value == int(value) >= 0
    ((labels, usage),) = got["vllm:kv_cache_usage_perc"]
    assert labels == {"model_name": MODEL}
    assert 0.0 <= usage <= 1.0  # a fraction, as upstream's despite the name
    ((info, one),) = got["vllm:cache_config_info"]
    assert one == 1
    assert int(info["block_size"]) in (8, 16, 32, 64, 128)
    assert int(info["num_gpu_blocks"]) > 0  # the loaded engine's KV blocks


def test_cache_config_info_labels_follow_the_engine() -> None:
    metrics = ServerMetrics(
        "m", CacheConfig(block_size=32, cache_dtype="fp8", enable_prefix_caching=False)
    )
    metrics.set_engine_stats(EngineStats(num_waiting=4, num_total_blocks=1200))
    got = _samples(metrics.render().decode())
    ((info, _),) = got["vllm:cache_config_info"]
    assert info == {
        "block_size": "32",
        "num_gpu_blocks": "1200",
        "cache_dtype": "fp8",
        "enable_prefix_caching": "False",
    }
    assert got["vllm:num_requests_waiting"] == [({"model_name": "m"}, 4.0)]
