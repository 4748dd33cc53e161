"""The DP pairing search: exact against brute force, constraints never broken, plan output."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import attrs
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.frontend.profiles import LaunchGap
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.planner.segment_bound import SegmentBound
from dhelix.dsl.planner import pairing
from dhelix.dsl.planner.certify import relaxed_total
from dhelix.dsl.planner.pairing import DEFAULT_MAX_SEGMENT, pair_sequences, plan_layers, plan_program
from dhelix.dsl.planner.pairing_rules import restriction, rules_of
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.core.plan import format_plan, plan_from_json, plan_to_json
from dhelix.dsl.core.program import Strands
from dhelix.dsl.planner.refine import refine
from dhelix.dsl.planner.sequences import canonical, is_legal, moving_ops, strand_of
from dhelix.dsl.planner.step_table import SAFE, PrefixTable, StepTable
from dhelix.dsl.passes.strands import select
from test_sequences import PROPERTY, checked, dags, legal_by_permutation

INF = float("inf")
ROOT = Path(__file__).resolve().parent.parent


def unit(*key) -> int:
    """A deterministic pseudo-random integer in 1..100 for ``key``."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=4).digest(), "big") % 100 + 1


class SetCost:
    """Random but deterministic integer costs of segment *sets* (integers add exactly, so
    two searches that find equally good plans report identical totals)."""

    def __init__(self, salt: int):
        self.salt = salt
        self.pairs: list[tuple[tuple, tuple]] = []

    def solo(self, ops):
        return unit(self.salt, "solo", sorted(op.name for op in ops))

    def pair(self, fwd, bwd):
        self.pairs.append((tuple(fwd), tuple(bwd)))
        # Pairs range up to 1.5 solos, so pairing sometimes pays and sometimes does not.
        return unit(self.salt, "pair", sorted(op.name for op in fwd), sorted(op.name for op in bwd)) * 3 // 2


class LaneCost:
    """A small lane model: a pair takes its busiest lane's work plus a gap, so hiding
    communication pays and the constraints bind."""

    unit = "us"

    def weight(self, op) -> int:
        return unit("w", op.name) * (3 if op.op_class == "gemm" else 1)

    def solo(self, ops):
        return sum(self.weight(op) for op in ops) + 2

    def pair(self, fwd, bwd):
        lanes: dict[str, int] = {}
        for op in (*fwd, *bwd):
            lane = op.lane if op.kind == "comm" else "compute"
            lanes[lane] = lanes.get(lane, 0) + self.weight(op)
        return max(lanes.values()) + 5


@st.composite
def strands_for(draw, fwd, bwd):
    """A random strands block over the two DAGs: overlap kinds, comm_with_comm, some movable
    ops (by name) and up to two forbid rules (op names or classes)."""
    overlap = tuple(k for k in ("tp", "cp", "ep") if draw(st.booleans()))
    movable = tuple(s.Selector((op.name,)) for dag in (fwd, bwd) for op in dag.ops
                    if op.movable and draw(st.integers(0, 3)) > 0)
    words = [op.name for op in fwd.ops + bwd.ops] + ["gemm", "comm", "compute", "norm", "all_gather"]
    forbid = tuple((s.Selector((a,)), s.Selector((b,)))
                   for a, b in draw(st.lists(st.tuples(st.sampled_from(words), st.sampled_from(words)), max_size=2)))
    return Strands(overlap, draw(st.booleans()), movable, forbid)


@st.composite
def problems(draw, max_ops: int = 6, max_moving: int = 2):
    fwd = draw(dags("forward", "f", max_ops, max_moving))
    bwd = draw(dags("backward", "b", max_ops, max_moving))
    return fwd, bwd, draw(strands_for(fwd, bwd)), draw(st.integers(0, 10**6))


def forbidden(fops, bops, strands, fwd, bwd) -> bool:
    """The pairing rules restated from the strands block, independently of dsl.planner.pairing."""
    if not fops or not bops:
        return False
    fcomm = [op for op in fops if op.kind == "comm"]
    bcomm = [op for op in bops if op.kind == "comm"]
    if any(op.axis.partition(".")[0] not in strands.overlap for op in fcomm + bcomm):
        return True  # communication `overlap` does not list is never hidden
    if {op.axis for op in fcomm} & {op.axis for op in bcomm}:
        return True  # never tp with tp, ring with ring, ep with ep
    if not strands.comm_with_comm and fcomm and bcomm:
        return True
    fnames, bnames = {op.name for op in fops}, {op.name for op in bops}
    for a, b in strands.forbid:
        first = {op.name for op in select(a, fwd, bwd)}
        second = {op.name for op in select(b, fwd, bwd)}
        if fnames & first and bnames & second or fnames & second and bnames & first:
            return True
    return False


def step_cost(cost, allowed, fseg, bseg) -> float:
    if not fseg or not bseg:
        return cost.solo(fseg or bseg)
    return cost.pair(fseg, bseg) if allowed(fseg, bseg) else INF


def exhaustive(fseq, bseq, cost, allowed) -> float:
    """Every segmentation of both sequences with every monotone pairing, enumerated."""

    def rest(a: int, b: int) -> float:
        if a == len(fseq) and b == len(bseq):
            return 0.0
        best = INF
        for a2 in range(a, len(fseq) + 1):
            for b2 in range(b, len(bseq) + 1):
                if (a2, b2) != (a, b):
                    best = min(best, step_cost(cost, allowed, tuple(fseq[a:a2]), tuple(bseq[b:b2])) + rest(a2, b2))
        return best

    return rest(0, 0)


