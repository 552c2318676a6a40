"""Symmetric buffers of an expert-parallel group and the launchers of the communication kernels.

A `SymmetricBuffer` is one allocation per rank, of the same size on every rank, that every rank
of the group can read and write: PyTorch symmetric memory on CUDA (NVLink multicast is never
used), shared-memory files mapped by every process on CPU (Triton's interpreter then runs the
same kernels and the same flag logic as the GPU). Kernels reach rank p's copy of a local view at
`view + deltas(dtype)[p]`.
"""

from __future__ import annotations

import os
import pickle
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mok import _env
from mok.errors import MoKTimeoutError
from mok.kernels import comm as kernels
from mok.ops.launch import cdiv, launch, next_power_of_2

HAS_TIMER = not _env.INTERPRET
# The interpreter has no clock: its waits count spins instead, about this many a second on an idle
# core (measured: 7-8K); a busy machine spins slower, so the wait only lasts longer.
INTERPRETER_SPINS_PER_S = 8000
_ALIGN_BYTES = 256
# gather_peers: programs per rank gathered from, each waiting on that rank's flag once.
_GATHER_PROGRAMS_PER_RANK = 16
# Rows move between ranks in 16-byte vectors where their offsets allow (see row_align).
_ROW_BYTES = 16


def timeout_units(seconds: float) -> int:
    """A wait's timeout in the kernels' unit: ns of the GPU timer, or interpreter spins."""
    if HAS_TIMER:
        return int(seconds * 1e9)
    return max(1, int(seconds * INTERPRETER_SPINS_PER_S))


def row_align(itemsize: int, *strides: int) -> int:
    """Elements every row offset into a symmetric buffer is a multiple of, as a kernel hint:
    16 bytes when the row strides allow it (the buffers' deltas always do), else 1."""
    vector = _ROW_BYTES // itemsize
    return vector if all(int(stride) % vector == 0 for stride in strides) else 1


def _p_pad(world_size: int) -> int:
    return next_power_of_2(max(world_size, 2))


_GATHER_ROUNDS: Counter = Counter()  # gather_within calls so far, by group and step


def gather_within(group: dist.ProcessGroup, value: object, *, timeout_s: float,
                  step: str) -> list:
    """Every rank's `value` (picklable), by group rank, exchanged through the default process
    group's store. Ranks that wait timeout_s without every rank having come raise
    MoKTimeoutError naming the ranks missing, and a rank coming after that raises too, so that
    no rank goes on alone into the collectives that follow `step`."""
    name = getattr(group, "group_name", "") or "default"
    _GATHER_ROUNDS[name, step] += 1
    store = dist.PrefixStore(f"mok/{name}/{step}/{_GATHER_ROUNDS[name, step]}/",
                             dist.distributed_c10d._get_default_store())
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    store.set(f"value{rank}", pickle.dumps(value))
    # "state" is written once, by whoever comes first: the last rank to arrive ("closed") or a
    # rank whose wait ran out ("abandoned"); compare_set makes that one write atomic.
    if store.add("arrived", 1) == world_size:
        store.compare_set("state", "", "closed")
    deadline, pause = time.monotonic() + timeout_s, 0.001
    while not store.check(["state"]) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(2 * pause, 0.05)  # many ranks polling one store: back off
    state = store.compare_set("state", "", f"abandoned by rank {rank}").decode()
    if state != "closed":
        if state == f"abandoned by rank {rank}":
            missing = [peer for peer in range(world_size)
                       if not store.check([f"value{peer}"])]
            what = f"rank(s) {missing} did not reach it within {timeout_s:g} s"
        else:
            what = f"{state.replace('abandoned by', '')} gave up waiting for it first"
        raise MoKTimeoutError(
            f"{step}: the ranks of the expert-parallel group did not all reach it: {what} "
            f"(MoKConfig.peer_timeout_s). A rank that raised or stopped before it, or ranks "
            f"calling with different options or dtypes (a workspace each), leave the others "
            f"waiting here")
    return [pickle.loads(store.get(f"value{peer}")) for peer in range(world_size)]


