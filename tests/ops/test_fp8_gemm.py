"""The forward's FP8 row GEMMs (mok.ops.fp8) against the same math on the dequantized operands
in fp32: gate/up with SwiGLU (h in e4m3 with its scales, or in bf16) and down."""

import dataclasses

import pytest
import torch

import mok.reference as reference
from mok import ops
from mok.errors import MoKInputError
from mok.ops import build_routing
from mok.ops import fp8 as fp8_ops
from mok.ops.fp8 import (
    d_x_rows_fp8,
    down_proj_fp8,
    dswiglu_fp8,
    gate_up_fp8,
    gate_up_swiglu_fp8,
    quantize_experts,
)
from mok.ops.quantize import QUANT_BLOCK, Quantized, quantize_rows, quantize_weights
from mok.ops.tuning import RowTiles
from mok.testing import RoutingPattern, make_topk

ALIGN = 16
TILES = RowTiles(16, 64, QUANT_BLOCK, group_m=2, num_warps=4, num_stages=2)
H_TILES = RowTiles(16, 128, QUANT_BLOCK, group_m=2, num_warps=4, num_stages=2)


def setup(device, *, tokens=37, hidden=256, inter=200, experts=4, topk=2, seed=0, align=ALIGN):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator).bfloat16().to(device)
    weights = [(torch.randn(experts, n, k, generator=generator) / k ** 0.5).bfloat16().to(device)
               for n, k in ((inter, hidden), (inter, hidden), (hidden, inter))]
    topk_experts = make_topk(tokens, experts, topk, RoutingPattern.RANDOM, generator).to(device)
    router_weights = torch.rand(tokens * topk, generator=generator).to(device)
    flags = torch.zeros(4, dtype=torch.int32, device=device)
    routing = build_routing(topk_experts, flags, num_experts=experts, first_local_expert=0,
                            num_local_experts=experts, align=align,
                            route_capacity=tokens * topk)
    return x, weights, topk_experts, router_weights, routing


def dequantized(q: Quantized, block) -> torch.Tensor:
    return reference.dequantize_e4m3(q.data, q.scales, block)


def used(routing) -> int:
    """Rows the schedule uses (the launches leave the rows past them unwritten)."""
    return int(routing.used_rows)


