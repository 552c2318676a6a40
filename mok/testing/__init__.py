"""Reference, inputs, tolerances and a multi-process launcher for testing mok."""

from mok.reference import expert_mlp, moe_reference, moe_reference_grads, swiglu
from mok.testing.distributed import distributed_test, free_port, rank_device, run_distributed
from mok.testing.graphs import eager_and_captured
from mok.testing.inputs import (
    MoEInputs,
    RoutingPattern,
    make_inputs,
    make_shape_inputs,
    make_topk,
    pad_expert_widths,
)
from mok.testing.scheduling import programs_last_first
from mok.testing.shapes import SHAPES, SHAPES_BY_NAME, UNTUNED_SHAPES, MoEShape
from mok.testing.tolerance import TOLERANCES, ErrorReport, Tolerance, assert_close, error_report

GRAD_NAMES = (
    "d_x", "d_router_weights", "d_w_routed_gate", "d_w_routed_up", "d_w_routed_down",
    "d_w_shared_gate", "d_w_shared_up", "d_w_shared_down",
)

__all__ = [
    "GRAD_NAMES",
    "SHAPES",
    "UNTUNED_SHAPES",
    "SHAPES_BY_NAME",
    "MoEShape",
    "TOLERANCES",
    "ErrorReport",
    "MoEInputs",
    "RoutingPattern",
    "Tolerance",
    "assert_close",
    "distributed_test",
    "eager_and_captured",
    "error_report",
    "expert_mlp",
    "free_port",
    "make_inputs",
    "make_shape_inputs",
    "pad_expert_widths",
    "make_topk",
    "moe_reference",
    "moe_reference_grads",
    "programs_last_first",
    "rank_device",
    "run_distributed",
    "swiglu",
]
