"""The DP pairing search: the best strand-interleaving plan of a forward and a backward layer.

The paper's Eq. (2) pairs the segments of two fixed, segmented operator sequences::

    T(i, j) = min(T(i-1, j) + P(i, ∅),  T(i, j-1) + P(∅, j),  T(i-1, j-1) + P(i, j))

Run on op positions instead of segments, with any earlier position as the previous boundary,
the same recurrence is exact over all segmentations at once (:func:`pair_sequences`). The
search (:func:`plan_layers`) goes one step further and runs it on *prefixes* of the two DAGs
(see :mod:`dsl.planner.sequences`): a state is (forward ops done, backward ops done) and a step runs
the next forward segment beside the next backward segment, each the difference of two
prefixes. Every plan over every legal order is such a path, so the search is exact over all
legal orders of both strands and all their segmentations, for a cost that depends on each
segment's op set; the planner always hands a segment to the cost in its canonical issue
order (:func:`dsl.planner.sequences.canonical`), which is also the order the plan records.

Bounds, both recorded in the plan: ``max_segment`` caps the ops per segment (None: any), and
a strand with more than ``max_prefixes`` prefixes gets a narrower window for its moving ops
(:func:`dsl.planner.sequences.strand_within`). By default (``AUTO``) segments are unbounded, so
the plan is the exact optimum, whenever the two strands have at most ``DEFAULT_EXACT_PAIRS``
pairs of segments; a larger search keeps segments of at most ``DEFAULT_MAX_SEGMENT`` ops, and
its plan (or one a window bounded) is then improved by a local search
(:mod:`dsl.planner.refine`: steps merged, ops moved across steps, consecutive steps cut anew;
its moves recorded in the plan's stats). Ties go to the first path found, deterministically.

The search prices a step only when it might matter (:func:`_shortest`): a cost that offers
lower bounds (``segment_bound``, as :class:`~dhelix.dsl.planner.paircost.PairCost` does) lets it
skip most pairs without simulating them, and the answer is the same as pricing every one. With
segments of any length it also bounds the rest of a plan by :mod:`dsl.planner.restbound`
(:func:`~dhelix.dsl.planner.certify.relaxed_total` is that bound from the start: no plan over
any order beats it), and on a pair of more than ``BEST_FIRST_PAIRS`` pairs of segments it first
finds the least total best first (:func:`_best_first`: a step priced only when its bound plus
the rest's is the lowest left), which the DP then prunes at as its ceiling; the DP's plan is the
one it finds with any ceiling at or above the optimum, so the best-first pass changes only how
many steps are priced (the MoE pair of benchmarks/planner_speed.py: 125,308 instead of 714,371).

Constraints: the strands block's pairing rules (:mod:`dsl.planner.pairing_rules`).

One module, though over 500 lines, because it is one thing: the DP search and the tables it
fills (segment costs, bounds and the fixed chains' table are the search's own state).
"""

from __future__ import annotations

import heapq
from typing import Protocol, Sequence, TypeGuard, cast

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.plan import Plan, PlanOp, SearchStats, SegmentPair
from dhelix.dsl.core.program import LayerDag, Op, Program, Strands
from dhelix.dsl.planner.pairing_rules import PairingRules, Traits, restriction, rules_of, traits_of
from dhelix.dsl.planner.refine import refine
from dhelix.dsl.planner.restbound import fixed_chain_rest
from dhelix.dsl.planner.segment_bound import SegmentBound
from dhelix.dsl.planner.step_table import SAFE as _SAFE, PrefixTable, StepTable, spare_enough
from dhelix.dsl.planner.sequences import (DEFAULT_MAX_PREFIXES, Strand, canonical, count_orders, moving_ops,
                        prefixes, strand_within)

