"""DeepGEMM's grouped FP8 GEMMs beside mok's FP8 launches: an anchor, per shape.

    python -m benchmarks.deepgemm [--shapes qwen3-30b-a3b kimi-ep64-slice] [--repeats 20]
                                  [--stages down d_x]

Needs an sm_90 GPU and DeepGEMM importable (`deep_gemm`, built from its source). Per shape, one
process, the schedule of random routes (rows grouped by expert, each expert's rows padded to
128, the layout DeepGEMM's contiguous grouped GEMMs read), the same e4m3 codes and scales for
both:

  gate_up        x's rows gathered by the schedule, times gate and up side by side
                 (DeepGEMM m_grouped_fp8_gemm_nt_contiguous, bf16 pre-activations out; mok's
                 gate_up_fp8 writes the same, gate_up_swiglu_fp8 gathers the rows itself
                 and writes h in e4m3);
  down           h's rows times w_down (mok's down_proj_fp8, unweighted);
  d_x            d_gate_up's rows times gate and up transposed (mok's d_x_rows_fp8); both of
                 mok's also at 128 x 256 (mok_fp8_gluon_256_s4);
  wgrad_down,    the weight gradients on operands quantized along the rows, 128 rows of an
  wgrad_gate_up  expert a block (DeepGEMM k_grouped_fp8_gemm_nt_contiguous, fp32 out, each
                 expert's block copied contiguous for it; mok's grouped_wgrad_fp8_quantized,
                 bf16 out).

DeepGEMM's scale factors are put in the layout its kernels read before the timing (its calls
would otherwise transpose them every call). Each DeepGEMM output is compared with mok's on the
used rows (max relative error in the CSV's max_rel_err). Rows are appended to
benchmarks/results/fp8.csv (--csv to change), the fields of benchmarks.fp8.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
from pathlib import Path

import torch

from benchmarks import append_rows, commit_id
from benchmarks.fp8 import FIELDS, RESULTS, max_rel_err, median_ms, shape_schedule
from mok import ops
from mok.ops.fp8 import down_proj_fp8, gate_up_swiglu_fp8
from mok.ops.fp8_wgrad import gluon_takes_fp8_wgrad, grouped_wgrad_fp8_quantized
from mok.ops.quantize import Quantized, quantize_rows
from mok.ops.tuning import FP8_WGRAD_GLUON_TILES, FP8_WGRAD_TILES
from mok.testing import SHAPES_BY_NAME, MoEShape

DEFAULT_SHAPES = ("qwen3-30b-a3b", "kimi-ep64-slice")


def _rows_of(routing, values: torch.Tensor, gather: bool) -> torch.Tensor:
    """values' schedule rows ([C, N]; gather: token rows by route), zeros in padding rows."""
    route = routing.row_route.long()
    used = route >= 0
    src = route // routing.topk if gather else route.clamp(min=0)
    rows = torch.zeros(routing.capacity_rows, values.shape[1], dtype=values.dtype,
                       device=values.device)
    rows[used] = values[src[used]] if gather else values[used]
    return rows


def _sf_for_deepgemm(scales: torch.Tensor) -> torch.Tensor:
    """1 x 128 row scales [M, K / 128] in the MN-major layout DeepGEMM reads (each column's M
    scales contiguous; M a multiple of 128, so TMA-aligned)."""
    return scales.T.contiguous().T


