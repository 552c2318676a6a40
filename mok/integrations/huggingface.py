"""Swap the sparse MoE blocks of a Hugging Face transformers model in place for mok's layer.

Legend: T tokens, H hidden, I expert intermediate, I_s shared intermediate, E experts, k top-k.

    from mok.integrations.huggingface import patch_moe_blocks
    model = AutoModelForCausalLM.from_config(config)      # or from_pretrained(...)
    patch_moe_blocks(model)                               # returns the number of blocks replaced

Supported block classes (where the installed transformers has them; transformers >= 5.17):

| family | block | router | experts | shared experts |
|---|---|---|---|---|
| qwen3_moe | Qwen3MoeSparseMoeBlock | Qwen3MoeTopKRouter | Qwen3MoeExperts | - |
| mixtral | MixtralSparseMoeBlock | MixtralTopKRouter | MixtralExperts | - |
| olmoe | OlmoeSparseMoeBlock | OlmoeTopKRouter | OlmoeExperts | - |
| deepseek_v3 | DeepseekV3MoE | DeepseekV3TopkRouter | DeepseekV3Experts | DeepseekV3MLP |
| deepseek_v2 | DeepseekV2Moe | DeepseekV2TopkRouter | DeepseekV2Experts | DeepseekV2MLP |
| glm4_moe | Glm4MoeMoE | Glm4MoeTopkRouter | Glm4MoeExperts | Glm4MoeMLP |
| ernie4_5_moe | Ernie4_5_MoeSparseMoeBlock | ...TopKRouter | ...Experts | ...MLP (optional) |
| qwen2_moe | Qwen2MoeSparseMoeBlock | Qwen2MoeTopKRouter | Qwen2MoeExperts | Qwen2MoeMLP, gated |
| qwen3_next | Qwen3NextSparseMoeBlock | Qwen3NextTopKRouter | Qwen3NextExperts | ...MLP, gated |
| hunyuan_v1_moe | HunYuanMoEV1Moe | HunYuanMoEV1Gate (its wg) | HunYuanMoEV1Experts | shared_mlp |
| flex_olmo | FlexOlmoSparseMoeBlock | FlexOlmoTopKRouter | FlexOlmoExperts | - |

Layout facts this relies on (checked at patch time, an unexpected layout raises ValueError):
- experts.gate_up_proj [E, 2I, H] holds gate rows [:, :I] then up rows [:, I:] (concatenated,
  not interleaved; the original splits its output with chunk(2)); experts.down_proj [E, H, I].
  Both are nn.Linear's [out, in] layout, so gate_up_proj[:, :I], gate_up_proj[:, I:] and down_proj
  are mok's w_gate, w_up [E, I, H] and w_down [E, H, I] as views: no copy, and gradients land in
  the fused parameter. The activation is SiLU: expert(x) = down @ (silu(gate @ x) * (up @ x)).
- the router module `gate` maps x [T, H] to (router_logits [T, E], topk_weights [T, k],
  topk_ids [T, k]); its scoring (softmax, top-k, optional renormalization; DeepSeek-V3's sigmoid
  scores with e_score_correction_bias, group-limited top-k, normalization and
  routed_scaling_factor) stays the model's own: the replacement calls it. transformers records
  router_logits (for output_router_logits and the auxiliary loss) with a hook on the router
  module, so calling it keeps that working.
- the shared expert (DeepSeek's, GLM's and ERNIE's shared_experts) is an MLP of bias-free
  nn.Linear gate_proj, up_proj [I_s, H] and down_proj [H, I_s] with SiLU: exactly mok's shared
  expert, so it runs inside mok's kernels (HunYuan's shared_mlp too). Qwen2-MoE's and
  Qwen3-Next's shared_expert is scaled per token by sigmoid(shared_expert_gate(x)): it runs
  through its own forward, scaled so.
  Checked at every call: a shared expert that is no longer that (an adapter such as LoRA or a
  quantized layer in place of a Linear, hooks on it or its layers, a size the kernels cannot
  run) runs through its own forward, added to the routed experts' output as the original does.
- every block's forward maps hidden_states [B, S, H] to a tensor [B, S, H] of the input's dtype
  (no router-logit tuple in transformers 5.x); the replacement does the same.

The experts module's own forward is not called (its weights are read directly), so hooks on it,
such as accelerate's weight offloading, and config._experts_implementation do not apply to patched
blocks; an experts module replaced or wrapped after patching raises MoKInputError.
transformers' own expert-parallel experts and quantized experts are refused. The hooks and the
plain attributes (config, top_k, ...) of a block move to its replacement (the same hook dicts,
so their handles still remove them).

Expert parallelism (`patch_moe_blocks(model, ep_group=group)`, P ranks, the same model on each):
rank r computes experts [r * E / P, (r + 1) * E / P) for the tokens of every rank (mok's
expert-parallel layer; every rank passes the same number of tokens, or with ep_max_tokens any
number up to it). The parameters stay whole and
replicated, so checkpoints are unchanged: on rank r the gradients of the other ranks' experts are
zero and those of its own hold every rank's tokens' contributions, so the usual data-parallel
gradient all-reduce (DDP's mean over ranks) yields the data-parallel gradient of every parameter.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mok.errors import MoKInputError
from mok.nn import Backend, _check_options, moe_experts

__all__ = ["MokSparseMoeBlock", "patch_moe_blocks", "supported_block_types"]


@dataclass(frozen=True)
class Family:
    """A transformers family whose sparse MoE blocks can be replaced: transformers.models.<name>,
    its block class, the attribute of its shared expert (None: none) and of the per-token
    sigmoid gate on that expert's output (Qwen2-MoE's shared_expert_gate; None: none), and
    where below the router its weight is (checked against the experts' count)."""

    name: str
    block: str
    shared: str | None = None
    shared_gate: str | None = None
    router_weight: str = "weight"  # the router's [E, H] weight, a dotted path below `gate`


FAMILIES: tuple[Family, ...] = (
    Family("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    Family("mixtral", "MixtralSparseMoeBlock"),
    Family("olmoe", "OlmoeSparseMoeBlock"),
    Family("deepseek_v3", "DeepseekV3MoE", shared="shared_experts"),
    Family("deepseek_v2", "DeepseekV2Moe", shared="shared_experts"),
    Family("glm4_moe", "Glm4MoeMoE", shared="shared_experts"),
    Family("ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", shared="shared_experts"),
    Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", shared="shared_expert",
           shared_gate="shared_expert_gate"),
    Family("qwen3_next", "Qwen3NextSparseMoeBlock", shared="shared_expert",
           shared_gate="shared_expert_gate"),
    Family("hunyuan_v1_moe", "HunYuanMoEV1Moe", shared="shared_mlp", router_weight="wg.weight"),
    Family("flex_olmo", "FlexOlmoSparseMoeBlock"),
)

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# A module's hooks, which the replacement block takes over (the same dicts, so the handles that
# registered them still remove them).
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


@functools.cache
def supported_block_types() -> dict[type[nn.Module], str]:
    """The block classes of the installed transformers that can be replaced, -> family name."""
    return {block_type: family.name for block_type, family in _block_families().items()}


@functools.cache
def _block_families() -> dict[type[nn.Module], Family]:
    types: dict[type[nn.Module], Family] = {}
    for family in FAMILIES:
        try:
            module = importlib.import_module(
                f"transformers.models.{family.name}.modeling_{family.name}")
        except ImportError:
            continue
        block_type = getattr(module, family.block, None)
        if block_type is not None:
            types[block_type] = family
    return types


def _silu_types() -> tuple[type[nn.Module], ...]:
    from transformers import activations

    found = getattr(activations, "SiLUActivation", None)
    return (nn.SiLU,) if found is None else (nn.SiLU, found)


def _check_experts(experts: nn.Module, router: nn.Module, where: str,
                   router_weight: str = "weight") -> None:
    """Raise ValueError unless `experts` is the layout the module docstring describes."""
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise ValueError(f"{where}: experts need gate_up_proj and down_proj tensors")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"{where}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} must be [E, 2I, H] and [E, H, I]")
    num_experts, two_i, hidden = gate_up.shape
    if tuple(down.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"{where}: down_proj {tuple(down.shape)} does not match gate_up_proj "
                         f"{tuple(gate_up.shape)} ([E, H, I] against [E, 2I, H])")
    if gate_up.dtype not in _WEIGHT_DTYPES or down.dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"{where}: expert weights of dtype {gate_up.dtype} (quantized?) are "
                         "not supported")
    # The flags transformers' use_experts_implementation sets (absent in some versions: their
    # absence means the default, the layout above).
    layout = {"is_transposed": False, "is_concatenated": True, "has_bias": False,
              "has_gate": True, "has_post_expert_norm": False}
    for flag, expected in layout.items():
        if bool(getattr(experts, flag, expected)) != expected:
            raise ValueError(f"{where}: experts.{flag}={not expected} is not supported")
    if getattr(experts, "_is_expert_parallel", False):
        raise NotImplementedError(f"{where}: expert parallelism is not supported")
    if not isinstance(getattr(experts, "act_fn", None), _silu_types()):
        raise ValueError(f"{where}: the experts' activation "
                         f"{type(getattr(experts, 'act_fn', None)).__name__} is not SiLU; mok "
                         "computes silu(gate) * up")
    from transformers.integrations import moe as hf_moe

    default_gate = getattr(hf_moe, "_default_apply_gate", None)
    apply_gate = getattr(type(experts), "_apply_gate", default_gate)
    if apply_gate is not default_gate:
        raise ValueError(f"{where}: experts override _apply_gate; only act(gate) * up is "
                         "supported")
    weight = functools.reduce(lambda owner, name: getattr(owner, name, None),
                              router_weight.split("."), router)
    if not isinstance(weight, torch.Tensor) or weight.shape[0] != num_experts:
        raise ValueError(f"{where}: the router scores {getattr(weight, 'shape', None)} "
                         f"experts, the experts hold {num_experts} (expert parallelism?)")


