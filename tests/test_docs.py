"""The language reference names every operator of the library with its real signature."""

from __future__ import annotations

from conftest import ROOT
from dhelix.dsl.core.oplib import OPS


def test_language_reference_lists_every_operator_with_its_usage():
    text = (ROOT / "docs" / "language.md").read_text()
    missing = [op.usage() for op in OPS.values() if f"`{op.usage()}`" not in text]
    assert not missing
