"""The single-process reference model: plain torch with autograd, no kernels, no comms.

It runs the program's layer DAG instantiated without model parallelism
(:func:`~dhelix.dsl.passes.overrides.reference_dags`: tp = cp = ep = 1, collectives elided) with the full seeded
weights of :class:`~.weights.WeightPlan`: embedding → L layers → final norm → LM head →
cross-entropy averaged over every token of every micro-batch. The distributed interpreter
must reproduce its loss and gradients. Its operators are written independently of
:mod:`.kernels` (torch's own norms, an explicit GQA head expansion before
``scaled_dot_product_attention``, a gather-based MoE combine) so that they check the
kernels rather than restate them.
"""

from __future__ import annotations

from typing import Mapping

import attrs
import torch
import torch.nn.functional as F

from dhelix.dsl.core.oplib import ROPE_SCALING
from dhelix.dsl.core.program import LayerDag, Program

from dhelix.interpreter.ops.kernels import norm_eps
from dhelix.interpreter.ops.weights import EMBEDDING, FINAL_NORM, LM_HEAD, WeightPlan, param_name, tie_grads


@attrs.frozen
class Batch:
    """Token ids and next-token targets, each ``[microbatches, micro_batch, seq]``."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def micro(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``m`` flattened to ``[micro_batch * seq]`` rows, (batch, seq) order."""
        return self.inputs[m].reshape(-1), self.targets[m].reshape(-1)


def make_batch(program: Program, seed: int = 0, microbatches: int | None = None) -> Batch:
    """A random seeded batch for ``program`` (``microbatches`` defaults to the train block's)."""
    gen = torch.Generator().manual_seed(seed)
    count = microbatches or program.train.microbatches
    shape = (count, program.train.micro_batch, program.model.get("seq"))
    vocab = program.model.get("vocab")
    tokens = torch.randint(0, vocab, (shape[0], shape[1], shape[2] + 1), generator=gen)
    return Batch(tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous())


def _rope(t, theta: int, scaling: tuple | None):
    """Rotary embedding of ``t`` ``[batch, heads, seq, d]`` as complex multiplication: the
    features ``i`` and ``i + d/2`` are one complex number, turned by ``position · theta^(-2i/d)``
    (written independently of the kernels' cos/sin form); with Llama 3's ``scaling``
    (factor, low, high, original) the long wavelengths' frequencies are divided by factor."""
    seq, d = t.shape[-2], t.shape[-1]
    freq = theta ** -(torch.arange(0, d, 2, dtype=torch.float64) / d)
    if scaling is not None:
        factor, low, high, original = scaling
        cycles = original * freq / (2 * torch.pi)  # turns within the original context
        share = ((cycles - low) / (high - low)).clamp(0, 1)  # 0: long wavelengths, 1: short ones
        freq = freq / factor * (1 - share) + freq * share
    turn = torch.polar(torch.ones(seq, d // 2, dtype=torch.float64),
                       torch.outer(torch.arange(seq, dtype=torch.float64), freq))
    pairs = torch.complex(*(half.double() for half in t.chunk(2, dim=-1))) * turn
    return torch.cat((pairs.real, pairs.imag), dim=-1).to(t.dtype)


def _attention(qkv, params, micro_batch):
    heads, kv_heads = params["heads"], params["kv_heads"]
    tokens, width = qkv.shape
    d, seq = width // (heads + 2 * kv_heads), tokens // micro_batch
    q, k, v = (t.reshape(micro_batch, seq, -1, d).transpose(1, 2)
               for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1))
    if params.get("rope") is not None:
        scaling = tuple(params.get(name) for name in ROPE_SCALING)
        scaling = None if scaling[0] is None else scaling
        q, k = _rope(q, params["rope"], scaling), _rope(k, params["rope"], scaling)
    group = heads // kv_heads  # query head j reads kv head j // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=params["mask"] == "causal")
    return out.transpose(1, 2).reshape(tokens, heads * d)


def _top_k(scores, top_k):
    probs, experts = scores.topk(top_k, dim=-1)
    order = torch.argsort(experts.reshape(-1), stable=True)
    return probs, experts, order


def _permute(x, scores, top_k, routing):
    _, experts, order = _top_k(scores.detach(), top_k)
    routing["counts"] = torch.bincount(experts.reshape(-1), minlength=scores.shape[1]).tolist()
    return x.repeat_interleave(top_k, dim=0)[order]


def _unpermute(y, scores, top_k):
    probs, _, order = _top_k(scores, top_k)
    by_pair = y[torch.argsort(order)].reshape(scores.shape[0], top_k, -1)  # back to (token, slot)
    return (by_pair * probs[..., None]).sum(1)


def _gemm(x, weight):
    # With a bias the weight has one more row than x has features: the bias.
    return x @ weight[:-1] + weight[-1] if weight.shape[0] == x.shape[-1] + 1 else x @ weight


def _grouped_gemm(x, weight, routing):
    return torch.cat([rows @ w for rows, w in zip(x.split(routing["counts"]), weight, strict=True)])


def _rmsnorm(args, weight, params, micro_batch, routing):
    return F.rms_norm(args[0], (args[0].shape[-1],), weight, eps=norm_eps(params))


def _layernorm(args, weight, params, micro_batch, routing):
    return F.layer_norm(args[0], (args[0].shape[-1],), weight[0], weight[1], eps=norm_eps(params))


