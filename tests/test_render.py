"""`dhelix render`: deterministic DOT text, golden diagrams of small cases, the pipeline grid's
geometry, the missing-Graphviz fallback and the command line's exit codes."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from dhelix.cli import render
from dhelix.cli import main
from dhelix.dsl.passes.overrides import Overrides, load_file
from dhelix.dsl.render.pipeline import MAX_WIDTH_PX, bands, pipeline_dot, strands_of
from dhelix.dsl.passes.unittime import unit_time
from dhelix.dsl.frontend.stdlib import fold_of, stdlib_pipelines

FOLDS = {name: fold_of(pipeline) for name, pipeline in stdlib_pipelines().items()}

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "tiny_llama_cpu.dhx")  # 4 layers, pp 2, fold u, w_helix, m 8
LIBRARY = str(ROOT / "stdlib_schedules" / "pipelines.dhx")
HAVE_DOT = shutil.which("dot") is not None


def dot_text(capsys, *argv: str) -> str:
    """The DOT text `dhelix render` prints for ``argv``."""
    assert main(["render", *argv]) == 0
    return capsys.readouterr().out


# --- determinism and goldens --------------------------------------------------------------------

@pytest.mark.parametrize("name,argv", [
    ("pipeline_w_helix_p2_m4.dot", ["--microbatches", "4"]),
    ("pipeline_one_f_one_b_p2_m4.dot", ["--microbatches", "4", "--pipeline", "one_f_one_b"]),
    ("pipeline_zb_h1_p2_m4.dot", ["--microbatches", "4", "--pipeline", "zb_h1"]),
    ("pipeline_zbv_p2_m4.dot", ["--microbatches", "4", "--pipeline", "zbv"]),
    ("pipeline_one_f_one_b_overlap_p2_m4.dot", ["--microbatches", "4", "--pipeline", "one_f_one_b_overlap"]),
    ("pipeline_looped_bfs_p2_m4.dot", ["--microbatches", "4", "--pipeline", "looped_bfs", "--fold", "loop(2)"]),
    ("pipeline_interleaved_zb_p2_m4.dot", ["--microbatches", "4", "--pipeline", "interleaved_zb", "--fold",
                                           "loop(2)"]),
    ("placement_u_p2.dot", ["--what", "placement"]),
    ("placement_none_p2.dot", ["--what", "placement", "--fold", "none"]),
    ("dag_tiny_llama.dot", ["--what", "dag"]),
])
def test_render_golden_and_deterministic(capsys, golden, name, argv):
    first = dot_text(capsys, EXAMPLE, *argv)
    assert dot_text(capsys, EXAMPLE, *argv) == first
    golden(f"render/{name}", first)


def test_dot_files_are_byte_identical_run_to_run(tmp_path):
    for run in ("a", "b"):
        for what in render.DIAGRAMS:
            assert main(["render", EXAMPLE, "--what", what, "-o", str(tmp_path / f"{what}_{run}.dot")]) == 0
    for what in render.DIAGRAMS:
        assert (tmp_path / f"{what}_a.dot").read_bytes() == (tmp_path / f"{what}_b.dot").read_bytes()


# --- the pipeline grid ----------------------------------------------------------------------------

def lowered_at(ranks: int, microbatches: int, pipeline: str = "w_helix"):
    """The tiny example's schedule lowered with ``pipeline`` at p = ranks, m = microbatches
    (a pipeline written for fold loop on loop(2))."""
    layers = 4 if ranks == 2 else 8
    fold = "loop(2)" if FOLDS.get(pipeline, (None,))[0] == "loop" else None
    return load_file(EXAMPLE, Overrides(ranks=ranks, microbatches=microbatches, layers=layers,
                                        pipeline=pipeline, fold=fold)).lowered


def test_w_helix_strands_alternate_every_p_microbatches_as_in_figure_8():
    strands = strands_of(lowered_at(4, 12))
    assert "".join(strands[mb] for mb in range(12)) == "αααα" "ββββ" "αααα"
    assert strands_of(lowered_at(4, 12, "one_f_one_b")) == {}


def test_the_glossary_says_of_the_strands_what_the_pictures_draw():
    # Issue 53, item 14: the glossary called the forward strand β while the pipeline diagram
    # draws α forwards over β backwards too (DESIGN: the forward of one strand is co-executed
    # with the backward of the other). Every block it cites is checked against the renderer.
    from dhelix.dsl.core.schedule import Interleaved
    from dhelix.dsl.passes.pipeline import check_text
    from dhelix.dsl.render.ladder import ladder_dot
    from dhelix.dsl.simulator.events import schedule_plan

    glossary = (ROOT / "docs" / "glossary.md").read_text()
    entry = " ".join(glossary[glossary.index("**Strand, α and β.**"):glossary.index("**SI block")].split())
    program = check_text(Path(EXAMPLE).read_text(), EXAMPLE)
    strands = strands_of(program.lowered)
    blocks = {str(a) for row in program.lowered.actions for a in row if isinstance(a, Interleaved)}
    cited = re.findall(r"`(SI\(F(\d+)\.\d+,B(\d+)\.\d+\))` (?:is )?(α|β)'s forward over (α|β)'s backward", entry)
    assert {(f, b) for _, _, _, f, b in cited} == {("β", "α"), ("α", "β")}, entry  # both roles, as drawn
    for block, fwd, bwd, f, b in cited:
        assert block in blocks and (strands[int(fwd)], strands[int(bwd)]) == (f, b), block
    dot = ladder_dot(schedule_plan(program))
    for label in ("forward strand (β)", "backward strand (α)"):
        assert label in dot and f"`{label}`" in entry
    assert "the forward's strand β" not in entry


@pytest.mark.parametrize("pipeline", ["w_helix", "one_f_one_b", "zb_h1", "dualpipe_v", "zbv", "looped_bfs",
                                      "interleaved_zb", "one_f_one_b_overlap"])
def test_every_rank_row_spans_the_make_span(pipeline):
    lowered = lowered_at(4, 8, pipeline)
    text = pipeline_dot(lowered)
    makespan = unit_time(lowered).makespan
    rows = [row for row in re.findall(r"<TR>(.*?)</TR>\n", text, re.DOTALL) if "<B>rank " in row]
    bands = len(rows) // lowered.ranks
    assert len(rows) == bands * lowered.ranks
    for rank in range(lowered.ranks):
        # A rank's row in each band (wrapped schedules have several); top-level cells only:
        # drop the SI blocks' inner tables first.
        flat = [re.sub(r"<TABLE.*?</TABLE>", "", row) for row in rows if f"<B>rank {rank}</B>" in row]
        spans = [sum(int(n) for n in re.findall(r'COLSPAN="(\d+)"', row)) for row in flat]
        assert sum(spans) == makespan
        assert all(span * 24 <= MAX_WIDTH_PX for span in spans)


def test_a_long_schedule_wraps_into_bands_of_whole_ticks():
    lowered = lowered_at(4, 64, "w_helix")
    text = pipeline_dot(lowered)
    makespan = unit_time(lowered).makespan
    rulers = text.count("time →")
    assert rulers == len(bands(makespan, lowered.chunks, 24)) > 1
    assert bands(makespan, 2, 24)[0] == (0, 40) and bands(makespan, 2, 24)[-1][1] == makespan


def test_si_block_shows_forward_over_backward():
    text = pipeline_dot(lowered_at(4, 12))
    # [β4 / α0] (the paper's [β5 / α1]): dark blue forward of chunk 0 over light green backward of chunk 1.
    assert ('<TR><TD WIDTH="70" HEIGHT="17" FIXEDSIZE="TRUE" BGCOLOR="#2171b5"><FONT POINT-SIZE="10" '
            'COLOR="white">β4<SUB>0</SUB></FONT></TD></TR><TR><TD WIDTH="70" HEIGHT="17" '
            'FIXEDSIZE="TRUE" BGCOLOR="#a1d99b"><FONT POINT-SIZE="10" COLOR="black">α0<SUB>1</SUB>') in text


# --- output files and Graphviz ------------------------------------------------------------------

@pytest.mark.skipif(not HAVE_DOT, reason="Graphviz dot is not installed")
def test_svg_and_png_are_drawn_by_dot(tmp_path):
    assert main(["render", EXAMPLE, "-o", str(tmp_path / "w.svg")]) == 0
    assert "<svg" in (tmp_path / "w.svg").read_text()
    assert main(["render", EXAMPLE, "--what", "dag", "-o", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "w.dot").exists()


def test_missing_dot_writes_the_dot_file_and_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(render.shutil, "which", lambda name: None)
    assert main(["render", EXAMPLE, "-o", str(tmp_path / "w.svg")]) == 1
    assert not (tmp_path / "w.svg").exists()
    assert (tmp_path / "w.dot").read_text() == dot_text(capsys, EXAMPLE)
    assert main(["render", EXAMPLE, "-o", str(tmp_path / "w.png")]) == 1
    err = capsys.readouterr().err
    assert "Graphviz `dot` was not found" in err
    assert "apt-get install graphviz" in err and "brew install graphviz" in err
    assert f"dot -Tpng {tmp_path / 'w.dot'} -o {tmp_path / 'w.png'}" in err


# --- command-line errors ----------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--what", "pipline"], "unknown diagram 'pipline' (did you mean 'pipeline'?)"),
    (["-o", "{tmp}/w.jpg"], "unknown picture format '.jpg'; write .dot, .svg, .png"),
    (["-o", "{tmp}/missing/w.svg"], "the folder '{tmp}/missing' does not exist"),
    (["--pipeline", "w_helx"], "unknown pipeline 'w_helx' (did you mean 'w_helix'?)"),
    (["--fold", "v"], "--fold: unknown fold 'v'"),
    (["--ranks", "0"], "--ranks must be at least 1"),
    (["--pipeline", "interleaved_1f1b"], "add --fold loop(2)"),
])
def test_command_line_mistakes_exit_2(tmp_path, capsys, argv, message):
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    assert main(["render", EXAMPLE, *argv]) == 2
    assert message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err


def test_library_file_exits_2(capsys):
    assert main(["render", LIBRARY]) == 2
    assert "is a library file (no model block)" in capsys.readouterr().err


def test_overrides_that_do_not_fit_are_located_errors(capsys):
    assert main(["render", EXAMPLE, "--ranks", "3"]) == 1
    err = capsys.readouterr().err
    assert "tiny_llama_cpu.dhx:" in err and "fold u" in err
    assert "note: with the overrides --ranks 3" in err
    assert main(["render", EXAMPLE, "--microbatches", "1"]) == 1
    assert "w_helix needs m >= p" in capsys.readouterr().err


def test_overrides_give_the_figure_8_case():
    lowered = lowered_at(4, 12)
    assert (lowered.name, lowered.ranks, lowered.microbatches, lowered.chunks) == ("w_helix", 4, 12, 2)
    first_si = next(str(a) for a in lowered.actions[0] if str(a).startswith("SI"))
    assert first_si == "SI(F4.0,B0.1)"  # the paper's [β5 / α1]


def test_pairing_ladder_renders_the_plan(capsys):
    assert main(["render", str(ROOT / "examples" / "llama39b_a40.dhx"), "--what", "pairing"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph") and "SI plan: llama forward" in dot and "qkv.wgrad" in dot


def test_pairing_without_a_profile_is_a_located_error(tmp_path, capsys):
    text = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text().replace('  profile = "a40"\n', "")
    path = tmp_path / "noprofile.dhx"
    path.write_text(text)
    assert main(["render", str(path), "--what", "pairing"]) == 1
    err = capsys.readouterr().err
    assert "needs a hardware profile" in err and "^" in err
    assert "while running `dhelix render`" in err


def test_the_ladder_never_shows_a_tiny_op_as_zero(capsys):
    from dhelix.cli import main

    assert main(["render", str(ROOT / "examples" / "tiny_llama_cpu.dhx"), "--what", "pairing"]) == 0
    dot = capsys.readouterr().out
    assert "0.000" not in dot and " ns alone" in dot and " µs" in dot
    # The legend hangs below both rails, so it centres under the ladder.
    assert dot.count('-> "legend" [style=invis]') == 2
