"""The MoE layer implementations the layer benchmark compares, on mok.testing.MoEInputs.

Each factory takes the shape and the Settings and returns an Implementation; one that cannot run
here raises Unavailable with the reason, which the benchmark prints and records as a skip.

- mok: build_schedule + forward (+ backward) of mok.functional with the default MoKConfig: the
  forward keeps the gate/up pre-activations and the backward's first kernel does one GEMM.
  Rows of commits before the default changed (2026-12-03, docs/measurements.md) ran the
  recomputing backward under this name, and the keeping one as mok_kept; `mok bench --redraw`
  charts them under today's names (benchmarks.layer.current_names).
- mok_recompute: mok with MoKConfig(recompute_gate_up=True): the forward keeps h (I fewer
  values per route) and the backward recomputes gate/up (one GEMM becomes three).
- mok_fp8, mok_fp8_recompute: mok and mok_recompute with MoKConfig(precision="fp8"): the row
  GEMMs on e4m3 operands with blockwise scales, checked against the reference within
  mok.testing.tolerance.FP8_TOLERANCE; on sm_90 the plan gives most launches the warp-specialized
  Gluon FP8 kernels (MOK_FP8_GLUON). mok_fp8_triton: mok_fp8 on the Triton FP8 kernels alone
  (MOK_FP8_GLUON=0); mok_fp8_fused_dswiglu: the dSwiGLU in one launch. mok_fp8_wgrad:
  mok_fp8 with its weight gradients on e4m3 operands too (MoKConfig.fp8_weight_gradients);
  mok_fp8_narrow: down, d_x and the dSwiGLU's GEMM on 128 x 128 Gluon tiles (the plan's
  _FP8_WIDE_ROWS off); mok_fp8_wide: on 128 x 256 (the plan's default since 2026-12-06; rows
  of earlier commits ran it beside 128 x 128 mok_fp8); mok_fp8_wgrad_narrow: mok_fp8_wgrad
  with the weight gradients' Gluon tiles at 128 x 128 (_FP8_WIDE_WGRAD off; rows named
  mok_fp8_wgrad_wide ran 128 x 256 beside 128 x 128 mok_fp8_wgrad before 2026-12-07).
- grouped_mm: the torchtitan-style pipeline: device-side counts and offsets, permute, one
  torch._grouped_mm for gate and up, SwiGLU, torch._grouped_mm down, weighted unpermute; no host
  sync; backward through autograd.
- grouped_mm_compile: the same pipeline under torch.compile (fullgraph), as torchtitan runs it.
- liger: Liger-Kernel's fused MoE (liger_kernel.ops.fused_moe.LigerFusedMoEFunction, 0.8.5:
  Triton grouped GEMMs with the gather and SwiGLU fused, backward recomputing instead of storing
  the expert outputs). Its layout: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I],
  int32 top-k ids with their weights. It has no shared expert, so the shared MLP runs in PyTorch
  beside it. Taken from an installed liger_kernel, else from the wheel in .whl/. It autotunes
  each kernel on its first call at every (H, I) (minutes on a GPU: over 4 minutes for its
  backward at qwen3-30b-a3b); the results are kept in LIGER_TUNING (Settings.liger_tuning) and
  read back by later runs on the same Triton and GPU, which then skip the tuning. Without
  autotuning it runs one pinned config per kernel and its rows are named liger_untuned.
- compile: the mok.testing reference, in bf16, under torch.compile (graph breaks where the
  reference synchronizes; what compiling naive code gives).
- loop: what naive code does (the eager MoE blocks of Hugging Face models): for each expert, find
  its routes (a host sync), run its MLP on those rows, index_add them back weighted.
- sonicmoe: no adapter (always skipped); SONICMOE_UNAVAILABLE says why.
- dense: the ceiling, no MoE: the layer's GEMMs as dense bf16 torch.matmul of equal FLOPs (all
  T*k routes as one expert: [T*k, H] x [H, 2I] and [T*k, I] x [I, H], plus the shared expert's
  two over T rows); its backward is their input and weight gradients (twice the FLOPs). It
  computes no layer, so it is not checked against the reference.
- dense_fp8: the FP8 ceiling: the same dense GEMMs as torch._scaled_mm on e4m3 operands (one
  scale per tensor), what the FP8 rows compare with. Not checked.
- triton_dense: the same dense GEMMs in a plain Triton kernel (benchmarks.triton_gemm: TMA loads,
  wgmma, a few tiles autotuned): what Triton itself reaches there, to tell the compiler's share
  of mok's gap to cuBLAS from the MoE structure's. Not checked either.
"""

