"""The weight gradients on e4m3 operands (mok.ops.fp8_wgrad) against PyTorch math: codes and
scales of the 128-row blocks bitwise equal to mok.reference.quantize_e4m3 of each expert's
rows (transposed, blocks of (1, 128)), the gradients equal to the products of the dequantized
operands up to the accumulation's rounding (assert_products)."""

import math

import pytest
import torch

import mok.reference as reference
from mok.errors import MoKInputError
from mok.ops import build_routing
from mok.ops.fp8 import padded_width
from mok.ops.fp8_wgrad import grouped_wgrad_fp8, quantize_row_blocks
from mok.ops.quantize import QUANT_BLOCK, quantize_rows
from mok.ops.tuning import RowTiles
from mok.testing import RoutingPattern, make_topk

TILES = RowTiles(128, 64, QUANT_BLOCK, num_warps=4, num_stages=2)
# Hopper's e4m3 MMA adds its products with fewer bits than fp32 (cuBLAS's torch._scaled_mm
# too, with or without fast accumulation): errors up to about 2e-4 of sum |a| |b| measured on
# an H100 at these sizes, 6e-8 under the interpreter. Bound: 2**-10 of it.
ACCUMULATION = 2.0**-10


def assert_products(got, a, b, rtol=0.0):
    """got [P, Q] equals a @ b.T (a [P, n], b [Q, n]) within ACCUMULATION of |a| @ |b|.T, plus
    rtol of the product (an output dtype's rounding)."""
    expected = a.double() @ b.double().T
    bound = ACCUMULATION * (a.double().abs() @ b.double().abs().T) + rtol * expected.abs()
    error = (got.cpu().double() - expected).abs()
    assert (error <= bound + 1e-6).all(), (f"max error {error.max():.3e}, worst error / bound "
                                           f"{(error / (bound + 1e-6)).max():.3f}")


def schedule(device, *, tokens, experts, topk, align, seed, capacity=None, unused=()):
    generator = torch.Generator().manual_seed(seed)
    topk_experts = make_topk(tokens, experts, topk, RoutingPattern.RANDOM, generator)
    for expert in unused:  # no route to these experts
        topk_experts[topk_experts == expert] = (expert + 1) % experts
    topk_experts = topk_experts.to(device)
    flags = torch.zeros(4, dtype=torch.int32, device=device)
    routing = build_routing(topk_experts, flags, num_experts=experts, first_local_expert=0,
                            num_local_experts=experts, align=align,
                            route_capacity=capacity or tokens * topk)
    router_weights = torch.rand(tokens * topk, generator=generator).to(device)
    return routing, router_weights


def expert_rows(src, routing, *, gather, router_weights=None):
    """Per local expert, its schedule rows of src in order (fp32; padding rows zeros), from the
    schedule's offsets cut at the rows in use."""
    row_route = routing.row_route.long().cpu()
    offsets = routing.expert_offsets.long().cpu()
    used = int(offsets[-1])
    out = []
    for e in range(routing.num_local_experts):
        start, end = min(int(offsets[e]), used), min(int(offsets[e + 1]), used)
        routes = row_route[start:end]
        valid = routes >= 0
        index = torch.where(valid, routes // routing.topk if gather else
                            torch.arange(start, end), 0)
        rows = src.float().cpu()[index]
        if router_weights is not None:
            rows = rows * router_weights.cpu()[routes.clamp_min(0)][:, None]
        out.append(torch.where(valid[:, None], rows, 0.0))  # +0 on padding rows
    return out


def column_blocks(rows):
    """(codes [N, n], scales [N, ceil(n / 128)]) of an expert's rows [n, N], blocks of 128
    rows and one column from its first row."""
    return reference.quantize_e4m3(rows.T.contiguous(), (1, QUANT_BLOCK))


