"""Lowering pipelines to per-rank action lists, and the text form of the lowered schedule.

Golden files: tests/golden/lower/<pipeline>_p<p>_m<m>.txt hold the text form of each stdlib
pipeline at a few sizes; `DHELIX_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_lower.py` (or
`pytest --update-golden`) rewrites them.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dhelix.dsl.core.errors import DhelixError, ParseError, ScheduleError
from dhelix.dsl.passes.fold import placement_for
from dhelix.dsl.passes.lower import lower_pipeline
from dhelix.dsl.frontend.parser import parse
from dhelix.dsl.frontend.stdlib import fold_of, stdlib_pipelines
from dhelix.dsl.core.schedule import (Compute, Interleaved, Lowered, Transfer, format_lowered,
                                 parse_lowered)

ROOT = Path(__file__).resolve().parent.parent

#: The fold each stdlib pipeline is written for, from its `for` clause.
FOLDS = {name: fold_of(pipeline) for name, pipeline in stdlib_pipelines().items()}


def lower_stdlib(name: str, ranks: int, microbatches: int, fold=None) -> Lowered:
    """Lower stdlib pipeline ``name`` with its fold (or ``fold`` = (kind, arg))."""
    kind, arg = fold or FOLDS[name]
    placement = placement_for(kind, arg, 12 * ranks, ranks)  # 12 layers split 1, 2, 3, 4 ways
    return lower_pipeline(stdlib_pipelines()[name], ranks=ranks, microbatches=microbatches,
                          placement=placement)


def lower_text(text: str, ranks: int, microbatches: int, fold=("none", None)) -> Lowered:
    pipeline = parse(textwrap.dedent(text).lstrip(), "test.dhx", start="pipeline_def")
    kind, arg = fold
    return lower_pipeline(pipeline, ranks=ranks, microbatches=microbatches,
                          placement=placement_for(kind, arg, 12 * ranks, ranks))


def error_text(call) -> str:
    with pytest.raises(DhelixError) as info:
        call()
    return info.value.render()


def test_stdlib_defines_the_six_pipelines():
    assert sorted(stdlib_pipelines()) == sorted(FOLDS)


# --- golden action lists ------------------------------------------------------------------

GOLDEN_SIZES = [(name, p, m) for name in FOLDS for p, m in ((2, 4), (4, 8))]


@pytest.mark.parametrize("name,ranks,microbatches", GOLDEN_SIZES)
def test_lowered_stdlib_matches_golden(name, ranks, microbatches, golden):
    text = format_lowered(lower_stdlib(name, ranks, microbatches))
    golden(f"lower/{name}_p{ranks}_m{microbatches}.txt", text)


def test_one_f_one_b_reads_like_the_textbook():
    assert format_lowered(lower_stdlib("one_f_one_b", 2, 2)) == (
        "lowered one_f_one_b p=2 m=2 v=1\n"
        "stages: r0.0 r1.0\n"
        "r0: F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0\n"
        "r1: RECV_F0.0<0 F0.0 B0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0\n")


# --- transfers ----------------------------------------------------------------------------

def test_fold_u_turn_stays_on_the_last_rank():
    lowered = lower_stdlib("w_helix", 2, 2)
    last = [str(a) for a in lowered.actions[1]]
    # F0.0 feeds F0.1 on rank 1 itself: no transfer between them; the chunk-1 output goes up.
    assert last[:4] == ["RECV_F0.0<0", "F0.0", "F0.1", "SEND_F0.1>0"]
    assert not any(isinstance(a, Transfer) and a.peer == 1 for a in lowered.actions[1])


def test_fold_loop_wraps_from_the_last_rank_to_the_first():
    lowered = lower_stdlib("interleaved_1f1b", 2, 2)
    assert "SEND_F0.0>0" in map(str, lowered.actions[1])  # stage 1 (r1.0) → stage 2 (r0.1)
    assert "RECV_F0.1<1" in map(str, lowered.actions[0])


def test_si_block_receives_before_and_sends_after():
    lowered = lower_stdlib("w_helix", 2, 4)
    row = [str(a) for a in lowered.actions[0]]
    at = row.index("SI(F2.1,B0.0)")
    assert row[at - 2:at + 1] == ["RECV_F2.1<1", "RECV_B0.0<1", "SI(F2.1,B0.0)"]
    assert row[row.index("SI(F3.0,B1.1)") + 1:][:2] == ["SEND_F3.0>1", "SEND_B1.1>1"]


def test_single_rank_has_no_transfers():
    for name in FOLDS:
        if FOLDS[name][0] == "bidir":
            continue  # two model copies need pipeline ranks to pair up: pp is even
        lowered = lower_stdlib(name, 1, 4)
        assert not any(isinstance(a, Transfer) for row in lowered.actions for a in row), name


# --- the text form ------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FOLDS))
def test_text_form_parses_back_exactly(name):
    for ranks, microbatches in ((1, 2), (3, 6), (4, 9)):
        if name in ("interleaved_1f1b", "interleaved_zb") and microbatches % ranks:
            continue
        if FOLDS[name][0] == "bidir":  # (even p and m, m >= 2p)
            ranks, microbatches = 2 * ranks, 4 * ranks
        lowered = lower_stdlib(name, ranks, microbatches)
        assert parse_lowered(format_lowered(lowered)) == lowered


def _computes(kinds="FBW"):
    return st.builds(Compute, st.sampled_from(kinds), st.integers(0, 30), st.integers(0, 4))


_actions = st.one_of(
    _computes(),
    st.builds(Interleaved, _computes("F"), _computes("B")),
    st.builds(Transfer, st.sampled_from(["SEND", "RECV"]), st.sampled_from("FB"),
              st.integers(0, 30), st.integers(0, 4), st.integers(0, 9)),
)


@st.composite
def lowered_schedules(draw):
    ranks, chunks = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    slots = draw(st.permutations([(g, c) for g in range(ranks) for c in range(chunks)]))
    rows = draw(st.lists(st.lists(_actions, max_size=8).map(tuple),
                         min_size=ranks, max_size=ranks).map(tuple))
    name = draw(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True))
    # Two model copies (fold bidir) where they divide the stages; the micro-batches then even.
    copies = draw(st.sampled_from([1, 2] if ranks * chunks % 2 == 0 else [1]))
    microbatches = draw(st.integers(1, 20)) * copies
    return Lowered(name, ranks, microbatches, chunks, tuple(slots), rows, copies=copies)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(lowered_schedules())
def test_any_lowered_schedule_round_trips(lowered):
    assert parse_lowered(format_lowered(lowered)) == lowered


def test_text_form_allows_comments_and_blank_lines():
    text = ("# a comment\nlowered x p=1 m=1 v=1   # sizes\n\nstages: r0.0  # r0.1\n"
            "r0: F0.0 B0.0  # the whole schedule\n")
    assert parse_lowered(text) == Lowered("x", 1, 1, 1, ((0, 0),),
                                          ((Compute("F", 0, 0), Compute("B", 0, 0)),))


BAD_TEXT = [
    ("lowered x p=2 m=1\n", "t:1:1: malformed header\n"
     "  1 | lowered x p=2 m=1\n    | ^^^^^^^^^^^^^^^^^\n"
     "  note: a schedule starts with `lowered NAME p=4 m=8 v=1`"),
    ("lowered x p=1 m=1 v=1\nr0: F0.0\n", "t:2:1: expected the stage line after the header\n"
     "  2 | r0: F0.0\n    | ^^^^^^^^\n"
     "  note: write `stages: r0.0 r1.0 …`, the (rank, chunk) of each stage in model order"),
    ("lowered x p=2 m=1 v=1\nstages: r0.0 r0.0\n", "t:2:14: stage slot r0.0 is out of "
     "range or repeated\n  2 | stages: r0.0 r0.0\n    |              ^^^^\n"
     "  note: list each of the 2 slots r0.0 … r1.0 once"),
    ("lowered x p=2 m=1 v=1\nstages: r0.0 r1.0\nr1: F0.0\n", "t:3:1: expected the line of "
     "rank 0\n  3 | r1: F0.0\n    | ^^^^^^^^\n"
     "  note: write `r0: …`; rank lines come in order r0 … r1"),
    ("lowered x p=2 m=1 v=1\nstages: r0.0 r1.0\nr0: F0.0\n", "t:3:1: missing the line of "
     "rank 1 (p = 2)\n  3 | r0: F0.0\n    | ^^^^^^^^\n  note: add `r1: …`"),
    ("lowered x p=1 m=1 v=1\nstages: r0.0\nr0: F0.0 X1\n", "t:3:10: unknown action 'X1'\n"
     "  3 | r0: F0.0 X1\n    |          ^^\n  note: actions are F3.0, B3.0, W3.0, "
     "SI(F4.0,B1.1), SEND_F3.0>1, RECV_B3.0<2"),
    ("lowered x p=1 m=1 v=1\nstages: r0.0\nr0: SI(B0.0,F0.0)\n", "t:3:5: malformed SI "
     "block 'SI(B0.0,F0.0)'\n  3 | r0: SI(B0.0,F0.0)\n    |     ^^^^^^^^^^^^^\n"
     "  note: an SI block pairs a forward with a backward: SI(F4.0,B1.1)"),
    ("lowered x p=2 m=1 v=1\nstages: r0.0 r1.0\nr0: SEND_F0.0<1\nr1:\n", "t:3:5: malformed "
     "transfer 'SEND_F0.0<1'\n  3 | r0: SEND_F0.0<1\n    |     ^^^^^^^^^^^\n"
     "  note: a SEND points to its peer with '>', a RECV with '<': SEND_F3.0>1, RECV_F3.0<0"),
]


@pytest.mark.parametrize("text,message", BAD_TEXT)
def test_bad_text_is_a_located_parse_error(text, message):
    with pytest.raises(ParseError) as info:
        parse_lowered(text, "t")
    assert info.value.render() == message


# --- lowering errors ----------------------------------------------------------------------

def test_chunk_out_of_range_names_the_rank():
    text = """
        pipeline x {
          F[r]
        }
    """
    assert error_text(lambda: lower_text(text, 2, 1)) == (
        "test.dhx:2:3: chunk 1 of F[r] is out of range on rank 1: v = 1, so the only chunk is 0\n"
        "  2 |   F[r]\n    |   ^^^^\n"
        "  note: fold none gives v = 1 chunk per rank, fold u and fold bidir 2, fold loop(v) v")


def test_negative_repeat_names_the_rank_and_the_values():
    text = """
        pipeline x {
          warm = p - r - 2
          repeat warm { F }
        }
    """
    assert error_text(lambda: lower_text(text, 4, 4)) == (
        "test.dhx:3:10: repeat count warm is -1 on rank 3 (warm = -1, p = 4, r = 3)\n"
        "  3 |   repeat warm { F }\n    |          ^^^^\n"
        "  note: a repeat runs its body N ≥ 0 times; clamp it with max(0, warm) if nothing "
        "should run here")


def test_failed_require_states_the_need_and_the_values():
    assert error_text(lambda: lower_stdlib("dualpipe_v", 4, 3)) == (
        "stdlib/pipelines.dhx:98:3: pipeline dualpipe_v needs m >= 2 * p (m = 3, p = 4)\n"
        "  98 |   require m >= 2 * p\n     |   ^^^^^^^^^^^^^^^^^^\n"
        "  note: choose sizes with m >= 2 * p, or another pipeline")


def test_require_failing_on_some_ranks_names_them():
    text = """
        pipeline x {
          require r < 2
        }
    """
    lines = error_text(lambda: lower_text(text, 4, 1)).splitlines()
    # The values differ between the ranks, so each failing rank has its own error.
    assert [line for line in lines if line.startswith("test.dhx")] == [
        "test.dhx:2:3: pipeline x needs r < 2 on rank 2 (r = 2)",
        "test.dhx:2:3: pipeline x needs r < 2 on rank 3 (r = 3)"]


def test_equal_failures_are_merged_across_ranks():
    text = """
        pipeline x {
          F[min(r, 1) * 2]
        }
    """
    assert error_text(lambda: lower_text(text, 4, 1)).splitlines()[0] == (
        "test.dhx:2:3: chunk 2 of F[min(r, 1) * 2] is out of range on ranks 1, 2 and 3: "
        "v = 1, so the only chunk is 0")


def test_rank_independent_mistakes_are_reported_once():
    text = """
        pipeline x {
          p = 3
          SI(B, F)
        }
    """
    assert error_text(lambda: lower_text(text, 4, 4)) == (
        "test.dhx:2:3: 'p' is a builtin (pipeline ranks) and cannot be rebound\n"
        "  2 |   p = 3\n    |   ^\n"
        "  note: pick another name; the builtins are p, r, m, v, g and gb\n"
        "test.dhx:3:3: an SI block pairs a forward with a backward, not B with F\n"
        "  3 |   SI(B, F)\n    |   ^^^^^^^^\n"
        "  note: write SI(F[c], B[c']): the forward of one strand beside the backward of the "
        "other\n2 errors")


def test_unknown_name_is_reported_once_without_ranks():
    text = """
        pipeline x {
          repeat warm { F }
        }
    """
    assert error_text(lambda: lower_text(text, 4, 4)) == (
        "test.dhx:2:10: unknown schedule variable 'warm'\n"
        "  2 |   repeat warm { F }\n    |          ^^^^\n  note: known here: g, gb, m, p, r, v")


def test_runaway_programs_stop_with_an_error():
    many = """
        pipeline x {
          repeat m * 100 { F }
        }
    """
    assert error_text(lambda: lower_text(many, 1, 4)).splitlines()[0] == (
        "test.dhx:2:20: pipeline x runs more than 12 F/B/W actions (3·v·m with v = 1, m = 4)")
    spin = """
        pipeline x {
          k = 0
          repeat 1000000000 { k = k + 1 }
        }
    """
    assert error_text(lambda: lower_text(spin, 1, 4)).splitlines()[0] == (
        "test.dhx:3:3: pipeline x runs too long")


def test_lets_rebind_so_a_counter_counts():
    text = """
        pipeline x {
          k = 0
          repeat m {
            F[k % v]
            k = k + 1
          }
        }
    """
    lowered = lower_text(text, 1, 4, fold=("loop", 2))
    assert [str(a) for a in lowered.actions[0]] == ["F0.0", "F0.1", "F1.0", "F1.1"]


def test_a_named_micro_batch_runs_that_one_and_leaves_the_counter():
    text = """
        pipeline x {
          repeat m { F }
          B[0, m - 1]
          B
          B[0, 2]
          B
        }
    """
    lowered = lower_text(text, 1, 4)
    assert [str(a) for a in lowered.actions[0]][4:] == ["B3.0", "B0.0", "B2.0", "B1.0"]
    assert error_text(lambda: lower_text(text.replace("m - 1", "m"), 1, 4)).splitlines()[0] == (
        "test.dhx:3:8: micro-batch 4 of B[0, m] is out of range: m = 4, so micro-batches are 0..3 (m = 4)")


def test_counts_are_per_kind_and_chunk():
    lowered = lower_stdlib("dualpipe_v", 3, 6)
    for row in lowered.actions:
        counts = Counter((c.kind, c.chunk) for a in row
                         for c in (a.parts if isinstance(a, Interleaved) else (a,))
                         if isinstance(c, Compute))
        assert counts == {(kind, chunk): 6 for kind in "FBW" for chunk in (0, 1)}


def test_lowering_errors_are_schedule_errors():
    with pytest.raises(ScheduleError):
        lower_stdlib("w_helix", 4, 3)


# --- the same orders as torch.distributed.pipelining: tests/test_torch_orders.py ------------


@pytest.mark.parametrize(("launch", "backward"), [(1, 1), (3, 2), (8, 8)])
def test_gpipe_u_runs_each_chunk_g_micro_batches_in_a_row(launch, backward):
    # Forwards: chunk 0 then chunk 1, g micro-batches at a time (the last m % g as a smaller
    # group); backwards chunk 1 then chunk 0, gb at a time. Valid (validate ran) on 2 ranks.
    from dhelix.dsl.passes.pipeline import check_text

    text = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text()
    text = text.replace("microbatches = 8", f"microbatches = 8  launch = {launch}  launch_backward = {backward}") \
        .replace("pipeline w_helix", "pipeline gpipe_u")
    lowered = check_text(text, str(ROOT / "examples" / "t.dhx")).lowered
    for rank in range(2):
        order = [(a.kind, a.chunk) for a in lowered.actions[rank] if getattr(a, "kind", None) in ("F", "B")]
        expected = []
        for kind, size, chunks in (("F", launch, (0, 1)), ("B", backward, (1, 0))):
            for start in range(0, 8, size):
                expected += [(kind, c) for c in chunks for _ in range(min(size, 8 - start))]
        assert order == expected


def test_interleaved_1f1b_runs_each_chunk_g_micro_batches_in_a_row():
    # launch = 4 on p = 2: rank 0 runs 4 forwards of chunk 0, then of chunk 1, as Megatron's
    # microbatch_group_size_per_vp_stage = 4; the warm-up grows by (v - 1)·(g - p).
    from dhelix.dsl.passes.pipeline import check_text

    text = (ROOT / "examples" / "tiny_llama_zero1_overlap_cpu.dhx").read_text()
    text = text.replace("layers = 4", "layers = 8").replace("microbatches = 4", "microbatches = 8  launch = 4") \
        .replace("fold u", "fold loop(2)").replace("pipeline w_helix", "pipeline interleaved_1f1b")
    lowered = check_text(text, str(ROOT / "examples" / "t.dhx")).lowered
    forwards = [str(a) for a in lowered.actions[0] if getattr(a, "kind", None) == "F"]
    assert forwards[:8] == ["F0.0", "F1.0", "F2.0", "F3.0", "F0.1", "F1.1", "F2.1", "F3.1"]
    default = check_text(text.replace("  launch = 4", ""), str(ROOT / "examples" / "t.dhx")).lowered
    assert [str(a) for a in default.actions[0] if getattr(a, "kind", None) == "F"][:4] == ["F0.0", "F1.0", "F0.1", "F1.1"]
    for bad, need in (("launch = 3", "m % g == 0"), ("launch = 1", "g >= p")):
        with pytest.raises(DhelixError) as info:
            check_text(text.replace("launch = 4", bad), str(ROOT / "examples" / "t.dhx"))
        assert f"needs {need}" in str(info.value)


@pytest.mark.parametrize("text", [
    "p - r - 1", "min((p - r - 1) * 2 + (v - 1) * max(g, gb), v * m)", "f // g % v", "v - 1 - b // gb % v",
    "-(m - 3 * p)", "m / p", "f / g", "m // 0", "m % (p - p)", "n + 1", "mux(m, p)",
    "1000000000000000 * 1000000000000000 * m", "(" * 40 + "m" + ")" * 40 + " + 1"])
def test_evaluator_equals_evaluate(text):
    # Lowering evaluates its statements through compiled closures (exprs.evaluator): the same
    # values as evaluate, and where evaluate raises, the same error.
    from dhelix.dsl.frontend.exprs import evaluate, evaluator

    expr = parse(text, start="expr")
    compiled = evaluator(expr, "schedule variable")
    for env in ({"p": 4, "r": 1, "m": 12, "v": 2, "g": 4, "gb": 4, "f": 7, "b": 5},
                {"p": 3, "r": 2, "m": 6, "v": 3, "g": 3, "gb": 6, "f": 0, "b": 11}):
        try:
            expected = evaluate(expr, env, "schedule variable")
        except DhelixError as error:
            with pytest.raises(type(error)) as raised:
                compiled(env)
            assert raised.value.render() == error.render()
        else:
            assert compiled(env) == expected