def compositions(seq):
    """Every way to cut ``seq`` into contiguous non-empty segments."""
    n = len(seq)
    for cuts in range(1 << max(n - 1, 0)):
        bounds = [0] + [i + 1 for i in range(n - 1) if cuts >> i & 1] + [n]
        yield [tuple(seq[x:y]) for x, y in zip(bounds, bounds[1:])]


def reference_code_search(fseq, bseq, cost, allowed) -> float:
    """The reference code's search: every pair of segmentations, each paired by Eq. (2)."""
    best = INF
    for fsegs in compositions(fseq):
        for bsegs in compositions(bseq):
            T = [[INF] * (len(bsegs) + 1) for _ in range(len(fsegs) + 1)]
            T[0][0] = 0.0
            for i in range(len(fsegs) + 1):
                for j in range(len(bsegs) + 1):
                    if i:
                        T[i][j] = min(T[i][j], T[i - 1][j] + cost.solo(fsegs[i - 1]))
                    if j:
                        T[i][j] = min(T[i][j], T[i][j - 1] + cost.solo(bsegs[j - 1]))
                    if i and j:
                        T[i][j] = min(T[i][j], T[i - 1][j - 1] + step_cost(cost, allowed, fsegs[i - 1], bsegs[j - 1]))
            best = min(best, T[-1][-1])
    return best


def rules_check(strands, fwd, bwd):
    return lambda fseg, bseg: not forbidden(fseg, bseg, strands, fwd, bwd)


@PROPERTY
@given(problems())
def test_position_dp_equals_the_reference_codes_search(problem):
    fwd, bwd, strands, salt = problem
    cost = SetCost(salt)
    total, steps = pair_sequences(fwd.ops, bwd.ops, cost, rules_of(strands, fwd, bwd))
    assert total == reference_code_search(fwd.ops, bwd.ops, cost, rules_check(strands, fwd, bwd))
    assert sum(time for _, _, time in steps) == total
    assert [op for f, _, _ in steps for op in f] == list(fwd.ops)
    assert [op for _, b, _ in steps for op in b] == list(bwd.ops)


@PROPERTY
@given(problems(max_ops=4))
def test_position_dp_equals_exhaustive_enumeration(problem):
    fwd, bwd, strands, salt = problem
    cost = SetCost(salt)
    total, _ = pair_sequences(fwd.ops, bwd.ops, cost, rules_of(strands, fwd, bwd))
    assert total == exhaustive(fwd.ops, bwd.ops, cost, rules_check(strands, fwd, bwd))


def moving_names(strands, fwd, bwd) -> frozenset[str]:
    return frozenset(op.name for sel in strands.movable for op in select(sel, fwd, bwd) if op.movable)


def order_pairs(fwd, bwd, strands):
    moving = moving_names(strands, fwd, bwd)
    return legal_by_permutation(fwd, moving), legal_by_permutation(bwd, moving)


@settings(PROPERTY, max_examples=300)
@given(problems())
def test_search_equals_the_best_over_all_legal_orders(problem):
    fwd, bwd, strands, salt = problem
    forders, borders = order_pairs(fwd, bwd, strands)
    assume(len(forders) * len(borders) <= 40)
    cost, rules = SetCost(salt), rules_of(strands, fwd, bwd)
    fops, bops = {op.name: op for op in fwd.ops}, {op.name: op for op in bwd.ops}
    best = min(pair_sequences([fops[n] for n in fo], [bops[n] for n in bo], cost, rules)[0]
               for fo in forders for bo in borders)
    assert plan_layers(fwd, bwd, strands, cost, max_segment=None).total == best


@PROPERTY
@given(problems(max_ops=3))
def test_search_equals_exhaustive_enumeration_over_orders_segmentations_and_pairings(problem):
    fwd, bwd, strands, salt = problem
    forders, borders = order_pairs(fwd, bwd, strands)
    cost, allowed = SetCost(salt), rules_check(strands, fwd, bwd)
    fops, bops = {op.name: op for op in fwd.ops}, {op.name: op for op in bwd.ops}
    best = min(exhaustive([fops[n] for n in fo], [bops[n] for n in bo], cost, allowed)
               for fo in forders for bo in borders)
    assert plan_layers(fwd, bwd, strands, cost, max_segment=None).total == best


