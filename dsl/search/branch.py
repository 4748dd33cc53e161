"""The branch and bound of `dhelix tune` over the layouts of a :class:`Space`.

Layouts are visited in order of their lower bound (:mod:`bound`); once the K-th best step
priced is no longer than the next layout's bound, no unvisited choice can enter the top K.
Inside a layout, each choice's peak memory and a floor of its step are computed before any
simulation (:func:`~dhelix.dsl.simulator.events.untimed`), and a choice that needs its SI
layer pair planned, or its chunk counts settled, waits (:class:`~dhelix.dsl.search.pricer.Deferred`)
bound by its floor until nothing with a lower bound is left; one waiting for its counts is then
bound anew by a simulation of its step before the planner's choices, and waits again with that
bound (most never get so far). The K best so far are an
:class:`Incumbent`; the work (a layout's choices visited, a waiting choice priced) runs here
(:class:`Inline`) or in other processes (:mod:`workers`), whose results may come back in
another order: the cutoff is always the K-th best step priced so far, never below the final
one, so the top is the same.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import operator
import time
from typing import Callable, Protocol

import attrs

from dhelix.dsl.search.bound import Bound
from dhelix.dsl.search.partitions import NOTHING_TO_PARTITION, writes_si
from dhelix.dsl.search.pricer import FLOOR_MARGIN, Deferred, Priced, Pricer, Pruned, Refused, TooBig
from dhelix.dsl.search.space import Choice, Layout, Space


#: A layout to visit: (its time bound, it, the time bound of its schedules that pair no
#: layers, why its strands block is refused or None: :class:`~dhelix.dsl.search.bound.Bound`).
Bounded = tuple[float, Layout, float, str | None]


@attrs.define
class Tally:
    """Counts of a search as it goes (choices, except ``unbounded``: layouts)."""

    simulated: int = 0
    fit: int = 0
    refused: int = 0
    pruned: int = 0
    too_big: int = 0
    same: int = 0
    unbounded: int = 0
    reasons: dict = attrs.field(factory=dict)
    #: The least memory (bytes) a choice over the memory was found to need, and whether that
    #: is its peak (else a lower bound of it: its layout's); None while none is over.
    nearest: tuple[float, bool] | None = None

    def refuse(self, why: str, count: int = 1) -> None:
        """Count ``count`` choices refused for ``why``."""
        self.refused += count
        self.reasons[why] = self.reasons.get(why, 0) + count

    def over(self, memory: float, count: int = 1, exact: bool = True) -> None:
        """Count ``count`` choices over the memory, needing ``memory`` bytes (at least, unless
        ``exact``)."""
        self.too_big += count
        if self.nearest is None or (memory, not exact) < (self.nearest[0], not self.nearest[1]):
            self.nearest = (memory, exact)


class Incumbent:
    """The ``top`` best choices priced so far that fit, fastest first (:func:`rank`), the
    cutoff they set, and when (``time.perf_counter()``) the first of them became the one it
    is (``found``; None while none is known)."""

    def __init__(self, top: int):
        self.top = top
        self.best: list[Priced] = []
        self.found: float | None = None

    def cutoff(self) -> float | None:
        """The step (seconds) a choice must not exceed to enter the top (the K-th best so
        far); None while fewer than ``top`` are known."""
        return self.best[self.top - 1].seconds if len(self.best) >= self.top else None

    def add(self, priced: Priced) -> None:
        """Take ``priced`` (fits) into the top if it belongs there."""
        leader = self.best[0].choice if self.best else None
        self.best = insert(self.best, priced, self.top)
        if self.best[0].choice != leader:
            self.found = time.perf_counter()


def bound_of(pricer: Pricer, space: Space, layouts: list[Layout], tally: Tally, deadline: float | None,
             progress=None) -> list[Bounded]:
    """(time bound, layout, time bound of its schedules that pair no layers, why its strands
    block is refused or None) of every layout of ``layouts`` that may hold a choice that
    fits, fastest bound first; the others counted in ``tally``. Stops at ``deadline`` (the
    rest counted unbounded)."""
    found, unbounded = bounds(pricer, space, layouts, deadline, progress)
    tally.unbounded += unbounded
    return keep_bounded(found, space, pricer.capacity, tally)


def bounds(pricer: Pricer, space: Space, layouts: list[Layout], deadline: float | None, progress=None
           ) -> tuple[list[tuple[Layout, Bound | str]], int]:
    """(layout, bound or why the passes refuse it) of ``layouts`` until ``deadline``, and how
    many were left unbounded; ``progress(done, total)`` every 64."""
    schedule = bound_schedule(space)
    found: list[tuple[Layout, Bound | str]] = []
    for index, layout in enumerate(layouts):
        if deadline is not None and time.perf_counter() > deadline:
            return found, len(layouts) - index
        found.append((layout, pricer.bound(layout, schedule)))
        if progress and index % 64 == 0:
            progress(index, len(layouts))
    return found, 0


def keep_bounded(found: list[tuple[Layout, Bound | str]], space: Space, capacity: float | None,
                 tally: Tally) -> list[Bounded]:
    """(time bound, layout, time bound of its schedules that pair no layers, why its strands
    block is refused or None) of the layouts
    whose bound (``found``) leaves a choice that may fit in ``capacity`` bytes (None: any),
    fastest bound first; the refused,
    the over-the-memory and the same-as-another counted in ``tally`` (each for every
    schedule of ``space``)."""
    bounded = []
    for layout, bound in found:
        if bound == NOTHING_TO_PARTITION:
            tally.same += len(space.schedules)
        elif isinstance(bound, str):
            tally.refuse(bound, len(space.schedules))
        elif capacity is not None and bound.memory > capacity:
            tally.over(bound.memory, len(space.schedules), exact=False)
        else:
            bounded.append((bound.seconds, layout, bound.alone, bound.strands))
    return sorted(bounded, key=lambda entry: (entry[0], _fields(entry[1])))


#: A layout's fields in their order: the tuple its order compares (attrs' ``order=True``),
#: built once per layout for a sort of many (each comparison through attrs builds two).
_fields = operator.attrgetter(*(field.name for field in attrs.fields(Layout)))


#: What pricing a choice returns (:meth:`~dhelix.dsl.search.pricer.Pricer.price`).
Result = Priced | Refused | Pruned | TooBig | Deferred


def visit_price(pricer: Pricer, choice: Choice, cutoff: float | None) -> Result:
    """``choice`` priced as a layout's visit prices it: its memory and floor first, deferred
    when its SI pair is not planned or its chunk counts not settled."""
    return pricer.price(choice, cutoff, memory_first=True, defer=True)


def settle_price(pricer: Pricer, choice: Choice, cutoff: float | None) -> Result:
    """The deferred ``choice`` priced: its SI pair planned, its chunk counts settled."""
    return pricer.price(choice, cutoff, memory_first=True)


def tighten_price(pricer: Pricer, choice: Choice, cutoff: float | None) -> Result:
    """The deferred ``choice`` (``loose``: bound by its floor) deferred again with the bound
    of its step before the planner's choices, or ruled out by it."""
    return pricer.price(choice, cutoff, memory_first=True, defer=True, tighten=True)


