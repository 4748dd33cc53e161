"""`dhelix plan`: the plan table and JSON of a file's layer pair, its errors, and the ladder
diagram of a plan (dsl.render.ladder)."""

from __future__ import annotations

import json

import pytest

from dhelix.cli import main
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.core.plan import optimality_line, plan_from_json
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.planner.certify import Optimality, optimality
from dhelix.dsl.planner.pairing import plan_layers
from dhelix.dsl.render.ladder import ladder_dot
from dhelix.dsl.simulator.events import schedule_plan
from conftest import ROOT
from test_pairing import Unbounded

EXAMPLE = "examples/llama39b_a40.dhx"


def test_plan_table(golden, capsys):
    assert main(["plan", EXAMPLE]) == 0
    golden("plan_cli/llama39b_a40.txt", capsys.readouterr().out)


def test_plan_json_round_trips(capsys):
    assert main(["plan", EXAMPLE, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data)[:4] == ["file", "model", "layer", "profile"]
    assert (data["pipeline"], data["fold"], data["si_blocks"], data["layer_pairs"]) == ("w_helix", "u", 56, 168)
    plan = plan_from_json(data["plan"])
    assert plan.speedup == pytest.approx(data["plan"]["speedup"])
    assert plan.total == pytest.approx(sum(pair.time for pair in plan.pairs))
    assert plan.comm_hidden + plan.comm_exposed == pytest.approx(plan.comm_time)


@pytest.mark.parametrize("example, kind", [("examples/tiny_llama_stages_cpu.dhx", "chunks"),
                                           ("examples/tiny_llama_group_cpu.dhx", "choices"),
                                           ("examples/tiny_llama_launch_cpu.dhx", "choices")])
def test_plan_json_holds_every_kind_of_planner_choice(example, kind, capsys):
    # A `by auto` count, a group order and a launch count (each once a traceback).
    assert main(["plan", example, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[kind], data
    for chunk in data["chunks"]:
        assert chunk["chosen"] in [int(v) if v.isdigit() else v for v in chunk["candidates"]]


def test_a_split_schedule_plans_the_backward_without_wgrads(capsys):
    text = (ROOT / EXAMPLE).read_text().replace("layers = 12", "layers = 16").replace("w_helix", "dualpipe_v")
    program = check_text(text, "dualpipe.dhx")
    plan = schedule_plan(program)
    assert not any(name.endswith(".wgrad") for name in plan.backward_order)
    whole = schedule_plan(check_text((ROOT / EXAMPLE).read_text(), EXAMPLE))
    assert sum(name.endswith(".wgrad") for name in whole.backward_order) == 4


def test_plan_needs_a_profile(tmp_path, capsys):
    path = tmp_path / "noprofile.dhx"
    path.write_text((ROOT / EXAMPLE).read_text().replace('  profile = "a40"\n', ""))
    assert main(["plan", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[:3] == [
        f"{path}:18:1: the cost model needs a hardware profile, and the cluster block names none",
        "  18 | cluster {",
        "     | ^^^^^^^^^",
    ]
    assert 'note: set one in the cluster block: cluster { profile = "a40" }' in err
    assert err.splitlines()[-1] == "  note: while running `dhelix plan`"


@pytest.mark.parametrize("argv, code, message", [
    (["stdlib_schedules/pipelines.dhx"], 2, "is a library file (no model block)"),
    (["no_such_file.dhx"], 2, "cannot read 'no_such_file.dhx'"),
    ([EXAMPLE, "--max-segment", "-1"], 2, "--max-segment must be 0 (no bound) or more"),
])
def test_plan_errors(argv, code, message, capsys):
    assert main(["plan", *argv]) == code
    assert message in capsys.readouterr().err


def test_ladder_has_a_rung_per_segment_pair(golden):
    program = check_text((ROOT / EXAMPLE).read_text(), EXAMPLE)
    plan = schedule_plan(program)
    dot = ladder_dot(plan)
    assert dot == ladder_dot(plan)
    rungs = [line for line in dot.splitlines() if '" -> "b' in line and "dir=" in line]
    assert len(rungs) == len(plan.pairs)
    assert sum('style="dashed"' in line for line in rungs) == sum(not (p.forward and p.backward) for p in plan.pairs)
    golden("render_ladder/llama39b_a40.dot", dot)


def test_plan_prints_the_choices_of_every_level(capsys):
    from dhelix.cli import main

    assert main(["plan", "examples/tiny_llama_group_cpu.dhx"]) == 0
    out = capsys.readouterr().out
    assert "partition group ag1: inter first (inter: " in out and "partition backward: " in out
    assert main(["plan", "examples/tiny_llama_launch_cpu.dhx"]) == 0
    assert "train launch = auto: " in capsys.readouterr().out


# -- how far a plan can be from the fastest (plan --certify) ---------------------------------

def _example(name: str):
    program = check_text((ROOT / "examples" / name).read_text(), name)
    return program, PairCost.for_program(program)


def test_certify_finds_a_faster_plan_where_the_default_segment_bound_loses_one(capsys):
    # Megatron's TP layer with its all_reduces substituted: the 4-op segments lose 0.9 %.
    program, cost = _example("megatron_tp_substitute_a40.dhx")
    fastest = plan_layers(program.forward, program.backward, program.strands, cost, max_segment=None)
    assert main(["plan", "examples/megatron_tp_substitute_a40.dhx", "--certify"]) == 0
    default = schedule_plan(program)
    assert fastest.total < default.total
    percent = 100 * (1 - fastest.total / default.total)
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"not optimal: segments of any length give {fastest.total * 1e3:.3f} ms ({percent:.1f}% faster); "
        "plan --max-segment 0 shows that plan")


def test_certify_proves_the_default_plan_optimal_or_bounds_it():
    program, cost = _example("llama39b_a40.dhx")
    fwd, bwd, strands = program.forward, program.backward, program.strands
    plan = plan_layers(fwd, bwd, strands, cost)
    assert optimality(plan, fwd, bwd, strands, cost) == Optimality(True, plan.total)  # the same total, searched
    assert "optimal: a search over every" in optimality_line(plan, optimality(plan, fwd, bwd, strands, cost))
    # A window on the moving ops: no exact search to compare with, the relaxation's bound instead.
    windowed = plan_layers(fwd, bwd, strands, cost, max_prefixes=40)
    assert windowed.stats.backward_window is not None
    known = optimality(windowed, fwd, bwd, strands, cost)
    assert not known.exact and known.floor <= plan.total <= windowed.total
    assert optimality_line(windowed, known).startswith("optimality: no plan over any order and segmentation beats")
    # Without bounds (a measured profile's cost) nothing is searched again and nothing is proven.
    unbounded = optimality(plan, fwd, bwd, strands, Unbounded(cost))
    assert unbounded == Optimality(False) and "not proven" in optimality_line(plan, unbounded)
    assert optimality_line(plan).startswith("optimality: not checked (a bounded search: segments of at most 4 ops)")
