"""Golden IR dumps of every standard-library and example file, at each front-end stage."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT, shipped_files
from dhelix.dsl.passes.pipeline import dump_stage, run_until

STAGES = ("check", "partition", "autodiff", "strands", "fold", "validate")


CASES = [(path, stage) for path in shipped_files()
         for stage in (STAGES if path.parent.name == "examples" else ("check",))]  # libraries: no model


@pytest.mark.parametrize(("path", "stage"), CASES, ids=lambda c: getattr(c, "name", c))
def test_dump_matches_golden(path, stage, golden):
    os.chdir(ROOT)  # imports and messages use paths relative to the repository
    relative = str(path.relative_to(ROOT))
    result = run_until(path.read_text(), relative, stage)
    golden(f"{stage}/{path.parent.name}/{path.stem}.txt", dump_stage(stage, result))
