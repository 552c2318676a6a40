"""Bad input gets a clear error before any kernel runs."""

import dataclasses

import pytest
import torch

import mok.functional as F
from mok import MoKInputError
from mok.testing import make_inputs

from ..conftest import DEVICE, tiles_for_tests


@pytest.fixture
def setup():
    inputs = make_inputs(12, 16, 24, 4, 2, shared_intermediate_size=8, device=DEVICE, seed=1)
    config = F.MoKConfig()
    workspace = F.create_workspace(config, None, device=DEVICE, num_local_tokens=12,
                                   hidden_size=16, topk=2)
    schedule = F.build_schedule(workspace, config, inputs.topk_experts, num_local_experts=4,
                                tiles=tiles_for_tests(16))
    return inputs, config, workspace, schedule


def forward_with(setup, **changes):
    inputs, config, workspace, schedule = setup
    inputs = dataclasses.replace(inputs, **changes)
    return F.forward(config, workspace, schedule, *inputs.layer_args)


@pytest.mark.parametrize("changes,match", [
    (lambda i: dict(x=i.x.float()), "x has dtype"),
    (lambda i: dict(x=i.x[:, :8]), r"x has shape \(12, 8\)"),
    (lambda i: dict(x=i.x[:10]), r"x has shape \(10, 16\)"),
    (lambda i: dict(router_weights=i.router_weights.bfloat16()), "router_weights has dtype"),
    (lambda i: dict(router_weights=i.router_weights[:, :1]), "router_weights has shape"),
    (lambda i: dict(w_routed_up=i.w_routed_up[:, :8]), "w_routed_up has shape"),
    (lambda i: dict(w_routed_down=i.w_routed_down.transpose(1, 2)), "w_routed_down has shape"),
    (lambda i: dict(w_routed_gate=i.w_routed_gate[:3]), "holds 3 experts"),
    (lambda i: dict(w_routed_gate=i.w_routed_gate[0]), "3-d tensor"),
    (lambda i: dict(w_routed_up=i.w_routed_up.half()), "w_routed_up has dtype"),
    (lambda i: dict(w_shared_up=None), "all given or all None"),
    (lambda i: dict(w_shared_down=i.w_shared_down.T), "w_shared_down has shape"),
    (lambda i: dict(x=i.x.to("meta")), "x is on meta"),
])
def test_forward_rejects_bad_tensors(setup, changes, match):
    with pytest.raises(MoKInputError, match=match):
        forward_with(setup, **changes(setup[0]))


def test_backward_rejects_bad_gradient_and_context(setup):
    inputs, config, workspace, schedule = setup
    y, context = F.forward(config, workspace, schedule, *inputs.layer_args)
    with pytest.raises(MoKInputError, match="d_output has dtype"):
        F.backward(config, workspace, schedule, context, inputs.d_output.half(),
                   *inputs.layer_args)
    with pytest.raises(MoKInputError, match="forward_context"):
        F.backward(config, workspace, schedule, None, inputs.d_output, *inputs.layer_args)
    no_shared = (inputs.x, inputs.router_weights, None, None, None, *inputs.routed_weights)
    with pytest.raises(MoKInputError, match="disagree"):
        F.backward(config, workspace, schedule, context, inputs.d_output, *no_shared)
    emptied = dataclasses.replace(context, h=None, gate_up=None)
    with pytest.raises(MoKInputError, match="neither h nor gate_up"):
        F.backward(config, workspace, schedule, emptied, inputs.d_output, *inputs.layer_args)
    cut = dataclasses.replace(context, gate_up=context.gate_up[:, :4])
    with pytest.raises(MoKInputError, match="another schedule"):
        F.backward(config, workspace, schedule, cut, inputs.d_output, *inputs.layer_args)
    # A context with kept pre-activations serves one backward: it writes the gradients over
    # them, and a second backward on it is refused, never run on the gradients.
    F.backward(config, workspace, schedule, context, inputs.d_output, *inputs.layer_args)
    with pytest.raises(MoKInputError, match="serves one backward"):
        F.backward(config, workspace, schedule, context, inputs.d_output, *inputs.layer_args)
    # The same for a forward under torch.inference_mode, whose tensors have no version counter
    # (the second backward ran on the first one's gradients).
    with torch.inference_mode():
        _, context = F.forward(config, workspace, schedule, *inputs.layer_args)
    F.backward(config, workspace, schedule, context, inputs.d_output, *inputs.layer_args)
    with pytest.raises(MoKInputError, match="serves one backward"):
        F.backward(config, workspace, schedule, context, inputs.d_output, *inputs.layer_args)
    # A context goes with the schedule it was made with: another of the same sizes holds other
    # rows.
    other = F.build_schedule(workspace, config, inputs.topk_experts.flip(0),
                             num_local_experts=schedule.routing.num_local_experts)
    _, context = F.forward(config, workspace, schedule, *inputs.layer_args)
    with pytest.raises(MoKInputError, match="made with another schedule"):
        F.backward(config, workspace, other, context, inputs.d_output, *inputs.layer_args)