@PROPERTY
@given(problems(), st.sampled_from([None, 1, 2, 3]))
def test_a_plan_is_legal_consistent_and_never_breaks_a_rule(problem, max_segment):
    fwd, bwd, strands, salt = problem
    cost = SetCost(salt)
    plan = plan_layers(fwd, bwd, strands, cost, max_segment=max_segment)
    moving = moving_names(strands, fwd, bwd)
    assert is_legal(strand_of(fwd, moving), plan.forward_order)
    assert is_legal(strand_of(bwd, moving), plan.backward_order)
    # The search never even evaluates a restricted pair, so no plan can hold one.
    assert not any(forbidden(f, b, strands, fwd, bwd) for f, b in cost.pairs)
    fops, bops = {op.name: op for op in fwd.ops}, {op.name: op for op in bwd.ops}
    fresh = SetCost(salt)
    for pair in plan.pairs:
        f, b = [fops[n] for n in pair.forward], [bops[n] for n in pair.backward]
        assert not forbidden(f, b, strands, fwd, bwd)
        # (or the strands one after the other, each whole, where the bounded search did worse)
        assert max_segment is None or max(len(f), len(b)) <= max_segment or not (f and b)
        assert pair.time == (fresh.pair(f, b) if f and b else fresh.solo(f or b))
        assert pair.alone == (fresh.solo(f) if f else 0) + (fresh.solo(b) if b else 0)
    assert plan.total == sum(pair.time for pair in plan.pairs)
    assert plan.sequential == fresh.solo(fwd.ops) + fresh.solo(bwd.ops)
    handed = [side for f, b in cost.pairs for side in (f, b)]
    planned = [[(fops | bops)[n] for n in side] for pair in plan.pairs for side in (pair.forward, pair.backward) if side]
    for segment in handed + planned:  # in canonical issue order, as the plan records them
        dag = fwd if segment[0].name in fops else bwd
        index = {op.name: i for i, op in enumerate(dag.ops)}
        mask = sum(1 << index[op.name] for op in segment)
        assert [op.name for op in segment] == [dag.ops[i].name for i in canonical(strand_of(dag, moving), mask)]

@PROPERTY
@given(problems(max_ops=5))
def test_bounding_segments_never_helps_and_a_loose_bound_changes_nothing(problem):
    fwd, bwd, strands, salt = problem
    exact = plan_layers(fwd, bwd, strands, SetCost(salt), max_segment=None).total
    assert plan_layers(fwd, bwd, strands, SetCost(salt), max_segment=2).total >= exact
    assert plan_layers(fwd, bwd, strands, SetCost(salt), max_segment=5).total == exact


class BoundedCost(SetCost):
    """SetCost with lower bounds the search may prune by: every op has random work on one
    of the three lanes, a segment's time is its bound (busiest lane or longest in-segment
    dependency path, plus a launch gap for a pair) plus a random non-negative extra, so the
    bounds hold and are sometimes tight."""

    GAP = LaunchGap(4.0e6, 0.5)  # 4 time units at least, half the comm: halves and ints add exactly

    def work(self, op) -> tuple[int, int, int]:
        lane = 0 if op.kind == "compute" else 1 + (op.lane == "cross")
        return tuple(unit(self.salt, "work", op.name) if k == lane else 0 for k in range(3))

    def segment_bound(self, ops):
        lanes = tuple(sum(self.work(op)[k] for op in ops) for k in range(3))
        chain: dict[str, int] = {}  # the longest path ending at each op (ops come in a topological order)
        for op in ops:
            chain[op.name] = max(self.work(op)) + max((chain.get(name, 0) for name in op.deps), default=0)
        return SegmentBound(lanes, float(max(chain.values(), default=0)), float(lanes[1] + lanes[2]), self.GAP)

    def solo(self, ops):
        return self.segment_bound(ops).solo() + super().solo(ops) % 7

    def pair(self, fwd, bwd):
        return self.segment_bound(fwd).pair(self.segment_bound(bwd)) + super().pair(fwd, bwd) % 11


def best_over_orders(fwd, bwd, strands, cost) -> float:
    """Brute force: the best Eq. (2) total over every pair of legal orders (each pairing of
    segmentations of two fixed orders is itself checked against enumeration above)."""
    forders, borders = order_pairs(fwd, bwd, strands)
    rules = rules_of(strands, fwd, bwd)
    fops, bops = {op.name: op for op in fwd.ops}, {op.name: op for op in bwd.ops}
    return min(pair_sequences([fops[n] for n in fo], [bops[n] for n in bo], cost, rules)[0]
               for fo in forders for bo in borders)


@settings(PROPERTY, max_examples=250)
@given(problems(), st.booleans())
def test_the_default_search_equals_brute_force(problem, bounded):
    """At its default bounds the planner is exact on random layers (the old default of four
    ops per segment lost on 12 of 250 such draws), whether or not the cost offers bounds."""
    fwd, bwd, strands, salt = problem
    forders, borders = order_pairs(fwd, bwd, strands)
    assume(len(forders) * len(borders) <= 40)
    cost = (BoundedCost if bounded else SetCost)(salt)
    plan = plan_layers(fwd, bwd, strands, cost)
    assert plan.stats.max_segment is None
    assert plan.total == best_over_orders(fwd, bwd, strands, cost)


@PROPERTY
@given(problems(), st.sampled_from([None, 2, 3]))
def test_pruning_by_bounds_returns_the_plan_pricing_everything_returns(problem, max_segment):
    fwd, bwd, strands, salt = problem
    pruned = plan_layers(fwd, bwd, strands, BoundedCost(salt), max_segment=max_segment)
    unpruned = plan_layers(fwd, bwd, strands, Unbounded(BoundedCost(salt)), max_segment=max_segment)
    assert pruned.pairs == unpruned.pairs and pruned.total == unpruned.total
    assert pruned.stats.pair_evaluations <= unpruned.stats.pair_evaluations


