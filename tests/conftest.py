"""Shared fixtures. Tests run the compiled kernels on CUDA when a GPU is present and the same
kernels under Triton's interpreter on CPU otherwise (mok sets TRITON_INTERPRET=1 itself then).
On a GPU every launch that skips Triton's argument binding is checked against Triton's own
choice of compiled kernel (MOK_CHECK_LAUNCH=1 unless set otherwise)."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("MOK_CHECK_LAUNCH", "1")

import pytest
import torch

import mok  # noqa: F401  (decides TRITON_INTERPRET before any kernel module loads)
import mok.functional as F
from mok.ops import small_tiles

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def tiles_for_tests(block: int = 16, align: int | None = None):
    """Small tiles under the interpreter (more tiles, more masking); the real ones on a GPU."""
    if DEVICE.type == "cuda":
        return None
    return small_tiles(block, align)


def with_row_tiles(tiles, **fields):
    """`tiles` with `fields` set in the tiles of every row GEMM (gate_up, down, down_bwd, d_x,
    and gate_up_saved, down_bwd_saved where the config has tiles of their own)."""
    return dataclasses.replace(tiles, **{
        name: dataclasses.replace(getattr(tiles, name), **fields)
        for name in ("gate_up", "down", "down_bwd", "d_x", "gate_up_saved", "down_bwd_saved")
        if getattr(tiles, name) is not None})


def with_tma_rows(tiles):
    """`tiles` with every row GEMM's whole row tiles through TMA (RowTiles.tma_rows)."""
    return with_row_tiles(tiles, tma_rows=True)


def run_layer(inputs, *, config=None, tiles=None, swiglu_limit=None, workspace=None,
              validate=None):
    """Schedule, forward and backward of mok on `inputs`; returns (y, grads, schedule, context),
    the context as the forward made it (kept pre-activations cloned before the backward writes
    their gradients over them)."""
    config = config or F.MoKConfig()
    num_tokens, topk = inputs.topk_experts.shape
    workspace = workspace or F.create_workspace(
        config, None, device=inputs.x.device, num_local_tokens=num_tokens,
        hidden_size=inputs.x.shape[1], topk=topk)
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=inputs.num_local_experts, tiles=tiles,
                                validate=validate)
    y, context = F.forward(config, workspace, schedule, *inputs.layer_args,
                           swiglu_limit=swiglu_limit)
    as_made = dataclasses.replace(context, **{
        name: getattr(context, name).clone() for name in ("gate_up", "gate_up_shared")
        if getattr(context, name) is not None})
    grads = F.backward(config, workspace, schedule, context, inputs.d_output,
                       *inputs.layer_args, swiglu_limit=swiglu_limit)
    return y, grads, schedule, as_made
