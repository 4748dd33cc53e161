"""Training data: a byte-level corpus or raw token files, packed into sequences, in a seeded
order that does not depend on the layout.

A data path is a file, a folder (every regular file under it, sorted by relative path;
hidden files and files that are neither UTF-8 text nor token files are skipped, so a
folder of documents with pictures in it works) or a glob pattern (``docs/*.md``, matches
sorted). A token file (pre-tokenized, e.g. by a BPE tokenizer: raw little-endian ``.uint16``
or ``.uint32`` ids, or a 1-D integer NumPy ``.npy`` array) is memory-mapped
(:mod:`.tokenfiles`); any other file is UTF-8 text, tokenized byte-level (token = byte value,
so the model's vocab must be at least 256), or with ``--tokenizer tokenizer.json`` by that
Hugging Face tokenizer, each file a document ended by the tokenizer's end-of-text id
(:mod:`.tokenizer`). A file given alone or matched by a pattern that
is neither is an error (a folder skips it, as it does pictures). The files'
tokens are concatenated into one stream; its last :data:`HELD_OUT` part is held out for
evaluation (or, with ``--eval-data``, all of it is trained on and that data is held out),
and each part is packed into windows of ``seq + 1`` tokens that do not overlap
(inputs are a window's first ``seq`` tokens, targets its last ``seq``).

Order: training sample ``j`` (counted from the first step) is window ``perm_e[j mod n]`` of
epoch ``e = j // n``, ``perm_e`` a permutation seeded by the run's seed and ``e``. Step k's
global batch holds samples ``[k·B, (k+1)·B)`` with ``B = dp · microbatches · micro_batch``
sequences, arranged as ``dp · microbatches`` micro-batches: the same tokens whatever
tp, pp, cp, ep and schedule, and DP replica d takes micro-batches ``[d·m, (d+1)·m)``
(:func:`.harness.replica_batch`). Without data the batches are seeded random tokens
(:func:`.reference.make_batch`), layout-independent the same way.

torch only (no NumPy, which the CPU build of torch may lack).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import attrs
import torch

from dhelix.dsl.core.errors import DhelixError, DhelixWarning
from dhelix.dsl.core.program import Program

from dhelix.interpreter.verify.reference import Batch, make_batch

from .tokenfiles import TOKEN_SUFFIXES, TokenFileError, is_token_file, read_token_file

#: The fraction of the token stream held out for evaluation (its tail).
HELD_OUT = 0.1
BYTE_VOCAB = 256


class DataError(DhelixError):
    """Training data that cannot be used: missing, empty, too short or of the wrong kind."""


@attrs.frozen
class DataSpec:
    """Where the data is (a resolved path) and where that path was written: ``span`` in the
    program, or ``flag`` on the command line (for the error messages)."""

    path: str
    span: object = None
    flag: str | None = None
    #: A Hugging Face ``tokenizer.json`` for the text files (None: byte-level), :mod:`.tokenizer`.
    tokenizer: str | None = None

    def error(self, message: str, notes=()) -> DataError:
        """A DataError about this data, located at its setting or naming its flag."""
        where = f" (given by {self.flag})" if self.flag else ""
        return DataError(f"{message}{where}", self.span, list(notes))


def data_spec(program: Program, program_path: str, override: str | None = None,
              flag: str | None = None, tokenizer: str | None = None) -> DataSpec | None:
    """The run's data: ``override`` (relative to the working folder; ``flag`` names where
    it was given) or the train block's ``data`` (relative to the program file); None for
    random tokens. ``tokenizer`` is a ``tokenizer.json`` for its text (None: byte-level)."""
    tokenizer = str(Path(tokenizer).resolve()) if tokenizer else None
    if override is not None:
        return DataSpec(str(Path(override).resolve()), flag=flag, tokenizer=tokenizer)
    if program.train.data is None:
        return None
    path = (Path(program_path).resolve().parent / program.train.data).resolve()
    return DataSpec(str(path), span=program.train.data_span, tokenizer=tokenizer)


def _is_text(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _named(spec: DataSpec, files: list[Path]) -> list[Path]:
    """``files``, named one by one (a file, a pattern's matches): DataError for one that is
    neither a token file nor UTF-8 text, rather than training on its bytes."""
    for path in files:
        if not is_token_file(path) and not _is_text(path):
            raise spec.error(f"'{path}' is neither UTF-8 text nor a token file ({', '.join(TOKEN_SUFFIXES)})",
                             ["give text, or token ids in one of those formats"])
    return files


def _files(spec: DataSpec) -> list[Path]:
    root = Path(spec.path)
    if root.is_file():
        return _named(spec, [root])
    if any(char in root.name for char in "*?["):
        files = sorted(p for p in root.parent.glob(root.name) if p.is_file())
        if not files:
            raise spec.error(f"no data file matches '{spec.path}'")
        return _named(spec, files)
    if not root.is_dir():
        raise spec.error(f"no data file or folder '{spec.path}'",
                         ["give a text file, a folder of text files, a pattern (docs/*.md), or token "
                          f"files ({', '.join(TOKEN_SUFFIXES)})"])
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts)
                   and (is_token_file(p) or _is_text(p)))
    if not files:
        raise spec.error(f"the data folder '{spec.path}' holds no text or token files")
    return files


def data_files(spec: DataSpec) -> list[Path]:
    """The files the data of ``spec`` is read from (what an output must never overwrite);
    DataError when there are none."""
    return _files(spec)


def _file_tokens(path: Path, spec: DataSpec, vocab: int) -> torch.Tensor:
    if is_token_file(path):
        try:
            return read_token_file(path, vocab)
        except TokenFileError as exc:
            raise spec.error(str(exc)) from None
    if spec.tokenizer is not None:
        return _tokenized(path.read_bytes().decode("utf-8", errors="replace"), spec, vocab)
    if vocab < BYTE_VOCAB:
        raise spec.error(f"'{path}' is text, tokenized byte-level (256 tokens), but the model's vocab is "
                         f"{vocab}", ["set vocab = 256 or more in the model block"])
    raw = path.read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long() if raw else torch.zeros(0, dtype=torch.long)


def short_data(spec: DataSpec, corpus: "Corpus", global_sequences: int) -> DhelixWarning | None:
    """A warning when the training part of the data holds fewer sequences than one step's
    global batch (every step then repeats the same few), located like the data's errors;
    None otherwise."""
    count = corpus.train.shape[0]
    if count >= global_sequences:
        return None
    where = f" (given by {spec.flag})" if spec.flag else ""
    return DhelixWarning(f"the data '{spec.path}'{where} holds {count} training sequence(s) of seq + 1 tokens, fewer "
                         f"than one step's global batch of {global_sequences}: every step repeats them",
                         spec.span, ["give more data, or fewer sequences a step (micro_batch, microbatches, dp)"])


def _tokenized(text: str, spec: DataSpec, vocab: int) -> torch.Tensor:
    """One text document through the spec's tokenizer, then its end-of-text id."""
    from .tokenizer import END_OF_TEXT, TokenizerError, codec

    try:
        found = codec(spec.tokenizer, vocab)
    except TokenizerError as exc:
        raise spec.error(exc.message, exc.notes) from None
    if found.end_of_text is None:
        raise spec.error(f"the tokenizer '{spec.tokenizer}' has no end-of-text token ({', '.join(END_OF_TEXT)}), "
                         "which separates the documents", ["give a tokenizer that has one"])
    return torch.tensor(found.encode(text) + [found.end_of_text], dtype=torch.long)


@attrs.frozen
class Corpus:
    """The packed windows ``[n, seq + 1]`` of the training and the held-out part (in the
    token file's own integer dtype when the data is one mapped token file: rows become
    ids as batches take them)."""

    train: torch.Tensor
    held_out: torch.Tensor


def load_corpus(spec: DataSpec, vocab: int, seq: int, evaluation: DataSpec | None = None) -> Corpus:
    """Read, tokenize, split and pack the data of ``spec``; DataError when it cannot be
    used (no file, nothing in it, too short for one window in each part). With
    ``evaluation`` (``--eval-data``) all of ``spec`` is trained on and the held-out windows
    are ``evaluation``'s."""
    window = seq + 1
    stream = _stream(spec, vocab)
    if evaluation is not None:
        held_out = _stream(evaluation, vocab)
        for part, tokens in ((spec, stream), (evaluation, held_out)):
            if tokens.numel() < window:
                raise part.error(f"the data '{part.path}' has {tokens.numel()} tokens: too short for one sequence "
                                 f"of seq + 1 = {window}")
        return Corpus(_pack(stream, window), _pack(held_out, window))
    held = max(window, math.ceil(HELD_OUT * stream.numel()))
    if stream.numel() - held < window:
        raise spec.error(f"the data '{spec.path}' has {stream.numel()} tokens: too short for sequences of "
                         f"{seq} (it needs at least {window + held} tokens: one training sequence of seq + 1 "
                         f"and a held-out tail of {held})")
    return Corpus(_pack(stream[:-held], window), _pack(stream[-held:], window))


def _stream(spec: DataSpec, vocab: int) -> torch.Tensor:
    """Every token of ``spec``'s files, in order; DataError when there are none."""
    parts = [_file_tokens(path, spec, vocab) for path in _files(spec)]
    # One file stays as it is (a token file: its memory map); several are joined as ids.
    stream = parts[0] if len(parts) == 1 else torch.cat([tokens.long() for tokens in parts])
    if stream.numel() == 0:
        raise spec.error(f"the data '{spec.path}' is empty")
    return stream


def _pack(tokens: torch.Tensor, window: int) -> torch.Tensor:
    count = tokens.numel() // window
    return tokens[:count * window].reshape(count, window)


def _epoch_order(seed: int, epoch: int, count: int) -> torch.Tensor:
    digest = hashlib.sha256(f"dhelix/data/{seed}/{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.randperm(count, generator=gen)


class DataSource:
    """The global batch of every step and the held-out batch, for ``program`` with ``dp``
    replicas (:meth:`global_sequences` sequences a step); ``corpus`` None gives random
    tokens seeded by ``seed + step``."""

    def __init__(self, program: Program, dp: int, seed: int, corpus: Corpus | None = None):
        self.program, self.seed, self.corpus = program, seed, corpus
        self.count = program.train.microbatches * dp
        self.shape = (self.count, program.train.micro_batch, program.model.get("seq"))
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def global_sequences(self) -> int:
        """Sequences in one step's global batch (dp · microbatches · micro_batch)."""
        return self.shape[0] * self.shape[1]

    def batch(self, step: int) -> Batch:
        """The global batch of step ``step`` (0-based over the whole training run)."""
        if self.corpus is None:
            return make_batch(self.program, self.seed + step, self.count)
        n, size = self.corpus.train.shape[0], self.global_sequences
        rows = []
        for sample in range(step * size, (step + 1) * size):
            epoch = sample // n
            if epoch not in self._orders:
                self._orders = {epoch: _epoch_order(self.seed, epoch, n)}  # one epoch at a time
            rows.append(self.corpus.train[self._orders[epoch][sample % n]])
        return self._shaped(torch.stack(rows))

    def held_out(self) -> Batch:
        """The evaluation batch: the held-out windows in order (repeated to fill a global
        batch when there are fewer); random tokens seeded apart from training without data."""
        if self.corpus is None:
            return make_batch(self.program, self.seed - 1, self.count)
        windows, size = self.corpus.held_out, self.global_sequences
        index = torch.arange(size) % windows.shape[0]
        return self._shaped(windows[index])

    def _shaped(self, windows: torch.Tensor) -> Batch:
        tokens = windows.long().reshape(*self.shape[:2], -1)
        return Batch(tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous())
