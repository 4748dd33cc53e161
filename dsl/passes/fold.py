"""Model folding: which rank and chunk hold each pipeline stage, and which layers each stage holds.

A *stage* is a contiguous run of layers in model order; stage ``s`` of ``S = p·v`` feeds stage
``s + 1``. A *placement* puts every stage on a (rank, chunk) slot: rank ``g`` holds ``v`` chunks.

- ``fold none``: stage g on rank g, chunk 0 (plain pipeline parallelism, v = 1).
- ``fold u`` (DHelix, paper §4.1): rank g holds chunk 0 = layers ``[g·L/2p, (g+1)·L/2p)`` and
  chunk 1 = ``[L−(g+1)·L/2p, L−g·L/2p)``. Stages 0..p−1 are chunk 0 on ranks 0..p−1 ("down"),
  stages p..2p−1 are chunk 1 on ranks p−1..0 ("up"), so the model doubles back like a U.
- ``fold loop(v)`` (Megatron's interleaved schedule): stage s on rank ``s mod p``, chunk ``s // p``.
- ``fold bidir`` (DualPipe, DeepSeek-V3 §3.2.1): two copies of the model, each split into p
  stages of ``L/p`` layers. Stages 0..p−1 are copy 0's on ranks 0..p−1 as chunk 0 (fed at rank
  0, running down); stages p..2p−1 are copy 1's stages 0..p−1 on ranks p−1..0 as chunk 1 (fed at
  rank p−1, running up). Rank r holds stage r of copy 0 and stage p−1−r of copy 1: twice the
  parameters of fold none, and every stage twice, on ranks r and p−1−r, whose gradients are
  summed like a data-parallel pair's. Stage ``s + 1`` follows stage s only within a copy
  (:func:`~dhelix.dsl.core.schedule.neighbour_stage`).

The stages hold equal layers, or, where the train block writes ``first_stage_layers`` and/or
``last_stage_layers``, the first stage (the embedding's) and the last (the LM head's) hold
those and the others an equal share of the rest (Megatron's first/last pipeline stage layer
counts; under ``loop(v)`` the first and last *model chunk*, where Megatron spreads the first
rank's count over its v chunks).

All functions are pure; invalid sizes raise :class:`CheckError` saying which sizes work (the
checker reports the same error, :func:`~dhelix.dsl.frontend.modelcheck.stage_split_error`, with
the program's other mistakes; this pass meets it only for sizes changed after checking).
"""

from __future__ import annotations

import functools

import attrs

from dhelix.dsl.core.errors import CheckError
from dhelix.dsl.core.program import FOLD_COPIES, FOLD_KINDS, FoldSpec, unknown_fold
from dhelix.dsl.core.schedule import neighbour_stage
from dhelix.dsl.core.span import Span
from dhelix.dsl.frontend.modelcheck import TIE_SETTING, stage_split_error, stage_widths


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
    """Where every stage lives: ``stages[s]`` is stage s; ``chunks`` is v (chunks per rank);
    ``copies`` the model copies, each ``len(stages) // copies`` consecutive stages."""

    kind: str
    ranks: int
    chunks: int
    stages: tuple[Stage, ...]
    copies: int = 1

    def neighbour(self, index: int, step: int) -> int | None:
        """The stage ``step`` (±1) from stage ``index`` in its copy's model order; None past
        the copy's ends."""
        return neighbour_stage(index, step, len(self.stages), self.copies)

    def copy_of(self, index: int) -> int:
        """The model copy stage ``index`` belongs to (0 but under fold bidir)."""
        return index // (len(self.stages) // self.copies)

    def is_first(self, index: int) -> bool:
        """Whether stage ``index`` is the first of its model copy (it holds the embedding)."""
        return self.neighbour(index, -1) is None

    def is_last(self, index: int) -> bool:
        """Whether stage ``index`` is the last of its model copy (it holds the LM head)."""
        return self.neighbour(index, 1) is None

    def stage_at(self, rank: int, chunk: int) -> Stage:
        """The stage held by ``rank`` as ``chunk`` (both assumed in range)."""
        return self._by_slot[(rank, chunk)]

    def slots(self) -> tuple[tuple[int, int], ...]:
        """(rank, chunk) of each stage, in stage order: the form the lowered schedule keeps."""
        return tuple((stage.rank, stage.chunk) for stage in self.stages)

    def layers_of(self, rank: int) -> tuple[range, ...]:
        """The layer ranges held by ``rank``, one per chunk in chunk order."""
        return tuple(self.stage_at(rank, chunk).layers for chunk in range(self.chunks))

    @functools.cached_property
    def _by_slot(self) -> dict[tuple[int, int], Stage]:
        # Built once: renderers ask for every slot, and rebuilding per call is quadratic in pp.
        return {(stage.rank, stage.chunk): stage for stage in self.stages}


#: The first and the last stage's layers (None: an equal share), as the train block sets them.
Ends = tuple[int | None, int | None]
EQUAL: Ends = (None, None)


def fold_none(layers: int, ranks: int, *, span: Span | None = None, ends: Ends = EQUAL) -> Placement:
    """Contiguous layers: stage g is rank g, chunk 0. Raises CheckError unless the layers
    split (``ranks`` divides ``layers``, or the rest of ``ends`` is an equal share)."""
    return _place("none", layers, ranks, FoldSpec.of("none").v, lambda s: (s, 0), span, ends)


