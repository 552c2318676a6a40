"""MoKConfig(precision="fp8"): the layer against the same recipe in PyTorch
(mok.reference.moe_reference_fp8_grads) and against the exact reference within the FP8
tolerance; determinism; what it rejects; the weight cache."""

import dataclasses

import pytest
import torch

import mok.functional as F
from mok import ops
from mok.errors import MoKInputError
from mok.reference import moe_reference_fp8_grads
from mok.testing import (
    GRAD_NAMES,
    assert_close,
    make_inputs,
    moe_reference_grads,
    pad_expert_widths,
)
from mok.testing.tolerance import FP8_TOLERANCE, Tolerance

from ..conftest import run_layer, tiles_for_tests

# Against the same recipe in fp32. The kernels sum in other orders, and on Hopper the tensor
# cores sum each 128-deep block of e4m3 products with fewer bits than fp32 (measured on one
# H200: up to 2.7e-4 of the block's largest value), which moves some of the e4m3 roundings of h
# and d_gate_up (0.5% of d_gate_up's codes): 2e-4 rel_rms under the interpreter, 3e-3 (y) to
# 7e-3 (d_x) on the H200; still a tenth of FP8's own error against the exact layer.
RECIPE = Tolerance(rel_rms=1.5e-2, max_rel=0.1)
# FP8 weight gradients against the recipe. Their operands are quantized along the routes: a
# column's 128-route block shares one scale, so a value that moves its block's amax moves every
# code of the block. Measured on the recipe itself (CPU): 1% of x's values moved by one bf16
# ulp moves the weight gradients by up to 0.17 max_rel and 1.4e-2 rel_rms (bf16 weight
# gradients: 0.075 and 5.7e-3); on an H100 the layer's were 0.12 and 5.9e-3 off the recipe.
RECIPE_WGRAD = Tolerance(rel_rms=3e-2, max_rel=0.3)


def assert_recipe(y, grads, y_ref, grads_ref, *, fp8_weight_gradients=False):
    """The layer's output and gradients against the recipe's, within RECIPE (the weight
    gradients within RECIPE_WGRAD with fp8_weight_gradients)."""
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y", tolerance=RECIPE)
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert (actual is None) == (expected is None), name
        if expected is not None:
            assert actual.shape == expected.shape, name
            wgrad = fp8_weight_gradients and name.startswith("d_w")
            assert_close(actual, expected, dtype=torch.bfloat16, name=name,
                         tolerance=RECIPE_WGRAD if wgrad else RECIPE)


def fp8_run(inputs, *, recompute=True, limit=None):
    config = F.MoKConfig(precision="fp8", recompute_gate_up=recompute)
    return run_layer(inputs, config=config, swiglu_limit=limit, tiles=tiles_for_tests(32))


@pytest.mark.parametrize(("shared", "recompute", "limit", "dtype"),
                         [(0, True, None, torch.bfloat16), (128, True, 2.5, torch.bfloat16),
                          (128, False, None, torch.bfloat16), (0, False, None, torch.float16)],
                         ids=["routed", "shared_limit", "shared_kept", "fp16_kept"])
