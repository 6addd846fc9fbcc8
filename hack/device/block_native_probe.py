"""Block-wise FP8 projections served natively (`Fp8BlockLinear`, `--fp8-block-scales native`)
against the same weights converted to channel scales (`Fp8Linear`, the default) and bf16, at
Llama-3.1-8B's four projection shapes with 128 x 128 block scales. Prints one JSON line per
shape and row count: microseconds (CUDA-graph replays, medians) and each output's error
against the float32 product of the checkpoint's values; from 16 rows also the native module's
other routes (`native_widened`: W widened then the library's GEMM; `native_tile`: the Triton
matrix-unit tile) and the library route's activation quantization alone (`quantize_groups`).

Run on the GPU machine from the repository root:
`. hack/device/env.sh && python3 hack/device/block_native_probe.py [rows,...]`; with `gated`, the
gate/up projection's one-row forms only (plain, gated, normed, both; native's also without the
one-row register cap, `fp8_block.ONE_ROW_MAX_REGISTERS`).
"""

from __future__ import annotations

import json
import sys

import torch

from davit_engine.kernels import fp8_block
from davit_engine.kernels.fp8_block import block_weight_matmul, quantize_groups, widen_blocks
from davit_engine.models.config import WeightBlocks
from davit_engine.quant.block_fp8 import channel_scales_from_blocks, expand_block_scales
from davit_engine.quant.fp8_block_linear import Fp8BlockLinear
from davit_engine.quant.fp8_linear import Fp8Linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BLOCKS = WeightBlocks(128, 128, ".weight_scale_inv")


def _us(fn) -> float:  # type: ignore[no-untyped-def]
    from triton.testing import do_bench_cudagraph

    return 1e3 * float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


def _block_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device="cuda") * 0.02
    blocks = w.view(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    codes = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.view(n, k), scale.float()


def _projections(n: int, k: int) -> tuple[Fp8BlockLinear, Fp8Linear]:
    """A random [n, k] block checkpoint's projection served natively and converted."""
    codes, scale = _block_weight(n, k)
    native = Fp8BlockLinear(k, n, False, 128, torch.bfloat16, "cuda")
    native.weight.data.copy_(codes)
    native.weight_scale.data.copy_(expand_block_scales(codes, scale, BLOCKS))
    native.prepare()
    channel = Fp8Linear(k, n, False, torch.bfloat16, "cuda")
    c_codes, c_scale = channel_scales_from_blocks(codes, scale, BLOCKS)
    channel.weight.data.copy_(c_codes)
    channel.weight_scale.data.copy_(c_scale)
    return native, channel


def gated() -> None:
    """gate/up at one row: the plain product, the gated one (`silu(gate) * up` in the
    epilogue) and the gated one with the norm's 1/rms, native against channel (us)."""
    n, k = SHAPES["gate_up"]
    native, channel = _projections(n, k)
    x = torch.randn(1, k, device="cuda").bfloat16()
    squares = torch.rand(256, device="cuda")
    row: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "shape": "gate_up", "rows": 1}

    def forms(m):  # type: ignore[no-untyped-def]
        return {
            "plain": lambda: m(x),
            "gated": lambda: m.forward_silu_mul(x),
            "normed": lambda: m.forward_normed(x, squares, 1e-5, gated=False),
            "normed_gated": lambda: m.forward_normed(x, squares, 1e-5, gated=True),
        }

    def time_forms(label: str, m, names: tuple[str, ...] = ()) -> None:  # type: ignore[no-untyped-def]
        for form, fn in forms(m).items():  # every form unless `names` picks some
            if not names or form in names:
                fn()
                row[label.format(form)] = round(_us(fn), 2)

    with torch.no_grad():
        time_forms("native_{}_us", native)
        time_forms("channel_{}_us", channel)
        cap = fp8_block.ONE_ROW_MAX_REGISTERS
        fp8_block.ONE_ROW_MAX_REGISTERS = None
        try:
            time_forms("native_{}_uncapped_us", native, ("plain", "normed_gated"))
        finally:
            fp8_block.ONE_ROW_MAX_REGISTERS = cap
    print(json.dumps(row))


def main() -> None:
    if sys.argv[1:] == ["gated"]:
        gated()
        return
    rows_list = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 16, 512]
    torch.manual_seed(0)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "blocks": "128x128", "dtype": "bfloat16"}))  # fmt: skip
    for label, (n, k) in SHAPES.items():
        native, channel = _projections(n, k)
        values = native.dequantized_weight(torch.float32)
        dense = values.bfloat16()
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda").bfloat16()
            exact = x.float() @ values.t()
            row: dict[str, object] = {"shape": label, "n": n, "k": k, "rows": rows,
                                      "library_blocks": native.library_scale is not None}  # fmt: skip
            cases = {
                "native": lambda m=native, x=x: m(x),
                "channel": lambda m=channel, x=x: m(x),
                "bf16": lambda w=dense, x=x: torch.nn.functional.linear(x, w),
            }
            if rows >= 16:  # the native module's other routes at these rows
                cases["native_widened"] = lambda m=native, x=x: torch.nn.functional.linear(
                    x, widen_blocks(m.weight, m.weight_scale, 128, torch.bfloat16)
                )
                cases["native_tile"] = lambda m=native, x=x: block_weight_matmul(
                    x, m.weight, m.weight_scale, 128
                )
            with torch.no_grad():
                for name, fn in cases.items():
                    out = fn()
                    err = float((out.float() - exact).norm() / exact.norm())
                    row[f"{name}_us"] = round(_us(fn), 2)
                    row[f"{name}_rel_err"] = round(err, 5)
            if rows >= 16:  # the library route's activation quantization alone
                row["quantize_groups_us"] = round(
                    _us(lambda x=x: quantize_groups(x, 128, rows_minor=True)), 2
                )
            if rows == 1:
                row.update(_chain_forms(label, x, native, channel))
            print(json.dumps(row))
            sys.stdout.flush()


def _chain_forms(label: str, x: torch.Tensor, native: Fp8BlockLinear, channel: Fp8Linear) -> dict:
    """At one row, runner V2's norm-chain forms of the product, native against channel
    (microseconds): o and down with the residual add and the next norm's weight in the
    epilogue, q/k/v and gate/up (gated) with the norm's 1/rms on their sums."""
    n = native.out_features
    if label in ("o", "down"):
        residual = torch.randn(1, n, device="cuda").bfloat16()
        norm_w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
        forms = {
            f"{name}_add_norm": lambda m=m: m.forward_add_norm(x, residual, norm_w)
            for name, m in (("native", native), ("channel", channel))
        }
    else:
        squares = torch.rand(256, device="cuda")
        gated = label == "gate_up"
        forms = {
            f"{name}_normed": lambda m=m: m.forward_normed(x, squares, 1e-5, gated=gated)
            for name, m in (("native", native), ("channel", channel))
        }
    return {f"{name}_us": round(_us(fn), 2) for name, fn in forms.items()}


if __name__ == "__main__":
    main()
