"""Tests of compiled kernels at real shapes (needs a CUDA GPU)."""
