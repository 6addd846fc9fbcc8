"""The rounding every kernel that writes FP8 (e4m3) applies before its cast, the Hadamard
matrix the FP8 KV cache's keys are rotated with (`layers/fp8.py` says why), and the clamp of
activations into fp16 for products with FP8 values.

Reading FP8: kernels widen e4m3 with the hardware conversion (`.to(tl.float16)` /
`.to(tl.float32)` of a float8e4nv tile; on sm_89+ one instruction turns a pair of e4m3 values
into an fp16 pair, and fp16 to fp32 runs on the arithmetic pipe). An integer bit-placement
widening was tried instead (exact, no conversion unit) and measured slower on the H200, in the
matrix products and in attention alike (docs/bench-notes.md, after run 9).

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
    # x's sign bit onto r by bits: a negation compiles to `0 - r` on the GPU, which turns a
    # negative value that rounds to zero into +0.0 where torch's cast keeps -0.0
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def hadamard_tile(DIM: tl.constexpr, DTYPE: tl.constexpr):  # type: ignore[no-untyped-def]
    """The DIM x DIM Sylvester-Hadamard matrix, `(-1)^popcount(i & j)`, made in registers (no
    memory read): the parity of `i & j` by folding its bits (DIM <= 256: 8 bits), placed as the
    sign bit of 1.0 (integer operations only: no int-to-float conversion per element)."""
    i = tl.arange(0, DIM)[:, None]
    j = tl.arange(0, DIM)[None, :]
    p = i & j
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    odd = p & 1
    if tl.float32 == DTYPE:
        return ((odd << 31) | 0x3F800000).to(tl.float32, bitcast=True)
    elif tl.float16 == DTYPE:
        return ((odd << 15) | 0x3C00).to(tl.int16).to(tl.float16, bitcast=True)
    elif tl.bfloat16 == DTYPE:
        return ((odd << 15) | 0x3F80).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return (1 - 2 * odd).to(DTYPE)


@triton.jit
def hadamard_operand(h_ptr, DIM: tl.constexpr, DTYPE: tl.constexpr, FROM_MEMORY: tl.constexpr):  # type: ignore[no-untyped-def]
    """The DIM x DIM Hadamard tile as a product operand: loaded from `h_ptr` (a contiguous
    DIM x DIM matrix in DTYPE, `layers.fp8.hadamard`) with FROM_MEMORY, else made in registers
    (`hadamard_tile`; `h_ptr` unused)."""
    if FROM_MEMORY:
        rows = tl.arange(0, DIM)[:, None]
        cols = tl.arange(0, DIM)[None, :]
        return tl.load(h_ptr + rows * DIM + cols)
    else:
        return hadamard_tile(DIM, DTYPE)


@triton.jit
def to_f16_saturated(x):  # type: ignore[no-untyped-def]
    """Activations or queries to fp16 for a product with e4m3 values widened to fp16, clamped to
    fp16's range (bf16 reaches further; a value beyond +-65504 would become infinite)."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
