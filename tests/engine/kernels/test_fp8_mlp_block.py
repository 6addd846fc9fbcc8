"""The persistent one-token block (kernels/fp8_mlp_block.py) against the unfused kernels it
replaces (`fp8_gemv` and `add_rms_norm`, bit for bit) and against plain torch."""

from __future__ import annotations

import pytest
import torch

from davit_engine.kernels import fp8_gemv, fp8_mlp_block
from davit_engine.kernels.fp8_gemv import fp8_gemv as gemv
from davit_engine.kernels.fp8_mlp_block import MlpBlockWeights
from davit_engine.kernels.fp8_mlp_block import fp8_mlp_block as block
from davit_engine.kernels.layer_ops import add_rms_norm, add_rms_norm_reference, silu_mul_reference
from tests.engine.kernels.fp8_cases import fp8_weights, rel_err

EPS = 1e-5


def _weights(h: int, q: int, inter: int, device: torch.device, seed: int) -> MlpBlockWeights:
    torch.manual_seed(seed)
    o_w, o_s = fp8_weights(h, q, device)
    gu_w, gu_s = fp8_weights(2 * inter, h, device)
    d_w, d_s = fp8_weights(h, inter, device)
    norm = lambda: (1.0 + 0.1 * torch.randn(h, device=device)).to(torch.bfloat16)  # noqa: E731
    return MlpBlockWeights(o_w, o_s, norm(), EPS, gu_w, gu_s, d_w, d_s, norm(), 2 * EPS)


