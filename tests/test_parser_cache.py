"""The analysed grammar is cached in the user's cache folder; a folder that cannot be made
or a corrupt cache file falls back to building the parser, with the same results."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = "examples/tiny_llama_cpu.dhx"


def check_with_cache(folder: Path | str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DHELIX_CACHE_DIR": str(folder)}
    return subprocess.run([sys.executable, "-m", "dhelix", "check", EXAMPLE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_first_command_writes_the_cache_and_the_next_reads_it(tmp_path):
    first = check_with_cache(tmp_path / "cache")
    cache, seal = sorted((tmp_path / "cache").iterdir(), key=lambda p: p.suffix == ".sha256")
    assert first.returncode == 0 and cache.stat().st_size > 0 and seal.name == cache.name + ".sha256"
    written = cache.stat().st_mtime_ns
    second = check_with_cache(tmp_path / "cache")
    assert second.returncode == 0 and second.stdout == first.stdout
    assert cache.stat().st_mtime_ns == written  # read, not rebuilt


def test_a_cache_folder_that_cannot_be_made_means_no_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")  # mkdir under a regular file fails, even for root
    result = check_with_cache(blocker / "cache")
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout and result.stderr == ""


@pytest.mark.parametrize("seed", range(8))
def test_a_corrupt_cache_file_is_rebuilt(tmp_path, seed):
    # Random bytes after lark's first line are unpickled by lark before it checks them; some
    # made the unpickler print "SystemError: deallocated bytearray object has exported
    # buffers" (once in a full run): a file that is not the one sealed is never read.
    assert check_with_cache(tmp_path).returncode == 0
    (cache,) = [p for p in tmp_path.iterdir() if p.suffix != ".sha256"]
    good = cache.read_bytes()
    rng = random.Random(seed)
    cache.write_bytes(good.split(b"\n", 1)[0] + b"\n" + rng.randbytes(64 + 64 * seed))
    result = check_with_cache(tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    rebuilt = cache.read_bytes()  # (pickled afresh: not byte for byte the first one)
    assert rebuilt.split(b"\n", 1)[0] == good.split(b"\n", 1)[0]
    assert (tmp_path / (cache.name + ".sha256")).read_text().strip() == hashlib.sha256(rebuilt).hexdigest()


def test_an_imported_file_is_parsed_once_per_text_and_again_once_edited(tmp_path):
    # Imported texts are parsed once a process (dhelix.dsl.frontend.imports): a program
    # loaded again shares its imports' modules, and an import edited in between is read anew.
    from dhelix.dsl.core import syntax as s
    from dhelix.dsl.core.errors import ParseError
    from dhelix.dsl.frontend.imports import load_modules

    main = 'import "lib.dhx"\nimport "stdlib/pipelines.dhx"\n'
    lib = tmp_path / "lib.dhx"

    def pipelines(modules) -> list[str]:
        return [item.name for item in modules[0].items if isinstance(item, s.PipelineDef)]

    lib.write_text("pipeline mine {\n  repeat m { F B }\n}\n")
    first, again = (load_modules(main, str(tmp_path / "main.dhx")) for _ in range(2))
    assert pipelines(first) == ["mine"] and again[0] is first[0] and again[1] is first[1]
    lib.write_text("pipeline other {\n  repeat m { F B }\n}\n")
    assert pipelines(load_modules(main, str(tmp_path / "main.dhx"))) == ["other"]
    lib.write_text("pipeline broken {\n")
    with pytest.raises(ParseError) as error:
        load_modules(main, str(tmp_path / "main.dhx"))
    assert "lib.dhx:1:17: unexpected end of file" in error.value.render()
