"""The rounding every kernel that writes FP8 (e4m3) applies before its cast, and the
Hadamard matrix the FP8 KV cache's keys are rotated with (`layers/fp8.py` says why).

Why the kernels round by hand before casting: the cast must give the same bits on the GPU,
under Triton's interpreter (which the CPU tests use) and in torch (`layers/fp8.py`, the
references). Triton's interpreter rounds some values wrongly when it casts to FP8 (values that
round up into the next power of two, and subnormals), while the cast of a value already on the
e4m3 grid is exact everywhere. Rounding first in float32, to nearest with ties to even and
saturating, gives one result on every path at the cost of a few arithmetic instructions.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(x):  # type: ignore[no-untyped-def]
    """float32 `x` rounded to the nearest e4m3 value (ties to even), saturated to +-448.

    Below 2^-6 e4m3 is subnormal with a fixed step of 2^-9, so the exponent is clamped there.
    Adding and subtracting `c = step * 2^23` rounds to a multiple of `step` in float32's own
    round-to-nearest-even (the sum lies in [2^23 step, 2^24 step), whose spacing is `step`).
    """
    a = tl.minimum(tl.abs(x), 448.0)
    exponent = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    # step = 2^(exponent - 3): three mantissa bits
    c = ((exponent - 3 + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign bit: -0.0 stays -0.0


@triton.jit
def hadamard_tile(DIM: tl.constexpr, DTYPE: tl.constexpr):  # type: ignore[no-untyped-def]
    """The DIM x DIM Sylvester-Hadamard matrix, `(-1)^popcount(i & j)`, made in registers (no
    memory read): the parity of `i & j` by folding its bits (DIM <= 256: 8 bits)."""
    i = tl.arange(0, DIM)[:, None]
    j = tl.arange(0, DIM)[None, :]
    p = i & j
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return (1 - 2 * (p & 1)).to(DTYPE)


@triton.jit
def e4m3_to_f16_scaled(x):  # type: ignore[no-untyped-def]
    """FP8 (e4m3) values `x`, as loaded from a float8_e4m3fn pointer, to float16 equal to
    `x * 2^-8`, by moving their bits into place: no conversion instruction runs.

    Why: Hopper converts FP8 to bf16 through fp16 and fp32 with conversion instructions that
    issue at a quarter of the arithmetic rate, and a kernel that widens every weight or cached
    key that way (a decode-time product, decode attention) becomes bound by them instead of by
    memory (measured: the FP8 kernels ran slower than bf16 ones reading twice the bytes).
    Sign to bit 15, exponent and mantissa to bits 7-13: an e4m3 number 2^(e-7) (1 + m/8) reads
    as the fp16 number 2^(e-15) (1 + m/8), and e4m3 subnormals land on fp16 subnormals, so the
    result is exact; callers fold the 2^8 into their scales.
    """
    u = x.to(tl.uint8, bitcast=True).to(tl.int16)
    bits = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def to_f16_saturated(x):  # type: ignore[no-untyped-def]
    """Activations to fp16 for a product with `e4m3_to_f16_scaled` values, clamped to fp16's
    range (bf16 reaches further; a value beyond +-65504 would become infinite)."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
