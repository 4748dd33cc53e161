"""Centauri's workload partition (ASPLOS'24 §3.1.3, Table 3; Algorithm 1's uneven split):
the ``chunk`` statements of a partition block, as :func:`~dhelix.dsl.passes.partition.partition_forward`
applies them to the forward layer DAG — a chain of a collective and the compute that depends on
it cut into chunks along tokens or features, a gemm cut over its weight's column blocks (``along
outputs``, ZeRO-3's gathers), or a chain split at the stages of a group-partitioned all_gather
(``by stages``). The statements' meaning is described in that module's docstring.

One module, though over 500 lines, because it is one thing: the chunk statements' rewrites, each
cutting one chain (along tokens, features or outputs, or at a gather's stages), sharing the
chain's checks and the chunks' naming.
"""

from __future__ import annotations

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError, ErrorCollector
from dhelix.dsl.core.mesh import INTER, INTRA
from dhelix.dsl.core.oplib import CD, OD, OUTPUTS, PARTITION_DIMS, dimension_split
from dhelix.dsl.core.program import AUTO, COLUMNS, STAGED, LayerDag, Op
from dhelix.dsl.core.wording import did_you_mean, join_words
from dhelix.dsl.frontend.exprs import evaluate


def is_auto(st: s.Chunk) -> bool:
    """Whether chunk statement ``st`` leaves its count to the planner (``by auto``)."""
    return isinstance(st.parts, s.Name) and st.parts.id == AUTO


#: ``chunk ag1 + qkv by stages``: the chain split unevenly at the stages of its
#: group-partitioned all_gather (Centauri's Algorithm 1, lines 8-22); also a count the
#: planner may choose for ``by auto``.
STAGES = "stages"


#: ``chunk ag1 + qkv by stages3``: Algorithm 1's finer three-way split (lines 19-20) of a
#: gather whose node-local stage runs first: the node's blocks, then the blocks of this rank's
#: place on the other nodes (a cross-node gather of one block each), then the rest.
STAGES3 = "stages3"


def is_stages(st: s.Chunk) -> bool:
    """Whether chunk statement ``st`` splits its chain at its gather's stages (``by stages``
    or ``by stages3``)."""
    return isinstance(st.parts, s.Name) and st.parts.id in (STAGES, STAGES3)


def is_fine(st: s.Chunk, auto: int | str | None = None) -> bool:
    """Whether ``st`` splits its chain three ways (``by stages3``, or the planner's choice
    ``auto`` for a ``by auto`` statement)."""
    return (isinstance(st.parts, s.Name) and st.parts.id == STAGES3) or auto == STAGES3


def chunk_statements(block: s.PartitionDef | None) -> list[s.Chunk]:
    """The chunk statements of ``block`` in order (their index keys ``counts``)."""
    return [st for st in block.body if isinstance(st, s.Chunk)] if block is not None else []


