"""MoKConfig(precision="fp8"): the layer against the same recipe in PyTorch
(mok.reference.moe_reference_fp8_grads) and against the exact reference within the FP8
tolerance; determinism; what it rejects; the weight cache."""

import pytest
import torch

import mok.functional as F
from mok import ops
from mok.errors import MoKInputError
from mok.reference import moe_reference_fp8_grads
from mok.testing import GRAD_NAMES, assert_close, make_inputs, moe_reference_grads
from mok.testing.tolerance import FP8_TOLERANCE, Tolerance

from ..conftest import run_layer, tiles_for_tests

# Against the same recipe in fp32. The kernels sum in other orders, and on Hopper the tensor
# cores sum each 128-deep block of e4m3 products with fewer bits than fp32 (measured on one
# H200: up to 2.7e-4 of the block's largest value), which moves some of the e4m3 roundings of h
# and d_gate_up (0.5% of d_gate_up's codes): 2e-4 rel_rms under the interpreter, 3e-3 (y) to
# 7e-3 (d_x) on the H200; still a tenth of FP8's own error against the exact layer.
RECIPE = Tolerance(rel_rms=1.5e-2, max_rel=0.1)


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
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y", tolerance=RECIPE)
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert (actual is None) == (expected is None), name
        if expected is not None:
            assert actual.shape == expected.shape, name
            assert_close(actual, expected, dtype=torch.bfloat16, name=name, tolerance=RECIPE)
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


def test_fp8_layer_is_deterministic_and_kept_equals_recomputed(device):
    inputs = make_inputs(40, 256, 128, 3, 2, device=device, seed=3)
    runs = [fp8_run(inputs, recompute=recompute) for recompute in (True, True, False)]
    (y, grads, *_), *others = runs
    for y_other, grads_other, *_ in others:
        assert torch.equal(y, y_other)
        for name, a, b in zip(GRAD_NAMES, grads, grads_other, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), name


def test_fp8_rejects_what_it_cannot_run(device):
    inputs = make_inputs(16, 256, 192, 2, 1, device=device, seed=4)
    with pytest.raises(MoKInputError, match="multiple of 128"):
        fp8_run(inputs)
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


def fp8_cache_entries():
    from mok.ops.fp8 import _CACHE

    return dict(_CACHE)
