"""Validation of lowered schedules: every stdlib pipeline passes; every mutation is caught."""

from __future__ import annotations

import textwrap
from collections import Counter

import pytest

from dhelix.dsl.core.errors import DhelixError, ErrorGroup, ScheduleError
from dhelix.dsl.core.schedule import Transfer, computes, format_grid, format_lowered, parse_lowered
from dhelix.dsl.passes.validate import dry_run, transfer_key, validate_lowered
from test_lower import FOLDS, lower_stdlib

# --- every stdlib pipeline, many sizes ----------------------------------------------------

CASES = [(name, FOLDS[name]) for name in sorted(FOLDS)] + [("interleaved_1f1b", ("loop", 3))]


def _sizes():
    for name, fold in CASES:
        for ranks in range(2 if fold[0] == "bidir" else 1, 9, 2 if fold[0] == "bidir" else 1):  # bidir: even p
            for microbatches in sorted({ranks, 2 * ranks, 3 * ranks + 1, 64}):
                yield pytest.param(name, fold, ranks, microbatches,
                                   id=f"{name}-{fold[0]}{fold[1] or ''}-p{ranks}-m{microbatches}")


def lower_or_skip(name, fold, ranks, microbatches):
    """Lower, or skip when the pipeline's own `require` rejects these sizes."""
    try:
        return lower_stdlib(name, ranks, microbatches, fold)
    except ScheduleError as error:
        if error.message.startswith(f"pipeline {name} needs"):
            pytest.skip(error.message)
        raise


