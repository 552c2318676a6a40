"""The device-built routing schedule against a stable sort written in PyTorch (exact)."""

import dataclasses

import pytest
import torch

import mok.functional as F
from mok import MoKDataError, ops
from mok.ops import build_routing, capacity_rows, small_tiles
from mok.testing import RoutingPattern, make_topk

from .conftest import DEVICE


def expected_routing(topk_experts, num_experts, align, rows):
    flat = topk_experts.reshape(-1).long().cpu()
    num_routes = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64)
    row_route = torch.full((rows,), -1, dtype=torch.int64)
    route_row = torch.full((num_routes,), -1, dtype=torch.int64)
    offsets = [0]
    for expert in range(num_experts):
        routes = (flat == expert).nonzero().squeeze(1)  # ascending route id: token, then slot
        counts[expert] = routes.numel()
        for i, route in enumerate(routes.tolist()):
            row = offsets[-1] + i
            if row < rows:
                row_route[row] = route
                route_row[route] = row
        offsets.append(offsets[-1] + -(-routes.numel() // align) * align)
    block_expert = torch.full((rows // align,), -1, dtype=torch.int64)
    for expert in range(num_experts):
        for block in range(offsets[expert] // align, offsets[expert + 1] // align):
            if block < block_expert.numel():
                block_expert[block] = expert
    return counts, torch.tensor(offsets), row_route, route_row, block_expert


def routing_of(topk_experts, num_experts, align, multiplier=1.0):
    flags = torch.zeros(4, dtype=torch.int32, device=topk_experts.device)
    num_routes = topk_experts.numel()
    routing = build_routing(topk_experts, flags, num_experts=num_experts, first_local_expert=0,
                            num_local_experts=num_experts, align=align,
                            route_capacity=int(multiplier * num_routes))
    return routing, flags


@pytest.mark.parametrize("num_tokens,num_experts,topk,align,pattern", [
    (37, 5, 2, 16, RoutingPattern.RANDOM),
    (100, 8, 4, 32, RoutingPattern.SKEWED),
    (64, 6, 3, 16, RoutingPattern.DUPLICATES),
    (50, 4, 2, 16, RoutingPattern.ONE_EXPERT),
    (40, 7, 1, 16, RoutingPattern.EMPTY_EXPERT),
    (1, 1, 1, 16, RoutingPattern.RANDOM),
    (700, 130, 8, 128, RoutingPattern.RANDOM),  # E above one pow2 block, many chunks
])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_schedule_matches_stable_sort(num_tokens, num_experts, topk, align, pattern,
                                      index_dtype):
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    topk_experts = make_topk(num_tokens, num_experts, topk, pattern, gen).to(index_dtype)
    routing, flags = routing_of(topk_experts.to(DEVICE), num_experts, align)
    rows = capacity_rows(num_tokens * topk, num_experts, align, num_tokens * topk)
    counts, offsets, row_route, route_row, block_expert = expected_routing(
        topk_experts, num_experts, align, rows)
    assert routing.capacity_rows == rows
    assert torch.equal(routing.expert_counts.cpu().long(), counts)
    assert torch.equal(routing.expert_offsets.cpu().long(), offsets)
    assert torch.equal(routing.row_route.cpu().long(), row_route)
    assert torch.equal(routing.route_row.cpu().long(), route_row)
    assert torch.equal(routing.block_expert.cpu().long(), block_expert)
    assert int(flags.sum()) == 0


def test_out_of_range_ids_are_flagged_and_left_out():
    topk_experts = torch.tensor([[0, 1], [5, 2], [-1, 3], [1, 4]])
    routing, flags = routing_of(topk_experts.to(DEVICE), 5, 16)
    assert flags.tolist()[:2] == [1, 0]
    # Routes 2 (id 5) and 4 (id -1) are not scheduled; the others are, in stable order.
    assert routing.route_row.cpu().tolist()[2] == -1
    assert routing.route_row.cpu().tolist()[4] == -1
    placed = routing.row_route.cpu()
    # expert 0: route 0; expert 1: routes 1, 6; expert 2: 3; expert 3: 5; expert 4: 7.
    assert placed[placed >= 0].tolist() == [0, 1, 6, 3, 5, 7]
    assert routing.expert_counts.cpu().tolist() == [1, 2, 1, 1, 1]


def test_capacity_overflow_is_flagged_and_never_written_past_capacity():
    topk_experts = torch.zeros(64, 2, dtype=torch.int64)  # 128 routes, all on expert 0
    routing, flags = routing_of(topk_experts.to(DEVICE), 3, 16, multiplier=0.25)
    assert routing.capacity_rows == capacity_rows(128, 3, 16, 32)
    assert flags.tolist()[:2] == [0, 1]
    placed = routing.route_row.cpu()
    assert int((placed >= 0).sum()) == routing.capacity_rows  # the first routes, in order
    assert torch.equal(placed[: routing.capacity_rows].long(),
                       torch.arange(routing.capacity_rows))
    assert bool((placed[routing.capacity_rows:] == -1).all())


def _workspace(topk=2, tokens=8):
    config = F.MoKConfig()
    return config, F.create_workspace(config, None, device=DEVICE, num_local_tokens=tokens,
                                      hidden_size=16, topk=topk)


def test_bad_ids_raise_at_next_call_and_at_once_with_validate():
    config, workspace = _workspace()
    bad = torch.tensor([[0, 9]] * 8, device=DEVICE)
    good = torch.tensor([[0, 1]] * 8, device=DEVICE)
    with pytest.raises(MoKDataError, match="EXPERT_ID_OUT_OF_RANGE"):
        F.build_schedule(workspace, config, bad, num_local_experts=4, validate=True)
    F.build_schedule(workspace, config, bad, num_local_experts=4)  # queued, not raised yet
    with pytest.raises(MoKDataError, match="EXPERT_ID_OUT_OF_RANGE"):
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        F.build_schedule(workspace, config, good, num_local_experts=4)
    F.build_schedule(workspace, config, good, num_local_experts=4)  # flags were cleared
    F.check_errors(workspace)


def test_capacity_overflow_raises():
    config = F.MoKConfig(schedule_capacity_multiplier=0.5)
    workspace = F.create_workspace(config, None, device=DEVICE, num_local_tokens=64,
                                   hidden_size=16, topk=2)
    topk_experts = torch.zeros(64, 2, dtype=torch.int64, device=DEVICE)
    F.build_schedule(workspace, config, topk_experts, num_local_experts=2,
                     tiles=small_tiles(16))
    with pytest.raises(MoKDataError, match="CAPACITY_OVERFLOW"):
        F.check_errors(workspace)


@pytest.mark.parametrize("grouped_mm", [False, True], ids=["triton", "grouped_mm"])
def test_weight_gradient_stops_at_the_rows_of_an_overflowing_schedule(grouped_mm):
    # Every route on one expert, a schedule holding a quarter of them (80 rows for 96 routes):
    # the expert's route count runs past the schedule's rows. On a GPU the backward may run
    # before the error reaches the host, so the kernels must stay inside the rows: the rows in
    # use are clamped to them, and the weight gradient sums exactly the rows scheduled.
    config = F.MoKConfig(schedule_capacity_multiplier=0.25)
    tokens, topk, width_p, width_q = 48, 2, 24, 40
    workspace = F.create_workspace(config, None, device=DEVICE, num_local_tokens=tokens,
                                   hidden_size=width_q, topk=topk)
    topk_experts = torch.zeros(tokens, topk, dtype=torch.int64, device=DEVICE)
    tiles = small_tiles(16)
    schedule = F.build_schedule(workspace, config, topk_experts, num_local_experts=3,
                                tiles=tiles)
    with pytest.raises(MoKDataError, match="CAPACITY_OVERFLOW"):
        F.check_errors(workspace)
    routing = schedule.routing
    rows = routing.capacity_rows
    assert rows < tokens * topk
    assert int(routing.expert_offsets[-1]) == rows  # clamped to the rows
    assert routing.expert_counts.tolist() == [tokens * topk, 0, 0]  # the true counts
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(rows, width_p, generator=generator).to(DEVICE, torch.float16)
    x = torch.randn(tokens, width_q, generator=generator).to(DEVICE, torch.float16)
    wgrad = dataclasses.replace(tiles.wgrad, grouped_mm=grouped_mm)
    out = ops.grouped_wgrad(a, x, routing, wgrad, gather_a=False, gather_b=True,
                            out_dtype=torch.float32)
    route = routing.row_route.long().cpu()
    placed = route >= 0
    expected = a.cpu().double()[placed].T @ x.cpu().double()[route[placed] // topk]
    assert int(placed.sum()) == rows  # every row of expert 0, no padding left
    torch.testing.assert_close(out[0].cpu().double(), expected, rtol=1e-3, atol=1e-2)
    assert bool((out[1:] == 0).all())
