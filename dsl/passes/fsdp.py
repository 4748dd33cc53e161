"""ZeRO-3 / FSDP in the layer DAGs: the weights' all-gathers and the gradients' reduce-scatters.

With ``train { zero = 3 }`` and dp > 1 every rank keeps only its 1/dp share of each layer
weight (the weight as the tensor and pipeline split leave it, flattened and padded to a
multiple of dp, as PyTorch's FSDP shards a parameter). This pass, run by the autodiff stage
after the backward is derived, makes the traffic that costs ordinary operators of the two
DAGs, so that the SI planner, the simulator, the renderers and the interpreter see it like
any collective (Centauri's §3.1 model, where FSDP is the main case):

* forward: ``<op>.gather_w``, an all-gather over dp of the op's weight shard, ahead of the
  layer's operators in the order the weights are first used (each is issued as early as
  the lane allows: FSDP's forward prefetch); the op ``waits`` for it;
* backward: ``<op>.regather_w`` for every weight a backward op reads (a dgrad, a norm's
  backward; a wgrad reads only activations), ahead of the layer's backward in the order of
  use: the gathered weight is not kept from the forward (FSDP's ``reshard_after_forward``),
  so memory holds about one layer's full weights at a time;
* backward: ``<op>.scatter_dw`` right after the last op that computes the weight's
  gradient (every chunk of a partitioned op): a reduce-scatter over dp of this
  micro-batch's full gradient into the rank's shard, which accumulates over micro-batches.
  Summing per micro-batch is exact (a sum of reduce-scatters is the reduce-scatter of the
  sum) and keeps no full gradient between micro-batches, which gradient accumulation
  without communication (FSDP's ``no_sync``) would.

A gemm chunked along its outputs (``chunk fc1 along outputs by 2``, Centauri's workload
partition of FSDP's collectives) has one of each per column block of its weight
(``fc1.c0.gather_w``, ``fc1.c0.regather_w``, ``fc1.c0.scatter_dw``, …: the unit of
:attr:`Op.weight_unit`), so a chunk computes on its columns while the next block's arrive;
each block is flattened, padded and cut over dp on its own (:mod:`dhelix.interpreter.ops.fsdp`).
Without ZeRO-3 such a chunk is a located error: there is no gather to split. A gemm chunked
along its outputs at its gather's stages (``chunk fc1 along outputs by stages``, under
``group weights``) keeps one unit, its weight, whose pieces are blocks of columns
(:data:`COLUMN_PIECES`): ``fc1.c0`` waits for the gather's first stage only, whose pieces are
whole columns to compute on, ``fc1.c1`` for the whole gather.

These operators read no activation: their dependencies are ``Op.waits``. Their shapes are
the flattened weight ``[elements, 1]`` (padded), so the cost model prices them as the
all-gather and reduce-scatter of that many elements in the model dtype. The model's ends
(embedding, final norm, LM head) are not in the layer DAGs and stay ZeRO-1: their optimizer
states are sharded, their weights replicated.

``group weights`` in the partition block (Centauri's group partition of FSDP, §3.1.2) runs
each of them as two sub-collectives when dp spans nodes with several ranks on each. By
default (:func:`~dhelix.dsl.passes.partition.fewest_cross_bytes`) a gather runs first over
``dp.inter`` (``<op>.gather_w.inter``: the pieces of the ranks at this rank's place on
every node, the only cross-node traffic, 1/intra of the flat ring's per node) then over
``dp.intra`` (``<op>.gather_w``, node-local), and a reduce-scatter, its transpose, first
over ``dp.intra`` then over ``dp.inter`` (``<op>.scatter_dw.intra``, ``<op>.scatter_dw``);
``group weights first intra`` (or the planner's choice) reverses both. The inter-first
gather collects the pieces out of dp order; its node-local stage carries
:data:`~dhelix.dsl.core.oplib.REGROUP` and the interpreter puts them back (one copy of the
weight), so pieces stay where the flat collectives put them.

Hybrid sharding (HSDP, PyTorch's ``HYBRID_SHARD``; Centauri's FSDP + DP): with
``train { zero = 3  shard = K }`` the weights are sharded over groups of ``K`` consecutive dp
ranks (the sub-axis ``dp.shard``) and replicated across them (``dp.replicate``): the gathers
and reduce-scatters above run over ``dp.shard``, each weight is cut into ``K`` pieces, and
the pieces' gradients are all-reduced over ``dp.replicate`` once per step, after the
pipeline (by the optimizer, as DP's buckets). With ``group weights`` a shard group that
spans nodes (``shard`` > ``gpus_per_node``, as many ranks on each) runs its collectives over
its own sub-groups, ``dp.shard.inter`` and ``dp.shard.intra``, as above.

With cp > 1 (torchtitan's ``dp_shard_cp``) a weight is replicated over cp as over dp, and
its gradient summed over both: the pieces, gathers and reduce-scatters run over the dp × cp
group (the sub-axis ``dp.cp``, :meth:`~dhelix.dsl.core.mesh.Mesh.fsdp_axis`; with dp = 1
too), whose lane and ranks per node are its own and which ``group weights`` splits as above
(``dp.cp.inter``, ``dp.cp.intra``). The check refuses cp and dp apart in the mesh order and
hybrid sharding with cp > 1.

Under selective recomputation (``train { recompute = selective }``) the backward computes
the dropped norms again from their weights, which the forward's gathers no longer hold:
their re-gathers come first in the backward, and every op reading a dropped output waits
for them (:func:`_rebuilt`), so the rebuild runs once they have landed (FSDP2's pre-backward
gather under torchtitan's selective checkpointing).

Not offered: FSDP with ep > 1 (the gradient of an expert sharded over ep would need the
reduce-scatter over another group than dp); a located error says so.
"""

