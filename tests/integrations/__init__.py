"""Tests of mok.nn, the Hugging Face patch, the examples."""
