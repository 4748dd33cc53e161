"""The memory model of the step simulator: model states and live activations per rank.

**Model states** (per GPU, for the parameters it holds), mixed-precision training as
Megatron-LM runs it: weights in the model dtype, gradients in fp32 (the backward adds each
micro-batch's weight gradient into an fp32 "main gradient", which the data-parallel
reduction and the optimizer read: 18 bytes per bf16 parameter in all, where the ZeRO paper
counts 16 with gradients in the model dtype), and for AdamW an fp32 master copy plus the two
fp32 moments (12 bytes per parameter; 8 for fp32 training, whose master copy is the weight);
offloaded (``train { offload = optimizer }``), none of it on the device: 12 bytes per
parameter in host memory, fp32 training too, and the host's staging buffers.
ZeRO-3 pieces and ZeRO-2 keep their gradients in the model dtype (ZeRO-2's reduced 1/dp
slices in fp32, the experts' 1/(DP×CP/EP) ones too). With ZeRO-1 (Megatron's distributed optimizer) the optimizer
states are divided over the gradient-sync group: DP×CP for dense weights, DP×CP/EP for
expert weights. With ZeRO-3 (FSDP) the layers' weights and gradients are divided over DP
too (:func:`model_states`; ZeRO-3 runs with EP = 1 only, so the experts are layer
weights sharded like the rest); the weights gathered at a time live while a layer runs
(:func:`gathered_bytes`). With ZeRO-2 the layers' gradients are divided over their sync
group, DP×CP or DP×CP/EP for experts (each micro-batch's reduce-scattered after its
backward and dropped).

**Activations** are counted from the layer DAGs: each backward op's ``saved`` list names the
forward tensors it reads; a layer keeps each named tensor once (its forward shape, the model
dtype) from the moment its forward starts until its backward has passed it. In a split
schedule the tensors that only weight-gradient ops read stay until W passes the layer; the
others go when B does. With full recomputation a layer keeps only its input from its forward
to its backward, which allocates the rest again when it starts. The LM head keeps its gathered
input and an fp32 softmax of the local logits (``[T, V/tp]``, Megatron's vocab-parallel
cross-entropy) until its backward; a loss that casts the logits to fp32 (the profile's
``kernels.loss``: ``upcast``) holds more copies of them for a moment in its forward and its
backward (:func:`head_transients`), a fused one keeps the 16-bit logits instead. Small per-row
statistics (norm variances, attention log-sum-exp) are left out.

**FP8** training keeps its tensors in memory at bf16's two bytes (:func:`stored_bytes`):
torchtitan's (torchao's) float8 keeps the weights in high precision and casts them for each
GEMM, and its published fp8 runs take the memory of its bf16 runs to 0.3 % (76.8 against 77.0
GiB, 61.8 against 62.0: ``benchmarks/published_runs.yaml``), so their saved activations are
16-bit too; Transformer Engine's fp8 weights keep an fp8 copy and its transpose (two bytes).
Transformer Engine keeps a GEMM's fp8-cast input for its weight gradient where only that GEMM
reads it, so a Megatron-LM fp8 run may hold somewhat fewer activation bytes than this model
says.

Time is layer-granular (the paper overlaps the strands "at the layer granularity"): a
forward allocates a layer's activations when it starts that layer, a backward frees them
when it finishes it; a forward layer paired with a backward layer in an SI block books only
the difference (:func:`interleaved`). :class:`MemoryTimeline` records these steps per rank and finds the peak.
"""

from __future__ import annotations

import math
from typing import Collection

import attrs

from dhelix.dsl.core.dtypes import MAIN_GRAD_DTYPE, dtype_bytes, tensor_dtype
from dhelix.dsl.frontend.kernel_terms import LOSS_COPIES
from dhelix.dsl.core.oplib import is_wgrad, selective_drops
from dhelix.dsl.core.program import LayerDag, Program

