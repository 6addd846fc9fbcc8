"""The few-row FP8 matrix-vector product (kernels/fp8_gemv.py) against its torch twin."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from davit_engine.kernels import fp8_gemv
from davit_engine.kernels.fp8_gemv import GemvConfig, default_split_k
from davit_engine.kernels.fp8_gemv import fp8_gemv as gemv
from davit_engine.kernels.fp8_linear import fp8_weight_matmul, fp8_weight_matmul_reference
from davit_engine.kernels.layer_ops import silu_mul, silu_mul_reference
from tests.engine.kernels.fp8_cases import fp8_weights as _weights
from tests.engine.kernels.fp8_cases import rel_err as _rel_err


@pytest.mark.parametrize("rows", list(range(1, 17)))
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(device: torch.device, rows: int, bias: bool) -> None:
    """Every row count up to 16 (several programs' row groups past 4), odd N and K (a partial
    column block, a K tail inside a step)."""
    torch.manual_seed(rows * 2 + bias)
    n, k = 37, 203
    weight, scale = _weights(n, k, device)
    x = torch.randn(rows, k, device=device)
    b = torch.randn(n, device=device) if bias else None
    out = gemv(x, weight, scale, b, GemvConfig(block_n=8, block_k=64, num_warps=4))
    assert out.shape == (rows, n) and out.dtype == x.dtype
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16])
def test_weight_matmul_dispatch_matches_reference(device: torch.device, rows: int) -> None:
    """`fp8_weight_matmul` without a config: the matrix-vector kernel up to MAX_ROWS rows,
    the matrix-unit kernel beyond; both give the reference's result."""
    torch.manual_seed(40 + rows)
    weight, scale = _weights(72, 160, device)
    x = torch.randn(rows, 160, device=device)
    b = torch.randn(72, device=device)
    out = fp8_weight_matmul(x, weight, scale, b)
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


@pytest.mark.parametrize("split_k", [1, 2, 8])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_split_k(device: torch.device, split_k: int, rows: int) -> None:
    """K split over programs, including splits that start past K (1100 = 18 steps of 64 in
    8 splits of 3 steps: the last two are empty) and a last step that ends inside K."""
    torch.manual_seed(split_k * 10 + rows)
    n, k = 24, 1100
    weight, scale = _weights(n, k, device)
    x = torch.randn(rows, k, device=device)
    b = torch.randn(n, device=device)
    cfg = GemvConfig(block_n=8, block_k=64, num_warps=4, split_k=split_k)
    out = gemv(x, weight, scale, b, cfg)
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


