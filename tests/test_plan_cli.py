"""`dhelix plan`: the plan table and JSON of a file's layer pair, its errors, and the ladder
diagram of a plan (dsl.render.ladder)."""

from __future__ import annotations

import json

import pytest

from dhelix.cli import main
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.core.plan import plan_from_json
from dhelix.dsl.render.ladder import ladder_dot
from dhelix.dsl.simulator.events import schedule_plan
from conftest import ROOT

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
