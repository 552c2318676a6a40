"""benchmarks.deepgemm's operands (DeepGEMM itself needs an sm_90 GPU): the rows it gathers, and
the weight gradients' operands regrouped for its K-grouped GEMM, which computed the way that
GEMM reads them give mok's weight gradient."""

import torch

from benchmarks.deepgemm import _k_grouped, _rows_of
from mok.ops.fp8_wgrad import grouped_wgrad_fp8_quantized, quantize_row_blocks
from mok.ops.quantize import QUANT_BLOCK
from mok.reference import dequantize_e4m3
from tests.ops.test_fp8_wgrad import schedule


def test_rows_and_k_grouped_operands_are_the_layers(device):
    tokens, hidden, inter = 200, 256, 128
    routing, _ = schedule(device, tokens=tokens, experts=3, topk=2, align=QUANT_BLOCK, seed=5)
    generator = torch.Generator().manual_seed(6)
    d_out = torch.randn(tokens, hidden, generator=generator).bfloat16().to(device)
    h = torch.randn(routing.capacity_rows, inter, generator=generator).bfloat16().to(device)

    rows = _rows_of(routing, d_out, gather=True)
    route = routing.row_route.long()
    used = route >= 0
    assert torch.equal(rows[used], d_out[route[used] // routing.topk])
    assert not rows[~used].any()

    qa, qb = (quantize_row_blocks(d_out, routing, gather=True),
              quantize_row_blocks(h, routing, gather=False))
    offsets = routing.expert_offsets.long().tolist()
    (codes_a, scales_a), (codes_b, scales_b) = _k_grouped(qa, offsets), _k_grouped(qb, offsets)
    assert scales_a.shape == (hidden, offsets[-1] // QUANT_BLOCK)
    expected = grouped_wgrad_fp8_quantized(qa, qb, routing, out_dtype=torch.float32)
    start = 0
    for e, (first, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        k = end - first
        a = codes_a[start * hidden:(start + k) * hidden].view(hidden, k)
        b = codes_b[start * inter:(start + k) * inter].view(inter, k)
        assert torch.equal(a.view(torch.uint8), qa.data[:, first:end].view(torch.uint8))
        slots = slice(first // QUANT_BLOCK, end // QUANT_BLOCK)
        # DeepGEMM's K-grouped GEMM: per 128-row block, the codes times the column scales
        a32 = dequantize_e4m3(a.T, scales_a[:, slots].T, (QUANT_BLOCK, 1))
        b32 = dequantize_e4m3(b.T, scales_b[:, slots].T, (QUANT_BLOCK, 1))
        torch.testing.assert_close(a32.T @ b32, expected[e], rtol=1e-4, atol=1e-4)
        start += k