def route_rows(routing):
    """(rows in use, their routes, tokens, experts) of the schedule."""
    row_route = routing.row_route.long()
    rows = (row_route >= 0).nonzero().flatten()
    routes = row_route[rows]
    tokens = routes // routing.topk
    block_expert = routing.block_expert.long()
    return rows, routes, tokens, block_expert[rows // routing.align]


def gate_up_reference(xq, gate_q, up_q, routing, limit=None):
    """h [C, I] fp32 from the dequantized operands, 0 on padding rows."""
    x = dequantized(xq, (1, QUANT_BLOCK))
    gate, up = (dequantized(w, (QUANT_BLOCK, QUANT_BLOCK)) for w in (gate_q, up_q))
    rows, _, tokens, experts = route_rows(routing)
    h = torch.zeros(routing.capacity_rows, gate.shape[1], device=x.device)
    g = torch.einsum("rk,rnk->rn", x[tokens], gate[experts])
    u = torch.einsum("rk,rnk->rn", x[tokens], up[experts])
    h[rows] = reference.swiglu(g, u, limit)
    return h


@pytest.mark.parametrize("limit", [None, 1.5], ids=["plain", "limit"])
def test_gate_up_fp8_matches_dequantized_math(device, limit):
    x, (w_g, w_u, _), _, _, routing = setup(device)
    xq = quantize_rows(x)
    gate_q, up_q = quantize_weights(w_g), quantize_weights(w_u)
    expected = gate_up_reference(xq, gate_q, up_q, routing, limit)
    h = gate_up_swiglu_fp8(xq, gate_q, up_q, routing, TILES, limit, quantize_h=False,
                           out_dtype=torch.float32)
    # The same products summed in another order: fp32 rounding apart.
    n = used(routing)
    torch.testing.assert_close(h[:n], expected[:n], rtol=1e-5, atol=1e-5)
    again = gate_up_swiglu_fp8(xq, gate_q, up_q, routing, TILES, limit, quantize_h=False,
                               out_dtype=torch.float32)
    assert torch.equal(h[:n], again[:n])


def test_gate_up_fp8_quantizes_h_with_row_block_scales(device):
    x, (w_g, w_u, _), _, _, routing = setup(device, seed=1)
    xq = quantize_rows(x)
    gate_q, up_q = quantize_weights(w_g), quantize_weights(w_u)
    h32 = gate_up_swiglu_fp8(xq, gate_q, up_q, routing, H_TILES, quantize_h=False,
                             out_dtype=torch.float32)
    hq = gate_up_swiglu_fp8(xq, gate_q, up_q, routing, H_TILES, quantize_h=True)
    assert hq.data.dtype == torch.float8_e4m3fn
    assert hq.scales.shape == (routing.capacity_rows, 2)
    # The epilogue quantizes the fp32 values the unquantized launch stores: as quantize_e4m3.
    n = used(routing)
    q_ref, scales_ref = reference.quantize_e4m3(h32[:n], (1, QUANT_BLOCK))
    assert torch.equal(hq.scales[:n], scales_ref)
    assert torch.equal(hq.data[:n].view(torch.uint8), q_ref.view(torch.uint8))
    padding = routing.row_route[:n] < 0
    assert padding.any()
    assert (hq.data[:n].float()[padding] == 0).all() and (hq.scales[:n][padding] == 1).all()


# Down and d_x may take tiles wider than a scale block: a weight scale per 128 columns.
WIDE_TILES = RowTiles(16, 256, QUANT_BLOCK, group_m=2, num_warps=4, num_stages=2)


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "shared"])
@pytest.mark.parametrize("limit", [None, 1.5], ids=["plain", "limit"])
def test_dswiglu_fp8_apart_is_the_one_launch_bit_for_bit(device, limit, weighted,
                                                        monkeypatch):
    # Two launches (the GEMM into fp32, then the dSwiGLU over it; its blocks in either grid
    # order) against one: every output of every used row, padding rows too, the same bits (on
    # a GPU the router-weight gradient's partial sums within 1e-5).
    x, (w_g, w_u, w_d), _, router_weights, routing = setup(device, inter=256, seed=12)
    gate_up = gate_up_fp8(quantize_rows(x), quantize_weights(w_g), quantize_weights(w_u),
                          routing, H_TILES, limit)
    d_out_q = quantize_rows(torch.randn_like(x))
    w_down_t = quantize_weights(w_d.transpose(1, 2))
    weights = router_weights if weighted else None
    results, partials = [], []
    for apart, columns_first in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(fp8_ops, "_DSWIGLU_COLUMNS_FIRST", columns_first)
        kept = gate_up.clone()
        q, h, partial = dswiglu_fp8(d_out_q, w_down_t, kept, routing, H_TILES, weights, limit,
                                    apart=apart)
        results.append((q.data, q.scales, h, kept))
        partials.append(partial)
    n = used(routing)
    assert n > 0
    for other in results[1:]:
        for one, two in zip(results[0], other, strict=True):
            assert torch.equal(one[:n].view(torch.uint8), two[:n].view(torch.uint8))
    assert all((partial is None) == (not weighted) for partial in partials)
    if weighted:
        one, two, three = (partial[:n] for partial in partials)
        assert torch.equal(two.view(torch.uint8), three.view(torch.uint8))  # the same kernel
        if one.is_cuda:  # compiled, the two kernels sum each 128 columns in other orders
            torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(one.view(torch.uint8), two.view(torch.uint8))


def test_launchers_refuse_router_weights_not_in_route_order(device):
    # The kernels read route r's weight at flat index r: a [T, k] view in column-major order
    # (the right values, other strides) was read wrongly with no error; now refused, as are
    # other sizes.
    x, (w_g, w_u, w_d), _, router_weights, routing = setup(device, inter=256, seed=13)
    strided = router_weights.view(-1, 2).t().contiguous().t()
    assert torch.equal(strided, router_weights.view(-1, 2)) and not strided.is_contiguous()
    gate_up = gate_up_fp8(quantize_rows(x), quantize_weights(w_g), quantize_weights(w_u),
                          routing, H_TILES)
    h = torch.randn(routing.capacity_rows, 256, device=device).bfloat16()
    for bad in (strided, router_weights[:-1]):
        with pytest.raises(MoKInputError, match="router_weights"):
            dswiglu_fp8(quantize_rows(x), quantize_weights(w_d.transpose(1, 2)), gate_up.clone(),
                        routing, H_TILES, bad)
        with pytest.raises(MoKInputError, match="router_weights"):
            down_proj_fp8(quantize_rows(h), quantize_weights(w_d), routing, TILES, bad)
        with pytest.raises(MoKInputError, match="router_weights"):
            ops.down_proj(h, w_d, routing, ops.small_tiles(16, ALIGN).pick(
                "down", 256, 256, dtype=torch.bfloat16), bad)
        with pytest.raises(MoKInputError, match="router_weights"):
            ops.copy_rows(x, routing, gather=True, router_weights=bad)


