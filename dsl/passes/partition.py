"""Communication partitioning (Centauri, ASPLOS'24 §3.1): rewrite the forward layer DAG.

The program's ``partition`` block says how; the result is an ordinary forward DAG, so
autodiff, the strands checks, the planner, the simulator, the renderers and the
interpreter see ordinary operators:

* ``substitute ar as reduce_scatter + all_gather`` (primitive substitution, Table 2):
  an ``all_reduce`` becomes ``ar.rs`` (a reduce_scatter) then ``ar`` (an all_gather of it),
  the substitution that scales; the rooted ones (reduce + broadcast, gather + scatter) send
  everything through one rank and are refused.
* ``move ar1 + ar2 later`` (after a substitution): the all_gathers move past the
  elementwise operators that read them (norms, activations, the residual add: token-wise,
  no weight to contract), which then run on the rank's 1/n of the tokens, up to the
  operators that need every token (a GEMM, attention), where an all_gather of their input
  is made (named ``ln2.ag`` for ``ln2``'s output; a moved gather that no elementwise operator
  took keeps its name). The layer's tokens are what gets sharded: its input is taken as the
  all_gather of a shard and moves the same way (``x.ag`` where it is still needed whole),
  and its output must then be a moved gather, which is dropped: the layer maps a shard of
  the tokens to a shard, as the ``llama`` layer of ``stdlib/layers.dhx`` does. That is how
  tensor parallelism becomes sequence parallelism (Centauri §3.1.1: after the substitution
  the all_gather may move through elementwise operators).
* ``chunk ag2 + fc1 + act + fc2 + rs2 by 2`` (workload partition, Table 3): the chain's
  operators run on ``k`` chunks (``ag2.c0``, ``fc1.c0``, … ``ag2.c1``, …), chunk-major so
  that chunk 1's collective can run while chunk 0 computes. Values the chain reads from
  outside are cut by ``slice`` ops (``ln2.s0``, ``ln2.s1``) and the chain's last operator's
  chunks are joined by a ``concat`` that keeps its name, so the rest of the layer is
  unchanged. Along tokens a gathered tensor holds one block per rank; a chunk takes its
  share of every block, which makes the chunk of a collective the collective of a chunk.
  Every operator must split along the dimension as an outer dimension (OD); a contracted
  (CD) or indivisible (ND) one is a located error, as are counts that do not divide.
  ``chunk fc1 along outputs by 2`` splits one gemm over the column blocks of its weight
  (``fc1.c0``, ``fc1.c1``: :attr:`Op.columns`; each reads the whole input), joined by a
  concat along the features: under ZeRO-3 each block is gathered and reduce-scattered on its
  own (:mod:`dhelix.dsl.passes.fsdp`, which refuses it without ZeRO-3).

* ``chunk ag1 + qkv by stages`` (Algorithm 1's uneven workload partition, after the group
  partitions): where ``ag1`` is group-partitioned, chunk 0 (``qkv.c0``) computes on the rank
  blocks its first stage brought (``ag1.inter`` or ``ag1.intra``) while the second runs,
  chunk 1 on the others (``ag1.rest``, a ``rest`` of the whole gather), and a ``merge``
  named like the chain's last compute op puts the rows back in rank order (:data:`STAGES`);
  collectives that end the chain (``rs2`` after the MLP) run whole on the merged rows.

* ``group ag1 + rs1 [first inter|intra]`` (group partition, §3.1.2): a collective over a
  group that spans nodes runs as two sub-collectives, with the same result: one over the
  ranks at the same place on every node (``tp.inter``, the cross lane) and one over the
  group's ranks on one node (``tp.intra``, the local lane). The first is named for its
  sub-group (``ag1.inter``), the second keeps the name. ``first`` says which runs first;
  without it the planner prices both orders (:mod:`dhelix.dsl.planner.chunking`) and before
  it chooses the order that carries fewest bytes across nodes: an all_gather across nodes
  first (each rank's piece, not the node's), a reduce_scatter inside the node first (the
  node's sums, not each rank's). Those orders see the rank blocks grouped by place on the node,
  so their node-local stage regroups them (:data:`~dhelix.dsl.core.oplib.REGROUP`). Chunks of
  the collective are split too. A group inside one node, or one with unequal ranks on its
  nodes, is refused.

Chunks of a weighted operator share its weight: their ``Op.origin`` names the written op
(along outputs each holds its own columns of it).
"""

from __future__ import annotations

from typing import Mapping

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError, ErrorCollector
from dhelix.dsl.core.mesh import INTER, INTRA, Mesh
from dhelix.dsl.core.oplib import CD, OD, OUTPUTS, PARTITION_DIMS, REGROUP, dimension_split
from dhelix.dsl.core.program import AUTO, COLUMNS, LayerDag, Op
from dhelix.dsl.core.wording import did_you_mean, join_words
from dhelix.dsl.frontend.exprs import evaluate
from dhelix.dsl.passes.priority import PRIORITIES


