"""Where the parser's analysed grammar is cached between commands, and the seal that keeps a
corrupt cache file from being read.

Building the LALR tables is most of a short command's time, so lark caches them in a file.
Lark keys the file on the grammar text and the options (a changed grammar rebuilds) and
falls back to building when the file is unreadable, but it unpickles part of the file before
checking it: random bytes there once made the unpickler print a ``SystemError`` to stderr.
So each file is sealed with its digest (``<file>.sha256``) once lark has written it, and a
file that does not match its seal (corrupt, cut short, or from before seals) is removed
before lark reads it. A cache folder that cannot be created (read-only home, no home) means
no cache, not an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

from dhelix.dsl.core.errors import OutputError
from dhelix.dsl.core.outputfile import write_text_atomically

#: The suffix of the file that holds the digest of a cached grammar.
SEAL = ".sha256"


def cache_dir() -> Path:
    """Where the built parser is cached: ``$DHELIX_CACHE_DIR``, else ``$XDG_CACHE_HOME/dhelix``,
    else ``~/.cache/dhelix``."""
    if os.environ.get("DHELIX_CACHE_DIR"):
        return Path(os.environ["DHELIX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dhelix"


def usable_file(builder: str) -> str | None:
    """The file the grammar is cached in (``builder``: the parser library and its version,
    in the name with Python's, as its pickled tables are not portable across them), with a
    file that does not match its seal removed; None when no cache can be kept."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    cache = str(folder / f"dhelix-grammar-{builder}-py{sys.version_info[0]}{sys.version_info[1]}.lark-cache")
    _drop_unsealed(cache)
    return cache


def seal(cache: str) -> None:
    """Write the digest of the cache file the parser left (if any) next to it, atomically."""
    try:
        digest = hashlib.sha256(Path(cache).read_bytes()).hexdigest()
        write_text_atomically(cache + SEAL, digest + "\n")
    except (OSError, OutputError):
        pass  # no seal: the next command rebuilds the cache


def _drop_unsealed(cache: str) -> None:
    """Remove ``cache`` unless its seal holds its digest."""
    try:
        data = Path(cache).read_bytes()
    except OSError:
        return  # none yet
    try:
        sealed = Path(cache + SEAL).read_text().strip()
    except (OSError, UnicodeDecodeError):
        sealed = None
    if sealed != hashlib.sha256(data).hexdigest():
        with contextlib.suppress(OSError):
            os.remove(cache)
