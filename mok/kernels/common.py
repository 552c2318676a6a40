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


E4M3_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn


@triton.jit
def to_e4m3(x, UPCAST: tl.constexpr):
    """fp32 x -> float8e4nv, rounding to nearest even and saturating: |x| > 448 (inf too) gives
    +-448, NaN stays NaN, as sm_89+'s cvt.rn.satfinite (the compiled cast) does. With UPCAST (the
    interpreter, whose fp8 casts can round the wrong way) the same by integer arithmetic on x's
    bits."""
    if UPCAST:
        x = tl.where(x > E4M3_MAX, E4M3_MAX, tl.where(x < -E4M3_MAX, -E4M3_MAX, x))
        bits = x.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        exponent = (mag >> 23).to(tl.int32)
        # |x| >= 2**-6 (e4m3's normals): 3 of 23 mantissa bits kept, the exponent rebiased
        # 127 -> 7 (120 << 3 = 960 in units of the kept bits).
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20).to(tl.int32) - 960
        # Below: multiples of 2**-9, the mantissa with its implicit bit shifted right by
        # 14 - (exponent - 127) >= 21, at most 25 (everything below 2**-10 rounds to 0; the
        # shift of the normals' lanes, unused, kept in range).
        full = (mag & 0x7FFFFF) | 0x800000
        shift = tl.maximum(tl.minimum(141 - exponent, 25), 1).to(tl.uint32)
        one = tl.full(full.shape, 1, tl.uint32)
        sub = ((full + (one << (shift - 1)) - 1 + ((full >> shift) & 1)) >> shift).to(tl.int32)
        code = tl.where(exponent >= 121, tl.minimum(normal, 126), sub)
        code = tl.where(mag > 0x7F800000, 127, code)  # NaN
        return (code.to(tl.uint32) | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def abs_max(x, AXIS: tl.constexpr, UPCAST: tl.constexpr):
    """max |x| along AXIS with NaN left out, 0 where all are NaN. Compiled, max.f32 returns the
    operand that is not NaN, so only the result is tested; the interpreter's max keeps NaN, so
    with UPCAST each value is."""
    magnitude = tl.abs(x)
    if UPCAST:
        return tl.max(tl.where(magnitude == magnitude, magnitude, 0.0), axis=AXIS)
    largest = tl.max(magnitude, axis=AXIS)
    return tl.where(largest == largest, largest, 0.0)


@triton.jit
def from_e4m3(q, UPCAST: tl.constexpr):
    """float8e4nv q -> fp32. With UPCAST the NaN codes (0x7F, 0xFF) read as NaN: the interpreter
    reads them as +-480."""
    x = q.to(tl.float32)
    if UPCAST:
        bits = q.to(tl.uint8, bitcast=True)
        x = tl.where((bits & 0x7F) == 0x7F, float("nan"), x)
    return x
