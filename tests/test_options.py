"""Every option of a run and setting of the train block is declared once
(:mod:`dhelix.dsl.core.options`): the command line, the range checks, ``RunOptions``, the train
block's keys and limits, the unknown-setting message and docs/language.md's table follow it.

The recipe test adds one option to a copy of the tree — one entry in the declaration, nothing
else — and shows the command line, ``RunOptions`` and the train block picking it up.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

from dhelix.cli.options import check_options, run_values, value_of
from dhelix.dsl.core.errors import DhelixError, UsageError
from dhelix.dsl.core.options import KINDS, OPTIONS, RunSettings, option, run_fields, train_keys, train_options
from dhelix.dsl.frontend.limits import limit_of
from dhelix.dsl.passes.pipeline import check_text

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = (ROOT / "tests" / "errors" / "unknown_setting.dhx").read_text().replace("micro_bach", "micro_batch")


def _run_args(*argv: str) -> argparse.Namespace:
    from dhelix.cli.main import build_parser

    return build_parser().parse_args(["run", "x.dhx", *argv])


def _program(extra: str):
    return check_text(PROGRAM.replace("microbatches = 8 }", f"microbatches = 8 {extra} }}"), "p.dhx")


# --- one declaration, everything from it ---------------------------------------------------------

def test_the_declaration_is_well_formed():
    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names))
    flags = [o.spelled for o in OPTIONS if o.on_command_line] + [a for o in OPTIONS for a in o.aliases]
    assert len(flags) == len(set(flags))
    for o in OPTIONS:
        assert o.kind in KINDS, o
        assert o.default is None or o.kind is float and isinstance(o.default, (int, float)) \
            or isinstance(o.default, o.kind), o
        assert not o.choices or o.default is None or o.default in o.choices, o
        assert o.on_command_line or o.train, f"{o.name}: neither a flag nor a train key"


def test_run_options_fields_and_defaults_are_the_declarations():
    from dhelix.interpreter.training.train import RunOptions

    assert issubclass(RunOptions, RunSettings)
    made = RunOptions(path="p.dhx", compiled=None)
    for o in run_fields():
        assert getattr(made, o.name) == o.default, o.name
    assert {f.name for f in attrs.fields(RunSettings)} == {o.name for o in run_fields()}


def test_the_command_line_has_each_option_with_a_flag_and_its_default_applies():
    args = _run_args()
    for o in OPTIONS:
        if o.on_command_line:
            assert hasattr(args, o.name), o.name
            assert getattr(args, o.name) == (o.default if o.kind is bool else None), o.name
    assert run_values(args) == {o.name: o.default for o in run_fields()}
    given = _run_args("--lr", "3e-3", "--weight-decay", "0.1", "--steps", "7", "--no-fp32-master", "--log", "l.jsonl")
    values = run_values(given)
    assert (values["lr"], values["weight_decay"], values["steps"], values["master"], values["log"]) == \
        (3e-3, 0.1, 7, False, "l.jsonl")


def test_the_command_line_beats_the_train_block_which_beats_the_default():
    program = _program("steps = 4  seed = 9")
    assert run_values(_run_args(), program.train)["steps"] == 4
    assert run_values(_run_args("--steps", "6"), program.train)["steps"] == 6
    assert value_of(_run_args(), "seed", program.train) == 9
    assert value_of(_run_args(), "warmup", program.train) == option("warmup").default


@pytest.mark.parametrize("name", [o.name for o in OPTIONS if o.on_command_line and o.kind in (int, float)
                                  and not o.choices])
def test_each_number_is_held_to_its_declared_range(name):
    o = option(name)
    below = (o.lowest - 1 if o.lowest is not None else -1.0) if not o.positive else 0.0
    with pytest.raises(UsageError, match=f"--{o.spelled} must be "):
        check_options(argparse.Namespace(**{name: o.kind(below)}), [name])
    check_options(argparse.Namespace(**{name: o.default}), [name])  # the default is within


def test_the_train_block_knows_the_declared_keys_and_their_ranges():
    assert set(train_keys()) == {o.train for o in train_options()}
    program = _program("warmup = 3  eval_every = 2")
    assert (program.train.warmup, program.train.eval_every, program.train.setting("warmup")) == (3, 2, 3)
    for o in train_options():
        if o.highest is not None:
            assert limit_of("train", o.train) == o.highest
    with pytest.raises(DhelixError, match="'warmup' must be at most 1,000,000"):
        _program("warmup = 1000001")
    with pytest.raises(DhelixError, match="unknown setting 'lr_decay'"):
        _program("lr_decay = 1")


# --- the docs follow the declaration ---------------------------------------------------------------

def _train_table() -> dict[str, str]:
    text = (ROOT / "docs" / "language.md").read_text()
    section = text[text.index("### The train block"):]
    section = section[:section.index("\n\n", section.index("| setting |"))]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return {row[0].strip("| `"): row[1] for row in rows}


def test_the_language_reference_lists_every_train_setting_in_order():
    table = _train_table()
    assert list(table) == list(train_keys())
    for o in train_options():
        cell = table[o.train]
        if o.default is not None and not o.choices:
            assert f"({o.default})" in cell, (o.train, cell)
        for choice in o.choices:
            assert f"`{choice}`" in cell, (o.train, choice, cell)
        if o.choices and o.default is not None:
            assert f"`{o.default}` (default)" in cell, (o.train, cell)


def test_the_language_reference_names_the_train_settings_run_overrides():
    text = " ".join((ROOT / "docs" / "language.md").read_text().split())
    sentence = text[text.index("Each setting that `dhelix run` also takes"):]
    named = re.findall(r"`--([a-z-]+)`", sentence[:sentence.index(")")])
    assert sorted(named) == sorted(o.spelled for o in train_options() if o.on_command_line)


# --- the recipe: a new option is one declaration ---------------------------------------------------

NEW_OPTION = '''    Option(name="log_every", kind=int, default=1, train="log_every", lowest=1, highest=MAX_STEPS, metavar="N",
           group="training", help="print the loss every N steps (default: the train block's log_every, else {default})"),
'''

CHECKS = textwrap.dedent('''
    import argparse, importlib.util, sys
    from pathlib import Path

    root = Path(sys.argv[1])
    for name, folder in (("dhelix", "dhelix"), ("dhelix.dsl", "dsl"), ("dhelix.interpreter", "interpreter"),
                         ("dhelix.grammar", "grammar"), ("dhelix.stdlib_schedules", "stdlib_schedules")):
        spec = importlib.util.spec_from_file_location(name, root / folder / "__init__.py",
                                                      submodule_search_locations=[str(root / folder)])
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)

    from dhelix.cli.main import build_parser
    from dhelix.cli.options import check_options, run_values
    from dhelix.dsl.core.errors import DhelixError, UsageError
    from dhelix.dsl.passes.pipeline import check_text
    from dhelix.interpreter.training.train import RunOptions
    import dhelix.dsl.core.options as declared
    assert declared.__file__.startswith(str(root)), declared.__file__

    parser = build_parser()
    assert "--log-every N" in parser._subparsers._group_actions[0].choices["run"].format_help()
    args = parser.parse_args(["run", "x.dhx", "--log-every", "5"])
    assert args.log_every == 5 and run_values(args)["log_every"] == 5
    try:
        check_options(parser.parse_args(["run", "x.dhx", "--log-every", "0"]))
        raise SystemExit("--log-every 0 passed")
    except UsageError as exc:
        assert str(exc).endswith("--log-every must be between 1 and 1000000, got 0"), str(exc)
    assert RunOptions(path="x", compiled=None).log_every == 1

    text = sys.stdin.read()
    program = check_text(text.replace("microbatches = 8 }", "microbatches = 8  log_every = 3 }"), "p.dhx")
    assert program.train.setting("log_every") == 3
    assert run_values(parser.parse_args(["run", "x.dhx"]), program.train)["log_every"] == 3
    try:
        check_text(text.replace("microbatches = 8 }", "microbatches = 8  log_every = 0 }"), "p.dhx")
        raise SystemExit("log_every = 0 passed")
    except DhelixError as exc:
        assert "'log_every' must be positive, got 0" in exc.render(), exc.render()
    try:
        check_text(text.replace("microbatches = 8 }", "microbatches = 8  log_evry = 2 }"), "p.dhx")
        raise SystemExit("log_evry passed")
    except DhelixError as exc:
        assert "did you mean 'log_every'" in exc.render() and ", log_every" in exc.render(), exc.render()
    print("picked up")
''')


def test_a_new_option_is_one_declaration(tmp_path):
    for folder in ("dhelix", "dsl", "interpreter", "grammar", "stdlib_schedules"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    declaration = tmp_path / "dsl" / "core" / "options.py"
    text = declaration.read_text()
    end = text.index("\n)\n", text.index("OPTIONS: tuple[Option, ...] = ("))
    declaration.write_text(text[:end + 1] + NEW_OPTION + text[end + 1:])
    changed = [str(p.relative_to(tmp_path)) for p in sorted(tmp_path.rglob("*.py"))
               if p.read_bytes() != (ROOT / p.relative_to(tmp_path)).read_bytes()]
    assert changed == ["dsl/core/options.py"]
    result = subprocess.run([sys.executable, "-c", CHECKS, str(tmp_path)], input=PROGRAM, capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == "picked up\n", result.stderr[-3000:]


# --- one mesh-axes tuple ----------------------------------------------------------------------------

def test_the_mesh_axes_are_listed_once():
    import ast

    from dhelix.dsl.core import mesh
    from dhelix.dsl.search import space

    assert space.MESH_AXES is mesh.MESH_AXES
    axes = set(mesh.MESH_AXES)
    listed = [f"{path.relative_to(ROOT)}:{node.lineno}"
              for folder in ("dsl", "interpreter", "dhelix") for path in sorted((ROOT / folder).rglob("*.py"))
              if path != ROOT / "dsl" / "core" / "mesh.py"
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) >= 4
              and all(isinstance(e, ast.Constant) and e.value in axes for e in node.elts)]
    assert listed == [], "mesh axes listed outside dsl/core/mesh.py (import MESH_AXES or DIMENSIONS)"
