"""Launchers of the expert GEMMs and the combine: allocate outputs, pick grids, pass strides.

Legend: T tokens, H hidden, I intermediate, E local experts, C schedule rows (Routing).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from mok import _env
from mok.arch import HOPPER, arch_of
from mok.errors import MoKInputError
from mok.kernels import combine as combine_kernels
from mok.kernels import gluon_dswiglu, gluon_gate_up, gluon_rows, gluon_wgrad
from mok.kernels import grouped_gemm as gemm_kernels
from mok.ops import comm
from mok.ops.checks import (
    check_experts,
    check_out_dtype,
    check_row_tiles,
    check_rows,
    check_schedule_rows,
    check_tokens,
)
from mok.ops.comm import Pull, ScatterRows
from mok.ops.launch import cdiv, launch, next_power_of_2
from mok.ops.routing import Routing, check_router_weights
from mok.ops.tuning import DswigluTiles, RowTiles, WgradTiles

UPCAST = _env.INTERPRET


def _strides(names: str, t: torch.Tensor) -> dict:
    """t's strides as keyword arguments, one name each (in t's dimension order)."""
    return dict(zip(names.split(), t.stride(), strict=True))


def _scatter_args(scatter: ScatterRows | None, out: torch.Tensor) -> dict:
    """A Triton row GEMM's SCATTER arguments (stand-ins without a scatter), by name."""
    if scatter is None:
        return dict(dest_route_ptr=out, out_delta_ptr=out, routes_per_rank=1, SCATTER=False,
                    ROW_ALIGN=1)
    return dict(dest_route_ptr=scatter.dest_route, out_delta_ptr=scatter.deltas,
                routes_per_rank=scatter.routes_per_rank, SCATTER=True,
                ROW_ALIGN=comm.row_align(out.element_size(), out.stride(0)))


