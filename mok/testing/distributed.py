"""A launcher for multi-process tests: one process per rank, gloo on CPU, NCCL on GPU.

`run_distributed(fn, world_size, *args)` spawns `world_size` processes on a free port, runs
fn(rank, world_size, *args) in each inside an initialized default process group, and returns the
per-rank results (what torch.save takes: tensors come back on the CPU). A rank that raises, or
a run past `timeout_s`, fails the whole call with the rank's traceback; no process is left
behind.
`distributed_test(world_sizes=...)` turns a test into one case per world size and skips (never
xfails) the cases the machine cannot run.
"""

from __future__ import annotations

import functools
import io
import os
import socket
import traceback
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mok import _env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# MOK_RANKS_SHARE_GPU=1 (mok._env): every rank on the one GPU cuda:0, gloo between the processes
# (NCCL refuses two ranks on one device). A check of the expert-parallel code on a machine with
# one GPU: the processes' kernels take turns on it (time slices), so it is slow and times nothing.
RANKS_SHARE_GPU = _env.RANKS_SHARE_GPU


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and not RANKS_SHARE_GPU else "gloo"


def rank_device(rank: int) -> torch.device:
    """The device of a rank of a multi-process test: its GPU (cuda:rank, or cuda:0 when the
    ranks share one), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", 0 if RANKS_SHARE_GPU else rank)


def too_few_gpus(world_size: int) -> bool:
    """Whether rank_device would put ranks on GPUs that are not present (one GPU a rank, the
    ranks not sharing one): tests of that many ranks skip then."""
    return (torch.cuda.is_available() and not RANKS_SHARE_GPU
            and torch.cuda.device_count() < world_size)


def _worker(rank, world_size, port, backend, fn, args, queue, env):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if torch.cuda.is_available() and (backend == "nccl" or RANKS_SHARE_GPU):
            torch.cuda.set_device(rank_device(rank))
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Serialized here, tensors in the bytes: a queue passes tensors through shared memory
        # that goes with this process, which may have ended before the parent reads them.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable,
    world_size: int,
    *args,
    backend: str | None = None,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list:
    """Run fn(rank, world_size, *args) on `world_size` processes; return results by rank."""
    backend = backend or default_backend()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker,
                         args=(rank, world_size, port, backend, fn, args, queue, env or {}),
                         daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, object] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout_s)
            except Exception as exc:  # queue.Empty: some rank hung
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} gave no result within {timeout_s:.0f} s")\
                    from exc
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), map_location="cpu",
                                           weights_only=False)
            else:
                failures.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise AssertionError("distributed test failed on " + "\n".join(failures))
    return [results[rank] for rank in range(world_size)]


_BODIES: dict[tuple[str, str], Callable] = {}


def distributed_test(world_sizes: Sequence[int] = (2,), backend: str | None = None,
                     gpu_world_sizes: Sequence[int] | None = None):
    """Decorator: run the test body as fn(rank, world_size) on each world size.

    The decorated function must be defined at module level (workers import its module and find
    the body by name). gpu_world_sizes: the world sizes where the cases run on a GPU (default
    world_sizes), e.g. 4 and 8 ranks that CPU processes would take too long for: on NCCL (one
    GPU a rank, the cases skipped when fewer GPUs than ranks are present), or with
    MOK_RANKS_SHARE_GPU every rank on the one GPU (unless backend pins gloo). Cases of more than
    two CPU processes are marked `slow` (the long tier, `pytest -m slow`).
    """
    import pytest

    on_gpus = ((backend or default_backend()) == "nccl"
               or (backend is None and RANKS_SHARE_GPU and torch.cuda.is_available()))
    sizes = list(gpu_world_sizes if on_gpus and gpu_world_sizes is not None else world_sizes)
    params = [pytest.param(size, marks=pytest.mark.slow) if size > 2 and not on_gpus else size
              for size in sizes]

    def decorate(fn):
        _BODIES[(fn.__module__, fn.__qualname__)] = fn

        @pytest.mark.parametrize("world_size", params)
        @functools.wraps(fn)
        def test(world_size):
            chosen = backend or default_backend()
            if chosen == "nccl" and torch.cuda.device_count() < world_size:
                pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
            run_distributed(_Body(fn.__module__, fn.__qualname__), world_size, backend=chosen)

        del test.__wrapped__  # pytest must see (world_size), not the body's (rank, world_size)
        return test

    return decorate


class _Body:
    """Picklable handle to the body of a distributed_test."""

    def __init__(self, module: str, qualname: str) -> None:
        self.module, self.qualname = module, qualname

    def __call__(self, rank: int, world_size: int):
        import importlib

        importlib.import_module(self.module)
        return _BODIES[(self.module, self.qualname)](rank, world_size)