#: ``group weights``: the ZeRO-3 weight all-gathers and gradient reduce-scatters
#: (:mod:`dhelix.dsl.passes.fsdp`), which this pass does not see, run hierarchically.
WEIGHTS = "weights"

#: The one substitution Centauri keeps for an all_reduce (Table 2).
SCALABLE = ("reduce_scatter", "all_gather")
_ROOTED = {"reduce", "broadcast", "gather", "scatter"}


def is_auto(st: s.Chunk) -> bool:
    """Whether chunk statement ``st`` leaves its count to the planner (``by auto``)."""
    return isinstance(st.parts, s.Name) and st.parts.id == AUTO


#: ``chunk ag1 + qkv by stages``: the chain split unevenly at the stages of its
#: group-partitioned all_gather (Centauri's Algorithm 1, lines 8-22); also a count the
#: planner may choose for ``by auto``.
STAGES = "stages"


def is_stages(st: s.Chunk) -> bool:
    """Whether chunk statement ``st`` splits its chain at its gather's stages (``by stages``)."""
    return isinstance(st.parts, s.Name) and st.parts.id == STAGES


def chunk_statements(block: s.PartitionDef | None) -> list[s.Chunk]:
    """The chunk statements of ``block`` in order (their index keys ``counts``)."""
    return [st for st in block.body if isinstance(st, s.Chunk)] if block is not None else []


def partition_forward(fwd: LayerDag, block: s.PartitionDef, env: Mapping[str, int], mesh: Mesh,
                      counts: Mapping[int, int | str] | None = None,
                      orders: Mapping[str, str] | None = None) -> LayerDag:
    """``fwd`` rewritten by the statements of ``block`` (substitutions first, then moved
    gathers, then chunks, then group partitions, which split the chunks' collectives too,
    then the chains split at their gathers' stages), with chunk counts
    evaluated over ``env`` and groups taken from ``mesh``. A ``by auto`` statement takes its
    count from ``counts`` (keyed by its index among the chunk statements; the planner
    chooses it, :mod:`dhelix.dsl.planner.chunking`); without one, or with 1, its chain stays
    whole. A group statement without ``first`` takes each collective's first sub-group from
    ``orders`` (by name; the planner's choice), else :func:`fewest_cross_bytes`. Raises
    CheckError or ErrorGroup with every problem found, each located at the statement's word
    at fault."""
    errors = ErrorCollector()
    _check_backward(block, errors)
    for st in block.body:
        if isinstance(st, s.Substitute):
            fwd = _substitute(fwd, st, errors)
    moves = [st for st in block.body if isinstance(st, s.Move)]
    if moves:  # one rewrite: the gathers of every statement shard the same tokens
        fwd = _moved_later(fwd, moves, errors)
    claimed: dict[str, s.Chunk] = {}
    staged = []
    for index, st in enumerate(chunk_statements(block)):
        auto = (counts or {}).get(index, 1) if is_auto(st) else None
        if is_stages(st) or auto == STAGES:
            staged.append(st)  # after the group partitions, whose stages they split at
            continue
        # An auto chain is checked even while whole (count 1): its mistakes show at once.
        chain = _checked_chain(fwd, st, env, claimed, errors, auto)
        if chain is not None and chain[1] > 1:
            fwd = _chunked(fwd, *chain)
    for st in block.body:
        if isinstance(st, s.Group) and _checked_first(st, errors):
            for i, name in enumerate(st.ops):
                if name == WEIGHTS and name not in {op.name for op in fwd.ops}:
                    continue  # ZeRO-3's collectives: split by the fsdp pass
                fwd = _group_partition(fwd, name, st.span_of(f"ops.{i}"), mesh, errors,
                                       st.first or (orders or {}).get(name))
    for st in staged:
        fwd = _by_stages(fwd, st, claimed, errors)
    errors.raise_if_any()
    return fwd


def _check_backward(block: s.PartitionDef, errors: ErrorCollector) -> None:
    """Errors for a ``backward … first`` statement that names no half, and for a second one."""
    statements = [st for st in block.body if isinstance(st, s.Backward)]
    for st in statements[:1]:
        if st.first not in PRIORITIES:
            errors.add(CheckError(f"unknown half '{st.first}' of the backward to run first (dgrad or wgrad)",
                                  st.span_of("first"), did_you_mean(st.first, PRIORITIES)
                                  + ["dgrad: each GEMM's activation gradient first (Megatron's order); wgrad: "
                                     "its weight gradient first (FSDP's reduce-scatter starts earlier); leave "
                                     "the statement out to let the planner choose"]))
    for st in statements[1:]:
        errors.add(CheckError("a second 'backward … first' statement", st.span,
                              [f"the first is at line {statements[0].span.line}: one priority holds for the layer"]))


# -- group partition ----------------------------------------------------------------------

#: The collectives a group partition splits, and the sub-group each runs over first when
#: neither the program nor the planner chose (:func:`fewest_cross_bytes`).
_CHEAP_FIRST = {"all_gather": INTER, "reduce_scatter": INTRA, "all_reduce": INTRA}
ORDERS = (INTER, INTRA)