def test_gemv_even_k_and_strided_rows(device: torch.device) -> None:
    """K a multiple of the step (the unmasked loads) and rows read through their stride."""
    torch.manual_seed(3)
    weight, scale = _weights(40, 256, device)
    wide = torch.randn(2, 320, device=device)
    x = wide[:, 32:288]
    cfg = GemvConfig(block_n=16, block_k=128, num_warps=4, split_k=2)
    out = gemv(x, weight, scale, None, cfg)
    assert _rel_err(out, fp8_weight_matmul_reference(x.contiguous(), weight, scale)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_half_activations(device: torch.device, dtype: torch.dtype) -> None:
    """Half-precision activations are widened to float32; only the final cast rounds."""
    torch.manual_seed(11)
    weight, scale = _weights(33, 130, device)
    x = torch.randn(2, 130, device=device).to(dtype)
    b = torch.randn(33, device=device).to(dtype)
    out = gemv(x, weight, scale, b)
    assert out.dtype == dtype
    ref = fp8_weight_matmul_reference(x.float(), weight, scale, b.float())
    assert _rel_err(out, ref) < 4e-3  # bf16's own rounding of the result is ~2e-3


def test_default_config_narrows_at_few_columns() -> None:
    gpu = torch.device("cpu")  # the interpreter's stand-in: 4 multiprocessors, 16 programs
    wide = dataclasses.replace(fp8_gemv.ONE_ROW_CONFIG, unroll=2)  # two K steps a round
    assert fp8_gemv.default_config(1, 128, gpu) == wide
    assert fp8_gemv.default_config(1, 120, gpu) == fp8_gemv.ONE_ROW_NARROW_CONFIG
    assert fp8_gemv.default_config(3, 4096, gpu) == fp8_gemv.FEW_ROWS_CONFIG


def test_default_split_k_fills_the_gpu() -> None:
    cfg = fp8_gemv.ONE_ROW_CONFIG
    gpu = torch.device("cpu")  # the interpreter's stand-in: 4 multiprocessors
    assert default_split_k(4096, 4096, cfg, gpu) == 1  # 512 programs already
    assert default_split_k(64, 4096, cfg, gpu) == 2  # 8 programs -> 16
    # never fewer than two steps of K per split
    assert default_split_k(8, 1024, GemvConfig(8, 512, 4), gpu) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemv_bf16_real_shapes(device: torch.device, rows: int, n: int, k: int) -> None:
    torch.manual_seed(7)
    weight, scale = _weights(n, k, device)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    out = gemv(x, weight, scale)
    assert torch.isfinite(out).all()
    assert _rel_err(out, fp8_weight_matmul_reference(x.float(), weight, scale)) < 4e-3


def _gated_unfused(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    cfg: GemvConfig | None,
) -> torch.Tensor:  # fmt: skip
    """The two kernels the gated product replaces: the plain product, then SiLU x up."""
    return silu_mul(gemv(x, weight, scale, bias, cfg))


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_gemv_equals_product_then_silu_mul(
    device: torch.device, rows: int, bias: bool, dtype: torch.dtype
) -> None:
    """`gated=True` gives `silu(gate) * up` of the product, bit for bit what the product
    followed by `layer_ops.silu_mul` gives, at an odd width (a partial last tile of columns)
    and a K tail inside a step; and close to the float64 reference."""
    torch.manual_seed(rows * 4 + bias)
    width, k = 19, 203
    weight, scale = _weights(2 * width, k, device)
    x = torch.randn(rows, k, device=device).to(dtype)
    b = torch.randn(2 * width, device=device).to(dtype) if bias else None
    cfg = GemvConfig(block_n=8, block_k=64, num_warps=4)
    out = gemv(x, weight, scale, b, cfg, gated=True)
    assert out.shape == (rows, width) and out.dtype == dtype
    unfused = _gated_unfused(x, weight, scale, b, cfg)
    if device.type == "cpu":
        assert torch.equal(out, unfused)
    else:  # the GPU's exp and division may round the last bit apart between two kernels
        torch.testing.assert_close(out, unfused, rtol=1e-2 if dtype != torch.float32 else 1e-5,
                                   atol=1e-5)  # fmt: skip
    product = fp8_weight_matmul_reference(x.double(), weight, scale.double(), b)
    expected = silu_mul_reference(product).to(dtype)
    # bf16: gate rounded before SiLU, whose relative error grows as 1 + |gate| for large
    # negative gates (about +-30 here)
    assert _rel_err(out, expected) < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("split_k", [2, 8])
@pytest.mark.parametrize("rows", [1, 3])
def test_gated_gemv_split_k(device: torch.device, split_k: int, rows: int) -> None:
    """K split over programs: the second pass sums the gate and the up rows' partials and
    applies the activation (the same numbers as the unsplit kernel, up to summation order)."""
    torch.manual_seed(50 + split_k + rows)
    width, k = 12, 1100
    weight, scale = _weights(2 * width, k, device)
    x = torch.randn(rows, k, device=device)
    b = torch.randn(2 * width, device=device)
    cfg = GemvConfig(block_n=8, block_k=64, num_warps=4, split_k=split_k)
    out = gemv(x, weight, scale, b, cfg, gated=True)
    assert out.shape == (rows, width)
    assert _rel_err(out, _gated_unfused(x, weight, scale, b, cfg)) < 1e-6
    unsplit = GemvConfig(block_n=8, block_k=64, num_warps=4, split_k=1)
    assert _rel_err(out, gemv(x, weight, scale, b, unsplit, gated=True)) < 1e-6


def test_gated_gemv_refuses_an_odd_weight(device: torch.device) -> None:
    weight, scale = _weights(9, 64, device)
    x = torch.randn(1, 64, device=device)
    with pytest.raises(ValueError, match="gated: .*even"):
        gemv(x, weight, scale, gated=True)
    weight, scale = _weights(8, 64, device)
    with pytest.raises(ValueError, match="block_n"):
        gemv(x, weight, scale, config=GemvConfig(block_n=1, block_k=64, num_warps=1), gated=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize(("inter", "k"), [(14336, 4096), (3072, 1024)])
def test_gated_gemv_real_shapes(device: torch.device, rows: int, inter: int, k: int) -> None:
    """The gate/up shapes of Llama-3.1-8B and Qwen3-0.6B at the engine's default tiles."""
    torch.manual_seed(9)
    weight, scale = _weights(2 * inter, k, device)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    out = gemv(x, weight, scale, gated=True)
    assert out.shape == (rows, inter) and torch.isfinite(out).all()
    torch.testing.assert_close(out, silu_mul(gemv(x, weight, scale)), rtol=1e-2, atol=1e-3)
    expected = silu_mul_reference(fp8_weight_matmul_reference(x.float(), weight, scale))
    assert _rel_err(out, expected) < 8e-3


_STREAMED = [GemvConfig(8, 64, 4, split_k=s, stages=t, preload=p)
             for s, t, p in ((1, 2, 0), (1, 3, 1), (2, 4, 0), (8, 3, 1))]  # fmt: skip


@pytest.mark.parametrize("cfg", _STREAMED, ids=lambda c: c.label)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("n", "k"), [(38, 208), (40, 256), (24, 1104)])
def test_streamed_gemv_equals_plain(
    device: torch.device, cfg: GemvConfig, gated: bool, n: int, k: int
) -> None:
    """W's tiles streamed through shared memory (pipeline stages, the first tile fetched
    before the wait for the previous kernel) give the plain loads' numbers: at a partial last
    tile of rows (38; gated: 19 columns, up rows read past the gate rows), a K tail inside a
    step (208, 1104), splits that start past K (1104 in 8) and with the bias."""
    torch.manual_seed(n + k + cfg.stages + gated)
    weight, scale = _weights(n, k, device)
    x = torch.randn(1, k, device=device)
    b = torch.randn(n, device=device)
    assert fp8_gemv.can_stream(x, weight, cfg)
    plain = dataclasses.replace(cfg, stages=0, preload=0)
    out = gemv(x, weight, scale, b, cfg, gated=gated)
    expected = gemv(x, weight, scale, b, plain, gated=gated)
    if device.type == "cpu":
        assert torch.equal(out, expected)
    else:  # the sums' reduction trees may differ by layout
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if not gated:
        assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


def test_streaming_falls_back_to_plain_loads(device: torch.device) -> None:
    """Where the tensor memory accelerator cannot stream W (several rows, rows of W not on 16
    bytes) the plain kernel runs, with the same result."""
    cfg = GemvConfig(8, 64, 4, stages=3, preload=1)
    weight, scale = _weights(24, 200, device)  # 200-byte rows
    x = torch.randn(1, 200, device=device)
    assert not fp8_gemv.can_stream(x, weight, cfg)
    out = gemv(x, weight, scale, None, cfg)
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale)) < 1e-5
    weight, scale = _weights(24, 256, device)
    rows = torch.randn(2, 256, device=device)
    assert not fp8_gemv.can_stream(rows, weight, cfg)
    assert fp8_gemv.can_stream(rows[:1], weight, cfg)
    assert not fp8_gemv.can_stream(rows[:1], weight, dataclasses.replace(cfg, stages=0))
    out = gemv(rows, weight, scale, None, cfg)
    assert _rel_err(out, fp8_weight_matmul_reference(rows, weight, scale)) < 1e-5


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("n", "k", "split_k"), [(38, 256, 1), (40, 1024, 2), (24, 1152, 8)])
def test_plain_preload_equals_plain(
    device: torch.device, gated: bool, n: int, k: int, split_k: int
) -> None:
    """The plain kernel with its first tile of W loaded before the wait: the same numbers as
    without, at a partial last tile of rows, with K split, and where a split starts past K's
    end (1,152 = 18 steps of 64 in 8 splits of 3: the last two read the last tile and add
    nothing). Several rows and a K tail inside a step ignore the preload."""
    torch.manual_seed(n + k + split_k + gated)
    weight, scale = _weights(n, k, device)
    b = torch.randn(n, device=device)
    cfg = GemvConfig(8, 64, 4, split_k=split_k, preload=1)
    plain = dataclasses.replace(cfg, preload=0)
    for rows in (1, 3):
        x = torch.randn(rows, k, device=device)
        out = gemv(x, weight, scale, b, cfg, gated=gated)
        expected = gemv(x, weight, scale, b, plain, gated=gated)
        assert torch.equal(out, expected)
        if not gated:
            assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5
    weight, scale = _weights(n, k - 8, device)  # a K tail: no preload, same result
    x = torch.randn(1, k - 8, device=device)
    assert torch.equal(gemv(x, weight, scale, None, cfg), gemv(x, weight, scale, None, plain))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(
    ("n", "k", "split_k", "preload"),
    [(38, 256, 1, 0), (40, 448, 1, 1), (40, 1024, 2, 0), (24, 1152, 8, 1), (16, 1152, 8, 0)],
)
def test_two_steps_a_round_equal_one(
    device: torch.device, gated: bool, n: int, k: int, split_k: int, preload: int
) -> None:
    """Two K steps' loads a round (`unroll` 2): the numbers of one step a round, bit for bit, at
    an even and an odd number of steps per split (448 = 7 steps of 64; 1,152 in 8 splits of 3
    steps, the last two starting past K's end), after a preloaded first tile, and at a partial
    last tile of rows. Several rows and a K tail inside a step take one step a round."""
    torch.manual_seed(n + k + split_k + gated + preload)
    weight, scale = _weights(n, k, device)
    b = torch.randn(n, device=device)
    plain = GemvConfig(8, 64, 4, split_k=split_k, preload=preload)
    cfg = dataclasses.replace(plain, unroll=2)
    for rows in (1, 3):
        x = torch.randn(rows, k, device=device)
        out = gemv(x, weight, scale, b, cfg, gated=gated)
        assert torch.equal(out, gemv(x, weight, scale, b, plain, gated=gated))
        if not gated:
            assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5
    weight, scale = _weights(n, k - 8, device)  # a K tail
    x = torch.randn(1, k - 8, device=device)
    assert torch.equal(gemv(x, weight, scale, None, cfg), gemv(x, weight, scale, None, plain))


