"""`dhelix tune --jobs N`: the branch and bound of :mod:`branch` run by N processes.

The processes are forked from the searching one, so each starts with its pricer and what
it has computed. First they bound the layouts, a slice each. Then the searching process
runs the branch and bound as in one process, lowest bound first, but hands its work out
(:class:`Across`): a layout's choices to visit (priced, or deferred with their bound), a
deferred choice to price (its SI layer pair planned, its chunk counts settled: where most of
a search's time goes), one task per process at a time. It meanwhile only keeps the top, the
waiting choices and the cutoff, which the processes read from shared memory. One family
(:func:`family`: the layouts whose layer DAGs are alike) has one deferred choice out at a
time, and the SI plans a process computes come back with its result and go out with every
later choice of the family, so a layer pair is planned once.

The cutoff is always the K-th best step priced so far, never below the final one, whatever
order the results come back in: without a time budget the top is the one a search in one
process finds (tests/test_tune.py holds both to the exhaustive pricing). The counts differ: a task handed
out beside another may price what that one's result would have ruled out, and a process
checks again a choice another one visited.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import attrs

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.lifetime import die_with_parent
from dhelix.dsl.search.branch import (Incumbent, Tally, bounds, branch, keep_bounded, settle_price, tighten_price,
                                      visit_price)
from dhelix.dsl.search.pricer import Pricer
from dhelix.dsl.search.space import Choice, Layout, Space


#: Whether the search processes can start as forks of the searching one (Linux: elsewhere a
#: fork is either missing or, on macOS, unsafe with the system's libraries).
FORKS = sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def family(layout: Layout) -> tuple:
    """The settings a layout's layer DAGs read besides the pipeline and data-parallel sizes:
    tensor, context and expert parallelism, micro-batch size, partition, and ZeRO-3 with its
    shard group. The SI plans of one family's layer pairs mostly serve each other's layouts."""
    return (layout.tp, layout.cp, layout.ep, layout.micro_batch, layout.partition, layout.zero == 3, layout.shard)


@attrs.frozen
class _Work:
    """What a search process reads: the pricer and space (its own copies, forked), the
    bounds' deadline and the cutoff in shared memory (the K-th best step so far, inf while
    fewer are known; one writer, the searching process, and a double: read whole)."""

    pricer: Pricer
    space: Space
    bounding_ends: float | None
    shared_cutoff: Any  # a multiprocessing Value: its ``value`` is the cutoff


#: The search a search process serves (set by :func:`_start` in the process).
_WORK: _Work | None = None


def search_across(pricer: Pricer, space: Space, layouts: list[Layout], top: int, jobs: int,
                  deadlines: tuple[float | None, float | None], progress=None
                  ) -> tuple[Incumbent, Tally, float | None]:
    """The ``top`` best of ``layouts`` searched with ``jobs`` processes (an
    :class:`~dhelix.dsl.search.branch.Incumbent`), the counts and the bound where the
    ``deadlines`` (of the bounds, of the search) stopped it (None: not stopped); the SI
    plans the processes computed are merged into ``pricer``'s."""
    bounding_ends, deadline = deadlines
    context = multiprocessing.get_context("fork")
    work = _Work(pricer, space, bounding_ends, context.Value("d", math.inf, lock=False))
    executor = ProcessPoolExecutor(jobs, mp_context=context, initializer=_start, initargs=(work, os.getpid()))
    finished = False
    try:
        tally, incumbent = Tally(), Incumbent(top)
        found = _bounds(executor, layouts, jobs, tally, progress)
        bounded = keep_bounded(found, space, pricer.capacity, tally)
        left = branch(pricer, space, bounded, incumbent, tally, deadline, progress,
                      lambda pricer, cutoff, handle: Across(executor, jobs, work.shared_cutoff, pricer, cutoff, handle))
        finished = True
        return incumbent, tally, left
    except BrokenProcessPool:
        raise DhelixError(f"a search process (one of {jobs}) was killed (for instance out of memory)",
                          notes=["search with fewer processes (each keeps what it computes)"]) from None
    finally:
        _stop(executor, finished)


