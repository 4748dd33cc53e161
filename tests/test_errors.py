"""Every user mistake gets a precise message: the full rendering is compared, line by line.

Each case is a wrong program ``tests/errors/NAME.dhx`` (its first line, a comment, says what
is wrong) with the whole expected message in ``tests/errors/NAME.expected``. Files named
``NAME.PART.dhx`` are helpers the case imports (an import cycle needs two files), and
``NAME.PART.yaml`` hardware profiles it names. A case
and its helpers are copied into a temporary folder and checked there; the folder's path is
shown as ``TMP`` in the expected messages. ``pytest --update-golden`` rewrites the
``.expected`` files from the current messages: review the diff before committing it.

The command line is tested end to end: exit code 1 and the message on stderr for a wrong
program, exit code 2 for a wrong command line, never a traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.options import train_keys
from dhelix.dsl.frontend.imports import stdlib_root
from dhelix.dsl.passes.pipeline import check_text

CASES_DIR = Path(__file__).resolve().parent / "errors"
CASES = sorted(p.stem for p in CASES_DIR.glob("*.dhx") if "." not in p.stem)


def _message(name: str, folder: Path) -> str:
    """The rendered error of case ``name``, checked as a copy in ``folder``."""
    for source in [*CASES_DIR.glob(f"{name}.*dhx"), *CASES_DIR.glob(f"{name}.*.yaml")]:
        shutil.copy(source, folder / source.name)
    path = folder / f"{name}.dhx"
    with pytest.raises(DhelixError) as caught:
        check_text(path.read_text(), str(path))
    return caught.value.render().replace(str(folder), "TMP") + "\n"


def _stdlib_listing() -> str:
    # The standard library grows; a missing-import message lists what it holds today.
    return ", ".join(sorted(p.name for p in stdlib_root().glob("*.dhx")))


def _train_settings() -> str:
    # The train block's keys as dhelix.dsl.core.options declares them: a new one changes no golden.
    return ", ".join(train_keys())


#: What an expected message writes in place of a list that grows: the stdlib's files, the train keys.
PLACEHOLDERS = {"{STDLIB_FILES}": _stdlib_listing, "{TRAIN_SETTINGS}": _train_settings}


def _expected(name: str) -> str:
    text = (CASES_DIR / f"{name}.expected").read_text()
    for placeholder, listing in PLACEHOLDERS.items():
        text = text.replace(placeholder, listing())
    return text


def _generalized(message: str) -> str:
    for placeholder, listing in PLACEHOLDERS.items():
        message = message.replace(listing(), placeholder)
    return message


@pytest.mark.parametrize("name", CASES)
def test_error_message(name, tmp_path):
    message = _message(name, tmp_path)
    expected_path = CASES_DIR / f"{name}.expected"
    if os.environ.get("DHELIX_UPDATE_GOLDEN") == "1":
        expected_path.write_text(_generalized(message))
        return
    if not expected_path.exists():
        pytest.fail(f"{expected_path.name} is missing; run pytest --update-golden and review it")
    assert message == _expected(name)


@pytest.mark.parametrize("name", CASES)
def test_message_is_located(name, tmp_path):
    """Every message starts at a position in one of the case's files (or in the standard
    library file whose `require` failed, with a note locating the case's sizes), underlines the
    source there and never prints a Python value such as 'None'."""
    message = _message(name, tmp_path)
    assert message.startswith("TMP/") or (message.startswith("stdlib/") and "TMP/" in message), message
    assert "^" in message
    assert "None" not in message


def test_every_expected_file_has_its_case():
    stale = sorted(p.stem for p in CASES_DIR.glob("*.expected") if p.stem not in CASES)
    assert not stale
    assert len(CASES) >= 40


# --- the command line, end to end ------------------------------------------------------------

def _dhelix(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dhelix", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("name", ["parse_missing_brace_before_block", "shape_gemm_in_features", "import_cycle"])
def test_cli_prints_the_message_and_exits_1(name, tmp_path):
    _message(name, tmp_path)  # copies the case and its helpers
    result = _dhelix("check", str(tmp_path / f"{name}.dhx"), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.replace(str(tmp_path), "TMP") == _expected(name)


def test_cli_reports_every_error_of_a_program(tmp_path):
    path = tmp_path / "two.dhx"
    path.write_text("layer a {\n  in x\n  y = rmsnorn(x)\n  out y\n}\n"
                    "layer b {\n  in x\n  y = gemm(x, 1)\n  out y\n}\n")
    result = _dhelix("check", "two.dhx", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        "two.dhx:3:7: unknown operator 'rmsnorn'\n"
        "  3 |   y = rmsnorn(x)\n"
        "    |       ^^^^^^^\n"
        "  note: did you mean 'rmsnorm'?\n"
        "  note: operators: add, all_gather, all_reduce, all_to_all, attention, gelu, gemm, grouped_gemm, layernorm, "
        "permute, recv, reduce_scatter, rmsnorm, router, send, swiglu, unpermute\n"
        "two.dhx:8:7: gemm() is missing its 'out_features' argument\n"
        "  8 |   y = gemm(x, 1)\n"
        "    |       ^^^^\n"
        "  note: usage: gemm(x, in_features, out_features, [bias])\n"
        "2 errors\n")


@pytest.mark.parametrize("args, message", [
    (["check", "missing.dhx"], "dhelix: cannot read 'missing.dhx': No such file or directory\n"),
    (["check", "."], "dhelix: cannot read '.': Is a directory\n"),
])
def test_cli_usage_errors_exit_2(args, message, tmp_path):
    result = _dhelix(*args, cwd=tmp_path)
    assert (result.returncode, result.stderr) == (2, message)


def test_cli_bad_dump_stage_exits_2(tmp_path):
    (tmp_path / "lib.dhx").write_text("layer a {\n  in x\n  y = rmsnorm(x)\n  out y\n}\n")
    result = _dhelix("check", "lib.dhx", "--dump", "bogus", cwd=tmp_path)
    assert result.returncode == 2
    assert "argument --dump: invalid choice: 'bogus'" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_non_utf8_file_exits_2(tmp_path):
    (tmp_path / "bin.dhx").write_bytes(b"\xff\xfe model")
    result = _dhelix("check", "bin.dhx", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (2, "dhelix: 'bin.dhx' is not UTF-8 text: byte 0xff on line 1 is not UTF-8\n")
