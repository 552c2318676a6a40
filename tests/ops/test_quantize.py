"""Blockwise float8_e4m3fn quantization (mok.ops.quantize) against the PyTorch reference
(mok.reference.quantize_e4m3): codes and scales bitwise equal. Under the interpreter the e4m3
rounding is mok.kernels.common.to_e4m3's integer emulation (the interpreter's own fp8 casts can
round the wrong way); on a GPU the same tests check the hardware conversion."""

import pytest
import torch
import triton
import triton.language as tl

from mok import _env
from mok.errors import MoKInputError
from mok.kernels.common import to_e4m3
from mok.ops.quantize import (
    QUANT_BLOCK,
    packed_row_bytes,
    quantize_rows,
    quantize_weights,
    quantize_weights_into,
    unpack_rows,
)
from mok.reference import E4M3_MAX, dequantize_e4m3, quantize_e4m3

E4M3 = torch.float8_e4m3fn


@triton.jit
def _to_e4m3_kernel(x_ptr, q_ptr, n, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(q_ptr + offsets, to_e4m3(x, UPCAST), mask=mask)


def codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def assert_same_codes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype == E4M3
    assert actual.shape == expected.shape
    differ = (codes(actual) != codes(expected)).nonzero()
    assert differ.numel() == 0, (
        f"{differ.shape[0]} codes differ, first at {differ[0].tolist()}: "
        f"{codes(actual)[tuple(differ[0])]} against {codes(expected)[tuple(differ[0])]}")


def fp32_cases() -> torch.Tensor:
    """Every bf16 value, e4m3's rounding midpoints and their fp32 neighbours, the edges of the
    subnormal and saturating ranges, and random fp32 values of both signs."""
    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(
        torch.bfloat16).float()
    representable = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # 0 .. 448
    midpoints = (representable[1:] + representable[:-1]) / 2
    bits = midpoints.view(torch.int32)
    near = torch.cat([(bits + d).view(torch.float32) for d in (-1, 0, 1)])
    edges = torch.tensor([2.0 ** -10, 2.0 ** -9, 2.0 ** -7, 2.0 ** -6, 448.0, 464.0, 479.9,
                          480.0, 1e30, float("inf"), float("nan"), 0.0, 1e-40])
    generator = torch.Generator().manual_seed(3)
    random = torch.randn(50_000, generator=generator) * torch.exp2(
        torch.randint(-12, 10, (50_000,), generator=generator).float())
    values = torch.cat([every_bf16, near, edges, random])
    return torch.cat([values, -values])


def test_to_e4m3_rounds_to_nearest_even_and_saturates(device):
    x = fp32_cases().to(device)
    q = torch.empty(x.shape, dtype=E4M3, device=device)
    _to_e4m3_kernel[(triton.cdiv(x.numel(), 1024),)](x, q, x.numel(), BLOCK=1024,
                                                     UPCAST=_env.INTERPRET)
    expected = x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)  # torch's cast alone gives NaN past 464
    nan = x.isnan()
    assert q.float()[nan].isnan().all()
    assert_same_codes(q[~nan], expected[~nan])
    assert (q.float()[x == float("inf")] == E4M3_MAX).all()
    assert (q.float()[x == -float("inf")] == -E4M3_MAX).all()


