"""Where a layout's mesh axes sit on the machine: the order of the axes in the mesh block
(innermost first), searched by `dhelix tune` as any other setting.

The order decides which groups lie inside a node (and inside each declared level): ``tp = 8
pp = 4 dp = 2`` on nodes of 8 keeps the tensor-parallel groups on NVLink and sends the
pipeline's and the data-parallel traffic across nodes; ``dp = 2 tp = 8 pp = 4`` splits each
tensor-parallel group over two nodes. Many orders place alike, though: what the simulator
prices of a placement is, at every boundary (a node, a declared level), which axes lie
inside a unit, which one (at most) straddles it and which lie across — so orders that agree
on that at every boundary are one placement (:func:`placement_key`), and the search tries
one of each (:func:`placements`; the file's own first, so that a layout the file writes
keeps its text). Where an axis's groups do not align with a boundary, no two orders are
taken to agree."""

from __future__ import annotations

import functools
import itertools

from dhelix.dsl.core.mesh import TUNE_ORDER

#: The axes an order places, in :data:`~dhelix.dsl.core.mesh.TUNE_ORDER`.
PLACED_AXES = TUNE_ORDER


def placements(sizes: dict[str, int], written: tuple[str, ...], boundaries: tuple[int, ...]
               ) -> tuple[tuple[str, ...], ...]:
    """The orders (innermost first) of the axes of ``sizes`` (axis → size) larger than 1,
    one per placement (:func:`placement_key`) on units of ``boundaries`` GPUs; the first is
    ``written`` (the file's order of its axes, the others after it in :data:`PLACED_AXES`
    order), the others in order of their axes. Only the written one without boundaries."""
    axes = tuple(axis for axis in PLACED_AXES if sizes.get(axis, 1) > 1)
    first = written_order(axes, written)
    if not boundaries:
        return (first,)
    return _placements(axes, first, tuple(sizes.get(axis, 1) for axis in axes), boundaries)


def written_order(axes: tuple[str, ...], written: tuple[str, ...]) -> tuple[str, ...]:
    """``axes`` in the order ``written`` lists them, those it does not list after, in
    :data:`PLACED_AXES` order (where a mesh block's new axes go)."""
    return tuple(axis for axis in written if axis in axes) + tuple(axis for axis in axes if axis not in written)


@functools.cache
def _placements(axes: tuple[str, ...], first: tuple[str, ...], sizes: tuple[int, ...], boundaries: tuple[int, ...]
                ) -> tuple[tuple[str, ...], ...]:
    size_of = dict(zip(axes, sizes, strict=True))
    found: dict[tuple, tuple[str, ...]] = {}
    for order in (first, *itertools.permutations(axes)):
        found.setdefault(placement_key(order, size_of, boundaries), order)
    return tuple(found.values())


def placement_key(order: tuple[str, ...], sizes: dict[str, int], boundaries: tuple[int, ...]) -> tuple:
    """What the placement of the axes in ``order`` (innermost first, of ``sizes``) is on
    units of each of ``boundaries`` GPUs: per boundary, the axes inside a unit, the one that
    straddles units (its groups' first part inside, the rest across) and those across; orders
    with equal keys place alike. An order whose groups do not align with a boundary is its
    own key."""
    key = []
    for bound in boundaries:
        inner, inside, straddle, across = 1, [], None, []
        for axis in order:
            outer = inner * sizes[axis]
            if bound % outer == 0:
                inside.append(axis)
            elif inner % bound == 0:
                across.append(axis)
            elif bound % inner == 0 and outer % bound == 0:
                straddle = axis
            else:
                return ("unaligned", order)
            inner = outer
        key.append((frozenset(inside), straddle, frozenset(across)))
    return tuple(key)


def placement_text(order: tuple[str, ...], sizes: dict[str, int], gpus_per_node: int) -> str:
    """The axes of ``order`` innermost first with ``|`` where a node ends: ``tp8 | pp4 dp2``
    (tp inside a node), ``dp2 tp4|2 pp4`` (each tp group on two nodes, 4 ranks on each);
    an axis whose groups do not align with the nodes is written without a mark."""
    parts, inner, marked = [], 1, False
    for axis in order:
        size = sizes[axis]
        outer = inner * size
        if not marked and gpus_per_node % inner == 0 and outer % gpus_per_node == 0 and outer > gpus_per_node \
                and inner < gpus_per_node:
            parts.append(f"{axis}{gpus_per_node // inner}|{outer // gpus_per_node}")
            marked = True
        else:
            if not marked and inner >= gpus_per_node and inner % gpus_per_node == 0 and parts:
                parts.append("|")
                marked = True
            parts.append(f"{axis}{size}")
        inner = outer
    return " ".join(parts)
