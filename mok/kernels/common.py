"""@triton.jit helpers shared by the kernels.

UPCAST is true under Triton's CPU interpreter, whose bf16 arithmetic differs from the GPU's:
tl.dot on bf16 multiplies the raw bit patterns, and fp32 -> bf16 casts truncate instead of
rounding to nearest even. With UPCAST the helpers compute what the GPU computes.
"""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def cast_to(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """x.to(dtype), rounding to nearest even as the GPU does."""
    if UPCAST:
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
