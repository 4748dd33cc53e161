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
(:func:`exhaustive`; a test holds the two to each other).

Work is shared across choices: the SI plan of a layer pair depends on the two layer DAGs, the
strands block and the profile only, so it is computed once per distinct pair
(:class:`~dhelix.dsl.search.plan_cache.PlanCache`), and equal DAGs are interned so the
pair-cost caches hit.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable

import attrs

from dhelix.dsl.search.partitions import NOTHING_TO_PARTITION
# The pricing's names are imported from here by the command, the benchmarks and the tests.
from dhelix.dsl.search.bound import relaxed_costs  # noqa: F401
from dhelix.dsl.search.pricer import Deferred, Priced, Pricer, Pruned, Refused, TooBig
from dhelix.dsl.search.space import Choice, Layout, Space
from dhelix.dsl.simulator.memory import GB


@attrs.frozen
class Outcome:
    """What a search found: the best ``top`` choices that fit, fastest first, and counts of
    what it looked at: choices simulated, and each choice once among those that fit, were
    refused, ruled out by a bound or over the device memory (by its bound, its peak computed
    without a simulation, or simulated).
    ``same`` counts the choices that are others again (a generated partition with nothing
    to partition). ``complete`` is False when the time budget ran out first (then ``bound`` is the least
    lower bound among the layouts not visited, None when some were not even bounded)."""

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



@attrs.define
class _Tally:
    """Counts of a search as it goes (choices, except ``unbounded``: layouts)."""

    simulated: int = 0
    fit: int = 0
    refused: int = 0
    pruned: int = 0
    too_big: int = 0
    same: int = 0
    unbounded: int = 0
    reasons: dict = attrs.field(factory=dict)

    def refuse(self, why: str, count: int = 1) -> None:
        self.refused += count
        self.reasons[why] = self.reasons.get(why, 0) + count


def search(pricer: Pricer, space: Space, *, top: int = 5, budget: float | None = None,
           progress: Callable[[int, int], None] | None = None) -> Outcome:
    """The ``top`` fastest choices of ``space`` that fit, by branch and bound (see the module
    docstring); ``budget`` caps the seconds spent (None: none; half of it at most goes to
    the bounds); ``progress(done, total)`` is called as layouts are bounded and visited."""
    start = time.perf_counter()
    layouts = list(space.layouts())
    tally = _Tally()
    bounding_ends = None if budget is None else start + budget / 2
    bounded = _bounded(pricer, space, layouts, tally, bounding_ends, progress)
    best, left = _branch(pricer, space, bounded, top, tally, None if budget is None else start + budget, progress)
    return Outcome(tuple(best), tally.simulated, tally.fit, tally.refused, tally.pruned, tally.too_big,
                   len(layouts), len(layouts) * len(space.schedules), time.perf_counter() - start,
                   left is None and not tally.unbounded, left, len(pricer.plans), pricer.memory_gb,
                   tuple(sorted(tally.reasons.items(), key=lambda kv: (-kv[1], kv[0]))), tally.same)


def _bounded(pricer: Pricer, space: Space, layouts: list[Layout], tally: _Tally, deadline: float | None,
             progress) -> list[tuple[float, Layout]]:
    """(time bound, layout) of every layout that may hold a choice that fits, fastest bound
    first; the others counted in ``tally``. Stops at ``deadline`` (the rest unbounded)."""
    schedule = _bound_schedule(space)
    bounded = []
    for index, layout in enumerate(layouts):
        if deadline is not None and time.perf_counter() > deadline:
            tally.unbounded = len(layouts) - index
            break
        bound = pricer.bound(layout, schedule)
        if bound == NOTHING_TO_PARTITION:
            tally.same += len(space.schedules)
        elif isinstance(bound, str):
            tally.refuse(bound, len(space.schedules))
        elif pricer.memory_gb is not None and bound.memory > pricer.memory_gb * GB:
            tally.too_big += len(space.schedules)
        else:
            bounded.append((bound.seconds, layout))
        if progress and index % 64 == 0:
            progress(index, len(layouts))
    return sorted(bounded)


