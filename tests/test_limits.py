"""Every input gets a located error in bounded time and memory (issue 12).

The wrong programs with their full messages are in ``tests/errors`` (nesting_*, *_past_limit,
profile_*, import_not_utf8, …); this file checks what those cannot: that what is within the
limits works (a flat chain of 100,000 terms), that the readers refuse devices, pipes and big
files, that every command treats a library file alike, and that long names still make DOT
that Graphviz accepts.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from dhelix.cli.main import main
from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import ParseError
from dhelix.dsl.core.span import Source
from dhelix.dsl.core.textfile import MAX_FILE_BYTES, FileProblem, read_text_file
from dhelix.dsl.frontend.exprs import evaluate, format_expr
from dhelix.dsl.frontend.fmt import format_source
from dhelix.dsl.frontend.modelcheck import stage_split_error
from dhelix.dsl.frontend.parser import MAX_NESTING, parse
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.render.dot import MAX_TEXT, quote, shorten

from conftest import ROOT

EXAMPLE = ROOT / "examples" / "tiny_llama_cpu.dhx"
LIBRARY = "stdlib_schedules/pipelines.dhx"


def test_a_flat_chain_of_100000_terms_evaluates_and_prints():
    chain = "+".join(["1"] * 100_000)
    expr = parse(chain, start="expr")
    assert evaluate(expr, {}) == 100_000
    assert format_expr(expr) == chain.replace("+", " + ")


def test_a_long_chain_in_a_program_checks_and_formats(tmp_path):
    text = EXAMPLE.read_text().replace("  layer = llama", "  layer = llama\n  extra = 10000" + " - 1" * 5_000)
    program = check_text(text, str(EXAMPLE))
    assert program.model.get("extra") == 5_000
    formatted = format_source(text, "x.dhx")
    assert "extra = 10000 - 1 - 1" in formatted and format_source(formatted, "x.dhx") == formatted


def test_nesting_up_to_the_limit_is_accepted_and_one_more_is_refused():
    def nested(depth: int) -> str:
        return "1 + (" * (depth - 1) + "1 + 1" + ")" * (depth - 1)

    assert evaluate(parse(nested(MAX_NESTING), start="expr"), {}) == MAX_NESTING + 1
    with pytest.raises(ParseError, match=f"nested more than {MAX_NESTING} levels deep"):
        parse(nested(MAX_NESTING + 1), start="expr")


def test_operator_precedence_survives_the_loop_printer():
    for text in ("(1 + 2) * 3 - 4", "1 - (2 - 3)", "-(1 + 2) * 3 // 2 % 5", "(a + b) * (c - d) / e"):
        expr = parse(text, start="expr")
        assert format_expr(expr) == text
        assert parse(format_expr(expr), start="expr") == expr


def test_split_suggestions_for_a_large_prime_layer_count_are_quick():
    error = stage_split_error("none", 1_000_000_007, 4, 1, None)
    assert error.notes[0] == "with 1000000007 layers, fold none works on 1 or 1000000007 ranks"
    error = stage_split_error("u", 2_000_000_014, 3, 2, None)
    assert error.notes[0] == "with 2000000014 layers, fold u works on 1 or 1000000007 ranks"


def test_source_lines_split_once_and_only_at_newlines():
    source = Source("f", "a\x0cb\nc\r\nd")
    assert [source.line(n) for n in (1, 2, 3, 4)] == ["a\x0cb", "c", "d", ""]


# --- files that are not regular, too large, or not UTF-8 ---------------------------------------

def test_devices_pipes_and_folders_are_refused(tmp_path):
    fifo = tmp_path / "pipe.dhx"
    os.mkfifo(fifo)
    for path, reason in (("/dev/zero", "not a regular file"), (fifo, "not a regular file"),
                         (tmp_path, "Is a directory"), (tmp_path / "nope.dhx", "No such file")):
        with pytest.raises(FileProblem, match=reason):
            read_text_file(path)


def test_a_file_over_the_limit_is_refused_without_reading_it(tmp_path):
    big = tmp_path / "big.dhx"
    with open(big, "wb") as file:
        file.truncate(MAX_FILE_BYTES + 1)  # sparse: no time or disk spent
    with pytest.raises(FileProblem, match=f"the file has {MAX_FILE_BYTES + 1:,} bytes"):
        read_text_file(big)


def test_a_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "bom.dhx"
    path.write_bytes(b"\xef\xbb\xbf" + EXAMPLE.read_bytes())
    assert read_text_file(path) == EXAMPLE.read_text()
    check_text("\ufeff" + EXAMPLE.read_text(), str(EXAMPLE))  # text that kept it parses too


def test_check_refuses_dev_zero_with_a_usage_error(capsys):
    assert main(["check", "/dev/zero"]) == 2
    assert capsys.readouterr().err == ("dhelix: cannot read '/dev/zero': not a regular file "
                                       "(a device, pipe or socket); give a file\n")


# --- one behaviour for a library file, bounds on overrides -------------------------------------

@pytest.mark.parametrize("argv", [["plan"], ["simulate"], ["render"], ["export", "--torch-csv", "x.csv"],
                                  ["run", "--check"], ["profile"]])
def test_every_command_calls_a_library_file_a_usage_error(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "stdlib_schedules", tmp_path / "stdlib_schedules", dirs_exist_ok=True)
    assert main([argv[0], LIBRARY, *argv[1:]]) == 2
    assert capsys.readouterr().err == (f"dhelix: '{LIBRARY}' is a library file (no model block): give a "
                                       "file with a model, e.g. examples/tiny_llama_cpu.dhx\n")


def test_overrides_past_their_limits_are_usage_errors(tmp_path, capsys):
    out = str(tmp_path / "x.csv")
    assert main(["export", str(EXAMPLE), "--torch-csv", out, "--microbatches", "1000000"]) == 2
    assert capsys.readouterr().err == "dhelix: --microbatches must be between 1 and 65,536, got 1000000\n"
    assert main(["render", str(EXAMPLE), "--ranks", "4096", "-o", str(tmp_path / "x.dot")]) == 2
    assert "--ranks must be between 1 and 1,024" in capsys.readouterr().err


# --- Graphviz's string limit ----------------------------------------------------------------

def test_long_names_are_shortened_in_dot_and_stay_distinct(tmp_path):
    first, second = "q" * 20_000, "q" * 19_999 + "r"
    assert len(shorten(first)) <= MAX_TEXT and shorten(first) != shorten(second)
    assert quote("short") == '"short"'
    text = EXAMPLE.read_text().replace('import "stdlib/layers.dhx"\n', "").replace("layer = llama", "layer = mlp")
    text = text.replace("  movable wgrad\n", "")
    text += f"\nlayer mlp {{\n  in x\n  {first} = layernorm(x)\n  y = add({first}, x)\n  out y\n}}\n"
    path = tmp_path / "long.dhx"
    path.write_text(text)
    for what in ("dag", "pipeline", "placement"):
        out = tmp_path / f"{what}.dot"
        assert main(["render", str(path), "--what", what, "-o", str(out)]) == 0
        strings = re.findall(r'"(?:[^"\\]|\\.)*"|<[^\n]*>', out.read_text())
        assert max(map(len, strings)) < 16384


def test_an_echoed_line_shows_control_characters_escaped():
    with pytest.raises(ParseError) as caught:
        parse("model m {\n  layers = 4\x1b[2J\x07\n}\n", "f.dhx")
    rendered = caught.value.render()
    assert "\x1b" not in rendered and "\x07" not in rendered
    assert "  2 |   layers = 4\\x1b[2J\\x07" in rendered


def test_nodes_of_a_deep_program_are_not_recursed_into_by_equality():
    # The builder's output for a long chain is an ordinary left-nested BinOp tree.
    expr = parse("1 - 2 - 3", start="expr")
    assert isinstance(expr, s.BinOp) and isinstance(expr.left, s.BinOp) and expr.right == s.Int(3)