def test_unroll_switch_sets_the_one_row_default(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    wide = fp8_gemv.default_config(1, 1 << 20, cpu)  # the 8 x 512 tile: two steps a round
    assert (wide.block_n, wide.unroll, wide.label) == (8, 2, "gemv_8x512w4sautou2")
    narrow = fp8_gemv.default_config(1, 64, cpu)  # too few rows for 8 x 512: 4 x 1,024, one
    assert (narrow.block_n, narrow.unroll) == (4, 1)
    assert fp8_gemv.default_config(2, 4096, cpu) == fp8_gemv.FEW_ROWS_CONFIG
    monkeypatch.setattr(fp8_gemv, "UNROLL_NARROW", True)
    assert fp8_gemv.default_config(1, 64, cpu).unroll == 2
    monkeypatch.setattr(fp8_gemv, "PLAIN_UNROLL", 1)
    assert fp8_gemv.default_config(1, 1 << 20, cpu).unroll == 1
    monkeypatch.setattr(fp8_gemv, "PLAIN_UNROLL", 2)
    monkeypatch.setattr(fp8_gemv, "STREAM_STAGES", 3)  # streamed W takes no unroll
    assert fp8_gemv.default_config(1, 1 << 20, cpu).unroll == 1


def test_stream_switch_sets_the_one_row_default(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = torch.device("cpu")
    assert fp8_gemv.default_config(1, 4096, gpu).stages == 0  # off until timed
    monkeypatch.setattr(fp8_gemv, "STREAM_STAGES", 4)
    monkeypatch.setattr(fp8_gemv, "STREAM_PRELOAD", 1)
    one_row = fp8_gemv.default_config(1, 4096, gpu)
    assert (one_row.block_n, one_row.stages, one_row.preload) == (8, 4, 1)
    assert one_row.label == "gemv_8x512w4sautot4p"
    assert fp8_gemv.default_config(2, 4096, gpu) == fp8_gemv.FEW_ROWS_CONFIG
    monkeypatch.setattr(fp8_gemv, "STREAM_STAGES", 0)
    assert fp8_gemv.default_config(1, 4096, gpu).preload == 0
    monkeypatch.setattr(fp8_gemv, "PLAIN_PRELOAD", 1)
    one_row = fp8_gemv.default_config(1, 4096, gpu)
    assert (one_row.stages, one_row.preload, one_row.label) == (0, 1, "gemv_8x512w4sautopu2")
    assert fp8_gemv.default_config(2, 4096, gpu) == fp8_gemv.FEW_ROWS_CONFIG


def _replayed_in_a_graph(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    cfg: GemvConfig,
    base: GemvConfig,
    gated: bool,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three launches of `cfg` back to back, captured in a graph and replayed after x is
    redrawn, and `base`'s eager launch on the new x."""
    graph = torch.cuda.CUDAGraph()
    gemv(x, weight, scale, None, cfg, gated=gated)  # compile outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        outs = [gemv(x, weight, scale, None, cfg, gated=gated) for _ in range(3)]
    x.copy_(torch.randn_like(x))
    expected = gemv(x, weight, scale, None, base, gated=gated)
    graph.replay()
    torch.cuda.synchronize()
    return outs, expected


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_streamed_gemv_real_shapes_in_a_graph(
    device: torch.device, gated: bool, stages: int, n: int, k: int
) -> None:
    """W2's shapes at the engine's one-row tiles, streamed with the first tile fetched before
    the wait, launched back to back in a captured graph (programmatic dependent launch: each
    launch's first tiles are fetched while the one before runs): the plain kernel's numbers."""
    torch.manual_seed(stages + n)
    weight, scale = _weights(n, k, device)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    base = fp8_gemv.default_config(1, n, device)
    cfg = dataclasses.replace(base, stages=stages, preload=1)
    assert fp8_gemv.can_stream(x, weight, cfg)
    outs, expected = _replayed_in_a_graph(x, weight, scale, cfg, base, gated)
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-3)
        assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("form", ["preload", "two_steps"])
def test_plain_forms_real_shapes_in_a_graph(
    device: torch.device, gated: bool, n: int, k: int, form: str
) -> None:
    """W2's shapes at the engine's one-row tiles with the first tile loaded before the wait
    (each launch's first tiles loaded while the one before runs, under programmatic dependent
    launch), or with two K steps a round (14 steps at down's 4 x 1,024 tile, 8 elsewhere):
    three launches back to back in a captured graph give the plain kernel's numbers."""
    torch.manual_seed(n + k + gated)
    weight, scale = _weights(n, k, device)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    base = fp8_gemv.default_config(1, n, device)
    cfg = dataclasses.replace(base, **({"preload": 1} if form == "preload" else {"unroll": 2}))
    outs, expected = _replayed_in_a_graph(x, weight, scale, cfg, base, gated)
    for out in outs:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "k", "gated", "bias"), [(96, 130, False, True), (160, 96, True, False)]
)
def test_one_row_chain_with_the_norm_folded_in(
    device: torch.device, dtype: torch.dtype, n: int, k: int, gated: bool, bias: bool
) -> None:
    """A producer (o or down: the residual add in its epilogue, the next norm's weight applied)
    then a consumer (q/k/v with a bias, or gate/up gated: the norm's 1/rms on its sums) against
    the unfused kernels: the product, `add_rms_norm`, the product. The residual stream is the
    unfused kernels' bit for bit; the consumer's output differs by one rounding of its input
    (see fp8_gemv.py)."""
    _norm_chain_case(device, dtype, n, k, 200, gated, bias)


