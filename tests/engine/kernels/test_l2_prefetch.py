from __future__ import annotations

import pytest
import torch

from davit_engine.kernels import l2_prefetch
from davit_engine.kernels.fp8_gemv import fp8_gemv
from davit_engine.layers.fp8 import FP8_DTYPE


def test_byte_range_is_an_aligned_view_clipped_to_the_tensor() -> None:
    w = torch.arange(4 * 64, dtype=torch.int32).view(4, 64)  # 1,024 bytes
    r = l2_prefetch.byte_range(w, 40, 100)
    assert r.dtype == torch.uint8 and r.dim() == 1
    assert r.data_ptr() == w.data_ptr() + 32  # 40 rounded down to 16 bytes
    assert r.numel() == 96  # 100 rounded down
    assert l2_prefetch.byte_range(w, 1000, 500).numel() == 32  # from 992 to the end (1,024)
    assert l2_prefetch.byte_range(w, 5000, 500).numel() == 0
    assert l2_prefetch.byte_range(w, -8, 64).data_ptr() == w.data_ptr()
    with pytest.raises(ValueError, match="contiguous tensor"):
        l2_prefetch.byte_range(w.t(), 0, 64)


def test_bad_ranges_and_options_are_refused_naming_the_argument() -> None:
    w = torch.zeros(4096, dtype=torch.uint8)
    good = l2_prefetch.byte_range(w, 0, 1024)
    with pytest.raises(ValueError, match="mode: one of"):
        l2_prefetch.l2_prefetch([good], mode="nearby")
    with pytest.raises(ValueError, match="mode: one of"):
        l2_prefetch.supported(w.device, "nearby")
    with pytest.raises(ValueError, match="programs"):
        l2_prefetch.l2_prefetch([good], programs=-1)
    with pytest.raises(ValueError, match="at most 4"):
        l2_prefetch.l2_prefetch([l2_prefetch.byte_range(w, 16 * i, 16) for i in range(5)])
    with pytest.raises(ValueError, match="1-D uint8 views on 16-byte"):
        l2_prefetch.l2_prefetch([w[8:1032]])
    with pytest.raises(ValueError, match="1-D uint8 views on 16-byte"):
        l2_prefetch.l2_prefetch([torch.zeros(64, dtype=torch.int32)])
    # empty ranges are dropped before the count
    assert l2_prefetch.l2_prefetch([w[:0]] * 6) is None


def test_nothing_launches_off_a_gpu() -> None:
    w = torch.zeros(4096, dtype=torch.uint8)
    for mode in l2_prefetch.MODES:
        assert not l2_prefetch.supported(w.device, mode)
        assert l2_prefetch.l2_prefetch([l2_prefetch.byte_range(w, 0, 4096)], mode) is None


@pytest.mark.gpu
@pytest.mark.parametrize("mode", l2_prefetch.MODES)
def test_prefetch_in_a_graph_changes_no_product(device: torch.device, mode: str) -> None:
    """Each form launches (its compiled code holds the prefetch statements and the waits of the
    launch chain) and, in a captured graph before one-row FP8 products at W2's o and gate/up
    shapes, the products are bit for bit those without it, over three replays on new inputs."""
    torch.manual_seed(0)
    o_w = (torch.randn(4096, 4096, device=device) * 0.05).to(FP8_DTYPE)
    gu_w = (torch.randn(2 * 14336, 4096, device=device) * 0.05).to(FP8_DTYPE)
    o_s = torch.rand(4096, device=device) + 0.5
    gu_s = torch.rand(2 * 14336, device=device) + 0.5
    half = gu_w.numel() // 2
    ranges = [
        l2_prefetch.byte_range(o_w, 0, o_w.numel()),
        l2_prefetch.byte_range(gu_w, 0, 3 << 20),
        l2_prefetch.byte_range(gu_w, half, 3 << 20),
    ]
    compiled = l2_prefetch.l2_prefetch(ranges, mode)
    assert compiled is not None
    ptx = compiled.asm["ptx"]
    statement = "cp.async.bulk.prefetch.L2" if mode == "bulk" else "prefetch.global.L2"
    assert ptx.count(statement) >= 3  # one site per range
    assert ("evict_last" in ptx) == (mode == "lines-last")
    assert "griddepcontrol.wait" in ptx or not torch.cuda.get_device_capability(device)[0] >= 9
    x = torch.randn(1, 4096, device=device).to(torch.bfloat16)

    def products() -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_gemv(x, o_w, o_s), fp8_gemv(x, gu_w, gu_s, gated=True)

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_prefetch.l2_prefetch(ranges, mode)
        outs = products()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        expected = products()
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, expected, strict=True):
            assert torch.equal(got, want)
