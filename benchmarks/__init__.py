"""Benchmarks: scripts that print figures, not tests (see README.rst)."""