#: Optimizer bytes per parameter: fp32 master weight and two fp32 moments (mixed precision),
#: or just the moments when the weights are fp32 already.
_OPTIMIZER_BYTES = {"fp32": 8}
_MIXED_OPTIMIZER_BYTES = 12
#: Host bytes per parameter of an offloaded optimizer's states: an fp32 master and two moments.
HOST_STATE_BYTES = _MIXED_OPTIMIZER_BYTES
#: Bytes per element of a main gradient (:data:`~dhelix.dsl.core.dtypes.MAIN_GRAD_DTYPE`).
MAIN_GRAD_BYTES = dtype_bytes(MAIN_GRAD_DTYPE)
GB = 1e9


def stored_bytes(dtype: str) -> int:
    """Bytes per element of a weight, a 16-bit gradient or an activation kept in memory by a
    model trained in ``dtype``: its own size, but bf16's under fp8, whose GEMMs alone run in
    fp8 (module docstring)."""
    return dtype_bytes(tensor_dtype(dtype, gemm=False))


@attrs.frozen
class ModelStates:
    """Bytes of weights, gradients and optimizer states one GPU holds."""

    params: float
    grads: float
    optimizer: float
    #: Offloaded (``train { offload = optimizer }``): bytes of host memory the optimizer
    #: keeps for this GPU — its fp32 masters and moments, and the staging buffers the
    #: gradients land in and the weights leave from (not in :attr:`total`, device bytes).
    host: float = 0.0

    @property
    def total(self) -> float:
        """All model-state bytes on the device."""
        return self.params + self.grads + self.optimizer


def model_states(dense: float, expert: float, dtype: str, *, zero1: bool, dense_group: int,
                 expert_group: int, fsdp_dense: float = 0.0, fsdp_group: int = 0,
                 grads_sharded: float = 0.0, expert_grads_sharded: bool = False,
                 offload: int = 0) -> ModelStates:
    """Model states of ``dense`` + ``expert`` parameters in ``dtype``; with ``zero1`` the
    optimizer states are sharded over the groups (sizes ``dense_group``, ``expert_group``).

    ZeRO-3: ``fsdp_dense`` of the dense parameters (the layers') keep their weights,
    gradients and optimizer states sharded over ``fsdp_group`` (0: ``dense_group``; hybrid
    sharding's shard group). The weights a ZeRO-3 gather brings in whole, and a full
    gradient before its reduce-scatter, live only while a layer runs: the timeline counts
    them (:func:`gathered_bytes`), not the states.

    ZeRO-2: ``grads_sharded`` of the dense parameters (the layers' and the LM head's, whose
    gradients are reduce-scattered once their backward has finished and then dropped) keep only their 1/``dense_group``
    gradient slice; their full gradient lives while a backward runs (:func:`gathered_bytes`).
    ``expert_grads_sharded`` (ZeRO-2: experts are layer weights, handed over alike): the
    expert gradients are 1/``expert_group`` slices, fp32 as the dense ones.

    ZeRO-3 with experts (EP = 1): give them as ``dense`` (and in ``fsdp_dense``), 0 as
    ``expert``: each layer's gathers and reduce-scatters shard them over DP as the rest.

    ``offload`` (``train { offload = optimizer }``, the percent of ``offload_percent``): that
    share of the optimizer states leaves the device for the host (:func:`host_bytes`), the rest
    stays; both keep fp32 masters whatever ``dtype`` (12 bytes a parameter)."""
    size = stored_bytes(dtype)
    per_param = _OPTIMIZER_BYTES.get(dtype, _MIXED_OPTIMIZER_BYTES)
    shards = max(1, fsdp_group or dense_group)
    if zero1:
        optimizer = per_param * ((dense - fsdp_dense) / max(1, dense_group) + fsdp_dense / shards
                                 + expert / max(1, expert_group))
    else:
        optimizer = per_param * (dense + expert)
    held = dense + expert - fsdp_dense + fsdp_dense / shards
    # Main gradients: the backward adds into fp32 gradients (Megatron-LM's main_grad, the
    # optimizer's flat buffers), but for ZeRO-3 pieces and under ZeRO-2, which keep their own;
    # ZeRO-2's reduced slices are fp32 (reduce-scattered from an fp32 buffer).
    main = MAIN_GRAD_BYTES if not (grads_sharded or expert_grads_sharded) else size
    whole_expert = 0.0 if expert_grads_sharded else expert
    grads = (dense + whole_expert - fsdp_dense - grads_sharded) * main + (fsdp_dense / shards) * size \
        + (grads_sharded / max(1, dense_group) + (expert - whole_expert) / max(1, expert_group)) * MAIN_GRAD_BYTES
    if offload:
        kept, share = optimizer / per_param, offload / 100
        return ModelStates(held * size, grads, HOST_STATE_BYTES * kept * (1 - share), host_bytes(kept * share, dtype))
    return ModelStates(held * size, grads, optimizer)


