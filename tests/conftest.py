"""Shared test fixtures: golden files with an update flag.

``pytest --update-golden`` (or ``DHELIX_UPDATE_GOLDEN=1``) rewrites golden files instead of
comparing against them; a missing golden fails with a hint.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (the suite is deterministic: a CI run
# passes or fails for the code, not for the draw); `benchmarks/fuzz_programs.py` explores further.
settings.register_profile("dhelix", derandomize=True, database=None)
settings.load_profile("dhelix")

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
#: Seconds a test's `dhelix` subprocess may run before the test calls it hung: generous, as a
#: machine at load average 15 on 2 cores runs a 10-second run 10 times slower (issue 33 item 7:
#: the suite passes beside a CPU burner).
HANG_S = 600


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite golden files from the current output")


#: The test files that take longest (tests/test_tune.py: about 4 of the suite's 10 minutes on
#: one core), collected first: with `pytest -n 2 --dist loadfile` a worker takes a whole file,
#: and a long one handed out last leaves the other worker idle while it finishes.
FIRST = ("test_tune.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the rest keep their order


def pytest_configure(config):
    if config.getoption("--update-golden"):
        os.environ["DHELIX_UPDATE_GOLDEN"] = "1"


@pytest.fixture
def golden():
    """``golden(relative_path, text)``: compare ``text`` with tests/golden/<relative_path>."""

    def check(relative: str, text: str) -> None:
        path = GOLDEN / relative
        if os.environ.get("DHELIX_UPDATE_GOLDEN") == "1":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        if not path.exists():
            pytest.fail(f"golden file {path.relative_to(ROOT)} is missing; run pytest --update-golden and review it")
        assert text == path.read_text(), f"output differs from {path.relative_to(ROOT)} (pytest --update-golden)"

    return check


def shipped_files() -> list[Path]:
    """Every .dhx file of the standard library and the examples, sorted."""
    return sorted((ROOT / "stdlib_schedules").glob("*.dhx")) + sorted((ROOT / "examples").glob("*.dhx"))


@functools.cache
def docs_corpus() -> str:
    """The glob of the training corpus tests run on: a copy of the checkout's docs/*.md taken
    once per test session (removed at exit). Tests compare the losses of separate runs (a
    resumed run with the uninterrupted one), each of which reads its corpus afresh; the live
    docs change whenever a merge or an edit lands in the checkout mid-suite, and the runs of
    one test would then train on different text (a loss off by 0.1, not noise)."""
    frozen = Path(tempfile.mkdtemp(prefix="dhelix-test-docs-"))
    atexit.register(shutil.rmtree, frozen, True)
    for doc in sorted((ROOT / "docs").glob("*.md")):
        shutil.copyfile(doc, frozen / doc.name)
    return str(frozen / "*.md")


def tiny_example_text() -> str:
    """The text of examples/tiny_llama_cpu.dhx with its data path made absolute, so that a
    copy of it in another folder still trains on the docs (their frozen copy, :func:`docs_corpus`)."""
    text = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text()
    return text.replace('"../docs/*.md"', f'"{docs_corpus()}"')
