"""Reading the text files dhelix is given (programs, their imports, hardware profiles).

Every read goes through :func:`read_text_file`, which refuses what is not a regular file (a
device such as /dev/zero, a pipe, a folder) and files over :data:`MAX_FILE_BYTES`, so no
input can make a command read without end; it decodes UTF-8, dropping a leading byte-order
mark. Problems are raised as :class:`FileProblem` for each caller to word in its own terms
(a usage error for a command-line file, a located error for an import or a profile).
"""

from __future__ import annotations

import os
import stat

#: The largest file dhelix reads: far above any real program or profile (the largest
#: shipped file is under 20 KB), low enough that reading and parsing stay quick.
MAX_FILE_BYTES = 4 * 2**20
#: The longest name of one path component and of a whole path (Linux's NAME_MAX, PATH_MAX).
MAX_NAME_BYTES, MAX_PATH_BYTES = 255, 4096


class FileProblem(Exception):
    """Why a file cannot be read: ``reason`` completes "cannot read 'PATH': …";
    ``not_utf8`` is True when the bytes were read but are not UTF-8 text."""

    def __init__(self, reason: str, not_utf8: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.not_utf8 = not_utf8


def name_problem(path: str) -> str | None:
    """Why ``path`` cannot name a file on this system (a part or the whole too long), or None."""
    if "\0" in path:
        return "the path contains a NUL character"
    encoded = os.fsencode(path)
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if longest > MAX_NAME_BYTES:
        return f"a name in the path has {longest} bytes; the limit is {MAX_NAME_BYTES}"
    if len(encoded) > MAX_PATH_BYTES:
        return f"the path has {len(encoded)} bytes; the limit is {MAX_PATH_BYTES}"
    return None


def read_text_file(path: str | os.PathLike) -> str:
    """The UTF-8 text of the regular file ``path`` (a leading byte-order mark dropped).

    Raises :class:`FileProblem` for a missing or unreadable file, a name too long, a
    folder, device, pipe or socket, a file over :data:`MAX_FILE_BYTES` and bytes that are
    not UTF-8 (the reason then names the line of the first bad byte).
    """
    problem = name_problem(os.fspath(path))
    if problem:
        raise FileProblem(problem)
    try:
        # O_NONBLOCK: opening a named pipe must not wait for a writer before fstat sees it.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise FileProblem(exc.strerror or str(exc)) from None
    try:
        mode = os.fstat(fd)
        if stat.S_ISDIR(mode.st_mode):
            raise FileProblem("Is a directory")
        if not stat.S_ISREG(mode.st_mode):
            raise FileProblem("not a regular file (a device, pipe or socket); give a file")
        data = _read_bounded(fd, mode.st_size)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise FileProblem(f"byte 0x{data[exc.start]:02x} on line {line} is not UTF-8", not_utf8=True) from None


def _read_bounded(fd: int, size: int) -> bytes:
    if size > MAX_FILE_BYTES:
        raise FileProblem(_too_large(size))
    chunks, total = [], 0
    try:
        while total <= MAX_FILE_BYTES:  # the file may have grown since fstat
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise FileProblem(exc.strerror or str(exc)) from None
    data = b"".join(chunks)
    if len(data) > MAX_FILE_BYTES:
        raise FileProblem(_too_large(len(data)))
    return data


def _too_large(size: int) -> str:
    return f"the file has {size:,} bytes; dhelix reads files of at most {MAX_FILE_BYTES:,} bytes"
