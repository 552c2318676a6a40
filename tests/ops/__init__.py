"""Tests of mok.ops: routing, tile table, sm_90 compilation."""
