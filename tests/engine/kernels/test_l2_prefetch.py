from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.l2_prefetch import l2_prefetch, prefetch_supported
from davit_engine.runner.v2.fused_layers import NO_PREFETCH, PREFETCH_ENV, PrefetchPlan

MIB = 1 << 20


def test_plan_parse() -> None:
    plan = PrefetchPlan.parse("o, gate_up=16, down=0.5, max_tokens=8")
    assert (plan.qkv, plan.o, plan.gate_up, plan.down, plan.lm_head) == (
        0,
        -1,
        16 * MIB,
        MIB // 2,
        0,
    )
    assert plan.max_tokens == 8
    assert plan.enabled and plan.active(8) and not plan.active(9)
    assert PrefetchPlan.parse("qkv=all").qkv == -1
    for off in ("off", "", " none "):
        assert PrefetchPlan.parse(off) == NO_PREFETCH
        assert not PrefetchPlan.parse(off).enabled
    assert not PrefetchPlan.parse("o,max_tokens=0").active(1)
    assert not PrefetchPlan.parse("o=0").enabled


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("o,gat_up=4", "'gat_up'"),
        ("o=lots", "o='lots'"),
        ("max_tokens=all", "max_tokens='all'"),
        ("down=-3", "down='-3'"),
    ],
)
def test_plan_parse_errors_name_the_entry(text: str, names: str) -> None:
    with pytest.raises(ValueError) as err:
        PrefetchPlan.parse(text)
    assert PREFETCH_ENV in str(err.value) and names in str(err.value)


def test_plan_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    default = PrefetchPlan.parse("o")
    monkeypatch.delenv(PREFETCH_ENV, raising=False)
    assert PrefetchPlan.from_env(default) is default
    monkeypatch.setenv(PREFETCH_ENV, "off")
    assert PrefetchPlan.from_env(default) == NO_PREFETCH


def test_prefetch_is_a_no_op_on_the_cpu() -> None:
    t = torch.randn(64, 64)
    assert not prefetch_supported(t.device)
    assert l2_prefetch(t) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetch_on_the_gpu_changes_nothing() -> None:
    """On sm_90+ the kernel runs (bytes asked for: the cap, rounded down to 16, or the whole
    tensor); the tensor keeps its values; a non-contiguous view is skipped."""
    t = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    before = t.clone()
    total = t.numel() * 2
    expected = (total, 5 * MIB, 1008) if prefetch_supported(t.device) else (0, 0, 0)
    assert l2_prefetch(t) == expected[0]
    assert l2_prefetch(t, 5 * MIB) == expected[1]
    assert l2_prefetch(t, 1013, chunk_bytes=64) == expected[2]
    assert l2_prefetch(t.t()) == 0
    torch.cuda.synchronize()
    assert torch.equal(t, before)