def expected_counts(lowered) -> Counter:
    kinds = "FBW" if lowered.split else "FB"
    # (fold bidir: each model copy's stages run its half of the micro-batches)
    share = lowered.microbatches // lowered.copies
    per_copy = len(lowered.stages) // lowered.copies
    return Counter({(kind, stage, mb): 1 for kind in kinds for stage in range(len(lowered.stages))
                    for mb in range(stage // per_copy * share, (stage // per_copy + 1) * share)})


def actual_counts(lowered) -> Counter:
    return Counter((part.kind, lowered.stage_of(rank, part.chunk), part.microbatch)
                   for rank, row in enumerate(lowered.actions)
                   for action in row for part in computes(action))


@pytest.mark.parametrize("name,fold,ranks,microbatches", list(_sizes()))
def test_stdlib_pipeline_validates_with_the_right_counts(name, fold, ranks, microbatches):
    lowered = lower_or_skip(name, fold, ranks, microbatches)
    validate_lowered(lowered)
    assert actual_counts(lowered) == expected_counts(lowered)
    assert lowered.split == (name in ("zb_h1", "dualpipe_v", "interleaved_zb", "zbv", "zb_h2", "v_min", "v_half",
                                     "dualpipe"))
    sends = Counter(transfer_key(lowered, rank, action) for rank, row in enumerate(lowered.actions)
                    for action in row if isinstance(action, Transfer) and action.kind == "SEND")
    receives = Counter(transfer_key(lowered, rank, action)
                       for rank, row in enumerate(lowered.actions)
                       for action in row if isinstance(action, Transfer) and action.kind == "RECV")
    assert sends == receives and max(sends.values(), default=1) == 1


def test_dry_run_order_runs_every_action_after_its_send():
    lowered = lower_stdlib("w_helix", 3, 7)
    order = dry_run(lowered)
    assert sorted(order) == [(r, k) for r, row in enumerate(lowered.actions) for k in range(len(row))]
    seen = set()
    for rank, step in order:
        action = lowered.actions[rank][step]
        if isinstance(action, Transfer):
            key = transfer_key(lowered, rank, action)
            assert action.kind == "SEND" or key in seen
            seen.add(key)


# --- mutations of a small 1F1B schedule -------------------------------------------------

BASE = (
    "lowered one_f_one_b p=2 m=3 v=1\n"
    "stages: r0.0 r1.0\n"
    "r0: F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 F2.0 SEND_F2.0>1 RECV_B1.0<1 B1.0 "
    "RECV_B2.0<1 B2.0\n"
    "r1: RECV_F0.0<0 F0.0 B0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0 RECV_F2.0<0 F2.0 "
    "B2.0 SEND_B2.0>0\n")


def mutated(old: str, new: str, count: int = 1) -> str:
    assert BASE.count(old) >= count
    return BASE.replace(old, new, count)


def validation_message(text: str) -> str:
    with pytest.raises(DhelixError) as info:
        validate_lowered(parse_lowered(text, "m.txt"))
    return info.value.render()


def dedent(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def test_the_base_schedule_is_the_lowered_1f1b():
    assert BASE == format_lowered(lower_stdlib("one_f_one_b", 2, 3))
    validate_lowered(parse_lowered(BASE))


def test_moving_a_backward_before_its_forward():
    text = mutated("r1: RECV_F0.0<0 F0.0 B0.0", "r1: B0.0 RECV_F0.0<0 F0.0")
    assert validation_message(text) == dedent("""
        m.txt:4:5: rank 1, step 0: B0.0 (micro-batch 0, chunk 0) runs before F0.0 (step 2), which it depends on
          4 | r1: B0.0 RECV_F0.0<0 F0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0 RECV_F2.0<0 F2.0 B2.0 SEND_B2.0>0
            |     ^^^^
          note: move B0.0 after F0.0
            step 0      1             2      3             4
        r0        F0.0   SEND_F0.0>1   F1.0   SEND_F1.0>1   RECV_B0.0<1 …
        r1       >B0.0<  RECV_F0.0<0   F0.0   SEND_B0.0>0   RECV_F1.0<0 …
        """)


def test_moving_a_backward_across_a_cross_rank_dependency_deadlocks():
    # Rank 1 now holds B0.0 back until after F2.0, but rank 0 sends F2.0 only after B0.0.
    text = mutated("r1: RECV_F0.0<0 F0.0 B0.0 SEND_B0.0>0", "r1: RECV_F0.0<0 F0.0")
    text = text.replace("RECV_F2.0<0 F2.0", "RECV_F2.0<0 F2.0 B0.0 SEND_B0.0>0")
    assert validation_message(text) == dedent("""
        m.txt:3:39: deadlock: rank 0, step 4 waits in RECV_B0.0<1 (micro-batch 0, chunk 0) and never gets it
          3 | r0: F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 F2.0 SEND_F2.0>1 RECV_B1.0<1 B1.0 RECV_B2.0<1 B2.0
            |                                       ^^^^^^^^^^^
          note: rank 1 sends that in SEND_B0.0>0 at step 9, but first waits at step 6 in RECV_F2.0<0
          note: rank 0 sends that in SEND_F2.0>1 at step 7, but first waits at step 4 in RECV_B0.0<1
          note: so ranks 0 → 1 → 0 wait for each other in a cycle
          note: reorder so that each rank sends what its peer needs before it waits for what that peer sends later: e.g. move the producing action (and its SEND) earlier, or the consuming action (and its RECV) later
            step 0             1             2             3             4             5             6             7             8             9             10
        r0        F0.0          SEND_F0.0>1   F1.0          SEND_F1.0>1  >RECV_B0.0<1<  B0.0          F2.0          SEND_F2.0>1   RECV_B1.0<1   B1.0          RECV_B2.0<1 …
        r1        RECV_F0.0<0   F0.0          RECV_F1.0<0   F1.0          B1.0          SEND_B1.0>0  >RECV_F2.0<0<  F2.0          B0.0          SEND_B0.0>0   B2.0 …
        """)


def test_dropping_a_forward():
    text = mutated("r0: F0.0 SEND_F0.0>1 F1.0 ", "r0: F0.0 SEND_F0.0>1 ")
    assert validation_message(text) == dedent("""
        m.txt:1:1: micro-batch 1 never runs F on stage 0 (rank 0, chunk 0)
          1 | lowered one_f_one_b p=2 m=3 v=1
            | ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
          note: every micro-batch runs one F and one B on every stage
            step 0             1             2             3             4             5      6             7             8
        r0        F0.0          SEND_F0.0>1   SEND_F1.0>1   RECV_B0.0<1   B0.0          F2.0   SEND_F2.0>1   RECV_B1.0<1   B1.0 …
        r1        RECV_F0.0<0   F0.0          B0.0          SEND_B0.0>0   RECV_F1.0<0   F1.0   B1.0          SEND_B1.0>0   RECV_F2.0<0 …
        """)


def test_duplicating_a_backward():
    text = mutated("B2.0 SEND_B2.0>0", "B2.0 SEND_B2.0>0 B2.0")
    assert validation_message(text) == dedent("""
        m.txt:4:107: rank 1, step 12: B2.0 (micro-batch 2, chunk 0) runs again; it already ran at step 10
          4 | r1: RECV_F0.0<0 F0.0 B0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0 RECV_F2.0<0 F2.0 B2.0 SEND_B2.0>0 B2.0
            |                                                                                                           ^^^^
          note: every micro-batch runs each of F, B (and W) once per stage; remove one of them
            step 8             9      10            11            12
        r0  …     RECV_B1.0<1   B1.0   RECV_B2.0<1   B2.0
        r1  …     RECV_F2.0<0   F2.0   B2.0          SEND_B2.0>0  >B2.0<
        """)


def test_a_send_without_its_receive():
    text = mutated("RECV_F1.0<0 ", "")
    assert validation_message(text) == dedent("""
        m.txt:3:27: rank 0, step 3: SEND_F1.0>1 (micro-batch 1, chunk 0) has no matching RECV_F1.0<0 on rank 1
          3 | r0: F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 F2.0 SEND_F2.0>1 RECV_B1.0<1 B1.0 RECV_B2.0<1 B2.0
            |                           ^^^^^^^^^^^
          note: add RECV_F1.0<0 on rank 1 just before F1.0
            step 0             1             2      3             4             5      6             7
        r0        F0.0          SEND_F0.0>1   F1.0  >SEND_F1.0>1<  RECV_B0.0<1   B0.0   F2.0          SEND_F2.0>1 …
        r1        RECV_F0.0<0   F0.0          B0.0   SEND_B0.0>0   F1.0          B1.0   SEND_B1.0>0   RECV_F2.0<0 …
        m.txt:4:39: rank 1, step 4: F1.0 (micro-batch 1, chunk 0) has no input: stage 1 needs the activation of stage 0 from rank 0, and no RECV_F1.0<0 comes before it
          4 | r1: RECV_F0.0<0 F0.0 B0.0 SEND_B0.0>0 F1.0 B1.0 SEND_B1.0>0 RECV_F2.0<0 F2.0 B2.0 SEND_B2.0>0
            |                                       ^^^^
          note: put RECV_F1.0<0 just before F1.0, and SEND_F1.0>1 right after F1.0 on rank 0
            step 0             1             2      3             4             5      6             7             8
        r0        F0.0          SEND_F0.0>1   F1.0   SEND_F1.0>1   RECV_B0.0<1   B0.0   F2.0          SEND_F2.0>1   RECV_B1.0<1 …
        r1        RECV_F0.0<0   F0.0          B0.0   SEND_B0.0>0  >F1.0<         B1.0   SEND_B1.0>0   RECV_F2.0<0   F2.0 …
        2 errors
        """)


def _first_lines(text: str) -> list[str]:
    """The message lines of a rendered error (no excerpts, notes or grids)."""
    return [line for line in validation_message(text).splitlines()
            if line.startswith(("m.txt:", "error:"))]


def test_a_receive_without_its_send():
    assert _first_lines(mutated("SEND_F1.0>1 ", "")) == [
        "m.txt:4:39: rank 1, step 4: RECV_F1.0<0 (micro-batch 1, chunk 0) has no matching "
        "SEND_F1.0>1 on rank 0"]


def test_a_send_before_what_it_sends():
    assert _first_lines(mutated("F1.0 SEND_F1.0>1", "SEND_F1.0>1 F1.0")) == [
        "m.txt:3:22: rank 0, step 2: SEND_F1.0>1 comes before F1.0 (step 3), which produces "
        "what it sends"]


def test_transfers_to_the_wrong_rank_or_past_the_ends():
    text = ("lowered x p=3 m=1 v=1\nstages: r0.0 r1.0 r2.0\n"
            "r0: F0.0 SEND_F0.0>2 RECV_B0.0<1 B0.0\n"
            "r1: RECV_F0.0<0 F0.0 SEND_F0.0>2 RECV_B0.0<2 B0.0 SEND_B0.0>0\n"
            "r2: RECV_F0.0<1 F0.0 SEND_F0.0>0 B0.0 SEND_B0.0>1\n")
    assert _first_lines(text) == [
        "m.txt:3:10: rank 0, step 1: SEND_F0.0>2 names rank 2, but stage 1 (micro-batch 0's next "
        "stage) is on rank 1",
        # rank 0's misaddressed SEND does not count, so rank 1's RECV has nothing to match
        "m.txt:4:5: rank 1, step 0: RECV_F0.0<0 (micro-batch 0, chunk 0) has no matching "
        "SEND_F0.0>1 on rank 0",
        "m.txt:5:22: rank 2, step 2: SEND_F0.0>0 has no peer stage: stage 2 is the last stage"]


def test_out_of_range_actions():
    text = ("lowered x p=1 m=1 v=1\nstages: r0.0\nr0: F0.0 F1.0 F0.1 B0.0\n")
    assert _first_lines(text) == [
        "m.txt:3:10: rank 0, step 1: F1.0 runs micro-batch 1, but m = 1 (only micro-batch 0)",
        "m.txt:3:15: rank 0, step 2: F0.1 uses chunk 1, but v = 1 (only chunk 0)"]


def test_split_schedules_need_every_w():
    text = mutated("r0: F0.0", "r0: F0.0 W0.0")
    assert _first_lines(text) == [
        "m.txt:1:1: micro-batches 1..2 never run W on stage 0 (rank 0, chunk 0)",
        "m.txt:1:1: micro-batches 0..2 never run W on stage 1 (rank 1, chunk 0)",
        "m.txt:3:10: rank 0, step 1: W0.0 (micro-batch 0, chunk 0) runs before B0.0 (step 6), "
        "which it depends on"]


def test_an_si_block_cannot_hold_a_forward_and_its_own_backward():
    text = mutated("r1: RECV_F0.0<0 F0.0 B0.0", "r1: RECV_F0.0<0 SI(F0.0,B0.0)")
    assert _first_lines(text) == [
        "m.txt:4:17: rank 1, step 1: B0.0 runs in the same SI block as F0.0, which it depends on"]


def test_many_errors_are_capped():
    text = "lowered x p=1 m=30 v=1\nstages: r0.0\nr0: " + " ".join(
        f"B{mb}.0 F{mb}.0" for mb in range(30)) + "\n"
    with pytest.raises(ErrorGroup) as info:
        validate_lowered(parse_lowered(text, "m.txt"))
    assert len(info.value.errors) == 20
    assert info.value.errors[-1].notes[-1] == "10 more schedule errors are not shown; fix these first"
    assert all(error.span is not None for error in info.value.errors)


# --- the grid -----------------------------------------------------------------------------

def test_grid_marks_steps_and_elides_the_rest():
    lowered = parse_lowered(BASE)
    assert format_grid(lowered, {0: 6, 1: 7}, context=1) == dedent("""
            step 5      6      7             8
        r0  …     B0.0  >F2.0<  SEND_F2.0>1   RECV_B1.0<1 …
        r1  …     F1.0   B1.0  >SEND_B1.0>0<  RECV_F2.0<0 …
        """)
