"""The top choices of `dhelix tune` priced again under what the profile does not know.

A shipped profile's collective efficiencies (1.0: the link's peak, until `dhelix profile`
measures them), its GEMM efficiency and its per-step link latencies are stated, not measured,
for most machines. A choice that wins by a few per cent at those values may lose at others:
each top choice is simulated again at every corner of the :data:`KNOBS` box (and at the
profile's own values), which gives its median and worst step; its rank among the top at each
corner says whether the order of the top holds within the uncertainty."""

from __future__ import annotations

import itertools
import statistics
from typing import Callable

import attrs

from dhelix.dsl.frontend.profiles import Profile
from dhelix.dsl.search.pricer import Priced


@attrs.frozen
class Knob:
    """A factor range applied to a group of the profile's numbers: ``low`` to ``high`` times
    the stated value (an efficiency capped at 1)."""

    name: str
    low: float
    high: float

    def describe(self) -> str:
        """``collective efficiency x0.7-1``."""
        return f"{self.name} x{self.low:g}-{self.high:g}"


#: What the search does not know of a shipped profile, as factors of its stated values:
#: collective efficiency 0.7-1.0 [assumed: the shipped profiles state 1.0, the link's peak
#: (DHelix Table 1's assumption); NCCL reaches about 360-400 of NVLink 4's 450 GB/s per
#: direction (h100.yaml's note), 0.8-0.89, and less across nodes, where the a100 fit found
#: 0.53]; GEMM efficiency 0.85-1.1 [assumed: the h100 profile's 0.71 is NOTES' "700 TFLOPS
#: assumed"; its fit of the published runs left 15 % mean error]; link latency 0.5-3x
#: [assumed: the profiles' 3 and 10 µs per step are order-of-magnitude choices].
KNOBS = (Knob("collective efficiency", 0.7, 1.0), Knob("GEMM efficiency", 0.85, 1.1), Knob("link latency", 0.5, 3.0))


def perturbed(profile: Profile, factors: tuple[float, float, float]) -> Profile:
    """``profile`` with its collective efficiencies, GEMM efficiencies (``gemm``,
    ``gemm_fp8``) and link latencies times ``factors`` (in :data:`KNOBS` order; efficiencies
    capped at 1)."""
    collective, gemm, latency = factors
    collectives = {kind: attrs.evolve(c, efficiency=min(1.0, c.efficiency * collective),
                                      lanes={lane: min(1.0, e * collective) for lane, e in c.lanes.items()})
                   for kind, c in profile.collectives.items()}
    achieved = {op: min(1.0, e * gemm) if op.startswith("gemm") else e for op, e in profile.achieved.items()}
    links = {lane: attrs.evolve(link, latency_us=link.latency_us * latency) for lane, link in profile.links.items()}
    return attrs.evolve(profile, collectives=collectives, achieved=achieved, links=links)


def corners(knobs: tuple[Knob, ...] = KNOBS) -> tuple[tuple[float, ...], ...]:
    """The profile's own values (all factors 1) first, then every corner of the ``knobs`` box."""
    return ((1.0,) * len(knobs),) + tuple(itertools.product(*((k.low, k.high) for k in knobs)))


@attrs.frozen
class Spread:
    """One top choice priced at every corner: its ``steps`` (seconds, :func:`corners`'
    order: the profile's own first) and its rank among the top at each (1: fastest)."""

    priced: Priced
    steps: tuple[float, ...]
    ranks: tuple[int, ...]

    @property
    def worst(self) -> float:
        """The longest step over the corners."""
        return max(self.steps)

    @property
    def median(self) -> float:
        """The median step over the profile's values and the corners."""
        return statistics.median(self.steps)

    @property
    def flips(self) -> bool:
        """Whether the choice's rank among the top changes within the uncertainty."""
        return len(set(self.ranks)) > 1


def spreads(top: tuple[Priced, ...], price_at: Callable[[tuple[float, ...]], Callable[[Priced], float]],
            knobs: tuple[Knob, ...] = KNOBS) -> tuple[Spread, ...]:
    """Each of ``top`` priced at every corner: ``price_at(factors)`` gives the function that
    prices a choice's step with the profile :func:`perturbed` by ``factors`` (the first,
    all 1, is the search's own step). In ``top``'s order."""
    steps: list[list[float]] = [[p.seconds] for p in top]
    for factors in corners(knobs)[1:]:
        price = price_at(factors)
        for row, priced in zip(steps, top, strict=True):
            row.append(price(priced))
    by_corner = list(zip(*steps, strict=True))
    ranks = [[sorted(corner).index(corner[i]) + 1 for corner in by_corner] for i in range(len(top))]
    return tuple(Spread(p, tuple(row), tuple(rank)) for p, row, rank in zip(top, steps, ranks, strict=True))


def most_robust(found: tuple[Spread, ...]) -> tuple[Spread, ...]:
    """``found`` ordered by worst step (ties: the search's order): the first is the choice
    whose worst case is best."""
    return tuple(sorted(found, key=lambda s: s.worst))
