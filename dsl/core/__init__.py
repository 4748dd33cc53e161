"""The IR and what every stage shares: spans, errors, syntax nodes, the Program and Plan IR, the mesh, the op library,
the lowered-schedule IR, wording helpers and a helper process's lifetime. Imports nothing else of dhelix."""
