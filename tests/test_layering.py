"""The architecture as a test: each stage package of dsl/ imports only the stages before it, and
each room of interpreter/ only the rooms below it.

dsl order: core → frontend → passes → planner → simulator → fidelity → render → search. ``core`` imports nothing of
dhelix; ``dsl`` never imports torch, the interpreter or the command line.

interpreter rooms, top to bottom: launch and measure → training → execute → verify → ops. A room
imports its own modules, the rooms below it and dsl; never a room above or beside it.

Nothing but the command line (and ``python -m dhelix``) imports the command line. Imports are
read from the source with :mod:`ast`, including the ones inside functions and the dynamic ones
naming their module in a string: ``importlib.import_module("m")``, ``import_module("m")`` and
``__import__("m")`` (an f-string counts by its constant head: ``f"dhelix.cli.{x}"`` imports
``dhelix.cli``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("core", "frontend", "passes", "planner", "simulator", "fidelity", "render", "search")
#: The interpreter's rooms by level, top first; a room may import the rooms of later levels.
ROOMS = (("launch", "measure"), ("training",), ("execute",), ("verify",), ("ops",))
DYNAMIC = ("import_module", "__import__")


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """Every module ``path`` (a source file under ``root``) imports, absolute, with its line
    number: import statements, and calls of importlib's ``import_module`` or ``__import__``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's own package
                parts = _package_of(path, root).split(".")
                package = ".".join(parts[:len(parts) - node.level + 1])
                found += [(node.lineno, f"{package}.{node.module}" if node.module else package)]
            else:
                found += [(node.lineno, node.module)]
        elif isinstance(node, ast.Call) and _called_name(node.func) in DYNAMIC and node.args:
            module = _literal_module(node.args[0])
            if module:
                found.append((node.lineno, module))
    return found


def _called_name(func: ast.expr) -> str | None:
    """``import_module`` for ``importlib.import_module(...)`` or ``import_module(...)``."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _literal_module(arg: ast.expr) -> str | None:
    """The module a dynamic import names: a string literal, or an f-string's constant head up to
    its last dot; None for anything computed."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value).rpartition(".")[0]
        return head or None
    return None


def _package_of(path: Path, root: Path = ROOT) -> str:
    """The dotted package a source file belongs to, as installed (``dsl/core/x.py`` →
    ``dhelix.dsl.core``)."""
    parts = path.relative_to(root).parent.parts
    return ".".join(("dhelix",) + parts) if parts and parts[0] != "dhelix" else ".".join(parts)


def sources(folder: str, root: Path = ROOT) -> list[Path]:
    """Every source file under ``root``/``folder``, sorted."""
    return sorted((root / folder).rglob("*.py"))


def stage_violations(stage: str, root: Path = ROOT) -> list[str]:
    """The imports of dsl/``stage`` under ``root`` that go to a later stage, torch or the interpreter."""
    allowed = {f"dhelix.dsl.{s}" for s in STAGES[:STAGES.index(stage) + 1]}
    wrong = []
    for path in sources(f"dsl/{stage}", root):
        for line, module in imported_modules(path, root):
            if module.split(".")[0] in ("torch", "interpreter") or module.startswith("dhelix.interpreter"):
                wrong.append(f"{path.relative_to(root)}:{line}: {module}")
            elif module.startswith("dhelix") and ".".join(module.split(".")[:3]) not in allowed:
                wrong.append(f"{path.relative_to(root)}:{line}: {module}")
    return wrong


def _level(room: str) -> int:
    return next(i for i, level in enumerate(ROOMS) if room in level)


def room_violations(room: str, root: Path = ROOT) -> list[str]:
    """The imports of interpreter/``room`` under ``root`` that go to a room above or beside it
    (or to the interpreter package outside a room)."""
    allowed = {room} | {r for level in ROOMS[_level(room) + 1:] for r in level}
    wrong = []
    for path in sources(f"interpreter/{room}", root):
        for line, module in imported_modules(path, root):
            parts = module.split(".")
            if parts[0] == "interpreter" or (parts[:2] == ["dhelix", "interpreter"]
                                             and (len(parts) < 3 or parts[2] not in allowed)):
                wrong.append(f"{path.relative_to(root)}:{line}: {module}")
    return wrong


def test_every_dsl_module_lives_in_a_stage_package():
    loose = [p.name for p in (ROOT / "dsl").glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"modules outside a stage package: {loose}"
    assert sorted(p.name for p in (ROOT / "dsl").iterdir() if p.is_dir() and p.name != "__pycache__") \
        == sorted(STAGES)


def test_every_interpreter_module_lives_in_a_room():
    loose = [p.name for p in (ROOT / "interpreter").glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"modules outside a room: {loose}"
    assert sorted(p.name for p in (ROOT / "interpreter").iterdir() if p.is_dir() and p.name != "__pycache__") \
        == sorted(room for level in ROOMS for room in level)


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_only_stages_before_it(stage):
    wrong = stage_violations(stage)
    assert wrong == [], f"dsl/{stage} may import only the stages up to it:\n" + "\n".join(wrong)


@pytest.mark.parametrize("room", [room for level in ROOMS for room in level])
def test_a_room_imports_only_rooms_below_it(room):
    wrong = room_violations(room)
    assert wrong == [], f"interpreter/{room} may import only the rooms below it and dsl:\n" + "\n".join(wrong)


def test_only_the_command_line_imports_the_command_line():
    wrong = [f"{path.relative_to(ROOT)}:{line}: {module}"
             for folder in ("dsl", "interpreter")
             for path in sources(folder)
             for line, module in imported_modules(path)
             if module == "dhelix.cli" or module.startswith("dhelix.cli.")]
    assert wrong == []


# --- the checker catches a mutant ---------------------------------------------------------------

#: A real module per tree, and an upward import added to it, statically and dynamically.
MUTANTS = {
    "dsl/core/errors.py": ("from dhelix.dsl.simulator import events",
                           "import importlib\nimportlib.import_module('dhelix.dsl.render.text')",
                           "__import__('dhelix.dsl.planner.costmodel')"),
    "interpreter/ops/comm.py": ("from ..execute import executor",
                                "from importlib import import_module\nimport_module(f'dhelix.interpreter.training.{x}')",
                                "__import__('dhelix.interpreter.verify.harness')"),
}


def _mutant_tree(tmp_path: Path, relative: str, added: str) -> Path:
    """A copy of ``relative`` under ``tmp_path`` with ``added`` inside a function at its end."""
    target = tmp_path / relative
    target.parent.mkdir(parents=True)
    body = "\n".join("    " + line for line in added.splitlines())
    target.write_text((ROOT / relative).read_text() + f"\n\ndef _mutant(x):\n{body}\n")
    return target


@pytest.mark.parametrize("relative,added", [(rel, add) for rel, adds in MUTANTS.items() for add in adds])
def test_an_upward_import_is_caught(tmp_path, relative, added):
    _mutant_tree(tmp_path, relative, added)
    folder = Path(relative).parent.name
    check = stage_violations if relative.startswith("dsl/") else room_violations
    wrong = check(folder, tmp_path)
    assert len(wrong) == 1 and wrong[0].startswith(relative + ":"), wrong


@pytest.mark.parametrize("relative", MUTANTS)
def test_the_unmutated_copy_passes(tmp_path, relative):
    _mutant_tree(tmp_path, relative, "importlib.import_module(name)")  # computed: not read
    folder = Path(relative).parent.name
    check = stage_violations if relative.startswith("dsl/") else room_violations
    assert check(folder, tmp_path) == []
