"""The pairing search's tables (:mod:`dsl.planner.pairing`): one strand's prefixes and the
steps out of each (:class:`PrefixTable`), and what the search knows of a step of both strands
(:class:`StepTable`): its time when priced, its lower bound, and the pairing facts by which
whole groups of steps are skipped. Every fact of a segment is worked out when the search
first needs it: a large search (segments of any length) never reaches most of them."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, cast

from dhelix.dsl.core.program import Op
from dhelix.dsl.planner.pairing_rules import PairingRules, Traits, traits_of
from dhelix.dsl.planner.segment_bound import SegmentBound
from dhelix.dsl.planner.sequences import Strand, available, canonical, prefixes

if TYPE_CHECKING:
    from dhelix.dsl.planner.pairing import BoundedCost, SegmentCost

INF = float("inf")
#: Bounds are scaled by this before pruning, so that float rounding in a simulated time can
#: never make a bound exceed the time it bounds.
SAFE = 1.0 - 1e-9


class PrefixTable:
    """One strand's prefixes, its distinct segments (id 0: the empty one) and, per prefix,
    the steps out of it: (segment id, index of the grown prefix), the empty step first.
    A segment's ops (in canonical issue order) are listed when first asked for."""

    def __init__(self, strand: Strand, max_segment: int | None):
        self.strand, self.max_segment = strand, max_segment
        table = prefixes(strand)
        assert table is not None, "no limit: every prefix"
        self.prefixes = table
        position = {p: k for k, p in enumerate(self.prefixes)}
        ids: dict[int, int] = {0: 0}
        self.succ: list[list[tuple[int, int]]] = []
        for k, prefix in enumerate(self.prefixes):
            steps = [(0, k)]
            for grown in _grown(strand, prefix, max_segment):
                steps.append((ids.setdefault(grown ^ prefix, len(ids)), position[grown]))
            self.succ.append(steps)
        self.segments = sorted(ids, key=ids.__getitem__)
        self.sizes = [mask.bit_count() for mask in self.segments]
        self._ops: list[tuple[Op, ...] | None] = [None] * len(self.segments)

    def ops(self, segment: int) -> tuple[Op, ...]:
        """The ops of segment id ``segment``, in canonical issue order."""
        found = self._ops[segment]
        if found is None:
            strand = self.strand
            found = self._ops[segment] = tuple(strand.ops[i] for i in canonical(strand, self.segments[segment]))
        return found


def _grown(strand: Strand, prefix: int, max_segment: int | None) -> list[int]:
    """Every prefix that extends ``prefix`` by 1 … ``max_segment`` ops, by size then mask."""
    found, level = [], {prefix}
    limit = max_segment if max_segment is not None else len(strand.ops)
    for _ in range(limit):
        level = {grown | 1 << i for grown in level for i in available(strand, grown)}
        if not level:
            break
        found += sorted(level)
    return found


