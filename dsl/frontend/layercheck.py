"""Structural checks of a layer definition, independent of any model or mesh.

Operator names exist, arguments bind to the signature (tensors are names of this layer's
values, axes are mesh axes, flags are among their choices), every name is defined once,
there is exactly one input and one output, and the DAG has no cycle. These run on library
files too; shapes need a model and are inferred by :mod:`dhelix.dsl.passes.shapes`.
"""

from __future__ import annotations

import graphlib

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError, DhelixError
from dhelix.dsl.core.oplib import AXIS, FLAG, INT, MESH_AXES, OPS, TENSOR, OpSpec, Param
from dhelix.dsl.core.wording import did_you_mean

Binding = list[tuple[Param, s.Arg | None]]  # (Param, Arg or None) in signature order


def bind_args(apply: s.OpApply, spec: OpSpec, values: set[str]) -> tuple[Binding, list[DhelixError]]:
    """Match the arguments of ``apply`` to ``spec``'s parameters.

    ``values`` are the names of the layer's tensors. Returns the binding and the errors.
    """
    errors: list[DhelixError] = []
    slots: dict[str, s.Arg] = {}
    params = {p.name: p for p in spec.params}
    positional = [a for a in apply.args if a.key is None]
    if len(positional) > len(spec.params):
        extra = positional[len(spec.params)]
        errors.append(CheckError(f"{spec.name}() takes {_count(spec)}, got {len(positional)}",
                                 extra.span, [f"usage: {spec.usage()}"]))
    for param, arg in zip(spec.params, positional):
        slots[param.name] = arg
    for arg in apply.args:
        if arg.key is None:
            continue
        if arg.key not in params:
            errors.append(CheckError(f"{spec.name}() has no parameter '{arg.key}'", arg.span_of("key"),
                                     did_you_mean(arg.key, params) + [f"usage: {spec.usage()}"]))
        elif arg.key in slots:
            errors.append(CheckError(f"{spec.name}() got '{arg.key}' twice", arg.span_of("key"),
                                     [f"'{arg.key}' is already given by the argument at {slots[arg.key].span}",
                                      f"usage: {spec.usage()}"]))
        else:
            slots[arg.key] = arg
    rejected = bool(errors)  # a misplaced argument explains the missing ones: say it once
    binding: Binding = []
    for param in spec.params:
        given = slots.get(param.name)
        if given is None and not param.optional and not rejected:
            errors.append(CheckError(f"{spec.name}() is missing its '{param.name}' argument",
                                     apply.span_of("op"), [f"usage: {spec.usage()}"]))
        elif given is not None:
            errors.extend(_check_arg_kind(spec, param, given, values))
        binding.append((param, given))
    return binding, errors


def _count(spec: OpSpec) -> str:
    least = sum(not p.optional for p in spec.params)
    most = len(spec.params)
    count = f"{most}" if least == most else f"{least} to {most}"
    return f"{count} argument{'s' if most != 1 else ''}"


_TENSOR_NOTE = "a tensor argument names the layer's input or an op defined in the layer"


def _check_arg_kind(spec: OpSpec, param, arg: s.Arg, values: set[str]) -> list[DhelixError]:
    name = arg.value.id if isinstance(arg.value, s.Name) else None
    where = f"'{param.name}' of {spec.name}()"
    if param.kind == TENSOR:
        if name is None:
            what = f"the number {_text(arg)}" if isinstance(arg.value, s.Int) else f"the expression '{_text(arg)}'"
            return [CheckError(f"{where} takes a tensor, got {what}", arg.value.span,
                               [_TENSOR_NOTE, f"usage: {spec.usage()}"])]
        if name not in values:
            return [CheckError(f"unknown tensor '{name}'", arg.value.span,
                               did_you_mean(name, values) + [_TENSOR_NOTE])]
    elif param.kind == AXIS:
        if name not in MESH_AXES:
            return [CheckError(f"{where} takes a mesh axis, got '{name or _text(arg)}'", arg.value.span,
                               did_you_mean(name or "", MESH_AXES) + [f"mesh axes: {', '.join(MESH_AXES)}"])]
    elif param.kind == FLAG:
        if name not in param.choices:
            return [CheckError(f"{where} is one of {', '.join(param.choices)}, got '{name or _text(arg)}'",
                               arg.value.span, did_you_mean(name or "", param.choices))]
    elif param.kind == INT and name in values:
        return [CheckError(f"'{name}' is a tensor but {where} takes an integer", arg.value.span,
                           [f"usage: {spec.usage()}"])]
    return []


