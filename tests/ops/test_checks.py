"""The launchers of mok.ops refuse inputs their kernels would read wrongly (each case ran with
no error before, giving garbage, non-finite values or writes out of bounds)."""

import dataclasses

import pytest
import torch

from mok import ops
from mok.errors import MoKInputError
from mok.ops.fp8 import down_proj_fp8, dswiglu_fp8, gate_up_swiglu_fp8
from mok.ops.fp8_wgrad import grouped_wgrad_fp8_quantized, quantize_row_blocks
from mok.ops.quantize import quantize_rows, quantize_weights
from mok.ops.tuning import RowTiles

from .test_fp8_gemm import H_TILES, TILES, setup

ROW_TILES = RowTiles(16, 64, 64, group_m=2, num_warps=4, num_stages=2)


def test_row_launchers_refuse_operands_they_would_misread(device):
    x, (w_g, w_u, w_d), topk_experts, router_weights, routing = setup(device, inter=128)
    h = torch.randn(routing.capacity_rows, 128, device=device).bfloat16()
    d_gate_up = torch.randn(routing.capacity_rows, 256, device=device).bfloat16()
    wide = torch.randn(x.shape[0], 2 * x.shape[1], device=device).bfloat16()
    cases = {
        "x, a column stride of 2": lambda: ops.gate_up_swiglu(wide[:, ::2], w_g, w_u, routing,
                                                              ROW_TILES, None),
        "x, transposed": lambda: ops.gate_up_swiglu(x.t().contiguous().t(), w_g, w_u, routing,
                                                    ROW_TILES, None),
        "x narrower than the weights": lambda: ops.gate_up_swiglu(x[:, :128], w_g, w_u, routing,
                                                                  ROW_TILES, None),
        "an expert fewer than the schedule's": lambda: ops.gate_up_swiglu(
            x, w_g[:-1], w_u[:-1], routing, ROW_TILES, None),
        "w_up of another shape": lambda: ops.gate_up_swiglu(x, w_g, w_u[:, :64], routing,
                                                           ROW_TILES, None),
        "h, a column stride of 2": lambda: ops.down_proj(
            torch.randn(routing.capacity_rows, 256, device=device).bfloat16()[:, ::2], w_d,
            routing, ROW_TILES, router_weights),
        "router weights [k, T]": lambda: ops.down_proj(
            h, w_d, routing, ROW_TILES, router_weights.view(-1, 2).t().contiguous()),
        "w_down as [E, I, H]": lambda: ops.down_bwd_dswiglu(
            x, x, w_d.transpose(1, 2).contiguous(), w_g, w_u, h, routing,
            ops.small_tiles(16, 16).pick("down_bwd", 128, 256), router_weights, None),
        "d_gate_up [C, I]": lambda: ops.d_x_rows(h, w_g, w_u, routing, ROW_TILES),
        "d_gate_up of an odd width": lambda: ops.grouped_wgrad_gate_up(
            d_gate_up[:, :255], x, routing, ops.small_tiles(16, 16).wgrad, gather_x=True,
            out_dtype=torch.bfloat16),
        "an integer out_dtype": lambda: ops.grouped_wgrad(
            x, h, routing, ops.small_tiles(16, 16).wgrad, gather_a=True, gather_b=False,
            out_dtype=torch.int32),
        "copy_rows from a transposed src": lambda: ops.copy_rows(x.t().contiguous().t(), routing,
                                                                 gather=True),
        "combine's shared rows of other tokens": lambda: ops.combine(
            torch.randn(routing.capacity_rows, 256, device=device).bfloat16(), routing,
            x[:-1], torch.bfloat16),
        "router_grad of bf16 partial sums": lambda: ops.router_grad(
            torch.randn(routing.capacity_rows, 2, device=device).bfloat16(), routing),
        # fewer rows than the schedule reads: tokens past them (or rows past C) read out of
        # bounds
        "x of a token fewer": lambda: ops.gate_up_swiglu(x[:-1], w_g, w_u, routing, ROW_TILES,
                                                         None),
        "h of a row fewer": lambda: ops.down_proj(h[:-1], w_d, routing, ROW_TILES,
                                                  router_weights),
        "d_out of a token fewer": lambda: ops.down_bwd_dswiglu(
            x[:-1], x, w_d, w_g, w_u, h, routing,
            ops.small_tiles(16, 16).pick("down_bwd", 128, 256), router_weights, None),
        "d_gate_up of a row fewer": lambda: ops.d_x_rows(d_gate_up[:-1], w_g, w_u, routing,
                                                         ROW_TILES),
        "a gathered operand of a token fewer": lambda: ops.grouped_wgrad(
            x[:-1], h, routing, ops.small_tiles(16, 16).wgrad, gather_a=True, gather_b=False,
            out_dtype=torch.bfloat16),
        "a row operand of a row fewer": lambda: ops.grouped_wgrad(
            x, h[:-1], routing, ops.small_tiles(16, 16).wgrad, gather_a=True, gather_b=False,
            out_dtype=torch.bfloat16),
        "x of a token fewer for the gate/up weight gradients": lambda: ops.grouped_wgrad_gate_up(
            d_gate_up, x[:-1], routing, ops.small_tiles(16, 16).wgrad, gather_x=True,
            out_dtype=torch.bfloat16),
        "copy_rows from a token fewer": lambda: ops.copy_rows(x[:-1], routing, gather=True),
    }
    for name, call in cases.items():
        with pytest.raises(MoKInputError):
            call()
            pytest.fail(f"no error: {name}")
    # row tiles that do not divide the schedule's alignment (16)
    with pytest.raises(ValueError, match="divide the schedule's alignment"):
        ops.gate_up_swiglu(x, w_g, w_u, routing, dataclasses.replace(ROW_TILES, block_m=32),
                           None)