INF = float("inf")
#: ``max_segment``'s default: unbounded segments when the search is small enough to be exact
#: (at most DEFAULT_EXACT_PAIRS pairs of segments), else DEFAULT_MAX_SEGMENT.
AUTO = "auto"
#: Pairs of (forward, backward) segments up to which the default search is exact: about a
#: second of pricing at most. Random layers of a few ops are far below it; a Llama TP+SP
#: layer pair (105 x ~2700 segments) is above it.
DEFAULT_EXACT_PAIRS = 20_000
#: Ops per segment when the exact search is too big. The reference code's segments never
#: exceed its atomic groups (at most 4 ops), and on the Llama examples the plan with 4 is as
#: fast as the unbounded one (benchmarks/planner_speed.py --unbounded); on that benchmark's
#: MoE layer pair it is 0.75 % slower than segments of any length (both within a 6-op window),
#: before the local search that follows it (dsl.planner.refine).
DEFAULT_MAX_SEGMENT = 4
#: The segment bound of the quick first search that gives the exact one its ceiling.
_CEILING_SEGMENT = 2
#: Pairs of segments above which the search with segments of any length first finds the
#: least total best first (:func:`_best_first`): its ceiling is then the optimum itself.
#: Below it (every default exact search) the quick search's ceiling costs less.
BEST_FIRST_PAIRS = DEFAULT_EXACT_PAIRS


class SegmentCost(Protocol):
    """What the search needs from a cost model (``dsl.planner.paircost.PairCost`` provides it).

    ``solo(ops)``: the make-span of one segment run alone; ``pair(fwd_ops, bwd_ops)``: the
    make-span of two non-empty segments co-executed on the three lanes. Ops come in issue
    order; inputs that are not in the list have already been computed. An optional ``unit``
    attribute names the time unit (seconds if absent).
    """

    def solo(self, ops: Sequence[Op]) -> float: ...

    def pair(self, fwd_ops: Sequence[Op], bwd_ops: Sequence[Op]) -> float: ...


class BoundedCost(SegmentCost, Protocol):
    """A SegmentCost that also bounds a step from below and prices a pair by its segments'
    shapes, as PairCost does (the search finds out which: :func:`has_bounds`, and the
    ``shape_number`` attribute); ``segment_bound`` is None under a measured profile."""

    def segment_bound(self, ops: Sequence[Op]) -> SegmentBound | None: ...

    def shape_number(self, ops: Sequence[Op]) -> int: ...

    def pair_of_shapes(self, fwd: Sequence[Op], bwd: Sequence[Op], first: tuple[int, Sequence[str]],
                       second: tuple[int, Sequence[str]]) -> float: ...


def segment_pairs_within(sides: tuple[Strand, Strand], limit: int) -> bool:
    """Whether the two strands have at most ``limit`` pairs of segments of any length (a
    segment: the difference of a prefix and a larger one); stops counting past the limit."""
    counts: list[int] = []
    for side in sides:
        table = prefixes(side)
        assert table is not None, "no limit: every prefix"
        budget = limit // max(counts[0], 1) if counts else limit
        count = 0
        for k, prefix in enumerate(table):
            count += sum(1 for grown in table[k + 1:] if grown & prefix == prefix)
            if count > budget:
                return False
        counts.append(count)
    return counts[0] * counts[1] <= limit


