"""Benchmarks of mok against the anchors (run with `python -m mok bench` from the repository)."""
