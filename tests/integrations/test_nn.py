"""mok.nn: the MoE module and its router, against the reference and PyTorch's own ops."""

import copy
import io
import math
import re
import warnings

import pytest
import torch

import mok.functional as F
from mok.errors import MoKDataError, MoKInputError
from mok.nn import Backend, MoE, Router, RouterConfig, RouterScoring, moe_experts
from mok.testing import assert_close, distributed_test, make_inputs, moe_reference, rank_device
from mok.testing.distributed import too_few_gpus
from mok.testing.tolerance import FP8_TOLERANCE

from ..conftest import DEVICE


def make_module(shared=16, router=None, seed=0, **kwargs):
    torch.manual_seed(seed)
    return MoE(32, 16, 6, 2, shared, router=router or RouterConfig(), device=DEVICE, **kwargs)


def loss_and_grads(module, x):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
    grads = {name.removeprefix("_orig_mod."): p.grad.clone()
             for name, p in module.named_parameters()}
    return y.detach(), x.grad, grads


def assert_steps_close(actual, expected):
    """Two loss_and_grads results: y, d_x and every parameter's gradient within bf16 bounds."""
    (y, d_x, grads), (y_ref, d_x_ref, grads_ref) = actual, expected
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y")
    assert_close(d_x, d_x_ref, dtype=torch.bfloat16, name="d_x")
    assert set(grads) == set(grads_ref)
    for name in grads:
        assert_close(grads[name], grads_ref[name], dtype=torch.bfloat16, name=name)


def compiled_step(module, x):
    """loss_and_grads of torch.compile(module, fullgraph=True) (inductor on a GPU)."""
    compiled = torch.compile(module, fullgraph=True,
                             backend="inductor" if DEVICE.type == "cuda" else "aot_eager")
    return loss_and_grads(compiled, x)


@pytest.mark.parametrize("recompute_gate_up", [True, False], ids=["recompute", "kept_gate_up"])
def test_module_matches_reference_backend(recompute_gate_up):
    module = make_module(recompute_gate_up=recompute_gate_up)
    x = torch.randn(3, 10, 32, device=DEVICE)
    step = y, d_x, grads = loss_and_grads(module, x)
    module.backend = Backend.REFERENCE
    assert y.shape == x.shape and y.dtype == x.dtype
    assert set(grads) == {"router.weight", "w_gate", "w_up", "w_down", "shared_gate",
                          "shared_up", "shared_down"}
    assert all(grad.dtype == torch.float32 for grad in grads.values())
    assert_steps_close(step, loss_and_grads(module, x))


def test_moe_experts_with_strided_weight_views():
    """Slices of a fused gate_up parameter work as weights; gradients land in the fused one."""
    inputs = make_inputs(20, 32, 16, 4, 2, device=DEVICE, seed=2)
    gate_up = torch.cat([inputs.w_routed_gate, inputs.w_routed_up], dim=1).requires_grad_(True)
    y = moe_experts(inputs.x, inputs.topk_experts, inputs.router_weights, None, None, None,
                    gate_up[:, :16], gate_up[:, 16:], inputs.w_routed_down)
    y.backward(inputs.d_output)
    leaves = [t.detach().double().requires_grad_(True) for t in
              (inputs.w_routed_gate, inputs.w_routed_up)]
    y_ref = moe_reference(inputs.x, inputs.topk_experts, inputs.router_weights, None, None,
                          None, *leaves, inputs.w_routed_down, compute_dtype=torch.float64)
    y_ref.backward(inputs.d_output.double())
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y")
    assert_close(gate_up.grad, torch.cat([leaves[0].grad, leaves[1].grad], dim=1),
                 dtype=torch.bfloat16, name="d_gate_up")


def test_softmax_router_selects_and_normalizes():
    router = Router(16, 8, 3, RouterConfig(normalize_topk=True)).to(DEVICE)
    x = torch.randn(40, 16, device=DEVICE)
    out = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    expected = probs.topk(3, dim=-1)
    assert torch.equal(out.topk_experts, expected.indices)
    torch.testing.assert_close(out.weights, expected.values / expected.values.sum(-1, True))
    assert torch.equal(out.tokens_per_expert,
                       torch.bincount(expected.indices.reshape(-1), minlength=8))
    assert float(out.aux_loss) == 0.0


def test_router_routes_leading_dimensions_as_flattened_tokens():
    # A [B, S, H] input routes its B * S tokens exactly as the same tokens passed as [T, H]:
    # the weights gathered from each token's own scores, the losses averaged over every token.
    torch.manual_seed(0)
    router = Router(16, 8, 2, RouterConfig(aux_loss_coef=0.1, z_loss_coef=1e-3)).to(DEVICE)
    x = torch.randn(3, 10, 16, device=DEVICE)
    out, flat = router(x), router(x.reshape(30, 16))
    for name in ("topk_experts", "weights", "logits", "tokens_per_expert", "aux_loss"):
        assert torch.equal(getattr(out, name), getattr(flat, name)), name
    assert out.topk_experts.shape == (30, 2) and out.logits.shape == (30, 8)
    assert router(x[0, 0]).topk_experts.shape == (1, 2)
    for bad in (torch.randn(4, 12, device=DEVICE), torch.randn((), device=DEVICE)):
        with pytest.raises(MoKInputError, match=r"router's input has shape .*\[\.\.\., 16\]"):
            router(bad)


def test_bias_update_rate_needs_sigmoid_scoring():
    # Softmax scoring never routes with the bias: a rate there would only move a bias that
    # nothing reads, so it is refused.
    needs = "bias_update_rate=0.01 needs scoring='sigmoid'"
    with pytest.raises(ValueError, match=re.escape(needs)):
        RouterConfig(bias_update_rate=0.01)
    config = RouterConfig(scoring="sigmoid", bias_update_rate=0.01)
    assert config.scoring is RouterScoring.SIGMOID


