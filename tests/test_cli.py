"""The command line at the edge: the exit-code policy of ``dhelix.cli.main``, the one
output-path check (:mod:`dhelix.cli.paths`) in every command that writes a file, and library
code (dsl/, interpreter/) that neither prints, parses arguments, exits nor names a command.

The unwritable cases need a place that refuses a new file even to root (the tests run as root
here, and root writes into a read-only folder): ``/proc`` refuses every new file; a read-only
folder is tried too where the tests do not run as root.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import ROOT
from dhelix.cli import main
from dhelix.cli.main import COMMANDS
from dhelix.cli.paths import output_path, program_inputs, refuse_inputs
from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.frontend.imports import stdlib_root
from dhelix.dsl.passes.pipeline import check_text

EXAMPLE = ROOT / "examples" / "tiny_llama_cpu.dhx"
PROC = Path("/proc")
needs_proc = pytest.mark.skipif(not PROC.is_dir(), reason="needs Linux's /proc")
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


# --- every command's help ------------------------------------------------------------------------

@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_prints_its_help(command, capsys):
    # argparse formats each option's help with %: a literal one must be doubled (tune's
    # --memory-margin default, "1 GB + 5 %", once made `dhelix tune --help` raise ValueError).
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: dhelix {command}")


# --- library code stays inside -----------------------------------------------------------------

#: Where library code may print or exit, and why: a spawned rank's top level reports its own
#: failure on the standard error it shares with the command (the parent sees only its exit code).
ALLOWED = {("interpreter/launch/spawn.py", "_rank_process")}


def _library_sources():
    for folder in ("dsl", "interpreter"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def _functions(tree):
    """(function name, node) for every node, the name of the innermost enclosing function."""
    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            yield inner, child
            yield from visit(child, inner)
    yield from visit(tree, "")


def test_library_code_neither_prints_nor_parses_arguments_nor_exits():
    found = []
    for path, tree in _library_sources():
        for function, node in _functions(tree):
            what = None
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
                what = "import argparse"
            elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
                what = "from argparse"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("print", "exit"):
                what = f"{node.func.id}()"
            elif isinstance(node, ast.Attribute) and node.attr == "exit" and getattr(node.value, "id", "") == "sys":
                what = "sys.exit"
            elif isinstance(node, ast.Name) and node.id == "SystemExit":
                what = "SystemExit"
            if what and (path, function) not in ALLOWED:
                found.append(f"{path}:{node.lineno}: {what} in {function or 'the module'}")
    assert found == []


def _docstrings(tree) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


#: dsl/passes/overrides.py still holds the --ranks/--pipeline/--fold options of render and export
#: (argparse wording and messages): it is being reworked elsewhere and moves to the CLI after.
NAMING_COMMANDS_ALLOWED = {"dsl/passes/overrides.py"}


def test_library_messages_name_no_command_and_no_option():
    pattern = re.compile(r"`dhelix|dhelix (check|fmt|render|export|plan|simulate|run|profile)\b"
                         r"|(?<![\w-])--[a-z][a-z0-9-]+")
    found = []
    for path, tree in _library_sources():
        if path in NAMING_COMMANDS_ALLOWED:
            continue
        docs = _docstrings(tree)
        found += [f"{path}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in docs and pattern.search(node.value)]
    assert found == []


# --- the exit-code policy ----------------------------------------------------------------------

def test_errors_of_a_command_end_with_the_command_it_was(tmp_path, capsys):
    path = tmp_path / "bad.dhx"
    path.write_text(EXAMPLE.read_text().replace("layers = 4", "layers = 5"))
    assert main(["simulate", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:") and err.splitlines()[-1] == "  note: while running `dhelix simulate`"
    assert main(["check", str(path)]) == 1  # check's errors are its report: no note
    assert "while running" not in capsys.readouterr().err


def test_usage_errors_exit_2_and_an_interrupt_130(monkeypatch, capsys):
    assert main(["plan", "no_such_file.dhx"]) == 2
    assert capsys.readouterr().err == "dhelix: cannot read 'no_such_file.dhx': No such file or directory\n"

    def interrupted(args):
        raise KeyboardInterrupt

    from dhelix.cli import check

    monkeypatch.setattr(check, "cmd_check", interrupted)
    assert main(["check", str(EXAMPLE)]) == 130
    assert capsys.readouterr().err == "dhelix: interrupted\n"


# --- the output path: the rules -----------------------------------------------------------------

def test_a_writable_new_or_existing_file_is_accepted_and_nothing_is_left_behind(tmp_path):
    existing = tmp_path / "old.json"
    existing.write_text("keep")
    assert output_path(str(tmp_path / "new.json"), "--trace") == tmp_path / "new.json"
    assert output_path(str(existing), "--trace") == existing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    assert existing.read_text() == "keep"


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp, "that is a folder"),
    (lambda tmp: tmp / "missing" / "x.json", "the folder '{tmp}/missing' does not exist"),
    (lambda tmp: tmp / "file.txt" / "x.json", "'{tmp}/file.txt' is not a folder"),
])
def test_folders_are_refused(tmp_path, make, message):
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(UsageError) as caught:
        output_path(str(make(tmp_path)), "--trace")
    assert message.replace("{tmp}", str(tmp_path)) in caught.value.message


@needs_proc
def test_a_folder_nobody_may_write_into_is_refused_by_trying():
    # os.access("/proc", W_OK) is true for root; creating a file there fails for everyone.
    with pytest.raises(UsageError) as caught:
        output_path("/proc/dhelix-trace.json", "--trace")
    assert caught.value.message.startswith("--trace /proc/dhelix-trace.json: cannot write there (")


@pytest.mark.skipif(IS_ROOT, reason="root may write into a read-only folder and file")
def test_read_only_folders_and_files_are_refused(tmp_path):
    folder, locked = tmp_path / "ro", tmp_path / "locked.json"
    folder.mkdir()
    locked.write_text("keep")
    folder.chmod(0o555)
    locked.chmod(0o444)
    try:
        for path in (folder / "x.json", locked):
            with pytest.raises(UsageError, match="cannot write there"):
                output_path(str(path), "--trace")
    finally:
        folder.chmod(0o755)
    assert locked.read_text() == "keep"


def test_an_input_is_refused_by_any_name(tmp_path, monkeypatch):
    source = tmp_path / "prog.dhx"
    source.write_text("x")
    (tmp_path / "link.dhx").symlink_to(source)
    os.link(source, tmp_path / "hard.dhx")
    monkeypatch.chdir(tmp_path)
    for name in ("prog.dhx", "./prog.dhx", str(source), "link.dhx", "hard.dhx", "sub/../prog.dhx"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(UsageError, match="that is an input of this command"):
            output_path(name, "-o", inputs=(str(source),))
    refuse_inputs(tmp_path / "other.dhx", "-o", (str(source),))  # another file is fine


def test_the_inputs_of_a_program_are_its_file_its_imports_and_its_profile(tmp_path):
    lib, profile = tmp_path / "lib.dhx", tmp_path / "lab.yaml"
    lib.write_text("layer tiny {\n  in x\n  y = rmsnorm(x)\n  out y\n}\n")
    shutil.copy(stdlib_root() / "a40.yaml", profile)
    path = _program(tmp_path, imports=("lib.dhx",), profile="lab.yaml")
    inputs = {os.path.realpath(p) for p in program_inputs(check_text(path.read_text(), str(path)))}
    expected = {path, lib, profile, stdlib_root() / "layers.dhx", stdlib_root() / "pipelines.dhx"}
    assert {os.path.realpath(p) for p in expected} <= inputs


def _program(folder: Path, name: str = "prog.dhx", imports=(), profile: str | None = None) -> Path:
    """A copy of the tiny example in ``folder``, importing ``imports`` too, with ``profile``."""
    text = EXAMPLE.read_text()
    for extra in imports:
        text = text.replace('import "stdlib/pipelines.dhx"\n', f'import "stdlib/pipelines.dhx"\nimport "{extra}"\n')
    if profile is not None:
        text = text.replace('profile = "a40"', f'profile = "{profile}"')
    path = folder / name
    path.write_text(text)
    return path


# --- the output path: every command that writes ------------------------------------------------

#: Every command and option that writes a file, with the file's usual suffix.
WRITERS = [("render", "-o", ".svg"), ("export", "--torch-csv", ".csv"), ("simulate", "--trace", ".json"),
           ("run", "--log", ".jsonl"), ("run", "--export-weights", ".pt"),
           ("run", "--trace", ".json"), ("run", "--metrics", ".json"), ("profile", "-o", ".yaml"),
           ("report", "-o", ".html")]


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if `dhelix run` starts a rank: its output is refused before training."""
    from dhelix.interpreter.launch import join, spawn

    def started(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(spawn, "run_local", started)
    monkeypatch.setattr(join, "run_rank", started)


@pytest.mark.parametrize("command, flag, suffix", WRITERS)
@pytest.mark.parametrize("where, message", [
    ("folder", "that is a folder"),
    ("missing", "does not exist"),
    pytest.param("proc", "cannot write there", marks=needs_proc),
])
def test_every_writer_refuses_bad_places_before_any_work(command, flag, suffix, where, message, tmp_path, capsys,
                                                         no_training):
    program = _program(tmp_path)
    target = {"folder": tmp_path / f"dir{suffix}", "missing": tmp_path / "missing" / f"x{suffix}",
              "proc": PROC / f"x{suffix}"}[where]
    if where == "folder":
        target.mkdir()
    assert main([command, str(program), flag, str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dhelix: {flag} {target}: ") and message in err


@pytest.mark.parametrize("command, flag, inputs, written", [
    ("export", "--torch-csv", (), "prog.dhx"),  # the program itself
    ("export", "--torch-csv", ("lib.dhx",), "lib.dhx"),  # a file it imports
    ("export", "--torch-csv", (), "lab.yaml"),  # its hardware profile
    ("export", "--torch-csv", (), "link.csv"),  # a link to the program
    ("run", "--trace", (), "prog.dhx"),
    ("run", "--trace", (), "lab.yaml"),
    ("run", "--metrics", ("lib.dhx",), "lib.dhx"),
    ("profile", "-o", (), "lab.yaml"),  # re-measuring over the profile the program names
    ("profile", "-o", (), "prog.dhx"),
    ("report", "-o", (), "prog.dhx"),
    ("report", "-o", ("lib.dhx",), "lib.dhx"),
    ("report", "-o", (), "lab.yaml"),
    ("simulate", "--trace", (), "lab.json"),  # a program file that happens to end in .json
    ("render", "-o", ("lib.dot",), "lib.dot"),  # an import that happens to end in .dot
    ("render", "-o", ("lib.dot",), "lib.svg"),  # its .dot fallback (Graphviz missing) would be lib.dot
])
def test_every_writer_refuses_to_overwrite_an_input(command, flag, inputs, written, tmp_path, capsys, no_training):
    library = "layer tiny {\n  in x\n  y = rmsnorm(x)\n  out y\n}\n"
    for name in inputs:
        (tmp_path / name).write_text(library)
    shutil.copy(stdlib_root() / "a40.yaml", tmp_path / "lab.yaml")
    name = "lab.json" if written == "lab.json" else "prog.dhx"
    program = _program(tmp_path, name, imports=inputs, profile="lab.yaml")
    (tmp_path / "link.csv").symlink_to(program)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert main([command, str(program), flag, str(tmp_path / written)]) == 2
    assert "that is an input of this command" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_run_refuses_one_file_for_two_outputs_and_outputs_with_check(tmp_path, capsys, no_training):
    program = _program(tmp_path)
    out = str(tmp_path / "out.json")
    assert main(["run", str(program), "--trace", out, "--metrics", out]) == 2
    assert "--trace and --metrics name the same file" in capsys.readouterr().err
    assert main(["run", str(program), "--check", "--metrics", out]) == 2
    assert "it writes no --metrics (run without --check for them)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prog.dhx"]


def test_a_good_output_is_still_written(tmp_path, capsys):
    program = _program(tmp_path, profile="a40")
    assert main(["export", str(program), "--torch-csv", str(tmp_path / "w.csv")]) == 0
    assert (tmp_path / "w.csv").read_text().count("\n") == 2  # one row per pipeline rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prog.dhx", "w.csv"]


@pytest.mark.parametrize("command", [["simulate", "examples/tiny_llama_cpu.dhx", "--json"],
                                     ["check", "examples/tiny_llama_cpu.dhx", "--dump", "lower"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(command):
    # `dhelix simulate --json | head -c 10`: the reader closes the pipe before dhelix writes.
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "dhelix", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_version_prints_the_packages_one_version(capsys):
    import importlib.metadata

    import dhelix
    from dhelix.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"dhelix {dhelix.__version__}\n"
    assert importlib.metadata.version("dhelix") == dhelix.__version__  # pyproject reads it from there