def test_the_default_bound_is_unbounded_exactly_when_the_search_is_small():
    program = _partitioned("chunk ag + fc by 2", "on")
    fwd, bwd, strands = program.forward, program.backward, program.strands
    assert plan_layers(fwd, bwd, strands, LaneCost()).stats.max_segment is None
    assert plan_layers(fwd, bwd, strands, LaneCost(), exact_pairs=10).stats.max_segment == DEFAULT_MAX_SEGMENT
    assert llama_plan()[3].stats.max_segment == DEFAULT_MAX_SEGMENT  # 105 x 2500+ segments


@PROPERTY
@given(problems(), st.booleans())
def test_the_local_search_keeps_a_plan_legal_and_lands_between_the_bounded_and_the_exact_search(problem, bounded):
    """A default search too big to be exact (here: forced by ``exact_pairs=0``) caps its
    segments, then improves the plan locally (dsl.planner.refine): never slower than the
    capped search's plan, never faster than the exact one, legal, every step priced as the
    cost prices it and never breaking a rule."""
    fwd, bwd, strands, salt = problem
    make = BoundedCost if bounded else SetCost
    plan = plan_layers(fwd, bwd, strands, make(salt), exact_pairs=0)
    capped = plan_layers(fwd, bwd, strands, make(salt), max_segment=DEFAULT_MAX_SEGMENT)
    exact = plan_layers(fwd, bwd, strands, make(salt), max_segment=None)
    assert plan.stats.max_segment == DEFAULT_MAX_SEGMENT
    assert exact.total <= plan.total <= capped.total
    if not plan.stats.local_moves:
        assert plan.pairs == capped.pairs and plan.total == capped.total
    moving = moving_names(strands, fwd, bwd)
    assert is_legal(strand_of(fwd, moving), plan.forward_order)
    assert is_legal(strand_of(bwd, moving), plan.backward_order)
    fops, bops = {op.name: op for op in fwd.ops}, {op.name: op for op in bwd.ops}
    fresh = make(salt)
    for pair in plan.pairs:
        f, b = [fops[n] for n in pair.forward], [bops[n] for n in pair.backward]
        assert f or b
        assert not forbidden(f, b, strands, fwd, bwd)
        assert pair.time == (fresh.pair(f, b) if f and b else fresh.solo(f or b))
        for dag, segment in ((fwd, f), (bwd, b)):  # issued in canonical order
            index = {op.name: i for i, op in enumerate(dag.ops)}
            mask = sum(1 << index[op.name] for op in segment)
            assert [op.name for op in segment] == [dag.ops[i].name for i in canonical(strand_of(dag, moving), mask)]
    assert plan.total == sum(pair.time for pair in plan.pairs)


class SetPricing:
    """The local search's pricing (dsl.planner.refine.Pricing) by SetCost: random costs of
    op sets, so that many moves of every kind pay; no bounds."""

    def __init__(self, sides, strands, fwd, bwd, salt):
        self.sides, self.strands, self.fwd, self.bwd = sides, strands, fwd, bwd
        self.cost = SetCost(salt)

    def ops(self, side, mask):
        return [self.sides[side].ops[i] for i in canonical(self.sides[side], mask)]

    def __call__(self, f, b):
        fops, bops = self.ops(0, f), self.ops(1, b)
        if fops and bops:
            return float("inf") if forbidden(fops, bops, self.strands, self.fwd, self.bwd) else self.cost.pair(fops, bops)
        return self.cost.solo(fops or bops) if fops or bops else 0.0

    def bound(self, f, b):
        return 0.0


@settings(PROPERTY, max_examples=1000)  # moves that break a rule are rare among the draws
@given(problems(max_moving=3), st.integers(1, 2))
def test_every_move_of_the_local_search_keeps_the_plan_legal_and_never_slower(problem, cap):
    fwd, bwd, strands, salt = problem
    moving = moving_names(strands, fwd, bwd)
    sides = (strand_of(fwd, moving), strand_of(bwd, moving))
    start = plan_layers(fwd, bwd, strands, SetCost(salt), max_segment=cap)
    masks = []
    for pair in start.pairs:
        masks.append(tuple(sum(1 << [op.name for op in dag.ops].index(name) for name in names)
                           for dag, names in ((fwd, pair.forward), (bwd, pair.backward))))
    price = SetPricing(sides, strands, fwd, bwd, salt)
    steps, moves = refine(masks, sides, price)
    assert sum(price(*step) for step in steps) <= start.total
    for side, strand in enumerate(sides):
        held = [step[side] for step in steps]
        assert sum(held) == strand.full and all(a & b == 0 for k, a in enumerate(held) for b in held[k + 1:])
        order = [strand.ops[i].name for mask in held for i in canonical(strand, mask)]
        assert is_legal(strand, order)
    assert all(price(*step) < float("inf") for step in steps)


def test_the_local_search_improves_a_capped_plan_of_a_chunk_chain():
    """On the small layer chunked by 4 the 4-op plan is 2293 units; the local search (steps
    merged, ops moved across steps, steps cut anew) finds 2281, the exact search's optimum,
    and the plan says so."""
    program = _partitioned("chunk ag + fc by 4", "on")
    fwd, bwd, strands = program.forward, program.backward, program.strands
    plan = plan_layers(fwd, bwd, strands, LaneCost(), exact_pairs=0)
    assert plan_layers(fwd, bwd, strands, LaneCost(), max_segment=DEFAULT_MAX_SEGMENT).total == 2293
    assert plan.total == 2281 and plan.stats.local_moves > 0
    assert plan_layers(fwd, bwd, strands, LaneCost(), max_segment=None).total == 2281
    assert max(len(side) for pair in plan.pairs for side in (pair.forward, pair.backward)) > DEFAULT_MAX_SEGMENT
    assert f"segments of at most 4 ops, then {plan.stats.local_moves} local moves" in format_plan(plan)
    assert plan_from_json(json.loads(json.dumps(plan_to_json(plan)))) == plan