def test_fp8_layer_matches_the_recipe(device, shared, recompute, limit, dtype):
    inputs = make_inputs(48, 256, 128, 4, 2, shared_intermediate_size=shared, device=device,
                         seed=2, dtype=dtype)
    y, grads, _, context = fp8_run(inputs, recompute=recompute, limit=limit)
    y_ref, grads_ref = moe_reference_fp8_grads(inputs, swiglu_limit=limit)
    assert_recipe(y, grads, y_ref, grads_ref)
    if limit is None:  # against the exact layer: what e4m3's 3 mantissa bits give (a limit
        # adds to it: the rounding moves pre-activations across it, switching their gradients)
        y_exact, grads_exact = moe_reference_grads(inputs)
        assert_close(y, y_exact, dtype=torch.bfloat16, name="y", tolerance=FP8_TOLERANCE)
        for name, actual, expected in zip(GRAD_NAMES, grads, grads_exact, strict=True):
            if expected is not None:
                assert_close(actual, expected, dtype=torch.bfloat16, name=name,
                             tolerance=FP8_TOLERANCE)
    # Recomputing: the context keeps nothing; kept: the pre-activations only.
    assert context.h is None and context.h_shared is None
    assert (context.gate_up is None) == recompute


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept"])
def test_fp8_weight_gradients_match_the_recipe(device, recompute):
    # MoKConfig(fp8_weight_gradients=True): experts of more than 128 rows (several row blocks)
    # and a shared expert; the other outputs are those of the default (bf16 weight gradients).
    inputs = make_inputs(160, 256, 128, 2, 2, shared_intermediate_size=128, device=device,
                         seed=11)
    config = F.MoKConfig(precision="fp8", recompute_gate_up=recompute, fp8_weight_gradients=True)
    y, grads, _, _ = run_layer(inputs, config=config, swiglu_limit=3.0, tiles=tiles_for_tests(32))
    y_ref, grads_ref = moe_reference_fp8_grads(inputs, swiglu_limit=3.0,
                                               fp8_weight_gradients=True)
    assert_recipe(y, grads, y_ref, grads_ref, fp8_weight_gradients=True)
    y_bf16, grads_bf16, _, _ = fp8_run(inputs, recompute=recompute, limit=3.0)
    assert torch.equal(y, y_bf16)
    for name, a, b in zip(GRAD_NAMES, grads, grads_bf16, strict=True):
        if name.startswith("d_w"):  # the e4m3 operands' error, FP8's size
            assert_close(a, b, dtype=torch.bfloat16, name=name, tolerance=FP8_TOLERANCE)
            assert not torch.equal(a, b), name
        else:
            assert torch.equal(a, b), name
    again = run_layer(inputs, config=config, swiglu_limit=3.0, tiles=tiles_for_tests(32))[1]
    for name, a, b in zip(GRAD_NAMES, grads, again, strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="fp8_weight_gradients needs precision='fp8'"):
        F.MoKConfig(fp8_weight_gradients=True)


