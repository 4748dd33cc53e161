"""Mesh axes that the layers never communicate over: a located warning, not an error.

An axis of tensor, context or expert parallelism splits the work of a layer only through the
layer's collectives over it (an ``all_gather(x, tp)``, ring attention over ``cp``, an
``all_to_all`` over ``ep``). A mesh with ``tp = 2`` and a layer without a tp collective runs
and checks, but both ranks of each tp group compute the same thing: half the machine is
wasted, which is rarely what was meant. Data and pipeline parallelism are used by the
optimizer and the schedule whatever the layer says, so only tp, cp and ep are looked at.
"""

from __future__ import annotations

from dhelix.dsl.core.errors import DhelixWarning
from dhelix.dsl.core.program import Program

#: The axes a layer uses only through its own operations, with how stdlib's layers use each.
LAYER_AXES = {"tp": "all_gather and reduce_scatter over tp, as stdlib's llama does",
              "cp": "attention(…, cp), ring attention, as stdlib's llama does",
              "ep": "all_to_all over ep, as stdlib's moe does"}


def unused_axes(program: Program) -> list[DhelixWarning]:
    """A warning per axis of :data:`LAYER_AXES` with more than one rank that no op of the
    forward or backward layer DAG runs over (a group partition's sub-axes, ``tp.intra``,
    count for their axis), located at the axis's setting in the mesh block. Needs the
    shapes and autodiff passes' DAGs; none before them."""
    if program.forward is None or program.mesh is None:
        return []
    ops = [*program.forward.ops, *(program.backward.ops if program.backward is not None else ())]
    used = {op.axis.split(".")[0] for op in ops if op.axis}
    layer = program.model.layer if program.model is not None else None
    warnings = []
    for axis, how in LAYER_AXES.items():
        size = program.mesh.size(axis)
        if size <= 1 or axis in used:
            continue
        warnings.append(DhelixWarning(
            f"{axis} = {size}, but no operation of layer '{layer}' runs over {axis}: each group of {size} {axis} "
            f"ranks computes the same thing",
            program.mesh.spans.get(axis),
            [f"use {axis} in the layer ({how}), or set {axis} = 1 and give the ranks to dp"]))
    return warnings
