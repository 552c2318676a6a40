"""What a GPU architecture gives mok's kernels: one entry per architecture, read by the ops.

A new architecture is one more entry (and `arch_of`'s rule for it); the launchers ask the entry,
never the compute capability.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mok import _env


@dataclass(frozen=True)
class Arch:
    """name; warp_specialized: mok's Gluon kernels run there (wgmma, TMA, warp-specialized
    partitions: sm_90); shared_memory: bytes of shared memory one program may hold;
    grouped_mm: torch._grouped_mm runs there."""

    name: str
    warp_specialized: bool
    shared_memory: int
    grouped_mm: bool


HOPPER = Arch("sm_90", warp_specialized=True, shared_memory=227 * 1024, grouped_mm=True)
# Triton's CPU interpreter: the Triton kernels only (torch._grouped_mm runs on CPU).
INTERPRETER = Arch("interpreter", warp_specialized=False, shared_memory=227 * 1024,
                   grouped_mm=True)


@functools.cache
def arch_of(device: torch.device) -> Arch:
    """The entry of device's architecture: Hopper for compute capability 9.0, the interpreter for
    CPU tensors (or any device under TRITON_INTERPRET), else a GPU that runs the Triton kernels
    only."""
    if device.type != "cuda":
        return INTERPRETER
    capability = torch.cuda.get_device_capability(device)
    if _env.INTERPRET:
        return INTERPRETER
    if capability == (9, 0):
        return HOPPER
    properties = torch.cuda.get_device_properties(device)
    return Arch(f"sm_{capability[0]}{capability[1]}", warp_specialized=False,
                shared_memory=int(getattr(properties, "shared_memory_per_block_optin", 0)),
                grouped_mm=capability >= (9, 0))
