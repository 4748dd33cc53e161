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

A blend of several sources (``--data 0.7:a/ 0.3:b.npy``, :class:`Blend`) packs and holds out
each source apart; training sample ``j`` comes from the source :func:`.blend.pick` names, and
is that source's ``c``-th window in its own seeded epoch order (``c``: what the source gave
before). The blend's position (``j`` and every ``c``) is stored in a checkpoint and restored
on ``--resume`` (:meth:`DataSource.position`, :meth:`DataSource.restore`); the held-out batch
mixes the sources' held-out windows by the same weights.

torch only (no NumPy, which the CPU build of torch may lack).

One module, though over 500 lines, because it is one thing: a run's training data from its paths
to each step's samples (the sources read, the stream packed, the seeded order and the position a
checkpoint keeps); token files, tokenizers and blends have modules of their own.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
from pathlib import Path

import attrs
import torch

from dhelix.dsl.core.errors import DhelixError, DhelixWarning
from dhelix.dsl.core.program import Program

from dhelix.interpreter.verify.reference import Batch, make_batch

from .blend import advance, normalised, parse_items, pick
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


@attrs.frozen
class Blend:
    """Several sources drawn by weight (``--data 0.7:a/ 0.3:b.npy``): ``sources`` (DataSpecs)
    and their ``weights`` as given (None: by their sizes, known once they are read)."""

    sources: tuple[DataSpec, ...]
    weights: tuple[float, ...] | None = None

    @property
    def flag(self) -> str | None:
        """Where the blend was given (its sources' flag)."""
        return self.sources[0].flag

    @property
    def span(self) -> None:
        """A blend is written on the command line only."""
        return None

    @property
    def path(self) -> str:
        """The sources' paths, for messages."""
        return " ".join(source.path for source in self.sources)

    def describe(self) -> dict:
        """What a checkpoint stores to recognise the blend: its paths and weights."""
        return {"sources": [source.path for source in self.sources],
                "weights": None if self.weights is None else list(self.weights)}


def data_spec(program: Program, program_path: str, override=None,
              flag: str | None = None, tokenizer: str | None = None) -> DataSpec | Blend | None:
    """The run's data: ``override`` (relative to the working folder; ``flag`` names where
    it was given: a path, or a list of ``[WEIGHT:]PATH`` items, :func:`.blend.parse_items`,
    several of which make a :class:`Blend`) or the train block's ``data`` (relative to the
    program file); None for random tokens. ``tokenizer`` is a ``tokenizer.json`` for its
    text (None: byte-level). UsageError for a malformed item or bad weights."""
    tokenizer = str(Path(tokenizer).resolve()) if tokenizer else None
    if override is not None:
        items = parse_items([override] if isinstance(override, str) else list(override), flag or "data")
        sources = tuple(DataSpec(str(Path(item.path).resolve()), flag=flag, tokenizer=tokenizer) for item in items)
        if len(sources) == 1:  # a weight of its own changes nothing (parse_items refused 0)
            return sources[0]
        return Blend(sources, None if items[0].weight is None else tuple(item.weight for item in items))
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


def data_files(spec: DataSpec | Blend) -> list[Path]:
    """The files the data of ``spec`` (a source or a blend) is read from (what an output
    must never overwrite); DataError when a source has none."""
    if isinstance(spec, Blend):
        return [path for source in spec.sources for path in _files(source)]
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


def short_data(spec: DataSpec | Blend, corpus: "Corpus | BlendedCorpus", global_sequences: int
               ) -> DhelixWarning | None:
    """A warning when the training part of the data holds fewer sequences than one step's
    global batch (every step then repeats the same few), located like the data's errors;
    None otherwise."""
    count = training_sequences(corpus)
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


@attrs.frozen
class BlendedCorpus:
    """A blend's sources read: each one's Corpus (``parts``), the ``weights`` normalised to sum
    to 1, and ``evaluation``: the ``--eval-data`` windows (None: each part's held-out ones)."""

    parts: tuple[Corpus, ...]
    weights: tuple[float, ...]
    evaluation: torch.Tensor | None = None


