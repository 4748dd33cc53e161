"""Operator kernels: an explicit forward, data-gradient and weight-gradient per operator.

Each compute operator of the library is a :class:`Kernel` of three functions:

* ``forward(inputs, weight, ctx) -> (out, saved)``: ``inputs`` are the op's input tensors in
  DAG order, ``weight`` its (per-GPU) weight or None, ``saved`` what the backward needs;
* ``dgrad(grad_out, saved, weight) -> grads``: one gradient per input, None for an input
  that gets none (token ids, the router scores read by ``permute``);
* ``wgrad(grad_out, saved) -> grad_weight``: kept separate so the executor can move it.

Backward formulas are written out (no autograd). Attention calls the flash-attention
kernels directly on CPU (saving the output and the log-sum-exp, never the probabilities);
on other devices its backward recomputes the forward under autograd. On a GPU RMSNorm and
SwiGLU run fused (:mod:`.gpu_kernels`).

Tensors are 2-D ``[tokens, features]``; a micro-batch's tokens are rows in (batch, seq)
order, so attention reshapes them with the micro-batch size from ``ctx``. Collectives go
through ``ctx.comm`` (:mod:`.comm`).

This module holds the model's operators (norms, GEMMs, the MoE router and grouped GEMM,
attention, activations, add, the vocabulary-parallel embedding and LM head) and the
:class:`Kernel` and :class:`KernelCtx` every kernel module shares. The partitioned chains'
layout ops are in :mod:`.layout_kernels`, the MoE permutes in :mod:`.routing`, the
collectives in :mod:`.collective_kernels`; :mod:`.handlers` is the dispatch table from an
``Op.op`` to its role and kernel.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import attrs
import torch
import torch.nn.functional as F

from . import gpu_kernels as gpu
from .comm import Communicator, SingleRankComm
from .moe import to_host
from .rope import rope_of, rope_tables, rotate

#: Epsilon of RMSNorm and LayerNorm when the op gives none (the reference model uses the same).
EPS = 1e-5


def norm_eps(params: Mapping[str, object]) -> float:
    """The epsilon of a norm op with ``params``: ``1 / inv_eps`` when the layer gives
    ``rmsnorm(x, inv_eps = N)``, else :data:`EPS`."""
    inv = params.get("inv_eps")
    return EPS if inv is None else 1.0 / int(inv)


@attrs.define
class KernelCtx:
    """What a kernel needs besides tensors and its weight.

    ``params`` are the op's integer and flag arguments (heads, kv_heads, mask, top_k…);
    ``routing`` is a record shared by the MoE ops of one layer run (the tokens per local
    expert that ``permute`` computes and ``grouped_gemm`` needs, as Megatron's token
    dispatcher keeps them beside the tensors); ``vocab_start`` is the first vocabulary row
    of this rank's embedding / LM-head shard.
    """

    comm: Communicator = attrs.field(factory=SingleRankComm)
    axis: str | None = None
    micro_batch: int = 1
    params: Mapping[str, object] = attrs.field(factory=dict)
    routing: dict = attrs.field(factory=dict)
    vocab_start: int = 0
    async_op: bool = False
    #: What a kernel derives from the rest once (a shared context serves every micro-batch
    #: of its op): by kernel, its own entry.
    derived: dict = attrs.field(factory=dict)


@attrs.frozen
class Kernel:
    """The three functions of one compute operator (``wgrad`` None: no weight), and
    optionally ``wgrad_into(acc, grad_out, saved)``, which adds the weight gradient into
    ``acc`` in place (micro-batch accumulation without a temporary)."""

    forward: Callable
    dgrad: Callable
    wgrad: Callable | None = None
    wgrad_into: Callable | None = None


# -- norms -------------------------------------------------------------------------------

def _rmsnorm_forward(inputs, weight, ctx):
    (x,) = inputs
    eps = ctx.derived.get("eps")
    if eps is None:
        eps = ctx.derived["eps"] = norm_eps(ctx.params)
    if gpu.on_gpu(x):
        out, rstd = gpu.rmsnorm_forward(x, weight, eps)
        return out, (x, rstd)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd * weight, (x, rstd)


def _rmsnorm_dgrad(grad, saved, weight):
    x, rstd = saved
    if gpu.on_gpu(x):
        return (gpu.rmsnorm_dgrad(grad, x, rstd, weight),)
    xhat, gy = x * rstd, grad * weight
    return (rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True)),)


def _rmsnorm_wgrad(grad, saved):
    x, rstd = saved
    if gpu.on_gpu(x):
        return gpu.rmsnorm_wgrad(grad, x, rstd)
    return (grad * x * rstd).sum(0)


def _layernorm_forward(inputs, weight, ctx):
    """LayerNorm; ``weight`` is ``[2, features]``: row 0 the scale, row 1 the bias."""
    (x,) = inputs
    mean = x.mean(-1, keepdim=True)
    centred = x - mean
    rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + norm_eps(ctx.params))
    xhat = centred * rstd
    return xhat * weight[0] + weight[1], (xhat, rstd)


def _layernorm_dgrad(grad, saved, weight):
    xhat, rstd = saved
    gy = grad * weight[0]
    return (rstd * (gy - gy.mean(-1, keepdim=True) - xhat * (gy * xhat).mean(-1, keepdim=True)),)


def _layernorm_wgrad(grad, saved):
    xhat, _ = saved
    return torch.stack(((grad * xhat).sum(0), grad.sum(0)))


# -- GEMMs -------------------------------------------------------------------------------

#: What a gemm with a bias saves beside its input, so that its wgrad adds the bias row.
_BIAS = "bias"


def _gemm_forward(inputs, weight, ctx):
    """``x @ W`` with ``W`` ``[in, out]``: column- and row-parallel alike (the shard is the
    weight); the row-parallel partial sums are reduced by the DAG's reduce_scatter. A gemm
    with ``bias = 1`` has ``W`` ``[in + 1, out]``, its last row the bias: ``x @ W[:in] + b``
    (its weight is one row longer than the input has features)."""
    (x,) = inputs
    if weight.shape[0] == x.shape[-1] + 1:
        return torch.addmm(weight[-1], x, weight[:-1]), (x, _BIAS)
    return x @ weight, (x,)


def _gemm_dgrad(grad, saved, weight):
    return (grad @ (weight[:-1] if len(saved) > 1 else weight).t(),)


def _gemm_wgrad(grad, saved):
    x = saved[0]
    if len(saved) > 1:  # the bias row: the output gradient summed over tokens
        return torch.cat((x.t() @ grad, grad.sum(0, keepdim=True)))
    return x.t() @ grad


def _gemm_wgrad_into(acc, grad, saved):
    x = saved[0]
    if len(saved) > 1:
        acc[:-1].addmm_(x.t(), grad)
        acc[-1] += grad.sum(0)
        return
    acc.addmm_(x.t(), grad)


def _router_forward(inputs, weight, ctx):
    """MoE gate: expert probabilities ``softmax(x @ Wr)`` per token."""
    (x,) = inputs
    probs = torch.softmax(x @ weight, dim=-1)
    return probs, (x, probs)


def _router_grad_logits(grad, probs):
    return probs * (grad - (grad * probs).sum(-1, keepdim=True))


def _router_dgrad(grad, saved, weight):
    _, probs = saved
    return (_router_grad_logits(grad, probs) @ weight.t(),)


def _router_wgrad(grad, saved):
    x, probs = saved
    return x.t() @ _router_grad_logits(grad, probs)


def _grouped_gemm_forward(inputs, weight, ctx):
    """One GEMM per local expert over its block of rows; ``weight`` is ``[experts, in, out]``
    and ``ctx.routing["counts"]`` the rows per local expert, in order."""
    (x,) = inputs
    counts = _counts(ctx, weight.shape[0], x.shape[0])
    out = torch.cat([rows @ w for rows, w in zip(x.split_with_sizes(counts), weight, strict=True)])
    return out, (x, counts)


def _counts(ctx, experts: int, rows: int) -> list[int]:
    # Without an ep exchange (which leaves host counts per local expert) the rows per expert
    # are permute's, on the device: read back once (the layer's one sync, :func:`.moe.to_host`).
    counts = ctx.routing.get("counts")
    if isinstance(counts, torch.Tensor):
        counts = ctx.routing["counts"] = to_host(counts)
    if counts is None or len(counts) != experts or sum(counts) != rows:
        raise RuntimeError(f"grouped_gemm over {rows} rows and {experts} local experts has no "
                           f"matching routing (got {counts}); a permute must run first")
    return list(counts)


def _grouped_gemm_dgrad(grad, saved, weight):
    _, counts = saved
    return (torch.cat([g @ w.t() for g, w in zip(grad.split_with_sizes(counts), weight, strict=True)]),)


def _grouped_gemm_wgrad(grad, saved):
    x, counts = saved
    return torch.stack([rows.t() @ g for rows, g in zip(x.split_with_sizes(counts), grad.split_with_sizes(counts),
                                                          strict=True)])


# -- attention ---------------------------------------------------------------------------

def _heads(qkv: torch.Tensor, heads: int, kv_heads: int, micro_batch: int, rope: tuple | None = None):
    """``qkv`` ``[tokens, (heads + 2*kv_heads) * d]``, laid out as ``[q heads | k heads |
    v heads]``, head-major inside each block, as q, k, v ``[micro_batch, heads, seq, d]``;
    with ``rope`` (:func:`rope_of`) q and k are rotated by their positions ``0 … seq-1``."""
    tokens, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    seq = tokens // micro_batch
    # (split_with_sizes: split's own entry point, without Tensor.split's Python wrapper)
    q, k, v = qkv.split_with_sizes([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q = q.reshape(micro_batch, seq, heads, d).transpose(1, 2)
    k = k.reshape(micro_batch, seq, kv_heads, d).transpose(1, 2)
    v = v.reshape(micro_batch, seq, kv_heads, d).transpose(1, 2)
    if rope is not None:
        cos, sin = rope_tables(seq, d, rope, qkv.device, qkv.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    return q, k, v


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """``[micro_batch, heads, seq, d]`` back to ``[tokens, heads * d]``."""
    b, n, seq, d = t.shape
    return t.transpose(1, 2).reshape(b * seq, n * d)


def _attend(qkv: torch.Tensor, heads: int, kv_heads: int, causal: bool, micro_batch: int,
            rope: tuple | None = None) -> torch.Tensor:
    """Scaled dot-product attention of ``qkv`` (see :func:`_heads`); query head i reads kv
    head ``i // (heads / kv_heads)``. Returns ``[tokens, heads * d]``."""
    q, k, v = _heads(qkv, heads, kv_heads, micro_batch, rope)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
    return _tokens(out)


