"""Tests of mok.functional on one GPU: the layer against the reference, layouts, errors."""
