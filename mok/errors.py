"""Errors raised by mok, and the device-side error flags behind the data errors."""

from __future__ import annotations

import enum


class MoKError(RuntimeError):
    """Base class of mok's errors."""


class MoKInputError(MoKError, ValueError):
    """A tensor argument has the wrong shape, dtype, device or layout (found on the host)."""


class MoKDataError(MoKError):
    """The data itself was invalid (found on the device, reported later without a host sync)."""


class MoKTimeoutError(MoKError, TimeoutError):
    """A rank of the expert-parallel group did not reach a step the group takes together
    (found on the host, within MoKConfig.peer_timeout_s)."""


class ErrorFlag(enum.IntEnum):
    """Slots of the int32 error-flag vector that kernels set (never clear) on the device."""

    EXPERT_ID_OUT_OF_RANGE = 0
    CAPACITY_OVERFLOW = 1
    PEER_TIMEOUT = 2  # slot 3 holds 1 + the rank that did not answer (0: this rank's own pull)


NUM_ERROR_FLAGS = 4

ERROR_MESSAGES = {
    ErrorFlag.EXPERT_ID_OUT_OF_RANGE: (
        "topk_experts held an expert id outside [0, num_experts); those routes were left out of "
        "the result (under expert parallelism also: ranks passing different num_local_experts)"
    ),
    ErrorFlag.CAPACITY_OVERFLOW: (
        "the routed rows exceeded the schedule capacity (MoKConfig.schedule_capacity_multiplier); "
        "the routes past the capacity were left out of the result. Raise the multiplier"
    ),
    ErrorFlag.PEER_TIMEOUT: (
        "a wait on another rank of the expert-parallel group timed out "
        "(MoKConfig.peer_timeout_s); results of that call are invalid"
    ),
}
