"""Property test: for drawn shapes, top-k, routings, dtypes, tiles and memory layouts of every
tensor argument, the layer gives the reference's answer, and bitwise the answer it gives with
contiguous arguments. Through mok.functional, mok.nn.moe_experts and mok.nn.MoE.

Cases come from a seeded generator (`draw`): a failure names its seed, and
`pytest tests/layer/test_layouts.py -k 'seed-N'` runs it again. Views are padded with NaN (integer
ids with out-of-range values), so a kernel reading outside a view or with another tensor's
strides shows as a wrong or non-finite result.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch

import mok.functional as F
from mok import nn as mok_nn
from mok.ops import small_tiles
from mok.testing import GRAD_NAMES, RoutingPattern, assert_close, make_inputs, moe_reference_grads
from mok.testing.layouts import Layout, layouts_for, relayout

from ..conftest import DEVICE, run_layer, with_row_tiles

REF_DTYPE = torch.float32 if DEVICE.type == "cuda" else torch.float64
TENSOR_NAMES = ("x", "topk_experts", "router_weights", "w_shared_gate", "w_shared_up",
                "w_shared_down", "w_routed_gate", "w_routed_up", "w_routed_down", "d_output")
NUM_FUNCTIONAL_CASES = 24
NUM_MODULE_CASES = 6


@dataclass(frozen=True)
class DrawnCase:
    seed: int
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    topk: int
    shared: int
    dtype: torch.dtype
    routing: RoutingPattern
    limit: float | None
    recompute_gate_up: bool
    block: int
    tile_options: tuple[str, ...]
    index_dtype: torch.dtype
    layouts: tuple[tuple[str, Layout], ...]

    def inputs(self):
        inputs = make_inputs(self.tokens, self.hidden, self.intermediate, self.experts,
                             self.topk, shared_intermediate_size=self.shared, dtype=self.dtype,
                             device=DEVICE, seed=self.seed, routing=self.routing)
        return dataclasses.replace(inputs,
                                   topk_experts=inputs.topk_experts.to(self.index_dtype))

    def laid_out(self, inputs):
        """`inputs` with every tensor in its drawn layout (same values)."""
        layouts = dict(self.layouts)
        changed = {}
        for name in TENSOR_NAMES:
            tensor = getattr(inputs, name)
            if tensor is not None:
                changed[name] = relayout(tensor, layouts[name],
                                         second_half=name.endswith("_up"))
        return dataclasses.replace(inputs, **changed)

    def tiles(self):
        tiles = small_tiles(self.block)
        options = {option: True for option in self.tile_options if option != "apart"}
        if "persistent" not in options:
            options.pop("flatten", None)
        if options:
            tiles = with_row_tiles(tiles, **options)
        if "apart" in self.tile_options:
            tiles = dataclasses.replace(
                tiles, down_bwd=dataclasses.replace(tiles.down_bwd, apart=True))
        return tiles

    def __str__(self) -> str:
        layouts = ", ".join(f"{name}={layout.value}" for name, layout in self.layouts
                            if layout is not Layout.CONTIGUOUS)
        return (f"seed {self.seed}: T={self.tokens} H={self.hidden} I={self.intermediate} "
                f"E={self.experts} k={self.topk} I_s={self.shared} {self.dtype} "
                f"{self.routing.value} limit={self.limit} recompute={self.recompute_gate_up} "
                f"block={self.block} tiles={self.tile_options} ids={self.index_dtype} "
                f"layouts: {layouts or 'all contiguous'}")


def draw(seed: int) -> DrawnCase:
    """A case drawn from `seed`: small shapes (multiples of 8), routings with empty experts,
    repeated ids and skew, and a layout for each tensor argument."""
    rng = random.Random(seed)
    experts = rng.randint(1, 8)
    routing = rng.choice(list(RoutingPattern))
    if routing is RoutingPattern.DUPLICATES:
        topk = rng.randint(1, 4)
    elif routing is RoutingPattern.EMPTY_EXPERT:
        experts = max(experts, 2)
        topk = rng.randint(1, min(experts - 1, 4))
    else:
        topk = rng.randint(1, min(experts, 4))
    shapes = dict(
        tokens=rng.choice([1, 2, 7, 16, 23, 40]),
        hidden=rng.choice([8, 16, 24, 32, 48, 64]),
        intermediate=rng.choice([8, 16, 24, 32, 40]),
        shared=rng.choice([0, 0, 8, 16, 24]),
    )
    dtype = rng.choice([torch.bfloat16, torch.float16])
    # Layouts cycle with the seed (every one reaches every argument within len(Layout) seeds);
    # the up weights take their gate's layout one case in four (a fused gate_up's halves).
    layouts = {}
    for position, name in enumerate(TENSOR_NAMES):
        options = layouts_for(torch.empty((1,) * (3 if name.startswith("w_routed") else 2)))
        layouts[name] = options[(seed + 5 * position) % len(options)]
    if seed % 4 == 0:
        layouts["w_routed_up"] = layouts["w_routed_gate"]
        layouts["w_shared_up"] = layouts["w_shared_gate"]
    tile_options = tuple(option for option in ("tma", "tma_rows", "persistent", "flatten",
                                               "apart") if rng.random() < 0.3)
    return DrawnCase(
        seed=seed, experts=experts, topk=topk, dtype=dtype, routing=routing,
        limit=rng.choice([None, None, 0.7, 3.0]), recompute_gate_up=rng.random() < 0.6,
        block=rng.choice([16, 32]), tile_options=tile_options,
        index_dtype=rng.choice([torch.int32, torch.int64]), layouts=tuple(layouts.items()),
        **shapes)


def _check_against_reference(case: DrawnCase, inputs, y, grads) -> None:
    y_ref, grads_ref = moe_reference_grads(inputs, swiglu_limit=case.limit,
                                           compute_dtype=REF_DTYPE)
    assert_close(y, y_ref, dtype=case.dtype, name=f"y ({case})")
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if expected is None:
            assert actual is None, name
            continue
        assert actual.shape == expected.shape, name
        assert_close(actual, expected, dtype=case.dtype, name=f"{name} ({case})")


@pytest.mark.parametrize("case", [draw(seed) for seed in range(NUM_FUNCTIONAL_CASES)],
                         ids=lambda case: f"seed-{case.seed}")
def test_functional_any_layout(case):
    inputs = case.inputs()
    laid_out = case.laid_out(inputs)
    config = F.MoKConfig(recompute_gate_up=case.recompute_gate_up)
    tiles = case.tiles() if DEVICE.type == "cpu" else None
    y, grads, _, _ = run_layer(laid_out, config=config, tiles=tiles, swiglu_limit=case.limit)
    _check_against_reference(case, inputs, y, grads)
    if DEVICE.type == "cpu":
        # The layout changes where values are read, not which ones or in what order. (On a GPU
        # the Gluon kernels take contiguous weights only, so a layout can pick another kernel.)
        y_plain, grads_plain, _, _ = run_layer(inputs, config=config, tiles=tiles,
                                               swiglu_limit=case.limit)
        assert torch.equal(y, y_plain), case
        for name, a, b in zip(GRAD_NAMES, grads, grads_plain, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), f"{name} ({case})"


def _parameter(module: torch.nn.Module, name: str, layout: Layout, second_half: bool) -> None:
    old = getattr(module, name)
    setattr(module, name, torch.nn.Parameter(relayout(old, layout, second_half=second_half)))


@pytest.mark.parametrize("case", [draw(1000 + seed) for seed in range(NUM_MODULE_CASES)],
                         ids=lambda case: f"seed-{case.seed}")
def test_module_any_layout(case):
    # mok.nn.MoE with parameters replaced by views in the drawn layouts, against the same module
    # with contiguous parameters on the reference backend: output, input and every parameter's
    # gradient.
    layouts = dict(case.layouts)
    kwargs = dict(shared_intermediate_size=case.shared, swiglu_limit=case.limit,
                  recompute_gate_up=case.recompute_gate_up, device=DEVICE, dtype=case.dtype)
    torch.manual_seed(case.seed)
    module = mok_nn.MoE(case.hidden, case.intermediate, case.experts, min(case.topk,
                        case.experts), **kwargs)
    reference = mok_nn.MoE(case.hidden, case.intermediate, case.experts,
                           min(case.topk, case.experts), backend="reference", **kwargs)
    reference.load_state_dict(module.state_dict())
    names = {"w_gate": "w_routed_gate", "w_up": "w_routed_up", "w_down": "w_routed_down",
             "shared_gate": "w_shared_gate", "shared_up": "w_shared_up",
             "shared_down": "w_shared_down"}
    for name, drawn in names.items():
        if getattr(module, name) is not None:
            _parameter(module, name, layouts[drawn], name.endswith("up"))
    gen = torch.Generator().manual_seed(case.seed)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(case.dtype).to(DEVICE)
    d_y = torch.randn(case.tokens, case.hidden, generator=gen).to(case.dtype).to(DEVICE)
    x_mok = relayout(x, layouts["x"]).requires_grad_(True)
    x_ref = x.clone().requires_grad_(True)
    y = module(x_mok)
    y_ref = reference(x_ref)
    assert y.shape == y_ref.shape and y.dtype == case.dtype
    y.backward(d_y)
    y_ref.backward(d_y)
    assert_close(y, y_ref, dtype=case.dtype, name=f"y ({case})")
    assert_close(x_mok.grad, x_ref.grad, dtype=case.dtype, name=f"d_x ({case})")
    for name, parameter in module.named_parameters():
        expected = dict(reference.named_parameters())[name].grad
        assert parameter.grad is not None and parameter.grad.shape == parameter.shape, name
        assert_close(parameter.grad, expected, dtype=case.dtype, name=f"{name}.grad ({case})")


def test_draws_cover_the_layouts_and_routings():
    # The generator reaches every layout of every tensor argument and every routing within the
    # cases the tests above run, so a layout bug of one argument cannot hide behind the seeds.
    cases = [draw(seed) for seed in range(NUM_FUNCTIONAL_CASES)]
    for name in TENSOR_NAMES:
        drawn = {dict(case.layouts)[name] for case in cases}
        assert len(drawn) >= 4, (name, drawn)
    for name in ("w_routed_gate", "w_routed_up", "w_shared_gate", "w_shared_up"):
        assert {dict(case.layouts)[name] for case in cases} == set(Layout), name
    assert {case.routing for case in cases} == set(RoutingPattern)
    assert {case.dtype for case in cases} == {torch.bfloat16, torch.float16}
    assert any(case.shared for case in cases) and any(not case.shared for case in cases)
    differ = [case for case in cases
              if dict(case.layouts)["w_routed_gate"] is not dict(case.layouts)["w_routed_up"]]
    assert len(differ) >= NUM_FUNCTIONAL_CASES // 2
    assert len(differ) < NUM_FUNCTIONAL_CASES


@pytest.mark.parametrize("layout", list(Layout), ids=lambda layout: layout.value)
def test_relayout_keeps_values_and_changes_strides(layout):
    t = torch.randn(3, 8, 16)
    view = relayout(t, layout)
    assert torch.equal(view, t)
    if layout is not Layout.CONTIGUOUS:
        assert view.stride() != t.stride() or view.storage_offset() != 0
