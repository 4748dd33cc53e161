"""The lowered schedule: per-rank action lists, the contract between compiler and runtime.

Every action names its micro-batch and its chunk (the chunk of *this* rank). Stages are
numbered in model order; ``Lowered.stages[s]`` is the (rank, chunk) slot holding stage s.

Stages are one chain in model order, or (fold bidir) ``copies`` chains of equal length, each a
whole model copy running its own share of the micro-batches (:meth:`Lowered.microbatches_of`).

Text form (one header, one stage line, one line per rank; ``#`` starts a comment; a header
ends in `` copies=2`` for two model copies)::

    lowered one_f_one_b p=2 m=2 v=1
    stages: r0.0 r1.0
    r0: F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0
    r1: RECV_F0.0<0 F0.0 B0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0

- ``F3.1`` / ``B3.1`` / ``W3.1``: forward, backward (input gradient when the schedule has W
  actions, else the whole backward), weight gradient of micro-batch 3 on this rank's chunk 1.
- ``SI(F4.0,B1.1)``: a strand-interleaved block co-executing a forward and a backward.
- ``SEND_F3.0>1``: send the output of F3.0 (just computed here) to rank 1.
  ``RECV_F3.1<2``: receive the input of F3.1 (computed next here) from rank 2.
  ``SEND_B3.1>0`` / ``RECV_B3.0<2``: the same for the gradients that backwards pass down.

SENDs come right after the action producing the data, RECVs right before the action consuming
it, so stepping the lists with blocking receives finds deadlocks. ``parse_lowered`` inverts
``format_lowered`` exactly; spans (into the ``.dhx`` source or the text) never affect equality.
"""

from __future__ import annotations

import functools
import re
from typing import Union

import attrs

from dhelix.dsl.core.errors import ParseError
from dhelix.dsl.core.span import Source, Span, span_field


@attrs.frozen
class Compute:
    """F, B or W of ``microbatch`` on this rank's ``chunk``."""

    kind: str
    microbatch: int
    chunk: int
    span: Span | None = span_field()

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


@attrs.frozen
class Interleaved:
    """An SI block: a forward and a backward of two micro-batches co-executed on one rank."""

    fwd: Compute
    bwd: Compute
    span: Span | None = span_field()

    def __str__(self) -> str:
        return f"SI({self.fwd},{self.bwd})"

    @property
    def parts(self) -> tuple[Compute, Compute]:
        """The two computations, forward first."""
        return (self.fwd, self.bwd)


@attrs.frozen(cache_hash=True)
class Transfer:
    """SEND or RECV of the ``data`` ('F' activation or 'B' gradient) of ``microbatch.chunk``.

    For a SEND, ``chunk`` is the local chunk whose action produced the data; for a RECV, the
    local chunk whose action consumes it. ``peer`` is the other rank. Its hash is computed
    once (the executor finds each transfer's key by it on every step).
    """

    kind: str
    data: str
    microbatch: int
    chunk: int
    peer: int
    span: Span | None = span_field()

    def __str__(self) -> str:
        arrow = ">" if self.kind == "SEND" else "<"
        return f"{self.kind}_{self.data}{self.microbatch}.{self.chunk}{arrow}{self.peer}"


Action = Union[Compute, Interleaved, Transfer]