def fold_u(layers: int, ranks: int, *, span: Span | None = None, ends: Ends = EQUAL) -> Placement:
    """DHelix's U fold: chunk 0 runs down ranks 0..p−1, chunk 1 back up p−1..0.

    Needs ``layers`` divisible by ``2·ranks`` (CheckError otherwise). With 32 layers on 4 ranks,
    rank 0 holds layers 0–3 and 28–31, rank 3 holds 12–15 and 16–19.
    """
    return _place("u", layers, ranks, FoldSpec.of("u").v,
                  lambda s: (s, 0) if s < ranks else (2 * ranks - 1 - s, 1), span, ends)


def fold_loop(layers: int, ranks: int, chunks: int, *, span: Span | None = None, ends: Ends = EQUAL) -> Placement:
    """Megatron's interleaved placement: stage s on rank ``s mod p`` as chunk ``s // p``.

    ``chunks`` is v ≥ 1; ``layers`` must be divisible by ``v·ranks`` (CheckError otherwise).
    """
    return _place(f"loop({chunks})", layers, ranks, chunks, lambda s: (s % ranks, s // ranks), span, ends)


def fold_bidir(layers: int, ranks: int, *, span: Span | None = None, ends: Ends = EQUAL) -> Placement:
    """DualPipe's two copies: copy 0's stage j on rank j as chunk 0, copy 1's stage j on rank
    p−1−j as chunk 1. Needs an even ``ranks`` dividing ``layers`` (CheckError otherwise). With 8
    layers on 4 ranks, rank 0 holds layers 0–1 (copy 0) and 6–7 (copy 1), rank 3 holds 6–7 and 0–1.
    """
    error = stage_split_error("bidir", layers, ranks, FoldSpec.of("bidir").v, span, ends, copies=FOLD_COPIES["bidir"])
    if error is not None:
        raise error
    width = layers // ranks
    stages = [Stage(copy * ranks + j, j if copy == 0 else ranks - 1 - j, copy, j * width, (j + 1) * width)
              for copy in (0, 1) for j in range(ranks)]
    return Placement("bidir", ranks, 2, tuple(stages), copies=2)


def placement_for(kind: str, arg: int | None, layers: int, ranks: int, *,
                  span: Span | None = None) -> Placement:
    """The placement of fold ``kind`` (``none``, ``u``, ``bidir`` or ``loop`` with ``arg`` = v).

    ``span`` locates the fold statement in messages. Raises CheckError for an unknown kind,
    a missing or unexpected argument, and sizes that do not divide.
    """
    if kind not in FOLD_KINDS:
        raise unknown_fold(kind, span)
    if FOLD_KINDS[kind] is None and arg is None:
        raise CheckError(f"fold {kind} needs the number of chunks per rank", span,
                         [f"write fold {kind}(2)"])
    if FOLD_KINDS[kind] is not None and arg is not None:
        raise CheckError(f"fold {kind} takes no argument", span, [f"write fold {kind}"])
    return placement_of(FoldSpec.of(kind, arg, span=span), layers, ranks)


def placement_of(fold: FoldSpec, layers: int, ranks: int, ends: Ends = EQUAL, ends_span: Span | None = None
                 ) -> Placement:
    """The placement of the checked ``fold`` for ``layers`` layers on ``ranks`` pipeline
    ranks, the first and the last stage holding ``ends`` layers where set (the train
    block's ``first_stage_layers`` and ``last_stage_layers``); a CheckError at the fold's span
    (at ``ends_span`` for set ends) when the layers do not split."""
    span = ends_span if ends != EQUAL and ends_span is not None else fold.span
    if fold.kind == "none":
        return fold_none(layers, ranks, span=span, ends=ends)
    if fold.kind == "u":
        return fold_u(layers, ranks, span=span, ends=ends)
    if fold.kind == "bidir":
        return fold_bidir(layers, ranks, span=span, ends=ends)
    return fold_loop(layers, ranks, fold.v, span=span, ends=ends)


def _place(kind: str, layers: int, ranks: int, chunks: int, slot_of, span, ends: Ends = EQUAL) -> Placement:
    error = stage_split_error(kind, layers, ranks, chunks, span, ends)
    if error is not None:
        raise error
    widths = stage_widths(layers, ranks * chunks, ends)
    assert widths is not None, "stage_split_error checked the split"
    stages, first = [], 0
    for index, width in enumerate(widths):
        rank, chunk = slot_of(index)
        stages.append(Stage(index, rank, chunk, first, first + width))
        first += width
    return Placement(kind, ranks, chunks, tuple(stages))


def tie_placement_error(model, fold, placement: Placement) -> CheckError | None:
    """An error at the fold statement (else the model block) when ``model`` ties its LM head
    to its embedding (``tie_embeddings = 1``) and ``placement`` puts the first stage (the
    embedding) and the last (the LM head) of a model copy on different pipeline ranks; None otherwise."""
    first, last = placement.stages[0].rank, placement.stages[len(placement.stages) // placement.copies - 1].rank
    if model.get(TIE_SETTING) != 1 or first == last:
        return None
    return CheckError(f"tie_embeddings = 1 with fold {fold.text} on {placement.ranks} pipeline ranks: the embedding "
                      f"(first stage, rank {first}) and the LM head (last stage, rank {last}) would be on different "
                      "ranks", fold.span or model.span,
                      ["a tied LM head runs where the embedding is: use fold u (rank 0 holds the first and the last "
                       "layers) or pp = 1",
                       "summing the two copies' gradients across pipeline ranks (Megatron's embedding group) is not "
                       "implemented"])
