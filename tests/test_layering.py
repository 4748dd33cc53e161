"""The architecture as a test: each stage package of dsl/ imports only the stages before it, and
each room of interpreter/ only the rooms below it.

dsl order: core → frontend → passes → planner → simulator → fidelity → render → search. ``core`` imports nothing of
dhelix; ``dsl`` never imports torch, the interpreter, the Python API or the command line.

interpreter rooms, top to bottom: launch and measure → training → execute → verify → ops. A room
imports its own modules, the rooms below it and dsl; never a room above or beside it, the
interpreter package as a whole, the Python API (``dhelix.api``) or the command line.

Every source file is read, package ``__init__``s included. What a package's ``__init__`` imports,
every module of the package imports first, so ``dsl/__init__.py`` and ``dhelix/__init__.py`` (the
parent of both trees) keep the rules of the lowest stage, ``core``, and ``interpreter/__init__.py``
those of the lowest room, ``ops``. Nothing but the command line (and ``python -m dhelix``) imports
the command line; the Python API (``dhelix/api.py``) may import dsl and the interpreter.

Imports are read from the source with :mod:`ast`, including the ones inside functions:
``import a.b``; ``from a import b`` (read as ``a.b``: ``b`` may be a module), relative ones
resolved against the file's package; and the dynamic ones naming their module in a string —
``importlib.import_module("m")`` and ``import_module("..m", __package__)`` (relative, resolved the
way importlib does), ``__import__("m", fromlist=[...], level=n)`` and
``pkgutil.resolve_name("m:attr")``, under any name they are imported as. An f-string counts by its
constant head: ``f"dhelix.cli.{x}"`` imports ``dhelix.cli``. A module name computed at run time is
not read.
"""

from __future__ import annotations

import ast
import functools
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("core", "frontend", "passes", "planner", "simulator", "fidelity", "render", "search")
#: The interpreter's rooms by level, top first; a room may import the rooms of later levels.
ROOMS = (("launch", "measure"), ("training",), ("execute",), ("verify",), ("ops",))
#: The source folders read, by the package each installs as.
TREES = {"dhelix": "dhelix", "dsl": "dhelix.dsl", "interpreter": "dhelix.interpreter"}
#: The functions that import the module their first argument names, by the module defining them.
DYNAMIC = {"import_module": "importlib", "__import__": "builtins", "resolve_name": "pkgutil"}


# --- reading the imports -------------------------------------------------------------------------

def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """Every module ``path`` (a source file under ``root``) imports, absolute, with its line
    number: import statements, and calls of ``import_module``, ``__import__`` and
    ``resolve_name``."""
    relative = path.relative_to(root)
    package = _package_of(relative)
    name = package if relative.name == "__init__.py" else f"{package}.{relative.stem}"
    return _imports_in(path.read_text(), str(relative), package, name)


@functools.cache
def _imports_in(text: str, filename: str, package: str, name: str) -> list[tuple[int, str]]:
    """The imports of a module's source ``text`` (cached: the mutant tests read the tree again
    with one file changed)."""
    tree = ast.parse(text, filename)
    dynamic = _dynamic_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, package)
            found += [(node.lineno, base if alias.name == "*" else _join(base, alias.name))
                      for alias in node.names]
        elif isinstance(node, ast.Call):
            function = dynamic.get(_called_name(node.func))
            if function:
                found += [(node.lineno, module)
                          for module in _dynamic_modules(function, node, package, name) if module]
    return found


def _dynamic_names(tree: ast.Module) -> dict[str | None, str]:
    """The names under which the module calls the dynamic importers: their own names (also as
    attributes: ``importlib.import_module``) and any ``from importlib import import_module as
    load``."""
    names: dict[str | None, str] = {function: function for function in DYNAMIC}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level:
            for alias in node.names:
                if DYNAMIC.get(alias.name) == node.module and alias.asname:
                    names[alias.asname] = alias.name
    return names


