"""The IR and what every stage shares: spans, errors, syntax nodes, the Program and Plan IR, the mesh, the op library,
the lowered-schedule IR and wording helpers. Imports nothing else of dhelix."""