def plan_layers(forward: LayerDag, backward: LayerDag, strands: Strands, cost: SegmentCost, *,
                max_segment: int | None | str = AUTO, max_prefixes: int = DEFAULT_MAX_PREFIXES,
                exact_pairs: int = DEFAULT_EXACT_PAIRS) -> Plan:
    """The best plan co-executing ``forward`` (one strand's layer) with ``backward`` (the
    other strand's), under the strands block's constraints and ``cost``.

    Assumes both DAGs come from a checked program (ops in topological order, selectors that
    resolve). ``max_segment`` bounds the ops per segment (None: any; AUTO: any when the
    strands have at most ``exact_pairs`` pairs of segments, else DEFAULT_MAX_SEGMENT);
    ``max_prefixes`` bounds each strand's prefixes by narrowing its moving ops' window.
    Returns the Plan with the chosen orders, the segment pairs, their predicted times and
    the totals; its stats record the bounds used.
    """
    moving = moving_ops(strands, forward, backward)
    rules = rules_of(strands, forward, backward)
    sides = (strand_within(forward, moving, max_prefixes), strand_within(backward, moving, max_prefixes))
    refined = max_segment == AUTO
    if isinstance(max_segment, str):  # AUTO
        max_segment = None if segment_pairs_within(sides, exact_pairs) else DEFAULT_MAX_SEGMENT
    tables = (PrefixTable(sides[0], max_segment), PrefixTable(sides[1], max_segment))
    matrix = StepTable(tables, cost, rules)
    ceiling = INF
    # A quick plan's total prunes the search (its steps are the search's own cells).
    if matrix.bounds is not None and (max_segment is None or max_segment > _CEILING_SEGMENT):
        ceiling = _shortest(tables, matrix, longest=_CEILING_SEGMENT)[1]
    chains = _chain_rest(matrix) if max_segment is None else None
    if chains is not None and len(tables[0].segments) * len(tables[1].segments) > BEST_FIRST_PAIRS:
        # The least total first (best first, by each step's bound): the search below then
        # prunes at it, as if it had known it, and finds its own path to it.
        ceiling = min(ceiling, _best_first(tables, matrix, ceiling, chains))
    steps, total = _shortest(tables, matrix, ceiling, chains=chains)
    pairs = tuple(SegmentPair(tuple(op.name for op in tables[0].ops(f)),
                              tuple(op.name for op in tables[1].ops(b)), time,
                              matrix.solo_of(0, f) + matrix.solo_of(1, b)) for f, b, time in steps)
    moves = 0
    if refined and (max_segment is not None or any(side.window is not None for side in sides)):
        better, moves = _refined(steps, tables, cost, rules)
        if moves:
            pairs, total = better, sum((pair.time for pair in better), 0.0)
    # Never slower than the strands one after the other (a bounded search can end there): then
    # run them so, each whole whatever the search's segment bound (a bound of the search only).
    alone = _one_after_the_other(sides, cost)
    if sum(pair.time for pair in alone) < total:
        pairs, total = alone, sum((pair.time for pair in alone), 0.0)
    stats = SearchStats(count_orders(tables[0].strand), count_orders(tables[1].strand),
                        len(tables[0].prefixes), len(tables[1].prefixes), tables[0].strand.window,
                        tables[1].strand.window, max_segment, matrix.evaluations, moves)
    return Plan(
        forward_layer=forward.name, backward_layer=backward.name,
        forward_order=tuple(name for pair in pairs for name in pair.forward),
        backward_order=tuple(name for pair in pairs for name in pair.backward),
        ops=_plan_ops(forward, backward, moving), pairs=pairs, total=total,
        sequential=_solo(cost, forward.ops) + _solo(cost, backward.ops),
        compute_time=sum(_solo(cost, [op for op in dag.ops if op.kind == "compute"]) for dag in (forward, backward)),
        comm_time=sum(_solo(cost, [op]) for dag in (forward, backward) for op in dag.ops if op.kind == "comm"),
        rules=_rules_text(strands, rules, moving), stats=stats, unit=getattr(cost, "unit", "s"))


def _refined(steps: list[tuple[int, int, float]], tables: tuple[PrefixTable, PrefixTable], cost: SegmentCost,
             rules: PairingRules) -> tuple[tuple[SegmentPair, ...], int]:
    """The segment pairs of the search's ``steps`` (segment ids of ``tables``, and times)
    after the local search of :mod:`~dhelix.dsl.planner.refine`, and its moves made."""
    price = _StepPrice((tables[0].strand, tables[1].strand), cost, rules)
    start = [(tables[0].segments[f], tables[1].segments[b]) for f, b, _ in steps]
    better, moves = refine(start, price.sides, price)
    pairs = []
    for f, b in better:
        fwd, bwd = price.ops(0, f), price.ops(1, b)
        pairs.append(SegmentPair(tuple(op.name for op in fwd), tuple(op.name for op in bwd), price(f, b),
                                 _solo(cost, fwd) + _solo(cost, bwd)))
    return tuple(pairs), moves


