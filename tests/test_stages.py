"""The named pipeline of passes: what each stage fills in, and re-running the passes after a
stage on a changed program (``rerun``), as the overrides and the simulator's variants do."""

from __future__ import annotations

import attrs
import pytest

from conftest import ROOT
from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.core.program import FoldSpec
from dhelix.dsl.passes.overrides import Overrides, load_program
from dhelix.dsl.core.schedule import format_lowered
from dhelix.dsl.passes.pipeline import STAGE_NAMES, dump_stage, rerun, run_until

TINY = ROOT / "examples" / "tiny_llama_cpu.dhx"  # 4 layers, tp 2 x pp 2, fold u, w_helix, m 8

#: The Program field each pass fills in, by the first stage that has it.
FIELDS = {"forward": "shapes", "backward": "autodiff", "placement": "fold", "lowered": "lower"}


def tiny(stop: str = "validate", text: str | None = None):
    return run_until(TINY.read_text() if text is None else text, "examples/tiny_llama_cpu.dhx", stop)


@pytest.mark.parametrize("stop", STAGE_NAMES[STAGE_NAMES.index("check"):])
def test_each_stage_fills_in_only_what_it_owns(stop):
    program = tiny(stop)
    for field, owner in FIELDS.items():
        done = STAGE_NAMES.index(stop) >= STAGE_NAMES.index(owner)
        assert (getattr(program, field) is not None) == done, (field, stop)
    assert bool(program.env) == (STAGE_NAMES.index(stop) >= STAGE_NAMES.index("shapes"))


def test_a_library_file_goes_through_every_stage_unchanged():
    text = 'import "stdlib/pipelines.dhx"\nimport "stdlib/layers.dhx"\n'
    checked = run_until(text, "lib.dhx", "check")
    assert run_until(text, "lib.dhx") == checked
    from dhelix.dsl.frontend.stdlib import stdlib_pipelines

    # every `pipeline NAME … {` definition of the library file
    defined = (ROOT / "stdlib_schedules" / "pipelines.dhx").read_text().count("\npipeline ")
    assert checked.model is None and len(checked.pipelines) == len(stdlib_pipelines()) == defined >= 7


def test_rerun_after_strands_equals_checking_the_edited_file():
    changed = attrs.evolve(tiny(), fold=FoldSpec.of("none"), pipeline=next(
        p for p in tiny().pipelines if p.name == "one_f_one_b"),
        train=attrs.evolve(tiny().train, microbatches=4))
    rerun_program = rerun(changed, after="strands")
    edited = tiny(text=TINY.read_text().replace("fold u", "fold none")
                  .replace("pipeline w_helix", "pipeline one_f_one_b")
                  .replace("microbatches = 8", "microbatches = 4"))
    assert format_lowered(rerun_program.lowered) == format_lowered(edited.lowered)
    assert rerun_program == edited  # the whole program, its layer names (env) too


def test_rerun_drops_what_the_later_passes_produced():
    program = tiny()
    more = attrs.evolve(program, train=attrs.evolve(program.train, microbatches=4))
    placed = rerun(more, after="strands", stop="fold")
    assert placed.placement == program.placement
    assert placed.lowered is None  # the old lowering was for 8 micro-batches


def test_rerun_after_check_rebuilds_the_names_the_layer_sees():
    program = tiny("check")
    settings = tuple((k, 8 if k == "layers" else v) for k, v in program.model.settings)
    longer = rerun(attrs.evolve(program, model=attrs.evolve(program.model, settings=settings)),
                   after="check", stop="fold")
    assert dict(longer.env)["layers"] == 8
    assert [stage.layers for stage in longer.placement.stages][-1] == range(6, 8)


@pytest.mark.parametrize("after", ["parse", "resolve"])
def test_rerun_before_the_passes_is_a_caller_error(after):
    with pytest.raises(ValueError, match="the passes start after 'check'"):
        rerun(tiny("check"), after=after)


def test_strands_dump_names_the_operators_of_each_selector():
    text = TINY.read_text().replace("  movable wgrad\n", "  movable qkv.wgrad\n  movable wgrad\n"
                                    "  forbid attention.bwd with comm\n")
    assert dump_stage("strands", tiny("strands", text)) == (
        "strands: overlap tp; comm_with_comm on\n"
        "  movable qkv.wgrad: qkv.wgrad\n"
        "  movable wgrad: fc2.wgrad, fc1.wgrad, prj.wgrad, qkv.wgrad\n"
        "  forbid attention.bwd with comm: att.bwd with ag1, rs1, ag2, rs2, rs2.bwd, ag2.bwd, "
        "rs1.bwd, ag1.bwd\n")


def test_strands_dump_says_when_the_defaults_are_used():
    text = TINY.read_text().split("strands {")[0]
    assert dump_stage("strands", tiny("strands", text)).startswith(
        "strands (defaults: the program has no strands block): overlap tp, cp, ep, dp;")


# --- the command-line overrides re-run the passes after check ---------------------------

def test_overrides_rerun_every_pass_after_check():
    program = load_program(TINY.read_text(), "examples/tiny_llama_cpu.dhx",
                           Overrides(layers=8, pipeline="interleaved_1f1b", fold="loop(2)"))
    assert dict(program.env)["layers"] == 8  # the layer sees the overridden sizes too
    assert (program.placement.kind, len(program.placement.stages)) == ("loop(2)", 4)
    assert program.lowered.name == "interleaved_1f1b"


@pytest.mark.parametrize("fold, message", [
    ("uu", "--fold: unknown fold 'uu' (did you mean 'u'?); folds: none, u, loop(V), bidir (e.g. loop(2))"),
    ("u(2)", "--fold: unknown fold 'u(2)'; folds: none, u, loop(V), bidir (e.g. loop(2))"),
    ("loop", "--fold: unknown fold 'loop'; folds: none, u, loop(V), bidir (e.g. loop(2))"),
])
def test_a_fold_override_names_a_fold(fold, message):
    with pytest.raises(UsageError) as caught:
        load_program(TINY.read_text(), "examples/tiny_llama_cpu.dhx", Overrides(fold=fold))
    assert caught.value.message == message


EXAMPLES = sorted((ROOT / "examples").glob("*.dhx"))
PASSES = STAGE_NAMES[STAGE_NAMES.index("check") + 1:]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_each_pass_writes_only_the_fields_its_stage_declares(path):
    from dhelix.dsl.passes.pipeline import STAGES

    program = run_until(path.read_text(), str(path), "check")
    for stage in STAGES[STAGE_NAMES.index("check") + 1:]:
        after = stage.run(program)
        written = {f.name for f in attrs.fields(type(program)) if getattr(after, f.name) != getattr(program, f.name)}
        assert written <= set(stage.produces), (stage.name, written)
        program = after


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_rerun_after_every_stage_equals_a_fresh_run(path):
    fresh = run_until(path.read_text(), str(path))
    for after in PASSES:
        assert rerun(fresh, after=after) == fresh, after


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_rerun_after_every_stage_with_other_micro_batches_equals_a_fresh_run(path):
    # The names the layer sees (env) hold the micro-batches: a rerun after autodiff, strands
    # or fold kept the old ones (issue 57). Whole programs are compared, env included.
    done = run_until(path.read_text(), str(path))
    train = attrs.evolve(done.train, microbatches=2 * done.train.microbatches)
    fresh = rerun(attrs.evolve(run_until(path.read_text(), str(path), "check"), train=train), after="check")
    assert dict(fresh.env)["microbatches"] == train.microbatches
    for after in PASSES:
        assert rerun(attrs.evolve(done, train=train), after=after) == fresh, after