def _attention_forward(inputs, weight, ctx):
    (qkv,) = inputs
    meta = ctx.derived.get("attention")
    if meta is None:
        if ctx.axis is not None and ctx.comm.size(ctx.axis) > 1:
            raise NotImplementedError("the attention kernel runs on one cp rank; ring attention over cp > 1 "
                                      "runs the ring steps of .ring_attention")
        meta = ctx.derived["attention"] = (int(ctx.params["heads"]), int(ctx.params["kv_heads"]),
                                           ctx.params.get("mask") == "causal", ctx.micro_batch, rope_of(ctx.params))
    if qkv.shape[0] % ctx.micro_batch:
        raise ValueError(f"attention over {qkv.shape[0]} tokens with micro_batch {ctx.micro_batch}")
    if _flash_cpu(qkv):
        # Flash attention as the CPU SDPA runs it, keeping its output and log-sum-exp so
        # the backward needs no second forward (GQA handled inside the kernel).
        q, k, v = _heads(qkv, *meta[:2], meta[3], meta[4])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, meta[2])
        return _tokens(out), (qkv, meta, out, lse)
    return _attend(qkv, *meta), (qkv, meta, None, None)


def _flash_cpu(qkv: torch.Tensor) -> bool:
    # The explicit flash kernels are called on CPU only; under autograd (the kernel tests
    # differentiate the forward) they are differentiable as well. On a GPU, SDPA picks the
    # fastest backend (on an H200 calling aten's flash kernels directly, with GQA heads
    # expanded, measured slower: benchmarks/results/h200_one_device.txt).
    return qkv.is_cpu and qkv.dtype in (torch.float32, torch.float64)  # (is_cpu: no device object made)


