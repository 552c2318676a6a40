"""MoK's functional API: workspace, schedule, forward, backward, recompute.

Code written against MoK's functional API runs unchanged; `group=None` means one GPU.

A call reads as the data flows: schedule -> rows in -> gate/up -> down -> rows out -> combine. The
workspace's exchange (mok.exchange: one GPU, a node, nodes) moves the rows and owns the order of
its phases; mok.plan picks the tiles of every GEMM; mok.ops launches the kernels.

Legend: T local tokens, H hidden size, I expert intermediate size, I_s shared-expert intermediate
size, E_local local experts, k experts per token (topk), C schedule rows (see mok.ops.Routing).

The layer computes, per token t (docs/design.md section 1):
    y[t] = shared(x[t]) + sum_j router_weights[t, j] * expert_{topk_experts[t, j]}(x[t])
    mlp(x) = W_down @ swiglu(W_gate @ x, W_up @ x),  swiglu(g, u) = silu(g) * u
with, when swiglu_limit L is given, swiglu(g, u) = silu(min(g, L)) * clamp(u, -L, L).

Data errors (expert ids out of range, schedule capacity overflow) are found on the device without a
host sync; they are raised as MoKDataError by the first mok call that finds the device's check
finished (on CPU: the next call; the check starts once the forward has launched its kernels), at
once by `check_errors(workspace)`, and at once by `build_schedule(..., validate=True)` or
MOK_VALIDATE=1. Routes affected are left out, never written out of bounds.

NaN/Inf policy: no checks are made on values. Non-finite values propagate as IEEE arithmetic
says: a non-finite x[t] or router weight of token t makes y[t] (and d_x[t]) non-finite and the
weight gradients of the experts t routes to; other tokens' outputs are unaffected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

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
from mok.exchange import BackwardRows, Exchange, Movement, Phase, create_exchange
from mok.ops import Routing, TileConfig
from mok.plan import (
    BackwardPlan,
    ForwardPlan,
    Fp8Plan,
    Operands,
    backward_plan,
    forward_plan,
    fp8_plan,
)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
PRECISIONS = ("bf16", "fp8")
# backward's swiglu_limit when not given: the forward context's
FROM_CONTEXT = object()
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
    macrobatch_size: under expert parallelism, None (the default): the symmetric buffer holds
        every token a rank may pass (the workspace's num_local_tokens: x, d_output and the rows
        delivered back, k a token); M (a multiple of minibatch_size): it holds a ring of two
        windows of M tokens a rank instead, whatever num_local_tokens is, and a call moves its
        tokens window by window (mok.exchange.symmetric). Read when the workspace is created.
        The GEMMs and their results are those without the ring, bitwise; the rows are pulled
        before the first GEMM rather than during it, and delivered back after the last.
    schedule_capacity_multiplier: the schedule holds capacity_multiplier * T * k routes (never more
        than can arrive); on one GPU any value >= 1 is dropless. Overflow is an error, never a
        silent drop.
    peer_timeout_s: how long a wait on another rank of the group may last before it is given up
        and reported (MoKDataError naming the rank): a dead peer ends in an error, not a hang.
    recompute_gate_up: False (the default) keeps the gate/up pre-activations [C, 2I] for the
        backward, whose first kernel then does one GEMM instead of three (4 of the 22 GEMM
        FLOPs per route that a forward+backward runs), rebuilds h from them and writes their
        gradients over them. True keeps h [C, I] only, half the bytes, and the backward
        recomputes the gate/up projections: slower, for less activation memory
        (docs/design.md, section 3.2).
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
        (mok.exchange.SymmetricExchange.forward_copy), taking the blocks of local rows first.
        Moves T_max rows a rank where the pull moves those with a route here.
    bwd_copy_rows: the same for the backward's d_output and x rows (SymmetricExchange.
        backward_copy), which lets the Gluon dSwiGLU kernel take its first GEMM.
    precision: "bf16", every GEMM in the inputs' dtype (bf16 or fp16); or "fp8", the row GEMMs
        (gate/up, down, and the backward's input gradients) on float8_e4m3fn operands with a
        scale per 1 x 128 block of a row and per 128 x 128 block of a weight, summed in fp32
        (mok.ops.fp8), the weights quantized once per version (mok.ops.
        cached_quantize_experts); the weight gradients, the router-weight gradient and the
        combine as with "bf16".
        Under expert parallelism it pulls the rows in launches of their own (the forward's in
        e4m3, the backward's in x's dtype) rather than copying them (fwd_copy_rows,
        bwd_copy_rows) or pulling them inside the GEMMs.
    fp8_weight_gradients: with precision "fp8", the weight gradients on e4m3 operands too: each
        operand quantized along the rows, a scale per column and block of 128 of an expert's
        rows (DeepSeek's recipe for them; mok.ops.fp8_wgrad), in a launch of its own before each
        GEMM, the sums in fp32. d_gate_up, d_output and x are quantized so from their e4m3 rows
        with 1 x 128 scales (dequantized first), h from x's dtype. Off by default: in x's
        dtype, as "bf16" runs them.
    """

    fwd_num_comm_sms: int = 32
    bwd_num_comm_sms: int = 32
    minibatch_size: int = 128
    macrobatch_size: int | None = None
    schedule_capacity_multiplier: float = 2.0
    peer_timeout_s: float = 60.0
    recompute_gate_up: bool = False
    fwd_pull_in_gluon: bool = False
    fwd_copy_rows: bool = False
    bwd_copy_rows: bool = False
    precision: str = "bf16"
    fp8_weight_gradients: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"MoKConfig.precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{self.precision!r}")
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms", "minibatch_size", "macrobatch_size"):
            value = getattr(self, name)
            if name == "macrobatch_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoKConfig.{name} must be a positive integer, got {value!r}")
        for name in ("recompute_gate_up", "fwd_pull_in_gluon", "fwd_copy_rows", "bwd_copy_rows",
                     "fp8_weight_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoKConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.fwd_copy_rows and self.fwd_pull_in_gluon:
            raise ValueError("MoKConfig.fwd_copy_rows and fwd_pull_in_gluon exclude each "
                             "other")
        if self.macrobatch_size is not None and self.macrobatch_size % self.minibatch_size:
            raise ValueError("MoKConfig.macrobatch_size must be a multiple of minibatch_size")
        multiplier = self.schedule_capacity_multiplier
        if isinstance(multiplier, bool) or not (isinstance(multiplier, (int, float))
                                                and 0 < multiplier < math.inf):
            raise ValueError(f"MoKConfig.schedule_capacity_multiplier must be a positive finite "
                             f"number, got {multiplier!r}")
        if self.fp8_weight_gradients and self.precision != "fp8":
            raise ValueError("MoKConfig.fp8_weight_gradients needs precision='fp8'")
        if not (isinstance(self.peer_timeout_s, (int, float))
                and 0 < self.peer_timeout_s < 1e9):
            raise ValueError(f"MoKConfig.peer_timeout_s must be a positive number of seconds "
                             f"(below 1e9), got {self.peer_timeout_s!r}")


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
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for name, value in (("num_local_tokens", num_local_tokens),
                            ("hidden_size", hidden_size), ("topk", topk)):
            if int(value) < (0 if name == "num_local_tokens" else 1):
                raise MoKInputError(f"{name} must be positive, got {value}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise MoKInputError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        self.config = config
        self.dtype = dtype
        self.group = group
        self.device = device
        self.num_local_tokens = int(num_local_tokens)
        self.hidden_size = int(hidden_size)
        self.topk = int(topk)
        self.error_flags = torch.zeros(NUM_ERROR_FLAGS, dtype=torch.int32, device=device)
        if group is not None and dist.get_world_size(group) > 1:
            _check_same_on_every_rank(group, config.peer_timeout_s,
                                      num_local_tokens=self.num_local_tokens,
                                      hidden_size=self.hidden_size, topk=self.topk,
                                      ranks_per_node=ranks_per_node or 0,
                                      macrobatch_size=config.macrobatch_size or 0,
                                      dtype=str(dtype).removeprefix("torch."),
                                      precision=config.precision)
        # How rows reach the experts (mok.exchange): one GPU, a node, or nodes.
        self.exchange: Exchange = create_exchange(
            group, device, num_tokens=self.num_local_tokens, hidden_size=self.hidden_size,
            topk=self.topk, timeout_s=config.peer_timeout_s, errors=self.error_flags,
            ranks_per_node=ranks_per_node, macrobatch=config.macrobatch_size)
        self.ep_size, self.ep_rank = self.exchange.num_ranks, self.exchange.rank
        pin = device.type == "cuda"
        self._host_flags = torch.zeros(NUM_ERROR_FLAGS, dtype=torch.int32, pin_memory=pin)
        self._host_view = self._host_flags.numpy()  # the same memory: read without torch
        self._flags_event: torch.cuda.Event | None = None
        self._flags_pending = False
        self._schedule_unpublished = False
        self._dense_routing: dict[tuple[int, int], Routing] = {}
        self._out_of_step: str | None = None  # set once a wait on a peer timed out

    def _check_rows(self, dtype: torch.dtype, precision: str) -> None:
        """Under expert parallelism the ranks read each other's rows in the workspace's format
        (its dtype and its config's precision, the same on every rank): a call in another
        raises MoKInputError."""
        if self.ep_size == 1:
            return
        if dtype != self.dtype:
            raise MoKInputError(
                f"x is {dtype}, this expert-parallel workspace moves {self.dtype} rows: create "
                f"it with dtype={dtype} on every rank (the ranks read each other's rows in the "
                f"workspace's dtype)")
        if precision != self.config.precision:
            raise MoKInputError(
                f"the config asks precision {precision!r}, this expert-parallel workspace was "
                f"made with {self.config.precision!r}: create it with that config on every "
                f"rank (the ranks read each other's rows in the workspace's precision)")

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

    def _publish_schedule_errors(self) -> None:
        """Publish the flags once after each schedule: called at the end of the forward (after
        its launches, which the copy would delay) and by the next build_schedule (a schedule
        that no forward used)."""
        if self._schedule_unpublished:
            self._schedule_unpublished = False
            self._publish_errors()

    def _poll_errors(self) -> None:
        """Raise the errors of an earlier call whose flag copy has landed, on this workspace or
        any other that get_workspace made on its device (a call of another token count may be
        the next one); never waits."""
        for each in [self] + [other for other in _WORKSPACES.values()
                              if other is not self and other.device == self.device]:
            each._poll_own_errors()

    def _poll_own_errors(self) -> None:
        self._raise_if_out_of_step()
        if not self._flags_pending:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        if self._flags_event is not None and not self._flags_event.query():
            return
        self._flags_pending = False
        self._raise_if_set(self._host_view.tolist())  # host memory: no device sync

    def check_errors(self) -> None:
        """Synchronize with the device and raise MoKDataError if any data error was flagged."""
        self._raise_if_out_of_step()
        self._flags_pending = False
        self._raise_if_set(self.error_flags.tolist())

    def _raise_if_out_of_step(self) -> None:
        """After a wait on a peer timed out the ranks' calls no longer pair up (a late rank's
        call meets the others' next one), so every later call raises rather than return what
        such pairs compute."""
        if self._out_of_step is not None:
            raise MoKDataError(
                f"an earlier call on this expert-parallel workspace timed out waiting on a peer "
                f"({self._out_of_step}): the ranks are out of step and this workspace's results "
                f"would be invalid from then on; end the job (or create new workspaces on every "
                f"rank at the same point)")

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
            who = (f"rank {self.exchange.group_rank(peer)}" if peer >= 0
                   else "this rank's own pull")
            details += f" (rank {self.ep_rank} waited on {who})"
            self._out_of_step = f"rank {self.ep_rank} waited on {who}"
        raise MoKDataError(f"mok found invalid data on the device: {details}; flagged by a "
                           f"call over {self!r}")

    def dense_routing(self, num_tokens: int, align: int) -> Routing:
        key = (num_tokens, align)
        if key not in self._dense_routing:
            with torch.inference_mode(False):  # kept for calls outside inference mode too
                self._dense_routing[key] = ops.dense_routing(num_tokens, align, self.device)
        return self._dense_routing[key]

    def __repr__(self) -> str:
        return (f"Workspace(device={self.device}, ep_size={self.ep_size}, "
                f"num_local_tokens={self.num_local_tokens}, hidden_size={self.hidden_size}, "
                f"topk={self.topk})")


_WORKSPACES: dict[tuple, Workspace] = {}


def _check_same_on_every_rank(group: dist.ProcessGroup, timeout_s: float,
                              **values: int | str) -> None:
    """Raise MoKInputError on every rank of `group` where the ranks' values differ (each rank's
    buffers, which the others read, are laid out by them); MoKTimeoutError where a rank does
    not come within timeout_s."""
    gathered = ops.gather_within(group, values, timeout_s=timeout_s,
                                 step="the creation of an expert-parallel workspace")
    differ = [name for name in values if len({each[name] for each in gathered}) > 1]
    if differ:
        by_rank = "; ".join(f"{name}: " + ", ".join(str(each[name]) for each in gathered)
                            for name in differ)
        hint = (" Ranks passing different numbers of tokens need ep_max_tokens (mok.nn.MoE, "
                "patch_moe_blocks), or num_local_tokens (mok.functional), set to the same bound "
                "on every rank" if "num_local_tokens" in differ else "")
        if "ranks_per_node" in differ:
            hint += " (ranks_per_node 0: None, found from the host names)"
        if "macrobatch_size" in differ:
            hint += " (macrobatch_size 0: None, no ring)"
        if "dtype" in differ or "precision" in differ:
            hint += (" (each rank reads the others' rows in the workspace's dtype and "
                     "precision)")
        raise MoKInputError(
            f"the ranks of the expert-parallel group passed different values ({by_rank}, by "
            f"rank): every rank must pass the same.{hint}")


def create_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    ranks_per_node: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Workspace:
    """A new workspace (not cached). num_local_tokens: the most tokens a schedule may hold.
    Its buffers are ordinary tensors even when made under torch.inference_mode, so calls
    outside it can use them too.

    ranks_per_node: with a group spanning nodes, its ranks per node (default: found from the
    host names; the ranks must be numbered node by node, as torchrun does).
    dtype: with a group, x's dtype in every call (bf16 or fp16): the rows the ranks exchange.
    The ranks must pass the same sizes, dtype, precision and macrobatch_size (checked here, a
    collective); on one GPU dtype is not used.
    """
    with torch.inference_mode(False):
        return Workspace(config, group, device=device, num_local_tokens=num_local_tokens,
                         hidden_size=hidden_size, topk=topk, ranks_per_node=ranks_per_node,
                         dtype=dtype)


def get_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    ranks_per_node: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Workspace:
    """The workspace for these arguments, created on first use and cached."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (config, id(group) if group is not None else None, str(device), int(num_local_tokens),
           int(hidden_size), int(topk), ranks_per_node, dtype)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = create_workspace(
            config, group, device=device, num_local_tokens=num_local_tokens,
            hidden_size=hidden_size, topk=topk, ranks_per_node=ranks_per_node, dtype=dtype)
    return _WORKSPACES[key]


def check_errors(workspace: Workspace | None = None) -> None:
    """Synchronize and raise MoKDataError for any data error flagged so far on this workspace,
    or (None) on every workspace get_workspace made: those mok.nn's layers run in."""
    for each in [workspace] if workspace is not None else list(_WORKSPACES.values()):
        each.check_errors()


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
    exchange: object = field(default=None, repr=False)  # the exchange's plan (mok.exchange)

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
        if workspace.ep_size > 1:
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
        those from them) when the config does not recompute them.
    weights_group [P * T_max * k] fp32 (expert parallelism with symmetric memory only): the
        router weights of the group's routes, pulled with their tokens (those of the routes
        scheduled here; by route, as the schedule's rows read them). The pulled token rows are
        not kept: the backward pulls them again with d_output.
    Without gate_up, the gate/up projections are recomputed inside the backward kernel; expert
    outputs are never kept (the router-weight gradient is computed from h).
    precision: the config's. An "fp8" context keeps no h (the FP8 backward recomputes the
    pre-activations, and h from them, when they are not kept).
    swiglu_limit: the limit the forward (or recompute_forward_context) ran with; the backward
    runs with it.
    has_shared: whether the forward ran a shared expert (None: what the context holds says).
    A context with kept pre-activations serves one backward: the backward writes their
    gradients over them (and bumps their version counters). A second backward on it raises
    MoKInputError; recompute_forward_context makes a fresh one.
    """

    h: torch.Tensor | None
    h_shared: torch.Tensor | None
    weights_group: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    gate_up_shared: torch.Tensor | None = None
    precision: str = "bf16"
    swiglu_limit: float | None = None
    has_shared: bool | None = None
    kept_versions: tuple = field(init=False, repr=False, compare=False)
    # Set by forward and recompute_forward_context: the routing of the schedule they ran with;
    # by the backward, once it reads kept pre-activations (whose gradients it writes over them).
    made_for: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    used: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.has_shared is None:
            object.__setattr__(self, "has_shared", self.h_shared is not None
                               or self.gate_up_shared is not None)
        object.__setattr__(self, "kept_versions",
                           tuple(_version(t) for t in (self.gate_up, self.gate_up_shared)))

    def check_unused(self) -> None:
        """Raise MoKInputError where the kept pre-activations changed since this context was
        made (a backward already wrote their gradients over them: its version counters say so,
        and for inference tensors, which have none, the context's own record)."""
        now = tuple(_version(t) for t in (self.gate_up, self.gate_up_shared))
        if now != self.kept_versions or (self.used and self.keeps_pre_activations):
            raise MoKInputError(
                "the forward context's kept pre-activations were overwritten since it was made: "
                "a backward already used this context (it writes the gradients over them), or "
                "they were changed in place. A context with kept pre-activations serves one "
                "backward; run the forward or recompute_forward_context again")

    @property
    def nbytes(self) -> int:
        parts = (self.h, self.h_shared, self.weights_group, self.gate_up, self.gate_up_shared)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @property
    def keeps_pre_activations(self) -> bool:
        return self.gate_up is not None or self.gate_up_shared is not None

    def kept_for_backward(self) -> ForwardContext:
        """This context without the h that kept pre-activations make redundant (what the
        forward returns; it needed h itself for the down projection)."""
        return replace(
            self, h=None if self.gate_up is not None else self.h,
            h_shared=None if self.gate_up_shared is not None else self.h_shared)


def _made_for(context: ForwardContext, schedule: Schedule) -> ForwardContext:
    object.__setattr__(context, "made_for", schedule.routing.row_route)
    return context


def _version(tensor: torch.Tensor | None) -> int | None:
    """tensor's version counter (None for None and for inference tensors, which have none)."""
    return None if tensor is None or tensor.is_inference() else tensor._version


def _overwritten(tensor: torch.Tensor) -> None:
    """Record that a launch wrote over tensor (a kept context's pre-activations): autograd's
    saved-tensor checks and ForwardContext.check_unused then refuse to read it again."""
    if not tensor.is_inference():
        torch.autograd.graph.increment_version(tensor)


# -- input checks (host-known facts only; never reads device values) ---------------------------

def _check_limit(swiglu_limit) -> None:
    if swiglu_limit is not None and (isinstance(swiglu_limit, bool) or not (
            isinstance(swiglu_limit, (int, float)) and swiglu_limit > 0)):
        raise MoKInputError(f"swiglu_limit must be a positive number or None, got "
                            f"{swiglu_limit!r}")


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
    workspace._publish_schedule_errors()
    if not isinstance(topk_experts, torch.Tensor) or topk_experts.dim() != 2:
        raise MoKInputError("topk_experts must be a 2-d tensor [num_tokens, topk]")
    num_tokens = topk_experts.shape[0]
    _check_tensor("topk_experts", topk_experts, (num_tokens, workspace.topk), INDEX_DTYPES,
                  workspace.device)
    if num_tokens > workspace.num_local_tokens:
        raise MoKInputError(f"{num_tokens} tokens exceed the workspace's num_local_tokens="
                            f"{workspace.num_local_tokens}")
    if int(num_local_experts) < 1:
        raise MoKInputError(f"num_local_experts must be positive, got {num_local_experts}")
    tiles = tiles or ops.default_tiles(workspace.device)
    routing, plan = workspace.exchange.build_schedule(
        topk_experts, config=config, num_local_experts=int(num_local_experts), align=tiles.align)
    workspace._schedule_unpublished = True
    if validate or (validate is None and _env.VALIDATE):
        workspace.check_errors()
    return Schedule(routing, workspace.dense_routing(num_tokens, tiles.align), tiles,
                    num_local_experts * workspace.ep_size, workspace, plan)


@dataclass(frozen=True)
class _Experts:
    """One group of experts' weights: gate, up [E, I, H] and down [E, H, I] (None where the
    call does not need it). The shared expert is a group of one ([None] views)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor | None

    @classmethod
    def shared(cls, gate, up, down) -> _Experts | None:
        if gate is None:
            return None
        return cls(gate[None], up[None], down[None] if down is not None else None)

    @property
    def intermediate(self) -> int:
        return self.gate.shape[1]

    def operands(self, x: torch.Tensor, d_output: torch.Tensor | None = None,
                 moved: bool = False) -> Operands:
        """mok.plan's facts of these weights and the token rows (moved: they reach the experts
        in the exchange's buffers)."""
        return Operands.of(x, self.gate, self.up, self.down, d_output=d_output, moved=moved)


def _forward_plans(config, schedule, x, shared: _Experts | None,
                   routed: _Experts) -> tuple[ForwardPlan, ForwardPlan | None]:
    """The forward's kernels and tiles of the routed experts and of the shared expert (None
    without one), for this rank's tokens x."""
    keep = not config.recompute_gate_up
    moved = schedule.workspace.exchange.movement(Phase.FORWARD, config) is not Movement.HERE
    routed_plan = forward_plan(schedule.tiles, routed.operands(x, moved=moved),
                               hidden=x.shape[1], intermediate=routed.intermediate,
                               keep_gate_up=keep)
    if shared is None:
        return routed_plan, None
    return routed_plan, forward_plan(schedule.tiles, shared.operands(x), hidden=x.shape[1],
                                     intermediate=shared.intermediate, keep_gate_up=keep)


def _gate_up(config, schedule, x, router_weights, shared: _Experts | None, routed: _Experts,
             swiglu_limit, plans) -> tuple[ForwardContext, torch.Tensor]:
    """The gate/up GEMMs of this rank's tokens x (and router weights), on `_forward_plans`'
    tiles: (context, the router weights the down GEMM scales the routed rows by). The shared
    expert goes first: it needs no rows of other ranks, and they have time to publish theirs."""
    exchange, plan = schedule.workspace.exchange, schedule.exchange
    routed_plan, shared_plan = plans
    keep = not config.recompute_gate_up
    h_shared = gate_up_shared = None
    if shared is not None:
        gate_up_shared = (ops.gate_up_buffer(x, shared.gate, schedule.shared_routing) if keep
                          else None)
        h_shared = ops.gate_up_swiglu(x, shared.gate, shared.up, schedule.shared_routing,
                                      shared_plan.gate_up, swiglu_limit, gate_up=gate_up_shared)
    tiles = routed_plan.gate_up
    x, router_weights = exchange.tokens(x, router_weights)
    gate_up = ops.gate_up_buffer(x, routed.gate, schedule.routing) if keep else None
    rows = exchange.forward_rows(plan, x, router_weights, config=config, block_m=tiles.block_m)
    h = ops.gate_up_swiglu(rows.x, routed.gate, routed.up, schedule.routing, tiles,
                           swiglu_limit, pull=rows.pull, gate_up=gate_up)
    exchange.rows_read(Phase.FORWARD)
    context = ForwardContext(h, h_shared, weights_group=rows.kept_weights, gate_up=gate_up,
                             gate_up_shared=gate_up_shared, swiglu_limit=swiglu_limit)
    return context, rows.route_weights


# -- FP8 (MoKConfig.precision "fp8"): the row GEMMs of mok.ops.fp8 ----------------------------

def _check_fp8(config: MoKConfig, workspace: Workspace) -> None:
    if workspace.ep_size > 1 and (config.fwd_copy_rows or config.bwd_copy_rows):
        raise MoKInputError("MoKConfig(precision='fp8') pulls the rows under expert "
                            "parallelism: fwd_copy_rows and bwd_copy_rows apply to 16-bit "
                            "precision only")


def _fp8_plan(schedule: Schedule, x: torch.Tensor, experts: _Experts, *,
              moved: bool = False) -> Fp8Plan:
    """moved: the routed experts' rows, which reach them in the exchange's buffers and whose
    outputs go back to the tokens' ranks."""
    return fp8_plan(schedule.tiles, experts.operands(x, moved=moved), hidden=x.shape[1],
                    intermediate=experts.intermediate, scatter=moved)


def _fp8_weights(experts: _Experts) -> ops.Fp8Experts:
    return ops.cached_quantize_experts(experts.gate, experts.up, experts.down)


def _fp8_pre_activations(schedule, x, xq, experts: _Experts, weights: ops.Fp8Experts,
                         routing: Routing, swiglu_limit, *, moved: bool = False) -> torch.Tensor:
    """The pre-activations [C, 2I] in x's dtype of x quantized (xq), as a keeping forward
    stores them."""
    return ops.gate_up_fp8(xq, weights.gate, weights.up, routing,
                           _fp8_plan(schedule, x, experts, moved=moved).gate_up_saved,
                           swiglu_limit, out_dtype=x.dtype)


def _moved(workspace: Workspace) -> bool:
    return not workspace.exchange.rows_here


def _forward_fp8(config, schedule, x, router_weights, shared: _Experts | None,
                 routed: _Experts, swiglu_limit) -> tuple[torch.Tensor, ForwardContext]:
    """forward in FP8: x quantized once; each group of experts' gate/up with SwiGLU (h in e4m3,
    the pre-activations kept alongside unless recomputed) and down, then the combine. With
    expert parallelism the routed experts' rows come quantized from their ranks (the shared
    expert's first, meanwhile) and down's rows go back to them."""
    exchange, plan = schedule.workspace.exchange, schedule.exchange
    keep = not config.recompute_gate_up
    dtype = x.dtype
    xq = ops.quantize_rows(x)

    def expert_rows(experts: _Experts, routing: Routing, rows: ops.Quantized, route_weights,
                    scatter=None):
        fp8 = _fp8_plan(schedule, x, experts, moved=scatter is not None)
        weights = _fp8_weights(experts)
        gate_up = ops.gate_up_buffer(x, experts.gate, routing) if keep else None
        h = ops.gate_up_swiglu_fp8(rows, weights.gate, weights.up, routing, fp8.gate_up,
                                   swiglu_limit, gate_up=gate_up)
        return ops.down_proj_fp8(h, weights.down, routing, fp8.down, route_weights,
                                 out_dtype=dtype, scatter=scatter), gate_up

    shared_rows = gate_up_shared = None
    if shared is not None:
        shared_rows, gate_up_shared = expert_rows(shared, schedule.shared_routing, xq, None)
    tokens, token_weights = exchange.tokens(x, router_weights)
    rows = exchange.forward_rows_fp8(plan, tokens, xq if tokens is x else None, token_weights,
                                     config=config)
    out, gate_up = expert_rows(routed, schedule.routing, rows.x, rows.route_weights,
                               exchange.scatter(plan, dtype))
    exchange.deliveries_done(plan, Phase.FORWARD, dtype, values=False, wait=True)
    y = exchange.combine(plan, out, schedule.routing, shared_rows, dtype)
    return y, ForwardContext(None, None, weights_group=rows.kept_weights, gate_up=gate_up,
                             gate_up_shared=gate_up_shared, precision="fp8",
                             swiglu_limit=swiglu_limit, has_shared=shared is not None)


def _backward_fp8(config, schedule, context: ForwardContext, d_output, x, router_weights,
                  shared: _Experts | None, routed: _Experts, swiglu_limit) -> tuple:
    """backward in FP8: d_output quantized once; per group of experts the pre-activations (kept,
    or recomputed from x quantized), dSwiGLU (d_gate_up in e4m3 and in x's dtype, h, the
    router-weight gradient's partial sums) and the d_x rows on e4m3 operands; the weight
    gradients in x's dtype from d_gate_up, h, x and d_output, as the 16-bit backward's (with
    fp8_weight_gradients on e4m3 operands from d_gate_up's, x's and d_output's e4m3 rows, and
    no d_gate_up in x's dtype). With expert parallelism the routed experts' d_output and x
    rows come from their ranks in x's dtype and are quantized here (with fp8_weight_gradients
    they come in e4m3, quantized on their ranks); d_x rows and router-weight gradients go
    back."""
    exchange, plan = schedule.workspace.exchange, schedule.exchange
    dtype = x.dtype
    dq = ops.quantize_rows(d_output)
    fp8_wgrad = config.fp8_weight_gradients
    x_whole = []  # x in e4m3 rows, made once for the shared and the routed experts

    def quantized_x(x_rows):
        if isinstance(x_rows, ops.Quantized):  # pulled in e4m3
            return x_rows
        if x_rows is not x:
            return ops.quantize_rows(x_rows)
        if not x_whole:
            x_whole.append(ops.quantize_rows(x))
        return x_whole[0]

    def input_grads(experts: _Experts, routing: Routing, gate_up, route_weights, d_rows, dq,
                    x_rows, scatter=None):
        """(plan, d_x rows, partial sums, [d_gate_up, h], (d_output, x)): the weight
        gradients' operands, in e4m3 rows with fp8_wgrad (d_gate_up's halves as dswiglu_fp8
        gives them)."""
        fp8 = _fp8_plan(schedule, x, experts, moved=scatter is not None)
        weights = _fp8_weights(experts)
        xq = quantized_x(x_rows) if gate_up is None or fp8_wgrad else None
        if gate_up is None:
            gate_up = _fp8_pre_activations(schedule, x, xq, experts, weights, routing,
                                           swiglu_limit, moved=scatter is not None)
        d_gate_up_q, h, partial = ops.dswiglu_fp8(dq, weights.down_t, gate_up, routing,
                                                  fp8.dswiglu, route_weights, swiglu_limit,
                                                  apart=fp8.dswiglu_apart,
                                                  in_place=not fp8_wgrad)
        _overwritten(gate_up)  # in place or not: a second backward is refused alike
        d_x_rows = ops.d_x_rows_fp8(d_gate_up_q, weights.gate_up_t, routing, fp8.d_x,
                                    out_dtype=dtype, scatter=scatter)
        if fp8_wgrad:
            return fp8, d_x_rows, partial, [d_gate_up_q, h], (dq, xq)
        return fp8, d_x_rows, partial, [gate_up, h], (d_rows, x_rows)  # gate_up: d_gate_up

    d_shared = (None, None, None)
    d_x_shared_rows = None
    if shared is not None:  # first: with expert parallelism it overlaps the exchange
        fp8, d_x_shared_rows, _, saved, operands = input_grads(
            shared, schedule.shared_routing, context.gate_up_shared, None, d_output, dq, x)
        grads = _weight_grads(fp8, schedule.shared_routing, *operands, saved, None, shared,
                              down_first=context.gate_up_shared is not None, fp8=fp8_wgrad)
        d_shared = tuple(grad[0] for grad in grads)
    d_tokens, x_tokens, router_weights = exchange.tokens(d_output, x, router_weights)
    rows = exchange.backward_rows_fp8(
        plan, d_tokens, x_tokens, config=config, dq=dq if d_tokens is d_output else None,
        xq=quantized_x(x) if fp8_wgrad and x_tokens is x else None)
    route_weights = context.weights_group if context.weights_group is not None else router_weights
    routing = schedule.routing
    d_rows = rows.d_output
    fp8, d_x_rows, partial, saved, operands = input_grads(
        routed, routing, context.gate_up, route_weights, d_rows,
        d_rows if isinstance(d_rows, ops.Quantized) else dq if d_rows is d_output
        else ops.quantize_rows(d_rows), rows.x, exchange.scatter(plan, dtype))
    by_route = ops.router_grad(partial, routing)
    exchange.send_route_values(plan, by_route)
    exchange.deliveries_done(plan, Phase.BACKWARD, dtype, values=True, wait=False)
    d_x = None
    if exchange.delivers_in_combine:
        # The d_x rows are freed before the weight gradients are allocated (as the 16-bit
        # backward).
        d_x = exchange.combine(plan, d_x_rows, routing, d_x_shared_rows, dtype)
        d_x_rows = d_x_shared_rows = None
    d_routed = _weight_grads(fp8, routing, *operands, saved, route_weights, routed,
                             down_first=context.gate_up is not None, fp8=fp8_wgrad)
    del rows, operands
    exchange.landed(Phase.BACKWARD)
    if d_x is None:
        d_x = exchange.combine(plan, d_x_rows, routing, d_x_shared_rows, dtype)
    d_router_weights = exchange.route_values(plan, by_route)
    return (d_x, d_router_weights, *d_routed, *d_shared)


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
    _check_limit(swiglu_limit)
    shared = (w_shared_gate, w_shared_up, w_shared_down)
    routed = (w_routed_gate, w_routed_up, w_routed_down)
    _check_weights(schedule, x, shared, routed)
    _check_router_weights(schedule, router_weights)
    workspace._check_rows(x.dtype, config.precision)
    x = _rowmajor(x)
    router_weights = router_weights.contiguous()
    shared, routed = _Experts.shared(*shared), _Experts(*routed)
    if config.precision == "fp8":
        _check_fp8(config, workspace)
        y, context = _forward_fp8(config, schedule, x, router_weights, shared, routed,
                                  swiglu_limit)
        workspace._publish_schedule_errors()
        return y, _made_for(context, schedule)
    exchange, plan = workspace.exchange, schedule.exchange
    plans = routed_plan, shared_plan = _forward_plans(config, schedule, x, shared, routed)
    # schedule -> rows in -> gate/up
    context, route_weights = _gate_up(config, schedule, x, router_weights, shared, routed,
                                      swiglu_limit, plans)
    # -> down, each weighted row to its token's rank -> combine
    rows = ops.down_proj(context.h, routed.down, schedule.routing, routed_plan.down,
                         route_weights, scatter=exchange.scatter(plan, x.dtype))
    shared_rows = None
    if shared is not None:
        shared_rows = ops.down_proj(context.h_shared, shared.down, schedule.shared_routing,
                                    shared_plan.down, None)
    exchange.deliveries_done(plan, Phase.FORWARD, x.dtype, values=False, wait=True)
    y = exchange.combine(plan, rows, schedule.routing, shared_rows, x.dtype)
    workspace._publish_schedule_errors()
    return y, _made_for(context.kept_for_backward(), schedule)


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
    _check_limit(swiglu_limit)
    workspace._check_rows(x.dtype, config.precision)
    x = _rowmajor(x)
    if workspace.ep_size > 1:
        if router_weights is None:
            raise MoKInputError("with expert parallelism, recompute_forward_context needs "
                                "router_weights= (the experts' ranks pull them with the rows)")
        _check_router_weights(schedule, router_weights)
        router_weights = router_weights.contiguous()
    else:
        router_weights = None  # one GPU: the gate/up GEMMs do not read them
    shared = _Experts.shared(w_shared_gate, w_shared_up, None)
    routed = _Experts(w_routed_gate, w_routed_up, None)
    if config.precision == "fp8":
        _check_fp8(config, workspace)
        return _made_for(_recompute_fp8(config, schedule, x, router_weights, shared, routed,
                                        swiglu_limit), schedule)
    context, _ = _gate_up(config, schedule, x, router_weights, shared, routed, swiglu_limit,
                          _forward_plans(config, schedule, x, shared, routed))
    return _made_for(context.kept_for_backward(), schedule)


def _recompute_fp8(config, schedule, x, router_weights, shared: _Experts | None,
                   routed: _Experts, swiglu_limit) -> ForwardContext:
    """recompute_forward_context in FP8: the kept pre-activations (a recomputing context holds
    none: the backward recomputes them); with expert parallelism the routed experts' rows and
    router weights come again from their ranks, as in the forward."""
    keep = not config.recompute_gate_up
    moved = _moved(schedule.workspace)
    context = dict(precision="fp8", swiglu_limit=swiglu_limit, has_shared=shared is not None)
    if not keep and not moved:
        return ForwardContext(None, None, **context)
    xq = ops.quantize_rows(x)

    def pre_activations(experts: _Experts, routing: Routing, rows: ops.Quantized,
                        moved: bool = False) -> torch.Tensor | None:
        if not keep:
            return None
        weights = ops.cached_quantize_experts(experts.gate, experts.up, None)
        return _fp8_pre_activations(schedule, x, rows, experts, weights, routing, swiglu_limit,
                                    moved=moved)

    gate_up_shared = (pre_activations(shared, schedule.shared_routing, xq)
                      if shared is not None else None)
    # the tokens as the forward takes them (across nodes of one rank each they are the
    # gathered tokens, though the rows stay here)
    exchange = schedule.workspace.exchange
    tokens, token_weights = exchange.tokens(x, router_weights)
    landed = exchange.forward_rows_fp8(schedule.exchange, tokens, xq if tokens is x else None,
                                       token_weights, config=config)
    return ForwardContext(None, None, weights_group=landed.kept_weights,
                          gate_up=pre_activations(routed, schedule.routing, landed.x, moved),
                          gate_up_shared=gate_up_shared, **context)


def _check_context_rows(h, gate_up, routing, intermediate, suffix, *,
                        may_be_empty: bool = False) -> None:
    """The context holds h or the pre-activations (or, may_be_empty, neither), with this
    schedule's rows."""
    if h is None and gate_up is None and not may_be_empty:
        raise MoKInputError(f"the forward context holds neither h{suffix} nor gate_up{suffix}")
    for name, tensor, width in ((f"h{suffix}", h, intermediate),
                                (f"gate_up{suffix}", gate_up, 2 * intermediate)):
        if tensor is not None and tuple(tensor.shape) != (routing.capacity_rows, width):
            raise MoKInputError(f"forward context {name} has shape {tuple(tensor.shape)}, this "
                                f"schedule and these weights need {(routing.capacity_rows, width)}"
                                ": it was made for another schedule")


def _dswiglu(plan: BackwardPlan, routing: Routing, rows: BackwardRows, h, gate_up,
             route_weights, experts: _Experts, swiglu_limit):
    """The backward's first launch(es): (d_gate_up [C, 2I], the router-weight gradients' partial
    sums or None, h). A context with kept pre-activations holds no h: the launch rebuilds it from
    them, for the down projection's weight gradient, and writes d_gate_up over them."""
    h_out = h is None
    if h_out:
        h = torch.empty(routing.capacity_rows, experts.intermediate, dtype=gate_up.dtype,
                        device=gate_up.device)
    if plan.apart is not None:  # gate/up recomputed in a launch of its own
        d_gate_up, partial = ops.dswiglu_apart(
            rows.d_output, rows.x, experts.down, experts.gate, experts.up, routing, *plan.apart,
            route_weights, swiglu_limit, pull=rows.pull)
    else:
        d_gate_up, partial = ops.down_bwd_dswiglu(
            rows.d_output, rows.x, experts.down, experts.gate, experts.up, h, routing,
            plan.dswiglu, route_weights, swiglu_limit, pull=rows.pull, gate_up=gate_up,
            h_out=h_out, out=gate_up)
        if gate_up is not None:
            _overwritten(gate_up)
    return d_gate_up, partial, h


def _weight_grads(plan: BackwardPlan | Fp8Plan, routing, d_output, x, saved, route_weights,
                  experts: _Experts, *, down_first: bool = False, fp8: bool = False):
    """(d_w_gate, d_w_up, d_w_down) from saved = [d_gate_up, h] (emptied, so that the first
    one's operand is freed before the other gradients are allocated: d_gate_up [C, 2I], or with
    down_first h [C, I], where d_gate_up lives on in a kept context); d_output and x by token.
    fp8 (MoKConfig.fp8_weight_gradients, plan an Fp8Plan): on e4m3 operands, quantized along
    the rows from d_gate_up, d_output and x in e4m3 rows (dswiglu_fp8's, quantize_rows') and
    from h."""
    d_gate_up, h = saved
    saved.clear()

    def gate_up():
        if fp8:
            return ops.grouped_wgrad_fp8(d_gate_up, x, routing, plan.wgrad_fp8, gather_a=False,
                                         gather_b=True, out_dtype=experts.gate.dtype,
                                         split=experts.intermediate)
        return ops.grouped_wgrad_gate_up(d_gate_up, x, routing, plan.wgrad_gate_up,
                                         gather_x=True, out_dtype=experts.gate.dtype)

    def down():
        if fp8:
            return ops.grouped_wgrad_fp8(d_output, h, routing, plan.wgrad_fp8, gather_a=True,
                                         gather_b=False, router_weights=route_weights,
                                         out_dtype=experts.down.dtype)
        return ops.grouped_wgrad(d_output, h, routing, plan.wgrad_down, gather_a=True,
                                 gather_b=False, router_weights=route_weights,
                                 out_dtype=experts.down.dtype)

    if down_first:
        d_w_down = down()
        del h
        d_w_gate, d_w_up = gate_up()
    else:
        d_w_gate, d_w_up = gate_up()
        del d_gate_up
        d_w_down = down()
    return d_w_gate, d_w_up, d_w_down


def _shared_backward(tiles, routing, d_output, x, h, gate_up, experts: _Experts, swiglu_limit):
    """The shared expert's backward on this rank's tokens: (d_x rows, its weight gradients)."""
    plan = backward_plan(tiles, experts.operands(x, d_output), hidden=x.shape[1],
                         intermediate=experts.intermediate,
                         kept=gate_up is not None)
    rows = BackwardRows(d_output, x)
    d_gate_up, _, h = _dswiglu(plan, routing, rows, h, gate_up, None, experts, swiglu_limit)
    d_x_rows = ops.d_x_rows(d_gate_up, experts.gate, experts.up, routing, plan.d_x)
    saved = [d_gate_up, h]
    del d_gate_up, h
    grads = _weight_grads(plan, routing, d_output, x, saved, None, experts,
                          down_first=gate_up is not None)
    return d_x_rows, tuple(grad[0] for grad in grads)


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
    swiglu_limit: float | None | object = FROM_CONTEXT,
) -> tuple[torch.Tensor, ...]:
    """The MoE layer's backward, from d_output [T, H] (x's dtype).

    swiglu_limit: the forward context's (the limit its forward ran with) unless given; a limit
    given here must equal it (MoKInputError otherwise).
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
    workspace._check_rows(x.dtype, config.precision)
    context = forward_context
    if not isinstance(context, ForwardContext):
        raise MoKInputError("forward_context must come from forward or recompute_forward_context")
    if context.has_shared != (w_shared_gate is not None):
        raise MoKInputError("the forward context and the shared-expert weights disagree")
    exchange, plan = workspace.exchange, schedule.exchange
    if (context.weights_group is None) != exchange.rows_here:
        raise MoKInputError("the forward context was made for another workspace")
    shared, routed = _Experts.shared(*shared), _Experts(*routed)
    if context.precision != config.precision:
        raise MoKInputError(f"the forward context was made with precision "
                            f"{context.precision!r}, the config asks {config.precision!r}")
    if context.made_for is not None and context.made_for is not schedule.routing.row_route:
        raise MoKInputError("the forward context was made with another schedule: pass the "
                            "schedule its forward (or recompute_forward_context) ran with")
    context.check_unused()
    if swiglu_limit is FROM_CONTEXT:
        swiglu_limit = context.swiglu_limit
    elif swiglu_limit != context.swiglu_limit:
        raise MoKInputError(f"backward's swiglu_limit={swiglu_limit!r} differs from the "
                            f"forward's ({context.swiglu_limit!r}): the gradients would be "
                            "those of another layer; leave it out to use the forward's")
    fp8 = config.precision == "fp8"
    _check_context_rows(context.h, context.gate_up, schedule.routing, routed.intermediate, "",
                        may_be_empty=fp8)
    if shared is not None:
        _check_context_rows(context.h_shared, context.gate_up_shared, schedule.shared_routing,
                            shared.intermediate, "_shared", may_be_empty=fp8)
    x, d_output = _rowmajor(x), _rowmajor(d_output)
    router_weights = router_weights.contiguous()
    if fp8:
        _check_fp8(config, workspace)
    object.__setattr__(context, "used", True)
    if fp8:
        return _backward_fp8(config, schedule, context, d_output, x, router_weights, shared, routed,
                             swiglu_limit)
    dtype = x.dtype
    d_shared = (None, None, None)
    d_x_shared_rows = None
    if shared is not None:  # first: with expert parallelism it overlaps the exchange
        d_x_shared_rows, d_shared = _shared_backward(
            schedule.tiles, schedule.shared_routing, d_output, x, context.h_shared,
            context.gate_up_shared, shared, swiglu_limit)
    # rows in -> dSwiGLU (gate/up recomputed or kept) -> d_x rows out -> combine; the weight
    # gradients while the other ranks' rows land.
    d_output, x, router_weights = exchange.tokens(d_output, x, router_weights)
    route_weights = context.weights_group if context.weights_group is not None else router_weights
    routing = schedule.routing
    kept = context.gate_up is not None
    movement = exchange.movement(Phase.BACKWARD, config)
    launches = backward_plan(schedule.tiles,
                             routed.operands(x, d_output, moved=movement is not Movement.HERE),
                             hidden=x.shape[1], intermediate=routed.intermediate, kept=kept,
                             movement=movement)
    rows = exchange.backward_rows(plan, d_output, x, config=config,
                                  block_m=launches.first_block_m, kept=kept,
                                  apart=launches.apart is not None)
    d_gate_up, partial, h = _dswiglu(launches, routing, rows, context.h, context.gate_up,
                                     route_weights, routed, swiglu_limit)
    by_route = ops.router_grad(partial, routing)
    exchange.send_route_values(plan, by_route)
    d_x_rows = ops.d_x_rows(d_gate_up, routed.gate, routed.up, routing, launches.d_x,
                            scatter=exchange.scatter(plan, dtype), pull=rows.x_pull,
                            pulled=rows.x if rows.x_pull is not None else None)
    exchange.rows_read(Phase.BACKWARD)
    exchange.deliveries_done(plan, Phase.BACKWARD, dtype, values=True, wait=False)
    d_x = None
    if exchange.delivers_in_combine:
        # The d_x rows ([C, H], the backward's largest buffer) are freed before the weight
        # gradients are allocated: the step's peak holds one or the other, not both.
        d_x = exchange.combine(plan, d_x_rows, routing, d_x_shared_rows, dtype)
        d_x_rows = d_x_shared_rows = None
    saved = [d_gate_up, h]
    del d_gate_up, h  # the one freed inside goes before the other gradients are allocated
    d_routed = _weight_grads(launches, routing, rows.d_output, rows.x, saved, route_weights,
                             routed, down_first=kept)
    del rows, d_output, x
    exchange.landed(Phase.BACKWARD)
    if d_x is None:
        d_x = exchange.combine(plan, d_x_rows, routing, d_x_shared_rows, dtype)
    d_router_weights = exchange.route_values(plan, by_route)
    return (d_x, d_router_weights, *d_routed, *d_shared)
