"""SI plans as the executor runs them: which ops of a layer pair each segment pair holds.

An SI block pairs forward layer k of one strand with backward layer k of the other; each
layer pair runs the same :data:`SegmentPlan`, an ordered list of (forward op names,
backward op names) segment pairs, either side possibly empty, covering both DAGs once.
Plans come from the planner
(:func:`dhelix.dsl.simulator.events.planned_pairs`, the plan of the program's hardware
profile) or are built here without costs (:data:`PLANS`: ``sequential``, ``op_by_op``);
:func:`check_plan` says whether one can run at all. :func:`backward_ops` and
:func:`in_weight_pass` say which backward ops a B action runs when W is split off.
"""

from __future__ import annotations

import enum
from typing import Callable

from dhelix.dsl.core.oplib import in_weight_pass
from dhelix.dsl.core.program import LayerDag, Op


#: An SI plan for one layer pair: ``((forward op names, backward op names), ...)``.
SegmentPlan = tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]
PlanFn = Callable[[LayerDag, LayerDag], SegmentPlan]


def sequential_plan(fwd: LayerDag, bwd: LayerDag) -> SegmentPlan:
    """One pair of all forward ops, then one of all backward ops: no interleaving."""
    return ((tuple(op.name for op in fwd.ops), ()), ((), tuple(op.name for op in bwd.ops)))


def op_by_op_plan(fwd: LayerDag, bwd: LayerDag) -> SegmentPlan:
    """Forward op i paired with backward op i in each DAG's listed (topological) order,
    the longer DAG's remaining ops alone: the finest interleaving, legal for any DAGs."""
    pairs = []
    for i in range(max(len(fwd.ops), len(bwd.ops))):
        pairs.append((tuple(op.name for op in fwd.ops[i:i + 1]), tuple(op.name for op in bwd.ops[i:i + 1])))
    return tuple(pairs)


class SIMode(enum.StrEnum):
    """How a run's SI blocks run (``dhelix run --si-plan``): the planner's segment pairs,
    the block scheduler's order of a whole block, op i beside op i, or no interleaving."""

    PLANNED = "planned"
    SCHEDULED = "scheduled"
    OP_BY_OP = "op_by_op"
    SEQUENTIAL = "sequential"


#: The plans built without costs, by mode.
PLANS: dict[SIMode, PlanFn] = {SIMode.SEQUENTIAL: sequential_plan, SIMode.OP_BY_OP: op_by_op_plan}


def has_si_blocks(lowered) -> bool:
    """Whether a lowered schedule has SI blocks (else no plan is needed)."""
    return lowered.interleaved


def fixed_plan(pairs: SegmentPlan) -> PlanFn:
    """A PlanFn returning ``pairs`` for every layer pair (all layers share one DAG)."""
    return lambda fwd, bwd: pairs


def check_plan(plan: SegmentPlan, fwd: LayerDag, bwd: LayerDag, optional=frozenset()) -> None:
    """Raise ValueError unless ``plan`` runs every op of ``fwd`` and ``bwd`` exactly once,
    each after the ops of its own DAG that it reads. Ops named in ``optional`` (the wgrads
    of a schedule that runs them in W actions) may be left out."""
    for dag, side in ((fwd, 0), (bwd, 1)):
        order = [name for pair in plan for name in pair[side]]
        known = {op.name: op for op in dag.ops}
        required = set(known) - set(optional)
        if len(order) != len(set(order)) or not required <= set(order) <= set(known):
            missing = sorted(required - set(order))
            extra = sorted(name for name in set(order) if order.count(name) > 1 or name not in known)
            raise ValueError(f"the SI plan does not cover the {dag.direction} DAG once: missing "
                             f"{missing or 'none'}, repeated or unknown {extra or 'none'}")
        done = {dag.input}
        for name in order:
            late = [x for x in known[name].deps if x not in done and x in known]
            if late:
                raise ValueError(f"the SI plan runs {name} before {', '.join(late)}, which it reads")
            done.add(name)


def backward_ops(bwd: LayerDag, split: bool) -> tuple[Op, ...]:
    """The ops a B action runs: all of them, or without the weight gradients when the
    schedule splits them into W actions."""
    return tuple(op for op in bwd.ops if not (split and in_weight_pass(op)))

