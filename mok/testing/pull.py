"""A pull of one rank's own tokens, from its local memory, for testing and timing the GEMMs that
pull (mok.ops.comm.Pull) on one device: the same kernels, flags and waits as between ranks, with
every peer delta 0 and this rank its own only peer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from mok.expert_parallel import pull_order
from mok.ops import Routing, comm

_PHASE = 1
_PUBLISH_SLOT = 0


@dataclass
class LocalPull:
    """pull: x's rows (and the router weights) into `rows` (and `weights`), as a GEMM's pull."""

    pull: comm.Pull
    rows: torch.Tensor
    weights: torch.Tensor | None

    def next_round(self) -> None:
        """Number a new round, as a publish would: the ready flags of the last one no longer
        pass (a GEMM pulling again waits on this round's)."""
        peer = self.pull.peer
        comm.advance(peer, _PHASE, _PUBLISH_SLOT)


def local_pull(x: torch.Tensor, routing: Routing, router_weights: torch.Tensor | None = None, *,
               minibatch: int = 128, num_programs: int = 32, in_gluon: bool = True,
               timeout_s: float = 10.0) -> LocalPull:
    """The pull of the tokens x [T, H] that routing's rows read, published and numbered (call
    next_round before each later GEMM that pulls with it); in_gluon: see mok.ops.comm.Pull."""
    device = x.device
    i64 = dict(dtype=torch.int64, device=device)
    tokens = x.shape[0]
    peer = comm.PeerFlags(
        flags=torch.zeros(1, **i64), flag_deltas=torch.zeros(1, **i64),
        seq=torch.zeros(3, **i64), errors=torch.zeros(4, dtype=torch.int32, device=device),
        rank=0, world_size=1, timeout=comm.timeout_units(timeout_s))
    order, position, moving = pull_order(routing)
    rows = torch.empty_like(x)
    weights = None
    if router_weights is not None:
        weights = torch.empty(tokens * routing.topk, dtype=torch.float32, device=device)
    zero = torch.zeros(1, **i64)
    pull = comm.Pull(
        peer, x, zero, router_weights.reshape(-1) if router_weights is not None else None,
        zero if router_weights is not None else None, weights, order, position, moving,
        torch.zeros(triton.cdiv(tokens, minibatch), **i64), _PHASE, _PUBLISH_SLOT, tokens,
        routing.topk, num_programs, minibatch, in_gluon=in_gluon)
    local = LocalPull(pull, rows, weights)
    local.next_round()
    return local
