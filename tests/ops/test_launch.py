"""mok.ops.launch's key against Triton's own specialization of the same arguments: two arguments
with one key must specialize alike (the key may be finer, never coarser)."""

from __future__ import annotations

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from mok.ops.launch import _key

BACKEND = make_backend(GPUTarget("cuda", 90, 32))


def _arguments() -> list:
    base = torch.zeros(256, 64, dtype=torch.bfloat16)
    wide = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    narrow = gl.NVMMASharedLayout.get_default_for([16, 32], gl.bfloat16)
    return [
        0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
        -2**31, -2**31 - 16, 2**40, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16,
        True, False, 0.0, 1.0, -2.5, None,
        base, base[1:], base[2:], base[8:], base.view(-1)[3:], base.float(), base.float()[1:],
        base.to(torch.int32), base.to(torch.int64)[5:], base.to(torch.float8_e4m3fn),
        torch.nn.Parameter(base.float()), torch.nn.Parameter(base.float())[1:],
        TensorDescriptor.from_tensor(base, [16, 32]), TensorDescriptor.from_tensor(base, [64, 64]),
        TensorDescriptor.from_tensor(base[8:], [16, 32]),
        TensorDescriptor.from_tensor(base.float(), [16, 32]),
        GluonDescriptor.from_tensor(base, [16, 32], narrow),
        GluonDescriptor.from_tensor(base, [64, 64], wide),
        GluonDescriptor.from_tensor(base[8:], [64, 64], wide),
        GluonDescriptor.from_tensor(base, [64, 64], narrow),
    ]


def _triton(value):
    return native_specialize_impl(BACKEND, value, False, True, True)


def test_one_key_means_one_specialization():
    values = _arguments()
    keys = [_key(0, {"arg": value}, {"arg"}, []) for value in values]
    distinct = 0
    for (i, a), (j, b) in itertools.combinations(enumerate(values), 2):
        if keys[i] == keys[j]:
            assert _triton(a) == _triton(b), (a, b)
        elif _triton(a) != _triton(b):
            distinct += 1
    assert distinct > len(values)  # the list does hold arguments Triton tells apart


def test_constexprs_and_options_are_keyed_by_value_or_identity():
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    same = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    keep: list = []
    key = _key(0, {"BLOCK": 64, "LAYOUT": layout, "num_warps": 4}, set(), keep)
    assert keep == [layout]
    assert key == _key(0, {"BLOCK": 64, "LAYOUT": layout, "num_warps": 4}, set(), [])
    assert key != _key(0, {"BLOCK": 64, "LAYOUT": layout, "num_warps": 8}, set(), [])
    assert key != _key(0, {"BLOCK": 128, "LAYOUT": layout, "num_warps": 4}, set(), [])
    assert key != _key(0, {"BLOCK": 64, "LAYOUT": same, "num_warps": 4}, set(), [])
    assert key != _key(1, {"BLOCK": 64, "LAYOUT": layout, "num_warps": 4}, set(), [])
    # the same values under other names, or a runtime argument's value, are other keys
    assert key != _key(0, {"BLOCK_N": 64, "LAYOUT": layout, "num_warps": 4}, set(), [])
    assert (_key(0, {"n": 32}, {"n"}, []) == _key(0, {"n": 48}, {"n"}, [])
            != _key(0, {"n": 40}, {"n"}, []))


def test_an_argument_of_unknown_type_has_no_key():
    with pytest.raises(TypeError, match="no launch key"):
        _key(0, {"arg": (1, 2)}, {"arg"}, [])