def training_sequences(corpus: Corpus | BlendedCorpus) -> int:
    """How many training windows ``corpus`` holds (every source's, for a blend)."""
    if isinstance(corpus, BlendedCorpus):
        return sum(part.train.shape[0] for part in corpus.parts)
    return corpus.train.shape[0]


def load_corpus(spec: DataSpec | Blend, vocab: int, seq: int,
                evaluation: DataSpec | None = None) -> Corpus | BlendedCorpus:
    """Read, tokenize, split and pack the data of ``spec``; DataError when it cannot be
    used (no file, nothing in it, too short for one window in each part). With
    ``evaluation`` (``--eval-data``) all of ``spec`` is trained on and the held-out windows
    are ``evaluation``'s. A blend's sources are each split and packed alone."""
    window = seq + 1
    held_out = None
    if evaluation is not None:
        held_out = _pack(_long_enough(evaluation, _stream(evaluation, vocab), window), window)
    if isinstance(spec, Blend):
        parts = tuple(_source_corpus(source, vocab, window, held_out) for source in spec.sources)
        weights = spec.weights or tuple(float(part.train.shape[0]) for part in parts)
        return BlendedCorpus(parts, normalised(weights), held_out)
    return _source_corpus(spec, vocab, window, held_out)


def _source_corpus(spec: DataSpec, vocab: int, window: int, held_out: torch.Tensor | None) -> Corpus:
    """One source's Corpus: all of it trained on beside the given ``held_out`` windows, or
    split into a training part and a held-out tail."""
    stream = _stream(spec, vocab)
    if held_out is not None:
        return Corpus(_pack(_long_enough(spec, stream, window), window), held_out)
    held = max(window, math.ceil(HELD_OUT * stream.numel()))
    if stream.numel() - held < window:
        raise spec.error(f"the data '{spec.path}' has {stream.numel()} tokens: too short for sequences of "
                         f"{window - 1} (it needs at least {window + held} tokens: one training sequence of seq + 1 "
                         f"and a held-out tail of {held})")
    return Corpus(_pack(stream[:-held], window), _pack(stream[-held:], window))


def _long_enough(spec: DataSpec, tokens: torch.Tensor, window: int) -> torch.Tensor:
    """``tokens``; DataError when they are too few for one window."""
    if tokens.numel() < window:
        raise spec.error(f"the data '{spec.path}' has {tokens.numel()} tokens: too short for one sequence "
                         f"of seq + 1 = {window}")
    return tokens


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


