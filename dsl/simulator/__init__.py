"""The step simulator: per-step costs, the discrete-event run over every pipeline rank, memory, variants and reports."""
