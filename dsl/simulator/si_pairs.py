"""What a step's SI blocks need before it is simulated: whether they co-execute, the
planner's SI plan of the layer pair and the block scheduler, as the schedule runs them (the
backward without its wgrads when W is split off), and the profile every price needs."""

from __future__ import annotations

from dhelix.dsl.core.errors import CheckError, DhelixError
from dhelix.dsl.planner.blockorder import BlockScheduler
from dhelix.dsl.planner.certify import Optimality, optimality
from dhelix.dsl.planner.pairing import plan_layers
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.planner.si_plan import SegmentPlan, has_si_blocks
from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.program import LayerDag, Program
from dhelix.dsl.simulator.costs import cost_of, si_backward


def require_profile(program: Program) -> None:
    """Raise a located CheckError unless ``program`` has a model and a hardware profile (what
    the cost model needs to plan and simulate); the command line says which command asked."""
    if program.model is None:
        raise DhelixError("the file has no model block, so there is nothing to plan or simulate",
                          notes=["give a file with a model, cluster and mesh (e.g. examples/llama8b_a40.dhx)"])
    if program.profile is None:
        raise CheckError("the cost model needs a hardware profile, and the cluster block names none",
                         program.cluster.span if program.cluster is not None else None,
                         ['set one in the cluster block: cluster { profile = "a40" } (or a800, h100, '
                          'or the path of a profile file)'])


def has_si(program: Program) -> bool:
    """Whether the step co-executes strand-interleaved blocks: the lowered schedule has
    some and the train block does not turn them off (``si = off``: each runs its F, then
    its B)."""
    return interleaves(program) and has_si_blocks(program.lowered)


def interleaves(program: Program) -> bool:
    """Whether ``program`` lets its SI blocks co-execute (its train block's ``si``)."""
    return program.train is None or program.train.interleaves


def schedule_plan(program: Program, cost: PairCost | None = None, **bounds) -> Plan:
    """The SI plan of the program's layer pair as its schedule runs it: the forward beside the
    whole backward, or beside the backward without its wgrads when the schedule splits W off.
    ``bounds`` go to :func:`pairing.plan_layers`; without ``cost`` the program's profile prices
    the segments (:func:`require_profile`'s error when there is none)."""
    cost, backward = _priced_backward(program, cost)
    assert program.forward is not None, "a checked model"
    return plan_layers(program.forward, backward, program.strands, cost, **bounds)


def plan_optimality(program: Program, plan: Plan, cost: PairCost | None = None) -> Optimality:
    """How far ``plan`` (:func:`schedule_plan`'s) can be from the fastest SI plan of the
    program's layer pair as its schedule runs it (:func:`~dhelix.dsl.planner.certify.optimality`)."""
    cost, backward = _priced_backward(program, cost)
    assert program.forward is not None, "a checked model"
    return optimality(plan, program.forward, backward, program.strands, cost)


def block_scheduler(program: Program, cost: PairCost | None = None) -> BlockScheduler:
    """The block scheduler of the program's SI blocks (:mod:`dhelix.dsl.planner.blockorder`):
    the forward DAG beside the backward as the schedule runs it, priced by ``cost`` (the
    program's profile when None: :func:`require_profile`'s error when there is none)."""
    cost, backward = _priced_backward(program, cost)
    assert program.forward is not None and program.backward is not None, "a checked model"
    return BlockScheduler(program.forward.ops, backward.ops, (program.forward.output, program.backward.output),
                          lambda op: cost.solo((op,)), program.profile.slowdown)


def _priced_backward(program: Program, cost: PairCost | None) -> tuple[PairCost, LayerDag]:
    """``cost`` (the program's profile's when None: :func:`require_profile`'s error when
    there is none) and the backward DAG an SI block runs: without its wgrads when the
    schedule splits W off."""
    if cost is None:
        require_profile(program)
        cost = cost_of(program)
    return cost, si_backward(program)


def planned_pairs(program: Program) -> SegmentPlan:
    """The planner's SI plan of ``program``'s layer pair as its schedule runs it (without
    the wgrads when W is split off), in the form the executor runs. Needs the program's
    hardware profile; raises the planner's DhelixError otherwise."""
    return tuple((tuple(pair.forward), tuple(pair.backward)) for pair in schedule_plan(program).pairs)


def block_orders(program: Program) -> dict[tuple[int, int], tuple]:
    """The block order for every (forward layers, backward layers) an SI block of the
    program can have: what every rank of a run must follow alike."""
    scheduler = block_scheduler(program)
    counts = sorted({len(stage.layers) for stage in program.placement.stages})
    return {(nf, nb): scheduler(nf, nb).order for nf in counts for nb in counts}
