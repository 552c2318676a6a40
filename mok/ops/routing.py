"""Launchers of the routing-schedule kernels, and the routing metadata they produce."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok import _env  # noqa: F401  (decides TRITON_INTERPRET before kernels load)
from mok.errors import MoKInputError
from mok.kernels import routing as kernels
from mok.ops.launch import cdiv, launch, next_power_of_2


@dataclass(frozen=True)
class Routing:
    """Expert-ordered rows of one GEMM group, all on the device, sized from host-known shapes.

    Legend: R = num_tokens * topk routes; C = capacity_rows (a multiple of align); E local experts.

    row_route      [C] int32: route id (token * topk + slot) of each row, -1 for padding.
    route_row      [R] int32: row of each route, -1 when not scheduled (bad id, other rank's
                   expert, or past the capacity).
    block_expert   [C // align] int32: local expert owning each block of align rows, -1 past the
                   last expert.
    expert_counts  [E] int32: routes of each local expert (per-expert token counts).
    expert_offsets [E + 1] int32: first row of each expert; [E] is the number of rows used (at
                   most C: on a capacity overflow the experts' rows past C are not scheduled,
                   while expert_counts keep every expert's routes).
    """

    row_route: torch.Tensor
    route_row: torch.Tensor
    block_expert: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    num_tokens: int
    topk: int
    num_local_experts: int
    align: int

    @property
    def capacity_rows(self) -> int:
        return self.row_route.shape[0]

    @property
    def used_rows(self) -> torch.Tensor:
        """[1] int32 on the device: the rows the experts use (expert_offsets[E])."""
        return self.expert_offsets[self.num_local_experts:]


def check_router_weights(router_weights: torch.Tensor | None, routing: Routing, *,
                         fp32: bool = False) -> None:
    """Raises MoKInputError unless router_weights is None or a contiguous [T * k] or [T, k]
    tensor of a weight per route (route r at flat index r, as the kernels read it), fp32 where
    asked."""
    if router_weights is None:
        return
    routes = routing.num_tokens * routing.topk
    shape = tuple(router_weights.shape)
    if (router_weights.numel() != routes or not router_weights.is_contiguous()
            or shape not in ((routes,), (routing.num_tokens, routing.topk))
            or not router_weights.is_floating_point()
            or (fp32 and router_weights.dtype != torch.float32)):
        raise MoKInputError(
            f"router_weights must be a contiguous {'fp32 ' if fp32 else ''}[T * k] or [T, k] "
            f"tensor of a weight per route (T = {routing.num_tokens}, k = {routing.topk}, route "
            f"r at flat index r), got {shape} {router_weights.dtype} with strides "
            f"{router_weights.stride()}")


def _check_align(align: int) -> None:
    if align < 1:
        raise MoKInputError(f"align must be at least 1 (rows of a block of one expert), got "
                            f"{align}")


def capacity_rows(num_routes: int, num_local_experts: int, align: int, route_capacity: int) -> int:
    """Rows for `route_capacity` routes once each expert's rows are padded to `align`."""
    padded = cdiv(min(num_routes, route_capacity), align) + num_local_experts
    return max(padded, 1) * align


# The histogram launch's most programs (each walks its chunk in sub-chunks) and the values of
# its one-hot tiles, and the routes a scatter program places.
_HISTOGRAM_PROGRAMS = 256
_ONE_HOT_VALUES = 16384
_SCATTER_BLOCK = 1024


def _pow2(n: int) -> int:
    return next_power_of_2(max(int(n), 1))


def build_routing(
    topk_experts: torch.Tensor,
    error_flags: torch.Tensor,
    *,
    num_experts: int,
    first_local_expert: int,
    num_local_experts: int,
    align: int,
    route_capacity: int,
) -> Routing:
    """Stable counting sort of the routes of `topk_experts` [T, topk] (int32/int64) by local expert.

    Routes of expert ids outside [0, num_experts) set ErrorFlag.EXPERT_ID_OUT_OF_RANGE and those
    past the capacity ErrorFlag.CAPACITY_OVERFLOW in `error_flags` (int32, on the device); both are
    left out of the schedule. No host synchronization.
    """
    if topk_experts.dim() != 2:
        raise MoKInputError(f"topk_experts must be [T, topk], got {tuple(topk_experts.shape)}")
    _check_align(align)
    num_tokens, topk = topk_experts.shape
    num_routes = num_tokens * topk
    device = topk_experts.device
    rows = capacity_rows(num_routes, num_local_experts, align, route_capacity)
    e_pad = _pow2(num_local_experts)
    # The histogram's one-hot tiles hold sub * e_pad values; its chunks are sub-chunks enough
    # that at most _HISTOGRAM_PROGRAMS of them cover the routes (the offsets launch, one
    # program, walks every chunk's counts).
    sub = max(16, min(1024, _pow2(_ONE_HOT_VALUES // e_pad)))
    chunk = sub * _pow2(max(cdiv(num_routes, sub * _HISTOGRAM_PROGRAMS), 1))
    num_chunks = max(cdiv(num_routes, chunk), 1)
    flat = topk_experts.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()

    i32 = dict(dtype=torch.int32, device=device)
    # The launches' own scratch (per chunk: counts, then bases; per route: rank in its chunk)
    # shares one allocation (each part 16-byte aligned).
    counts = num_chunks * e_pad
    part = cdiv(counts, 4) * 4
    scratch = torch.empty(2 * part + max(num_routes, 1), **i32)
    chunk_counts = scratch[:counts].view(num_chunks, e_pad)
    chunk_base = scratch[part:part + counts].view(num_chunks, e_pad)
    route_rank = scratch[2 * part:]
    # Separate allocations: the routing tensors leave custom ops (mok.nn), whose outputs may not
    # alias one another. row_route's -1s are written by the histogram kernel.
    row_route = torch.empty(rows, **i32)
    route_row = torch.empty(num_routes, **i32)
    block_expert = torch.empty(rows // align, **i32)
    expert_counts = torch.empty(num_local_experts, **i32)
    expert_offsets = torch.empty(num_local_experts + 1, **i32)

    scalars = (num_routes, num_experts, first_local_expert, num_local_experts)
    fill_rows = cdiv(cdiv(rows, num_chunks), sub) * sub
    launch(kernels.route_histogram_kernel, (num_chunks,))(
        flat, chunk_counts, route_rank, row_route, error_flags, *scalars, rows, fill_rows,
        CHUNK=chunk, SUB=sub, E_PAD=e_pad,
    )
    launch(kernels.route_offsets_kernel, (1,))(
        chunk_counts, chunk_base, expert_counts, expert_offsets, error_flags,
        num_chunks, num_local_experts, rows,
        ALIGN=align, E_PAD=e_pad, CHUNKS_PER_STEP=max(1, min(64, 8192 // e_pad)),
    )
    block = min(chunk, _SCATTER_BLOCK)
    num_blocks = rows // align
    owner_blocks = max(1, min(128, 8192 // e_pad))  # a [blocks, E_PAD] tile of 8192 at most
    programs = max(cdiv(num_routes, block), cdiv(num_blocks, owner_blocks), 1)
    launch(kernels.route_scatter_kernel, (programs,))(
        flat, route_rank, chunk_base, expert_offsets, row_route, route_row, block_expert,
        *scalars, rows, num_blocks,
        CHUNK=chunk, BLOCK=block, E_PAD=e_pad, ALIGN=align, OWNER_BLOCKS=owner_blocks,
    )
    return Routing(row_route, route_row, block_expert, expert_counts, expert_offsets,
                   num_tokens, topk, num_local_experts, align)


def dense_routing(num_tokens: int, align: int, device: torch.device) -> Routing:
    """The identity schedule of a dense MLP (the shared expert): row t is token t, one expert."""
    _check_align(align)
    rows = max(cdiv(num_tokens, align), 1) * align
    i32 = dict(dtype=torch.int32, device=device)
    row_route = torch.arange(rows, **i32)
    row_route[num_tokens:] = -1
    return Routing(
        row_route=row_route,
        route_row=torch.arange(num_tokens, **i32),
        block_expert=torch.zeros(rows // align, **i32),
        expert_counts=torch.full((1,), num_tokens, **i32),
        expert_offsets=torch.arange(2, **i32) * rows,  # no host-to-device copy
        num_tokens=num_tokens, topk=1, num_local_experts=1, align=align,
    )




def exchange_routes(topk_experts: torch.Tensor, routes_per_rank: int, num_experts: int, *,
                    ghost_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(published [routes_per_rank] int32, source_route_row [T * k] int32) of a rank's routes
    under expert parallelism (mok.exchange.SymmetricExchange.build_plan): the expert id of
    each route, -1 when outside [0, num_experts) (ghost_expert: num_experts passes as the
    ghost), num_experts past the T * k routes; route r's own row r, -1 when its id is outside
    [0, num_experts). One launch."""
    flat = topk_experts.reshape(-1)
    if routes_per_rank < flat.shape[0]:
        raise MoKInputError(f"routes_per_rank {routes_per_rank} cannot hold this rank's "
                            f"{flat.shape[0]} routes")
    if not flat.is_contiguous():
        flat = flat.contiguous()
    i32 = dict(dtype=torch.int32, device=flat.device)
    published = torch.empty(routes_per_rank, **i32)
    source_route_row = torch.empty(flat.shape[0], **i32)
    block = 1024
    launch(kernels.exchange_routes_kernel, (max(cdiv(routes_per_rank, block), 1),))(
        flat, published, source_route_row, flat.shape[0], routes_per_rank, num_experts,
        GHOST=bool(ghost_expert), BLOCK=block)
    return published, source_route_row


def local_first_blocks(routing: Routing, block_m: int, rank: int, routes_per_rank: int,
                       lead: float = 1.0) -> torch.Tensor:
    """[C // block_m] int32: the schedule's row blocks of block_m rows, those whose rows all
    come from `rank` (group route g from rank g // routes_per_rank) first, then those with other
    ranks' rows, then those past the used rows; in schedule order within each. lead < 1: only
    the local blocks among the first `lead` of the used ones come first. One launch (one
    program)."""
    num_blocks = routing.capacity_rows // block_m
    order = torch.empty(num_blocks, dtype=torch.int32, device=routing.row_route.device)
    chunk = max(1, min(64, 8192 // block_m))
    launch(kernels.local_first_kernel, (1,))(
        routing.row_route, routing.used_rows, order, num_blocks, rank, routes_per_rank,
        float(lead), BLOCK_M=block_m, CHUNK=chunk, HAS_LEAD=lead < 1.0)
    return order
