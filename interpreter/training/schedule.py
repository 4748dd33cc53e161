"""The learning-rate schedule, through torch's schedulers (``torch.optim.lr_scheduler``).

Linear warm-up from ``peak / warmup`` to ``peak`` over the first ``warmup`` updates
(``LinearLR``), then cosine decay to ``MIN_LR_RATIO · peak`` reached *at* the last of the
run's ``total`` updates (``CosineAnnealingLR`` with ``T_max = total - warmup - 1``), chained
by ``SequentialLR``; without decay the rate stays at ``peak`` after the warm-up. A run of a
single update after the warm-up spends it at the floor (``ConstantLR``), as the cosine would.

torch's schedulers write the rate into a ``torch.optim.Optimizer``'s parameter groups; the
distributed optimizer (:class:`~.optim.DistributedAdamW`) updates flat buckets of its own,
so the schedule keeps a group holder (:class:`_Rates`, no parameters of the model) that the
schedulers drive and the training loop reads the rate from (:attr:`LRSchedule.lr`).

A resumed run continues the schedule where its checkpoint's step left it: the schedulers are
stepped that many times (:meth:`LRSchedule.at`), so the rates are those of the run that was
not interrupted, to the last bit (torch's cosine is computed recursively, step by step).
"""

from __future__ import annotations

import torch
from torch.optim import lr_scheduler

#: The cosine decay ends at this fraction of the peak learning rate.
MIN_LR_RATIO = 0.1


class _Rates(torch.optim.Optimizer):
    """The one parameter group torch's schedulers write the learning rate into; it updates
    nothing (the distributed optimizer does, with the rate read from here)."""

    def __init__(self, peak: float):
        super().__init__([torch.empty(0)], {"lr": peak})

    def step(self, closure=None):
        """Nothing to update: the distributed optimizer applies the step."""
        return None


class LRSchedule:
    """The learning rate of each update of a run: ``peak`` after ``warmup`` warm-up updates,
    decaying over ``total`` updates (None: constant after the warm-up). :attr:`lr` is the
    current update's rate; :meth:`advance` moves to the next update."""

    def __init__(self, peak: float, warmup: int = 0, total: int | None = None):
        self.peak, self.warmup, self.total = peak, warmup, total
        self._rates = _Rates(peak)
        self._scheduler = _chain(self._rates, peak, warmup, total)
        self.step = 0

    @classmethod
    def at(cls, start: int, peak: float, warmup: int = 0, total: int | None = None) -> "LRSchedule":
        """The schedule positioned at update ``start`` (0-based): a resumed run's."""
        schedule = cls(peak, warmup, total)
        for _ in range(start):
            schedule.advance()
        return schedule

    @property
    def lr(self) -> float:
        """The learning rate of the current update (:attr:`step`)."""
        return float(self._rates.param_groups[0]["lr"])

    def advance(self) -> None:
        """Move to the next update (torch's order: the optimizer's step, then the scheduler's)."""
        self._rates.step()
        self._scheduler.step()
        self.step += 1

    def rates(self, count: int) -> list[float]:
        """The rates of updates ``step`` … ``step + count - 1``, advancing past them."""
        out = []
        for _ in range(count):
            out.append(self.lr)
            self.advance()
        return out


def _chain(rates: _Rates, peak: float, warmup: int, total: int | None) -> lr_scheduler.LRScheduler:
    # The warm-up (if any), then the decay (if any), as one SequentialLR.
    parts, milestones = [], []
    if warmup:
        parts.append(lr_scheduler.LinearLR(rates, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1))
    if total is not None and total > warmup:
        span = total - 1 - warmup
        if warmup:
            milestones.append(warmup)
        if span > 0:
            parts.append(lr_scheduler.CosineAnnealingLR(rates, T_max=span, eta_min=MIN_LR_RATIO * peak))
        else:  # the one update after the warm-up is the last: at the floor
            parts.append(lr_scheduler.ConstantLR(rates, factor=MIN_LR_RATIO, total_iters=1))
    if not parts:  # constant from the start
        parts.append(lr_scheduler.ConstantLR(rates, factor=1.0, total_iters=0))
    return lr_scheduler.SequentialLR(rates, parts, milestones=milestones)
