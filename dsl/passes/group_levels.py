"""Group partition over a declared topology (Centauri §3.1.2: a group as a d-dimensional mesh).

With ``cluster { … levels { island = 2 } }`` a collective's group is a mesh ``[N1 … Nd]``,
one dimension per level it spans (:meth:`~dhelix.dsl.core.mesh.Mesh.level_stages`): ``N1``
ranks of it in one island, ``N2`` islands of it in one node, ``N3`` nodes. ``group ag1``
then runs ``ag1`` as one sub-collective per level, each over the group's ranks in one unit of
that level at the same place in the units below (sub-axis ``tp.island``, ``tp.node``,
``tp.cluster``), on the lane of its groups (inside a node: the local lane; across nodes: the
cross lane) and priced with its level's link (:data:`~dhelix.dsl.core.oplib.LINK`). The
stages but the last are named for their level (``ag1.cluster``, ``ag1.node``), the last keeps
the name. An all_gather's stages compose to the whole gather, a reduce_scatter's to the whole
reduce-scatter (each stage scatters what the one before left), an all_reduce's sum.

Any order of the stages gives the same result once the rank blocks are put in the group's
order: the blocks lie with the last gather stage outermost (a reduce_scatter's first stage
outermost), so an order other than the group's own (largest level outermost) regroups
(:data:`~dhelix.dsl.core.oplib.REGROUP`, the layout's sub-axes). The default order carries
fewest bytes over the slow links: an all_gather's largest level first (each rank's piece
crosses the racks, not the node's pieces), a reduce_scatter's and an all_reduce's smallest
first (the partial sums cross). ``first LEVEL`` runs that level first and the rest in the
default order; without it the planner prices every order (:mod:`dhelix.dsl.planner.chunking`).
"""

from __future__ import annotations

import itertools

import attrs

from dhelix.dsl.core.errors import CheckError
from dhelix.dsl.core.mesh import Mesh
from dhelix.dsl.core.oplib import LINK, REGROUP
from dhelix.dsl.core.program import LayerDag, Op
from dhelix.dsl.core.wording import did_you_mean, join_words

#: How an order of stages is written in ``Program.group_orders`` (the planner's choice).
ORDER_JOIN = ">"
#: The order a gather split three ways (``by stages3``) runs its stages in where nothing
#: fixes it: smallest level first (the node-local stage first, over levels).
SMALLEST_FIRST = "smallest first"


def stages_of(name: str, axis: str, mesh: Mesh, span) -> tuple[str, ...] | CheckError:
    """The levels (smallest first) a group partition of ``name`` over ``axis`` splits into,
    or the error (located at ``span``) when its groups are unbalanced or span fewer than two
    levels."""
    stages = mesh.level_stages(axis)
    if isinstance(stages, str):
        return CheckError(f"cannot group-partition '{name}': its {axis} groups do not split evenly over the levels",
                          span, [stages, "every unit of a level must hold as many ranks of each group, and every "
                                 f"group of {axis} span the levels alike",
                                 f"change the mesh's sizes or order, or leave '{name}' out of the group statement"])
    if len(stages) < 2:
        return CheckError(f"cannot group-partition '{name}': its {axis} group {list(mesh.groups(axis)[0])} "
                          f"{_one_level(stages, mesh)}", span,
                          ["a group partition runs one sub-collective per level a group spans: it needs two "
                           f"levels or more (levels: {', '.join(f'{lv} = {g}' for lv, g in mesh.levels)})",
                           f"give {axis} more ranks, or order the mesh so that its groups span two levels, or "
                           f"leave '{name}' out of the group statement"])
    return tuple(level for level, _, _ in stages)


def _one_level(stages, mesh: Mesh) -> str:
    """Where a group whose ranks differ at one level only lies, in words."""
    if not stages:
        return "has one rank"
    level, size, _ = stages[0]
    names = [name for name, _ in mesh.levels]
    below = names[names.index(level) - 1] if names.index(level) else "GPU"
    where = f"lies inside one {level}" if below == "GPU" else \
        f"has one rank in each of {size} {below}s of one {level}"
    return f"{where}: it spans one level only"


def default_order(kind: str, stages: tuple[str, ...]) -> tuple[str, ...]:
    """The order of ``stages`` (smallest level first) that carries fewest bytes over the slow
    links: an all_gather's largest level first, a reduce_scatter's or all_reduce's smallest."""
    return tuple(reversed(stages)) if kind == "all_gather" else stages


def order_with_first(kind: str, stages: tuple[str, ...], first: str) -> tuple[str, ...]:
    """``first`` (one of ``stages``), then the others in the default order."""
    return (first, *(level for level in default_order(kind, stages) if level != first))