def test_fp8_layer_is_deterministic_and_kept_equals_recomputed(device):
    inputs = make_inputs(40, 256, 128, 3, 2, device=device, seed=3)
    runs = [fp8_run(inputs, recompute=recompute) for recompute in (True, True, False)]
    (y, grads, *_), *others = runs
    for y_other, grads_other, *_ in others:
        assert torch.equal(y, y_other)
        for name, a, b in zip(GRAD_NAMES, grads, grads_other, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("limit", [None, 2.5], ids=["plain", "limit"])
def test_fp8_layer_with_the_dswiglu_apart_is_the_layer_in_one_launch(device, monkeypatch, limit):
    # The plan runs the dSwiGLU apart where its GEMM has Gluon tiles (sm_90); here the Triton
    # kernel runs both ways. A shared expert (no router weights) and routed ones, kept and
    # recomputed pre-activations: every output and gradient the same bits (on a GPU the
    # router-weight gradient within 1e-5).
    from mok import plan

    inputs = make_inputs(40, 256, 128, 3, 2, shared_intermediate_size=128, device=device,
                         seed=4)
    one = [fp8_run(inputs, recompute=recompute, limit=limit) for recompute in (True, False)]
    made = plan.fp8_plan

    def apart(*args, **kwargs):
        return dataclasses.replace(made(*args, **kwargs), dswiglu_apart=True)

    monkeypatch.setattr(F, "fp8_plan", apart)
    two = [fp8_run(inputs, recompute=recompute, limit=limit) for recompute in (True, False)]
    for (y, grads, *_), (y_two, grads_two, *_) in zip(one, two, strict=True):
        assert torch.equal(y, y_two)
        for name, a, b in zip(GRAD_NAMES, grads, grads_two, strict=True):
            if name == "d_router_weights" and a.is_cuda:
                # compiled, the two kernels sum the partial sums' 128 columns in other orders
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize(("tokens", "experts", "hidden", "inter", "shared", "recompute", "limit",
                          "wgrad"),
                         [(48, 4, 256, 192, 0, True, 2.5, False),
                          (160, 2, 200, 200, 136, False, None, True)],
                         ids=["i192_limit", "h200_i200_shared_kept_wgrad"])
def test_fp8_widths_that_are_no_multiple_of_128(device, tokens, experts, hidden, inter, shared,
                                                recompute, limit, wgrad):
    # Expert widths with a partial last scale block (gate's and up's halves padded apart in the
    # backward's e4m3 d_gate_up, the weight gradients' split inside a tile): the recipe, and
    # the layer whose experts are padded with zero weights to a multiple of 128, which gives
    # the same numbers (zero blocks and columns add nothing, a partial block's scale is its
    # values' amax). FP8 weight gradients with experts of more than 128 rows (two row blocks).
    inputs = make_inputs(tokens, hidden, inter, experts, 2, shared_intermediate_size=shared,
                         device=device, seed=9)
    config = F.MoKConfig(precision="fp8", recompute_gate_up=recompute,
                         fp8_weight_gradients=wgrad)
    y, grads, _, _ = run_layer(inputs, config=config, swiglu_limit=limit,
                               tiles=tiles_for_tests(32))
    y_ref, grads_ref = moe_reference_fp8_grads(inputs, swiglu_limit=limit,
                                               fp8_weight_gradients=wgrad)
    assert_recipe(y, grads, y_ref, grads_ref, fp8_weight_gradients=wgrad)
    y_pad, grads_pad, _, _ = run_layer(pad_expert_widths(inputs), config=config,
                                       swiglu_limit=limit, tiles=tiles_for_tests(32))
    torch.testing.assert_close(y, y_pad, rtol=1e-6, atol=1e-6)
    for name, actual, wide in zip(GRAD_NAMES, grads, grads_pad, strict=True):
        if actual is not None:
            wide = wide[tuple(slice(0, n) for n in actual.shape)]
            torch.testing.assert_close(actual, wide, rtol=1e-6, atol=1e-6, msg=name)


def test_fp8_rejects_what_it_cannot_run(device):
    with pytest.raises(ValueError, match="precision"):
        F.MoKConfig(precision="fp4")
    # A context made in bf16 cannot feed an FP8 backward.
    inputs = make_inputs(16, 256, 128, 2, 1, device=device, seed=4)
    bf16, fp8 = F.MoKConfig(), F.MoKConfig(precision="fp8")
    workspace = F.create_workspace(bf16, None, device=device, num_local_tokens=16,
                                   hidden_size=256, topk=1)
    schedule = F.build_schedule(workspace, bf16, inputs.topk_experts, num_local_experts=2,
                                tiles=tiles_for_tests(32))
    _, context = F.forward(bf16, workspace, schedule, *inputs.layer_args)
    with pytest.raises(MoKInputError, match="precision"):
        F.backward(fp8, workspace, schedule, context, inputs.d_output, *inputs.layer_args)


def test_fp8_recompute_forward_context_gives_the_forward_s(device):
    inputs = make_inputs(30, 256, 128, 2, 2, shared_intermediate_size=128, device=device, seed=5)
    config = F.MoKConfig(precision="fp8", recompute_gate_up=False)
    y, grads, schedule, context = run_layer(inputs, config=config, tiles=tiles_for_tests(32))
    workspace = schedule.workspace
    _, context = F.forward(config, workspace, schedule, *inputs.layer_args)
    rebuilt = F.recompute_forward_context(
        config, workspace, schedule, inputs.x, inputs.w_shared_gate, inputs.w_shared_up,
        inputs.w_routed_gate, inputs.w_routed_up)
    used = int(schedule.routing.used_rows)
    assert torch.equal(rebuilt.gate_up[:used], context.gate_up[:used])
    grads_rebuilt = F.backward(config, workspace, schedule, rebuilt, inputs.d_output,
                               *inputs.layer_args)
    for name, a, b in zip(GRAD_NAMES, grads, grads_rebuilt, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
    # The backward wrote the gradients over the kept pre-activations: the context is used up.
    with pytest.raises(MoKInputError, match="serves one backward"):
        F.backward(config, workspace, schedule, rebuilt, inputs.d_output, *inputs.layer_args)


def test_fp8_layer_stays_finite_with_tokens_of_tiny_values(device):
    # Rows of normal bf16 values below 448 * 2**-126: their blocks' scales come from that
    # floor (448 / amax overflowed and turned the block's zeros into NaN, which reached y, d_x
    # and the whole weight gradients of the experts the token was routed to).
    inputs = make_inputs(16, 256, 128, 4, 2, shared_intermediate_size=128, device=device,
                         seed=9)
    with torch.no_grad():
        inputs.x[3] *= 1e-37
        inputs.d_output[5] *= 1e-37
    y, grads, _, _ = fp8_run(inputs, recompute=False)
    assert torch.isfinite(y).all()
    for name, grad in zip(GRAD_NAMES, grads, strict=True):
        assert grad is None or torch.isfinite(grad).all(), name
    y_ref, grads_ref = moe_reference_fp8_grads(inputs)
    assert_recipe(y, grads, y_ref, grads_ref)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept"])
def test_fp8_backward_refuses_shared_weights_the_forward_did_not_run(device, recompute):
    # A recomputing FP8 context keeps no tensor that would tell whether the forward ran a
    # shared expert; it records it.
    inputs = make_inputs(24, 256, 128, 4, 2, shared_intermediate_size=128, device=device,
                         seed=11)
    config = F.MoKConfig(precision="fp8", recompute_gate_up=recompute)
    no_shared = (inputs.x, inputs.router_weights, None, None, None, *inputs.routed_weights)
    for forward_args, backward_args in ((inputs.layer_args, no_shared),
                                        (no_shared, inputs.layer_args)):
        workspace = F.create_workspace(config, None, device=device, num_local_tokens=24,
                                       hidden_size=256, topk=2)
        schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                    num_local_experts=4, tiles=tiles_for_tests(32))
        _, context = F.forward(config, workspace, schedule, *forward_args)
        with pytest.raises(MoKInputError, match="disagree"):
            F.backward(config, workspace, schedule, context, inputs.d_output, *backward_args)


def test_fp8_module_trains_under_autocast(device):
    # The backward quantizes the shared expert's weights (views made per call), inside
    # autocast when the loss's backward runs there: autocast must not reach the e4m3 copies.
    from mok.nn import MoE

    ops.clear_fp8_cache()
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2)).to(device)
    grads = []
    for inside in (True, False):
        torch.manual_seed(0)
        module = MoE(256, 128, 4, 2, shared_intermediate_size=128, precision="fp8",
                     dtype=torch.bfloat16, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = module(x.bfloat16()).float().pow(2).mean()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append({name: p.grad for name, p in module.named_parameters()})
    # the experts' gradients as outside autocast; the router's backward matmul runs in bf16
    # inside it (PyTorch's autocast, not mok's)
    for name, grad in grads[0].items():
        if name.startswith("router"):
            torch.testing.assert_close(grad, grads[1][name], rtol=1e-2, atol=1e-4)
        else:
            assert torch.equal(grad, grads[1][name]), name


def test_fp8_weight_cache_follows_in_place_writes(device):
    ops.clear_fp8_cache()
    inputs = make_inputs(8, 256, 128, 2, 1, device=device, seed=6)
    weights = inputs.routed_weights
    first = ops.cached_quantize_experts(*weights)
    assert ops.cached_quantize_experts(*weights) is first  # same versions: reused
    assert ops.cached_quantize_experts(*weights[:2], None).gate is first.gate
    with torch.no_grad():
        weights[0].mul_(2)  # an optimizer step's in-place write bumps the version
    second = ops.cached_quantize_experts(*weights)
    assert second is not first
    expected = ops.quantize_experts(*weights)
    for got, want in zip(second, expected, strict=True):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scales, want.scales)
    ops.clear_fp8_cache()
    assert ops.cached_quantize_experts(*weights) is not second
    # An entry lives as long as its weights: copies made per call (a cast of fp32 parameters)
    # leave nothing behind.
    for _ in range(3):
        ops.cached_quantize_experts(*(w.float().bfloat16() for w in weights))
    assert len(fp8_cache_entries()) == 1
    del weights, inputs
    assert not fp8_cache_entries()


