"""The rank blocks of a group-partitioned collective: a gathered tensor holds one block per
rank of the group (equal slices along dim 0); which blocks each stage of a gather over a
group's sub-axes (``tp.intra``, ``tp.inter``, or declared levels) brings a rank, which a
split at those stages computes on, and the blocks reordered between the stages' layout and
the group's order (:mod:`dhelix.dsl.passes.partition` makes such chains; :mod:`.layout_kernels`,
:mod:`.collective_kernels` and :mod:`.fsdp` run them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dhelix.dsl.core.mesh import INTER, INTRA

if TYPE_CHECKING:
    from .comm import Communicator


def regrouped(x: torch.Tensor, comm: "Communicator", axis: str, gathered: bool, layout=True) -> torch.Tensor:
    """``x``'s rank blocks (equal slices along dim 0, one per rank of ``axis``'s whole group)
    reordered for the node-local stage ``axis`` (``tp.intra``) of a group-partitioned
    collective (:data:`~dhelix.dsl.core.oplib.REGROUP`). A rank's position in the group is
    ``inter · intra_size + intra``. After a gather across nodes then inside the node
    (``gathered``) the blocks come intra-major and go back to that order; before a
    reduce-scatter inside the node then across, they go intra-major, so that each intra
    position receives the blocks of its place on every node. Over declared levels
    ``layout`` names the stages' sub-axes in the order the blocks lie (outermost first):
    :func:`levels_regrouped`."""
    if layout is not True:
        return levels_regrouped(x, comm, tuple(layout), gathered)
    base = axis.rpartition(".")[0]
    intra, inter = comm.size(f"{base}.{INTRA}"), comm.size(f"{base}.{INTER}")
    outer, inner = (intra, inter) if gathered else (inter, intra)
    return x.reshape(outer, inner, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def levels_regrouped(x: torch.Tensor, comm: "Communicator", layout: tuple[str, ...], gathered: bool) -> torch.Tensor:
    """``x``'s rank blocks moved from ``layout`` (sub-axes, outermost first: how a
    group-partitioned all_gather's stages left them) to the group's order (the sub-axis of
    the largest stride outermost), or (not ``gathered``) from the group's order to
    ``layout``, as a reduce_scatter's stages take them."""
    sizes = {axis: comm.size(axis) for axis in layout}
    group = sorted(layout, key=lambda axis: -(comm.mesh.stride(axis) if comm.mesh is not None else 0))
    source, target = (layout, group) if gathered else (group, layout)
    blocks = x.reshape(*(sizes[axis] for axis in source), -1, *x.shape[1:])
    moved = blocks.permute(*(source.index(axis) for axis in target), *range(len(source), blocks.dim()))
    return moved.reshape(x.shape)


def stage_blocks(comm: "Communicator", axis: str, stage: str) -> list[int]:
    """The positions in ``axis``'s group (position = inter · intra_size + intra, as in
    :func:`regrouped`) of the ranks whose blocks the first stage of a group-partitioned
    all_gather over ``axis.<stage>`` brings this rank, in the order it brings them: its
    node's ranks (``intra``) or the ranks at its place on every node (``inter``)."""
    intra, inter = comm.size(f"{axis}.{INTRA}"), comm.size(f"{axis}.{INTER}")
    if stage == INTRA:
        node = comm.index(f"{axis}.{INTER}")
        return [node * intra + place for place in range(intra)]
    place = comm.index(f"{axis}.{INTRA}")
    return [node * intra + place for node in range(inter)]


def part_blocks(comm: "Communicator", axis: str, first: str, blocks: int, parts: int) -> list[list[int]]:
    """The rank blocks (positions in ``axis``'s group) each of the ``parts`` chunks of a split
    at a gather's stages computes on, each in block order: the first stage's
    (:func:`stage_blocks`) and the others; three ways (``by stages3``, node-local stage first)
    the node's, this place's on the other nodes, and the rest."""
    near = stage_blocks(comm, axis, first)
    if parts == 2:
        return [near, [b for b in range(blocks) if b not in near]]
    intra, place = comm.size(f"{axis}.{INTRA}"), comm.index(f"{axis}.{INTRA}")
    across = [b for b in range(blocks) if b % intra == place and b not in near]
    return [near, across, [b for b in range(blocks) if b not in near and b not in across]]


def level_part_blocks(comm: "Communicator", axis: str, order: tuple[str, ...], fine: bool) -> list[list[int]]:
    """The rank blocks (positions in ``axis``'s group) each chunk of a split at the stages of
    a gather over declared levels computes on, the stages running over the levels ``order``:
    the first stage's, then each later stage's new ones (its blocks without the copy of what
    the stages before brought) in the order that stage lays them out (its level outermost),
    the last stage's in block order (taken from the whole, regrouped gather); ``fine`` (the
    levels smallest first) the last stage's cut in two, this rank's place in every unit of the
    largest level, then the rest."""
    sizes = {level: comm.size(f"{axis}.{level}") for level in order}
    own = {level: comm.index(f"{axis}.{level}") for level in order}
    mesh = comm.mesh
    assert mesh is not None, "declared levels are sub-axes of the mesh"
    weights, weight = {}, 1
    for level in sorted(order, key=lambda level: mesh.stride(f"{axis}.{level}")):
        weights[level], weight = weight, weight * sizes[level]

    def position(digits: dict) -> int:
        return sum(digits[level] * weights[level] for level in order)
    layout, parts = [dict(own)], []
    for index, level in enumerate(order):
        grown = [{**digits, level: j} for j in range(sizes[level]) for digits in layout]
        parts.append([position(d) for d in grown if index == 0 or d[level] != own[level]])
        layout = grown
    parts[-1].sort()
    if fine:
        last = order[-1]
        across = [b for b in parts[-1] if all(d == own[level] for level, d in _digits(b, weights, sizes).items()
                                              if level != last)]
        parts[-1:] = [across, [b for b in parts[-1] if b not in across]]
    return parts


def _digits(position: int, weights: dict, sizes: dict) -> dict:
    """A group position's digit on each level (the inverse of ``level_part_blocks``' position)."""
    return {level: position // weight % sizes[level] for level, weight in weights.items()}


def within_index(comm: "Communicator", axes) -> int:
    """This rank's index in the group of the sub-axes ``axes`` taken together, the first
    innermost (one axis: its own index)."""
    if isinstance(axes, str):
        return comm.index(axes)
    index, size = 0, 1
    for axis in axes:
        index, size = index + comm.index(axis) * size, size * comm.size(axis)
    return index


def without_group(x, groups: int, mine: int):
    """``x`` (cut into ``groups`` equal slices along dim 0) without slice ``mine``."""
    return torch.cat([p for i, p in enumerate(x.chunk(groups)) if i != mine]).contiguous()