def test_tiles_refuse_what_the_kernels_cannot_tile():
    for fields in (dict(group_m=0), dict(group_m=-1), dict(block_m=48), dict(num_warps=3)):
        with pytest.raises(ValueError):
            dataclasses.replace(ROW_TILES, **fields)


def test_fp8_launchers_refuse_operands_they_would_misread(device):
    x, (w_g, w_u, w_d), _, router_weights, routing = setup(device, inter=128)
    xq = quantize_rows(x)
    h = quantize_rows(torch.randn(routing.capacity_rows, 128, device=device).bfloat16())
    cases = {
        "an expert fewer than the schedule's": lambda: gate_up_swiglu_fp8(
            xq, quantize_weights(w_g[:-1]), quantize_weights(w_u[:-1]), routing, H_TILES),
        "an integer out_dtype": lambda: down_proj_fp8(h, quantize_weights(w_d), routing, TILES,
                                                      out_dtype=torch.int32),
        "an e4m3 out_dtype without scales": lambda: gate_up_swiglu_fp8(
            xq, quantize_weights(w_g), quantize_weights(w_u), routing, H_TILES,
            quantize_h=False, out_dtype=torch.float8_e4m3fn),
        "router weights of stride 2": lambda: quantize_row_blocks(
            x, routing, gather=True,
            router_weights=torch.stack([router_weights] * 2, 1)[:, 0]),
        "weight gradients in int32": lambda: grouped_wgrad_fp8_quantized(
            quantize_row_blocks(x, routing, gather=True),
            quantize_row_blocks(x, routing, gather=True), routing, out_dtype=torch.int32),
        "x of a token fewer": lambda: gate_up_swiglu_fp8(
            quantize_rows(x[:-1]), quantize_weights(w_g), quantize_weights(w_u), routing,
            H_TILES),
        "d_output of a token fewer": lambda: dswiglu_fp8(
            quantize_rows(x[:-1]), quantize_weights(w_d.transpose(1, 2).contiguous()),
            torch.zeros(routing.capacity_rows, 256, device=device).bfloat16(), routing,
            H_TILES, router_weights),
    }
    for name, call in cases.items():
        with pytest.raises(MoKInputError):
            call()
            pytest.fail(f"no error: {name}")


def test_routing_refuses_alignments_and_route_bounds_it_cannot_use(device):
    topk_experts = torch.tensor([[0, 1], [1, 2]], device=device)
    flags = torch.zeros(4, dtype=torch.int32, device=device)
    with pytest.raises(MoKInputError, match="align"):
        ops.build_routing(topk_experts, flags, num_experts=3, first_local_expert=0,
                          num_local_experts=3, align=0, route_capacity=4)
    with pytest.raises(MoKInputError, match="align"):
        ops.dense_routing(2, 0, device)
    with pytest.raises(MoKInputError, match="routes_per_rank"):
        ops.exchange_routes(topk_experts, 3, 3)
