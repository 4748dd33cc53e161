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

With expert parallelism (ep > 1) the grouped-GEMM weights are sharded over ep: ranks of one
dp group with different ep indices hold *different* experts, so those parameters form a
second buffer, summed only over the ``edp`` group (:data:`~.comm.EDP`: the dp / ep replicas
of the same expert shard). Each rank's expert gradient already holds the contributions of
every token its EP group routed to those experts, so that sum covers every DP replica's
tokens once, and dividing it by dp (not dp / ep) gives the same average as the dense
weights. Dense weights (attention, norms, router, the model's ends) stay in the buffer over
``dp``. Each buffer is padded to a multiple of its axis size and, under ZeRO-1, sliced
over that axis.
"""

from __future__ import annotations

import math
from typing import Collection, Mapping

import attrs
import torch

from .comm import EDP, Communicator


@attrs.frozen
class AdamWConfig:
    """AdamW hyper-parameters (Loshchilov & Hutter, decoupled weight decay)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0


class _Bucket:
    """Parameters synchronised over one axis: their names (sorted, the same on every
    replica), the flat buffer layout padded to a multiple of the axis size, and the AdamW
    moments of this rank's part (all of it, or its 1/size slice under ZeRO-1)."""

    def __init__(self, names, params: Mapping[str, torch.Tensor], comm: Communicator, axis: str,
                 zero1: bool, device):
        self.names, self.axis = sorted(names), axis
        self.shapes = [params[n].shape for n in self.names]
        self.total = sum(params[n].numel() for n in self.names)
        size = comm.size(axis)
        self.padded = math.ceil(max(self.total, 1) / size) * size
        width = self.padded // size if zero1 else self.padded
        self.offset = comm.index(axis) * width if zero1 else 0
        self.exp_avg = torch.zeros(width, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)

    def flat(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``tensors`` of :attr:`names` as one padded fp32 buffer."""
        flat = torch.zeros(self.padded, dtype=torch.float32, device=self.exp_avg.device)
        if self.names:
            flat[:self.total] = torch.cat([tensors[n].reshape(-1).float() for n in self.names])
        return flat

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped like the parameters, by name."""
        out, start = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            out[name] = flat[start:start + shape.numel()].view(shape)
            start += shape.numel()
        return out


class DistributedAdamW:
    """AdamW over this rank's ``params`` (name → tensor, updated in place) with the
    gradients averaged over dp by ``comm``; ``zero1`` shards the optimizer state.

    ``expert`` names the parameters sharded over ep (the grouped GEMMs'; see
    :meth:`~.weights.WeightPlan.ep_sharded`): with ep > 1 they are synchronised over the
    ``edp`` group instead of ``dp`` (module docstring) and must be given — None is refused
    then, so that no caller silently sums the gradients of different experts."""

    def __init__(self, params: Mapping[str, torch.Tensor], comm: Communicator, *, zero1: bool = False,
                 config: AdamWConfig = AdamWConfig(), expert: Collection[str] | None = None):
        self.params, self.comm, self.zero1, self.config = dict(params), comm, zero1, config
        self.dp = comm.size("dp")
        if comm.size("ep") > 1 and expert is None:
            raise ValueError("with ep > 1 the optimizer must be told which parameters are sharded over "
                             "ep (expert=…): their gradients are summed over edp, not dp")
        # With one expert shard the experts are plain dp replicas: one buffer suffices.
        expert = set(expert or ()) & set(self.params) if comm.size("ep") > 1 else set()
        like = next(iter(self.params.values()), torch.zeros(()))
        self.buckets = [_Bucket(set(self.params) - expert, self.params, comm, "dp", zero1, like.device)]
        if expert:
            self.buckets.append(_Bucket(expert, self.params, comm, EDP, zero1, like.device))
        self.steps = 0

    def _average(self, bucket: _Bucket, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        # A sum over the bucket's axis divided by dp, for edp too (module docstring).
        flat = bucket.flat(grads)
        if self.zero1:
            flat = self.comm.reduce_scatter(flat, bucket.axis)
        else:
            self.comm.all_reduce(flat, bucket.axis)
        return flat / self.dp

    def averaged_grads(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every parameter's gradient averaged over dp (ZeRO-1 gathers the slices: for checks)."""
        out = {}
        for bucket in self.buckets:
            flat = self._average(bucket, grads)
            if self.zero1:
                flat = self.comm.all_gather(flat, bucket.axis)
            out.update(bucket.unflatten(flat))
        return out

    def step(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Average ``grads`` (dense over dp, experts over edp) and apply one AdamW update to
        :attr:`params`."""
        self.steps += 1
        for bucket in self.buckets:
            grad = self._average(bucket, grads)
            flat = bucket.flat(self.params)
            mine = flat[bucket.offset:bucket.offset + grad.numel()]
            self._adamw(bucket, mine, grad)
            if self.zero1:
                flat = self.comm.all_gather(mine.contiguous(), bucket.axis)
            for name, value in bucket.unflatten(flat).items():
                self.params[name].copy_(value)

    def _adamw(self, bucket: _Bucket, param: torch.Tensor, grad: torch.Tensor) -> None:
        cfg = self.config
        beta1, beta2 = cfg.betas
        param.mul_(1 - cfg.lr * cfg.weight_decay)
        bucket.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        bucket.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = cfg.lr / (1 - beta1 ** self.steps)
        denom = (bucket.exp_avg_sq / (1 - beta2 ** self.steps)).sqrt_().add_(cfg.eps)
        param.addcdiv_(bucket.exp_avg, denom, value=-step_size)
