"""SwiGLU and its derivative, with the limit, for the Gluon kernels (fp32 register tiles); the
math and the +-inf form of kept pre-activations as mok.kernels.activation describes."""

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E = gl.constexpr(1.4426950408889634)
NAN = gl.constexpr(tl.PropagateNan.ALL)  # min and max that return a NaN operand


@gluon.jit
def clamp(gate, up, limit):
    """min(g, L), clamp(u, -L, L), NaN kept (mok.kernels.activation.clamp)."""
    return (gl.minimum(gate, limit, propagate_nan=NAN),
            gl.minimum(gl.maximum(up, -limit, propagate_nan=NAN), limit, propagate_nan=NAN))


@gluon.jit
def kept(gate, up, limit):
    """A clamped value as +-inf (NaN stays NaN)."""
    gate_kept = gl.where(gate > limit, float("inf"), gate)
    up_kept = gl.where(up > limit, float("inf"), up)
    up_kept = gl.where(up < -limit, float("-inf"), up_kept)
    return gate_kept, up_kept


@gluon.jit
def passes(gate, up, limit, KEPT: gl.constexpr):
    """Where the gradient passes the limit, from computed or (KEPT) kept pre-activations."""
    if KEPT:
        gate_pass = gate != float("inf")
        up_pass = (up != float("inf")) & (up != float("-inf"))
    else:
        gate_pass = gate <= limit
        up_pass = (up >= -limit) & (up <= limit)
    return gate_pass, up_pass


@gluon.jit
def swiglu(gate, up):
    """h = silu(g) * u = g * u / (1 + 2^(-g * log2(e))) (the forward's epilogue)."""
    return gl.fdiv(gate * up, 1.0 + gl.exp2(gate * -LOG2E), ieee_rounding=False)


@gluon.jit
def silu(gate):
    """(sigmoid(g), silu(g)) (the backward's epilogue)."""
    sig = 1 / (1 + gl.exp(-gate))
    return sig, gate * sig


@gluon.jit
def dswiglu(d_h, gate, up, sig, silu_gate):
    """(d_gate, d_up) of h = silu(g) * u, from `silu`'s values."""
    d_gate = d_h * up * (sig * (1.0 + gate * (1.0 - sig)))
    d_up = d_h * silu_gate
    return d_gate, d_up
