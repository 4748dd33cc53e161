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
order the results come back in: the top is the one a search in one process finds
(tests/test_tune.py holds both to the exhaustive pricing). The counts differ: a task handed
out beside another may price what that one's result would have ruled out, and a process
checks again a choice another one visited.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

import attrs

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.lifetime import die_with_parent
from dhelix.dsl.search.branch import Incumbent, Tally, bound_schedule, branch, keep_bounded
from dhelix.dsl.search.pricer import Priced, Pricer
from dhelix.dsl.search.space import Choice, Layout, Space


#: Whether this platform forks processes (the search processes start as forks of the searching one).
FORKS = "fork" in multiprocessing.get_all_start_methods()


def family(layout: Layout) -> tuple:
    """The settings a layout's layer DAGs read besides the pipeline and data-parallel sizes:
    tensor, context and expert parallelism, micro-batch size, partition, and ZeRO-3 with its
    shard group. The SI plans of one family's layer pairs mostly serve each other's layouts."""
    return (layout.tp, layout.cp, layout.ep, layout.micro_batch, layout.partition, layout.zero == 3, layout.shard)


@attrs.frozen
class _Work:
    """What every process reads: set before they fork (``cutoff``: shared memory)."""

    pricer: Pricer
    space: Space
    bounding_ends: float | None
    cutoff: object


@attrs.frozen
class _Pool:
    """The processes (``jobs`` of them) and the cutoff they read."""

    executor: ProcessPoolExecutor
    jobs: int
    cutoff: object


#: The search the forked processes serve (set in the parent just before they fork).
_WORK: _Work | None = None


def search_across(pricer: Pricer, space: Space, layouts: list[Layout], top: int, jobs: int,
                  deadlines: tuple[float | None, float | None], progress=None
                  ) -> tuple[list[Priced], Tally, float | None, int]:
    """The ``top`` best of ``layouts`` searched with ``jobs`` processes, the counts, the
    bound where the ``deadlines`` (of the bounds, of the search) stopped it (None: not
    stopped) and how many SI plans were computed."""
    global _WORK
    bounding_ends, deadline = deadlines
    context = multiprocessing.get_context("fork")
    cutoff = context.Value("d", math.inf, lock=False)  # one writer (here), a double: read whole
    _WORK = _Work(pricer, space, bounding_ends, cutoff)
    executor = ProcessPoolExecutor(jobs, mp_context=context, initializer=_start, initargs=(os.getpid(),))
    pool = _Pool(executor, jobs, cutoff)
    finished = False
    try:
        tally, incumbent = Tally(), Incumbent(top)
        found = _bounds(pool.executor, layouts, jobs, tally, progress)
        bounded = keep_bounded(found, space, pricer.memory_gb, tally)
        left = branch(pricer, space, bounded, incumbent, tally, deadline, progress,
                      lambda pricer, cutoff, handle: Across(pool, pricer, cutoff, handle))
        finished = True
        return incumbent.best, tally, left, len(pricer.plans)
    except BrokenProcessPool:
        raise DhelixError(f"tune: a search process (of --jobs {jobs}) died, likely out of memory",
                          notes=["run again with fewer --jobs (each process keeps what it computes)"]) from None
    finally:
        _stop(pool.executor, finished)
        _WORK = None