class Unbounded:
    """A cost without bounds: the search must price every pair it might use."""

    def __init__(self, cost):
        self.solo, self.pair = cost.solo, cost.pair


@pytest.mark.parametrize("max_segment", [2, DEFAULT_MAX_SEGMENT])
def test_pruning_keeps_the_plan_of_the_real_pair_cost(max_segment):
    program = check_text((ROOT / "examples" / "llama39b_a40.dhx").read_text(), "llama39b_a40.dhx")
    fwd, bwd, strands = program.forward, program.backward, program.strands
    pruned = plan_layers(fwd, bwd, strands, PairCost.for_program(program), max_segment=max_segment)
    full = plan_layers(fwd, bwd, strands, Unbounded(PairCost.for_program(program)), max_segment=max_segment)
    assert pruned.pairs == full.pairs and pruned.total == full.total
    assert pruned.stats.pair_evaluations < full.stats.pair_evaluations / 2


@PROPERTY
@given(problems())
def test_restriction_agrees_with_the_rules_restated(problem):
    fwd, bwd, strands, _ = problem
    rules = rules_of(strands, fwd, bwd)
    for fo in range(len(fwd.ops)):
        for bo in range(len(bwd.ops)):
            f, b = fwd.ops[fo:fo + 3], bwd.ops[bo:bo + 2]
            assert (restriction(f, b, rules) is not None) == forbidden(f, b, strands, fwd, bwd)


# --- the shipped layers ------------------------------------------------------------------------

def llama_plan(mesh: str = "tp = 8", strands: str = "overlap tp\n movable wgrad", **bounds):
    fwd, bwd, block = checked(mesh=mesh, strands=strands)
    return fwd, bwd, block, plan_layers(fwd, bwd, block, LaneCost(), **bounds)


def pairs_with(plan, fwd, bwd, test):
    ops = {op.name: op for op in fwd.ops + bwd.ops}
    return [(p.forward, p.backward) for p in plan.pairs
            if p.forward and p.backward and test([ops[n] for n in p.forward], [ops[n] for n in p.backward])]


def test_llama_plan_hides_tp_comm_but_never_beside_tp_comm():
    fwd, bwd, block, plan = llama_plan()
    assert plan.total < plan.sequential and plan.comm_hidden > 0
    assert not pairs_with(plan, fwd, bwd, lambda f, b: any(op.axis == "tp" and op.kind == "comm" for op in f)
                          and any(op.axis == "tp" and op.kind == "comm" for op in b))
    assert plan.stats.backward_orders == 5824 and plan.stats.forward_orders == 1


@pytest.mark.parametrize("overlap, paired", [("tp", False), ("tp, cp", True)])
def test_ring_steps_pair_only_when_cp_overlap_is_on(overlap, paired):
    fwd, bwd, block, plan = llama_plan("tp = 4  cp = 2", f"overlap {overlap}\n movable wgrad", max_segment=3)
    ring = pairs_with(plan, fwd, bwd, lambda f, b: any(op.op_class == "ring_attention" for op in f + b))
    assert bool(ring) == paired


def test_comm_with_comm_off_keeps_comm_apart():
    fwd, bwd, _, plan = llama_plan("tp = 4  cp = 2", "overlap tp, cp\n comm_with_comm off\n movable wgrad",
                                   max_segment=3)
    assert not pairs_with(plan, fwd, bwd, lambda f, b: any(op.kind == "comm" for op in f)
                          and any(op.kind == "comm" for op in b))


def test_forbid_keeps_attention_backward_away_from_gemms():
    fwd, bwd, _, plan = llama_plan(strands="overlap tp\n movable wgrad\n forbid attention.bwd with gemm")
    assert not pairs_with(plan, fwd, bwd, lambda f, b: any(op.name == "att.bwd" for op in b)
                          and any(op.op_class == "gemm" for op in f))
    free = llama_plan()[3]
    assert plan.total >= free.total


def test_the_default_segment_bound_is_recorded_and_only_narrows_the_search():
    bounded = llama_plan()[3]
    capped = llama_plan(max_segment=4)[3]  # the 4-op search alone, without the local search
    free = llama_plan(max_segment=None)[3]
    assert bounded.stats.max_segment == 4 and free.stats.max_segment is None
    assert free.total <= bounded.total <= capped.total
    assert capped.stats.local_moves == 0
    assert max(len(side) for pair in capped.pairs for side in (pair.forward, pair.backward)) <= 4


def test_plan_table_golden(golden):
    golden("pairing/llama_tp8_lanecost.txt", format_plan(llama_plan()[3]))


