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
"""

from __future__ import annotations

import attrs

from dhelix.dsl.core.program import LayerDag, Op

_TRANSPOSE = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
              "all_to_all": "all_to_all", "send": "recv", "recv": "send"}
_SPLIT = {"gemm", "grouped_gemm", "router"}  # ops with a weight: dgrad + wgrad
# Which forward tensors each backward op reads, by forward op: input indices and the output.
_SAVES_INPUTS = {"rmsnorm", "layernorm", "swiglu", "gelu", "attention", "unpermute", "permute"}


def derive_backward(fwd: LayerDag) -> LayerDag:
    """The backward DAG of ``fwd``: ops in a topological order, gradient producers as
    ``inputs``; its input is the gradient of the layer output (``d<out>``) and its output
    the op producing the gradient of the layer input."""
    grad_in = f"d{fwd.output}"
    readers = _readers(fwd)
    contributions: dict[str, list[str]] = {}  # forward value -> bwd ops giving its gradient
    ops: list[Op] = []
    for op in reversed(fwd.ops):
        if op.op_class == "ring_attention":
            continue  # derived together with the ring's last step
        upstream = _grad_sources(op.name, fwd.output, grad_in, contributions, readers)
        for new in _backward_of(op, upstream, fwd):
            ops.append(new)
        for index, value in enumerate(dict.fromkeys(_differentiable_inputs(op, fwd))):
            contributions.setdefault(value, []).append(_producer_of_input_grad(op, index))
    ops = _fuse_accumulations(ops, contributions, readers)
    final = _grad_sources(fwd.input, None, grad_in, contributions, readers)
    return LayerDag(fwd.name, "backward", grad_in, fwd.op(fwd.output).shape if fwd.ops else fwd.input_shape,
                    final[0] if final else grad_in, tuple(ops))


def _readers(fwd: LayerDag) -> dict[str, list[str]]:
    readers: dict[str, list[str]] = {}
    for op in fwd.ops:
        for value in dict.fromkeys(op.inputs):
            readers.setdefault(value, []).append(op.name)
    return readers


def _grad_sources(value, output, grad_in, contributions, readers) -> list[str]:
    """Ops whose outputs a consumer of grad(value) must wait for (after fusion: one op)."""
    if value == output:
        return [grad_in]
    found = contributions.get(value, [])
    # The contribution of the first reader (appended last, reverse order) holds the sum.
    return found[-1:] if found else []


def _differentiable_inputs(op: Op, fwd: LayerDag) -> list[str]:
    if op.op == "permute":
        return [op.inputs[0]]  # the scores only choose rows: no gradient flows to them
    if op.op_class == "attention" and op.group_size > 1:
        return [_ring_input(op, fwd)]
    return list(op.inputs)


def _ring_input(op: Op, fwd: LayerDag) -> str:
    first = fwd.op(f"{op.name}.step0")
    return first.inputs[0]


def _producer_of_input_grad(op: Op, index: int) -> str:
    return f"{op.name}.dgrad" if op.op in _SPLIT else f"{op.name}.bwd"


def _backward_of(op: Op, upstream: list[str], fwd: LayerDag) -> list[Op]:
    grad_shape = op.shape
    in_shape = op.in_shapes[0] if op.in_shapes else op.shape
    base = dict(inputs=tuple(upstream), in_shapes=(grad_shape,), forward=op.name, span=op.span,
                axis=op.axis, group_size=op.group_size, params=op.params)
    if op.op in _SPLIT:
        dgrad = Op(f"{op.name}.dgrad", f"{op.op}_dgrad", "compute", op.op_class, shape=in_shape,
                   weight=op.weight, **base)
        wgrad = Op(f"{op.name}.wgrad", f"{op.op}_wgrad", "compute", op.op_class, shape=op.weight or (),
                   weight=op.weight, movable=True, saved=(op.inputs[0],), **base)
        return [dgrad, wgrad]
    if op.kind == "comm":
        kind = _TRANSPOSE[op.op]
        return [Op(f"{op.name}.bwd", kind, "comm", kind, shape=in_shape, lane=op.lane, **base)]
    if op.op_class == "attention" and op.group_size > 1:
        return _ring_backward(op, base, fwd)
    saved = tuple(op.inputs) + ((op.name,) if op.op_class == "attention" else ()) \
        if op.op in _SAVES_INPUTS else ()
    return [Op(f"{op.name}.bwd", f"{op.op}_bwd", "compute", op.op_class, shape=in_shape,
               weight=op.weight, saved=saved, **base)]


def _ring_backward(op: Op, base: dict, fwd: LayerDag) -> list[Op]:
    qkv = _ring_input(op, fwd)
    first = fwd.op(f"{op.name}.step0")
    in_shape = first.in_shapes[0]
    steps, previous = [], base["inputs"]
    for i in range(op.group_size):
        step = Op(f"{op.name}.bwd.step{i}", "attention_bwd", "comm", "ring_attention",
                  **{**base, "inputs": previous}, shape=in_shape, lane=first.lane, saved=(qkv, op.name))
        steps.append(step)
        previous = (step.name,)
    steps.append(Op(f"{op.name}.bwd", "attention_bwd", "compute", "attention",
                    **{**base, "inputs": previous}, shape=in_shape, saved=(qkv, op.name)))
    return steps


def _fuse_accumulations(ops: list[Op], contributions, readers) -> list[Op]:
    """Make the accumulating op of each multiply-read value depend on the other
    contributions (their sum is computed inside it)."""
    extra: dict[str, list[str]] = {}
    for value, producers in contributions.items():
        if len(producers) > 1:
            extra.setdefault(producers[-1], []).extend(producers[:-1])
    out = []
    for op in ops:
        more = tuple(p for p in extra.get(op.name, []) if p not in op.inputs)
        out.append(attrs.evolve(op, inputs=op.inputs + more) if more else op)
    return out
