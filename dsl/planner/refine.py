"""A local search that improves the plan of a bounded pairing search.

Where the pairing search (:func:`~dhelix.dsl.planner.pairing.plan_layers`) is too big to be
exact, its segments hold at most a few ops, and a step that should pair a long run of one
strand with the other strand's (a ring attention's steps beside a backward GEMM chain, a
chunk chain's pieces) is cut into several: on the chunked Llama-70B layer pairs `dhelix
tune` prices, the 4-op plans are 1.4-5.8 % slower than the optimum inside the same windows.
This search starts from such a plan and repeats three moves while any makes the plan
strictly faster:

* **merge** ``2 … MERGE_WIDTH`` consecutive steps into one (each strand's segments joined);
* **move one op across a step boundary**, either strand, either way: an op of a step whose
  inputs are all done by the end of the step before joins it, and an op of a step that no
  other op of that step reads joins the step after;
* **relocate a moving op** (a wgrad, the router) to whichever step, near or far, gains most
  (after its inputs, before its readers);

and when none helps, a fourth:

* **cut two, then three, consecutive steps anew into two**: their forward ops and their
  backward ops, each in canonical order, split at every pair of points (the cuts whose step
  bounds leave no room for a gain are not priced).

Every step stays the difference of two prefixes of its strand (a legal segment, issued in
its canonical order, :func:`~dhelix.dsl.planner.sequences.canonical`), so the plan stays
inside the pairing search's own space of plans, only without its segment cap and window: it
is never faster than the search with segments of any length and no window, and never
slower than the plan it started from. Moves are tried in a fixed order, so the result is
deterministic; at most :data:`MAX_ROUNDS` rounds run. On those 70B pairs it adds 10-16 % to
the search's time and leaves them 0.1-1.8 % above that optimum (from 1.4-5.8 %;
benchmarks/results/cpu_plan_local_search.txt).
"""

from __future__ import annotations

from typing import Protocol

from dhelix.dsl.planner.sequences import Strand, canonical, members

#: Consecutive steps the merge move joins at most.
MERGE_WIDTH = 4
#: Rounds of moves at most (each round tries every move once); the search stops earlier
#: when a round improves nothing.
MAX_ROUNDS = 20
#: A move must shorten the steps it changes by more than this fraction (float rounding in a
#: simulated time never counts as a gain).
_GAIN = 1e-12

#: (forward prefix difference, backward prefix difference) of one step, as bitmasks.
Step = tuple[int, int]


class Pricing(Protocol):
    """The time of the step running forward segment ``f`` beside backward segment ``b``
    (bitmasks; either may be empty; INF where the pairing rules forbid the pair), and a
    lower bound of it (``bound``, 0.0 where the cost offers none; 0.0 for an empty step)."""

    def __call__(self, f: int, b: int) -> float: ...

    def bound(self, f: int, b: int) -> float: ...


def refine(steps: list[Step], sides: tuple[Strand, Strand], price: Pricing
           ) -> tuple[list[Step], int]:
    """``steps`` (a plan's segment pairs, in order, as bitmasks over each strand's ops)
    improved by the moves above, and how many moves were made, priced by ``price``."""
    steps = [step for step in steps if step != (0, 0)]
    times = [price(*step) for step in steps]
    moves = 0
    for _ in range(MAX_ROUNDS):
        made = _merges(steps, times, price) + _shifts(steps, times, sides, price) + \
            _relocations(steps, times, sides, price)
        if not made:
            made = _resplits(steps, times, sides, price, 2)
        if not made:
            made = _resplits(steps, times, sides, price, 3)
        if not made:
            break
        moves += made
        kept = [k for k, step in enumerate(steps) if step != (0, 0)]
        steps[:], times[:] = [steps[k] for k in kept], [times[k] for k in kept]
    return steps, moves


def _better(new: float, old: float) -> bool:
    return new < old * (1.0 - _GAIN)


def _merges(steps: list[Step], times: list[float], price: Pricing) -> int:
    """Merge runs of consecutive steps where one step is faster (in place); the merges made."""
    made = 0
    for width in range(2, MERGE_WIDTH + 1):
        k = 0
        while k + width <= len(steps):
            run = steps[k:k + width]
            merged = (_union(f for f, _ in run), _union(b for _, b in run))
            time = price(*merged)
            if _better(time, sum(times[k:k + width])):
                steps[k:k + width], times[k:k + width] = [merged], [time]
                made += 1
            else:
                k += 1
    return made


def _shifts(steps: list[Step], times: list[float], sides: tuple[Strand, Strand],
            price: Pricing) -> int:
    """Move single ops across each step boundary where the two steps get faster (in
    place; a step may empty); the moves made."""
    made = 0
    for k in range(len(steps) - 1):
        for side, strand in enumerate(sides):
            done = _union(step[side] for step in steps[:k + 1])  # run by the end of step k
            for i in members(steps[k + 1][side]):  # pull: op i of step k+1 into step k
                if strand.needs[i] & ~done == 0 and _try(steps, times, side, i, k + 1, k, price):
                    done |= 1 << i
                    made += 1
            for i in members(steps[k][side]):  # push: op i of step k into step k+1
                readers = any(strand.needs[j] >> i & 1 for j in members(steps[k][side]))
                if not readers and _try(steps, times, side, i, k, k + 1, price):
                    made += 1
    return made