def spread_values(shape, seed, dtype, device) -> torch.Tensor:
    """Random values whose magnitudes span many binades, columns of different scales."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    binades = 8 if dtype == torch.float16 else 20  # fp16 holds finite values below 2**16
    x *= torch.exp2(torch.randint(-binades, binades, shape[-1:], generator=generator).float())
    return x.to(dtype).to(device)


@pytest.mark.parametrize("pow2_scales", [False, True], ids=["scales", "pow2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(37, 300), (64, 128), (1, 5), (0, 256)], ids=str)
def test_quantize_rows_matches_reference(device, shape, dtype, pow2_scales):
    x = spread_values(shape, seed=1, dtype=dtype, device=device)
    q, scales = quantize_rows(x, pow2_scales=pow2_scales)
    q_ref, scales_ref = quantize_e4m3(x, (1, QUANT_BLOCK), pow2_scales=pow2_scales)
    assert scales.shape == (shape[0], triton.cdiv(shape[1], QUANT_BLOCK))
    assert scales.dtype == torch.float32
    assert_same_codes(q, q_ref)
    assert torch.equal(scales, scales_ref)
    if pow2_scales and scales.numel():
        mantissa = scales.view(torch.int32) & 0x7FFFFF
        assert (mantissa == 0).all()


@pytest.mark.parametrize("pow2_scales", [False, True], ids=["scales", "pow2"])
@pytest.mark.parametrize("shape", [(3, 200, 260), (2, 256, 128), (130, 70)], ids=str)
def test_quantize_weights_matches_reference(device, shape, pow2_scales):
    w = spread_values(shape, seed=2, dtype=torch.bfloat16, device=device)
    q, scales = quantize_weights(w, pow2_scales=pow2_scales)
    q_ref, scales_ref = quantize_e4m3(w, (QUANT_BLOCK, QUANT_BLOCK), pow2_scales=pow2_scales)
    *batch, n, k = shape
    assert scales.shape == (*batch, triton.cdiv(n, QUANT_BLOCK), triton.cdiv(k, QUANT_BLOCK))
    assert_same_codes(q, q_ref)
    assert torch.equal(scales, scales_ref)


def test_weight_blocks_leave_nan_out_of_their_scale(device):
    w = spread_values((256, 256), seed=8, dtype=torch.bfloat16, device=device)
    w[3, 7] = float("nan")  # one NaN in block (0, 0)
    w[128:, 128:] = float("nan")  # block (1, 1) all NaN: scale 1, as a block of zeros
    q, scales = quantize_weights(w)
    q_ref, scales_ref = quantize_e4m3(w.cpu(), (QUANT_BLOCK, QUANT_BLOCK))
    assert torch.equal(scales.cpu(), scales_ref) and scales[1, 1] == 1.0
    nan = w.isnan()
    assert q.float()[nan].isnan().all()
    assert_same_codes(q[~nan], q_ref.to(device)[~nan])


@pytest.mark.parametrize("pow2_scales", [False, True], ids=["scales", "pow2"])
def test_quantize_weights_into_writes_the_transposed_copy(device, pow2_scales):
    # The transposed codes and scales, into views of wider buffers (as gate's and up's halves
    # of [gate, up] transposed), equal quantizing the transposed weight; edge blocks included.
    w = spread_values((2, 200, 260), seed=6, dtype=torch.bfloat16, device=device)
    data = torch.full((2, 260, 456), 0x11, dtype=torch.uint8, device=device).view(E4M3)
    scales = torch.full((2, 3, 4), -1.0, device=device)
    q, s = quantize_weights_into(w, (data[..., 256:], scales[..., 2:]), pow2_scales=pow2_scales)
    q_ref, s_ref = quantize_weights(w, pow2_scales=pow2_scales)
    assert_same_codes(q, q_ref)
    assert torch.equal(s, s_ref)
    qt_ref, st_ref = quantize_weights(w.transpose(1, 2).contiguous(), pow2_scales=pow2_scales)
    assert_same_codes(data[..., 256:], qt_ref)
    assert torch.equal(scales[..., 2:], st_ref)
    assert (codes(data[..., :256]) == 0x11).all() and (scales[..., :2] == -1).all()
    with pytest.raises(MoKInputError, match="transposed copy"):
        quantize_weights_into(w, (data[:, :200], scales[..., 2:]))


def test_quantize_reads_strided_inputs(device):
    # torchtitan's [E, H, I] weights viewed as [E, I, H], and rows of a wider tensor.
    w = spread_values((2, 192, 160), seed=4, dtype=torch.bfloat16, device=device)
    w_t = w.transpose(1, 2)
    q, scales = quantize_weights(w_t)
    q_ref, scales_ref = quantize_weights(w_t.contiguous())
    assert_same_codes(q, q_ref)
    assert torch.equal(scales, scales_ref)
    wide = spread_values((40, 400), seed=5, dtype=torch.bfloat16, device=device)
    q, scales = quantize_rows(wide[:, 100:356])
    q_ref, scales_ref = quantize_rows(wide[:, 100:356].contiguous())
    assert_same_codes(q, q_ref)
    assert torch.equal(scales, scales_ref)


def test_dequantized_values_are_within_e4m3_rounding(device):
    x = spread_values((48, 384), seed=6, dtype=torch.float32, device=device)
    for pow2_scales in (False, True):
        q, scales = quantize_rows(x, pow2_scales=pow2_scales)
        back = dequantize_e4m3(q, scales, (1, QUANT_BLOCK))
        per_element = scales.repeat_interleave(QUANT_BLOCK, dim=1)[:, :x.shape[1]]
        # 3 mantissa bits: half a unit is 2**-4 of a normal value; the subnormals' unit is
        # 2**-9 of the scale. Each block's largest value lands on the top code or below it.
        bound = x.abs() * 2.0 ** -4 + per_element * 2.0 ** -10
        assert ((back - x).abs() <= bound).all()
        block_max = q.float().abs().reshape(48, 3, QUANT_BLOCK).amax(-1)
        assert (block_max <= E4M3_MAX).all()
        if not pow2_scales:
            assert (block_max == E4M3_MAX).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0
def test_special_values_stay_in_their_block(device):
    x = spread_values((5, 256), seed=7, dtype=torch.bfloat16, device=device)
    x[0, :128] = 0.0
    x[1, 5] = float("nan")
    x[2, 200] = float("inf")
    x[4, 128:] = float("nan")
    q, scales = quantize_rows(x)
    assert scales[0, 0] == 1.0 and (q[0, :128].float() == 0).all()
    assert scales[4, 1] == 1.0 and q[4, 128:].float().isnan().all()  # all NaN: as zeros
    assert q[1, 5].float().isnan()
    finite = torch.cat([x[1, :5], x[1, 6:128]]).float().abs().max()
    finite = finite / torch.full_like(finite, E4M3_MAX)  # tensor / tensor: correctly rounded
    assert scales[1, 0] == finite  # the NaN leaves the scale to the block's numbers
    assert scales[2, 1] == float("inf")
    assert dequantize_e4m3(q, scales, (1, QUANT_BLOCK))[2, 128:].isnan().all()
    # the other blocks are untouched by them
    q_clean, scales_clean = quantize_rows(x[3:])
    assert torch.equal(scales[3], scales_clean[0]) and torch.equal(codes(q[3]), codes(q_clean[0]))
    assert torch.isfinite(scales[:, :1][1:]).all() and torch.isfinite(scales[[0, 1, 3], 1]).all()


@pytest.mark.parametrize("pow2_scales", [False, True], ids=["scales", "pow2"])
def test_blocks_of_tiny_values_stay_finite(device, pow2_scales):
    # 448 / amax overflows fp32 for amax below 448 * 2**-126 (about 5.3e-36), normal bf16
    # values: the scale is taken from that floor instead, so the block's zeros stay 0 (they
    # were NaN, 0 * inf) and its values keep e4m3's precision.
    floor = E4M3_MAX * 2.0 ** -126
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    x[:, ::3] = 0  # zeros in every block
    x[0] *= 1e-37  # both blocks of row 0 below the floor
    x[1, :128] *= 1e-38  # one block with subnormal fp32 values
    x[2, 128:] *= 3e-36  # near the floor
    x = x.to(device)
    for block, quantize in (((1, QUANT_BLOCK), quantize_rows),
                            ((128, 128), quantize_weights)):
        data = x if block[0] == 1 else x.repeat(32, 1)  # 128 rows: one block per 128 columns
        q, scales = quantize(data, pow2_scales=pow2_scales)
        q_ref, scales_ref = quantize_e4m3(data.cpu(), block, pow2_scales=pow2_scales)
        assert_same_codes(q.cpu(), q_ref)
        assert torch.equal(scales.cpu(), scales_ref)
        assert torch.isfinite(scales).all() and not q.float().isnan().any()
        back = dequantize_e4m3(q, scales, block)
        assert (back[data == 0] == 0).all()
        if block[0] == 1:
            assert scales[0].tolist() == [floor / E4M3_MAX] * 2  # 2**-126
            # within e4m3's rounding of the tiny values (scaled up to about 8, not to 448):
            # half a unit of 3 mantissa bits, or of the subnormal step 2**-9
            step = scales[0].repeat_interleave(QUANT_BLOCK)
            assert ((back[0] - data[0]).abs()
                    <= data[0].abs() * 2.0 ** -4 + step * 2.0 ** -10).all()


def test_quantize_is_deterministic(device):
    x = spread_values((96, 512), seed=8, dtype=torch.bfloat16, device=device)
    first = quantize_rows(x)
    for _ in range(2):
        again = quantize_rows(x)
        assert torch.equal(codes(first[0]), codes(again[0])) and torch.equal(first[1], again[1])


def test_quantize_rejects_bad_inputs(device):
    with pytest.raises(MoKInputError, match="2 dimensions"):
        quantize_rows(torch.zeros(2, 3, 4, device=device))
    with pytest.raises(MoKInputError, match="2 or 3 dimensions"):
        quantize_weights(torch.zeros(4, device=device))
    with pytest.raises(MoKInputError, match="bf16, fp16 or fp32"):
        quantize_rows(torch.zeros(2, 3, dtype=torch.int32, device=device))
    with pytest.raises(MoKInputError, match="bf16, fp16 or fp32"):
        quantize_weights(torch.zeros(2, 3, dtype=E4M3, device=device))


@pytest.mark.parametrize("width", [16, 200, 2048])
def test_packed_rows_hold_codes_then_scales(device, width):
    # Expert parallelism moves a row's e4m3 codes and scales as one byte row: codes at the
    # start, the scales from the next multiple of 16 bytes, rows apart by a multiple of 16.
    x = spread_values((5, width), seed=9, dtype=torch.bfloat16, device=device)
    q, scales = quantize_rows(x)
    nbytes = packed_row_bytes(width)
    start = -(-width // 16) * 16
    assert nbytes % 16 == 0 and nbytes >= start + 4 * scales.shape[1]
    packed = torch.randint(0, 256, (5, nbytes + 16), dtype=torch.uint8, device=device)
    codes_view, scales_view = unpack_rows(packed, width)
    codes_view.copy_(q)
    scales_view.copy_(scales)
    assert torch.equal(packed[:, :width], codes(q))
    assert torch.equal(packed[:, start:start + 4 * scales.shape[1]],
                       scales.contiguous().view(torch.uint8))
    again = unpack_rows(packed, width)
    assert torch.equal(codes(again.data), codes(q)) and torch.equal(again.scales, scales)


def test_unpack_rows_rejects_unaligned_rows(device):
    with pytest.raises(MoKInputError, match="multiples of 16 bytes"):
        unpack_rows(torch.zeros(3, 40, dtype=torch.uint8, device=device), 16)  # 40-byte rows
    with pytest.raises(MoKInputError, match="uint8"):
        unpack_rows(torch.zeros(3, 48, dtype=torch.uint8, device=device), 128)  # too narrow
    with pytest.raises(MoKInputError, match="uint8"):
        unpack_rows(torch.zeros(3, 48, dtype=torch.int8, device=device), 16)