def test_fp8_weight_cache_is_cleared_by_optimizer_steps_that_bump_no_version(device):
    # A fused optimizer writes the weights without bumping their version counters; every
    # torch.optim step clears the cache, so the next forward quantizes the new weights.
    ops.clear_fp8_cache()
    inputs = make_inputs(8, 256, 128, 2, 1, device=device, seed=7)
    weights = [torch.nn.Parameter(w.clone()) for w in inputs.routed_weights]
    first = ops.cached_quantize_experts(*weights)
    versions = [w._version for w in weights]
    for w in weights:
        w.grad = torch.randn_like(w)
    torch.optim.AdamW(weights, lr=0.1, fused=True).step()
    assert [w._version for w in weights] == versions  # what makes the hook necessary
    second = ops.cached_quantize_experts(*weights)
    assert second is not first
    for got, want in zip(second, ops.quantize_experts(*weights), strict=True):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))


def test_fp8_weight_cache_serves_views_frees_superseded_copies_and_lets_tensors_swap(device):
    import gc
    import weakref

    ops.clear_fp8_cache()
    inputs = make_inputs(8, 256, 128, 2, 1, device=device, seed=8)
    weights = [torch.nn.Parameter(w.clone()) for w in inputs.routed_weights]
    first = ops.cached_quantize_experts(*weights)
    # views of the same memory (a fresh one per call, as the shared expert's) share the entry
    assert ops.cached_quantize_experts(*(w[:] for w in weights)) is first
    gc.disable()  # superseded copies go without the cycle collector
    try:
        old = weakref.ref(first.gate.data)
        del first
        with torch.no_grad():
            weights[1].add_(1)
        ops.cached_quantize_experts(*weights)
        assert old() is None
    finally:
        gc.enable()
    # no weak reference to the weights themselves: they can still be swapped
    swapped = torch.nn.Parameter(weights[0].detach() * 2)
    torch.utils.swap_tensors(weights[0], swapped)
    got = ops.cached_quantize_experts(*weights).gate
    want = ops.quantize_weights(weights[0])
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))


