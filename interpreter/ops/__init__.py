"""Kernels and communicators: operators, collectives, FSDP shards, MoE, ring attention, weight layout."""
