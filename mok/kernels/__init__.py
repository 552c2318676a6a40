"""Triton kernels (@triton.jit code only; the launchers live in mok.ops)."""