def _bounds(executor, layouts: list[Layout], jobs: int, tally: Tally, progress) -> list:
    """(layout, bound or why refused) of every layout bounded before the bounds' deadline,
    in slices of the layouts in family order (one process's caches serve alike layouts);
    the rest counted unbounded in ``tally``."""
    ordered = sorted(layouts, key=family)
    size = max(8, len(ordered) // (jobs * 16))
    pending = {executor.submit(_bound_slice, ordered[i:i + size]) for i in range(0, len(ordered), size)}
    found, done = [], 0
    while pending:
        ready, pending = wait(pending, return_when=FIRST_COMPLETED)
        for future in ready:
            bounds, unbounded = future.result()
            found += bounds
            tally.unbounded += unbounded
            done += len(bounds) + unbounded
        if progress and done < len(layouts):  # (at the total a progress bar would close)
            progress(done, len(layouts))
    return found


class Across:
    """Runs the search's work (:class:`~dhelix.dsl.search.branch.Inline`'s tasks) in the
    ``jobs`` processes of ``executor``, one task per process at a time and one deferred
    choice of a family at a time. A deferred choice goes out with the SI plans of its family
    known here, and every task comes back with those its process computed (merged into ``pricer``'s cache); every
    result goes to ``handle``, and the K-th best step so far (``cutoff()``) to the processes
    (``shared_cutoff``)."""

    def __init__(self, executor: ProcessPoolExecutor, jobs: int, shared_cutoff, pricer: Pricer, cutoff, handle):
        self.executor, self.jobs, self.shared_cutoff = executor, jobs, shared_cutoff
        self.pricer, self.cutoff, self.handle = pricer, cutoff, handle
        self._futures: dict = {}  # future: (what it does: visit, settle or tighten, its family)
        self._plans: dict[tuple, dict] = {}

    @property
    def in_flight(self) -> int:
        """Tasks handed out whose result has not been collected."""
        return len(self._futures)

    def free(self) -> bool:
        """Whether a process is free."""
        return len(self._futures) < self.jobs

    def takes(self, choice: Choice) -> bool:
        """Whether a process is free for the deferred ``choice`` and none is pricing one of
        its family (whose plans it would compute again)."""
        return self.free() and ("settle", family(choice.layout)) not in self._futures.values()

    def visit(self, layout: Layout, schedules, skip) -> None:
        """Hand out the choices of ``layout`` with ``schedules`` but those ``skip`` rules out."""
        kept = [schedule for schedule in schedules if not skip(Choice(layout, *schedule))]
        self._submit("visit", layout, _visit, (layout, kept))

    def settle(self, choice: Choice) -> None:
        """Hand out the deferred ``choice``."""
        self._submit("settle", choice.layout, _settle, choice)

    def tighten(self, choice: Choice) -> None:
        """Hand out the loosely deferred ``choice``, to be bound anew."""
        self._submit("tighten", choice.layout, _tighten, choice)

    def _submit(self, kind: str, layout: Layout, task, argument) -> None:
        # A visit plans only what it prices whole (a launch = auto program's pair), seldom,
        # and a new bound none: they go out without their family's plans, which would be sent
        # with every layout.
        kin = family(layout)
        plans = list(self._plans.get(kin, {}).items()) if kind == "settle" else []
        self._futures[self.executor.submit(task, argument, plans)] = (kind, kin)

    def collect(self, block: bool = False) -> int:
        """The layouts visited since the last call, their results handled (``block``: wait
        for a task to end when none has)."""
        if not self._futures:
            return 0
        ready, _ = wait(self._futures, timeout=None if block else 0, return_when=FIRST_COMPLETED)
        visited = 0
        for future in ready:
            kind, kin = self._futures.pop(future)
            results, plans = future.result()
            if plans:
                self.pricer.plans.merge(plans)
                self._plans.setdefault(kin, {}).update(plans)
            for result in results:
                self.handle(result)
            visited += kind == "visit"
        cutoff = self.cutoff()
        self.shared_cutoff.value = math.inf if cutoff is None else cutoff
        return visited


def _bound_slice(layouts: list[Layout]) -> tuple[list, int]:
    """(layout, bound or why refused) of ``layouts`` until the bounds' deadline, and how many
    were left unbounded."""
    work = _work()
    return bounds(work.pricer, work.space, layouts, work.bounding_ends)


def _cutoff() -> float | None:
    """The K-th best step the searching process knows (None: fewer known)."""
    value = _work().shared_cutoff.value
    return None if value == math.inf else value


def _visit(visit: tuple[Layout, list], plans: list) -> tuple[list, list]:
    """The results of a layout's choices (priced, or deferred), ``visit`` being the layout
    and the schedules to price; and the SI plans computed for them."""
    layout, schedules = visit
    return _with_plans(plans, lambda pricer: [visit_price(pricer, Choice(layout, *schedule), _cutoff())
                                              for schedule in schedules])


def _settle(choice: Choice, plans: list) -> tuple[list, list]:
    """The deferred ``choice`` priced; and the SI plans computed for it."""
    return _with_plans(plans, lambda pricer: [settle_price(pricer, choice, _cutoff())])


def _tighten(choice: Choice, plans: list) -> tuple[list, list]:
    """The loosely deferred ``choice`` bound anew (or ruled out); no SI plans."""
    return _with_plans(plans, lambda pricer: [tighten_price(pricer, choice, _cutoff())])


def _with_plans(plans: list, task) -> tuple[list, list]:
    """``task(pricer)``'s results with ``plans`` (of the task's family, computed elsewhere)
    known first, and the plans it computed."""
    pricer = _work().pricer
    cache = pricer.plans
    cache.merge(plans)
    known = len(cache)
    return task(pricer), cache.since(known)


def _work() -> _Work:
    """The search this process serves (set when it started)."""
    assert _WORK is not None, "a search process, started by _start"
    return _WORK


def _start(work: _Work, parent: int) -> None:
    """A search process: serves ``work``, leaves Ctrl-C to its parent, which stops it
    (:func:`_stop`), and dies with it (a parent killed outright leaves nothing computing)."""
    global _WORK
    _WORK = work
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)


def _stop(executor: ProcessPoolExecutor, finished: bool) -> None:
    """Shut ``executor`` down; unless its tasks ``finished``, without waiting for those an
    error or Ctrl-C left running: its processes are ended."""
    if finished:
        executor.shutdown()
        return
    processes = list((executor._processes or {}).values())  # no public way to end them
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join()
