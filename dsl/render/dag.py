"""The DAG diagram: a layer's forward operator DAG beside its derived backward DAG.

One cluster per direction (forward framed blue, backward green, the paper's colours). Compute
operators are boxes; communication operators are hexagons coloured by lane: orange for the
node-local lane, red for the cross-node lane (``dsl.core.mesh``: a group inside one node is local).
Each box shows the op's name, its library op (with the group it communicates over), its per-GPU
output shape and, for a backward op, the forward tensors it reads back. Movable operators (weight
gradients, by default) have a dashed outline: the planner may move them within the order.
Edges follow the ops' inputs; the layer input comes in on top, the output is double-framed.
"""

from __future__ import annotations

from dhelix.dsl.core.program import LayerDag, Op
from dhelix.dsl.render.dot import FONT, attributes, graph_header, html, quote, with_html_label

COMPUTE_FILL = "#eef3fa"
LANE_FILLS = {"local": "#fdd0a2", "cross": "#fc9272", "compute": COMPUTE_FILL}
FRAMES = {"forward": "#2171b5", "backward": "#238b45"}


def dag_dot(forward: LayerDag, backward: LayerDag) -> str:
    """DOT text of ``forward`` and ``backward`` (the same layer) side by side."""
    title = (f"layer {forward.name}: forward ({len(forward.ops)} ops) and derived backward "
             f"({len(backward.ops)} ops)")
    lines = graph_header("digraph", f"dag_{forward.name}", label=title, labelloc="t",
                         fontname=FONT, fontsize="14", rankdir="TB", nodesep="0.25", ranksep="0.3",
                         newrank="true")
    lines.append(f"  node {attributes(shape='box', style='rounded,filled', fontsize='10', color='#404040')};")
    lines.append(f"  edge {attributes(color='#505050', arrowsize='0.7')};")
    for dag in (forward, backward):
        lines += _cluster(dag)
    # Both inputs on the top row, so the two clusters start level.
    lines.append(f"  {{ rank=same; {_id(forward, forward.input)}; {_id(backward, backward.input)} }}")
    lines += _legend()
    # Hang the legend under both clusters.
    for dag in (forward, backward):
        lines.append(f"  {_id(dag, dag.output)} -> {quote('legend')} [style=invis];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _id(dag: LayerDag, name: str) -> str:
    return quote(f"{dag.direction}:{name}")


def _cluster(dag: LayerDag) -> list[str]:
    comms = sum(op.kind == "comm" for op in dag.ops)
    label = (f"{dag.direction} ({len(dag.ops) - comms} compute, {comms} communication)"
             if dag.direction == "forward" else
             f"backward, derived ({len(dag.ops) - comms} compute, {comms} communication)")
    frame = FRAMES.get(dag.direction, "#404040")
    lines = [f"  subgraph {quote(f'cluster_{dag.direction}')} {{",
             f"    graph {attributes(label=label, color=frame, penwidth='1.5', style='rounded')};"]
    rows, cols = dag.input_shape
    lines.append(f"    {_id(dag, dag.input)} "
                 f"{attributes(shape='plaintext', style='', label=f'{dag.input} [{rows}, {cols}]')};")
    names = {op.name for op in dag.ops} | {dag.input}
    for op in dag.ops:
        lines.append(f"    {_id(dag, op.name)} {_op_attributes(op, op.name == dag.output)};")
    for op in dag.ops:
        for source in op.inputs:
            if source not in names:  # an input the DAG does not define: draw it as a plain name
                names.add(source)
                lines.append(f"    {_id(dag, source)} {attributes(shape='plaintext', style='')};")
            lines.append(f"    {_id(dag, source)} -> {_id(dag, op.name)};")
        for source in op.waits:  # an order, not a value: dashed
            lines.append(f"    {_id(dag, source)} -> {_id(dag, op.name)} [style=dashed];")
    lines.append("  }")
    return lines


def _op_attributes(op: Op, is_output: bool) -> str:
    group = f"({op.axis}={op.group_size})" if op.axis and op.group_size > 1 else ""
    rows = [f"<B>{html(op.name)}</B>", f"{html(op.op + group)} [{op.shape[0]}, {op.shape[1]}]"]
    if op.kind == "comm":
        rows.append(f"<I>{op.lane} lane</I>")
    if op.saved:
        rows.append(f'<FONT COLOR="#606060">reads {html(", ".join(op.saved))}</FONT>')
    if op.movable:
        rows.append("<I>movable</I>")
    styles = ["filled"] + (["dashed"] if op.movable else []) + ([] if op.kind == "comm" else ["rounded"])
    return with_html_label("<BR/>".join(rows), shape="hexagon" if op.kind == "comm" else None,
                           style=",".join(styles), fillcolor=LANE_FILLS.get(op.lane, COMPUTE_FILL),
                           peripheries="2" if is_output else None)


def _legend() -> list[str]:
    cells = [(f'BGCOLOR="{COMPUTE_FILL}" BORDER="1"', "compute"),
             (f'BGCOLOR="{LANE_FILLS["local"]}" BORDER="1"', "communication, local lane"),
             (f'BGCOLOR="{LANE_FILLS["cross"]}" BORDER="1"', "communication, cross-node lane"),
             ('BORDER="1" STYLE="dashed"', "movable"),
             ("", "double frame: layer output")]
    row = "".join(f'<TD {attrs}><FONT POINT-SIZE="9">{html(text)}</FONT></TD>' for attrs, text in cells)
    table = f'<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="4" CELLPADDING="3"><TR>{row}</TR></TABLE>'
    return [f"  {quote('legend')} {with_html_label(table, shape='plaintext', style='')};"]