def every_order(stages: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every order of ``stages`` (d! of them: 6 for three levels)."""
    return list(itertools.permutations(stages))


def order_text(order: tuple[str, ...]) -> str:
    """``cluster>node>island``: an order as ``Program.group_orders`` holds it."""
    return ORDER_JOIN.join(order)


def split_over_levels(op: Op, mesh: Mesh, order: tuple[str, ...]) -> list[Op]:
    """``op`` as one sub-collective per level of ``order``, in that order; the last keeps its
    name (readers are unchanged), each carries its sub-axis, lane, link and, where the blocks
    leave the group's order, the regroup layout."""
    sub = {level: f"{op.axis}.{level}" for level in order}
    group_order = tuple(sorted(order, key=lambda level: -mesh.stride(sub[level])))  # largest level outermost
    layout = tuple(reversed(order)) if op.op == "all_gather" else order
    regroup = tuple(sub[level] for level in layout) if layout != group_order and op.op != "all_reduce" else None
    # An all_gather's blocks are put in order after its last stage, a reduce_scatter's before its first.
    regroup_at = len(order) - 1 if op.op == "all_gather" else 0
    rows, cols = op.in_shapes[0]
    ops, inputs, in_shapes = [], op.inputs, op.in_shapes
    for index, level in enumerate(order):
        size = mesh.size(sub[level])
        rows = {"all_gather": rows * size, "reduce_scatter": rows // size}.get(op.op, rows)
        last = index == len(order) - 1
        params = (("axis", sub[level]), (LINK, level)) + (((REGROUP, regroup),) if regroup and index == regroup_at
                                                           else ())
        ops.append(attrs.evolve(op, name=op.name if last else f"{op.name}.{level}", inputs=inputs,
                                in_shapes=in_shapes, shape=op.shape if last else (rows, cols), axis=sub[level],
                                group_size=size, lane=mesh.lane(sub[level]), per_node=mesh.per_node(sub[level]),
                                params=params))
        inputs, in_shapes = (ops[-1].name,), (ops[-1].shape,)
    return ops


def checked_level(st, mesh: Mesh, errors) -> bool:
    """Whether the ``first`` of group statement ``st`` names a level of ``mesh``'s declared
    topology; else records the error, located at it."""
    levels = [level for level, _ in mesh.levels]
    if st.first in levels and "weights" in st.ops:
        errors.add(CheckError(f"'first {st.first}' with 'weights'", st.span_of("first"),
                              ["ZeRO-3's gathers split at the node whatever the levels (first inter or intra): "
                               "write 'group weights' in a statement of its own"]))
        return False
    if st.first in levels:
        return True
    notes = [f"inter and intra name the two stages without declared levels; here the stages are "
             f"the levels: {', '.join(levels)}"] if st.first in ("inter", "intra") else did_you_mean(st.first, levels)
    errors.add(CheckError(f"unknown level '{st.first}' to run first", st.span_of("first"),
                          notes + [f"the cluster's levels: {', '.join(levels)}; leave 'first' out to let the "
                                   "planner choose the order"]))
    return False


def split_at_levels(fwd: LayerDag, op: Op, targets: list[Op], span, mesh: Mesh, errors, first: str | None
                    ) -> LayerDag:
    """``fwd`` with collective ``op`` and its chunks (``targets``) split at the levels they span
    (:func:`split_over_levels`); ``first`` is a level (the statement's: the others follow in the
    default order), a whole order (the planner's, :func:`order_text`) or None (the default)."""
    assert op.axis is not None, "a collective has its axis"
    stages = stages_of(op.name if op.origin is None else op.origin, op.axis, mesh, span)
    if isinstance(stages, CheckError):
        errors.add(stages)
        return fwd
    if first is not None and ORDER_JOIN in first:
        order = tuple(first.split(ORDER_JOIN))
    elif first == SMALLEST_FIRST:
        order = stages
    elif first is not None and first not in stages:
        errors.add(CheckError(f"cannot run '{op.origin or op.name}' over level '{first}' first: its {op.axis} "
                              f"group spans {join_words(list(stages))}", span,
                              [f"name one of {join_words(list(stages), 'or')} after 'first', or leave it out"]))
        return fwd
    else:
        order = order_with_first(op.op, stages, first) if first else default_order(op.op, stages)
    replaced = {target.name: split_over_levels(target, mesh, order) for target in targets}
    return attrs.evolve(fwd, ops=tuple(new for o in fwd.ops for new in replaced.get(o.name, [o])))