def checked_chain(fwd: LayerDag, st: s.Chunk, env, claimed: dict, errors: ErrorCollector,
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
        op = named_op(fwd, name, span, errors)
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


def named_op(fwd: LayerDag, name: str, span, errors: ErrorCollector) -> Op | None:
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


def chunked(fwd: LayerDag, ops: list[Op], parts: int, dim: int | str) -> LayerDag:
    """``fwd`` with the chain ``ops`` replaced, at its last op's place, by slices of its
    outside inputs, the chunk ops (chunk-major, the chain's head collectives first for every
    chunk) and the concat of the last op's chunks
    (along ``OUTPUTS``: the gemm's chunks, each on the whole input with its own columns)."""
    if dim == OUTPUTS:
        return _by_columns(fwd, ops[0], parts)
    assert isinstance(dim, int), f"no partition dimension {dim!r}"
    names = {op.name for op in ops}
    taken = {op.name for op in fwd.ops} | {fwd.input}
    slices: dict[str, list[Op]] = {}
    new: list[Op] = []
    for op in ops:
        for value, shape in zip(op.inputs, op.in_shapes, strict=True):
            if value not in names and value not in slices:
                slices[value] = _slices(ops, value, shape, parts, dim, taken, op.span)
                new += slices[value]
    # A lane runs its ops in their listed order, so a collective that reads only the chain's
    # slices (its head gather) goes first for every chunk: chunk i + 1's gather then runs
    # under chunk i's compute instead of waiting behind chunk i's closing reduce_scatter.
    heads = [op for op in ops if op.kind == "comm" and not any(v in names for v in op.inputs)]
    order = [(i, op) for op in heads for i in range(parts)]
    order += [(i, op) for i in range(parts) for op in ops if op not in heads]
    for i, op in order:
        inputs = tuple(f"{v}.c{i}" if v in names else slices[v][i].name for v in op.inputs)
        new.append(attrs.evolve(op, name=f"{op.name}.c{i}", inputs=inputs, origin=op.origin or op.name,
                                in_shapes=tuple(_chunk_shape(x, parts, dim) for x in op.in_shapes),
                                shape=_chunk_shape(op.shape, parts, dim)))
    last = ops[-1]
    new.append(Op(last.name, "concat", "compute", "layout", tuple(f"{last.name}.c{i}" for i in range(parts)),
                  (_chunk_shape(last.shape, parts, dim),) * parts, last.shape,
                  params=(("parts", parts), ("dim", dim), ("blocks", _blocks(ops, last.shape, dim))),
                  span=last.span))
    return _replaced(fwd, names, last.name, new)


def _replaced(fwd: LayerDag, names, last: str, new: list[Op]) -> LayerDag:
    """``fwd`` without the ops ``names``, ``new`` in the place of ``last`` (one of them)."""
    out = []
    for op in fwd.ops:
        if op.name == last:
            out += new
        elif op.name not in names:
            out.append(op)
    return attrs.evolve(fwd, ops=tuple(out))


def _by_columns(fwd: LayerDag, op: Op, parts: int) -> LayerDag:
    """``fwd`` with gemm ``op`` split into ``parts`` gemms over its weight's column blocks
    (``op.c0`` …, :attr:`Op.columns`), joined by a concat along the features that keeps its name."""
    rows, cols = op.shape
    assert op.weight is not None, "a gemm split by columns has a weight"
    chunks = [attrs.evolve(op, name=f"{op.name}.c{i}", origin=op.origin or op.name, shape=(rows, cols // parts),
                           weight=(op.weight[0], op.weight[1] // parts), params=op.params + ((COLUMNS, (i, parts)),))
              for i in range(parts)]
    join = Op(op.name, "concat", "compute", "layout", tuple(c.name for c in chunks), (chunks[0].shape,) * parts,
              op.shape, params=(("parts", parts), ("dim", 1), ("blocks", 1)), span=op.span)
    return _replaced(fwd, {op.name}, op.name, [*chunks, join])


def by_stages(fwd: LayerDag, st: s.Chunk, claimed: dict, errors: ErrorCollector, fine: bool,
              mesh) -> LayerDag:
    """``fwd`` with the chain of ``st`` (a group-partitioned all_gather, token-wise compute,
    then maybe collectives) split unevenly: chunk 0 computes on the rank blocks the gather's
    first stage brought (``ag.inter`` or ``ag.intra``), chunk 1 on the others (``ag.rest``,
    taken from the whole gather), and a ``merge`` named like the chain's last compute op puts
    the rows back in rank order, where the collectives that end the chain (the MLP's
    reduce_scatter) read it whole. ``fine``: three ways (:func:`_split_in_three`), which needs
    the node-local stage first. Over declared levels (``mesh``'s) one chunk per stage
    (:func:`_split_at_level_stages`). ``fwd`` unchanged after recording errors."""
    found = _stage_chain(fwd, st, claimed, errors)
    if found is None:
        return fwd
    gather, stages, chain, tail = found
    first = stages[0]
    leveled = first.name.rpartition(".")[2] not in (INTER, INTRA)
    if leveled:
        axes = [stage.axis for stage in stages] + [gather.axis]
        if fine and [mesh.stride(axis) for axis in axes] != sorted(mesh.stride(axis) for axis in axes):
            levels = sorted(axes, key=mesh.stride)
            errors.add(CheckError(f"'by {STAGES3}' splits a gather whose stages run smallest level first, and "
                                  f"{gather.name} runs {join_words([a.rpartition('.')[2] for a in axes])} in that "
                                  "order", st.parts.span,
                                  [f"leave 'first' out of group {gather.name}: under 'by {STAGES3}' it then runs "
                                   f"{join_words([a.rpartition('.')[2] for a in levels])} (Centauri Algorithm 1, "
                                   "lines 14-20: the finer split of the slowest stage follows the faster ones)",
                                   f"or 'by {STAGES}' for one chunk per stage in this order"]))
            return fwd
        claimed.update({op.name: st for op in [gather, *chain, *tail]})
        return _split_at_level_stages(fwd, gather, stages, chain, fine)
    if fine and not first.name.endswith(f".{INTRA}"):
        errors.add(CheckError(f"'by {STAGES3}' splits a gather whose node-local stage runs first, and {gather.name} "
                              "runs across nodes first", st.parts.span,
                              [f"write: group {gather.name} first intra (Centauri Algorithm 1, lines 14-20: the "
                               "finer split of the cross-node stage follows the intra-node one)",
                               f"or 'by {STAGES}' for the two-way split in this order"]))
        return fwd
    claimed.update({op.name: st for op in [gather, *chain, *tail]})
    return (_split_in_three if fine else _split_at_stages)(fwd, gather, first, chain)


def by_weight_stages(fwd: LayerDag, st: s.Chunk, claimed: dict, errors: ErrorCollector, axis: str,
                     first: str, pieces: int, near: int, nodes: int = 0) -> LayerDag:
    """``fwd`` with the gemm of ``st`` (``chunk fc1 along outputs by stages``) split at the
    stages of its ZeRO-3 weight gather under ``group weights`` (Algorithm 1's uneven split
    for FSDP): its weight is cut into ``pieces`` column blocks, one per rank of ``axis``
    (``dp`` or ``dp.shard``), and the gather's first stage (over ``axis.<first>``) brings
    ``near`` of them; ``fc1.c0`` computes on those columns while the second stage runs,
    ``fc1.c1`` on the others, and a ``merge`` along the features named ``fc1`` puts the
    columns back in order. ``nodes`` > 0 (``by stages3``, the node-local stage first, over
    ``nodes`` nodes): three ways (Algorithm 1, lines 19-20), ``fc1.c0`` on the node's blocks,
    ``fc1.c1`` on this rank's place's blocks of the other nodes (a cross-node gather of one
    piece each, :mod:`dhelix.dsl.passes.fsdp`), ``fc1.c2`` on the rest. ``fwd`` unchanged
    after recording errors."""
    name, span = st.ops[0], st.span_of("ops.0")
    word = STAGES3 if nodes else STAGES
    if len(st.ops) > 1:
        errors.add(CheckError(f"'along {OUTPUTS}' chunks one gemm, not a chain of {len(st.ops)} operators",
                              st.span_of("ops.1"), [f"write one statement per gemm: chunk {name} along {OUTPUTS} "
                                                    f"by {word}"]))
        return fwd
    op = named_op(fwd, name, span, errors)
    if op is None:
        return fwd
    if name in claimed:
        errors.add(CheckError(f"'{name}' is already chunked", span,
                              [f"by the chunk statement at {claimed[name].span}"]))
        return fwd
    split, why = dimension_split(op.op, OUTPUTS)
    if split != OD or not op.weight:
        errors.add(CheckError(f"cannot chunk {name} ({op.op}) along {OUTPUTS} by {word}", span,
                              [why or f"{name} has no weight"]))
        return fwd
    rows, cols = op.shape
    if cols % pieces:
        errors.add(CheckError(f"the {cols} output features of {name} do not split into {pieces} column blocks, one "
                              f"per rank of {axis}", st.parts.span,
                              [f"'by {word}' along {OUTPUTS} shards {name}'s weight by column blocks, so that the "
                               "first stage of its gather brings whole columns to compute on"]))
        return fwd
    claimed[name] = st
    width = cols // pieces
    counts = (near * width, (nodes - 1) * width, cols - (near + nodes - 1) * width) if nodes else \
        (near * width, cols - near * width)
    chunks = [attrs.evolve(op, name=f"{name}.c{i}", origin=op.origin or name, shape=(rows, n),
                           weight=(*op.weight[:-1], n), params=op.params + ((STAGED, (i, first, cols)),))
              for i, n in enumerate(counts)]
    join = Op(name, "merge", "compute", "layout", tuple(c.name for c in chunks), tuple(c.shape for c in chunks),
              op.shape, params=(("axis", axis), ("first", first), ("blocks", pieces), ("dim", 1)), span=op.span)
    return _replaced(fwd, {name}, name, [*chunks, join])


def _stage_chain(fwd: LayerDag, st: s.Chunk, claimed: dict, errors: ErrorCollector):
    """(the gather, its first stage, the compute to split, the collectives that end the
    chain) of ``st``, or None after recording errors located at the statement's words;
    those of a gather without stages say it "has no stages" (``by auto`` leaves it out)."""
    spans = {name: st.span_of(f"ops.{i}") for i, name in enumerate(st.ops)}
    word = st.parts.id if isinstance(st.parts, s.Name) and is_stages(st) else STAGES  # stages or stages3, as written
    if st.dim not in (None, PARTITION_DIMS[0]):
        errors.add(CheckError(f"'by {word}' splits the tokens a gather brings, not its {st.dim}",
                              st.span_of("dim"), ["leave 'along' out, or chunk by a count"]))
        return None
    name = st.ops[0]
    lead = f"'by {word}' computes on what the first stage of a group-partitioned all_gather brought, and " \
        f"{name} has no stages"
    if name in fwd.elided:
        errors.add(CheckError(f"{lead}: it runs over an axis of size 1", spans[name],
                              ["a collective over one rank is the identity: there is nothing to split"]))
        return None
    gather = named_op(fwd, name, spans[name], errors)
    chain = [op for other in st.ops[1:] if (op := named_op(fwd, other, spans[other], errors)) is not None]
    if gather is None or len(chain) < len(st.ops) - 1:
        return None
    stages = _earlier_stages(fwd, gather) if gather.op == "all_gather" else []
    if not stages:
        what = f"it is {gather.op}, not an all_gather" if gather.op != "all_gather" else "it is not group-partitioned"
        notes = [f"add: group {name}"] if gather.op == "all_gather" else []
        errors.add(CheckError(f"{lead}: {what}", spans[name],
                              notes + ["the chain starts with the gather (Centauri Algorithm 1: the uneven "
                                       "workload partition of a hierarchical all_gather)"]))
        return None
    order = [o.name for o in fwd.ops]
    chain.sort(key=lambda o: order.index(o.name))
    tail: list[Op] = []  # the collectives that end the chain: they run whole on the merged rows
    while chain and chain[-1].kind == "comm":
        tail.insert(0, chain.pop())
    if not chain:
        errors.add(CheckError(f"'by {word}' needs the compute after {name}", spans[name],
                              [f"name the operators that read it: chunk {name} + … by {word}"]))
        return None
    found = len(errors.errors)
    for op in [gather, *chain, *tail]:
        if op.name in claimed:
            errors.add(CheckError(f"'{op.name}' is already chunked", spans[op.name],
                                  [f"by the chunk statement at {claimed[op.name].span}"]))
    for op in chain:
        split, why = dimension_split(op.op, "tokens")
        if op.kind != "compute" or split != OD:
            errors.add(CheckError(f"cannot split {op.name} ({op.op}) by {word}: it is not token-wise compute",
                                  spans[op.name], ([why] if why else []) + [
                                      "the stages' chunks are rows of the gathered tokens: each operator between "
                                      "the gather and the collectives that may end the chain must compute row by "
                                      "row"]))
    inside = {o.name for o in [gather, *chain]}
    for before, op in zip([chain[-1], *tail], tail):
        if not _reads(fwd, op, before.name):
            errors.add(CheckError(f"{op.name} does not read {before.name}", spans[op.name],
                                  [f"the collectives that end a chain split by {word} read what comes before them"]))
    for op in chain:
        outside = [v for v in op.inputs if v not in inside]
        if outside:
            errors.add(CheckError(f"{op.name} reads {outside[0]} from outside the chain", spans[op.name],
                                  [f"'by {word}' splits the rows of {name} only; end the chain before "
                                   f"{op.name}"]))
    if len(errors.errors) > found or not _connected(fwd, [gather, *chain], st, errors):
        return None
    return gather, stages, chain, tail


def _earlier_stages(fwd: LayerDag, gather: Op) -> list[Op]:
    """The stages of group-partitioned all_gather ``gather`` before its last (which keeps its
    name), in the order they run: ``[AG.inter]`` or ``[AG.intra]``, or over declared levels
    one per level but the last (``AG.cluster``, ``AG.node``); [] when it is not split."""
    ops = {op.name: op for op in fwd.ops}
    stages: list[Op] = []
    source = gather
    while source.inputs and source.inputs[0].startswith(f"{gather.name}.") and \
            ops.get(source.inputs[0]) is not None and ops[source.inputs[0]].op == "all_gather":
        source = ops[source.inputs[0]]
        stages.insert(0, source)
    return stages


def _others(name: str, source: Op, axis, groups: int, span) -> Op:
    """An ``others`` op: ``source``'s rank blocks without the group at this rank's index on
    ``axis`` (a sub-axis, or a tuple of them), one of ``groups`` groups."""
    cols = source.shape[1]
    return Op(name, "others", "compute", "layout", (source.name,), (source.shape,),
              (source.shape[0] // groups * (groups - 1), cols), params=(("axis", axis), ("groups", groups)),
              span=span)


def _chunk_of(chain: list[Op], gather: str, index: int, source: str, rows: int) -> list[Op]:
    """Chunk ``index`` of ``chain`` (token-wise ops after all_gather ``gather``): each op on
    ``rows`` rows, the gather's output read from ``source`` instead."""
    return [attrs.evolve(op, name=f"{op.name}.c{index}", origin=op.origin or op.name,
                         inputs=tuple(source if v == gather else f"{v}.c{index}" for v in op.inputs),
                         in_shapes=tuple((rows, shape[1]) for shape in op.in_shapes), shape=(rows, op.shape[1]))
            for op in chain]


def _split_at_stages(fwd: LayerDag, gather: Op, first: Op, chain: list[Op]) -> LayerDag:
    """The rewrite of :func:`by_stages` for a checked chain."""
    rows, whole = first.in_shapes[0][0], first.group_size * gather.group_size
    near, far = rows * first.group_size, rows * (whole - first.group_size)
    assert first.axis is not None, "a gather's stage has its axis"
    params = (("axis", first.axis.rpartition(".")[0]), ("first", first.name.rpartition(".")[2]),
              ("blocks", whole))
    rest = Op(f"{gather.name}.rest", "rest", "compute", "layout", (gather.name,), (gather.shape,),
              (far, gather.shape[1]), params=params, span=gather.span)
    last = chain[-1]
    new = [*_chunk_of(chain, gather.name, 0, first.name, near), rest, *_chunk_of(chain, gather.name, 1, rest.name, far),
           Op(last.name, "merge", "compute", "layout", (f"{last.name}.c0", f"{last.name}.c1"),
              ((near, last.shape[1]), (far, last.shape[1])), last.shape, params=params, span=last.span)]
    return _replaced(fwd, {op.name for op in chain}, last.name, new)


def _split_in_three(fwd: LayerDag, gather: Op, first: Op, chain: list[Op]) -> LayerDag:
    """The rewrite of :func:`by_stages` three ways (Algorithm 1, lines 19-20: granularity
    [intra/world, (inter-1)/world, the rest]) for a checked chain whose gather runs inside the
    node first (``first``, ``AG.intra``). The cross-node stage is cut in two: ``AG.place``
    gathers this rank's own block from its place on every node (one block each across), and
    ``AG`` gathers the node-mates' blocks (``AG.mates``, the first stage's others) from every
    node. Chunk 0 computes on the node's blocks, chunk 1 on the other nodes' blocks of this
    place (``AG.near``), chunk 2 on the rest (``AG.rest``); a ``merge`` of the three puts the
    rows back in rank order. The cross-node bytes are those of the two-way split."""
    (rows, cols), intra, inter = first.in_shapes[0], first.group_size, gather.group_size
    assert first.axis is not None, "a gather's stage has its axis"
    base = first.axis.rpartition(".")[0]
    place = attrs.evolve(gather, name=f"{gather.name}.place", inputs=first.inputs, in_shapes=first.in_shapes,
                         shape=(rows * inter, cols))
    near = _others(f"{gather.name}.near", place, gather.axis, inter, gather.span)
    mates = _others(f"{gather.name}.mates", first, first.axis, intra, gather.span)
    second = attrs.evolve(gather, inputs=(mates.name,), in_shapes=(mates.shape,), shape=(mates.shape[0] * inter, cols))
    rest = _others(f"{gather.name}.rest", second, gather.axis, inter, gather.span)

    def part(index: int, source: Op) -> list[Op]:
        return _chunk_of(chain, gather.name, index, source.name, source.shape[0])
    last = chain[-1]
    sources = (first, near, rest)
    merge = Op(last.name, "merge", "compute", "layout", tuple(f"{last.name}.c{i}" for i in range(3)),
               tuple((s.shape[0], last.shape[1]) for s in sources), last.shape,
               params=(("axis", base), ("first", INTRA), ("blocks", intra * inter)), span=last.span)
    new = [place, *part(0, first), near, mates, second, *part(1, near), rest, *part(2, rest), merge]
    ops = []
    for op in fwd.ops:
        if op.name == gather.name:
            continue  # its place: the second cross-node stage, with the chunks
        ops += new if op.name == last.name else [] if op in chain else [op]
    return attrs.evolve(fwd, ops=tuple(ops))


def _split_at_level_stages(fwd: LayerDag, gather: Op, stages: list[Op], chain: list[Op], fine: bool) -> LayerDag:
    """The rewrite of :func:`by_stages` over declared levels (Centauri §3.1.2's d-dimensional
    group, Algorithm 1's uneven split generalised): one chunk per stage, each on the rank
    blocks its stage brought that the stages before had not — chunk 0 on the first stage's
    (``AG.<level>``), chunk k on ``AG.<level>.new`` (an ``others`` of stage k: its blocks
    without the copy of what this rank held), the last on ``AG.rest`` (the whole gather's
    blocks the earlier stages did not bring). ``fine`` (the stages run smallest level first):
    the last stage is cut in two as in :func:`_split_in_three` — ``AG.place`` (this rank's own
    block from its place in every unit of the largest level), ``AG`` over the mates (the
    earlier stages' blocks without its own) — and its chunk in two (``AG.near``, ``AG.rest``).
    A ``merge`` named like the chain's last compute op puts the rows back in rank order."""
    assert gather.axis is not None and all(op.axis is not None for op in stages), "gathers have their axes"
    cols, base = gather.shape[1], gather.axis.rpartition(".")[0]
    order = tuple(str(op.axis).rpartition(".")[2] for op in [*stages, gather])
    whole = 1
    for op in [*stages, gather]:
        whole *= op.group_size

    def others(name: str, source: Op, axis, groups: int) -> Op:
        return _others(name, source, axis, groups, gather.span)
    sources = [stages[0], *(others(f"{op.name}.new", op, op.axis, op.group_size) for op in stages[1:])]
    extra: list[Op] = []  # the ops the last chunks read that are not sources themselves
    params = (("axis", base), ("order", order), ("blocks", whole))
    if fine:
        rows = stages[0].in_shapes[0][0]
        place = attrs.evolve(gather, name=f"{gather.name}.place", inputs=stages[0].inputs,
                             in_shapes=stages[0].in_shapes, shape=(rows * gather.group_size, cols))
        mates = others(f"{gather.name}.mates", stages[-1], tuple(op.axis for op in stages),
                       stages[-1].shape[0] // rows)
        second = attrs.evolve(gather, inputs=(mates.name,), in_shapes=(mates.shape,),
                              shape=(mates.shape[0] * gather.group_size, cols))
        extra = [place, mates, second]
        sources += [others(f"{gather.name}.near", place, gather.axis, gather.group_size),
                    others(f"{gather.name}.rest", second, gather.axis, gather.group_size)]
    else:
        far = gather.shape[0] - stages[-1].shape[0]
        sources.append(Op(f"{gather.name}.rest", "rest", "compute", "layout", (gather.name,), (gather.shape,),
                          (far, cols), params=params, span=gather.span))
    last = chain[-1]
    merge = Op(last.name, "merge", "compute", "layout", tuple(f"{last.name}.c{i}" for i in range(len(sources))),
               tuple((source.shape[0], last.shape[1]) for source in sources), last.shape, params=params,
               span=last.span)
    new = [*extra, *(op for index, source in enumerate(sources)
                     for op in ([] if source is stages[0] else [source])
                     + _chunk_of(chain, gather.name, index, source.name, source.shape[0])), merge]
    ops = []
    for op in fwd.ops:
        if fine and op.name == gather.name:
            continue  # its place: the second stage over the mates, with the chunks
        ops += new if op.name == last.name else [] if op in chain else [op]
    return attrs.evolve(fwd, ops=tuple(ops))


def _reads(fwd: LayerDag, op: Op, value: str) -> bool:
    """Whether ``op`` reads ``value``, itself or through the earlier stages of its group
    partition (``rs2.intra``; over levels ``rs2.island``, ``rs2.node``)."""
    ops = {o.name: o for o in fwd.ops}
    while value not in op.inputs and op.inputs and op.inputs[0].startswith(f"{op.name.partition('.')[0]}.") \
            and op.inputs[0] in ops:
        op = ops[op.inputs[0]]
    return value in op.inputs


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