from __future__ import annotations

import os
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as torch_f

import mok.functional as F
from mok.testing import MoEInputs, MoEShape, expert_mlp, moe_reference
from mok.testing.tolerance import FP8_TOLERANCE, Tolerance

REPO_ROOT = Path(__file__).resolve().parent.parent
WHEELS = REPO_ROOT / ".whl"
LIGER_TUNING = REPO_ROOT / "benchmarks" / "liger_tuning"

SONICMOE_UNAVAILABLE = (
    "SonicMoE (Dao-AILab/sonic-moe) is not supported by this benchmark: it runs QuACK's CuTe-DSL "
    "grouped GEMMs, which need the binary CUDA wheels nvidia-cutlass-dsl and quack-kernels "
    "(CUDA 12.9+, built for specific, newer torch releases), and the benchmark has no adapter "
    "for it")


class Unavailable(RuntimeError):
    """An implementation that cannot run here; the message says why."""


@dataclass(frozen=True)
class Settings:
    """device: where inputs live; liger_autotune: let Liger autotune its kernels (else pinned);
    liger_tuning: the folder of Liger's autotuning results kept between runs (None: Triton's
    own cache only); host_ahead: time the kernels alone, the whole call queued before the GPU
    starts it (benchmarks.layer.measure)."""

    device: torch.device
    liger_autotune: bool = True
    liger_tuning: Path | None = LIGER_TUNING
    host_ahead: bool = False


@dataclass(frozen=True)
class Implementation:
    """One way to compute the layer on MoEInputs.

    forward(inputs) -> y [T, H] bf16, keeping nothing for a backward (a forward-only step);
    forward_train(inputs) -> (y, saved): a training step's forward, saved is what backward needs;
    backward(saved, inputs) -> the gradients of sum(y * inputs.d_output) in MoK's order
    (mok.testing.GRAD_NAMES; None for absent shared weights), nothing kept afterwards.
    checked: compared with the mok.testing reference before timing (the dense ceiling is not).
    tolerance: the bound of that comparison (None: the inputs' dtype's, mok.testing.tolerance).
    """

    name: str
    forward: Callable[[MoEInputs], object]
    forward_train: Callable[[MoEInputs], tuple[object, object]]
    backward: Callable[[object, MoEInputs], tuple]
    checked: bool = True
    tolerance: Tolerance | None = None


# A layer differentiated by autograd: (x [T, H], topk_experts [T, k], router_weights [T, k],
# routed weights in the implementation's layout, shared (gate, up, down) or None) -> y [T, H].
Layer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple, tuple | None], torch.Tensor]


def autograd_implementation(name: str, layer: Layer, *, fuse_gate_up: bool) -> Implementation:
    """An Implementation whose backward is autograd's through `layer`.

    Routed weights reach `layer` as (gate [E, I, H], up [E, I, H], down [E, H, I]), or with
    fuse_gate_up as (gate_up [E, 2I, H] (gate rows first), down [E, H, I]); that layout is built
    once per input set, outside the timing. Gradients are taken off the leaves after each backward
    so no step keeps another's.
    """
    leaves_by_set: dict[int, tuple] = {}

    def leaves(inputs: MoEInputs) -> tuple:
        key = id(inputs)
        if key not in leaves_by_set:
            routed = inputs.routed_weights
            if fuse_gate_up:
                routed = (torch.cat(routed[:2], dim=1), routed[2])
            leaves_by_set[key] = tuple(
                None if t is None else t.detach().requires_grad_(True)
                for t in (inputs.x, inputs.router_weights, *routed, *inputs.shared_weights))
        return leaves_by_set[key]

    def call(inputs: MoEInputs) -> torch.Tensor:
        x, router_weights, *weights = leaves(inputs)
        routed, shared = tuple(weights[:-3]), tuple(weights[-3:])
        return layer(x, inputs.topk_experts, router_weights, routed,
                     None if shared[0] is None else shared)

    def forward(inputs: MoEInputs) -> torch.Tensor:
        with torch.no_grad():
            return call(inputs)

    def forward_train(inputs: MoEInputs) -> tuple[torch.Tensor, torch.Tensor]:
        y = call(inputs)
        return y, y

    def backward(y: torch.Tensor, inputs: MoEInputs) -> tuple:
        y.backward(inputs.d_output)
        grads = []
        for leaf in leaves(inputs):
            grads.append(None if leaf is None else leaf.grad)
            if leaf is not None:
                leaf.grad = None
        d_x, d_router_weights, *d_routed, d_shared_gate, d_shared_up, d_shared_down = grads
        if fuse_gate_up:
            d_gate_up, d_down = d_routed
            intermediate = d_gate_up.shape[1] // 2
            d_routed = [d_gate_up[:, :intermediate], d_gate_up[:, intermediate:], d_down]
        return (d_x, d_router_weights, *d_routed, d_shared_gate, d_shared_up, d_shared_down)

    return Implementation(name, forward, forward_train, backward)