def fewest_cross_bytes(op: str) -> str:
    """The sub-group (``inter`` or ``intra``) collective ``op`` runs over first to carry the
    fewest bytes across nodes (Centauri §3.1.2: limit cross-node volume). An all_gather
    across nodes first sends each rank's piece there, where the node-local gather first
    would make every rank of the node send the node's pieces again (intra_size times the
    bytes); a reduce_scatter inside the node first sends the node's partial sums; an
    all_reduce carries as much either way."""
    return _CHEAP_FIRST[op]


def _checked_first(st: s.Group, errors: ErrorCollector) -> bool:
    if st.first is None or st.first in ORDERS:
        return True
    errors.add(CheckError(f"unknown sub-group '{st.first}' to run first (inter or intra)", st.span_of("first"),
                          did_you_mean(st.first, ORDERS)
                          + ["inter: across nodes first (an all_gather's cheapest order); intra: inside the "
                             "node first (a reduce_scatter's); leave 'first' out to let the planner choose"]))
    return False


def _group_partition(fwd: LayerDag, name: str, span, mesh: Mesh, errors: ErrorCollector,
                     first: str | None) -> LayerDag:
    targets = [op for op in fwd.ops if name in (op.name, op.origin) and op.kind == "comm"]
    if not targets:
        if name not in fwd.elided:  # an elided collective has no group to split
            op = _named_op(fwd, name, span, errors)
            if op is not None:
                errors.add(CheckError(f"cannot group-partition '{name}': it is {op.op}, a {op.kind} operator",
                                      span, ["group partition splits an all_gather, reduce_scatter or "
                                             "all_reduce over a group that spans nodes"]))
        return fwd
    op = targets[0]
    if op.op not in _CHEAP_FIRST:
        errors.add(CheckError(f"cannot group-partition '{name}': {op.op} has no hierarchical form here",
                              span, [f"group partition splits {join_words(list(_CHEAP_FIRST), 'or')}"]))
        return fwd
    problem = unsplittable(name, op.axis, mesh, span)
    if problem is not None:
        errors.add(problem)
        return fwd
    first = first or fewest_cross_bytes(op.op)
    replaced = {target.name: _hierarchical(target, mesh, first) for target in targets}
    return attrs.evolve(fwd, ops=tuple(new for o in fwd.ops for new in replaced.get(o.name, [o])))


def unsplittable(name: str, axis: str, mesh: Mesh, span) -> CheckError | None:
    """Why the groups of ``axis`` cannot be group-partitioned (the error for ``name``,
    located at ``span``), or None when each spans nodes with as many ranks (two or more) on each."""
    split = mesh.hierarchy(axis)
    if split is None or (isinstance(split, tuple) and split[0] == 1):
        where = "lies inside one node" if split is None else "has one rank on each node"
        return CheckError(f"cannot group-partition '{name}': its {axis} group {list(mesh.groups(axis)[0])} {where}",
                          span, [f"group partition splits a group with several ranks on each of several "
                                 f"nodes (gpus_per_node = {mesh.gpus_per_node})"])
    if isinstance(split, str):
        return CheckError(f"cannot group-partition '{name}': its sub-groups are unbalanced", span,
                          [split, "every node must hold as many ranks of the group"])
    return None


