"""The layout kernels of a partitioned chain (:mod:`dhelix.dsl.passes.partition`): ``slice``
and ``concat`` of workload chunks, ``rest`` and ``merge`` of a group-partitioned gather's
stages, ``others`` (a tensor without this rank's group's blocks) and ``pick`` (this rank's
reduce among reduces of distinct roots). They move rows and columns only; each backward puts
a gradient back where its forward took the value from.
"""

from __future__ import annotations

import torch

from .blocks import level_part_blocks, part_blocks, stage_blocks, within_index, without_group
from .kernels import Kernel

# -- the slices and concats of a partitioned chain ------------------------------------------
# Along tokens a gathered tensor holds ``blocks`` rank blocks; chunk ``index`` of ``parts``
# is that share of every block, in block order (:mod:`dhelix.dsl.passes.partition`).

def _piece(x, index: int, parts: int, dim: int, blocks: int):
    if blocks == 1:
        step = x.shape[dim] // parts
        return x.narrow(dim, index * step, step)
    rows = x.shape[0] // blocks
    step = rows // parts
    return torch.cat([x.narrow(0, b * rows + index * step, step) for b in range(blocks)])


def _layout(ctx) -> tuple[int, int, int]:
    return ctx.params["parts"], ctx.params["dim"], ctx.params["blocks"]


def _slice_forward(inputs, weight, ctx):
    (x,) = inputs
    parts, dim, blocks = _layout(ctx)
    index = ctx.params["index"]
    return _piece(x, index, parts, dim, blocks).contiguous(), (tuple(x.shape), index, parts, dim, blocks)


def _slice_dgrad(grad, saved, weight):
    # The chunk's gradient in place in a zero tensor of the sliced value's shape; the
    # accumulation of the value's gradients adds the other chunks'.
    shape, index, parts, dim, blocks = saved
    full = grad.new_zeros(shape)
    if blocks == 1:
        full.narrow(dim, index * grad.shape[dim], grad.shape[dim]).copy_(grad)
        return (full,)
    rows, step = shape[0] // blocks, grad.shape[0] // blocks
    for b in range(blocks):
        full.narrow(0, b * rows + index * step, step).copy_(grad.narrow(0, b * step, step))
    return (full,)


def _concat_forward(inputs, weight, ctx):
    parts, dim, blocks = _layout(ctx)
    if blocks == 1:
        return torch.cat(inputs, dim), (parts, dim, blocks)
    step = inputs[0].shape[0] // blocks  # rows of one chunk in one rank block
    order = [x.narrow(0, b * step, step) for b in range(blocks) for x in inputs]
    return torch.cat(order), (parts, dim, blocks)


def _concat_dgrad(grad, saved, weight):
    parts, dim, blocks = saved
    return tuple(_piece(grad, i, parts, dim, blocks).contiguous() for i in range(parts))


# -- rest and merge: a chain split at the stages of a group-partitioned all_gather ----------
# The first stage brought the rank blocks of this rank's node (``first`` intra) or of its
# place on every node (inter), in rank order; ``rest`` takes the other blocks of the whole
# gather, ``merge`` puts chunk 0's rows (the first stage's blocks) and chunk 1's (the rest)
# back in rank order (:func:`~.blocks.stage_blocks` says which blocks are whose).

def _first_blocks(ctx) -> list[int]:
    # Over declared levels: every block the stages before the last brought.
    if "order" in ctx.params:
        last = level_part_blocks(ctx.comm, ctx.params["axis"], ctx.params["order"], False)[-1]
        return [b for b in range(ctx.params["blocks"]) if b not in last]
    return stage_blocks(ctx.comm, ctx.params["axis"], ctx.params["first"])


def _take_blocks(x, groups: list[list[int]], blocks: int, dim: int = 0) -> tuple:
    """For each list of block indices in ``groups``, those blocks of ``x`` (cut into
    ``blocks`` equal pieces along ``dim``) joined along ``dim`` in the list's order."""
    pieces = x.chunk(blocks, dim)
    return tuple(torch.cat([pieces[b] for b in group], dim) for group in groups)