def test_schedule_rejects_bad_routing(setup):
    inputs, config, workspace, _ = setup
    with pytest.raises(MoKInputError, match="topk_experts has dtype"):
        F.build_schedule(workspace, config, inputs.topk_experts.float(), num_local_experts=4)
    with pytest.raises(MoKInputError, match="topk_experts has shape"):
        F.build_schedule(workspace, config, inputs.topk_experts[:, :1], num_local_experts=4)
    too_many = torch.zeros(13, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(MoKInputError, match="exceed the workspace"):
        F.build_schedule(workspace, config, too_many, num_local_experts=4)
    with pytest.raises(MoKInputError, match="num_local_experts"):
        F.build_schedule(workspace, config, inputs.topk_experts, num_local_experts=0)


def test_schedule_from_another_workspace_is_rejected(setup):
    inputs, config, _, schedule = setup
    other = F.create_workspace(config, None, device=DEVICE, num_local_tokens=12,
                               hidden_size=16, topk=2)
    with pytest.raises(MoKInputError, match="another workspace"):
        F.forward(config, other, schedule, *inputs.layer_args)


def test_sizes_must_be_multiples_of_8():
    inputs = make_inputs(4, 12, 16, 2, 1, device=DEVICE)
    config = F.MoKConfig()
    workspace = F.create_workspace(config, None, device=DEVICE, num_local_tokens=4,
                                   hidden_size=12, topk=1)
    schedule = F.build_schedule(workspace, config, inputs.topk_experts, num_local_experts=2)
    with pytest.raises(MoKInputError, match="hidden_size=12"):
        F.forward(config, workspace, schedule, *inputs.layer_args)


@pytest.mark.parametrize("kwargs", [
    dict(minibatch_size=0), dict(macrobatch_size=100, minibatch_size=64),
    dict(schedule_capacity_multiplier=0.0), dict(fwd_num_comm_sms=-1),
    dict(peer_timeout_s=0.0), dict(peer_timeout_s=float("inf")), dict(fwd_num_comm_sms=1.5),
    dict(minibatch_size=8.0), dict(recompute_gate_up="no"), dict(fwd_copy_rows=1),
    dict(schedule_capacity_multiplier=float("inf")), dict(fp8_weight_gradients=True),
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="MoKConfig." + next(iter(kwargs))):
        F.MoKConfig(**kwargs)


@pytest.mark.parametrize("limit", [0.0, -1.0, float("nan"), True])
def test_swiglu_limit_must_be_positive(setup, limit):
    inputs, config, workspace, schedule = setup
    with pytest.raises(MoKInputError, match="swiglu_limit must be a positive number"):
        F.forward(config, workspace, schedule, *inputs.layer_args, swiglu_limit=limit)
    with pytest.raises(MoKInputError, match="swiglu_limit must be a positive number"):
        F.recompute_forward_context(config, workspace, schedule, inputs.x, inputs.w_shared_gate,
                                    inputs.w_shared_up, inputs.w_routed_gate,
                                    inputs.w_routed_up, swiglu_limit=limit)


def test_get_workspace_is_cached_and_create_is_not():
    config = F.MoKConfig()
    kwargs = dict(device=DEVICE, num_local_tokens=8, hidden_size=16, topk=2)
    assert F.get_workspace(config, None, **kwargs) is F.get_workspace(config, None, **kwargs)
    assert F.create_workspace(config, None, **kwargs) is not F.create_workspace(config, None,
                                                                                 **kwargs)