class Runner(Protocol):
    """What runs the search's work (:class:`Inline`, or
    :class:`~dhelix.dsl.search.workers.Across` in other processes), made with the pricer,
    the cutoff (a callable) and where each result goes."""

    @property
    def in_flight(self) -> int: ...

    def free(self) -> bool: ...

    def takes(self, choice: Choice) -> bool: ...

    def visit(self, layout: Layout, schedules, skip: Callable[[Choice], bool]) -> None: ...

    def settle(self, choice: Choice) -> None: ...

    def tighten(self, choice: Choice) -> None: ...

    def collect(self, block: bool = False) -> int: ...


class Inline:
    """Runs the search's work here, one task at a time: a layout's choices visited (priced,
    or deferred with their bound), a deferred choice priced (its SI pair planned, its chunk
    counts settled). Each result goes to ``handle`` as it is made, each price reads the
    ``cutoff`` as it is then."""

    in_flight = 0

    def __init__(self, pricer: Pricer, cutoff: Callable[[], float | None], handle: Callable):
        self.pricer, self.cutoff, self.handle = pricer, cutoff, handle
        self._visited = 0

    def free(self) -> bool:
        """Whether a task may be handed in now."""
        return True

    def takes(self, choice: Choice) -> bool:
        """Whether the deferred ``choice`` may be handed in now."""
        return True

    def visit(self, layout: Layout, schedules, skip: Callable[[Choice], bool]) -> None:
        """Price the choices of ``layout`` with ``schedules`` but those ``skip`` rules out."""
        for schedule in schedules:
            choice = Choice(layout, *schedule)
            if not skip(choice):
                self.handle(visit_price(self.pricer, choice, self.cutoff()))
        self._visited += 1

    def settle(self, choice: Choice) -> None:
        """Price the deferred ``choice``."""
        self.handle(settle_price(self.pricer, choice, self.cutoff()))

    def tighten(self, choice: Choice) -> None:
        """Bound the loosely deferred ``choice`` anew."""
        self.handle(tighten_price(self.pricer, choice, self.cutoff()))

    def collect(self, block: bool = False) -> int:
        """The layouts visited since the last call, their results handled (``block``: wait
        for a task to end when none has)."""
        done, self._visited = self._visited, 0
        return done


