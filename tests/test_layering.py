"""The architecture as a test: each stage package of dsl/ imports only the stages before it.

Order: core → frontend → passes → planner → simulator → render. ``core`` imports nothing of
dhelix; ``dsl`` never imports torch, the interpreter or the command line; nothing but the
command line (and ``python -m dhelix``) imports the command line. Imports are read from the
source with :mod:`ast`, including the ones inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("core", "frontend", "passes", "planner", "simulator", "render")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, absolute, with its line number."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's own package
                package = ".".join(_package_of(path).split(".")[:len(_package_of(path).split(".")) - node.level + 1])
                found += [(node.lineno, f"{package}.{node.module}" if node.module else package)]
            else:
                found += [(node.lineno, node.module)]
    return found


def _package_of(path: Path) -> str:
    """The dotted package a source file belongs to, as installed (``dsl/core/x.py`` →
    ``dhelix.dsl.core``)."""
    parts = path.relative_to(ROOT).parent.parts
    return ".".join(("dhelix",) + parts) if parts and parts[0] != "dhelix" else ".".join(parts)


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_every_dsl_module_lives_in_a_stage_package():
    loose = [p.name for p in (ROOT / "dsl").glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"modules outside a stage package: {loose}"
    assert sorted(p.name for p in (ROOT / "dsl").iterdir() if p.is_dir() and p.name != "__pycache__") \
        == sorted(STAGES)


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_only_stages_before_it(stage):
    allowed = {f"dhelix.dsl.{s}" for s in STAGES[:STAGES.index(stage) + 1]}
    wrong = []
    for path in sources(f"dsl/{stage}"):
        for line, module in imported_modules(path):
            if module.split(".")[0] in ("torch", "interpreter"):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module}")
            elif module.startswith("dhelix") and ".".join(module.split(".")[:3]) not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert wrong == [], f"{stage} may import only {sorted(allowed)}:\n" + "\n".join(wrong)


def test_only_the_command_line_imports_the_command_line():
    wrong = [f"{path.relative_to(ROOT)}:{line}: {module}"
             for folder in ("dsl", "interpreter")
             for path in sources(folder)
             for line, module in imported_modules(path)
             if module == "dhelix.cli" or module.startswith("dhelix.cli.")]
    assert wrong == []