def _attention_dgrad(grad, saved, weight):
    qkv, meta, out, lse = saved
    if out is not None:
        q, k, v = _heads(qkv, *meta[:2], meta[3], meta[4])
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.reshape(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).transpose(1, 2),
            q, k, v, out, lse, 0.0, meta[2])
        if meta[4] is not None:  # the gradients of the rotated q and k, turned back
            cos, sin = rope_tables(q.shape[2], q.shape[3], meta[4], q.device, q.dtype)
            dq, dk = rotate(dq, cos, -sin), rotate(dk, cos, -sin)
        return (torch.cat([_tokens(g) for g in (dq, dk, dv)], dim=1),)
    # Elsewhere recompute the forward from qkv under autograd and differentiate it.
    with torch.enable_grad():
        leaf = qkv.detach().requires_grad_(True)
        (dqkv,) = torch.autograd.grad(_attend(leaf, *meta), leaf, grad)
    return (dqkv,)


# -- activations and add -----------------------------------------------------------------

def _swiglu_forward(inputs, weight, ctx):
    """``silu(gate) * up`` with gate the first and up the second half of the features."""
    (x,) = inputs
    if gpu.on_gpu(x):
        return gpu.swiglu_forward(x), (x,)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up, (x,)


def _swiglu_dgrad(grad, saved, weight):
    (x,) = saved
    if gpu.on_gpu(x):
        return (gpu.swiglu_dgrad(grad, x),)
    gate, up = x.chunk(2, dim=-1)
    # aten's fused silu_backward, both halves written straight into one buffer: the
    # written-out sigmoid formula took nine elementwise passes and a concatenation.
    dx = torch.empty_like(x)
    dgate, dup = dx.chunk(2, dim=-1)
    torch.mul(grad, F.silu(gate), out=dup)
    torch.ops.aten.silu_backward(grad * up, gate, grad_input=dgate)
    return (dx,)


