"""Load a file and everything it imports.

An import path is resolved against the importing file's folder first, then the standard
library: ``import "stdlib/layers.dhx"`` names ``stdlib_schedules/layers.dhx`` of the
installed package. A file imported twice is loaded once; an import cycle is an error that
shows the chain. An imported text parsed before in this process is not parsed again.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import ErrorCollector, ImportFailure, UsageError
from dhelix.dsl.core.textfile import FileProblem, name_problem, read_text_file
from dhelix.dsl.frontend.parser import parse
from dhelix.dsl.core.wording import did_you_mean

STDLIB_PREFIX = "stdlib/"


def stdlib_root() -> Path:
    """The folder of the installed standard library files."""
    return Path(str(resources.files("dhelix.stdlib_schedules")))


def read_source(path: str) -> str:
    """The text of the schedule file ``path`` named on a command line; UsageError (exit 2)
    when it cannot be read or is not UTF-8."""
    try:
        return read_text_file(path)
    except FileProblem as exc:
        if exc.not_utf8:
            raise UsageError(f"'{path}' is not UTF-8 text: {exc.reason}") from None
        raise UsageError(f"cannot read '{path}': {exc.reason}") from None


def sources_digest(files: tuple[str, ...], text: str) -> str:
    """What identifies a program whatever profile prices it: the SHA-256 (16 hex digits) of
    its sources, ``files`` as a checked Program names them (its imports, then its own
    file, whose ``text`` is given: the text as compiled); an import is read now (``stdlib/…``
    from the installed library), and one that cannot be read counts as its name."""
    import hashlib

    digest = hashlib.sha256()
    for name in files[:-1]:
        path = stdlib_root() / name[len(STDLIB_PREFIX):] if name.startswith(STDLIB_PREFIX) else Path(name)
        try:
            body = read_text_file(str(path))
        except FileProblem:
            body = f"unreadable: {name}"
        digest.update(f"{len(body)}:".encode() + body.encode())
    digest.update(f"{len(text)}:".encode() + text.encode())
    return digest.hexdigest()[:16]


def load_modules(text: str, path: str) -> list[s.Module]:
    """Parse ``text`` (the file at ``path``) and its imports, transitively.

    Returns the modules in dependency order (imports before importers, the main file
    last). Raises ParseError for the first unparsable file and ImportFailure (several
    collected into an ErrorGroup) for missing files and cycles.
    """
    loader = _Loader()
    loader.visit(parse(text, path), Path(path), chain=())
    loader.errors.raise_if_any()
    return loader.order


def resolve_import(path: str, importer: Path) -> tuple[Path, str] | None:
    """The file an import of ``path`` from ``importer`` names and the name messages show
    for it (``stdlib/x.dhx`` for library files), or None if there is none."""
    local = importer.parent / path
    if _is_file(local):
        return local, str(local)
    if path.startswith(STDLIB_PREFIX):
        library = stdlib_root() / path[len(STDLIB_PREFIX):]
        if _is_file(library):
            return library, path
    return None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a path too long for the system names no file
        return False


class _Loader:
    def __init__(self) -> None:
        self.done: dict[Path, s.Module] = {}
        self.order: list[s.Module] = []
        self.errors = ErrorCollector()

    def visit(self, module: s.Module, path: Path, chain: tuple[Path, ...]) -> None:
        key = path.resolve()
        chain = chain + (key,)
        for item in module.items:
            if isinstance(item, s.Import):
                self._follow(item, path, chain)
        self.done[key] = module
        self.order.append(module)

    def _follow(self, item: s.Import, importer: Path, chain: tuple[Path, ...]) -> None:
        problem = name_problem(item.path)
        if problem:
            self.errors.add(ImportFailure(f"cannot import this file: {problem}", item.span_of("path")))
            return
        found = resolve_import(item.path, importer)
        if found is None:
            notes = [f"looked for {importer.parent / item.path}"]
            if item.path.startswith(STDLIB_PREFIX):
                known = sorted(p.name for p in stdlib_root().glob("*.dhx"))
                notes.append(f"and in the standard library, which has: {', '.join(known)}")
                notes += did_you_mean(item.path, [STDLIB_PREFIX + name for name in known])
            else:
                notes.append('standard library files are imported as "stdlib/<file>.dhx"')
            self.errors.add(ImportFailure(f"cannot find imported file '{item.path}'",
                                          item.span_of("path"), notes))
            return
        target, shown = found
        key = target.resolve()
        if key in chain:
            cycle = " -> ".join(p.name for p in chain[chain.index(key):] + (key,))
            self.errors.add(ImportFailure(f"import cycle: {cycle}", item.span_of("path"),
                                          ["break the cycle by moving shared definitions into a third file"]))
            return
        if key in self.done:
            return
        try:
            text = read_text_file(target)
        except FileProblem as exc:
            what = "is not UTF-8 text" if exc.not_utf8 else "cannot be read"
            self.errors.add(ImportFailure(f"imported file '{item.path}' {what}: {exc.reason}",
                                          item.span_of("path"), ["save it as UTF-8 text"] if exc.not_utf8 else []))
            return
        self.visit(_parsed_import(text, shown), target, chain)


@functools.lru_cache(maxsize=32)
def _parsed_import(text: str, shown: str) -> s.Module:
    """``parse(text, shown)``, once per text and name: the modules are immutable, and the
    library's pipelines.dhx and layers.dhx took most of a compile's time (50 of 70 ms for the
    tiny example), paid again by every program a search, a test or a rank compiles."""
    return parse(text, shown)
