"""MoK's functional API: workspace, schedule, forward, backward, recompute.

Code written against MoK's functional API runs unchanged; `group=None` means one GPU.

Legend: T local tokens, H hidden size, I expert intermediate size, I_s shared-expert intermediate
size, E_local local experts, k experts per token (topk), C schedule rows (see mok.ops.Routing).

The layer computes, per token t (DESIGN.md section 1):
    y[t] = shared(x[t]) + sum_j router_weights[t, j] * expert_{topk_experts[t, j]}(x[t])
    mlp(x) = W_down @ swiglu(W_gate @ x, W_up @ x),  swiglu(g, u) = silu(g) * u
with, when swiglu_limit L is given, swiglu(g, u) = silu(min(g, L)) * clamp(u, -L, L).

Data errors (expert ids out of range, schedule capacity overflow) are found on the device without a
host sync; they are raised as MoKDataError by the first mok call that finds the device's check
finished (on CPU: the next call), at once by `check_errors(workspace)`, and at once by
`build_schedule(..., validate=True)` or MOK_VALIDATE=1. Routes affected are left out, never
written out of bounds.

NaN/Inf policy: no checks are made on values. Non-finite values propagate as IEEE arithmetic
says: a non-finite x[t] or router weight of token t makes y[t] (and d_x[t]) non-finite and the
weight gradients of the experts t routes to; other tokens' outputs are unaffected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mok import _env, ops
from mok.errors import (
    ERROR_MESSAGES,
    NUM_ERROR_FLAGS,
    ErrorFlag,
    MoKDataError,
    MoKInputError,
)
from mok.expert_parallel import ExchangePlan, ExpertParallel, Phase

if TYPE_CHECKING:
    from mok.cross_node import CrossNodePlan
from mok.ops import GemmTiles, Routing, TileConfig

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class MoKConfig:
    """Tuning knobs of the fused layer (MoK's names and meaning).

    fwd_num_comm_sms / bwd_num_comm_sms: programs that pull token rows from the other ranks in
        expert parallelism (the first programs of the forward's gate/up and the backward's
        first GEMM launch). Pulls by SM loads need bytes in flight (mok.ops.comm,
        PULL_BYTES_PER_THREAD); with 64 KB a program, 32 programs pull as fast as 64 did and
        leave the GEMM more SMs (two H200: the forward 3.49 -> 3.28 ms at qwen3-30b-a3b, 3.76
        -> 3.57 at kimi-ep64-slice).
    minibatch_size: tokens per ready flag when tokens arrive from peers.
    macrobatch_size: rows of the dispatch ring buffer (MoK's knob, checked, not used: the pull
        buffers hold the group's tokens, each pulled once; docs/history.md, expert parallelism, says
        why a ring does not pay at these sizes).
    schedule_capacity_multiplier: the schedule holds capacity_multiplier * T * k routes (never more
        than can arrive); on one GPU any value >= 1 is dropless. Overflow is an error, never a
        silent drop.
    peer_timeout_s: how long a wait on another rank of the group may last before it is given up
        and reported (MoKDataError naming the rank): a dead peer ends in an error, not a hang.
    recompute_gate_up: the backward recomputes the gate/up projections (True: the forward
        context keeps h only). False keeps the pre-activations [C, 2I] instead, twice h's bytes,
        and the backward's first kernel does one GEMM instead of three (4 of the 22 GEMM FLOPs
        per route that a forward+backward runs) and rebuilds h from them.
    fwd_pull_in_gluon: where the Gluon gate/up kernel takes the forward's routed GEMM under
        expert parallelism, it pulls its rows in a partition of two warps in each of its programs
        while its tiles run (mok.kernels.gluon_comm) instead of after a launch of its own that
        pulls them over every SM. Off by default: on one H200, a rank pulling its own tokens from
        its own memory (benchmarks/ep_local.py), it cost the GEMM more than the separate
        launch at qwen3-30b-a3b and kimi-ep64-slice (less at olmoe-1b-7b); its tiles wait on
        their rows' minibatches, so pair it with a small minibatch_size (16 to 32).
    fwd_copy_rows: under expert parallelism the forward's token rows and router weights move by
        copies of every rank's whole published buffers on a side stream (on a GPU the copy
        engines, which take no SM from the GEMMs), a flag per rank raised as its rows land,
        while the gate/up GEMM runs; its tiles wait on their rows' ranks
        (mok.expert_parallel.ExpertParallel.forward_copy), taking the blocks of local rows first.
        Moves T_max rows a rank where the pull moves those with a route here.
    bwd_copy_rows: the same for the backward's d_output and x rows (ExpertParallel.
        backward_copy), which lets the Gluon dSwiGLU kernel take its first GEMM.
    """

    fwd_num_comm_sms: int = 32
    bwd_num_comm_sms: int = 32
    minibatch_size: int = 128
    macrobatch_size: int = 8192
    schedule_capacity_multiplier: float = 2.0
    peer_timeout_s: float = 60.0
    recompute_gate_up: bool = True
    fwd_pull_in_gluon: bool = False
    fwd_copy_rows: bool = False
    bwd_copy_rows: bool = False

    def __post_init__(self) -> None:
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms", "minibatch_size", "macrobatch_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"MoKConfig.{name} must be positive, got {getattr(self, name)}")
        if self.fwd_copy_rows and self.fwd_pull_in_gluon:
            raise ValueError("MoKConfig.fwd_copy_rows and fwd_pull_in_gluon exclude each "
                             "other")
        if self.macrobatch_size % self.minibatch_size != 0:
            raise ValueError("MoKConfig.macrobatch_size must be a multiple of minibatch_size")
        if not self.schedule_capacity_multiplier > 0:
            raise ValueError("MoKConfig.schedule_capacity_multiplier must be positive")
        if not self.peer_timeout_s > 0:
            raise ValueError("MoKConfig.peer_timeout_s must be positive")


class Workspace:
    """Device state shared by every layer of one shape on one group: error flags, caches.

    Create with `get_workspace` (cached) or `create_workspace`.
    """

    def __init__(
        self,
        config: MoKConfig,
        group: dist.ProcessGroup | None,
        *,
        device: torch.device | str,
        num_local_tokens: int,
        hidden_size: int,
        topk: int,
        ranks_per_node: int | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for name, value in (("num_local_tokens", num_local_tokens),
                            ("hidden_size", hidden_size), ("topk", topk)):
            if int(value) < (0 if name == "num_local_tokens" else 1):
                raise MoKInputError(f"{name} must be positive, got {value}")
        self.config = config
        self.group = group
        self.device = device
        self.num_local_tokens = int(num_local_tokens)
        self.hidden_size = int(hidden_size)
        self.topk = int(topk)
        self.error_flags = torch.zeros(NUM_ERROR_FLAGS, dtype=torch.int32, device=device)
        self.ep: ExpertParallel | None = None
        self.cross_node = None
        self._ghost_expert = False  # set on the one-node workspace inside a cross-node one
        self.ep_size, self.ep_rank = 1, 0
        if group is not None and dist.get_world_size(group) > 1:
            if device.type == "cpu" and not _env.INTERPRET:
                raise MoKInputError("expert parallelism on CPU needs Triton's interpreter")
            from mok import cross_node

            self.ep_size, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
            per_node = ranks_per_node or cross_node.ranks_per_node_of(group)
            if per_node < 1 or self.ep_size % per_node:
                raise MoKInputError(f"ranks_per_node={per_node} does not divide the group of "
                                    f"{self.ep_size} ranks")
            if per_node < self.ep_size:
                self.cross_node = cross_node.CrossNode(
                    config, group, device, num_tokens=self.num_local_tokens,
                    hidden_size=self.hidden_size, topk=self.topk, ranks_per_node=per_node)
            else:
                self.ep = ExpertParallel(group, device, num_tokens=self.num_local_tokens,
                                         hidden_size=self.hidden_size, topk=self.topk,
                                         timeout_s=config.peer_timeout_s)
        pin = device.type == "cuda"
        self._host_flags = torch.zeros(NUM_ERROR_FLAGS, dtype=torch.int32, pin_memory=pin)
        self._flags_event: torch.cuda.Event | None = None
        self._flags_pending = False
        self._dense_routing: dict[tuple[int, int], Routing] = {}

    # -- device-side error flags -------------------------------------------------------------
    def _publish_errors(self) -> None:
        """Start a copy of the error flags to the host; `_poll_errors` reads it once it landed."""
        if self.device.type != "cuda":
            self._host_flags.copy_(self.error_flags)
            self._flags_pending = True
            return
        if torch.cuda.is_current_stream_capturing():
            return
        self._host_flags.copy_(self.error_flags, non_blocking=True)
        if self._flags_event is None:
            self._flags_event = torch.cuda.Event()
        self._flags_event.record()
        self._flags_pending = True

    def _poll_errors(self) -> None:
        """Raise the errors of an earlier call whose flag copy has landed; never waits."""
        if not self._flags_pending:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        if self._flags_event is not None and not self._flags_event.query():
            return
        self._flags_pending = False
        self._raise_if_set(self._host_flags.tolist())  # host memory: no device sync

    def check_errors(self) -> None:
        """Synchronize with the device and raise MoKDataError if any data error was flagged."""
        self._flags_pending = False
        self._raise_if_set(self.error_flags.tolist())
        if self.cross_node is not None:
            self.cross_node.inner.check_errors()

    def _raise_if_set(self, flags: list[int]) -> None:
        raised = [ErrorFlag(i) for i, value in enumerate(flags)
                  if value and i in ErrorFlag._value2member_map_]
        if not raised:
            return
        self.error_flags.zero_()
        self._host_flags.zero_()
        details = "; ".join(f"{flag.name}: {ERROR_MESSAGES[flag]}" for flag in raised)
        if ErrorFlag.PEER_TIMEOUT in raised:
            peer = flags[ErrorFlag.PEER_TIMEOUT + 1] - 1
            who = f"rank {peer}" if peer >= 0 else "this rank's own pull"
            details += f" (rank {self.ep_rank} waited on {who})"
        raise MoKDataError(f"mok found invalid data on the device: {details}")

    def dense_routing(self, num_tokens: int, align: int) -> Routing:
        key = (num_tokens, align)
        if key not in self._dense_routing:
            self._dense_routing[key] = ops.dense_routing(num_tokens, align, self.device)
        return self._dense_routing[key]

    def __repr__(self) -> str:
        return (f"Workspace(device={self.device}, ep_size={self.ep_size}, "
                f"num_local_tokens={self.num_local_tokens}, hidden_size={self.hidden_size}, "
                f"topk={self.topk})")


_WORKSPACES: dict[tuple, Workspace] = {}


def create_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    ranks_per_node: int | None = None,
) -> Workspace:
    """A new workspace (not cached). num_local_tokens: the most tokens a schedule may hold.

    ranks_per_node: with a group spanning nodes, its ranks per node (default: found from the
    host names; the ranks must be numbered node by node, as torchrun does).
    """
    return Workspace(config, group, device=device, num_local_tokens=num_local_tokens,
                     hidden_size=hidden_size, topk=topk, ranks_per_node=ranks_per_node)


def get_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    ranks_per_node: int | None = None,
) -> Workspace:
    """The workspace for these arguments, created on first use and cached."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (config, id(group) if group is not None else None, str(device), int(num_local_tokens),
           int(hidden_size), int(topk), ranks_per_node)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = create_workspace(
            config, group, device=device, num_local_tokens=num_local_tokens,
            hidden_size=hidden_size, topk=topk, ranks_per_node=ranks_per_node)
    return _WORKSPACES[key]


