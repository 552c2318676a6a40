"""A pull of one rank's own tokens, from its local memory, for testing and timing the GEMMs that
pull (mok.ops.comm.Pull) on one device: the same kernels, flags and waits as between ranks, with
every peer delta 0 and this rank its own only peer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok.exchange import pull_order
from mok.ops import Routing, comm, local_first_blocks
from mok.ops.launch import cdiv

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
        torch.zeros(cdiv(tokens, minibatch), **i64), _PHASE, _PUBLISH_SLOT, tokens,
        routing.topk, num_programs, minibatch, in_gluon=in_gluon)
    local = LocalPull(pull, rows, weights)
    local.next_round()
    return local


@dataclass
class LocalCopied:
    """A copied pull (mok.ops.comm.Pull.copied) of one device's rows as if they came from
    `ranks` ranks, tokens_per_rank each, this being rank 0: landed[p] = 1 once rank p's rows are
    there (the GEMM's tiles wait on it), the row blocks taken local first. The rows are the
    tensor the GEMM reads, already in place: `land` says when they count as landed."""

    pull: comm.Pull
    landed: torch.Tensor
    _ones: torch.Tensor | None = None  # pinned, for flag_by_copy

    def land(self, late: torch.cuda.Stream | None = None,
             delay: tuple[torch.Tensor, torch.Tensor] | None = None,
             flag_by_copy: bool = False) -> None:
        """Rank 0's rows land now (in stream order); the others' too, or, with `late`, once the
        side stream `late` has done, after the current stream's work so far, delay = (dst, src)
        dst.copy_(src) (a host-to-device copy runs on the copy engines, as a peer's copy does)
        if given, then written their flags: by the stream itself (cuStreamWriteValue32) or,
        flag_by_copy, by a host-to-device copy of ones."""
        self.landed.zero_()
        if late is None:
            self.landed.fill_(1)
            return
        self.landed[:1].fill_(1)
        from torch._C._distributed_c10d import _SymmetricMemory

        late.wait_stream(torch.cuda.current_stream(self.landed.device))
        flags = self.landed.view(torch.uint32)  # a flag's low word: little-endian
        with torch.cuda.stream(late):
            if delay is not None:
                delay[0].copy_(delay[1], non_blocking=True)
            if flag_by_copy:
                if self._ones is None:
                    self._ones = torch.ones(self.landed.shape[0] - 1, dtype=torch.int64,
                                            pin_memory=True)
                self.landed[1:].copy_(self._ones, non_blocking=True)
                return
            for p in range(1, self.landed.shape[0]):
                _SymmetricMemory.stream_write_value32(flags, 2 * p, 1)


def local_copied(rows: torch.Tensor, routing: Routing, block_m: int, *, ranks: int = 2,
                 lead: float | None = 1.0, timeout_s: float = 10.0) -> LocalCopied:
    """The copied pull of rows [T, H] (T a multiple of `ranks`) that routing's rows read, as rank
    0 of `ranks` (see LocalCopied), the row blocks in mok.ops.local_first_blocks's order with
    `lead`, or with lead None in schedule order."""
    device = rows.device
    tokens = rows.shape[0]
    if tokens % ranks:
        raise ValueError(f"{tokens} tokens do not split over {ranks} ranks")
    per_rank = tokens // ranks
    i64 = dict(dtype=torch.int64, device=device)
    peer = comm.PeerFlags(
        flags=torch.zeros(1, **i64), flag_deltas=torch.zeros(1, **i64),
        seq=torch.ones(1, **i64), errors=torch.zeros(4, dtype=torch.int32, device=device),
        rank=0, world_size=ranks, timeout=comm.timeout_units(timeout_s))
    blocks = routing.capacity_rows // block_m
    order = (torch.arange(blocks, dtype=torch.int32, device=device) if lead is None
             else local_first_blocks(routing, block_m, 0, per_rank * routing.topk, lead))
    landed = torch.zeros(ranks, **i64)
    zero = torch.zeros(1, **i64)
    identity = torch.arange(tokens, dtype=torch.int32, device=device)  # position[u] = u
    # as SymmetricExchange._copied_pull: `moving` a stand-in (nothing is pulled)
    pull = comm.Pull(peer, rows, zero, None, None, None, order, identity, identity, landed,
                     0, 0, per_rank, routing.topk, 0, per_rank, copied=True)
    return LocalCopied(pull, landed)