class _StepPrice:
    """The steps of the local search (:class:`~dhelix.dsl.planner.refine.Pricing`): a step's
    segments as bitmasks over the two strands' ops, issued in canonical order, priced by the
    cost under the pairing rules, each once; bounded below by the cost's segment bounds."""

    def __init__(self, sides: tuple[Strand, Strand], cost: SegmentCost, rules: PairingRules):
        self.sides, self.cost, self.rules = sides, cost, rules
        self._times: dict[tuple[int, int], float] = {}
        self._bounds: dict[tuple[int, int], float] = {}
        self._segment_bounds: dict[tuple[int, int], object] = {}
        self._ops: dict[tuple[int, int], tuple[Op, ...]] = {}
        self._traits: dict[tuple[int, int], Traits] = {}
        self._axis_bits: dict[str, int] = {}
        self._bounded = has_bounds(cost, sides[0].dag)

    def ops(self, side: int, mask: int) -> tuple[Op, ...]:
        """The ops of segment ``mask`` of strand ``side``, in canonical issue order."""
        found = self._ops.get((side, mask))
        if found is None:
            strand = self.sides[side]
            found = self._ops[side, mask] = tuple(strand.ops[i] for i in canonical(strand, mask))
        return found

    def _allowed(self, f: int, b: int) -> bool:
        """Whether the pairing rules let the two (non-empty) segments run side by side."""
        traits = []
        for side, mask in ((0, f), (1, b)):
            found = self._traits.get((side, mask))
            if found is None:
                found = self._traits[side, mask] = traits_of(self.ops(side, mask), self.rules, self._axis_bits)
            traits.append(found)
        return traits[0].allows(traits[1], self.rules.comm_with_comm)

    def __call__(self, f: int, b: int) -> float:
        value = self._times.get((f, b))
        if value is None:
            if f and b and not self._allowed(f, b):
                value = INF
            else:
                value = _step_cost(self.cost, self.rules, self.ops(0, f), self.ops(1, b))
            self._times[f, b] = value
        return value

    def bound(self, f: int, b: int) -> float:
        value = self._bounds.get((f, b))
        if value is None:
            value = self._bounds[f, b] = self._bound(f, b)
        return value

    def _bound(self, f: int, b: int) -> float:
        if not self._bounded or not (f or b):
            return 0.0
        if f and b:
            if not self._allowed(f, b):
                return INF
            return self._segment(0, f).pair(self._segment(1, b)) * _SAFE
        side, mask = (0, f) if f else (1, b)
        return self._segment(side, mask).solo() * _SAFE

    def _segment(self, side: int, mask: int):
        found = self._segment_bounds.get((side, mask))
        if found is None:
            bounded = cast(BoundedCost, self.cost)  # only called where has_bounds held
            found = self._segment_bounds[side, mask] = bounded.segment_bound(self.ops(side, mask))
        return found


def has_bounds(cost: SegmentCost, forward: LayerDag) -> TypeGuard[BoundedCost]:
    """Whether ``cost`` bounds its steps from below (PairCost does, but not under a measured
    profile: a measured time obeys no model bound)."""
    bound = getattr(cost, "segment_bound", None)
    return bound is not None and bound(tuple(forward.ops[:1])) is not None


def plan_program(program: Program, cost: SegmentCost, **bounds) -> Plan:
    """:func:`plan_layers` for a checked program's layer (forward of one strand with the
    backward of the other); ``bounds`` are plan_layers' keyword arguments. Raises
    DhelixError for a library file, which has no model and so no layer to plan."""
    if program.forward is None or program.backward is None:
        raise DhelixError("there is no layer to plan: the file has no model block",
                          notes=["plan a file with a model, cluster and mesh (e.g. examples/llama8b_a40.dhx)"])
    return plan_layers(program.forward, program.backward, program.strands, cost, **bounds)