def _called_name(func: ast.expr) -> str | None:
    """``import_module`` for ``importlib.import_module(...)`` or ``import_module(...)``."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _argument(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    """A call's argument given by position ``index`` or by ``keyword``; None when absent."""
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args[:index + 1]):
        return call.args[index]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _dynamic_modules(function: str, call: ast.Call, package: str, name: str) -> list[str]:
    """The modules a call of a dynamic importer imports, absolute; [] when it names them by a
    value computed at run time."""
    named = _argument(call, 0, "name")
    module = _literal_module(named) if named is not None else None
    if module is None:
        return []
    if function == "resolve_name":  # "pkg.mod:attr", or a dotted path that may end in attributes
        return [module.partition(":")[0]]
    level = len(module) - len(module.lstrip("."))
    if function == "import_module":
        anchor = _anchor(_argument(call, 1, "package"), package, name) if level else package
        return [_resolve(module[level:], level, anchor)]
    # __import__(name, globals, locals, fromlist, level): relative to the calling module's package
    level_node = _argument(call, 4, "level")
    if isinstance(level_node, ast.Constant) and isinstance(level_node.value, int):
        level = level_node.value
    base = _resolve(module.lstrip("."), level, package)
    fromlist = _argument(call, 3, "fromlist")
    names = [e.value for e in fromlist.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)] \
        if isinstance(fromlist, (ast.List, ast.Tuple)) else []
    return [_join(base, item) for item in names] or [base]


def _anchor(node: ast.expr | None, package: str, name: str) -> str:
    """The package a relative ``import_module`` resolves against: ``__package__``, ``__name__``
    or a string literal; any other value is taken as the calling module's package."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id == "__name__":
        return name
    return package


def _literal_module(arg: ast.expr) -> str | None:
    """The module a dynamic import names: a string literal, or an f-string's constant head up to
    its last dot (its leading dots kept: ``f"..{x}"`` is the parent package); None for anything
    computed."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value)
        dots = len(head) - len(head.lstrip("."))
        return (head[:dots] + head[dots:].rpartition(".")[0]) or None
    return None


def _resolve(module: str, level: int, package: str) -> str:
    """A relative module name made absolute the way the import system does: ``level`` 1 is
    ``package`` itself, 2 its parent, and so on."""
    if not level:
        return module
    parts = package.split(".")
    return _join(".".join(parts[:max(len(parts) - level + 1, 0)]), module)


def _join(package: str, module: str) -> str:
    return f"{package}.{module}" if package and module else package or module


def _package_of(relative: Path) -> str:
    """The dotted package a source file (a path relative to the root) belongs to, as installed
    (``dsl/core/x.py`` → ``dhelix.dsl.core``)."""
    top, *rest = relative.parent.parts
    return ".".join([TREES[top], *rest])


# --- the rules -----------------------------------------------------------------------------------

def place_of(relative: Path) -> str:
    """The rule a source file keeps: ``dsl/<stage>``, ``interpreter/<room>``, ``api`` or
    ``cli``. A package ``__init__`` keeps the rule of its package's lowest level."""
    parts = relative.parts
    if parts[0] == "dhelix":
        return {"__init__.py": "dsl/core", "api.py": "api"}.get(parts[1], "cli")
    if len(parts) == 2:  # dsl/__init__.py, interpreter/__init__.py
        return "dsl/core" if parts[0] == "dsl" else f"interpreter/{ROOMS[-1][0]}"
    return f"{parts[0]}/{parts[1]}"


def _level(room: str) -> int:
    return next(i for i, level in enumerate(ROOMS) if room in level)


def allows(place: str, module: str) -> bool:
    """Whether a file keeping the rule ``place`` may import ``module`` (absolute)."""
    parts = module.split(".")
    if parts[0] in ("dsl", "interpreter"):  # the source folders: a second copy of the packages
        return False
    if place == "cli":
        return True
    if parts[0] != "dhelix":
        return not (parts[0] == "torch" and place.startswith("dsl/"))
    if len(parts) < 3 or parts[1] not in ("dsl", "interpreter"):  # dhelix, dhelix.api, dhelix.cli, …
        return place == "api" and parts[1:2] not in (["cli"], ["__main__"]) and len(parts) > 1
    tree, level = parts[1], parts[2]
    if place == "api":
        return True
    where, own = place.split("/")
    if where == "dsl":
        return tree == "dsl" and level in STAGES[:STAGES.index(own) + 1]
    return tree == "dsl" or level in {own} | {r for lv in ROOMS[_level(own) + 1:] for r in lv}


