"""The device-built routing schedule against a stable sort written in PyTorch (exact)."""

import dataclasses

import pytest
import torch

import mok.functional as F
from mok import MoKDataError, ops
from mok.ops import build_routing, capacity_rows, small_tiles
from mok.ops import routing as routing_ops
from mok.testing import RoutingPattern, make_topk

from ..conftest import DEVICE


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
    (4, 300, 2, 16, RoutingPattern.RANDOM),  # more row blocks than routes: owner-only programs
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


@pytest.mark.parametrize("num_tokens,num_experts,topk,pattern", [
    (100, 8, 4, RoutingPattern.SKEWED),
    (64, 6, 3, RoutingPattern.DUPLICATES),
    (300, 130, 8, RoutingPattern.RANDOM),
    (1, 1, 1, RoutingPattern.RANDOM),
])
def test_schedule_with_many_sub_chunks_a_program(monkeypatch, num_tokens, num_experts, topk,
                                                pattern):
    # Few histogram programs, each walking many sub-chunks (as with many routes or many
    # experts): the ranks carry over from sub-chunk to sub-chunk.
    monkeypatch.setattr(routing_ops, "_HISTOGRAM_PROGRAMS", 3)
    monkeypatch.setattr(routing_ops, "_ONE_HOT_VALUES", 256)  # sub-chunks of 16 to 32 routes
    gen = torch.Generator().manual_seed(num_tokens * num_experts)
    topk_experts = make_topk(num_tokens, num_experts, topk, pattern, gen)
    routing, flags = routing_of(topk_experts.to(DEVICE), num_experts, 16)
    rows = capacity_rows(num_tokens * topk, num_experts, 16, num_tokens * topk)
    expected = expected_routing(topk_experts, num_experts, 16, rows)
    actual = (routing.expert_counts, routing.expert_offsets, routing.row_route,
              routing.route_row, routing.block_expert)
    for name, a, b in zip(("counts", "offsets", "row_route", "route_row", "block_expert"),
                          actual, expected, strict=True):
        assert torch.equal(a.cpu().long(), b), name
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
    # No forward used that schedule: the next call starts its check, the one after raises.
    F.build_schedule(workspace, config, good, num_local_experts=4)
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
    # torch._grouped_mm takes bf16 on a GPU (mok.ops.experts.grouped_mm_takes)
    dtype = torch.bfloat16 if grouped_mm and DEVICE.type == "cuda" else torch.float16
    a = torch.randn(rows, width_p, generator=generator).to(DEVICE, dtype)
    x = torch.randn(tokens, width_q, generator=generator).to(DEVICE, dtype)
    wgrad = dataclasses.replace(tiles.wgrad, grouped_mm=grouped_mm)
    out = ops.grouped_wgrad(a, x, routing, wgrad, gather_a=False, gather_b=True,
                            out_dtype=torch.float32)
    route = routing.row_route.long().cpu()
    placed = route >= 0
    expected = a.cpu().double()[placed].T @ x.cpu().double()[route[placed] // topk]
    assert int(placed.sum()) == rows  # every row of expert 0, no padding left
    # torch._grouped_mm rounds its bf16 result (to 2**-8 relative) before it becomes fp32
    rtol, atol = (8e-3, 8e-2) if dtype == torch.bfloat16 else (1e-3, 1e-2)
    torch.testing.assert_close(out[0].cpu().double(), expected, rtol=rtol, atol=atol)
    assert bool((out[1:] == 0).all())


def _local_first_expected(row_route, used_rows, block_m, rank, routes_per_rank, lead):
    """The order of ops.local_first_blocks, by a sort on the host."""
    blocks = row_route.shape[0] // block_m
    route = row_route[:blocks * block_m].view(blocks, block_m)
    remote = ((route >= 0) & (route // routes_per_rank != rank)).any(dim=1).tolist()
    used = used_rows // block_m
    keys = [2 if b >= used else 0 if not remote[b] and b < used * lead else 1
            for b in range(blocks)]
    return sorted(range(blocks), key=lambda b: (keys[b], b))


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("lead", [1.0, 0.5, 0.3])
def test_local_first_blocks_is_a_stable_partition(block_m, lead):
    # Row blocks of a group schedule whose routes come from three ranks, some blocks all one
    # rank's, padding (-1) mixed in, and unused blocks past used_rows: the order puts rank's
    # blocks (within the lead) first, then the other used ones, then the unused ones, each in
    # schedule order; more blocks than the kernel's chunk.
    generator = torch.Generator().manual_seed(block_m + int(lead * 10))
    routes_per_rank, blocks = 1000, 150
    rows = blocks * block_m + block_m // 2  # a partial block at the end is left out
    owner = torch.randint(0, 3, (blocks,), generator=generator)
    mixed = torch.rand(blocks, generator=generator) < 0.4
    rank_of_row = owner.repeat_interleave(block_m)
    rank_of_row = torch.where(mixed.repeat_interleave(block_m),
                              torch.randint(0, 3, (blocks * block_m,), generator=generator),
                              rank_of_row)
    route = rank_of_row * routes_per_rank + torch.randint(0, routes_per_rank,
                                                          (blocks * block_m,),
                                                          generator=generator)
    route = torch.where(torch.rand(blocks * block_m, generator=generator) < 0.1, -1, route)
    row_route = torch.cat([route, torch.full((rows - blocks * block_m,), -1)]).to(torch.int32)
    for rank in range(3):
        for used_blocks in (0, 97, blocks):
            used_rows = used_blocks * block_m
            routing = ops.Routing(
                row_route=row_route.to(DEVICE), route_row=torch.empty(0, dtype=torch.int32),
                block_expert=torch.empty(0, dtype=torch.int32),
                expert_counts=torch.empty(0, dtype=torch.int32),
                expert_offsets=torch.tensor([0, used_rows], dtype=torch.int32, device=DEVICE),
                num_tokens=0, topk=1, num_local_experts=1, align=block_m)
            order = ops.local_first_blocks(routing, block_m, rank, routes_per_rank, lead)
            expected = _local_first_expected(row_route, used_rows, block_m, rank,
                                             routes_per_rank, lead)
            assert order.dtype == torch.int32
            assert order.cpu().tolist() == expected, (rank, used_blocks)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ghost", [False, True])
def test_exchange_routes(dtype, ghost):
    # A rank's published expert ids: in-range ids as they are, out-of-range ones -1 (an int64 id
    # is not wrapped into range first), the ghost id E kept only with ghost_expert, the slots
    # past the rank's T * k routes up to the workspace's E; its routes' own rows, -1 where the
    # id is out of range or the ghost.
    num_experts, routes_per_rank = 12, 2100
    topk = torch.randint(0, num_experts, (250, 7), generator=torch.Generator().manual_seed(3))
    topk = topk.to(dtype)
    topk[0, 0], topk[1, 3], topk[2, 6] = -1, num_experts, num_experts + 5
    if dtype == torch.int64:
        topk[3, 1] = 2**32 + 1  # wraps to 1 in int32
    flat = topk.reshape(-1)
    published, source_row = ops.exchange_routes(topk.to(DEVICE), routes_per_rank, num_experts,
                                                ghost_expert=ghost)
    valid = (flat >= 0) & (flat < num_experts)
    passes = valid | (flat == num_experts) if ghost else valid
    expected = torch.full((routes_per_rank,), num_experts, dtype=torch.int32)
    expected[:flat.shape[0]] = torch.where(passes, flat, -1).to(torch.int32)
    assert torch.equal(published.cpu(), expected)
    rows = torch.arange(flat.shape[0], dtype=torch.int32)
    assert torch.equal(source_row.cpu(), torch.where(valid, rows, -1))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_bad_ids_of_a_layer_call_raise_at_a_later_call(precision):
    # The forward starts the check of its schedule once its kernels are launched; a later
    # call raises (on a GPU once the check has finished: here after a sync).
    from mok.testing import make_inputs

    from ..conftest import tiles_for_tests

    tokens, hidden, inter, experts, topk = 16, 128, 128, 4, 2
    inputs = make_inputs(tokens, hidden, inter, experts, topk, device=DEVICE, seed=3)
    config = F.MoKConfig(precision=precision)
    workspace = F.create_workspace(config, None, device=DEVICE, num_local_tokens=tokens,
                                   hidden_size=hidden, topk=topk)
    bad = inputs.topk_experts.clone()
    bad[5, 1] = experts  # out of range
    tiles = tiles_for_tests(32)
    schedule = F.build_schedule(workspace, config, bad, num_local_experts=experts, tiles=tiles)
    F.forward(config, workspace, schedule, *inputs.layer_args)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    with pytest.raises(MoKDataError, match="EXPERT_ID_OUT_OF_RANGE"):
        F.build_schedule(workspace, config, inputs.topk_experts, num_local_experts=experts,
                         tiles=tiles)
    F.build_schedule(workspace, config, inputs.topk_experts, num_local_experts=experts,
                     tiles=tiles)
    F.check_errors(workspace)  # raised once, then cleared
