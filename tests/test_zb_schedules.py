"""The zero-bubble family's schedules torch does not ship — zb_h2, v_min, v_half — held to
what their comments in stdlib_schedules/pipelines.dhx say: unit-time make-span, bubble and
in-flight activations, against 1F1B and ZB-H1; simulated, drawn and searched by `dhelix tune`
as every stdlib pipeline; and run on gloo ranks with `dhelix run --check` (each exact against
the single-process reference)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from commands import dhelix_here
from dhelix.cli import main
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.passes.unittime import Costs, peak_in_flight, timed_run, unit_time
from dhelix.dsl.search.space import space_of
from dhelix.dsl.simulator.events import simulate
from test_lower import lower_stdlib
from test_simulate import tiny_program, unit_costs

#: Sizes the unit-time checks run at: p = 1..8, m from p to 5p (the V schedules need m >= p).
SIZES = [(p, m) for p in range(1, 9) for m in sorted({p, p + 1, 2 * p, 2 * p + 1, 3 * p + 1, 5 * p})]


def test_zb_h2_reaches_the_least_make_span_and_holds_2p_minus_1_on_the_first_rank():
    for p, m in SIZES:
        lowered = lower_stdlib("zb_h2", p, m)
        timing = unit_time(lowered)
        assert timing.makespan == 3 * m + p - 1, (p, m)  # F on p ranks, then 3m on the last
        assert timing.bubble_ratio == Fraction(p - 1, 3 * m + p - 1)
        assert peak_in_flight(lowered) == tuple(min(2 * (p - r) - 1, m) for r in range(p)), (p, m)


def test_zb_h2_hides_a_transfer_that_zb_h1_waits_for():
    # Unit time prices them alike; a transfer of half a forward tells them apart, as its comment says.
    half = Costs(transfer=Fraction(1, 2))
    h1, h2 = (timed_run(lower_stdlib(name, 4, 8), half) for name in ("zb_h1", "zb_h2"))
    assert (h2.makespan, h1.makespan) == (30, 33)
    for p, m in SIZES:
        if p > 1 and m >= 2 * p:
            assert timed_run(lower_stdlib("zb_h2", p, m), half).makespan < \
                timed_run(lower_stdlib("zb_h1", p, m), half).makespan, (p, m)


#: name → (make-span / v and in flight at p = 4, m = 8, as the comments say; bound of the
#: in-flight whole-rank micro-batches in p).
V_SCHEDULES = {"v_min": (Fraction(59, 2), (4, 4, 3, 4), lambda p: Fraction(p, 3) + 1),
               "v_half": (30, (6, 6, 6, 6), lambda p: Fraction(p, 2) + 1)}


@pytest.mark.parametrize("name", sorted(V_SCHEDULES))
def test_v_schedules_save_memory_and_beat_one_f_one_b(name):
    span, in_flight, bound = V_SCHEDULES[name]
    lowered = lower_stdlib(name, 4, 8)
    assert (unit_time(lowered).normalized_makespan, peak_in_flight(lowered)) == (span, in_flight)
    for p, m in SIZES:
        lowered = lower_stdlib(name, p, m)
        timing = unit_time(lowered)
        # Whole-rank micro-batches held: divide the chunk activations by v = 2.
        assert max(peak_in_flight(lowered)) <= 2 * bound(p), (p, m)
        assert max(peak_in_flight(lower_stdlib("one_f_one_b", p, m))) == min(p, m)
        if p > 1 and m >= 2 * p:
            assert timing.normalized_makespan < 3 * (m + p - 1), (p, m)  # 1F1B's


def test_v_min_holds_a_third_and_v_half_half_of_one_f_one_b():
    p, m = 8, 32
    whole = {name: Fraction(max(peak_in_flight(lower_stdlib(name, p, m))), 2) for name in V_SCHEDULES}
    assert whole == {"v_min": 3, "v_half": 5}  # 1F1B: 8
    assert unit_time(lower_stdlib("v_min", p, m)).normalized_makespan == Fraction(219, 2)
    assert unit_time(lower_stdlib("v_half", p, m)).normalized_makespan == 109  # 1F1B 117, ZB-H1 103


NEW = [("zb_h2", "none"), ("v_min", "u"), ("v_half", "u")]


@pytest.mark.parametrize("pipeline, fold", NEW)
def test_free_transfers_and_unit_costs_reproduce_the_unit_time_run(pipeline, fold):
    for p, m in ((2, 4), (4, 8)):
        program = tiny_program(pipeline, fold, p, m)
        sim = simulate(program, costs=unit_costs(program))
        timing = unit_time(program.lowered)
        assert sim.pipeline_time == pytest.approx(timing.makespan, rel=1e-9)
        assert sim.bubble_ratio == pytest.approx(float(timing.bubble_ratio), abs=1e-9)


@pytest.mark.parametrize("pipeline, fold", NEW)
def test_drawn_and_searched(pipeline, fold, tmp_path, capsys):
    program = tiny_program(pipeline, fold, 4, 8)
    path = tmp_path / "p.dhx"
    path.write_text(program_text(pipeline, fold, 4, 8))
    assert main(["render", str(path), "--what", "pipeline"]) == 0
    dot = capsys.readouterr().out
    assert all(f"<B>rank {rank}</B>" in dot for rank in range(4))
    assert (fold, pipeline, "on") in space_of(program).schedules


def program_text(pipeline: str, fold: str, p: int, m: int) -> str:
    """A tiny Llama on p gloo pipeline ranks, 1 layer per chunk."""
    return f"""import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model tiny {{ layers = {p * (2 if fold == "u" else 1)}  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8
  vocab = 64  dtype = fp32  layer = llama }}
cluster {{ nodes = 1  gpus_per_node = {p}  profile = "a40" }}
mesh {{ pp = {p} }}
train {{ micro_batch = 1  microbatches = {m}  seed = 7 }}
fold {fold}
pipeline {pipeline}
"""


def test_dhelix_check_names_each_new_schedule(tmp_path):
    for pipeline, fold in NEW:
        program = check_text(program_text(pipeline, fold, 4, 8), "t.dhx")
        assert program.pipeline.name == pipeline and program.lowered.split


@pytest.mark.parametrize("pipeline, fold", NEW)
def test_run_check_is_exact_on_gloo_ranks(pipeline, fold, tmp_path):
    # 4 pipeline ranks (the V schedules' rank 3 turns the V), 8 micro-batches: every phase of
    # each schedule runs; none pairs a forward with a backward, so there is no SI to check.
    path = tmp_path / f"{pipeline}.dhx"
    path.write_text(program_text(pipeline, fold, 4, 8))
    result = dhelix_here("run", str(path), "--steps", "1", "--check")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("check: passed: 1 step(s) match the single-process reference")
    assert math.isfinite(float(result.stdout.split("loss ")[1].split()[0]))
