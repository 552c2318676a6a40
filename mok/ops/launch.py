"""Kernel launches with less host time: `launch(kernel, grid)(**kwargs)` runs what
`kernel[grid](**kwargs)` runs.

Triton's launch binds the arguments, derives the kernel's specialization from them (each
argument's type, the 16-byte alignment of pointers, integers equal to 1 or divisible by 16),
looks the compiled kernel up by it and launches it. On a GPU, `launch` keys each call by the
same facts, computed in Python from the arguments (finer than Triton's key where they differ:
constexpr values and options by value, other objects by identity), and after the first call
with a key, which goes through Triton and compiles, runs the compiled kernel's launcher
directly. A launch costs the host 10-50 us less that way (the Gluon kernels with many
arguments and TMA descriptors the most).

Triton's own path runs instead under the interpreter, with a callable grid, with launch hooks
installed (profilers), with an argument of a type the key does not know, or where
`JITFunction.run` was replaced (scripts/sm90_compile.py). MOK_CHECK_LAUNCH=1 also binds every
direct launch as Triton would and raises if Triton would have picked another compiled kernel
(the GPU tests run with it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction, compute_cache_key

from mok import _env

# False: every launch takes Triton's own path (to measure the difference).
ENABLED = True
_TRITON_RUN = JITFunction.run
_NO_DEFAULT = inspect.Parameter.empty
_PRIMITIVE = (int, float, bool, str, type(None))
_TENSOR = torch.Tensor


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of integers, as triton.cdiv (whose constexpr wrapper costs the host some
    microseconds a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (0 for n <= 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


class _KernelLaunches:
    """One kernel's parameter order, constexpr names, defaults and compiled kernels by key."""

    def __init__(self, kernel: JITFunction) -> None:
        self.names = [param.name for param in kernel.params]
        # arguments keyed by their specialization; the rest (constexprs, options) by value
        self.runtime = {param.name for param in kernel.params if not param.is_constexpr}
        self.defaults = {name: param.default
                         for name, param in kernel.signature.parameters.items()
                         if param.default is not _NO_DEFAULT}
        # key -> (its _runner, the compiled kernel, the constexpr and descriptor-layout objects
        # the key names by identity, kept alive so that their ids are not reused)
        self.compiled: dict[tuple, tuple[Callable, CompiledKernel, list]] = {}


def _key(device: int, kwargs: dict, runtime: set, keep: list) -> tuple:
    """What Triton's specialization reads from the arguments, and the values of constexprs and
    options (other objects than numbers, strings and None by identity, appended to keep); raises
    TypeError for an argument of a type it does not know. The names come first, then one record
    per argument: a tensor's (dtype, 16-byte aligned); a constexpr's (type, value); a runtime
    integer's value below 16 in magnitude, else (divisible by 16, within int32, beyond int64);
    a bool's, float's or None's type; a TMA descriptor's (type, dtype, box, layout, padding).
    Records of different kinds never compare equal."""
    key = [device, *kwargs]
    add = key.append
    for name, value in kwargs.items():
        kind = type(value)
        if kind is _TENSOR:
            add((value.dtype, value.data_ptr() & 15 == 0))
        elif name not in runtime:
            if kind in _PRIMITIVE:
                add((kind, value))
            else:
                keep.append(value)
                add((kind, id(value)))
        elif kind is int:
            add(value if -16 < value < 16 else
                (value & 15 == 0, -2**31 <= value < 2**31, value >= 2**63))
        elif kind is bool or kind is float or value is None:
            add(kind)
        elif isinstance(value, _TENSOR):
            add((value.dtype, value.data_ptr() & 15 == 0))
        elif isinstance(getattr(value, "base", None), _TENSOR):  # a TMA descriptor
            layout = getattr(value, "layout", None)  # Gluon's descriptors have one
            keep.append(layout)
            add((kind, value.base.dtype, tuple(value.block_shape), id(layout), value.padding))
        else:
            raise TypeError(f"no launch key for an argument of type {kind.__name__}")
    return tuple(key)


def _direct(kernel: JITFunction) -> bool:
    return (ENABLED and not _env.INTERPRET and isinstance(kernel, JITFunction)
            and type(kernel).run is _TRITON_RUN and not kernel.pre_run_hooks
            and not knobs.runtime.launch_enter_hook.calls
            and not knobs.runtime.launch_exit_hook.calls)


def launch(kernel, grid):
    """kernel[grid], launched as described above: call the result with the kernel's arguments
    (and Triton's options by name, e.g. num_warps)."""
    if callable(grid) or not _direct(kernel):
        return kernel[grid]
    return lambda *args, **kwargs: _launch(kernel, grid, args, kwargs)


def _launch(kernel: JITFunction, grid, args: tuple, kwargs: dict) -> None:
    launches = kernel.__dict__.get("_mok_launches")
    if launches is None:
        launches = kernel._mok_launches = _KernelLaunches(kernel)
    if args:
        kwargs = dict(zip(launches.names, args, strict=False), **kwargs)
    active = driver.active
    device = active.get_current_device()
    keep: list = []
    try:
        key = _key(device, kwargs, launches.runtime, keep)
    except TypeError:
        kernel[grid](**kwargs)
        return
    entry = launches.compiled.get(key)
    if entry is None:
        compiled = kernel[grid](**kwargs)
        if isinstance(compiled, CompiledKernel) and all(
                name in kwargs or name in launches.defaults for name in launches.names):
            launches.compiled[key] = (_runner(compiled), compiled, keep)
        return
    run, compiled = entry[0], entry[1]
    values = [kwargs[name] if name in kwargs else launches.defaults[name]
              for name in launches.names]
    if _env.CHECK_LAUNCH:
        _check(kernel, device, kwargs, compiled)
    run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
        active.get_current_stream(device), values)


def _runner(compiled: CompiledKernel):
    """run(grid_0, grid_1, grid_2, stream, values) launching `compiled` with no launch hooks.
    Without scratch memory to allocate, it calls the launcher's own launch function (what
    Triton's launcher object calls after allocating the scratch)."""
    launcher, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    plain = getattr(launcher, "launch", None)
    if (plain is None or getattr(launcher, "global_scratch_size", 1) != 0
            or getattr(launcher, "profile_scratch_size", 1) != 0):
        def run(grid_0, grid_1, grid_2, stream, values):
            launcher(grid_0, grid_1, grid_2, stream, function, metadata, None, None, None,
                     *values)
        return run
    cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl

    def run(grid_0, grid_1, grid_2, stream, values):
        plain(grid_0, grid_1, grid_2, stream, function, cooperative, pdl, None, None, metadata,
              None, None, None, *values)
    return run


def _check(kernel: JITFunction, device: int, kwargs: dict, compiled: CompiledKernel) -> None:
    """Raise unless Triton's own binding of kwargs picks `compiled`."""
    kernel_cache, key_cache, _, _, binder = kernel.device_caches[device]
    options = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                   instrumentation_mode=knobs.compilation.instrumentation_mode)
    _, specialization, options = binder(**options)
    picked = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
    if picked is not compiled:
        raise RuntimeError(f"mok.ops.launch: {kernel.__name__}'s launch key chose a compiled "
                           f"kernel Triton would not: {specialization}")