def fixed_chain_table(sides: tuple[Strand, Strand], cost: BoundedCost, rules: PairingRules) -> list[list[float]]:
    """:func:`~dhelix.dsl.planner.restbound.fixed_chain_rest` for the two strands."""
    fixed = [[op for op, rank in zip(side.ops, side.fixed_rank, strict=True) if rank >= 0] for side in sides]
    moving = [[op for op, rank in zip(side.ops, side.fixed_rank, strict=True) if rank < 0] for side in sides]
    axis_bits: dict[str, int] = {}
    return fixed_chain_rest(fixed[0], fixed[1], (moving[0], moving[1]), cost.segment_bound,
                            lambda ops: traits_of(ops, rules, axis_bits),
                            lambda a, b: a.allows(b, rules.comm_with_comm))


def _chain_rest(matrix: StepTable) -> tuple[list[list[float]], list[int], list[int]] | None:
    """The rest bound of :mod:`dsl.planner.restbound` (None without the cost's bounds):
    the table by fixed ops done, and per prefix of each strand its count of fixed ops."""
    if matrix.bounds is None:
        return None
    tables = matrix.tables
    rest = fixed_chain_table((tables[0].strand, tables[1].strand), cast(BoundedCost, matrix.cost),
                             matrix.rules)  # (bounds: the cost has them)
    counts = []
    for table in tables:
        mask = sum(1 << i for i, rank in enumerate(table.strand.fixed_rank) if rank >= 0)
        counts.append([(prefix & mask).bit_count() for prefix in table.prefixes])
    return rest, counts[0], counts[1]


def _shortest(tables: tuple[PrefixTable, PrefixTable], matrix: StepTable, ceiling: float = INF,
              longest: int | None = None, chains: tuple | None = None) -> tuple[list[tuple[int, int, float]], float]:
    """The cheapest path from (∅, ∅) to (all, all): its steps (forward segment id, backward
    segment id, step time) and its total. States are visited forward prefix by forward
    prefix, then backward prefix by backward prefix, each by size, so a state's value is
    final before it is extended; ties go to the first path found.

    Pruning never changes the answer (nor which of several equal paths is returned): a step
    is priced only if its lower bound could improve the state it reaches, if a pair's bound
    is not above running its two segments one after the other (the path through the
    intermediate state is then strictly cheaper), and if its bound plus a bound of the rest
    (its busiest lane, or either strand's longest remaining dependency path, or with
    ``chains`` (:func:`_chain_rest`) the fixed-op relaxation's) stays within
    ``ceiling``, a total some plan reaches (INF: none known). ``longest``
    skips segments of more ops (the quick search that finds a ceiling)."""
    fwd, bwd = tables
    width = len(bwd.prefixes)
    best = [INF] * (len(fwd.prefixes) * width)
    back: list[tuple[int, int, int] | None] = [None] * len(best)
    best[0] = 0.0
    limit = ceiling * (1.0 + 1e-9)
    # Without a ceiling nothing is pruned by the rest's bound: not worked out then.
    rest = _rest_bounds(tables, matrix, chains) if limit < INF else None
    lower, cell, lows_of, allowed = matrix.lower, matrix.cell, matrix.lows, matrix.allowed
    quiet, spare_of, cut, spares = matrix.quiet, matrix.spare_of, matrix.cut, matrix.spare[1]
    bwd_out: list[list | None] = [None] * width
    bounded = matrix.bounds is not None
    # (with bounds shared by shape, a pair's bound is a lookup: no use ruling it out first)
    plain_of, cells = matrix.plain_of, matrix.cells
    plains = matrix.plain[1] if bounded and not matrix.share_bounds else None
    fixed, fraction = matrix.gap
    for i in range(len(fwd.prefixes)):
        fwd_kinds = _shorter(matrix.steps_out(0, i), fwd.sizes, longest)
        for k in range(width):
            here = i * width + k
            start = best[here]
            if start == INF or (rest is not None and start + rest[here] > limit):
                continue
            bwd_kinds = bwd_out[k]
            if bwd_kinds is None:
                bwd_kinds = bwd_out[k] = _shorter(matrix.steps_out(1, k), bwd.sizes, longest)
            for kf, fwd_steps in fwd_kinds:
                beside = allowed[kf]
                for kb, all_bwd_steps in bwd_kinds:
                    if not beside[kb]:
                        continue
                    both_quiet = quiet[kf] and quiet[kb]
                    plain = plains is not None and kf and kb
                    for f, j in fwd_steps:
                        base = j * width
                        known = lows_of[f].get
                        bwd_steps = spare_enough(all_bwd_steps, spares, cut - spare_of(0, f)) if both_quiet \
                            else all_bwd_steps
                        if plain:
                            f0, f1, f2, fp, fc = plain_of(0, f)
                        for b, l in bwd_steps:
                            target = best[base + l]
                            low = known(b)
                            if low is None:
                                if plain:  # the pair's bound before what overlap saves (as in _best_first)
                                    b0, b1, b2, bp, bc = plain_of(1, b)
                                    low = max(f0 + b0, f1 + b1, f2 + b2, fp, bp)
                                    gap = fraction * (fc + bc)
                                    low = (low + (gap if gap > fixed else fixed)) * _SAFE
                                    if start + low >= target or (rest is not None and start + low + rest[base + l] > limit):
                                        continue
                                low = lower(f, b)
                            if start + low >= target:
                                continue
                            if rest is not None and start + low + rest[base + l] > limit:
                                continue
                            if f and b and b not in cells[f] and bounded and matrix.useless(f, b):
                                continue
                            value = start + cell(f, b)
                            if value < target:
                                best[base + l] = value
                                back[base + l] = (here, f, b)
    steps, state = [], len(best) - 1
    while (step := back[state]) is not None:
        state, f, b = step
        steps.append((f, b, matrix.cell(f, b)))
    return steps[::-1], best[-1]


