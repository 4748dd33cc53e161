"""The search of `dhelix tune`: branch and bound over the layouts of a :class:`Space`.

Every choice is a program variant (:mod:`variant`) checked by the passes of `dhelix check`,
given the planner's choices as `simulate` gives them (``by auto`` chunk counts, group orders,
``launch = auto``), priced by the step simulator and capped by the profile's device memory.
Layouts are visited in order of their lower bound (:mod:`bound`); once the K-th best step
priced is no longer than the next layout's bound, no unvisited choice can enter the top K,
and the search stops. Inside a layout, each choice's peak memory and a floor of its step are
computed before any simulation (:func:`~dhelix.dsl.simulator.events.untimed`), and a choice
that needs its SI layer pair planned waits, bound by its floor, until nothing with a lower
bound is left (then a simulation with the pairs at their lower bound may still rule it out);
so does a choice whose partition has chunk chains, bound by its step before the planner
settles their counts (which simulates the step several times per choice). The result
equals an exhaustive pricing of every choice
(:func:`exhaustive`; a test holds the two to each other), in one process
(:mod:`~dhelix.dsl.search.branch`) or several (``jobs``, :mod:`~dhelix.dsl.search.workers`).

Work is shared across choices: the SI plan of a layer pair depends on the two layer DAGs, the
strands block and the profile only, so it is computed once per distinct pair
(:class:`~dhelix.dsl.search.plan_cache.PlanCache`), and equal DAGs are interned so the
pair-cost caches hit.
"""

from __future__ import annotations

import time
from typing import Callable

import attrs

# The pricing's names are imported from here by the command, the benchmarks and the tests.
from dhelix.dsl.search.bound import relaxed_costs  # noqa: F401
from dhelix.dsl.search.branch import Incumbent, Tally, bound_of, branch, insert
from dhelix.dsl.search.pricer import Deferred, Priced, Pricer, Pruned, Refused, TooBig  # noqa: F401
from dhelix.dsl.search.space import Space
from dhelix.dsl.search.workers import FORKS, search_across
from dhelix.dsl.simulator.memory import GB


@attrs.frozen
class Outcome:
    """What a search found: the best ``top`` choices that fit, fastest first, and counts of
    what it looked at: choices simulated, and each choice once among those that fit, were
    refused, ruled out by a bound or over the device memory (by its bound, its peak computed
    without a simulation, or simulated).
    ``same`` counts the choices that are others again (a generated partition with nothing
    to partition). ``complete`` is False when the time budget ran out first (then ``bound`` is the least
    lower bound among the layouts not visited, None when some were not even bounded).
    ``jobs``: the processes that searched. ``found``: seconds into the search when the best
    (the first of ``top``) was priced; the rest went to proving that nothing beats it (None:
    nothing fits). ``memory_gb``: the device's memory; ``reserve_gb`` of it was kept free
    (:mod:`~dhelix.dsl.search.headroom`)."""

    top: tuple[Priced, ...]
    simulated: int
    fit: int
    refused: int
    pruned: int
    too_big: int
    layouts: int
    choices: int
    seconds: float
    complete: bool = True
    bound: float | None = None
    plans: int = 0
    memory_gb: float | None = None
    reasons: tuple[tuple[str, int], ...] = ()
    same: int = 0
    jobs: int = 1
    found: float | None = None
    reserve_gb: float = 0.0
    #: The least memory (GB) a choice over the memory needs, and whether that is its peak
    #: (else a lower bound of it); None when no choice was over.
    nearest_gb: float | None = None
    nearest_exact: bool = True
    #: The GPUs of a node: where the table marks a node's end in each layout's mesh.
    gpus_per_node: int = 0

    @property
    def usable_gb(self) -> float | None:
        """What a choice's peak may take (GB): the device's memory less the reserve."""
        return None if self.memory_gb is None else self.memory_gb - self.reserve_gb


def search(pricer: Pricer, space: Space, *, top: int = 5, budget: float | None = None,
           progress: Callable[[int, int], None] | None = None, jobs: int = 1) -> Outcome:
    """The ``top`` fastest choices of ``space`` that fit, by branch and bound (see the module
    docstring); ``budget`` caps the seconds spent (None: none; half of it at most goes to
    the bounds); ``progress(done, total)`` is called as layouts are bounded and visited;
    ``jobs`` processes search side by side (the same top, sooner on as many cores; one
    where processes cannot be forked)."""
    start = time.perf_counter()
    layouts = list(space.layouts())
    bounding_ends = None if budget is None else start + budget / 2
    deadline = None if budget is None else start + budget
    jobs = jobs if FORKS else 1
    if jobs > 1:  # the plans computed there are merged into the pricer's
        incumbent, tally, left = search_across(pricer, space, layouts, top, jobs, (bounding_ends, deadline),
                                               progress)
    else:
        tally, incumbent = Tally(), Incumbent(top)
        bounded = bound_of(pricer, space, layouts, tally, bounding_ends, progress)
        left = branch(pricer, space, bounded, incumbent, tally, deadline, progress)
    found = None if incumbent.found is None else incumbent.found - start
    return Outcome(tuple(incumbent.best), tally.simulated, tally.fit, tally.refused, tally.pruned, tally.too_big,
                   len(layouts), len(layouts) * len(space.schedules), time.perf_counter() - start,
                   left is None and not tally.unbounded, left, len(pricer.plans), pricer.memory_gb,
                   tuple(sorted(tally.reasons.items(), key=lambda kv: (-kv[1], kv[0]))), tally.same, jobs, found,
                   pricer.reserve.bytes_of(pricer.memory_gb) / GB if pricer.memory_gb is not None else 0.0,
                   None if tally.nearest is None else tally.nearest[0] / GB,
                   tally.nearest is None or tally.nearest[1], pricer.gpus_per_node)


def exhaustive(pricer: Pricer, space: Space, top: int = 5) -> tuple[Priced, ...]:
    """The ``top`` fastest fitting choices found by pricing every choice of ``space`` (what
    :func:`search` must equal; slow, for tests)."""
    best: list[Priced] = []
    for choice in space.choices():
        result = pricer.price(choice)
        if isinstance(result, Priced) and result.fits:
            best = insert(best, result, top)
    return tuple(best)


