"""How token rows reach the experts and come back: one exchange object per mode, one protocol.

LocalExchange      one GPU (moves nothing)
SymmetricExchange  the ranks of one node, through symmetric memory (rows pulled or copied)
CrossNodeExchange  nodes: collectives between them around one of the above inside each

mok.exchange.base describes the protocol and the order of its phases.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok import _env
from mok.errors import MoKInputError
from mok.exchange.base import (
    BackwardRows,
    Exchange,
    ForwardRows,
    Fp8ForwardRows,
    Movement,
    Phase,
    route_capacity,
)
from mok.exchange.cross_node import CrossNodeExchange, CrossNodePlan, ranks_per_node_of
from mok.exchange.local import LocalExchange
from mok.exchange.symmetric import ExchangePlan, SymmetricExchange, pull_order


def create_exchange(group: dist.ProcessGroup | None, device: torch.device, *, num_tokens: int,
                    hidden_size: int, topk: int, timeout_s: float, errors: torch.Tensor,
                    ranks_per_node: int | None = None,
                    macrobatch: int | None = None) -> Exchange:
    """The exchange of a workspace: one GPU without a group (or a group of one rank), else
    symmetric memory inside a node and collectives between nodes (ranks_per_node: default found
    from the host names); macrobatch: the symmetric buffer's ring window (MoKConfig.
    macrobatch_size)."""
    if group is None or dist.get_world_size(group) == 1:
        return LocalExchange(errors)
    if device.type == "cpu" and not _env.INTERPRET:
        raise MoKInputError("expert parallelism on CPU needs Triton's interpreter")
    world = dist.get_world_size(group)
    per_node = ranks_per_node or ranks_per_node_of(group)
    if per_node < 1 or world % per_node:
        raise MoKInputError(f"ranks_per_node={per_node} does not divide the group of "
                            f"{world} ranks")
    if per_node < world:
        return CrossNodeExchange(group, device, num_tokens=num_tokens, hidden_size=hidden_size,
                                 topk=topk, ranks_per_node=per_node, timeout_s=timeout_s,
                                 errors=errors, macrobatch=macrobatch)
    return SymmetricExchange(group, device, num_tokens=num_tokens, hidden_size=hidden_size,
                             topk=topk, timeout_s=timeout_s, errors=errors,
                             macrobatch=macrobatch)


__all__ = [
    "BackwardRows",
    "CrossNodeExchange",
    "CrossNodePlan",
    "Exchange",
    "ExchangePlan",
    "ForwardRows",
    "Fp8ForwardRows",
    "LocalExchange",
    "Movement",
    "Phase",
    "SymmetricExchange",
    "create_exchange",
    "pull_order",
    "ranks_per_node_of",
    "route_capacity",
]
