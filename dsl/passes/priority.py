"""Centauri's layer-level scheduling (ASPLOS'24 §3.2.2, Eq. 1): which half of a weighted
operator's backward runs first on the compute lane.

A GEMM's backward is two independent computations of the same upstream gradient: the
activation gradient (``dgrad``, which the layer below waits for, and whose collective — the
transpose of the forward's all_gather — follows it) and the weight gradient (``wgrad``, which
only the optimizer needs, and, under ZeRO-3, its reduce-scatter). Megatron runs the dgrad first
(Centauri's T1), which is what autodiff lists; running the wgrad first (T2) lets FSDP's
gradient reduce-scatter start a GEMM earlier while the activation gradients are computed.
The executor and the simulator run a backward in its listed order on the compute lane, so
the choice is this pass's reordering: with ``wgrad`` first each wgrad goes right before the
dgrad of the same operator (its sibling; both read only the upstream gradient, so the swap
is always legal). Collectives keep their places.

``backward wgrad first`` (or ``dgrad``) in the partition block fixes it; without, with a
partition block, the planner prices both (:mod:`dhelix.dsl.planner.chunking`) and
``Program.backward_first`` holds its choice; otherwise the order is autodiff's (dgrad first).
"""

from __future__ import annotations

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.oplib import DGRAD, WGRAD, part_of
from dhelix.dsl.core.program import LayerDag, Program

#: The two priorities, in Eq. 1's order (T1, T2).
PRIORITIES = (DGRAD, WGRAD)


def backward_statement(program: Program) -> s.Backward | None:
    """The partition block's ``backward … first`` statement, or None."""
    body = program.partition.body if program.partition is not None else ()
    return next((st for st in body if isinstance(st, s.Backward)), None)


def backward_first(program: Program) -> str:
    """The half that runs first: the program's statement, else the planner's choice (only
    with a partition block), else dgrad."""
    if program.partition is None:
        return DGRAD
    statement = backward_statement(program)
    return statement.first if statement is not None else program.backward_first or DGRAD


def prioritized(backward: LayerDag, first: str) -> LayerDag:
    """``backward`` listed with ``first`` (dgrad or wgrad) ahead in every dgrad/wgrad pair
    (autodiff lists each pair dgrad first, side by side)."""
    if first == DGRAD:
        return backward
    ops = list(backward.ops)
    for i in range(len(ops) - 1):
        one, two = ops[i], ops[i + 1]
        if part_of(one.op) == DGRAD and part_of(two.op) == WGRAD and one.forward == two.forward:
            ops[i], ops[i + 1] = two, one
    return attrs.evolve(backward, ops=tuple(ops))
