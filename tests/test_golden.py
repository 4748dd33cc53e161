"""Golden IR dumps of every standard-library and example file, at each front-end stage."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT, shipped_files
from dhelix.dsl.passes import dump_stage, run_until

STAGES = ("check", "autodiff", "fold", "validate")


@pytest.mark.parametrize("path", shipped_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
@pytest.mark.parametrize("stage", STAGES)
def test_dump_matches_golden(path, stage, golden):
    os.chdir(ROOT)  # imports and messages use paths relative to the repository
    relative = str(path.relative_to(ROOT))
    result = run_until(path.read_text(), relative, stage)
    golden(f"{stage}/{path.parent.name}/{path.stem}.txt", dump_stage(stage, result))
