"""One training step without pipelining or strand interleaving (:func:`sequential_step`, the
executor's baseline), and the all-reduce of the gradients that are partial sums over tp or cp
(:func:`sum_partial_grads`), with which every step ends.
"""

from __future__ import annotations

import torch

from dhelix.dsl.core.program import Program

from dhelix.interpreter.ops.comm import AXES, Communicator
from dhelix.interpreter.ops.ring_attention import local_micro
from dhelix.interpreter.ops.weights import EMBEDDING, FINAL_NORM, LM_HEAD, WeightPlan, param_name, torch_dtype
from dhelix.interpreter.verify.reference import Batch
from .layer_exec import LayerPlan, LayerRun
from .model_ends import EmbedRun, HeadRun


def sequential_step(program: Program, batch: Batch, comm: Communicator, plan: WeightPlan | None = None,
                    seed: int = 0, device="cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step without pipelining or strand interleaving (pp = 1): each micro-batch of
    ``batch`` runs forward through the embedding, every layer and the head, then backward.

    Returns the loss (the mean over all tokens of ``batch``, the same on every tp and cp rank)
    and this rank's gradients by parameter name — partial over tp for the parameters whose
    ShardSpec says so (:func:`sum_partial_grads` completes them). The executor's baseline.
    """
    assert program.mesh is not None and program.train is not None, "a checked model"
    assert program.forward is not None and program.backward is not None, "a program through autodiff"
    if program.mesh.size("pp") > 1:
        raise ValueError("sequential_step runs the whole model on one stage; the mesh has pp > 1")
    plan = plan or WeightPlan(program, seed)
    index = {axis: comm.index(axis) for axis in AXES}
    dtype, micro_batch = torch_dtype(program), program.train.micro_batch
    layer_plan = LayerPlan.build(program.forward, program.backward, micro_batch)
    weights = [plan.layer_weights(i, index, dtype, device) for i in range(plan.layers)]
    layer_grads: list[dict] = [{} for _ in range(plan.layers)]
    grads: dict[str, torch.Tensor] = {}
    start = plan.vocab_start(index)
    ends = [plan.shard(name, index, dtype).to(device) for name in (EMBEDDING, FINAL_NORM, LM_HEAD)]
    count = batch.inputs.shape[0]
    scale = 1.0 / (count * batch.inputs[0].numel())
    total = torch.zeros((), dtype=dtype, device=device)
    for m in range(count):
        ids, targets = (t.to(device) for t in local_micro(batch, m, comm.size("cp"), comm.index("cp")))
        embed = EmbedRun(ends[0], comm, start, plan.sequence_parallel, grads)
        x = embed.forward(ids)
        runs = [LayerRun(layer_plan, weights[i], comm, layer_grads[i]) for i in range(plan.layers)]
        for run in runs:
            x = run.forward(x)
        head = HeadRun(ends[1], ends[2], comm, start, plan.sequence_parallel, grads, norm_params=plan.norm_params)
        total = total + head.forward(x, targets)
        grad = head.backward(scale)
        for run in reversed(runs):
            grad = run.backward(grad)
        embed.backward(grad)
    for i, layer in enumerate(layer_grads):
        grads.update({param_name(i, op): grad for op, grad in layer.items()})
    # Each cp rank summed the losses of its own tokens.
    return comm.all_reduce(total * scale, "cp"), grads


def sum_partial_grads(plan: WeightPlan, grads: dict[str, torch.Tensor], comm: Communicator) -> None:
    """All-reduce, in place, the gradients that are partial sums over tp (replicated
    weights applied to sequence-parallel tokens: norms, router, experts) or over cp (every
    weight: each cp rank sees its own part of the sequences), by name: every rank issues
    them in the same order whatever order its gradients were made in (an SI block's filler
    runs weight-gradient ops when a rank would otherwise wait, which differs by rank)."""
    for name in sorted(grads):
        grad = grads[name]
        for axis in plan.spec(name).grad_sum:
            comm.all_reduce(grad, axis)
