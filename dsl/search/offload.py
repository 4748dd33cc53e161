"""How `dhelix tune` offloads the optimizer's states to host memory (``train { offload =
optimizer  offload_percent = P }``): which share, and when at all.

**Which share.** A choice that offloads keeps P % of its optimizer states on the host, P one
of :data:`OFFLOAD_PERCENTS` (tenths). Offloading more frees more device memory (each
parameter's 12 bytes of masters and moments) and takes more host memory; its step changes
only in the optimizer's part, :func:`~dhelix.dsl.planner.costmodel.step_optimizer_time`,
which is linear in each rank's parameters. So among the shares that fit (the device's
memory less the reserve, from below; the host memory of a node, from above) one share is
the fastest on every rank at once, hence for the whole step, which never shortens when a
rank's optimizer step lengthens: :func:`fastest_percent` (the least of equals). Where the
host link is slower per parameter than the device's optimizer (every shipped profile), that
is the least share that fits the device. The tenths are a grid a user would write
(Megatron-LM takes any fraction): a finer one fits a choice a few GB closer to the device's
memory at the price of more device states to check per choice, and the step between two
tenths is a tenth of what offloading all costs. Where the planner's own choices read the
device memory (a partition block's ``by auto`` counts, ``launch = auto``), the memory of a
share is known only after those choices, which simulate the step several times: such a
choice offloads all (100 %), the share that frees the most.

**When.** Where even the least share's host step is no faster than the device's
(:func:`offload_slower`), a choice that fits on the device is never faster offloaded, and
the offloaded copy would only add a slower twin to the table: a choice offloads only where
its twin does not fit on the device (the pricer rules the others out by that twin's bound;
:meth:`~dhelix.dsl.search.pricer.Pricer.price`). Elsewhere both are priced.
"""

from __future__ import annotations

from typing import Iterable

from dhelix.dsl.planner.costmodel import optimizer_time, step_optimizer_time

#: The shares (percent of each optimizer part's parameters) a choice may offload.
OFFLOAD_PERCENTS = tuple(range(10, 101, 10))


def fastest_percent(percents: Iterable[int], profile, dtype: str) -> int:
    """The share of ``percents`` whose optimizer step is the shortest on ``profile`` for a
    model in ``dtype`` (the least of equals): the shortest for any parameter count, since
    each part of the step is linear in it."""
    return min(percents, key=lambda percent: (step_optimizer_time(1.0, dtype, profile, percent), percent))


def offload_slower(profile, dtype: str, percents: Iterable[int] = OFFLOAD_PERCENTS) -> bool:
    """Whether an optimizer step offloading any of ``percents`` of its states is no faster
    than the device's on ``profile`` for a model in ``dtype``, whatever the parameters (both
    times are linear in them); False without the profile's host section (nothing offloads then)."""
    if profile.host is None:
        return False
    device = optimizer_time(1.0, dtype, profile)
    return all(step_optimizer_time(1.0, dtype, profile, percent) >= device for percent in percents)
