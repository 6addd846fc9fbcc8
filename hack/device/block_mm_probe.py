"""Whether this GPU's torch multiplies FP8 with block-wise scales in the library GEMM, and how
fast: activations scaled per row and 128 columns (1 x 128), weights per 128 x 128 block, the
layout of block-wise FP8 checkpoints (docs/fp8.md). Prints one JSON line per case: the scale
layouts tried, the error against float32, and microseconds beside the row-wise product the
engine runs for per-channel weights and a bf16 product.

Run on the GPU machine: `python3 hack/device/block_mm_probe.py`.
"""

from __future__ import annotations

import json
import sys

import torch

FP8 = torch.float8_e4m3fn


def _us(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    from triton.testing import do_bench

    return 1e3 * float(do_bench(fn, warmup=10, rep=reps, return_mode="median"))


def _quantize_blocks(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    blocks = w.view(n // rows, rows, k // cols, cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448  # [n/rows, k/cols]
    codes = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(FP8).view(n, k)
    return codes, scale.float()


def main() -> None:
    import torch.nn.functional as F

    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                      "scaled_mm": hasattr(F, "scaled_mm")}))  # fmt: skip
    if not hasattr(F, "scaled_mm"):
        return
    torch.manual_seed(0)
    n, k = 6144, 4096
    w = torch.randn(n, k, device="cuda") * 0.02
    w_codes, w_scale = _quantize_blocks(w, 128, 128)  # [48, 32]
    w_deq = (w_codes.float().view(n // 128, 128, k // 128, 128) * w_scale[:, None, :, None]).view(
        n, k
    )
    w_chan_scale = w.abs().amax(dim=1) / 448
    w_chan = (w / w_chan_scale[:, None]).clamp(-448, 448).to(FP8)
    for m in (16, 512, 2048):
        print(json.dumps(_case(m, w, w_codes, w_scale, w_deq, w_chan, w_chan_scale)))
        sys.stdout.flush()


def _case(  # type: ignore[no-untyped-def]
    m, w, w_codes, w_scale, w_deq, w_chan, w_chan_scale
) -> dict[str, object]:
    import torch.nn.functional as F

    recipe = F.ScalingType
    n, k = w.shape
    w_bf16 = w.bfloat16()
    x = torch.randn(m, k, device="cuda").bfloat16()
    x_codes, x_scale = _quantize_blocks(x.float(), 1, 128)  # [m, 32]
    x_deq = (x_codes.float().view(m, 1, k // 128, 128) * x_scale[:, None, :, None]).view(m, k)
    ref = x_deq @ w_deq.t()
    row: dict[str, object] = {"m": m, "n": n, "k": k}
    for label, sa, sb in (
        # torch 2.11 wants scale_a [M, K/128] with M contiguous and scale_b [K/128, N/128]
        ("scales_b_kn", x_scale.t().contiguous().t(), w_scale.t().contiguous()),
        ("scales_b_kn_view", x_scale.t().contiguous().t(), w_scale.t()),
    ):

        def block(sa: torch.Tensor = sa, sb: torch.Tensor = sb) -> torch.Tensor:
            return F.scaled_mm(x_codes, w_codes.t(), sa, recipe.BlockWise1x128, sb,
                               recipe.BlockWise128x128, output_dtype=torch.bfloat16)  # fmt: skip

        try:
            out = block()
            row[f"{label}_rel_err"] = round(
                float((out.float() - ref).abs().max() / ref.abs().max()), 5
            )
            row[f"{label}_us"] = round(_us(block), 2)
        except Exception as error:  # report, go on with the next layout
            row[f"{label}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    x_row_scale = x.float().abs().amax(dim=1, keepdim=True) / 448
    x_row = (x.float() / x_row_scale).clamp(-448, 448).to(FP8)
    row["rowwise_us"] = round(_us(lambda: torch._scaled_mm(
        x_row, w_chan.t(), scale_a=x_row_scale, scale_b=w_chan_scale.view(1, -1),
        out_dtype=torch.bfloat16)), 2)  # fmt: skip
    row["bf16_us"] = round(_us(lambda: x @ w_bf16.t()), 2)
    return row


if __name__ == "__main__":
    main()
