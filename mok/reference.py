"""The MoE layer in plain PyTorch (docs/design.md section 1), EP-aware: the `reference` backend of
mok.nn and the reference every test and benchmark compares against.

It is written for clarity, not speed: it synchronizes with the device, loops over experts and
differentiates through autograd (all_to_all_single with autograd when the experts are spread over
a process group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F

if TYPE_CHECKING:
    from mok.testing.inputs import MoEInputs


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with a limit L: silu(min(gate, L)) * clamp(up, -L, L)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def expert_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """w_down @ swiglu(w_gate @ x, w_up @ x) for rows x [N, H].

    w_gate, w_up [I, H]; w_down [H, I].
    """
    return swiglu(x @ w_gate.T, x @ w_up.T, limit) @ w_down.T


def _local_experts(rows, local_expert, w_gate, w_up, w_down, limit, dtype):
    # Experts without rows run too (on no rows): under a process group every rank's backward
    # must reach the same collectives, and its weights get zero gradients rather than None.
    out = rows.new_zeros(rows.shape[0], w_down.shape[1])
    for expert in range(w_gate.shape[0]):
        index = (local_expert == expert).nonzero().squeeze(1)
        y = expert_mlp(rows[index], w_gate[expert].to(dtype), w_up[expert].to(dtype),
                       w_down[expert].to(dtype), limit)
        out = out.index_copy(0, index, y)
    return out


def moe_reference(
    x: torch.Tensor,
    topk_experts: torch.Tensor,
    router_weights: torch.Tensor,
    w_shared_gate: torch.Tensor | None,
    w_shared_up: torch.Tensor | None,
    w_shared_down: torch.Tensor | None,
    w_routed_gate: torch.Tensor,
    w_routed_up: torch.Tensor,
    w_routed_down: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    group: dist.ProcessGroup | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """y [T, H] in compute_dtype, differentiable with respect to every floating input.

    x [T, H]; topk_experts [T, k] global expert ids; router_weights [T, k]; shared weights
    [I_s, H], [I_s, H], [H, I_s] or None; routed weights [E_local, I, H], [E_local, I, H],
    [E_local, H, I]. With a process group of size W, expert e lives on rank e // E_local and the
    token rows travel there and back with all_to_all_single.
    """
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    num_tokens, topk = topk_experts.shape
    num_local = w_routed_gate.shape[0]
    num_experts = num_local * world
    flat_expert = topk_experts.reshape(-1).long()
    if flat_expert.numel() and (flat_expert.min() < 0 or flat_expert.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts})")
    xc = x.to(compute_dtype)
    token = torch.arange(num_tokens, device=x.device).repeat_interleave(topk)
    rows = xc[token]
    routed = (w_routed_gate, w_routed_up, w_routed_down, swiglu_limit, compute_dtype)
    if world == 1:
        y_routes = _local_experts(rows, flat_expert, *routed)
    else:
        destination = flat_expert // num_local
        order = torch.argsort(destination, stable=True)
        send = torch.bincount(destination, minlength=world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        expert_recv = flat_expert.new_empty(sum(recv_splits))
        dist.all_to_all_single(expert_recv, flat_expert[order].contiguous(), recv_splits,
                               send_splits, group=group)
        rows_recv = dist_fn.all_to_all_single(
            rows.new_empty(sum(recv_splits), rows.shape[1]), rows[order].contiguous(),
            recv_splits, send_splits, group=group)
        y_recv = _local_experts(rows_recv, expert_recv - rank * num_local, *routed)
        y_sorted = dist_fn.all_to_all_single(
            y_recv.new_empty(rows.shape[0], y_recv.shape[1]), y_recv, send_splits, recv_splits,
            group=group)
        y_routes = y_sorted[torch.argsort(order)]
    weights = router_weights.to(compute_dtype).reshape(-1, 1)
    y = (y_routes * weights).view(num_tokens, topk, x.shape[1]).sum(dim=1)  # T may be 0
    if w_shared_gate is not None:
        y = y + expert_mlp(xc, w_shared_gate.to(compute_dtype), w_shared_up.to(compute_dtype),
                           w_shared_down.to(compute_dtype), swiglu_limit)
    return y


def moe_reference_grads(inputs, *, swiglu_limit=None, group=None,
                        compute_dtype: torch.dtype = torch.float32):
    """(y, gradients in MoK's backward order) of the reference for `inputs` (MoEInputs).

    The gradients are those of sum(y * inputs.d_output): (d_x, d_router_weights,
    d_w_routed_gate, d_w_routed_up, d_w_routed_down, d_w_shared_gate, d_w_shared_up,
    d_w_shared_down), None for absent shared weights.
    """
    leaves = [t.detach().to(compute_dtype).requires_grad_(True) if t is not None else None
              for t in (inputs.x, inputs.router_weights, *inputs.routed_weights,
                        *inputs.shared_weights)]
    x, router_weights, w_rg, w_ru, w_rd, w_sg, w_su, w_sd = leaves
    y = moe_reference(x, inputs.topk_experts, router_weights, w_sg, w_su, w_sd, w_rg, w_ru, w_rd,
                      swiglu_limit=swiglu_limit, group=group, compute_dtype=compute_dtype)
    y.backward(inputs.d_output.to(compute_dtype))
    return y.detach(), tuple(t.grad if t is not None else None for t in leaves)


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_e4m3(x: torch.Tensor, block: tuple[int, int], *,
                  pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise float8_e4m3fn quantization of x [..., M, K] in blocks of block = (rows,
    columns) (the edge blocks cut short): (q [..., M, K] float8_e4m3fn, scales [..., ceil(M /
    rows), ceil(K / columns)] fp32), x = q * scale up to e4m3's rounding (mok.kernels.quantize
    gives the rule). Block (1, 128): activations' scales per row; (128, 128): weights'."""
    rows, cols = block
    *batch, m, k = x.shape
    pad_m, pad_k = -m % rows, -k % cols
    x32 = F.pad(x.float(), (0, pad_k, 0, pad_m))
    tiles = x32.reshape(*batch, (m + pad_m) // rows, rows, (k + pad_k) // cols, cols)
    magnitude = tiles.abs().nan_to_num(nan=0.0, posinf=float("inf"))
    amax = magnitude.amax(dim=(-3, -1))
    # Tensor by tensor: `scalar / tensor` multiplies by a reciprocal, rounding twice.
    largest = torch.full_like(amax, E4M3_MAX)
    # a block of zeros: scale 1; amax at least 448 * 2**-126 (448 / amax stays finite)
    amax = torch.where(amax == 0, largest, amax.clamp_min(E4M3_MAX * 2.0 ** -126))
    if pow2_scales:
        bits = (amax / largest).view(torch.int32)
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).int()
        scale = (exponent << 23).view(torch.float32)
        inverse = torch.ones_like(scale) / scale
    else:
        scale = amax / largest
        inverse = largest / amax
    scaled = tiles * inverse[..., :, None, :, None]
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*batch, m + pad_m, k + pad_k)[..., :m, :k]
    return q.contiguous(), scale