def check_errors(workspace: Workspace) -> None:
    """Synchronize and raise MoKDataError for any data error flagged so far on this workspace."""
    workspace.check_errors()


@dataclass(frozen=True)
class Schedule:
    """Routing of one batch: expert-ordered rows of the routed experts and of the shared expert.

    expert_counts [E_local] int32 (device): tokens routed to each local expert, no host sync.
    """

    routing: Routing
    shared_routing: Routing
    tiles: TileConfig
    num_experts: int
    workspace: Workspace = field(repr=False)
    exchange: ExchangePlan | CrossNodePlan | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.shared_routing.num_tokens

    @property
    def num_local_experts(self) -> int:
        return self.routing.num_local_experts

    @property
    def expert_counts(self) -> torch.Tensor:
        return self.routing.expert_counts

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The device tensors of the routing (to carry a schedule through autograd or a graph)."""
        r = self.routing
        return (r.row_route, r.route_row, r.block_expert, r.expert_counts, r.expert_offsets)

    @classmethod
    def from_tensors(
        cls,
        workspace: Workspace,
        tensors: tuple[torch.Tensor, ...],
        *,
        num_tokens: int,
        num_local_experts: int,
        tiles: TileConfig | None = None,
    ) -> Schedule:
        """Rebuild a schedule from `Schedule.tensors()` (no kernel runs; one GPU only)."""
        if workspace.ep is not None:
            raise NotImplementedError("Schedule.from_tensors with expert parallelism")
        tiles = tiles or ops.default_tiles(workspace.device)
        routing = Routing(*tensors, num_tokens=num_tokens, topk=workspace.topk,
                          num_local_experts=num_local_experts, align=tiles.align)
        return cls(routing, workspace.dense_routing(num_tokens, tiles.align), tiles,
                   num_local_experts * workspace.ep_size, workspace)


@dataclass(frozen=True)
class ForwardContext:
    """What the backward needs beyond the inputs: the SwiGLU outputs, or with
    MoKConfig(recompute_gate_up=False) the pre-activations instead.

    h        [C, I] or None: routed experts' SwiGLU output, in schedule row order (x.dtype).
    h_shared [T_pad, I_s] or None: the shared expert's SwiGLU output (None without one).
    gate_up, gate_up_shared [C, 2I], [T_pad, 2 I_s] or None: the pre-activations [gate, up] of
        the routed and shared experts, kept (in place of h, h_shared: the backward rebuilds
        those from them) when the config does not recompute them (across nodes the shared
        expert keeps h_shared and recomputes).
    weights_group [P * T_max * k] fp32 (expert parallelism only): the router weights of the
        group's routes, pulled with their tokens (those of the routes scheduled here; by route,
        as the schedule's rows read them). The pulled token rows are not kept: the backward
        pulls them again with d_output.
    inner (expert parallelism across nodes): the one-node context of the tokens gathered from
        the other nodes.
    Without gate_up, the gate/up projections are recomputed inside the backward kernel; expert
    outputs are never kept (the router-weight gradient is computed from h).
    """

    h: torch.Tensor | None
    h_shared: torch.Tensor | None
    weights_group: torch.Tensor | None = None
    inner: ForwardContext | None = None
    gate_up: torch.Tensor | None = None
    gate_up_shared: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        parts = (self.h, self.h_shared, self.weights_group, self.gate_up, self.gate_up_shared)
        own = sum(t.numel() * t.element_size() for t in parts if t is not None)
        return own + (self.inner.nbytes if self.inner is not None else 0)

    def kept_for_backward(self) -> ForwardContext:
        """This context without the h that kept pre-activations make redundant (what the
        forward returns; it needed h itself for the down projection)."""
        return replace(
            self, h=None if self.gate_up is not None else self.h,
            h_shared=None if self.gate_up_shared is not None else self.h_shared)


# -- input checks (host-known facts only; never reads device values) ---------------------------

def _check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise MoKInputError(f"{name} is on {tensor.device}, the workspace on {device}")
    if device.type == "cpu" and not _env.INTERPRET:
        raise MoKInputError(
            "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing mok")


def _check_tensor(name, tensor, shape, dtypes, device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise MoKInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise MoKInputError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise MoKInputError(f"{name} has dtype {tensor.dtype}, expected one of {names}")
    _check_device(name, tensor, device)


def _check_size(name: str, value: int) -> None:
    if value < 8 or value % 8 != 0:
        raise MoKInputError(f"{name}={value} must be a positive multiple of 8 (16-byte rows)")


def _check_weights(
    schedule: Schedule,
    x: torch.Tensor,
    shared: tuple[torch.Tensor | None, ...],
    routed: tuple[torch.Tensor, ...],
    *,
    need_down: bool = True,
) -> None:
    workspace = schedule.workspace
    hidden = workspace.hidden_size
    _check_tensor("x", x, (schedule.num_tokens, hidden), SUPPORTED_DTYPES, workspace.device)
    _check_size("hidden_size", hidden)
    w_gate = routed[0]
    if not isinstance(w_gate, torch.Tensor) or w_gate.dim() != 3:
        raise MoKInputError("w_routed_gate must be a 3-d tensor [E_local, I, H]")
    num_local, intermediate = w_gate.shape[0], w_gate.shape[1]
    if num_local != schedule.num_local_experts:
        raise MoKInputError(f"w_routed_gate holds {num_local} experts, the schedule "
                            f"{schedule.num_local_experts} local experts")
    _check_size("intermediate_size", intermediate)
    shapes = {"w_routed_gate": (num_local, intermediate, hidden),
              "w_routed_up": (num_local, intermediate, hidden),
              "w_routed_down": (num_local, hidden, intermediate)}
    num_checked = 3 if need_down else 2
    for (name, shape), tensor in list(zip(shapes.items(), routed, strict=True))[:num_checked]:
        _check_tensor(name, tensor, shape, (x.dtype,), workspace.device)
    present = [w is not None for w in shared[:num_checked]]
    if any(present) and not all(present):
        raise MoKInputError("the shared-expert weights must be all given or all None")
    if all(present):
        shared_size = shared[0].shape[0] if shared[0].dim() == 2 else -1
        _check_size("shared intermediate size", shared_size)
        shapes = {"w_shared_gate": (shared_size, hidden), "w_shared_up": (shared_size, hidden),
                  "w_shared_down": (hidden, shared_size)}
        for (name, shape), tensor in list(zip(shapes.items(), shared, strict=True))[:num_checked]:
            _check_tensor(name, tensor, shape, (x.dtype,), workspace.device)


def _check_router_weights(schedule: Schedule, router_weights: torch.Tensor) -> None:
    _check_tensor("router_weights", router_weights,
                  (schedule.num_tokens, schedule.workspace.topk), (torch.float32,),
                  schedule.workspace.device)


def _rowmajor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _check_schedule(workspace: Workspace, schedule: Schedule) -> None:
    if not isinstance(schedule, Schedule):
        raise MoKInputError("schedule must come from mok.functional.build_schedule")
    if schedule.workspace is not workspace:
        raise MoKInputError("the schedule was built on another workspace")


# -- the API -----------------------------------------------------------------------------------

def build_schedule(
    workspace: Workspace,
    config: MoKConfig,
    topk_experts: torch.Tensor,
    *,
    num_local_experts: int,
    tiles: TileConfig | None = None,
    validate: bool | None = None,
) -> Schedule:
    """Expert-ordered routing of `topk_experts` [T, k] (int32/int64, global expert ids), built on
    the device without host sync.

    num_local_experts: experts on this rank (E_local); E = E_local * EP size.
    tiles: GEMM tiles (default: per device type); their `align` pads each expert's rows.
    validate: synchronize and raise at once on invalid data (default: MOK_VALIDATE).
    """
    workspace._poll_errors()
    if not isinstance(topk_experts, torch.Tensor) or topk_experts.dim() != 2:
        raise MoKInputError("topk_experts must be a 2-d tensor [num_tokens, topk]")
    num_tokens, topk = topk_experts.shape
    _check_tensor("topk_experts", topk_experts, (num_tokens, workspace.topk), INDEX_DTYPES,
                  workspace.device)
    if num_tokens > workspace.num_local_tokens:
        raise MoKInputError(f"{num_tokens} tokens exceed the workspace's num_local_tokens="
                            f"{workspace.num_local_tokens}")
    if int(num_local_experts) < 1:
        raise MoKInputError(f"num_local_experts must be positive, got {num_local_experts}")
    tiles = tiles or ops.default_tiles(workspace.device)
    num_routes = num_tokens * topk
    route_capacity = min(num_routes * workspace.ep_size,
                         math.ceil(config.schedule_capacity_multiplier * num_routes))
    exchange = None
    if workspace.cross_node is not None:
        schedule = workspace.cross_node.build_schedule(
            workspace, config, topk_experts, num_local_experts=int(num_local_experts),
            tiles=tiles)
        workspace._publish_errors()
        if validate or (validate is None and _env.VALIDATE):
            workspace.check_errors()
        return schedule
    ghost = int(workspace._ghost_expert)
    if workspace.ep is not None:
        exchange = workspace.ep.build_plan(
            workspace.ep.peer_flags(workspace.error_flags), topk_experts,
            num_local_experts=int(num_local_experts), align=tiles.align,
            route_capacity=route_capacity, ghost_expert=bool(ghost),
            pulls=not (config.fwd_copy_rows and config.bwd_copy_rows))
        routing = exchange.group_routing
    else:
        routing = ops.build_routing(
            topk_experts, workspace.error_flags, num_experts=int(num_local_experts) + ghost,
            first_local_expert=0, num_local_experts=int(num_local_experts), align=tiles.align,
            route_capacity=route_capacity,
        )
    workspace._publish_errors()
    if validate or (validate is None and _env.VALIDATE):
        workspace.check_errors()
    return Schedule(routing, workspace.dense_routing(num_tokens, tiles.align), tiles,
                    num_local_experts * workspace.ep_size, workspace, exchange)


def _gate_up(config, schedule, x, router_weights, w_shared_gate, w_shared_up, w_routed_gate,
             w_routed_up, swiglu_limit):
    """The gate/up GEMMs; with expert parallelism the routed one pulls its rows (and router
    weights) from their ranks in its own launch (fwd_copy_rows: they come by copies beside it).
    The shared expert goes first: it needs no remote rows, and the other ranks have time to
    publish theirs."""
    hidden, intermediate = x.shape[1], w_routed_gate.shape[1]
    keep = not config.recompute_gate_up

    def pick(n: int) -> GemmTiles:  # storing the pre-activations has tiles of its own
        return schedule.tiles.pick("gate_up_saved" if keep else "gate_up", n, hidden)

    h_shared = gate_up_shared = None
    if w_shared_gate is not None:
        shared_routing = schedule.shared_routing
        gate_up_shared = ops.gate_up_buffer(x, w_shared_gate[None], shared_routing) if keep \
            else None
        h_shared = ops.gate_up_swiglu(x, w_shared_gate[None], w_shared_up[None], shared_routing,
                                      pick(w_shared_gate.shape[0]),
                                      swiglu_limit, gate_up=gate_up_shared)
    ep = schedule.workspace.ep
    gate_up = ops.gate_up_buffer(x, w_routed_gate, schedule.routing) if keep else None
    if ep is None:
        h = ops.gate_up_swiglu(x, w_routed_gate, w_routed_up, schedule.routing,
                               pick(intermediate), swiglu_limit,
                               gate_up=gate_up)
        return ForwardContext(h, h_shared, gate_up=gate_up, gate_up_shared=gate_up_shared)
    peer = ep.peer_flags(schedule.workspace.error_flags)
    if config.fwd_copy_rows:
        x_group, weights_group, pull = ep.forward_copy(peer, schedule.exchange, x,
                                                       router_weights,
                                                       block_m=pick(intermediate).block_m)
    else:
        x_group, weights_group, pull = ep.forward_pull(
            peer, schedule.exchange, x, router_weights, minibatch=config.minibatch_size,
            num_programs=config.fwd_num_comm_sms, in_gluon=config.fwd_pull_in_gluon)
    h = ops.gate_up_swiglu(x_group, w_routed_gate, w_routed_up, schedule.routing,
                           pick(intermediate), swiglu_limit, pull=pull,
                           gate_up=gate_up)
    ep.copies_joined()
    ep.pulled(peer, Phase.FORWARD)
    return ForwardContext(h, h_shared, weights_group=weights_group, gate_up=gate_up,
                          gate_up_shared=gate_up_shared)


def forward(
    config: MoKConfig,
    workspace: Workspace,
    schedule: Schedule,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    w_shared_gate: torch.Tensor | None,
    w_shared_up: torch.Tensor | None,
    w_shared_down: torch.Tensor | None,
    w_routed_gate: torch.Tensor,
    w_routed_up: torch.Tensor,
    w_routed_down: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
) -> tuple[torch.Tensor, ForwardContext]:
    """The MoE layer's forward.

    x [T, H] bf16/fp16; router_weights [T, k] fp32; w_shared_gate, w_shared_up [I_s, H] and
    w_shared_down [H, I_s] or all None; w_routed_gate, w_routed_up [E_local, I, H];
    w_routed_down [E_local, H, I]; weights in x's dtype. Returns (y [T, H] in x's dtype, context).
    """
    workspace._poll_errors()
    _check_schedule(workspace, schedule)
    shared = (w_shared_gate, w_shared_up, w_shared_down)
    routed = (w_routed_gate, w_routed_up, w_routed_down)
    _check_weights(schedule, x, shared, routed)
    _check_router_weights(schedule, router_weights)
    x = _rowmajor(x)
    router_weights = router_weights.contiguous()
    if workspace.cross_node is not None:
        return workspace.cross_node.forward(config, schedule, x, router_weights, shared, routed,
                                            swiglu_limit)
    context = _gate_up(config, schedule, x, router_weights, w_shared_gate, w_shared_up,
                       w_routed_gate, w_routed_up, swiglu_limit)
    pick = schedule.tiles.pick
    hidden = x.shape[1]
    ep = workspace.ep
    # with expert parallelism the Gluon kernel scatters its rows too (mok.kernels.gluon_rows)
    down_tiles = pick("down", hidden, w_routed_down.shape[2])
    if ep is None:
        rows = ops.down_proj(context.h, w_routed_down, schedule.routing, down_tiles,
                             router_weights)
        combine_routing = schedule.routing
    else:  # each weighted row lands in its token's rank's combine buffer
        rows = ops.down_proj(context.h, w_routed_down, schedule.routing, down_tiles,
                             context.weights_group, scatter=ep.scatter_rows(schedule.exchange,
                                                                           x.dtype))
        combine_routing = schedule.exchange.source_routing
    shared_rows = None
    if w_shared_down is not None:
        shared_rows = ops.down_proj(context.h_shared, w_shared_down[None],
                                    schedule.shared_routing,
                                    pick("down", hidden, w_shared_down.shape[1]), None)
    if ep is not None:
        peer = ep.peer_flags(workspace.error_flags)
        ep.clear_dropped(peer, schedule.exchange, rows_dtype=x.dtype)
        ep.finish(peer, Phase.FORWARD)
    y = ops.combine(rows, combine_routing, shared_rows, x.dtype)
    return y, context.kept_for_backward()


def recompute_forward_context(
    config: MoKConfig,
    workspace: Workspace,
    schedule: Schedule,
    x: torch.Tensor,
    w_shared_gate: torch.Tensor | None,
    w_shared_up: torch.Tensor | None,
    w_routed_gate: torch.Tensor,
    w_routed_up: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    router_weights: torch.Tensor | None = None,
) -> ForwardContext:
    """Rebuild the forward context (for activation checkpointing): the gate/up GEMMs only.

    router_weights [T, k] fp32: needed with expert parallelism only, where the experts' ranks
    pull them again with the token rows (every rank of the group recomputes, like the forward).
    """
    workspace._poll_errors()
    _check_schedule(workspace, schedule)
    _check_weights(schedule, x, (w_shared_gate, w_shared_up, None),
                   (w_routed_gate, w_routed_up, None), need_down=False)
    x = _rowmajor(x)
    if workspace.ep is None and workspace.cross_node is None:
        return _gate_up(config, schedule, x, None, w_shared_gate, w_shared_up, w_routed_gate,
                        w_routed_up, swiglu_limit).kept_for_backward()
    if router_weights is None:
        raise MoKInputError("with expert parallelism, recompute_forward_context needs "
                            "router_weights= (the experts' ranks pull them with the rows)")
    _check_router_weights(schedule, router_weights)
    router_weights = router_weights.contiguous()
    if workspace.cross_node is not None:
        return workspace.cross_node.recompute(config, schedule, x, router_weights,
                                              (w_shared_gate, w_shared_up),
                                              (w_routed_gate, w_routed_up), swiglu_limit)
    return _gate_up(config, schedule, x, router_weights, w_shared_gate, w_shared_up,
                    w_routed_gate, w_routed_up, swiglu_limit).kept_for_backward()


def _down_bwd_kind(gate_up: torch.Tensor | None) -> str:
    return "down_bwd" if gate_up is None else "down_bwd_saved"


def _check_context_rows(h, gate_up, routing, intermediate, suffix) -> None:
    """The context holds h or the pre-activations, with this schedule's rows."""
    if h is None and gate_up is None:
        raise MoKInputError(f"the forward context holds neither h{suffix} nor gate_up{suffix}")
    for name, tensor, width in ((f"h{suffix}", h, intermediate),
                                (f"gate_up{suffix}", gate_up, 2 * intermediate)):
        if tensor is not None and tuple(tensor.shape) != (routing.capacity_rows, width):
            raise MoKInputError(f"forward context {name} has shape {tuple(tensor.shape)}, this "
                                f"schedule and these weights need {(routing.capacity_rows, width)}"
                                ": it was made for another schedule")


