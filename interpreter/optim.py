"""Data-parallel gradient synchronisation and AdamW.

The gradients of a rank's parameters are flattened into one buffer (in sorted name order,
the same on every DP replica since replicas hold the same stages and shards) and averaged
over the ``dp`` axis:

* plain data parallelism: one all-reduce of the buffer, then every replica runs AdamW on
  all of it;
* ZeRO-1 (Rajbhandari et al., 2020, stage 1): a reduce-scatter leaves each replica the
  average of its 1/dp slice of the buffer; it keeps the AdamW moments of that slice only,
  updates those parameters, and an all-gather gives every replica all parameters again.

Both compute the same numbers; the average over replicas matches the reference model, whose
loss is the mean over all micro-batches of all replicas.
"""

from __future__ import annotations

import math
from typing import Mapping

import attrs
import torch

from .comm import Communicator


@attrs.frozen
class AdamWConfig:
    """AdamW hyper-parameters (Loshchilov & Hutter, decoupled weight decay)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0


class DistributedAdamW:
    """AdamW over this rank's ``params`` (name → tensor, updated in place) with the
    gradients averaged over ``dp`` by ``comm``; ``zero1`` shards the optimizer state."""

    def __init__(self, params: Mapping[str, torch.Tensor], comm: Communicator, *, zero1: bool = False,
                 config: AdamWConfig = AdamWConfig()):
        self.params, self.comm, self.zero1, self.config = dict(params), comm, zero1, config
        self.names = sorted(self.params)
        self.dp = comm.size("dp")
        total = sum(self.params[n].numel() for n in self.names)
        self.padded = math.ceil(max(total, 1) / self.dp) * self.dp
        self.total = total
        width = self.padded // self.dp if zero1 else self.padded
        self.offset = comm.index("dp") * width if zero1 else 0
        like = next(iter(self.params.values()), torch.zeros(()))
        self.exp_avg = torch.zeros(width, dtype=torch.float32, device=like.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.steps = 0

    def _flat(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=torch.float32, device=self.exp_avg.device)
        if self.names:
            flat[:self.total] = torch.cat([tensors[n].reshape(-1).float() for n in self.names])
        return flat

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name in self.names:
            param = self.params[name]
            out[name] = flat[start:start + param.numel()].view(param.shape)
            start += param.numel()
        return out

    def average(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The flat gradient averaged over dp: all of it, or (ZeRO-1) this replica's slice."""
        flat = self._flat(grads)
        if self.zero1:
            flat = self.comm.reduce_scatter(flat, "dp")
        else:
            self.comm.all_reduce(flat, "dp")
        return flat / self.dp

    def averaged_grads(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every parameter's gradient averaged over dp (ZeRO-1 gathers the slices: for checks)."""
        flat = self.average(grads)
        if self.zero1:
            flat = self.comm.all_gather(flat, "dp")
        return self._unflatten(flat)

    def step(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Average ``grads`` over dp and apply one AdamW update to :attr:`params`."""
        grad = self.average(grads)
        flat = self._flat(self.params)
        width = grad.numel()
        mine = flat[self.offset:self.offset + width]
        self._adamw(mine, grad)
        if self.zero1:
            flat = self.comm.all_gather(mine.contiguous(), "dp")
        for name, value in self._unflatten(flat).items():
            self.params[name].copy_(value)

    def _adamw(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        cfg = self.config
        self.steps += 1
        beta1, beta2 = cfg.betas
        param.mul_(1 - cfg.lr * cfg.weight_decay)
        self.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = cfg.lr / (1 - beta1 ** self.steps)
        denom = (self.exp_avg_sq / (1 - beta2 ** self.steps)).sqrt_().add_(cfg.eps)
        param.addcdiv_(self.exp_avg, denom, value=-step_size)
