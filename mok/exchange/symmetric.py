"""Expert parallelism inside a node: the symmetric buffer and the exchange of each phase.

The exchange of mok.functional when its group has more than one rank on one node. Legend: P
ranks, T tokens of this rank (each rank its own, at most the workspace's T_max), k slots, H
hidden, E_local experts per rank, TK = T_max * k route slots per rank; a route of the group is
g = rank * TK + t * k + j, and the slots past a rank's T * k routes hold the ghost id E, which no
rank owns. C = schedule rows of this rank.

Each rank's symmetric buffer holds what it publishes (topk ids, x and router weights, d_output)
and what the other ranks deliver to it (expert output rows and d_x rows in its combine buffer,
router-weight gradients), plus the flags. Every phase is numbered on the device (seq), identically
on every rank since every rank makes the same calls:

- schedule: publish topk; pull every rank's topk (waiting on each rank's publish flag); sort the
  routes of the local experts, exactly as on one GPU but over the P * TK routes of the group.
- forward: publish x and the router weights; the first programs of the gate/up GEMM's launch pull
  the token rows the local experts need from their ranks, each token once however many of its
  routes come here (with k = 8 of 128 experts over 2 ranks a quarter of the bytes of a row per
  route), in the order of their first rows in the schedule, in minibatches, raising a ready flag
  per minibatch, while its other programs gather each row tile from the pulled tokens as on
  one GPU as soon as its rows' tokens have landed (one launch: the pulling roles go to the
  first programs to start, so a spinning tile can never keep them from running, as a separate
  kernel on a side stream could); the down GEMM writes each weighted row straight into its
  token's rank's combine buffer; each rank signals "done" to every rank and, once all have,
  combines its own tokens in a fixed order.
- backward: x (published again: the forward keeps no copy of the pulled rows, so what the
  forward leaves for the backward stays h and routing metadata) and d_output, pulled together by
  the first backward GEMM's launch; d_x rows and router-weight gradients go back to the token's
  rank; weight gradients stay with the experts.

Buffers a rank publishes are overwritten only after every rank acknowledged having pulled them
(x is published by the forward and the backward phases, so a publish waits for the
acknowledgements of both); buffers written by other ranks are read after their "done".

The ring (a workspace made with MoKConfig.macrobatch_size M, where RING_SLOTS * M < T_max): the
symmetric buffer holds RING_SLOTS windows of M tokens a rank instead of T_max tokens (x, d_output,
the router weights and the delivered rows), so its size no longer grows with T_max. A call runs
ceil(T_max / M) windows, the same number on every rank (a rank with fewer tokens publishes empty
windows); window w holds every rank's tokens [w M, (w + 1) M), in slot w % RING_SLOTS:

- rows in: per window, publish the rank's tokens of the window into their slot (once every rank
  acknowledged the window that used it last), pull the group's tokens of the window that have a
  route here (a launch of its own, into the group buffers [P * T_max, H] of ordinary memory, as
  without the ring), acknowledge. The GEMMs then run once over every row, as without the ring.
- rows out: the last GEMM writes its rows here ([C, H]); per window (a DELIVERY round), once every
  rank acknowledged the round that used the slot last, deliver the window's rows into their
  tokens' ranks' slots, signal "done", wait for every rank's, combine the window's tokens, and
  acknowledge.

Every GEMM reads and writes the rows the path without the ring does, and each token's rows are
summed in the same order: the outputs and gradients are bitwise those of that path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mok import _env, ops
from mok.errors import NUM_ERROR_FLAGS, MoKInputError
from mok.exchange.base import (
    NUM_PHASES,
    BackwardRows,
    Exchange,
    ForwardRows,
    Fp8ForwardRows,
    Movement,
    Phase,
    route_capacity,
)
from mok.ops import Quantized, Routing, comm
from mok.ops.launch import cdiv

# Published expert ids carry the publisher's expert count: id + E * EXPERT_TAG. A reader with
# another count (a rank passing a different num_local_experts) finds them out of range, an error
# on the device, rather than routing them by its own count to experts no rank computes.
EXPERT_TAG = 1 << 16
# Windows of the ring the symmetric buffer holds at once: a rank may publish window w + 1 while
# others still pull window w.
RING_SLOTS = 2
# A stream priority below CUDA's range, which torch maps to the highest the GPU has.
HIGHEST_PRIORITY = -100


def tag_experts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids (in [-1, E], E the ghost) with this rank's expert count E folded in."""
    if num_experts >= EXPERT_TAG // 2:
        raise MoKInputError(f"{num_experts} experts: at most {EXPERT_TAG // 2 - 1} are supported")
    return ids + num_experts * EXPERT_TAG