def test_fp8_weight_cache_in_a_graph_capture_serves_that_capture_only(device, monkeypatch):
    # Inside a CUDA-graph capture (its id from the driver, simulated here) only entries made in
    # the same capture serve: the captured forward quantizes, its backward reuses that copy, an
    # eager entry (whose copy no replay would refresh) is not read, and a capture's entries go
    # when the next capture makes one. A capture the driver does not name caches nothing.
    import mok.ops.fp8 as fp8

    ops.clear_fp8_cache()
    weights = make_inputs(8, 256, 128, 2, 1, device=device, seed=9).routed_weights
    tag = [None]
    monkeypatch.setattr(fp8, "_capture_tag", lambda w: tag[0])
    eager = ops.cached_quantize_experts(*weights)
    tag[0] = ("capture", 1)
    first = ops.cached_quantize_experts(*weights)
    assert first is not eager
    assert ops.cached_quantize_experts(*weights) is first
    assert ops.cached_quantize_experts(*weights[:2], None).gate is first.gate
    for got, want in zip(first, eager, strict=True):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    tag[0] = ("capture", 2)
    second = ops.cached_quantize_experts(*weights)
    assert second is not first and len(fp8_cache_entries()) == 2  # eager's and capture 2's
    tag[0] = fp8._UNNAMED
    unnamed = ops.cached_quantize_experts(*weights)
    assert ops.cached_quantize_experts(*weights) is not unnamed
    assert len(fp8_cache_entries()) == 2
    # After a capture quantized them, eager calls quantize these weights afresh: the graph's
    # replays may write them (an optimizer step in it too) without bumping a version.
    tag[0] = None
    after = ops.cached_quantize_experts(*weights)
    assert after is not eager and ops.cached_quantize_experts(*weights) is not after
    ops.clear_fp8_cache()  # also an optimizer step's: graphed weights stay uncached
    assert ops.cached_quantize_experts(*weights) is not ops.cached_quantize_experts(*weights)
    other = make_inputs(8, 256, 128, 2, 1, device=device, seed=10).routed_weights
    assert ops.cached_quantize_experts(*other) is ops.cached_quantize_experts(*other)
    fp8._GRAPHED.clear()