def _best_first(tables: tuple[PrefixTable, PrefixTable], matrix: StepTable, ceiling: float,
                chains: tuple[list[list[float]], list[int], list[int]]) -> float:
    """The least total of a path from (∅, ∅) to (all, all) (INF when none is within
    ``ceiling``, a total some plan reaches), found best first (A*): states are taken in
    order of their time so far plus a bound of the rest (the lanes' work left, either
    strand's longest path left, the fixed-op relaxation's ``chains``), and a step out of a
    state waits, at its bound (:meth:`StepTable.lower`) plus the rest's, until nothing
    lower is left; only then is it priced. The search stops when the end comes first: every
    step it has not priced is bound at least as high. So it prices only steps whose bound
    stays below the optimum, where :func:`_shortest` with a ceiling above the optimum prices
    those whose bound stays below the ceiling (on the MoE benchmark pair, 0.5 M more steps
    at a ceiling 3 % above). The bounds are those of :func:`_shortest`; a state whose time
    improves after it was taken is taken again, so the total is exact whatever the bounds'
    rounding. Which of several equal paths :func:`_shortest` returns is its own business:
    this gives it only the total."""
    fwd, bwd = tables
    width = len(bwd.prefixes)
    goal = len(fwd.prefixes) * width - 1
    rest = _rest_bounds(tables, matrix, chains)
    assert rest is not None, "chains come with the cost's bounds"
    limit = ceiling * (1.0 + 1e-9)
    best = [INF] * (goal + 1)
    best[0] = 0.0
    taken = bytearray(goal + 1)
    # (bound, 0, target, its bound without the rest's, source, f, b): a step waiting;
    # (bound, 1, state, time): a state reached.
    heap: list[tuple] = [(rest[0], 1, 0, 0.0)]
    lower, cell, lows_of, allowed = matrix.lower, matrix.cell, matrix.lows, matrix.allowed
    steps_out, quiet, spare_of, cut, spares = matrix.steps_out, matrix.quiet, matrix.spare_of, matrix.cut, matrix.spare[1]
    plain_of, plains, cells = matrix.plain_of, matrix.plain[1], matrix.cells
    fixed, fraction = matrix.gap
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        entry = pop(heap)
        if entry[0] > limit:
            break
        if entry[1] == 0:  # a step out of a taken state: priced now
            _, _, target, low, source, f, b = entry
            if low >= best[target]:  # the target was reached faster meanwhile
                continue
            if f and b and b not in cells[f] and matrix.useless(f, b):
                continue
            value = best[source] + cell(f, b)
            if value < best[target]:
                best[target] = value
                taken[target] = 0
                push(heap, (value + rest[target], 1, target, value))
            continue
        _, _, here, start = entry
        if start != best[here] or taken[here]:
            continue
        if here == goal:
            return start
        taken[here] = 1
        i, k = divmod(here, width)
        for kf, fwd_steps in steps_out(0, i):
            beside = allowed[kf]
            for kb, all_bwd_steps in steps_out(1, k):
                if not beside[kb]:
                    continue
                both_quiet = quiet[kf] and quiet[kb]
                for f, j in fwd_steps:
                    base, known = j * width, lows_of[f].get
                    bwd_steps = spare_enough(all_bwd_steps, spares, cut - spare_of(0, f)) if both_quiet \
                        else all_bwd_steps
                    if not (kf and kb):  # a solo step: its bound straight away
                        for b, l in bwd_steps:
                            target = base + l
                            low = known(b)
                            if low is None:
                                low = lower(f, b)
                            low += start
                            if low < best[target] and low + rest[target] <= limit:
                                push(heap, (low + rest[target], 0, target, low, here, f, b))
                        continue
                    # A pair: ruled out by its bound before what overlap saves where that
                    # suffices (SegmentBound.pair, written out), else by its whole bound.
                    f0, f1, f2, fp, fc = plain_of(0, f)
                    for b, l in bwd_steps:
                        target = base + l
                        low = known(b)
                        if low is None:
                            plain = plains[b]
                            if plain is None:
                                plain = plain_of(1, b)
                            b0, b1, b2, bp, bc = plain
                            low = f0 + b0
                            if f1 + b1 > low:
                                low = f1 + b1
                            if f2 + b2 > low:
                                low = f2 + b2
                            if fp > low:
                                low = fp
                            if bp > low:
                                low = bp
                            gap = fraction * (fc + bc)
                            low = start + (low + (gap if gap > fixed else fixed)) * _SAFE
                            if low >= best[target] or low + rest[target] > limit:
                                continue
                            low = lower(f, b)
                        low += start
                        if low >= best[target]:
                            continue
                        bound = low + rest[target]
                        if bound <= limit:
                            push(heap, (bound, 0, target, low, here, f, b))
    return INF


