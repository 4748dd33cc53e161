"""Instantiate a layer definition into a forward :class:`LayerDag` with per-GPU shapes.

Integer arguments are evaluated exactly over the model, mesh and train settings; shapes
flow from the layer input through the operator library's rules, and a mismatch is reported
at the argument at fault. Collectives over an axis of size 1 are elided (their consumers
read the collective's input), so a TP = 1 mesh runs the same layer without no-op comms.
"""

from __future__ import annotations

from typing import Mapping

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError, ErrorCollector
from dhelix.dsl.frontend.exprs import evaluate
from dhelix.dsl.frontend.layercheck import bind_args, topological_applies
from dhelix.dsl.core.mesh import Mesh
from dhelix.dsl.core.oplib import AXIS, FLAG, INT, OPS, TENSOR, ShapeMismatch
from dhelix.dsl.core.program import LayerDag, Op, Shape

WHAT = "model, mesh or train setting"


def instantiate(layer: s.LayerDef, env: Mapping[str, int], mesh: Mesh) -> LayerDag:
    """The forward DAG of a structurally valid ``layer`` under ``env`` and ``mesh``.

    Raises CheckError (or an ErrorGroup) for evaluation errors and shape mismatches.
    """
    errors = ErrorCollector()
    inp = next(st for st in layer.body if isinstance(st, s.LayerIn))
    out = next(st for st in layer.body if isinstance(st, s.LayerOut))
    input_shape = _input_shape(inp, env)
    shapes: dict[str, Shape] = {inp.name: input_shape}
    alias: dict[str, str] = {}
    ops: list[Op] = []
    elided: list[str] = []
    for apply in topological_applies(layer):
        try:
            op = _instantiate_op(apply, env, mesh, shapes, alias)
        except CheckError as exc:
            errors.add(exc)
            break  # later shapes depend on this one; report the first mismatch only
        shapes[apply.name] = op.shape
        if op.op_class == "attention" and mesh.size("cp") > 1 and (op.axis or "").split(".")[0] != "cp":
            errors.add(_attention_off_cp(apply, op, mesh))
        if op.kind == "comm" and op.group_size == 1 and op.op not in ("send", "recv"):
            alias[apply.name] = op.inputs[0]
            elided.append(apply.name)
        elif op.op_class == "attention" and op.group_size > 1:
            ops.extend(ring_steps(op, op.group_size - 1))
        else:
            ops.append(op)
    errors.raise_if_any()
    if shapes[out.name] != input_shape:
        raise CheckError(f"layer {layer.name} maps {_fmt(input_shape)} to {_fmt(shapes[out.name])}",
                         out.span_of("name"), ["layers are stacked, so the output shape must equal the input shape"])
    return LayerDag(layer.name, "forward", inp.name, input_shape, alias.get(out.name, out.name),
                    tuple(ops), tuple(elided))


def _input_shape(inp: s.LayerIn, env: Mapping[str, int]) -> tuple[int, int]:
    if inp.shape is None:
        # Sequence-parallel layout, the default with TP: tokens split over cp, then tp.
        return (env["tokens"] // env["tp"], env["hidden"])
    rows, cols = (evaluate(e, env, WHAT) for e in inp.shape)
    if rows <= 0 or cols <= 0:
        raise CheckError(f"input shape [{rows}, {cols}] must be positive", inp.span)
    return (rows, cols)


def _attention_off_cp(apply, op: Op, mesh: Mesh) -> CheckError:
    """The error of an attention that does not ring over cp while cp splits every sequence:
    each rank would attend only within its own part of the sequence."""
    cp = mesh.size("cp")
    over = f"runs over {op.axis}" if op.axis else "is not given the cp axis"
    where = mesh.spans.get("cp")
    return CheckError(f"attention {apply.name} {over}, but cp = {cp} splits each sequence over {cp} ranks: each "
                      "would attend only within its own part of the sequence", apply.span,
                      [*([f"cp = {cp} is set at {where}"] if where is not None else []),
                       "give the attention the cp axis, attention(…, cp), for ring attention as stdlib's llama "
                       "does, or set cp = 1"])


def _instantiate_op(apply, env, mesh: Mesh, shapes, alias) -> Op:
    spec = OPS[apply.op]
    binding, _ = bind_args(apply, spec, set(shapes))
    values: list[object] = []
    inputs: list[str] = []
    in_shapes: list[Shape] = []
    params: list[tuple[str, object]] = []
    axis: str | None = None
    size = 1
    for param, arg in binding:
        if arg is None:
            values.append(None)
            continue
        if param.kind == INT:
            values.append(evaluate(arg.value, env, WHAT))
            params.append((param.name, values[-1]))
            continue
        assert isinstance(arg.value, s.Name), "the layer checker lets only names be tensors, axes or flags"
        word = arg.value.id
        if param.kind == TENSOR:
            inputs.append(alias.get(word, word))
            in_shapes.append(shapes[word])
            values.append(shapes[word])
        elif param.kind == AXIS:
            axis, size = word, mesh.size(word)
            values.append((axis, size))
            params.append((param.name, axis))
        elif param.kind == FLAG:
            values.append(word)
            params.append((param.name, word))
    try:
        shape = spec.infer(values)
    except ShapeMismatch as exc:
        bad = binding[exc.arg][1]
        raise CheckError(f"shape mismatch in {apply.name} = {spec.name}(…): {exc.message}",
                         bad.span if bad is not None else apply.span, list(exc.notes)) from None
    # (every communication op has an axis parameter: oplib)
    lane = "compute" if spec.kind == "compute" or axis is None else mesh.lane(axis)
    if spec.op_class == "attention":
        params.append(("seq", env["seq"]))  # attention cost grows with the full sequence
        if size > 1 and axis is not None:
            lane = mesh.lane(axis)  # the lane of the ring's P2P steps (see ring_steps)
    return Op(apply.name, spec.name, spec.kind, spec.op_class, tuple(inputs), tuple(in_shapes), shape,
              weight=spec.weight(values), axis=axis, group_size=size, lane=lane,
              per_node=mesh.per_node(axis) if axis and spec.kind == "comm" else 1,
              movable=spec.op_class == "router",  # the paper lets the MoE router move
              params=tuple(params), span=apply.span)


def ring_steps(op: Op, carrying: int) -> list[Op]:
    """Split ring attention into ``carrying`` steps that compute while passing KV blocks
    over the ring (communication ops, on the ring axis's lane) and a last step that
    computes and merges (a compute op that keeps the op's name, so consumers are unchanged).

    Forward rings have cp - 1 carrying steps; backward rings cp (KV and dKV both travel).
    """
    steps, previous = [], op.inputs
    for i in range(carrying):
        step = attrs.evolve(op, name=f"{op.name}.step{i}", kind="comm", op_class="ring_attention",
                            inputs=previous)
        steps.append(step)
        previous = (step.name,)
    steps.append(attrs.evolve(op, kind="compute", lane="compute", inputs=previous))
    return steps


def _fmt(shape) -> str:
    return f"[{shape[0]}, {shape[1]}]"
