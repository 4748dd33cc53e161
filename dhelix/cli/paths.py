"""The one check of an output path, shared by every command that writes a file.

``render -o``, ``export --torch-csv``, ``simulate --trace`` and ``run --trace`` refuse, with
exit code 2 and before any work:

- an output that is one of the command's input files: the program file, every file it
  imports (standard library files included) and its hardware profile's YAML, compared as
  real paths (symbolic links resolved, hard links seen by :func:`os.path.samefile`);
- an existing directory;
- a folder that does not exist or is not a folder;
- a place where nothing can be written (:func:`output_folder` probes a folder an output
  goes into, ``run --save``). That is found out by trying: an existing file is
  opened for appending (which changes nothing in it), otherwise a temporary file is created
  in the folder and removed. ``os.access`` is not asked, because it says yes to root even on
  a read-only file system.

The input files are known only once the program is checked (imports and profile), so a
command calls :func:`output_path` before it reads the program (comparing with the program
file) and :func:`refuse_inputs` with :func:`program_inputs` right after checking it, before
it plans, simulates, draws or trains. ``fmt`` rewrites its file in place and needs neither.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable

from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.core.outputfile import write_text_atomically
from dhelix.dsl.core.program import Program
from dhelix.dsl.frontend.imports import STDLIB_PREFIX, stdlib_root


def output_path(text: str, flag: str, *, inputs: Iterable[str | Path] = ()) -> Path:
    """``text``, the value of option ``flag``, as the Path of a file the command may write.

    Raises UsageError (exit 2) naming the option when ``text`` is an existing directory, when
    its folder is missing or not a folder, when it is one of ``inputs``, or when a probe
    shows that nothing can be written there. Leaves no file behind.
    """
    path = Path(text)
    try:
        if path.is_dir():
            raise UsageError(f"{flag} {text}: that is a folder; give the name of a file to write")
        folder = path.parent
        if not folder.exists():
            raise UsageError(f"{flag} {text}: the folder '{folder}' does not exist")
        if not folder.is_dir():
            raise UsageError(f"{flag} {text}: '{folder}' is not a folder")
        refuse_inputs(path, flag, inputs)
        _probe(path)
    except OSError as exc:  # a folder we may not even look into, or the probe's failure
        raise UsageError(f"{flag} {text}: cannot write there ({exc.strerror or exc})") from None
    return path


def refuse_inputs(output: Path, flag: str, inputs: Iterable[str | Path]) -> None:
    """Raise UsageError when ``output`` is the same file as one of ``inputs`` (real paths
    compared; for files that exist, also the same inode, i.e. a hard link)."""
    target = os.path.realpath(output)
    for name in inputs:
        same = os.path.realpath(name) == target
        if not same and os.path.exists(output) and os.path.exists(name):
            same = os.path.samefile(output, name)
        if same:
            raise UsageError(f"{flag} {output}: that is an input of this command ('{name}'); "
                             "writing there would overwrite it")


def program_inputs(program: Program) -> tuple[Path, ...]:
    """The files a checked program was read from: the file itself, every file it imports and
    its hardware profile's YAML. A name shown as ``stdlib/…`` stands for the installed
    standard library's file (and, to be safe, a file of that name in the working folder)."""
    names = list(program.files)
    if program.profile is not None and program.profile.path:
        names.append(program.profile.path)
    found = []
    for name in names:
        found.append(Path(name))
        if name.startswith(STDLIB_PREFIX):
            found.append(stdlib_root() / name[len(STDLIB_PREFIX):])
    return tuple(found)


def _probe(path: Path) -> None:
    """Raise OSError unless a file can be written at ``path``, changing nothing there."""
    if path.is_file():
        with open(path, "ab"):  # appending nothing: the file keeps its bytes
            return
    if path.exists():
        return  # a device or a pipe (e.g. /dev/null): the write itself will tell
    handle, probe = tempfile.mkstemp(prefix=".dhelix-probe-", dir=path.parent)
    os.close(handle)
    os.unlink(probe)


def write_output(path: Path, text: str) -> None:
    """Write ``text`` to the output ``path`` (:func:`~dhelix.dsl.core.outputfile.write_text_atomically`:
    a failed write leaves neither a partial file nor a truncated old one). OutputError (exit 1:
    the command line was right) when the system refuses anyway (a disk that filled up since the
    probe, a file made read-only meanwhile), with nothing left behind."""
    write_text_atomically(path, text)


def output_folder(text: str, flag: str) -> Path:
    """``text``, the value of option ``flag``, as a folder the command may create or add files
    to: an existing folder, or a new one in an existing folder; probed by creating (and
    removing) a file there. UsageError (exit 2) naming the option otherwise."""
    path = Path(text)
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {text}: that is a file; give a folder")
        where = path if path.exists() else path.parent
        if not where.exists():
            raise UsageError(f"{flag} {text}: the folder '{where}' does not exist")
        if not where.is_dir():
            raise UsageError(f"{flag} {text}: '{where}' is not a folder")
        handle, probe = tempfile.mkstemp(prefix=".dhelix-probe-", dir=where)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{flag} {text}: cannot write there ({exc.strerror or exc})") from None
    return path