def host_bytes(params: float, dtype: str) -> float:
    """Host bytes of an offloaded optimizer over ``params`` (this GPU's share of the
    parameters' optimizer states): an fp32 master and two fp32 moments each, the fp32
    buffer the averaged gradients land in and, but for fp32 (whose master goes back as it
    is), the buffer of the weights rounded to ``dtype`` for their copy to the device."""
    staging = MAIN_GRAD_BYTES + (stored_bytes(dtype) if dtype != "fp32" else 0)
    return params * (HOST_STATE_BYTES + staging)


def largest_gathered(forward: LayerDag) -> int:
    """Elements of the largest dense weight unit of a layer (a weight, or a column block of
    one chunked along its outputs): what one ZeRO-3 gather brings in whole."""
    units = {op.weight_unit: math.prod(op.unit_weight or ()) for op in forward.ops
             if op.weight and op.op != "grouped_gemm"}
    return max(units.values(), default=0)


def gathered_bytes(forward: LayerDag, dtype: str, fsdp: bool) -> float:
    """ZeRO-3: the bytes one running layer holds besides its activations, per strand: the
    largest gathered weight (the DAG gathers weight by weight and drops each after its last
    reader); a backward also holds that weight's full gradient until its reduce-scatter.
    A forward layer books this once, a backward layer twice, an SI pair three times, each
    from its start to its end. 0 without ZeRO-3."""
    return float(largest_gathered(forward) * stored_bytes(dtype)) if fsdp else 0.0


@attrs.frozen
class Activations:
    """Bytes one micro-batch keeps per layer (or per LM head): freed by B and freed by W."""

    at_backward: float
    at_weight: float = 0.0

    @property
    def total(self) -> float:
        """Everything the forward allocates."""
        return self.at_backward + self.at_weight


def layer_activations(forward: LayerDag, backward: LayerDag, dtype: str, split: bool,
                      drop: Collection[str] = ()) -> Activations:
    """The saved-tensor bytes of one layer and micro-batch (see the module docstring);
    ``split`` keeps the tensors only wgrad ops read until W; the values ``drop`` names are
    not kept (selective recomputation)."""
    shapes = {op.name: op.shape for op in forward.ops}
    shapes[forward.input] = forward.input_shape
    readers: dict[str, list[bool]] = {}
    for op in backward.ops:
        for name in op.saved:
            readers.setdefault(name, []).append(is_wgrad(op))
    size = stored_bytes(dtype)
    at_backward = at_weight = 0.0
    for name in sorted(readers):
        if name not in shapes or name in drop:
            continue  # a tensor the forward never materialises (an elided collective's output)
        nbytes = float(math.prod(shapes[name]) * size)
        if split and all(readers[name]):
            at_weight += nbytes
        else:
            at_backward += nbytes
    return Activations(at_backward, at_weight)


def head_activations(program: Program, split: bool) -> Activations:
    """The LM head's bytes per micro-batch on the last stage: the final norm's input and what
    the loss keeps of the logits (the fp32 softmax, but for a ``fused`` loss) go with B; the
    gathered LM-head input goes with W when ``split``."""
    model = program.model
    assert model is not None and program.mesh is not None and program.forward is not None, "a checked model"
    vocab, hidden = model.get("vocab"), model.get("hidden")
    if not vocab or not hidden:
        return Activations(0.0)
    tp, size = program.mesh.size("tp"), stored_bytes(model.dtype)
    softmax = _loss_copies(program)[0] * _logits_fp32(program)
    tokens = program.forward.input_shape[0] * tp
    norm_input = tokens / tp * hidden * size
    head_input = tokens * hidden * size
    if split:
        return Activations(softmax + norm_input, head_input)
    return Activations(softmax + norm_input + head_input)


