"""The warp-specialized Gluon FP8 kernels (mok.kernels.gluon_fp8: gate/up, the pre-activations,
down, d_x and the dSwiGLU's GEMM, run apart; RowTiles.gluon) on an sm_90 GPU:
against the same math on the dequantized operands, against the Triton FP8 kernels, bitwise
deterministic, 0 on padding rows, and the layer on them (MOK_FP8_GLUON) against the layer on
the Triton kernels."""

import dataclasses
import math

import pytest
import torch

import mok.reference as reference
from mok.arch import arch_of
from mok.ops import build_routing
from mok.ops.fp8 import (
    d_x_rows_fp8,
    down_proj_fp8,
    dswiglu_fp8,
    gate_up_fp8,
    gate_up_swiglu_fp8,
    gluon_takes_fp8_rows,
    quantize_experts,
)
from mok.ops.quantize import QUANT_BLOCK, quantize_rows
from mok.ops.tuning import RowTiles, fp8_tiles
from mok.testing import RoutingPattern, assert_close, make_topk
from mok.testing.tolerance import Tolerance

pytestmark = pytest.mark.gpu
SM90 = pytest.mark.skipif(not torch.cuda.is_available()
                          or not arch_of(torch.device("cuda")).warp_specialized,
                          reason="needs an sm_90 GPU")

ALIGN = 128
# Against the same math on the dequantized operands in fp32: the tensor cores sum each 128-deep
# K step's e4m3 products with fewer bits than fp32. Measured on one H200, the largest error
# over the largest output: down and d_x 3.2e-4 to 3.9e-4, gate/up 2.5e-4, 8.3e-4 with a
# 16-deep K tail and a SwiGLU limit. Against the Triton kernel (the same sums) they stay 1e-4.
DEQUANTIZED = 2e-3
# The dSwiGLU's outputs from such products: a few of millions of bf16 elements near 0 move by
# up to 1.8e-3 (measured), beyond bf16's rtol.
DSWIGLU = Tolerance(rel_rms=2e-3, max_rel=2e-2)
GLUON = RowTiles(128, 128, QUANT_BLOCK, group_m=8, num_warps=4, num_stages=4, gluon=True)


def _setup(*, tokens, hidden, inter, experts, topk, seed):
    generator = torch.Generator().manual_seed(seed)
    w_g, w_u = ((torch.randn(experts, inter, hidden, generator=generator) / hidden ** 0.5)
                .bfloat16().cuda() for _ in range(2))
    w_d = (torch.randn(experts, hidden, inter, generator=generator) / inter ** 0.5).bfloat16()
    topk_experts = make_topk(tokens, experts, topk, RoutingPattern.SKEWED, generator).cuda()
    router_weights = torch.rand(tokens * topk, generator=generator).cuda()
    flags = torch.zeros(4, dtype=torch.int32, device="cuda")
    routing = build_routing(topk_experts, flags, num_experts=experts, first_local_expert=0,
                            num_local_experts=experts, align=ALIGN,
                            route_capacity=tokens * topk)
    weights = quantize_experts(w_g, w_u, w_d.cuda())
    return weights, router_weights, routing, generator


def _rows_times_experts(a, w, experts):
    """a [R, K] times each row's expert's matrix of w [E, N, K]: [R, N] fp32, one product per
    expert (w[experts] itself would take R * N * K floats, gigabytes at these sizes)."""
    out = a.new_zeros(a.shape[0], w.shape[1])
    for e in range(w.shape[0]):
        mine = experts == e
        out[mine] = a[mine] @ w[e].T
    return out


