"""Writing the files dhelix makes: the one "write a temporary, then rename" of every output.

:func:`write_atomically` writes a file through a temporary beside it (``.NAME.partial-PID``)
renamed over it once complete, so that a failed write leaves neither a partial file nor a
truncated old one: the temporary is removed whatever fails, and a system error becomes an
:class:`~.errors.OutputError` naming the file and the system's reason (exit 1: the command
line was right). An existing device or pipe (``/dev/null``) is written directly, as renaming
over it would replace it. Every output goes through here: command outputs, exported weights
(``torch.save``, Hugging Face folders), a checkpoint's manifest and ``latest`` pointer, the
step log's rewrite on resume, the grammar cache's seal.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from .errors import OutputError


def write_atomically(path: str | Path, write: Callable[[Path], object], *, what: str | None = None,
                     durable: bool = False) -> None:
    """Make the file ``path`` by calling ``write`` with the path to write (a temporary beside
    ``path``, renamed over it afterwards; ``path`` itself when it is a device or a pipe).
    ``durable`` syncs the data to the disk before the rename (a checkpoint's manifest).
    Raises OutputError("cannot write {what} to 'path'" or "cannot write 'path'", the OSError
    as its ``__cause__``) when ``write`` or the rename raises OSError; whatever it raises, the
    temporary is gone."""
    path = Path(path)
    direct = path.exists() and not path.is_file()
    partial = path if direct else path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        write(partial)
        if durable and not direct:
            _sync(partial)
        if not direct:
            os.replace(partial, path)
    except OSError as exc:
        target = f"{what} to '{path}'" if what else f"'{path}'"
        raise OutputError(f"cannot write {target}: {exc.strerror or exc}",
                          notes=[] if direct else ["nothing was written there (the partial file was removed)"]) \
            from exc
    finally:
        if not direct:
            try:
                partial.unlink(missing_ok=True)
            except OSError:
                pass  # a folder we may no longer write to: nothing was made there either


def write_text_atomically(path: str | Path, text: str, *, what: str | None = None, durable: bool = False) -> None:
    """:func:`write_atomically` of the UTF-8 ``text``."""
    write_atomically(path, lambda target: target.write_text(text, encoding="utf-8"), what=what, durable=durable)


def _sync(path: Path) -> None:
    with open(path, "rb+") as data:
        os.fsync(data.fileno())