def _logits_fp32(program: Program) -> float:
    """Bytes of one micro-batch's local logits ``[T, V/tp]`` in fp32 (0 without a vocabulary)."""
    model = program.model
    assert model is not None and program.mesh is not None and program.forward is not None, "a checked model"
    vocab = model.get("vocab")
    if not vocab or not model.get("hidden"):
        return 0.0
    tokens = program.forward.input_shape[0] * program.mesh.size("tp")
    return tokens * vocab / program.mesh.size("tp") * 4.0


def _loss_copies(program: Program) -> tuple[float, float, float]:
    """The profile's loss's (kept, forward, backward) copies of the fp32 logits
    (:data:`~dhelix.dsl.frontend.kernel_terms.LOSS_COPIES`; Megatron's without a profile)."""
    return LOSS_COPIES["vocab_parallel" if program.profile is None else program.profile.kernels.loss]


def head_transients(program: Program) -> tuple[float, float]:
    """Bytes the LM head's loss holds for a moment beyond what it keeps, in its forward and in
    its backward (:func:`_loss_copies` of the fp32 logits)."""
    _, forward, backward = _loss_copies(program)
    logits = _logits_fp32(program)
    return forward * logits, backward * logits


def interleaved(alloc: float, free: float) -> tuple[float, float]:
    """What a forward layer allocating ``alloc`` bytes, paired in an SI block with a backward
    layer freeing ``free``, books at the pair's start and frees at its end: the backward
    frees each op's saved tensors as it passes them while the forward allocates its own
    (the paper: "forward allocates activations while backward frees them"), so the pair
    raises the live bytes only by what it allocates beyond what it frees; its net change is
    ``alloc - free`` either way."""
    return max(0.0, alloc - free), max(0.0, free - alloc)


def recomputed(acts: Activations, forward: LayerDag, dtype: str) -> tuple[Activations, float]:
    """Full recomputation: what a layer keeps from its forward to its backward (its input
    only), and what its backward allocates when it starts (the rest of ``acts``, rebuilt by
    running the forward again); the backward and W free what ``acts`` says they free."""
    kept = float(math.prod(forward.input_shape) * stored_bytes(dtype))
    return Activations(kept), max(acts.total - kept, 0.0)


def selectively_recomputed(acts: Activations, forward: LayerDag, backward: LayerDag, dtype: str,
                           split: bool, fsdp: bool = False) -> tuple[Activations, float]:
    """Selective recomputation: what a layer keeps from its forward to its backward (``acts``
    without the outputs :func:`~dhelix.dsl.core.oplib.selective_drops` names), and what its
    backward allocates when it starts (those outputs, computed again; under ZeRO-3, with
    the weights they are computed with, gathered again for it)."""
    dropped = selective_drops(forward.ops, backward.ops)
    kept = layer_activations(forward, backward, dtype, split, drop=dropped)
    weights = sum(math.prod(op.unit_weight or ()) for op in forward.ops if fsdp and op.name in dropped and op.weight)
    return kept, max(acts.total - kept.total, 0.0) + float(weights * stored_bytes(dtype))


class MemoryTimeline:
    """Live activation bytes of one rank over time: (time, change) steps, added in the order
    they happen (a rank's compute lane is sequential, so that order is also time order, and
    at one instant it says which came first)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []

    def change(self, time: float, delta: float) -> None:
        """Allocate (``delta`` > 0) or free bytes at ``time``."""
        if delta:
            self.steps.append((time, delta))

    def peak(self) -> tuple[float, float]:
        """(peak live bytes, the first time it is reached)."""
        live = best = when = 0.0
        for time, delta in self.steps:
            live += delta
            if live > best + 1e-6:
                best, when = live, time
        return best, when

    def samples(self) -> list[tuple[float, float]]:
        """(time, live bytes) after every instant with a change: the trace's counter track."""
        out: list[tuple[float, float]] = []
        live = 0.0
        for time, delta in self.steps:
            live += delta
            if out and out[-1][0] == time:
                out[-1] = (time, live)
            else:
                out.append((time, live))
        return out