def _shorter(groups: list[tuple[int, list[tuple[int, int]]]], sizes: list[int],
             longest: int | None) -> list[tuple[int, list[tuple[int, int]]]]:
    """``groups`` (kind, steps) without the steps of segments of more than ``longest`` ops
    (all of them with ``longest`` None)."""
    if longest is None:
        return groups
    out = [(kind, [step for step in steps if sizes[step[0]] <= longest]) for kind, steps in groups]
    return [(kind, steps) for kind, steps in out if steps]


def _rest_bounds(tables: tuple[PrefixTable, PrefixTable], matrix: StepTable, chains: tuple | None) -> list[float] | None:
    """Per state (by index: forward prefix, then backward prefix), a lower bound of any path
    from it to the end, scaled by _SAFE: the larger of its lanes' work left and either
    strand's longest path left (:meth:`StepTable.remaining`) and, with ``chains``
    (:func:`_chain_rest`), the fixed-op relaxation's; None without the cost's
    bounds. (Worked out once per state: the searches add it to millions of steps.)"""
    rem_f, rem_b = matrix.remaining(0), matrix.remaining(1)
    if rem_f is None or rem_b is None:
        return None
    width = len(tables[1].prefixes)
    if chains is None:
        return [_rest(rem_f[j], rem_b[l]) * _SAFE for j in range(len(tables[0].prefixes)) for l in range(width)]
    chain, fixed_f, fixed_b = chains
    return [max(_rest(rem_f[j], rem_b[l]) * _SAFE, chain[fixed_f[j]][fixed_b[l]] * _SAFE)
            for j in range(len(tables[0].prefixes)) for l in range(width)]