@pytest.mark.parametrize("gated", [False, True])
def test_one_row_chain_two_steps_a_round(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, gated: bool
) -> None:
    """The norm chain's products with the default tile at two K steps a round
    (`PLAIN_UNROLL`): the numbers of one step a round, bit for bit (the producer's K an odd
    number of the tile's steps, the consumer's an even one)."""
    torch.manual_seed(7 + gated)
    k_in, k, n = 3 * 1024, 2048, 64
    w_o, s_o = _weights(k, k_in, device)
    w_next, s_next = _weights(n, k, device)
    x = torch.randn(1, k_in, device=device).to(torch.bfloat16)
    residual = torch.randn(1, k, device=device).to(torch.bfloat16)
    norm_w = (torch.rand(k, device=device) + 0.5).to(torch.bfloat16)
    results = []
    for unroll in (1, 2):
        monkeypatch.setattr(fp8_gemv, "PLAIN_UNROLL", unroll)
        res = residual.clone()
        xw, squares = fp8_gemv.fp8_gemv_add_norm(x, w_o, s_o, res, norm_w)
        out = fp8_gemv.fp8_gemv_normed(xw, squares, 1e-5, w_next, s_next, gated=gated)
        results.append((res, xw, squares, out))
    for once, twice in zip(*results, strict=True):
        assert torch.equal(once, twice)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "gated"), [(6144, False), (28672, True)])
