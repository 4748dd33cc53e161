"""SVG pictures of a simulated step, drawn without Graphviz: the timeline of every pipeline
rank and the memory of every rank against the device.

**Timeline** (:func:`timeline_svg`): one band per pipeline rank, time left to right on one
scale for all ranks. Each band has the rank's lanes as rows:

- ``compute``: the actions (F blue, B green, W orange, an SI block blue over green, the
  optimizer grey), with an SI block's segment pairs marked by thin white lines when the
  simulation was run with ``detail=True``; under it a thin strip splits each action's layer
  communication (its tensor-, context-, expert-parallel collectives) into the part hidden
  behind computation (grey) and the part exposed (red), proportionally;
- ``local`` and ``cross``: the communication lanes, each as two rows — the collectives that
  SI segment pairs run there (``layer``) and the pipeline sends and data-parallel
  collectives (``p2p / dp``).

Every shape carries a ``<title>`` (the browser shows it on hover): the event's name, start,
duration and arguments. **Memory** (:func:`memory_svg`): one bar per rank, model states
(weights, gradients, optimizer) and the activation peak stacked, with the device's memory
as a red line when the profile gives it.

The SVG is written for inline use in HTML5 (no XML prolog, no namespace attributes, no
external references) and is deterministic.
"""

from __future__ import annotations

from dhelix.dsl.core.table import duration
from html import escape as html

WIDTH = 1000
LEFT = 130  # the label column
ROW = 18
STRIP = 6
SUB = 10  # a communication lane's half row
GAP = 14  # between ranks

COLOURS = {"F": "#6baed6", "B": "#74c476", "W": "#fdae6b", "optimizer": "#bdbdbd", "SEND": "#9e9ac8",
           "DP": "#fb6a4a", "SI collective": "#dadaeb", "hidden": "#969696", "exposed": "#de2d26"}
INK = "#404040"


def timeline_svg(events, ranks: int, step: float) -> str:
    """The timeline of a simulation's trace ``events`` (TraceEvents) over ``ranks`` pipeline
    ranks and ``step`` seconds (see the module docstring)."""
    scale = (WIDTH - LEFT - 10) / step if step > 0 else 0.0
    band = ROW + STRIP + 4 * SUB + 2
    height = 24 + ranks * (band + GAP)
    parts = [_axis(step, scale, height)]
    by_rank: dict[int, list] = {r: [] for r in range(ranks)}
    for event in events:
        by_rank.setdefault(event.rank, []).append(event)
    for rank in range(ranks):
        top = 24 + rank * (band + GAP)
        parts.append(_rank_band(rank, sorted(by_rank[rank], key=_order), top, scale))
    return _svg(WIDTH, height, "".join(parts))


def _order(event) -> tuple:
    return (event.start, -event.duration, event.lane, event.name)


def _svg(width: int, height: int, body: str) -> str:
    return (f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'font-family="Helvetica, Arial, sans-serif" font-size="11">{body}</svg>\n')


def _axis(step: float, scale: float, height: int) -> str:
    ticks = []
    for k in range(11):
        x = LEFT + k * step / 10 * scale
        ticks.append(f'<line x1="{x:.1f}" y1="14" x2="{x:.1f}" y2="{height}" stroke="#e0e0e0"/>'
                     f'<text x="{x:.1f}" y="11" text-anchor="{"end" if k == 10 else "middle"}" fill="#606060">'
                     f'{html(duration(k * step / 10))}</text>')
    return "".join(ticks)


def _rank_band(rank: int, events, top: float, scale: float) -> str:
    rows = {"compute": top, "strip": top + ROW, "local layer": top + ROW + STRIP + 2,
            "local": top + ROW + STRIP + 2 + SUB, "cross layer": top + ROW + STRIP + 2 + 2 * SUB,
            "cross": top + ROW + STRIP + 2 + 3 * SUB}
    out = [f'<text x="4" y="{top + 13}" font-weight="bold">pipeline rank {rank}</text>',
           f'<text x="70" y="{top + ROW + STRIP + 10}" fill="#606060">local</text>',
           f'<text x="70" y="{top + ROW + STRIP + 10 + 2 * SUB}" fill="#606060">cross</text>']
    for y in (rows["local layer"], rows["cross layer"]):
        out.append(f'<rect x="{LEFT}" y="{y}" width="{WIDTH - LEFT - 10}" height="{2 * SUB}" fill="#fafafa"/>')
    for event in events:
        x, w = LEFT + event.start * scale, max(event.duration * scale, 0.5)
        args = event.args or {}
        kind = args.get("kind", "")
        if event.lane == "compute":
            out.append(_compute_shape(event, kind, x, w, rows))
        elif event.lane in ("local", "cross"):
            y = rows[f"{event.lane} layer"] if kind == "SI collective" else rows[event.lane]
            fill = COLOURS.get(kind, COLOURS["DP"])
            out.append(_rect(x, y + 1, w, SUB - 2, fill, _tip(event)))
    return "".join(out)