class SymmetricBuffer:
    """`nbytes` on every rank of `group`, mapped into every rank's address space."""

    def __init__(self, nbytes: int, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.nbytes = nbytes = max(int(nbytes), _ALIGN_BYTES)
        self._offset = 0
        self._peers: list[torch.Tensor] = []
        self._peer_views: dict[tuple, torch.Tensor] = {}
        if device.type == "cuda" and _env.RANKS_SHARE_GPU:
            self.local, addresses = self._map_ipc(nbytes, device)
        elif device.type == "cuda":
            from torch.distributed import _symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group.group_name)
            self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
            self.local.zero_()
            torch.cuda.synchronize(device)
            handle = symm_mem.rendezvous(self.local, group.group_name)
            self._handle = handle
            addresses = [int(ptr) for ptr in handle.buffer_ptrs]
        else:
            self.local, addresses = self._map_shared_files(nbytes)
        base = self.local.data_ptr()
        self._delta_bytes = [address - base for address in addresses]
        if any(delta % _ROW_BYTES for delta in self._delta_bytes):
            raise RuntimeError(f"symmetric buffers are not {_ROW_BYTES}-byte aligned alike on "
                               "every rank")
        # Made once here: a host-to-device copy later would be a sync in the forward.
        self._deltas = {size: torch.tensor([delta // size for delta in self._delta_bytes],
                                           dtype=torch.int64).to(device)
                        for size in (1, 2, 4, 8)}
        dist.barrier(group)

    def _map_ipc(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """Ranks sharing one GPU (MOK_RANKS_SHARE_GPU): each allocates its buffer and every rank
        opens the others' by CUDA IPC handle, exchanged over the group."""
        from torch.multiprocessing.reductions import reduce_tensor

        local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        handles: list = [None] * self.world_size
        dist.all_gather_object(handles, reduce_tensor(local), group=self.group)
        mappings = [local if peer == self.rank else rebuild(*args)
                    for peer, (rebuild, args) in enumerate(handles)]
        self._peers = mappings
        return local, [mapping.data_ptr() for mapping in mappings]

    def _map_shared_files(self, nbytes: int) -> tuple[torch.Tensor, list[int]]:
        """CPU: each rank creates a file in shared memory; every rank maps all of them."""
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(self.group, 0),
                                   group=self.group)
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        paths = [os.path.join(root or "/tmp", f"mok-{token[0]}-{peer}")
                 for peer in range(self.world_size)]
        local = torch.from_file(paths[self.rank], shared=True, size=nbytes, dtype=torch.uint8)
        local.zero_()
        dist.barrier(self.group)
        mappings = [local if peer == self.rank else
                    torch.from_file(paths[peer], shared=True, size=nbytes, dtype=torch.uint8)
                    for peer in range(self.world_size)]
        dist.barrier(self.group)
        os.unlink(paths[self.rank])  # the mappings stay valid; nothing is left on disk
        self._peers = mappings
        return local, [mapping.data_ptr() for mapping in mappings]

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next free region of the buffer as a local tensor of `shape` and `dtype`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for size in shape:
            numel *= int(size)
        start = self._offset
        end = start + numel * itemsize
        if end > self.nbytes:
            raise ValueError(f"symmetric buffer of {self.nbytes} bytes is full")
        self._offset = -(-end // _ALIGN_BYTES) * _ALIGN_BYTES
        return self.local[start:end].view(dtype).view(shape)

    def peer_view(self, view: torch.Tensor, peer: int) -> torch.Tensor:
        """Rank `peer`'s copy of `view` (a contiguous view into this buffer) as a tensor of this
        device over the peer's memory, for copies (on the copy engines on a GPU); made once per
        view and rank."""
        if peer == self.rank:
            return view
        key = (view.data_ptr(), tuple(view.shape), view.dtype, peer)
        mapped = self._peer_views.get(key)
        if mapped is None:
            offset = view.data_ptr() - self.local.data_ptr()
            if self._peers:
                mapped = self._peers[peer][offset:offset + view.numel() * view.element_size()]
                mapped = mapped.view(view.dtype).view(view.shape)
            else:
                mapped = self._handle.get_buffer(peer, tuple(view.shape), view.dtype,
                                                 offset // view.element_size())
            self._peer_views[key] = mapped
        return mapped

    def deltas(self, dtype: torch.dtype) -> torch.Tensor:
        """[world_size] int64 on the device: rank p's mapping of a view = view + deltas[p]."""
        return self._deltas[dtype.itemsize]

    @staticmethod
    def round_up(nbytes: int) -> int:
        return -(-int(nbytes) // _ALIGN_BYTES) * _ALIGN_BYTES


@dataclass(frozen=True)
class PeerFlags:
    """Flags and sequence numbers of one workspace (see mok.kernels.comm).

    flags  [num_slots] int64, symmetric; seq [num_phases] int64, local; errors: the error flags.
    """

    flags: torch.Tensor
    flag_deltas: torch.Tensor
    seq: torch.Tensor
    errors: torch.Tensor
    rank: int
    world_size: int
    timeout: int


def advance(peer: PeerFlags, phase: int, publish_slot: int | None) -> None:
    """Number the next round of `phase`; with publish_slot, tell the peers it is published."""
    launch(kernels.advance_kernel, (1,))(
        peer.seq, peer.flags, phase, publish_slot or 0, PUBLISH=publish_slot is not None)


def signal_peers(peer: PeerFlags, phase: int, slot: int) -> None:
    """Every rank's flags[slot + this rank] = the current round of `phase`."""
    launch(kernels.signal_peers_kernel, (1,))(
        peer.flags, peer.flag_deltas, peer.seq, phase, slot, peer.rank, peer.world_size,
        P_PAD=_p_pad(peer.world_size))


def wait_peers(peer: PeerFlags, phase: int, slot: int, *, remote: bool = False,
               then: tuple[int, int] | None = None, lag: int = 0) -> None:
    """Wait for flags[slot + p] of this rank (or, remote, flags[slot] of rank p) for every p to
    reach the round of `phase` (lag: that many rounds before it); then=(phase2, slot2): in the
    same launch, then likewise for those (their current round)."""
    phase2, slot2 = then if then is not None else (0, 0)
    launch(kernels.wait_peers_kernel, (1,))(
        peer.flags, peer.flag_deltas, peer.seq, peer.errors, phase, slot, 1, peer.world_size,
        peer.timeout, int(lag), phase2, slot2, REMOTE=remote, SECOND=then is not None,
        HAS_TIMER=HAS_TIMER)


def publish_and_wait(peer: PeerFlags, phase: int, publish_slot: int) -> None:
    """advance(peer, phase, publish_slot), then wait until every rank published that round:
    one launch."""
    launch(kernels.publish_and_wait_kernel, (1,))(
        peer.flags, peer.flag_deltas, peer.seq, peer.errors, phase, publish_slot,
        peer.world_size, peer.timeout, HAS_TIMER=HAS_TIMER)


def finish(peer: PeerFlags, phase: int, done_slot: int, report_slot: int, *,
           signal: bool = True) -> None:
    """The end of a phase's deliveries, in one launch: signal_peers(done_slot) (unless not
    signal: an earlier launch did), wait_peers(done_slot), then the reports of this rank's
    dropped routes in report_slot become its CAPACITY_OVERFLOW error (and are cleared)."""
    launch(kernels.finish_kernel, (1,))(
        peer.flags, peer.flag_deltas, peer.seq, peer.errors, phase, done_slot, report_slot,
        peer.rank, peer.world_size, peer.timeout, SIGNAL=bool(signal),
        P_PAD=_p_pad(peer.world_size), HAS_TIMER=HAS_TIMER)


def gather_peers(peer: PeerFlags, src: torch.Tensor, dst: torch.Tensor, src_deltas: torch.Tensor,
                 phase: int, publish_slot: int) -> None:
    """dst [P, *src.shape] = every rank's src, each once that rank published `phase`."""
    numel = src.numel()
    block = min(4096, next_power_of_2(max(numel, 16)))
    programs = min(cdiv(numel, block), _GATHER_PROGRAMS_PER_RANK)
    launch(kernels.gather_peers_kernel, (peer.world_size, programs))(
        src, src_deltas, dst, peer.flags, peer.flag_deltas, peer.seq, peer.errors,
        phase, publish_slot, numel, peer.world_size, peer.timeout,
        BLOCK=block, HAS_TIMER=HAS_TIMER, num_warps=8)


def pull_tokens(
    peer: PeerFlags,
    *,
    src: torch.Tensor,
    dst: torch.Tensor,
    weights: torch.Tensor | None,
    dst_weights: torch.Tensor | None,
    order: torch.Tensor,
    moving: torch.Tensor,
    ready: torch.Tensor,
    phase: int,
    publish_slot: int,
    tokens_per_rank: int,
    topk: int,
    num_programs: int,
    minibatch: int,
    src_deltas: torch.Tensor,
    weights_deltas: torch.Tensor | None,
    ring_rows: int = 0,
) -> None:
    """The dispatch on its own (see mok.kernels.comm.pull_tokens): dst[p * tokens_per_rank + t]
    = rank p's src[t % ring_rows] for the group tokens order[:moving[0]] (those with a route
    scheduled here, by first schedule row; ring_rows 0: tokens_per_rank); ready[minibatch] is
    set as minibatches of them land."""
    width = src.shape[1]
    num_warps = 8 if HAS_TIMER else 1
    block_r, block_w = pull_blocks(width, minibatch, src.element_size(), num_warps)
    has_weights = weights is not None
    launch(kernels.pull_tokens_kernel, (num_programs,))(
        src, src_deltas, weights if has_weights else src,
        weights_deltas if has_weights else src_deltas, dst,
        dst_weights if has_weights else dst,
        order, moving, ready, peer.flags, peer.flag_deltas, peer.seq,
        peer.errors, phase, publish_slot, tokens_per_rank, ring_rows or tokens_per_rank, topk,
        width, peer.world_size, peer.timeout, src.stride(0), dst.stride(0),
        HAS_WEIGHTS=has_weights, MINIBATCH=minibatch, BLOCK_R=block_r, BLOCK_W=block_w,
        K_PAD=_k_pad(topk), ROW_ALIGN=row_align(src.element_size(), src.stride(0)),
        HAS_TIMER=HAS_TIMER, num_warps=num_warps,
    )


def _k_pad(topk: int) -> int:
    return next_power_of_2(max(int(topk), 1))


def deliver_rows(rows: torch.Tensor, route_row: torch.Tensor, topk_ids: torch.Tensor,
                 out: torch.Tensor, out_deltas: torch.Tensor, *, world_size: int,
                 window_start: int, window_tokens: int, tokens_per_rank: int, topk: int,
                 first_local_expert: int, num_local_experts: int) -> None:
    """One delivery round of the ring (see mok.kernels.comm.deliver_rows_kernel): the rows
    [C, W] of the routes of every rank's tokens [window_start, + window_tokens) that chose this
    rank's experts, into their ranks' out [ring tokens * topk, W] (a view of the symmetric
    buffer), zeros for routes without a row. route_row and topk_ids: the group's [P *
    tokens_per_rank * topk]."""
    if window_tokens <= 0:
        return
    width = out.shape[1]
    block_r, block_w = 16, min(256, next_power_of_2(width))
    ring_rows = out.shape[0] // topk
    launch(kernels.deliver_rows_kernel, (world_size, cdiv(window_tokens * topk, block_r)))(
        rows, route_row, topk_ids, out, out_deltas, window_start, window_tokens,
        tokens_per_rank, ring_rows, tokens_per_rank * topk, topk, first_local_expert,
        num_local_experts, width, rows.stride(0), out.stride(0),
        BLOCK_R=block_r, BLOCK_W=block_w, num_warps=4)


def scatter_route_values(values: torch.Tensor, route_row: torch.Tensor, out: torch.Tensor,
                         out_deltas: torch.Tensor, routes_per_rank: int) -> None:
    """For every route g scheduled here: rank g // routes_per_rank's out[g % routes_per_rank] =
    values[g]."""
    num_routes = route_row.shape[0]
    if num_routes == 0:
        return
    block = 256
    launch(kernels.scatter_route_values_kernel, (cdiv(num_routes, block),))(
        values, route_row, out, out_deltas, num_routes, routes_per_rank, BLOCK=block)


def clear_dropped_routes(peer: PeerFlags, report_slot: int, topk: torch.Tensor,
                         route_row: torch.Tensor, *, routes_per_rank: int,
                         first_local_expert: int, num_local_experts: int,
                         rows: torch.Tensor | None = None, rows_deltas: torch.Tensor | None = None,
                         values: torch.Tensor | None = None,
                         values_deltas: torch.Tensor | None = None) -> None:
    """Zero, on their tokens' ranks, the rows (and values) of the routes to this rank's experts
    that its schedule had no room for, and report them in those ranks' flags[report_slot] (see
    mok.kernels.comm.clear_dropped_routes_kernel).

    topk [P * routes_per_rank] int32 (the group's expert ids), route_row likewise (-1: no row);
    rows [routes_per_rank, W] and values [routes_per_rank] fp32, views of symmetric buffers."""
    num_routes = route_row.shape[0]
    if num_routes == 0:
        return
    block_r = 256
    width = rows.shape[1] if rows is not None else 1
    block_w = min(32, next_power_of_2(width))
    launch(kernels.clear_dropped_routes_kernel, (cdiv(num_routes, block_r),))(
        topk, route_row, rows if rows is not None else route_row,
        rows_deltas if rows is not None else route_row,
        values if values is not None else route_row,
        values_deltas if values is not None else route_row,
        peer.flags, peer.flag_deltas, report_slot, num_routes, routes_per_rank,
        first_local_expert, num_local_experts, width,
        rows.stride(0) if rows is not None else 0,
        CLEAR_ROWS=rows is not None, CLEAR_VALUES=values is not None, BLOCK_R=block_r,
        BLOCK_W=block_w)


# Bytes each thread of a pulling program loads per step (64 registers). A remote load waits
# microseconds, so a program's pull rate is the bytes it has in flight over that wait. Two H200,
# the dispatch alone at qwen3-30b-a3b: 32 KB a step (8 warps) pulled 221 GB/s with 64 programs
# and 98 with 16; 64 KB a step pulls as fast with 32 programs as with 64 (0.34 ms).
PULL_BYTES_PER_THREAD = 256


# A Gluon GEMM's pulling partition (mok.kernels.gluon_comm): two warps in every program (one per
# SM) at PULL_BYTES_PER_THREAD a step, 2 MB in flight over 132 SMs (as the Triton launches' 32
# pulling programs of 8 warps), and its registers a thread (no spills at 128).
GLUON_PULL_WARPS = 2
GLUON_PULL_REGS = 128


def pull_blocks(width: int, minibatch: int, itemsize: int, num_warps: int) -> tuple[int, int]:
    """(rows, columns) of a pulling program's step: PULL_BYTES_PER_THREAD a thread, at most a
    minibatch of rows and 512 columns."""
    elements = PULL_BYTES_PER_THREAD * 32 * max(1, num_warps) // itemsize
    block_w = min(512, next_power_of_2(width))
    return max(1, min(next_power_of_2(minibatch), elements // block_w)), block_w


@dataclass(frozen=True)
class Pull:
    """Token rows a GEMM pulls from their ranks in its own launch (mok.kernels.comm.pull_tokens):
    the GEMM's A operand [P * tokens_per_rank, H], row p * tokens_per_rank + t = rank p's token
    t, read from that rank's copy of `src`, for the group's tokens with a route scheduled here:
    order[:moving[0]], by first schedule row, position[u] being token u's index there (see
    mok.exchange.ExchangePlan); the GEMM gathers them by route as on one GPU. With weights,
    dst_weights[g] = route g's router weight for those tokens' routes; with second_src (a buffer
    of the same symmetric allocation and row layout as src), the GEMM's second token-row operand
    likewise. ring_rows: src holds token t at row t % ring_rows (a window of the ring of
    mok.exchange.symmetric; run_apart only), 0 where it holds them all. in_gluon: a Gluon GEMM
    pulls in a partition of each of its programs rather than in a launch of its own before it
    (MoKConfig.fwd_pull_in_gluon). copied: the rows land by
    copies outside the GEMM (mok.exchange.SymmetricExchange.forward_copy and
    backward_copy, on the copy engines): the GEMM pulls nothing (num_programs 0) and its tiles
    only wait on their rows' ready flags, there one per rank (position[u] = u, minibatch =
    tokens_per_rank)."""

    peer: PeerFlags
    src: torch.Tensor
    src_deltas: torch.Tensor
    weights: torch.Tensor | None
    weights_deltas: torch.Tensor | None
    dst_weights: torch.Tensor | None
    order: torch.Tensor
    position: torch.Tensor
    moving: torch.Tensor
    ready: torch.Tensor
    phase: int
    publish_slot: int
    tokens_per_rank: int
    topk: int
    num_programs: int
    minibatch: int
    second_src: torch.Tensor | None = None
    in_gluon: bool = False
    copied: bool = False
    ring_rows: int = 0

    def run_apart(self, dst: torch.Tensor, num_programs: int | None = None) -> None:
        """This pull in a launch of its own (pull_tokens) into dst, the A operand, over
        num_programs programs (default: the pull's own), for a GEMM that does not pull: it reads
        dst after this launch, in stream order. Pulls of one token-row buffer only."""
        if self.second_src is not None:
            raise ValueError("Pull.run_apart pulls one token-row buffer (second_src is set)")
        if self.copied:
            raise ValueError("Pull.run_apart: a copied pull's rows land by copies")
        pull_tokens(self.peer, src=self.src, dst=dst, weights=self.weights,
                    dst_weights=self.dst_weights, order=self.order, moving=self.moving,
                    ready=self.ready, phase=self.phase, publish_slot=self.publish_slot,
                    tokens_per_rank=self.tokens_per_rank, topk=self.topk,
                    num_programs=num_programs or self.num_programs, minibatch=self.minibatch,
                    src_deltas=self.src_deltas, weights_deltas=self.weights_deltas,
                    ring_rows=self.ring_rows)

    @staticmethod
    def kernel_args(pull: Pull | None, fallback: torch.Tensor, num_warps: int) -> dict:
        """The pull's arguments of a Triton GEMM kernel (mok.kernels.grouped_gemm), by the
        kernel's parameter names; stand-ins (fallback, 0) without a pull. num_warps: the
        launch's."""
        if pull is None:
            return (dict.fromkeys(_POINTERS + ("pull_src2_ptr", "pull_ticket_ptr")
                                  + _FLAG_POINTERS, fallback)
                    | dict.fromkeys(_SCALARS, 0) | dict(
                PULL=False, PULL_WEIGHTS=False, PULL_SECOND=False, MINIBATCH=1, PULL_BLOCK_R=1,
                PULL_BLOCK_W=1, PULL_K_PAD=1, PULL_ROW_ALIGN=1, HAS_TIMER=HAS_TIMER))
        peer = pull.peer
        block_r, block_w = pull_blocks(pull.src.shape[1], pull.minibatch,
                                       pull.src.element_size(), num_warps)
        return dict(
            pull_src_ptr=pull.src, pull_src_delta_ptr=pull.src_deltas, **pull._weight_pointers(),
            pull_src2_ptr=pull.second_src if pull.second_src is not None else pull.src,
            **pull._flag_pointers(),
            pull_ticket_ptr=pull._claim_counter(),
            num_pull_programs=pull.num_programs, phase=pull.phase,
            publish_slot=pull.publish_slot, tokens_per_rank=pull.tokens_per_rank,
            pull_topk=pull.topk, world_size=peer.world_size, timeout=peer.timeout,
            stride_pull_src=pull.src.stride(0),
            PULL=True, PULL_WEIGHTS=pull.weights is not None,
            PULL_SECOND=pull.second_src is not None, MINIBATCH=pull.minibatch,
            PULL_BLOCK_R=block_r, PULL_BLOCK_W=block_w, PULL_K_PAD=_k_pad(pull.topk),
            PULL_ROW_ALIGN=row_align(pull.src.element_size(), pull.src.stride(0)),
            HAS_TIMER=HAS_TIMER)

    def _claim_counter(self) -> torch.Tensor:
        """A zeroed counter (on the device's stream, no sync) from which a launch's programs
        take their pulling roles or minibatches in the order they start (see
        mok.kernels.grouped_gemm._pull_programs and mok.kernels.gluon_comm.pull_partition)."""
        return torch.zeros(1, dtype=torch.int32, device=self.src.device)

    def _weight_pointers(self) -> dict:
        """weights, their deltas and dst_weights, or stand-ins without router weights."""
        if self.weights is None:
            return dict(pull_w_ptr=self.src, pull_w_delta_ptr=self.src_deltas,
                        pull_dst_w_ptr=self.src)
        return dict(pull_w_ptr=self.weights, pull_w_delta_ptr=self.weights_deltas,
                    pull_dst_w_ptr=self.dst_weights)

    def _flag_pointers(self) -> dict:
        """The pull order and the flags."""
        peer = self.peer
        return dict(pull_order_ptr=self.order, pull_position_ptr=self.position,
                    pull_moving_ptr=self.moving, ready_ptr=self.ready, seq_ptr=peer.seq,
                    flags_ptr=peer.flags, flag_delta_ptr=peer.flag_deltas, error_ptr=peer.errors)

    @staticmethod
    def gluon_args(pull: Pull | None, fallback: torch.Tensor) -> dict:
        """The arguments of a warp-specialized Gluon GEMM's pull (its pulling partition,
        mok.kernels.gluon_comm), by name; stand-ins without a pull."""
        if pull is None or pull.copied:
            constexprs = dict(
                PULL=False, PULL_WEIGHTS=False, MINIBATCH=1, PULL_BLOCK_R=1, PULL_BLOCK_W=8,
                PULL_K_PAD=1, PULL_ROW_ALIGN=1, PULL_WARPS=GLUON_PULL_WARPS,
                PULL_REGS=GLUON_PULL_REGS, WAIT_ROWS=False)
            scalars = dict.fromkeys(_GLUON_SCALARS, 0)
            if pull is None:
                return (dict.fromkeys(_POINTERS + _FLAG_POINTERS + ("pull_claim_ptr",), fallback)
                        | scalars | constexprs)
            # A copied pull: the loader's waits alone (position, ready, seq, errors; phase,
            # timeout).
            return (dict.fromkeys(_POINTERS + ("pull_claim_ptr",), fallback)
                    | pull._flag_pointers() | scalars
                    | dict(phase=pull.phase, world_size=pull.peer.world_size,
                           timeout=pull.peer.timeout)
                    | constexprs | dict(MINIBATCH=pull.minibatch, WAIT_ROWS=True))
        if pull.second_src is not None:
            raise ValueError("a Gluon GEMM's pull moves one token-row buffer (second_src is set)")
        peer = pull.peer
        block_r, block_w = pull_blocks(pull.src.shape[1], pull.minibatch,
                                       pull.src.element_size(), GLUON_PULL_WARPS)
        return dict(
            pull_src_ptr=pull.src, pull_src_delta_ptr=pull.src_deltas, **pull._weight_pointers(),
            **pull._flag_pointers(), pull_claim_ptr=pull._claim_counter(),
            phase=pull.phase, publish_slot=pull.publish_slot,
            tokens_per_rank=pull.tokens_per_rank, world_size=peer.world_size,
            timeout=peer.timeout, stride_pull_src=pull.src.stride(0),
            PULL=True, PULL_WEIGHTS=pull.weights is not None, MINIBATCH=pull.minibatch,
            PULL_BLOCK_R=block_r, PULL_BLOCK_W=block_w, PULL_K_PAD=_k_pad(pull.topk),
            PULL_ROW_ALIGN=row_align(pull.src.element_size(), pull.src.stride(0)),
            PULL_WARPS=GLUON_PULL_WARPS, PULL_REGS=GLUON_PULL_REGS, WAIT_ROWS=False)

    @staticmethod
    def gluon_rows_args(pull: Pull | None, pulled: torch.Tensor | None,
                        fallback: torch.Tensor) -> dict:
        """The arguments of a Gluon row GEMM's pulling partition (mok.kernels.gluon_rows,
        PULL), by name: token rows into `pulled`, no router weights, no tile waiting on them (so
        no position); stand-ins without a pull."""
        if pull is None:
            return (dict.fromkeys(("pull_src_ptr", "pull_src_delta_ptr", "pulled_ptr",
                                   "pull_order_ptr", "pull_moving_ptr", "ready_ptr", "seq_ptr",
                                   "flags_ptr", "flag_delta_ptr", "error_ptr",
                                   "pull_claim_ptr"), fallback)
                    | dict.fromkeys(("stride_pulled", "phase", "publish_slot",
                                     "tokens_per_rank", "world_size", "timeout",
                                     "stride_pull_src", "pull_width"), 0)
                    | dict(PULL=False, MINIBATCH=1, PULL_BLOCK_R=1, PULL_BLOCK_W=8,
                           PULL_ROW_ALIGN=1, PULL_WARPS=GLUON_PULL_WARPS,
                           PULL_REGS=GLUON_PULL_REGS))
        if pull.weights is not None or pull.second_src is not None:
            raise ValueError("a Gluon row GEMM pulls one token-row buffer, without router "
                             "weights")
        peer, src = pull.peer, pull.src
        block_r, block_w = pull_blocks(src.shape[1], pull.minibatch, src.element_size(),
                                       GLUON_PULL_WARPS)
        return dict(
            pull_src_ptr=src, pull_src_delta_ptr=pull.src_deltas, pulled_ptr=pulled,
            stride_pulled=pulled.stride(0), pull_order_ptr=pull.order,
            pull_moving_ptr=pull.moving, ready_ptr=pull.ready, seq_ptr=peer.seq,
            flags_ptr=peer.flags, flag_delta_ptr=peer.flag_deltas, error_ptr=peer.errors,
            pull_claim_ptr=pull._claim_counter(), phase=pull.phase,
            publish_slot=pull.publish_slot, tokens_per_rank=pull.tokens_per_rank,
            world_size=peer.world_size, timeout=peer.timeout, stride_pull_src=src.stride(0),
            pull_width=src.shape[1],
            PULL=True, MINIBATCH=pull.minibatch, PULL_BLOCK_R=block_r, PULL_BLOCK_W=block_w,
            PULL_ROW_ALIGN=row_align(src.element_size(), src.stride(0)),
            PULL_WARPS=GLUON_PULL_WARPS, PULL_REGS=GLUON_PULL_REGS)


# The parameter names of a pull in the GEMM kernels (Pull.kernel_args, Pull.gluon_args).
_POINTERS = ("pull_src_ptr", "pull_src_delta_ptr", "pull_w_ptr", "pull_w_delta_ptr",
             "pull_dst_w_ptr")
_FLAG_POINTERS = ("pull_order_ptr", "pull_position_ptr", "pull_moving_ptr", "ready_ptr",
                  "seq_ptr", "flags_ptr", "flag_delta_ptr", "error_ptr")
_SCALARS = ("num_pull_programs", "phase", "publish_slot", "tokens_per_rank", "pull_topk",
            "world_size", "timeout", "stride_pull_src")
_GLUON_SCALARS = ("phase", "publish_slot", "tokens_per_rank", "world_size", "timeout",
                  "stride_pull_src")


@dataclass(frozen=True)
class ScatterRows:
    """Where a GEMM's output rows go: row g % routes_per_rank of `out` on rank
    g // routes_per_rank, g = dest_route[row] (routes of the whole group)."""

    out: torch.Tensor
    deltas: torch.Tensor
    dest_route: torch.Tensor
    routes_per_rank: int