def branch(pricer: Pricer, space: Space, bounded: list[Bounded], incumbent: Incumbent, tally: Tally,
           deadline: float | None, progress=None, runner: Callable[..., Runner] | None = None) -> float | None:
    """Price the choices of the ``bounded`` layouts into ``incumbent``, visited in order
    until the next bound exceeds the K-th best step; returns the least bound of what
    ``deadline`` left unvisited or waiting (None: not stopped). ``runner(pricer, cutoff,
    handle)`` makes what runs the work (default :class:`Inline`).

    A choice whose SI layer pair is not planned yet, or whose chunk counts are not settled
    yet, waits (:class:`Deferred`) with its bound, and is planned, settled and simulated
    only when no layout or waiting choice has a lower bound left (best first; with a runner
    of several processes, the lowest it takes): most never are, once the K-th best is below it.
    A choice whose schedule pairs no layers (no SI block, or SI off) is not visited when the
    layout's bound of such schedules exceeds the K-th best. Nor is a choice the checks refuse
    on its sizes (:mod:`~dhelix.dsl.search.prefilter`): it is counted refused, for the
    reason pricing it would give."""
    dominance = _Dominance(pricer.offload_slower, offloads=len(space.offload) > 1,
                           only_to_fit=pricer.offloads_only_to_fit)
    waiting: list[tuple[float, int, Choice]] = []  # (bound, arrival, choice)
    loose: set[Choice] = set()  # waiting with their floor: bound anew (tighten) before settled
    order = itertools.count()

    def handle(result: Result) -> None:
        if isinstance(result, Deferred):
            heapq.heappush(waiting, (result.bound, next(order), result.choice))
            (loose.add if result.loose else loose.discard)(result.choice)
        else:
            _count(result, tally, dominance, incumbent)

    pairs = {name: writes_si(pipeline) for name, pipeline in pricer.pipelines.items()}

    def skip(choice: Choice, alone: float, strands: str | None) -> bool:
        cutoff = incumbent.cutoff()
        if cutoff is not None and not (pairs.get(choice.pipeline, True) and choice.si == "on") \
                and alone * (1 - FLOOR_MARGIN) > cutoff:  # its layers run alone: bound by that
            tally.pruned += 1
            return True
        ruled = dominance.rules_out(choice, cutoff)
        tally.pruned += ruled == "slower"
        tally.too_big += ruled == "bigger"
        if ruled is not None:
            return True
        why = dominance.refusal(choice)
        if why is not None:  # its twin on the device was refused so
            if why == NOTHING_TO_PARTITION:
                tally.same += 1
            else:
                tally.refuse(why)
            return True
        # Last, so that what a bound rules out is counted as before: pricing it would not refuse it.
        why = pricer.schedule_checks.refusal(choice, strands)
        if why is not None:
            tally.refuse(why)
        return why is not None

    work = (runner or Inline)(pricer, incumbent.cutoff, handle)
    visited = following = 0  # layouts visited, the next to visit
    block = False
    while True:
        done = work.collect(block)
        visited += done
        if progress and done:
            progress(visited, len(bounded))
        block = False
        cutoff = incumbent.cutoff()
        while waiting and cutoff is not None and waiting[0][0] > cutoff:
            heapq.heappop(waiting)
            tally.pruned += 1
        if following < len(bounded) and cutoff is not None and bounded[following][0] > cutoff:
            tally.pruned += (len(bounded) - following) * len(space.schedules)
            following = len(bounded)
        limit = bounded[following][0] if following < len(bounded) else math.inf
        unfinished = following < len(bounded) or bool(waiting)  # layouts or waiting choices left
        if unfinished and deadline is not None and time.perf_counter() > deadline:
            while work.in_flight:
                work.collect(block=True)
            return min([limit] + [w[0] for w in waiting])
        picked = _lowest_taken(waiting, limit, work, loose)
        if picked is not None:
            if cutoff is not None and picked[0] > cutoff:
                tally.pruned += 1
            elif picked[1] in loose:
                loose.discard(picked[1])
                work.tighten(picked[1])
            else:
                work.settle(picked[1])
        elif following < len(bounded) and work.free():
            _, layout, alone, strands = bounded[following]
            work.visit(layout, space.schedules, functools.partial(skip, alone=alone, strands=strands))
            following += 1
        elif work.in_flight:
            block = True  # nothing to hand in: wait for a result
        else:  # nothing in flight: every waiting choice would have been taken
            return None