def _compute_shape(event, kind: str, x: float, w: float, rows: dict) -> str:
    y = rows["compute"]
    if kind == "SI pair":
        # A segment pair's boundary inside its SI block.
        return (f'<line x1="{x:.2f}" y1="{y + 2}" x2="{x:.2f}" y2="{y + ROW - 2}" stroke="white" '
                f'stroke-width="0.6"><title>{html(_tip(event))}</title></line>')
    tip = _tip(event)
    if kind == "SI":
        shape = (_rect(x, y, w, ROW / 2, COLOURS["F"], tip, stroke=False)
                 + _rect(x, y + ROW / 2, w, ROW / 2, COLOURS["B"], tip, stroke=False)
                 + f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW}" fill="none" stroke="{INK}" '
                   f'stroke-width="0.5"/>')
    else:
        shape = _rect(x, y, w, ROW, COLOURS.get(kind, COLOURS["optimizer"]), tip)
    args = event.args or {}
    comm, exposed = args.get("layer_comm_s", 0.0), args.get("layer_comm_exposed_s", 0.0)
    if comm > 0:
        share = min(1.0, exposed / comm)
        strip = rows["strip"]
        text = f"{event.name}: layer communication {duration(comm)}, exposed {duration(exposed)}"
        shape += _rect(x, strip + 1, w * (1 - share), STRIP - 2, COLOURS["hidden"], text, stroke=False)
        shape += _rect(x + w * (1 - share), strip + 1, w * share, STRIP - 2, COLOURS["exposed"], text,
                       stroke=False)
    return shape


def _rect(x: float, y: float, w: float, h: float, fill: str, tip: str, stroke: bool = True) -> str:
    line = f' stroke="{INK}" stroke-width="0.5"' if stroke else ""
    return (f'<rect x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{h:.1f}" fill="{fill}"{line}>'
            f'<title>{html(tip)}</title></rect>')


def _tip(event) -> str:
    lines = [f"{event.name} ({event.lane})", f"start {duration(event.start)}, {duration(event.duration)}"]
    for key, value in (event.args or {}).items():
        if isinstance(value, float):
            value = duration(value) if key.endswith("_s") else f"{value:.4g}"
        elif isinstance(value, (list, tuple)):
            value = ", ".join(str(item) for item in value) or "-"
        lines.append(f"{key}: {value}")
    return "\n".join(lines)


def memory_svg(ranks, capacity: float | None, unit: tuple[str, float]) -> str:
    """Bars of each rank's predicted peak (``ranks``: the simulator's RankStats) against the
    device's ``capacity`` in bytes (None: not known); ``unit`` is (name, bytes) for labels.
    A device more than four times the largest peak is named, not drawn (the bars would not show)."""
    peak = max(r.memory for r in ranks)
    drawn = capacity if capacity and capacity <= 4 * peak else None
    top = max(peak, drawn or 0.0) * 1.08 or 1.0
    scale = (WIDTH - LEFT - 120) / top
    height = 30 + 26 * len(ranks)
    parts = []
    for i, r in enumerate(ranks):
        y, x = 20 + 26 * i, float(LEFT)
        parts.append(f'<text x="4" y="{y + 13}">pipeline rank {r.rank}</text>')
        pieces = (("weights", r.states.params, "#6baed6"), ("gradients", r.states.grads, "#74c476"),
                  ("optimizer", r.states.optimizer, "#fdae6b"), ("activations (peak)", r.activations, "#9e9ac8"))
        for name, size, fill in pieces:
            parts.append(_rect(x, y, size * scale, 18, fill, f"rank {r.rank} {name}: {_size(size, unit)}"))
            x += size * scale
        share = f" ({100 * r.memory / capacity:.3g}% of the device)" if capacity else ""
        parts.append(f'<text x="{x + 6:.1f}" y="{y + 13}">{html(_size(r.memory, unit) + share)}</text>')
    if drawn:
        x = LEFT + drawn * scale
        parts.append(f'<line x1="{x:.1f}" y1="14" x2="{x:.1f}" y2="{height - 4}" stroke="{COLOURS["exposed"]}" '
                     f'stroke-width="2"/><text x="{x:.1f}" y="11" text-anchor="middle" '
                     f'fill="{COLOURS["exposed"]}">device {html(_size(drawn, unit))}</text>')
    return _svg(WIDTH, height, "".join(parts))


def _size(nbytes: float, unit: tuple[str, float]) -> str:
    return f"{nbytes / unit[1]:.2f} {unit[0]}"
