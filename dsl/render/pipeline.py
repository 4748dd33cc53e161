"""The pipeline diagram: ranks as rows, unit time as columns, like the DHelix paper's Figs. 7–8.

One Graphviz node holds one HTML-like table (a second node below it, the legend). A ruler row
of one cell per time unit fixes the column widths; every action of a rank is one cell spanning
its unit-time duration (from :mod:`dsl.passes.unittime`), idle time is a pale cell. Forwards are blue
and backwards green, as in the paper; weight gradients (W) orange. An SI block is one cell split
in two: the forward on top over the backward below (the paper's [β5 / α1]). Transfers cost no
unit time and are not drawn.

Strands: when a schedule has SI blocks, every micro-batch gets a strand, α or β, such that the
two halves of each SI block are of opposite strands (micro-batch 0 is α); the labels then read
``α0`` / ``β4`` and the β shades are darker. Numbers are 0-based micro-batch indices, as in
``dhelix check --dump lower`` (the paper counts from 1). With v > 1 chunks per rank the chunk
follows as a subscript.

Long schedules wrap: past :data:`MAX_WIDTH_PX` of time columns the picture continues in
another band below (ruler and ranks again), cut at a ruler tick; an action cut by the wrap
shows in both bands.

Time scale: one whole-rank forward (v chunk forwards) is the same width whatever v is (down to
a least cell width for v > 2), so pictures of different folds compare directly; the ruler counts
whole-rank forwards.
"""

from __future__ import annotations

from collections import deque

from dhelix.dsl.render.dot import FONT, graph_header, html, quote
from dhelix.dsl.core.schedule import Compute, Interleaved, Lowered, computes
from dhelix.dsl.passes.unittime import Timing, describe, unit_time

#: Pixels per whole-rank forward, and the least per chunk action (narrower labels would clash).
WHOLE_UNIT_PX = 48
MIN_UNIT_PX = 22
ROW_PX = 36
HEADER_PX = 64
TICK_EVERY = 5  # whole-rank units between ruler labels
#: The widest band of time columns, in pixels; longer schedules wrap into several bands.
MAX_WIDTH_PX = 1100

#: (background, text) colours by kind and strand ("" when the schedule has no strands).
COLOURS = {
    ("F", ""): ("#6baed6", "black"), ("F", "α"): ("#9ecae1", "black"), ("F", "β"): ("#2171b5", "white"),
    ("B", ""): ("#74c476", "black"), ("B", "α"): ("#a1d99b", "black"), ("B", "β"): ("#238b45", "white"),
    ("W", ""): ("#fdae6b", "black"), ("W", "α"): ("#fdd0a2", "black"), ("W", "β"): ("#e6550d", "white"),
}
IDLE = "#f2f2f2"
BORDER = "#404040"