def _gelu_forward(inputs, weight, ctx):
    """Exact (erf) GeLU."""
    (x,) = inputs
    return F.gelu(x), (x,)


def _gelu_dgrad(grad, saved, weight):
    (x,) = saved
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return (grad * (cdf + x * pdf),)


def _add_forward(inputs, weight, ctx):
    a, b = inputs
    return a + b, None


def _add_dgrad(grad, saved, weight):
    return (grad, grad)


# -- vocabulary-parallel embedding and LM head with cross-entropy --------------------------

def _embedding_forward(inputs, weight, ctx):
    """Rows of this rank's vocabulary shard ``[vocab/tp, hidden]`` for token ``ids``,
    zeros for ids outside it (Megatron's VocabParallelEmbedding): a partial sum the caller
    reduces (reduce_scatter over tp for sequence parallelism)."""
    (ids,) = inputs
    local = ids - ctx.vocab_start
    inside = (local >= 0) & (local < weight.shape[0])
    local = local.masked_fill(~inside, 0)
    out = weight[local] * inside[:, None].to(weight.dtype)
    return out, (local, inside, weight.shape[0])


def _embedding_dgrad(grad, saved, weight):
    return (None,)  # token ids have no gradient


def _embedding_wgrad(grad, saved):
    # Ids outside the shard point at row 0 (masked in the forward) with a zero gradient: no
    # boolean indexing, whose nonzero would wait for the device on every micro-batch.
    local, inside, rows = saved
    return grad.new_zeros((rows, grad.shape[1])).index_add_(0, local, grad * inside[:, None].to(grad.dtype))