def test_plan_json_is_deterministic_and_round_trips():
    plan = llama_plan()[3]
    data = plan_to_json(plan)
    assert json.dumps(data) == json.dumps(plan_to_json(llama_plan()[3]))
    assert list(data) == ["forward_layer", "backward_layer", "unit", "forward_order", "backward_order", "ops",
                          "pairs", "total", "sequential", "speedup", "compute_time", "comm_time", "comm_hidden",
                          "comm_exposed", "rules", "stats"]
    assert plan_from_json(json.loads(json.dumps(data))) == plan


def test_plan_program_plans_the_programs_layer():
    program = check_text(PROGRAM, "t.dhx")
    plan = plan_program(program, LaneCost())
    assert plan.forward_layer == "llama" and len(plan.forward_order) == 14 and len(plan.backward_order) == 18


PROGRAM = """
import "stdlib/layers.dhx"
model m {
  layers = 4  hidden = 1024  ffn = 4096  heads = 16  kv_heads = 8  seq = 4096  vocab = 32000
  dtype = bf16  layer = llama
}
cluster { nodes = 1  gpus_per_node = 8 }
mesh { tp = 8 }
train { micro_batch = 1  microbatches = 8 }
pipeline p
pipeline p { repeat m { F } repeat m { B } }
"""


def test_plan_program_refuses_a_library_file():
    library = check_text('import "stdlib/layers.dhx"\n', "lib.dhx")
    with pytest.raises(DhelixError, match="no layer to plan"):
        plan_program(library, LaneCost())


# -- partitioned DAGs (Centauri chunks): the search stays exact ---------------------------

SMALL_PARTITIONED = """
import "stdlib/pipelines.dhx"
layer mlp {{
  in x [tokens / tp, hidden]
  ag = all_gather(x, tp)
  fc = gemm(ag, hidden, hidden)
  rs = reduce_scatter(fc, tp)
  out rs
}}
model m {{ layers = 2  hidden = 32  ffn = 64  heads = 4  kv_heads = 4  seq = 8  vocab = 64
  dtype = fp32  layer = mlp }}
cluster {{ nodes = 1  gpus_per_node = 2  profile = "a40" }}
mesh {{ tp = 2 }}
train {{ micro_batch = 2  microbatches = 2 }}
fold u
pipeline w_helix
strands {{ overlap tp  comm_with_comm {comm_with_comm}  movable wgrad }}
partition {{ {chunk} }}
"""


#: A tensor-parallel block without SP whose all_reduce is substituted and its all_gather moved
#: later: the block's tokens become sequence-parallel (the input's gather before the GEMM).
SMALL_MOVED = SMALL_PARTITIONED.replace("""layer mlp {{
  in x [tokens / tp, hidden]
  ag = all_gather(x, tp)
  fc = gemm(ag, hidden, hidden)
  rs = reduce_scatter(fc, tp)
  out rs
}}""", """layer mlp {{
  in x [tokens, hidden]
  n = rmsnorm(x)
  up = gemm(n, hidden, hidden / tp)
  down = gemm(up, hidden / tp, hidden)
  ar = all_reduce(down, tp)
  h = add(ar, x)
  out h
}}""")
MOVED = "substitute ar as reduce_scatter + all_gather  move ar later"


@functools.cache
def _partitioned(chunk: str, comm_with_comm: str):
    """The small layer chunked by ``chunk`` (or, for MOVED, the tensor-parallel block moved)."""
    from dhelix.dsl.passes.pipeline import check_text

    template = SMALL_MOVED if chunk == MOVED else SMALL_PARTITIONED
    return check_text(template.format(chunk=chunk, comm_with_comm=comm_with_comm), "small.dhx")


@functools.cache
def _partitioned_orders(chunk: str):
    # Enumerated by permutation: seconds per chain, so once per chain (the rules do not change them).
    program = _partitioned(chunk, "on")
    return order_pairs(program.forward, program.backward, program.strands)


@settings(PROPERTY, max_examples=8)
@given(st.sampled_from(["chunk ag + fc by 2", "chunk fc + rs by 2", MOVED]), st.sampled_from(["on", "off"]),
       st.integers(0, 10**6))
@example(MOVED, "on", 7)
def test_search_over_partitioned_dags_equals_the_best_over_all_legal_orders(chunk, comm_with_comm, salt):
    program = _partitioned(chunk, comm_with_comm)
    forders, borders = _partitioned_orders(chunk)
    fwd, bwd, strands = program.forward, program.backward, program.strands
    if chunk == MOVED:  # the gather moved past the add, the input's made before the GEMM
        assert [op.name for op in fwd.ops] == ["n", "n.ag", "up", "down", "ar.rs", "h"]
    else:
        assert any(".c1" in op.name for op in fwd.ops)  # the chain is chunked
    cost, rules = SetCost(salt), rules_of(strands, fwd, bwd)
    fops, bops = {op.name: op for op in fwd.ops}, {op.name: op for op in bwd.ops}
    best = min(pair_sequences([fops[n] for n in fo], [bops[n] for n in bo], cost, rules)[0]
               for fo in forders for bo in borders)
    assert plan_layers(fwd, bwd, strands, cost, max_segment=None).total == best


# -- the exact search's rest bound (dsl.planner.restbound) --------------------------------

