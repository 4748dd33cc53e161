"""Legal operator sequences of one strand: the DAG's given order, with moving ops free.

A strand runs its layer DAG's operators in the DAG's given topological order, except the
*moving* ops: those that a ``movable`` selector of the strands block names **and** that may
move at all (``Op.movable``: wgrad GEMMs and the MoE router). A moving op may be placed
anywhere its data dependencies allow; a wgrad feeds nothing inside the layer, so it may go
anywhere after its inputs, even to the very end. The fixed ops keep their given relative order.

Everything the planner needs is phrased on *prefixes*: a set of ops that can have run before
the rest (a downset of the ordering constraints), held as a bitmask over the given order.
Every legal order is a chain of prefixes, and every segment of a segmented order is the
difference of two prefixes, so the search can work on prefixes and never list the orders
(there are 5824 for a Llama TP+SP backward). Orders are listed here for display and for the
exhaustive checks in the tests, up to a cap.

A *window* bounds how far a moving op may travel: at most ``window`` fixed ops away from its
given position. ``None`` is unbounded; :func:`strand_within` picks the widest window that keeps
the prefix count under a limit, because every pending moving op doubles the prefixes. The
window only bounds the search: inside a segment the canonical issue order ignores it, and a
plan's orders are always legal by dependencies.

The self-overlapping pairs of the paper's Fig. 10 (a column-parallel GEMM's wgrad beside the
reduce_scatter of its dgrad output) are *not* fused into one unit: a segment may hold both,
and the lane model runs them side by side, so the search finds that block by itself and may
also split it.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.program import LayerDag, Op, Strands
from dhelix.dsl.passes.strands import select

#: Orders listed at most by :func:`legal_orders`; past it the first ``cap`` orders (in the
#: deterministic order described there) come back with ``truncated`` set.
DEFAULT_ORDER_CAP = 10_000
#: Prefixes a strand may have before :func:`strand_within` narrows the moving ops' window.
DEFAULT_MAX_PREFIXES = 300


@attrs.frozen
class Strand:
    """One strand's operators with the constraints on their order.

    ``needs[i]`` is the bitmask of ops that must precede op ``i``: its producers inside the
    DAG and, for a fixed op, the fixed op before it. ``fixed_before[i]`` counts the fixed ops
    before op ``i`` in the given order (a moving op's "home"), and ``fixed_rank[i]`` is a fixed
    op's index among the fixed ops (-1 for a moving op).
    """

    dag: LayerDag
    moving: tuple[bool, ...]
    needs: tuple[int, ...]
    fixed_before: tuple[int, ...]
    fixed_rank: tuple[int, ...]
    window: int | None = None

    @property
    def ops(self) -> tuple[Op, ...]:
        """The DAG's ops in the given order; bit ``i`` of a prefix is ``ops[i]``."""
        return self.dag.ops

    @property
    def full(self) -> int:
        """The prefix holding every op."""
        return (1 << len(self.dag.ops)) - 1

    def names(self, indices: Sequence[int]) -> tuple[str, ...]:
        """The op names at ``indices``."""
        return tuple(self.dag.ops[i].name for i in indices)


def moving_ops(strands: Strands, forward: LayerDag, backward: LayerDag) -> frozenset[str]:
    """Names of the ops that may move: selected by a ``movable`` selector and ``Op.movable``.

    A selector may also name ops that cannot move (``movable gemm`` names dgrads too); those
    keep their place, since moving them would change what the layer computes.
    """
    chosen: set[str] = set()
    for selector in strands.movable:
        chosen |= {op.name for op in select(selector, forward, backward) if op.movable}
    return frozenset(chosen)


def strand_of(dag: LayerDag, moving: frozenset[str] = frozenset(), window: int | None = None) -> Strand:
    """The Strand of ``dag`` where the ops named in ``moving`` may move within ``window``.

    Assumes ``dag.ops`` is a topological order (the IR guarantees it); inputs that are not
    ops of the DAG (the layer input) impose nothing.
    """
    index = {op.name: i for i, op in enumerate(dag.ops)}
    is_moving = tuple(op.name in moving for op in dag.ops)
    needs, fixed_before, fixed_rank = [], [], []
    fixed_seen, last_fixed = 0, -1
    for i, op in enumerate(dag.ops):
        mask = 0
        for name in op.deps:
            if name in index:
                mask |= 1 << index[name]
        if not is_moving[i] and last_fixed >= 0:
            mask |= 1 << last_fixed  # fixed ops keep their given relative order
        needs.append(mask)
        fixed_before.append(fixed_seen)
        fixed_rank.append(-1 if is_moving[i] else fixed_seen)
        if not is_moving[i]:
            fixed_seen, last_fixed = fixed_seen + 1, i
    return Strand(dag, is_moving, tuple(needs), tuple(fixed_before), tuple(fixed_rank), window)


def available(strand: Strand, prefix: int) -> list[int]:
    """Indices of the ops that may run next after ``prefix``, in the given order."""
    placed_fixed = _placed_fixed(strand, prefix)
    out = []
    for i, needs in enumerate(strand.needs):
        if prefix >> i & 1 or needs & prefix != needs:
            continue
        if _within_window(strand, prefix, i, placed_fixed):
            out.append(i)
    return out


def _placed_fixed(strand: Strand, prefix: int) -> int:
    return sum(1 for i, rank in enumerate(strand.fixed_rank) if rank >= 0 and prefix >> i & 1)


def _within_window(strand: Strand, prefix: int, i: int, placed_fixed: int) -> bool:
    """Whether op ``i`` may run after ``prefix`` without a moving op leaving its window."""
    w = strand.window
    if w is None:
        return True
    if strand.moving[i]:
        return abs(placed_fixed - strand.fixed_before[i]) <= w
    # Running fixed op i passes every pending moving op once more.
    return all(prefix >> m & 1 or placed_fixed + 1 - strand.fixed_before[m] <= w
               for m in range(len(strand.moving)) if strand.moving[m])


def prefixes(strand: Strand, limit: int | None = None) -> tuple[int, ...] | None:
    """Every prefix reachable from the empty one, sorted by size then bitmask (so the
    empty prefix comes first and the full one last); None once more than ``limit`` exist."""
    seen, frontier = {0}, [0]
    while frontier:
        nxt = []
        for prefix in frontier:
            for i in available(strand, prefix):
                grown = prefix | 1 << i
                if grown not in seen:
                    seen.add(grown)
                    nxt.append(grown)
                    if limit is not None and len(seen) > limit:
                        return None
        frontier = nxt
    return tuple(sorted(seen, key=lambda p: (p.bit_count(), p)))


def strand_within(dag: LayerDag, moving: frozenset[str], max_prefixes: int = DEFAULT_MAX_PREFIXES) -> Strand:
    """The Strand of ``dag`` with the widest moving-op window whose prefixes number at most
    ``max_prefixes``: unbounded when that fits, else the largest window that fits, else
    window 0 (each moving op stays between the same two fixed ops as in the given order)."""
    free = strand_of(dag, moving)
    if not any(free.moving) or prefixes(free, max_prefixes) is not None:
        return free
    best = attrs.evolve(free, window=0)
    for window in range(1, len(dag.ops) + 1):
        trial = attrs.evolve(free, window=window)
        if prefixes(trial, max_prefixes) is None:
            break
        best = trial
    return best


def count_orders(strand: Strand) -> int:
    """The number of legal orders (linear extensions under the window), counted on prefixes."""
    table = prefixes(strand)
    assert table is not None, "no limit: every prefix"
    ways = {strand.full: 1}
    for prefix in reversed(table):
        if prefix != strand.full:
            ways[prefix] = sum(ways.get(prefix | 1 << i, 0) for i in available(strand, prefix))
    return ways.get(0, 0)


@attrs.frozen
class Orders:
    """Legal orders of a strand as op-name tuples; ``total`` counts all of them, and
    ``truncated`` says the list stopped at the cap."""

    orders: tuple[tuple[str, ...], ...]
    total: int
    truncated: bool


def legal_orders(strand: Strand, cap: int = DEFAULT_ORDER_CAP) -> Orders:
    """The legal orders of ``strand``, lexicographic in the given order's indices (so the
    given order comes first), at most ``cap`` of them (the first ``cap``; ``truncated`` then)."""
    found: list[tuple[str, ...]] = []
    for order in _extensions(strand, 0, []):
        if len(found) == cap:
            return Orders(tuple(found), count_orders(strand), True)
        found.append(strand.names(order))
    return Orders(tuple(found), len(found), False)


def _extensions(strand: Strand, prefix: int, order: list[int]) -> Iterator[list[int]]:
    if prefix == strand.full:
        yield list(order)
        return
    for i in available(strand, prefix):
        order.append(i)
        yield from _extensions(strand, prefix | 1 << i, order)
        order.pop()


def is_legal(strand: Strand, names: Sequence[str]) -> bool:
    """Whether ``names`` lists every op of the strand once, in a legal order."""
    index = {op.name: i for i, op in enumerate(strand.ops)}
    if sorted(names) != sorted(index) or len(set(names)) != len(names):
        return False
    prefix = 0
    for name in names:
        if index[name] not in available(strand, prefix):
            return False
        prefix |= 1 << index[name]
    return True


def canonical(strand: Strand, segment: int) -> tuple[int, ...]:
    """The issue order of the ops in ``segment`` (a difference of two prefixes): the given
    order, except that moving ops go as late as the segment's own dependencies allow.

    Running a wgrad last lets the segment's critical path (dgrad → reduce_scatter) start
    first; a segment's cost therefore depends on its op set only, which is what makes the
    prefix search exact over all orders.
    """
    left, out = segment, []
    while left:
        ready = [i for i in _members(left) if strand.needs[i] & left == 0]
        pick = min(ready, key=lambda i: (strand.moving[i], i))
        out.append(pick)
        left &= ~(1 << pick)
    return tuple(out)


def _members(mask: int) -> Iterator[int]:
    i = 0
    while mask:
        if mask & 1:
            yield i
        mask >>= 1
        i += 1


def members(mask: int) -> tuple[int, ...]:
    """The op indices in the bitmask ``mask``, ascending."""
    return tuple(_members(mask))


def selector_names(selector: s.Selector, forward: LayerDag, backward: LayerDag) -> frozenset[str]:
    """The names of the ops ``selector`` matches in either DAG."""
    return frozenset(op.name for op in select(selector, forward, backward))