def with_shared(y: torch.Tensor, x: torch.Tensor, shared: tuple | None) -> torch.Tensor:
    """y plus the shared expert's MLP of x (mok.testing.expert_mlp) when there is one."""
    return y if shared is None else y + expert_mlp(x, *shared)


def mok_implementation(shape: MoEShape, settings: Settings, *, name: str = "mok",
                       config: F.MoKConfig | None = None) -> Implementation:
    config = config or F.MoKConfig()
    workspace = F.get_workspace(config, None, device=settings.device,
                                num_local_tokens=shape.num_tokens,
                                hidden_size=shape.hidden_size, topk=shape.topk)

    def forward_train(inputs):
        schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                    num_local_experts=inputs.num_local_experts)
        y, context = F.forward(config, workspace, schedule, *inputs.layer_args)
        return y, (schedule, context)

    def backward(saved, inputs):
        schedule, context = saved
        return F.backward(config, workspace, schedule, context, inputs.d_output,
                          *inputs.layer_args)

    return Implementation(name, lambda inputs: forward_train(inputs)[0], forward_train,
                          backward,
                          tolerance=FP8_TOLERANCE if config.precision == "fp8" else None)


def mok_recompute_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    return mok_implementation(shape, settings, name="mok_recompute",
                              config=F.MoKConfig(recompute_gate_up=True))


def mok_fp8_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    return mok_implementation(shape, settings, name="mok_fp8",
                              config=F.MoKConfig(precision="fp8"))


def mok_fp8_recompute_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    return mok_implementation(shape, settings, name="mok_fp8_recompute",
                              config=F.MoKConfig(precision="fp8", recompute_gate_up=True))


def mok_fp8_wgrad_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    return mok_implementation(shape, settings, name="mok_fp8_wgrad",
                              config=F.MoKConfig(precision="fp8", fp8_weight_gradients=True))


def mok_fp8_wide_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    """mok_fp8 with down, d_x and the dSwiGLU's GEMM on 128 x 256 Gluon tiles."""
    from mok import plan

    return _with_setting(mok_implementation(shape, settings, name="mok_fp8_wide",
                                            config=F.MoKConfig(precision="fp8")),
                         plan, "_FP8_WIDE_ROWS", True)


def mok_fp8_narrow_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    """mok_fp8 with every Gluon row GEMM on 128 x 128 tiles."""
    from mok import plan

    return _with_setting(mok_implementation(shape, settings, name="mok_fp8_narrow",
                                            config=F.MoKConfig(precision="fp8")),
                         plan, "_FP8_WIDE_ROWS", False)


def mok_fp8_wgrad_narrow_implementation(shape: MoEShape,
                                        settings: Settings) -> Implementation:
    """mok_fp8_wgrad with the weight gradients' Gluon tiles at 128 x 128."""
    from mok import plan

    return _with_setting(mok_implementation(shape, settings, name="mok_fp8_wgrad_narrow",
                                            config=F.MoKConfig(precision="fp8",
                                                               fp8_weight_gradients=True)),
                         plan, "_FP8_WIDE_WGRAD", False)


