"""The CUDA-graph capture in progress on the current stream, as the CUDA driver names it.

PyTorch says whether the current stream is capturing, not which capture it is. The driver's
cuStreamGetCaptureInfo gives each capture sequence a unique id (streams joined to it by events
report the same one); every version of the call takes the stream, the status and the id as its
first three arguments, and the later ones optional outputs, passed here as NULL.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
_VERSIONS = ("cuStreamGetCaptureInfo_v3", "cuStreamGetCaptureInfo_v2", "cuStreamGetCaptureInfo")


@functools.cache
def _capture_info():
    """The driver's cuStreamGetCaptureInfo (its newest version), or None without a driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in _VERSIONS:
        try:
            call = getattr(driver, name)
        except AttributeError:
            continue
        call.restype = ctypes.c_int
        return call
    return None


def capture_id() -> int | None:
    """The unique id of the CUDA-graph capture in progress on the current CUDA stream; None when
    none is, or where the driver does not say."""
    if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
        return None
    call = _capture_info()
    if call is None:
        return None
    status, ident = ctypes.c_int(0), ctypes.c_ulonglong(0)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    result = call(stream, ctypes.byref(status), ctypes.byref(ident), None, None, None, None)
    if result != 0 or status.value != _ACTIVE:
        return None
    return int(ident.value)