def _branch(pricer: Pricer, space: Space, bounded: list[tuple[float, Layout]], top: int, tally: _Tally,
            deadline: float | None, progress) -> tuple[list[Priced], float | None]:
    """The ``top`` best choices of the ``bounded`` layouts, visited in order until the next
    bound exceeds the K-th best step; and the bound where ``deadline`` stopped the visit
    (None: not stopped).

    A choice whose SI layer pair is not planned yet, or whose chunk counts are not settled
    yet, waits (:class:`Deferred`) with its bound, and is planned, settled and simulated
    only when no layout or waiting choice
    has a lower bound left (best first): most never are, once the K-th best is below it."""
    best: list[Priced] = []
    dominance = _Dominance()
    waiting: list[tuple[float, int, Choice]] = []  # (bound, arrival, choice)
    order = itertools.count()

    def settle(limit: float) -> None:
        # Price the waiting choices whose bound is at most ``limit``, lowest first.
        nonlocal best
        while waiting and waiting[0][0] <= limit:
            bound, _, choice = heapq.heappop(waiting)
            cutoff = best[top - 1].seconds if len(best) >= top else None
            if cutoff is not None and bound > cutoff:
                tally.pruned += 1
                continue
            best = _count(pricer.price(choice, cutoff, memory_first=True), tally, dominance, best, top)

    for visited, (seconds, layout) in enumerate(bounded):
        settle(seconds)
        if len(best) >= top and seconds > best[top - 1].seconds:
            tally.pruned += (len(bounded) - visited) * len(space.schedules)
            break
        if deadline is not None and time.perf_counter() > deadline:
            return best, min([seconds] + [w[0] for w in waiting])
        for schedule in space.schedules:
            choice = Choice(layout, *schedule)
            cutoff = best[top - 1].seconds if len(best) >= top else None
            ruled = dominance.rules_out(choice, cutoff)
            if ruled == "slower":
                tally.pruned += 1
                continue
            if ruled == "bigger":
                tally.too_big += 1
                continue
            result = pricer.price(choice, cutoff, memory_first=True, defer=True)
            if isinstance(result, Deferred):
                heapq.heappush(waiting, (result.bound, next(order), choice))
                continue
            best = _count(result, tally, dominance, best, top)
        if progress:
            progress(visited + 1, len(bounded))
    settle(float("inf"))
    return best, None


def _count(result, tally: _Tally, dominance: "_Dominance", best: list[Priced], top: int) -> list[Priced]:
    """Count ``result`` (of :meth:`Pricer.price`) in ``tally``; ``best`` with it in its place."""
    if isinstance(result, TooBig):
        tally.too_big += 1
        dominance.saw(result)
    elif isinstance(result, Refused) and result.why == NOTHING_TO_PARTITION:
        tally.same += 1
    elif isinstance(result, Refused):
        tally.refuse(result.why)
    elif isinstance(result, Pruned):
        tally.pruned += 1
    else:
        tally.simulated += 1
        dominance.saw(result)
        if result.fits:
            tally.fit += 1
            best = _insert(best, result, top)
        else:
            tally.too_big += 1
    return best


class _Dominance:
    """Choices another priced one settles without a simulation of their own.

    Recomputation only adds work to a schedule, so a choice recomputing (selective or full)
    is never faster than the same choice without recomputation (visited first: its time
    bound is lower); when that one fits and is already slower than the K-th best, so is the
    recomputing one. ZeRO-1 only shrinks the model states of ZeRO-0 (the activations follow the same actions
    in the same order), so when a ZeRO-1 choice does not fit, its ZeRO-0 twin does not either.
    Both rest, as the bounds do, on the simulator never shortening a step for more work."""

    def __init__(self) -> None:
        self._fits: dict[Choice, float] = {}
        self._too_big: set[Choice] = set()

    def saw(self, result: Priced | TooBig) -> None:
        """Remember what ``result`` settles."""
        choice = result.choice
        if isinstance(result, TooBig):
            if choice.layout.zero == 1:
                self._too_big.add(choice)
        elif result.fits and choice.layout.recompute == "none":
            self._fits[choice] = result.seconds
        elif not result.fits and choice.layout.zero == 1:
            self._too_big.add(choice)

    def rules_out(self, choice: Choice, cutoff: float | None) -> str | None:
        """"slower" (than ``cutoff``, the K-th best step) or "bigger" (than the device) when
        a priced choice settles ``choice``, else None."""
        layout = choice.layout
        twin = attrs.evolve(choice, layout=attrs.evolve(layout, recompute="none"))
        if layout.recompute != "none" and cutoff is not None and self._fits.get(twin, 0.0) > cutoff:
            return "slower"
        if layout.zero == 0 and attrs.evolve(choice, layout=attrs.evolve(layout, zero=1)) in self._too_big:
            return "bigger"
        return None


def exhaustive(pricer: Pricer, space: Space, top: int = 5) -> tuple[Priced, ...]:
    """The ``top`` fastest fitting choices found by pricing every choice of ``space`` (what
    :func:`search` must equal; slow, for tests)."""
    best: list[Priced] = []
    for choice in space.choices():
        result = pricer.price(choice)
        if isinstance(result, Priced) and result.fits:
            best = _insert(best, result, top)
    return tuple(best)


def _insert(best: list[Priced], result: Priced, top: int) -> list[Priced]:
    """``best`` with ``result`` in its place (fastest first; ties in choice order) cut to ``top``."""
    return sorted(best + [result], key=_rank)[:top]


def _rank(p: Priced) -> tuple:
    # Steps equal to the last rounding digits are ties, settled by SI on first (SI off
    # gains nothing then), then the file's partition before a generated one (a generated
    # block that gains nothing only adds statements), then the choice's order.
    return (round(p.seconds, 12), p.choice.si != "on", p.choice.layout.partition != "written", p.choice)


def _bound_schedule(space: Space) -> tuple[str, str, str]:
    """The schedule the layouts' DAGs are checked with: the first with fold none (every
    fold's stage split divides a fold-none one), else the first."""
    return next((sched for sched in space.schedules if sched[0] == "none"), space.schedules[0])