def sources(root: Path = ROOT) -> list[Path]:
    """Every source file of the three trees under ``root``, sorted."""
    return sorted(path for folder in TREES for path in (root / folder).rglob("*.py"))


def violations(root: Path = ROOT) -> list[str]:
    """Every import under ``root`` that its file's rule forbids, as ``path:line: module``."""
    wrong = []
    for path in sources(root):
        relative = path.relative_to(root)
        place = place_of(relative)
        wrong += [f"{relative}:{line}: {module}" for line, module in imported_modules(path, root)
                  if not allows(place, module)]
    return wrong


@functools.cache
def _real_violations() -> tuple[str, ...]:
    return tuple(violations())


def _in(folder: str) -> list[str]:
    return [v for v in _real_violations() if v.startswith(folder)]


# --- the real tree -------------------------------------------------------------------------------

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
    wrong = _in(f"dsl/{stage}/")
    assert wrong == [], f"dsl/{stage} may import only the stages up to it:\n" + "\n".join(wrong)


@pytest.mark.parametrize("room", [room for level in ROOMS for room in level])
def test_a_room_imports_only_rooms_below_it(room):
    wrong = _in(f"interpreter/{room}/")
    assert wrong == [], f"interpreter/{room} may import only the rooms below it and dsl:\n" + "\n".join(wrong)


def test_the_package_inits_and_the_api_keep_their_rules():
    checked = ["dhelix/__init__.py", "dsl/__init__.py", "interpreter/__init__.py", "dhelix/api.py"]
    assert all((ROOT / path).is_file() for path in checked)
    wrong = [v for path in checked for v in _in(path + ":")]
    assert wrong == []


def test_only_the_command_line_imports_the_command_line():
    wrong = [f"{path.relative_to(ROOT)}:{line}: {module}"
             for path in sources()
             if place_of(path.relative_to(ROOT)) != "cli"
             for line, module in imported_modules(path)
             if module == "dhelix.cli" or module.startswith("dhelix.cli.")]
    assert wrong == []


def test_the_whole_tree_is_read():
    assert _real_violations() == ()
    read = {str(path.relative_to(ROOT)) for path in sources()}
    assert {"dsl/__init__.py", "interpreter/__init__.py", "dhelix/__init__.py", "dhelix/api.py",
            "dsl/core/__init__.py", "interpreter/ops/comm.py", "dhelix/cli/run.py"} <= read


# --- the checker catches a mutant ----------------------------------------------------------------

