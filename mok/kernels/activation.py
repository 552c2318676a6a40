"""SwiGLU and its derivative, with the limit, for the Triton kernels (fp32 tiles).

    swiglu(g, u) = silu(g) * u,  silu(g) = g * sigmoid(g)
    with a limit L: swiglu(min(g, L), clamp(u, -L, L)); the gradient of a clamped value is 0.

The forward that keeps its pre-activations stores a clamped value as +-inf (`kept`), so that
rounding to the storage dtype cannot move it back across the limit; `passes` reads either form.
mok.kernels.gluon_activation holds the same for the Gluon kernels.
"""

import triton
import triton.language as tl

NAN = tl.constexpr(tl.PropagateNan.ALL)  # min and max that return a NaN operand


@triton.jit
def clamp(gate, up, limit):
    """The pre-activations under the limit L: min(g, L), clamp(u, -L, L), NaN kept (a GPU's
    plain min and max return the other operand of a NaN)."""
    return (tl.minimum(gate, limit, propagate_nan=NAN),
            tl.minimum(tl.maximum(up, -limit, propagate_nan=NAN), limit, propagate_nan=NAN))


@triton.jit
def kept(gate, up, limit):
    """The pre-activations as a forward keeps them under the limit: a clamped value as +-inf
    (NaN stays NaN)."""
    gate_kept = tl.where(gate > limit, float("inf"), gate)
    up_kept = tl.where(up > limit, float("inf"), up)
    up_kept = tl.where(up < -limit, float("-inf"), up_kept)
    return gate_kept, up_kept


@triton.jit
def passes(gate, up, limit, KEPT: tl.constexpr):
    """Where the gradient passes the limit (the value was not clamped), from the
    pre-activations as computed or, KEPT, as `kept` stored them."""
    if KEPT:
        gate_pass = gate != float("inf")
        up_pass = (up != float("inf")) & (up != float("-inf"))
    else:
        gate_pass = gate <= limit
        up_pass = (up >= -limit) & (up <= limit)
    return gate_pass, up_pass


@triton.jit
def silu(gate):
    """(sigmoid(g), silu(g))."""
    sig = tl.sigmoid(gate)
    return sig, gate * sig


@triton.jit
def swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """h = silu(g) * u, the pre-activations clamped first with a limit."""
    if HAS_LIMIT:
        gate, up = clamp(gate, up, limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def dswiglu(d_h, gate, up, sig, silu_gate):
    """(d_gate, d_up) of h = silu(g) * u at the (clamped) pre-activations, from `silu`'s
    values; mask them with `passes` under a limit."""
    d_gate = d_h * up * (sig * (1.0 + gate * (1.0 - sig)))
    d_up = d_h * silu_gate
    return d_gate, d_up