def dequantize_e4m3(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale of its block, in dtype (the inverse of quantize_e4m3 up to its rounding)."""
    rows, cols = block
    m, k = q.shape[-2:]
    expanded = scales.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
    return (q.float() * expanded[..., :m, :k]).to(dtype)


def _quantized(a: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """a quantized to e4m3 in blocks of `block` and dequantized back, fp32."""
    return dequantize_e4m3(*quantize_e4m3(a, block), block)


def _rows_quantized(a: torch.Tensor) -> torch.Tensor:
    """a [N, K] quantized to e4m3 along its rows (a scale per column and block of 128 rows from
    the first) and dequantized back, fp32."""
    return _quantized(a.T, (1, 128)).T


def _fp8_expert(xq, x, dq, d_out, weight, w_gate, w_up, w_down, limit, dtype, fp8_wgrad=False):
    """One expert's share of the FP8 recipe over its N routes (fp32 math).

    xq, dq: the routes' rows of x and d_out quantized (fp32); x, d_out: the same rows as given;
    weight [N] fp32; w_gate, w_up [I, H], w_down [H, I]: the quantized weights (fp32);
    fp8_wgrad: the weight gradients' operands quantized along the rows.
    Returns (y_rows [N, H], d_x_rows [N, H], d_weight [N], d_w_gate, d_w_up, d_w_down).
    """
    def rnd(v):
        return v.to(dtype).float()

    gate, up = xq @ w_gate.T, xq @ w_up.T
    h = _quantized(swiglu(gate, up, limit), (1, 128))
    y_rows = rnd(weight[:, None] * (h @ w_down.T))
    # The backward reads the pre-activations stored in dtype; under the limit, whether a value
    # was clamped is decided on the fp32 value (the kernels keep a clamped one as +-inf).
    gate_b, up_b = rnd(gate), rnd(up)
    h_b = swiglu(gate_b, up_b, limit)
    dh0 = dq @ w_down
    d_weight = (dh0 * h_b).sum(dim=1)
    d_h = weight[:, None] * dh0
    if limit is not None:
        gate_b, up_b = gate_b.clamp(max=limit), up_b.clamp(-limit, limit)
    sig = torch.sigmoid(gate_b)
    d_gate = d_h * up_b * (sig * (1.0 + gate_b * (1.0 - sig)))
    d_up = d_h * (gate_b * sig)
    if limit is not None:
        d_gate = torch.where(gate <= limit, d_gate, 0.0)
        d_up = torch.where((up >= -limit) & (up <= limit), d_up, 0.0)
    d_gate_up = torch.cat((d_gate, d_up), dim=1)
    d_gate_up_q = torch.cat((_quantized(d_gate, (1, 128)), _quantized(d_up, (1, 128))), dim=1)
    d_x_rows = rnd(d_gate_up_q @ torch.cat((w_gate, w_up), dim=0))
    d_gate_up_b = rnd(d_gate_up)
    x32 = x.float()
    d_out_w, h_w = weight[:, None] * d_out.float(), rnd(h_b)
    if fp8_wgrad:  # from the e4m3 rows of d_gate_up, x and d_output, and from h
        d_gate_up_b, x32, d_out_w, h_w = map(_rows_quantized, (
            d_gate_up_q, xq, weight[:, None] * dq, h_w))
    d_w_gate = d_gate_up_b[:, :w_gate.shape[0]].T @ x32
    d_w_up = d_gate_up_b[:, w_gate.shape[0]:].T @ x32
    d_w_down = d_out_w.T @ h_w
    return y_rows, d_x_rows, d_weight, d_w_gate, d_w_up, d_w_down


def moe_reference_fp8_grads(
    inputs: MoEInputs, *, swiglu_limit: float | None = None, fp8_weight_gradients: bool = False
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """(y, gradients) of the layer's FP8 recipe (docs/design.md section 3.5) in plain PyTorch.

    `inputs` is a MoEInputs (one process, no group); the gradients are those of
    sum(y * inputs.d_output) in moe_reference_grads' order: (d_x, d_router_weights,
    d_w_routed_gate, d_w_routed_up, d_w_routed_down, d_w_shared_gate, d_w_shared_up,
    d_w_shared_down), None for absent shared weights.

    Q(a) below is quantize_e4m3 then dequantize_e4m3 (fp32): rows in 1x128 blocks, weights in
    128x128 blocks of each expert's matrix. dt is x.dtype; all math is fp32 otherwise.

    Forward, per route (token t, expert e, router weight w; the shared expert with w = 1):
    g, u = Q(x)[t] @ Q(w_gate)[e]^T, Q(x)[t] @ Q(w_up)[e]^T; h = swiglu(g, u); the route's row
    w * Q(h) @ Q(w_down)[e]^T is rounded to dt; y[t] sums the shared expert's row then the
    routes' rows in the order j = 0..k-1 in fp32 and is rounded to dt.

    Backward: the pre-activations g, u are rounded to dt and h_b = swiglu of them;
    dh0 = Q(d_output)[t] @ Q(w_down)[e]; d_router_weights = sum(dh0 * h_b); d_gate, d_up =
    dSwiGLU(w * dh0) at the rounded pre-activations (zero where the fp32 value was clamped);
    d_x[t] = sum of [Q(d_gate), Q(d_up)] @ [Q(w_gate)[e]; Q(w_up)[e]] (each half its own
    blocks), each rounded to dt, over the shared expert then the routes, in fp32, rounded to
    dt. Weight gradients on dt operands, fp32 sums:
    d_w_gate[e], d_w_up[e] = sum of round(d_gate), round(d_up) outer x[t]; d_w_down[e] = sum of
    (w * d_output[t]) outer round(h_b). An expert without routes gets zero gradients. With
    fp8_weight_gradients the operands are quantized along the routes, Q^r(a) with a scale per
    column and block of 128 of an expert's routes in route order, from the e4m3 rows where the
    backward has them (DeepSeek-V3's recipe: dequantized, then quantized along the routes):
    d_w_gate[e], d_w_up[e] = sum of Q^r([Q(d_gate), Q(d_up)]) outer Q^r(Q(x)[t]); d_w_down[e] =
    sum of Q^r(w * Q(d_output)[t]) outer Q^r(round(h_b)).

    Returns y [T, H] and d_x [T, H] in dt, the other gradients in fp32.
    """
    x, topk_experts, d_output = inputs.x, inputs.topk_experts, inputs.d_output
    routed = inputs.routed_weights
    shared = inputs.shared_weights
    num_tokens, topk = topk_experts.shape
    num_experts = routed[0].shape[0]
    expert = topk_experts.reshape(-1).long()
    if expert.numel() and (expert.min() < 0 or expert.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts})")
    dtype, limit = x.dtype, swiglu_limit
    xq, dq = _quantized(x, (1, 128)), _quantized(d_output, (1, 128))
    token = torch.arange(num_tokens, device=x.device).repeat_interleave(topk)
    weight = inputs.router_weights.reshape(-1).float()

    y_routes = xq.new_zeros(token.shape[0], x.shape[1])
    d_x_routes = torch.zeros_like(y_routes)
    d_router = weight.new_zeros(token.shape[0])
    d_routed = [torch.zeros(w.shape, device=w.device) for w in routed]
    routed_q = [_quantized(w, (128, 128)) for w in routed]
    for e in range(num_experts):
        index = (expert == e).nonzero().squeeze(1)
        rows = token[index]
        out = _fp8_expert(xq[rows], x[rows], dq[rows], d_output[rows], weight[index],
                          *(w[e] for w in routed_q), limit, dtype, fp8_weight_gradients)
        y_routes[index], d_x_routes[index], d_router[index] = out[:3]
        for grad, g in zip(d_routed, out[3:], strict=True):
            grad[e] = g

    y = torch.zeros_like(xq)
    d_x = torch.zeros_like(xq)
    d_shared = [None, None, None]
    if shared[0] is not None:
        out = _fp8_expert(xq, x, dq, d_output, weight.new_ones(num_tokens),
                          *(_quantized(w, (128, 128)) for w in shared), limit, dtype,
                          fp8_weight_gradients)
        y, d_x = out[0], out[1]
        d_shared = list(out[3:])
    y_routes = y_routes.view(num_tokens, topk, x.shape[1])
    d_x_routes = d_x_routes.view(num_tokens, topk, x.shape[1])
    for j in range(topk):  # the combine's order
        y = y + y_routes[:, j]
        d_x = d_x + d_x_routes[:, j]
    return y.to(dtype), (d_x.to(dtype), d_router.view(num_tokens, topk), *d_routed, *d_shared)