@pytest.mark.parametrize(("tiles", "hidden"), [(TILES, 256), (WIDE_TILES, 384)],
                         ids=["narrow", "wide"])
def test_down_fp8_matches_dequantized_math(device, tiles, hidden):
    x, (w_g, w_u, w_d), _, router_weights, routing = setup(device, seed=2, hidden=hidden)
    hq = gate_up_swiglu_fp8(quantize_rows(x), quantize_weights(w_g), quantize_weights(w_u),
                            routing, H_TILES)
    down_q = quantize_weights(w_d)
    out = down_proj_fp8(hq, down_q, routing, tiles, router_weights, out_dtype=torch.float32)
    h = dequantized(hq, (1, QUANT_BLOCK))
    down = dequantized(down_q, (QUANT_BLOCK, QUANT_BLOCK))
    rows, routes, _, experts = route_rows(routing)
    expected = torch.zeros(routing.capacity_rows, w_d.shape[1], device=device)
    expected[rows] = (torch.einsum("rk,rnk->rn", h[rows], down[experts])
                      * router_weights[routes, None])
    n = used(routing)
    torch.testing.assert_close(out[:n], expected[:n], rtol=1e-5, atol=1e-5)
    unweighted = down_proj_fp8(hq, down_q, routing, TILES, out_dtype=torch.bfloat16)
    assert unweighted.dtype == torch.bfloat16
    torch.testing.assert_close(unweighted[rows].float() * router_weights[routes, None],
                               expected[rows], rtol=1e-2, atol=1e-2)


def test_fp8_forward_is_close_to_bf16_reference(device):
    # What FP8 costs against the bf16 layer's math. e4m3 keeps 3 mantissa bits: rounding one
    # operand costs about 2-3.6% RMS, and x, the weights and h are each rounded once (6.5% in
    # all here, measured); elementwise the errors are unbiased, so they do not grow with K.
    x, (w_g, w_u, w_d), topk_experts, router_weights, routing = setup(device, seed=3)
    hq = gate_up_swiglu_fp8(quantize_rows(x), quantize_weights(w_g), quantize_weights(w_u),
                            routing, H_TILES)
    rows_out = down_proj_fp8(hq, quantize_weights(w_d), routing, TILES, router_weights,
                             out_dtype=torch.float32)
    rows, routes, tokens, experts = route_rows(routing)
    y = torch.zeros(x.shape[0], x.shape[1], device=device).index_add_(0, tokens, rows_out[rows])
    y_ref = torch.zeros_like(y)
    for e in range(w_g.shape[0]):
        mine = experts == e
        h = reference.swiglu(x[tokens[mine]].float() @ w_g[e].float().T,
                             x[tokens[mine]].float() @ w_u[e].float().T)
        y_ref.index_add_(0, tokens[mine],
                         (h @ w_d[e].float().T) * router_weights[routes[mine], None])
    relative = (y - y_ref).norm() / y_ref.norm()
    assert relative < 0.08, relative


def kept_reference(gate, up, limit):
    """The pre-activations as the forward that keeps them stores them (+-inf where clamped)."""
    if limit is None:
        return gate, up
    gate = torch.where(gate > limit, float("inf"), gate)
    up = torch.where(up > limit, float("inf"), torch.where(up < -limit, -float("inf"), up))
    return gate, up


