"""Pre-tokenized data (issue 31): NumPy ``.npy`` token arrays, memory-mapped, trained on as
their ids; any other binary file given as data is an error, not bytes to train on.

The ``.npy`` files are written here byte by byte in NumPy's format 1.0 (NumPy need not be
installed), as ``numpy.save`` lays them out: the magic, a header padded to 64 bytes, the data."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dhelix.cli import main  # noqa: E402
from dhelix.interpreter.training.data import DataSpec, load_corpus  # noqa: E402
from dhelix.interpreter.training.tokenfiles import read_token_file  # noqa: E402
from commands import dhelix_here  # noqa: E402

FORMATS = {"<u2": "<H", "<u4": "<I", "<i4": "<i", "<i8": "<q", "|u1": "<B", "<f4": "<f"}


def write_npy(path: Path, descr: str, values, shape=None) -> Path:
    """``values`` as NumPy's ``numpy.save`` would write them with dtype ``descr``."""
    shape = (len(values),) if shape is None else shape
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    data = struct.pack(f"<{len(values)}{FORMATS[descr][1:]}", *values)
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1") + data)
    return path


@pytest.mark.parametrize("descr", ["<u2", "<u4", "<i4", "<i8", "|u1"])
def test_a_npy_token_array_is_mapped_and_read_as_its_ids(descr, tmp_path):
    ids = [(7 * i + 3) % 200 for i in range(1000)]
    path = write_npy(tmp_path / "tokens.npy", descr, ids)
    mapped = read_token_file(path, vocab=256)
    assert mapped.long().tolist() == ids
    corpus = load_corpus(DataSpec(str(path)), vocab=256, seq=32)
    window = corpus.train[0].long().tolist()
    assert window == ids[:33]  # the first training window, in file order
    assert corpus.train.shape == (27, 33) and corpus.held_out.shape == (3, 33)


def test_a_run_trains_on_a_npy_file(tmp_path):

    from test_training import write_program

    path = write_npy(tmp_path / "tokens.npy", "<u2", [(5 * i) % 256 for i in range(2000)])
    result = dhelix_here("run", write_program(tmp_path, "one"), "--steps", "1", "--data", str(path), cwd=None)
    assert result.returncode == 0, result.stderr
    assert "loss: " in result.stdout


@pytest.mark.parametrize(("descr", "values", "shape", "message"), [
    ("<f4", [1.0, 2.0], None, "holds '<f4' elements; a token array holds integers (|u1, <u2, <u4, |i1, <i2, <i4, <i8)"),
    ("<u2", [1, 2, 3, 4], (2, 2), "holds an array of shape (2, 2); a token array is 1-D (flatten it: ids.reshape(-1))"),
    ("<u2", [1, 300], None, "holds token id 300, outside the model's vocab of 256"),
    ("<i4", [1, -2], None, "holds token id -2, a negative id"),
])
def test_a_npy_file_that_is_no_token_array_is_a_located_error(descr, values, shape, message, tmp_path, capsys):
    path = write_npy(tmp_path / "bad.npy", descr, values, shape)
    example = str(Path(__file__).resolve().parent.parent / "examples" / "tiny_llama_cpu.dhx")
    assert main(["run", example, "--data", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"error: '{path}' {message} (given by --data)" in err, err


def test_a_binary_file_given_as_data_is_refused(tmp_path, capsys):
    picture = tmp_path / "picture.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    example = str(Path(__file__).resolve().parent.parent / "examples" / "tiny_llama_cpu.dhx")
    assert main(["run", example, "--data", str(picture)]) == 1
    assert (f"error: '{picture}' is neither UTF-8 text nor a token file (.uint16, .uint32, .npy) (given by --data)"
            in capsys.readouterr().err)
    # In a folder it is skipped, as before: a folder of documents may hold pictures.
    (tmp_path / "notes.txt").write_text("some words to train on " * 40)
    corpus = load_corpus(DataSpec(str(tmp_path)), vocab=256, seq=32)
    assert corpus.train.shape[0] > 0
