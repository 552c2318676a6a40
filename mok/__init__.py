"""mok: a fused, deterministic, sync-free mixture-of-experts training layer for Hopper GPUs.

Layers (imports only go down): mok.nn -> mok.functional -> mok.ops -> mok.kernels.
mok.testing holds the pure-PyTorch reference the kernels are checked against.
"""

from mok import _env  # noqa: F401  (must run before any Triton kernel is decorated)
from mok.errors import MoKDataError, MoKError, MoKInputError, MoKTimeoutError

__version__ = "0.1.0"

__all__ = ["MoKDataError", "MoKError", "MoKInputError", "MoKTimeoutError", "__version__"]
