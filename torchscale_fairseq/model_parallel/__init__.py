"""Megatron-style tensor model parallelism: groups, communication ops, layers, RNG, loss."""
