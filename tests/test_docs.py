"""The language reference names every operator of the library with its real signature."""

from __future__ import annotations

from conftest import ROOT
from dhelix.dsl.core.oplib import OPS


def test_language_reference_lists_every_operator_with_its_usage():
    text = (ROOT / "docs" / "language.md").read_text()
    missing = [op.usage() for op in OPS.values() if f"`{op.usage()}`" not in text]
    assert not missing


def test_the_architecture_tour_names_every_module():
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = [path for folder in ("dsl", "interpreter", "dhelix") for path in (ROOT / folder).rglob("*.py")
               if path.name != "__init__.py"]
    missing = sorted(str(p.relative_to(ROOT)) for p in modules if not re.search(rf"\b{p.stem}\b", text))
    assert missing == [], f"docs/architecture.md does not name {missing}"
