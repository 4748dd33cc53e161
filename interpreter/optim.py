"""Data-parallel gradient synchronisation and AdamW.

The gradients of a rank's parameters are flattened into one buffer (in sorted name order,
the same on every DP replica since replicas hold the same stages and shards) and averaged
over the ``dp`` axis:

* plain data parallelism: one all-reduce of the buffer, then every replica runs AdamW on
  all of it;
* ZeRO-1 (Rajbhandari et al., 2020, stage 1): a reduce-scatter leaves each replica the
  average of its 1/dp slice of the buffer; it keeps the AdamW moments of that slice only,
  updates those parameters, and an all-gather gives every replica all parameters again.

Before the update the gradients may be clipped to a global norm (``AdamWConfig.clip``, as
``torch.nn.utils.clip_grad_norm_`` on the full model): the norm counts every element of the
full model once, so each rank weighs its squared gradients by one over the number of ranks
that hold the same elements (:func:`norm_weights`: tp-replicated norms are held by every tp
rank, a pipeline stage's weights by its rank only, a ZeRO-1 slice by one replica) and the
weighted sums are added over the world. The learning rate of each update comes from
:func:`lr_at` (linear warm-up, then cosine decay), passed to :meth:`DistributedAdamW.step`.

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
    #: The largest global gradient norm (None: no clipping).
    clip: float | None = None
    #: Keep fp32 master weights (Megatron's mixed precision: bf16 parameters are copies of
    #: them); False updates the parameters in their own dtype ("pure" bf16).
    master: bool = True


#: The cosine decay ends at this fraction of the peak learning rate.
MIN_LR_RATIO = 0.1


def lr_at(step: int, peak: float, warmup: int, total: int | None) -> float:
    """The learning rate of update ``step`` (0-based): linear warm-up from ``peak / warmup``
    to ``peak`` over the first ``warmup`` updates, then cosine decay to
    ``MIN_LR_RATIO · peak`` at update ``total`` (None: constant after the warm-up). The
    same numbers as torch's ``SequentialLR(LinearLR, CosineAnnealingLR)`` (tested)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if total is None or total <= warmup:
        return peak
    progress = min(step - warmup, total - warmup) / (total - warmup)
    low = MIN_LR_RATIO * peak
    return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * progress))


