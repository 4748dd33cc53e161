"""MoE top-k routing and its two kernels: ``permute`` (each token's rows grouped by expert,
the rows per expert recorded on the device) and ``unpermute`` (each token's expert outputs
summed, weighted by their probabilities). The all_to_all between them is :mod:`.moe`'s.
"""

from __future__ import annotations

import attrs
import torch

from .kernels import Kernel

@attrs.frozen
class Routing:
    """Top-k routing of ``tokens`` tokens: chosen experts and probabilities ``[tokens, k]``
    and ``order``, the (token, slot) pairs ``t * k + s`` sorted stably by expert; all on the
    device (nothing read back)."""

    experts: torch.Tensor
    probs: torch.Tensor
    order: torch.Tensor

    @property
    def rows(self) -> torch.Tensor:
        """The source token of each routed row."""
        return self.order // self.experts.shape[1]


def route(scores: torch.Tensor, top_k: int) -> Routing:
    """The top-k routing that ``scores`` ``[tokens, experts]`` choose (deterministic, so
    permute and unpermute derive the same order independently)."""
    probs, experts = scores.topk(top_k, dim=-1)
    order = torch.argsort(experts.reshape(-1), stable=True)
    return Routing(experts, probs, order)


def expert_counts(routing: Routing, experts: int) -> torch.Tensor:
    """The routed rows per expert, int64 on the device (a scatter-add: CUDA's bincount reads
    its input's maximum back to size its output)."""
    flat = routing.experts.reshape(-1)
    return flat.new_zeros(experts).scatter_add_(0, flat, torch.ones_like(flat))


def _permute_forward(inputs, weight, ctx):
    """Replicate each token top_k times, rows grouped by expert; records the rows per expert
    (on the device: the dispatch or the grouped GEMM reads them back, :func:`.moe.to_host`)."""
    x, scores = inputs
    routing = route(scores, int(ctx.params["top_k"]))
    ctx.routing["counts"] = expert_counts(routing, scores.shape[1])
    rows = routing.rows
    return x[rows], (rows, x.shape[0])


def _permute_dgrad(grad, saved, weight):
    rows, tokens = saved
    dx = grad.new_zeros((tokens, grad.shape[1])).index_add_(0, rows, grad)
    return (dx, None)  # the scores only choose rows: no gradient


def _unpermute_forward(inputs, weight, ctx):
    """Each token's sum of its top_k expert outputs, weighted by their probabilities."""
    y, scores = inputs
    routing = route(scores, int(ctx.params["top_k"]))
    weights = routing.probs.reshape(-1)[routing.order]
    rows = routing.rows
    out = y.new_zeros((scores.shape[0], y.shape[1])).index_add_(0, rows, y * weights[:, None])
    return out, (y, routing, weights, scores.shape)


def _unpermute_dgrad(grad, saved, weight):
    y, routing, weights, scores_shape = saved
    tokens, experts = scores_shape
    picked = grad[routing.rows]
    dy = picked * weights[:, None]
    dweights = (picked * y).sum(-1)
    slot = routing.rows * experts + routing.experts.reshape(-1)[routing.order]
    dscores = grad.new_zeros(tokens * experts).index_add_(0, slot, dweights)
    return (dy, dscores.view(tokens, experts))


#: The MoE permutes by op kind.
ROUTING_KERNELS: dict[str, Kernel] = {
    "permute": Kernel(_permute_forward, _permute_dgrad),
    "unpermute": Kernel(_unpermute_forward, _unpermute_dgrad),
}