from __future__ import annotations

import math

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError
from dhelix.dsl.core.mesh import INTER, INTRA
from dhelix.dsl.core.oplib import OUTPUTS, REGROUP, WEIGHT_PASS, is_wgrad, selective_drops
from dhelix.dsl.core.program import COLUMNS, GradFlow, Op, Program
from dhelix.dsl.passes.partition import WEIGHTS, unsplittable, weights_first
from dhelix.dsl.passes.workload import chunk_statements

GATHER, SCATTER = "param_gather", "grad_scatter"
#: The suffixes of the ops this pass adds to a weight's (written) name.
FORWARD_GATHER, BACKWARD_GATHER, GRAD_SCATTER = ".gather_w", ".regather_w", ".scatter_dw"
#: The parameter (set True) of the first of a ``group weights`` collective's two stages,
#: whose output the second stage reads.
FIRST_STAGE = "first_stage"
#: The parameter naming what an op of a three-way forward gather (``by stages3`` along
#: outputs) gathers across nodes: this rank's own piece (:data:`PLACE`), or the pieces the
#: node-local stage brought without this rank's own (:data:`MATES`); both give them flat.
PART, PLACE, MATES = "part", "place", "mates"
#: The parameter holding how many pieces a weight is cut into (dp, or the shard size).
PIECES = "pieces"
#: The parameter naming what a collective gathers or reduce-scatters when it is not the whole
#: weight: under a chunk along outputs, one chunk's columns of it (:attr:`Op.weight_unit`).
UNIT = "unit"
#: The parameter (set True) of the collectives of a weight cut into column blocks, one per
#: rank (``chunk G along outputs by stages``): a rank's piece is its block of columns, not a
#: slice of the flattened weight, so the first stage of a gather brings whole columns.
COLUMN_PIECES = "column_pieces"


def unit_of(params) -> str:
    """What the ZeRO-3 collective with ``params`` gathers or reduce-scatters (:data:`UNIT`)."""
    params = dict(params)
    return params.get(UNIT, params["weight"])


def is_fsdp(program: Program) -> bool:
    """Whether ``program`` shards its layer weights (ZeRO-3 with dp × cp > 1)."""
    return (program.train is not None and program.train.zero == 3 and program.mesh is not None
            and program.mesh.size("dp") * program.mesh.size("cp") > 1)


def shard_axis(program: Program) -> str:
    """The axis ZeRO-3 shards the layer weights over: ``dp``; ``dp.cp`` with cp > 1 (the dp
    × cp group); ``dp.shard`` under hybrid sharding (``train { shard = K }``):
    :meth:`~dhelix.dsl.core.mesh.Mesh.fsdp_axis`; ``dp`` for a program that does not shard."""
    return program.mesh.fsdp_axis() if program.mesh is not None and is_fsdp(program) else "dp"


def padded_elements(shape: tuple[int, ...], dp: int) -> int:
    """Elements of a weight of ``shape`` flattened and padded to a multiple of ``dp``."""
    return math.ceil(math.prod(shape) / dp) * dp


