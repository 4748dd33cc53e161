"""Pre-tokenized training data: raw token files and NumPy ``.npy`` arrays, memory-mapped.

A raw token file (``.uint16``, ``.uint32``) is nothing but little-endian unsigned ids. A
``.npy`` file is NumPy's format: a header (a Python dict literal: ``descr``, ``fortran_order``,
``shape``) then the array's bytes; a token file must hold a 1-D array of integers
(:data:`NPY_DTYPES`), as ``numpy.save(path, ids.astype(numpy.uint16))`` writes. Either is
mapped, not read: the tensor returned is a private memory map of the file in its own dtype
(``torch.from_file``), so the file is not read into memory at once; the ids are checked
against the vocabulary in chunks. (Packing the windows and sampling batches take views and
rows of it; several files are joined into one stream in memory.) NumPy itself is not needed (the CPU build of torch may lack it).
"""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import torch

#: Raw token files: suffix → dtype of their little-endian unsigned ids.
RAW_DTYPES = {".uint16": torch.uint16, ".uint32": torch.uint32}
#: The ``.npy`` element types a token array may have (``descr``) → torch dtype.
NPY_DTYPES = {"|u1": torch.uint8, "<u2": torch.uint16, "<u4": torch.uint32, "|i1": torch.int8,
              "<i2": torch.int16, "<i4": torch.int32, "<i8": torch.int64}
#: Every suffix of a token file.
TOKEN_SUFFIXES = (*RAW_DTYPES, ".npy")
NPY_MAGIC = b"\x93NUMPY"
#: Ids checked against the vocabulary per chunk (bounded memory for a large mapped file).
CHECK_CHUNK = 1 << 24


class TokenFileError(ValueError):
    """A token file that cannot be used; the message says why (the caller adds where)."""


def is_token_file(path: Path) -> bool:
    """Whether ``path`` is named as a token file (:data:`TOKEN_SUFFIXES`)."""
    return path.suffix in TOKEN_SUFFIXES


def read_token_file(path: Path, vocab: int) -> torch.Tensor:
    """The ids of token file ``path`` as a 1-D tensor mapped from the file (its own integer
    dtype; convert rows with ``.long()`` as they are used). TokenFileError when the file is
    not a token file of its kind or holds an id outside ``[0, vocab)``."""
    size = path.stat().st_size
    if path.suffix == ".npy":
        dtype, offset, count = _npy_layout(path, size)
    else:
        dtype, offset = RAW_DTYPES[path.suffix], 0
        if size % dtype.itemsize:
            raise TokenFileError(f"'{path}' is {size} bytes, not a whole number of {8 * dtype.itemsize}-bit token ids")
        count = size // dtype.itemsize
    if count == 0:
        return torch.zeros(0, dtype=torch.long)
    raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)[offset:offset + count * dtype.itemsize]
    if offset % dtype.itemsize:  # a header not padded to the element size: copy to align
        raw = raw.clone()
    ids = raw.view(dtype)
    _check_range(path, ids, vocab)
    return ids


def _npy_layout(path: Path, size: int) -> tuple[torch.dtype, int, int]:
    """(dtype, offset of the data, number of ids) of the ``.npy`` file ``path``."""
    with open(path, "rb") as file:
        head = file.read(12)
        if len(head) < 10 or not head.startswith(NPY_MAGIC):
            raise TokenFileError(f"'{path}' is not a NumPy .npy file (no \\x93NUMPY header)")
        major = head[6]
        if major == 1:
            length, start = struct.unpack("<H", head[8:10])[0], 10
        elif major in (2, 3) and len(head) == 12:
            length, start = struct.unpack("<I", head[8:12])[0], 12
        else:
            raise TokenFileError(f"'{path}' is a .npy file of format version {major}, which is not read here")
        file.seek(start)
        text = file.read(min(length, 65_536))
    try:
        header = ast.literal_eval(text.decode("latin1").strip())
        descr, shape = header["descr"], tuple(header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError):
        raise TokenFileError(f"'{path}' has a .npy header that cannot be read") from None
    if not isinstance(descr, str) or descr not in NPY_DTYPES:
        raise TokenFileError(f"'{path}' holds {descr!r} elements; a token array holds integers "
                             f"({', '.join(NPY_DTYPES)})")
    if len(shape) != 1:
        raise TokenFileError(f"'{path}' holds an array of shape {shape}; a token array is 1-D "
                             "(flatten it: ids.reshape(-1))")
    dtype, offset, count = NPY_DTYPES[descr], start + length, shape[0]
    if offset + count * dtype.itemsize > size:
        raise TokenFileError(f"'{path}' is truncated: its header says {count} ids, the file holds fewer")
    return dtype, offset, count


def _check_range(path: Path, ids: torch.Tensor, vocab: int) -> None:
    """TokenFileError when an id of ``ids`` lies outside ``[0, vocab)``."""
    for start in range(0, ids.numel(), CHECK_CHUNK):
        chunk = ids[start:start + CHECK_CHUNK].long()
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0:
            raise TokenFileError(f"'{path}' holds token id {low}, a negative id")
        if high >= vocab:
            raise TokenFileError(f"'{path}' holds token id {high}, outside the model's vocab of {vocab}")