def _bounds(executor, layouts: list[Layout], jobs: int, tally: Tally, progress) -> list:
    """(layout, bound or why refused) of every layout bounded before the bounds' deadline,
    in slices of the layouts in family order (a process checks a family's layer DAGs once);
    the rest counted unbounded in ``tally``."""
    ordered = sorted(layouts, key=family)
    size = max(8, len(ordered) // (jobs * 16))
    futures = [executor.submit(_bound_slice, ordered[i:i + size]) for i in range(0, len(ordered), size)]
    found, done = [], 0
    pending = set(futures)
    while pending:
        ready, pending = wait(pending, return_when=FIRST_COMPLETED)
        for future in ready:
            bounds, unbounded = future.result()
            found += bounds
            tally.unbounded += unbounded
            done += len(bounds) + unbounded
        if progress:
            progress(done, len(layouts))
    return found


class Across:
    """Runs the search's work (:class:`~dhelix.dsl.search.branch.Inline`'s tasks) in the
    processes of an executor, one task per process at a time and one deferred choice of a
    family at a time. A deferred choice goes out with the SI plans of its family known here
    and comes back with those its process computed (merged into ``pricer``'s cache); every
    result goes to ``handle``, and the K-th best step so far (``cutoff``) to the processes."""

    def __init__(self, pool: _Pool, pricer: Pricer, cutoff, handle):
        self.pool, self.pricer, self.cutoff, self.handle = pool, pricer, cutoff, handle
        self._futures: dict = {}  # future: the family of the choice it settles, or None
        self._plans: dict[tuple, dict] = {}

    @property
    def in_flight(self) -> int:
        """Tasks handed out whose result has not been collected."""
        return len(self._futures)

    def free(self) -> bool:
        """Whether a process is free."""
        return len(self._futures) < self.pool.jobs

    def takes(self, choice: Choice) -> bool:
        """Whether a process is free for the deferred ``choice`` and none is pricing one of
        its family (whose plans it would compute again)."""
        return self.free() and family(choice.layout) not in self._futures.values()

    def visit(self, layout: Layout, schedules, skip) -> None:
        """Hand out the choices of ``layout`` with ``schedules`` but those ``skip`` rules out."""
        kept = [schedule for schedule in schedules if not skip(Choice(layout, *schedule))]
        self._futures[self.pool.executor.submit(_visit, layout, kept)] = None

    def settle(self, choice: Choice) -> None:
        """Hand out the deferred ``choice``."""
        kin = family(choice.layout)
        plans = list(self._plans.get(kin, {}).items())
        self._futures[self.pool.executor.submit(_settle, choice, plans)] = kin

    def collect(self, block: bool = False) -> int:
        """The layouts visited since the last call, their results handled (``block``: wait
        for a task to end when none has)."""
        if not self._futures:
            return 0
        ready, _ = wait(self._futures, timeout=None if block else 0, return_when=FIRST_COMPLETED)
        visited = 0
        for future in ready:
            kin = self._futures.pop(future)
            results, plans = future.result()
            if plans:
                self.pricer.plans.merge(plans)
                self._plans.setdefault(kin, {}).update(plans)
            for result in results:
                self.handle(result)
            visited += kin is None
        cutoff = self.cutoff()
        self.pool.cutoff.value = math.inf if cutoff is None else cutoff
        return visited


def _bound_slice(layouts: list[Layout]) -> tuple[list, int]:
    """(layout, bound or why refused) of ``layouts`` until the bounds' deadline, and how many
    were left unbounded."""
    work = _WORK
    schedule = bound_schedule(work.space)
    found = []
    for index, layout in enumerate(layouts):
        if work.bounding_ends is not None and time.perf_counter() > work.bounding_ends:
            return found, len(layouts) - index
        found.append((layout, work.pricer.bound(layout, schedule)))
    return found, 0


def _cutoff() -> float | None:
    """The K-th best step the searching process knows (None: fewer known)."""
    value = _WORK.cutoff.value
    return None if value == math.inf else value


def _visit(layout: Layout, schedules: list) -> tuple[list, list]:
    """The results of the choices of ``layout`` with ``schedules`` (priced, or deferred)."""
    pricer = _WORK.pricer
    return [pricer.price(Choice(layout, *schedule), _cutoff(), memory_first=True, defer=True)
            for schedule in schedules], []


def _settle(choice: Choice, plans: list) -> tuple[list, list]:
    """The deferred ``choice`` priced (its SI pair planned, its counts settled) with
    ``plans`` known too; and the plans computed for it."""
    cache = _WORK.pricer.plans
    cache.merge(plans)
    known = len(cache)
    result = _WORK.pricer.price(choice, _cutoff(), memory_first=True)
    return [result], cache.since(known)


def _start(parent: int) -> None:
    """A search process leaves Ctrl-C to its parent, which stops it (:func:`_stop`), and dies
    with it (a parent killed outright leaves nothing computing)."""
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