def shard_weights(program: Program) -> Program:
    """``program`` with its layer DAGs carrying the ZeRO-3 collectives (module docstring);
    unchanged unless :func:`is_fsdp`. CheckError, located at the ``zero`` setting, for a
    mesh this does not support."""
    _check_replica_statement(program)
    statement = _weights_statement(program)
    # Whether `group weights` splits the collectives, and where it is written (None for a
    # statement that `tune --partitions` generated: it splits them all the same).
    hierarchy = statement is not None
    where = statement.span_of(f"ops.{statement.ops.index(WEIGHTS)}") if statement is not None else None
    columns = _output_chunks(program)
    if columns is not None and not is_fsdp(program):
        raise CheckError(f"chunking along {OUTPUTS} splits the ZeRO-3 gather of a gemm's weight, which this "
                         "program does not run", columns.span_of("dim"),
                         ["ZeRO-3 is train { zero = 3 } with dp > 1: each chunk then gathers only its columns "
                          "of the weight and computes on them while the next chunk's columns arrive",
                          "without ZeRO-3 a gemm's weight is not gathered; a layer collective and the compute "
                          "after it chunk along tokens (chunk ag2 + fc1 by 2, under tensor parallelism)"])
    if hierarchy and not is_fsdp(program):
        raise CheckError("'group weights' splits the collectives of ZeRO-3, which this program does not run",
                         where, ["ZeRO-3 is train { zero = 3 } with dp > 1: its weight all-gathers and "
                                     "gradient reduce-scatters are what 'weights' names",
                                     "to split a collective of the layer, name it: group ag1 + rs1"])
    if not is_fsdp(program) or program.forward is None:
        return program
    mesh, train, forward, backward = program.mesh, program.train, program.forward, program.backward
    assert mesh is not None and train is not None and backward is not None, "ZeRO-3 runs on a checked model"
    sharded_over = shard_axis(program)
    if hierarchy and (problem := unsplittable(WEIGHTS, sharded_over, mesh, where)) is not None:
        raise problem
    if mesh.size("ep") > 1:
        raise CheckError(f"zero = 3 with ep = {mesh.size('ep')} is not supported", train.zero_span or train.span,
                         ["an expert weight's gradient is summed over the expert-data-parallel group, not over dp "
                          "alone", "use zero = 1 with ep > 1, or ep = 1 with zero = 3"])
    dp = mesh.size(sharded_over)  # the pieces each weight is cut into
    if statement is not None:
        first = weights_first(program.partition, dict(program.group_orders), dict(program.chunk_counts))
        parts = (first, INTRA if first == INTER else INTER)

    def collective(name: str, kind: str, weight: Op, forward_op: str | None = None,
                   waits: tuple[str, ...] = (), weight_pass: bool = False, three: bool = False) -> list[Op]:
        """The op (or, under ``group weights``, the two ops, the second named ``name``) of
        ``weight``'s unit (:attr:`Op.weight_unit`: its columns when chunked along outputs);
        ``three``: the forward gather of a gemm split three ways (:func:`_three_way`)."""
        part = ((UNIT, weight.weight_unit), (COLUMNS, weight.columns)) if weight.columns else \
            ((COLUMN_PIECES, True),) if weight.staged else ()
        assert weight.unit_weight is not None, "a weighted op"
        full = padded_elements(weight.unit_weight, dp)
        gathered = kind == GATHER
        # The reduce-scatter is the gather's transpose: its stages run in reverse.
        stages = ((sharded_over, dp),) if not hierarchy else \
            tuple((f"{sharded_over}.{part}", mesh.size(f"{sharded_over}.{part}"))
                  for part in (parts if gathered else parts[::-1]))
        ops: list[Op] = []
        size = full // dp if gathered else full
        previous: tuple[str, ...] = ()
        for index, (axis, group) in enumerate(stages):
            out = size * group if gathered else size // group
            last = index == len(stages) - 1
            # Inter-first gathers see the pieces grouped by place on the node (partition pass).
            regroup = hierarchy and parts[0] == INTER and axis.endswith(INTRA)
            ops.append(Op(name if last else f"{name}.{axis.rpartition('.')[2]}", kind, "comm",
                          "all_gather" if gathered else "reduce_scatter", previous, ((size, 1),), (out, 1),
                          axis=axis, group_size=group, lane=mesh.lane(axis), per_node=mesh.per_node(axis),
                          forward=forward_op, waits=() if previous else waits, span=weight.span,
                          params=(("weight", weight.weight_name), ("shape", tuple(weight.unit_weight)), (PIECES, dp))
                          + part
                          + (((WEIGHT_PASS, True),) if weight_pass else ())
                          + (((REGROUP, True),) if regroup else ()) + (((FIRST_STAGE, True),) if not last else ()),
                          grad=None if forward_op is None else GradFlow(upstream=None)))
            size, previous = out, (ops[-1].name,)
        return _three_way(ops, mesh) if three else ops

    weights = _weights_in_order(forward.ops)
    three = {op.weight_unit for op in forward.ops if op.staged and op.staged[0] == 2}
    gather_ops = {name: collective(name + FORWARD_GATHER, GATHER, op, three=name in three)
                  for name, op in weights.items()}
    # The backward re-gathers the whole weight (two stages at most).
    gathers = {name: ops[-1] for name, ops in gather_ops.items()}
    # A chunk at the gather's stages computes on the columns its stage brought (the first's,
    # then, three ways, the place gather's, then the last's).
    fwd_ops = [op for ops in gather_ops.values() for op in ops] + [
        attrs.evolve(op, waits=op.waits + (gather_ops[op.weight_unit][op.staged[0] if op.staged else -1].name,))
        if op.weight else op for op in forward.ops]
    owner = {op.name: op.weight_unit for op in forward.ops if op.weight}
    bwd_ops = _backward(backward.ops, weights, gathers, owner, collective, _rebuilt(program))
    return attrs.evolve(program, forward=attrs.evolve(forward, ops=tuple(fwd_ops)),
                        backward=attrs.evolve(backward, ops=tuple(bwd_ops)))


