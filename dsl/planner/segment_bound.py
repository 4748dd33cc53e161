"""Lower-bound terms of segments for the pair cost (:mod:`dsl.planner.paircost`): what any
step holding a segment, alone or beside another strand's, takes at least — its lanes' work, its
longest chain (:func:`lane_chain`), and what two lanes' OEFs can save side by side
(:class:`OverlapBound`). The pairing search prunes with them (:mod:`dsl.planner.pairing`), as do
its rest bound (:mod:`dsl.planner.restbound`) and the tune search's bounds
(:mod:`dsl.search.bound`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import attrs

from dhelix.dsl.frontend.profiles import LaunchGap

if TYPE_CHECKING:
    from dhelix.dsl.planner.paircost import PairCost


def lane_chain(inputs: Sequence[Sequence[str]], tasks: Sequence[Sequence[tuple]], names: Sequence[str]) -> float:
    """The longest chain of one strand's segment through its data dependencies *and* each
    lane's order (a strand's tasks on one lane run one after the other in segment order, as
    on a CUDA stream): each task at full speed, an op done when its longest task is. Any
    simulation of the segment, alone or beside another, lasts at least this long.
    ``tasks[i]``: op i's (lane, seconds, …) tuples; ``inputs[i]``: its input names."""
    done: dict[str, float] = {}
    free = [0.0, 0.0, 0.0]  # when each lane's last task of this strand is done, at the earliest
    for name, needs, work in zip(names, inputs, tasks, strict=True):
        ready = max((done[x] for x in needs if x in done), default=0.0)
        end = ready
        for lane, seconds, *_ in work:
            free[lane] = max(ready, free[lane]) + seconds
            end = max(end, free[lane])
        done[name] = end
    return max(free)



@attrs.frozen
class SegmentBound:
    """Lower-bound terms of one segment: seconds of work per lane (compute, local, cross),
    its longest chain through its dependencies and each lane's order (:func:`lane_chain`)
    and its communication seconds; with ``overlap``,
    also the OEF classes of its tasks per lane (``kinds``: one representative task per class).

    A lane runs one task at a time and a running task never goes faster than alone (every
    OEF is clamped to at most 1), so a solo step takes at least its busiest lane's work and
    its longest path; a pair at least the two segments' busiest summed lane and either
    segment's path (whether interleaved or run back to back), plus its launch gap. With
    ``overlap`` (:class:`OverlapBound`), two lanes running together cost at least their work
    less what their tasks' OEFs can save."""

    lanes: tuple[float, ...]
    path: float
    comm: float
    launch_gap: LaunchGap  # the profile's
    kinds: tuple[frozenset, ...] = (frozenset(), frozenset(), frozenset())
    overlap: "OverlapBound | None" = attrs.field(default=None, eq=False)

    def solo(self) -> float:
        """A lower bound of this segment's solo time."""
        value = max(*self.lanes, self.path)
        if self.overlap is not None:
            value = max(value, self.overlap.solo(self))
        return value

    def pair(self, other: "SegmentBound") -> float:
        """A lower bound of this segment's pair time with ``other`` (both non-empty)."""
        a, b = self.lanes, other.lanes
        value = max(a[0] + b[0], a[1] + b[1], a[2] + b[2], self.path, other.path)
        if self.overlap is not None and other.overlap is not None:
            saved = self.overlap.pair(self, other)
            if saved > value:
                value = saved
        gap = self.launch_gap  # its seconds(), written out: the planner asks for millions of these
        return value + max(gap.fixed_us * 1e-6, gap.comm_fraction * (self.comm + other.comm))


_LANE_PAIRS = ((0, 1), (0, 2), (1, 2))