def _h_for_backward(h, gate_up, routing, intermediate) -> tuple[torch.Tensor, bool]:
    """(h, whether the backward's first kernel writes it): a context with kept pre-activations
    holds no h; that kernel rebuilds it from them for the down projection's weight gradient."""
    if h is not None:
        return h, False
    return torch.empty(routing.capacity_rows, intermediate, dtype=gate_up.dtype,
                       device=gate_up.device), True


def _expert_input_grads(tiles, routing, d_output, x, h, router_weights, w_gate, w_up, w_down,
                        swiglu_limit, gate_up=None):
    """The first half of one group of experts' backward: (d_x rows, d_router_weights or None,
    what `_expert_weight_grads` needs)."""
    hidden, intermediate = x.shape[1], w_gate.shape[1]
    pick = tiles.pick
    down_bwd_tiles = pick(_down_bwd_kind(gate_up), intermediate, hidden)
    if down_bwd_tiles.apart and gate_up is None:  # gate/up recomputed in a launch of its own
        d_gate_up, partial = ops.dswiglu_apart(
            d_output, x, w_down, w_gate, w_up, routing, *tiles.pick_apart(intermediate, hidden),
            router_weights, swiglu_limit)
    else:
        h_used, h_out = _h_for_backward(h, gate_up, routing, intermediate)
        d_gate_up, partial = ops.down_bwd_dswiglu(
            d_output, x, w_down, w_gate, w_up, h_used, routing, down_bwd_tiles, router_weights,
            swiglu_limit, gate_up=gate_up, h_out=h_out)
        h = h_used
    d_router_weights = ops.router_grad(partial, routing) if partial is not None else None
    d_x_rows = ops.d_x_rows(d_gate_up, w_gate, w_up, routing, pick("d_x", hidden, intermediate))
    return d_x_rows, d_router_weights, [d_gate_up, h]