@functools.cache
def _num_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM (a few under the interpreter)."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def _experts_descriptor(w: torch.Tensor, box: list[int], wanted: bool) -> tuple[object, bool]:
    """(w or a TMA descriptor of w [E, R, C] viewed [E * R, C] with `box`, whether it is the
    descriptor): the descriptor when `wanted` and w's layout allows one (unit C stride, experts
    back to back, 16-byte aligned rows and start); pointer loads otherwise."""
    experts, rows, cols = w.shape
    usable = (wanted and w.stride(2) == 1 and w.stride(0) == rows * w.stride(1)
              and (w.stride(1) * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0
              and experts * rows > 0)
    if not usable:
        return w, False
    flat = w.as_strided((experts * rows, cols), (w.stride(1), 1))
    return TensorDescriptor(flat, [experts * rows, cols], [w.stride(1), 1], box), True


def _weights_operand(w: torch.Tensor, tiles: RowTiles) -> tuple[object, bool]:
    """w [E, N, K] as a descriptor with [block_n, block_k] boxes (_experts_descriptor) when
    tiles.tma asks for it and the boxes hold at most 128 bytes along K."""
    return _experts_descriptor(w, [tiles.block_n, tiles.block_k],
                               tiles.tma and tiles.block_k * w.element_size() <= 128)


def _weights_k_rows_operand(w: torch.Tensor, tiles: RowTiles) -> tuple[object, bool]:
    """w [E, K, N] as a descriptor with [block_k, block_n] boxes (_experts_descriptor) when
    tiles.tma asks for it and block_k divides K, so that no box reaches the next expert's rows."""
    return _experts_descriptor(w, [tiles.block_k, tiles.block_n],
                               tiles.tma and w.shape[1] % tiles.block_k == 0)


def _gate_up_operands(w_gate: torch.Tensor, w_up: torch.Tensor,
                      tiles: RowTiles) -> tuple[object, object, bool]:
    """Both gate/up weights as TMA descriptors, or both as pointers (see _weights_operand)."""
    gate, gate_tma = _weights_operand(w_gate, tiles)
    up, up_tma = _weights_operand(w_up, tiles)
    if gate_tma and up_tma:
        return gate, up, True
    return w_gate, w_up, False


def _up_strides(w_gate: torch.Tensor, w_up: torch.Tensor, tma: bool) -> bool:
    """Whether a kernel loading both weights by pointers must address w_up by its own strides
    (UP_STRIDES): its layout differs from w_gate's. TMA descriptors carry their own."""
    return not tma and w_up.stride() != w_gate.stride()


def _rows_operands(tiles: RowTiles, *specs, wanted: bool = True) -> tuple[list, bool]:
    """(operands, whether they are TMA descriptors), one per spec (t, part, span, box_n): t a
    [rows, width] tensor whose columns are blocks of `part` columns each, covered by tiles
    `span` columns wide (block_k for an A operand, block_n for an output) and read or written in
    [block_m, box_n] boxes (box_n divides span). Descriptors when tiles.tma_rows (and `wanted`)
    ask for them and every t allows one (unit column stride, 16-byte aligned start and rows,
    span dividing part, so that no tile reaches past its block into the next); the tensors
    otherwise."""
    def usable(t: torch.Tensor, part: int, span: int, box_n: int) -> bool:
        size = t.element_size()
        return (t.stride(1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0
                and (part * size) % 16 == 0 and part % span == 0 and t.shape[0] > 0)

    if not (wanted and tiles.tma_rows and all(usable(*spec) for spec in specs)):
        return [spec[0] for spec in specs], False
    return [TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [tiles.block_m, box_n])
            for t, _, _, box_n in specs], True


def _a_spec(t: torch.Tensor, part: int, tiles: RowTiles) -> tuple:
    """_rows_operands' spec of an A operand read whole, [block_m, block_k] per K step."""
    return t, part, tiles.block_k, tiles.block_k


def _out_spec(t: torch.Tensor, part: int, tiles: RowTiles) -> tuple:
    """_rows_operands' spec of a tile-shaped epilogue operand, in tiles.epilogue_split boxes."""
    return t, part, tiles.block_n, tiles.block_n // tiles.epilogue_split


def _gemm_meta(tiles: RowTiles) -> dict:
    return dict(
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, PERSISTENT=tiles.persistent, FLATTEN=tiles.flatten,
        SPLIT=tiles.epilogue_split,
        UPCAST=UPCAST,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _row_grid(routing: Routing, tiles: RowTiles, n: int) -> tuple[int, int]:
    """(row blocks of the schedule, GEMM programs): a program per tile, or with
    tiles.persistent at most one per SM, striding over the tiles of the rows in use."""
    num_m_blocks = routing.capacity_rows // tiles.block_m
    num_tiles = num_m_blocks * cdiv(n, tiles.block_n)
    if tiles.persistent:
        return num_m_blocks, min(num_tiles, _num_programs(routing.row_route.device))
    return num_m_blocks, num_tiles


def _tile_counter(tiles: RowTiles, pull: Pull | None, routing: Routing) -> tuple:
    """(tile_counter, DYNAMIC) of a row GEMM launch. A launch that pulls rows from other ranks
    and runs persistent programs hands its tiles out from a counter (zeroed here, on the
    device's stream: no sync) rather than in fixed shares: a persistent program that finds its
    SM held by a pulling program (a 128 x 128 dSwiGLU tile at 8 warps takes all 64K registers of
    an SM) starts only once the pulls end, and with a fixed share the rest of the launch would
    wait on it (the recomputing dSwiGLU under EP=2 at qwen3 with fixed shares: 4.66 ms, 2.87
    alone; from the counter: 2.92-2.96 ms)."""
    if pull is None or not tiles.persistent:
        return routing.used_rows, False
    return torch.zeros(1, dtype=torch.int32, device=routing.used_rows.device), True


def _limit_args(swiglu_limit: float | None) -> dict:
    """swiglu_limit and HAS_LIMIT, by name."""
    if swiglu_limit is None:
        return dict(swiglu_limit=0.0, HAS_LIMIT=False)
    return dict(swiglu_limit=float(swiglu_limit), HAS_LIMIT=True)


def gate_up_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    routing: Routing,
    tiles: RowTiles,
    swiglu_limit: float | None,
    pull: Pull | None = None,
    gate_up: torch.Tensor | None = None,
    pulled_second: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [C, I] = swiglu(x[token] @ w_gate[e].T, x[token] @ w_up[e].T); x [T, H], w [E, I, H].

    pull: x's rows come from the other ranks, pulled by this launch's first programs; where
    the Gluon kernel takes the launch (RowTiles.gluon), by a launch of their own just before it
    over every SM or, with pull.in_gluon, by a partition of each of its programs while the tiles
    run (mok.kernels.gluon_comm). With pull.copied they land by copies outside the launch, its
    tiles waiting on them. pulled_second (x's shape and dtype): where the pull has a second
    buffer (pull.second_src), the destination of its rows, pulled with x's by this launch and
    not read by it (the recomputing backward's gate/up launch, `dswiglu_apart`, takes
    d_output's rows along for the launch after it); the Triton kernel runs such a launch.
    gate_up [C, 2I] (x's dtype): also receives the pre-activations [gate, up] of every row
    (see `gate_up_buffer`), for a backward that reads them instead of recomputing them; with a
    swiglu limit, a value the limit clamps is stored as +-inf.
    """
    check_experts(w_gate, "w_gate", routing.num_local_experts)
    intermediate, hidden = w_gate.shape[1:]
    check_experts(w_up, "w_up", routing.num_local_experts, (intermediate, hidden))
    check_rows(x, "x", width=hidden)
    check_tokens(x, "x", routing.num_tokens)
    check_row_tiles(tiles.block_m, routing.align)
    h = torch.empty(routing.capacity_rows, intermediate, dtype=x.dtype, device=x.device)
    if gate_up is not None:
        _check_gate_up(gate_up, routing, intermediate)
    if pull is not None and pull.copied:
        _check_block_order(pull, h.shape[0], tiles)
    second = pull is not None and pull.second_src is not None and not pull.copied
    if second != (pulled_second is not None):
        raise ValueError("gate_up_swiglu: pulled_second goes with a pull of a second buffer "
                         "(Pull.second_src), and only with one")
    if second and (pulled_second.shape != x.shape or pulled_second.dtype != x.dtype
                   or pulled_second.stride(1) != 1):
        raise ValueError(f"pulled_second must be a row-major {tuple(x.shape)} {x.dtype} tensor "
                         f"as x, got {tuple(pulled_second.shape)} {pulled_second.dtype}")
    if tiles.gluon and h.shape[0] > 0:
        if second:
            raise ValueError("gate_up_swiglu: a launch pulling a second buffer runs the Triton "
                             "kernel: give it tiles without RowTiles.gluon")
        _check_gluon("gate_up", tiles, (x,), (w_gate, w_up), hidden=hidden,
                     intermediate=intermediate)
        if pull is not None and not (pull.in_gluon or pull.copied):
            pull.run_apart(x, _num_programs(x.device))
            pull = None
        _gate_up_gluon(x, w_gate, w_up, routing, tiles, swiglu_limit, h, gate_up, pull)
        return h
    tile_counter, dynamic = _tile_counter(tiles, pull, routing)
    num_m_blocks, grid = _row_grid(routing, tiles, intermediate)
    pull_args = Pull.kernel_args(pull, h, tiles.num_warps)
    gate, up, tma = _gate_up_operands(w_gate, w_up, tiles)
    outs = [_out_spec(h, intermediate, tiles)]
    if gate_up is not None:
        outs.append(_out_spec(gate_up, intermediate, tiles))
    (h_out, *gate_up_out), rows_tma = _rows_operands(tiles, *outs)
    x2 = pulled_second if second else x
    launch(gemm_kernels.gate_up_swiglu_kernel, (grid + pull_args["num_pull_programs"],))(
        x_ptr=x, x2_ptr=x2, w_gate_ptr=gate, w_up_ptr=up, h_ptr=h_out,
        gate_up_ptr=gate_up_out[0] if gate_up_out else h_out, row_route_ptr=routing.row_route,
        block_expert_ptr=routing.block_expert, used_rows_ptr=routing.used_rows,
        tile_counter_ptr=tile_counter, num_m_blocks=num_m_blocks, N=intermediate, K=hidden,
        topk=routing.topk, stride_xm=x.stride(0), stride_x2m=x2.stride(0),
        **_strides("stride_we stride_wn stride_wk", w_gate),
        **_strides("stride_ue stride_un stride_uk", w_up), stride_hm=h.stride(0),
        stride_gum=gate_up.stride(0) if gate_up is not None else 0,
        **_limit_args(swiglu_limit), ALIGN=routing.align, W_TMA=tma,
        UP_STRIDES=_up_strides(w_gate, w_up, tma), SAVE_GATE_UP=gate_up is not None,
        ROWS_TMA=rows_tma, DYNAMIC=dynamic, BLOCK_ORDER=pull is not None and pull.copied,
        **pull_args, **_gemm_meta(tiles),
    )
    return h


# The Gluon gate/up kernel's loader partition: warps and registers per thread (its cp.async
# gather of a 128 x 64 x tile is eight 16-byte copies a thread at 4 warps).
_GLUON_LOAD_WARPS = 4
_GLUON_LOAD_REGS = 40
# Pulling (expert parallelism), the loader gives two of its warps to the pulling partition
# (mok.ops.comm.GLUON_PULL_WARPS): the launch's warps stay a multiple of four (the compiler pads
# them so, and 16 warps would leave 128 registers a thread, too few for the wgmma).
_GLUON_PULL_LOAD_WARPS = 2
_GLUON_PULL_LOAD_REGS = 48
_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def gluon_reads_rows(t: torch.Tensor) -> bool:
    """Rows the Gluon kernels can read (TMA or cp.async): unit column stride, rows and start
    16-byte aligned."""
    return (t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def gluon_reads_weights(dtype: torch.dtype, *weights: torch.Tensor) -> bool:
    """Expert weights the Gluon kernels can read (TMA over [E * R, C]): of dtype, contiguous,
    16-byte aligned, experts present."""
    return all(w.dtype == dtype and w.is_contiguous() and w.data_ptr() % 16 == 0
               and w.shape[0] > 0 for w in weights)


def gluon_takes(kind: str, tiles: RowTiles, *, hidden: int, intermediate: int,
                dtype: torch.dtype) -> bool:
    """Whether the Gluon kernel of GEMM `kind` (mok.ops.tuning.KINDS) takes these tiles at these
    sizes, its operands aside (gluon_reads_rows, gluon_reads_weights): a 16-bit dtype, K steps
    of 32 or 64 (128 is the FP8 kernels'), and
    - gate/up: H a multiple of block_k, I of 8, block_n at most 128 (gate and up share one
      wgmma of 2 * block_n columns);
    - down: rows of H and of I elements 16-byte aligned (TMA);
    - d_x: I a multiple of block_k, rows of H elements 16-byte aligned;
    - the dSwiGLU: rows of I elements 16-byte aligned, H a multiple of block_k, block_n at most
      128 kept and 64 recomputing (three accumulators).
    """
    if dtype not in _GLUON_DTYPES or tiles.block_k not in (32, 64):
        return False

    def aligned(*widths: int) -> bool:
        return all((w * dtype.itemsize) % 16 == 0 for w in widths)

    if kind in ("gate_up", "gate_up_saved"):
        return hidden % tiles.block_k == 0 and intermediate % 8 == 0 and tiles.block_n <= 128
    if kind == "down":
        return aligned(hidden, intermediate)
    if kind == "d_x":
        return intermediate % tiles.block_k == 0 and aligned(hidden, 2 * intermediate)
    if kind in ("down_bwd", "down_bwd_saved"):
        widest = 128 if kind == "down_bwd_saved" else 64
        return tiles.block_n <= widest and hidden % tiles.block_k == 0 and aligned(intermediate)
    raise ValueError(f"no Gluon kernel for {kind!r}")


def _check_gluon(kind: str, tiles: RowTiles, rows: tuple[torch.Tensor, ...],
                 weights: tuple[torch.Tensor, ...], *, hidden: int, intermediate: int) -> None:
    """Raise unless the Gluon kernel of `kind` takes this launch (the launchers run the kernel
    the tiles name; mok.plan gives Gluon tiles only where it does)."""
    dtype = rows[0].dtype
    if not (arch_of(rows[0].device).warp_specialized and all(gluon_reads_rows(t) for t in rows)
            and gluon_reads_weights(dtype, *weights)
            and gluon_takes(kind, tiles, hidden=hidden, intermediate=intermediate, dtype=dtype)):
        raise ValueError(f"{kind}: the tiles ask for the Gluon kernel (RowTiles.gluon), which "
                         f"does not take this launch (GPU, dtype, layout, alignment or sizes); "
                         f"mok.plan gives Gluon tiles only where it does")


def _gluon_descriptor(t: torch.Tensor, box: list[int], dtype) -> GluonDescriptor:
    """A Gluon TMA descriptor of t with `box`, in the default NVMMA shared layout for it."""
    return GluonDescriptor.from_tensor(t, box, _nvmma_layout(tuple(box), dtype))


@functools.cache
def _nvmma_layout(box: tuple[int, ...], dtype) -> gl.NVMMASharedLayout:
    """The default NVMMA shared layout of a `box` tile of dtype, made once (about 10 us of host
    time each, several a launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), dtype)


def _gate_up_gluon(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   routing: Routing, tiles: RowTiles, swiglu_limit: float | None,
                   h: torch.Tensor, gate_up: torch.Tensor | None, pull: Pull | None) -> None:
    """gate_up_swiglu by the warp-specialized Gluon kernel (mok.kernels.gluon_gate_up), which
    pulls x's rows itself with a pull (or, copied, waits on them)."""
    experts, intermediate, hidden = w_gate.shape
    dtype = _GLUON_DTYPES[x.dtype]
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k

    w_gate_desc = _gluon_descriptor(w_gate.view(experts * intermediate, hidden), [bn, bk], dtype)
    w_up_desc = _gluon_descriptor(w_up.view(experts * intermediate, hidden), [bn, bk], dtype)
    h_desc = gate_desc = up_desc = _gluon_descriptor(h, [bm, bn], dtype)
    if gate_up is not None:
        gate_desc = _gluon_descriptor(gate_up[:, :intermediate], [bm, bn], dtype)
        up_desc = _gluon_descriptor(gate_up[:, intermediate:], [bm, bn], dtype)
    load_warps, load_regs = ((_GLUON_LOAD_WARPS, _GLUON_LOAD_REGS)
                             if pull is None or pull.copied
                             else (_GLUON_PULL_LOAD_WARPS, _GLUON_PULL_LOAD_REGS))
    launch(gluon_gate_up.gate_up_swiglu_ws_kernel, (_num_programs(x.device),))(
        x_ptr=x, w_gate_desc=w_gate_desc, w_up_desc=w_up_desc, h_desc=h_desc,
        gate_desc=gate_desc, up_desc=up_desc, row_route_ptr=routing.row_route,
        block_expert_ptr=routing.block_expert, used_rows_ptr=routing.used_rows, N=intermediate,
        K=hidden, topk=routing.topk, stride_xm=x.stride(0), **_limit_args(swiglu_limit),
        **Pull.gluon_args(pull, x),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tiles.group_m, ALIGN=routing.align,
        NUM_STAGES=tiles.num_stages, LOAD_WARPS=load_warps, LOAD_REGS=load_regs,
        SAVE_GATE_UP=gate_up is not None, A_LAYOUT=_nvmma_layout((bm, bk), dtype),
        num_warps=bm // 16,
    )


# The Gluon row GEMMs' loader partition (one warp issuing TMA copies): registers per thread.
_GLUON_ROWS_LOAD_REGS = 24
# Shared memory one program of the Gluon kernels (sm_90) may hold.
_SM90_SMEM = HOPPER.shared_memory


def _gluon_rows_split(tiles: RowTiles, stages: int, size: int) -> int:
    """The Gluon row GEMMs' epilogue slices: tiles.epilogue_split, or 2 where a ring of `stages`
    stages and a whole-tile epilogue buffer would not fit in shared memory."""
    ring = stages * (tiles.block_m + tiles.block_n) * tiles.block_k * size
    if ring + tiles.block_m * tiles.block_n * size > _SM90_SMEM - 1024:
        return 2
    return tiles.epilogue_split


def _gluon_scatter_args(scatter: ScatterRows | None, out: torch.Tensor) -> dict:
    """The arguments of a Gluon row GEMM's SCATTER (mok.kernels.gluon_rows) into `out`
    (scatter.out), by name; stand-ins without a scatter."""
    if scatter is None:
        return dict(out_ptr=out, out_delta_ptr=out, routes_per_rank=1, stride_out=0,
                    SCATTER=False, ROW_ALIGN=1)
    return dict(out_ptr=out, out_delta_ptr=scatter.deltas,
                routes_per_rank=scatter.routes_per_rank, stride_out=out.stride(0), SCATTER=True,
                ROW_ALIGN=comm.row_align(out.element_size(), out.stride(0)))


def _down_gluon(h: torch.Tensor, w_down: torch.Tensor, routing: Routing, tiles: RowTiles,
                router_weights: torch.Tensor | None, out: torch.Tensor,
                scatter: ScatterRows | None) -> None:
    """down_proj by the warp-specialized Gluon kernel (mok.kernels.gluon_rows); with scatter,
    out is scatter.out."""
    experts, hidden, intermediate = w_down.shape
    dtype = _GLUON_DTYPES[h.dtype]
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    split = _gluon_rows_split(tiles, tiles.num_stages, h.element_size())
    launch(gluon_rows.down_proj_ws_kernel, (_num_programs(h.device),))(
        h_desc=_gluon_descriptor(h, [bm, bk], dtype),
        w_desc=_gluon_descriptor(w_down.view(experts * hidden, intermediate), [bn, bk], dtype),
        out_desc=_gluon_descriptor(out, [bm, bn // split], dtype),
        router_weights_ptr=router_weights if router_weights is not None else h,
        row_route_ptr=routing.row_route, block_expert_ptr=routing.block_expert,
        used_rows_ptr=routing.used_rows, N=hidden, K=intermediate,
        **_gluon_scatter_args(scatter, out),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tiles.group_m, ALIGN=routing.align,
        NUM_STAGES=tiles.num_stages, EPI_SPLIT=split, LOAD_REGS=_GLUON_ROWS_LOAD_REGS,
        HAS_WEIGHT=router_weights is not None, num_warps=bm // 16,
    )


def _d_x_gluon(d_gate_up: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
               routing: Routing, tiles: RowTiles, out: torch.Tensor,
               scatter: ScatterRows | None, pull: Pull | None,
               pulled: torch.Tensor | None) -> None:
    """d_x_rows by the warp-specialized Gluon kernel (mok.kernels.gluon_rows); with scatter,
    out is scatter.out; with pull, a partition of each program pulls token rows into `pulled`
    (no tile waits on them: they are a later kernel's). Each of the tile's num_stages holds a K
    step's gate and up tiles, as in the Triton kernel (so a tile fits both kernels' shared
    memory alike): two stages of the Gluon kernel's ring."""
    experts, intermediate, hidden = w_gate.shape
    dtype = _GLUON_DTYPES[d_gate_up.dtype]
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    stages = 2 * tiles.num_stages
    split = _gluon_rows_split(tiles, stages, d_gate_up.element_size())

    def weights(w: torch.Tensor) -> GluonDescriptor:
        return _gluon_descriptor(w.view(experts * intermediate, hidden), [bk, bn], dtype)

    launch(gluon_rows.d_x_rows_ws_kernel, (_num_programs(out.device),))(
        d_gate_up_desc=_gluon_descriptor(d_gate_up, [bm, bk], dtype),
        w_gate_desc=weights(w_gate), w_up_desc=weights(w_up),
        out_desc=_gluon_descriptor(out, [bm, bn // split], dtype),
        block_expert_ptr=routing.block_expert, used_rows_ptr=routing.used_rows, N=hidden,
        K=intermediate, row_route_ptr=routing.row_route, **_gluon_scatter_args(scatter, out),
        **Pull.gluon_rows_args(pull, pulled, out),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tiles.group_m, ALIGN=routing.align,
        NUM_STAGES=stages, EPI_SPLIT=split, LOAD_REGS=_GLUON_ROWS_LOAD_REGS,
        num_warps=bm // 16,
    )


def gate_up_buffer(x: torch.Tensor, w_gate: torch.Tensor, routing: Routing) -> torch.Tensor:
    """An empty [C, 2I] buffer for the pre-activations (`gate_up_swiglu(..., gate_up=)`)."""
    return torch.empty(routing.capacity_rows, 2 * w_gate.shape[1], dtype=x.dtype,
                       device=x.device)


def _check_gate_up(gate_up: torch.Tensor, routing: Routing, intermediate: int) -> None:
    expected = (routing.capacity_rows, 2 * intermediate)
    if tuple(gate_up.shape) != expected or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be a row-major {expected} tensor, got "
                         f"{tuple(gate_up.shape)} with strides {gate_up.stride()}")


def down_proj(
    h: torch.Tensor,
    w_down: torch.Tensor,
    routing: Routing,
    tiles: RowTiles,
    router_weights: torch.Tensor | None,
    scatter: ScatterRows | None = None,
) -> torch.Tensor:
    """rows [C, H] = router_weights[route] * (h @ w_down[e].T); h [C, I], w_down [E, H, I].

    scatter: write each row into its token's rank's combine buffer instead (returns that buffer).
    """
    check_router_weights(router_weights, routing)
    check_experts(w_down, "w_down", routing.num_local_experts)
    hidden, intermediate = w_down.shape[1:]
    check_rows(h, "h", width=intermediate)
    check_schedule_rows(h, "h", routing.capacity_rows)
    check_row_tiles(tiles.block_m, routing.align)
    if scatter is None:
        out = torch.empty(routing.capacity_rows, hidden, dtype=h.dtype, device=h.device)
    else:
        out = scatter.out
    if tiles.gluon and routing.capacity_rows > 0:
        _check_gluon("down", tiles, (h,), (w_down,), hidden=hidden, intermediate=intermediate)
        _down_gluon(h, w_down, routing, tiles, router_weights, out, scatter)
        return out
    num_m_blocks, grid = _row_grid(routing, tiles, hidden)
    weights, tma = _weights_operand(w_down, tiles)
    (h_in, out_arg), rows_tma = _rows_operands(
        tiles, _a_spec(h, intermediate, tiles), _out_spec(out, hidden, tiles),
        wanted=scatter is None)
    launch(gemm_kernels.down_proj_kernel, (grid,))(
        h_ptr=h_in, w_down_ptr=weights, out_ptr=out_arg,
        router_weights_ptr=router_weights if router_weights is not None else h,
        row_route_ptr=routing.row_route, block_expert_ptr=routing.block_expert,
        used_rows_ptr=routing.used_rows, num_m_blocks=num_m_blocks, N=hidden, K=intermediate,
        stride_hm=h.stride(0), **_strides("stride_we stride_wn stride_wk", w_down),
        stride_om=out.stride(0), HAS_WEIGHT=router_weights is not None, ALIGN=routing.align,
        W_TMA=tma, ROWS_TMA=rows_tma, **_scatter_args(scatter, out),
        # (RowTiles.flatten stays off where rows go to other ranks: not yet run on two GPUs.)
        **_gemm_meta(tiles if scatter is None else dataclasses.replace(tiles, flatten=False)),
    )
    return out


def combine(
    rows: torch.Tensor,
    routing: Routing,
    shared_rows: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, N] = shared_rows[t] + sum_slot rows[route_row[t * topk + slot]] (fp32 sums);
    out: a [T, N] tensor of out_dtype to write (default: a new one)."""
    check_rows(rows, "rows")
    num_tokens, width = routing.num_tokens, rows.shape[1]
    if shared_rows is not None:
        check_rows(shared_rows, "shared_rows", width=width)
        check_tokens(shared_rows, "shared_rows", num_tokens)
    check_out_dtype(out_dtype)
    if out is None:
        out = torch.empty(num_tokens, width, dtype=out_dtype, device=rows.device)
    else:
        check_rows(out, "out", width=width)
        if out.shape[0] != num_tokens or out.dtype != out_dtype:
            raise MoKInputError(f"combine: out must be [{num_tokens}, {width}] {out_dtype}, got "
                                f"{list(out.shape)} {out.dtype}")
    if num_tokens == 0:
        return out
    block_t, block_n = 16, min(256, next_power_of_2(width))
    grid = (cdiv(num_tokens, block_t), cdiv(width, block_n))
    launch(combine_kernels.combine_kernel, grid)(
        rows, routing.route_row, shared_rows if shared_rows is not None else rows, out,
        num_tokens, width,
        rows.stride(0), shared_rows.stride(0) if shared_rows is not None else 0, out.stride(0),
        TOPK=routing.topk, HAS_SHARED=shared_rows is not None, BLOCK_T=block_t,
        BLOCK_N=block_n, UPCAST=UPCAST,
        num_warps=4,
    )
    return out


def _check_dswiglu_operands(d_out, x, w_down, w_gate, w_up, routing: Routing) -> None:
    """d_out and x [*, H], w_gate and w_up [E, I, H], w_down [E, H, I]."""
    check_experts(w_gate, "w_gate", routing.num_local_experts)
    intermediate, hidden = w_gate.shape[1:]
    check_experts(w_up, "w_up", routing.num_local_experts, (intermediate, hidden))
    check_experts(w_down, "w_down", routing.num_local_experts, (hidden, intermediate))
    check_rows(d_out, "d_out", width=hidden)
    check_rows(x, "x", width=hidden)
    check_tokens(d_out, "d_out", routing.num_tokens)
    check_tokens(x, "x", routing.num_tokens)


def down_bwd_dswiglu(
    d_out: torch.Tensor,
    x: torch.Tensor,
    w_down: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    h: torch.Tensor,
    routing: Routing,
    tiles: DswigluTiles,
    router_weights: torch.Tensor | None,
    swiglu_limit: float | None,
    pull: Pull | None = None,
    gate_up: torch.Tensor | None = None,
    h_out: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients at the gate/up outputs, gate/up recomputed in the same pass (or read from
    gate_up [C, 2I], the forward's pre-activations: then x, w_gate and w_up are not read, except
    x as the destination of a pull). h_out (with gate_up): h [C, I] receives swiglu of the kept
    pre-activations instead of being read (a forward context that keeps gate_up only).
    out: the d_gate_up buffer to write ([C, 2I], x's dtype; default a new one); it may be
    gate_up itself (each tile reads its pre-activations before it writes their gradients).

    Returns d_gate_up [C, 2I] (d_gate in [:, :I], d_up in [:, I:]) and, with router weights, the
    partial router-weight gradients [C, cdiv(I, block_n)] fp32 (summed by `router_grad`).
    pull: d_out's rows come from the other ranks, pulled by this launch's first programs (with
    pull.copied they land by copies beside it, the tiles waiting on them and taking their row
    blocks in pull.order's order; the Gluon kernel may then take the launch).
    """
    check_router_weights(router_weights, routing)
    _check_dswiglu_operands(d_out, x, w_down, w_gate, w_up, routing)
    check_row_tiles(tiles.block_m, routing.align)
    intermediate, hidden = w_gate.shape[1:]
    rows = routing.capacity_rows
    if out is not None:
        _check_gate_up(out, routing, intermediate)
        if out.dtype != x.dtype:
            raise ValueError(f"out is {out.dtype}, the gradients are {x.dtype}")
    d_gate_up = out if out is not None else torch.empty(rows, 2 * intermediate, dtype=x.dtype,
                                                        device=x.device)
    partial = None
    if router_weights is not None:
        partial = torch.empty(rows, cdiv(intermediate, tiles.block_n),
                              dtype=torch.float32, device=x.device)
    _check_gate_up_args(gate_up, h_out, routing, intermediate)
    copied = pull is not None and pull.copied
    if copied:
        _check_block_order(pull, rows, tiles)
    if tiles.gluon and rows > 0:
        if pull is not None and not copied:
            raise ValueError("down_bwd_dswiglu: a launch whose programs pull rows runs the "
                             "Triton kernel: give it tiles without RowTiles.gluon")
        if gate_up is None:
            kind, gluon_rows_in, weights = "down_bwd", (d_out, x, h, d_gate_up), (w_down, w_gate,
                                                                                 w_up)
        else:
            if not h_out:
                raise ValueError("down_bwd_dswiglu: the Gluon kernel's kept form writes h "
                                 "(h_out=True)")
            kind, gluon_rows_in, weights = "down_bwd_saved", (d_out, gate_up, h, d_gate_up), (
                w_down,)
        _check_gluon(kind, tiles, gluon_rows_in, weights, hidden=hidden,
                     intermediate=intermediate)
        _down_bwd_gluon(d_out, x, w_down, w_gate, w_up, h, routing, tiles, router_weights,
                        swiglu_limit, gate_up, d_gate_up, partial, pull)
        return d_gate_up, partial
    tile_counter, dynamic = _tile_counter(tiles, pull, routing)
    num_m_blocks, grid = _row_grid(routing, tiles, intermediate)
    pull_args = Pull.kernel_args(pull, d_gate_up, tiles.num_warps)
    if gate_up is None:
        gate, up, tma = _gate_up_operands(w_gate, w_up, tiles)
    else:
        gate, up, tma = w_gate, w_up, False
    down_weights, wk_tma = _weights_k_rows_operand(w_down, tiles)
    specs = [_out_spec(d_gate_up, intermediate, tiles), _out_spec(h, intermediate, tiles)]
    if gate_up is not None:
        specs.append(_out_spec(gate_up, intermediate, tiles))
    (d_gate_up_arg, h_arg, *gate_up_arg), rows_tma = _rows_operands(tiles, *specs)
    launch(gemm_kernels.down_bwd_dswiglu_kernel, (grid + pull_args["num_pull_programs"],))(
        d_out_ptr=d_out, x_ptr=x, w_down_ptr=down_weights, w_gate_ptr=gate, w_up_ptr=up,
        h_ptr=h_arg, gate_up_ptr=gate_up_arg[0] if gate_up_arg else h_arg,
        router_weights_ptr=router_weights if router_weights is not None else h,
        d_gate_up_ptr=d_gate_up_arg,
        d_weight_partial_ptr=partial if partial is not None else d_gate_up,
        row_route_ptr=routing.row_route, block_expert_ptr=routing.block_expert,
        used_rows_ptr=routing.used_rows, tile_counter_ptr=tile_counter,
        num_m_blocks=num_m_blocks, N=intermediate, K=hidden, topk=routing.topk,
        stride_dm=d_out.stride(0), stride_xm=x.stride(0),
        **_strides("stride_wd_e stride_wd_k stride_wd_n", w_down),
        **_strides("stride_we stride_wn stride_wk", w_gate),
        **_strides("stride_ue stride_un stride_uk", w_up), stride_hm=h.stride(0),
        stride_gum=gate_up.stride(0) if gate_up is not None else 0,
        stride_gm=d_gate_up.stride(0), stride_pm=partial.stride(0) if partial is not None else 0,
        **_limit_args(swiglu_limit), HAS_WEIGHT=router_weights is not None,
        ALIGN=routing.align, W_TMA=tma,
        UP_STRIDES=gate_up is None and _up_strides(w_gate, w_up, tma),
        SAVED_GATE_UP=gate_up is not None, H_OUT=h_out, ROWS_TMA=rows_tma, WK_TMA=wk_tma,
        DYNAMIC=dynamic, BLOCK_ORDER=copied, **pull_args, **_gemm_meta(tiles),
    )
    return d_gate_up, partial


def dswiglu_apart(
    d_out: torch.Tensor,
    x: torch.Tensor,
    w_down: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    routing: Routing,
    gate_up_tiles: RowTiles,
    kept_tiles: DswigluTiles,
    router_weights: torch.Tensor | None,
    swiglu_limit: float | None,
    pull: Pull | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """down_bwd_dswiglu recomputing gate/up in a launch of its own (DswigluTiles.apart): gate/up
    stores the pre-activations into the d_gate_up buffer (gate_up_tiles, as the forward with
    kept pre-activations), then the kept dSwiGLU (kept_tiles) reads them and writes their
    gradients in place, and h, of the kept pre-activations as a kept backward does, into a
    buffer of its own (the router-weight gradients' partial sums read it). Returns what
    down_bwd_dswiglu does, bitwise what the backward of a forward that kept its pre-activations
    with gate_up_tiles gets. pull: a copied pull (SymmetricExchange.backward_copy, both x's and
    d_out's rows under each rank's flag): the gate/up launch waits on it, and the dSwiGLU
    launch too where its row blocks are of the same size. Or a pull by the gate/up launch's
    first programs of x's rows (pull.src) with d_out's (pull.second_src; SymmetricExchange.
    backward_pull's x_first), its tiles waiting on them (the Triton kernel runs it: give
    Triton tiles, TileConfig.pick's triton); the dSwiGLU launch reads them after it, in stream
    order, and waits on nothing."""
    check_router_weights(router_weights, routing)
    _check_dswiglu_operands(d_out, x, w_down, w_gate, w_up, routing)
    pulling = pull is not None and not pull.copied
    if pulling and pull.second_src is None:
        raise ValueError("dswiglu_apart: a pull by its gate/up launch brings d_out's rows along "
                         "(Pull.second_src)")
    d_gate_up = gate_up_buffer(x, w_gate, routing)
    h = gate_up_swiglu(x, w_gate, w_up, routing, gate_up_tiles, swiglu_limit, pull=pull,
                       gate_up=d_gate_up, pulled_second=d_out if pulling else None)
    same_blocks = (pull is not None and not pulling
                   and kept_tiles.block_m == gate_up_tiles.block_m)
    return down_bwd_dswiglu(d_out, x, w_down, w_gate, w_up, h, routing, kept_tiles,
                            router_weights, swiglu_limit, pull=pull if same_blocks else None,
                            gate_up=d_gate_up, h_out=True, out=d_gate_up)


def _check_block_order(pull: Pull, rows: int, tiles: RowTiles) -> None:
    if pull.order.shape[0] != rows // tiles.block_m:
        raise ValueError(f"a copied pull's block order has {pull.order.shape[0]} row blocks, the "
                         f"schedule {rows // tiles.block_m} of {tiles.block_m} rows")


def _check_gate_up_args(gate_up: torch.Tensor | None, h_out: bool, routing: Routing,
                        intermediate: int) -> None:
    if gate_up is not None:
        _check_gate_up(gate_up, routing, intermediate)
    elif h_out:
        raise ValueError("h_out needs the kept pre-activations (gate_up)")


# The Gluon dSwiGLU kernel's loader partition: warps, and registers per thread kept and
# recomputing (the cp.async gathers of d_out's rows; recomputing also x's, twice the addresses).
_GLUON_DSWIGLU_LOAD_WARPS = 4
_GLUON_DSWIGLU_LOAD_REGS = {True: 48, False: 56}


def _gluon_dswiglu_split(tiles: DswigluTiles, kept: bool, weighted: bool, size: int) -> int:
    """The Gluon dSwiGLU epilogue's column slices: tiles.epilogue_split, or 2 where slices of
    128 columns would spill registers (a thread holds 64 of dh0 and 64 of each of gate, up and
    what they make) or the ring, the epilogue's input boxes (the kept gate and up, or h) and a
    whole-tile output buffer (per MMA partition: two with tiles.pingpong) would not fit in
    shared memory."""
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    stage = (bm + bn) * bk if kept else (2 * bm + 3 * bn) * bk
    epilogue = (2 if kept else int(weighted)) + 1  # input boxes and the output buffer
    consumers = 2 if tiles.pingpong else 1  # each with epilogue buffers of its own
    if bn > 64 or (tiles.num_stages * stage + consumers * epilogue * bm * bn) * size > (
            _SM90_SMEM - 1024):
        return 2
    return tiles.epilogue_split


def _down_bwd_gluon(d_out: torch.Tensor, x: torch.Tensor, w_down: torch.Tensor,
                    w_gate: torch.Tensor, w_up: torch.Tensor, h: torch.Tensor, routing: Routing,
                    tiles: DswigluTiles, router_weights: torch.Tensor | None,
                    swiglu_limit: float | None, gate_up: torch.Tensor | None,
                    d_gate_up: torch.Tensor, partial: torch.Tensor | None,
                    pull: Pull | None = None) -> None:
    """down_bwd_dswiglu by the warp-specialized Gluon kernel (mok.kernels.gluon_dswiglu): kept
    (gate_up, h written) or recomputing (h read); a pull must be `copied` (its tiles wait on
    the copies' flags, its row blocks in its order)."""
    experts, intermediate, hidden = w_gate.shape
    dtype = _GLUON_DTYPES[d_out.dtype]
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    kept = gate_up is not None
    split = _gluon_dswiglu_split(tiles, kept, router_weights is not None, d_out.element_size())

    def rows(t: torch.Tensor) -> GluonDescriptor:
        return _gluon_descriptor(t, [bm, bn // split], dtype)

    w_down_desc = _gluon_descriptor(w_down.view(experts * hidden, intermediate), [bk, bn], dtype)
    w_gate_desc = w_up_desc = w_down_desc
    h_desc = gate_desc = up_desc = rows(h)
    if kept:
        gate_desc, up_desc = rows(gate_up[:, :intermediate]), rows(gate_up[:, intermediate:])
    else:
        w_gate_desc, w_up_desc = (
            _gluon_descriptor(w.view(experts * intermediate, hidden), [bn, bk], dtype)
            for w in (w_gate, w_up))
    if pull is None:  # stand-ins: nothing is waited on
        waits = dict(block_order_ptr=d_gate_up, ready_ptr=d_gate_up, seq_ptr=d_gate_up,
                     phase=0, error_ptr=d_gate_up, timeout=0, world_size=1)
    else:
        waits = dict(block_order_ptr=pull.order, ready_ptr=pull.ready, seq_ptr=pull.peer.seq,
                     phase=pull.phase, error_ptr=pull.peer.errors, timeout=pull.peer.timeout,
                     world_size=pull.peer.world_size)
    launch(gluon_dswiglu.down_bwd_dswiglu_ws_kernel, (_num_programs(d_out.device),))(
        d_out_ptr=d_out, x_ptr=x, w_down_desc=w_down_desc, w_gate_desc=w_gate_desc,
        w_up_desc=w_up_desc, h_desc=h_desc, gate_desc=gate_desc, up_desc=up_desc,
        d_gate_desc=rows(d_gate_up[:, :intermediate]),
        d_up_desc=rows(d_gate_up[:, intermediate:]),
        router_weights_ptr=router_weights if router_weights is not None else d_gate_up,
        d_weight_partial_ptr=partial if partial is not None else d_gate_up,
        row_route_ptr=routing.row_route, block_expert_ptr=routing.block_expert,
        used_rows_ptr=routing.used_rows, N=intermediate, K=hidden, topk=routing.topk,
        stride_dm=d_out.stride(0), stride_xm=x.stride(0),
        stride_pm=partial.stride(0) if partial is not None else 0,
        **_limit_args(swiglu_limit), **waits,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tiles.group_m, ALIGN=routing.align,
        NUM_STAGES=tiles.num_stages, EPI_SPLIT=split, LOAD_WARPS=_GLUON_DSWIGLU_LOAD_WARPS,
        LOAD_REGS=_GLUON_DSWIGLU_LOAD_REGS[kept],
        HAS_WEIGHT=router_weights is not None, SAVED_GATE_UP=kept,
        A_LAYOUT=_nvmma_layout((bm, bk), dtype),
        PINGPONG=tiles.pingpong, MMA_REGS=_gluon_mma_regs(bm, 2, _GLUON_DSWIGLU_LOAD_WARPS,
                                                          _GLUON_DSWIGLU_LOAD_REGS[kept]),
        WAIT_ROWS=pull is not None, TOKENS_PER_RANK=pull.tokens_per_rank if pull else 1,
        num_warps=bm // 16,
    )


def _gluon_mma_regs(block_m: int, consumers: int, load_warps: int, load_regs: int) -> int:
    """Registers per thread for each of `consumers` MMA partitions of block_m // 16 warps once
    the loader's warps hold load_regs: an SM's 64K shared out, in multiples of 8, at most 256."""
    mma_threads = consumers * block_m // 16 * 32
    free = 65536 - load_warps * 32 * load_regs
    return min(256, free // mma_threads // 8 * 8)


def d_x_rows(
    d_gate_up: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    routing: Routing,
    tiles: RowTiles,
    scatter: ScatterRows | None = None,
    pull: Pull | None = None,
    pulled: torch.Tensor | None = None,
) -> torch.Tensor:
    """rows [C, H] = d_gate @ w_gate[e] + d_up @ w_up[e]; w [E, I, H].

    scatter: write each row into its token's rank's combine buffer instead (returns that buffer).
    pull: this launch's first programs also pull token rows [P * T, H] into `pulled`, for a
    later kernel (no tile here reads them).
    """
    check_experts(w_gate, "w_gate", routing.num_local_experts)
    intermediate, hidden = w_gate.shape[1:]
    check_experts(w_up, "w_up", routing.num_local_experts, (intermediate, hidden))
    check_rows(d_gate_up, "d_gate_up", width=2 * intermediate)
    check_schedule_rows(d_gate_up, "d_gate_up", routing.capacity_rows)
    check_row_tiles(tiles.block_m, routing.align)
    if (pull is None) != (pulled is None):
        raise ValueError("d_x_rows takes pull and pulled together")
    if scatter is None:
        out = torch.empty(routing.capacity_rows, hidden, dtype=d_gate_up.dtype,
                          device=d_gate_up.device)
    else:
        out = scatter.out
    if tiles.gluon and routing.capacity_rows > 0:
        _check_gluon("d_x", tiles, (d_gate_up,), (w_gate, w_up), hidden=hidden,
                     intermediate=intermediate)
        _d_x_gluon(d_gate_up, w_gate, w_up, routing, tiles, out, scatter, pull, pulled)
        return out
    num_m_blocks, grid = _row_grid(routing, tiles, hidden)
    tile_counter, dynamic = _tile_counter(tiles, pull, routing)
    pull_args = Pull.kernel_args(pull, out, tiles.num_warps)
    (d_gate_up_in, out_arg), rows_tma = _rows_operands(
        tiles, _a_spec(d_gate_up, intermediate, tiles), _out_spec(out, hidden, tiles),
        wanted=scatter is None)
    gate, gate_tma = _weights_k_rows_operand(w_gate, tiles)
    up, up_tma = _weights_k_rows_operand(w_up, tiles)
    wk_tma = gate_tma and up_tma
    pulled = out if pulled is None else pulled
    launch(gemm_kernels.d_x_rows_kernel, (grid + pull_args["num_pull_programs"],))(
        d_gate_up_ptr=d_gate_up_in, w_gate_ptr=gate if wk_tma else w_gate,
        w_up_ptr=up if wk_tma else w_up, out_ptr=out_arg, block_expert_ptr=routing.block_expert,
        pulled_ptr=pulled, stride_pulled=pulled.stride(0), used_rows_ptr=routing.used_rows,
        tile_counter_ptr=tile_counter, num_m_blocks=num_m_blocks, N=hidden, K=intermediate,
        stride_gm=d_gate_up.stride(0), **_strides("stride_we stride_wk stride_wn", w_gate),
        **_strides("stride_ue stride_uk stride_un", w_up), stride_om=out.stride(0),
        ALIGN=routing.align, ROWS_TMA=rows_tma, WK_TMA=wk_tma,
        UP_STRIDES=_up_strides(w_gate, w_up, wk_tma), DYNAMIC=dynamic,
        **_scatter_args(scatter, out), **pull_args, **_gemm_meta(tiles),
    )
    return out


def _check_read_rows(t: torch.Tensor, name: str, routing: Routing, *, gather: bool) -> None:
    """t read by token (gather) or by schedule row: enough rows for the schedule."""
    if gather:
        check_tokens(t, name, routing.num_tokens)
    else:
        check_schedule_rows(t, name, routing.capacity_rows)


def grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    routing: Routing,
    tiles: WgradTiles,
    *,
    gather_a: bool,
    gather_b: bool,
    router_weights: torch.Tensor | None = None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """out [E, P, Q] = sum over expert e's rows of a[row, :P]^T b[row, :Q].

    a [rows or T, P] and b [rows or T, Q] (a view with unit column stride); a gathered operand is
    indexed by token. With router_weights [T * k], a's rows are scaled by the route's weight. A
    row-indexed b holds zeros on padding rows, as the row GEMMs' outputs (h) do: with
    tiles.grouped_mm it is read as it is, padding included (a is copied, see copy_rows).
    """
    check_router_weights(router_weights, routing)
    check_rows(a, "a")
    check_rows(b, "b")
    _check_read_rows(a, "a", routing, gather=gather_a)
    _check_read_rows(b, "b", routing, gather=gather_b)
    check_out_dtype(out_dtype)
    if tiles.grouped_mm:
        _check_grouped_mm(a, b)
        a_rows = copy_rows(a, routing, gather=gather_a, router_weights=router_weights)
        b_rows = copy_rows(b, routing, gather=True) if gather_b else b
        return _grouped_mm_wgrad(a_rows, b_rows, _group_ends(routing), out_dtype)
    out = torch.empty(routing.num_local_experts, a.shape[1], b.shape[1], dtype=out_dtype,
                      device=a.device)
    if tiles.gluon:  # the down projection's: a = d_output by token, b = h by row
        _check_gluon_wgrad("wgrad_down", tiles, b, a, routing, out_dtype,
                           intermediate=b.shape[1], gathered=gather_a and not gather_b)
        _wgrad_gluon(b, a, routing, tiles, out, None, router_weights)
        return out
    _launch_wgrad(a, None, b, out, None, routing, tiles, gather_a=gather_a, gather_b=gather_b,
                  router_weights=router_weights)
    return out


def grouped_wgrad_gate_up(
    d_gate_up: torch.Tensor,
    x: torch.Tensor,
    routing: Routing,
    tiles: WgradTiles,
    *,
    gather_x: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_w_gate, d_w_up) [E, I, H] from d_gate_up [C, 2I] (d_gate, then d_up) and x (by token
    with gather_x, else by row). With tiles.pair one launch computes both, loading each tile of
    x once; otherwise two launches. Either way each output tile is summed in the same order.
    With tiles.grouped_mm x's rows are copied into schedule order (copy_rows)."""
    check_rows(d_gate_up, "d_gate_up")
    check_rows(x, "x")
    check_schedule_rows(d_gate_up, "d_gate_up", routing.capacity_rows)
    _check_read_rows(x, "x", routing, gather=gather_x)
    check_out_dtype(out_dtype)
    if d_gate_up.shape[1] % 2:
        raise MoKInputError(f"d_gate_up must be [C, 2I] (d_gate, then d_up), got "
                            f"{tuple(d_gate_up.shape)}")
    intermediate = d_gate_up.shape[1] // 2
    d_gate, d_up = d_gate_up[:, :intermediate], d_gate_up[:, intermediate:]
    if tiles.grouped_mm:
        _check_grouped_mm(d_gate_up, x)
        x_rows = copy_rows(x, routing, gather=gather_x)
        ends = _group_ends(routing)
        return (_grouped_mm_wgrad(d_gate, x_rows, ends, out_dtype),
                _grouped_mm_wgrad(d_up, x_rows, ends, out_dtype))
    shape = (routing.num_local_experts, intermediate, x.shape[1])
    d_w_gate = torch.empty(shape, dtype=out_dtype, device=x.device)
    d_w_up = torch.empty(shape, dtype=out_dtype, device=x.device)
    if tiles.gluon:
        _check_gluon_wgrad("wgrad_gate_up", tiles, d_gate_up, x, routing, out_dtype,
                           intermediate=intermediate, gathered=gather_x)
        _wgrad_gluon(d_gate_up, x, routing, tiles, d_w_gate, d_w_up, None)
    elif tiles.pair:
        _launch_wgrad(d_gate, d_up, x, d_w_gate, d_w_up, routing, tiles, gather_a=False,
                      gather_b=gather_x, router_weights=None)
    else:
        for a, out in ((d_gate, d_w_gate), (d_up, d_w_up)):
            _launch_wgrad(a, None, x, out, None, routing, tiles, gather_a=False,
                          gather_b=gather_x, router_weights=None)
    return d_w_gate, d_w_up


def gluon_takes_wgrad(kind: str, tiles: WgradTiles, dtype: torch.dtype,
                      out_dtype: torch.dtype, *, hidden: int, intermediate: int,
                      align: int) -> bool:
    """Whether the Gluon weight gradient of `kind` (mok.kernels.gluon_wgrad) takes these sizes:
    16-bit operands and gradients of one dtype, block_k dividing the schedule's align, and the
    tile's side along I (wgrad_gate_up: block_m; wgrad_down: block_n) 128 or 256 and dividing
    I, its side along H dividing H."""
    along_i, along_h = tiles.gluon_sides(kind)
    return (dtype in _GLUON_DTYPES and out_dtype == dtype and along_i in (128, 256)
            and intermediate % along_i == 0 and hidden % along_h == 0
            and align % tiles.block_k == 0)


def _check_gluon_wgrad(kind: str, tiles: WgradTiles, rows: torch.Tensor, tokens: torch.Tensor,
                       routing: Routing, out_dtype: torch.dtype, *, intermediate: int,
                       gathered: bool) -> None:
    """Raise unless the Gluon weight gradient of `kind` takes this launch: rows (d_gate_up or
    h) by row, tokens (x or d_output) by token (gathered: the launch asks for them so); mok.plan
    gives its tiles only where it does."""
    if not (gathered and arch_of(tokens.device).warp_specialized and gluon_reads_rows(rows)
            and gluon_reads_rows(tokens) and rows.dtype == tokens.dtype
            and gluon_takes_wgrad(kind, tiles, tokens.dtype, out_dtype,
                                  hidden=tokens.shape[1], intermediate=intermediate,
                                  align=routing.align)):
        raise ValueError(f"{kind}: the tiles ask for the Gluon kernel (WgradTiles.gluon), which "
                         f"does not take this launch (GPU, operands by row and by token, dtype, "
                         f"layout or sizes); mok.plan gives Gluon tiles only where it does")


def _wgrad_gluon(rows: torch.Tensor, tokens: torch.Tensor, routing: Routing, tiles: WgradTiles,
                 out: torch.Tensor, out2: torch.Tensor | None,
                 router_weights: torch.Tensor | None) -> None:
    """A weight gradient by the warp-specialized Gluon kernel (mok.kernels.gluon_wgrad), the
    token rows gathered: gate/up's (out2 given: rows = d_gate_up, out and out2 [E, I, H]) or
    down's (rows = h, out [E, H, I] written transposed, tokens scaled by router_weights)."""
    experts = out.shape[0]
    dtype = _GLUON_DTYPES[tokens.dtype]
    pair = out2 is not None
    kind = "wgrad_gate_up" if pair else "wgrad_down"
    width = rows.shape[1] // 2 if pair else rows.shape[1]  # I
    hidden = tokens.shape[1]
    # the kernel's tile: BLOCK_P along I (its MMA's M), BLOCK_Q along H
    bp, bq = tiles.gluon_sides(kind)
    br = tiles.block_k
    if pair:
        out_desc = _gluon_descriptor(out.view(experts * width, hidden), [bp, bq], dtype)
        out2_desc = _gluon_descriptor(out2.view(experts * width, hidden), [bp, bq], dtype)
    else:
        out_desc = out2_desc = _gluon_descriptor(out.view(experts * hidden, width), [bq, bp],
                                                 dtype)
    num_out = 2 if pair else 1
    num_tiles = experts * tiles.gluon_tiles(kind, hidden=hidden, intermediate=width)
    launch(gluon_wgrad.wgrad_ws_kernel, (min(num_tiles, _num_programs(tokens.device)),))(
        a_desc=_gluon_descriptor(rows, [br, bp], dtype), b_ptr=tokens, out_desc=out_desc,
        out2_desc=out2_desc, row_route_ptr=routing.row_route,
        router_weights_ptr=router_weights if router_weights is not None else rows,
        expert_offsets_ptr=routing.expert_offsets, expert_counts_ptr=routing.expert_counts,
        num_experts=experts, P_OUT=width, Q=hidden, topk=routing.topk,
        num_rows=routing.capacity_rows, stride_bm=tokens.stride(0),
        BLOCK_P=bp, BLOCK_Q=bq, BLOCK_R=br, NUM_STAGES=tiles.num_stages,
        LOAD_WARPS=_GLUON_LOAD_WARPS, LOAD_REGS=_GLUON_WGRAD_LOAD_REGS,
        B_LAYOUT=_nvmma_layout((br, bq), dtype), NUM_OUT=num_out,
        SCALE_B=router_weights is not None, TRANSPOSE_OUT=not pair, num_warps=tiles.num_warps,
    )


# The Gluon weight gradient's loader (cp.async of [block_k, block_n] gathered rows and the next
# step's routes): registers per thread.
_GLUON_WGRAD_LOAD_REGS = 80


def copy_rows(
    src: torch.Tensor,
    routing: Routing,
    *,
    gather: bool,
    router_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """rows [C, width] in schedule order: src[token] (gather; src [T, width]) or src[row] (src
    [C, width]), scaled by the route's router weight (router_weights [T * k]) and rounded to
    src's dtype; 0 on padding rows. Rows past the schedule's used rows are left unwritten."""
    check_router_weights(router_weights, routing)
    check_rows(src, "src")
    _check_read_rows(src, "src", routing, gather=gather)
    width = src.shape[1]
    out = torch.empty(routing.capacity_rows, width, dtype=src.dtype, device=src.device)
    block_m, block_n = 16, min(256, next_power_of_2(max(width, 1)))
    launch(combine_kernels.copy_rows_kernel, (cdiv(routing.capacity_rows, block_m),))(
        src, routing.row_route, router_weights if router_weights is not None else src, out,
        routing.used_rows, width, routing.topk, src.stride(0), out.stride(0),
        GATHER=gather, SCALE=router_weights is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=UPCAST, num_warps=4,
    )
    return out


def grouped_mm_takes(device: torch.device, dtype: torch.dtype, *widths: int) -> bool:
    """Whether torch._grouped_mm takes weight-gradient operands of dtype with rows of `widths`
    elements (WgradTiles.grouped_mm): bf16 on a Hopper or newer GPU (any dtype on CPU), rows
    16-byte aligned."""
    if not arch_of(device).grouped_mm:
        return False
    dtype_ok = device.type == "cpu" or dtype == torch.bfloat16
    return dtype_ok and all((w * dtype.itemsize) % 16 == 0 for w in widths)


def _check_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype or not grouped_mm_takes(a.device, a.dtype, a.shape[1], b.shape[1]):
        raise ValueError("the tiles ask for torch._grouped_mm (WgradTiles.grouped_mm), which "
                         "does not take these operands; mok.plan asks for it only where it does")


def _group_ends(routing: Routing) -> torch.Tensor:
    """[E] int32 on the device: each expert's last row + 1, clamped to the rows in use (a
    capacity overflow leaves the experts' rows past them unscheduled)."""
    return torch.minimum(routing.expert_offsets[1:], routing.used_rows)


def _grouped_mm_wgrad(a_rows: torch.Tensor, b_rows: torch.Tensor, ends: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """out [E, P, Q]: out[e] = a_rows[rows of e]^T b_rows[rows of e] by torch._grouped_mm,
    one K-split group per expert ending at ends[e] (_group_ends): its rows, padding included,
    which are 0 in both operands."""
    out = torch._grouped_mm(a_rows.t(), b_rows, offs=ends)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _launch_wgrad(a, a2, b, out, out2, routing, tiles, *, gather_a, gather_b, router_weights):
    width_p, width_q = a.shape[1], b.shape[1]
    num_tiles = (routing.num_local_experts * cdiv(width_p, tiles.block_m)
                 * cdiv(width_q, tiles.block_n))
    grid = min(num_tiles, _num_programs(a.device)) if tiles.persistent else num_tiles
    launch(gemm_kernels.grouped_wgrad_kernel, (grid,))(
        a_ptr=a, a2_ptr=a2 if a2 is not None else a, b_ptr=b, out_ptr=out,
        out2_ptr=out2 if out2 is not None else out, row_route_ptr=routing.row_route,
        router_weights_ptr=router_weights if router_weights is not None else a,
        expert_counts_ptr=routing.expert_counts, expert_offsets_ptr=routing.expert_offsets,
        P=width_p, Q=width_q, topk=routing.topk, num_rows=routing.capacity_rows,
        num_tiles=num_tiles, stride_am=a.stride(0), stride_bm=b.stride(0),
        **_strides("stride_oe stride_op stride_oq", out),
        GATHER_A=gather_a, SCALE_A=router_weights is not None, GATHER_B=gather_b,
        PAIR=a2 is not None, BLOCK_P=tiles.block_m, BLOCK_Q=tiles.block_n,
        BLOCK_R=tiles.block_k, PERSISTENT=tiles.persistent, UPCAST=UPCAST,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def router_grad(partial: torch.Tensor, routing: Routing) -> torch.Tensor:
    """d_router_weights [T, topk] fp32 from the partial sums of `down_bwd_dswiglu`."""
    check_rows(partial, "partial", dtypes=(torch.float32,))
    num_routes = routing.num_tokens * routing.topk
    out = torch.empty(routing.num_tokens, routing.topk, dtype=torch.float32,
                      device=partial.device)
    if num_routes == 0:
        return out
    block_r, block_p = 64, min(64, next_power_of_2(partial.shape[1]))
    launch(combine_kernels.router_grad_kernel, (cdiv(num_routes, block_r),))(
        partial, routing.route_row, out, num_routes, partial.shape[1], partial.stride(0),
        BLOCK_R=block_r, BLOCK_P=block_p, num_warps=4,
    )
    return out
