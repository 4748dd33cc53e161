"""Checking a run: the single-process reference model and the comparison harness."""