@attrs.frozen
class Lowered:
    """A lowered pipeline: ``actions[r]`` is rank r's program, in order.

    ``ranks`` = p, ``microbatches`` = m, ``chunks`` = v; ``stages[s]`` = (rank, chunk) of stage s.
    """

    name: str
    ranks: int
    microbatches: int
    chunks: int
    stages: tuple[tuple[int, int], ...]
    actions: tuple[tuple[Action, ...], ...]
    span: Span | None = span_field()  # the pipeline definition (or the text) it came from
    #: The model copies (fold bidir: 2): copy c is the ``len(stages) // copies`` stages from
    #: ``c · len(stages) // copies`` on and runs micro-batches ``c · m/copies`` .. ``(c+1) · m/copies - 1``.
    copies: int = 1

    def neighbour(self, index: int, step: int) -> int | None:
        """The stage ``step`` (±1) from stage ``index`` in its copy; None past the copy's ends
        (the first stage reads the batch, the last one computes the loss)."""
        return neighbour_stage(index, step, len(self.stages), self.copies)

    def is_first(self, index: int) -> bool:
        """Whether stage ``index`` is the first of its model copy (it embeds the tokens)."""
        return self.neighbour(index, -1) is None

    def is_last(self, index: int) -> bool:
        """Whether stage ``index`` is the last of its model copy (it computes the loss)."""
        return self.neighbour(index, 1) is None

    def copy_of(self, index: int) -> int:
        """The model copy stage ``index`` belongs to (0 but under fold bidir)."""
        return index // (len(self.stages) // self.copies)

    def microbatches_of(self, index: int) -> range:
        """The micro-batches stage ``index`` runs: all m, or its copy's share of them."""
        share = self.microbatches // self.copies
        return range(self.copy_of(index) * share, (self.copy_of(index) + 1) * share)

    @functools.cached_property
    def split(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradient).
        Cached: renderers ask once per action, and each answer scans every action."""
        return any(isinstance(a, Compute) and a.kind == "W" for row in self.actions for a in row)

    def stage_of(self, rank: int, chunk: int) -> int | None:
        """The stage index held by ``rank`` as ``chunk``, or None for a slot outside the placement."""
        return self.stage_index.get((rank, chunk))

    def stages_run(self, rank: int, action: Action) -> tuple[str, int | None, int | None]:
        """(kind, forward stage, backward stage) of a computation of ``rank``: ``SI`` with
        its two stages for an SI block, else F, B or W with its stage twice."""
        if isinstance(action, Interleaved):
            return "SI", self.stage_of(rank, action.fwd.chunk), self.stage_of(rank, action.bwd.chunk)
        index = self.stage_of(rank, action.chunk)
        return action.kind, index, index

    @functools.cached_property
    def interleaved(self) -> bool:
        """Whether any action is an SI block. Cached: a search asks for every candidate."""
        return any(isinstance(a, Interleaved) for row in self.actions for a in row)

    @functools.cached_property
    def computations(self) -> tuple[tuple[tuple[str, int | None, int | None], ...], ...]:
        """:meth:`stages_run` of each rank's computations (its transfers left out), in order.
        Cached: a search prices one lowered schedule for many layouts."""
        return tuple(tuple(self.stages_run(rank, a) for a in row if not isinstance(a, Transfer))
                     for rank, row in enumerate(self.actions))

    @functools.cached_property
    def computation_indices(self) -> tuple[tuple[tuple[str, int | None, int | None], ...],
                                           tuple[tuple[int, ...], ...]]:
        """(the distinct :attr:`computations`, in order of first appearance; each rank's
        computations as indices into them). Cached, for the same reason."""
        index: dict = {}
        rows = tuple(tuple(index.setdefault(key, len(index)) for key in row) for row in self.computations)
        return tuple(index), rows

    @functools.cached_property
    def stage_index(self) -> dict[tuple[int, int], int]:
        """(rank, chunk) -> the stage it holds (:meth:`stage_of`, as a dict for loops that
        look up every action's)."""
        return {slot: index for index, slot in enumerate(self.stages)}


def neighbour_stage(index: int, step: int, count: int, copies: int) -> int | None:
    """The stage ``step`` (±1) from stage ``index`` of ``count`` stages that make ``copies``
    equal model copies in turn; None when it would leave ``index``'s copy."""
    per_copy = count // copies
    other = index + step
    return other if 0 <= other < count and other // per_copy == index // per_copy else None


def computes(action: Action) -> tuple[Compute, ...]:
    """The computations an action runs: one, two for an SI block, none for a transfer."""
    if isinstance(action, Interleaved):
        return action.parts
    if isinstance(action, Compute):
        return (action,)
    return ()


# --- text form ----------------------------------------------------------------------------

def format_lowered(lowered: Lowered) -> str:
    """The text form of ``lowered`` (see the module docstring), ending in a newline."""
    copies = f" copies={lowered.copies}" if lowered.copies != 1 else ""
    lines = [f"lowered {lowered.name} p={lowered.ranks} m={lowered.microbatches} "
             f"v={lowered.chunks}{copies}",
             "stages: " + " ".join(f"r{rank}.{chunk}" for rank, chunk in lowered.stages)]
    for rank, row in enumerate(lowered.actions):
        lines.append(" ".join([f"r{rank}:"] + [str(action) for action in row]))
    return "\n".join(lines) + "\n"


_HEADER = re.compile(r"lowered ([A-Za-z_][A-Za-z0-9_]*) p=(\d+) m=(\d+) v=(\d+)(?: copies=(\d+))?$")
_SLOT = re.compile(r"r(\d+)\.(\d+)$")
_RANK = re.compile(r"r(\d+):")
_COMPUTE = re.compile(r"([FBW])(\d+)\.(\d+)$")
_SI = re.compile(r"SI\(([^,()]*),([^,()]*)\)$")
_TRANSFER = re.compile(r"(SEND|RECV)_([FB])(\d+)\.(\d+)([<>])(\d+)$")
_TOKEN = re.compile(r"\S+")


def parse_lowered(text: str, path: str = "<lowered>") -> Lowered:
    """Parse the text form back into a :class:`Lowered`; spans point into ``text``.

    Checks the layout only (header, a stage line naming every slot once, rank lines r0..r{p-1}
    in order, well-formed actions); whether the actions make a runnable schedule is
    :func:`validate.validate_lowered`'s job. Raises :class:`ParseError` at the offending token.
    """
    source = Source(path, text)
    lines = [(number, line.split("#", 1)[0].strip())
             for number, line in enumerate(text.splitlines(), start=1)]
    lines = [(number, line) for number, line in lines if line]
    if not lines:
        raise ParseError("empty schedule text", Span(source, 1, 1, 1, 2),
                         [_HEADER_HINT])
    name, ranks, microbatches, chunks, copies = _parse_header(source, *lines[0])
    if len(lines) < 2 or not lines[1][1].startswith("stages:"):
        number = lines[1][0] if len(lines) > 1 else lines[0][0]
        raise ParseError("expected the stage line after the header", _line_span(source, number),
                         ["write `stages: r0.0 r1.0 …`, the (rank, chunk) of each stage in "
                          "model order"])
    stages = _parse_stages(source, lines[1][0], ranks, chunks)
    rows = _parse_rank_lines(source, lines[2:], ranks, lines[1][0])
    return Lowered(name, ranks, microbatches, chunks, stages, rows, span=_line_span(source, lines[0][0]),
                   copies=copies)


_HEADER_HINT = "a schedule starts with `lowered NAME p=4 m=8 v=1`"


def _parse_header(source: Source, number: int, line: str):
    match = _HEADER.match(line)
    if not match:
        raise ParseError("malformed header", _line_span(source, number), [_HEADER_HINT])
    name, *sizes = match.groups()
    ranks, microbatches, chunks = (int(size) for size in sizes[:3])
    copies = int(sizes[3]) if sizes[3] is not None else 1
    if min(ranks, microbatches, chunks, copies) < 1:
        raise ParseError("p, m, v and copies must be at least 1", _line_span(source, number))
    if (ranks * chunks) % copies or microbatches % copies:
        raise ParseError(f"copies={copies} must divide the p·v = {ranks * chunks} stages and the m = "
                         f"{microbatches} micro-batches", _line_span(source, number),
                         ["each model copy has as many stages and micro-batches as the others"])
    return name, ranks, microbatches, chunks, copies


def _parse_stages(source: Source, number: int, ranks: int, chunks: int):
    line = source.line(number).split("#", 1)[0]
    slots = []
    for token, span in _tokens(source, number, line, line.index("stages:") + len("stages:")):
        match = _SLOT.match(token)
        if not match:
            raise ParseError(f"malformed stage slot {token!r}", span,
                             ["a slot is r{rank}.{chunk}, e.g. r3.1"])
        slot = (int(match[1]), int(match[2]))
        if slot[0] >= ranks or slot[1] >= chunks or slot in slots:
            raise ParseError(f"stage slot {token} is out of range or repeated", span,
                             [f"list each of the {ranks * chunks} slots r0.0 … "
                              f"r{ranks - 1}.{chunks - 1} once"])
        slots.append(slot)
    if len(slots) != ranks * chunks:
        raise ParseError(f"the stage line names {len(slots)} slots, expected p·v = "
                         f"{ranks * chunks}", _line_span(source, number))
    return tuple(slots)


def _parse_rank_lines(source: Source, lines, ranks: int, last_number: int):
    rows: list[tuple[Action, ...]] = []
    for number, _ in lines:
        line = source.line(number)
        match = _RANK.match(line.lstrip())
        offset = len(line) - len(line.lstrip())
        if not match or int(match[1]) != len(rows):
            span = _line_span(source, number)
            if len(rows) == ranks:
                raise ParseError(f"more rank lines than p = {ranks}", span)
            raise ParseError(f"expected the line of rank {len(rows)}", span,
                             [f"write `r{len(rows)}: …`; rank lines come in order r0 … "
                              f"r{ranks - 1}"])
        if len(rows) == ranks:
            raise ParseError(f"more rank lines than p = {ranks}", _line_span(source, number))
        body = line.split("#", 1)[0]
        rows.append(tuple(_parse_action(token, span)
                          for token, span in _tokens(source, number, body,
                                                     offset + match.end())))
    if len(rows) < ranks:
        number = lines[-1][0] if lines else last_number
        raise ParseError(f"missing the line of rank {len(rows)} (p = {ranks})",
                         _line_span(source, number), [f"add `r{len(rows)}: …`"])
    return tuple(rows)


def _parse_action(token: str, span: Span) -> Action:
    match = _COMPUTE.match(token)
    if match:
        return Compute(match[1], int(match[2]), int(match[3]), span=span)
    match = _SI.match(token)
    if match:
        fwd, bwd = (_parse_action(part, span) for part in match.groups())
        if not (isinstance(fwd, Compute) and fwd.kind == "F"
                and isinstance(bwd, Compute) and bwd.kind == "B"):
            raise ParseError(f"malformed SI block {token!r}", span,
                             ["an SI block pairs a forward with a backward: SI(F4.0,B1.1)"])
        return Interleaved(fwd, bwd, span=span)
    match = _TRANSFER.match(token)
    if match:
        kind, data, microbatch, chunk, arrow, peer = match.groups()
        if arrow != (">" if kind == "SEND" else "<"):
            raise ParseError(f"malformed transfer {token!r}", span,
                             ["a SEND points to its peer with '>', a RECV with '<': "
                              "SEND_F3.0>1, RECV_F3.0<0"])
        return Transfer(kind, data, int(microbatch), int(chunk), int(peer), span=span)
    raise ParseError(f"unknown action {token!r}", span,
                     ["actions are F3.0, B3.0, W3.0, SI(F4.0,B1.1), SEND_F3.0>1, RECV_B3.0<2"])


def _tokens(source: Source, number: int, line: str, start: int):
    for match in _TOKEN.finditer(line, start):
        yield match.group(), Span(source, number, match.start() + 1, number, match.end() + 1)


def _line_span(source: Source, number: int) -> Span:
    line = source.line(number)
    indent = len(line) - len(line.lstrip())
    return Span(source, number, indent + 1, number, max(indent + 2, len(line.rstrip()) + 1))


# --- the rank × step grid of error messages ---------------------------------------------

def format_grid(lowered: Lowered, marks: dict[int, int], context: int = 4) -> str:
    """Rank × step grid around the marked steps; ``marks`` maps rank → marked step.

    Shows steps ``context`` before the first mark to ``context`` after the last (all steps
    when nothing is marked and the schedule is short); a marked cell is wrapped in ``>…<``.
    """
    longest = max((len(row) for row in lowered.actions), default=0)
    if marks:
        first = max(0, min(marks.values()) - context)
        stop = min(longest, max(marks.values()) + context + 1)
    else:
        first, stop = 0, min(longest, 2 * context + 1)
    cells = [[_cell(row, step, marks.get(rank) == step) for step in range(first, stop)]
             for rank, row in enumerate(lowered.actions)]
    widths = [max([len(str(first + i))] + [len(row[i]) for row in cells])
              for i in range(stop - first)]
    label = len(f"r{lowered.ranks - 1}")
    head = " " * label + "  step " + " ".join(
        str(first + i).ljust(w) for i, w in enumerate(widths))
    lines = [head.rstrip()]
    for rank, row in enumerate(cells):
        more = "…" if stop < len(lowered.actions[rank]) else ""
        less = "…" if first > 0 else " "
        text = " ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        lines.append(f"{f'r{rank}'.rjust(label)}  {less}    {text.rstrip()} {more}".rstrip())
    return "\n".join(lines)


def _cell(row, step: int, marked: bool) -> str:
    if step >= len(row):
        return ""
    text = str(row[step])
    return f">{text}<" if marked else f" {text} "