def _rest(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return max(a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3], b[3])


def pair_sequences(fwd_ops: Sequence[Op], bwd_ops: Sequence[Op], cost: SegmentCost, rules: PairingRules, *,
                   max_segment: int | None = None) -> tuple[float, list[tuple[tuple[Op, ...], tuple[Op, ...], float]]]:
    """Eq. (2) on op positions for two fixed sequences: the least make-span over every
    segmentation of both and every monotone pairing of their segments. Segments are slices
    of the given sequences, handed to ``cost`` as they are. Returns the total and the steps
    (forward slice, backward slice, time), either slice possibly empty."""
    n, m = len(fwd_ops), len(bwd_ops)
    limit = max_segment or max(n, m, 1)
    best: dict[tuple[int, int], tuple[float, tuple[int, int, tuple[Op, ...], tuple[Op, ...], float] | None]] = {
        (0, 0): (0.0, None)}
    for a in range(n + 1):
        for b in range(m + 1):
            for a0 in range(max(0, a - limit), a + 1):
                for b0 in range(max(0, b - limit), b + 1):
                    if (a0, b0) == (a, b):
                        continue
                    fseg, bseg = tuple(fwd_ops[a0:a]), tuple(bwd_ops[b0:b])
                    time = _step_cost(cost, rules, fseg, bseg)
                    value = best[a0, b0][0] + time
                    if value < best.get((a, b), (INF, None))[0]:
                        best[a, b] = (value, (a0, b0, fseg, bseg, time))
    steps, state = [], (n, m)
    while (came := best[state][1]) is not None:
        a0, b0, fseg, bseg, time = came
        steps.append((fseg, bseg, time))
        state = (a0, b0)
    return best[n, m][0], steps[::-1]


def _step_cost(cost: SegmentCost, rules: PairingRules, fseg: tuple[Op, ...], bseg: tuple[Op, ...]) -> float:
    if not fseg or not bseg:
        return cost.solo(fseg or bseg)
    return INF if restriction(fseg, bseg, rules) else cost.pair(fseg, bseg)


def _one_after_the_other(sides: tuple[Strand, Strand], cost: SegmentCost) -> tuple[SegmentPair, ...]:
    """The sequential plan's segment pairs (:func:`~dhelix.dsl.planner.si_plan.sequential_plan`):
    the whole forward strand alone, then the whole backward strand alone, each issued in its
    canonical order, at its solo time."""
    pairs = []
    for side, strand in enumerate(sides):
        ops = tuple(strand.ops[i] for i in canonical(strand, (1 << len(strand.ops)) - 1))
        if ops:
            names, time = tuple(op.name for op in ops), _solo(cost, ops)
            forward, backward = (names, ()) if side == 0 else ((), names)
            pairs.append(SegmentPair(forward, backward, time, time))
    return tuple(pairs)


def _solo(cost: SegmentCost, ops: Sequence[Op]) -> float:
    return cost.solo(tuple(ops)) if ops else 0.0


def _plan_ops(forward: LayerDag, backward: LayerDag, moving: frozenset[str]) -> tuple[PlanOp, ...]:
    # A compute op runs on the compute lane whatever group it belongs to (the IR gives an
    # attention over a size-1 cp axis that group's lane).
    return tuple(PlanOp(op.name, dag.direction, op.kind, op.lane if op.kind == "comm" else "compute", op.axis,
                        op.name in moving) for dag in (forward, backward) for op in dag.ops)


def _rules_text(strands: Strands, rules: PairingRules, moving: frozenset[str]) -> tuple[str, ...]:
    text = [f"overlap {', '.join(strands.overlap) or '(none)'}",
            f"comm_with_comm {'on' if rules.comm_with_comm else 'off'}",
            "never two comm ops over one axis"]
    text += [f"forbid {rule}" for rule in rules.forbid_text]
    text.append(f"moving {', '.join(sorted(moving)) or '(none)'}")
    return tuple(text)
