"""The learning-rate schedule, through torch's ``LambdaLR`` (``torch.optim.lr_scheduler``).

Linear warm-up from ``peak / warmup`` to ``peak`` over the first ``warmup`` updates, then
cosine decay to ``MIN_LR_RATIO · peak`` reached *at* the last of the run's ``total`` updates,
the floor held after it; without decay the rate stays at ``peak`` after the warm-up. A run of
a single update after the warm-up spends it at the floor, as the cosine would.

Each update's rate is a closed form of its step (:func:`factor`), never a recurrence over the
updates before it, so a resumed run is positioned at its checkpoint's step at once
(:meth:`LRSchedule.at`: no replay of the past steps, which took 82 s at step 999,999 when
torch's recursive cosine was stepped there) and its rates are those of the run that was not
interrupted, to the last bit.

torch's schedulers write the rate into a ``torch.optim.Optimizer``'s parameter groups; the
distributed optimizer (:class:`~.optim.DistributedAdamW`) updates flat buckets of its own,
so the schedule keeps a group holder (:class:`_Rates`, no parameters of the model) that the
scheduler drives and the training loop reads the rate from (:attr:`LRSchedule.lr`).
"""

from __future__ import annotations

import functools
import math

import torch
from torch.optim import lr_scheduler

#: The cosine decay ends at this fraction of the peak learning rate.
MIN_LR_RATIO = 0.1


class _Rates(torch.optim.Optimizer):
    """The one parameter group torch's schedulers write the learning rate into; it updates
    nothing (the distributed optimizer does, with the rate read from here)."""

    def __init__(self, peak: float):
        super().__init__([torch.empty(0)], {"lr": peak, "initial_lr": peak})

    def step(self, closure=None):
        """Nothing to update: the distributed optimizer applies the step."""
        return None


def factor(step: int, warmup: int, total: int | None) -> float:
    """The rate of update ``step`` (0-based) as a fraction of the peak: ``(step + 1) / warmup``
    during the warm-up, then the cosine from 1 down to :data:`MIN_LR_RATIO` at update
    ``total - 1`` (held there after it), or 1 without decay (``total`` None, or no update
    after the warm-up)."""
    if step < warmup:
        return (step + 1) / warmup
    if total is None or total <= warmup:
        return 1.0
    span = total - 1 - warmup
    progress = 1.0 if span <= 0 else min(step - warmup, span) / span
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


class LRSchedule:
    """The learning rate of each update of a run: ``peak`` after ``warmup`` warm-up updates,
    decaying over ``total`` updates (None: constant after the warm-up). :attr:`lr` is the
    current update's rate; :meth:`advance` moves to the next update."""

    def __init__(self, peak: float, warmup: int = 0, total: int | None = None, *, start: int = 0):
        self.peak, self.warmup, self.total = peak, warmup, total
        self._rates = _Rates(peak)
        # torch's LambdaLR positioned at ``start``: it computes the rate of that step at once.
        self._scheduler = lr_scheduler.LambdaLR(self._rates, functools.partial(factor, warmup=warmup, total=total),
                                                last_epoch=start - 1)
        self.step = start

    @classmethod
    def at(cls, start: int, peak: float, warmup: int = 0, total: int | None = None) -> "LRSchedule":
        """The schedule positioned at update ``start`` (0-based): a resumed run's, in O(1)."""
        return cls(peak, warmup, total, start=start)

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
