"""How far a plan can be from the fastest plan of its layer pair: `dhelix plan`'s last line and
``--certify``. Where the pairing search (:mod:`dsl.planner.pairing`) was exhaustive its plan is
the fastest; else the search with segments of any length works out the fastest where that is
affordable, and otherwise the relaxation of :mod:`dsl.planner.restbound` bounds every plan
(:func:`relaxed_total`)."""

from __future__ import annotations

import attrs

from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.program import LayerDag, Strands
from dhelix.dsl.planner.pairing import (SegmentCost, fixed_chain_table, has_bounds, segment_pairs_within,
                                        plan_layers)
from dhelix.dsl.planner.pairing_rules import rules_of
from dhelix.dsl.planner.sequences import moving_ops, strand_of


def relaxed_total(forward: LayerDag, backward: LayerDag, strands: Strands, cost: SegmentCost) -> float | None:
    """A lower bound of every plan's total (:mod:`dsl.planner.restbound`: the least total
    with the moving ops dropped and every step at its cost's bound), or None when the cost
    offers no bounds (e.g. a measured profile). What the exact search's pruning rests on."""
    if not has_bounds(cost, forward):
        return None
    moving = moving_ops(strands, forward, backward)
    sides = (strand_of(forward, moving), strand_of(backward, moving))
    return fixed_chain_table(sides, cost, rules_of(strands, forward, backward))[0][0]


#: Pairs of segments up to which :func:`optimality` checks a bounded plan by the search with
#: segments of any length (a Llama TP+SP pair, ~280,000, takes about half a second).
CERTIFY_PAIRS = 2_000_000


@attrs.frozen
class Optimality:
    """How far a plan can be from the fastest plan of its layer pair, under the cost model.

    ``exact``: no plan over any legal order and segmentation is faster (the search was
    exhaustive, or the search with segments of any length found the same total);
    ``fastest``: that search's total where it was run; ``floor``: a proven lower bound of
    every plan (:func:`relaxed_total`) where neither applies (None under a measured profile)."""

    exact: bool
    fastest: float | None = None
    floor: float | None = None

    def faster(self, plan: Plan) -> bool:
        """Whether the search with segments of any length found a plan faster than ``plan``."""
        return self.fastest is not None and self.fastest < plan.total * (1 - 1e-9)


def optimality(plan: Plan, forward: LayerDag, backward: LayerDag, strands: Strands, cost: SegmentCost) -> Optimality:
    """What is known of ``plan``'s distance from the fastest (see :class:`Optimality`): the
    plan's own search when it was exhaustive; else, when the moving ops had no window, the
    strands have at most CERTIFY_PAIRS pairs of segments and the cost offers bounds (without
    them every pair is simulated: a measured profile), the search with segments of any length
    (exact then); else the relaxation's lower bound."""
    stats = plan.stats
    if stats.exhaustive:
        return Optimality(True, plan.total)
    if has_bounds(cost, forward) and stats.forward_window is None and stats.backward_window is None:
        moving = moving_ops(strands, forward, backward)
        sides = (strand_of(forward, moving), strand_of(backward, moving))
        if segment_pairs_within(sides, CERTIFY_PAIRS):
            fastest = plan_layers(forward, backward, strands, cost, max_segment=None).total
            return Optimality(True, fastest)
    return Optimality(False, floor=relaxed_total(forward, backward, strands, cost))