def _relocations(steps: list[Step], times: list[float], sides: tuple[Strand, Strand], price: Pricing) -> int:
    """Move each moving op (a wgrad, the router: free to run anywhere after its inputs and
    before its readers) to the step, near or far, where the two steps it leaves and joins
    gain the most (in place); the moves made."""
    made = 0
    for side, strand in enumerate(sides):
        for i in (i for i, moving in enumerate(strand.moving) if moving):
            source = next((k for k, step in enumerate(steps) if step[side] >> i & 1), None)
            if source is None:
                continue
            best, found = 0.0, None
            for target in _reachable(steps, side, strand, i, source):
                left, right = _moved(steps, side, i, source, target)
                old, new = times[source] + times[target], price(*left) + price(*right)
                if _better(new, old) and old - new > best:
                    best, found = old - new, target
            if found is not None and _try(steps, times, side, i, source, found, price):
                made += 1
    return made


def _reachable(steps: list[Step], side: int, strand: Strand, i: int, source: int) -> list[int]:
    """The steps other than ``source`` that op ``i`` of strand ``side`` may move to: an
    earlier one by whose end its inputs are done (inside it too: a step issues its ops in
    dependency order), a later one before which nothing reads it."""
    out = []
    done = _union(step[side] for step in steps[:source])
    for target in range(source - 1, -1, -1):
        if strand.needs[i] & ~done:
            break
        out.append(target)
        done &= ~steps[target][side]
    for target in range(source + 1, len(steps)):
        between = _union(step[side] for step in steps[source:target]) & ~(1 << i)
        if any(strand.needs[j] >> i & 1 for j in members(between)):
            break
        out.append(target)
    return out


def _resplits(steps: list[Step], times: list[float], sides: tuple[Strand, Strand], price: Pricing, width: int) -> int:
    """Cut the ops of ``width`` consecutive steps (2 or 3) anew into two steps where that is
    faster: the first takes the first ``a`` of their forward ops and the first ``c`` of
    their backward ops (each strand's in canonical order, so each cut is a prefix), for
    every ``a`` and ``c`` whose step bounds leave room for a gain (in place); the cuts made."""
    made, k = 0, 0
    while k + width <= len(steps):
        run = steps[k:k + width]
        unions = (_union(f for f, _ in run), _union(b for _, b in run))
        cuts = [_cuts(strand, union) for strand, union in zip(sides, unions)]
        best, found = sum(times[k:k + width]), None
        for f in cuts[0]:
            for b in cuts[1]:
                first, second = (f, b), (unions[0] & ~f, unions[1] & ~b)
                if first == steps[k] or price.bound(*first) + price.bound(*second) >= best:
                    continue
                time_first = price(*first)
                if not _better(time_first + price.bound(*second), best):
                    continue
                time_second = price(*second)
                if _better(time_first + time_second, best):
                    best, found = time_first + time_second, ((first, second), (time_first, time_second))
        if found is not None:
            steps[k:k + width], times[k:k + width] = list(found[0]), list(found[1])
            made += 1
        k += 1
    return made


def _cuts(strand: Strand, union: int) -> list[int]:
    """Every prefix, in canonical order, of the ops in ``union`` (a difference of two of
    ``strand``'s prefixes), as bitmasks: the empty one first, ``union`` last."""
    out, mask = [0], 0
    for i in canonical(strand, union):
        mask |= 1 << i
        out.append(mask)
    return out


def _moved(steps: list[Step], side: int, i: int, source: int, target: int) -> tuple[Step, Step]:
    """Steps ``source`` and ``target`` with op ``i`` of strand ``side`` moved from the one
    to the other."""
    out = []
    for k, change in ((source, lambda m: m & ~(1 << i)), (target, lambda m: m | 1 << i)):
        step = list(steps[k])
        step[side] = change(step[side])
        out.append((step[0], step[1]))
    return out[0], out[1]


def _try(steps: list[Step], times: list[float], side: int, i: int, source: int, target: int,
         price: Pricing) -> bool:
    """Move op ``i`` of strand ``side`` from step ``source`` to step ``target`` if the two
    get faster; whether it moved."""
    left, right = _moved(steps, side, i, source, target)
    time_left, time_right = price(*left), price(*right)
    if not _better(time_left + time_right, times[source] + times[target]):
        return False
    steps[source], steps[target] = left, right
    times[source], times[target] = time_left, time_right
    return True


def _union(masks) -> int:
    out = 0
    for mask in masks:
        out |= mask
    return out

