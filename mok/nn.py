"""mok.nn: the MoE module (router + shared expert + routed experts) and an autograd entry point.

Legend: T tokens, H hidden, I expert intermediate, I_s shared intermediate, E experts, k top-k.

`moe_experts(...)` is the layer as a differentiable function of its tensors, registered as the
torch.library custom ops `mok::moe_forward` / `mok::moe_backward` (with fake implementations, so
torch.compile(fullgraph=True) traces a model containing it). `MoE` adds the router: softmax top-k
(optionally renormalized) or sigmoid scores with a per-expert selection bias for auxiliary-loss-free
balancing (DeepSeek-V3), the load-balancing auxiliary loss and the router z-loss.
"""

from __future__ import annotations

import contextlib
import enum
import math
import numbers
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as torch_f
from torch import nn

from mok import functional as F
from mok.errors import MoKInputError
from mok.ops import capacity_rows, default_tiles
from mok.reference import moe_reference


class Backend(enum.Enum):
    """Which implementation runs the experts."""

    MOK = "mok"              # the fused Triton kernels (compiled on GPU, interpreted on CPU)
    REFERENCE = "reference"  # mok.reference: the pure-PyTorch layer, for debugging

    @classmethod
    def parse(cls, value: Backend | str) -> Backend:
        """The backend named by value; ValueError listing the valid names otherwise."""
        return _parse_enum(cls, value, "backend")


def _parse_enum(cls: type[enum.Enum], value, what: str, note: str = ""):
    """cls's member named by value; ValueError naming `what` and the valid names otherwise."""
    try:
        return cls(value)
    except ValueError:
        names = ", ".join(repr(member.value) for member in cls)
        raise ValueError(f"{what} must be one of {names}{note}, got {value!r}") from None


# -- the fused layer as custom ops ------------------------------------------------------------

def _workspace(x: torch.Tensor, topk: int) -> F.Workspace:
    """The cached one-GPU workspace of a call: one per power-of-two bound of the token count
    (on one GPU nothing else is sized by it), so calls of many token counts share a few."""
    bound = 1 << max(x.shape[0] - 1, 0).bit_length()
    return F.get_workspace(F.MoKConfig(), None, device=x.device, num_local_tokens=bound,
                           hidden_size=x.shape[1], topk=topk)


def _num_rows(x: torch.Tensor, topk: int, num_local_experts: int) -> int:
    routes = x.shape[0] * topk
    return capacity_rows(routes, num_local_experts, default_tiles(x.device).align, routes)


