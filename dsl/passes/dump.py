"""Deterministic text dumps of each stage's result, for `dhelix check --dump` and goldens."""

from __future__ import annotations

import functools

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.frontend.exprs import format_expr
from dhelix.dsl.core.program import LayerDag, Op, Program
from dhelix.dsl.core.schedule import format_lowered
from dhelix.dsl.frontend.fmt import format_statement
from dhelix.dsl.passes.strands import select
from dhelix.dsl.passes.unittime import describe, unit_time


def dump_syntax(module: s.Module) -> str:
    """An indented tree of the syntax nodes (spans left out)."""
    lines: list[str] = []
    _tree(module, 0, lines)
    return "\n".join(lines) + "\n"


def _tree(value, depth: int, lines: list[str], label: str = "") -> None:
    pad = "  " * depth + (f"{label}: " if label else "")
    if isinstance(value, (s.Int, s.Name, s.BinOp, s.Neg, s.Call)):
        lines.append(pad + format_expr(value))
    elif isinstance(value, s.Node):
        fields = [f for f in attrs.fields(type(value)) if f.eq]
        scalars = [f"{f.name}={getattr(value, f.name)!r}" for f in fields
                   if isinstance(getattr(value, f.name), (str, int, type(None)))]
        lines.append(pad + type(value).__name__ + (f" {' '.join(scalars)}" if scalars else ""))
        for f in fields:
            child = getattr(value, f.name)
            if isinstance(child, s.Node):
                _tree(child, depth + 1, lines, f.name)
            elif isinstance(child, tuple):
                for item in child:
                    _tree(item, depth + 1, lines, f.name)
    else:
        lines.append(pad + repr(value))


def dump_modules(modules: list[s.Module]) -> str:
    """Each loaded file (imports first) with the names it defines."""
    lines = []
    for module in modules:
        path = module.span.source.path if module.span else "<empty>"
        lines.append(path)
        for item in module.items:
            name = getattr(item, "name", None) or getattr(item, "kind", None) or getattr(item, "path", "")
            lines.append(f"  {type(item).__name__} {name}")
    return "\n".join(lines) + "\n"


def dump_config(program: Program) -> str:
    """The checked configuration: definitions, model, cluster, mesh groups, fold, strands."""
    lines = [f"layers: {', '.join(l.name for l in program.layers) or '-'}",
             f"pipelines: {', '.join(p.name for p in program.pipelines) or '-'}"]
    if program.model is None:
        return "\n".join(lines + ["(a library file: no model)"]) + "\n"
    m, c, mesh, train, fold = program.model, program.cluster, program.mesh, program.train, program.fold
    assert c is not None and mesh is not None and train is not None and fold is not None, "a checked model"
    lines.append(f"model {m.name}: layer {m.layer}, dtype {m.dtype}")
    lines += [f"  {k} = {v}" for k, v in m.settings]
    lines.append(f"cluster: {c.nodes} nodes x {c.gpus_per_node} GPUs, profile {c.profile or '-'}"
                 + (", levels " + " < ".join(f"{level} {gpus}" for level, gpus in c.levels) if c.levels else ""))
    lines.append(f"mesh: {mesh.world} ranks, order {' '.join(mesh.order)}"
                 + (f", ep {mesh.ep} inside dp" if mesh.ep > 1 else ""))
    shown = [a for a in mesh.order if mesh.size(a) > 1] or ["tp"]
    for axis in shown + (["ep"] if mesh.ep > 1 else []):
        groups = mesh.groups(axis)
        lines.append(f"  {axis} = {mesh.size(axis)}: stride {mesh.stride(axis)}, {len(groups)} groups, "
                     f"lane {mesh.lane(axis)}, first {list(groups[0])}")
    lines.append(f"train: micro_batch {train.micro_batch}, microbatches {train.microbatches}, seed {train.seed}"
                 + (f", steps {train.steps}" if train.steps else "")
                 + (f", zero {train.zero}" if train.zero else "")
                 + (f", shard {train.shard}" if train.shard else "")
                 + (f", launch {train.launch}" if train.launch is not None else "")
                 + (f", launch_backward {train.launch_backward}" if train.launch_backward is not None else "")
                 + (f", param_gather {train.param_gather}" if train.param_gather != "step" else "")
                 + (f", grad_reduce {train.grad_reduce}" if train.grad_reduce != "backward" else "")
                 + (f", recompute {train.recompute}" if train.recompute != "none" else "")
                 + (f", recompute_layers {train.recompute_layers}" if train.recompute_layers is not None else "")
                 + (f", offload {train.offload}" if train.offloads else "")
                 + (f", offload_percent {train.offload_percent}" if train.offload_percent is not None else ""))
    lines.append(f"fold: {fold.kind} ({fold.v} chunk{'s' if fold.v > 1 else ''} per rank)")
    lines.append(f"pipeline: {program.pipeline.name if program.pipeline else '-'}")
    st = program.strands
    lines.append(f"strands: overlap {', '.join(st.overlap) or '-'}; comm_with_comm "
                 f"{'on' if st.comm_with_comm else 'off'}; movable {', '.join(map(str, st.movable)) or '-'}")
    lines += [f"  forbid {a} with {b}" for a, b in st.forbid]
    if program.partition is not None:
        lines.append("partition:")
        lines += [f"  {format_statement(statement)}" for statement in program.partition.body]
    return "\n".join(lines) + "\n"