@pytest.mark.parametrize("limit", [None, 1.5], ids=["plain", "limit"])
def test_gate_up_fp8_keeps_the_pre_activations(device, limit):
    x, (w_g, w_u, _), _, _, routing = setup(device, inter=256, seed=4)
    xq, gate_q, up_q = quantize_rows(x), quantize_weights(w_g), quantize_weights(w_u)
    gate_up = gate_up_fp8(xq, gate_q, up_q, routing, TILES, limit, out_dtype=torch.float32)
    x_dq = dequantized(xq, (1, QUANT_BLOCK))
    gate_w, up_w = (dequantized(w, (QUANT_BLOCK, QUANT_BLOCK)) for w in (gate_q, up_q))
    rows, _, tokens, experts = route_rows(routing)
    gate, up = kept_reference(torch.einsum("rk,rnk->rn", x_dq[tokens], gate_w[experts]),
                              torch.einsum("rk,rnk->rn", x_dq[tokens], up_w[experts]), limit)
    torch.testing.assert_close(gate_up[rows], torch.cat([gate, up], 1), rtol=1e-5, atol=1e-5)
    n = used(routing)
    padding = (routing.row_route[:n] < 0).nonzero().flatten()
    assert (gate_up[padding] == 0).all()


@pytest.mark.parametrize("limit", [None, 1.5], ids=["plain", "limit"])
def test_gate_up_swiglu_fp8_keeps_what_gate_up_fp8_stores(device, limit):
    # The forward that keeps its pre-activations stores them from the same products as h.
    x, (w_g, w_u, _), _, _, routing = setup(device, inter=256, seed=5)
    xq, gate_q, up_q = quantize_rows(x), quantize_weights(w_g), quantize_weights(w_u)
    expected = gate_up_fp8(xq, gate_q, up_q, routing, H_TILES, limit)
    kept = torch.full_like(expected, float("nan"))
    h = gate_up_swiglu_fp8(xq, gate_q, up_q, routing, H_TILES, limit, gate_up=kept)
    h_alone = gate_up_swiglu_fp8(xq, gate_q, up_q, routing, H_TILES, limit)
    n = used(routing)
    assert torch.equal(kept[:n], expected[:n])
    assert torch.equal(h.data[:n].view(torch.uint8), h_alone.data[:n].view(torch.uint8))
    assert torch.equal(h.scales[:n], h_alone.scales[:n])


def dswiglu_reference(dh0, gate, up, weights, limit):
    """(d_gate, d_up, h, the router-weight gradient's terms dh0 * h) of kept pre-activations."""
    gate_pass = gate != float("inf")
    up_pass = up.abs() != float("inf")
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    h = silu * up
    d_h = dh0 * weights[:, None]
    d_gate = torch.where(gate_pass, d_h * up * (sig * (1 + gate * (1 - sig))), 0.0)
    d_up = torch.where(up_pass, d_h * silu, 0.0)
    return d_gate, d_up, h, dh0 * h