def norm_weights(plan, comm: Communicator, names) -> dict[str, float]:
    """For each of this rank's parameter ``names``, one over the number of ranks in the
    world that hold the same elements (the same shard of the same parameter); collective
    over the world. ``plan`` is the run's :class:`~.weights.WeightPlan`."""
    import torch.distributed as dist

    keys = {(name, part) for name in plan.names()
            for part in range(comm.size(plan.spec(name).axis) if plan.spec(name).axis else 1)}
    index = {key: i for i, key in enumerate(sorted(keys))}
    mine = {name: (name, comm.index(plan.spec(name).axis) if plan.spec(name).axis else 0) for name in names}
    counts = torch.zeros(len(index), dtype=torch.float64)
    for key in mine.values():
        counts[index[key]] += 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    return {name: 1.0 / float(counts[index[key]]) for name, key in mine.items()}


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
        self.width = width
        self.exp_avg = torch.zeros(width, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        #: This rank's part of the fp32 master weights (None: the parameters are the masters).
        self.master: torch.Tensor | None = None

    def keep_master(self, params: Mapping[str, torch.Tensor]) -> None:
        """Start the fp32 masters of this rank's part from ``params``."""
        self.master = self.flat(params)[self.offset:self.offset + self.width].clone()

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
                 config: AdamWConfig = AdamWConfig(), expert: Collection[str] | None = None,
                 weights: Mapping[str, float] | None = None):
        self.params, self.comm, self.zero1, self.config = dict(params), comm, zero1, config
        #: The global gradient norm of the last step (None without ``weights``: see
        #: :func:`norm_weights`; clipping needs them).
        self.last_norm: float | None = None
        if config.clip is not None and weights is None:
            raise ValueError("clipping needs the norm weights of the parameters (weights=norm_weights(…))")
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
        if config.master:
            for bucket in self.buckets:
                bucket.keep_master(self.params)
        self.norm_weights = None
        if weights is not None:
            # Under ZeRO-1 each replica of the bucket's axis holds its own slice.
            self.norm_weights = [bucket.flat({n: torch.full_like(self.params[n], weights[n] * (
                comm.size(bucket.axis) if zero1 else 1), dtype=torch.float32) for n in bucket.names})
                for bucket in self.buckets]
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

    def global_norm(self, averaged: list[torch.Tensor]) -> float:
        """The norm of the full model's averaged gradient from this rank's ``averaged``
        bucket parts (collective over the world)."""
        import torch.distributed as dist

        total = torch.zeros((), dtype=torch.float64, device=averaged[0].device)
        for bucket, weight, grad in zip(self.buckets, self.norm_weights, averaged, strict=True):
            part = weight[bucket.offset:bucket.offset + grad.numel()]
            total += (part.double() * grad.double() ** 2).sum()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        return math.sqrt(float(total))

    def step(self, grads: Mapping[str, torch.Tensor], lr: float | None = None) -> None:
        """Average ``grads`` (dense over dp, experts over edp), clip them to the global norm
        ``config.clip`` and apply one AdamW update with learning rate ``lr`` (default
        ``config.lr``) to :attr:`params`; the norm before clipping is :attr:`last_norm`."""
        self.steps += 1
        averaged = [self._average(bucket, grads) for bucket in self.buckets]
        if self.norm_weights is not None:
            self.last_norm = self.global_norm(averaged)
            if self.config.clip is not None:
                # torch.nn.utils.clip_grad_norm_'s coefficient, so the reference agrees.
                scale = min(1.0, self.config.clip / (self.last_norm + 1e-6))
                averaged = [grad * scale for grad in averaged]
        for bucket, grad in zip(self.buckets, averaged, strict=True):
            flat = bucket.flat(self.params)
            mine = bucket.master if bucket.master is not None else flat[bucket.offset:bucket.offset + grad.numel()]
            self._adamw(bucket, mine, grad, self.config.lr if lr is None else lr)
            self._publish(bucket, mine, flat)

    def _publish(self, bucket: _Bucket, mine: torch.Tensor, flat: torch.Tensor) -> None:
        # Every replica's parameters from the updated part (a copy rounds fp32 masters to bf16).
        if self.zero1:
            flat = self.comm.all_gather(mine.contiguous(), bucket.axis)
        elif bucket.master is not None:
            flat = mine
        for name, value in bucket.unflatten(flat).items():
            self.params[name].copy_(value)

    def moments(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This rank's AdamW moments (exp_avg, exp_avg_sq) of each of its parameters, shaped
        like them (ZeRO-1 gathers the slices over the bucket's axis: collective)."""
        out: dict = {}
        for bucket in self.buckets:
            pair = [m if not self.zero1 else self.comm.all_gather(m.contiguous(), bucket.axis)
                    for m in (bucket.exp_avg, bucket.exp_avg_sq)]
            first, second = (bucket.unflatten(m) for m in pair)
            out.update({name: (first[name].clone(), second[name].clone()) for name in bucket.names})
        return out

    def masters(self) -> dict[str, torch.Tensor]:
        """The fp32 value of each of this rank's parameters: its master weight, or the
        parameter itself without masters (ZeRO-1 gathers the slices: collective)."""
        out = {}
        for bucket in self.buckets:
            if bucket.master is None:
                out.update({name: self.params[name].float() for name in bucket.names})
                continue
            flat = self.comm.all_gather(bucket.master.contiguous(), bucket.axis) if self.zero1 else bucket.master
            out.update({name: value.clone() for name, value in bucket.unflatten(flat).items()})
        return out

    def load_state(self, masters: Mapping[str, torch.Tensor],
                   moments: Mapping[str, tuple[torch.Tensor, torch.Tensor]], steps: int) -> None:
        """Set every parameter and its master from fp32 ``masters``, the moments and the step
        count (each tensor shaped like this rank's shard, as :meth:`masters` and
        :meth:`moments` return them on any layout)."""
        for bucket in self.buckets:
            for name in bucket.names:
                self.params[name].copy_(masters[name])
            if bucket.master is not None:
                bucket.keep_master(masters)
            for slot, moment in enumerate((bucket.exp_avg, bucket.exp_avg_sq)):
                flat = bucket.flat({name: moments[name][slot] for name in bucket.names})
                moment.copy_(flat[bucket.offset:bucket.offset + moment.numel()])
        self.steps = steps

    def _adamw(self, bucket: _Bucket, param: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        cfg = self.config
        beta1, beta2 = cfg.betas
        param.mul_(1 - lr * cfg.weight_decay)
        bucket.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        bucket.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** self.steps)
        denom = (bucket.exp_avg_sq / (1 - beta2 ** self.steps)).sqrt_().add_(cfg.eps)
        param.addcdiv_(bucket.exp_avg, denom, value=-step_size)
