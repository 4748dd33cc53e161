"""The placement diagram: which layers each pipeline rank holds, chunk by chunk.

Ranks are rows (rank 0 on top), chunks are columns (chunk 0 on the left), one box per stage
with its layers. Arrows join consecutive stages in model order: solid between ranks (a
SEND/RECV), dashed inside a rank (a local hand-off). For ``fold u`` the arrows draw the paper's
U (Fig. 7, right): chunk 0 runs down the ranks, turns on the last rank and chunk 1 comes back
up, so the model's input and its loss are both on rank 0. For ``fold bidir`` the two model
copies run in opposite directions, each with its own input and loss.
"""

from __future__ import annotations

from dhelix.dsl.passes.fold import Placement, Stage
from dhelix.dsl.render.dot import FONT, attributes, graph_header, html, quote

#: Fill colours of chunk 0, 1, … (cycled beyond).
CHUNK_FILLS = ("#deebf7", "#fdd0a2", "#c7e9c0", "#dadaeb")


def placement_dot(placement: Placement, model: str, layers: int) -> str:
    """DOT text of the placement diagram of ``placement`` for ``model`` with ``layers`` layers."""
    title = (f"{model}: fold {placement.kind}, {layers} layers on {placement.ranks} "
             f"rank{'s' if placement.ranks != 1 else ''}, {placement.chunks} "
             f"chunk{'s' if placement.chunks != 1 else ''} per rank")
    lines = graph_header("digraph", "placement", label=title, labelloc="t", fontname=FONT,
                         fontsize="14", newrank="true", rankdir="TB", nodesep="0.6", ranksep="0.45")
    lines.append(f"  node {attributes(shape='box', style='rounded,filled', color='#404040')};")
    for rank in range(placement.ranks):
        lines += _rank_cluster(placement, rank)
    lines += _ends(placement)
    lines += _stage_edges(placement)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node(stage: Stage) -> str:
    return quote(f"s{stage.index}")


def _rank_cluster(placement: Placement, rank: int) -> list[str]:
    stages = [placement.stage_at(rank, chunk) for chunk in range(placement.chunks)]
    lines = [f"  subgraph {quote(f'cluster_rank{rank}')} {{",
             f"    graph {attributes(label=f'rank {rank}', labeljust='l', style='rounded', color='#909090')};"]
    for stage in stages:
        fill = CHUNK_FILLS[stage.chunk % len(CHUNK_FILLS)]
        label = (f"<<B>{html(_layers(stage))}</B><BR/><FONT POINT-SIZE=\"9\">stage {stage.index}"
                 f" · chunk {stage.chunk}</FONT>>")
        lines.append(f"    {_node(stage)} [label={label}, fillcolor={quote(fill)}];")
    lines.append("    { rank=same; " + " ".join(_node(stage) for stage in stages) + " }")
    # Keep chunk 0 left of chunk 1 … whatever the stage arrows say.
    for left, right in zip(stages, stages[1:]):
        lines.append(f"    {_node(left)} -> {_node(right)} [style=invis];")
    lines.append("  }")
    return lines


def _layers(stage: Stage) -> str:
    last = stage.stop_layer - 1
    return f"L{stage.first_layer}" + (f"–L{last}" if last > stage.first_layer else "")


def _ends(placement: Placement) -> list[str]:
    """The model's input above the first stage, its loss beside (or below) the last one; for
    two model copies (fold bidir) each copy's, named by its copy."""
    if placement.copies > 1:
        return _copy_ends(placement)
    first, last = placement.stages[0], placement.stages[-1]
    plain = {"shape": "plaintext", "style": "", "fontsize": "11"}
    lines = [f"  {quote('input')} {attributes(label='input', **plain)};",
             f"  {quote('loss')} {attributes(label='loss', **plain)};",
             f"  {quote('input')} -> {_node(first)} [color=\"#404040\"];"]
    if last.rank == first.rank:
        # Folded back (fold u): the loss is on the first rank too, so it sits beside the input.
        lines += [f"  {{ rank=same; {quote('input')}; {quote('loss')} }}",
                  f"  {quote('input')} -> {quote('loss')} [style=invis];",
                  f"  {_node(last)} -> {quote('loss')} [color=\"#404040\", constraint=false];"]
    else:
        lines.append(f"  {_node(last)} -> {quote('loss')} [color=\"#404040\"];")
    return lines


def _copy_ends(placement: Placement) -> list[str]:
    """Fold bidir's ends: each copy's input beside its first stage, its loss beside its last
    (copy 0 is fed at rank 0 and ends at rank p - 1, copy 1 the other way)."""
    plain = {"shape": "plaintext", "style": "", "fontsize": "11", "constraint": "false"}
    lines = []
    for stage in placement.stages:
        copy = placement.copy_of(stage.index)
        for end, is_end, edge in (("input", placement.is_first, "{end} -> {node}"),
                                  ("loss", placement.is_last, "{node} -> {end}")):
            if is_end(stage.index):
                name = quote(f"{end}{copy}")
                lines.append(f"  {name} {attributes(label=f'{end} (copy {copy})', **plain)};")
                lines.append("  " + edge.format(end=name, node=_node(stage))
                             + ' [color="#404040", constraint=false];')
    return lines


def _stage_edges(placement: Placement) -> list[str]:
    lines = []
    for stage, after in zip(placement.stages, placement.stages[1:]):
        if placement.neighbour(stage.index, 1) != after.index:
            continue  # the next model copy starts: no hand-off between copies
        style = {"penwidth": "1.6", "color": "#2171b5"}
        if after.rank == stage.rank:
            style.update(style="dashed", label=" local", fontsize="9")
        if after.rank < stage.rank:
            # Arrows going back up must not pull the rows out of rank order.
            style["constraint"] = "false"
        lines.append(f"  {_node(stage)} -> {_node(after)} {attributes(**style)};")
    return lines
