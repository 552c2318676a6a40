"""Every environment variable mok reads, read in this one place.

TRITON_INTERPRET   "1" runs the Triton kernels under Triton's CPU interpreter. Triton reads it when
                   a kernel is decorated, so mok decides it here, before any kernel module is
                   imported: when no CUDA device is present and the variable is unset, mok sets it
                   to "1" so that the layer runs on CPU tensors.
MOK_VALIDATE       "1" makes every schedule check its device-side error flags at once (this
                   synchronizes with the device; for debugging).
MOK_COMMIT         the commit that benchmark rows, training runs and GPU test logs record
                   (mok.provenance), in place of the git commit of the tree holding mok:
                   for a copy of the tree without .git, or whose .git is not its history.
MOK_TILES_FILE     a JSON file of tuned GEMM tiles to use instead of the committed
                   mok/ops/tuned_tiles.json (written by `python -m benchmarks.tune`).
MOK_CHECK_LAUNCH  "1": every kernel launch that skips Triton's argument binding (mok.ops.launch)
                   is also bound as Triton would and raises if Triton would pick another
                   compiled kernel (for tests on a GPU).
MOK_FP8_GLUON      "0": on sm_90 the FP8 path (MoKConfig(precision="fp8")) runs every launch on
                   the Triton kernels (mok.kernels.fp8_gemm). By default ("1") mok.plan gives
                   its gate/up, pre-activations, down and d_x launches the warp-specialized Gluon
                   kernels (mok.kernels.gluon_fp8).
MOK_RANKS_SHARE_GPU "1": the processes of an expert-parallel group all run on one GPU (tests on
                   a machine with one GPU; mok.testing.distributed): their symmetric buffers are
                   mapped by CUDA IPC, since PyTorch's symmetric memory wants a GPU a rank.
"""

from __future__ import annotations

import os

import torch


def _flag(name: str, default: str = "0") -> bool:
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET: bool = _flag("TRITON_INTERPRET")
VALIDATE: bool = _flag("MOK_VALIDATE")
TILES_FILE: str | None = os.environ.get("MOK_TILES_FILE") or None
COMMIT: str = os.environ.get("MOK_COMMIT", "unknown")
RANKS_SHARE_GPU: bool = _flag("MOK_RANKS_SHARE_GPU")
CHECK_LAUNCH: bool = _flag("MOK_CHECK_LAUNCH")
FP8_GLUON: bool = _flag("MOK_FP8_GLUON", default="1")