#: A real module, a forbidden import added to it, and the module the checker must name.
MUTANTS = [
    ("dsl/core/errors.py", "from dhelix.dsl.simulator import events", "dhelix.dsl.simulator.events"),
    ("dsl/core/errors.py", "import importlib\nimportlib.import_module('dhelix.dsl.render.text')",
     "dhelix.dsl.render.text"),
    ("dsl/core/errors.py", "__import__('dhelix.dsl.planner.costmodel')", "dhelix.dsl.planner.costmodel"),
    ("dsl/core/errors.py", "from importlib import import_module\nimport_module('..simulator.events', __package__)",
     "dhelix.dsl.simulator.events"),
    ("dsl/core/errors.py", "import pkgutil\npkgutil.resolve_name('dhelix.dsl.render.text:render')",
     "dhelix.dsl.render.text"),
    ("dsl/core/errors.py", "from dhelix import interpreter", "dhelix.interpreter"),
    ("dsl/frontend/check.py", "from dhelix import api", "dhelix.api"),
    ("interpreter/ops/comm.py", "from ..execute import executor", "dhelix.interpreter.execute.executor"),
    ("interpreter/ops/comm.py",
     "from importlib import import_module\nimport_module(f'dhelix.interpreter.training.{x}')",
     "dhelix.interpreter.training"),
    ("interpreter/ops/comm.py", "__import__('dhelix.interpreter.verify.harness')",
     "dhelix.interpreter.verify.harness"),
    # the five holes the issue named (#57)
    ("interpreter/ops/comm.py", "from importlib import import_module\nimport_module('..training.train', __package__)",
     "dhelix.interpreter.training.train"),
    ("interpreter/ops/comm.py", "import pkgutil\npkgutil.resolve_name('dhelix.interpreter.training.train:train')",
     "dhelix.interpreter.training.train"),
    ("interpreter/training/train.py", "import dhelix.api", "dhelix.api"),
    ("interpreter/training/train.py", "from dhelix import api", "dhelix.api"),
    ("dsl/__init__.py", "import torch", "torch"),
    ("interpreter/ops/comm.py", "from dhelix import interpreter", "dhelix.interpreter"),
    # their cousins
    ("interpreter/ops/comm.py", "from importlib import import_module as load\nload('dhelix.interpreter.launch.spawn')",
     "dhelix.interpreter.launch.spawn"),
    ("interpreter/ops/comm.py", "import importlib\nimportlib.import_module(f'..{x}', __package__)",
     "dhelix.interpreter"),
    ("interpreter/ops/comm.py", "__import__('training', globals(), None, ['train'], 2)",
     "dhelix.interpreter.training.train"),
    ("interpreter/ops/comm.py", "__import__('dhelix.interpreter', fromlist=['training'])",
     "dhelix.interpreter.training"),
    ("interpreter/ops/comm.py", "from ... import cli", "dhelix.cli"),
    ("interpreter/execute/si.py", "from .. import launch", "dhelix.interpreter.launch"),
    ("interpreter/__init__.py", "from .training import train", "dhelix.interpreter.training.train"),
    ("dhelix/__init__.py", "import torch", "torch"),
    ("dhelix/__init__.py", "from dhelix.interpreter.ops import comm", "dhelix.interpreter.ops.comm"),
    ("dhelix/api.py", "from dhelix.cli import main", "dhelix.cli.main"),
    ("dsl/passes/fold.py", "import dsl.core.errors", "dsl.core.errors"),
]


def _copy_tree(tmp_path: Path) -> Path:
    """The three trees' sources copied under ``tmp_path``."""
    for folder in TREES:
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=lambda d, names: [n for n in names
                                                 if not n.endswith(".py") and not (Path(d) / n).is_dir()
                                                 or n == "__pycache__"])
    return tmp_path


def _mutate(root: Path, relative: str, added: str) -> None:
    """``added`` put inside a function at the end of ``root``/``relative``."""
    target = root / relative
    body = "\n".join("    " + line for line in added.splitlines())
    target.write_text(target.read_text() + f"\n\ndef _mutant(x):\n{body}\n")


@pytest.mark.parametrize("relative,added,module", MUTANTS)
def test_a_forbidden_import_is_caught(tmp_path, relative, added, module):
    root = _copy_tree(tmp_path)
    _mutate(root, relative, added)
    wrong = violations(root)
    assert len(wrong) == 1 and wrong[0].startswith(relative + ":") and wrong[0].endswith(": " + module), wrong


def test_the_unmutated_copy_passes(tmp_path):
    root = _copy_tree(tmp_path)
    for relative in {relative for relative, _, _ in MUTANTS}:
        _mutate(root, relative, "importlib.import_module(name)\n__import__(x)")  # computed: not read
    _mutate(root, "interpreter/ops/comm.py", "from . import weights\nimport_module('.weights', __package__)")
    _mutate(root, "interpreter/training/train.py", "import_module('..execute.executor', __package__)")
    _mutate(root, "dhelix/api.py", "import dhelix.interpreter.training.train")
    assert violations(root) == []