def _with_setting(inner: Implementation, owner, name: str, value) -> Implementation:
    """inner with owner.name set to value during each of its calls."""
    def wrap(fn):
        def run(*args):
            before = getattr(owner, name)
            setattr(owner, name, value)
            try:
                return fn(*args)
            finally:
                setattr(owner, name, before)
        return run

    return Implementation(inner.name, wrap(inner.forward), wrap(inner.forward_train),
                          wrap(inner.backward), tolerance=inner.tolerance)


def mok_fp8_triton_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    """mok_fp8 with MOK_FP8_GLUON=0: the Triton FP8 kernels alone."""
    from mok import _env

    return _with_setting(mok_implementation(shape, settings, name="mok_fp8_triton",
                                            config=F.MoKConfig(precision="fp8")),
                         _env, "FP8_GLUON", False)


def mok_fp8_fused_dswiglu_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    """mok_fp8 with the dSwiGLU in one launch of the Triton kernel (the plan runs it apart on
    sm_90)."""
    from mok import plan

    return _with_setting(mok_implementation(shape, settings, name="mok_fp8_fused_dswiglu",
                                            config=F.MoKConfig(precision="fp8")),
                         plan, "_FP8_DSWIGLU_APART", False)


def grouped_mm_moe(x, topk_experts, router_weights, routed, shared):
    """The torchtitan way; routed = (w_gate_up [E, 2I, H] (gate rows then up rows), w_down)."""
    w_gate_up, w_down = routed
    num_tokens, topk = topk_experts.shape
    num_experts = w_gate_up.shape[0]
    flat = topk_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    token = order // topk
    rows = x[token]
    gate_up = torch._grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    h = torch_f.silu(gate) * up
    out_rows = torch._grouped_mm(h, w_down.transpose(-2, -1), offs=offsets)
    out_rows = (out_rows.float() * router_weights.reshape(-1)[order, None]).to(x.dtype)
    y = torch.zeros_like(x).index_add_(0, token, out_rows)
    return with_shared(y, x, shared)


def grouped_mm_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    return autograd_implementation("grouped_mm", grouped_mm_moe, fuse_gate_up=True)


def grouped_mm_compile_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    if settings.device.type != "cuda":
        raise Unavailable("torch.compile of the grouped_mm pipeline is measured on a GPU")
    compiled = torch.compile(grouped_mm_moe, fullgraph=True)
    return autograd_implementation("grouped_mm_compile", compiled, fuse_gate_up=True)


def kept_tuning_cache(folder: Path) -> type:
    """A Triton cache manager class that keeps autotuning results (*.autotune.json) in `folder`
    (folder/<key>/<name>, read from there first) and every other file where Triton's own cache
    manager does. Triton names the key from its version, the GPU, the kernel's source, the
    configs and the tuning key, so a result is reused only where it was measured."""
    from triton.runtime.cache import FileCacheManager

    class KeptTuning(FileCacheManager):
        def get_file(self, filename):
            if filename.endswith(".autotune.json"):
                kept = folder / self.key / filename
                if kept.is_file():
                    return str(kept)
            return super().get_file(filename)

        def put(self, data, filename, binary=True):
            path = super().put(data, filename, binary=binary)
            if filename.endswith(".autotune.json"):
                kept = folder / self.key / filename
                kept.parent.mkdir(parents=True, exist_ok=True)
                partial = kept.with_name(f"{filename}.{os.getpid()}")
                partial.write_text(data if isinstance(data, str) else data.decode())
                partial.replace(kept)
            return path

    return KeptTuning