@pytest.mark.parametrize("limit", [None, 1.5], ids=["plain", "limit"])
def test_dswiglu_fp8_matches_dequantized_math(device, limit):
    x, (w_g, w_u, w_d), _, router_weights, routing = setup(device, inter=256, seed=5)
    gate_up = gate_up_fp8(quantize_rows(x), quantize_weights(w_g), quantize_weights(w_u),
                          routing, H_TILES, limit)
    kept = gate_up.clone()
    generator = torch.Generator().manual_seed(9)
    d_out = torch.randn(x.shape, generator=generator).bfloat16().to(device)
    d_out_q = quantize_rows(d_out)
    w_down_t = quantize_weights(w_d.transpose(1, 2))
    d_gate_up_q, h, partial = dswiglu_fp8(d_out_q, w_down_t, gate_up, routing, H_TILES,
                                          router_weights, limit)
    rows, routes, tokens, experts = route_rows(routing)
    dh0 = torch.einsum("rk,rnk->rn", dequantized(d_out_q, (1, QUANT_BLOCK))[tokens],
                       dequantized(w_down_t, (QUANT_BLOCK, QUANT_BLOCK))[experts])
    inter = w_d.shape[2]
    d_gate, d_up, h_ref, terms = dswiglu_reference(
        dh0, kept[rows, :inter].float(), kept[rows, inter:].float(), router_weights[routes],
        limit)
    bf16 = dict(rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(h[rows].float(), h_ref, **bf16)
    torch.testing.assert_close(gate_up[rows].float(), torch.cat([d_gate, d_up], 1), **bf16)
    torch.testing.assert_close(partial[rows], terms.reshape(len(rows), -1, 128).sum(-1),
                               rtol=1e-4, atol=1e-4)
    # e4m3: each value within half a unit of its 3 mantissa bits, or of the block's subnormal
    # step; each block's scale its largest value over 448.
    expected = torch.cat([d_gate, d_up], 1)
    block_scales = expected.abs().reshape(len(rows), -1, 128).amax(-1) / 448
    block_scales = torch.where(block_scales == 0, 1.0, block_scales)
    torch.testing.assert_close(d_gate_up_q.scales[rows], block_scales, rtol=1e-5, atol=0)
    back = dequantized(d_gate_up_q, (1, QUANT_BLOCK))[rows]
    step = d_gate_up_q.scales[rows].repeat_interleave(128, dim=1)
    assert ((back - expected).abs() <= expected.abs() * 2.0 ** -4 + step * 2.0 ** -9).all()


@pytest.mark.parametrize(("tiles", "hidden"), [(TILES, 256), (WIDE_TILES, 384)],
                         ids=["narrow", "wide"])
def test_d_x_fp8_matches_dequantized_math(device, tiles, hidden):
    x, (w_g, w_u, w_d), _, router_weights, routing = setup(device, inter=256, seed=6,
                                                           hidden=hidden)
    gate_up = gate_up_fp8(quantize_rows(x), quantize_weights(w_g), quantize_weights(w_u),
                          routing, H_TILES)
    d_out_q = quantize_rows(torch.randn_like(x))
    d_gate_up_q, _, _ = dswiglu_fp8(d_out_q, quantize_weights(w_d.transpose(1, 2)), gate_up,
                                    routing, H_TILES, router_weights)
    w_gate_up_t = quantize_weights(torch.cat([w_g, w_u], dim=1).transpose(1, 2))
    rows_out = d_x_rows_fp8(d_gate_up_q, w_gate_up_t, routing, tiles, out_dtype=torch.float32)
    rows, _, _, experts = route_rows(routing)
    expected = torch.einsum("rk,rnk->rn", dequantized(d_gate_up_q, (1, QUANT_BLOCK))[rows],
                            dequantized(w_gate_up_t, (QUANT_BLOCK, QUANT_BLOCK))[experts])
    torch.testing.assert_close(rows_out[rows], expected, rtol=1e-5, atol=1e-5)


def test_fp8_input_gradient_is_close_to_bf16_math(device):
    # d_x through the FP8 backward (dSwiGLU over FP8 gate/up pre-activations, FP8 d_x)
    # against autograd on the bf16 operands in fp32: e4m3 roundings of d_out, the transposed
    # weights and d_gate_up, plus the forward's of x and the gate/up weights (6.5% here).
    x, (w_g, w_u, w_d), _, router_weights, routing = setup(device, inter=256, seed=7)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).bfloat16().to(device)
    gate_up = gate_up_fp8(quantize_rows(x), quantize_weights(w_g), quantize_weights(w_u),
                          routing, H_TILES)
    d_gate_up_q, _, _ = dswiglu_fp8(quantize_rows(d_out), quantize_weights(w_d.transpose(1, 2)),
                                    gate_up, routing, H_TILES, router_weights)
    rows_out = d_x_rows_fp8(d_gate_up_q, quantize_weights(torch.cat([w_g, w_u], 1).transpose(1, 2)),
                            routing, TILES, out_dtype=torch.float32)
    rows, routes, tokens, experts = route_rows(routing)
    d_x = torch.zeros(x.shape, device=device).index_add_(0, tokens, rows_out[rows])
    x_ref = x.float().requires_grad_()
    y = torch.zeros(x.shape, device=device)
    for e in range(w_g.shape[0]):
        mine = experts == e
        rows_x = x_ref[tokens[mine]]
        h = reference.swiglu(rows_x @ w_g[e].float().T, rows_x @ w_u[e].float().T)
        y = y.index_add(0, tokens[mine], (h @ w_d[e].float().T) * router_weights[routes[mine],
                                                                                   None])
    (d_x_ref,) = torch.autograd.grad(y, x_ref, d_out.float())
    relative = (d_x - d_x_ref).norm() / d_x_ref.norm()
    assert relative < 0.1, relative


