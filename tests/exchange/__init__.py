"""Tests of mok.exchange: expert parallelism on CPU processes."""