def _rest_forward(inputs, weight, ctx):
    (x,) = inputs
    near, blocks = _first_blocks(ctx), ctx.params["blocks"]
    far = [b for b in range(blocks) if b not in near]
    return _take_blocks(x, [far], blocks)[0].contiguous(), (near, blocks)


def _rest_dgrad(grad, saved, weight):
    # The others' gradient in place in a zero tensor of the whole gather; the first stage's
    # blocks get theirs through chunk 0 (the gradients of the gather's stages add up).
    near, blocks = saved
    rows = grad.shape[0] // (blocks - len(near))
    full = grad.new_zeros((rows * blocks, *grad.shape[1:]))
    far = [b for b in range(blocks) if b not in near]
    for i, b in enumerate(far):
        full.narrow(0, b * rows, rows).copy_(grad.narrow(0, i * rows, rows))
    return (full,)


def _part_blocks(ctx, parts: int) -> list[list[int]]:
    """The blocks each of a merge's ``parts`` inputs holds (:func:`~.blocks.part_blocks`, over
    declared levels :func:`~.blocks.level_part_blocks`)."""
    if "order" in ctx.params:
        order = ctx.params["order"]
        return level_part_blocks(ctx.comm, ctx.params["axis"], order, parts > len(order))
    return part_blocks(ctx.comm, ctx.params["axis"], ctx.params["first"], ctx.params["blocks"], parts)


def _merge_forward(inputs, weight, ctx):
    # Rows of rank blocks (an activation gather's stages), or along the features (``dim`` 1)
    # the column blocks of a weight split at its ZeRO-3 gather's stages.
    owners, blocks, dim = _part_blocks(ctx, len(inputs)), ctx.params["blocks"], ctx.params.get("dim", 0)
    size = inputs[0].shape[dim] // len(owners[0])
    where = {b: (part, i) for part, owned in enumerate(owners) for i, b in enumerate(owned)}
    pieces = [x.split(size, dim) for x in inputs]
    return torch.cat([pieces[where[b][0]][where[b][1]] for b in range(blocks)], dim), (owners, blocks, dim)


def _merge_dgrad(grad, saved, weight):
    owners, blocks, dim = saved
    return tuple(piece.contiguous() for piece in _take_blocks(grad, owners, blocks, dim))


# -- others: a tensor's blocks without those of this rank's group (``by stages3``) ----------

def _others_forward(inputs, weight, ctx):
    (x,) = inputs
    groups, mine = ctx.params["groups"], within_index(ctx.comm, ctx.params["axis"])
    return without_group(x, groups, mine), (groups, mine)


def _others_dgrad(grad, saved, weight):
    groups, mine = saved
    size = grad.shape[0] // (groups - 1)
    full = grad.new_zeros((size * groups, *grad.shape[1:]))
    for i, b in enumerate(g for g in range(groups) if g != mine):
        full.narrow(0, b * size, size).copy_(grad.narrow(0, i * size, size))
    return (full,)


def _pick_forward(inputs, weight, ctx):
    # After reduces of distinct roots: the one whose root is this rank holds its block's sum.
    mine = ctx.comm.index(ctx.params["axis"])
    return inputs[mine], (mine, len(inputs))


def _pick_dgrad(grad, saved, weight):
    # Only this rank's reduce gets a gradient: a reduce's transpose is a broadcast from its
    # root, which reads nothing from the other members.
    mine, parts = saved
    return tuple(grad if i == mine else grad.new_zeros(grad.shape) for i in range(parts))


#: The layout kernels by op kind.
LAYOUT_KERNELS: dict[str, Kernel] = {
    "slice": Kernel(_slice_forward, _slice_dgrad),
    "concat": Kernel(_concat_forward, _concat_dgrad),
    "rest": Kernel(_rest_forward, _rest_dgrad),
    "merge": Kernel(_merge_forward, _merge_dgrad),
    "others": Kernel(_others_forward, _others_dgrad),
    "pick": Kernel(_pick_forward, _pick_dgrad),
}
