"""Derive a layer's backward DAG from its forward DAG.

Rules (per forward op, visited in reverse order):

* ``gemm``/``grouped_gemm``/``router`` → ``.dgrad`` (gradient of the input) and ``.wgrad``
  (gradient of the weight; it feeds nothing else in the layer, so it is *movable*);
* ``all_gather`` ↔ ``reduce_scatter``, ``all_to_all`` → ``all_to_all``, ``send`` ↔ ``recv``
  on the same group and lane;
* norms, activations, attention, permutes and ``add`` → one ``.bwd`` op; ``add`` fans its
  output gradient out to both operands;
* a ring attention over cp (``att.step0…`` + ``att``) → ``att.bwd.step0…`` (cp steps that
  pass KV and dKV blocks) + ``att.bwd``.

A value read by several ops receives several gradient contributions; their sum is fused
into the backward op of its *first* reader (which runs last), as Megatron fuses the
residual-gradient add into the norm backward. Activations a backward op reads are listed
in ``saved``: a column-parallel GEMM's wgrad reads the all-gathered input saved in the
forward pass, so the backward needs no second all-gather (the paper's 14 + 18 operators).

Each backward op records its part in the flow of gradients in ``Op.grad``
(:class:`~dhelix.dsl.core.program.GradFlow`): the gradient it reads, the forward values it
gives gradients to, the contributions it sums and the weight whose gradient it computes.
The interpreter runs the DAG from these records.
"""

from __future__ import annotations

from typing import Any

import attrs

from dhelix.dsl.core.oplib import BWD, DGRAD, SPLIT_OPS, WGRAD, derived_kind
from dhelix.dsl.core.program import GradFlow, LayerDag, Op

_TRANSPOSE = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
              "all_to_all": "all_to_all", "send": "recv", "recv": "send", "all_reduce": "all_reduce",
              "reduce": "broadcast", "broadcast": "reduce"}
# Which forward tensors each backward op reads, by forward op: input indices and the output.
_SAVES_INPUTS = {"rmsnorm", "layernorm", "swiglu", "gelu", "attention", "unpermute", "permute"}


def derive_backward(fwd: LayerDag) -> LayerDag:
    """The backward DAG of ``fwd``: ops in a topological order, gradient producers as
    ``inputs``, each with its :class:`GradFlow`; its input is the gradient of the layer
    output (``d<out>``) and its output the op producing the gradient of the layer input."""
    grad_in = f"d{fwd.output}"
    contributions: dict[str, list[str]] = {}  # forward value -> bwd ops giving its gradient
    ops: list[Op] = []
    for op in reversed(fwd.ops):
        if op.op_class == "ring_attention":
            continue  # derived together with the ring's last step
        upstream = _grad_source(op.name, fwd.output, grad_in, contributions)
        for new in _backward_of(op, upstream, fwd):
            ops.append(new)
            assert new.grad is not None, "a backward op has its gradient flow"
            for value in new.grad.produces:
                contributions.setdefault(value, []).append(new.name)
    ops = _fuse_accumulations(ops, contributions)
    final = _grad_source(fwd.input, None, grad_in, contributions)
    return LayerDag(fwd.name, "backward", grad_in, fwd.op(fwd.output).shape if fwd.ops else fwd.input_shape,
                    final or grad_in, tuple(ops))


def _grad_source(value, output, grad_in, contributions) -> str | None:
    """The op whose output a consumer of grad(value) reads (after fusion, it holds the
    sum), None when nothing differentiable reads ``value``."""
    if value == output:
        return grad_in
    found = contributions.get(value, [])
    # The contribution of the first reader (appended last, reverse order) holds the sum.
    return found[-1] if found else None


def _differentiable_inputs(op: Op, fwd: LayerDag) -> tuple[str, ...]:
    """The distinct inputs of forward op ``op`` that receive a gradient from its backward."""
    if op.op == "permute":
        return (op.inputs[0],)  # the scores only choose rows: no gradient flows to them
    if op.op_class == "attention" and op.group_size > 1:
        return (_ring_input(op, fwd),)
    return tuple(dict.fromkeys(op.inputs))