def untag_experts(tagged: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The ids of tag_experts for a reader with num_experts experts: -1 (an error) where the
    publisher counted otherwise."""
    ids = tagged - num_experts * EXPERT_TAG
    return torch.where((ids >= -1) & (ids <= num_experts), ids, -1)


class FlagSlots:
    """Slots of the int64 flag vector: pub[phase] (this rank's own), then ack[phase][rank] and
    done[phase][rank] written by the other ranks, then `reported`: set by an expert's rank
    that had no schedule row for a route of this rank's tokens (capacity overflow)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.reported = NUM_PHASES * (1 + 2 * world_size)
        self.size = self.reported + 1

    def pub(self, phase: Phase) -> int:
        return int(phase)

    def ack(self, phase: Phase) -> int:
        return NUM_PHASES + int(phase) * self.world_size

    def done(self, phase: Phase) -> int:
        return NUM_PHASES * (1 + self.world_size) + int(phase) * self.world_size


@dataclass(frozen=True)
class ExchangePlan:
    """The per-schedule facts of the exchange (device tensors, no host sync).

    group_routing: the sort of the group's routes (row_route = g per row; route_row per g), the
        GEMMs' routing: route g = p * routes_per_rank + t * k + j reads group token
        g // k = p * T_max + t of the pulled token buffers [P * T_max, H].
    source_routing: this rank's own routes for the combine: route_row[t * k + j] = t * k + j, or
        -1 when the expert id is out of range (those routes are computed nowhere).
    pull_order [P * T_max] int32: the group tokens with a route scheduled here (the first
        pull_moving[0] entries), by their first row in the schedule (its rows are in expert
        order, so that is a token's earliest), the others after them: the order the pulls move
        them in. pull_position [P * T_max] int32: a token's index in pull_order. All three are
        None in a plan built without pulls (build_plan), whose rows all move by copies.
    window_order [W, P * M] int32, window_moving [W] int32 (the ring's, else None): window w's
        group tokens with a route here, window_order[w, :window_moving[w]], by first row.
    """

    group_routing: Routing
    source_routing: Routing
    routes_per_rank: int
    group_topk: torch.Tensor  # [P * routes_per_rank] int32: the group's expert ids as sorted
    first_local_expert: int
    pull_order: torch.Tensor | None
    pull_position: torch.Tensor | None
    pull_moving: torch.Tensor | None
    window_order: torch.Tensor | None = None
    window_moving: torch.Tensor | None = None


class SymmetricExchange(Exchange):
    """The expert-parallel state of a workspace: the symmetric buffer, its views and the flags.

    errors: the workspace's error flags (default: a vector of its own); ghost_expert: the expert
    id E passes as an expert no rank owns (mok.exchange.cross_node); macrobatch: the ring's
    window of tokens a rank (see the module docstring; None, or RING_SLOTS windows holding
    num_tokens: no ring).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, *, num_tokens: int,
                 hidden_size: int, topk: int, timeout_s: float,
                 errors: torch.Tensor | None = None, ghost_expert: bool = False,
                 macrobatch: int | None = None) -> None:
        self.errors = (errors if errors is not None
                       else torch.zeros(NUM_ERROR_FLAGS, dtype=torch.int32, device=device))
        self.ghost_expert = ghost_expert
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = self.num_ranks = world = dist.get_world_size(group)
        self.device = device
        self.num_tokens, self.hidden_size, self.topk = num_tokens, hidden_size, topk
        self.routes_per_rank = routes = num_tokens * topk
        # The ring: windows of `window` tokens, RING_SLOTS of them in the buffer at once.
        self.window = ring_window(num_tokens, macrobatch)
        self.ring_tokens = ring = RING_SLOTS * self.window if self.window else num_tokens
        self.num_windows = cdiv(num_tokens, self.window) if self.window else 1
        self.slots = FlagSlots(world)
        nbytes = symmetric_bytes(world, num_tokens=num_tokens, hidden_size=hidden_size,
                                 topk=topk, macrobatch=macrobatch)
        self.buffer = buffer = comm.SymmetricBuffer(nbytes, group, device)
        self.flags = buffer.take((self.slots.size,), torch.int64)
        self._x_pub = buffer.take((ring, hidden_size), torch.bfloat16)
        self._dy_pub = buffer.take((ring, hidden_size), torch.bfloat16)
        self._combine = buffer.take((ring * topk, hidden_size), torch.bfloat16)
        self.topk_pub = buffer.take((routes,), torch.int32)
        self.weights_pub = buffer.take((ring * topk,), torch.float32)
        self.d_weights = buffer.take((routes,), torch.float32)
        self.seq = torch.zeros(NUM_PHASES, dtype=torch.int64, device=device)
        self._ready: dict[Phase, torch.Tensor] = {}
        self.timeout_s = timeout_s
        # copy_rows: a flag per rank whose rows landed, the target they reach, position[u] = u,
        # the side stream of the copies and whether the GEMM must wait for the copies to end.
        self._landed = torch.zeros(world, dtype=torch.int64, device=device)
        self._one = torch.ones(1, dtype=torch.int64, device=device)
        self._identity = torch.arange(world * num_tokens, dtype=torch.int32, device=device)
        # Ranks sharing one GPU: a peer's copy is a copy within that GPU, which runs as a kernel
        # and waits for SMs the GEMM's spinning tiles hold (scripts/copy_progress.py), so every
        # copy runs before the GEMM, on the current stream. Between GPUs the side stream has the
        # highest priority: should a peer's copy need SMs, its blocks, queued before the
        # GEMM's and ready with them, are dispatched first.
        self._copy_stream = (
            torch.cuda.Stream(device, priority=HIGHEST_PRIORITY)
            if device.type == "cuda" and not _env.RANKS_SHARE_GPU else None)
        self._ones_host = (torch.ones(world, dtype=torch.int64, pin_memory=True)
                           if device.type == "cuda" else None)  # the landed flags' source
        self._copies_pending = False
        self._local_first: tuple | None = None  # (row_route, block_m, order) of the last call
        self._peer_flags: comm.PeerFlags | None = None
        self._copied_peer: tuple | None = None  # (peer flags, the same with seq = 1)

    def peer_flags(self, errors: torch.Tensor) -> comm.PeerFlags:
        """The flags' handle for kernels reporting into `errors` (the last one is kept: a
        workspace passes the same error flags every time)."""
        cached = self._peer_flags
        if cached is None or cached.errors is not errors:
            cached = self._peer_flags = comm.PeerFlags(
                self.flags, self.buffer.deltas(torch.int64), self.seq, errors, self.rank,
                self.world_size, comm.timeout_units(self.timeout_s))
        return cached

    def x_pub(self, dtype: torch.dtype) -> torch.Tensor:
        return self._x_pub.view(dtype)

    def dy_pub(self, dtype: torch.dtype) -> torch.Tensor:
        return self._dy_pub.view(dtype)

    def combine_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        return self._combine.view(dtype)

    def ready(self, phase: Phase, minibatch: int) -> torch.Tensor:
        """Ready flags of `phase`'s pulls, one per minibatch of the group's tokens in pull order
        (zeros at first; the values only grow)."""
        needed = max(cdiv(self.world_size * self.num_tokens, minibatch), 1)
        flags = self._ready.get(phase)
        if flags is None or flags.shape[0] < needed:
            flags = torch.zeros(needed, dtype=torch.int64, device=self.device)
            self._ready[phase] = flags
        return flags

    # -- steps shared by the phases ----------------------------------------------------------
    def publish(self, peer: comm.PeerFlags, phase: Phase,
                copies: list[tuple[torch.Tensor, torch.Tensor]], *,
                wait_all: bool = False, lag: int = 0) -> None:
        """Wait until every rank pulled the last round (lag: the round that many before it),
        copy `copies` (dst <- src) into the symmetric buffer, and announce the new round;
        wait_all: then wait until every rank announced it (in the same launch)."""
        then = None
        if phase is not Phase.SCHEDULE:  # x_pub is written by both of these phases
            other = Phase.BACKWARD if phase is Phase.FORWARD else Phase.FORWARD
            then = (other, self.slots.ack(other))
        comm.wait_peers(peer, phase, self.slots.ack(phase), then=then, lag=lag)
        for dst, src in copies:
            dst.copy_(src)
        if wait_all:
            comm.publish_and_wait(peer, phase, self.slots.pub(phase))
        else:
            comm.advance(peer, phase, self.slots.pub(phase))

    def pull(self, peer: comm.PeerFlags, phase: Phase, plan: ExchangePlan, *,
             src: torch.Tensor, weights: torch.Tensor | None, minibatch: int,
             num_programs: int, second_src: torch.Tensor | None = None, in_gluon: bool = False,
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, comm.Pull]:
        """The buffers the group's tokens with a route to this rank's experts ([P * T_max, H];
        their router weights [P * T_max * k], and the rows of second_src) are pulled into, and
        the pull for the GEMM that reads them to run in its launch (then call `pulled`). Rows
        of the other tokens are left unwritten: no route scheduled here reads them."""
        _check_pulls(plan)
        tokens = self.world_size * self.num_tokens
        dst = torch.empty(tokens, src.shape[1], dtype=src.dtype, device=self.device)
        dst_weights = (torch.empty(tokens * self.topk, dtype=torch.float32, device=self.device)
                       if weights is not None else None)
        dst2 = torch.empty_like(dst) if second_src is not None else None
        pull = comm.Pull(
            peer, src, self.buffer.deltas(src.dtype), weights,
            self.buffer.deltas(torch.float32) if weights is not None else None, dst_weights,
            plan.pull_order, plan.pull_position, plan.pull_moving, self.ready(phase, minibatch),
            int(phase), self.slots.pub(phase), self.num_tokens, self.topk,
            max(1, int(num_programs)), int(minibatch), second_src, in_gluon)
        return dst, dst_weights, dst2, pull

    def forward_pull(self, peer: comm.PeerFlags, plan: ExchangePlan, x: torch.Tensor,
                     router_weights: torch.Tensor, *, minibatch: int, num_programs: int,
                     in_gluon: bool = False) -> tuple[torch.Tensor, torch.Tensor, comm.Pull]:
        """The forward's exchange up to its GEMM: publish x and the router weights, and the pull
        of the tokens of the local experts' routes and their weights (see `pull`; in_gluon: see
        mok.ops.comm.Pull). Returns (x of the group's tokens, router weights of the group's
        routes, pull)."""
        _check_pulls(plan)  # before publishing: every rank refuses at the same point
        tokens = x.shape[0]
        self.publish(peer, Phase.FORWARD, [
            (self.x_pub(x.dtype)[:tokens], x),
            (self.weights_pub[:tokens * self.topk], router_weights.reshape(-1))])
        x_group, weights_group, _, pull = self.pull(
            peer, Phase.FORWARD, plan, src=self.x_pub(x.dtype), weights=self.weights_pub,
            minibatch=minibatch, num_programs=num_programs, in_gluon=in_gluon)
        return x_group, weights_group, pull

    def forward_copy(self, peer: comm.PeerFlags, plan: ExchangePlan, x: torch.Tensor,
                     router_weights: torch.Tensor, *, block_m: int,
                     ) -> tuple[torch.Tensor, torch.Tensor, comm.Pull]:
        """forward_pull with the rows moved by copies (MoKConfig.fwd_copy_rows): publish x and
        the router weights, wait for every rank's, then copy each rank's whole published x and
        router weights into the group's buffers (the other ranks' on a side stream, on a GPU the
        copy engines: no SM is taken from the GEMM), raising a flag per rank once its rows
        landed. The GEMM's tiles wait on the flags of their rows' ranks (the Pull is `copied`);
        call `copies_joined` after its launch, before `pulled`. The GEMM takes its row blocks
        (of block_m rows) in the order of `local_first` (the Pull's order), so the copies land
        while the blocks of this rank's rows run. Every rank's rows move, T_max of them, where
        the pull moves only the tokens with a route here (at qwen3-30b-a3b all but a few in a
        thousand)."""
        tokens, world, routes = x.shape[0], self.world_size, self.routes_per_rank
        x_pub = self.x_pub(x.dtype)
        self.publish(peer, Phase.FORWARD, [
            (x_pub[:tokens], x),
            (self.weights_pub[:tokens * self.topk], router_weights.reshape(-1))],
            wait_all=True)
        x_group = torch.empty(world * self.num_tokens, x.shape[1], dtype=x.dtype,
                              device=self.device)
        weights_group = torch.empty(world * routes, dtype=torch.float32, device=self.device)
        self._landed.zero_()
        moves = []
        for p in self._ranks_from_here():
            rows = x_group[p * self.num_tokens:(p + 1) * self.num_tokens]
            weights = weights_group[p * routes:(p + 1) * routes]
            moves.append((p, [(rows, self.buffer.peer_view(x_pub, p)),
                              (weights, self.buffer.peer_view(self.weights_pub, p))], True))
        self._copy(moves)
        pull = self._copied_pull(peer, plan, Phase.FORWARD, x_pub, block_m, weights_group)
        return x_group, weights_group, pull

    def _ranks_from_here(self) -> list[int]:
        """The group's ranks, this one first, then on around the ring."""
        return [(self.rank + step) % self.world_size for step in range(self.world_size)]

    def _copied_pull(self, peer: comm.PeerFlags, plan: ExchangePlan, phase: Phase,
                     src: torch.Tensor, block_m: int,
                     dst_weights: torch.Tensor | None = None) -> comm.Pull:
        """The Pull of rows copied by forward_copy or backward_copy: no pulling programs, a
        landed flag per rank (position[u] = u, a minibatch of tokens_per_rank, target 1), the
        row blocks local first; `moving` is a stand-in (nothing is pulled)."""
        weights = self.weights_pub if dst_weights is not None else None
        copied_peer = self._copied_peer
        if copied_peer is None or copied_peer[0] is not peer:
            copied_peer = self._copied_peer = (peer, dataclasses.replace(peer, seq=self._one))
        return comm.Pull(
            copied_peer[1], src, self.buffer.deltas(src.dtype),
            weights, self.buffer.deltas(torch.float32) if weights is not None else None,
            dst_weights, self.local_first(plan.group_routing, block_m), self._identity,
            self._identity, self._landed, 0, self.slots.pub(phase), self.num_tokens,
            self.topk, 0, self.num_tokens, copied=True)

    def local_first(self, routing: Routing, block_m: int) -> torch.Tensor:
        """mok.ops.local_first_blocks for this rank; the last one is kept: a backward over the
        forward's schedule takes it again."""
        cached = self._local_first
        if cached is not None and cached[0] is routing.row_route and cached[1] == block_m:
            return cached[2]
        order = ops.local_first_blocks(routing, block_m, self.rank, self.routes_per_rank)
        self._local_first = (routing.row_route, block_m, order)
        return order

    def _copy(self, moves: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]], bool]],
              ) -> None:
        """For each (rank, copies, flagged), in order: the copies (dst <- src), then, flagged,
        that rank's landed flag = 1 (unflagged copies are for launches after copies_joined). On
        a GPU this rank's own copies run on the current stream (a copy within one GPU may run as
        a kernel, which would need an SM the GEMM's spinning tiles hold) and the other ranks' on
        the side stream (the copy engines), each flag written by a copy too, of a one from
        pinned host memory (no kernel; a CUDA graph captures it, so the copies overlap the GEMM
        there as well). With the ranks sharing one GPU (MOK_RANKS_SHARE_GPU) every rank's copies
        are copies within that GPU, and all run on the current stream."""
        stream = self._copy_stream
        if stream is not None:  # first, so they start before this rank's own copies
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for p, copies, flagged in moves:
                    if p == self.rank:
                        continue
                    for dst, src in copies:
                        dst.copy_(src)
                    if flagged:
                        self._landed[p:p + 1].copy_(self._ones_host[p:p + 1], non_blocking=True)
            self._copies_pending = True
        for p, copies, flagged in moves:
            if stream is None or p == self.rank:
                for dst, src in copies:
                    dst.copy_(src)
                if flagged:
                    self._landed[p:p + 1].fill_(1)

    def copies_joined(self) -> None:
        """The current stream waits for the side stream's copies (forward_copy)."""
        if self._copies_pending:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            self._copies_pending = False

    def backward_copy(self, peer: comm.PeerFlags, plan: ExchangePlan, d_output: torch.Tensor,
                      x: torch.Tensor, *, block_m: int, kept: bool,
                      ) -> tuple[torch.Tensor, torch.Tensor, comm.Pull]:
        """backward_pull with the rows moved by copies (MoKConfig.bwd_copy_rows), as
        forward_copy: publish d_output and x, wait for every rank's, copy each rank's whole
        published d_output and x (kept: x after every rank's d_output and unflagged, for the
        weight gradients alone) into the group's buffers, the flags raised as a rank's rows the
        first GEMM reads landed. Returns (d_output and x of the group's tokens, the copied pull
        for the first GEMM, whose row blocks of block_m rows run local first); call
        `copies_joined` before a launch that reads x when kept, and before `pulled`."""
        tokens, world, per_rank = x.shape[0], self.world_size, self.num_tokens
        dy_pub, x_pub = self.dy_pub(d_output.dtype), self.x_pub(x.dtype)
        self.publish(peer, Phase.BACKWARD, [(dy_pub[:tokens], d_output), (x_pub[:tokens], x)],
                     wait_all=True)
        dy_group = torch.empty(world * per_rank, d_output.shape[1], dtype=d_output.dtype,
                               device=self.device)
        x_group = torch.empty(world * per_rank, x.shape[1], dtype=x.dtype, device=self.device)
        self._landed.zero_()
        moves, unflagged = [], []
        for p in self._ranks_from_here():
            rows = slice(p * per_rank, (p + 1) * per_rank)
            x_copy = (x_group[rows], self.buffer.peer_view(x_pub, p))
            moves.append((p, [(dy_group[rows], self.buffer.peer_view(dy_pub, p))]
                          + ([] if kept else [x_copy]), True))
            if kept:
                unflagged.append((p, [x_copy], False))
        self._copy(moves + unflagged)
        return dy_group, x_group, self._copied_pull(peer, plan, Phase.BACKWARD, dy_pub, block_m)

    def backward_pull(self, peer: comm.PeerFlags, plan: ExchangePlan, d_output: torch.Tensor,
                      x: torch.Tensor, *, minibatch: int, num_programs: int,
                      defer_x: bool = False, x_first: bool = False,
                      ) -> tuple[torch.Tensor, torch.Tensor, comm.Pull, comm.Pull | None]:
        """The backward's exchange up to its first GEMM: publish d_output and x; the pull of
        both for the tokens of the local experts' routes. Returns (d_output and x of the
        group's tokens, the pull, None). defer_x: the first GEMM pulls d_output's rows only, and
        x's come in a second pull (returned last) for a later launch that reads neither: a
        backward with kept pre-activations needs x for the weight gradients alone, and its first
        GEMM, a third of the recomputing one, would otherwise wait on twice the bytes. x_first:
        the pull's first buffer is x's, d_output's its second (the gate/up launch of
        mok.ops.dswiglu_apart pulls them)."""
        _check_pulls(plan)
        if defer_x and x_first:
            raise ValueError("backward_pull: defer_x and x_first exclude each other")
        tokens = x.shape[0]
        self.publish(peer, Phase.BACKWARD, [(self.dy_pub(d_output.dtype)[:tokens], d_output),
                                            (self.x_pub(x.dtype)[:tokens], x)])
        if x_first:
            x_group, _, dy_group, pull = self.pull(
                peer, Phase.BACKWARD, plan, src=self.x_pub(x.dtype), weights=None,
                minibatch=minibatch, num_programs=num_programs,
                second_src=self.dy_pub(d_output.dtype))
            return dy_group, x_group, pull, None
        dy_group, _, x_group, pull = self.pull(
            peer, Phase.BACKWARD, plan, src=self.dy_pub(d_output.dtype), weights=None,
            minibatch=minibatch, num_programs=num_programs,
            second_src=None if defer_x else self.x_pub(x.dtype))
        x_pull = None
        if defer_x:
            x_group, _, _, x_pull = self.pull(
                peer, Phase.BACKWARD, plan, src=self.x_pub(x.dtype), weights=None,
                minibatch=minibatch, num_programs=num_programs)
        return dy_group, x_group, pull, x_pull

    def pulled(self, peer: comm.PeerFlags, phase: Phase) -> None:
        """After the GEMM that pulled: tell every rank its published rows may be overwritten."""
        comm.signal_peers(peer, phase, self.slots.ack(phase))

    def scatter_rows(self, plan: ExchangePlan, dtype: torch.dtype) -> comm.ScatterRows:
        return comm.ScatterRows(self.combine_buffer(dtype), self.buffer.deltas(dtype),
                                plan.group_routing.row_route, self.routes_per_rank)

    def clear_dropped(self, peer: comm.PeerFlags, plan: ExchangePlan, *,
                      rows_dtype: torch.dtype | None, values: bool = False) -> None:
        """Zero what the token ranks read for the routes to this rank's experts that the
        schedule had no room for (a capacity overflow, reported as a data error here and, by
        `finish`, on the tokens' ranks): their rows of the combine buffer (rows_dtype)
        and, with values, their router-weight gradients. They then add nothing, as on one GPU.
        Call before signalling "done"."""
        group = plan.group_routing
        comm.clear_dropped_routes(
            peer, self.slots.reported, plan.group_topk, group.route_row,
            routes_per_rank=plan.routes_per_rank,
            first_local_expert=plan.first_local_expert,
            num_local_experts=group.num_local_experts,
            rows=self.combine_buffer(rows_dtype) if rows_dtype is not None else None,
            rows_deltas=self.buffer.deltas(rows_dtype) if rows_dtype is not None else None,
            values=self.d_weights if values else None,
            values_deltas=self.buffer.deltas(torch.float32) if values else None)

    def finish(self, peer: comm.PeerFlags, phase: Phase, *, signal: bool = True) -> None:
        """Tell every rank this rank's deliveries of `phase` landed (signal=False: `signal_done`
        did, earlier), wait for theirs; then routes of this rank's tokens that an expert's rank had
        no row for become this rank's CAPACITY_OVERFLOW error too. One launch."""
        comm.finish(peer, phase, self.slots.done(phase), self.slots.reported, signal=signal)

    def signal_done(self, peer: comm.PeerFlags, phase: Phase) -> None:
        """The first half of `finish`, for work to run before waiting for the other ranks."""
        comm.signal_peers(peer, phase, self.slots.done(phase))

    # -- the exchange protocol (mok.exchange.base) -------------------------------------------
    @property
    def rows_here(self) -> bool:
        return False

    @property
    def delivers_in_combine(self) -> bool:
        return self.window is not None

    def movement(self, phase: Phase, config) -> Movement:
        copied = config.fwd_copy_rows if phase is Phase.FORWARD else config.bwd_copy_rows
        return Movement.COPIED if copied else Movement.PULLED

    def build_schedule(self, topk_experts, *, config, num_local_experts, align):
        # Sized from the most tokens a rank passes (the workspace's), not this rank's own: the
        # rows that arrive here come from every rank.
        num_routes = self.num_tokens * topk_experts.shape[1]
        plan = self.build_plan(
            self.peer_flags(self.errors), topk_experts, num_local_experts=num_local_experts,
            align=align, route_capacity=route_capacity(num_routes, self.world_size,
                                                       config.schedule_capacity_multiplier),
            ghost_expert=self.ghost_expert,
            pulls=not (config.fwd_copy_rows and config.bwd_copy_rows))
        return plan.group_routing, plan

    def tokens(self, *tensors):
        return tensors

    def forward_rows(self, plan, x, router_weights, *, config, block_m):
        """Publish x and the router weights; the group's rows come by copies beside the gate/up
        launch (fwd_copy_rows; its row blocks of block_m rows local first) or by its pull (with
        the ring: pulled window by window before it)."""
        peer = self.peer_flags(self.errors)
        if self.window is not None:
            self._refuse_copies(config)
            x_group, weights_group = self._ring_rows_in(
                peer, Phase.FORWARD, plan, [(self.x_pub(x.dtype), x)], router_weights,
                config=config)
            return ForwardRows(x_group, weights_group, None, kept_weights=weights_group)
        if config.fwd_copy_rows:
            x_group, weights_group, pull = self.forward_copy(peer, plan, x, router_weights,
                                                             block_m=block_m)
        else:
            x_group, weights_group, pull = self.forward_pull(
                peer, plan, x, router_weights, minibatch=config.minibatch_size,
                num_programs=config.fwd_num_comm_sms, in_gluon=config.fwd_pull_in_gluon)
        return ForwardRows(x_group, weights_group, pull, kept_weights=weights_group)

    def backward_rows(self, plan, d_output, x, *, config, block_m, kept, apart):
        """Publish d_output and x; the group's rows come by copies (bwd_copy_rows; the first
        launch's row blocks of block_m rows local first) or by the first launch's pull (kept:
        x's rows by the d_x launch's, for the weight gradients alone; apart: x's first, as the
        gate/up launch reads them)."""
        peer = self.peer_flags(self.errors)
        if self.window is not None:
            self._refuse_copies(config)
            dy_group, x_group = self._ring_rows_in(
                peer, Phase.BACKWARD, plan,
                [(self.dy_pub(d_output.dtype), d_output), (self.x_pub(x.dtype), x)], None,
                config=config)
            return BackwardRows(dy_group, x_group)
        if config.bwd_copy_rows:
            dy_group, x_group, pull = self.backward_copy(peer, plan, d_output, x,
                                                         block_m=block_m, kept=kept)
            return BackwardRows(dy_group, x_group, pull)
        dy_group, x_group, pull, x_pull = self.backward_pull(
            peer, plan, d_output, x, minibatch=config.minibatch_size,
            num_programs=config.bwd_num_comm_sms, defer_x=kept, x_first=apart)
        return BackwardRows(dy_group, x_group, pull, x_pull)

    def forward_rows_fp8(self, plan, x, xq, router_weights, *, config):
        """Publish x in e4m3, each row's codes and scales packed in one byte row
        (mok.ops.unpack_rows: about half the bytes of a bf16 row), and the router weights; pull
        the group's rows of the local experts' routes in a launch of their own over
        fwd_num_comm_sms programs (the FP8 GEMMs take no pull), then acknowledge them. A row
        quantized here or on its expert's rank is the same bits: the scales are per row."""
        peer = self.peer_flags(self.errors)
        tokens, width = x.shape
        xq = xq if xq is not None else ops.quantize_rows(x)
        packed = self.packed_pub(width)
        if self.window is not None:
            def window_copies(at, start, count):
                codes, scales = ops.unpack_rows(packed[at:at + count], width)
                return [(codes, xq.data[start:start + count]),
                        (scales, xq.scales[start:start + count])]
            rows, weights_group = self._ring_pulls(peer, Phase.FORWARD, plan, [packed],
                                                   window_copies, tokens, router_weights,
                                                   config=config)
            return Fp8ForwardRows(ops.unpack_rows(rows, width), weights_group, weights_group)
        _check_pulls(plan)
        codes, scales = ops.unpack_rows(packed[:tokens], width)
        self.publish(peer, Phase.FORWARD, [
            (codes, xq.data), (scales, xq.scales),
            (self.weights_pub[:tokens * self.topk], router_weights.reshape(-1))])
        rows, weights_group, _, pull = self.pull(
            peer, Phase.FORWARD, plan, src=packed, weights=self.weights_pub,
            minibatch=config.minibatch_size, num_programs=config.fwd_num_comm_sms)
        pull.run_apart(rows)
        self.pulled(peer, Phase.FORWARD)
        return Fp8ForwardRows(ops.unpack_rows(rows, width), weights_group, weights_group)

    def backward_rows_fp8(self, plan, d_output, x, *, config, dq=None, xq=None):
        """Publish d_output and x (with fp8_weight_gradients in e4m3, packed as the forward's
        x); pull the group's rows of both in launches of their own over bwd_num_comm_sms
        programs each, then acknowledge them."""
        peer = self.peer_flags(self.errors)
        if config.fp8_weight_gradients:
            return self._backward_rows_e4m3(
                peer, plan, dq if dq is not None else ops.quantize_rows(d_output),
                xq if xq is not None else ops.quantize_rows(x), config=config)
        if self.window is not None:
            dy_group, x_group = self._ring_rows_in(
                peer, Phase.BACKWARD, plan,
                [(self.dy_pub(d_output.dtype), d_output), (self.x_pub(x.dtype), x)], None,
                config=config)
            return BackwardRows(dy_group, x_group)
        dy_group, x_group, pull, x_pull = self.backward_pull(
            peer, plan, d_output, x, minibatch=config.minibatch_size,
            num_programs=config.bwd_num_comm_sms, defer_x=True)
        pull.run_apart(dy_group)
        x_pull.run_apart(x_group)
        self.pulled(peer, Phase.BACKWARD)
        return BackwardRows(dy_group, x_group)

    def _backward_rows_e4m3(self, peer, plan, dq: Quantized, xq: Quantized, *, config):
        """backward_rows_fp8's rows in e4m3: d_output's in the 16-bit d_output's published
        memory and x's in x's, packed (mok.ops.unpack_rows)."""
        tokens, width = dq.data.shape
        packed = [self.packed_pub(width, self.dy_pub), self.packed_pub(width)]

        def window_copies(at, start, count):
            copies = []
            for pub, rows in zip(packed, (dq, xq), strict=True):
                codes, scales = ops.unpack_rows(pub[at:at + count], width)
                copies += [(codes, rows.data[start:start + count]),
                           (scales, rows.scales[start:start + count])]
            return copies

        if self.window is not None:
            groups = self._ring_pulls(peer, Phase.BACKWARD, plan, packed, window_copies, tokens,
                                      None, config=config)
        else:
            _check_pulls(plan)
            self.publish(peer, Phase.BACKWARD, window_copies(0, 0, tokens))
            groups = []
            for pub in packed:
                group, _, _, pull = self.pull(peer, Phase.BACKWARD, plan, src=pub, weights=None,
                                              minibatch=config.minibatch_size,
                                              num_programs=config.bwd_num_comm_sms)
                pull.run_apart(group)
                groups.append(group)
            self.pulled(peer, Phase.BACKWARD)
        return BackwardRows(*(ops.unpack_rows(group, width) for group in groups))

    def packed_pub(self, width: int, pub=None) -> torch.Tensor:
        """The published x (or pub's rows: dy_pub) as packed e4m3 rows of `width` columns
        (mok.ops.unpack_rows): [T_max, packed_row_bytes(width)] uint8 over the 16-bit rows'
        memory."""
        nbytes = ops.packed_row_bytes(width)
        if nbytes > 2 * self.hidden_size:
            raise MoKInputError(f"packed e4m3 rows of hidden size {width} take {nbytes} bytes, "
                                f"more than a 16-bit row's {2 * self.hidden_size}: FP8 under "
                                "expert parallelism needs a hidden size of at least 16")
        return (pub or self.x_pub)(torch.uint8)[:, :nbytes]

    def rows_read(self, phase):
        """After every pull (or copy) of the phase: the published rows may be overwritten (with
        the ring each window's pull said so already)."""
        if self.window is not None:
            return
        self.copies_joined()
        self.pulled(self.peer_flags(self.errors), phase)

    def scatter(self, plan, dtype):
        """Into the tokens' ranks' combine buffers; with the ring, here (`combine` delivers
        them window by window)."""
        return self.scatter_rows(plan, dtype) if self.window is None else None

    def send_route_values(self, plan, by_route):
        """Each route's router-weight gradient into its token's rank's buffer."""
        ops.scatter_route_values(by_route.reshape(-1), plan.group_routing.route_row,
                                 self.d_weights, self.buffer.deltas(torch.float32),
                                 plan.routes_per_rank)

    def deliveries_done(self, plan, phase, dtype, *, values, wait):
        peer = self.peer_flags(self.errors)
        if self.window is not None:  # the rows go in `combine`'s rounds, which zero the dropped
            self.clear_dropped(peer, plan, rows_dtype=None, values=values)
            if values and wait:
                self.finish(peer, phase)
            elif values:
                self.signal_done(peer, phase)
            return
        self.clear_dropped(peer, plan, rows_dtype=dtype, values=values)
        if wait:
            self.finish(peer, phase)
        else:
            self.signal_done(peer, phase)

    def landed(self, phase):
        self.finish(self.peer_flags(self.errors), phase, signal=False)

    def combine(self, plan, rows, routing, shared_rows, dtype):
        """rows: the combine buffer the other ranks delivered into (with the ring: this rank's
        rows [C, H], delivered here window by window)."""
        if self.window is not None:
            return self._ring_rows_out(plan, rows, shared_rows, dtype)
        return ops.combine(rows, plan.source_routing, shared_rows, dtype)

    # -- the ring (module docstring) -----------------------------------------------------------
    def _windows(self, tokens: int):
        """(w, first token, this rank's tokens in it, lag) for each window of a call; lag: how
        many rounds before the last one the round that used the window's slot is (none before
        the call's first window: every earlier round is waited for)."""
        for w in range(self.num_windows):
            start = w * self.window
            yield w, start, max(0, min(self.window, tokens - start)), min(w, RING_SLOTS - 1)

    def _refuse_copies(self, config) -> None:
        if config.fwd_copy_rows or config.bwd_copy_rows:
            raise MoKInputError("fwd_copy_rows and bwd_copy_rows copy every rank's whole "
                                "published buffers: not with a workspace's macrobatch_size ring")

    def _ring_rows_in(self, peer: comm.PeerFlags, phase: Phase, plan: ExchangePlan,
                      pairs: list[tuple[torch.Tensor, torch.Tensor]],
                      router_weights: torch.Tensor | None, *, config) -> tuple:
        """Window by window: publish the window's rows of each (ring buffer [ring rows, width],
        this rank's rows [T, width]) pair (and of the router weights) into the window's slot,
        pull the group's tokens of the window with a route here into a group buffer [P * T_max,
        width] per pair (and their router weights), acknowledge. Returns the group buffers
        (then the router weights')."""
        def window_copies(at, start, count):
            return [(ring_rows[at:at + count], rows[start:start + count])
                    for ring_rows, rows in pairs]
        return self._ring_pulls(peer, phase, plan, [ring_rows for ring_rows, _ in pairs],
                                window_copies, pairs[0][1].shape[0], router_weights,
                                config=config)

    def _ring_pulls(self, peer: comm.PeerFlags, phase: Phase, plan: ExchangePlan,
                    sources: list[torch.Tensor], window_copies, tokens: int,
                    router_weights: torch.Tensor | None, *, config) -> tuple:
        """_ring_rows_in with the copies of a window given by window_copies(first slot row,
        first token, tokens) -> [(dst, src)] and the ring buffers pulled from, `sources`."""
        if plan.window_order is None:
            raise RuntimeError("this schedule was built on another workspace: it has no "
                               "windows of the ring")
        world, k, ring = self.world_size, self.topk, self.ring_tokens
        groups = [torch.empty(world * self.num_tokens, src.shape[1], dtype=src.dtype,
                              device=self.device) for src in sources]
        weights_group = None
        if router_weights is not None:
            weights_group = torch.empty(world * self.routes_per_rank, dtype=torch.float32,
                                        device=self.device)
            flat = router_weights.reshape(-1)
        ready = self.ready(phase, config.minibatch_size)
        programs = max(1, int(config.fwd_num_comm_sms if phase is Phase.FORWARD
                              else config.bwd_num_comm_sms))
        for w, start, count, lag in self._windows(tokens):
            at = start % ring
            copies = window_copies(at, start, count)
            if router_weights is not None:
                copies.append((self.weights_pub[at * k:(at + count) * k],
                               flat[start * k:(start + count) * k]))
            self.publish(peer, phase, copies, lag=lag)
            for i, (src, group) in enumerate(zip(sources, groups, strict=True)):
                weights = router_weights is not None and i == 0
                comm.Pull(
                    peer, src, self.buffer.deltas(src.dtype),
                    self.weights_pub if weights else None,
                    self.buffer.deltas(torch.float32) if weights else None,
                    weights_group if weights else None,
                    plan.window_order[w], plan.window_order[w], plan.window_moving[w:w + 1],
                    ready, int(phase), self.slots.pub(phase), self.num_tokens, k, programs,
                    int(config.minibatch_size), ring_rows=ring).run_apart(group)
            self.pulled(peer, phase)
        return (*groups, weights_group) if router_weights is not None else tuple(groups)

    def _ring_rows_out(self, plan: ExchangePlan, rows: torch.Tensor,
                       shared_rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The delivery rounds, a window each: once every rank acknowledged the round that
        used the window's slot, deliver this rank's rows [C, H] of every rank's tokens of the
        window into their ranks' slot (mok.ops.deliver_rows), signal and wait for "done", combine
        this rank's tokens of the window, acknowledge. Returns out [T, H]."""
        peer = self.peer_flags(self.errors)
        source, group = plan.source_routing, plan.group_routing
        tokens, k = source.num_tokens, self.topk
        ring = self.combine_buffer(dtype)
        out = torch.empty(tokens, rows.shape[1], dtype=dtype, device=self.device)
        for _, start, count, lag in self._windows(tokens):
            comm.wait_peers(peer, Phase.DELIVERY, self.slots.ack(Phase.DELIVERY), lag=lag)
            comm.advance(peer, Phase.DELIVERY, None)
            comm.deliver_rows(
                rows, group.route_row, plan.group_topk, ring, self.buffer.deltas(dtype),
                world_size=self.world_size, window_start=start, window_tokens=self.window,
                tokens_per_rank=self.num_tokens, topk=k,
                first_local_expert=plan.first_local_expert,
                num_local_experts=group.num_local_experts)
            self.finish(peer, Phase.DELIVERY)
            if count:
                route_row = source.route_row[start * k:(start + count) * k]
                shift = (start - start % self.ring_tokens) * k
                window = dataclasses.replace(
                    source, route_row=torch.where(route_row >= 0, route_row - shift, -1),
                    num_tokens=count)
                ops.combine(ring, window, shared_rows[start:start + count]
                            if shared_rows is not None else None, dtype,
                            out=out[start:start + count])
            comm.signal_peers(peer, Phase.DELIVERY, self.slots.ack(Phase.DELIVERY))
        return out

    def route_values(self, plan, by_route):
        source = plan.source_routing
        valid = (source.route_row >= 0).view(source.num_tokens, source.topk)
        received = self.d_weights[:source.num_tokens * source.topk].view(valid.shape)
        return torch.where(valid, received, 0.0)

    # -- the schedule ------------------------------------------------------------------------
    def build_plan(self, peer: comm.PeerFlags, topk_experts: torch.Tensor, *,
                   num_local_experts: int, align: int, route_capacity: int,
                   ghost_expert: bool = False, pulls: bool = True) -> ExchangePlan:
        """The schedule of this rank's experts over the group's routes.

        topk_experts [T, k], T <= T_max. Ids outside [0, E) are published as -1, so every rank
        reports them (an int64 id is never wrapped into range by the int32 buffer); with
        ghost_expert the id E passes as the ghost (routes to experts of other nodes, see
        mok.exchange.cross_node), as do the slots past T * k. pulls=False: no pull order (its
        sort is needed only where a GEMM pulls rows, not where copies move them all).
        """
        world, routes = self.world_size, self.routes_per_rank
        num_experts = num_local_experts * world
        published, source_route_row = ops.exchange_routes(topk_experts, routes, num_experts,
                                                          ghost_expert=ghost_expert)
        self.publish(peer, Phase.SCHEDULE, [(self.topk_pub, tag_experts(published, num_experts))])
        group_topk = torch.empty(world * routes, dtype=torch.int32, device=self.device)
        comm.gather_peers(peer, self.topk_pub, group_topk, self.buffer.deltas(torch.int32),
                          Phase.SCHEDULE, self.slots.pub(Phase.SCHEDULE))
        comm.signal_peers(peer, Phase.SCHEDULE, self.slots.ack(Phase.SCHEDULE))
        group_topk = untag_experts(group_topk, num_experts)
        group_routing = ops.build_routing(
            group_topk.view(world * self.num_tokens, self.topk), peer.errors,
            num_experts=num_experts + 1,
            first_local_expert=num_local_experts * self.rank,
            num_local_experts=num_local_experts, align=align, route_capacity=route_capacity)
        empty = torch.empty(0, dtype=torch.int32, device=self.device)
        source_routing = Routing(
            row_route=empty, route_row=source_route_row, block_expert=empty,
            expert_counts=empty, expert_offsets=empty, num_tokens=topk_experts.shape[0],
            topk=self.topk, num_local_experts=num_local_experts, align=align)
        order = position = moving = window_order = window_moving = None
        if self.window is not None:
            window_order, window_moving = ring_pull_orders(group_routing, self.num_tokens,
                                                           self.window)
        elif pulls:
            order, position, moving = pull_order(group_routing)
        return ExchangePlan(group_routing, source_routing, routes, group_topk,
                            num_local_experts * self.rank, order, position, moving,
                            window_order, window_moving)


def ring_window(num_tokens: int, macrobatch: int | None) -> int | None:
    """The ring's window of tokens a rank: macrobatch, or None where RING_SLOTS windows would
    hold all num_tokens (no ring then)."""
    if macrobatch is None or RING_SLOTS * int(macrobatch) >= num_tokens:
        return None
    return int(macrobatch)


def symmetric_bytes(world_size: int, *, num_tokens: int, hidden_size: int, topk: int,
                    macrobatch: int | None = None) -> int:
    """Bytes of a rank's symmetric buffer (SymmetricExchange): the flags, x and d_output rows
    (2-byte dtypes) and delivered rows of num_tokens tokens or of the ring's windows, the
    router weights likewise, the expert ids and router-weight gradients of num_tokens."""
    window = ring_window(num_tokens, macrobatch)
    ring = RING_SLOTS * window if window else num_tokens
    up = comm.SymmetricBuffer.round_up
    return (up(FlagSlots(world_size).size * 8)
            + 2 * up(ring * hidden_size * 2)         # x, d_output
            + up(ring * topk * hidden_size * 2)      # combine buffer
            + up(ring * topk * 4)                    # router weights
            + 2 * up(num_tokens * topk * 4))         # expert ids, router-weight gradients


def _check_pulls(plan: ExchangePlan) -> None:
    if plan.pull_order is None:
        raise RuntimeError("this schedule was built for rows moved by copies alone "
                           "(MoKConfig.fwd_copy_rows and bwd_copy_rows): it has no pull order; "
                           "build the schedule with the config of the layer's calls")


def pull_order(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, position, moving) of a pull of the tokens the rows of `routing` read (see
    ExchangePlan): each token by its first row (int32 max: none), on the device."""
    none = torch.iinfo(torch.int32).max
    first_row = _first_rows(routing, none)
    order = torch.sort(first_row, stable=True).indices.to(torch.int32)
    position = torch.empty_like(order).scatter_(
        0, order.long(), torch.arange(order.shape[0], dtype=torch.int32, device=order.device))
    moving = (first_row < none).sum(dtype=torch.int32).view(1)
    return order, position, moving


def _first_rows(routing: Routing, none: int) -> torch.Tensor:
    """Each group token's first schedule row (`none` where it has none)."""
    rows = routing.route_row.view(-1, routing.topk)
    return torch.where(rows >= 0, rows, none).amin(dim=1)


def ring_pull_orders(routing: Routing, tokens_per_rank: int,
                     window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(window_order [W, P * window], window_moving [W]) of the ring's pulls (see
    ExchangePlan): the group tokens u = p * tokens_per_rank + t with a route in `routing`, by
    window t // window, each window's by first row; on the device."""
    none = torch.iinfo(torch.int32).max
    first_row = _first_rows(routing, none).long()
    num_group = first_row.shape[0]
    world = num_group // tokens_per_rank
    num_windows = cdiv(tokens_per_rank, window)
    device = first_row.device
    token = torch.arange(num_group, device=device)
    win = token % tokens_per_rank // window
    moves = first_row < none
    # Moving tokens by (window, first row), the others after them.
    key = torch.where(moves, win * (none + 1) + first_row, num_windows * (none + 1))
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_windows, dtype=torch.long, device=device).scatter_add_(
        0, win, moves.long())  # (bincount of a masked selection would sync with the host)
    starts = torch.cumsum(counts, 0) - counts
    sorted_win = win[order]
    index = torch.arange(num_group, device=device) - starts[sorted_win]
    slot = torch.where(moves[order], sorted_win * (world * window) + index,
                       num_windows * world * window)  # the others into a spare entry
    window_order = torch.zeros(num_windows * world * window + 1, dtype=torch.int32,
                               device=device)
    window_order.scatter_(0, slot, order.to(torch.int32))
    return (window_order[:-1].view(num_windows, world * window),
            counts.to(torch.int32))