def _expert_weight_grads(tiles, routing, d_output, x, saved, router_weights, w_gate, w_down):
    """The second half: (d_w_gate, d_w_up, d_w_down), from `_expert_input_grads`'s `saved`
    (emptied: d_gate_up [C, 2I] is freed before d_w_down is allocated)."""
    hidden, intermediate = x.shape[1], w_gate.shape[1]
    pick = tiles.pick
    d_gate_up, h = saved
    saved.clear()
    d_w_gate, d_w_up = ops.grouped_wgrad_gate_up(
        d_gate_up, x, routing, pick("wgrad_gate_up", intermediate, hidden), gather_x=True,
        out_dtype=w_gate.dtype)
    del d_gate_up
    d_w_down = ops.grouped_wgrad(d_output, h, routing, pick("wgrad_down", hidden, intermediate),
                                 gather_a=True, gather_b=False, router_weights=router_weights,
                                 out_dtype=w_down.dtype)
    return d_w_gate, d_w_up, d_w_down


def _expert_backward(tiles, routing, d_output, x, h, router_weights, w_gate, w_up, w_down,
                     swiglu_limit, gate_up=None):
    """Backward of one group of experts: (d_x rows, d_router_weights or None, weight grads)."""
    d_x_rows, d_router_weights, saved = _expert_input_grads(
        tiles, routing, d_output, x, h, router_weights, w_gate, w_up, w_down, swiglu_limit,
        gate_up)
    return d_x_rows, d_router_weights, _expert_weight_grads(
        tiles, routing, d_output, x, saved, router_weights, w_gate, w_down)