@settings(PROPERTY, max_examples=150)
@given(problems())
def test_the_relaxed_total_never_exceeds_the_best_plan(problem):
    """The fixed-chain relaxation is a lower bound of every plan, brute force on random layers."""
    fwd, bwd, strands, salt = problem
    forders, borders = order_pairs(fwd, bwd, strands)
    assume(len(forders) * len(borders) <= 40)
    cost = BoundedCost(salt)
    assert relaxed_total(fwd, bwd, strands, cost) <= best_over_orders(fwd, bwd, strands, cost) * (1 + 1e-12)
    assert relaxed_total(fwd, bwd, strands, SetCost(salt)) is None  # no bounds, no relaxation


def _lane_model(program, oef: float, slowdown: float, fraction: float) -> PairCost:
    """The program's PairCost on its profile with every OEF class, σ and the launch gap's
    share of comm time replaced."""
    base = PairCost.for_program(program).profile
    profile = attrs.evolve(base, oef_classes={key: oef for key in base.oef_classes}, slowdown=slowdown,
                           launch_gap=LaunchGap(20, fraction))
    return PairCost.for_program(program, profile)


def _best_over_orders_of(chunk: str, program, cost) -> float:
    forders, borders = _partitioned_orders(chunk)
    fwd, bwd = program.forward, program.backward
    fops, bops = {op.name: op for op in fwd.ops}, {op.name: op for op in bwd.ops}
    rules = rules_of(program.strands, fwd, bwd)
    return min(pair_sequences([fops[n] for n in fo], [bops[n] for n in bo], cost, rules)[0]
               for fo in forders for bo in borders)


PARTITIONS = ["chunk ag + fc by 2", "chunk fc + rs by 2", MOVED]


@settings(PROPERTY, max_examples=5)
@given(st.sampled_from(PARTITIONS), st.sampled_from(["on", "off"]), st.floats(0, 1), st.floats(0, 0.5),
       st.floats(0, 0.3))
def test_with_the_lane_model_the_exact_search_and_its_bounds_hold_against_brute_force(
        chunk, comm_with_comm, oef, slowdown, fraction):
    """PairCost's bounds (lanes, chains, OEF savings) and the relaxation built on them: the
    relaxed total is below the best plan, and the exact search that prunes by them finds it."""
    program = _partitioned(chunk, comm_with_comm)
    cost = _lane_model(program, oef, slowdown, fraction)
    best = _best_over_orders_of(chunk, program, cost)
    fwd, bwd, strands = program.forward, program.backward, program.strands
    assert relaxed_total(fwd, bwd, strands, cost) <= best * (1 + 1e-12)
    plan = plan_layers(fwd, bwd, strands, _lane_model(program, oef, slowdown, fraction), max_segment=None)
    assert plan.total == pytest.approx(best, rel=1e-12)


class _BestFirst:
    """Within it, the search with segments of any length runs its best-first pass
    (pairing._best_first) at every size (``on``) or at none."""

    def __init__(self, on: bool):
        self.pairs = 0 if on else 10 ** 18

    def __enter__(self):
        self.saved, pairing.BEST_FIRST_PAIRS = pairing.BEST_FIRST_PAIRS, self.pairs

    def __exit__(self, *exc):
        pairing.BEST_FIRST_PAIRS = self.saved


@settings(PROPERTY, max_examples=60)
@given(problems())
def test_the_best_first_pass_keeps_the_exact_plan(problem):
    """With the best-first pass (its total the DP's ceiling) the search with segments of any
    length is exact against brute force and returns the very plan it returns without it."""
    fwd, bwd, strands, salt = problem
    forders, borders = order_pairs(fwd, bwd, strands)
    assume(len(forders) * len(borders) <= 40)
    with _BestFirst(True):
        first = plan_layers(fwd, bwd, strands, BoundedCost(salt), max_segment=None)
    with _BestFirst(False):
        plain = plan_layers(fwd, bwd, strands, BoundedCost(salt), max_segment=None)
    assert first.total == best_over_orders(fwd, bwd, strands, BoundedCost(salt))
    assert first.pairs == plain.pairs and first.total == plain.total


@settings(PROPERTY, max_examples=5)
@given(st.sampled_from(PARTITIONS), st.sampled_from(["on", "off"]), st.floats(0, 1), st.floats(0, 0.5),
       st.floats(0, 0.3))
def test_with_the_lane_model_the_best_first_pass_finds_the_optimum(chunk, comm_with_comm, oef, slowdown, fraction):
    """The best-first pass on PairCost's bounds (lanes, chains, OEF savings, the relaxation):
    its total is the best plan's over every order, and the plan is the one found without it."""
    program = _partitioned(chunk, comm_with_comm)
    best = _best_over_orders_of(chunk, program, _lane_model(program, oef, slowdown, fraction))
    fwd, bwd, strands = program.forward, program.backward, program.strands
    with _BestFirst(True):
        first = plan_layers(fwd, bwd, strands, _lane_model(program, oef, slowdown, fraction), max_segment=None)
    with _BestFirst(False):
        plain = plan_layers(fwd, bwd, strands, _lane_model(program, oef, slowdown, fraction), max_segment=None)
    assert first.total == pytest.approx(best, rel=1e-12)
    assert first.pairs == plain.pairs and first.total == plain.total


