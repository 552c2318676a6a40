"""Tests of the benchmarks (repository tools)."""
