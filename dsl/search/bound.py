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
(:meth:`~dhelix.dsl.planner.paircost.PairCost.lane_work`). Recomputation adds its forward
work again before each backward that recomputes (with ``recompute_layers = N``, those of the
first N layers of each model chunk: at least ``min(p·N, layers)`` of them, whatever the fold);
the embedding and the LM head run alone, once per micro-batch. So the busiest pipeline rank
is busy at least the average over the ``pp`` ranks of all this work, and the step (which ends
after the busiest rank's last action) is at least that, plus the average rank's optimizer
step (on the device, or offloaded: its copies and the host's step), which runs after its last action. A rank's gradient reductions too
run one after another before its optimizer (every layer's once a step, under ZeRO-2 once per
micro-batch): the step is at least the average rank's reductions, plus its optimizer.
A schedule that pairs no layers (no SI block, or SI off) runs every layer pass alone, as the
simulator prices it (its ops' make-span run alone; a backward split in two, at least the
lesser of the whole one's time and the two's sum): its bound takes those times instead of the
busiest lane's work (not where a partition block leaves chunk counts or substitutions to choose, which can
make a pass alone faster).

**Memory.** Each rank holds the model states of its layers (and the model's ends); the
busiest rank holds at least the average over the pipeline ranks (the states are linear in
the parameters held). And whatever the schedule, a micro-batch's backward starts only once
its forward has passed the last stage, so every rank at some moment holds what each of its
layers keeps of one micro-batch (after recomputation's drops, in the layers that recompute:
with ``recompute_layers`` as if every layer did: a fold of more chunks recomputes more):
the average rank's share of the model's layers' activations comes on top of its states.
"""

from __future__ import annotations

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.program import Program
from dhelix.dsl.passes.fsdp import is_fsdp, replicas_substituted
from dhelix.dsl.simulator.costs import (NOTHING, LayerCosts, StepCosts, Work, gradient_syncs, layer_costs, offloads,
                                        optimizer_seconds, si_backward, step_costs)
from dhelix.dsl.simulator.memory import layer_activations, model_states, recomputed, selectively_recomputed
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.planner.segment_bound import SegmentBound


@attrs.frozen
class Bound:
    """Lower bounds of any schedule of a layout: step seconds and peak bytes per GPU."""

    seconds: float
    memory: float
    #: A lower bound of the schedules that pair no layers (no SI block, or SI off): seconds.
    alone: float
    #: Why the strands pass refuses the layout's programs (its strands block names no op of
    #: their layer DAGs: every schedule that its fold's stage split leaves is refused so),
    #: None when it does not (:mod:`~dhelix.dsl.search.prefilter`).
    strands: str | None = None
    #: The parts before the optimizer's step (:func:`with_optimizer` adds it): of
    #: :attr:`seconds` and of :attr:`alone` (None: as :attr:`seconds`), and the bytes of
    #: activations that come on top of the model states in :attr:`memory`.
    work: float = 0.0
    alone_work: float | None = None
    activations: float = 0.0


def layout_bound(program: Program, cost: PairCost, costs: StepCosts | None = None) -> Bound:
    """The bounds of the layout of ``program`` (checked up to autodiff: its layer DAGs, mesh
    and train block) priced by ``cost``; ``costs``: its step costs without a plan, when
    already computed."""
    costs = costs or step_costs(program, None, cost)
    train, mesh = program.train, program.mesh
    assert program.model is not None and mesh is not None and train is not None and program.forward is not None \
        and program.backward is not None, "a checked model"
    layers, m, pp = program.model.setting("layers"), train.microbatches, mesh.size("pp")
    again = _recomputing(program)[0] * costs.layer.again.seconds  # per micro-batch, over the model
    layer = max(cost.lane_work(program.forward.ops + program.backward.ops))
    heads = costs.heads
    ends = sum(w.seconds for w in (heads.embed_forward, heads.embed_backward, heads.head_forward,
                                   heads.head_backward, heads.head_weight))
    compute = (layers * m * layer + m * again + m * ends) / pp
    reductions = _reductions(program, costs)
    alone = None
    if program.partition is None:  # (chunks the planner chooses may make a pass alone faster)
        passes = costs.layer.forward.seconds + min(costs.layer.backward.seconds,
                                                   costs.layer.backward_input.seconds + costs.layer.weight.seconds)
        alone = max((layers * m * passes + m * again + m * ends) / pp, reductions)
    parts = Bound(0.0, 0.0, 0.0, work=max(compute, reductions), alone_work=alone, activations=_kept(program) / pp)
    return with_optimizer(parts, program, program, costs)


def with_optimizer(bound: Bound, timed: Program, held: Program, costs: StepCosts) -> Bound:
    """``bound`` (its parts before the optimizer: :attr:`Bound.work`, …) with the optimizer's
    step of ``timed`` added to its times and the model states of ``held`` to its memory: the
    two are the layout's program, or where a choice's share offloaded is not chosen yet
    (:mod:`~dhelix.dsl.search.offload`), that program offloading the fastest of the shares
    whose memory bound fits the device (times) and its largest share (memory: the least). ``costs``: their step costs without a plan."""
    optimizer = _optimizer(timed, costs)
    seconds = bound.work + optimizer
    alone = seconds if bound.alone_work is None else max(seconds, bound.alone_work + optimizer)
    return attrs.evolve(bound, seconds=seconds, memory=held_memory(bound, held, costs), alone=alone)


def held_memory(bound: Bound, held: Program, costs: StepCosts) -> float:
    """The memory bound of :func:`with_optimizer` (``bound``'s activations and the model
    states of ``held``) alone."""
    return _states(held, costs) + bound.activations


def _recomputing(program: Program) -> tuple[int, int]:
    """The fewest and the most of the model's layers that recompute before their backward,
    whatever the fold: all of them as ``recompute`` says (none for none); with
    ``recompute_layers = N`` the first N of each of the p·v model chunks, at least
    ``min(p·N, layers)`` (one chunk per rank, the fewest: ``min(p·v·N, layers)`` grows with v;
    0 where the train block sets the first or last stage's layers) and at most every layer (a
    fold of more chunks recomputes more)."""
    assert program.model is not None and program.mesh is not None and program.train is not None, "a checked model"
    train, layers = program.train, program.model.setting("layers")
    if train.recompute_layers is None or train.recompute == "none":
        every = train.recomputed_of(layers)
        return every, every
    if train.stage_ends != (None, None):  # an end stage may hold fewer than N: none counted
        return 0, layers
    return min(program.mesh.size("pp") * train.recompute_layers, layers), layers


def _reductions(program: Program, costs: StepCosts) -> float:
    """Seconds of the average pipeline rank's layer gradient reductions (every layer's once a
    step, under ZeRO-2 once per micro-batch), which run one after another before its
    optimizer whatever the schedule (:meth:`~dhelix.dsl.simulator.events._Run.floor`)."""
    assert program.model is not None and program.mesh is not None and program.train is not None, "a checked model"
    train, params = program.train, costs.params
    seconds = sum(sync[3] for sync in gradient_syncs(costs, program.profile, 0, params.layer_dense,
                                                     params.layer_expert, zero1=train.zero >= 1,
                                                     fsdp=is_fsdp(program),
                                                     replicas_sliced=replicas_substituted(program)))
    per_step = train.microbatches if train.zero == 2 else 1
    return program.model.setting("layers") * per_step * seconds / program.mesh.size("pp")


def _kept(program: Program) -> float:
    """Bytes the model's layers keep for one micro-batch from their forward to their
    backward (after recomputation's drops, in the layers that recompute), as the simulator
    counts them."""
    assert program.model is not None and program.mesh is not None and program.train is not None, "a checked model"
    assert program.forward is not None and program.backward is not None, "a checked model"
    forward, backward, dtype = program.forward, program.backward, program.model.dtype
    acts = layer_activations(forward, backward, dtype, split=False)
    layers, recompute = program.model.setting("layers"), program.train.recompute
    again = _recomputing(program)[1]  # the most: the fewest bytes kept
    if recompute == "full":
        return again * recomputed(acts, forward, dtype)[0].total + (layers - again) * acts.total
    if recompute == "selective":
        return layers * selectively_recomputed(acts, forward, backward, dtype, split=False)[0].total
    return layers * acts.total


def _held(program: Program, costs: StepCosts) -> tuple[float, float]:
    """(dense, expert) parameters the average pipeline rank holds."""
    assert program.model is not None and program.mesh is not None and program.train is not None, "a checked model"
    params, pp = costs.params, program.mesh.size("pp")
    layers = program.model.setting("layers")
    return (layers * params.layer_dense + params.embedding + params.head) / pp, layers * params.layer_expert / pp


def _optimizer(program: Program, costs: StepCosts) -> float:
    """Seconds of the average rank's optimizer step, which runs after its last action."""
    dense, expert = _held(program, costs)
    assert program.train is not None, "a checked model"
    if program.train.zero >= 1:
        dense, expert = dense / costs.dense_group.size, expert / costs.expert_group.size
    return optimizer_seconds(program, dense + expert, costs.dtype)


def _states(program: Program, costs: StepCosts) -> float:
    """Model-state bytes of the average pipeline rank (a lower bound of the busiest one's)."""
    assert program.model is not None and program.mesh is not None and program.train is not None, "a checked model"
    params, pp = costs.params, program.mesh.size("pp")
    layers = program.model.setting("layers")
    dense, expert = _held(program, costs)
    train = program.train
    fsdp = train.zero == 3
    if fsdp:  # ZeRO-3 runs with ep = 1: the experts are sharded as the layers' other weights
        dense, expert = dense + expert, 0.0
    states = model_states(dense, expert, costs.dtype, zero1=train.zero >= 1, dense_group=costs.dense_group.size,
                          expert_group=costs.expert_group.size,
                          fsdp_dense=layers * (params.layer_dense + params.layer_expert) / pp if fsdp else 0.0,
                          fsdp_group=costs.shard_group.size if fsdp and costs.shard_group else 0,
                          grads_sharded=(layers * params.layer_dense + params.head) / pp if train.zero == 2 else 0.0,
                          expert_grads_sharded=train.zero == 2, offload=offloads(program))
    return states.total


def relaxed_costs(program: Program, cost: PairCost, layers: bool = False, costs: StepCosts | None = None
                  ) -> StepCosts:
    """The program's step costs with every SI layer pair at a lower bound of its plan: the
    two layers' busiest lane, every two lanes' work less what their tasks' OEFs let them
    save side by side (:class:`~dhelix.dsl.planner.segment_bound.OverlapBound`), and either
    strand's longest path (:func:`chained_path`), after what the backward runs again.
    Simulated, they give a lower bound of the step with any plan (the simulator only delays
    an action for a longer one before it). With ``layers``, every layer pass alone and what
    it runs again is at such a bound too (:func:`pass_bound`): a lower bound of the step
    whatever chunk counts and substitutions the planner then chooses, none of which lessens
    a lane's work (:mod:`dhelix.dsl.search.partitions`); the pair's OEF term is left out
    then where a substitution is still to choose. ``costs``: the program's step costs
    without a plan, when already computed."""
    costs = costs or step_costs(program, None, cost)
    return attrs.evolve(costs, layer=relaxed_layer(program, cost, costs.layer, layers))


def relaxed_layer(program: Program, cost: PairCost, layer: LayerCosts, layers: bool = False) -> LayerCosts:
    """The layer part of :func:`relaxed_costs` (``layer``: the program's layer costs without a
    plan): what it reads of ``program`` is its layer DAGs, whether its schedule splits W off,
    its recomputation and its partition block, so a search works it out once for the
    programs that share them."""
    chains = chain_groups(program)

    def bound(cost: PairCost, ops) -> Work:
        return pass_bound(cost, ops, chains)
    layer = layer_costs(program, cost, None, work=bound) if layers else layer
    assert program.forward is not None, "a checked model"
    forward, backward = program.forward.ops, si_backward(program).ops
    pair = max(cost.lane_work(forward + backward))
    fwd, bwd = _lanes_bound(cost, forward), _lanes_bound(cost, backward)
    # Two strands' tasks overlap by OEFs the profile may set per collective: a substitution
    # still to choose could bring a collective whose OEF is higher (one strand's tasks
    # overlap by their lanes' classes alone, which a substitution keeps).
    if fwd is not None and bwd is not None and not (layers and _substitutes(program)):
        pair = max(pair, fwd.pair(bwd) - fwd.launch_gap.seconds(fwd.comm + bwd.comm))
    pair = max(pair, chained_path(cost, forward, chains), chained_path(cost, backward, chains))
    return attrs.evolve(layer, pair=Work(pair))


def _substitutes(program: Program) -> bool:
    """Whether ``program``'s partition block substitutes a collective."""
    block = program.partition
    return block is not None and any(isinstance(st, s.Substitute) for st in block.body)


def chain_groups(program: Program) -> dict[str, int]:
    """The chunk chains of ``program``'s partition block: each chained forward op's name →
    its chain's index (the ops a backward op derives from say its chain)."""
    block = program.partition
    statements = [st for st in block.body if isinstance(st, s.Chunk)] if block is not None else []
    return {name: index for index, st in enumerate(statements) for name in st.ops}


def pass_bound(cost: PairCost, ops, chains: dict[str, int]) -> Work:
    """A lower bound of running ``ops`` (one layer pass, alone) whatever chunk counts its
    chains (:func:`chain_groups`) take: the busiest lane's work, every two lanes' work less
    what their tasks' OEFs let them save run side by side (:class:`OverlapBound`), and the
    longest path through the ops' dependencies (:func:`chained_path`)."""
    ops = tuple(ops)
    if not ops:
        return NOTHING
    return Work(max(_alone(cost, ops), chained_path(cost, ops, chains)))


def _alone(cost: PairCost, ops: tuple) -> float:
    """A lower bound of running ``ops`` in any order and pieces: :func:`_lanes_bound`'s."""
    lanes = _lanes_bound(cost, ops)
    return lanes.solo() if lanes is not None else max(cost.lane_work(ops))


def _lanes_bound(cost: PairCost, ops) -> SegmentBound | None:
    """The segment bound of ``ops`` without its path (:meth:`PairCost.segment_bound` takes
    it in the ops' issue order, which chunks and the planner's priority change): their lanes'
    work, less what the OEFs of its tasks let two lanes save (:class:`OverlapBound`)."""
    found = cost.segment_bound(tuple(ops))
    return None if found is None else attrs.evolve(found, path=0.0)


def chained_path(cost: PairCost, ops, chains: dict[str, int]) -> float:
    """The longest path through the dependencies of ``ops`` (in topological order), each op
    at what running it alone takes at least (:func:`_alone`), whatever chunk counts the
    ``chains`` take (their ops are checked whole here): a lower bound of any run of them,
    alone or beside another strand.

    An op outside the chains starts once every op it reads is done. A chain's op runs in
    pieces (the chunks), each reading a piece of the chain's op before it (or the whole of
    an op outside it) and none shorter in sum than the whole op (a GEMM reads its weight
    once per chunk, a collective pays its latency per chunk). So no piece of a chain's op
    ``g`` starts before ``entry(g)`` — every op outside the chain it reads done (or, for an
    op of another chain, started) — nor does any piece of the chain's ops that ``g``
    reaches through the chain; a chain's op ``o`` is done at the earliest ``entry(g)`` plus
    what running the chain's ops on the way from ``g`` to ``o`` alone takes at least (their
    busiest lane, less than two lanes' work only by what their OEFs save: other tasks
    running beside them only slow them more), for every ``g`` before it. A backward op
    belongs to the chain of the forward op it derives from."""
    ops = tuple(ops)
    index = {op.name: i for i, op in enumerate(ops)}
    # A chunk already cut (``origin`` set) is an op of its own; a group partition's stage of
    # a chained collective (``ag1.inter``), or its backward, is cut with the chain.
    group = {op.name: None if op.origin else chains.get((op.forward or op.name).split(".")[0]) for op in ops}
    start: dict[str, float] = {}  # no piece of the op starts earlier
    finish: dict[str, float] = {}  # every piece of the op is done no earlier
    entry: dict[str, float] = {}
    reach: dict[str, set[str]] = {}  # a chain's op: the chain's ops before it that reach it, itself too
    for op in ops:
        name, chain = op.name, group[op.name]
        preds = [p for p in dict.fromkeys(op.deps) if p in index]
        if chain is None:
            start[name] = max((finish[p] for p in preds), default=0.0)
            finish[name] = start[name] + _alone(cost, (op,))
            continue
        inner = [p for p in preds if group[p] == chain]
        entry[name] = max((finish[p] if group[p] is None else start[p] for p in preds if group[p] != chain),
                          default=0.0)
        start[name] = max([entry[name]] + [start[p] for p in inner])
        reach[name] = {name}.union(*(reach[p] for p in inner))
        done = max((finish[p] for p in inner), default=0.0)
        for source in reach[name]:
            between = tuple(ops[i] for i in sorted(index[other] for other in reach[name] if source in reach[other]))
            done = max(done, entry[source] + _alone(cost, between))
        finish[name] = done
    return max(finish.values(), default=0.0)