def _fused_shared(shared: nn.Module, hidden: int) -> bool:
    """Whether mok's kernels can run `shared` themselves: a bias-free SiLU MLP of plain
    nn.Linear gate_proj, up_proj [I_s, H] and down_proj [H, I_s] (forward not overridden,
    16/32-bit weights, I_s a positive multiple of 8, no hooks on it or its layers). Anything
    else (LoRA or quantized layers, hooks) runs through its own forward."""
    linears = [getattr(shared, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(layer, nn.Linear) and type(layer).forward is nn.Linear.forward
               and layer.bias is None and layer.weight.dtype in _WEIGHT_DTYPES
               and not _has_hooks(layer) for layer in linears):
        return False
    gate, up, down = (layer.weight for layer in linears)
    size = gate.shape[0]
    return (tuple(gate.shape) == (size, hidden) and tuple(up.shape) == (size, hidden)
            and tuple(down.shape) == (hidden, size) and size > 0 and size % 8 == 0
            and isinstance(getattr(shared, "act_fn", None), _silu_types())
            and not _has_hooks(shared))


def _has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in _HOOK_DICTS[:7])


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The kernels' dtype: autocast's, else the weights' when bf16/fp16, else bf16."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        if dtype in _KERNEL_DTYPES:
            return dtype
    return weight.dtype if weight.dtype in _KERNEL_DTYPES else torch.bfloat16