def _epoch_order(seed: int, epoch: int, count: int, source: int | None = None) -> torch.Tensor:
    key = f"dhelix/data/{seed}/{epoch}" if source is None else f"dhelix/data/{seed}/source-{source}/{epoch}"
    digest = hashlib.sha256(key.encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.randperm(count, generator=gen)


class DataSource:
    """The global batch of every step and the held-out batch, for ``program`` with ``dp``
    replicas (:meth:`global_sequences` sequences a step); ``corpus`` None gives random
    tokens seeded by ``seed + step``; a BlendedCorpus draws its sources by weight."""

    def __init__(self, program: Program, dp: int, seed: int, corpus: Corpus | BlendedCorpus | None = None):
        self.program, self.seed, self.corpus = program, seed, corpus
        self.count = program.train.microbatches * dp
        self.shape = (self.count, program.train.micro_batch, program.model.get("seq"))
        self._orders: dict[int, torch.Tensor] = {}
        #: A blend's position: the next sample and what each source gave before it.
        self._sample, self._counts = 0, [0] * len(corpus.parts) if isinstance(corpus, BlendedCorpus) else []
        #: A blend's epoch orders: source → (epoch, order).
        self._source_orders: dict[int, tuple[int, torch.Tensor]] = {}

    @functools.cached_property
    def fingerprint(self) -> dict | None:
        """The corpus's :func:`fingerprint`, read once (every token of it) and kept."""
        return fingerprint(self.corpus)

    @property
    def global_sequences(self) -> int:
        """Sequences in one step's global batch (dp · microbatches · micro_batch)."""
        return self.shape[0] * self.shape[1]

    def batch(self, step: int) -> Batch:
        """The global batch of step ``step`` (0-based over the whole training run)."""
        if self.corpus is None:
            return make_batch(self.program, self.seed + step, self.count)
        if isinstance(self.corpus, BlendedCorpus):
            return self._shaped(self._blended(step))
        n, size = self.corpus.train.shape[0], self.global_sequences
        rows = []
        for sample in range(step * size, (step + 1) * size):
            epoch = sample // n
            if epoch not in self._orders:
                self._orders = {epoch: _epoch_order(self.seed, epoch, n)}  # one epoch at a time
            rows.append(self.corpus.train[self._orders[epoch][sample % n]])
        return self._shaped(torch.stack(rows))

    def sources_of(self, step: int) -> list[int]:
        """For a blend: which source each sequence of step ``step``'s global batch comes from
        (in the batch's order); what :meth:`batch` draws, without reading the windows."""
        start = step * self.global_sequences
        counts, found = self._counts_at(start), []
        for sample in range(start, start + self.global_sequences):
            found.append(pick(self.corpus.weights, sample, counts))
            counts[found[-1]] += 1
        return found

    def position(self) -> dict | None:
        """Where a blend stands (the next sample and each source's count), for a checkpoint;
        None for one source or none (its position is the step)."""
        if not isinstance(self.corpus, BlendedCorpus):
            return None
        return {"sample": self._sample, "counts": list(self._counts)}

    def restore(self, position: dict | None) -> bool:
        """Continue a blend from ``position`` (what :meth:`position` returned when the
        checkpoint was saved); returns whether it was taken (it is not for one source, nor
        when it has another number of sources: the blend then replays to the step)."""
        if not isinstance(self.corpus, BlendedCorpus) or not position:
            return False
        counts = position.get("counts")
        if not isinstance(counts, list) or len(counts) != len(self._counts):
            return False
        self._sample, self._counts = int(position["sample"]), [int(c) for c in counts]
        return True

    def _counts_at(self, sample: int) -> list[int]:
        """Each source's count at blend sample ``sample``: from the position when it is there
        or behind it, else replayed from the start."""
        if sample >= self._sample:
            return advance(self.corpus.weights, self._sample, self._counts, sample)
        return advance(self.corpus.weights, 0, [0] * len(self._counts), sample)

    def _blended(self, step: int) -> torch.Tensor:
        """The windows of step ``step`` from a blend, moving its position past them."""
        start = step * self.global_sequences
        counts, rows = self._counts_at(start), []
        for sample in range(start, start + self.global_sequences):
            source = pick(self.corpus.weights, sample, counts)
            rows.append(self._window(source, counts[source]).long())
            counts[source] += 1
        self._sample, self._counts = start + self.global_sequences, counts
        return torch.stack(rows)

    def _window(self, source: int, index: int) -> torch.Tensor:
        """The ``index``-th training window source ``source`` gives: its own seeded order,
        epoch after epoch."""
        windows = self.corpus.parts[source].train
        n = windows.shape[0]
        epoch = index // n
        if self._source_orders.get(source, (None,))[0] != epoch:
            self._source_orders[source] = (epoch, _epoch_order(self.seed, epoch, n, source))
        return windows[self._source_orders[source][1][index % n]]

    def held_out(self) -> Batch:
        """The evaluation batch: the held-out windows in order (repeated to fill a global
        batch when there are fewer; a blend's sources mixed by their weights); random tokens
        seeded apart from training without data."""
        if self.corpus is None:
            return make_batch(self.program, self.seed - 1, self.count)
        size = self.global_sequences
        if isinstance(self.corpus, BlendedCorpus) and self.corpus.evaluation is None:
            counts, rows = [0] * len(self.corpus.parts), []
            for sample in range(size):
                source = pick(self.corpus.weights, sample, counts)
                windows = self.corpus.parts[source].held_out
                rows.append(windows[counts[source] % windows.shape[0]].long())
                counts[source] += 1
            return self._shaped(torch.stack(rows))
        windows = self.corpus.evaluation if isinstance(self.corpus, BlendedCorpus) else self.corpus.held_out
        index = torch.arange(size) % windows.shape[0]
        return self._shaped(windows[index])

    def held_out_coverage(self) -> tuple[int, int] | None:
        """How much of the held-out data :meth:`held_out` evaluates: (distinct windows in its
        one global batch, held-out windows in all); None for seeded random tokens."""
        if self.corpus is None:
            return None
        size = self.global_sequences
        if isinstance(self.corpus, BlendedCorpus) and self.corpus.evaluation is None:
            counts = [0] * len(self.corpus.parts)
            for sample in range(size):
                counts[pick(self.corpus.weights, sample, counts)] += 1
            held = [part.held_out.shape[0] for part in self.corpus.parts]
            return sum(min(c, n) for c, n in zip(counts, held, strict=True)), sum(held)
        windows = self.corpus.evaluation if isinstance(self.corpus, BlendedCorpus) else self.corpus.held_out
        return min(size, windows.shape[0]), windows.shape[0]

    def _shaped(self, windows: torch.Tensor) -> Batch:
        tokens = windows.long().reshape(*self.shape[:2], -1)
        return Batch(tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous())


#: How many evenly spaced windows the fingerprint of an older dhelix read (its saves carry no
#: ``hashed``; a resume from one compares those windows only, and says so).
FINGERPRINT_SAMPLES = 64
#: The token ids a fingerprint hashes at a time (as int32: the same ids hash alike whatever
#: integer type their file stores).
FINGERPRINT_BLOCK = 1 << 22


def fingerprint(corpus: Corpus | BlendedCorpus | None, *, sampled: bool = False) -> dict | None:
    """What identifies the training data a run reads: its window count and the SHA-256 of
    every training window (every source's, for a blend), read in blocks; ``sampled``: of
    :data:`FINGERPRINT_SAMPLES` evenly spaced windows only, as an older dhelix's saves have it.
    ``hashed`` says which ("all" or "64 sampled windows"). None for seeded random tokens."""
    if corpus is None:
        return None
    parts = corpus.parts if isinstance(corpus, BlendedCorpus) else (corpus,)
    digest = hashlib.sha256()
    for part in parts:
        windows = part.train
        n = windows.shape[0]
        if sampled:
            for row in sorted({i * n // FINGERPRINT_SAMPLES for i in range(min(n, FINGERPRINT_SAMPLES))}):
                digest.update(repr(windows[row].tolist()).encode())  # ids, whatever the file's integer type
            continue
        rows = max(1, FINGERPRINT_BLOCK // max(1, windows[0].numel() if n else 1))
        for first in range(0, n, rows):
            block = windows[first:first + rows].to(torch.int32).contiguous()
            digest.update(_raw_bytes(block))
    found = {"windows": training_sequences(corpus), "sha256": digest.hexdigest()[:16]}
    return {**found, "hashed": f"{FINGERPRINT_SAMPLES} sampled windows" if sampled else "all"}


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU ``tensor``, not copied (without NumPy, which this module
    does without); valid while ``tensor`` lives."""
    return memoryview((ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr()))


def saved_data(spec, source: DataSource) -> dict | None:
    """What a checkpoint stores about the data of ``spec``: its :func:`fingerprint`, and a
    blend's sources, weights and position (``source``'s); None for seeded random tokens."""
    saved = {}
    if (found := source.fingerprint) is not None:
        saved["fingerprint"] = found
    position = source.position()
    if position is not None and isinstance(spec, Blend):
        saved.update(blend=spec.describe(), position=position)
    return saved or None


def resume_data(spec, saved: dict | None, source: DataSource) -> bool:
    """Continue ``source`` from the position a checkpoint stored (``saved``, what
    :func:`saved_data` returned) when its blend is ``spec``; returns whether it did (a
    changed blend replays its order from the first step with the new weights)."""
    if not isinstance(spec, Blend) or not saved or saved.get("blend") != spec.describe():
        return False
    return source.restore(saved.get("position"))