def test_fp8_launchers_reject_bad_operands(device):
    x, (w_g, w_u, w_d), _, _, routing = setup(device)
    xq, gate_q, up_q = quantize_rows(x), quantize_weights(w_g), quantize_weights(w_u)
    with pytest.raises(MoKInputError, match="float8_e4m3fn rows"):
        gate_up_swiglu_fp8(Quantized(x, xq.scales), gate_q, up_q, routing, TILES)
    with pytest.raises(MoKInputError, match="scales must be"):
        gate_up_swiglu_fp8(Quantized(xq.data, xq.scales[:, :1]), gate_q, up_q, routing, TILES)
    with pytest.raises(MoKInputError, match="rows it multiplies"):
        gate_up_swiglu_fp8(xq, quantize_weights(w_d), up_q, routing, TILES)
    with pytest.raises(ValueError, match="K steps of 128"):
        gate_up_swiglu_fp8(xq, gate_q, up_q, routing, RowTiles(16, 64, 64))
    with pytest.raises(ValueError, match="block_n 128"):
        gate_up_swiglu_fp8(xq, gate_q, up_q, routing, TILES, quantize_h=True)
    with pytest.raises(MoKInputError, match="rows, the schedule"):
        down_proj_fp8(xq, quantize_weights(w_d), routing, TILES)


def test_quantize_experts_gives_every_copy_the_launchers_read(device):
    _, (w_g, w_u, w_d), _, _, _ = setup(device, inter=256, seed=8)
    experts = quantize_experts(w_g, w_u, w_d)
    block = (QUANT_BLOCK, QUANT_BLOCK)
    for name, q, weight in (("gate", experts.gate, w_g), ("up", experts.up, w_u),
                            ("down", experts.down, w_d),
                            ("down_t", experts.down_t, w_d.transpose(1, 2)),
                            ("gate_up_t", experts.gate_up_t,
                             torch.cat([w_g, w_u], dim=1).transpose(1, 2))):
        expected = quantize_weights(weight.contiguous())
        assert q.data.shape == weight.shape, name
        assert torch.equal(q.data.view(torch.uint8), expected.data.view(torch.uint8)), name
        assert torch.equal(q.scales, expected.scales), name
    # The transposed copy's blocks are the normal copy's blocks, transposed.
    assert torch.equal(experts.down_t.scales, experts.down.scales.transpose(1, 2))
    assert torch.equal(dequantized(experts.down_t, block), dequantized(experts.down, block)
                       .transpose(1, 2))
    with pytest.raises(MoKInputError, match="do not match"):
        quantize_experts(w_g, w_u, w_d[:, :128])


def test_a_partial_scale_block_gives_the_zero_padded_experts_bits(device):
    # I = 192: every e4m3 copy, h and the backward's d_gate_up (each half from column 0 and
    # 256, zero codes between) are those of the experts padded with zero weights to I = 256.
    x, (w_g, w_u, w_d), _, router_weights, routing = setup(device, inter=192, seed=10)
    wide = [torch.cat([w, w.new_zeros(shape)], dim=dim) for w, shape, dim in (
        (w_g, (4, 64, 256), 1), (w_u, (4, 64, 256), 1), (w_d, (4, 256, 64), 2))]
    d_out_q = quantize_rows(torch.randn_like(x))
    n = used(routing)
    outs = []
    for weights in ((w_g, w_u, w_d), wide):
        experts = quantize_experts(*weights)
        xq = quantize_rows(x)
        h = gate_up_swiglu_fp8(xq, experts.gate, experts.up, routing, H_TILES)
        y = down_proj_fp8(h, experts.down, routing, TILES, router_weights)
        gate_up = gate_up_fp8(xq, experts.gate, experts.up, routing, H_TILES)
        kept = gate_up.clone()
        d_gate_up, _, partial = dswiglu_fp8(d_out_q, experts.down_t, gate_up, routing, H_TILES,
                                            router_weights)
        # the two launches: the same bits (compiled, the partial sums up to their order)
        apart = dswiglu_fp8(d_out_q, experts.down_t, kept, routing, H_TILES, router_weights,
                            apart=True)
        assert torch.equal(kept[:n], gate_up[:n])
        assert torch.equal(d_gate_up.data[:n].view(torch.uint8), apart[0].data[:n].view(
            torch.uint8))
        assert torch.equal(d_gate_up.scales[:n], apart[0].scales[:n])
        torch.testing.assert_close(partial[:n], apart[2][:n], rtol=1e-5, atol=1e-5)
        if not partial.is_cuda:
            assert torch.equal(partial[:n], apart[2][:n])
        d_x = d_x_rows_fp8(d_gate_up, experts.gate_up_t, routing, TILES)
        outs.append((experts, h, y, d_gate_up, partial, d_x))
    (narrow, h, y, d_gate_up, partial, d_x), (padded, h_p, y_p, d_gate_up_p, partial_p,
                                              d_x_p) = outs

    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    assert d_gate_up.data.shape == (routing.capacity_rows, 512)
    for name, a, b in (("gate_up_t", narrow.gate_up_t, padded.gate_up_t),
                       ("d_gate_up", d_gate_up, d_gate_up_p)):
        assert torch.equal(bits(a.data[:n] if name == "d_gate_up" else a.data),
                           bits(b.data[:n] if name == "d_gate_up" else b.data)), name
    for name, a, b in (("gate", narrow.gate.data, padded.gate.data[:, :192]),
                       ("down_t", narrow.down_t.data, padded.down_t.data[:, :192]),
                       ("down", narrow.down.data, padded.down.data[..., :192]),
                       ("h", h.data[:n], h_p.data[:n, :192]),
                       ("h scales", h.scales[:n], h_p.scales[:n]),
                       ("y", y[:n], y_p[:n]), ("partial", partial[:n], partial_p[:n]),
                       ("d_x", d_x[:n], d_x_p[:n])):
        assert torch.equal(bits(a), bits(b)), name