def fp8_cache_entries():
    from mok.ops.fp8 import _CACHE

    return dict(_CACHE)


def test_fp8_layer_takes_an_alignment_that_is_no_power_of_two(device):
    # align 48: the FP8 row tiles take 16 rows (the largest power of two dividing it).
    from mok.ops import small_tiles

    inputs = make_inputs(40, 256, 128, 3, 2, device=device, seed=6)
    y, grads, _, _ = run_layer(inputs, config=F.MoKConfig(precision="fp8"),
                               tiles=small_tiles(16, 48))
    y_ref, grads_ref = moe_reference_fp8_grads(inputs)
    assert_recipe(y, grads, y_ref, grads_ref)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize(("recompute", "limit"), [(True, None), (False, None), (False, 0.5)],
                         ids=["recompute", "kept", "kept_limit"])
def test_fp8_nonfinite_inputs_stay_in_their_token(device, recompute, limit):
    # design.md 7, in FP8: a NaN in x[3] makes y[3] NaN (e4m3 codes keep NaN: an output clamped
    # to +-448 before its cast must compare, not take min/max, which drop NaN on a GPU), an inf
    # router weight of token 7 makes y[7] non-finite; every other token's outputs and
    # gradients, and the weight gradients of experts neither reaches, are those of the run
    # without them, bit for bit; with a SwiGLU limit too (its clamp keeps NaN).
    def inputs():
        return make_inputs(48, 256, 128, 4, 2, shared_intermediate_size=128, device=device,
                           seed=21)

    dirty = inputs()
    with torch.no_grad():
        dirty.x[3, 5] = float("nan")
        dirty.router_weights[7, 1] = float("inf")
    y, grads, _, _ = fp8_run(dirty, recompute=recompute, limit=limit)
    y_clean, grads_clean, _, _ = fp8_run(inputs(), recompute=recompute, limit=limit)
    assert bool(torch.isnan(y[3]).all())
    assert not bool(torch.isfinite(y[7]).all())
    others = torch.ones(48, dtype=torch.bool, device=y.device)
    others[[3, 7]] = False
    assert torch.equal(y[others], y_clean[others])
    for name in ("d_x", "d_router_weights"):
        grad, clean = grads[GRAD_NAMES.index(name)], grads_clean[GRAD_NAMES.index(name)]
        assert torch.equal(grad[others], clean[others]), name
        assert not bool(torch.isfinite(grad[3]).all()), name
    touched = set(dirty.topk_experts[3].tolist()) | {int(dirty.topk_experts[7, 1])}
    for name in ("d_w_routed_gate", "d_w_routed_up", "d_w_routed_down"):
        grad, clean = grads[GRAD_NAMES.index(name)], grads_clean[GRAD_NAMES.index(name)]
        for expert in range(grad.shape[0]):
            if expert in touched:
                assert not bool(torch.isfinite(grad[expert]).all()), (name, expert)
            else:
                assert torch.equal(grad[expert], clean[expert]), (name, expert)