def pipeline_dot(lowered: Lowered, title: str = "") -> str:
    """DOT text of the pipeline diagram of ``lowered`` (assumed valid); ``title`` goes on top."""
    timing = unit_time(lowered)
    strands = strands_of(lowered)
    unit = max(MIN_UNIT_PX, WHOLE_UNIT_PX // lowered.chunks)
    rows = []
    for lo, hi in bands(timing.makespan, lowered.chunks, unit):
        if lo:  # a gap between the bands of a wrapped schedule
            rows.append(f'<TR><TD COLSPAN="{hi - lo + 1}" HEIGHT="16" FIXEDSIZE="TRUE"></TD></TR>')
        rows.append(_ruler(lo, hi, lowered.chunks, unit))
        for rank in range(lowered.ranks):
            # A thin blank row between ranks keeps neighbouring blocks apart.
            rows.append(f'<TR><TD COLSPAN="{hi - lo + 1}" HEIGHT="4" FIXEDSIZE="TRUE"></TD></TR>')
            rows.append(_rank_row(lowered, timing, rank, strands, unit, (lo, hi)))
    table = ('<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0">\n'
             + "\n".join(rows) + "\n</TABLE>")
    lines = graph_header("digraph", f"pipeline_{lowered.name}", label=title or None,
                         labelloc="t", fontname=FONT, fontsize="14", nodesep="0.1", ranksep="0.15")
    lines.append(f"  {quote('schedule')} [shape=plaintext, margin=0, label=<\n{table}\n>];")
    lines.append(f"  {quote('legend')} [shape=plaintext, margin=0, label=<\n{_legend(lowered, strands)}\n>];")
    lines.append(f"  {quote('schedule')} -> {quote('legend')} [style=invis];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def pipeline_title(lowered: Lowered, fold: str) -> str:
    """The diagram's title line: name, sizes, fold, make-span and bubble ratio."""
    return (f"{lowered.name}: p = {lowered.ranks}, m = {lowered.microbatches}, fold {fold} "
            f"(v = {lowered.chunks}); {describe(unit_time(lowered))}")


def strands_of(lowered: Lowered) -> dict[int, str]:
    """Micro-batch → 'α' or 'β' such that every SI block pairs two strands; {} without SI blocks.

    Two-colours the graph whose edges are the SI pairs, each component from its smallest
    micro-batch (α). Returns {} when the pairs admit no two-colouring (an odd cycle).
    """
    pairs = [(a.fwd.microbatch, a.bwd.microbatch) for row in lowered.actions for a in row
             if isinstance(a, Interleaved)]
    if not pairs:
        return {}
    neighbours: dict[int, set[int]] = {mb: set() for mb in range(lowered.microbatches)}
    for fwd, bwd in pairs:
        neighbours[fwd].add(bwd)
        neighbours[bwd].add(fwd)
    strand: dict[int, int] = {}
    for start in range(lowered.microbatches):
        if start in strand:
            continue
        strand[start] = 0
        queue = deque([start])
        while queue:
            mb = queue.popleft()
            for other in sorted(neighbours[mb]):
                if other not in strand:
                    strand[other] = 1 - strand[mb]
                    queue.append(other)
                elif strand[other] == strand[mb]:
                    return {}
    return {mb: "αβ"[side] for mb, side in sorted(strand.items())}


def bands(makespan: int, chunks: int, unit: int) -> list[tuple[int, int]]:
    """The time columns ``[lo, hi)`` of each band of the picture: one band when the schedule
    fits :data:`MAX_WIDTH_PX`, else bands of whole ruler ticks stacked top to bottom (a long
    schedule wraps like text instead of making a picture thousands of pixels wide)."""
    tick = chunks * TICK_EVERY
    width = max(tick, (MAX_WIDTH_PX // unit) // tick * tick)
    if makespan <= width:
        return [(0, makespan)]
    return [(lo, min(lo + width, makespan)) for lo in range(0, makespan, width)]


def _ruler(lo: int, hi: int, chunks: int, unit: int) -> str:
    cells = [f'<TD WIDTH="{HEADER_PX}" HEIGHT="18" FIXEDSIZE="TRUE" ALIGN="LEFT">'
             f'<FONT POINT-SIZE="9" COLOR="#606060">time →</FONT></TD>']
    for column in range(lo, hi):
        tick = column % (chunks * TICK_EVERY) == 0
        text = f'<FONT POINT-SIZE="9" COLOR="#606060">{column // chunks}</FONT>' if tick else ""
        side = ' SIDES="L" BORDER="1" COLOR="#b0b0b0"' if tick else ""
        cells.append(f'<TD WIDTH="{unit}" HEIGHT="18" FIXEDSIZE="TRUE" ALIGN="LEFT"{side}>{text}</TD>')
    return "<TR>" + "\n".join(cells) + "</TR>"


def _rank_row(lowered: Lowered, timing: Timing, rank: int, strands: dict[int, str], unit: int,
              band: tuple[int, int]) -> str:
    # The rank's actions and idle stretches, each cut to the band's columns [lo, hi).
    lo, hi = band
    cells = [f'<TD WIDTH="{HEADER_PX}" HEIGHT="{ROW_PX}" FIXEDSIZE="TRUE" ALIGN="LEFT">'
             f'<B>rank {rank}</B></TD>']
    now = lo
    for action, start, end in zip(lowered.actions[rank], timing.starts[rank], timing.ends[rank],
                                  strict=True):
        start, end = max(start, lo), min(end, hi)
        if end <= start:  # transfers take no unit time; other bands' actions
            continue
        if start > now:
            cells.append(_idle(start - now, unit))
        cells.append(_action_cell(action, end - start, unit, strands, lowered.chunks))
        now = end
    if hi > now:
        cells.append(_idle(hi - now, unit))
    return "<TR>" + "\n".join(cells) + "</TR>"


def _idle(units: int, unit: int) -> str:
    return (f'<TD COLSPAN="{units}" WIDTH="{units * unit}" HEIGHT="{ROW_PX}" FIXEDSIZE="TRUE" '
            f'BGCOLOR="{IDLE}"></TD>')


def _action_cell(action, units: int, unit: int, strands: dict[int, str], chunks: int) -> str:
    width = units * unit
    span = f'COLSPAN="{units}" WIDTH="{width}" HEIGHT="{ROW_PX}" FIXEDSIZE="TRUE"'
    if isinstance(action, Interleaved):
        # Two stacked halves inside one bordered cell: forward over backward, as in Fig. 8.
        half = ROW_PX // 2
        inner = "".join(f"<TR>{_compute_cell(part, width - 2, half - 1, strands, chunks, False)}</TR>"
                        for part in action.parts)
        return (f'<TD {span} BORDER="1" COLOR="{BORDER}" CELLPADDING="0">'
                f'<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0">{inner}'
                f'</TABLE></TD>')
    return _compute_cell(action, width, ROW_PX, strands, chunks, True, span)


def _compute_cell(part: Compute, width: int, height: int, strands: dict[int, str], chunks: int,
                  border: bool, span: str | None = None) -> str:
    strand = strands.get(part.microbatch, "")
    background, ink = COLOURS[(part.kind, strand)]
    label = f"{strand}{part.microbatch}"
    if chunks > 1:
        label += f"<SUB>{part.chunk}</SUB>"
    size = span or f'WIDTH="{width}" HEIGHT="{height}" FIXEDSIZE="TRUE"'
    frame = f' BORDER="1" COLOR="{BORDER}"' if border else ""
    return (f'<TD {size} BGCOLOR="{background}"{frame}>'
            f'<FONT POINT-SIZE="10" COLOR="{ink}">{label}</FONT></TD>')


def _legend(lowered: Lowered, strands: dict[int, str]) -> str:
    kinds = sorted({part.kind for row in lowered.actions for a in row for part in computes(a)},
                   key="FBW".index)
    names = {"F": "forward", "B": "input gradient" if lowered.split else "backward",
             "W": "weight gradient"}
    entries = []
    for kind in kinds:
        for strand in ("α", "β") if strands else ("",):
            background, ink = COLOURS[(kind, strand)]
            text = f"{names[kind]} {strand}".rstrip()
            entries.append(f'<TD BGCOLOR="{background}" BORDER="1" COLOR="{BORDER}" CELLPADDING="3">'
                           f'<FONT POINT-SIZE="9" COLOR="{ink}">{html(text)}</FONT></TD>')
    if any(isinstance(a, Interleaved) for row in lowered.actions for a in row):
        entries.append('<TD CELLPADDING="3"><FONT POINT-SIZE="9">SI block: forward over '
                       'backward, co-executed</FONT></TD>')
    chunk_note = ("; subscript = chunk" if lowered.chunks > 1 else "")
    entries.append(f'<TD CELLPADDING="3"><FONT POINT-SIZE="9">numbers: micro-batch (0-based)'
                   f'{chunk_note}; ruler: whole-rank forwards</FONT></TD>')
    return ('<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="4" CELLPADDING="0"><TR>'
            + "".join(entries) + "</TR></TABLE>")