class MokSparseMoeBlock(nn.Module):
    """A transformers sparse MoE block whose experts run in mok's fused layer.

    It holds the original block's submodules (router `gate`, `experts`, and `shared_experts`
    where present), parameters and buffers under the same names and in the same order, so
    state_dict keys, parameter objects and checkpoints are the original's. forward(hidden_states
    [B, S, H]) -> [B, S, H] in hidden_states' dtype, like the original block: the model's router
    picks the experts and their weights, then mok.nn.moe_experts computes the routed experts and
    the shared expert in one call.

    Compute dtype (backend "mok"): the autocast dtype under torch.autocast; otherwise the expert
    weights' dtype when bf16/fp16; fp32 weights are cast to bf16 for the kernels (gradients flow
    back in fp32). Backend "reference": mok's pure-PyTorch reference on the tensors as they are
    (computed in fp32), for debugging.
    """

    def __init__(self, block: nn.Module, *, backend: Backend | str = Backend.MOK,
                 swiglu_limit: float | None = None,
                 ep_group: dist.ProcessGroup | None = None, ep_max_tokens: int | None = None,
                 ep_timeout_s: float = 60.0, recompute_gate_up: bool = False,
                 precision: str = "bf16", ep_macrobatch_size: int | None = None) -> None:
        super().__init__()
        where = type(block).__name__
        for name, parameter in block._parameters.items():
            self.register_parameter(name, parameter)
        for name, buffer in block._buffers.items():
            self.register_buffer(name, buffer,
                                 persistent=name not in block._non_persistent_buffers_set)
        for name, child in block._modules.items():
            self.add_module(name, child)
        for name in _HOOK_DICTS:  # the block's hooks, the same dicts
            if hasattr(block, name):
                object.__setattr__(self, name, getattr(block, name))
        for name, value in vars(block).items():  # its plain attributes (config, top_k, ...)
            if not name.startswith("_") and name not in vars(self) and name != "training":
                object.__setattr__(self, name, value)
        self.gate: nn.Module
        self.experts: nn.Module
        if not isinstance(getattr(block, "gate", None), nn.Module):
            raise ValueError(f"{where}: no router module `gate`")
        if not isinstance(getattr(block, "experts", None), nn.Module):
            raise ValueError(f"{where}: no experts module `experts`")
        family = _block_families().get(type(block), Family("", where, shared="shared_experts"))
        _check_experts(self.experts, self.gate, where, family.router_weight)
        # The shared expert's attribute and its gate's (Family), where the block has them.
        self._shared_name = family.shared if isinstance(
            self._modules.get(family.shared or ""), nn.Module) else None
        self._shared_gate_name = family.shared_gate if self._shared_name else None
        if self._shared_gate_name is not None and not isinstance(
                self._modules.get(self._shared_gate_name), nn.Module):
            raise ValueError(f"{where}: no shared expert gate `{self._shared_gate_name}`")
        if "shared_experts" not in self._modules:
            self.shared_experts = None
        self.block_type = where
        self.backend = Backend.parse(backend)
        num_experts, two_i, hidden = self.experts.gate_up_proj.shape
        if self.backend is Backend.MOK:
            for name, value in (("hidden size", hidden), ("expert intermediate size", two_i // 2)):
                if value % 8:
                    raise ValueError(f"{where}: {name} {value}: the mok backend needs a multiple "
                                     "of 8 (16-byte rows); backend='reference' takes any size")
        self.ep_group = ep_group if ep_group is not None and dist.get_world_size(ep_group) > 1 \
            else None
        self._local_experts = slice(None)
        if self.ep_group is not None:
            ranks, rank = dist.get_world_size(self.ep_group), dist.get_rank(self.ep_group)
            num_experts = self.experts.gate_up_proj.shape[0]
            if num_experts % ranks:
                raise ValueError(f"{where}: {num_experts} experts do not split over the "
                                 f"expert-parallel group's {ranks} ranks")
            per_rank = num_experts // ranks
            self._local_experts = slice(rank * per_rank, (rank + 1) * per_rank)
        try:
            _check_options(self.backend, swiglu_limit=swiglu_limit,
                           recompute_gate_up=recompute_gate_up, precision=precision,
                           ep_max_tokens=ep_max_tokens, ep_timeout_s=ep_timeout_s,
                           ep_macrobatch_size=ep_macrobatch_size)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        self.swiglu_limit = swiglu_limit
        self.recompute_gate_up = recompute_gate_up
        self.precision = precision
        self.ep_max_tokens, self.ep_timeout_s = ep_max_tokens, ep_timeout_s
        self.ep_macrobatch_size = ep_macrobatch_size
        # Mixtral multiplies the block's input by U(1 - j, 1 + j) noise in training.
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.train(block.training)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if self.training and self.jitter_noise > 0:
            # Same draw as Mixtral's in-place multiply (same element count and order), made out
            # of place so the caller's tensor is left alone.
            noise = torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            x = x * noise
        _, topk_weights, topk_ids = self.gate(x)
        return self._experts(x, topk_ids, topk_weights).view(shape)

    def _shared(self) -> nn.Module | None:
        """The shared expert (Family.shared), or None."""
        return getattr(self, self._shared_name) if self._shared_name else None

    def _experts(self, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed (+ shared) experts: x [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H].
        The shared expert runs inside mok's call where _fused_shared says it can and no gate
        scales it, else through its own forward (as the original block runs it), scaled by
        sigmoid(its gate(x)) where the family has one, and added to the routed experts'
        output."""
        experts = self.experts
        if not (isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
                and isinstance(getattr(experts, "down_proj", None), torch.Tensor)):
            raise MoKInputError(
                f"{self.block_type}: the experts module is now {type(experts).__name__}, "
                "without gate_up_proj and down_proj tensors: it was replaced or wrapped after "
                "patching (an adapter on the experts?), which mok cannot run; apply such "
                "adapters to an unpatched model")
        # This rank's experts (all of them without expert parallelism): views, no copy.
        gate_up = experts.gate_up_proj[self._local_experts]
        down = experts.down_proj[self._local_experts]
        intermediate = down.shape[-1]
        if self.backend is Backend.REFERENCE:
            cast = lambda t: t
        else:
            dtype = _compute_dtype(x, gate_up)
            cast = lambda t: t.to(dtype)
        # One cast of the fused parameter serves both halves; without a cast the halves are views
        # of the parameter itself.
        gate_up = cast(gate_up)
        shared: list[torch.Tensor | None] = [None, None, None]
        mlp = self._shared()
        fused = (mlp is not None and self._shared_gate_name is None
                 and _fused_shared(mlp, x.shape[-1]))
        if fused:
            shared = [cast(mlp.gate_proj.weight), cast(mlp.up_proj.weight),
                      cast(mlp.down_proj.weight)]
        with torch.autocast(x.device.type, enabled=False):
            y = moe_experts(cast(x).contiguous(), topk_ids, topk_weights.float(), *shared,
                            gate_up[:, :intermediate], gate_up[:, intermediate:], cast(down),
                            swiglu_limit=self.swiglu_limit, backend=self.backend,
                            group=self.ep_group, max_tokens=self.ep_max_tokens,
                            peer_timeout_s=self.ep_timeout_s,
                            recompute_gate_up=self.recompute_gate_up, precision=self.precision,
                            macrobatch_size=self.ep_macrobatch_size)
        y = y.to(x.dtype)
        if mlp is not None and not fused:
            shared_y = mlp(x)
            if self._shared_gate_name is not None:
                gate = getattr(self, self._shared_gate_name)
                shared_y = torch.sigmoid(gate(x)) * shared_y
            y = y + shared_y
        return y

    def extra_repr(self) -> str:
        ep = "" if self.ep_group is None else \
            f", experts={self._local_experts.start}:{self._local_experts.stop}"
        return (f"block={self.block_type}, backend={self.backend.value}, "
                f"swiglu_limit={self.swiglu_limit}, precision={self.precision}{ep}")


def patch_moe_blocks(model: nn.Module, *, backend: Backend | str = Backend.MOK,
                     swiglu_limit: float | None = None,
                     ep_group: dist.ProcessGroup | None = None,
                     ep_max_tokens: int | None = None, ep_timeout_s: float = 60.0,
                     recompute_gate_up: bool = False, precision: str = "bf16",
                     ep_macrobatch_size: int | None = None) -> int:
    """Replace, in place, every supported sparse MoE block below `model` by a MokSparseMoeBlock.

    Returns the number of blocks replaced (0 when there are none, e.g. already patched). The
    parameters stay the same objects, state_dict keys are unchanged, and checkpoints load into
    the unpatched model. swiglu_limit clamps gate and up as mok's swiglu_limit does, for the
    routed and the shared experts; it changes the model's math unless the model was trained so.
    ep_group: run the experts with expert parallelism over this group (module docstring);
    ep_max_tokens: the most tokens a rank passes a block (batch x sequence), when ranks pass
    different counts; ep_timeout_s: how long a wait on another rank may last, and
    ep_macrobatch_size the symmetric buffer's ring window (mok.nn.MoE's).
    recompute_gate_up=True keeps h instead of the experts' gate/up pre-activations and
    recomputes them in the backward (mok.functional.MoKConfig.recompute_gate_up): I fewer
    values per route of activations, a slower backward, and repeated backwards through one
    graph (retain_graph=True) allowed.
    precision="fp8": the experts' row GEMMs on e4m3 operands with blockwise scales
    (mok.functional.MoKConfig.precision).
    Raises ValueError (before changing anything) when a block has a layout mok cannot run, or
    (backend "mok") sizes its kernels cannot (H and I multiples of 8), or an option mok.nn.MoE
    refuses. A model whose blocks are
    already mok's is left as it is, as is one without a supported block (a warning says so).
    """
    block_types = supported_block_types()
    replacements: dict[int, nn.Module] = {}
    sites: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) in block_types:
                sites.append((parent, name, child))
    for _, _, block in sites:
        if id(block) not in replacements:
            replacements[id(block)] = MokSparseMoeBlock(
                block, backend=backend, swiglu_limit=swiglu_limit, ep_group=ep_group,
                ep_max_tokens=ep_max_tokens, ep_timeout_s=ep_timeout_s,
                recompute_gate_up=recompute_gate_up, precision=precision,
                ep_macrobatch_size=ep_macrobatch_size)
    for parent, name, block in sites:
        setattr(parent, name, replacements[id(block)])
    if not replacements and any(isinstance(m, MokSparseMoeBlock) for m in model.modules()):
        warnings.warn("patch_moe_blocks: the model's MoE blocks already run in mok; nothing was "
                      "changed (their options stay those they were patched with)", stacklevel=2)
    elif not replacements:
        others = sorted({type(m).__name__ for m in model.modules()
                         if "moe" in type(m).__name__.lower()})
        found = f" (its {', '.join(others)} are not among them)" if others else ""
        supported = ", ".join(sorted(t.__name__ for t in block_types))
        warnings.warn(f"patch_moe_blocks: no block mok replaces in this model{found}; nothing "
                      f"was changed. mok replaces {supported}", stacklevel=2)
    return len(replacements)
