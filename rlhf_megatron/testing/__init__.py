"""Helpers shared by tests and benchmarks: multi-rank runner, tiny HF checkpoints."""