def _ring_input(op: Op, fwd: LayerDag) -> str:
    first = fwd.op(f"{op.name}.step0")
    return first.inputs[0]


def _backward_of(op: Op, upstream: str | None, fwd: LayerDag) -> list[Op]:
    grad_shape = op.shape
    in_shape = op.in_shapes[0] if op.in_shapes else op.shape
    base: dict[str, Any] = dict(inputs=(upstream,) if upstream else (), in_shapes=(grad_shape,), forward=op.name,
                span=op.span, axis=op.axis, group_size=op.group_size, per_node=op.per_node, params=op.params)
    flow = GradFlow(upstream=upstream, produces=_differentiable_inputs(op, fwd))
    if op.op in SPLIT_OPS:
        dgrad = Op(f"{op.name}.{DGRAD}", derived_kind(op.op, DGRAD), "compute", op.op_class, shape=in_shape,
                   weight=op.weight, grad=flow, **base)
        wgrad = Op(f"{op.name}.{WGRAD}", derived_kind(op.op, WGRAD), "compute", op.op_class,
                   shape=op.weight or (), weight=op.weight, movable=True, saved=(op.inputs[0],),
                   grad=GradFlow(upstream=upstream, weight=op.name), **base)
        return [dgrad, wgrad]
    if op.kind == "comm":
        kind = _TRANSPOSE[op.op]
        return [Op(f"{op.name}.{BWD}", kind, "comm", kind, shape=in_shape, lane=op.lane, grad=flow, **base)]
    if op.op_class == "attention" and op.group_size > 1:
        return _ring_backward(op, base, flow, fwd)
    saved = tuple(op.inputs) + ((op.name,) if op.op_class == "attention" else ()) \
        if op.op in _SAVES_INPUTS else ()
    # A weighted op that is not split (a norm) computes its weight gradient in its .bwd.
    flow = attrs.evolve(flow, weight=op.name if op.weight else None)
    return [Op(f"{op.name}.{BWD}", derived_kind(op.op, BWD), "compute", op.op_class, shape=in_shape,
               weight=op.weight, saved=saved, grad=flow, **base)]


def _ring_backward(op: Op, base: dict, flow: GradFlow, fwd: LayerDag) -> list[Op]:
    """cp steps that pass the ring's state on (each reads the previous one), then the step
    that gives qkv its gradient."""
    qkv = _ring_input(op, fwd)
    first = fwd.op(f"{op.name}.step0")
    in_shape = first.in_shapes[0]
    kind = derived_kind("attention", BWD)
    steps, previous, upstream = [], base["inputs"], flow.upstream
    for i in range(op.group_size):
        step = Op(f"{op.name}.{BWD}.step{i}", kind, "comm", "ring_attention",
                  **{**base, "inputs": previous}, shape=in_shape, lane=first.lane, saved=(qkv, op.name),
                  grad=GradFlow(upstream=upstream))
        steps.append(step)
        previous, upstream = (step.name,), step.name
    steps.append(Op(f"{op.name}.{BWD}", kind, "compute", "attention",
                    **{**base, "inputs": previous}, shape=in_shape, saved=(qkv, op.name),
                    grad=attrs.evolve(flow, upstream=upstream)))
    return steps


def _fuse_accumulations(ops: list[Op], contributions: dict[str, list[str]]) -> list[Op]:
    """Make the accumulating op of each multiply-read value depend on the other
    contributions and record them in its GradFlow (their sum is computed inside it)."""
    sums: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for value, producers in contributions.items():
        if len(producers) > 1:
            sums.setdefault(producers[-1], []).append((value, tuple(producers[:-1])))
    out = []
    for op in ops:
        if op.name not in sums:
            out.append(op)
            continue
        others = [p for _, producers in sums[op.name] for p in producers]
        more = tuple(p for p in dict.fromkeys(others) if p not in op.inputs)
        assert op.grad is not None, "a backward op has its gradient flow"
        out.append(attrs.evolve(op, inputs=op.inputs + more,
                                grad=attrs.evolve(op.grad, accumulates=tuple(sums[op.name]))))
    return out