def _needs(field: str):
    """Dump the configuration instead when ``program.<field>`` is missing (a library file)."""
    def wrap(dumper):
        @functools.wraps(dumper)
        def dump(program: Program) -> str:
            return dump_config(program) if getattr(program, field) is None else dumper(program)
        return dump
    return wrap


@_needs("forward")
def dump_forward(program: Program) -> str:
    """The forward DAG."""
    assert program.forward is not None, "the stage made it"
    return dump_dag(program.forward)


@_needs("backward")
def dump_dags(program: Program) -> str:
    """The forward and backward DAGs."""
    assert program.forward is not None and program.backward is not None, "the stage made them"
    return dump_dag(program.forward) + "\n" + dump_dag(program.backward)


def dump_dag(dag: LayerDag) -> str:
    """One DAG as a table: name, operator, kind/lane, output shape, inputs, notes."""
    comms = sum(op.kind == "comm" for op in dag.ops)
    head = (f"layer {dag.name} {dag.direction}: {len(dag.ops)} ops ({len(dag.ops) - comms} compute, "
            f"{comms} comm); input {dag.input} {list(dag.input_shape)}; output {dag.output}")
    lines = [head] + [_op_line(op) for op in dag.ops]
    if dag.elided:
        lines.append(f"  elided (size-1 group): {', '.join(dag.elided)}")
    return "\n".join(lines) + "\n"


def _op_line(op: Op) -> str:
    kind = op.kind if op.kind == "compute" else f"comm/{op.lane}"
    group = f"({op.axis}={op.group_size})" if op.axis and op.group_size > 1 else ""
    notes = []
    if op.weight:
        notes.append(f"weight {list(op.weight)}")
    if op.movable:
        notes.append("movable")
    if op.saved:
        notes.append(f"saves {','.join(op.saved)}")
    if op.waits:
        notes.append(f"after {','.join(op.waits)}")
    if not op.weight:
        notes += [f"{k}={v}" for k, v in op.params if k not in ("axis", "ring")]
    return (f"  {op.name:<16} {op.op + group:<24} {kind:<12} {str(list(op.shape)):<16} "
            f"<- {', '.join(op.inputs) or '-':<22} {'  '.join(notes)}").rstrip()


@_needs("backward")
def dump_strands(program: Program) -> str:
    """The strands constraints with the operators each selector names in the layer's DAGs."""
    st, forward, backward = program.strands, program.forward, program.backward
    assert forward is not None and backward is not None, "the stage made them"

    def named(selector) -> str:
        return ", ".join(op.name for op in select(selector, forward, backward)) or "-"

    source = "" if st.span else " (defaults: the program has no strands block)"
    lines = [f"strands{source}: overlap {', '.join(st.overlap) or '-'}; comm_with_comm "
             f"{'on' if st.comm_with_comm else 'off'}"]
    lines += [f"  movable {selector}: {named(selector)}" for selector in st.movable]
    lines += [f"  forbid {a} with {b}: {named(a)} with {named(b)}" for a, b in st.forbid]
    return "\n".join(lines) + "\n"


@_needs("placement")
def dump_placement(program: Program) -> str:
    """Each pipeline rank's chunks and their layers (the fold)."""
    placement = program.placement
    assert program.fold is not None, "a checked model"
    copies = f" ({placement.copies} model copies)" if placement.copies > 1 else ""
    lines = [f"fold {program.fold.kind}: {len(placement.stages)} stages{copies} on {placement.ranks} ranks"]
    for stage in placement.stages:
        last = stage.stop_layer - 1
        layers = f"L{stage.first_layer}" + (f"-L{last}" if last > stage.first_layer else "")
        copy = f"  copy {placement.copy_of(stage.index)}" if placement.copies > 1 else ""
        lines.append(f"  stage {stage.index}: rank {stage.rank} chunk {stage.chunk}  {layers}{copy}")
    return "\n".join(lines) + "\n"


@_needs("lowered")
def dump_lowered(program: Program) -> str:
    """The lowered schedule in its text form."""
    assert program.lowered is not None, "the stage made it"
    return format_lowered(program.lowered)


@_needs("lowered")
def dump_validated(program: Program) -> str:
    """The lowered schedule and its unit-time make-span and bubble ratio."""
    assert program.lowered is not None, "the stage made it"
    return format_lowered(program.lowered) + f"# valid; {describe(unit_time(program.lowered))}\n"