def test_one_row_chain_with_the_norm_folded_in_real_shapes(n: int, gated: bool) -> None:
    """Llama-3.1-8B's shapes in bf16: o (4,096 x 4,096) then q/k/v, down (4,096 x 14,336)
    then gate/up."""
    _norm_chain_case(torch.device("cuda"), torch.bfloat16, n, 4096, 14336 if gated else 4096,
                     gated, False)  # fmt: skip


def _norm_chain_case(
    device: torch.device, dtype: torch.dtype, n: int, k: int, k_in: int, gated: bool, bias: bool
) -> None:
    from davit_engine.kernels.layer_ops import add_rms_norm

    torch.manual_seed(n + k + gated)
    eps = 1e-5
    w_o, s_o = _weights(k, k_in, device)  # producer: k_in inputs -> the hidden size k
    w_next, s_next = _weights(n, k, device)
    x = torch.randn(1, k_in, device=device).to(dtype)
    residual = (torch.randn(1, k, device=device) * 3).to(dtype)
    norm_w = (torch.rand(k, device=device) + 0.5).to(dtype)
    b = torch.randn(n // 2 if gated else n, device=device).to(dtype) if bias else None

    y = gemv(x, w_o, s_o)
    ref_x, ref_s = add_rms_norm(y, residual.clone(), norm_w, eps)
    ref = gemv(ref_x, w_next, s_next, b, gated=gated)

    fused_res = residual.clone()
    xw, squares = fp8_gemv.fp8_gemv_add_norm(x, w_o, s_o, fused_res, norm_w)
    assert torch.equal(fused_res, ref_s)
    # one rounding of s * norm weight (Triton's interpreter rounds bf16 toward zero, the GPU
    # to nearest: within one step of the product either way)
    want = ref_s.float() * norm_w.float()
    assert bool(((xw.float() - want).abs() <= want.abs() * torch.finfo(dtype).eps).all())
    assert abs(float(squares.double().sum()) / float(ref_s.double().pow(2).sum()) - 1) < 1e-5
    out = fp8_gemv.fp8_gemv_normed(xw, squares, eps, w_next, s_next, b, gated=gated)
    assert out.shape == ref.shape and out.dtype == dtype
    assert _rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1.5e-2)
    with pytest.raises(ValueError, match="one row only"):
        fp8_gemv.fp8_gemv_normed(torch.cat([xw, xw]), squares, eps, w_next, s_next)