class OverlapBound:
    """What running two lanes together can save, from the OEFs of the tasks on them.

    While a task on lane i and one on lane j run together, each runs at most at
    ``1 / (2 - e)`` of its solo speed (``e``: their OEF, at most 1; a third running task only
    slows them more). Doing ``z`` seconds of work on each lane side by side then takes
    ``(2 - e) z``: the two lanes' work ``W_i + W_j`` less at most ``e⁺ z``. With ``e_s`` the
    largest OEF of two tasks of one strand and ``e_x`` of two tasks of different strands, and
    ``z_s``, ``z_x`` the work so overlapped (``z_s + z_x <= min(W_i, W_j)``; ``z_x`` at most
    ``min(W_i^f, W_j^b) + min(W_i^b, W_j^f)``, ``z_s`` at most ``min(W_i^f, W_j^f) +
    min(W_i^b, W_j^b)``), the step lasts at least ``W_i + W_j - e_s z_s - e_x z_x`` at the
    worst such z (a small linear programme, solved greedily: the larger OEF's class first).
    This is never above running the two segments one after the other, and never grows when
    an OEF grows or work is removed, which :mod:`dsl.planner.restbound` relies on.
    """

    def __init__(self, cost: PairCost):
        self._cost = cost
        self._memo: dict[tuple, float] = {}
        self._pairs: dict[tuple, tuple[tuple[float, float], ...]] = {}

    def _oef(self, kinds_a: frozenset, kinds_b: frozenset, same: bool) -> float:
        key = (kinds_a, kinds_b, same)
        value = self._memo.get(key)
        if value is None:
            value = max((self._cost.oef(a, b, same) for a in kinds_a for b in kinds_b), default=0.0)
            value = self._memo[key] = min(1.0, max(0.0, value))
        return value

    def _same(self, kinds: tuple[frozenset, ...], i: int, j: int) -> float:
        return max(self._oef(kinds[i], kinds[j], True), self._oef(kinds[j], kinds[i], True))

    def solo(self, seg: SegmentBound) -> float:
        """A lower bound of one segment run alone: every two of its lanes."""
        value, w = 0.0, seg.lanes
        for i, j in _LANE_PAIRS:
            m = min(w[i], w[j])
            if m > 0.0:
                value = max(value, w[i] + w[j] - self._same(seg.kinds, i, j) * m)
        return value

    def _classes(self, f: SegmentBound, b: SegmentBound) -> tuple[tuple[float, float], ...]:
        """Per lane pair, (e_s, e_x) of the two segments' tasks (cached by their classes)."""
        key = (f.kinds, b.kinds)
        found = self._pairs.get(key)
        if found is None:
            found = self._pairs[key] = tuple(
                (max(self._same(f.kinds, i, j), self._same(b.kinds, i, j)),
                 max(self._oef(f.kinds[i], b.kinds[j], False), self._oef(f.kinds[j], b.kinds[i], False)))
                for i, j in _LANE_PAIRS)
        return found

    def pair(self, f: SegmentBound, b: SegmentBound) -> float:
        """A lower bound of the two segments interleaved (without the launch gap); the
        three lane pairs written out (the planner asks for millions of these)."""
        f0, f1, f2 = f.lanes
        b0, b1, b2 = b.lanes
        busy0, busy1, busy2 = f0 + b0 > 0.0, f1 + b1 > 0.0, f2 + b2 > 0.0
        if busy0 + busy1 + busy2 < 2:
            return 0.0
        classes = self._classes(f, b)
        value = 0.0
        if busy0 and busy1:
            value = _unsaved(f0, f1, b0, b1, classes[0])
        if busy0 and busy2:
            other = _unsaved(f0, f2, b0, b2, classes[1])
            if other > value:
                value = other
        if busy1 and busy2:
            other = _unsaved(f1, f2, b1, b2, classes[2])
            if other > value:
                value = other
        return value

def _unsaved(fi: float, fj: float, bi: float, bj: float, classes: tuple[float, float]) -> float:
    """Two busy lanes' work (the forward's ``fi``, ``fj`` and the backward's ``bi``, ``bj``)
    less the most their OEFs can save (:class:`OverlapBound`; ``classes``: (e_s, e_x)): the
    class with the larger OEF overlapped first."""
    e_s, e_x = classes
    wi, wj = fi + bi, fj + bj
    cap_x = (fi if fi < bj else bj) + (bi if bi < fj else fj)  # min(f_i, b_j) + min(b_i, f_j)
    cap_s = (fi if fi < fj else fj) + (bi if bi < bj else bj)  # min(f_i, f_j) + min(b_i, b_j)
    m = wi if wi < wj else wj
    if e_x >= e_s:
        z = cap_x if cap_x < m else m
        rest = m - z
        saved = e_x * z + e_s * (cap_s if cap_s < rest else rest)
    else:
        z = cap_s if cap_s < m else m
        rest = m - z
        saved = e_s * z + e_x * (cap_x if cap_x < rest else rest)
    return wi + wj - saved