def assert_column_blocks(codes, scales, src, routing, *, gather, router_weights=None):
    """quantize_row_blocks' codes and scales of src equal column_blocks of each expert's rows:
    scales and codes bit for bit, a NaN value's code NaN. Returns the experts' scales."""
    sub = math.gcd(routing.align, QUANT_BLOCK)
    offsets = routing.expert_offsets.long().cpu()
    expected = []
    for e, mine in enumerate(expert_rows(src, routing, gather=gather,
                                         router_weights=router_weights)):
        start = int(offsets[e])
        expected_codes, expected_scales = column_blocks(mine)
        blocks = expected_scales.shape[1]
        assert torch.equal(scales[start // sub:start // sub + blocks].T.cpu(), expected_scales), e
        got = codes[:, start:start + mine.shape[0]].cpu()
        nan = mine.T.isnan()
        assert got.float()[nan].isnan().all() and not got.float()[~nan].isnan().any(), e
        assert torch.equal(got.view(torch.uint8)[~nan], expected_codes.view(torch.uint8)[~nan]), e
        expected.append(expected_scales)
    return expected


@pytest.mark.parametrize("source", ["bf16", "e4m3"])
@pytest.mark.parametrize("align", [16, 128, 192], ids=lambda a: f"align{a}")
@pytest.mark.parametrize("gather", [True, False], ids=["by_token", "by_row"])
def test_quantize_row_blocks_matches_reference(device, align, gather, source):
    # e4m3: a source of codes with 1 x 128 scales (quantize_rows'), each value dequantized
    # (code times its block's scale, then times the route's weight), then quantized along the
    # rows as a float source is; 200 columns: a partial last scale block.
    routing, router_weights = schedule(device, tokens=150, experts=3, topk=2, align=align,
                                       seed=1, unused=(1,))
    generator = torch.Generator().manual_seed(2)
    rows = routing.num_tokens if gather else routing.capacity_rows
    src = values = (torch.randn(rows, 200, generator=generator) * 3).bfloat16().to(device)
    if source == "e4m3":
        src = quantize_rows(values)
        values = reference.dequantize_e4m3(src.data.cpu(), src.scales.cpu(), (1, QUANT_BLOCK))
    weights = router_weights if gather else None
    codes, scales = quantize_row_blocks(src, routing, gather=gather, router_weights=weights)
    sub = math.gcd(align, QUANT_BLOCK)
    assert codes.shape == (200, routing.capacity_rows)
    assert scales.shape == (routing.capacity_rows // sub, 200)
    assert_column_blocks(codes, scales, values, routing, gather=gather, router_weights=weights)
    assert routing.expert_counts[1] == 0


@pytest.mark.parametrize("half", [96, 128], ids=lambda n: f"half{n}")
def test_quantize_row_blocks_from_e4m3_halves(device, half):
    # dswiglu_fp8's d_gate_up: d_gate's codes in columns [0, I), d_up's from padded_width(I)
    # (128 for I = 96: 32 zero columns between); the result holds the 2I columns.
    routing, _ = schedule(device, tokens=100, experts=2, topk=2, align=16, seed=14)
    generator = torch.Generator().manual_seed(15)
    gate, up = (torch.randn(routing.capacity_rows, half, generator=generator).bfloat16()
                for _ in range(2))
    wide = padded_width(half)
    laid = torch.zeros(routing.capacity_rows, 2 * wide, dtype=torch.bfloat16)
    laid[:, :half], laid[:, wide:wide + half] = gate, up
    src = quantize_rows(laid.to(device))
    values = reference.dequantize_e4m3(src.data.cpu(), src.scales.cpu(), (1, QUANT_BLOCK))
    codes, scales = quantize_row_blocks(src, routing, gather=False, halves=half)
    assert codes.shape == (2 * half, routing.capacity_rows)
    assert_column_blocks(codes, scales, torch.cat((values[:, :half],
                                                   values[:, wide:wide + half]), 1),
                         routing, gather=False)
    with pytest.raises(MoKInputError, match="two halves"):
        quantize_row_blocks(src, routing, gather=False, halves=2 * half)
    with pytest.raises(ValueError, match="halves"):
        quantize_row_blocks(laid.to(device), routing, gather=False, halves=half)


@pytest.mark.parametrize("gather", [True, False], ids=["by_token", "by_row"])
def test_quantize_row_blocks_leaves_nan_out_of_the_scales(device, gather):
    routing, _ = schedule(device, tokens=150, experts=3, topk=2, align=16, seed=8)
    generator = torch.Generator().manual_seed(9)
    rows = routing.num_tokens if gather else routing.capacity_rows
    src = torch.randn(rows, 192, generator=generator).bfloat16()
    src[:, 70] = float("nan")  # a column all NaN: scale 1 in every block, as zeros
    src[::7, 3] = float("nan")  # a few NaN in another: the scales from its numbers
    src = src.to(device)
    codes, scales = quantize_row_blocks(src, routing, gather=gather)
    for expected_scales in assert_column_blocks(codes, scales, src, routing, gather=gather):
        assert (expected_scales[70] == 1.0).all()


@pytest.mark.parametrize(("align", "split"), [(16, 128), (128, 128), (192, 128), (16, 96)],
                         ids=["align16", "align128", "align192", "split_in_a_tile"])
def test_grouped_wgrad_fp8_matches_dequantized_math(device, align, split):
    # d_w_down's form (a by token, scaled by the route's weight; b by row) and d_w_gate/up's
    # (a by row split in two, at 96 inside a 128-row tile; b by token); an expert without
    # routes gets zeros.
    routing, router_weights = schedule(device, tokens=150, experts=3, topk=2, align=align,
                                       seed=3, unused=(2,))
    generator = torch.Generator().manual_seed(4)
    by_token = torch.randn(routing.num_tokens, 96, generator=generator).bfloat16().to(device)
    by_row = torch.randn(routing.capacity_rows, 256, generator=generator).bfloat16().to(device)
    down = grouped_wgrad_fp8(by_token, by_row, routing, TILES, gather_a=True, gather_b=False,
                             router_weights=router_weights, out_dtype=torch.float32)
    gate, up = grouped_wgrad_fp8(by_row, by_token, routing, TILES, gather_a=False,
                                 gather_b=True, out_dtype=torch.bfloat16, split=split)
    weighted = expert_rows(by_token, routing, gather=True, router_weights=router_weights)
    tokens = expert_rows(by_token, routing, gather=True)
    rows = expert_rows(by_row, routing, gather=False)
    for e in range(routing.num_local_experts):
        qw, qt, qr = (reference.dequantize_e4m3(*column_blocks(each[e]), (1, QUANT_BLOCK))
                      for each in (weighted, tokens, rows))
        assert_products(down[e], qw, qr)
        # qr @ qt.T [256, 96]: gate's rows, then up's, rounded to bf16
        assert_products(gate[e].float(), qr[:split], qt, rtol=2.0**-8)
        assert_products(up[e].float(), qr[split:], qt, rtol=2.0**-8)
    assert not down[2].any() and not gate[2].any() and not up[2].any()
    again = grouped_wgrad_fp8(by_token, by_row, routing, TILES, gather_a=True, gather_b=False,
                              router_weights=router_weights, out_dtype=torch.float32)
    assert torch.equal(down, again)


def test_grouped_wgrad_fp8_past_the_capacity_sums_the_scheduled_rows(device):
    routing, _ = schedule(device, tokens=150, experts=3, topk=2, align=16, seed=5,
                          capacity=200)
    generator = torch.Generator().manual_seed(6)
    a = torch.randn(routing.num_tokens, 64, generator=generator).bfloat16().to(device)
    b = torch.randn(routing.capacity_rows, 128, generator=generator).bfloat16().to(device)
    out = grouped_wgrad_fp8(a, b, routing, TILES, gather_a=True, gather_b=False,
                            out_dtype=torch.float32)
    for e, (a_e, b_e) in enumerate(zip(expert_rows(a, routing, gather=True),
                                       expert_rows(b, routing, gather=False), strict=True)):
        qa, qb = (reference.dequantize_e4m3(*column_blocks(rows), (1, QUANT_BLOCK))
                  for rows in (a_e, b_e))
        assert_products(out[e], qa, qb)


def test_fp8_wgrad_rejects_bad_operands(device):
    routing, router_weights = schedule(device, tokens=20, experts=2, topk=2, align=16, seed=7)
    x = torch.randn(20, 64, device=device).bfloat16()
    with pytest.raises(MoKInputError, match=r"\[20, N\]"):
        quantize_row_blocks(x[:10], routing, gather=True)
    with pytest.raises(MoKInputError, match="router_weights"):
        quantize_row_blocks(x, routing, gather=True, router_weights=router_weights[:5])
    rows = torch.randn(routing.capacity_rows, 128, device=device).bfloat16()
    with pytest.raises(ValueError, match="split"):
        grouped_wgrad_fp8(rows, x, routing, TILES, gather_a=False, gather_b=True,
                          out_dtype=torch.float32, split=128)
    with pytest.raises(ValueError, match="K steps"):
        grouped_wgrad_fp8(rows, x, routing, RowTiles(128, 64, 64), gather_a=False,
                          gather_b=True, out_dtype=torch.float32)


@pytest.mark.parametrize("threads", [(8, 8, 4), (16, 4, 4), (8, 4, 8), (4, 16, 4)],
                         ids=lambda t: "{}x{}_w{}".format(*t))
def test_gluon_quantize_layouts_cover_the_tile_once_in_both_orders(threads):
    # mok.kernels.gluon_quantize.tile_layouts (the Gluon kernel runs on sm_90 GPUs only,
    # tests/gpu/test_fp8_gluon.py): each (register, lane, warp) holds one element of the
    # [128, BLOCK_N] tile and each element is held once; by_col holds the same elements in the
    # same threads as by_row, a thread's registers along its rows instead of its columns, and
    # a thread's rows and columns are consecutive.
    from mok.kernels.gluon_quantize import tile_layouts
    from mok.ops import fp8_wgrad

    rows_t, cols_t, warps = threads
    by_row, by_col = tile_layouts(*threads)
    assert by_row.shape == by_col.shape == [128, fp8_wgrad._QUANTIZE_COLUMNS]

    def held(layout):
        def at(bases, index):
            row = col = 0
            for bit, (r, c) in enumerate(bases):
                if index >> bit & 1:
                    row, col = row ^ r, col ^ c
            return row, col

        out = {}
        for warp in range(warps):
            for lane in range(32):
                w, la = at(layout.warp_bases, warp), at(layout.lane_bases, lane)
                out[warp, lane] = [tuple(a ^ b ^ c for a, b, c in zip(w, la, at(
                    layout.reg_bases, reg), strict=True)) for reg in range(rows_t * cols_t)]
        return out

    mine, theirs = held(by_row), held(by_col)
    every = [element for values in mine.values() for element in values]
    assert sorted(every) == [(r, c) for r in range(128) for c in range(by_row.shape[1])]
    for thread, values in mine.items():
        assert sorted(values) == sorted(theirs[thread])
        assert values[1] == (values[0][0], values[0][1] + 1)  # along the columns
        assert theirs[thread][1] == (values[0][0] + 1, values[0][1])  # along the rows
        rows = {r for r, _ in values}
        cols = {c for _, c in values}
        assert rows == set(range(min(rows), min(rows) + rows_t))
        assert cols == set(range(min(cols), min(cols) + cols_t))
