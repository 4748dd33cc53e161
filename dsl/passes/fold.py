"""Model folding: which rank and chunk hold each pipeline stage, and which layers each stage holds.

A *stage* is a contiguous run of layers in model order; stage ``s`` of ``S = p·v`` feeds stage
``s + 1``. A *placement* puts every stage on a (rank, chunk) slot: rank ``g`` holds ``v`` chunks.

- ``fold none``: stage g on rank g, chunk 0 (plain pipeline parallelism, v = 1).
- ``fold u`` (DHelix, paper §4.1): rank g holds chunk 0 = layers ``[g·L/2p, (g+1)·L/2p)`` and
  chunk 1 = ``[L−(g+1)·L/2p, L−g·L/2p)``. Stages 0..p−1 are chunk 0 on ranks 0..p−1 ("down"),
  stages p..2p−1 are chunk 1 on ranks p−1..0 ("up"), so the model doubles back like a U.
- ``fold loop(v)`` (Megatron's interleaved schedule): stage s on rank ``s mod p``, chunk ``s // p``.

All functions are pure; invalid sizes raise :class:`CheckError` saying which sizes work.
"""

from __future__ import annotations

import attrs

from dhelix.dsl.core.errors import CheckError
from dhelix.dsl.core.span import Span
from dhelix.dsl.core.wording import did_you_mean, join_words

#: The fold kinds of the language, with whether they take an argument.
FOLD_KINDS = {"none": False, "u": False, "loop": True}


@attrs.frozen
class Stage:
    """One pipeline stage: its index in model order, its slot and its layers ``[first, stop)``."""

    index: int
    rank: int
    chunk: int
    first_layer: int
    stop_layer: int

    @property
    def layers(self) -> range:
        """The layer indices of this stage, in model order."""
        return range(self.first_layer, self.stop_layer)


@attrs.frozen
class Placement:
    """Where every stage lives: ``stages[s]`` is stage s; ``chunks`` is v (chunks per rank)."""

    kind: str
    ranks: int
    chunks: int
    stages: tuple[Stage, ...]

    def stage_at(self, rank: int, chunk: int) -> Stage:
        """The stage held by ``rank`` as ``chunk`` (both assumed in range)."""
        return self._by_slot()[(rank, chunk)]

    def slots(self) -> tuple[tuple[int, int], ...]:
        """(rank, chunk) of each stage, in stage order: the form the lowered schedule keeps."""
        return tuple((stage.rank, stage.chunk) for stage in self.stages)

    def layers_of(self, rank: int) -> tuple[range, ...]:
        """The layer ranges held by ``rank``, one per chunk in chunk order."""
        return tuple(self.stage_at(rank, chunk).layers for chunk in range(self.chunks))

    def _by_slot(self) -> dict[tuple[int, int], Stage]:
        return {(stage.rank, stage.chunk): stage for stage in self.stages}


def fold_none(layers: int, ranks: int, *, span: Span | None = None) -> Placement:
    """Contiguous layers: stage g is rank g, chunk 0. Raises CheckError unless ``ranks`` divides ``layers``."""
    return _place("none", layers, ranks, 1, lambda s: (s, 0), span)


def fold_u(layers: int, ranks: int, *, span: Span | None = None) -> Placement:
    """DHelix's U fold: chunk 0 runs down ranks 0..p−1, chunk 1 back up p−1..0.

    Needs ``layers`` divisible by ``2·ranks`` (CheckError otherwise). With 32 layers on 4 ranks,
    rank 0 holds layers 0–3 and 28–31, rank 3 holds 12–15 and 16–19.
    """
    return _place("u", layers, ranks, 2,
                  lambda s: (s, 0) if s < ranks else (2 * ranks - 1 - s, 1), span)


def fold_loop(layers: int, ranks: int, chunks: int, *, span: Span | None = None) -> Placement:
    """Megatron's interleaved placement: stage s on rank ``s mod p`` as chunk ``s // p``.

    ``chunks`` is v ≥ 1; ``layers`` must be divisible by ``v·ranks`` (CheckError otherwise).
    """
    if chunks < 1:
        raise CheckError(f"fold loop({chunks}) needs at least 1 chunk per rank", span,
                         ["write loop(2) or more for Megatron's interleaved schedule; "
                          "loop(1) is the same as fold none"])
    return _place(f"loop({chunks})", layers, ranks, chunks, lambda s: (s % ranks, s // ranks), span)


def placement_for(kind: str, arg: int | None, layers: int, ranks: int, *,
                  span: Span | None = None) -> Placement:
    """The placement of fold ``kind`` (``none``, ``u`` or ``loop`` with ``arg`` = v).

    ``span`` locates the fold statement in messages. Raises CheckError for an unknown kind,
    a missing or unexpected argument, and sizes that do not divide.
    """
    if kind not in FOLD_KINDS:
        raise CheckError(f"unknown fold '{kind}'", span,
                         did_you_mean(kind, FOLD_KINDS) + ["folds are: none, u, loop(v)"])
    if FOLD_KINDS[kind] and arg is None:
        raise CheckError(f"fold {kind} needs the number of chunks per rank", span,
                         [f"write fold {kind}(2)"])
    if not FOLD_KINDS[kind] and arg is not None:
        raise CheckError(f"fold {kind} takes no argument", span, [f"write fold {kind}"])
    if kind == "none":
        return fold_none(layers, ranks, span=span)
    if kind == "u":
        return fold_u(layers, ranks, span=span)
    return fold_loop(layers, ranks, arg, span=span)


def _place(kind: str, layers: int, ranks: int, chunks: int, slot_of, span) -> Placement:
    _check_sizes(kind, layers, ranks, chunks, span)
    count = ranks * chunks
    width = layers // count
    stages = []
    for index in range(count):
        rank, chunk = slot_of(index)
        stages.append(Stage(index, rank, chunk, index * width, (index + 1) * width))
    return Placement(kind, ranks, chunks, tuple(stages))


def _check_sizes(kind: str, layers: int, ranks: int, chunks: int, span) -> None:
    if ranks < 1:
        raise CheckError(f"a pipeline needs at least 1 rank, got {ranks}", span,
                         ["set mesh pp to 1 or more"])
    if layers < 1:
        raise CheckError(f"a model needs at least 1 layer, got {layers}", span)
    count = ranks * chunks
    if layers % count == 0:
        return
    per_rank = "" if chunks == 1 else f" ({chunks} per rank)"
    on_ranks = f"{ranks} rank{'s' if ranks != 1 else ''}"
    working = [g for g in range(1, layers + 1) if layers % (g * chunks) == 0]
    multiples = ", ".join(str(count * k) for k in (1, 2, 3))
    works = (f"with {layers} layers, fold {kind} works on {_listing(working)} ranks" if working
             else f"no number of ranks works: fold {kind} needs a multiple of {chunks} layers")
    raise CheckError(
        f"{layers} layers do not split into {count} stages{per_rank} for fold {kind} "
        f"on {on_ranks}", span,
        [works, f"on {on_ranks}, fold {kind} needs a multiple of {count} layers "
                f"({multiples}, …)"])


def _listing(values: list[int]) -> str:
    words = [str(v) for v in values[:8]] + (["…"] if len(values) > 8 else [])
    return join_words(words, "or")
