"""Expert parallelism across nodes: torch.distributed collectives between nodes, symmetric memory
inside each node.

The group's ranks are taken node by node: rank r is local rank r % L of node r // L (L ranks per
node, N = P / L nodes; torchrun numbers ranks this way). Expert e lives on rank e // E_local as
always, so node n holds experts [n * E_node, (n + 1) * E_node), E_node = L * E_local.

Rank (n, l) exchanges tokens with its "rail": the ranks (m, l) of the other nodes.

- Dispatch: every rank gathers its rail's tokens (x, top-k ids, router weights; d_output in the
  backward), each rank's T tokens padded to the workspace's T_max: N * T_max "group tokens" in
  node order (padding routes to no expert). A fixed size, known on the host, so no host sync
  and no dropped token, at the cost of sending each token to every node once.
- Inside the node, the group tokens go through the one-node layer (symmetric memory when L > 1,
  one GPU when L == 1) against the node's experts; a route to another node's expert is a ghost
  (an id no rank of the node owns), left out.
- Combine: an all_to_all returns each node's partial output of a token to the token's rank, which
  adds the shared expert and the N partials in a fixed order (node 0 first). The backward returns
  d_x and the router-weight gradients the same way; weight gradients stay with the experts.

Deterministic as long as the collectives are (they only move data; every sum is ours).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mok import functional as F
from mok import ops
from mok.errors import MoKInputError


def ranks_per_node_of(group: dist.ProcessGroup) -> int:
    """Ranks of `group` per host (one host: the whole group); checks node-by-node numbering."""
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    per_node = hosts.count(hosts[0])
    runs = [hosts[i:i + per_node] for i in range(0, len(hosts), per_node)]
    if any(len(set(run)) != 1 for run in runs) or len({run[0] for run in runs}) != len(runs):
        raise MoKInputError(f"the group's ranks must be numbered node by node, got hosts {hosts}")
    return per_node


_PADDING = -2  # the top-k id of the padding rows (no expert anywhere, not an error)


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup, rows: int,
            fill: float = 0) -> torch.Tensor:
    """[N * rows, ...]: every rail rank's `tensor` padded to `rows` rows with `fill`, in node
    order."""
    if tensor.shape[0] < rows:
        padding = tensor.new_full((rows - tensor.shape[0], *tensor.shape[1:]), fill)
        tensor = torch.cat([tensor, padding])
    size = dist.get_world_size(group)
    out = tensor.new_empty((size * rows, *tensor.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor.contiguous(), group=group)
    return out


def _return_and_sum(partial: torch.Tensor, group: dist.ProcessGroup, rows: int,
                    first=None) -> torch.Tensor:
    """Send node m's block of `partial` [N * T_max, ...] back to rail rank m; sum the first `rows`
    rows of what comes back (plus `first`, added first) in fp32, node by node, in partial's
    dtype."""
    received = torch.empty_like(partial)
    dist.all_to_all_single(received, partial.contiguous(), group=group)
    blocks = received.view(dist.get_world_size(group), -1, *partial.shape[1:])[:, :rows]
    total = first.float() if first is not None else torch.zeros_like(blocks[0], dtype=torch.float)
    for block in blocks:
        total += block.float()
    return total.to(partial.dtype)


@dataclass(frozen=True)
class CrossNodePlan:
    """The one-node schedule of the group tokens (and the ranks' layout)."""

    inner: F.Schedule
    num_nodes: int


class CrossNode:
    """The cross-node state of a workspace: subgroups and the one-node workspace inside."""

    def __init__(self, config: F.MoKConfig, group: dist.ProcessGroup, device: torch.device, *,
                 num_tokens: int, hidden_size: int, topk: int, ranks_per_node: int) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        per_node = int(ranks_per_node)
        if per_node < 1 or world % per_node:
            raise MoKInputError(f"ranks_per_node={per_node} does not divide the group of {world}")
        self.num_nodes = world // per_node
        self.ranks_per_node = per_node
        self.node, self.local_rank = divmod(rank, per_node)
        ranks = [dist.get_global_rank(group, r) for r in range(world)]
        # Every rank creates every subgroup, in the same order (torch.distributed requires it).
        for node in range(self.num_nodes):
            subgroup = dist.new_group(ranks[node * per_node:(node + 1) * per_node])
            if node == self.node:
                self.node_group = subgroup
        for local in range(per_node):
            subgroup = dist.new_group(ranks[local::per_node])
            if local == self.local_rank:
                self.rail_group = subgroup
        self.inner = F.create_workspace(
            config, self.node_group if per_node > 1 else None, device=device,
            num_local_tokens=self.num_nodes * num_tokens, hidden_size=hidden_size, topk=topk,
            ranks_per_node=per_node)
        self.inner._ghost_expert = True
        self.max_tokens = num_tokens

    # -- the phases --------------------------------------------------------------------------
    def build_schedule(self, workspace: F.Workspace, config: F.MoKConfig,
                       topk_experts: torch.Tensor, *, num_local_experts: int,
                       tiles) -> F.Schedule:
        node_experts = num_local_experts * self.ranks_per_node
        num_experts = node_experts * self.num_nodes
        group_topk = _gather(topk_experts.to(torch.int64), self.rail_group, self.max_tokens,
                             fill=_PADDING)
        first = self.node * node_experts
        here = (group_topk >= first) & (group_topk < first + node_experts)
        elsewhere = ((group_topk >= 0) & (group_topk < num_experts)) | (group_topk == _PADDING)
        # Ids of this node's experts count from 0; other nodes' experts and padding become the
        # ghost id node_experts (no rank owns it); ids out of range become -1 (an error).
        node_topk = torch.where(here, group_topk - first,
                                torch.where(elsewhere, node_experts, -1))
        inner = F.build_schedule(self.inner, config, node_topk,
                                 num_local_experts=num_local_experts, tiles=tiles,
                                 validate=False)
        return F.Schedule(inner.routing, workspace.dense_routing(topk_experts.shape[0],
                                                                  inner.tiles.align),
                          inner.tiles, num_experts, workspace,
                          CrossNodePlan(inner, self.num_nodes))

    def forward(self, config, schedule, x, router_weights, shared, routed, swiglu_limit):
        inner = schedule.exchange.inner
        x_group = _gather(x, self.rail_group, self.max_tokens)
        weights_group = _gather(router_weights, self.rail_group, self.max_tokens)
        partial, context = F.forward(config, self.inner, inner, x_group, weights_group,
                                     None, None, None, *routed, swiglu_limit=swiglu_limit)
        shared_rows, h_shared = None, None
        if shared[0] is not None:
            h_shared, shared_rows = _shared_forward(schedule, x, shared, swiglu_limit)
        y = _return_and_sum(partial, self.rail_group, x.shape[0],
                            shared_rows[:x.shape[0]] if shared_rows is not None else None)
        return y, F.ForwardContext(context.h, h_shared, inner=context)

    def recompute(self, config, schedule, x, router_weights, shared, routed, swiglu_limit):
        """The forward context again (gate/up only), every rank of the group taking part."""
        x_group = _gather(x, self.rail_group, self.max_tokens)
        weights_group = _gather(router_weights, self.rail_group, self.max_tokens)
        context = F.recompute_forward_context(
            config, self.inner, schedule.exchange.inner, x_group, None, None, *routed,
            swiglu_limit=swiglu_limit, router_weights=weights_group)
        h_shared = None
        if shared[0] is not None:
            h_shared = _shared_gate_up(schedule, x, shared, swiglu_limit)
        return F.ForwardContext(context.h, h_shared, inner=context)

    def backward(self, config, schedule, context, d_output, x, router_weights, shared, routed,
                 swiglu_limit):
        inner = schedule.exchange.inner
        # The group tokens are gathered again rather than kept from the forward (N x T rows).
        d_output_group = _gather(d_output, self.rail_group, self.max_tokens)
        x_group = _gather(x, self.rail_group, self.max_tokens)
        weights_group = _gather(router_weights, self.rail_group, self.max_tokens)
        d_x_part, d_w_part, *d_routed = F.backward(
            config, self.inner, inner, context.inner, d_output_group, x_group, weights_group,
            None, None, None, *routed, swiglu_limit=swiglu_limit)[:5]
        d_shared, d_x_shared = (None, None, None), None
        if shared[0] is not None:
            d_x_shared_rows, _, grads = F._expert_backward(
                schedule.tiles, schedule.shared_routing, d_output, x, context.h_shared, None,
                shared[0][None], shared[1][None], shared[2][None], swiglu_limit)
            d_shared = tuple(grad[0] for grad in grads)
            d_x_shared = d_x_shared_rows[:x.shape[0]]  # the shared rows are the tokens
        tokens = x.shape[0]
        d_x = _return_and_sum(d_x_part, self.rail_group, tokens, d_x_shared)
        d_router_weights = _return_and_sum(d_w_part, self.rail_group, tokens)  # one node each
        return (d_x, d_router_weights, *d_routed, *d_shared)


def _shared_gate_up(schedule, x, shared, swiglu_limit):
    """h of the shared expert on this rank's own tokens."""
    return ops.gate_up_swiglu(x, shared[0][None], shared[1][None], schedule.shared_routing,
                              schedule.tiles.pick("gate_up", shared[0].shape[0], x.shape[1]),
                              swiglu_limit)


def _shared_forward(schedule, x, shared, swiglu_limit):
    """The shared expert on this rank's own tokens: (h_shared, its output rows)."""
    h = _shared_gate_up(schedule, x, shared, swiglu_limit)
    rows = ops.down_proj(h, shared[2][None], schedule.shared_routing,
                         schedule.tiles.pick("down", x.shape[1], shared[0].shape[0]), None)
    return h, rows
