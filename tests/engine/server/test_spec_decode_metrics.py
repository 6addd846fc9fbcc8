"""Speculative decoding's counters on /metrics: upstream's names, labelled with the
verification policy so a lossy one (FLy, synthetic) is visible on every series."""

from __future__ import annotations

from davit_engine.server.metrics import ServerMetrics
from davit_engine.types import EngineStats


def test_spec_decode_counters_carry_the_verification_label() -> None:
    metrics = ServerMetrics("m")
    metrics.set_engine_stats(
        EngineStats(
            spec_verification="fly",
            spec_num_drafts=10,
            spec_num_draft_tokens=40,
            spec_num_accepted_tokens=25,
            spec_accepted_per_position=[9, 8, 5, 3],
        )
    )
    text = metrics.render().decode()
    labels = 'model_name="m",verification="fly"'
    assert f"vllm:spec_decode_num_drafts_total{{{labels}}} 10.0" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 40.0" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 25.0" in text
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{model_name="m",position="3",verification="fly"}} 3.0' in text


def test_no_spec_decode_series_without_speculative_decoding() -> None:
    metrics = ServerMetrics("m")
    metrics.set_engine_stats(EngineStats())
    assert "spec_decode" not in metrics.render().decode()
