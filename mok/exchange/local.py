"""One GPU: every token row is here; the exchange moves nothing."""

from __future__ import annotations

import torch

from mok import ops
from mok.exchange.base import (
    BackwardRows,
    Exchange,
    ForwardRows,
    Fp8ForwardRows,
    Movement,
    Phase,
    route_capacity,
)
from mok.ops import Routing


class LocalExchange(Exchange):
    """The identity exchange. ghost_expert: the expert id E passes as an expert no one owns (the
    routes of a node to other nodes' experts, mok.exchange.cross_node)."""

    def __init__(self, errors: torch.Tensor, *, ghost_expert: bool = False) -> None:
        self.errors = errors
        self.ghost_expert = ghost_expert

    @property
    def rows_here(self) -> bool:
        return True

    def movement(self, phase: Phase, config) -> Movement:
        return Movement.HERE

    def build_schedule(self, topk_experts, *, config, num_local_experts, align):
        num_routes = topk_experts.shape[0] * topk_experts.shape[1]
        routing = ops.build_routing(
            topk_experts, self.errors, num_experts=num_local_experts + int(self.ghost_expert),
            first_local_expert=0, num_local_experts=num_local_experts, align=align,
            route_capacity=route_capacity(num_routes, 1, config.schedule_capacity_multiplier))
        return routing, None

    def tokens(self, *tensors):
        return tensors

    def forward_rows(self, plan, x, router_weights, *, config, block_m):
        return ForwardRows(x, router_weights)

    def backward_rows(self, plan, d_output, x, *, config, block_m, kept, apart):
        return BackwardRows(d_output, x)

    def forward_rows_fp8(self, plan, x, xq, router_weights, *, config):
        return Fp8ForwardRows(xq if xq is not None else ops.quantize_rows(x), router_weights)

    def backward_rows_fp8(self, plan, d_output, x, *, config, dq=None, xq=None):
        if config.fp8_weight_gradients:
            return BackwardRows(dq if dq is not None else ops.quantize_rows(d_output),
                                xq if xq is not None else ops.quantize_rows(x))
        return BackwardRows(d_output, x)

    def rows_read(self, phase):
        pass

    def scatter(self, plan, dtype):
        return None

    def send_route_values(self, plan, by_route):
        pass

    def deliveries_done(self, plan, phase, dtype, *, values, wait):
        pass

    def landed(self, phase):
        pass

    def combine(self, plan, rows: torch.Tensor, routing: Routing, shared_rows, dtype):
        return ops.combine(rows, routing, shared_rows, dtype)

    def route_values(self, plan, by_route):
        return by_route
