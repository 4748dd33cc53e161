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

These operators read no activation: their dependencies are ``Op.waits``. Their shapes are
the flattened weight ``[elements, 1]`` (padded), so the cost model prices them as the
all-gather and reduce-scatter of that many elements in the model dtype. The model's ends
(embedding, final norm, LM head) are not in the layer DAGs and stay ZeRO-1: their optimizer
states are sharded, their weights replicated.

Not offered: FSDP with cp > 1 or ep > 1 (the gradient of a weight shared over cp, or of an
expert sharded over ep, would need the reduce-scatter over another group than dp); a
located error says so.
"""

from __future__ import annotations

import math

import attrs

from dhelix.dsl.core.errors import CheckError
from dhelix.dsl.core.oplib import WEIGHT_PASS, is_wgrad
from dhelix.dsl.core.program import GradFlow, Op, Program

GATHER, SCATTER = "param_gather", "grad_scatter"
#: The suffixes of the ops this pass adds to a weight's (written) name.
FORWARD_GATHER, BACKWARD_GATHER, GRAD_SCATTER = ".gather_w", ".regather_w", ".scatter_dw"


def is_fsdp(program: Program) -> bool:
    """Whether ``program`` shards its layer weights over dp (ZeRO-3 with dp > 1)."""
    return (program.train is not None and program.train.zero == 3 and program.mesh is not None
            and program.mesh.size("dp") > 1)


def padded_elements(shape: tuple[int, ...], dp: int) -> int:
    """Elements of a weight of ``shape`` flattened and padded to a multiple of ``dp``."""
    return math.ceil(math.prod(shape) / dp) * dp


def shard_weights(program: Program) -> Program:
    """``program`` with its layer DAGs carrying the ZeRO-3 collectives (module docstring);
    unchanged unless :func:`is_fsdp`. CheckError, located at the ``zero`` setting, for a
    mesh this does not support."""
    if not is_fsdp(program) or program.forward is None:
        return program
    mesh, train = program.mesh, program.train
    for axis, why in (("cp", "a weight shared over cp has its gradient summed over cp too"),
                      ("ep", "an expert weight's gradient is summed over the expert-data-parallel group")):
        if mesh.size(axis) > 1:
            raise CheckError(f"zero = 3 with {axis} = {mesh.size(axis)} is not supported",
                             train.zero_span or train.span,
                             [f"{why}, not over dp alone", f"use zero = 1 with {axis} > 1, or {axis} = 1 with zero = 3"])
    dp, lane = mesh.size("dp"), mesh.lane("dp")
    forward, backward = program.forward, program.backward

    def collective(name: str, kind: str, weight: Op, forward_op: str | None = None,
                   waits: tuple[str, ...] = (), weight_pass: bool = False) -> Op:
        full = padded_elements(weight.weight, dp)
        gathered = kind == GATHER
        shapes = ((full // dp, 1), (full, 1)) if gathered else ((full, 1), (full // dp, 1))
        return Op(name, kind, "comm", "all_gather" if gathered else "reduce_scatter", (), (shapes[0],), shapes[1],
                  axis="dp", group_size=dp, lane=lane, per_node=mesh.per_node("dp"), forward=forward_op, waits=waits, span=weight.span,
                  params=(("weight", weight.weight_name), ("shape", tuple(weight.weight)))
                  + (((WEIGHT_PASS, True),) if weight_pass else ()),
                  grad=None if forward_op is None else GradFlow(upstream=None))

    weights = _weights_in_order(forward.ops)
    gathers = {name: collective(name + FORWARD_GATHER, GATHER, op) for name, op in weights.items()}
    fwd_ops = [*gathers.values()] + [
        attrs.evolve(op, waits=op.waits + (gathers[op.weight_name].name,)) if op.weight else op
        for op in forward.ops]
    owner = {op.name: op.weight_name for op in forward.ops if op.weight}
    bwd_ops = _backward(backward.ops, weights, gathers, owner, collective)
    return attrs.evolve(program, forward=attrs.evolve(forward, ops=tuple(fwd_ops)),
                        backward=attrs.evolve(backward, ops=tuple(bwd_ops)))


def _weights_in_order(ops) -> dict[str, Op]:
    """The first op of each weight (by weight name), in the order the weights are first used."""
    found: dict[str, Op] = {}
    for op in ops:
        if op.weight and op.weight_name not in found:
            found[op.weight_name] = op
    return found


def _backward(ops, weights: dict[str, Op], gathers: dict[str, Op], owner: dict[str, str], collective) -> list[Op]:
    """The backward ops with the re-gathers first and a reduce-scatter after the last op
    computing each weight's gradient. ``owner`` maps a weighted forward op to its weight."""
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
    result = [collective(weight + BACKWARD_GATHER, GATHER, weights[weight], forward_op=gathers[weight].name)
              for weight in readers]
    last_producer = {names[-1]: weight for weight, names in producers.items()}
    for op in ops:
        if op.weight is not None and op.forward in owner and not is_wgrad(op):
            op = attrs.evolve(op, waits=op.waits + (owner[op.forward] + BACKWARD_GATHER,))
        result.append(op)
        if op.name in last_producer:
            weight = last_producer[op.name]
            # Only wgrads compute it: a split schedule's W runs it (after them), not its B.
            only_wgrads = all(is_wgrad(by_name[name]) for name in producers[weight])
            result.append(collective(weight + GRAD_SCATTER, SCATTER, weights[weight], forward_op=gathers[weight].name,
                                     waits=tuple(producers[weight]), weight_pass=only_wgrads))
    return result
