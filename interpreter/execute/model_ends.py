"""The model's ends for one micro-batch: the vocabulary-parallel embedding (:class:`EmbedRun`)
and the final norm, LM head and cross-entropy (:class:`HeadRun`), each with its backward
adding its weight gradients.
"""

from __future__ import annotations

from typing import Mapping

import torch

from dhelix.interpreter.ops.comm import Communicator, Pending
from dhelix.interpreter.ops.handlers import KERNELS
from dhelix.interpreter.ops.kernels import KernelCtx, lm_head_backward
from .layer_exec import add_grad, count_storages


class EmbedRun:
    """The vocabulary-parallel embedding of one micro-batch: every tp rank looks up all
    tokens in its vocabulary shard, then the partial rows are reduce-scattered over tp
    (sequence parallelism) or all-reduced (without it)."""

    def __init__(self, weight: torch.Tensor, comm: Communicator, vocab_start: int,
                 sequence_parallel: bool = True, grads: dict | None = None, name: str = "embedding"):
        self.weight, self.comm, self.name = weight, comm, name
        self.ctx = KernelCtx(comm, "tp", vocab_start=vocab_start)
        self.sequence_parallel = sequence_parallel
        self.grads = grads if grads is not None else {}
        self.saved: tuple | None = None
        self._storages: dict[int, int] | None = None  # of :attr:`saved`, counted once (storages())

    def forward(self, ids: torch.Tensor, async_op: bool = False):
        """The layer-0 input for token ``ids`` ``[tokens]`` (all tokens of the micro-batch);
        with ``async_op`` a Pending of it, its tp reduction in flight."""
        partial, self.saved = KERNELS["embedding"].forward((ids,), self.weight, self.ctx)
        self._storages = None
        if self.sequence_parallel:
            return self.comm.reduce_scatter(partial, "tp", async_op=async_op)
        return self.comm.all_reduce(partial, "tp", async_op=async_op)

    def backward(self, grad: torch.Tensor, async_op: bool = False):
        """Add the embedding gradient for ``grad``, the gradient of the forward output. With
        ``async_op`` the gather of ``grad`` over tp is left in flight and a Pending is
        returned whose wait adds the gradient (nothing reads it before the optimizer)."""
        if self.sequence_parallel:
            gathered = self.comm.all_gather(grad, "tp", async_op=async_op)
        else:
            gathered = Pending.ready(grad) if async_op else grad
        if async_op:
            return Pending(gathered, None, lambda _: self._add_grad(gathered.wait()))
        self._add_grad(gathered)
        return None

    def _add_grad(self, grad: torch.Tensor) -> None:
        wgrad = KERNELS["embedding"].wgrad
        assert wgrad is not None, "the embedding has a weight"
        add_grad(self.grads, self.name, wgrad(grad, self.saved))
        self.saved = self._storages = None

    def storages(self) -> dict[int, int]:
        """The storages (data pointer → bytes) of what the forward saved for the backward,
        counted once per change (the memory probe asks after every layer)."""
        if self._storages is None:
            self._storages = {}
            count_storages((self.saved,), self._storages)
        return self._storages


class HeadRun:
    """The final norm, the vocabulary-parallel LM head and the cross-entropy of one
    micro-batch. ``norm`` is an rmsnorm ``[hidden]`` or layernorm ``[2, hidden]`` weight."""

    def __init__(self, norm: torch.Tensor, head: torch.Tensor, comm: Communicator, vocab_start: int,
                 sequence_parallel: bool = True, grads: dict | None = None,
                 names: tuple[str, str] = ("final_norm", "lm_head"), norm_params: Mapping | None = None):
        self.norm_kernel = KERNELS["rmsnorm" if norm.dim() == 1 else "layernorm"]
        self.norm, self.head, self.comm, self.names = norm, head, comm, names
        self.ctx = KernelCtx(comm, "tp", vocab_start=vocab_start)
        #: The final norm's parameters (its epsilon: the layer's norms', WeightPlan.norm_params).
        self.norm_ctx = KernelCtx(comm, "tp", params=dict(norm_params or {}))
        self.sequence_parallel = sequence_parallel
        self.grads = grads if grads is not None else {}
        self._norm_saved: tuple | None = None
        self._head_saved: tuple | None = None
        self._storages: dict[int, int] | None = None  # of both, counted once (storages())

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of the micro-batch (a scalar, the same on every tp rank)
        for the last layer's output ``x`` and the ``targets`` of all its tokens."""
        h, self._norm_saved = self.norm_kernel.forward((x,), self.norm, self.norm_ctx)
        if self.sequence_parallel:
            h = self.comm.all_gather(h, "tp")
        losses, self._head_saved = KERNELS["lm_head"].forward((h, targets), self.head, self.ctx)
        self._storages = None
        return losses.sum()

    def backward(self, scale: float, async_op: bool = False):
        """The gradient of ``scale * loss_sum`` with respect to ``x``; adds the LM-head and
        norm weight gradients to :attr:`grads`. With ``async_op`` a Pending of it: the tp
        reduction of the head's input gradient stays in flight, and the final norm's backward
        runs when the gradient is first read. The head's weight gradient is computed after
        that reduction is issued, beside it."""
        saved = self._head_saved
        assert saved is not None, "a head's backward follows its forward"
        grad_losses = torch.full((saved[0].shape[0],), scale, dtype=saved[0].dtype, device=saved[0].device)
        grad_h, head_wgrad = lm_head_backward(grad_losses, saved, self.head)
        grad_h = self.comm.reduce_scatter(grad_h, "tp", async_op=async_op) if self.sequence_parallel \
            else self.comm.all_reduce(grad_h, "tp", async_op=async_op)
        add_grad(self.grads, self.names[1], head_wgrad())
        return grad_h.then(self._norm_backward) if async_op else self._norm_backward(grad_h)

    def _norm_backward(self, grad_h: torch.Tensor) -> torch.Tensor:
        (grad_x,) = self.norm_kernel.dgrad(grad_h, self._norm_saved, self.norm)
        wgrad = self.norm_kernel.wgrad
        assert wgrad is not None, "a norm has a weight"
        add_grad(self.grads, self.names[0], wgrad(grad_h, self._norm_saved))
        self._norm_saved = self._head_saved = self._storages = None
        return grad_x

    def storages(self) -> dict[int, int]:
        """The storages (data pointer → bytes) of what the forwards saved for the backward,
        counted once per change (the memory probe asks after every layer)."""
        if self._storages is None:
            self._storages = {}
            count_storages((self._norm_saved, self._head_saved), self._storages)
        return self._storages
