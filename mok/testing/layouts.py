"""The same tensor in other memory layouts: views with the values of `t` and NaN (or, for
integer tensors, out-of-range ids) in every element of storage outside the view, so a kernel
that reads past a view or with the wrong strides gives a visibly wrong answer."""

from __future__ import annotations

import enum

import torch


class Layout(enum.Enum):
    """How `relayout` lays a tensor out in memory. Every layout holds the same values."""

    CONTIGUOUS = "contiguous"      # a fresh row-major copy
    TRANSPOSED = "transposed"      # the last two dimensions stored swapped (column-major rows;
                                   # torchtitan's [E, H, I] weights passed as [E, I, H])
    ROW_SLICE = "row_slice"        # a slice of rows of a taller tensor: the first or second half
                                   # of a fused [.., 2N, K] gate_up
    PADDED_ROWS = "padded_rows"    # rows of a wider tensor: stride(-2) > size(-1)
    EVERY_OTHER = "every_other"    # every second entry of the first dimension of a larger tensor
    OFFSET = "offset"              # contiguous, starting one element into its storage (so not
                                   # 16-byte aligned)


def _junk_like(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=t.dtype, device=t.device)
    return torch.full(shape, torch.iinfo(t.dtype).max, dtype=t.dtype, device=t.device)


def relayout(t: torch.Tensor, layout: Layout | str, *, second_half: bool = False
             ) -> torch.Tensor:
    """A view holding t's values in `layout` (see Layout), detached from t's graph.

    second_half: with ROW_SLICE, the view is the second half of the taller tensor (up's half of
    a fused gate_up) rather than the first.
    """
    layout = Layout(layout)
    t = t.detach()
    if layout is Layout.CONTIGUOUS:
        return t.clone(memory_format=torch.contiguous_format)
    if t.dim() < 2 and layout in (Layout.TRANSPOSED, Layout.ROW_SLICE, Layout.PADDED_ROWS):
        raise ValueError(f"{layout.value} needs a tensor of 2 or more dimensions")
    if layout is Layout.TRANSPOSED:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout is Layout.ROW_SLICE:
        rows = t.shape[-2]
        taller = _junk_like(t, (*t.shape[:-2], 2 * rows, t.shape[-1]))
        part = slice(rows, 2 * rows) if second_half else slice(0, rows)
        taller[..., part, :] = t
        return taller[..., part, :]
    if layout is Layout.PADDED_ROWS:
        cols = t.shape[-1]
        wider = _junk_like(t, (*t.shape[:-1], cols + 8))
        wider[..., 3:3 + cols] = t
        return wider[..., 3:3 + cols]
    if layout is Layout.EVERY_OTHER:
        if t.dim() < 1:
            raise ValueError("every_other needs a tensor of 1 or more dimensions")
        larger = _junk_like(t, (2 * t.shape[0], *t.shape[1:]))
        larger[1::2] = t
        return larger[1::2]
    flat = _junk_like(t, (t.numel() + 1,))  # OFFSET
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


def layouts_for(t: torch.Tensor) -> tuple[Layout, ...]:
    """The layouts `relayout` can give t."""
    if t.dim() >= 2:
        return tuple(Layout)
    return (Layout.CONTIGUOUS, Layout.EVERY_OTHER, Layout.OFFSET)