def _k_grouped(q: Quantized, offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """mok's along-row codes [N, C] and scales [C / 128, N] as DeepGEMM's K-grouped operand:
    each expert's [N, K_e] block contiguous, one after the other; scales [N, sum K / 128]."""
    blocks = [q.data[:, start:end].contiguous().flatten()
              for start, end in zip(offsets[:-1], offsets[1:], strict=True)]
    return torch.cat(blocks), q.scales[: offsets[-1] // 128].T


def bench_shape(deep_gemm, shape: MoEShape, device: torch.device, repeats: int,
                warmup: int, only: tuple[str, ...] = ()) -> list[dict]:
    inputs, schedule = shape_schedule(shape, device)
    x = inputs.x
    w_gate, w_up, w_down = inputs.routed_weights
    routing = schedule.routing
    if routing.align % 128:
        raise SystemExit(f"the schedule's alignment {routing.align} is not a multiple of 128")
    hidden, inter = shape.hidden_size, shape.intermediate_size
    used = routing.row_route >= 0
    # each row's expert, -1 in padding rows (DeepGEMM's grouped_layout)
    row_expert = routing.block_expert.repeat_interleave(routing.align)
    m_indices = torch.where(used, row_expert, -1).to(torch.int32).contiguous()
    offsets = routing.expert_offsets.long().cpu().tolist()
    ks = [end - start for start, end in zip(offsets[:-1], offsets[1:], strict=True)]
    ks_device = torch.tensor(ks, dtype=torch.int32, device=device)

    x_q = quantize_rows(x)
    x_rows_q = quantize_rows(_rows_of(routing, x, gather=True))
    experts = ops.quantize_experts(w_gate, w_up, w_down)
    gate_q, up_q, down_q = experts.gate, experts.up, experts.down
    gate_up_w = Quantized(torch.cat([gate_q.data, up_q.data], dim=1),
                          torch.cat([gate_q.scales, up_q.scales], dim=1))
    h_q = quantize_rows(torch.randn(routing.capacity_rows, inter, device=device,
                                    dtype=x.dtype))
    d_gate_up_q = quantize_rows(torch.randn(routing.capacity_rows, 2 * inter, device=device,
                                            dtype=x.dtype))
    gluon = {kind: ops.fp8_tiles(kind, routing.align, gluon=True)
             for kind in ("gate_up", "gate_up_saved", "down", "d_x")}
    # down and d_x also at 128 x 256 (two products of 128 columns a K step)
    wide = {kind: dataclasses.replace(gluon[kind], block_n=256, num_stages=4)
            for kind in ("down", "d_x")}
    gemm = 2.0 * shape.num_tokens * shape.topk * hidden * inter

    def deepgemm_m(a: Quantized, b: Quantized, n: int):
        sfa = _sf_for_deepgemm(a.scales)
        out = torch.empty(a.data.shape[0], n, dtype=torch.bfloat16, device=device)

        def call():
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a.data, sfa), (b.data, b.scales), out,
                                                       m_indices)
            return out
        return call

    stages = {
        "gate_up": (2 * gemm, {
            "deepgemm": deepgemm_m(x_rows_q, gate_up_w, 2 * inter),
            "mok_fp8_pre_activations": lambda: ops.gate_up_fp8(
                x_q, gate_q, up_q, routing, gluon["gate_up_saved"]),
            "mok_fp8_swiglu": lambda: gate_up_swiglu_fp8(x_q, gate_q, up_q, routing,
                                                         gluon["gate_up"]),
        }),
        "down": (gemm, {
            "deepgemm": deepgemm_m(h_q, down_q, hidden),
            "mok_fp8": lambda: down_proj_fp8(h_q, down_q, routing, gluon["down"], None),
            "mok_fp8_gluon_256_s4": lambda: down_proj_fp8(h_q, down_q, routing, wide["down"],
                                                          None),
        }),
        "d_x": (2 * gemm, {
            "deepgemm": deepgemm_m(d_gate_up_q, experts.gate_up_t, hidden),
            "mok_fp8": lambda: ops.d_x_rows_fp8(d_gate_up_q, experts.gate_up_t, routing,
                                                gluon["d_x"]),
            "mok_fp8_gluon_256_s4": lambda: ops.d_x_rows_fp8(d_gate_up_q, experts.gate_up_t,
                                                             routing, wide["d_x"]),
        }),
    }
    # the weight gradients: operands quantized along the rows by mok, regrouped for DeepGEMM
    d_out = torch.randn_like(x)
    h = torch.randn(routing.capacity_rows, inter, device=device, dtype=x.dtype)
    d_gate_up = torch.randn(routing.capacity_rows, 2 * inter, device=device, dtype=x.dtype)
    along = {name: ops.quantize_row_blocks(t, routing, gather=gather)
             for name, t, gather in (("d_out", d_out, True), ("h", h, False),
                                     ("d_gate_up", d_gate_up, False), ("x", x, True))}
    for kind, (a, b) in (("down", ("d_out", "h")), ("gate_up", ("d_gate_up", "x"))):
        qa, qb = along[a], along[b]
        m, n = qa.data.shape[0], qb.data.shape[0]
        ka, kb = _k_grouped(qa, offsets), _k_grouped(qb, offsets)
        acc = torch.zeros(routing.num_local_experts, m, n, device=device)

        def deepgemm_k(ka=ka, kb=kb, acc=acc):
            acc.zero_()
            deep_gemm.k_grouped_fp8_gemm_nt_contiguous(ka, kb, acc, ks, ks_device, acc)
            return acc
        split = inter if kind == "gate_up" else None
        impls = {"deepgemm": deepgemm_k}
        # mok's Triton kernel, and the Gluon one the layer's plan runs where it takes the launch
        for label, tiles in (("mok_fp8_gemm_only", FP8_WGRAD_TILES),
                             (f"mok_fp8_gemm_only_gluon_s{FP8_WGRAD_GLUON_TILES.num_stages}",
                              FP8_WGRAD_GLUON_TILES)):
            if tiles.gluon and not gluon_takes_fp8_wgrad(qa, qb, routing, tiles, x.dtype, split):
                continue
            impls[label] = functools.partial(grouped_wgrad_fp8_quantized, qa, qb, routing, tiles,
                                             out_dtype=x.dtype, split=split)
        stages[f"wgrad_{kind}"] = ((2 if kind == "gate_up" else 1) * gemm, impls)

    stages = {stage: v for stage, v in stages.items()
              if not only or stage.startswith(only)}
    # DeepGEMM against mok on the same codes (used rows; the experts' gradients)
    errors = {}
    for stage, mine in (("gate_up", "mok_fp8_pre_activations"), ("down", "mok_fp8"),
                        ("d_x", "mok_fp8")):
        if stage not in stages:
            continue
        theirs = stages[stage][1]["deepgemm"]().float()
        errors[stage] = max_rel_err(theirs[used], stages[stage][1][mine]().float()[used])
    for kind in ("down", "gate_up"):
        if f"wgrad_{kind}" not in stages:
            continue
        theirs = stages[f"wgrad_{kind}"][1]["deepgemm"]()
        ours = list(stages[f"wgrad_{kind}"][1].values())[-1]()  # the layer's kernel
        ours = torch.cat(ours, dim=1) if isinstance(ours, tuple) else ours
        errors[f"wgrad_{kind}"] = max_rel_err(theirs, ours.float())
    print(f"== {shape.name}: DeepGEMM against mok, max rel: "
          + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()), flush=True)

    gpu = torch.cuda.get_device_name(device)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    rows = []
    for stage, (flops, impls) in stages.items():
        for impl, fn in impls.items():
            ms = median_ms(fn, device, repeats, warmup)
            error = errors.get(stage) if impl == "deepgemm" else None
            rows.append(dict(gpu=gpu, commit=commit_id(), date=date, shape=shape.name,
                             stage=stage, impl=impl, ms=f"{ms:.4f}",
                             tflops=f"{flops / ms / 1e9:.1f}", gbps="",
                             max_rel_err="" if error is None else f"{error:.2e}"))
            print(f"  {stage:14s} {impl:24s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s",
                  flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES,
                        choices=sorted(SHAPES_BY_NAME), metavar="SHAPE")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--csv", default=str(RESULTS))
    parser.add_argument("--stages", nargs="+", metavar="STAGE", default=(),
                        help="check and time only the stages whose names start so (default: "
                             "all)")
    args = parser.parse_args(argv)
    import deep_gemm  # optional: only this benchmark needs it

    device = torch.device("cuda")
    for name in args.shapes:
        rows = bench_shape(deep_gemm, SHAPES_BY_NAME[name], device, args.repeats, args.warmup,
                           only=tuple(args.stages))
        append_rows(Path(args.csv), FIELDS, rows)
    print(f"rows appended to {args.csv}")


if __name__ == "__main__":
    main()
