"""Outputs for people and other tools: Graphviz diagrams, the torch.distributed.pipelining CSV and Chrome traces."""