def test_fp8_tiles_fit_the_schedule():
    from mok.ops.tuning import FP8_GLUON_KINDS, FP8_KINDS, fp8_tiles

    for kind in FP8_KINDS:
        for align in (16, 32, 128):
            tiles = fp8_tiles(kind, align)
            assert tiles.block_k == QUANT_BLOCK and tiles.block_n == QUANT_BLOCK
            assert align % tiles.block_m == 0
    with pytest.raises(ValueError, match="no FP8 tiles"):
        fp8_tiles("wgrad_down", 128)
    # The Gluon kernels' tiles (mok.kernels.gluon_fp8) where the alignment takes their rows:
    # gate/up's and dSwiGLU's two MMA partitions 64 rows each, down and d_x 64 or 128.
    for kind in FP8_KINDS:
        for align in (16, 32, 64, 128, 256):
            tiles = fp8_tiles(kind, align, gluon=True)
            expected = kind in FP8_GLUON_KINDS and align % (
                64 if kind in ("down", "d_x") else 128) == 0
            assert tiles.gluon == expected, (kind, align)
            assert align % tiles.block_m == 0 and tiles.block_k == QUANT_BLOCK
            if tiles.gluon:
                assert (tiles.block_m, tiles.block_n) == (min(128, align), 128)


def test_gluon_fp8_tiles_off_sm90_raise_and_the_plan_does_not_give_them(device, monkeypatch):
    from mok import _env, plan
    from mok.arch import arch_of
    from mok.ops.tuning import fp8_tiles

    x, (w_g, w_u, w_d), _, router_weights, routing = setup(device, inter=256, align=128)
    if device.type == "cuda" and arch_of(device).warp_specialized:
        pytest.skip("an sm_90 GPU runs the Gluon FP8 kernels (tests/gpu/test_fp8_gluon.py)")
    experts = quantize_experts(w_g, w_u, w_d)
    xq = quantize_rows(x)
    h = gate_up_swiglu_fp8(xq, experts.gate, experts.up, routing, H_TILES)
    for kind, run in (
            ("gate_up", lambda t: gate_up_swiglu_fp8(xq, experts.gate, experts.up, routing, t)),
            ("gate_up_saved", lambda t: gate_up_fp8(xq, experts.gate, experts.up, routing, t)),
            ("down", lambda t: down_proj_fp8(h, experts.down, routing, t, router_weights)),
            ("down_bwd_saved", lambda t: dswiglu_fp8(
                xq, experts.down_t, gate_up_fp8(xq, experts.gate, experts.up, routing, H_TILES),
                routing, t, router_weights))):
        with pytest.raises(ValueError, match="Gluon FP8 kernel"):
            run(fp8_tiles(kind, 128, gluon=True))
    monkeypatch.setattr(_env, "FP8_GLUON", True)
    tiles = ops.default_tiles(device)
    fp8 = plan.fp8_plan(tiles, plan.Operands.of(x, w_g, w_u, w_d), hidden=256, intermediate=256)
    assert not any(t.gluon for t in (fp8.gate_up, fp8.gate_up_saved, fp8.down, fp8.dswiglu,
                                     fp8.d_x))