def _import_liger_fused_moe(autotune: bool, tuning: Path | None = None):
    """(LigerFusedMoEFunction, whether it autotunes), from an installed liger_kernel or from
    .whl/liger_kernel-*.whl (unpacked beside it). Liger reads LIGER_FUSED_MOE_AUTOTUNE once, at
    import, so a process keeps its first choice; the second value reports it. With `tuning`,
    Triton's autotuner caches its results (TRITON_CACHE_AUTOTUNING, read when Liger's kernels
    are defined) and the cache manager keeps them in that folder (kept_tuning_cache)."""
    os.environ["LIGER_FUSED_MOE_AUTOTUNE"] = "1" if autotune else "0"
    if autotune and tuning is not None:
        import triton

        os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
        triton.knobs.cache.manager_class = kept_tuning_cache(Path(tuning))
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        wheels = sorted(WHEELS.glob("liger_kernel-*.whl"))
        if not wheels:
            raise Unavailable(
                "liger-kernel is not installed (pip install liger-kernel==0.8.5, or put its "
                "wheel in .whl/: pip download liger-kernel==0.8.5 --no-deps -d .whl)") from None
        unpacked = wheels[-1].with_suffix("")
        if not unpacked.exists():
            partial = unpacked.with_name(f"{unpacked.name}.{os.getpid()}")
            with zipfile.ZipFile(wheels[-1]) as wheel:
                wheel.extractall(partial)
            try:
                partial.rename(unpacked)
            except OSError:  # another process unpacked it first
                pass
        sys.path.insert(0, str(unpacked))
    try:
        from liger_kernel.ops import fused_moe_kernels
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as exc:
        raise Unavailable(f"liger_kernel has no usable fused MoE: {exc}") from None
    return LigerFusedMoEFunction, not fused_moe_kernels._AUTOTUNE_DISABLED


def liger_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    function, autotuned = _import_liger_fused_moe(settings.liger_autotune,
                                                   settings.liger_tuning)

    def layer(x, topk_experts, router_weights, routed, shared):
        w_gate_up, w_down = routed
        y = function.apply(x, w_gate_up, w_down, topk_experts.to(torch.int32), router_weights)
        return with_shared(y, x, shared)

    return autograd_implementation("liger" if autotuned else "liger_untuned", layer,
                                   fuse_gate_up=True)


def compile_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    compiled = torch.compile(moe_reference)

    def layer(x, topk_experts, router_weights, routed, shared):
        return compiled(x, topk_experts, router_weights, *(shared or (None, None, None)),
                        *routed, compute_dtype=x.dtype)

    return autograd_implementation("compile", layer, fuse_gate_up=False)


def expert_loop_moe(x, topk_experts, router_weights, routed, shared):
    """Per expert: its routes (torch.where: a host sync), its MLP on those rows, index_add."""
    w_gate, w_up, w_down = routed
    y = torch.zeros_like(x)
    for expert in range(w_gate.shape[0]):
        token, slot = torch.where(topk_experts == expert)
        out = expert_mlp(x[token], w_gate[expert], w_up[expert], w_down[expert])
        y.index_add_(0, token, (out * router_weights[token, slot, None]).to(x.dtype))
    return with_shared(y, x, shared)


def loop_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    return autograd_implementation("loop", expert_loop_moe, fuse_gate_up=False)


def sonicmoe_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    raise Unavailable(SONICMOE_UNAVAILABLE)


def dense_gemms(shape: MoEShape) -> list[tuple[int, int, int]]:
    """(rows, in, out) of each dense GEMM whose FLOPs sum to the layer's forward count."""
    routes = shape.num_tokens * shape.topk
    hidden, inter, shared = (shape.hidden_size, shape.intermediate_size,
                             shape.shared_intermediate_size)
    gemms = [(routes, hidden, 2 * inter), (routes, inter, hidden)]
    if shared:
        gemms += [(shape.num_tokens, hidden, 2 * shared), (shape.num_tokens, shared, hidden)]
    return gemms


def dense_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    """The ceiling: cuBLAS on dense GEMMs of the layer's FLOPs (dense_gemms)."""
    return _dense_gemms_implementation("dense", shape, settings, torch.matmul)


def triton_dense_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    """The same dense GEMMs in a plain Triton kernel (benchmarks.triton_gemm): how far Triton
    itself gets on them."""
    from benchmarks.triton_gemm import matmul

    return _dense_gemms_implementation("triton_dense", shape, settings, matmul)


