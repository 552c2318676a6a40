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
- Inside the node, the group tokens go through the one-node exchange (symmetric memory when
  L > 1, one GPU when L == 1) against the node's experts; a route to another node's expert is a
  ghost (an id no rank of the node owns), left out.
- Combine: an all_to_all returns each node's partial output of a token to the token's rank, which
  adds the shared expert (computed on its own tokens) and the N partials in a fixed order (node 0
  first). The backward returns d_x and the router-weight gradients the same way; weight
  gradients stay with the experts.

Deterministic as long as the collectives are (they only move data; every sum is ours).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mok.errors import ErrorFlag, MoKInputError
from mok.exchange.base import Exchange
from mok.exchange.local import LocalExchange
from mok.exchange.symmetric import EXPERT_TAG, SymmetricExchange


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
    """The one-node exchange's plan of the group tokens' schedule; num_tokens: this rank's."""

    inner: object
    num_nodes: int
    num_tokens: int


class CrossNodeExchange(Exchange):
    """Collectives between the nodes around the one-node exchange `inner` of the node's ranks.

    errors: the workspace's error flags. The subgroups are created here, on every rank alike.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, *, num_tokens: int,
                 hidden_size: int, topk: int, ranks_per_node: int, timeout_s: float,
                 errors: torch.Tensor, macrobatch: int | None = None) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        per_node = int(ranks_per_node)
        if per_node < 1 or world % per_node:
            raise MoKInputError(f"ranks_per_node={per_node} does not divide the group of {world}")
        self.num_ranks, self.rank = world, rank
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
        self.max_tokens = num_tokens
        self.errors = errors
        group_tokens = self.num_nodes * num_tokens
        if per_node > 1:
            self.inner: Exchange = SymmetricExchange(
                self.node_group, device, num_tokens=group_tokens, hidden_size=hidden_size,
                topk=topk, timeout_s=timeout_s, errors=errors, ghost_expert=True,
                macrobatch=macrobatch and self.num_nodes * macrobatch)
        else:
            self.inner = LocalExchange(errors, ghost_expert=True)

    @property
    def rows_here(self) -> bool:
        return self.inner.rows_here

    @property
    def delivers_in_combine(self) -> bool:
        return self.inner.delivers_in_combine

    def group_rank(self, peer: int) -> int:
        return self.node * self.ranks_per_node + peer

    def movement(self, phase, config):
        return self.inner.movement(phase, config)

    def build_schedule(self, topk_experts, *, config, num_local_experts, align):
        node_experts = num_local_experts * self.ranks_per_node
        num_experts = node_experts * self.num_nodes
        # Ids out of range become -1 (an error) before the padding joins them, so that no id of
        # the caller's reads as padding; each carries its rank's expert count (as inside the
        # node), so that a rank counting otherwise reads -1.
        own_topk = topk_experts.to(torch.int64)
        own_topk = torch.where((own_topk >= 0) & (own_topk < num_experts), own_topk, -1)
        tag = num_experts * EXPERT_TAG
        group_topk = _gather(own_topk + tag, self.rail_group, self.max_tokens,
                             fill=_PADDING + tag) - tag
        group_topk = torch.where((group_topk >= -1) & (group_topk < num_experts)
                                 | (group_topk == _PADDING), group_topk, -1)
        first = self.node * node_experts
        here = (group_topk >= first) & (group_topk < first + node_experts)
        elsewhere = (group_topk >= 0) | (group_topk == _PADDING)
        # Ids of this node's experts count from 0; other nodes' experts and padding become the
        # ghost id node_experts (no rank owns it); -1 stays (an error).
        node_topk = torch.where(here, group_topk - first,
                                torch.where(elsewhere, node_experts, -1))
        routing, inner = self.inner.build_schedule(node_topk, config=config,
                                                   num_local_experts=num_local_experts,
                                                   align=align)
        return routing, CrossNodePlan(inner, self.num_nodes, topk_experts.shape[0])

    def tokens(self, *tensors):
        """Every rail rank's tokens, each rank's padded to T_max rows: [N * T_max, ...]."""
        return tuple(_gather(t, self.rail_group, self.max_tokens) for t in tensors)

    def forward_rows(self, plan, x, router_weights, *, config, block_m):
        return self.inner.forward_rows(plan.inner, x, router_weights, config=config,
                                       block_m=block_m)

    def backward_rows(self, plan, d_output, x, *, config, block_m, kept, apart):
        return self.inner.backward_rows(plan.inner, d_output, x, config=config, block_m=block_m,
                                        kept=kept, apart=apart)

    def forward_rows_fp8(self, plan, x, xq, router_weights, *, config):
        return self.inner.forward_rows_fp8(plan.inner, x, xq, router_weights, config=config)

    def backward_rows_fp8(self, plan, d_output, x, *, config, dq=None, xq=None):
        return self.inner.backward_rows_fp8(plan.inner, d_output, x, config=config, dq=dq,
                                            xq=xq)

    def rows_read(self, phase):
        self.inner.rows_read(phase)

    def scatter(self, plan, dtype):
        return self.inner.scatter(plan.inner, dtype)

    def send_route_values(self, plan, by_route):
        self.inner.send_route_values(plan.inner, by_route)

    def deliveries_done(self, plan, phase, dtype, *, values, wait):
        self.inner.deliveries_done(plan.inner, phase, dtype, values=values, wait=wait)

    def landed(self, phase):
        self.inner.landed(phase)

    def combine(self, plan, rows, routing, shared_rows, dtype):
        """The node's partial outputs of the group tokens go back to their ranks, which add the
        shared expert's rows first and the nodes' partials in node order."""
        partial = self.inner.combine(plan.inner, rows, routing, None, dtype)
        own = plan.num_tokens
        self._share_overflow()
        return _return_and_sum(partial, self.rail_group, own,
                               shared_rows[:own] if shared_rows is not None else None)

    def _share_overflow(self) -> None:
        """A capacity overflow flagged on another node (by a rank of the experts, or of the
        node's copy of this rank's tokens) becomes this rank's error too: the rail's flags,
        their maximum, on the device."""
        slot = int(ErrorFlag.CAPACITY_OVERFLOW)
        dist.all_reduce(self.errors[slot:slot + 1], op=dist.ReduceOp.MAX, group=self.rail_group)

    def route_values(self, plan, by_route):
        return _return_and_sum(self.inner.route_values(plan.inner, by_route), self.rail_group,
                               plan.num_tokens)