@pytest.mark.parametrize("kwargs, match", [
    (dict(scoring="sigmoid", bias_update_rate=math.nan),
     "bias_update_rate must be a finite non-negative number, got nan"),
    (dict(scoring="sigmoid", bias_update_rate=-0.01),
     "bias_update_rate must be a finite non-negative number, got -0.01"),
    (dict(aux_loss_coef=-0.01), "aux_loss_coef must be a finite non-negative number"),
    (dict(aux_loss_coef=math.inf), "aux_loss_coef must be a finite non-negative number"),
    (dict(z_loss_coef=-1e-3), "z_loss_coef must be a finite non-negative number"),
    (dict(routed_scaling_factor=math.inf), "routed_scaling_factor must be a finite positive"),
    (dict(routed_scaling_factor=math.nan), "routed_scaling_factor must be a finite positive"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor must be a finite positive"),
    (dict(scoring="Softmax"),
     "RouterConfig.scoring must be one of 'softmax', 'sigmoid' (or RouterScoring), got 'Softmax'"),
    (dict(normalize_topk="no"), "normalize_topk must be a bool, got 'no'"),
])
def test_router_config_rejects_values_out_of_range(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        RouterConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(swiglu_limit=True), "swiglu_limit must be a positive finite number or None, got True"),
    (dict(recompute_gate_up="no"), "recompute_gate_up must be a bool, got 'no'"),
    (dict(recompute_gate_up=1), "recompute_gate_up must be a bool, got 1"),
    (dict(router=dict(aux_loss_coef=0.01)), "the router config must be a RouterConfig"),
], ids=["swiglu_limit_bool", "recompute_str", "recompute_int", "router_dict"])
def test_constructor_checks_option_types(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        MoE(32, 16, 4, 2, **kwargs)


def test_sigmoid_router_bias_steers_selection_not_weights():
    config = RouterConfig(scoring=RouterScoring.SIGMOID, normalize_topk=False,
                          bias_update_rate=0.01, routed_scaling_factor=2.5)
    router = Router(16, 8, 2, config).to(DEVICE)
    x = torch.randn(64, 16, device=DEVICE)
    router.expert_bias.copy_(torch.tensor([5.0, 5.0, 0, 0, 0, 0, 0, 0]))
    router.eval()
    out = router(x)
    assert bool((out.topk_experts.sort(dim=-1).values == torch.tensor([0, 1],
                                                                      device=DEVICE)).all())
    scores = torch.sigmoid(x @ router.weight.T)
    torch.testing.assert_close(out.weights, 2.5 * scores[:, :2].gather(
        1, out.topk_experts))
    router.train()
    before = router.expert_bias.clone()
    router(x)
    # Overloaded experts 0 and 1 are pushed down, the idle ones up, by exactly the rate: the
    # update is pending (this forward routed with the bias before it), the next forward routes
    # with it, and state_dict saves it.
    pushed = torch.tensor([-0.01, -0.01] + [0.01] * 6, device=DEVICE)
    assert torch.equal(router.expert_bias, before)
    for bias in (router.next_bias(), router.state_dict()["expert_bias"]):
        torch.testing.assert_close(bias - before, pushed, atol=1e-6, rtol=0)
    router.eval()
    assert torch.equal(router(x).topk_experts, routed_with(router, x, router.next_bias()))
    router.train()
    out = router(x)
    assert torch.equal(out.topk_experts, routed_with(router, x, before + pushed))
    torch.testing.assert_close(router.expert_bias - before, pushed, atol=1e-6, rtol=0)
    # Loading a state dict takes its bias as the next one and drops the pending load.
    fresh = Router(16, 8, 2, config).to(DEVICE)
    fresh.load_state_dict(router.state_dict())
    assert torch.equal(fresh.next_bias(), router.next_bias())
    assert not fresh.expert_load.any()


def routed_with(router, x, bias):
    scores = torch.sigmoid(x @ router.weight.T)
    return (scores + bias).topk(router.top_k, dim=-1).indices


def _twin_biased_modules(rate):
    """Two equal float64 reference modules whose sigmoid router updates its bias at `rate`."""
    router = RouterConfig(scoring=RouterScoring.SIGMOID, bias_update_rate=rate)
    plain, twin = (MoE(32, 16, 8, 2, router=router, backend="reference", device=DEVICE,
                       dtype=torch.float64) for _ in range(2))
    twin.load_state_dict(plain.state_dict())
    return plain, twin


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointing_routes_the_recomputed_forward_as_the_first(use_reentrant):
    # Activation checkpointing runs the forward again inside the backward. With the
    # auxiliary-loss-free bias update that second run must route with the first run's bias and
    # update nothing: gradients and biases then equal those of the module run plainly.
    plain, checkpointed = _twin_biased_modules(1e-3)
    for step in range(3):
        x = torch.randn(64, 32, device=DEVICE, dtype=torch.float64,
                        generator=torch.Generator(DEVICE).manual_seed(step))
        d_y = torch.randn_like(x)
        x_plain, x_checkpointed = x.clone().requires_grad_(), x.clone().requires_grad_()
        plain(x_plain).backward(d_y)
        y = torch.utils.checkpoint.checkpoint(checkpointed, x_checkpointed,
                                              use_reentrant=use_reentrant)
        y.backward(d_y)
        assert torch.equal(x_plain.grad, x_checkpointed.grad), step
        assert torch.equal(plain.router.expert_bias, checkpointed.router.expert_bias), step
        assert torch.equal(plain.router.next_bias(), checkpointed.router.next_bias()), step
        for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (step, name)
    assert plain.router.next_bias().abs().max() > 0  # the bias did move


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointing_several_forwards_before_one_backward(use_reentrant):
    # Several training forwards, each moving the bias, then one backward: every recomputed
    # forward must route with the bias its own first run used. Two of the forwards take the same
    # tokens (their recomputations find one entry each, the latest first).
    torch.manual_seed(0)
    plain, checkpointed = _twin_biased_modules(5e-2)
    xs = [torch.randn(64, 32, device=DEVICE, dtype=torch.float64,
                      generator=torch.Generator(DEVICE).manual_seed(seed))
          for seed in (0, 1, 0, 2)]
    d_ys = [torch.randn_like(x) for x in xs]
    for step in range(2):
        plain_in = [x.clone().requires_grad_() for x in xs]
        checkpointed_in = [x.clone().requires_grad_() for x in xs]
        biases, plain_out = [], []
        for x in plain_in:
            biases.append(plain.router.next_bias().clone())
            plain_out.append(plain(x))
        # The bias moved between the forwards: recomputing with the last one would differ.
        assert not any(torch.equal(a, b) for a, b in zip(biases, biases[1:], strict=False)), step
        checkpointed_out = [torch.utils.checkpoint.checkpoint(
            checkpointed, x, use_reentrant=use_reentrant) for x in checkpointed_in]
        sum((y * d_y).sum() for y, d_y in zip(plain_out, d_ys, strict=True)).backward()
        sum((y * d_y).sum() for y, d_y in zip(checkpointed_out, d_ys, strict=True)).backward()
        for i, (a, b) in enumerate(zip(plain_in, checkpointed_in, strict=True)):
            assert torch.equal(a.grad, b.grad), (step, i)
        assert torch.equal(plain.router.next_bias(), checkpointed.router.next_bias()), step
        for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (step, name)
            a.grad = b.grad = None


def test_bias_updates_compile_without_recompiles():
    # The bias history's slot is a device tensor: training steps of a compiled module with the
    # bias update compile once (fullgraph) and match eager bitwise, bias included.
    torch.manual_seed(0)
    router = RouterConfig(scoring=RouterScoring.SIGMOID, bias_update_rate=1e-2)
    eager = MoE(32, 16, 8, 2, router=router, device=DEVICE)
    module = MoE(32, 16, 8, 2, router=router, device=DEVICE)
    module.load_state_dict(eager.state_dict())
    compiles = []

    def backend(graph, example_inputs):
        compiles.append(graph)
        return graph.forward

    compiled = torch.compile(module, fullgraph=True, backend=backend)
    for step in range(4):
        x = torch.randn(64, 32, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(step))
        assert torch.equal(compiled(x), eager(x)), step
        assert torch.equal(module.router.next_bias(), eager.router.next_bias()), step
    assert len(compiles) == 1
    assert bool(eager.router.next_bias().abs().max() > 0)


def test_recomputation_routes_with_its_forward_s_bias():
    # The router alone: biases recorded per forward and found again by the logits, the latest
    # not yet recomputed first among equal tokens; tokens never seen route with expert_bias.
    torch.manual_seed(0)
    router = Router(16, 8, 2, RouterConfig(scoring=RouterScoring.SIGMOID,
                                           bias_update_rate=0.5)).to(DEVICE)
    xs = [torch.randn(40, 16, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(s))
          for s in (0, 1, 0)]
    biases = []
    for x in xs:
        biases.append(router.next_bias().clone())
        router(x)
    assert not torch.equal(biases[0], biases[2])

    def recompute(x):
        # A forward run inside autograd's backward, as activation checkpointing runs it.
        found = []
        leaf = torch.zeros((), device=DEVICE, requires_grad=True)
        out = leaf * 1.0
        out.register_hook(lambda grad: found.append(router(x).topk_experts))
        out.backward()
        return found[0]

    for i in (2, 1, 0):
        assert torch.equal(recompute(xs[i]), routed_with(router, xs[i], biases[i])), i
    assert torch.equal(recompute(xs[0]), routed_with(router, xs[0], biases[2]))  # all recomputed
    unseen = torch.randn(40, 16, device=DEVICE)
    assert torch.equal(recompute(unseen), routed_with(router, unseen, router.expert_bias))
    assert torch.equal(router.expert_bias, biases[2])  # recomputations change nothing


def test_router_keeps_fp32_bias_and_scores_under_casts_and_autocast():
    router = Router(16, 4, 2, RouterConfig(scoring=RouterScoring.SIGMOID,
                                           bias_update_rate=1e-3)).to(DEVICE)
    with torch.no_grad():
        router.expert_bias.fill_(0.5)
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == router.expert_load.dtype == torch.float32
    assert bool((router.expert_bias == 0.5).all())
    router.half().float()
    assert router.expert_bias.dtype == torch.float32
    x = torch.randn(24, 16, device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = router.eval()(x)
    router.train()
    assert out.logits.dtype == out.weights.dtype == torch.float32
    assert torch.equal(out.logits, x.float() @ router.weight.float().T)
    # Ten updates of 1e-3 around 0.5 keep their size (in bf16 most would round away).
    expected = torch.full((4,), 0.5, dtype=torch.float64, device=DEVICE)
    for i in range(10):
        load = router(x[i:i + 1]).tokens_per_expert.double()
        expected += 1e-3 * torch.sign(load.mean() - load)
    torch.testing.assert_close(router.next_bias().double(), expected, atol=1e-6, rtol=0)


def test_aux_and_z_losses():
    config = RouterConfig(aux_loss_coef=0.1, z_loss_coef=0.001)
    router = Router(16, 4, 2, config).to(DEVICE)
    x = torch.randn(50, 16, device=DEVICE)
    out = router(x)
    logits = x @ router.weight.T
    probs = torch.softmax(logits, -1)
    fraction = torch.bincount(probs.topk(2, -1).indices.reshape(-1), minlength=4) / 100
    expected = 0.1 * 4 * (fraction * probs.mean(0)).sum() + \
        0.001 * torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(out.aux_loss, expected)
    out.aux_loss.backward()
    assert router.weight.grad is not None and bool(router.weight.grad.abs().sum() > 0)


def test_deepcopy_after_a_step_with_a_balancing_loss():
    """The last call's aux_loss holds a graph; copies and pickles take it without one."""
    torch.manual_seed(0)
    model = MoE(32, 32, 4, 2, router=RouterConfig(aux_loss_coef=1e-2), dtype=torch.bfloat16,
                device=DEVICE)
    x = torch.randn(8, 32, device=DEVICE, dtype=torch.bfloat16)
    (model(x).float().sum() + model.aux_loss).backward()
    twin = copy.deepcopy(model)
    assert twin.aux_loss.grad_fn is None and model.aux_loss.grad_fn is not None
    torch.testing.assert_close(twin.aux_loss, model.aux_loss, rtol=0, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(dict(twin.named_parameters())[name], param, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_aux_loss_is_one_kth_of_transformers_load_balancing_loss(top_k):
    # RouterConfig's aux loss: E * sum_e f_e * P_e with f_e the fraction of the T * k routes.
    # transformers' load_balancing_loss_func (Mixtral, Qwen3-MoE), written out here: the mean
    # over tokens of the [T, k, E] one-hot selection, times the mean probabilities, summed over
    # k and E, times E. It counts f_e over tokens (summing to k): k times mok's loss.
    torch.manual_seed(top_k)
    num_tokens, num_experts = 40, 6
    router = Router(16, num_experts, top_k, RouterConfig(aux_loss_coef=1.0)).to(DEVICE)
    x = torch.randn(num_tokens, 16, device=DEVICE)
    aux_loss = router(x).aux_loss
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    selected = probs.topk(top_k, dim=-1).indices
    fraction = torch.bincount(selected.reshape(-1), minlength=num_experts) / (num_tokens * top_k)
    documented = num_experts * (fraction * probs.mean(0)).sum()
    torch.testing.assert_close(aux_loss, documented)
    expert_mask = torch.nn.functional.one_hot(selected, num_experts).float()  # [T, k, E]
    tokens_per_expert = expert_mask.mean(dim=0)                               # [k, E]
    transformers_style = num_experts * (tokens_per_expert * probs.mean(0)).sum()
    torch.testing.assert_close(transformers_style, top_k * aux_loss)


@pytest.mark.parametrize("recompute_gate_up", [True, False], ids=["recompute", "kept_gate_up"])
def test_torch_compile_fullgraph_traces_the_module(recompute_gate_up):
    module = make_module(seed=3, recompute_gate_up=recompute_gate_up)
    x = torch.randn(2, 9, 32, device=DEVICE)
    assert_steps_close(compiled_step(module, x), loss_and_grads(module, x))


def test_kept_pre_activations_serve_one_backward():
    # The default keeps the pre-activations and the backward writes their gradients over them:
    # a second backward through the same graph (retain_graph) is refused (autograd's
    # saved-tensor check, said in mok's words: what to pass instead), never run on the
    # gradients. Recomputing keeps h, which it may reread.
    x = torch.randn(2, 7, 32, device=DEVICE)
    loss = make_module()(x).float().pow(2).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(MoKInputError, match="recompute_gate_up=True") as refused:
        loss.backward()
    assert "modified by an inplace operation" in str(refused.value.__cause__)
    recomputing = make_module(recompute_gate_up=True)
    loss = recomputing(x).float().pow(2).sum()
    loss.backward(retain_graph=True)
    first = {name: p.grad.clone() for name, p in recomputing.named_parameters()}
    loss.backward()
    for name, p in recomputing.named_parameters():
        assert torch.equal(p.grad, 2 * first[name]), name


@pytest.mark.parametrize("change", ["input", "weight"])
def test_in_place_change_before_backward_is_not_called_a_second_backward(change):
    # A tensor the layer saved for its backward (here its bf16 input or w_down) changed in
    # place between the forward and the backward: PyTorch's saved-tensor error says so. Only a
    # backward that already ran is reported as one (test_kept_pre_activations_serve_one_backward).
    module = make_module(dtype=torch.bfloat16)
    x = torch.randn(2, 7, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    xi = x * 1
    y = module(xi)
    with torch.no_grad():
        if change == "input":
            xi.add_(1)
        else:
            module.w_down.mul_(1.01)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as refused:
        y.float().sum().backward()
    assert "already ran" not in str(refused.value)


def test_autocast_runs_in_the_autocast_dtype():
    module = make_module(shared=0, seed=4)
    x = torch.randn(12, 32, device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = module(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert module.w_gate.grad.dtype == torch.float32
    module.backend = Backend.REFERENCE
    y_ref = module(x)
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y")


def test_bad_top_k_is_rejected():
    with pytest.raises(ValueError, match="top_k"):
        MoE(32, 16, 4, 5)


@pytest.mark.parametrize("args, kwargs, match", [
    ((32, 16, 0, 1), {}, "num_experts must be a positive integer, got 0"),
    ((0, 16, 4, 2), {}, "hidden_size must be a positive integer, got 0"),
    ((32, -16, 4, 2), {}, "intermediate_size must be a positive integer, got -16"),
    ((32, 16, 4, 0), {}, "top_k must be a positive integer, got 0"),
    ((32, 16, 4, 2.0), {}, "top_k must be a positive integer, got 2.0"),
    ((32, 16, 4, 2, -8), {}, "shared_intermediate_size must be a non-negative integer"),
    ((36, 16, 4, 2), {}, "hidden_size=36: the mok backend needs a multiple of 8"),
    ((32, 12, 4, 2), {}, "intermediate_size=12: the mok backend needs a multiple of 8"),
    ((32, 16, 4, 2, 12), {}, "shared_intermediate_size=12: the mok backend"),
    ((32, 16, 4, 2), {"backend": "triton"},
     "backend must be one of 'mok', 'reference', got 'triton'"),
    ((32, 16, 4, 2), {"swiglu_limit": -1.0}, "swiglu_limit must be a positive finite"),
    ((32, 16, 4, 2), {"swiglu_limit": float("nan")}, "swiglu_limit must be a positive finite"),
    ((32, 16, 4, 2), {"ep_max_tokens": 0}, "ep_max_tokens must be a positive integer"),
])
def test_constructor_errors_name_the_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        MoE(*args, **kwargs)


def test_reference_backend_takes_any_size():
    module = MoE(36, 12, 3, 2, 5, backend="reference", device=DEVICE)
    x = torch.randn(4, 36, device=DEVICE)
    assert module(x).shape == x.shape


@pytest.mark.parametrize("shape", [(16, 48), (16, 128), (4, 8, 32), (48,), ()],
                         ids=lambda shape: "x".join(map(str, shape)) or "scalar")
def test_wrong_hidden_size_is_an_input_error(shape):
    from mok import MoKInputError

    module = MoE(64, 16, 4, 2, device=DEVICE)
    x = torch.randn(shape, device=DEVICE)
    with pytest.raises(MoKInputError, match="last dimension must be hidden_size=64"):
        module(x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_non_floating_input_is_an_input_error(dtype):
    from mok import MoKInputError

    module = MoE(64, 16, 4, 2, device=DEVICE)
    with pytest.raises(MoKInputError, match="floating-point"):
        module(torch.ones(16, 64, device=DEVICE).to(dtype))


@pytest.mark.parametrize("backend, dtype", [
    ("mok", torch.float8_e4m3fn), ("mok", torch.float8_e5m2), ("mok", torch.float64),
    ("reference", torch.float8_e4m3fn)])
def test_input_dtype_the_backend_does_not_take_is_an_input_error(backend, dtype):
    # Inputs are bf16, fp16 or fp32 (float64 too on the reference backend): a float8 input
    # would come back as float8, a float64 one through bf16 kernels.
    module = MoE(64, 16, 4, 2, backend=backend, device=DEVICE)
    x = torch.randn(16, 64, device=DEVICE).to(dtype)
    with pytest.raises(MoKInputError, match=f"dtype {dtype}; MoE with backend='{backend}' takes"):
        module(x)
    if dtype is torch.float64:
        module.backend = Backend.REFERENCE
        assert module(x).dtype == torch.float64


def test_top1_normalized_router_without_losses_warns():
    # top_k=1 with renormalized weights: every weight is 1, so the task loss gives the router
    # weight zero gradient (up to rounding; without renormalization it learns). The
    # constructor warns unless something else trains it.
    with pytest.warns(UserWarning, match="router gets no gradient.*normalize_topk=False"):
        module = MoE(32, 16, 4, 1, backend="reference", device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        learning = MoE(32, 16, 4, 1, router=RouterConfig(normalize_topk=False),
                       backend="reference", device=DEVICE)
        for config in (RouterConfig(aux_loss_coef=0.01), RouterConfig(z_loss_coef=1e-3),
                       RouterConfig(scoring="sigmoid", bias_update_rate=1e-3)):
            MoE(32, 16, 4, 1, router=config, backend="reference", device=DEVICE)
        MoE(32, 16, 4, 2, backend="reference", device=DEVICE)
    learning.load_state_dict(module.state_dict())
    x = torch.randn(8, 32, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    for layer in (module, learning):
        layer(x).pow(2).sum().backward()
    assert module.router.weight.grad.norm() < 1e-5 * learning.router.weight.grad.norm()


def test_moe_experts_names_a_bad_backend():
    inputs = make_inputs(4, 32, 16, 4, 2, device=DEVICE, seed=2)
    with pytest.raises(ValueError, match="backend must be one of 'mok', 'reference'"):
        moe_experts(inputs.x, inputs.topk_experts, inputs.router_weights, None, None, None,
                    *inputs.routed_weights, backend="cuda")


def test_moe_experts_takes_tokens_as_rows():
    # x [B, S, H] (a module's input) raised "tokens exceed the workspace's num_local_tokens",
    # the workspace sized by B; it now says what x must be.
    inputs = make_inputs(8, 32, 16, 4, 2, device=DEVICE, seed=2)
    with pytest.raises(MoKInputError, match=r"x must be a \[T, H\] tensor"):
        moe_experts(inputs.x.view(2, 4, 32), inputs.topk_experts, inputs.router_weights, None,
                    None, None, *inputs.routed_weights)


def test_bad_expert_ids_raise_at_check_errors():
    # moe_experts with ids past the experts: no sync in the call; check_errors() with no
    # workspace checks those the layer ran in and raises at once, then the flags are clear.
    inputs = make_inputs(6, 32, 16, 4, 2, device=DEVICE, seed=3)
    ids = inputs.topk_experts.clone()
    ids[2, 1] = 4
    F.check_errors()
    moe_experts(inputs.x, ids, inputs.router_weights, None, None, None, *inputs.routed_weights)
    with pytest.raises(MoKDataError, match="EXPERT_ID_OUT_OF_RANGE"):
        F.check_errors()
    F.check_errors()


def test_bad_expert_ids_raise_from_the_next_call_of_any_token_count():
    # Without a sync the next call reports a call's data error, even when it runs in another
    # workspace (another token count), naming the workspace of the call that flagged it.
    bad = make_inputs(7, 32, 16, 4, 2, device=DEVICE, seed=4)
    ids = bad.topk_experts.clone()
    ids[2, 1] = 4
    good = make_inputs(12, 32, 16, 4, 2, device=DEVICE, seed=5)
    F.check_errors()
    moe_experts(bad.x, ids, bad.router_weights, None, None, None, *bad.routed_weights)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()  # the flags' copy has landed: the next call sees it
    with pytest.raises(MoKDataError, match="EXPERT_ID_OUT_OF_RANGE.*num_local_tokens=8,"):
        moe_experts(good.x, good.topk_experts, good.router_weights, None, None, None,
                    *good.routed_weights)
    moe_experts(good.x, good.topk_experts, good.router_weights, None, None, None,
                *good.routed_weights)  # reported once
    F.check_errors()


def test_calls_of_many_token_counts_share_a_few_workspaces():
    # One cached workspace per power-of-two bound of the token count: 33..64 tokens share one.
    before = set(F._WORKSPACES)
    for tokens in (33, 40, 64, 47):
        inputs = make_inputs(tokens, 32, 16, 4, 2, device=DEVICE, seed=tokens)
        y = moe_experts(inputs.x, inputs.topk_experts, inputs.router_weights, None, None, None,
                        *inputs.routed_weights)
        y_ref = moe_reference(inputs.x, inputs.topk_experts, inputs.router_weights, None, None,
                              None, *inputs.routed_weights, compute_dtype=torch.float64)
        assert_close(y, y_ref, dtype=inputs.x.dtype, name="y")
    added = [F._WORKSPACES[key] for key in set(F._WORKSPACES) - before]
    assert [each.num_local_tokens for each in added] in ([64], [])


def test_gate_and_up_in_different_layouts():
    # The gate weight stored transposed, the up weight a slice of a fused gate_up (their
    # strides differ: each is read by its own), through moe_experts and MoE.
    from mok.testing.layouts import Layout, relayout

    inputs = make_inputs(16, 64, 64, 4, 2, device=DEVICE, seed=5)
    gate = relayout(inputs.w_routed_gate, Layout.TRANSPOSED).requires_grad_(True)
    up = relayout(inputs.w_routed_up, Layout.ROW_SLICE, second_half=True).requires_grad_(True)
    assert gate.stride() != up.stride()
    y = moe_experts(inputs.x, inputs.topk_experts, inputs.router_weights, None, None, None,
                    gate, up, inputs.w_routed_down)
    y.backward(inputs.d_output)
    leaves = [t.detach().double().requires_grad_(True) for t in
              (inputs.w_routed_gate, inputs.w_routed_up)]
    y_ref = moe_reference(inputs.x, inputs.topk_experts, inputs.router_weights, None, None,
                          None, *leaves, inputs.w_routed_down, compute_dtype=torch.float64)
    y_ref.backward(inputs.d_output.double())
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y")
    assert_close(gate.grad, leaves[0].grad, dtype=torch.bfloat16, name="d_gate")
    assert_close(up.grad, leaves[1].grad, dtype=torch.bfloat16, name="d_up")


def test_torch_compile_with_strided_parameters():
    # The fake backward reports contiguous gradients, as the op returns them, whatever the
    # parameters' layout: a compiled graph reads them with the right strides.
    from mok.testing.layouts import Layout, relayout

    module = make_module(seed=7)
    with torch.no_grad():
        module.w_up = torch.nn.Parameter(relayout(module.w_up, Layout.TRANSPOSED))
        module.shared_down = torch.nn.Parameter(relayout(module.shared_down, Layout.TRANSPOSED))
    x = torch.randn(2, 9, 32, device=DEVICE)
    eager = loss_and_grads(module, x)
    # (Compiled, the casts and the router's fp32 math around the op may round differently:
    # close, not bitwise; a gradient read with the wrong strides is off by O(1).)
    assert_steps_close(compiled_step(module, x), eager)
    module.backend = Backend.REFERENCE
    assert_steps_close(eager, loss_and_grads(module, x))


def _fsdp_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # gloo on CPU: name the mesh's device, else FSDP2 picks CUDA whenever a GPU is present.
    mesh = init_device_mesh("cpu", (world_size,))

    torch.manual_seed(0)
    reference = MoE(32, 16, 4, 2, 16, backend=Backend.REFERENCE)
    sharded = MoE(32, 16, 4, 2, 16, backend=Backend.REFERENCE)
    sharded.load_state_dict(reference.state_dict())
    fully_shard(sharded.router, mesh=mesh)  # the non-expert parameters, sharded over the ranks
    fully_shard(sharded, mesh=mesh)
    torch.manual_seed(1)
    x_all = torch.randn(world_size, 10, 32)
    reference(x_all.reshape(-1, 32)).pow(2).sum().div(world_size).backward()
    sharded(x_all[rank]).pow(2).sum().backward()
    for name, param in sharded.named_parameters():
        full = param.grad.full_tensor()  # FSDP2 averages over ranks: times world_size
        expected = dict(reference.named_parameters())[name].grad
        torch.testing.assert_close(full * world_size, expected * world_size, rtol=1e-4,
                                   atol=1e-5, msg=name)


@distributed_test(world_sizes=(2,), backend="gloo")
def test_fsdp2_shards_the_module(rank, world_size):
    _fsdp_body(rank, world_size)


def _own_experts(module, rank):
    """module with experts of this rank's own values (a seed per rank)."""
    generator = torch.Generator(device=module.w_gate.device).manual_seed(100 + rank)
    with torch.no_grad():
        for weight in (module.w_gate, module.w_up, module.w_down):
            weight.uniform_(-0.25, 0.25, generator=generator)
    return module


def _ep_module_body(rank, world_size):
    """MoE(ep_group=...): each rank holds its experts; matches the reference backend on the
    same group (all_to_all with autograd), gradients of every parameter included."""
    import torch.distributed as dist

    device = rank_device(rank)
    torch.manual_seed(0)  # router and shared expert: the same on every rank
    module = MoE(32, 16, 3 * world_size, 2, 16, device=device, ep_group=dist.group.WORLD,
                 ep_max_tokens=24)
    assert module.w_gate.shape == (3, 16, 32)
    _own_experts(module, rank)
    x = torch.randn(2, 12 - 2 * rank, 32, device=device,  # ranks pass different token counts
                    generator=torch.Generator(device=device).manual_seed(rank))
    step = loss_and_grads(module, x)
    module.backend = Backend.REFERENCE
    assert_steps_close(step, loss_and_grads(module, x))


@distributed_test(world_sizes=(2,))
def test_expert_parallel_module_matches_reference_backend(rank, world_size):
    _ep_module_body(rank, world_size)


def _ep_compiled_body(rank, world_size):
    """torch.compile of a module under expert parallelism breaks the graph at the experts (the
    workspace's creation and the exchange run eagerly): the compiled module's outputs and
    gradients equal the eager module's."""
    import torch.distributed as dist

    device = rank_device(rank)
    torch.manual_seed(0)
    module = MoE(32, 16, 2 * world_size, 2, device=device, ep_group=dist.group.WORLD,
                 ep_max_tokens=12)
    _own_experts(module, rank)
    x = torch.randn(12, 32, device=device, generator=torch.Generator(device=device)
                    .manual_seed(rank))
    eager = loss_and_grads(module, x)
    compiled = loss_and_grads(torch.compile(module, backend="aot_eager"), x)
    for a, b in zip(compiled[:2], eager[:2], strict=True):
        assert torch.equal(a, b)
    assert set(compiled[2]) == set(eager[2])
    for name, grad in compiled[2].items():
        assert torch.equal(grad, eager[2][name]), name


@distributed_test(world_sizes=(2,))
def test_expert_parallel_module_compiles(rank, world_size):
    _ep_compiled_body(rank, world_size)


def _ep_ring_body(rank, world_size):
    """MoE(ep_macrobatch_size=128) with ep_max_tokens=300: the symmetric buffer a ring of two
    windows of 128 tokens, a call moving its tokens in three (ranks passing 150 and 130);
    bitwise the module without the ring. A macrobatch that is not a multiple of the minibatch
    (128) is refused."""
    import torch.distributed as dist

    device = rank_device(rank)
    torch.manual_seed(0)
    plain = MoE(32, 16, 2 * world_size, 2, 16, device=device, ep_group=dist.group.WORLD,
                ep_max_tokens=300)
    _own_experts(plain, rank)
    ring = MoE(32, 16, 2 * world_size, 2, 16, device=device, ep_group=dist.group.WORLD,
               ep_max_tokens=300, ep_macrobatch_size=128)
    ring.load_state_dict(plain.state_dict())
    x = torch.randn(2, 75 - 10 * rank, 32, device=device,
                    generator=torch.Generator(device=device).manual_seed(rank))
    (y, d_x, grads), (y_ring, d_x_ring, grads_ring) = (loss_and_grads(plain, x),
                                                       loss_and_grads(ring, x))
    assert torch.equal(y, y_ring) and torch.equal(d_x, d_x_ring)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ring[name]), name
    rings = [w.exchange.window for key, w in F._WORKSPACES.items()
             if key[0].macrobatch_size == 128 and key[1] == id(dist.group.WORLD)]
    assert rings == [128]
    with pytest.raises(ValueError, match="ep_macrobatch_size"):
        MoE(32, 16, 2 * world_size, 2, device=device, ep_group=dist.group.WORLD,
            ep_macrobatch_size=100)


@distributed_test(world_sizes=(2,))
def test_expert_parallel_ring_is_bitwise_the_module_without_it(rank, world_size):
    _ep_ring_body(rank, world_size)


def _ep_state_dict_body(rank, world_size):
    """An expert-parallel module's state dict names its experts: each rank's loads back into
    it, another rank's (or one rank's into a module holding every expert) is refused."""
    import torch.distributed as dist

    device = rank_device(rank)
    module = _own_experts(MoE(32, 16, 3 * world_size, 2, device=device,
                              ep_group=dist.group.WORLD), rank)
    state = {name: value.cpu() for name, value in module.state_dict().items()}
    assert state["ep_expert_ids"].tolist() == list(range(3 * rank, 3 * rank + 3))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, state)
    fresh = MoE(32, 16, 3 * world_size, 2, device=device, ep_group=dist.group.WORLD)
    fresh.load_state_dict(everyone[rank])
    assert torch.equal(fresh.w_gate, module.w_gate)
    other = (rank + 1) % world_size
    with pytest.raises(MoKInputError, match=f"holds experts {3 * other}..{3 * other + 2}; "
                                            f"this module \\(rank {rank} "):
        fresh.load_state_dict(everyone[other])
    whole = MoE(32, 16, 3, 2, device=device)  # every expert in one module, as many as a rank's
    assert "ep_expert_ids" not in whole.state_dict()
    with pytest.raises(MoKInputError, match="one rank's share"):
        whole.load_state_dict(everyone[rank])
    whole.load_state_dict(MoE(32, 16, 3, 2, device=device).state_dict())  # no ids: as before


@distributed_test(world_sizes=(2,))
def test_expert_parallel_state_dict_names_its_experts(rank, world_size):
    _ep_state_dict_body(rank, world_size)


def _ep_later_calls_body(rank, world_size):
    """Without ep_max_tokens: a later call of fewer tokens on one rank (a short last batch)
    runs in the first call's workspace (a new one is a collective the other rank would not
    join: it hung); a second backward through a graph (retain_graph) as on one GPU."""
    import torch.distributed as dist

    device = rank_device(rank)
    for recompute in (True, False):
        torch.manual_seed(0)
        module = MoE(32, 16, 2 * world_size, 2, 16, device=device, ep_group=dist.group.WORLD,
                     recompute_gate_up=recompute)
        generator = torch.Generator(device=device).manual_seed(rank)
        module(torch.randn(12, 32, device=device, generator=generator)).sum().backward()
        x = torch.randn(12 - 2 * rank, 32, device=device, generator=generator)
        step = loss_and_grads(module, x)
        module.backend = Backend.REFERENCE
        assert_steps_close(step, loss_and_grads(module, x))
        module.backend = Backend.MOK
        module.zero_grad()
        loss = module(x).pow(2).sum()
        loss.backward(retain_graph=True)
        first = module.w_gate.grad.clone()
        if recompute:
            loss.backward()
            torch.testing.assert_close(module.w_gate.grad, 2 * first)
        else:
            with pytest.raises(MoKInputError, match="recompute_gate_up=True"):
                loss.backward()
        dist.barrier()


@distributed_test(world_sizes=(2,))
def test_expert_parallel_later_calls_and_second_backward(rank, world_size):
    _ep_later_calls_body(rank, world_size)


def _ddp_body(rank, world_size):
    """prepare_ddp, then DDP: each rank keeps its own experts (DDP's start would copy rank 0's
    over them) and every gradient is what the README's averaging by hand gives."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from mok.nn import prepare_ddp

    device = rank_device(rank)

    def build():
        torch.manual_seed(0)
        module = MoE(32, 16, 2 * world_size, 2, 16, device=device, ep_group=dist.group.WORLD)
        return _own_experts(module, rank)

    for nested in (False, True):  # the MoE wrapped itself, or inside a model
        by_hand, inner = build(), build()
        if nested:
            by_hand, inner = torch.nn.Sequential(by_hand), torch.nn.Sequential(inner)
        prefix = "0." if nested else ""
        assert prepare_ddp(inner) == [prefix + name for name in ("w_gate", "w_up", "w_down")]
        wrapped = DistributedDataParallel(inner, device_ids=[device] if device.type == "cuda"
                                          else None)
        assert torch.equal(inner.get_parameter(prefix + "w_gate"),
                           by_hand.get_parameter(prefix + "w_gate"))  # not rank 0's
        x = torch.randn(12, 32, device=device, generator=torch.Generator(device=device)
                        .manual_seed(rank))
        by_hand(x).pow(2).sum().backward()
        wrapped(x).pow(2).sum().backward()
        for name, parameter in by_hand.named_parameters():
            grad = parameter.grad / world_size
            if not name.startswith(prefix + "w_"):  # replicated: averaged over the ranks
                dist.all_reduce(grad)
            torch.testing.assert_close(inner.get_parameter(name).grad, grad, msg=name)
        with pytest.raises(MoKInputError, match="already wrapped"):  # too late: refused
            prepare_ddp(wrapped)


# gloo between the ranks, each rank's module on rank_device
@pytest.mark.skipif(too_few_gpus(2), reason="two ranks need two GPUs, or MOK_RANKS_SHARE_GPU=1")
@distributed_test(world_sizes=(2,), backend="gloo")
def test_prepare_ddp_keeps_each_rank_s_experts(rank, world_size):
    _ddp_body(rank, world_size)


def _ep_sizes_and_bias_body(rank, world_size):
    """Under expert parallelism: ranks passing different token counts without ep_max_tokens are
    told so on every rank (their buffers would differ in size, which the others read); the
    replicated router's bias follows the group's load, so it stays the same on every rank."""
    import torch.distributed as dist

    device = rank_device(rank)
    torch.manual_seed(0)
    config = RouterConfig(scoring=RouterScoring.SIGMOID, bias_update_rate=1e-2)
    module = MoE(32, 16, 2 * world_size, 2, device=device, ep_group=dist.group.WORLD,
                 router=config)

    def tokens(count, seed):
        return torch.randn(count, 32, device=device,
                           generator=torch.Generator(device=device).manual_seed(seed))

    with pytest.raises(MoKInputError, match="different values.*ep_max_tokens"):
        module.eval()(tokens(8 + 2 * rank, rank))
    module.train()
    expected = torch.zeros(2 * world_size, device=device)
    for step in range(2):
        module(tokens(8, 10 * step + rank)).sum().backward()
        load = module.tokens_per_expert.float()
        dist.all_reduce(load)
        expected += 1e-2 * torch.sign(load.mean() - load)
    biases = [torch.empty_like(expected) for _ in range(world_size)]
    dist.all_gather(biases, module.router.next_bias())
    for bias in biases:
        torch.testing.assert_close(bias, expected, atol=1e-6, rtol=0)
    assert bool(expected.abs().max() > 0)


@distributed_test(world_sizes=(2,))
def test_expert_parallel_sizes_checked_and_router_bias_kept_alike(rank, world_size):
    _ep_sizes_and_bias_body(rank, world_size)


def _ep_over_max_tokens_body(rank, world_size):
    """A rank passing more than ep_max_tokens raises at once; on the first call, too, the others
    do not block in the workspace's creation: their waits on it time out naming it."""
    import torch.distributed as dist

    device = rank_device(rank)
    torch.manual_seed(0)
    module = MoE(32, 16, 2 * world_size, 2, device=device, ep_group=dist.group.WORLD,
                 ep_max_tokens=8, ep_timeout_s=1.0)
    x = torch.randn(8 + rank, 32, device=device)
    if rank == 1:
        with pytest.raises(MoKInputError, match="9 tokens exceed max_tokens=8"):
            module(x)
    else:
        module(x)
        with pytest.raises(MoKDataError, match="PEER_TIMEOUT.*waited on rank 1"):
            F.check_errors()
    dist.barrier()


@distributed_test(world_sizes=(2,))
def test_expert_parallel_rank_over_max_tokens_is_named(rank, world_size):
    _ep_over_max_tokens_body(rank, world_size)


def test_fp8_module_trains_close_to_the_reference_and_compiles():
    # MoE(precision="fp8"): the experts' row GEMMs in e4m3.
    torch.manual_seed(5)
    module = MoE(256, 128, 4, 2, 128, precision="fp8", device=DEVICE)
    assert "precision=fp8" in repr(module)
    x = torch.randn(24, 256, device=DEVICE)
    y, d_x, grads = loss_and_grads(module, x)
    module.backend = Backend.REFERENCE
    y_ref, d_x_ref, grads_ref = loss_and_grads(module, x)
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y", tolerance=FP8_TOLERANCE)
    assert_close(d_x, d_x_ref, dtype=torch.bfloat16, name="d_x", tolerance=FP8_TOLERANCE)
    for name in ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down"):
        assert_close(grads[name], grads_ref[name], dtype=torch.bfloat16, name=name,
                     tolerance=FP8_TOLERANCE)
    module.backend = Backend.MOK
    assert_steps_close(compiled_step(module, x), (y, d_x, grads))


def test_fp8_module_rejects_what_it_cannot_run():
    # An unknown precision is refused by the constructor; expert widths of a partial scale
    # block run (the reference backend ignores precision).
    with pytest.raises(ValueError, match="precision"):
        MoE(32, 16, 4, 2, precision="int8")
    x = torch.randn(4, 32, device=DEVICE)
    for backend in ("mok", "reference"):
        module = MoE(32, 16, 4, 2, 24, precision="fp8", backend=backend, device=DEVICE)
        out = module(x)
        assert out.shape == (4, 32) and out.isfinite().all()