def _lowest_taken(waiting: list[tuple[float, int, Choice]], limit: float, work: Runner, loose: set[Choice]
                  ) -> tuple[float, Choice] | None:
    """(bound, choice) of the waiting choice of lowest bound at most ``limit`` that ``work``
    takes now (any free process bounds a ``loose`` one anew), taken off the heap
    ``waiting``; None when there is none."""
    if not waiting or waiting[0][0] > limit or not work.free():
        return None
    if waiting[0][2] in loose or work.takes(waiting[0][2]):
        bound, _, choice = heapq.heappop(waiting)
        return bound, choice
    for entry in sorted(entry for entry in waiting if entry[0] <= limit):
        if entry[2] in loose or work.takes(entry[2]):
            waiting.remove(entry)
            heapq.heapify(waiting)
            return entry[0], entry[2]
    return None


def _count(result, tally: Tally, dominance: "_Dominance", incumbent: Incumbent) -> None:
    """Count ``result`` (of :meth:`Pricer.price`) in ``tally``; into ``incumbent`` when it fits."""
    if isinstance(result, TooBig):
        tally.over(result.memory)
        dominance.saw(result)
    elif isinstance(result, Refused) and result.why == NOTHING_TO_PARTITION:
        tally.same += 1
        dominance.saw(result)
    elif isinstance(result, Refused):
        tally.refuse(result.why)
        dominance.saw(result)
    elif isinstance(result, Pruned):
        tally.pruned += 1
        dominance.saw(result)
    else:
        tally.simulated += 1
        dominance.saw(result)
        if result.fits:
            tally.fit += 1
            incumbent.add(result)
        else:
            tally.over(max(r.memory for r in result.sim.ranks))


