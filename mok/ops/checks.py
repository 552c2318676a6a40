"""Checks of the launchers' inputs: what the kernels assume and do not test themselves (they
step a tensor's rows by its row stride and its columns by 1, and index weights by the
schedule's experts)."""

from __future__ import annotations

import torch

from mok.errors import MoKInputError

FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def check_rows(t: torch.Tensor, name: str, *, width: int | None = None,
               dtypes: tuple[torch.dtype, ...] = FLOATS) -> None:
    """t: a 2-D tensor of one of dtypes with unit column stride (any row stride), `width`
    columns where given."""
    if t.dim() != 2 or t.dtype not in dtypes or (t.shape[1] > 1 and t.stride(1) != 1):
        raise MoKInputError(
            f"{name} must be a 2-D tensor of {_names(dtypes)} with unit column stride, got "
            f"{tuple(t.shape)} {t.dtype} with strides {t.stride()}")
    if width is not None and t.shape[1] != width:
        raise MoKInputError(f"{name} must be {width} wide (the weights' size), got "
                            f"{tuple(t.shape)}")


def check_tokens(t: torch.Tensor, name: str, num_tokens: int) -> None:
    """t, read by token: at least the schedule's num_tokens rows."""
    if t.shape[0] < num_tokens:
        raise MoKInputError(f"{name} must have a row for each of the schedule's {num_tokens} "
                            f"tokens, got {tuple(t.shape)}")


def check_schedule_rows(t: torch.Tensor, name: str, capacity_rows: int) -> None:
    """t, read by schedule row: at least the schedule's capacity_rows rows."""
    if t.shape[0] < capacity_rows:
        raise MoKInputError(f"{name} must have a row for each of the schedule's {capacity_rows} "
                            f"rows, got {tuple(t.shape)}")


def check_experts(w: torch.Tensor, name: str, num_experts: int,
                  size: tuple[int, int] | None = None) -> None:
    """w: [E, N, K] floating weights of the schedule's E local experts ([N, K] = size where
    given)."""
    if w.dim() != 3 or w.dtype not in FLOATS or w.shape[0] != num_experts:
        raise MoKInputError(f"{name} must be [{num_experts}, N, K] weights of {_names(FLOATS)}, "
                            f"one per local expert of the schedule, got {tuple(w.shape)} "
                            f"{w.dtype}")
    if size is not None and tuple(w.shape[1:]) != tuple(size):
        raise MoKInputError(f"{name} must be [{num_experts}, {size[0]}, {size[1]}], got "
                            f"{tuple(w.shape)}")


def check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLOATS:
        raise MoKInputError(f"out_dtype must be one of {_names(FLOATS)}, got {dtype}")


def check_row_tiles(block_m: int, align: int) -> None:
    if align % block_m:
        raise ValueError(f"block_m {block_m} must divide the schedule's alignment {align} (a "
                         f"row block of one expert)")


def _names(dtypes) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)
