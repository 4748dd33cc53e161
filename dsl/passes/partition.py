"""Communication partitioning (Centauri, ASPLOS'24 §3.1): rewrite the forward layer DAG.

The program's ``partition`` block says how; the result is an ordinary forward DAG, so
autodiff, the strands checks, the planner, the simulator, the renderers and the
interpreter see ordinary operators:

* ``substitute ar as reduce_scatter + all_gather`` (primitive substitution, Table 2):
  an ``all_reduce`` becomes ``ar.rs`` (a reduce_scatter) then ``ar`` (an all_gather of it),
  the substitution that scales; the rooted ones (reduce + broadcast, gather + scatter) send
  everything through one rank and are refused. ``substitute rs1 as reduce`` and
  ``substitute ag1 as broadcast`` are Table 2's substitutions of distinct roots: one
  ``reduce`` (``rs1.rJ``, of rank block J, a slice ``rs1.sJ``) or ``broadcast`` (``ag1.bJ``)
  per rank J of the group, rank J its root, joined by a ``pick`` of this rank's reduce or a
  ``concat`` of the broadcasts in rank order that keeps the collective's name.
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
  named like the chain's last compute op puts the rows back in rank order;
  collectives that end the chain (``rs2`` after the MLP) run whole on the merged rows.
  ``chunk fc1 along outputs by stages`` does the same for ZeRO-3's weight gather under
  ``group weights``: fc1's weight is cut into one column block per dp rank, ``fc1.c0``
  computes on the columns the gather's first stage brought, ``fc1.c1`` on the others, and a
  ``merge`` along the features puts them back in order (:func:`~dhelix.dsl.passes.workload.by_weight_stages`).
  ``chunk ag1 + qkv by stages3`` (Algorithm 1's finer split, the gather inside the node
  first) cuts the cross-node stage in two and the chain in three: the node's blocks, this
  place's blocks of the other nodes, the rest; ``chunk fc1 along outputs by stages3`` does the
  same for ZeRO-3's weight gather under ``group weights`` (inside the node first). Over
  declared levels ``by stages`` makes one chunk per stage and ``by stages3`` one more
  (:func:`~dhelix.dsl.passes.workload.by_stages`).

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
  nodes, is refused. When the cluster declares levels, the collective runs one stage per
  level instead (:mod:`dhelix.dsl.passes.group_levels`).

Chunks of a weighted operator share its weight: their ``Op.origin`` names the written op
(along outputs each holds its own columns of it). The chunk statements' rewrites live in
:mod:`dhelix.dsl.passes.workload`; this module applies every statement in order.

One module, though over 500 lines, because it is one thing: the partition block's rewrite of the
forward DAG, its statements applied in order (the chunk statements' rewrites are in
:mod:`~dhelix.dsl.passes.workload`, a group partition over declared levels in
:mod:`~dhelix.dsl.passes.group_levels`).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError, ErrorCollector
from dhelix.dsl.core.mesh import INTER, INTRA, Mesh
from dhelix.dsl.core.oplib import DISTINCT_ROOTS, OUTPUTS, REGROUP, ROOT
from dhelix.dsl.core.program import AUTO, LayerDag, Op
from dhelix.dsl.core.wording import did_you_mean, join_words
from dhelix.dsl.passes.group_levels import SMALLEST_FIRST, checked_level, split_at_levels
from dhelix.dsl.passes.priority import PRIORITIES
from dhelix.dsl.passes.workload import (STAGES, STAGES3, by_stages, by_weight_stages, checked_chain,
                                        chunk_statements, chunked, is_auto, is_fine, is_stages, named_op)


#: ``group weights``: the ZeRO-3 weight all-gathers and gradient reduce-scatters
#: (:mod:`dhelix.dsl.passes.fsdp`), which this pass does not see, run hierarchically.
WEIGHTS = "weights"

#: The one substitution Centauri keeps for an all_reduce (Table 2).
SCALABLE = ("reduce_scatter", "all_gather")
_ROOTED = {"reduce", "broadcast", "gather", "scatter"}


def partition_forward(fwd: LayerDag, block: s.PartitionDef, env: Mapping[str, int], mesh: Mesh,
                      counts: Mapping[int, int | str] | None = None,
                      orders: Mapping[str, str] | None = None, substituted=()) -> LayerDag:
    """``fwd`` rewritten by the statements of ``block`` (substitutions first, then moved
    gathers, then chunks, then group partitions, which split the chunks' collectives too,
    then the chains split at their gathers' stages), with chunk counts
    evaluated over ``env`` and groups taken from ``mesh``. A ``by auto`` statement takes its
    count from ``counts`` (keyed by its index among the chunk statements; the planner
    chooses it, :mod:`dhelix.dsl.planner.chunking`); without one, or with 1, its chain stays
    whole. A group statement without ``first`` takes each collective's first sub-group from
    ``orders`` (by name; the planner's choice), else — when a ``by stages3`` chain splits
    it — its smallest stage first (inside the node; over declared levels the smallest
    level), else :func:`fewest_cross_bytes`. A
    ``substitute X as auto`` statement substitutes X (Table 2's scalable form for its kind)
    when X is in ``substituted`` (the planner's choice), else leaves it whole. Raises
    CheckError or ErrorGroup with every problem found, each located at the statement's word
    at fault."""
    errors = ErrorCollector()
    _check_backward(block, errors)
    _check_chunked_auto_substitutions(fwd, block, errors)
    seen: dict[str, s.Substitute] = {}
    for st in block.body:
        if isinstance(st, s.Substitute) and st.op in seen:
            errors.add(CheckError(f"'{st.op}' is already substituted", st.span_of("op"),
                                  [f"by the statement at {seen[st.op].span}; keep one substitution per collective"]))
        elif isinstance(st, s.Substitute):
            seen[st.op] = st
            fwd = _substitute(fwd, st, errors, st.op in substituted)
    moves = [st for st in block.body if isinstance(st, s.Move)]
    if moves:  # one rewrite: the gathers of every statement shard the same tokens
        fwd = _moved_later(fwd, moves, errors)
    claimed: dict[str, s.Chunk] = {}
    staged = []
    for index, st in enumerate(chunk_statements(block)):
        auto = (counts or {}).get(index, 1) if is_auto(st) else None
        if is_stages(st) or auto in (STAGES, STAGES3):
            staged.append((st, is_fine(st, auto)))  # after the group partitions, whose stages they split at
            continue
        # An auto chain is checked even while whole (count 1): its mistakes show at once.
        assert not isinstance(auto, str), f"an auto count {auto!r} past the stages"
        chain = checked_chain(fwd, st, env, claimed, errors, auto)
        if chain is not None and chain[1] > 1:
            fwd = chunked(fwd, *chain)
    # A gather split three ways runs its smallest stage first unless told otherwise: inside the
    # node, or over declared levels the smallest level.
    fine = {st.ops[0] for st, three in staged if three}
    failed: set[str] = set()  # collectives whose group statement has an error already
    grouped: dict[str, s.Group] = {}
    for st in block.body:
        if not isinstance(st, s.Group):
            continue
        if not _checked_first(st, mesh, errors):
            failed.update(st.ops)
            continue
        for i, name in enumerate(st.ops):
            if name in grouped:  # a second statement would be ignored (or split a split collective)
                errors.add(CheckError(f"'{name}' is already group-partitioned", st.span_of(f"ops.{i}"),
                                      [f"by the statement at {grouped[name].span}; keep one group statement "
                                       "per collective"]))
                continue
            grouped[name] = st
            if name == WEIGHTS and name not in {op.name for op in fwd.ops}:
                continue  # ZeRO-3's collectives: split by the fsdp pass
            found = len(errors.errors)
            fwd = _group_partition(fwd, name, st.span_of(f"ops.{i}"), mesh, errors,
                                   st.first or (orders or {}).get(name)
                                   or ((SMALLEST_FIRST if mesh.levels else INTRA) if name in fine else None))
            if len(errors.errors) > found:
                failed.add(name)
    for st, three in staged:
        if (WEIGHTS if st.dim == OUTPUTS else st.ops[0]) in failed:
            continue  # its gather's group statement is wrong: that error says what to fix
        if st.dim == OUTPUTS:
            fwd = _at_weight_stages(fwd, st, block, mesh, claimed, errors, orders, counts, three)
        else:
            fwd = by_stages(fwd, st, claimed, errors, three, mesh)
    errors.raise_if_any()
    return fwd


def weights_first(block: s.PartitionDef | None, orders: Mapping[str, str] | None,
                  counts: Mapping[int, int | str] | None = None) -> str | None:
    """The sub-group ZeRO-3's weight gathers run over first under ``group weights`` (the
    statement's ``first``, else the planner's choice, else ``intra`` where a gemm splits at
    its gather's stages three ways (``by stages3``, chosen or written: ``counts`` as for
    :func:`partition_forward`), else :func:`fewest_cross_bytes`), or None when no group
    statement names ``weights``."""
    for st in block.body if block is not None else ():
        if isinstance(st, s.Group) and WEIGHTS in st.ops:
            return st.first or (orders or {}).get(WEIGHTS) or (INTRA if three_way_weights(block, counts) else None) \
                or fewest_cross_bytes("all_gather")
    return None


def three_way_weights(block: s.PartitionDef | None, counts: Mapping[int, int | str] | None) -> bool:
    """Whether a chunk statement of ``block`` splits a gemm at its weight gather's stages
    three ways (``chunk G along outputs by stages3``, or ``by auto`` with the planner's
    ``stages3`` in ``counts``)."""
    return any(st.dim == OUTPUTS and is_fine(st, (counts or {}).get(index) if is_auto(st) else None)
               for index, st in enumerate(chunk_statements(block)))


def _at_weight_stages(fwd: LayerDag, st: s.Chunk, block: s.PartitionDef, mesh: Mesh, claimed: dict,
                      errors: ErrorCollector, orders: Mapping[str, str] | None, counts, three: bool) -> LayerDag:
    """``chunk G along outputs by stages`` (``three``: ``by stages3``): G split at the stages
    of its ZeRO-3 weight gather (:func:`~dhelix.dsl.passes.workload.by_weight_stages`), which
    ``group weights`` must split (node-local stage first for three ways)."""
    word = STAGES3 if three else STAGES
    first = weights_first(block, orders, counts)
    if first is None:
        errors.add(CheckError(f"'by {word}' along {OUTPUTS} computes on what the first stage of {st.ops[0]}'s "
                              "weight gather brought, and that gather has no stages", st.parts.span,
                              ["add: group weights (ZeRO-3's gathers then run across nodes and inside the node "
                               "one after the other)"]))
        return fwd
    axis = mesh.fsdp_axis()
    if first not in ORDERS or unsplittable(WEIGHTS, axis, mesh, st.span) is not None:
        return fwd  # the group statement's own error (or the fsdp pass's) says why
    if three and first != INTRA:
        errors.add(CheckError(f"'by {STAGES3}' splits a weight gather whose node-local stage runs first, and "
                              "ZeRO-3's gathers run across nodes first", st.parts.span,
                              ["write: group weights first intra (Centauri Algorithm 1, lines 14-20: the finer "
                               "split of the cross-node stage follows the intra-node one)",
                               f"or 'by {STAGES}' for the two-way split in this order"]))
        return fwd
    return by_weight_stages(fwd, st, claimed, errors, axis, first, mesh.size(axis), mesh.size(f"{axis}.{first}"),
                            mesh.size(f"{axis}.{INTER}") if three else 0)


def _check_chunked_auto_substitutions(fwd: LayerDag, block: s.PartitionDef, errors: ErrorCollector) -> None:
    """Errors for a chunk statement naming a collective that ``substitute X as auto`` leaves
    to the planner: a chunked collective has no one op left to substitute."""
    auto = {st.op: st for st in block.body if isinstance(st, s.Substitute) and is_auto_substitution(st)}
    for st in chunk_statements(block):
        for i, name in enumerate(st.ops):
            if name not in auto:
                continue
            op = next((o for o in fwd.ops if o.name == name), None)
            form = scalable_form(op.op) if op is not None else None
            written = f"substitute {name} as {' + '.join(form)}" if form else f"substitute {name} as …"
            errors.add(CheckError(f"cannot chunk '{name}': 'substitute {name} as auto' leaves its substitution to "
                                  "the planner, which cannot substitute a chunked collective",
                                  st.span_of(f"ops.{i}"),
                                  [f"the substitution is at {auto[name].span}; leave one of the two statements "
                                   f"out, or write the substitution out ('{written}') and chunk the ops it leaves"]))


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
    first_line = statements[0].span.line if statements and statements[0].span else "?"
    for st in statements[1:]:
        errors.add(CheckError("a second 'backward … first' statement", st.span,
                              [f"the first is at line {first_line}: one priority holds for the layer"]))


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


def _checked_first(st: s.Group, mesh: Mesh, errors: ErrorCollector) -> bool:
    if mesh.levels and st.ops != (WEIGHTS,):  # ZeRO-3's gathers split at the node: inter, intra
        return st.first is None or checked_level(st, mesh, errors)
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
            op = named_op(fwd, name, span, errors)
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
    if mesh.levels:
        return split_at_levels(fwd, op, targets, span, mesh, errors, first)
    assert op.axis is not None, "a collective has its axis"
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

def is_auto_substitution(st: s.Substitute) -> bool:
    """Whether ``st`` leaves its substitution to the planner (``substitute X as auto``)."""
    return st.into == (AUTO,)


def scalable_form(kind: str) -> tuple[str, ...] | None:
    """What Table 2 substitutes collective ``kind`` by where it scales, or None."""
    return SCALABLE if kind == "all_reduce" else ((DISTINCT_ROOTS[kind],) if kind in DISTINCT_ROOTS else None)


def _substitute(fwd: LayerDag, st: s.Substitute, errors: ErrorCollector, chosen: bool = False) -> LayerDag:
    if st.op in fwd.elided:
        return fwd  # over a size-1 axis: the identity, nothing to substitute
    if st.op == WEIGHTS and WEIGHTS not in {op.name for op in fwd.ops}:
        # Hybrid sharding's all-reduce across replicas (not a layer op: the fsdp pass checks it).
        if st.into != SCALABLE:
            errors.add(_bad_target(st))
        return fwd
    op = named_op(fwd, st.op, st.span_of("op"), errors)
    if op is None:
        return fwd
    if is_auto_substitution(st):
        form = scalable_form(op.op) if op.kind == "comm" else None
        if form is None:
            errors.add(CheckError(f"cannot substitute '{op.name}': it is {op.op}, not an all_reduce, reduce_scatter "
                                  "or all_gather", st.span_of("op"), [_SUBSTITUTIONS]))
            return fwd
        if not chosen:
            return fwd  # whole until the planner substitutes it (or prunes it)
        st = attrs.evolve(st, into=form)
    if op.kind == "comm" and op.op in DISTINCT_ROOTS:
        return _distinct_roots(fwd, op, st, errors)
    if op.kind != "comm" or op.op != "all_reduce":
        what = "a collective" if op.kind == "comm" else f"a {op.kind} operator"
        errors.add(CheckError(f"cannot substitute '{op.name}': it is {op.op}, {what}, not an all_reduce, "
                              f"reduce_scatter or all_gather", st.span_of("op"), [_SUBSTITUTIONS]))
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
    for st, i, name in [(statement, i, name) for statement in statements for i, name in enumerate(statement.ops)]:
        span = st.span_of(f"ops.{i}")
        if name in fwd.elided:
            continue  # over a size-1 axis: the identity, nothing to move
        op = named_op(fwd, name, span, errors)
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


_SUBSTITUTIONS = ("primitive substitution replaces an all_reduce by reduce_scatter + all_gather, a "
                  "reduce_scatter by reduces of distinct roots ('as reduce'), an all_gather by broadcasts of "
                  "distinct roots ('as broadcast') (Centauri Table 2)")


def _distinct_roots(fwd: LayerDag, op: Op, st: s.Substitute, errors: ErrorCollector) -> LayerDag:
    """``fwd`` with reduce_scatter or all_gather ``op`` replaced by one rooted collective per
    rank of its group (Table 2): a reduce_scatter by ``op.sJ`` (rank block J of its input, a
    slice) reduced to root J by ``op.rJ``, and a ``pick`` named ``op`` of the one whose root
    is this rank; an all_gather by ``op.bJ`` (root J's input broadcast) joined by a
    ``concat`` named ``op`` in rank order. Readers are unchanged."""
    rooted = DISTINCT_ROOTS[op.op]
    if st.into != (rooted,):
        errors.add(_bad_rooted_target(st, op, rooted))
        return fwd
    size, (rows, cols) = op.group_size, op.in_shapes[0]
    common: dict[str, Any] = dict(op=rooted, op_class=rooted, origin=op.name)
    if op.op == "all_gather":
        parts = [attrs.evolve(op, name=f"{op.name}.b{j}", shape=(rows, cols), params=op.params + ((ROOT, j),),
                              **common) for j in range(size)]
        join = Op(op.name, "concat", "compute", "layout", tuple(p.name for p in parts), ((rows, cols),) * size,
                  op.shape, params=(("parts", size), ("dim", 0), ("blocks", 1)), span=op.span)
        return attrs.evolve(fwd, ops=tuple(new for o in fwd.ops for new in ([*parts, join] if o is op else [o])))
    block = (rows // size, cols)
    slices = [Op(f"{op.name}.s{j}", "slice", "compute", "layout", op.inputs, op.in_shapes, block,
                 params=(("index", j), ("parts", size), ("dim", 0), ("blocks", 1)), span=op.span)
              for j in range(size)]
    parts = [attrs.evolve(op, name=f"{op.name}.r{j}", inputs=(piece.name,), in_shapes=(block,), shape=block,
                          params=op.params + ((ROOT, j),), **common) for j, piece in enumerate(slices)]
    pick = Op(op.name, "pick", "compute", "layout", tuple(p.name for p in parts), (block,) * size, block,
              params=(("axis", op.axis),), span=op.span)
    new = [*slices, *parts, pick]
    return attrs.evolve(fwd, ops=tuple(n for o in fwd.ops for n in (new if o is op else [o])))


def _bad_rooted_target(st: s.Substitute, op: Op, rooted: str) -> CheckError:
    written = " + ".join(st.into)
    span = st.span_of("into.0")
    if len(st.into) > 1 and set(st.into) & _ROOTED:
        return CheckError(f"rooted substitution '{written}' of {op.op} '{op.name}' is not supported", span, [
            "a rooted pair (reduce + scatter, gather + broadcast) sends the whole tensor through one root "
            "rank, so it scales worse than the collective it replaces; Centauri prunes it (Table 2)",
            f"write: substitute {op.name} as {rooted} (one {rooted} per rank, each rank a root)"])
    return CheckError(f"no substitution '{written}' for {op.op} '{op.name}'", span,
                      [f"the scalable substitution is: substitute {op.name} as {rooted} (one {rooted} per rank, "
                       "each rank a root; Centauri Table 2)"])


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