def _unfused(
    attn: torch.Tensor, residual: torch.Tensor, w: MlpBlockWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the engine runs without the block: four kernels of the products and norms."""
    o = gemv(attn, w.o_weight, w.o_scale)
    x1, s1 = add_rms_norm(o, residual, w.post_norm, w.post_eps)
    h = gemv(x1, w.gate_up_weight, w.gate_up_scale, gated=True)
    y = gemv(h, w.down_weight, w.down_scale)
    return add_rms_norm(y, s1, w.next_norm, w.next_eps)


def _torch(
    attn: torch.Tensor, residual: torch.Tensor, w: MlpBlockWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layer half in plain torch (float32 products of the dequantized weights)."""

    def product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return ((x.float() @ weight.float().t()) * scale).to(x.dtype)

    x1, s1 = add_rms_norm_reference(
        product(attn, w.o_weight, w.o_scale), residual, w.post_norm, w.post_eps
    )
    h = silu_mul_reference(product(x1, w.gate_up_weight, w.gate_up_scale))
    return add_rms_norm_reference(
        product(h, w.down_weight, w.down_scale), s1, w.next_norm, w.next_eps
    )


@pytest.mark.parametrize("unroll", [1, 2])
@pytest.mark.parametrize("programs", [4, 20])
def test_block_by_phase_matches_unfused_kernels(
    device: torch.device, programs: int, unroll: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One launch per phase (the interpreter's form; on a GPU the same code without barriers):
    the unfused kernels' numbers bit for bit. 20 multiprocessors make the 512-output products
    take the narrow 4 x 1,024 tiles (fewer than 4 programs a multiprocessor of 8 x 512), as o
    and down do on an H100; 4 keep the wide tiles. Unrolled (two K steps' loads at once),
    the wide tiles' o and down take double steps; the other products, an odd count of steps,
    single ones."""
    monkeypatch.setattr(fp8_mlp_block, "K_UNROLL", unroll)
    monkeypatch.setattr(fp8_gemv, "multiprocessors", lambda _device: programs)
    monkeypatch.setattr(fp8_mlp_block, "multiprocessors", lambda _device: programs)
    h, q, inter = 512, 1024, 1024
    w = _weights(h, q, inter, device, seed=programs)
    configs = fp8_mlp_block.tile_configs(w, device)
    narrow = fp8_gemv.ONE_ROW_NARROW_CONFIG
    assert (configs[0] == narrow) == (programs == 20) and configs[1] == fp8_gemv.ONE_ROW_CONFIG
    attn = torch.randn(1, q, device=device).to(torch.bfloat16)
    residual = torch.randn(1, h, device=device).to(torch.bfloat16)
    counters = fp8_mlp_block.new_counters(device)
    x2, s2 = block(attn, residual, w, counters, fused=False)
    ux2, us2 = _unfused(attn, residual, w)
    assert torch.equal(s2, us2) and torch.equal(x2, ux2)
    tx2, ts2 = _torch(attn, residual, w)
    # a sanity check of the whole chain: each product differs from torch's by its float32
    # summation order, which five bf16 roundings and the SiLU spread to about 2.5%
    assert rel_err(s2, ts2) < 5e-2 and rel_err(x2, tx2) < 5e-2
    assert not counters.any()  # unfused launches never touch the counters


def test_block_refuses_what_it_cannot_run(device: torch.device) -> None:
    """Several tokens, shapes whose tiles are not whole, a non-FP8 weight: a clear error."""
    w = _weights(512, 1024, 1024, device, seed=1)
    counters = fp8_mlp_block.new_counters(device)
    attn = torch.randn(2, 1024, device=device).to(torch.bfloat16)
    residual = torch.randn(2, 512, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="one token"):
        block(attn, residual, w, counters, fused=False)
    odd = _weights(512, 1000, 1024, device, seed=2)
    with pytest.raises(ValueError, match="o \\[512, 1000\\]"):
        block(attn[:1, :1000].contiguous(), residual[:1], odd, counters, fused=False)
    bad = MlpBlockWeights(**{**w.__dict__, "down_weight": w.down_weight.to(torch.bfloat16)})
    with pytest.raises(ValueError, match="down weight must be contiguous float8_e4m3fn"):
        block(attn[:1], residual[:1], bad, counters, fused=False)
    with pytest.raises(ValueError, match="attn must be contiguous"):
        block(attn[:1, :512].contiguous(), residual[:1], w, counters, fused=False)
    trace = torch.zeros(32 * 4, fp8_mlp_block.TRACE_SLOTS, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="trace: an int64 tensor"):
        block(attn[:1], residual[:1], w, counters, fused=False, trace=trace)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("h", "inter", "unroll", "registers"),
    [(4096, 14336, 1, 64), (4096, 14336, 2, 64), (4096, 14336, 1, None), (5120, 13824, 1, 64)],
)
def test_fused_block_matches_unfused_in_a_graph(
    device: torch.device,
    h: int,
    inter: int,
    unroll: int,
    registers: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The persistent launch at Llama-3.1-8B's and a 14B-class model's shapes: eager, then five
    launches back to back in a captured graph replayed three times on new inputs (the counters
    must be zero again after every launch): the unfused kernels' numbers bit for bit, no wait
    given up. With two K steps' loads at once, and without the register cap."""
    monkeypatch.setattr(fp8_mlp_block, "K_UNROLL", unroll)
    monkeypatch.setattr(fp8_mlp_block, "MAX_REGISTERS", registers)
    q = h  # the chained launches feed each block's normed output to the next as its input
    w = _weights(h, q, inter, device, seed=h)
    counters = fp8_mlp_block.new_counters(device)
    attn = torch.randn(1, q, device=device).to(torch.bfloat16)
    residual = torch.randn(1, h, device=device).to(torch.bfloat16)
    x2, s2 = block(attn, residual, w, counters)
    ux2, us2 = _unfused(attn, residual, w)
    torch.cuda.synchronize()
    assert counters.tolist() == [0] * fp8_mlp_block.NUM_COUNTERS, "waits given up: slot 5"
    assert torch.equal(s2, us2), (s2 - us2).abs().max()
    assert torch.equal(x2, ux2), (x2 - ux2).abs().max()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the block's outputs feed the next launch, as layers chain
        outs = [block(attn, residual, w, counters)]
        for _ in range(4):
            outs.append(block(outs[-1][0], outs[-1][1], w, counters))
    for replay in range(3):
        attn.copy_(torch.randn_like(attn))
        residual.copy_(torch.randn_like(residual))
        expected = [_unfused(attn, residual, w)]
        for _ in range(4):
            expected.append(_unfused(expected[-1][0], expected[-1][1], w))
        graph.replay()
        torch.cuda.synchronize()
        assert counters.tolist() == [0] * fp8_mlp_block.NUM_COUNTERS, f"replay {replay}"
        for (x, s), (ux, us) in zip(outs, expected, strict=True):
            assert torch.equal(s, us) and torch.equal(x, ux)


@pytest.mark.gpu
def test_fused_block_trace(device: torch.device) -> None:
    """Traced: every program's eight timer stamps in order, the phases' last stamps after
    the previous phase's first barrier release, and the same numbers as untraced."""
    h, inter = 4096, 14336
    w = _weights(h, h, inter, device, seed=3)
    counters = fp8_mlp_block.new_counters(device)
    attn = torch.randn(1, h, device=device).to(torch.bfloat16)
    residual = torch.randn(1, h, device=device).to(torch.bfloat16)
    rows = 32 * torch.cuda.get_device_properties(device).multi_processor_count
    trace = torch.zeros(rows, fp8_mlp_block.TRACE_SLOTS, dtype=torch.int64, device=device)
    x2, s2 = block(attn, residual, w, counters, trace=trace)
    ux2, us2 = _unfused(attn, residual, w)
    torch.cuda.synchronize()
    programs = fp8_mlp_block.last_programs
    stamps = trace[:programs]
    assert counters.tolist() == [0] * fp8_mlp_block.NUM_COUNTERS
    assert torch.equal(s2, us2) and torch.equal(x2, ux2)
    assert (stamps > 0).all() and not trace[programs:].any()
    assert (stamps[:, 1:] >= stamps[:, :-1]).all()
    # nobody leaves a barrier before the last program reached it
    assert stamps[:, 2].min() >= stamps[:, 1].max()
    assert stamps[:, 5].min() >= stamps[:, 4].max()
