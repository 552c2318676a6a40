"""Program order under Triton's interpreter, for tests of launches whose programs wait on each
other.

The interpreter runs a launch's programs one after the other, in program-id order. A GPU starts
them in an order of its own choosing and may hold some back until others end (its SMs taken by
the launch's spinning programs, another stream's kernels, or another process). A launch is
correct only if it finishes in every order; `programs_last_first` runs the interpreter's
programs from the last program id to the first, the order a launch that hands out work by
program id is least likely to survive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mok import _env


@contextlib.contextmanager
def programs_last_first() -> Iterator[None]:
    """Within the block, every interpreted launch runs its programs along the first grid axis
    from last to first. Raises RuntimeError when the kernels are compiled (not interpreted)."""
    if not _env.INTERPRET:
        raise RuntimeError("programs_last_first orders the programs of Triton's interpreter; "
                           "the kernels here are compiled")
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_grid_idx = builder.set_grid_idx

    def last_first(x: int, y: int, z: int) -> None:
        set_grid_idx(builder.grid_dim[0] - 1 - x, y, z)

    builder.set_grid_idx = last_first
    try:
        yield
    finally:
        del builder.set_grid_idx