@settings(PROPERTY, max_examples=60)
@given(problems())
def test_the_best_first_search_finds_the_plan_of_pricing_every_step(problem):
    """The search with segments of any length as it runs on a large pair (best first, steps
    skipped by their segments' kinds, by their bound before what overlap saves, quiet pairs
    cut by spare, solo times worked out late) returns the very plan of the plain DP pricing
    every step (a cost without bounds, the search before any pruning)."""
    fwd, bwd, strands, salt = problem
    with _BestFirst(True):
        fast = plan_layers(fwd, bwd, strands, BoundedCost(salt), max_segment=None)
    slow = plan_layers(fwd, bwd, strands, Unbounded(BoundedCost(salt)), max_segment=None)
    assert fast.pairs == slow.pairs and fast.total == slow.total
    assert fast.stats.pair_evaluations <= slow.stats.pair_evaluations


def _quiet_cut_pairs(fwd, bwd, strands, cost) -> tuple[int, int]:
    """(pairs of quiet segments the spare cut drops, of them those not useless by their
    bound): every pair of non-empty segments of two quiet kinds checked against its bound."""
    moving = moving_ops(strands, fwd, bwd)
    sides = (strand_of(fwd, moving), strand_of(bwd, moving))
    tables = (PrefixTable(sides[0], None), PrefixTable(sides[1], None))
    matrix = StepTable(tables, cost, rules_of(strands, fwd, bwd))
    dropped = wrong = 0
    for f in range(1, len(tables[0].segments)):
        for b in range(1, len(tables[1].segments)):
            kf, kb = matrix.kinds[0][f], matrix.kinds[1][b]
            if not (matrix.quiet[kf] and matrix.quiet[kb]) or not matrix.allowed[kf][kb]:
                continue
            if matrix.spare_of(0, f) + matrix.spare_of(1, b) < matrix.cut:
                dropped += 1
                bound = matrix.bound_of(0, f).pair(matrix.bound_of(1, b)) * SAFE
                wrong += not bound > matrix.solo_of(0, f) + matrix.solo_of(1, b)
    return dropped, wrong


@settings(PROPERTY, max_examples=40)
@given(problems())
def test_the_spare_cut_drops_only_pairs_slower_than_their_segments_one_after_the_other(problem):
    fwd, bwd, strands, salt = problem
    assert _quiet_cut_pairs(fwd, bwd, strands, BoundedCost(salt))[1] == 0


def test_the_spare_cut_drops_the_compute_pairs_of_a_chunked_layer():
    """On PairCost two compute-only segments never pay beside each other (the launch gap):
    the cut finds such pairs, and each is slower paired than one after the other."""
    program = _partitioned(PARTITIONS[0], "on")
    dropped, wrong = _quiet_cut_pairs(program.forward, program.backward, program.strands,
                                      PairCost.for_program(program))
    assert dropped > 0 and wrong == 0


def test_a_best_first_total_below_the_optimum_loses_the_plan(monkeypatch):
    """The tests above can fail: a best-first pass answering 1 % below the optimum leaves the
    DP a ceiling no plan reaches (it then ends on a plan above it or none)."""
    program = _partitioned(PARTITIONS[0], "on")
    fwd, bwd, strands = program.forward, program.backward, program.strands
    best = _best_over_orders_of(PARTITIONS[0], program, PairCost.for_program(program))
    monkeypatch.setattr(pairing, "BEST_FIRST_PAIRS", 0)
    monkeypatch.setattr(pairing, "_best_first", lambda *args: best * 0.99)
    monkeypatch.setattr(pairing, "_one_after_the_other", lambda *args: (pairing.SegmentPair((), (), INF, INF),))
    assert plan_layers(fwd, bwd, strands, PairCost.for_program(program), max_segment=None).total != \
        pytest.approx(best, rel=1e-12)


def test_a_rest_bound_that_over_estimates_loses_the_optimum(monkeypatch):
    """The test above can fail: doubled, the rest bound prunes the best plan away."""
    program = _partitioned(PARTITIONS[0], "on")
    fwd, bwd, strands = program.forward, program.backward, program.strands
    best = _best_over_orders_of(PARTITIONS[0], program, PairCost.for_program(program))
    exact = pairing.fixed_chain_rest
    monkeypatch.setattr(pairing, "fixed_chain_rest", lambda *args: [[2 * x for x in row] for row in exact(*args)])
    # (nor rescued by the plan of the strands one after the other, which is this optimum)
    monkeypatch.setattr(pairing, "_one_after_the_other", lambda *args: (pairing.SegmentPair((), (), INF, INF),))
    assert plan_layers(fwd, bwd, strands, PairCost.for_program(program), max_segment=None).total != \
        pytest.approx(best, rel=1e-12)


def test_the_plan_is_never_slower_than_the_strands_one_after_the_other():
    # Issue 53: the search's plan of the FSDP example cost 0.999x of running the forward then
    # the backward; the planner then runs them so (the sequential plan's two segment pairs).
    from dhelix.dsl.simulator.costs import cost_of
    from dhelix.dsl.simulator.launch import priced_program
    from dhelix.dsl.simulator.si_pairs import schedule_plan

    path = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama_fsdp_cpu.dhx"
    program, _ = priced_program(path.read_text(), str(path))
    plan = schedule_plan(program, cost_of(program))
    assert plan.total <= plan.sequential and plan.speedup >= 1.0
    assert [(bool(p.forward), bool(p.backward)) for p in plan.pairs] == [(True, False), (False, True)]
    assert plan.total == sum(p.time for p in plan.pairs)