def _dense_gemms_implementation(name: str, shape: MoEShape, settings: Settings,
                                matmul: Callable) -> Implementation:
    operands_by_set: dict[int, list] = {}

    def operands(inputs):
        """[(a [M, K], w [N, K] as nn.Linear's, d_out [M, N])] of bf16, one list per input set."""
        key = id(inputs)
        if key not in operands_by_set:
            gen = torch.Generator(settings.device).manual_seed(len(operands_by_set))

            def randn(*size):
                return torch.randn(*size, generator=gen, device=settings.device,
                                   dtype=torch.bfloat16)

            operands_by_set[key] = [(randn(m, k), randn(n, k) / k ** 0.5, randn(m, n))
                                    for m, k, n in dense_gemms(shape)]
        return operands_by_set[key]

    def forward(inputs):
        return [matmul(a, w.T) for a, w, _ in operands(inputs)]

    def backward(saved, inputs):
        return tuple(grad for a, w, d_out in saved
                     for grad in (matmul(d_out, w), matmul(d_out.T, a)))

    return Implementation(name, forward, lambda inputs: (forward(inputs), operands(inputs)),
                          backward, checked=False)


def dense_fp8_implementation(shape: MoEShape, settings: Settings) -> Implementation:
    """The FP8 ceiling: the same dense GEMMs as torch._scaled_mm on e4m3 operands with one
    scale per tensor (the cheapest scaling cuBLAS has), bf16 out. The operands are e4m3 before
    the timed calls, each in the layout _scaled_mm reads (A row-major, B column-major), so only
    the GEMMs are timed."""
    if any(size % 16 for gemm in dense_gemms(shape) for size in gemm):
        raise Unavailable("torch._scaled_mm takes sizes that are multiples of 16")
    e4m3 = torch.float8_e4m3fn
    one = torch.ones((), device=settings.device)
    operands_by_set: dict[int, list] = {}

    def operands(inputs):
        """[(a, w, w^T, d_out, d_out^T, a^T)] in e4m3, each contiguous, one list per input set."""
        key = id(inputs)
        if key not in operands_by_set:
            gen = torch.Generator(settings.device).manual_seed(len(operands_by_set))

            def randn(*size):
                return torch.randn(*size, generator=gen, device=settings.device)

            sets = []
            for m, k, n in dense_gemms(shape):
                a, w, d_out = randn(m, k), randn(n, k) / k ** 0.5, randn(m, n)
                sets.append(tuple(t.contiguous().to(e4m3) for t in (a, w, w.T, d_out, d_out.T,
                                                                     a.T)))
            operands_by_set[key] = sets
        return operands_by_set[key]

    def scaled(a, b_t):
        """a [M, K] @ b_t^T with b_t [N, K] row-major (so b_t.T is column-major)."""
        return torch._scaled_mm(a, b_t.T, one, one, out_dtype=torch.bfloat16)

    def forward(inputs):
        return [scaled(a, w) for a, w, *_ in operands(inputs)]

    def backward(saved, inputs):
        # d_a = d_out @ w (w^T [K, N] row-major as b_t), d_w = d_out^T @ a (a^T [K, M])
        return tuple(grad for _, _, w_t, d_out, d_out_t, a_t in saved
                     for grad in (scaled(d_out, w_t), scaled(d_out_t, a_t)))

    return Implementation("dense_fp8", forward, lambda inputs: (forward(inputs),
                                                                operands(inputs)),
                          backward, checked=False)


IMPLEMENTATIONS: dict[str, Callable[[MoEShape, Settings], Implementation]] = {
    "mok": mok_implementation,
    "mok_recompute": mok_recompute_implementation,
    "mok_fp8": mok_fp8_implementation,
    "mok_fp8_recompute": mok_fp8_recompute_implementation,
    "mok_fp8_triton": mok_fp8_triton_implementation,
    "mok_fp8_fused_dswiglu": mok_fp8_fused_dswiglu_implementation,
    "mok_fp8_wgrad": mok_fp8_wgrad_implementation,
    "mok_fp8_wide": mok_fp8_wide_implementation,
    "mok_fp8_narrow": mok_fp8_narrow_implementation,
    "mok_fp8_wgrad_narrow": mok_fp8_wgrad_narrow_implementation,
    "dense": dense_implementation,
    "dense_fp8": dense_fp8_implementation,
    "triton_dense": triton_dense_implementation,
    "grouped_mm": grouped_mm_implementation,
    "grouped_mm_compile": grouped_mm_compile_implementation,
    "liger": liger_implementation,
    "loop": loop_implementation,
    "compile": compile_implementation,
    "sonicmoe": sonicmoe_implementation,
}