def _rows(routing):
    row_route = routing.row_route.long()
    rows = (row_route >= 0).nonzero().flatten()
    return rows, row_route[rows], routing.block_expert.long()[rows // routing.align]


def _schedule_rows(routing, width, generator):
    """Random e4m3 rows [C, width] with their scales, NaN codes on the padding rows (the kernel
    must still write 0 there)."""
    rows = torch.randn(routing.capacity_rows, width, generator=generator).bfloat16().cuda()
    q = quantize_rows(rows)
    padding = routing.row_route < 0
    q.data.view(torch.uint8)[padding] = 0x7F
    return q


@SM90
@pytest.mark.parametrize(("hidden", "inter", "tiles"), [
    (512, 384, GLUON),  # 3 K blocks in down, 6 in d_x
    (640, 256, dataclasses.replace(GLUON, num_stages=5)),  # N not a multiple of 128 x 2
    (512, 256, dataclasses.replace(GLUON, block_m=64, num_stages=6)),
    (512, 384, dataclasses.replace(GLUON, block_n=256, num_stages=3)),
    # down's last tile: its second 128 columns past N = 640
    (640, 256, dataclasses.replace(GLUON, block_n=256, num_stages=4)),
], ids=["128x128", "n640_s5", "64x128", "128x256", "128x256_n640_s4"])
def test_gluon_fp8_rows_match_dequantized_math_and_the_triton_kernel(hidden, inter, tiles):
    weights, router_weights, routing, generator = _setup(
        tokens=3000, hidden=hidden, inter=inter, experts=16, topk=4, seed=hidden + inter)
    rows, routes, experts = _rows(routing)
    triton = fp8_tiles("down", ALIGN)
    n = int(routing.used_rows)
    block = (QUANT_BLOCK, QUANT_BLOCK)
    for kind, width, w in (("down", inter, weights.down), ("d_x", 2 * inter, weights.gate_up_t)):
        a = _schedule_rows(routing, width, generator)
        assert gluon_takes_fp8_rows(a, w, torch.float32, tiles)
        weighted = router_weights if kind == "down" else None

        def run(t, a=a, w=w, kind=kind, weighted=weighted):
            if kind == "down":
                return down_proj_fp8(a, w, routing, t, weighted, out_dtype=torch.float32)
            return d_x_rows_fp8(a, w, routing, t, out_dtype=torch.float32)

        out = run(tiles)
        assert torch.equal(out[:n], run(tiles)[:n]), kind  # bitwise deterministic
        if tiles.block_n == 256:  # the same products, 128 columns at a time
            plain = dataclasses.replace(tiles, block_n=128)
            assert torch.equal(out[:n], run(plain)[:n]), kind
        expected = _rows_times_experts(
            reference.dequantize_e4m3(a.data, a.scales, (1, QUANT_BLOCK))[rows],
            reference.dequantize_e4m3(w.data, w.scales, block), experts)
        if weighted is not None:
            expected = expected * weighted[routes, None]
        err = (out[rows] - expected).abs().max() / expected.abs().max()
        assert err < DEQUANTIZED, (kind, float(err))
        padding = routing.row_route[:n] < 0
        assert padding.any() and (out[:n][padding] == 0).all(), kind
        theirs = run(triton)
        err = (out[rows] - theirs[rows]).abs().max() / theirs[rows].abs().max()
        assert err < 1e-4, (kind, float(err))
        bf16 = (down_proj_fp8(a, w, routing, tiles, weighted) if kind == "down"
                else d_x_rows_fp8(a, w, routing, tiles))
        assert bf16.dtype == torch.bfloat16
        torch.testing.assert_close(bf16[:n].float(), out[:n], rtol=1e-2, atol=1e-2)
        # The 16-bit output: where the Triton kernel puts it, the same bits as fp32's rounded
        # (the sums are the same).
        theirs16 = (down_proj_fp8(a, w, routing, triton, weighted) if kind == "down"
                    else d_x_rows_fp8(a, w, routing, triton))
        assert torch.equal(bf16[:n], theirs16[:n]), kind
        assert torch.equal(bf16[:n], out[:n].bfloat16()), kind


def _token_rows(tokens, width, generator):
    x = torch.randn(tokens, width, generator=generator).bfloat16().cuda()
    return quantize_rows(x)


@SM90
@pytest.mark.parametrize(("hidden", "inter", "limit"),
                         [(512, 256, None), (400, 256, 1.5), (512, 192, None)],
                         ids=["plain", "k_tail_limit", "i192"])
def test_gluon_fp8_gate_up_matches_dequantized_math_and_the_triton_kernel(hidden, inter, limit):
    # hidden 400: 4 K blocks, the last one 16 columns deep (TMA and the gather zero past K).
    # inter 192: each expert's last column tile reads the next expert's weight rows, which h's
    # scales must leave out.
    weights, _, routing, generator = _setup(tokens=3000, hidden=hidden, inter=inter,
                                            experts=16, topk=4, seed=hidden + inter)
    xq = _token_rows(3000, hidden, generator)
    tiles, saved = (fp8_tiles(kind, ALIGN, gluon=True) for kind in ("gate_up", "gate_up_saved"))
    assert tiles.gluon and saved.gluon
    triton, triton_saved = (fp8_tiles(kind, ALIGN) for kind in ("gate_up", "gate_up_saved"))
    rows, _, experts = _rows(routing)
    n = int(routing.used_rows)
    x = reference.dequantize_e4m3(xq.data, xq.scales, (1, QUANT_BLOCK))
    block = (QUANT_BLOCK, QUANT_BLOCK)
    tokens = routing.row_route.long()[rows] // routing.topk
    g, u = (_rows_times_experts(x[tokens], reference.dequantize_e4m3(w.data, w.scales, block),
                                experts)
            for w in (weights.gate, weights.up))
    expected_h = reference.swiglu(g, u, limit)
    padding = routing.row_route[:n] < 0
    assert padding.any()

    def h32(t):
        return gate_up_swiglu_fp8(xq, weights.gate, weights.up, routing, t, limit,
                                  quantize_h=False, out_dtype=torch.float32)

    h = h32(tiles)
    assert torch.equal(h[:n], h32(tiles)[:n])
    err = (h[rows] - expected_h).abs().max() / expected_h.abs().max()
    assert err < DEQUANTIZED, float(err)
    assert (h[:n][padding] == 0).all()
    theirs = h32(triton)
    assert (h[rows] - theirs[rows]).abs().max() / theirs[rows].abs().max() < 1e-4

    # h in e4m3 with its row scales: the quantization of the unquantized h (mok's rule), and
    # the pre-activations kept alongside, as gate_up_fp8 stores them.
    kept = torch.empty(routing.capacity_rows, 2 * inter, dtype=torch.bfloat16, device="cuda")
    hq = gate_up_swiglu_fp8(xq, weights.gate, weights.up, routing, tiles, limit, gate_up=kept)
    again = gate_up_swiglu_fp8(xq, weights.gate, weights.up, routing, tiles, limit)
    assert torch.equal(hq.data[:n].view(torch.uint8), again.data[:n].view(torch.uint8))
    q_ref, scales_ref = reference.quantize_e4m3(h[:n], (1, QUANT_BLOCK))
    assert torch.equal(hq.scales[:n], scales_ref)
    assert torch.equal(hq.data[:n].view(torch.uint8), q_ref.view(torch.uint8))
    assert (hq.scales[:n][padding] == 1).all()
    pre = gate_up_fp8(xq, weights.gate, weights.up, routing, saved, limit)
    assert torch.equal(pre[:n], kept[:n])
    theirs = gate_up_fp8(xq, weights.gate, weights.up, routing, triton_saved, limit)
    finite = pre[rows].isfinite()
    assert torch.equal(finite, theirs[rows].isfinite())  # the same values clamped (+-inf)
    torch.testing.assert_close(pre[rows][finite].float(), theirs[rows][finite].float(),
                               rtol=1e-2, atol=1e-2)
    assert (pre[:n][padding] == 0).all()


@SM90
@pytest.mark.parametrize(("recompute", "limit"), [(True, None), (False, 7.0)],
                         ids=["recompute", "kept_limit"])
def test_fp8_layer_on_the_gluon_kernels(recompute, limit, monkeypatch):
    # MOK_FP8_GLUON (the default): the layer's FP8 plan takes the Gluon kernels (the dSwiGLU
    # apart, its GEMM on the Gluon kernel), which give the Triton kernels' layer
    # (MOK_FP8_GLUON=0) within the recipe's tolerance (other sums inside each K block move
    # some e4m3 roundings), bitwise deterministic.
    import mok.functional as F
    from mok import _env
    from mok.ops import fp8 as fp8_ops
    from mok.testing import GRAD_NAMES, assert_close, make_inputs

    from ..conftest import run_layer
    from ..layer.test_fp8 import RECIPE

    inputs = make_inputs(3000, 512, 256, 16, 4, shared_intermediate_size=256, device="cuda",
                         seed=5)
    config = F.MoKConfig(precision="fp8", recompute_gate_up=recompute)
    monkeypatch.setattr(_env, "FP8_GLUON", False)
    triton = run_layer(inputs, config=config, swiglu_limit=limit)
    monkeypatch.setattr(_env, "FP8_GLUON", True)
    launches = []
    for name in ("_rows_gluon", "_gate_up_gluon", "_gather_gluon"):
        launcher = getattr(fp8_ops, name)

        def counted(*args, name=name, launcher=launcher, **kwargs):
            launches.append(name)
            return launcher(*args, **kwargs)
        monkeypatch.setattr(fp8_ops, name, counted)
    y, grads, _, _ = run_layer(inputs, config=config, swiglu_limit=limit)
    # forward: gate/up and down, backward: dSwiGLU and d_x (and the pre-activations
    # recomputed), for the routed and the shared experts
    assert sorted(set(launches)) == ["_gate_up_gluon", "_gather_gluon", "_rows_gluon"]
    assert launches.count("_rows_gluon") == 4
    assert launches.count("_gather_gluon") == 2
    assert launches.count("_gate_up_gluon") == (4 if recompute else 2)
    y2, grads2, _, _ = run_layer(inputs, config=config, swiglu_limit=limit)
    assert torch.equal(y, y2)
    assert_close(y, triton[0], dtype=torch.bfloat16, name="y", tolerance=RECIPE)
    for name, a, b, theirs in zip(GRAD_NAMES, grads, grads2, triton[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
        if theirs is not None:
            assert_close(a, theirs, dtype=torch.bfloat16, name=name, tolerance=RECIPE)


@SM90
@pytest.mark.parametrize(("hidden", "limit"), [(512, None), (400, 1.5)],
                         ids=["plain", "k_tail_limit"])
def test_gluon_fp8_dswiglu_gemm_at_128x256_gives_the_128x128_bits(hidden, limit):
    # The dSwiGLU's GEMM apart at 128 x 256 (two products of 128 columns a K step): every
    # output of the dSwiGLU after it the bits of 128 x 128 tiles, deterministic.
    weights, router_weights, routing, generator = _setup(tokens=3000, hidden=hidden, inter=256,
                                                         experts=16, topk=4, seed=hidden + 1)
    xq = _token_rows(3000, hidden, generator)
    d_out_q = _token_rows(3000, hidden, generator)
    n = int(routing.used_rows)
    tiles = fp8_tiles("down_bwd_saved", ALIGN, gluon=True)
    wide = dataclasses.replace(tiles, block_n=256, num_stages=3)
    assert tiles.gluon and tiles.block_n == 128

    def run(t):
        d_gate_up = gate_up_fp8(xq, weights.gate, weights.up, routing,
                                fp8_tiles("gate_up_saved", ALIGN), limit)
        q, h, partial = dswiglu_fp8(d_out_q, weights.down_t, d_gate_up, routing, t,
                                    router_weights, limit, apart=True)
        return d_gate_up, q.data.view(torch.uint8), q.scales, h, partial

    ours = run(wide)
    for mine, theirs, again in zip(ours, run(tiles), run(wide), strict=True):
        assert torch.equal(mine[:n], theirs[:n])
        assert torch.equal(mine[:n], again[:n])


@SM90
@pytest.mark.parametrize(("limit", "weighted"), [(None, True), (1.5, True), (None, False)],
                         ids=["plain", "limit", "shared"])
def test_gluon_fp8_dswiglu_matches_dequantized_math_and_the_triton_kernel(limit, weighted):
    # Gluon tiles: the Gluon GEMM into fp32 (fp8_gather_ws_kernel), then the dSwiGLU over it.
    from ..ops.test_fp8_gemm import dswiglu_reference

    weights, router_weights, routing, generator = _setup(tokens=3000, hidden=512, inter=256,
                                                         experts=16, topk=4, seed=11)
    xq = _token_rows(3000, 512, generator)
    d_out_q = _token_rows(3000, 512, generator)
    gate_up = gate_up_fp8(xq, weights.gate, weights.up, routing,
                          fp8_tiles("gate_up_saved", ALIGN), limit)
    route_weights = router_weights if weighted else None
    tiles = fp8_tiles("down_bwd_saved", ALIGN, gluon=True)
    assert tiles.gluon

    def run(t):
        d_gate_up = gate_up.clone()
        q, h, partial = dswiglu_fp8(d_out_q, weights.down_t, d_gate_up, routing, t,
                                    route_weights, limit)
        return d_gate_up, q, h, partial

    d_gate_up, q, h, partial = run(tiles)
    n = int(routing.used_rows)
    again = run(tiles)
    for a, b in ((d_gate_up, again[0]), (q.data.view(torch.uint8), again[1].data.view(
            torch.uint8)), (q.scales, again[1].scales), (h, again[2]), (partial, again[3])):
        assert (a is None and b is None) or torch.equal(a[:n], b[:n])
    rows, routes, experts = _rows(routing)
    tokens = routing.row_route.long()[rows] // routing.topk
    dh0 = _rows_times_experts(
        reference.dequantize_e4m3(d_out_q.data, d_out_q.scales, (1, QUANT_BLOCK))[tokens],
        reference.dequantize_e4m3(weights.down_t.data, weights.down_t.scales,
                                  (QUANT_BLOCK, QUANT_BLOCK)), experts)
    weights_of_rows = router_weights[routes] if weighted else torch.ones_like(dh0[:, 0])
    d_gate, d_up, h_ref, terms = dswiglu_reference(
        dh0, gate_up[rows, :256].float(), gate_up[rows, 256:].float(), weights_of_rows, limit)
    bf16 = dict(rtol=1.6e-2, atol=1e-3)
    assert_close(h[rows], h_ref, dtype=torch.bfloat16, name="h", tolerance=DSWIGLU)
    expected = torch.cat([d_gate, d_up], 1)
    assert_close(d_gate_up[rows], expected, dtype=torch.bfloat16, name="d_gate_up",
                 tolerance=DSWIGLU)
    if weighted:
        assert_close(partial[rows], terms.reshape(len(rows), -1, 128).sum(-1),
                     dtype=torch.bfloat16, name="partial", tolerance=DSWIGLU)
    else:
        assert partial is None
    # e4m3 d_gate_up: each 1 x 128 block quantized from the fp32 values, which the bf16 output
    # holds to 2^-9: its scale is the block's amax / 448, every code within e4m3's rounding.
    ours = d_gate_up[rows].float()
    block_scales = ours.abs().reshape(len(rows), -1, 128).amax(-1) / 448
    block_scales = torch.where(block_scales == 0, 1.0, block_scales)
    torch.testing.assert_close(q.scales[rows], block_scales, rtol=2.0 ** -8, atol=0)
    back = reference.dequantize_e4m3(q.data, q.scales, (1, QUANT_BLOCK))[rows]
    step = q.scales[rows].repeat_interleave(128, dim=1)
    assert ((back - ours).abs() <= ours.abs() * (2.0 ** -4 + 2.0 ** -7) + step * 2.0 ** -8).all()
    padding = routing.row_route[:n] < 0
    assert (d_gate_up[:n][padding] == 0).all() and (h[:n][padding] == 0).all()
    assert (q.data[:n].float()[padding] == 0).all() and (q.scales[:n][padding] == 1).all()
    # The Triton kernel on the same operands: the same up to the order of the sums.
    theirs = run(fp8_tiles("down_bwd_saved", ALIGN))
    torch.testing.assert_close(d_gate_up[rows].float(), theirs[0][rows].float(), **bf16)
    torch.testing.assert_close(q.scales[rows], theirs[1].scales[rows], rtol=1e-4, atol=0)


@SM90
@pytest.mark.parametrize(("kind", "stages", "block_n", "inter", "hidden"),
                         [("down", 5, 128, 256, 512), ("gate_up", 5, 128, 256, 512),
                          ("gate_up", 3, 128, 256, 512), ("down", 5, 256, 384, 512),
                          ("gate_up", 5, 256, 256, 512), ("down", 5, 256, 192, 448),
                          ("gate_up", 5, 256, 192, 448)],
                         ids=["down", "gate_up", "gate_up_s3", "down_128x256_i384",
                              "gate_up_128x256", "down_h448_i192", "gate_up_h448_i192"])
def test_gluon_fp8_wgrad_matches_the_triton_kernel(kind, stages, block_n, inter, hidden):
    # The FP8 weight gradients' GEMM (mok.kernels.gluon_fp8_wgrad) against the Triton one on
    # the same quantized operands (the same blocks in the same order): down (a = d_output by
    # token, weighted; b = h by row), gate/up (a = [d_gate, d_up] by row, split at I; b = x by
    # token); an expert without rows gives zeros; bitwise deterministic. 256 columns (down's
    # I = 384: a tile's second half wholly past the columns) give the 128-column tiles' bits.
    # H = 448 and I = 192 (multiples of 64, not of 128): a tile's 64-row halves on each side
    # of the split, or past the rows.
    from mok.ops.fp8_wgrad import (
        gluon_takes_fp8_wgrad,
        grouped_wgrad_fp8_quantized,
        quantize_row_blocks,
    )
    from mok.ops.tuning import FP8_WGRAD_GLUON_TILES, FP8_WGRAD_TILES

    tokens, experts = 3000, 17
    generator = torch.Generator().manual_seed(17)
    topk_experts = make_topk(tokens, experts - 1, 4, RoutingPattern.SKEWED, generator).cuda()
    routing = build_routing(topk_experts, torch.zeros(4, dtype=torch.int32, device="cuda"),
                            num_experts=experts, first_local_expert=0,
                            num_local_experts=experts, align=ALIGN, route_capacity=tokens * 4)
    x = torch.randn(tokens, hidden, generator=generator).bfloat16().cuda()
    rows = routing.capacity_rows
    if kind == "down":
        weights = torch.rand(tokens * 4, generator=generator).cuda()
        a = quantize_row_blocks(x, routing, gather=True, router_weights=weights)
        b = quantize_row_blocks(torch.randn(rows, inter, generator=generator).bfloat16().cuda(),
                                routing, gather=False)
        split = None
    else:
        a = quantize_row_blocks(
            torch.randn(rows, 2 * inter, generator=generator).bfloat16().cuda(), routing,
            gather=False)
        b = quantize_row_blocks(x, routing, gather=True)
        split = inter
    tiles = dataclasses.replace(FP8_WGRAD_GLUON_TILES, block_n=block_n, num_stages=stages)
    assert gluon_takes_fp8_wgrad(a, b, routing, tiles, torch.float32, split)

    def run(t):
        out = grouped_wgrad_fp8_quantized(a, b, routing, t, out_dtype=torch.float32,
                                          split=split)
        return out if split is not None else (out,)

    ours, again, theirs = run(tiles), run(tiles), run(FP8_WGRAD_TILES)
    for mine, mine_again, their in zip(ours, again, theirs, strict=True):
        assert torch.equal(mine, mine_again)
        assert (mine[-1] == 0).all()  # the expert without rows
        scale = their.abs().amax()
        torch.testing.assert_close(mine, their, rtol=0, atol=1e-5 * float(scale))
    if block_n != 128:
        for mine, narrow in zip(ours, run(FP8_WGRAD_GLUON_TILES), strict=True):
            assert torch.equal(mine, narrow)


@SM90
@pytest.mark.parametrize("threads", [(8, 8, 4), (16, 4, 4), (8, 4, 8), (4, 16, 4)],
                         ids=lambda t: "{}x{}_w{}".format(*t))
@pytest.mark.parametrize(("align", "width"), [(128, 2048), (16, 200)],
                         ids=["align128_w2048", "align16_w200"])
def test_gluon_quantize_row_blocks_gives_the_triton_kernels_bits(threads, align, width,
                                                                 monkeypatch):
    # mok.kernels.gluon_quantize against mok.kernels.fp8_wgrad's kernel, codes and scales bit
    # for bit: by token (router-weighted or not) and by row, an expert without rows, a partial
    # last block of each expert, a partial last column block (200), zeros, NaN and inf; from
    # e4m3 rows with 1 x 128 scales too (by token weighted, by row, and in two halves of 64 and
    # 1024 columns with padded_width between them).
    from mok.ops import fp8_wgrad, quantize_rows
    from mok.ops.fp8 import padded_width

    tokens, experts, topk = 1500, 9, 4
    generator = torch.Generator().manual_seed(23)
    topk_experts = make_topk(tokens, experts - 1, topk, RoutingPattern.SKEWED, generator).cuda()
    routing = build_routing(topk_experts, torch.zeros(4, dtype=torch.int32, device="cuda"),
                            num_experts=experts, first_local_expert=0,
                            num_local_experts=experts, align=align,
                            route_capacity=tokens * topk)
    weights = torch.rand(tokens * topk, generator=generator).cuda()
    by_token = (torch.randn(tokens, width, generator=generator) * 4).bfloat16()
    by_row = (torch.randn(routing.capacity_rows, width, generator=generator) * 4).bfloat16()
    for src in (by_token, by_row):
        src[:, 5] = 0.0
        src[::3, 7] = float("nan")
        src[::11, 9] = float("inf")
        src[:, 11] = float("nan")
    by_token, by_row = by_token.cuda(), by_row.cuda()
    half = 64 if width < 1024 else 1024
    halves = torch.zeros(routing.capacity_rows, 2 * padded_width(half), dtype=torch.bfloat16,
                         device="cuda")
    halves[:, :half] = by_row[:, :half]
    halves[:, padded_width(half):padded_width(half) + half] = by_row[:, half:2 * half]
    monkeypatch.setattr(fp8_wgrad, "_GLUON_QUANTIZE_THREADS", threads)
    monkeypatch.setattr(fp8_wgrad, "_GLUON_QUANTIZE_CODES", True)
    for src, gather, router_weights, split in (
            (by_token, True, weights, None), (by_token, True, None, None),
            (by_row, False, None, None), (quantize_rows(by_token), True, weights, None),
            (quantize_rows(by_row), False, None, None), (quantize_rows(halves), False, None,
                                                         half)):
        assert fp8_wgrad.gluon_takes_quantize_rows(
            src if isinstance(src, torch.Tensor) else src.data, split)
        mine = fp8_wgrad.quantize_row_blocks(src, routing, gather=gather,
                                             router_weights=router_weights, halves=split)
        monkeypatch.setattr(fp8_wgrad, "_GLUON_QUANTIZE", False)
        theirs = fp8_wgrad.quantize_row_blocks(src, routing, gather=gather,
                                               router_weights=router_weights, halves=split)
        monkeypatch.setattr(fp8_wgrad, "_GLUON_QUANTIZE", True)
        # what the kernels write: each expert's rows and their blocks' scales
        sub = math.gcd(align, QUANT_BLOCK)
        offsets = routing.expert_offsets.tolist()
        for start, end in zip(offsets[:-1], offsets[1:], strict=True):
            blocks = slice(start // sub, start // sub + -(-(end - start) // QUANT_BLOCK))
            assert torch.equal(mine.data[:, start:end].view(torch.uint8),
                               theirs.data[:, start:end].view(torch.uint8))
            assert torch.equal(mine.scales[blocks], theirs.scales[blocks])
