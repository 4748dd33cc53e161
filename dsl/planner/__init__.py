"""The SI planner: per-op cost model, the pair cost P(seg_f, seg_b), legal operator sequences and the DP pairing search."""
