"""The pairing "ladder": an SI plan drawn as two rails joined by rungs (Graphviz DOT text).

The left rail is the forward strand's layer (β), the right rail the backward strand's (α),
both top to bottom in the plan's order. Each rung is one segment pair: the forward segment's
ops on the left, the backward segment's on the right, and on the rung the pair's predicted
time against running the two segments one after the other. An empty side (∅) means the other
segment runs alone. Ops are coloured by lane, as in the pipeline diagram's palette: forward
compute blue, backward compute green, node-local communication purple, cross-node
communication red; ops the strands block lets move (``movable``) are in italics.

The text is deterministic (no dict or set order, fixed number formats), so it diffs cleanly.
"""

from __future__ import annotations

from dhelix.dsl.core.plan import Plan, SegmentPair
from dhelix.dsl.core.table import duration
from dhelix.dsl.render.dot import FONT, graph_header, html, quote

#: Cell colours by (strand, lane); text is black on all of them.
COLOURS = {
    ("forward", "compute"): "#9ecae1", ("backward", "compute"): "#a1d99b",
    ("forward", "local"): "#dadaeb", ("backward", "local"): "#dadaeb",
    ("forward", "cross"): "#fcbba1", ("backward", "cross"): "#fcbba1",
}
EMPTY = "#f2f2f2"


def ladder_dot(plan: Plan) -> str:
    """DOT text of the ladder of ``plan`` (see the module docstring)."""
    time = _timer(plan.unit)
    title = (f"SI plan: {plan.forward_layer} forward (β) × {plan.backward_layer} backward (α)\n"
             f"{len(plan.pairs)} segment pairs; predicted {time(plan.total)}, sequential "
             f"{time(plan.sequential)}, speedup {plan.speedup:.3f}x; communication hidden "
             f"{100 * plan.comm_hidden_fraction:.1f}%")
    lines = graph_header("digraph", f"ladder_{plan.forward_layer}_{plan.backward_layer}", label=title,
                         labelloc="t", fontname=FONT, fontsize="14", rankdir="TB", nodesep="1.2",
                         ranksep="0.25")
    lines.append(f"  node {_attrs(shape='plaintext', margin='0', fontsize='11')};")
    lines.append(f"  {quote('f_head')} {_label(_header('forward strand (β)'))};")
    lines.append(f"  {quote('b_head')} {_label(_header('backward strand (α)'))};")
    lines.append(f"  {{ rank=same; {quote('f_head')}; {quote('b_head')}; }}")
    previous = ("f_head", "b_head")
    ops = {op.name: op for op in plan.ops}
    for k, pair in enumerate(plan.pairs, 1):
        left, right = f"f{k}", f"b{k}"
        lines.append(f"  {quote(left)} {_label(_segment(pair.forward, ops, 'forward'))};")
        lines.append(f"  {quote(right)} {_label(_segment(pair.backward, ops, 'backward'))};")
        lines.append(f"  {{ rank=same; {quote(left)}; {quote(right)}; }}")
        lines.append(f"  {quote(left)} -> {quote(right)} {_rung(k, pair, time)};")
        for rail, node in zip(previous, (left, right), strict=True):
            lines.append(f"  {quote(rail)} -> {quote(node)} {_attrs(color='#808080', arrowsize='0.6')};")
        previous = (left, right)
    lines.append(f"  {quote('legend')} {_label(_legend())};")
    # Below both rails, so the legend sits centred under the ladder, not under one rail.
    for rail in previous:
        lines.append(f"  {quote(rail)} -> {quote('legend')} [style=invis];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _attrs(**values) -> str:
    return "[" + ", ".join(f"{key}={quote(value)}" for key, value in values.items()) + "]"


def _label(table: str) -> str:
    return f"[label=<{table}>]"


def _header(text: str) -> str:
    return f'<TABLE BORDER="0" CELLPADDING="2"><TR><TD><B>{html(text)}</B></TD></TR></TABLE>'


def _segment(names: tuple[str, ...], ops: dict, strand: str) -> str:
    if not names:
        return (f'<TABLE BORDER="1" CELLBORDER="0" CELLPADDING="3" COLOR="#b0b0b0"><TR>'
                f'<TD BGCOLOR="{EMPTY}">∅</TD></TR></TABLE>')
    cells = []
    for name in names:
        op = ops[name]
        text = html(name) + ("" if op.lane == "compute" else f" ({html(op.lane)})")
        if op.moving:
            text = f"<I>{text}</I>"
        cells.append(f'<TR><TD BGCOLOR="{COLOURS[(strand, op.lane)]}" ALIGN="LEFT">{text}</TD></TR>')
    return '<TABLE BORDER="1" CELLBORDER="0" CELLSPACING="1" CELLPADDING="3">' + "".join(cells) + "</TABLE>"


def _timer(unit: str):
    """Times of the plan's ``unit`` as text: seconds with three significant digits in the
    unit that reads best (so a tiny op is never "0.000 ms"); other units as they are."""
    if unit == "s":
        return duration
    return lambda value: f"{value:.4g} {unit}"


def _rung(k: int, pair: SegmentPair, time) -> str:
    if pair.forward and pair.backward:
        label = f"#{k}  {time(pair.time)}\n(apart {time(pair.alone)})"
        return _attrs(label=label, dir="none", penwidth="2", color="#404040")
    label = f"#{k}  {time(pair.time)} alone"
    return _attrs(label=label, dir="none", style="dashed", color="#b0b0b0")


def _legend() -> str:
    rows = [(COLOURS[("forward", "compute")], "forward compute"),
            (COLOURS[("backward", "compute")], "backward compute"),
            (COLOURS[("forward", "local")], "node-local communication"),
            (COLOURS[("forward", "cross")], "cross-node communication")]
    # Two rows of two, then the notes: no wider than the ladder itself.
    cells = [f'<TD BGCOLOR="{colour}">{html(text)}</TD>' for colour, text in rows]
    return (f'<TABLE BORDER="0" CELLSPACING="4" CELLPADDING="3"><TR>{"".join(cells[:2])}</TR>'
            f'<TR>{"".join(cells[2:])}</TR>'
            f'<TR><TD COLSPAN="2"><I>italic</I>: movable; ∅: the other segment runs alone</TD></TR></TABLE>')