def _hierarchical(op: Op, mesh: Mesh, first_part: str) -> list[Op]:
    """``op`` as its two sub-collectives, over ``first_part`` (inter or intra) first; the
    second keeps its name (readers are unchanged)."""
    second_part = INTRA if first_part == INTER else INTER
    first, second = f"{op.axis}.{first_part}", f"{op.axis}.{second_part}"
    rows, cols = op.in_shapes[0]
    size = mesh.size(first)
    middle = {"all_gather": rows * size, "reduce_scatter": rows // size, "all_reduce": rows}[op.op]
    # Blocks come grouped by node place after a gather across nodes, and a reduce-scatter
    # inside the node must see them so: that stage regroups (an all_reduce sums in place).
    regroup = {"all_gather": first_part == INTER, "reduce_scatter": first_part == INTRA}.get(op.op, False)

    def params(axis: str) -> tuple:
        return (("axis", axis),) + (((REGROUP, True),) if regroup and axis.endswith(INTRA) else ())
    one = attrs.evolve(op, name=f"{op.name}.{first_part}", axis=first, group_size=size,
                       lane=mesh.lane(first), per_node=mesh.per_node(first), shape=(middle, cols), params=params(first))
    two = attrs.evolve(op, inputs=(one.name,), in_shapes=(one.shape,), axis=second,
                       group_size=mesh.size(second), lane=mesh.lane(second), per_node=mesh.per_node(second),
                       params=params(second))
    return [one, two]


# -- primitive substitution ---------------------------------------------------------------

def _substitute(fwd: LayerDag, st: s.Substitute, errors: ErrorCollector) -> LayerDag:
    op = _named_op(fwd, st.op, st.span_of("op"), errors)
    if op is None:
        return fwd
    if op.kind != "comm" or op.op != "all_reduce":
        what = "a collective" if op.kind == "comm" else f"a {op.kind} operator"
        errors.add(CheckError(f"cannot substitute '{op.name}': it is {op.op}, {what}, not an all_reduce",
                              st.span_of("op"), ["primitive substitution replaces an all_reduce by "
                                                 "reduce_scatter + all_gather (Centauri Table 2)"]))
        return fwd
    if st.into != SCALABLE:
        errors.add(_bad_target(st))
        return fwd
    rows, size = op.in_shapes[0][0], op.group_size
    if rows % size:
        errors.add(CheckError(f"cannot substitute '{op.name}': its {rows} tokens do not split over "
                              f"{op.axis} = {size} for the reduce_scatter", st.span_of("op")))
        return fwd
    half = (rows // size, op.shape[1])
    rs = attrs.evolve(op, name=f"{op.name}.rs", op="reduce_scatter", op_class="reduce_scatter", shape=half)
    ag = attrs.evolve(op, op="all_gather", op_class="all_gather", inputs=(rs.name,), in_shapes=(half,))
    ops = []
    for other in fwd.ops:
        ops += [rs, ag] if other.name == op.name else [other]
    return attrs.evolve(fwd, ops=tuple(ops))


# -- all_gathers moved later ---------------------------------------------------------------

#: The operator classes an all_gather moves through: token-wise, without a weight that would
#: contract the gathered rows (Table 3's OD along tokens, elementwise).
ELEMENTWISE = ("norm", "activation", "add")


def _gathers_to_move(fwd: LayerDag, statements: list[s.Move], errors: ErrorCollector) -> dict:
    """The all_gathers the move ``statements`` name (name -> (op, its span), in statement
    order), or {} after recording why they cannot move: not an all_gather, gathers over
    different axes, a layer whose tokens are split already or do not divide."""
    found, gathers = len(errors.errors), {}
    for st, i, name in [(st, i, name) for st in statements for i, name in enumerate(st.ops)]:
        span = st.span_of(f"ops.{i}")
        if name in fwd.elided:
            continue  # over a size-1 axis: the identity, nothing to move
        op = _named_op(fwd, name, span, errors)
        if op is None:
            continue
        if op.op != "all_gather":
            notes = [f"write 'substitute {name} as reduce_scatter + all_gather' before it: the all_gather "
                     f"half keeps the name {name}"] if op.op == "all_reduce" else []
            errors.add(CheckError(f"cannot move '{name}' later: it is {op.op}, not an all_gather", span,
                                  notes + [f"an all_gather commutes with the elementwise operators after it "
                                           f"({join_words(ELEMENTWISE, 'or')}); this moves it past them"]))
            continue
        gathers[name] = (op, span)
    if len(errors.errors) > found or not gathers:
        return {}
    (template, first_span), *others = gathers.values()
    for op, span in others:
        if (op.axis, op.group_size) != (template.axis, template.group_size):
            errors.add(CheckError(f"cannot move '{op.name}' with '{template.name}': it gathers over {op.axis} = "
                                  f"{op.group_size}, '{template.name}' over {template.axis} = {template.group_size}",
                                  span, ["the gathers moved together shard the layer's tokens over one axis"]))
            return {}
    rows = fwd.input_shape[0]
    if template.shape[0] != rows:
        errors.add(CheckError(f"cannot move '{template.name}' later: the layer's input holds {rows} tokens, "
                              f"'{template.name}' gathers {template.shape[0]}", first_span,
                              ["moving gathers later shards a layer whose input holds every token (tensor "
                               "parallelism without sequence parallelism); this layer's tokens are split already"]))
        return {}
    if rows % template.group_size:
        errors.add(CheckError(f"cannot move '{template.name}' later: the layer's {rows} tokens do not split over "
                              f"{template.axis} = {template.group_size}", first_span))
        return {}
    return gathers


def _moved_later(fwd: LayerDag, statements: list[s.Move], errors: ErrorCollector) -> LayerDag:
    """``fwd`` with the all_gathers the move ``statements`` name, and its input, moved past
    the elementwise operators that read them (module docstring); errors located at the names."""
    gathers = _gathers_to_move(fwd, statements, errors)
    if not gathers:
        return fwd
    (template, first_span) = next(iter(gathers.values()))
    size, (rows, cols) = template.group_size, fwd.input_shape
    # value -> (the name of its shard, the shard's shape), for every value that is an
    # all_gather of a shard: the moved gathers, the layer input, what elementwise ops made of them.
    shard = {name: (op.inputs[0], op.in_shapes[0]) for name, (op, _) in gathers.items()}
    shard[fwd.input] = (fwd.input, (rows // size, cols))
    made: dict[str, str] = {}  # value -> the all_gather op that gives it whole again
    ops: list[Op] = []

    def whole(value: str, reader: Op) -> str:
        if value not in made:
            source, shape = shard[value]
            # Written names have no dots: ``V.ag`` names no other operator.
            made[value] = value if value in gathers else f"{value}.ag"
            # A new gather points where its reader is written.
            written = gathers[value][0] if value in gathers else attrs.evolve(template, span=reader.span)
            ops.append(attrs.evolve(written, name=made[value], inputs=(source,), in_shapes=(shape,),
                                    shape=(shape[0] * size, shape[1])))
        return made[value]

    for op in fwd.ops:
        if op.name in gathers:
            continue
        if op.kind == "compute" and op.op_class in ELEMENTWISE and op.inputs and all(i in shard for i in op.inputs):
            shapes = tuple(shard[i][1] for i in op.inputs)
            ops.append(attrs.evolve(op, inputs=tuple(shard[i][0] for i in op.inputs), in_shapes=shapes,
                                    shape=(op.shape[0] // size, op.shape[1])))
            shard[op.name] = (op.name, ops[-1].shape)
        else:
            ops.append(attrs.evolve(op, inputs=tuple(whole(i, op) if i in shard else i for i in op.inputs)))
    if fwd.output not in shard:
        producer = fwd.op(fwd.output)
        whole_inputs = [i for i in producer.inputs if i not in shard]
        why = f"{producer.name} ({producer.op}) needs every token" if producer.op_class not in ELEMENTWISE \
            else f"{producer.name} ({producer.op}) also reads {whole_inputs[0]} ({fwd.op(whole_inputs[0]).op}), " \
            "which no moved gather gives"
        errors.add(CheckError(f"moving {join_words(list(gathers))} later leaves the layer's output "
                              f"{fwd.output} whole: {why}", first_span,
                              ["the moved gathers shard the layer's tokens, its input and output included: every "
                               "path from a moved gather to the output must run through elementwise operators "
                               f"({join_words(ELEMENTWISE, 'or')})"]))
        return fwd
    return attrs.evolve(fwd, ops=tuple(ops), input_shape=(rows // size, cols), output=shard[fwd.output][0])


def _bad_target(st: s.Substitute) -> CheckError:
    written = " + ".join(st.into)
    span = st.span_of("into.0")
    if set(st.into) & _ROOTED:
        return CheckError(f"rooted substitution '{written}' is not supported", span, [
            "a rooted collective (reduce, broadcast, gather, scatter) concentrates the traffic on "
            "one root rank, so it scales worse than the all_reduce it replaces; Centauri prunes "
            "these substitutions (Table 2)",
            f"write: substitute {st.op} as {' + '.join(SCALABLE)}"])
    return CheckError(f"no substitution '{written}' for an all_reduce", span,
                      [f"the scalable substitution is: substitute {st.op} as {' + '.join(SCALABLE)}"])


# -- workload partition -------------------------------------------------------------------

def _checked_chain(fwd: LayerDag, st: s.Chunk, env, claimed: dict, errors: ErrorCollector,
                   parts: int | None = None):
    """(ops of the chain in DAG order, parts, dim index) or None after recording errors;
    ``parts`` is the count of a ``by auto`` statement (else the statement's own)."""
    dim = st.dim or "tokens"
    if dim not in PARTITION_DIMS:
        errors.add(CheckError(f"unknown dimension '{dim}'", st.span_of("dim"),
                              did_you_mean(dim, PARTITION_DIMS) + [f"chunks split along "
                                                                    f"{join_words(PARTITION_DIMS, 'or')}"]))
        return None
    if parts is None:
        parts = evaluate(st.parts, env, "model, mesh or train setting")
    elif parts < 2:  # an auto count the planner left at 1: the chain stays whole
        parts = 1
    if parts < 2 and not is_auto(st):
        errors.add(CheckError(f"a chunk count must be at least 2, got {parts}", st.parts.span))
        return None
    if dim == OUTPUTS and len(st.ops) > 1:
        errors.add(CheckError(f"'along {OUTPUTS}' chunks one gemm, not a chain of {len(st.ops)} operators",
                              st.span_of("ops.1"), [f"the chunks of {st.ops[0]} are joined along their "
                                                    "columns right after it: its readers see the whole output",
                                                    f"write one statement per gemm: chunk {st.ops[0]} along "
                                                    f"{OUTPUTS} by {'auto' if is_auto(st) else parts}"]))
        return None
    found = len(errors.errors)
    ops = []
    for i, name in enumerate(st.ops):
        span = st.span_of(f"ops.{i}")
        if name in fwd.elided:
            continue  # a collective over a size-1 axis is the identity: nothing to chunk
        op = _named_op(fwd, name, span, errors)
        if op is None:
            continue
        if name in claimed:
            errors.add(CheckError(f"'{name}' is already chunked", span,
                                  [f"by the chunk statement at {claimed[name].span}"]))
        split, why = dimension_split(op.op, dim)
        if split != OD:
            kind = "contracted: its chunks would be partial sums that need a reduction, which a chunk " \
                "chain does not add" if split == CD else "not divisible: it never splits"
            errors.add(CheckError(f"cannot chunk {name} ({op.op}) along {dim}: {dim} is {split} for "
                                  f"{op.op} ({kind})", span, [f"{why} (Centauri Table 3)"] if why else []))
        ops.append(op)
    if len(errors.errors) > found or not ops:
        return None
    claimed.update({op.name: st for op in ops})
    order = [o.name for o in fwd.ops]
    ops.sort(key=lambda op: order.index(op.name))
    if dim == OUTPUTS:  # the gemm's output features: its input is read whole by every chunk
        return (ops, parts, OUTPUTS) if _divides(ops, parts, 1, st, errors, outputs=True) else None
    axis = PARTITION_DIMS.index(dim)
    if not _connected(fwd, ops, st, errors) or not _divides(ops, parts, axis, st, errors):
        return None
    return ops, parts, axis


def _named_op(fwd: LayerDag, name: str, span, errors: ErrorCollector) -> Op | None:
    names = [op.name for op in fwd.ops]
    if name in names:
        return fwd.op(name)
    notes = did_you_mean(name, names) + [f"operators of layer {fwd.name}: {', '.join(names)}"]
    errors.add(CheckError(f"layer {fwd.name} has no operator '{name}'", span, notes))
    return None


def _connected(fwd: LayerDag, ops: list[Op], st: s.Chunk, errors: ErrorCollector) -> bool:
    """Whether ``ops`` form one chain: each op after the first reads an earlier one, and
    only the last is read from outside (its chunks are joined; the others' never are)."""
    names = {op.name for op in ops}
    where = {op.name: st.span_of(f"ops.{st.ops.index(op.name)}") for op in ops}
    for op in ops[1:]:
        if not names & set(op.inputs):
            errors.add(CheckError(f"{op.name} does not read another operator of the chain", where[op.name],
                                  [f"it reads {join_words(op.inputs)}; a chunk chain follows the data: "
                                   "each operator after the first reads one before it"]))
            return False
    readers = {o.name: o for o in fwd.ops if o.name not in names}
    for op in ops[:-1]:
        outside = [r for r in readers.values() if op.name in r.inputs]
        if outside or op.name == fwd.output:
            who = f"{outside[0].name} reads it" if outside else "it is the layer's output"
            errors.add(CheckError(f"{op.name} is used outside the chain, so it cannot stay chunked",
                                  where[op.name], [f"{who}; end the chain at {op.name} or add "
                                                   f"{outside[0].name if outside else 'its readers'} to it"]))
            return False
    return True


def _blocks(chain: list[Op], shape, dim: int) -> int:
    """Rank blocks of a tensor of the chain along ``dim``. A chunk of a collective's output
    must be the collective of a chunk of its input: an all_gather over g ranks turns n rows
    into g blocks of n, a reduce_scatter g blocks into one, so along tokens the chain's
    collectives say how many blocks a tensor of each row count holds (1 where none does: the
    chain's token-wise operators only need every tensor cut the same way)."""
    if dim != 0:
        return 1
    blocks: dict[int, int] = {}
    for op in chain:
        if op.op == "all_gather":
            inner = blocks.setdefault(op.in_shapes[0][0], 1)
            blocks.setdefault(op.shape[0], inner * op.group_size)
        elif op.op == "reduce_scatter":
            inner = blocks.setdefault(op.shape[0], 1)
            blocks.setdefault(op.in_shapes[0][0], inner * op.group_size)
    return blocks.get(shape[0], 1)


def _divides(ops: list[Op], parts: int, dim: int, st: s.Chunk, errors: ErrorCollector,
             outputs: bool = False) -> bool:
    for op in ops:
        values = [] if outputs else list(zip(op.inputs, op.in_shapes, strict=True))
        for name, shape in [*values, (op.name, op.shape)]:
            blocks = _blocks(ops, shape, dim)
            size = shape[dim] // blocks
            if size % parts:
                word = "output features" if outputs else PARTITION_DIMS[dim]
                notes = [f"{name} is {list(shape)}" + (f": {blocks} gathered blocks of {size} {word}"
                                                       if blocks > 1 else "")]
                errors.add(CheckError(f"{parts} chunks do not divide the {size} {word} of {name}"
                                      + (" per rank block" if blocks > 1 else ""), st.parts.span, notes))
                return False
    return True


def _chunk_shape(shape, parts: int, dim: int):
    return tuple(n // parts if d == dim else n for d, n in enumerate(shape))


def _chunked(fwd: LayerDag, ops: list[Op], parts: int, dim: int | str) -> LayerDag:
    """``fwd`` with the chain ``ops`` replaced, at its last op's place, by slices of its
    outside inputs, the chunk ops (chunk-major) and the concat of the last op's chunks
    (along ``OUTPUTS``: the gemm's chunks, each on the whole input with its own columns)."""
    if dim == OUTPUTS:
        return _by_columns(fwd, ops[0], parts)
    names = {op.name for op in ops}
    taken = {op.name for op in fwd.ops} | {fwd.input}
    slices: dict[str, list[Op]] = {}
    new: list[Op] = []
    for op in ops:
        for value, shape in zip(op.inputs, op.in_shapes, strict=True):
            if value not in names and value not in slices:
                slices[value] = _slices(ops, value, shape, parts, dim, taken, op.span)
                new += slices[value]
    for i in range(parts):
        for op in ops:
            inputs = tuple(f"{v}.c{i}" if v in names else slices[v][i].name for v in op.inputs)
            new.append(attrs.evolve(op, name=f"{op.name}.c{i}", inputs=inputs, origin=op.origin or op.name,
                                    in_shapes=tuple(_chunk_shape(x, parts, dim) for x in op.in_shapes),
                                    shape=_chunk_shape(op.shape, parts, dim)))
    last = ops[-1]
    new.append(Op(last.name, "concat", "compute", "layout", tuple(f"{last.name}.c{i}" for i in range(parts)),
                  (_chunk_shape(last.shape, parts, dim),) * parts, last.shape,
                  params=(("parts", parts), ("dim", dim), ("blocks", _blocks(ops, last.shape, dim))),
                  span=last.span))
    out = []
    for op in fwd.ops:
        if op.name == last.name:
            out += new
        elif op.name not in names:
            out.append(op)
    return attrs.evolve(fwd, ops=tuple(out))


def _by_columns(fwd: LayerDag, op: Op, parts: int) -> LayerDag:
    """``fwd`` with gemm ``op`` split into ``parts`` gemms over its weight's column blocks
    (``op.c0`` …, :attr:`Op.columns`), joined by a concat along the features that keeps its name."""
    rows, cols = op.shape
    chunks = [attrs.evolve(op, name=f"{op.name}.c{i}", origin=op.origin or op.name, shape=(rows, cols // parts),
                           weight=(op.weight[0], op.weight[1] // parts), params=op.params + ((COLUMNS, (i, parts)),))
              for i in range(parts)]
    join = Op(op.name, "concat", "compute", "layout", tuple(c.name for c in chunks), (chunks[0].shape,) * parts,
              op.shape, params=(("parts", parts), ("dim", 1), ("blocks", 1)), span=op.span)
    out = []
    for each in fwd.ops:
        out += [*chunks, join] if each.name == op.name else [each]
    return attrs.evolve(fwd, ops=tuple(out))


def _by_stages(fwd: LayerDag, st: s.Chunk, claimed: dict, errors: ErrorCollector) -> LayerDag:
    """``fwd`` with the chain of ``st`` (a group-partitioned all_gather, token-wise compute,
    then maybe collectives) split unevenly: chunk 0 computes on the rank blocks the gather's
    first stage brought (``ag.inter`` or ``ag.intra``), chunk 1 on the others (``ag.rest``,
    taken from the whole gather), and a ``merge`` named like the chain's last compute op puts
    the rows back in rank order, where the collectives that end the chain (the MLP's
    reduce_scatter) read it whole. ``fwd`` unchanged after recording errors."""
    found = _stage_chain(fwd, st, claimed, errors)
    if found is None:
        return fwd
    gather, first, chain, tail = found
    claimed.update({op.name: st for op in [gather, *chain, *tail]})
    return _split_at_stages(fwd, gather, first, chain)


def _stage_chain(fwd: LayerDag, st: s.Chunk, claimed: dict, errors: ErrorCollector):
    """(the gather, its first stage, the compute to split, the collectives that end the
    chain) of ``st``, or None after recording errors located at the statement's words;
    those of a gather without stages say it "has no stages" (``by auto`` leaves it out)."""
    spans = {name: st.span_of(f"ops.{i}") for i, name in enumerate(st.ops)}
    if st.dim not in (None, PARTITION_DIMS[0]):
        errors.add(CheckError(f"'by {STAGES}' splits the tokens a gather brings, not its {st.dim}",
                              st.span_of("dim"), ["leave 'along' out, or chunk by a count"]))
        return None
    name = st.ops[0]
    lead = f"'by {STAGES}' computes on what the first stage of a group-partitioned all_gather brought, and " \
        f"{name} has no stages"
    if name in fwd.elided:
        errors.add(CheckError(f"{lead}: it runs over an axis of size 1", spans[name],
                              ["a collective over one rank is the identity: there is nothing to split"]))
        return None
    gather = _named_op(fwd, name, spans[name], errors)
    chain = [op for other in st.ops[1:] if (op := _named_op(fwd, other, spans[other], errors)) is not None]
    if gather is None or len(chain) < len(st.ops) - 1:
        return None
    first = next((o for o in fwd.ops if gather.op == "all_gather" and gather.inputs == (o.name,)
                  and o.name in (f"{name}.{INTER}", f"{name}.{INTRA}")), None)
    if first is None:
        what = f"it is {gather.op}, not an all_gather" if gather.op != "all_gather" else "it is not group-partitioned"
        notes = [f"add: group {name}"] if gather.op == "all_gather" else []
        errors.add(CheckError(f"{lead}: {what}", spans[name],
                              notes + ["the chain starts with the gather (Centauri Algorithm 1: the uneven "
                                       "workload partition of a hierarchical all_gather)"]))
        return None
    order = [o.name for o in fwd.ops]
    chain.sort(key=lambda o: order.index(o.name))
    tail = []  # the collectives that end the chain: they run whole on the merged rows
    while chain and chain[-1].kind == "comm":
        tail.insert(0, chain.pop())
    if not chain:
        errors.add(CheckError(f"'by {STAGES}' needs the compute after {name}", spans[name],
                              [f"name the operators that read it: chunk {name} + … by {STAGES}"]))
        return None
    found = len(errors.errors)
    for op in [gather, *chain, *tail]:
        if op.name in claimed:
            errors.add(CheckError(f"'{op.name}' is already chunked", spans[op.name],
                                  [f"by the chunk statement at {claimed[op.name].span}"]))
    for op in chain:
        split, why = dimension_split(op.op, "tokens")
        if op.kind != "compute" or split != OD:
            errors.add(CheckError(f"cannot split {op.name} ({op.op}) by {STAGES}: it is not token-wise compute",
                                  spans[op.name], ([why] if why else []) + [
                                      "the stages' chunks are rows of the gathered tokens: each operator between "
                                      "the gather and the collectives that may end the chain must compute row by "
                                      "row"]))
    inside = {o.name for o in [gather, *chain]}
    for before, op in zip([chain[-1], *tail], tail):
        if not _reads(fwd, op, before.name):
            errors.add(CheckError(f"{op.name} does not read {before.name}", spans[op.name],
                                  [f"the collectives that end a chain split by {STAGES} read what comes before them"]))
    for op in chain:
        outside = [v for v in op.inputs if v not in inside]
        if outside:
            errors.add(CheckError(f"{op.name} reads {outside[0]} from outside the chain", spans[op.name],
                                  [f"'by {STAGES}' splits the rows of {name} only; end the chain before "
                                   f"{op.name}"]))
    if len(errors.errors) > found or not _connected(fwd, [gather, *chain], st, errors):
        return None
    return gather, first, chain, tail


def _split_at_stages(fwd: LayerDag, gather: Op, first: Op, chain: list[Op]) -> LayerDag:
    """The rewrite of :func:`_by_stages` for a checked chain."""
    rows, whole = first.in_shapes[0][0], first.group_size * gather.group_size
    near, far = rows * first.group_size, rows * (whole - first.group_size)
    params = (("axis", first.axis.rpartition(".")[0]), ("first", first.name.rpartition(".")[2]),
              ("blocks", whole))
    rest = Op(f"{gather.name}.rest", "rest", "compute", "layout", (gather.name,), (gather.shape,),
              (far, gather.shape[1]), params=params, span=gather.span)

    def part(index: int, source: str, count: int) -> list[Op]:
        return [attrs.evolve(op, name=f"{op.name}.c{index}", origin=op.origin or op.name,
                             inputs=tuple(source if v == gather.name else f"{v}.c{index}" for v in op.inputs),
                             in_shapes=tuple((count, shape[1]) for shape in op.in_shapes), shape=(count, op.shape[1]))
                for op in chain]
    last = chain[-1]
    new = [*part(0, first.name, near), rest, *part(1, rest.name, far),
           Op(last.name, "merge", "compute", "layout", (f"{last.name}.c0", f"{last.name}.c1"),
              ((near, last.shape[1]), (far, last.shape[1])), last.shape, params=params, span=last.span)]
    split = {op.name for op in chain}
    out = []
    for op in fwd.ops:
        if op.name == last.name:
            out += new
        elif op.name not in split:
            out.append(op)
    return attrs.evolve(fwd, ops=tuple(out))


def _reads(fwd: LayerDag, op: Op, value: str) -> bool:
    """Whether ``op`` reads ``value``, itself or through the first stage of its group partition."""
    stages = {f"{op.name}.{INTER}", f"{op.name}.{INTRA}"}
    return value in op.inputs or any(value in o.inputs for o in fwd.ops if o.name in stages & set(op.inputs))


def _slices(chain: list[Op], value: str, shape, parts: int, dim: int, taken: set, span) -> list[Op]:
    blocks = _blocks(chain, shape, dim)
    result = []
    for i in range(parts):
        name, again = f"{value}.s{i}", 1
        while name in taken:  # another chain sliced the same value already
            name, again = f"{value}.s{i}_{again}", again + 1
        taken.add(name)
        result.append(Op(name, "slice", "compute", "layout", (value,), (shape,), _chunk_shape(shape, parts, dim),
                         params=(("index", i), ("parts", parts), ("dim", dim), ("blocks", blocks)), span=span))
    return result