def test_fp8_plan_gives_the_gluon_kernels_on_sm90(device, monkeypatch):
    # By default (MOK_FP8_GLUON) on an sm_90 GPU: gate/up, the pre-activations, down and d_x on
    # the Gluon kernels, the dSwiGLU apart with its GEMM on the Gluon kernel (in one launch the
    # Triton kernel's, where _FP8_DSWIGLU_APART is off); scattering rows to other ranks (expert
    # parallelism), down and d_x on the Triton one; H not a multiple of 16, I not one of 128, or
    # MOK_FP8_GLUON=0, every launch on the Triton kernels, the dSwiGLU in one launch.
    from mok import _env, plan
    from mok.arch import HOPPER

    monkeypatch.setattr(plan, "arch_of", lambda device: HOPPER)
    x, (w_g, w_u, w_d), *_ = setup(device, inter=256, align=128)
    operands = plan.Operands.of(x, w_g, w_u, w_d)
    tiles = dataclasses.replace(ops.default_tiles(device), align=128)

    def gluon(intermediate=256, **kwargs):
        fp8 = plan.fp8_plan(tiles, operands, intermediate=intermediate, **kwargs)
        assert fp8.dswiglu_apart == fp8.dswiglu.gluon
        # the FP8 weight gradients: Gluon where H and I are multiples of 64
        assert fp8.wgrad_fp8.gluon == (fp8.gate_up.gluon and kwargs["hidden"] % 64 == 0
                                       and intermediate % 64 == 0)
        return tuple(t.gluon for t in (fp8.gate_up, fp8.gate_up_saved, fp8.down, fp8.dswiglu,
                                       fp8.d_x))

    assert _env.FP8_GLUON  # the default
    assert gluon(hidden=256) == (True, True, True, True, True)
    assert gluon(hidden=256, scatter=True) == (True, True, False, True, False)
    assert gluon(hidden=264) == (False,) * 5
    assert gluon(hidden=272) == (True,) * 5  # H a multiple of 16, not of 128
    assert gluon(hidden=256, intermediate=384) == (True,) * 5
    assert gluon(hidden=256, intermediate=208) == (True,) * 5  # a partial block of I
    assert gluon(hidden=256, intermediate=200) == (False,) * 5  # h's rows: 16-byte multiples
    monkeypatch.setattr(plan, "_FP8_DSWIGLU_APART", False)
    assert gluon(hidden=256) == (True, True, True, False, True)
    monkeypatch.setattr(plan, "_FP8_DSWIGLU_APART", True)
    assert plan._FP8_WIDE_ROWS  # the default
    assert plan._FP8_WIDE_WGRAD
    wgrad = plan.fp8_plan(tiles, operands, hidden=256, intermediate=256).wgrad_fp8
    assert wgrad.gluon and wgrad.block_n == 256
    monkeypatch.setattr(plan, "_FP8_WIDE_WGRAD", False)
    assert plan.fp8_plan(tiles, operands, hidden=256, intermediate=256).wgrad_fp8.block_n == 128
    monkeypatch.setattr(plan, "_FP8_WIDE_WGRAD", True)
    # the switch: 128 x 256 for down, d_x and the dSwiGLU's GEMM (scattering, down and d_x stay
    # on the Triton tiles)
    for wide in (True, False):
        monkeypatch.setattr(plan, "_FP8_WIDE_ROWS", wide)
        for scatter in (False, True):
            fp8 = plan.fp8_plan(tiles, operands, hidden=256, intermediate=256, scatter=scatter)
            for name in ("gate_up", "gate_up_saved", "down", "dswiglu", "d_x"):
                t = getattr(fp8, name)
                widened = wide and t.gluon and name in ("down", "dswiglu", "d_x")
                assert (t.block_n, t.num_stages) == ((256, 3) if widened else (128, 4)), (
                    name, scatter)
    monkeypatch.setattr(plan, "_FP8_WIDE_ROWS", False)
    monkeypatch.setattr(_env, "FP8_GLUON", False)
    assert gluon(hidden=256) == (False,) * 5
