"""mok.reference.moe_reference_fp8_grads, the FP8 recipe in plain PyTorch (CPU, fast)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok.reference import (
    dequantize_e4m3,
    moe_reference_fp8_grads,
    moe_reference_grads,
    quantize_e4m3,
    swiglu,
)
from mok.testing import GRAD_NAMES, RoutingPattern, error_report, make_inputs, pad_expert_widths

# e4m3 keeps 3 mantissa bits: ~6.5% relative error of the outputs at these sizes (section 3.5).
FP8_REL_RMS = 0.12
LIMIT = 2.5  # clamps about 1% of the pre-activations of make_inputs' unit-scale activations

CASES = [(128, 0, None), (256, 128, None), (256, 128, LIMIT)]


def _inputs(intermediate, shared, seed=0, **kwargs):
    return make_inputs(64, 256, intermediate, 4, 2, shared_intermediate_size=shared, seed=seed,
                       **kwargs)


@pytest.mark.parametrize("intermediate, shared, limit", CASES)
def test_close_to_fp32_reference(intermediate, shared, limit):
    inputs = _inputs(intermediate, shared)
    if limit is not None:  # the limit is exercised: some pre-activations clamp
        x, w_gate, w_up = inputs.x.float(), *(w.float() for w in inputs.routed_weights[:2])
        assert ((x @ w_gate.transpose(1, 2)) > limit).any()
        assert ((x @ w_up.transpose(1, 2)).abs() > limit).any()
    y, grads = moe_reference_fp8_grads(inputs, swiglu_limit=limit)
    y_ref, grads_ref = moe_reference_grads(inputs, swiglu_limit=limit,
                                           compute_dtype=torch.float32)
    assert y.dtype == grads[0].dtype == inputs.x.dtype
    for name, actual, expected in zip(("y", *GRAD_NAMES), (y, *grads), (y_ref, *grads_ref),
                                      strict=True):
        if expected is None:
            assert actual is None, name
            continue
        report = error_report(actual, expected, name)
        assert not report.nonfinite, report
        assert report.rel_rms < FP8_REL_RMS, report


def test_quantization_is_not_a_no_op():
    inputs = _inputs(256, 128)
    y, _ = moe_reference_fp8_grads(inputs)
    y_ref, _ = moe_reference_grads(inputs, compute_dtype=torch.float32)
    assert error_report(y, y_ref).rel_rms > 0.005


def _roundtrip(a, block):
    return dequantize_e4m3(*quantize_e4m3(a, block), block)


def _exact(shape, block, exponent, gen):
    """Values on e4m3's grid times 2^exponent, each block's amax 448 * 2^exponent: unchanged by
    quantization in `block`s and representable in bf16."""
    v = (torch.randn(*shape, generator=gen) * 100).clamp(-448, 448)
    v = v.to(torch.float8_e4m3fn).float()
    v[..., ::block[0], ::block[1]] = 448.0
    v = (v * 2.0 ** exponent).to(torch.bfloat16)
    assert torch.equal(_roundtrip(v, block), v.float())
    return v


def _hand_forward_backward(inputs, limit):
    """y, d_x and d_router_weights token by token, route by route, on operands that quantize
    exactly (so only h's and d_gate_up's quantization remains)."""
    dt = inputs.x.dtype

    def rnd(v):
        return v.to(dt).float()

    x, d_out = inputs.x.float(), inputs.d_output.float()
    wg, wu, wd = (w.float() for w in inputs.routed_weights)
    num_tokens, topk = inputs.topk_experts.shape
    y = torch.zeros_like(x)
    d_x = torch.zeros_like(x)
    d_router = torch.zeros(num_tokens, topk)
    for t in range(num_tokens):
        experts = [(None, 1.0, *(w.float() for w in inputs.shared_weights))]
        experts = experts if inputs.w_shared_gate is not None else []
        for j in range(topk):
            e = int(inputs.topk_experts[t, j])
            experts.append((j, float(inputs.router_weights[t, j]), wg[e], wu[e], wd[e]))
        y_sum = torch.zeros(x.shape[1])
        d_x_sum = torch.zeros(x.shape[1])
        for j, w, w_gate, w_up, w_down in experts:
            g, u = w_gate @ x[t], w_up @ x[t]
            h = _roundtrip(swiglu(g, u, limit)[None], (1, 128))[0]
            y_sum = y_sum + rnd(w * (w_down @ h))
            gb = rnd(g).requires_grad_(True)
            ub = rnd(u).requires_grad_(True)
            hb = swiglu(gb, ub, limit)
            dh0 = d_out[t] @ w_down
            if j is not None:
                d_router[t, j] = (dh0 * hb.detach()).sum()
            d_gate, d_up = torch.autograd.grad(hb, (gb, ub), w * dh0)
            if limit is not None:  # clamped where the fp32 value passed the limit
                d_gate = torch.where(g > limit, 0.0, d_gate)
                d_up = torch.where(u.abs() > limit, 0.0, d_up)
            d_gate_up = _roundtrip(torch.cat((d_gate, d_up))[None], (1, 128))[0]
            d_x_sum = d_x_sum + rnd(d_gate_up[:g.shape[0]] @ w_gate
                                    + d_gate_up[g.shape[0]:] @ w_up)
        y[t] = rnd(y_sum)
        d_x[t] = rnd(d_x_sum)
    return y, d_x, d_router


@pytest.mark.parametrize("limit", [None, 1.0])
def test_exact_operands_match_hand_computation(limit):
    gen = torch.Generator().manual_seed(7)
    tokens, hidden, inter, experts = 16, 256, 128, 4
    inputs = make_inputs(tokens, hidden, inter, experts, 2, shared_intermediate_size=128, seed=7)
    inputs = dataclasses.replace(
        inputs,
        x=_exact((tokens, hidden), (1, 128), -8, gen),
        d_output=_exact((tokens, hidden), (1, 128), -8, gen),
        w_shared_gate=_exact((inter, hidden), (128, 128), -9, gen),
        w_shared_up=_exact((inter, hidden), (128, 128), -9, gen),
        w_shared_down=_exact((hidden, inter), (128, 128), -9, gen),
        w_routed_gate=_exact((experts, inter, hidden), (128, 128), -9, gen),
        w_routed_up=_exact((experts, inter, hidden), (128, 128), -9, gen),
        w_routed_down=_exact((experts, hidden, inter), (128, 128), -9, gen),
    )
    y, grads = moe_reference_fp8_grads(inputs, swiglu_limit=limit)
    y_hand, d_x_hand, d_router_hand = _hand_forward_backward(inputs, limit)
    # The same rounding steps; only the fp32 GEMMs' summation order differs, which may move a
    # value across a bf16 or e4m3 rounding boundary now and then.
    for name, actual, expected in (("y", y, y_hand), ("d_x", grads[0], d_x_hand),
                                   ("d_router_weights", grads[1], d_router_hand)):
        report = error_report(actual, expected, name)
        assert report.rel_rms < 1e-3 and report.max_rel < 1e-2, report


def test_deterministic():
    inputs = _inputs(256, 128, seed=3)
    first = moe_reference_fp8_grads(inputs, swiglu_limit=LIMIT)
    second = moe_reference_fp8_grads(inputs, swiglu_limit=LIMIT)
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[1], second[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_empty_expert_and_few_tokens():
    inputs = make_inputs(5, 256, 128, 4, 2, shared_intermediate_size=128, seed=4,
                         routing=RoutingPattern.EMPTY_EXPERT)
    y, grads = moe_reference_fp8_grads(inputs)
    assert y.shape == inputs.x.shape and grads[1].shape == inputs.router_weights.shape
    for grad in grads[2:5]:
        assert grad is not None and not grad[-1].any() and grad[:-1].any()
    empty = make_inputs(0, 256, 128, 4, 2, shared_intermediate_size=128, seed=4)
    y, grads = moe_reference_fp8_grads(empty)
    assert y.shape == (0, 256) and all(not g.any() for g in grads[2:])


def test_d_gate_and_d_up_are_quantized_apart():
    # d_x's e4m3 d_gate_up: each half its own 1 x 128 blocks, so an I that is no multiple of
    # 128 gives what the same experts padded with zero weights to 256 give.
    inputs = make_inputs(8, 256, 192, 4, 2, shared_intermediate_size=64, seed=6)
    y, grads = moe_reference_fp8_grads(inputs)
    y_pad, grads_pad = moe_reference_fp8_grads(pad_expert_widths(inputs))
    torch.testing.assert_close(y, y_pad, rtol=1e-6, atol=1e-6)
    for grad, wide in zip(grads, grads_pad, strict=True):
        torch.testing.assert_close(grad, wide[tuple(slice(0, n) for n in grad.shape)],
                                   rtol=1e-6, atol=1e-6)