class StepTable:
    """Solo times per segment and pair costs per (forward, backward) segment, each asked of
    the cost once and only when the search needs it: ``cell(f, b)`` is the step's time, INF
    for a restricted pair and for ∅ × ∅. With the cost's bounds (``segment_bound``, see
    :class:`~dhelix.dsl.planner.segment_bound.SegmentBound`), ``lower(f, b)`` bounds a cell from
    below without pricing it. A segment's solo time, bound and shape are worked out when the
    search first needs them (a large search never reaches most segments).

    Segments fall in *kinds* by their pairing facts (:class:`Traits`; kind 0: the empty
    segment, which goes beside anything): ``allowed[kf][kb]`` says whether the rules let
    kinds kf and kb run side by side, and ``grouped[side][k]`` lists the steps out of prefix
    k kind by kind, so that the searches skip a whole kind the rules keep apart."""

    def __init__(self, tables: tuple[PrefixTable, PrefixTable], cost: SegmentCost, rules: PairingRules):
        self.tables, self.cost, self.rules = tables, cost, rules
        self.solo: list[list[float | None]] = [[0.0] + [None] * (len(table.segments) - 1) for table in tables]
        self.kinds, self.allowed, quiet = _kinds(tables, rules)
        self._grouped: list[list[list | None]] = [[None] * len(table.prefixes) for table in tables]
        self.cells: list[dict[int, float]] = [{} for _ in tables[0].segments]
        # lower(f, b) by f, then b; a step with one segment empty costs its solo time.
        self.lows: list[dict[int, float]] = [{} for _ in tables[0].segments]
        self.lows[0][0] = INF
        self.evaluations = 0
        bound = getattr(cost, "segment_bound", None)
        first = next((table.ops(1) for table in tables if len(table.segments) > 1), ())
        bounded = bound is not None and (not first or bound(first) is not None)
        self.bounds: list[list[SegmentBound | None]] | None = \
            [[None] * len(table.segments) for table in tables] if bounded else None
        # A pair's time (the cost's pair_of_shapes, where it numbers shapes) is asked by the
        # segments' shapes, worked out once per segment.
        self.numbered = self.bounds is not None and getattr(cost, "shape_number", None) is not None
        self.numbers: list[list[int | None]] = [[None] * len(table.segments) for table in tables]
        # With short segments (a bounded search) shapes are cheap to number and repeat (the
        # chunks of a chain, the expert groups): a pair's bound is then worked out once per
        # two shapes. With segments of any length most segments are never numbered.
        self.share_bounds = self.numbered and all(table.max_segment is not None for table in tables)
        self._shape_bounds: dict[int, float] = {}
        self._remaining: dict[int, list[tuple[float, ...]] | None] = {}
        # Two segments that hold no communication mostly only compute, and then their pair's
        # bound (the compute lane's work of both, plus the launch gap) exceeds their solo
        # times: useless. ``spare`` (a segment's solo time less its compute lane's work)
        # finds those in bulk: a pair whose spares add up to less than ``cut`` (half the
        # launch gap's fixed part) is one, so the steps of such kinds are listed by spare,
        # largest first, and a search stops at the first too small (:meth:`steps_out`).
        self.cut = 0.0
        if self.bounds is not None and first:
            gap = self.bound_of(0 if len(tables[0].segments) > 1 else 1, 1).launch_gap.fixed_us * 1e-6
            self.cut = gap / 2 if gap > 0 and not self.share_bounds else 0.0
        self.quiet = quiet if self.cut > 0 else [False] * len(quiet)
        self.spare: list[list[float | None]] = [[None] * len(table.segments) for table in tables]
        # Per segment, what a pair's bound reads before what overlap saves (lanes, chain,
        # communication), so that the searches rule most pairs out without it; and per
        # segment its solo bound.
        self.plain: list[list[tuple[float, ...] | None]] = [[None] * len(table.segments) for table in tables]
        self._solo_bounds: list[list[float | None]] = [[None] * len(table.segments) for table in tables]
        self.gap = (0.0, 0.0)
        if self.bounds is not None and first:
            launch = self.bound_of(0 if len(tables[0].segments) > 1 else 1, 1).launch_gap
            self.gap = (launch.fixed_us * 1e-6, launch.comm_fraction)

    def solo_of(self, side: int, segment: int) -> float:
        """The solo time of segment ``segment`` of strand ``side`` (0.0 for the empty one)."""
        value = self.solo[side][segment]
        if value is None:
            value = self.solo[side][segment] = self.cost.solo(self.tables[side].ops(segment))
        return value

    def bound_of(self, side: int, segment: int) -> SegmentBound:
        """The cost's SegmentBound of a (non-empty) segment; only with the cost's bounds."""
        assert self.bounds is not None, "the cost bounds its segments"
        found = self.bounds[side][segment]
        if found is None:
            bounded = cast("BoundedCost", self.cost)
            found = self.bounds[side][segment] = cast(SegmentBound, bounded.segment_bound(self.tables[side].ops(segment)))
        return found

    def number_of(self, side: int, segment: int) -> int:
        """The cost's shape number of a (non-empty) segment (only where the cost numbers them)."""
        found = self.numbers[side][segment]
        if found is None:
            found = self.numbers[side][segment] = cast("BoundedCost", self.cost).shape_number(self.tables[side].ops(segment))
        return found

    def plain_of(self, side: int, segment: int) -> tuple[float, ...]:
        """A non-empty segment's (compute, local, cross work, chain, communication) of its
        bound (only with the cost's bounds): a pair's bound is at least the largest of its
        two segments' summed lanes and their chains, plus the launch gap
        (:meth:`SegmentBound.pair`, before what overlap saves)."""
        found = self.plain[side][segment]
        if found is None:
            bound = self.bound_of(side, segment)
            found = self.plain[side][segment] = (*bound.lanes, bound.path, bound.comm)
        return found

    def spare_of(self, side: int, segment: int) -> float:
        """Segment ``segment``'s solo time less its compute lane's work (its bound's); only
        with the cost's bounds, for a non-empty segment."""
        value = self.spare[side][segment]
        if value is None:
            value = self.spare[side][segment] = self.solo_of(side, segment) - self.bound_of(side, segment).lanes[0]
        return value

    def steps_out(self, side: int, prefix: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """The steps out of prefix index ``prefix`` of strand ``side``, kind by kind (in
        first-seen order; :class:`StepTable`): (kind, [(segment id, grown prefix index),
        …]), each list in the table's order but for a quiet kind's (no communication), which
        goes by spare, largest first. Worked out once per prefix, when first asked for."""
        found = self._grouped[side][prefix]
        if found is None:
            kinds = self.kinds[side]
            groups: dict[int, list[tuple[int, int]]] = {}
            for step in self.tables[side].succ[prefix]:
                groups.setdefault(kinds[step[0]], []).append(step)
            for kind, steps in groups.items():
                if kind and self.quiet[kind]:
                    steps.sort(key=lambda step: -self.spare_of(side, step[0]))
            found = self._grouped[side][prefix] = list(groups.items())
        return found

    def cell(self, f: int, b: int) -> float:
        """The time of the step running forward segment ``f`` beside backward segment ``b``."""
        if not f or not b:
            if not b:
                if not f:
                    return INF
                value = self.lows[f][0] = self.solo_of(0, f)
            else:
                value = self.lows[0][b] = self.solo_of(1, b)
            return value
        row = self.cells[f]
        found = row.get(b)
        if found is not None:
            return found
        if self.allowed[self.kinds[0][f]][self.kinds[1][b]]:
            self.evaluations += 1
            fwd, bwd = self.tables[0].ops(f), self.tables[1].ops(b)
            if not self.numbered:
                value = self.cost.pair(fwd, bwd)
            else:
                shaped = cast("BoundedCost", self.cost)  # numbered: the cost numbers shapes
                value = shaped.pair_of_shapes(fwd, bwd, (self.number_of(0, f), tuple(op.name for op in fwd)),
                                              (self.number_of(1, b), tuple(op.name for op in bwd)))
        else:
            value = INF
        row[b] = value
        self.lows[f][b] = self._useful(f, b, value)
        return value

    def lower(self, f: int, b: int) -> float:
        """A lower bound of ``cell(f, b)`` (0 without the cost's bounds); exact once priced;
        INF for a restricted pair, and for a pair whose bound exceeds running its two
        segments one after the other, where their solo times are known (the path through
        the intermediate state is then strictly cheaper). A step with one side empty is
        bounded by its segment's solo bound until its solo time is worked out. Each pair's
        bound is worked out once (the search asks for it from many states)."""
        row = self.lows[f]
        value = row.get(b)
        if value is not None:
            return value
        if not f or not b:
            side, segment = (0, f) if f else (1, b)
            value = self.solo[side][segment]
            if value is None:
                if self.bounds is None:
                    value = self.solo_of(side, segment)
                else:  # (not kept: the row learns the solo time when it is worked out)
                    bound = self._solo_bounds[side][segment]
                    if bound is None:
                        bound = self._solo_bounds[side][segment] = self.bound_of(side, segment).solo() * SAFE
                    return bound
        else:
            value = self.cells[f].get(b)
            if value is None:
                if not self.allowed[self.kinds[0][f]][self.kinds[1][b]]:
                    value = INF
                elif self.bounds is None:
                    value = 0.0
                elif self.share_bounds:
                    shapes = self.number_of(0, f) << 32 | self.number_of(1, b)
                    value = self._shape_bounds.get(shapes)
                    if value is None:
                        value = self._shape_bounds[shapes] = self.bound_of(0, f).pair(self.bound_of(1, b)) * SAFE
                else:
                    value = self.bound_of(0, f).pair(self.bound_of(1, b)) * SAFE
            solo_f, solo_b = self.solo[0][f], self.solo[1][b]
            if solo_f is not None and solo_b is not None and value > solo_f + solo_b:
                value = INF
        row[b] = value
        return value

    def useless(self, f: int, b: int) -> bool:
        """Whether the pair step f, b (both non-empty, its bound worked out, not priced)
        costs more than its two segments one after the other, by its bound; works out their
        solo times (cheaper than pricing the pair, which needs them too)."""
        row = self.lows[f]
        if row[b] > self.solo_of(0, f) + self.solo_of(1, b):
            row[b] = INF
            return True
        return False

    def _useful(self, f: int, b: int, value: float) -> float:
        """``value`` (the time of the pair step f, b), or INF where it exceeds the two
        segments run one after the other."""
        return INF if f and b and value < INF and value > self.solo_of(0, f) + self.solo_of(1, b) else value

    def remaining(self, side: int) -> list[tuple[float, ...]] | None:
        """Per prefix of strand ``side``, the per-lane work of the ops not yet run and their
        longest dependency path (None without the cost's bounds): any plan of the rest takes
        at least its busiest lane, and at least that path (a step lasts at least the part of
        the path inside it, and steps run one after the other). Worked out once per side."""
        if side not in self._remaining:
            self._remaining[side] = self._remaining_of(side)
        return self._remaining[side]

    def _remaining_of(self, side: int) -> list[tuple[float, ...]] | None:
        if self.bounds is None:
            return None
        table = self.tables[side]
        ops = table.strand.ops
        bounded = cast("BoundedCost", self.cost)  # with self.bounds the cost bounds every segment
        bounds = [cast(SegmentBound, bounded.segment_bound((op,))) for op in ops]
        total = [sum(b.lanes[lane] for b in bounds) for lane in range(3)]
        readers: list[list[int]] = [[] for _ in ops]
        index = {op.name: i for i, op in enumerate(ops)}
        for i, op in enumerate(ops):
            for name in dict.fromkeys(op.deps):
                if name in index:
                    readers[index[name]].append(i)
        out = []
        for prefix in table.prefixes:
            done = [0.0, 0.0, 0.0]
            path = [0.0] * len(ops)
            for i in range(len(ops) - 1, -1, -1):  # the given order is topological
                if prefix >> i & 1:
                    done = [d + x for d, x in zip(done, bounds[i].lanes)]
                else:
                    path[i] = bounds[i].path + max((path[r] for r in readers[i]), default=0.0)
            out.append((*(t - d for t, d in zip(total, done)), max(path, default=0.0)))
        return out


def _kinds(tables: tuple[PrefixTable, PrefixTable], rules: PairingRules) -> tuple[list[list[int]], list[list[bool]], list[bool]]:
    """Per strand, each segment's kind (0: the empty segment; else one per distinct
    :class:`Traits`), ``allowed[kf][kb]``: whether the rules let a forward segment of
    kind kf run beside a backward one of kind kb (kind 0 beside anything: a solo step), and
    per kind whether it is quiet (non-empty, no communication).
    A segment's traits are its ops' traits joined (any op pinned or communicating, the
    union of their axes and forbid matches), so each op's are worked out once."""
    axis_bits: dict[str, int] = {}
    facts = [[traits_of((op,), rules, axis_bits) for op in table.strand.ops] for table in tables]
    found: dict[Traits, int] = {}
    kinds = []
    for table, ops in zip(tables, facts):
        codes = [_join(ops, mask) for mask in table.segments]
        kinds.append([0] + [found.setdefault(code, len(found) + 1) for code in codes[1:]])
    traits = sorted(found, key=found.__getitem__)
    allowed = [[True] * (len(traits) + 1)] + [[True] + [a.allows(b, rules.comm_with_comm) for b in traits]
                                               for a in traits]
    return kinds, allowed, [False] + [not t.comm for t in traits]


def _join(facts: list[Traits], mask: int) -> Traits:
    pinned = comm = False
    axes = first = second = 0
    i = 0
    while mask:
        if mask & 1:
            t = facts[i]
            pinned, comm = pinned or t.pinned, comm or t.comm
            axes, first, second = axes | t.axes, first | t.first, second | t.second
        mask >>= 1
        i += 1
    return Traits(pinned, comm, axes, first, second)


def spare_enough(steps: list[tuple[int, int]], spares: list, floor: float) -> list[tuple[int, int]]:
    """The head of ``steps`` (a quiet kind's, by spare, largest first) whose spares are at
    least ``floor``: beside a quiet segment whose spare is ``cut - floor``, every later step
    is useless (:class:`_PairMatrix`)."""
    return steps[:bisect.bisect_right(steps, -floor, key=lambda step: -spares[step[0]])]


