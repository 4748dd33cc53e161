"""What each piece of one training step costs: the inputs of the step simulator.

Everything here is per GPU, for one representative TP rank of each pipeline rank (all TP ranks
of a group run the same operators on equal shards, and every DP replica runs the same
timeline), in seconds of the program's hardware profile:

* **Layers.** One layer's forward, backward (dgrad + wgrad), input-gradient backward (all but
  the wgrads: B of a split schedule) and weight gradient (the wgrads: W) each cost the
  make-span of its ops run alone (:meth:`PairCost.solo`, the single-strand time the planner
  compares SI against; a strand's own independent comm and compute may overlap, as in the
  paper's single-strand baseline). An SI layer pair costs the plan's ``total``.
* **Layer communication** of each piece: its comm time (solo times of its comm ops) and the
  part of it exposed, as :mod:`dsl.core.plan` defines for a plan:
  ``exposed = clamp(time - compute_time, 0, comm_time)``.
* **Embedding and LM head** (untied, vocab-parallel over tp, as in Megatron and Llama 3), on
  the first and the last stage. The LM head gathers the sequence-parallel hidden state over
  tp, runs a ``[T, h] x [h, V/tp]`` GEMM (``2·T·h·V/tp`` FLOPs; dgrad and wgrad the same) and
  a vocab-parallel cross-entropy in fp32 (memory-bound: reads the logits, writes and reads an
  fp32 softmax; backward reads it and writes the logit gradient; three tiny all-reduces over
  tp). The embedding writes its ``[T, h]`` partial lookup and reduce-scatters it over tp;
  its backward gathers the gradient and scatter-adds it. These run alone, never paired. A
  profile measured by `dhelix profile` times them (``embedding``, ``lm_head`` and their
  ``.bwd`` in ``measured.ops``); those times replace the model's.
* **Activation recomputation** (``train { recompute = full }``): every layer's backward, and
  every SI layer pair, first runs the layer's forward again, alone (its collectives included);
  with ``selective`` only the forward ops whose outputs it dropped
  (:func:`~dhelix.dsl.core.oplib.selective_drops`: norms, activations, adds); under ZeRO-3
  the rebuilt norms wait for the backward's re-gathers of their weights, so ``again`` is what
  the rebuild adds to the backward run with it (:func:`rebuild_ops`; a search's bound of it
  is 0). With
  ``recompute_layers = N`` only the first N layers of each model chunk do; the pieces
  (:mod:`dsl.simulator.pieces`) add ``again`` layer by layer.
* **Pipeline P2P**: ``micro_batch·(seq/cp)·hidden/tp`` elements of the model dtype per
  micro-batch and stage boundary (NOTES §3.5): the layer input's bytes, on the pp group's lane.
* **Data parallel**: each stage's gradients (model dtype) are reduced over the DP×CP group
  (expert weights over DP×CP/EP) on that group's lane; the optimizer is a memory-bound AdamW
  over the local parameters (a shard of them with ZeRO-1): :func:`~dhelix.dsl.planner.costmodel.optimizer_time`.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import attrs

from dhelix.dsl.core.dtypes import dtype_bytes, tensor_dtype
from dhelix.dsl.core.options import option
from dhelix.dsl.core.mesh import REPLICATE, SHARD, ranks_per_node
from dhelix.dsl.core.oplib import END_OPS, in_weight_pass, selective_drops
from dhelix.dsl.passes.fsdp import BACKWARD_GATHER, GATHER, unit_of
from dhelix.dsl.planner.costmodel import collective_time, op_time, step_optimizer_time
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.program import LayerDag, Op, Program

@attrs.frozen
class Work:
    """One piece of work: seconds, and its layer communication (total and exposed seconds)."""

    seconds: float
    comm: float = 0.0
    exposed: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.seconds + other.seconds, self.comm + other.comm, self.exposed + other.exposed)


NOTHING = Work(0.0)


@attrs.frozen
class LayerCosts:
    """The per-layer work of one micro-batch (see the module docstring)."""

    forward: Work
    #: The backward, and B of a split backward, without what a recomputing layer runs first
    #: (``again``, which :meth:`backward_of` and :meth:`backward_input_of` add).
    backward: Work
    backward_input: Work
    weight: Work
    pair: Work | None  # one SI layer pair, from the plan (None without a plan), without ``again``
    #: What a backward layer that recomputes runs again first (NOTHING without recomputation);
    #: which layers recompute is the train block's (:meth:`~dhelix.dsl.core.program.Train.recomputes`).
    again: Work = NOTHING
    #: SI blocks priced whole by the block scheduler, a callable of (forward layers,
    #: backward layers) giving a :class:`~dhelix.dsl.planner.blockorder.BlockSchedule`
    #: (a BlockScheduler); None: pair by pair with ``pair``.
    block: Callable | None = None

    def again_of(self, recomputes: bool) -> Work:
        """What a backward layer runs again first: ``again`` when it ``recomputes``, else nothing."""
        return self.again if recomputes else NOTHING

    def backward_of(self, recomputes: bool) -> Work:
        """A whole layer backward (dgrad and wgrad), its recomputation first when it ``recomputes``."""
        return self.again_of(recomputes) + self.backward

    def backward_input_of(self, recomputes: bool) -> Work:
        """B of a split layer backward, its recomputation first when it ``recomputes``."""
        return self.again_of(recomputes) + self.backward_input


@attrs.frozen
class HeadCosts:
    """Embedding (first stage) and LM head (last stage) work of one micro-batch."""

    embed_forward: Work = NOTHING
    embed_backward: Work = NOTHING
    head_forward: Work = NOTHING
    head_backward: Work = NOTHING  # cross-entropy, LM head dgrad, final norm backward
    head_weight: Work = NOTHING  # the LM head wgrad (part of B unless the schedule splits)


@attrs.frozen
class Params:
    """Parameters held per GPU: dense and expert elements of one layer and of the extras."""

    layer_dense: int
    layer_expert: int
    embedding: int
    head: int  # LM head and final norm


@attrs.frozen
class Group:
    """A communication group of the step: its size, lane and ranks on each node it spans."""

    size: int
    lane: str
    per_node: int = 1


@attrs.frozen
class StepCosts:
    """Everything the simulator charges for, built by :func:`step_costs`."""

    layer: LayerCosts
    heads: HeadCosts
    params: Params
    p2p_seconds: float
    p2p_bytes: float
    pp_lane: str
    dense_group: Group  # gradient sync of dense weights (DP x CP)
    expert_group: Group  # gradient sync of expert weights (DP x CP / EP)
    grad_bytes: int  # bytes per element of a gradient data parallelism reduces (train { grad_reduce_dtype })
    weight_bytes: int  # bytes per element of a weight as a ZeRO-1 gather sends it: the model dtype's
    #: (fp8: in fp8, as Megatron-LM's fp8 param gather keeps and gathers them [assumed for its fp8 runs])
    dtype: str
    #: Hybrid sharding (HSDP): the ZeRO-3 shard group of the layers' weights and the group
    #: their pieces' gradients are all-reduced over (None without).
    shard_group: Group | None = None
    replicate_group: Group | None = None


def input_backward(backward: LayerDag) -> LayerDag:
    """The backward DAG without its weight-gradient ops: what B runs when W is split off."""
    return attrs.evolve(backward, ops=tuple(op for op in backward.ops if not in_weight_pass(op)))


def si_backward(program: Program) -> LayerDag:
    """The backward DAG an SI block of ``program`` runs: without its wgrads when the schedule
    splits W off (then W runs them on its own)."""
    assert program.backward is not None, "a checked model"
    if program.lowered is not None and program.lowered.split:
        return input_backward(program.backward)
    return program.backward


def cost_of(program: Program) -> PairCost:
    """The PairCost of a checked program with a profile (the caller checks that it has one)."""
    assert program.model is not None, "a checked model"
    return PairCost(program.profile, program.model.dtype, seq=program.model.get("seq"))


def solo_work(cost: PairCost, ops) -> Work:
    """The Work of ``ops`` run alone: their make-span, comm time and exposed comm."""
    ops = tuple(ops)
    if not ops:
        return NOTHING
    seconds = cost.solo(ops)
    compute = [op for op in ops if op.kind == "compute"]
    compute_time = cost.solo(tuple(compute)) if compute else 0.0
    comm = sum(cost.solo((op,)) for op in ops if op.kind == "comm")
    return Work(seconds, comm, min(max(seconds - compute_time, 0.0), comm))


def plan_work(plan: Plan) -> Work:
    """The Work of one SI layer pair run by ``plan``."""
    return Work(plan.total, plan.comm_time, plan.comm_exposed)


def layer_costs(program: Program, cost: PairCost, plan: Plan | None, work=None) -> LayerCosts:
    """Per-layer Works of ``program``'s layer; ``plan`` prices SI layer pairs; ``work(cost,
    ops)`` prices a run of ops (default :func:`solo_work`; a search passes a lower bound)."""
    bound = work is not None
    work = work or solo_work
    forward, backward = program.forward, program.backward
    assert forward is not None and backward is not None, "a checked model"
    fwd = work(cost, forward.ops)
    backward_work = work(cost, backward.ops)
    # Full recomputation runs the layer's forward again, alone, before its backward (in an SI
    # pair too: the backward strand's first op needs what it rebuilds).
    recompute = program.train.recompute if program.train is not None else "none"
    again = fwd if recompute == "full" else NOTHING
    if recompute == "selective":
        rebuilt = rebuild_ops(forward, backward)
        if not any(op.waits for op in rebuilt):
            again = work(cost, rebuilt)
        elif not bound:  # (what it adds may be nothing: a bound of it is 0)
            again = _added(backward_work, solo_work(cost, _with_rebuild(backward.ops, rebuilt)))
    return LayerCosts(
        forward=fwd, backward=backward_work,
        backward_input=work(cost, (op for op in backward.ops if not in_weight_pass(op))),
        weight=work(cost, (op for op in backward.ops if in_weight_pass(op))),
        pair=plan_work(plan) if plan is not None else None, again=again)


def rebuild_ops(forward: LayerDag, backward: LayerDag) -> list[Op]:
    """The forward ops selective recomputation runs again before a layer's backward reads
    their outputs (:func:`~dhelix.dsl.core.oplib.selective_drops`); under ZeRO-3 each
    weighted one (a norm) waits for the backward's re-gather of its weight instead of the
    forward's gather (:mod:`dhelix.dsl.passes.fsdp`: the forward's gathered weights are gone)."""
    dropped = set(selective_drops(forward.ops, backward.ops))
    regathered = {unit_of(op.params) for op in backward.ops if op.op == GATHER}
    return [attrs.evolve(op, waits=(op.weight_unit + BACKWARD_GATHER,))
            if op.weight and op.weight_unit in regathered else op
            for op in forward.ops if op.name in dropped]


def _with_rebuild(backward: list | tuple, rebuilt: list[Op]) -> list[Op]:
    """The backward ops with ``rebuilt`` after its leading re-gathers (the norms' first):
    under ZeRO-3 the rebuild computes while the other weights are still arriving, as FSDP
    gathers them ahead of the compute that reads them."""
    lead = next((i for i, op in enumerate(backward) if op.op != GATHER), len(backward))
    return [*backward[:lead], *rebuilt, *backward[lead:]]


def _added(before: Work, after: Work) -> Work:
    """What ``after`` adds to ``before``, each part at least 0."""
    return Work(max(0.0, after.seconds - before.seconds), max(0.0, after.comm - before.comm),
                max(0.0, after.exposed - before.exposed))


def step_costs(program: Program, plan: Plan | None, cost: PairCost | None = None,
               layer: LayerCosts | None = None) -> StepCosts:
    """The :class:`StepCosts` of a validated program with a profile; ``plan`` prices its SI
    blocks (None when it has none, or to run them one after the other); ``layer``: its
    :func:`layer_costs` with ``plan``, when already computed (a search shares them between
    the programs whose layer DAGs and recomputation are one)."""
    cost = cost or cost_of(program)
    mesh, model = program.mesh, program.model
    assert mesh is not None and model is not None and program.forward is not None, "a checked model"
    dtype = model.dtype
    p2p_bytes = float(math.prod(program.forward.input_shape) * dtype_bytes(tensor_dtype(dtype, gemm=False)))
    pp_lane = mesh.lane("pp") if mesh.size("pp") > 1 else "local"
    p2p_seconds = collective_time("p2p", p2p_bytes, 2, pp_lane, program.profile)
    return StepCosts(
        layer=layer or layer_costs(program, cost, plan), heads=head_costs(program),
        params=layer_params(program), p2p_seconds=p2p_seconds, p2p_bytes=p2p_bytes, pp_lane=pp_lane,
        dense_group=_sync_group(mesh, expert=1), expert_group=_sync_group(mesh, expert=mesh.size("ep")),
        grad_bytes=dtype_bytes(grad_reduce_dtype(program)), weight_bytes=dtype_bytes(dtype), dtype=dtype,
        shard_group=_sub_group(mesh, f"dp.{SHARD}") if mesh.dp_shard else None,
        replicate_group=_sub_group(mesh, f"dp.{REPLICATE}") if mesh.dp_shard else None)


def offloads(program: Program) -> int:
    """The percent of ``program``'s optimizer states in host memory (``train { offload =
    optimizer  offload_percent = P }``; 0: none)."""
    return program.train.offload_share if program.train is not None else 0


def optimizer_seconds(program: Program, params: float, dtype: str) -> float:
    """Seconds of the optimizer step over ``params`` local parameters of ``program``: AdamW on
    the device, or offloaded, the gradients' copy to the host, AdamW there and the weights'
    copy back (:func:`~dhelix.dsl.planner.costmodel.offload_time`; a profile without a host
    section is an error located at the train block's ``offload``). With ``offload_percent``
    below 100 the rest of the parameters are updated on the device while the host computes
    (the ranks launch that update before they wait for the gradients' copy)."""
    span = program.train.offload_span if program.train is not None else None
    return step_optimizer_time(params, dtype, program.profile, offloads(program), span)


def grad_reduce_dtype(program: Program) -> str:
    """The dtype data parallelism reduces ``program``'s gradients in: the train block's
    ``grad_reduce_dtype``, else its default (the fp32 main gradients as accumulated)."""
    written = program.train.setting("grad_reduce_dtype") if program.train is not None else None
    return written if written is not None else option("grad_reduce_dtype").default


def layer_params(program: Program) -> Params:
    """Parameters per GPU: each layer's dense and expert (grouped GEMM) weights from the
    forward DAG's ``weight`` shapes, the embedding and the LM head (``V·h/tp`` each, untied)
    and the final norm (``h``)."""
    assert program.forward is not None and program.model is not None and program.mesh is not None, "a checked model"
    dense, expert = program.forward.weight_elements()
    vocab, hidden = program.model.get("vocab") or 0, program.model.get("hidden") or 0
    shard = vocab * hidden // program.mesh.size("tp")
    return Params(dense, expert, shard, shard + hidden)


@functools.cache
def _sync_group(mesh, expert: int) -> Group:
    """The gradient-sync group of rank 0: DP coordinates ``0, e, 2e, …`` (``e`` the EP size
    for expert weights, else 1) times every CP coordinate; local when on one node. Once per
    mesh (its members are up to the world's ranks; a search asks for every layout's)."""
    size = max(1, mesh.size("dp") * mesh.size("cp") // expert)
    if size <= 1:
        return Group(size, "local")
    dp_stride, cp_stride = mesh.stride("dp"), mesh.stride("cp")
    members = {k * expert * dp_stride + c * cp_stride
               for k in range(max(1, mesh.size("dp") // expert)) for c in range(mesh.size("cp"))}
    if len({rank // mesh.gpus_per_node for rank in members}) == 1:
        return Group(size, "local")
    return Group(size, "cross", ranks_per_node(members, mesh.gpus_per_node))


def _sub_group(mesh, axis: str) -> Group:
    """The Group of rank 0 on sub-axis ``axis`` of ``mesh``."""
    return Group(mesh.size(axis), mesh.lane(axis), mesh.per_node(axis))


# ---------------------------------------------------------------- embedding and LM head

def head_costs(program: Program) -> HeadCosts:
    """Embedding and LM-head Works of one micro-batch (see the module docstring); nothing
    when the model has no vocab."""
    model, mesh, profile = program.model, program.mesh, program.profile
    assert model is not None and mesh is not None and program.forward is not None, "a checked model"
    vocab, hidden = model.get("vocab"), model.get("hidden")
    if not vocab or not hidden:
        return HeadCosts()
    tp, dtype = mesh.size("tp"), model.dtype
    tp_lane = mesh.lane("tp") if tp > 1 else "local"
    tokens = program.forward.input_shape[0] * tp  # micro_batch · seq / cp, gathered over tp
    local, full, logits = (tokens // tp, hidden), (tokens, hidden), (tokens, vocab // tp)  # tp divides vocab
    size = dtype_bytes(tensor_dtype(dtype, gemm=False))
    streaming = profile.hbm_gbps * 1e9 * profile.achieved.get("activation", 1.0)

    def run(op: Op) -> Work:
        seconds = op_time(op, profile, dtype)
        return Work(seconds, seconds, seconds) if op.kind == "comm" else Work(seconds)

    def collective(name: str, kind: str, shape_in, shape_out) -> Work:
        if tp == 1:
            return NOTHING
        return run(Op(name, kind, "comm", kind, (), (shape_in,), shape_out, axis="tp", group_size=tp, lane=tp_lane,
                      per_node=mesh.per_node("tp")))

    def gemm(name: str, kind: str) -> Work:
        shape_in = logits if kind == "gemm_dgrad" else full
        return run(Op(name, kind, "compute", "gemm", (), (shape_in,), logits, weight=(hidden, logits[1])))

    def memory(elements: float, bytes_each: float) -> Work:
        return Work(elements * bytes_each / streaming)

    # Three all-reduces of one fp32 value per token: the max, the sum and the target logit.
    reduce = 3 * collective_time("all_reduce", 4.0 * tokens, tp, tp_lane, profile, mesh.per_node("tp")) if tp > 1 else 0.0
    cross_entropy = memory(math.prod(logits), size + 8) + Work(reduce, reduce, reduce)
    norm = Op("final_norm", "rmsnorm", "compute", "norm", (), (local,), local, weight=(hidden,))
    modelled = HeadCosts(
        embed_forward=memory(math.prod(full), 2 * size) + collective("embed.rs", "reduce_scatter", full, local),
        embed_backward=collective("embed.ag", "all_gather", local, full) + memory(math.prod(full), 3 * size),
        head_forward=(run(norm) + collective("head.ag", "all_gather", local, full) + gemm("lm_head", "gemm")
                      + cross_entropy),
        head_backward=(memory(math.prod(logits), 4 + size) + gemm("lm_head.dgrad", "gemm_dgrad")
                       + collective("head.rs", "reduce_scatter", full, local)
                       + run(attrs.evolve(norm, name="final_norm.bwd", op="rmsnorm_bwd"))),
        head_weight=gemm("lm_head.wgrad", "gemm_wgrad"))
    return _measured_ends(modelled, profile, dtype)


def gradient_syncs(costs: StepCosts, profile, slot, dense: float, expert: float, *, zero1: bool, fsdp: bool,
                   replicas_sliced: bool) -> list[tuple[str, float, Group, float]]:
    """(collective, bytes, group, seconds) of each data-parallel sync of the gradients of
    gradient ``slot`` (a layer's index, ``embedding`` or ``head``; ``dense`` and ``expert``
    parameters), in order: reduce-scattered under ZeRO-1 and 2 (``zero1``), else all-reduced,
    in the main gradients' dtype. ZeRO-3 (``fsdp``): a layer's are reduce-scattered by its
    scatter_dw ops; under hybrid sharding its piece is then all-reduced across the shard
    groups (``replicas_sliced``: reduce-scattered there, its updated part all-gathered after
    the optimizer)."""
    kind = "reduce_scatter" if zero1 else "all_reduce"
    syncs: tuple[tuple[float, Group, str], ...] = ((dense, costs.dense_group, kind), (expert, costs.expert_group, kind))
    if fsdp and isinstance(slot, int):
        if costs.replicate_group is None:
            return []
        across = "reduce_scatter" if replicas_sliced else "all_reduce"
        # ZeRO-3 runs with ep = 1: a layer's experts are pieces as its other weights.
        assert costs.shard_group is not None, "hybrid sharding has both groups"
        syncs = (((dense + expert) / costs.shard_group.size, costs.replicate_group, across),)
    out = []
    for elements, group, collective in syncs:
        if not elements or group.size <= 1:
            continue
        size = elements * costs.grad_bytes
        out.append((collective, size, group,
                    collective_time(collective, size, group.size, group.lane, profile, group.per_node)))
    return out


def _measured_ends(modelled: HeadCosts, profile, dtype: str) -> HeadCosts:
    """``modelled`` with the times a measured profile has for the model's end ops
    (:data:`END_OPS`, timed by `dhelix profile` with their collectives). The communication
    inside stays the model's (at most the measured time); the LM head's measured backward
    includes its weight gradient, which keeps the model's share when a schedule splits it off."""
    measured = profile.measured
    if measured is None or measured.dtype != dtype:
        return modelled
    times = {name: measured.ops[name] * 1e-6 for name in END_OPS if name in measured.ops}

    def timed(work: Work, name: str, minus: float = 0.0) -> Work:
        if name not in times:
            return work
        seconds = max(times[name] - minus, 0.0)
        return Work(seconds, min(work.comm, seconds), min(work.exposed, seconds))

    return HeadCosts(
        embed_forward=timed(modelled.embed_forward, "embedding"),
        embed_backward=timed(modelled.embed_backward, "embedding.bwd"),
        head_forward=timed(modelled.head_forward, "lm_head"),
        head_backward=timed(modelled.head_backward, "lm_head.bwd", minus=modelled.head_weight.seconds),
        head_weight=modelled.head_weight)