@torch.library.custom_op("mok::moe_forward", mutates_args=())
def _moe_forward(
    x: torch.Tensor,
    topk_experts: torch.Tensor,
    router_weights: torch.Tensor,
    w_shared_gate: torch.Tensor | None,
    w_shared_up: torch.Tensor | None,
    w_shared_down: torch.Tensor | None,
    w_routed_gate: torch.Tensor,
    w_routed_up: torch.Tensor,
    w_routed_down: torch.Tensor,
    swiglu_limit: float | None,
    recompute_gate_up: bool,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, h_shared, gate_up, gate_up_shared (each empty when absent: h and h_shared when
    the pre-activations are kept), row_route, route_row, block_expert, expert_counts,
    expert_offsets); an FP8 context that recomputes keeps neither h nor gate_up."""
    config = F.MoKConfig(recompute_gate_up=recompute_gate_up, precision=precision)
    workspace = _workspace(x, topk_experts.shape[1])
    schedule = F.build_schedule(workspace, config, topk_experts,
                                num_local_experts=w_routed_gate.shape[0])
    y, context = F.forward(config, workspace, schedule, x, router_weights, w_shared_gate,
                           w_shared_up, w_shared_down, w_routed_gate, w_routed_up, w_routed_down,
                           swiglu_limit=swiglu_limit)
    saved = [t if t is not None else x.new_empty(0)
             for t in (context.h, context.h_shared, context.gate_up, context.gate_up_shared)]
    return (y, *saved, *schedule.tensors())


@_moe_forward.register_fake
def _(x, topk_experts, router_weights, w_shared_gate, w_shared_up, w_shared_down,
      w_routed_gate, w_routed_up, w_routed_down, swiglu_limit, recompute_gate_up, precision):
    num_local = w_routed_gate.shape[0]
    rows = _num_rows(x, topk_experts.shape[1], num_local)
    align = default_tiles(x.device).align
    i32 = dict(dtype=torch.int32, device=x.device)
    # What the context keeps: h (and h_shared), or the pre-activations [gate, up] instead; in
    # FP8, recomputing, nothing.
    width = 0 if recompute_gate_up and precision == "fp8" else 1 if recompute_gate_up else 2
    h, h_shared, gate_up, gate_up_shared = (x.new_empty(0) for _ in range(4))
    routed = x.new_empty(rows, width * w_routed_gate.shape[1])
    h, gate_up = (routed, gate_up) if recompute_gate_up else (h, routed)
    if w_shared_gate is not None:
        shared_rows = math.ceil(max(x.shape[0], 1) / align) * align
        shared = x.new_empty(shared_rows, width * w_shared_gate.shape[0])
        h_shared, gate_up_shared = (shared, gate_up_shared) if recompute_gate_up \
            else (h_shared, shared)
    return (x.new_empty(x.shape), h, h_shared, gate_up, gate_up_shared,
            torch.empty(rows, **i32), torch.empty(topk_experts.numel(), **i32),
            torch.empty(rows // align, **i32), torch.empty(num_local, **i32),
            torch.empty(num_local + 1, **i32))


@torch.library.custom_op("mok::moe_backward", mutates_args=("gate_up", "gate_up_shared"))
def _moe_backward(
    d_y: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    w_shared_gate: torch.Tensor | None,
    w_shared_up: torch.Tensor | None,
    w_shared_down: torch.Tensor | None,
    w_routed_gate: torch.Tensor,
    w_routed_up: torch.Tensor,
    w_routed_down: torch.Tensor,
    h: torch.Tensor,
    h_shared: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_shared: torch.Tensor,
    row_route: torch.Tensor,
    route_row: torch.Tensor,
    block_expert: torch.Tensor,
    expert_counts: torch.Tensor,
    expert_offsets: torch.Tensor,
    swiglu_limit: float | None,
    recompute_gate_up: bool,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    config = F.MoKConfig(recompute_gate_up=recompute_gate_up, precision=precision)
    workspace = _workspace(x, router_weights.shape[1])
    schedule = F.Schedule.from_tensors(
        workspace, (row_route, route_row, block_expert, expert_counts, expert_offsets),
        num_tokens=x.shape[0], num_local_experts=w_routed_gate.shape[0])
    has_shared, kept = w_shared_gate is not None, not recompute_gate_up
    holds_h = not kept and precision != "fp8"
    context = F.ForwardContext(h if holds_h else None, h_shared if has_shared and holds_h else None,
                               gate_up=gate_up if kept else None,
                               gate_up_shared=gate_up_shared if kept and has_shared else None,
                               precision=precision, swiglu_limit=swiglu_limit,
                               has_shared=has_shared)
    grads = F.backward(config, workspace, schedule, context, d_y, x, router_weights,
                       w_shared_gate, w_shared_up, w_shared_down, w_routed_gate, w_routed_up,
                       w_routed_down)  # the context's swiglu_limit
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


@_moe_backward.register_fake
def _(d_y, x, router_weights, w_shared_gate, w_shared_up, w_shared_down, w_routed_gate,
      w_routed_up, w_routed_down, h, h_shared, gate_up, gate_up_shared, row_route, route_row,
      block_expert, expert_counts, expert_offsets, swiglu_limit, recompute_gate_up, precision):
    # Every gradient comes back contiguous, whatever the layout of its input (the real op's).
    def like(t: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(0) if t is None else t.new_empty(t.shape)

    return tuple(like(t) for t in (x, router_weights, w_routed_gate, w_routed_up, w_routed_down,
                                   w_shared_gate, w_shared_up, w_shared_down))


def _setup_context(ctx, inputs, output):
    (x, _, router_weights, w_sg, w_su, w_sd, w_rg, w_ru, w_rd, swiglu_limit,
     recompute_gate_up, precision) = inputs
    _, *saved = output  # h, h_shared, gate_up, gate_up_shared, then the routing
    ctx.has_shared = w_sg is not None
    ctx.swiglu_limit, ctx.recompute_gate_up = swiglu_limit, recompute_gate_up
    ctx.precision = precision
    shared = (w_sg, w_su, w_sd) if ctx.has_shared else (x.new_empty(0),) * 3
    ctx.save_for_backward(x, router_weights, *shared, w_rg, w_ru, w_rd, *saved)


# What a second backward through a graph whose forward kept its pre-activations raises.
_SECOND_BACKWARD = (
    "this graph's backward already ran: the layer kept its gate/up pre-activations for one "
    "backward and wrote their gradients over them (recompute_gate_up=False, the default); to "
    "run backward twice through one graph (retain_graph=True), build the layer with "
    "recompute_gate_up=True")


def _backward(ctx, d_y, *_unused):
    try:
        x, router_weights, w_sg, w_su, w_sd, w_rg, w_ru, w_rd, *saved = ctx.saved_tensors
    except RuntimeError as error:  # autograd's check of the saved tensors' versions
        # Only a backward that already wrote over the kept pre-activations is reported as one;
        # an input or weight changed in place keeps PyTorch's own error, which says so.
        if not getattr(ctx, "kept_overwritten", False) or "inplace operation" not in str(error):
            raise
        raise MoKInputError(_SECOND_BACKWARD) from error
    if not ctx.has_shared:
        w_sg = w_su = w_sd = None
    # The op writes the gradients over kept pre-activations (gate_up, gate_up_shared), which
    # bumps their versions: a second backward through this graph then fails autograd's check.
    # An empty placeholder is passed fresh, so a recomputing context stays reusable.
    saved[2:4] = [t if t.numel() else t.new_empty(t.shape) for t in saved[2:4]]
    ctx.kept_overwritten = not ctx.recompute_gate_up
    grads = _moe_backward(d_y.contiguous(), x, router_weights, w_sg, w_su, w_sd, w_rg, w_ru,
                          w_rd, *saved, ctx.swiglu_limit, ctx.recompute_gate_up, ctx.precision)
    d_x, d_rw, d_rg, d_ru, d_rd, d_sg, d_su, d_sd = grads
    if not ctx.has_shared:
        d_sg = d_su = d_sd = None
    return d_x, None, d_rw, d_sg, d_su, d_sd, d_rg, d_ru, d_rd, None, None, None


_moe_forward.register_autograd(_backward, setup_context=_setup_context)


# Per (group, device, H, k): the token bound of expert-parallel calls without max_tokens (the
# first call's count).
_EP_BOUNDS: dict[tuple, int] = {}


class _ExpertParallelExperts(torch.autograd.Function):
    """The layer over an expert-parallel group. Schedules and forward contexts of expert
    parallelism hold the group's exchange state, so this is an autograd.Function rather than a
    custom op (torch.compile breaks the graph here)."""

    @staticmethod
    def forward(ctx, group, max_tokens, config, swiglu_limit, x, topk_experts, router_weights,
                w_sg, w_su, w_sd, w_rg, w_ru, w_rd):
        # Without max_tokens the first call's count is the bound: a later call with fewer
        # tokens (a short last batch) reuses its workspace, whose creation is a collective
        # that a rank alone would wait in forever.
        key = (id(group), str(x.device), x.shape[1], topk_experts.shape[1])
        bound = max_tokens if max_tokens is not None else _EP_BOUNDS.get(key, x.shape[0])
        workspace = F.get_workspace(config, group, device=x.device, num_local_tokens=bound,
                                    hidden_size=x.shape[1], topk=topk_experts.shape[1],
                                    dtype=x.dtype)
        if max_tokens is None:
            _EP_BOUNDS.setdefault(key, bound)
        # Checked once the workspace exists: the other ranks then go on to the step, whose
        # waits on this rank time out with an error naming it.
        if x.shape[0] > bound:
            named = (f"max_tokens={max_tokens}" if max_tokens is not None else
                     f"{bound}, the count of the first call without max_tokens of any layer of "
                     f"hidden size {x.shape[1]} and top-k {topk_experts.shape[1]} on this group "
                     "(pass max_tokens, ep_max_tokens in MoE, for a larger bound)")
            raise MoKInputError(f"{x.shape[0]} tokens exceed {named}; the ranks that did not "
                                "raise this will time out waiting on this rank")
        schedule = F.build_schedule(workspace, config, topk_experts,
                                    num_local_experts=w_rg.shape[0])
        y, context = F.forward(config, workspace, schedule, x, router_weights, w_sg, w_su, w_sd,
                               w_rg, w_ru, w_rd, swiglu_limit=swiglu_limit)
        ctx.state = (config, workspace, schedule, context, swiglu_limit)
        ctx.save_for_backward(x, router_weights, w_sg, w_su, w_sd, w_rg, w_ru, w_rd)
        return y

    @staticmethod
    def backward(ctx, d_y):
        config, workspace, schedule, context, swiglu_limit = ctx.state
        x, router_weights, *weights = ctx.saved_tensors
        try:  # ctx.state stays: a recomputing context serves a second backward
            d_x, d_rw, d_rg, d_ru, d_rd, d_sg, d_su, d_sd = F.backward(
                config, workspace, schedule, context, d_y.contiguous(), x, router_weights,
                *weights, swiglu_limit=swiglu_limit)
        except MoKInputError as error:
            if not context.used:
                raise
            raise MoKInputError(_SECOND_BACKWARD) from error
        return (None, None, None, None, d_x, None, d_rw, d_sg, d_su, d_sd, d_rg, d_ru, d_rd)


@torch.compiler.disable
def _expert_parallel_experts(*args) -> torch.Tensor:
    """_ExpertParallelExperts.apply, where torch.compile breaks the graph: the workspace's
    creation and the exchange run eagerly (collectives and host-side state)."""
    return _ExpertParallelExperts.apply(*args)


def moe_experts(
    x: torch.Tensor,
    topk_experts: torch.Tensor,
    router_weights: torch.Tensor,
    w_shared_gate: torch.Tensor | None,
    w_shared_up: torch.Tensor | None,
    w_shared_down: torch.Tensor | None,
    w_routed_gate: torch.Tensor,
    w_routed_up: torch.Tensor,
    w_routed_down: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    backend: Backend | str = Backend.MOK,
    group: dist.ProcessGroup | None = None,
    max_tokens: int | None = None,
    peer_timeout_s: float = 60.0,
    recompute_gate_up: bool = False,
    precision: str = "bf16",
    macrobatch_size: int | None = None,
) -> torch.Tensor:
    """The routed + shared experts as a differentiable function (docs/design.md section 1).

    x [T, H] bf16/fp16 (the kernels' dtypes; the reference backend takes any float dtype);
    topk_experts [T, k] int; router_weights [T, k] fp32; weights as mok.functional.forward.
    Weight views (e.g. slices of a fused gate_up parameter) are fine: strides are honoured and
    gradients flow back into the viewed parameter. group: an expert-parallel process group; the
    routed weights are then this rank's experts (mok.functional's contract). max_tokens: with a
    group, the most tokens a rank passes (each rank may pass fewer); default T, which every rank
    must then pass on the first call, and at most that many later; a rank passing more than the
    bound raises MoKInputError, and the others' waits on it time out after peer_timeout_s
    (MoKConfig's), reported as MoKDataError. recompute_gate_up:
    MoKConfig's (the default False keeps the gate/up pre-activations for the backward; True
    keeps h and recomputes them: slower, less memory). precision: MoKConfig's ("fp8": the
    experts' row GEMMs on e4m3 operands with blockwise scales; the reference backend ignores
    it). macrobatch_size: with a group, MoKConfig's (the symmetric buffer a ring of two windows
    of that many tokens a rank, whatever max_tokens is).
    """
    if Backend.parse(backend) is Backend.REFERENCE:
        return moe_reference(x, topk_experts, router_weights, w_shared_gate, w_shared_up,
                             w_shared_down, w_routed_gate, w_routed_up, w_routed_down,
                             swiglu_limit=swiglu_limit, group=group).to(x.dtype)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise MoKInputError(f"x must be a [T, H] tensor (flatten the leading dimensions first), "
                            f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
    if group is not None and dist.get_world_size(group) > 1:
        config = F.MoKConfig(recompute_gate_up=recompute_gate_up, precision=precision,
                             peer_timeout_s=peer_timeout_s, macrobatch_size=macrobatch_size)
        return _expert_parallel_experts(
            group, max_tokens, config, swiglu_limit, x, topk_experts, router_weights.float(),
            w_shared_gate, w_shared_up, w_shared_down, w_routed_gate, w_routed_up,
            w_routed_down)
    return _moe_forward(x, topk_experts, router_weights.float(), w_shared_gate, w_shared_up,
                        w_shared_down, w_routed_gate, w_routed_up, w_routed_down,
                        swiglu_limit, recompute_gate_up, precision)[0]


# -- the module -------------------------------------------------------------------------------

def _check_options(backend: Backend, *, swiglu_limit, recompute_gate_up, precision,
                   ep_max_tokens, ep_timeout_s, ep_macrobatch_size: int | None = None) -> None:
    """ValueError naming the first of a layer's options it cannot run with (MoE's and
    mok.integrations.huggingface's)."""
    if swiglu_limit is not None and not (_is_real(swiglu_limit)
                                         and 0 < swiglu_limit < math.inf):
        raise ValueError(f"swiglu_limit must be a positive finite number or None, got "
                         f"{swiglu_limit!r}")
    if not isinstance(recompute_gate_up, bool):
        raise ValueError(f"recompute_gate_up must be a bool, got {recompute_gate_up!r}")
    F.MoKConfig(precision=precision)  # checks it
    if ep_max_tokens is not None and not (_is_int(ep_max_tokens) and ep_max_tokens >= 1):
        raise ValueError(f"ep_max_tokens must be a positive integer or None, got "
                         f"{ep_max_tokens!r}")
    F.MoKConfig(peer_timeout_s=ep_timeout_s)  # checks it
    if ep_macrobatch_size is not None:
        try:
            F.MoKConfig(macrobatch_size=ep_macrobatch_size)
        except ValueError as error:
            raise ValueError(f"ep_macrobatch_size must be a positive multiple of "
                             f"{F.MoKConfig().minibatch_size} or None, got "
                             f"{ep_macrobatch_size!r}") from error


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sizes(hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 shared_intermediate_size: int, backend: Backend) -> None:
    """ValueError naming the first size MoE cannot be built with."""
    for name, value, least in (("hidden_size", hidden_size, 1),
                               ("intermediate_size", intermediate_size, 1),
                               ("num_experts", num_experts, 1), ("top_k", top_k, 1),
                               ("shared_intermediate_size", shared_intermediate_size, 0)):
        if not _is_int(value) or value < least:
            kind = "a positive integer" if least else "a non-negative integer"
            raise ValueError(f"{name} must be {kind}, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
    if backend is Backend.MOK:
        for name, value in (("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size),
                            ("shared_intermediate_size", shared_intermediate_size)):
            if value % 8:
                raise ValueError(f"{name}={value}: the mok backend needs a multiple of 8 "
                                 "(16-byte rows); backend='reference' takes any size")


class RouterScoring(enum.Enum):
    SOFTMAX = "softmax"  # softmax over experts, then top-k
    SIGMOID = "sigmoid"  # independent sigmoid scores (DeepSeek-V3), top-k of score + bias

    @classmethod
    def parse(cls, value: RouterScoring | str) -> RouterScoring:
        """The scoring named by value; ValueError listing the valid names otherwise."""
        return _parse_enum(cls, value, "RouterConfig.scoring", " (or RouterScoring)")


@dataclass(frozen=True)
class RouterConfig:
    """Router options.

    scoring: softmax or sigmoid scores (a RouterScoring or its name, "softmax" or "sigmoid";
        stored as RouterScoring).
    normalize_topk: rescale the k selected weights to sum to 1.
    aux_loss_coef: weight of the load-balancing loss E * sum_e f_e * P_e (Switch Transformer;
        DeepSeek-V2's expert-level balance loss), with f_e the fraction of the T * k routes that
        go to expert e (sum_e f_e = 1) and P_e the mean over tokens of expert e's score,
        normalized over the experts. Hugging Face transformers' load_balancing_loss_func
        (Mixtral, Qwen3-MoE) counts f_e over tokens instead (sum_e f_e = k): it is k times this
        loss, so aux_loss_coef = k * c weights the balance as router_aux_loss_coef = c does there.
    z_loss_coef: weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE).
    bias_update_rate: with sigmoid scoring only, the auxiliary-loss-free balancing step: after
        each training forward, expert_bias += rate * sign(mean load - load) (DeepSeek-V3). The
        bias steers selection only; the weights come from the unbiased scores.
    routed_scaling_factor: multiplies the routed experts' weights.
    The coefficients and the rate are finite and non-negative; the scaling factor is finite and
    positive. ValueError names an option out of range.
    """

    scoring: RouterScoring = RouterScoring.SOFTMAX
    normalize_topk: bool = True
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scoring", RouterScoring.parse(self.scoring))
        if not isinstance(self.normalize_topk, bool):
            raise ValueError(f"RouterConfig.normalize_topk must be a bool, got "
                             f"{self.normalize_topk!r}")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if not (_is_real(value) and 0 <= value < math.inf):
                raise ValueError(f"RouterConfig.{name} must be a finite non-negative number, "
                                 f"got {value!r}")
        factor = self.routed_scaling_factor
        if not (_is_real(factor) and 0 < factor < math.inf):
            raise ValueError(f"RouterConfig.routed_scaling_factor must be a finite positive "
                             f"number, got {factor!r}")
        if self.bias_update_rate and self.scoring is not RouterScoring.SIGMOID:
            raise ValueError(f"RouterConfig.bias_update_rate={self.bias_update_rate!r} needs "
                             f"scoring='sigmoid' (softmax scoring routes without the bias); "
                             "set scoring=RouterScoring.SIGMOID or leave bias_update_rate at 0")


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class RoutingOutput:
    """topk_experts [T, k] int64; weights [T, k] fp32; logits [T, E] fp32;
    tokens_per_expert [E] int64 (device); aux_loss scalar fp32 (0 when no loss is enabled).
    T counts the tokens of every leading dimension of the router's input."""

    topk_experts: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor


class Router(nn.Module):
    """Linear scores over experts, top-k selection and the balancing losses, in fp32 (also under
    torch.autocast); expert_bias stays fp32 whatever dtype the module is cast to.

    With RouterConfig.bias_update_rate, a training forward routes with the bias and leaves its
    load pending: the next forward routes with the updated bias (next_bias) and, in training,
    stores it in expert_bias. So expert_bias is the bias of the last training forward;
    state_dict saves next_bias, the one the next forward routes with, and loading one drops the
    pending load. A forward recomputed inside the backward (activation checkpointing) routes
    with the bias its first run used and changes nothing: the router keeps the bias and the
    logits' column sums of its last RECOMPUTE_HISTORY training forwards and, on the device,
    takes the latest of them whose sums equal the recomputed ones (the latest not yet
    recomputed where several match; expert_bias where none does). load_group: the
    ranks whose loads add up to the one the update sees (MoE passes its expert-parallel group,
    so that the replicated router's bias stays the same on every rank).

    forward(x [..., H]) routes the tokens of x flattened to [T, H], T the product of the leading
    dimensions (as MoE does): its outputs are [T, k] and [T, E] whatever x's shape.
    With top_k=1 and normalize_topk=True every token's weight is 1, so the task loss gives the
    router no gradient: without aux_loss_coef, z_loss_coef or bias_update_rate the constructor
    warns (UserWarning).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 config: RouterConfig = RouterConfig(), *, load_group=None, device=None,
                 dtype=None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
        if not isinstance(config, RouterConfig):
            raise ValueError(f"the router config must be a RouterConfig, got "
                             f"{type(config).__name__}")
        if top_k == 1 and config.normalize_topk and not (
                config.aux_loss_coef or config.z_loss_coef or config.bias_update_rate):
            warnings.warn(
                "top_k=1 with normalize_topk=True gives every token the weight 1, so the router "
                "gets no gradient from the loss, and with aux_loss_coef, z_loss_coef and "
                "bias_update_rate at 0 it never learns: set RouterConfig(normalize_topk=False) "
                "(the weight is then the expert's score, as in Switch Transformer) or enable "
                "a balancing loss", UserWarning, stacklevel=2)
        self.num_experts, self.top_k, self.config = num_experts, top_k, config
        self.load_group = load_group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device,
                                               dtype=dtype))
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device,
                                                        dtype=torch.float32))
        # The last training forward's tokens per expert, whose bias update is pending.
        self.register_buffer("expert_load", torch.zeros(num_experts, device=device,
                                                        dtype=torch.float32), persistent=False)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.register_state_dict_post_hook(_save_next_bias)
        self.register_load_state_dict_pre_hook(_drop_pending_load)
        # The biases of the last training forwards, for their recomputation (not buffers: not
        # saved, nor broadcast by DDP).
        self._bias_history = _BiasHistory(num_experts, self.expert_bias.device)

    def next_bias(self) -> torch.Tensor:
        """The bias the next forward routes with: expert_bias plus the pending update,
        rate * sign(mean load - load) (DeepSeek-V3's balancing step)."""
        rate = self.config.bias_update_rate
        if not rate:
            return self.expert_bias
        load = self.expert_load
        return self.expert_bias + rate * torch.sign(load.mean() - load)

    def _apply(self, fn, recurse=True):
        # .to(dtype), .half() and the like cast floating buffers: these stay fp32 (a bf16 bias
        # rounds the balancing steps away) and move only to fn's device.
        kept = {name: self._buffers[name] for name in ("expert_bias", "expert_load")}
        for name in kept:
            self._buffers[name] = None
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buffer in kept.items():
                self._buffers[name] = buffer.to(fn(buffer[:0]).device)
            self._bias_history = self._bias_history.to(self.expert_bias.device)
        return self

    def forward(self, x: torch.Tensor) -> RoutingOutput:
        hidden_size = self.weight.shape[1]
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise MoKInputError(f"the router's input has shape {shape}; it takes a tensor "
                                f"[..., {hidden_size}] (hidden_size last)")
        x = x.reshape(-1, hidden_size)
        cfg = self.config
        updates = bool(cfg.bias_update_rate) and self.training
        recomputed = updates and _in_backward()
        logits = _fp32_linear(x, self.weight)
        if updates:
            fingerprint = logits.detach().sum(dim=0)
            if recomputed:
                bias = self._bias_history.find(fingerprint, self.expert_bias)
            else:
                bias = self.next_bias()
                self._bias_history.add(fingerprint, bias)
        else:
            bias = self.expert_bias
        if cfg.scoring is RouterScoring.SOFTMAX:
            scores = logits.softmax(dim=-1)
            selection = scores
        else:
            scores = logits.sigmoid()
            selection = scores + bias
        topk_experts = selection.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, topk_experts)
        if cfg.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        weights = weights * cfg.routed_scaling_factor
        tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        tokens_per_expert.scatter_add_(0, topk_experts.reshape(-1),
                                       torch.ones_like(topk_experts.reshape(-1)))
        aux_loss = logits.new_zeros(())
        if cfg.aux_loss_coef and x.shape[0]:
            fraction = tokens_per_expert.float() / (x.shape[0] * self.top_k)
            probs = scores / scores.sum(dim=-1, keepdim=True)
            aux_loss = aux_loss + cfg.aux_loss_coef * self.num_experts * (
                fraction * probs.mean(dim=0)).sum()
        if cfg.z_loss_coef and x.shape[0]:
            aux_loss = aux_loss + cfg.z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
        if updates and not recomputed:
            with torch.no_grad():
                self.expert_bias.copy_(bias)
                self.expert_load.copy_(tokens_per_expert)
                if self.load_group is not None:  # no host sync: stream-ordered on a GPU
                    dist.all_reduce(self.expert_load, group=self.load_group)
        return RoutingOutput(topk_experts, weights, logits, tokens_per_expert, aux_loss)


RECOMPUTE_HISTORY = 64  # training forwards whose bias a recomputation can find


class _BiasHistory:
    """A ring of the last RECOMPUTE_HISTORY training forwards' (logits' column sums, bias),
    written and searched on the device (no host sync; its slot is a device tensor, so a
    compiled forward sees no changing Python state)."""

    def __init__(self, num_experts: int, device: torch.device) -> None:
        size = RECOMPUTE_HISTORY
        self.fingerprints = torch.zeros(size, num_experts, device=device, dtype=torch.float32)
        self.biases = torch.zeros(size, num_experts, device=device, dtype=torch.float32)
        # 0: empty, 1: not yet recomputed, 2: recomputed.
        self.state = torch.zeros(size, device=device, dtype=torch.int8)
        self.next_slot = torch.zeros(1, device=device, dtype=torch.int64)

    def to(self, device: torch.device) -> _BiasHistory:
        if self.state.device == device:
            return self
        moved = _BiasHistory.__new__(_BiasHistory)
        for name in ("fingerprints", "biases", "state", "next_slot"):
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def add(self, fingerprint: torch.Tensor, bias: torch.Tensor) -> None:
        slot = self.next_slot
        self.fingerprints.index_copy_(0, slot, fingerprint[None])
        self.biases.index_copy_(0, slot, bias.detach()[None])
        self.state.index_fill_(0, slot, 1)
        self.next_slot.add_(1).remainder_(RECOMPUTE_HISTORY)

    def find(self, fingerprint: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
        """The bias of the latest forward whose fingerprint equals this one, preferring one not
        yet recomputed (and marking it recomputed); default where none matches."""
        size = RECOMPUTE_HISTORY
        match = (self.fingerprints == fingerprint).all(dim=1) & (self.state > 0)
        fresh = match & (self.state == 1)
        pick = torch.where(fresh.any(), fresh, match)
        slots = torch.arange(size, device=match.device)
        newness = size - (self.next_slot - 1 - slots) % size  # the latest slot scores size
        index = (pick * newness).argmax().reshape(1)
        found = pick.any()
        kept = self.state.index_select(0, index)
        self.state.index_copy_(0, index, torch.where(found, 2, kept).to(torch.int8))
        return torch.where(found, self.biases.index_select(0, index)[0], default)


def _fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in fp32, autocast or not."""
    device = x.device.type
    with (torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device)
          else contextlib.nullcontext()):
        return torch_f.linear(x.float(), weight.float())


def _in_backward() -> bool:
    """Whether this runs inside autograd's backward: a forward recomputed by activation
    checkpointing (False while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def _save_next_bias(router: Router, state_dict, prefix, local_metadata) -> None:
    state_dict[prefix + "expert_bias"] = router.next_bias().detach()


def _drop_pending_load(router: Router, state_dict, prefix, *args) -> None:
    with torch.no_grad():
        router.expert_load.zero_()


# The input dtypes MoE takes, by backend: the kernels' and fp32 (computed in bf16); the
# reference computes in PyTorch and takes float64 as well.
_INPUT_DTYPES = {
    Backend.MOK: (torch.bfloat16, torch.float16, torch.float32),
    Backend.REFERENCE: (torch.bfloat16, torch.float16, torch.float32, torch.float64),
}


class MoE(nn.Module):
    """Mixture-of-experts block: router, optional shared expert, routed SwiGLU experts.

    Parameters: router.weight [E, H]; w_gate, w_up [E_local, I, H]; w_down [E_local, H, I]
    (E_local = E, or E / P with an expert-parallel `ep_group` of P ranks: this rank's experts
    [rank * E_local, (rank + 1) * E_local); the router and shared expert are replicated; with
    `ep_max_tokens` ranks may pass different numbers of tokens, at most that many, and without
    it the same number on the first call and at most that many later (the first call of any
    such layer of the same hidden size and top_k on the group sets the bound);
    `ep_timeout_s` bounds a wait on another rank, MoKConfig.peer_timeout_s;
    `ep_macrobatch_size`: MoKConfig.macrobatch_size, the symmetric buffer a ring of two
    windows of that many tokens a rank, however many a rank passes); and with
    shared_intermediate_size > 0: shared_gate, shared_up [I_s, H], shared_down [H, I_s].
    forward(hidden_states [..., H]) -> [..., H]. After each forward: `aux_loss` (add it to the
    training loss) and `tokens_per_expert` [E] (device tensor, no host sync) hold that call's
    values. The experts' gate/up pre-activations are kept for the backward, which writes their
    gradients over them, so a graph runs one backward (a second, with retain_graph=True, raises
    MoKInputError); recompute_gate_up=True keeps h instead and recomputes them
    (MoKConfig.recompute_gate_up): I fewer values per route of activations, a slower backward,
    and backwards through the graph may repeat.
    Under expert parallelism state_dict also holds `ep_expert_ids`, the global ids of the
    rank's experts, and load_state_dict refuses a state dict of other experts (MoKInputError).
    precision="fp8" runs the experts' row GEMMs on e4m3 operands with blockwise scales
    (MoKConfig.precision), keeping an e4m3 copy of the
    expert weights per optimizer step.

    Compute dtype: the autocast dtype under torch.autocast (the output then has that dtype, as
    nn.Linear's would); otherwise the parameters' dtype when bf16/fp16; fp32 parameters are cast
    to bf16 for the kernels (gradients flow back in fp32) and the output has the input's dtype;
    the reference backend computes fp32 parameters in fp32. Inputs: bf16, fp16 or fp32, and
    float64 with backend="reference" (MoKInputError otherwise).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        shared_intermediate_size: int = 0,
        *,
        router: RouterConfig = RouterConfig(),
        swiglu_limit: float | None = None,
        ep_group: dist.ProcessGroup | None = None,
        ep_max_tokens: int | None = None,
        ep_timeout_s: float = 60.0,
        ep_macrobatch_size: int | None = None,
        backend: Backend | str = Backend.MOK,
        recompute_gate_up: bool = False,
        precision: str = "bf16",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        backend = Backend.parse(backend)
        _check_sizes(hidden_size, intermediate_size, num_experts, top_k,
                     shared_intermediate_size, backend)
        _check_options(backend, swiglu_limit=swiglu_limit, recompute_gate_up=recompute_gate_up,
                       precision=precision, ep_max_tokens=ep_max_tokens,
                       ep_timeout_s=ep_timeout_s, ep_macrobatch_size=ep_macrobatch_size)
        ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not a multiple of the "
                             f"expert-parallel group's {ep_size} ranks")
        self.ep_group = ep_group if ep_size > 1 else None
        self.ep_max_tokens = ep_max_tokens
        self.ep_timeout_s = ep_timeout_s
        self.ep_macrobatch_size = ep_macrobatch_size
        num_local = num_experts // ep_size
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.shared_intermediate_size = shared_intermediate_size
        self.swiglu_limit = swiglu_limit
        self.backend = backend
        self.recompute_gate_up = recompute_gate_up
        self.precision = precision
        factory = dict(device=device, dtype=dtype)
        self.router = Router(hidden_size, num_experts, top_k, router, load_group=self.ep_group,
                             **factory)
        self.w_gate = nn.Parameter(torch.empty(num_local, intermediate_size, hidden_size,
                                               **factory))
        self.w_up = nn.Parameter(torch.empty(num_local, intermediate_size, hidden_size,
                                             **factory))
        self.w_down = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size,
                                               **factory))
        if shared_intermediate_size:
            self.shared_gate = nn.Parameter(torch.empty(shared_intermediate_size, hidden_size,
                                                        **factory))
            self.shared_up = nn.Parameter(torch.empty(shared_intermediate_size, hidden_size,
                                                      **factory))
            self.shared_down = nn.Parameter(torch.empty(hidden_size, shared_intermediate_size,
                                                        **factory))
        else:
            self.shared_gate = self.shared_up = self.shared_down = None
        self.reset_parameters()
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.first_expert = (dist.get_rank(ep_group) * num_local if self.ep_group is not None
                             else 0)
        if self.ep_group is not None:
            self.register_state_dict_post_hook(_save_expert_ids)
        self.register_load_state_dict_pre_hook(_check_expert_ids)

    def __getstate__(self) -> dict:
        """The module's state, the last call's aux_loss without its graph (deepcopy and pickle
        take only graph leaves)."""
        state = dict(self.__dict__)
        if state.get("aux_loss") is not None:
            state["aux_loss"] = state["aux_loss"].detach()
        return state

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        for weight in (self.w_gate, self.w_up, self.w_down, self.shared_gate, self.shared_up,
                       self.shared_down):
            if weight is not None:
                bound = 1.0 / math.sqrt(weight.shape[-1])
                nn.init.uniform_(weight, -bound, bound)

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        kernel_dtype = self.w_gate.dtype in (torch.bfloat16, torch.float16)
        if kernel_dtype or self.backend is Backend.REFERENCE:
            return self.w_gate.dtype
        return torch.bfloat16

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self._check_input(hidden_states)
        x = hidden_states.reshape(-1, self.hidden_size)
        routing = self.router(x)
        self.aux_loss, self.tokens_per_expert = routing.aux_loss, routing.tokens_per_expert
        dtype = self.compute_dtype(x)
        out_dtype = dtype if torch.is_autocast_enabled(x.device.type) else hidden_states.dtype
        shared = [w.to(dtype) if w is not None else None
                  for w in (self.shared_gate, self.shared_up, self.shared_down)]
        with torch.autocast(x.device.type, enabled=False):
            y = moe_experts(x.to(dtype), routing.topk_experts, routing.weights, *shared,
                            self.w_gate.to(dtype), self.w_up.to(dtype), self.w_down.to(dtype),
                            swiglu_limit=self.swiglu_limit, backend=self.backend,
                            group=self.ep_group, max_tokens=self.ep_max_tokens,
                            peer_timeout_s=self.ep_timeout_s,
                            recompute_gate_up=self.recompute_gate_up,
                            precision=self.precision,
                            macrobatch_size=self.ep_macrobatch_size)
        return y.to(out_dtype).view(hidden_states.shape)

    def _check_input(self, hidden_states: torch.Tensor) -> None:
        """hidden_states [..., H]: bf16, fp16 or fp32 (float64 too for the reference backend),
        on the parameters' device."""
        if not isinstance(hidden_states, torch.Tensor):
            raise MoKInputError(f"hidden_states must be a torch.Tensor, got "
                                f"{type(hidden_states).__name__}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise MoKInputError(f"hidden_states has shape {tuple(hidden_states.shape)}; its last "
                                f"dimension must be hidden_size={self.hidden_size}")
        backend = Backend.parse(self.backend)
        dtypes = _INPUT_DTYPES[backend]
        if hidden_states.dtype not in dtypes:
            names = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
            raise MoKInputError(f"hidden_states has dtype {hidden_states.dtype}; MoE with "
                                f"backend={backend.value!r} takes floating-point inputs "
                                f"of dtype {names}: cast the input to one of them")
        if hidden_states.device != self.w_gate.device:
            raise MoKInputError(f"hidden_states is on {hidden_states.device}, the module's "
                                f"parameters on {self.w_gate.device}")

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"shared_intermediate_size={self.shared_intermediate_size}, "
                f"backend={self.backend.value}, precision={self.precision}")


_EXPERT_IDS = "ep_expert_ids"


def _expert_range(first: int, count: int) -> str:
    return f"experts {first}..{first + count - 1}"


def _own_expert_ids(module: MoE) -> list[int]:
    """The global ids of the experts the module holds."""
    return list(range(module.first_expert, module.first_expert + module.w_gate.shape[0]))


def _save_expert_ids(module: MoE, state_dict, prefix, local_metadata) -> None:
    """An expert-parallel module's state dict names the global ids of the experts it holds."""
    state_dict[prefix + _EXPERT_IDS] = torch.tensor(_own_expert_ids(module))


def _check_expert_ids(module: MoE, state_dict, prefix, *args) -> None:
    """Refuse a state dict holding other experts than the module's: another rank's, or one
    rank's loaded into a module holding every expert."""
    saved = state_dict.pop(prefix + _EXPERT_IDS, None)
    if saved is None:
        return
    saved = saved.tolist()
    own = _own_expert_ids(module)
    if saved == own and module.ep_group is not None:
        return
    held = _expert_range(saved[0], len(saved)) if saved else "no experts"
    if module.ep_group is None:
        raise MoKInputError(
            f"the state dict at {prefix or 'the top'!r} holds {held}, one rank's share under "
            f"expert parallelism; this module holds every expert: load "
            f"it on that rank of a module with ep_group, or concatenate the ranks' w_gate, "
            f"w_up and w_down in rank order (dropping {prefix + _EXPERT_IDS!r})")
    rank = dist.get_rank(module.ep_group)
    raise MoKInputError(
        f"the state dict at {prefix or 'the top'!r} holds {held}; this module (rank {rank} of "
        f"its expert-parallel group) holds {_expert_range(own[0], len(own))}: load each "
        f"rank's own state dict")


def prepare_ddp(model: nn.Module) -> list[str]:
    """Ready a model whose MoE layers hold this rank's experts (ep_group) for
    torch.nn.parallel.DistributedDataParallel over the same ranks; call it before wrapping.

    DDP would copy rank 0's experts over every rank's own (its broadcast at start) and average
    different experts' gradients, silently. The experts' parameters are left out of DDP
    (returned, by name), and their gradients, which already hold every rank's tokens, are
    divided by the group's size in the backward, as DDP averages the replicated parameters'.
    A model without such layers is left as it is (and [] returned).
    """
    from torch.nn.parallel import DistributedDataParallel

    wrapped = [prefix or "the model" for prefix, module in model.named_modules()
               if isinstance(module, DistributedDataParallel)]
    if wrapped and any(isinstance(module, MoE) and module.ep_group is not None
                       for module in model.modules()):
        raise MoKInputError(
            f"prepare_ddp: {wrapped[0]} is already wrapped in DistributedDataParallel, whose "
            f"start copied rank 0's experts over every rank's own: call prepare_ddp on the "
            f"model before wrapping it")
    names = []
    for prefix, module in model.named_modules():
        if not isinstance(module, MoE) or module.ep_group is None:
            continue
        size = dist.get_world_size(module.ep_group)
        for name in ("w_gate", "w_up", "w_down"):
            names.append(f"{prefix}.{name}" if prefix else name)
            parameter = getattr(module, name)
            if not getattr(parameter, "_mok_ddp_scaled", False):
                parameter.register_hook(lambda grad, size=size: grad / size)
                parameter._mok_ddp_scaled = True
    if names:
        # DDP's reducer names a parameter of the wrapped module itself ".name" (module name "")
        # where its broadcast says "name": both are given.
        ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        added = names + [f".{name}" for name in names if "." not in name]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, ignored + [name for name in added if name not in ignored])
    return names
