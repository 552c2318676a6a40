"""mok.integrations.huggingface: patched transformers MoE models against the unpatched ones.

Tiny random models of each family the installed transformers has (built in code, no downloads).
The MoE weights are drawn at nn.Linear's scale (transformers' initializer_range of 0.02 would make
the experts a rounding error of the residual stream), so the logits depend on them: a model whose
gate and up halves are swapped misses the tolerance by far (test_swapped_gate_up_is_detected).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from mok.errors import MoKInputError
from mok.integrations.huggingface import MokSparseMoeBlock, patch_moe_blocks
from mok.nn import Backend
from mok.testing import TOLERANCES, Tolerance, assert_close, distributed_test, error_report
from mok.testing.tolerance import FP8_TOLERANCE

from ..conftest import DEVICE

VOCAB, BATCH, SEQ = 64, 2, 8
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
              max_position_embeddings=64, tie_word_embeddings=False)

# The mok backend runs the experts of the fp32 model in bf16: each MoE layer rounds x, the fp32
# weights, h and its output to bf16 (d_y and d_h in the backward), more roundings than the single
# layer's bf16 bound counts (its inputs are bf16 already); two layers' errors add up, and a
# router's weight gradient, a difference of nearly equal terms through the softmax, amplifies
# them. Measured on these models: rel_rms up to 1.6e-2 (a router's gradient) and max_rel up to
# 0.11 (the embedding's gradient); the bound leaves 2x. A wrong layout or routing costs O(1)
# (test_swapped_gate_up_is_detected). The reference backend computes in fp32 like the original,
# in another summation order.
MODEL_BF16 = Tolerance(rel_rms=3e-2, max_rel=2.5e-1)
TOLERANCE = {"mok": MODEL_BF16, "mok_recompute": MODEL_BF16,
             "reference": TOLERANCES[torch.float32]}


@dataclass(frozen=True)
class Family:
    name: str                 # transformers.models.<name>
    model_class: str
    config_class: str
    config: dict = field(default_factory=dict)
    moe_layers: int = 2
    router_logits: bool = True  # the model returns router_logits and an aux_loss

    def module(self) -> ModuleType:
        try:
            return importlib.import_module(f"transformers.models.{self.name}.modeling_{self.name}")
        except ImportError:
            pytest.skip(f"transformers has no {self.name}")


FAMILIES = [
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
           dict(num_hidden_layers=3, mlp_only_layers=[1], intermediate_size=48,
                moe_intermediate_size=16, num_key_value_heads=2, head_dim=8, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, output_router_logits=True,
                router_aux_loss_coef=0.01)),
    Family("mixtral", "MixtralForCausalLM", "MixtralConfig",
           dict(num_hidden_layers=2, intermediate_size=16, num_key_value_heads=2, head_dim=8,
                num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1,
                output_router_logits=True, router_aux_loss_coef=0.01)),
    Family("olmoe", "OlmoeForCausalLM", "OlmoeConfig",
           dict(num_hidden_layers=2, intermediate_size=16, num_key_value_heads=4,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                output_router_logits=True, router_aux_loss_coef=0.01, eos_token_id=2)),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
           dict(num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=48,
                moe_intermediate_size=16, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                norm_topk_prob=True, routed_scaling_factor=2.5, kv_lora_rank=16,
                q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
           router_logits=False),
    Family("deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Config",
           dict(num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=48,
                moe_intermediate_size=16, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                topk_method="group_limited_greedy", norm_topk_prob=True,
                routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=None,
                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
           router_logits=False),
    Family("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig",
           dict(num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=48,
                moe_intermediate_size=16, num_key_value_heads=2, head_dim=8, n_shared_experts=1,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                norm_topk_prob=True, routed_scaling_factor=2.5),
           router_logits=False),
    Family("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig",
           dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                num_key_value_heads=2, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
                moe_layer_start_index=1),
           router_logits=False),
    # The shared expert scaled by sigmoid(shared_expert_gate(x)): runs through its own forward.
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
           dict(num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=16,
                shared_expert_intermediate_size=32, num_key_value_heads=2, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=False, output_router_logits=True,
                router_aux_loss_coef=0.01)),
    Family("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
           dict(num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=16,
                shared_expert_intermediate_size=32, num_key_value_heads=2, head_dim=8,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                output_router_logits=True, router_aux_loss_coef=0.01,
                layer_types=["full_attention", "full_attention"])),
    # The router's weight is gate.wg.weight; the shared expert is shared_mlp.
    Family("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config",
           dict(num_hidden_layers=2, intermediate_size=16, num_key_value_heads=2, head_dim=8,
                num_experts=8, moe_topk=2, num_shared_expert=1),
           router_logits=False),
    Family("flex_olmo", "FlexOlmoForCausalLM", "FlexOlmoConfig",
           dict(num_hidden_layers=2, intermediate_size=16, num_key_value_heads=4,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                output_router_logits=True, router_aux_loss_coef=0.01, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)),
]
BY_NAME = {family.name: family for family in FAMILIES}


def build(family: Family, seed: int = 0) -> nn.Module:
    """A tiny fp32 model of `family` on DEVICE, MoE weights at nn.Linear's scale."""
    module = family.module()
    config = getattr(module, family.config_class)(**COMMON, **family.config)
    torch.manual_seed(seed)
    model = getattr(module, family.model_class)(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".mlp." in name:
                bound = parameter.shape[-1] ** -0.5
                parameter.uniform_(-bound, bound)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)  # the selection bias takes part in choosing experts
    return model.to(DEVICE)


