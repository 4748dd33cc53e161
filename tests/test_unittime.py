"""Unit-time dry run: make-span, bubble ratio and in-flight activations of every stdlib pipeline.

Costs: F = 1, B = 2 (B = W = 1 when split), an SI block the sum of its pair, transfers 0.
Bubble ratio = idle / (p × make-span). Each formula below is the one stated in the
pipeline's comment in stdlib_schedules/pipelines.dhx; the tests hold them to it exactly.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from dhelix.dsl.core.errors import ScheduleError
from dhelix.dsl.core.schedule import Compute, Interleaved, Transfer, parse_lowered
from dhelix.dsl.passes.unittime import action_cost, peak_in_flight, unit_time
from test_lower import lower_stdlib


def test_one_f_one_b_has_the_textbook_bubble_exactly():
    for p in range(1, 9):
        for m in range(1, 25):
            timing = unit_time(lower_stdlib("one_f_one_b", p, m))
            assert timing.makespan == 3 * (m + p - 1)
            assert timing.busy == 3 * m * p
            assert timing.bubble_ratio == Fraction(p - 1, m + p - 1)


#: name → (fold or None, sizes it admits, make-span, bubble ratio, in-flight on rank r).
FORMULAS = {
    "gpipe": (None, lambda p, m: True, lambda p, m: 3 * (m + p - 1),
              lambda p, m: Fraction(p - 1, m + p - 1), lambda p, m, r: m),
    "one_f_one_b": (None, lambda p, m: True, lambda p, m: 3 * (m + p - 1),
                    lambda p, m: Fraction(p - 1, m + p - 1), lambda p, m, r: min(p - r, m)),
    "interleaved_1f1b": (("loop", 2), lambda p, m: m % p == 0, lambda p, m: 3 * (2 * m + p - 1),
                         lambda p, m: Fraction(p - 1, 2 * m + p - 1),
                         lambda p, m, r: min((p - r - 1) * 2 + p + 1, 2 * m)),
    "interleaved_1f1b v=3": (("loop", 3), lambda p, m: m % p == 0,
                             lambda p, m: 3 * (3 * m + p - 1),
                             lambda p, m: Fraction(p - 1, 3 * m + p - 1),
                             lambda p, m, r: min((p - r - 1) * 2 + 2 * p + 1, 3 * m)),
    "zb_h1": (None, lambda p, m: True, lambda p, m: 3 * m + p - 1,
              lambda p, m: Fraction(p - 1, 3 * m + p - 1), lambda p, m, r: min(p - r, m)),
    "dualpipe_v": (None, lambda p, m: m >= 2 * p, lambda p, m: 6 * m + p - 1,
                   lambda p, m: Fraction(p - 1, 6 * m + p - 1),
                   lambda p, m, r: 2 * p + (r == p - 1)),
    # With g = p (the default), each group of p micro-batches fills and drains the 2p stages.
    "gpipe_u": (None, lambda p, m: m % p == 0, lambda p, m: 6 * m * (2 * p - 1) // p,
                lambda p, m: Fraction(p - 1, 2 * p - 1), lambda p, m, r: 2 * m),
    "w_helix": (None, lambda p, m: m > p, lambda p, m: 6 * (m + p - 1),
                lambda p, m: Fraction(p - 1, m + p - 1), lambda p, m, r: min(2 * p, m + r + 1)),
    # LoopedBFS: GPipe over the chunks, breadth first; each chunk's forwards keep rank 0 busy
    # until the first micro-batch comes back round once m >= p.
    "looped_bfs": (("loop", 2), lambda p, m: m >= p, lambda p, m: 3 * (2 * m + p - 1),
                   lambda p, m: Fraction(p - 1, 2 * m + p - 1), lambda p, m, r: 2 * m),
    "looped_bfs v=3": (("loop", 3), lambda p, m: m >= p, lambda p, m: 3 * (3 * m + p - 1),
                       lambda p, m: Fraction(p - 1, 3 * m + p - 1), lambda p, m, r: 3 * m),
    "interleaved_zb": (("loop", 2), lambda p, m: m % p == 0, lambda p, m: 3 * 2 * m + p - 1,
                       lambda p, m: Fraction(p - 1, 3 * 2 * m + p - 1),
                       lambda p, m, r: min(p - r + p, 2 * m)),
    "interleaved_zb v=3": (("loop", 3), lambda p, m: m % p == 0, lambda p, m: 3 * 3 * m + p - 1,
                           lambda p, m: Fraction(p - 1, 3 * 3 * m + p - 1),
                           lambda p, m, r: min(p - r + 2 * p, 3 * m)),
    "zbv": (None, lambda p, m: m >= 2 * p - 1, lambda p, m: 6 * m + p - 1,
            lambda p, m: Fraction(p - 1, 6 * m + p - 1), lambda p, m, r: min(2 * p, m + r + 1)),
    # Megatron-Core's combined 1F1B: 1F1B's make-span, 2(p - r) - 1 warm-up forwards held
    # between actions (one more inside an SI block: tests/test_one_f_one_b_overlap.py).
    "one_f_one_b_overlap": (None, lambda p, m: True, lambda p, m: 3 * (m + p - 1),
                            lambda p, m: Fraction(p - 1, m + p - 1),
                            lambda p, m, r: min(2 * (p - r) - 1, m)),
    "w_helix m=p": (None, lambda p, m: m == p, lambda p, m: 10 * p - 4,
                    lambda p, m: Fraction(2 * p - 2, 5 * p - 2),
                    lambda p, m, r: min(2 * p, m + r + 1)),
}


@pytest.mark.parametrize("case", sorted(FORMULAS))
def test_stdlib_unit_time_matches_the_stated_formulas(case):
    fold, admits, makespan, bubble, in_flight = FORMULAS[case]
    name = case.split()[0]
    checked = 0
    for p in range(1, 9):
        for m in sorted({p, p + 1, 2 * p, 2 * p + 1, 3 * p + 1, 4 * p, 40}):
            if not admits(p, m):
                continue
            lowered = lower_stdlib(name, p, m, fold)
            timing = unit_time(lowered)
            assert (timing.makespan, timing.bubble_ratio) == (makespan(p, m), bubble(p, m)), (p, m)
            assert peak_in_flight(lowered) == tuple(in_flight(p, m, r) for r in range(p)), (p, m)
            checked += 1
    assert checked >= 8


def test_w_helix_against_one_f_one_b():
    """At equal p and m (m > p), w_helix's make-span divided by v = 2 equals 1F1B's, and so does
    its bubble ratio (p−1)/(m+p−1): unit time gives an SI block no speed-up, so folding
    alone neither adds nor removes bubble — as the paper says (§4.1), DHelix wins by making
    each SI block shorter than its pair. With m = p (one strand, no SI block) w_helix is
    shorter: its half-size chunks fill and drain the pipeline faster."""
    for p in range(2, 9):
        for m in (p + 1, 2 * p, 3 * p + 1, 64):
            helix, baseline = unit_time(lower_stdlib("w_helix", p, m)), \
                unit_time(lower_stdlib("one_f_one_b", p, m))
            assert helix.normalized_makespan == baseline.makespan
            assert helix.bubble_ratio == baseline.bubble_ratio
        helix, baseline = unit_time(lower_stdlib("w_helix", p, p)), \
            unit_time(lower_stdlib("one_f_one_b", p, p))
        assert helix.normalized_makespan < baseline.makespan
        assert helix.bubble_ratio < baseline.bubble_ratio


def test_w_helix_steady_phase_is_all_si_blocks():
    lowered = lower_stdlib("w_helix", 4, 12)  # the paper's Fig. 8: 4 GPUs, 12 micro-batches
    for row in lowered.actions:
        blocks = [a for a in row if isinstance(a, Interleaved)]
        # micro-batches 4..11 (strand β, then α again) each run both forwards inside SI blocks
        assert len(blocks) == 2 * (12 - 4)
        assert all(a.fwd.microbatch == a.bwd.microbatch + 4 for a in blocks)


def test_costs():
    fwd, bwd = Compute("F", 0, 0), Compute("B", 1, 0)
    assert [action_cost(a, False) for a in (fwd, bwd, Compute("W", 0, 0))] == [1, 2, 1]
    assert action_cost(bwd, True) == 1
    assert action_cost(Interleaved(fwd, bwd), False) == 3
    assert action_cost(Interleaved(fwd, bwd), True) == 2
    assert action_cost(Transfer("SEND", "F", 0, 0, 1), False) == 0


def test_a_receive_waits_for_its_send():
    lowered = parse_lowered("lowered x p=2 m=1 v=1\nstages: r0.0 r1.0\n"
                            "r0: F0.0 SEND_F0.0>1 RECV_B0.0<1 B0.0\n"
                            "r1: RECV_F0.0<0 F0.0 B0.0 SEND_B0.0>0\n")
    timing = unit_time(lowered)
    assert timing.starts == ((0, 1, 4, 4), (1, 1, 2, 4))
    assert timing.ends == ((1, 1, 4, 6), (1, 2, 4, 4))
    assert (timing.makespan, timing.busy, timing.bubble_ratio) == (6, 6, Fraction(1, 2))


def test_unit_time_refuses_a_deadlock():
    lowered = parse_lowered("lowered x p=2 m=1 v=1\nstages: r0.0 r1.0\n"
                            "r0: RECV_B0.0<1 F0.0 SEND_F0.0>1 B0.0\n"
                            "r1: RECV_F0.0<0 F0.0 B0.0 SEND_B0.0>0\n")
    with pytest.raises(ScheduleError, match="deadlock"):
        unit_time(lowered)