def _three_way(ops: list[Op], mesh) -> list[Op]:
    """The two stages of a ``group weights first intra`` gather of column pieces as three ops
    (Algorithm 1, lines 19-20: ``by stages3`` along outputs): the node-local stage
    (``W.gather_w.intra``: the node's pieces), ``W.gather_w.place`` (this rank's own piece from
    its place on every node, across: one piece each) and the cross-node stage ``W.gather_w``
    over the node-mates' pieces only (:data:`PART`); both give their pieces flat. Across
    nodes they carry the bytes of the two-stage gather."""
    first, last = ops
    piece = first.in_shapes[0]
    nodes, intra = last.group_size, first.group_size
    place = attrs.evolve(last, name=f"{last.name}.place", inputs=(), in_shapes=(piece,), shape=(piece[0] * nodes, 1),
                         waits=first.waits, params=last.params + ((PART, PLACE),))
    mates = (piece[0] * (intra - 1), 1)
    second = attrs.evolve(last, in_shapes=(mates,), shape=(mates[0] * nodes, 1), params=last.params + ((PART, MATES),))
    return [first, place, second]


def _weights_in_order(ops) -> dict[str, Op]:
    """The first op of each weight unit (:attr:`Op.weight_unit`), in the order the units are
    first used."""
    found: dict[str, Op] = {}
    for op in ops:
        if op.weight and op.weight_unit not in found:
            found[op.weight_unit] = op
    return found


def _rebuilt(program: Program) -> tuple[tuple[str, ...], frozenset[str]]:
    """Under selective recomputation, the weights (units) of the dropped ops that the
    backward's rebuild computes with (the norms': :func:`~dhelix.dsl.core.oplib.selective_drops`),
    in forward order, and the backward ops that read a dropped output (the rebuild runs,
    all at once, before the first of them runs); ((), ∅) otherwise."""
    assert program.forward is not None and program.backward is not None and program.train is not None
    if program.train.recompute != "selective":
        return (), frozenset()
    dropped = selective_drops(program.forward.ops, program.backward.ops)
    weights = tuple(op.weight_unit for op in program.forward.ops if op.name in dropped and op.weight)
    if not weights:
        return (), frozenset()
    return weights, frozenset(op.name for op in program.backward.ops if set(op.saved) & set(dropped))