def patched_copy(model: nn.Module, backend: str) -> tuple[nn.Module, int]:
    """backend: mok (its defaults: the gate/up pre-activations kept), mok_recompute (recomputed
    in the backward), or reference."""
    patched = copy.deepcopy(model)
    if backend == "mok_recompute":
        return patched, patch_moe_blocks(patched, backend="mok", recompute_gate_up=True)
    return patched, patch_moe_blocks(patched, backend=backend)


def token_ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(DEVICE)


@contextlib.contextmanager
def recorded_routing(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """The top-k expert ids [T, k] (sorted per token) each router of `model` picks, in order."""
    picked: list[torch.Tensor] = []
    hooks = [module.register_forward_hook(
        lambda _module, _args, output: picked.append(output[2].detach().sort(-1).values))
        for name, module in model.named_modules() if name.split(".")[-1] == "gate"]
    try:
        yield picked
    finally:
        for hook in hooks:
            hook.remove()


def assert_same_routing(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Routing is discrete: the bf16 rounding of one MoE layer may flip a near tie in a later
    router, and then that token's values differ by O(1). The inputs are chosen with margins far
    above that rounding; say so plainly if a flip happens anyway, rather than fail on values."""
    assert len(actual) == len(expected) > 0
    for layer, (a, e) in enumerate(zip(actual, expected, strict=True)):
        flipped = int((a != e).any(-1).sum())
        assert flipped == 0, (f"router {layer}: {flipped} tokens picked other experts (a near "
                              "tie flipped by bf16 rounding, or wrong routing)")


def moe_block_prefixes(model: nn.Module) -> list[str]:
    return [f"{name}." for name, module in model.named_modules()
            if isinstance(module, MokSparseMoeBlock)]


def checked_parameters(model: nn.Module) -> list[str]:
    """Every parameter of the MoE blocks (router, experts, shared experts) and the embedding,
    whose gradient flows through the blocks' d_x."""
    prefixes = moe_block_prefixes(model)
    return [name for name, _ in model.named_parameters()
            if name.startswith(tuple(prefixes)) or "embed_tokens" in name]


def train_losses_and_routing(models, ids, seed=None):
    """Loss and backward of each model on `ids` (labels = ids): (losses, each one's routing).
    seed: reseeded before each model (the same router jitter noise in all)."""
    losses, routings = [], []
    for model in models:
        if seed is not None:
            torch.manual_seed(seed)
        with recorded_routing(model) as routing:
            output = model(ids, labels=ids)
        output.loss.backward()
        losses.append(output.loss.detach())
        routings.append(routing)
    return losses, routings


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_patch_keeps_parameters_and_state_dict_keys(family):
    model = build(family)
    before = model.state_dict(keep_vars=True)
    count = patch_moe_blocks(model)
    assert count == family.moe_layers
    blocks = [m for m in model.modules() if isinstance(m, MokSparseMoeBlock)]
    assert len(blocks) == family.moe_layers
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    for key, tensor in after.items():
        assert tensor is before[key], key
        assert tensor.data_ptr() == before[key].data_ptr(), key
    # The experts, routers and shared experts are the original modules, parameters included.
    names = [name for name, _ in model.named_parameters()]
    assert any(".experts.gate_up_proj" in name for name in names)
    assert sum(".mlp.gate." in name and name.endswith("weight")
               for name in names) == family.moe_layers
    assert patch_moe_blocks(model) == 0  # nothing left to replace


@pytest.mark.parametrize("backend", ["mok", "reference"])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_logits_match_original(family, backend):
    original = build(family).eval()
    patched, _ = patched_copy(original, backend)
    ids = token_ids()
    with torch.no_grad(), recorded_routing(original) as routing:
        expected = original(ids)
    with torch.no_grad(), recorded_routing(patched) as patched_routing:
        actual = patched(ids)
    assert_same_routing(patched_routing, routing)
    tolerance = TOLERANCE[backend]
    assert actual.logits.dtype == torch.float32
    assert_close(actual.logits, expected.logits, dtype=torch.float32, name="logits",
                 tolerance=tolerance)
    if family.router_logits:
        # Recorded from the model's own router modules, which the patched blocks call.
        assert len(actual.router_logits) == family.moe_layers
        for layer, (a, e) in enumerate(zip(actual.router_logits, expected.router_logits,
                                           strict=True)):
            assert_close(a, e, dtype=torch.float32, name=f"router_logits[{layer}]",
                         tolerance=tolerance)
        assert_close(actual.aux_loss, expected.aux_loss, dtype=torch.float32, name="aux_loss",
                     tolerance=tolerance)


@pytest.mark.parametrize("backend", ["mok", "mok_recompute", "reference"])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_gradients_match_original(family, backend):
    original = build(family).train()  # train mode: Mixtral's router jitter is on
    patched, _ = patched_copy(original, backend)
    losses, routings = train_losses_and_routing((original, patched), token_ids(), seed=7)
    assert_same_routing(routings[1], routings[0])
    tolerance = TOLERANCE[backend]
    assert_close(losses[1], losses[0], dtype=torch.float32, name="loss", tolerance=tolerance)
    names = checked_parameters(patched)
    assert len(names) >= 1 + 3 * family.moe_layers
    expected = dict(original.named_parameters())
    for name, parameter in patched.named_parameters():
        if name not in names:
            continue
        if expected[name].grad is None:  # selection only (Ernie's e_score_correction_bias)
            assert parameter.grad is None, name
            continue
        assert parameter.grad is not None, name
        assert parameter.grad.abs().max() > 0, name
        assert_close(parameter.grad, expected[name].grad, dtype=torch.float32, name=name,
                     tolerance=tolerance)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_checkpoint_of_patched_model_loads_into_original(family, tmp_path: Path):
    original = build(family).eval()
    patched, _ = patched_copy(original, "reference")
    ids = token_ids()
    with torch.no_grad():
        expected = original(ids).logits
    torch.save(patched.state_dict(), tmp_path / "moe.pt")
    fresh = build(family, seed=1).eval()
    with torch.no_grad():
        assert not torch.equal(fresh(ids).logits, expected)  # other weights before loading
        fresh.load_state_dict(torch.load(tmp_path / "moe.pt"), strict=True)
        assert torch.equal(fresh(ids).logits, expected)
    patched.save_pretrained(tmp_path / "hf")
    model_class = getattr(family.module(), family.model_class)
    reloaded = model_class.from_pretrained(tmp_path / "hf", dtype=torch.float32).to(DEVICE)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(ids).logits, expected)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_swapped_gate_up_is_detected(family):
    """The comparisons above can tell the gate/up layout apart: a model whose experts' gate and
    up halves are swapped is far outside even the mok backend's tolerance."""
    original = build(family).eval()
    swapped = copy.deepcopy(original)
    with torch.no_grad():
        for name, parameter in swapped.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                parameter.copy_(parameter.roll(parameter.shape[1] // 2, dims=1))
        ids = token_ids()
        report = error_report(swapped(ids).logits, original(ids).logits)
    assert report.rel_rms > 10 * MODEL_BF16.rel_rms, report


def test_swiglu_limit_reaches_both_backends():
    family = BY_NAME["qwen3_moe"]
    original = build(family).eval()
    ids = token_ids()
    logits, routings = {}, {}
    for backend, limit in (("mok", 0.5), ("reference", 0.5), ("reference", None)):
        patched = copy.deepcopy(original)
        patch_moe_blocks(patched, backend=backend, swiglu_limit=limit)
        with torch.no_grad(), recorded_routing(patched) as routing:
            logits[backend, limit] = patched(ids).logits
        routings[backend, limit] = routing
    assert_same_routing(routings["mok", 0.5], routings["reference", 0.5])
    assert_close(logits["mok", 0.5], logits["reference", 0.5], dtype=torch.float32,
                 name="logits with limit", tolerance=MODEL_BF16)
    # The clamp changes the model: gate and up values beyond 0.5 are common at this scale.
    report = error_report(logits["reference", 0.5], logits["reference", None])
    assert report.rel_rms > 10 * MODEL_BF16.rel_rms, report


def test_block_dtypes_follow_autocast_and_parameters():
    block = build(BY_NAME["qwen3_moe"]).model.layers[0].mlp
    patched = MokSparseMoeBlock(copy.deepcopy(block))
    x = torch.randn(BATCH, SEQ, 32, device=DEVICE)
    with torch.no_grad():
        with recorded_routing(block) as routing:
            expected = block(x)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            original_autocast = block(x)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16), \
                recorded_routing(patched) as autocast_routing:
            actual = patched(x)
        # Under autocast the output keeps the input's dtype, as the original block's does.
        assert actual.dtype == original_autocast.dtype == torch.float32
        assert_same_routing(autocast_routing, routing)
        assert_close(actual, expected, dtype=torch.bfloat16, name="autocast bf16")
        patched.to(torch.float16)
        with recorded_routing(patched) as fp16_routing:
            actual = patched(x.half())
        assert actual.dtype == torch.float16
        assert_same_routing(fp16_routing, routing)
        assert_close(actual, expected, dtype=torch.float16, name="fp16 parameters")


def test_non_silu_experts_are_refused():
    family = BY_NAME["qwen3_moe"]
    module = family.module()
    config = getattr(module, family.config_class)(**COMMON, **family.config, hidden_act="gelu")
    model = getattr(module, family.model_class)(config)
    with pytest.raises(ValueError, match="not SiLU"):
        patch_moe_blocks(model)
    # Nothing was replaced: the check runs on every block before the first swap.
    assert not any(isinstance(m, MokSparseMoeBlock) for m in model.modules())



def _expert_parallel_body(rank, world_size, uneven=False):
    """patch_moe_blocks(ep_group=...): each rank computes its share of the experts for every
    rank's tokens. Logits and loss equal the unpatched model's on this rank's tokens; summed over
    the ranks (what a data-parallel all-reduce does), every gradient equals the unpatched one.
    uneven: the ranks' sequences differ in length, under ep_max_tokens."""
    import torch.distributed as dist

    family = BY_NAME["qwen3_moe"]
    original = build(family).train()  # the same weights on every rank (same seed)
    patched = copy.deepcopy(original)
    bound = dict(ep_max_tokens=BATCH * SEQ) if uneven else {}
    assert patch_moe_blocks(patched, ep_group=dist.group.WORLD, **bound) == family.moe_layers
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    seq = SEQ - 3 * rank if uneven else SEQ
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=generator).to(DEVICE)
    losses, routings = train_losses_and_routing((original, patched), ids)
    assert_same_routing(routings[1], routings[0])
    assert_close(losses[1], losses[0], dtype=torch.float32, name="loss", tolerance=MODEL_BF16)
    expected = dict(original.named_parameters())
    for name, parameter in patched.named_parameters():
        if name not in checked_parameters(patched):
            continue
        grad, grad_ref = parameter.grad.clone(), expected[name].grad.clone()
        dist.all_reduce(grad)
        dist.all_reduce(grad_ref)
        assert_close(grad, grad_ref, dtype=torch.float32, name=name, tolerance=MODEL_BF16)
    # On this rank, the other ranks' experts get no gradient; its own get every rank's share.
    experts = next(m for m in patched.modules() if isinstance(m, MokSparseMoeBlock)).experts
    per_rank = experts.gate_up_proj.shape[0] // world_size
    mine = torch.zeros(experts.gate_up_proj.shape[0], dtype=torch.bool)
    mine[rank * per_rank:(rank + 1) * per_rank] = True
    assert experts.gate_up_proj.grad[~mine.to(DEVICE)].abs().max() == 0
    assert experts.gate_up_proj.grad[mine.to(DEVICE)].abs().max() > 0


@distributed_test(world_sizes=(2,))
def test_expert_parallel_patch_matches_original(rank, world_size):
    _expert_parallel_body(rank, world_size)


@distributed_test(world_sizes=(2,))
def test_expert_parallel_patch_takes_uneven_batches_under_ep_max_tokens(rank, world_size):
    _expert_parallel_body(rank, world_size, uneven=True)


@pytest.mark.parametrize("layout", ["transposed", "row_slice", "padded_rows"])
def test_patched_block_takes_parameters_in_any_layout(layout):
    # bf16 parameters reach the kernels as they are (no cast copies them): the fused gate_up,
    # down_proj and the shared expert's weights in another memory layout give the answer of the
    # same block with contiguous parameters on the reference backend, output and gradients.
    from mok.testing.layouts import relayout

    block = build(BY_NAME["deepseek_v3"]).model.layers[1].mlp.to(torch.bfloat16)
    reference = MokSparseMoeBlock(copy.deepcopy(block), backend="reference")
    patched = MokSparseMoeBlock(copy.deepcopy(block))
    shared = patched.shared_experts
    holders = [(patched.experts, "gate_up_proj"), (patched.experts, "down_proj"),
               (shared.gate_proj, "weight"), (shared.up_proj, "weight"),
               (shared.down_proj, "weight")]
    for module, name in holders:
        setattr(module, name, nn.Parameter(relayout(getattr(module, name), layout)))
    assert not patched.experts.gate_up_proj.is_contiguous()
    x = torch.randn(BATCH, SEQ, 32, device=DEVICE, dtype=torch.bfloat16)
    d_y = torch.randn_like(x)
    outputs, grads = [], []
    for model in (patched, reference):
        x_leaf = x.clone().requires_grad_(True)
        y = model(x_leaf)
        y.backward(d_y)
        outputs.append(y)
        grads.append({"x": x_leaf.grad, **{name: p.grad for name, p in model.named_parameters()
                                           if p.grad is not None}})
    assert_close(outputs[0], outputs[1], dtype=torch.bfloat16, name="y")
    assert set(grads[0]) == set(grads[1])
    for name in grads[1]:
        assert_close(grads[0][name], grads[1][name], dtype=torch.bfloat16, name=name)


def test_fp8_patch_runs_the_experts_in_fp8():
    # patch_moe_blocks(precision="fp8") on a model whose experts are 128 wide: a patched
    # block's output and its experts' gradients within FP8's error of the same block on the
    # reference backend (the whole model's gradients are no test here: FP8's error flips near
    # routing ties in later layers); the model's loss too.
    family = dataclasses.replace(BY_NAME["qwen3_moe"],
                                 config={**BY_NAME["qwen3_moe"].config,
                                         "moe_intermediate_size": 128})
    original = build(family)
    patched = copy.deepcopy(original)
    assert patch_moe_blocks(patched, precision="fp8") == family.moe_layers
    assert "precision=fp8" in repr(patched)
    (loss, loss_fp8), _ = train_losses_and_routing([original, patched], token_ids())
    assert_close(loss_fp8, loss, dtype=torch.bfloat16, name="loss", tolerance=FP8_TOLERANCE)
    block = next(m for m in patched.modules() if isinstance(m, MokSparseMoeBlock))
    x = torch.randn(BATCH, SEQ, COMMON["hidden_size"], device=DEVICE)
    results = []
    for backend in ("mok", "reference"):
        block.backend = Backend(backend)
        block.zero_grad(set_to_none=True)
        y = block(x)
        (y * torch.linspace(-1, 1, y.shape[-1], device=DEVICE)).sum().backward()
        results.append((y.detach(), {name: p.grad for name, p in block.named_parameters()
                                     if ".experts." in f".{name}"}))
    (y, grads), (y_ref, grads_ref) = results
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y", tolerance=FP8_TOLERANCE)
    assert set(grads) == {"experts.gate_up_proj", "experts.down_proj"}
    for name, grad in grads.items():
        assert_close(grad, grads_ref[name], dtype=torch.bfloat16, name=name,
                     tolerance=FP8_TOLERANCE)
    with pytest.raises(ValueError, match="precision"):
        patch_moe_blocks(copy.deepcopy(original), precision="fp16")


class _Tripled(nn.Linear):
    """An nn.Linear whose own forward differs (as LoRA-wrapped or quantized layers' do)."""

    def forward(self, x):
        return 3 * super().forward(x)


def test_shared_expert_changed_after_patching_runs_its_own_forward():
    # An adapter or a hook on DeepSeek-V3's shared expert, added after patching: the block runs
    # the shared expert through its forward (it read the plain layer's weights and ignored it).
    original = build(BY_NAME["deepseek_v3"]).eval()
    patched, _ = patched_copy(original, "mok")
    fired = []
    blocks = []
    for model in (original, patched):
        block = next(m for m in model.modules() if hasattr(m, "shared_experts"))
        mlp = block.shared_experts
        old = mlp.gate_proj
        mlp.gate_proj = _Tripled(old.in_features, old.out_features, bias=False)
        mlp.gate_proj.weight = old.weight
        mlp.register_forward_hook(lambda *args: fired.append(1))
        blocks.append(block)
    assert isinstance(blocks[1], MokSparseMoeBlock)
    x = torch.randn(BATCH, SEQ, COMMON["hidden_size"], device=DEVICE)
    with torch.no_grad():
        expected = blocks[0](x)
        fired.clear()
        actual = blocks[1](x)
    assert fired == [1]
    assert_close(actual, expected, dtype=torch.float32, name="block", tolerance=MODEL_BF16)


def test_block_hooks_registered_before_patching_still_run():
    original = build(BY_NAME["qwen3_moe"]).eval()
    patched = copy.deepcopy(original)
    handles = []
    for model in (original, patched):
        for block in model.modules():
            if type(block).__name__ == "Qwen3MoeSparseMoeBlock":
                handles.append(block.register_forward_hook(lambda m, i, o: torch.zeros_like(o)))
    assert patch_moe_blocks(patched) == BY_NAME["qwen3_moe"].moe_layers
    ids = token_ids()
    with torch.no_grad():
        expected, actual = original(ids).logits, patched(ids).logits
    assert_close(actual, expected, dtype=torch.float32, name="logits", tolerance=MODEL_BF16)
    for handle in handles:  # the handles still remove them
        handle.remove()
    assert not any(block._forward_hooks for block in patched.modules()
                   if isinstance(block, MokSparseMoeBlock))
    # the block's plain attributes come along (code reading block.top_k, block.config)
    for before, after in zip((m for m in original.modules()
                              if type(m).__name__ == "Qwen3MoeSparseMoeBlock"),
                             (m for m in patched.modules() if isinstance(m, MokSparseMoeBlock)),
                             strict=True):
        public = {name for name in vars(before) if not name.startswith("_")} - {"training"}
        assert all(getattr(after, name) is getattr(before, name) for name in public), public


def test_patch_refuses_sizes_the_kernels_cannot_run_and_replaced_experts():
    family = dataclasses.replace(BY_NAME["qwen3_moe"],
                                 config={**BY_NAME["qwen3_moe"].config,
                                         "moe_intermediate_size": 20})
    model = build(family)
    with pytest.raises(ValueError, match="multiple of 8.*backend='reference'"):
        patch_moe_blocks(model)
    assert not any(isinstance(m, MokSparseMoeBlock) for m in model.modules())
    assert patch_moe_blocks(model, backend="reference") == family.moe_layers
    # Options mok.nn.MoE refuses, refused before anything changes.
    for options, match in ((dict(swiglu_limit=0.0), "swiglu_limit must be a positive"),
                           (dict(swiglu_limit=float("nan")), "swiglu_limit must be a positive"),
                           (dict(swiglu_limit="3"), "swiglu_limit must be a positive"),
                           (dict(precision="fp8", backend="reference"), None),
                           (dict(ep_max_tokens=0), "ep_max_tokens must be a positive"),
                           (dict(ep_macrobatch_size=100), "ep_macrobatch_size must be a")):
        unpatched = build(family)
        if match is None:  # the reference backend takes any width
            assert patch_moe_blocks(unpatched, **options) == family.moe_layers
            continue
        with pytest.raises(ValueError, match=match):
            patch_moe_blocks(unpatched, backend="reference", **options)
        assert not any(isinstance(m, MokSparseMoeBlock) for m in unpatched.modules())
    # FP8 takes experts of any width the mok backend takes (64: a partial scale block).
    wide = dataclasses.replace(family, config={**family.config, "moe_intermediate_size": 64})
    assert patch_moe_blocks(build(wide), precision="fp8") == family.moe_layers
    # Patching a patched model changes nothing, and says so.
    with pytest.warns(UserWarning, match="already run in mok"):
        assert patch_moe_blocks(model, backend="mok") == 0
    # A model without a block mok replaces is left as it is, and says so.
    class OtherMoeBlock(nn.Module):
        pass

    with pytest.warns(UserWarning, match=r"its OtherMoeBlock are not among them.*"
                                         r"Qwen3MoeSparseMoeBlock"):
        assert patch_moe_blocks(nn.Sequential(nn.Linear(4, 4), OtherMoeBlock())) == 0
    patched, _ = patched_copy(build(BY_NAME["qwen3_moe"]), "mok")
    block = next(m for m in patched.modules() if isinstance(m, MokSparseMoeBlock))
    block.experts = nn.Identity()  # what wrapping the experts (an adapter) leaves
    with pytest.raises(MoKInputError, match="replaced or wrapped after patching"):
        patched(token_ids())


def test_patched_model_runs_outside_inference_mode_after_running_in_it():
    patched, _ = patched_copy(build(BY_NAME["qwen3_moe"]), "mok")
    ids = token_ids()
    with torch.inference_mode():
        first = patched(ids).logits
    with torch.no_grad():  # the same token count: the workspace made under inference mode
        again = patched(ids).logits
    assert torch.equal(first, again)
    patched(ids).logits.sum().backward()


def test_float8_expert_weights_are_refused():
    model = build(BY_NAME["qwen3_moe"])
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            experts.gate_up_proj.data = experts.gate_up_proj.data.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="quantized"):
        patch_moe_blocks(model)