class _Dominance:
    """Choices another priced one settles without a simulation of their own.

    Recomputation only adds work to a schedule, so a choice recomputing (selective or full)
    is never faster than the same choice without recomputation (visited first: its time
    bound is lower); when that one fits, had no ``by auto`` count left out for the memory
    (which the recomputing one might fit) and is already slower than the K-th best, so is
    the recomputing one. ZeRO-1 only shrinks the model states of ZeRO-0 (the activations follow the same actions
    in the same order), so when a ZeRO-1 choice does not fit, its ZeRO-0 twin does not either.
    Offloading the optimizer's states only shrinks the device's model states and only changes
    the optimizer step's time: where the profile makes that step slower per parameter at
    every share (``offload_slower``: :func:`~dhelix.dsl.search.offload.offload_slower`), a
    choice offloading is settled by its twin that does not, as a recomputing one is, and by
    a twin ruled out by its bound (a floor that only grows with the optimizer's step). The
    passes read no offload: a choice offloading is refused as its twin is (``offloads``: the
    space searches both, so the twins' refusals and bounds are kept). All rest, as the
    bounds do, on the simulator never shortening a step for more work."""

    def __init__(self, offload_slower: bool = False, offloads: bool = False,
                 only_to_fit: Callable[[Choice], bool] | None = None) -> None:
        self._fits: dict[Choice, float] = {}
        self._too_big: set[Choice] = set()
        self._offload_slower = offload_slower
        self._offloads = offloads
        self._only_to_fit = only_to_fit
        self._refused: dict[Choice, str] = {}
        self._pruned: set[Choice] = set()

    def saw(self, result: Priced | TooBig | Refused | Pruned) -> None:
        """Remember what ``result`` settles."""
        if isinstance(result, (Refused, Pruned)):
            twin = result.choice
            if self._offloads and isinstance(twin, Choice) and twin.layout.offload == "none":
                if isinstance(result, Refused):
                    self._refused[twin] = result.why
                elif self._offload_slower:
                    self._pruned.add(twin)
            return
        choice = result.choice
        if isinstance(result, TooBig):
            if choice.layout.zero == 1:
                self._too_big.add(choice)
        elif result.fits and (choice.layout.recompute == "none" or choice.layout.offload == "none") \
                and not result.squeezed:
            self._fits[choice] = result.seconds
        elif not result.fits and choice.layout.zero == 1:
            self._too_big.add(choice)

    def rules_out(self, choice: Choice, cutoff: float | None) -> str | None:
        """"slower" (than ``cutoff``, the K-th best step) or "bigger" (than the device) when
        a priced choice settles ``choice``, else None."""
        layout = choice.layout
        twin = attrs.evolve(choice, layout=attrs.evolve(layout, recompute="none", recompute_layers=0))
        if layout.recompute != "none" and cutoff is not None and self._fits.get(twin, 0.0) > cutoff:
            if self._offloads and self._offload_slower and layout.offload == "none":
                self._pruned.add(choice)  # (so is its offloading twin: slower still)
            return "slower"
        if layout.offload != "none" and self._offload_slower:
            kept = attrs.evolve(choice, layout=attrs.evolve(layout, offload="none", offload_percent=0))
            if kept in self._pruned or (cutoff is not None and self._fits.get(kept, 0.0) > cutoff):
                return "slower"
            if kept in self._fits and self._only_to_fit is not None and self._only_to_fit(choice):
                return "slower"  # offloading only where the twin does not fit: pricing rules it out so
        if layout.zero == 0 and attrs.evolve(choice, layout=attrs.evolve(layout, zero=1)) in self._too_big:
            return "bigger"
        return None

    def refusal(self, choice: Choice) -> str | None:
        """Why the passes refused the twin on the device of ``choice`` (offloading), if they did."""
        if choice.layout.offload == "none" or not self._refused:
            return None
        return self._refused.get(attrs.evolve(choice, layout=attrs.evolve(choice.layout, offload="none",
                                                                          offload_percent=0)))


def insert(best: list[Priced], result: Priced, top: int) -> list[Priced]:
    """``best`` with ``result`` in its place (fastest first; ties in choice order) cut to
    ``top``; of the choices that are one program (:attr:`Priced.program`,
    :mod:`~dhelix.dsl.search.duplicates`) only the first stays."""
    kept, seen = [], set()
    for priced in sorted(best + [result], key=rank):
        if priced.program is not None and priced.program in seen:
            continue
        seen.add(priced.program)
        kept.append(priced)
    return kept[:top]


def rank(p: Priced) -> tuple:
    """The order of the top: steps equal to the last rounding digits are ties, settled by
    SI on first (SI off gains nothing then), then the file's partition before a generated
    one (a generated block that gains nothing only adds statements), then the choice's order."""
    return (round(p.seconds, 12), p.choice.si != "on", p.choice.layout.partition != "written", p.choice)


def bound_schedule(space: Space) -> tuple[str, str, str]:
    """The schedule the layouts' DAGs are checked with: the first with fold none (every
    fold's stage split divides a fold-none one), else the first."""
    return next((sched for sched in space.schedules if sched[0] == "none"), space.schedules[0])