def _lm_head_forward(inputs, weight, ctx):
    """Per-token cross-entropy ``[tokens]`` of ``h @ W`` against ``targets`` with the
    vocabulary split over ``ctx.axis``: the max, the sum of exponentials and the target
    logit are all-reduced over the group, so every rank gets the full losses."""
    h, targets = inputs
    logits = h @ weight
    vocab = weight.shape[1]
    local = targets - ctx.vocab_start
    inside = (local >= 0) & (local < vocab)
    local = local.masked_fill(~inside, 0)
    peak = ctx.comm.all_reduce(logits.max(dim=-1).values, ctx.axis, "max")
    exp = torch.exp(logits - peak[:, None])
    total = ctx.comm.all_reduce(exp.sum(-1), ctx.axis, "sum")
    target = logits.gather(1, local[:, None]).squeeze(1) * inside.to(logits.dtype)
    target = ctx.comm.all_reduce(target, ctx.axis, "sum")
    losses = torch.log(total) + peak - target
    return losses, (h, exp / total[:, None], local, inside)


def _lm_head_grad_logits(grad, saved):
    _, softmax, local, inside = saved
    grad_logits = softmax * grad[:, None]
    # Minus the gradient at each token's target logit; a target outside the shard points at
    # column 0 with nothing to take (no boolean indexing: its nonzero waits for the device).
    return grad_logits.scatter_add_(1, local[:, None], -(grad * inside.to(grad.dtype))[:, None])


def _lm_head_dgrad(grad, saved, weight):
    """Gradient of ``h`` for ``grad`` ``[tokens]`` of the losses: a partial sum over the
    vocabulary shards (the caller reduces it over tp); targets get none."""
    return (_lm_head_grad_logits(grad, saved) @ weight.t(), None)


def _lm_head_wgrad(grad, saved):
    return saved[0].t() @ _lm_head_grad_logits(grad, saved)


def lm_head_backward(grad, saved, weight) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """dgrad and wgrad of the LM head together: the logits gradient, the largest tensor of
    the head, is computed once instead of once per half. Returns the dgrad and a function
    computing the wgrad, so a caller can launch the dgrad's reduction first and compute
    the wgrad beside it (as Megatron's output layer does)."""
    grad_logits = _lm_head_grad_logits(grad, saved)
    return grad_logits @ weight.t(), lambda: saved[0].t() @ grad_logits


#: The model's operators by library name (:data:`.handlers.KERNELS` adds the other kernel modules').
OPERATOR_KERNELS: dict[str, Kernel] = {
    "rmsnorm": Kernel(_rmsnorm_forward, _rmsnorm_dgrad, _rmsnorm_wgrad),
    "layernorm": Kernel(_layernorm_forward, _layernorm_dgrad, _layernorm_wgrad),
    "gemm": Kernel(_gemm_forward, _gemm_dgrad, _gemm_wgrad, _gemm_wgrad_into),
    "router": Kernel(_router_forward, _router_dgrad, _router_wgrad),
    "grouped_gemm": Kernel(_grouped_gemm_forward, _grouped_gemm_dgrad, _grouped_gemm_wgrad),
    "attention": Kernel(_attention_forward, _attention_dgrad),
    "swiglu": Kernel(_swiglu_forward, _swiglu_dgrad),
    "gelu": Kernel(_gelu_forward, _gelu_dgrad),
    "add": Kernel(_add_forward, _add_dgrad),
    "embedding": Kernel(_embedding_forward, _embedding_dgrad, _embedding_wgrad),
    "lm_head": Kernel(_lm_head_forward, _lm_head_dgrad, _lm_head_wgrad),
}