def backward(
    config: MoKConfig,
    workspace: Workspace,
    schedule: Schedule,
    forward_context: ForwardContext,
    d_output: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    w_shared_gate: torch.Tensor | None,
    w_shared_up: torch.Tensor | None,
    w_shared_down: torch.Tensor | None,
    w_routed_gate: torch.Tensor,
    w_routed_up: torch.Tensor,
    w_routed_down: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """The MoE layer's backward, from d_output [T, H] (x's dtype).

    Returns (d_x [T, H], d_router_weights [T, k] fp32, d_w_routed_gate, d_w_routed_up,
    d_w_routed_down, d_w_shared_gate, d_w_shared_up, d_w_shared_down), each weight gradient in
    its weight's shape and dtype; the shared ones are None without a shared expert.
    """
    workspace._poll_errors()
    _check_schedule(workspace, schedule)
    shared = (w_shared_gate, w_shared_up, w_shared_down)
    routed = (w_routed_gate, w_routed_up, w_routed_down)
    _check_weights(schedule, x, shared, routed)
    _check_router_weights(schedule, router_weights)
    _check_tensor("d_output", d_output, tuple(x.shape), (x.dtype,), workspace.device)
    if not isinstance(forward_context, ForwardContext):
        raise MoKInputError("forward_context must come from forward or recompute_forward_context")
    context_shared = (forward_context.h_shared is not None
                      or forward_context.gate_up_shared is not None)
    if context_shared != (w_shared_gate is not None):
        raise MoKInputError("the forward context and the shared-expert weights disagree")
    x, d_output = _rowmajor(x), _rowmajor(d_output)
    router_weights = router_weights.contiguous()
    if workspace.cross_node is not None:
        if forward_context.inner is None:
            raise MoKInputError("the forward context was made for another workspace")
        return workspace.cross_node.backward(config, schedule, forward_context, d_output, x,
                                             router_weights, shared, routed, swiglu_limit)
    if (forward_context.weights_group is None) != (workspace.ep is None):
        raise MoKInputError("the forward context was made for another workspace")
    _check_context_rows(forward_context.h, forward_context.gate_up, schedule.routing,
                        w_routed_gate.shape[1], "")
    if w_shared_gate is not None:
        _check_context_rows(forward_context.h_shared, forward_context.gate_up_shared,
                            schedule.shared_routing, w_shared_gate.shape[0], "_shared")
    d_shared = (None, None, None)
    d_x_shared_rows = None
    if w_shared_gate is not None:  # first: with expert parallelism it overlaps the pulls
        d_x_shared_rows, _, d_shared = _expert_backward(
            schedule.tiles, schedule.shared_routing, d_output, x, forward_context.h_shared, None,
            w_shared_gate[None], w_shared_up[None], w_shared_down[None], swiglu_limit,
            gate_up=forward_context.gate_up_shared)
        d_shared = tuple(grad[0] for grad in d_shared)
    if workspace.ep is None:
        d_x_rows, d_router_weights, saved = _expert_input_grads(
            schedule.tiles, schedule.routing, d_output, x, forward_context.h, router_weights,
            w_routed_gate, w_routed_up, w_routed_down, swiglu_limit,
            gate_up=forward_context.gate_up)
        d_x = ops.combine(d_x_rows, schedule.routing, d_x_shared_rows, x.dtype)
        # The d_x rows ([C, H], the backward's largest buffer) are freed before the weight
        # gradients are allocated: the step's peak holds one or the other, not both.
        del d_x_rows, d_x_shared_rows
        d_routed = _expert_weight_grads(schedule.tiles, schedule.routing, d_output, x, saved,
                                        router_weights, w_routed_gate, w_routed_down)
    else:
        d_x, d_router_weights, d_routed = _expert_parallel_backward(
            config, schedule, forward_context, d_output, x, d_x_shared_rows,
            w_routed_gate, w_routed_up, w_routed_down, swiglu_limit)
    return (d_x, d_router_weights, *d_routed, *d_shared)


def _expert_parallel_backward(config, schedule, context, d_output, x, d_x_shared_rows, w_gate,
                              w_up, w_down, swiglu_limit):
    """The routed experts' backward when the token rows live on their tokens' ranks: pull d_output
    and x of the group's tokens in the first GEMM's launch (x in d_x's launch when the forward
    kept the pre-activations: only the weight gradients read it then), send d_x rows and
    router-weight gradients back, keep the weight gradients."""
    workspace, plan = schedule.workspace, schedule.exchange
    ep = workspace.ep
    peer = ep.peer_flags(workspace.error_flags)
    dtype = d_output.dtype
    hidden, intermediate = d_output.shape[1], w_gate.shape[1]
    pick = schedule.tiles.pick
    routing = schedule.routing
    kept = context.gate_up is not None  # x is read by the weight gradients alone
    down_bwd_kind = _down_bwd_kind(context.gate_up)
    down_bwd_tiles = pick(down_bwd_kind, intermediate, hidden)
    # With GemmTiles.apart gate/up recomputes in a launch of its own first: the launch that
    # waits on the rows (copied: its row blocks local first; pulled: it pulls x's and
    # d_output's), the kept dSwiGLU after it (the Gluon kernel where the table says so).
    apart_tiles = (schedule.tiles.pick_apart(intermediate, hidden,
                                             pulling=not config.bwd_copy_rows)
                   if down_bwd_tiles.apart and not kept else None)
    if config.bwd_copy_rows:
        # The rows come by copies beside the first launch, which waits on them: the Gluon
        # kernel where the table says so.
        first_tiles = apart_tiles[0] if apart_tiles is not None else down_bwd_tiles
        dy_group, x_group, pull = ep.backward_copy(peer, plan, d_output, x,
                                                   block_m=first_tiles.block_m, kept=kept)
        x_pull = None
    else:
        # The first launch pulls rows its tiles wait on: the Triton kernel runs it, on the
        # table's Triton tiles.
        if apart_tiles is None:
            down_bwd_tiles = pick(down_bwd_kind, intermediate, hidden, triton=True)
        dy_group, x_group, pull, x_pull = ep.backward_pull(
            peer, plan, d_output, x, minibatch=config.minibatch_size,
            num_programs=config.bwd_num_comm_sms, defer_x=kept,
            x_first=apart_tiles is not None)
    h, h_out = _h_for_backward(context.h, context.gate_up, routing, intermediate)
    # d_x scatters its rows (and with kept pre-activations, unless they were copied, pulls x for
    # the weight gradients, no tile waiting on it): the Gluon kernel where the table says so.
    if apart_tiles is not None:
        d_gate_up, partial = ops.dswiglu_apart(
            dy_group, x_group, w_down, w_gate, w_up, routing, *apart_tiles,
            context.weights_group, swiglu_limit, pull=pull)
    else:
        d_gate_up, partial = ops.down_bwd_dswiglu(
            dy_group, x_group, w_down, w_gate, w_up, h, routing, down_bwd_tiles,
            context.weights_group, swiglu_limit, pull=pull, gate_up=context.gate_up,
            h_out=h_out)
    # Router-weight gradients by route of the group, each sent to its token's rank.
    by_route = ops.router_grad(partial, routing)
    ops.scatter_route_values(by_route.reshape(-1), routing.route_row, ep.d_weights,
                             ep.buffer.deltas(torch.float32), plan.routes_per_rank)
    ops.d_x_rows(d_gate_up, w_gate, w_up, routing,
                 pick("d_x", hidden, intermediate),
                 scatter=ep.scatter_rows(plan, dtype), pull=x_pull,
                 pulled=x_group if x_pull is not None else None)
    ep.copies_joined()
    ep.pulled(peer, Phase.BACKWARD)  # after every pull (or copy) of the phase
    ep.clear_dropped(peer, plan, rows_dtype=dtype, values=True)
    ep.signal_done(peer, Phase.BACKWARD)
    # The weight gradients as on one GPU, over the pulled tokens of the group.
    saved = [d_gate_up, h]
    del d_gate_up  # freed inside, before d_w_down is allocated
    d_routed = _expert_weight_grads(schedule.tiles, routing, dy_group, x_group, saved,
                                    context.weights_group, w_gate, w_down)
    del dy_group, x_group
    ep.finish(peer, Phase.BACKWARD, signal=False)
    source = plan.source_routing
    d_x = ops.combine(ep.combine_buffer(dtype), source, d_x_shared_rows, dtype)
    valid = (source.route_row >= 0).view(source.num_tokens, source.topk)
    received = ep.d_weights[:source.num_tokens * source.topk].view(valid.shape)
    d_router_weights = torch.where(valid, received, 0.0)
    return d_x, d_router_weights, d_routed