def _text(arg: s.Arg) -> str:
    from dhelix.dsl.frontend.exprs import format_expr
    return format_expr(arg.value)


def check_layer(layer: s.LayerDef) -> list[DhelixError]:
    """Every structural error of ``layer`` (empty when it is well formed)."""
    errors: list[DhelixError] = []
    inputs = [st for st in layer.body if isinstance(st, s.LayerIn)]
    outputs = [st for st in layer.body if isinstance(st, s.LayerOut)]
    applies = [st for st in layer.body if isinstance(st, s.OpApply)]
    errors += _check_ends(layer, inputs, "in", "in x [tokens / tp, hidden]")
    errors += _check_ends(layer, outputs, "out", "out h")
    defined: dict[str, s.Node] = {}
    for st in inputs + applies:
        if st.name in defined:
            first = defined[st.name].span_of("name")
            errors.append(CheckError(f"'{st.name}' is defined twice in layer {layer.name}", st.span_of("name"),
                                     [f"first defined at {first}"]))
        defined.setdefault(st.name, st)
    values = set(defined)
    for apply in applies:
        spec = OPS.get(apply.op)
        if spec is None:
            errors.append(CheckError(f"unknown operator '{apply.op}'", apply.span_of("op"),
                                     did_you_mean(apply.op, OPS) + [f"operators: {', '.join(sorted(OPS))}"]))
            continue
        errors += bind_args(apply, spec, values)[1]
    for out in outputs:
        if out.name not in values:
            errors.append(CheckError(f"layer output '{out.name}' is not defined", out.span_of("name"),
                                     did_you_mean(out.name, values)))
    if not errors:
        errors += _check_cycles(layer, applies)
    if not errors:
        errors += _check_unused(layer, inputs + applies, outputs[0].name)
    return errors


def _check_unused(layer: s.LayerDef, defs: list, output: str) -> list[DhelixError]:
    used = {output}
    for st in defs:
        if isinstance(st, s.OpApply):
            used.update(tensor_inputs(st))
    return [CheckError(f"'{st.name}' is computed but never used in layer {layer.name}", st.span_of("name"),
                       ["use it in a later op or as the layer's `out`, or remove it"])
            for st in defs if st.name not in used]


def _check_ends(layer: s.LayerDef, found: list, keyword: str, example: str) -> list[DhelixError]:
    if len(found) == 1:
        return []
    if not found:
        return [CheckError(f"layer {layer.name} has no '{keyword}' statement", layer.span_of("name"),
                           [f"a layer has exactly one, e.g. `{example}`"])]
    return [CheckError(f"layer {layer.name} has {len(found)} '{keyword}' statements", found[1].span,
                       ["a layer has exactly one input and one output"])]


def tensor_inputs(apply: s.OpApply) -> list[str]:
    """The names of the tensors ``apply`` consumes, in signature order (bound args only)."""
    spec = OPS[apply.op]
    binding, _ = bind_args(apply, spec, set())
    return [arg.value.id for param, arg in binding
            if arg is not None and param.kind == TENSOR and isinstance(arg.value, s.Name)]


def _check_cycles(layer: s.LayerDef, applies: list[s.OpApply]) -> list[DhelixError]:
    graph = {a.name: set(tensor_inputs(a)) for a in applies}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        cycle = exc.args[1]
        by_name = {a.name: a for a in applies}
        return [CheckError(f"layer {layer.name} has a cycle: {' -> '.join(reversed(cycle))}",
                           by_name[cycle[0]].span_of("name"),
                           ["a layer is a DAG: every op must depend only on earlier values"])]
    return []


def topological_applies(layer: s.LayerDef) -> list[s.OpApply]:
    """The op applications of a well-formed layer in a topological order that keeps the
    written order wherever the written order is already valid."""
    applies = [st for st in layer.body if isinstance(st, s.OpApply)]
    done = {st.name for st in layer.body if isinstance(st, s.LayerIn)}
    ordered: list[s.OpApply] = []
    pending = list(applies)
    while pending:
        ready = next(a for a in pending if set(tensor_inputs(a)) <= done)
        pending.remove(ready)
        ordered.append(ready)
        done.add(ready.name)
    return ordered