def _backward(ops, weights: dict[str, Op], gathers: dict[str, Op], owner: dict[str, str], collective,
              rebuilt: tuple[tuple[str, ...], frozenset[str]] = ((), frozenset())) -> list[Op]:
    """The backward ops with the re-gathers first and a reduce-scatter after the last op
    computing each weight's gradient. ``owner`` maps a weighted forward op to its weight.
    ``rebuilt`` (:func:`_rebuilt`): the weights selective recomputation rebuilds with are
    re-gathered first of all, and every op reading a rebuilt output waits for them too
    (FSDP2 under torchtitan's selective checkpointing: the layer's gather lands, then its
    dropped operators run again, then its backward)."""
    rebuild_weights, rebuild_readers = rebuilt
    by_name = {op.name: op for op in ops}
    readers: dict[str, list[str]] = {}  # weight -> backward ops reading it (dgrads, norm .bwd)
    producers: dict[str, list[str]] = {}  # weight -> backward ops computing its gradient
    for op in ops:
        if op.weight is None or op.forward not in owner:
            continue
        name = owner[op.forward]
        if op.grad is not None and op.grad.weight is not None:
            producers.setdefault(name, []).append(op.name)
        if not is_wgrad(op):
            readers.setdefault(name, []).append(op.name)
    # Every re-gather first, in the order of use (FSDP's backward prefetch: the dp lane runs
    # them back to back while the layer computes), each reduce-scatter after its gradient.
    order = [weight for weight in rebuild_weights if weight in readers] + \
        [weight for weight in readers if weight not in rebuild_weights]
    result = [op for weight in order
              for op in collective(weight + BACKWARD_GATHER, GATHER, weights[weight], forward_op=gathers[weight].name)]
    rebuild_waits = tuple(weight + BACKWARD_GATHER for weight in rebuild_weights if weight in readers)
    last_producer = {names[-1]: weight for weight, names in producers.items()}
    for op in ops:
        if op.weight is not None and op.forward in owner and not is_wgrad(op):
            op = attrs.evolve(op, waits=op.waits + (owner[op.forward] + BACKWARD_GATHER,))
        if op.name in rebuild_readers:
            op = attrs.evolve(op, waits=op.waits + tuple(w for w in rebuild_waits if w not in op.waits))
        result.append(op)
        if op.name in last_producer:
            weight = last_producer[op.name]
            # Only wgrads compute it: a split schedule's W runs it (after them), not its B.
            only_wgrads = all(is_wgrad(by_name[name]) for name in producers[weight])
            result += collective(weight + GRAD_SCATTER, SCATTER, weights[weight], forward_op=gathers[weight].name,
                                 waits=tuple(producers[weight]), weight_pass=only_wgrads)
    return result


def _output_chunks(program: Program) -> s.Chunk | None:
    """The first chunk statement of the partition block along outputs, or None."""
    return next((st for st in chunk_statements(program.partition) if st.dim == OUTPUTS), None)


def replicas_substituted(program: Program) -> bool:
    """Whether the partition block substitutes hybrid sharding's all-reduce of the pieces'
    gradients across the replicas (``substitute weights as reduce_scatter + all_gather``):
    each replica then reduce-scatters them over ``dp.replicate``, updates its part of its
    piece and all-gathers the updated part (ZeRO-1 across the replicas)."""
    return _replica_statement(program) is not None and is_fsdp(program) and program.mesh is not None \
        and bool(program.mesh.dp_shard)


def _replica_statement(program: Program) -> s.Substitute | None:
    if program.partition is None:
        return None
    names = {op.name for op in program.forward.ops} if program.forward is not None else set()
    return next((st for st in program.partition.body
                 if isinstance(st, s.Substitute) and st.op == WEIGHTS and WEIGHTS not in names), None)


def _check_replica_statement(program: Program) -> None:
    """CheckError, located at the name, for ``substitute weights …`` without hybrid sharding."""
    statement = _replica_statement(program)
    if statement is None or (is_fsdp(program) and program.mesh is not None and program.mesh.dp_shard):
        return
    zero = program.train.zero if program.train is not None else 0
    notes = ["under hybrid sharding (train { zero = 3  shard = K }) each weight's pieces are all-reduced across "
             "the replicas once per step: 'weights' names that all-reduce"]
    if zero in (0, 1, 2):
        notes.append("without ZeRO-3 the gradients' all-reduce over dp is substituted by train { zero = 1 } "
                     "(reduce-scatter, update the slice, all-gather)")
    else:
        notes.append("plain ZeRO-3 reduce-scatters the gradients in the layers: there is no all-reduce to substitute")
    raise CheckError("'substitute weights' substitutes the all-reduce of hybrid sharding across its replicas, "
                     "which this program does not run", statement.span_of("op"), notes)


def _weights_statement(program: Program) -> s.Group | None:
    """The ``group`` statement of the partition block that names ``weights`` (the layer has
    no operator of that name), or None."""
    if program.partition is None:
        return None
    names = {op.name for op in program.forward.ops} if program.forward is not None else set()
    for st in program.partition.body:
        if isinstance(st, s.Group) and WEIGHTS in st.ops and WEIGHTS not in names:
            return st
    return None