def _swiglu(args, weight, params, micro_batch, routing):
    gate, up = args[0].chunk(2, dim=-1)
    return F.silu(gate) * up


#: Reference op → ``fn(args, weight, params, micro_batch, routing)`` (autograd does the rest).
_OPS = {
    "rmsnorm": _rmsnorm,
    "layernorm": _layernorm,
    "gemm": lambda args, weight, *_: _gemm(args[0], weight),
    "router": lambda args, weight, *_: torch.softmax(args[0] @ weight, dim=-1),
    "grouped_gemm": lambda args, weight, params, mb, routing: _grouped_gemm(args[0], weight, routing),
    "attention": lambda args, weight, params, mb, routing: _attention(args[0], params, mb),
    "swiglu": _swiglu,
    "gelu": lambda args, *_: F.gelu(args[0]),
    "add": lambda args, *_: args[0] + args[1],
    "permute": lambda args, weight, params, mb, routing: _permute(args[0], args[1], params["top_k"], routing),
    "unpermute": lambda args, weight, params, *_: _unpermute(args[0], args[1], params["top_k"]),
}


def _apply(op, args, weight, micro_batch, routing):
    if op.op not in _OPS:
        raise NotImplementedError(f"the reference model has no op '{op.op}' (is {op.name} a collective "
                                  "over an axis that the reference does not elide?)")
    return _OPS[op.op](args, weight, dict(op.params), micro_batch, routing)


def reference_layer(fwd: LayerDag, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
                    micro_batch: int) -> torch.Tensor:
    """The output of the full (unsharded) layer DAG ``fwd`` for input ``x`` ``[tokens,
    hidden]`` with ``weights`` keyed by op name; differentiable by autograd."""
    values = {fwd.input: x}
    routing: dict = {}
    for op in fwd.ops:
        args = [values[name] for name in op.inputs]
        values[op.name] = _apply(op, args, weights.get(op.name), micro_batch, routing)
    return values[fwd.output]


class ReferenceModel(torch.nn.Module):
    """The whole model with full weights as ``nn.Parameter`` s, keyed by parameter name in
    :attr:`params` (dotted names, so they are registered with ``__`` instead of dots).
    ``plan`` is the run's WeightPlan (of ``program`` and ``seed``; built when None)."""

    def __init__(self, program: Program, seed: int = 0, dtype: torch.dtype = torch.float32, hf: str | None = None,
                 plan: WeightPlan | None = None):
        super().__init__()
        self.program, self.plan = program, plan or WeightPlan(program, seed, hf=hf)
        self.params: dict[str, torch.nn.Parameter] = {}
        for name in self.plan.names():
            param = torch.nn.Parameter(self.plan.full(name, dtype))
            self.register_parameter(name.replace(".", "__"), param)
            self.params[name] = param

    def grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient after a backward, keyed by parameter name; a tied LM
        head's summed with the embedding's into both (:func:`~.weights.tie_grads`), as the
        interpreter keeps them."""
        grads = {name: p.grad for name, p in self.params.items()}
        if self.plan.tied:
            tie_grads(grads)
        return grads

    def layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s parameters keyed by op name."""
        return {op: self.params[param_name(layer, op)] for op in self.plan.layer_specs}

    def micro_loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over one micro-batch's ``[tokens]`` ids and targets."""
        micro_batch = self.program.train.micro_batch
        h = F.embedding(ids, self.params[EMBEDDING])
        for layer in range(self.plan.layers):
            h = reference_layer(self.plan.full_forward, self.layer_weights(layer), h, micro_batch)
        return F.cross_entropy(self.logits_of(h), targets)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The next-token logits ``[batch, seq, vocab]`` of token ``ids`` ``[batch, seq]`` (any
        sequence length: attention and rotary embeddings follow the ids given)."""
        batch, seq = ids.shape
        h = F.embedding(ids.reshape(-1), self.params[EMBEDDING])
        for layer in range(self.plan.layers):
            h = reference_layer(self.plan.full_forward, self.layer_weights(layer), h, batch)
        return self.logits_of(h).reshape(batch, seq, -1)

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head's logits ``[tokens, vocab]`` for the last layer's output ``h``: the
        final norm (with the layer's norm epsilon), then ``h @ lm_head``."""
        norm, eps = self.params[FINAL_NORM], norm_eps(self.plan.norm_params)
        if norm.dim() == 1:
            h = F.rms_norm(h, (h.shape[-1],), norm, eps=eps)
        else:
            h = F.layer_norm(h, (h.shape[-1],), norm[0], norm[1], eps=eps)
        return h @ self.params[LM_HEAD]

    def forward(self, batch: Batch) -> torch.Tensor:
        """The loss: the mean over micro-batches of their mean token cross-entropy (all
        micro-batches have the same token count, so this is the mean over all tokens)."""
        count = batch.inputs.shape[0]
        return sum(self.micro_loss(*batch.micro(m)) for m in range(count)) / count


def reference_step(program: Program, batch: Batch, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of the reference model: the loss (a detached scalar) and
    the gradient of every parameter, keyed like :meth:`WeightPlan.names`."""
    model = ReferenceModel(program, seed, dtype)
    loss = model(batch)
    loss.backward()
    return loss.detach(), model.grads()
