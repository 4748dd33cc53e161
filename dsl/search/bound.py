"""Lower bounds of a layout's step time and peak memory, from its layer DAGs alone.

They let the search skip a layout without lowering, planning or simulating any of its
schedules, and stay exact: a layout is skipped only when its bound is no better than the
K-th best step already priced (or its memory bound exceeds the device), and every schedule
of it would then be no better either.

**Time.** Whatever the schedule, every micro-batch runs every layer's forward and backward
once, and a rank's compute lane runs one op at a time: an SI layer pair costs the plan's
make-span, at least the compute of both strands' layers run alone; a forward or backward run
alone costs at least its compute. More generally, each of the three lanes (compute, local and
cross-node communication) runs one task at a time, at most at full speed, so a layer's
forward and backward take at least the busiest lane's work, whether paired or alone
(:meth:`~dhelix.dsl.planner.paircost.PairCost.lane_work`). Recomputation adds its forward work again before each
backward; the embedding and the LM head run alone, once per micro-batch. So the busiest
pipeline rank is busy at least the average over the ``pp`` ranks of all this work, and the
step (which ends after the busiest rank's last action) is at least that, plus the average
rank's optimizer step, which runs after its last action.

**Memory.** Each rank holds the model states of its layers (and the model's ends); the
busiest rank holds at least the average over the pipeline ranks (the states are linear in
the parameters held). And whatever the schedule, a micro-batch's backward starts only once
its forward has passed the last stage, so every rank at some moment holds what each of its
layers keeps of one micro-batch (after recomputation's drops): its ``layers / pp`` layers'
activations come on top of its states.
"""

from __future__ import annotations

import attrs

from dhelix.dsl.core.program import Program
from dhelix.dsl.planner.costmodel import optimizer_time
from dhelix.dsl.simulator.costs import NOTHING, StepCosts, Work, layer_costs, si_backward, step_costs
from dhelix.dsl.simulator.memory import layer_activations, model_states, recomputed, selectively_recomputed
from dhelix.dsl.planner.paircost import PairCost


@attrs.frozen
class Bound:
    """Lower bounds of any schedule of a layout: step seconds and peak bytes per GPU."""

    seconds: float
    memory: float


def layout_bound(program: Program, cost: PairCost, costs: StepCosts | None = None) -> Bound:
    """The bounds of the layout of ``program`` (checked up to autodiff: its layer DAGs, mesh
    and train block) priced by ``cost``; ``costs``: its step costs without a plan, when
    already computed."""
    costs = costs or step_costs(program, None, cost)
    train, mesh = program.train, program.mesh
    layers, m, pp = program.model.get("layers"), train.microbatches, mesh.size("pp")
    layer = max(cost.lane_work(program.forward.ops + program.backward.ops)) + costs.layer.again.seconds
    heads = costs.heads
    ends = sum(w.seconds for w in (heads.embed_forward, heads.embed_backward, heads.head_forward,
                                   heads.head_backward, heads.head_weight))
    return Bound((layers * m * layer + m * ends) / pp + _optimizer(program, costs),
                 _states(program, costs) + layers / pp * _kept(program))


def _kept(program: Program) -> float:
    """Bytes one layer keeps for one micro-batch from its forward to its backward (after
    recomputation's drops), as the simulator counts them."""
    forward, backward, dtype = program.forward, program.backward, program.model.dtype
    acts = layer_activations(forward, backward, dtype, split=False)
    recompute = program.train.recompute
    if recompute == "full":
        return recomputed(acts, forward, dtype)[0].total
    if recompute == "selective":
        return selectively_recomputed(acts, forward, backward, dtype, split=False)[0].total
    return acts.total


def _held(program: Program, costs: StepCosts) -> tuple[float, float]:
    """(dense, expert) parameters the average pipeline rank holds."""
    params, pp = costs.params, program.mesh.size("pp")
    layers = program.model.get("layers")
    return (layers * params.layer_dense + params.embedding + params.head) / pp, layers * params.layer_expert / pp


def _optimizer(program: Program, costs: StepCosts) -> float:
    """Seconds of the average rank's optimizer step, which runs after its last action."""
    dense, expert = _held(program, costs)
    if program.train.zero >= 1:
        dense, expert = dense / costs.dense_group.size, expert / costs.expert_group.size
    return optimizer_time(dense + expert, costs.dtype, program.profile)


def _states(program: Program, costs: StepCosts) -> float:
    """Model-state bytes of the average pipeline rank (a lower bound of the busiest one's)."""
    params, pp = costs.params, program.mesh.size("pp")
    layers = program.model.get("layers")
    dense, expert = _held(program, costs)
    train = program.train
    fsdp = train.zero == 3
    states = model_states(dense, expert, costs.dtype, zero1=train.zero >= 1, dense_group=costs.dense_group.size,
                          expert_group=costs.expert_group.size,
                          fsdp_dense=layers * params.layer_dense / pp if fsdp else 0.0,
                          fsdp_group=costs.shard_group.size if fsdp and costs.shard_group else 0,
                          grads_sharded=(layers * params.layer_dense + params.head) / pp if train.zero == 2 else 0.0)
    return states.total


def relaxed_costs(program: Program, cost: PairCost, layers: bool = False, costs: StepCosts | None = None
                  ) -> StepCosts:
    """The program's step costs with every SI layer pair at a lower bound of its plan: the
    busiest lane's work of the two layers (:meth:`PairCost.lane_work`), after what the
    backward runs again. Simulated, they give a lower bound of the step with any plan (the
    simulator only delays an action for a longer one before it). With ``layers``, every
    layer pass alone and what it runs again is at its busiest lane's work too: a lower bound
    of the step whatever chunk counts and substitutions the planner then chooses, none of
    which lessens a lane's work (:mod:`dhelix.dsl.search.partitions`). ``costs``: the
    program's step costs without a plan, when already computed."""
    costs = costs or step_costs(program, None, cost)
    layer = layer_costs(program, cost, None, work=_lane_bound) if layers else costs.layer
    pair = layer.again + Work(max(cost.lane_work(program.forward.ops + si_backward(program).ops)))
    return attrs.evolve(costs, layer=attrs.evolve(layer, pair=pair))


def _lane_bound(cost: PairCost, ops) -> Work:
    """The busiest lane's work of ``ops``: a lower bound of running them, in any pieces."""
    ops = tuple(ops)
    return Work(max(cost.lane_work(ops))) if ops else NOTHING
