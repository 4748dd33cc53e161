"""The analysed grammar is cached in the user's cache folder; a folder that cannot be made
or a corrupt cache file falls back to building the parser, with the same results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = "examples/tiny_llama_cpu.dhx"


def check_with_cache(folder: Path | str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DHELIX_CACHE_DIR": str(folder)}
    return subprocess.run([sys.executable, "-m", "dhelix", "check", EXAMPLE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_first_command_writes_the_cache_and_the_next_reads_it(tmp_path):
    first = check_with_cache(tmp_path / "cache")
    files = list((tmp_path / "cache").iterdir())
    assert first.returncode == 0 and len(files) == 1 and files[0].stat().st_size > 0
    written = files[0].stat().st_mtime_ns
    second = check_with_cache(tmp_path / "cache")
    assert second.returncode == 0 and second.stdout == first.stdout
    assert files[0].stat().st_mtime_ns == written  # read, not rebuilt


def test_a_cache_folder_that_cannot_be_made_means_no_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")  # mkdir under a regular file fails, even for root
    result = check_with_cache(blocker / "cache")
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout and result.stderr == ""


def test_a_corrupt_cache_file_is_rebuilt(tmp_path):
    assert check_with_cache(tmp_path).returncode == 0
    (cache,) = tmp_path.iterdir()
    cache.write_bytes(b"garbage\n" + os.urandom(64))
    result = check_with_cache(tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
