"""`dhelix report`'s page: one self-contained HTML file that shows a schedule.

Sections, in order, each a ``<section id=…>`` (:data:`SECTIONS`): the commands that reproduce
the page, the W pipeline, the layer placement, the layer DAG, the SI pairing ladder, every
pipeline rank's simulated step as a timeline with hidden and exposed communication per lane,
memory per rank against the device, the ``simulate --compare`` table and — given a run's
metrics (``dhelix run --metrics``) — measured beside predicted.

The page needs nothing outside itself: the diagrams are Graphviz's SVG inlined
(:func:`dot.inline_svg`), or, where ``dot`` is not installed, their text form (the same
dumps as ``dhelix check --dump``); the timeline and memory pictures are drawn here
(:mod:`step_svg`); the style is inline and there is no script. No address is named, so it
opens offline and leaks nothing. This module only assembles text: the command line reads
files, runs ``dot`` and writes the page.
"""

from __future__ import annotations

import json
from typing import Callable, Mapping

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.plan import Plan, format_plan
from dhelix.dsl.core.program import Program
from dhelix.dsl.core.table import duration
from dhelix.dsl.passes.dump import dump_dags, dump_lowered, dump_placement
from dhelix.dsl.render.diagrams import diagram_source
from html import escape as html
from dhelix.dsl.render.step_svg import memory_svg, timeline_svg
from dhelix.dsl.simulator.events import Simulation
from dhelix.dsl.simulator.memory import GB
from dhelix.dsl.simulator.report import Units, describe, format_comparison, format_simulation

#: Section id → heading, in page order.
SECTIONS = {
    "commands": "Commands that reproduce this page",
    "pipeline": "Pipeline schedule",
    "placement": "Layer placement",
    "dag": "Layer DAG (forward and derived backward)",
    "pairing": "SI pairing ladder",
    "timeline": "Simulated step per pipeline rank",
    "memory": "Memory per rank against the device",
    "compare": "Comparison: the program minus one feature at a time",
    "measured": "Measured beside predicted",
}

STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 1.5em auto; max-width: 1100px; color: #202020; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; border-bottom: 1px solid #d0d0d0; margin-top: 2em; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 12px; }
.picture { overflow-x: auto; } .picture svg { max-width: 100%; height: auto; }
table.figures { border-collapse: collapse; font-size: 13px; }
table.figures td, table.figures th { border: 1px solid #d0d0d0; padding: 2px 8px; text-align: right; }
table.figures td:first-child, table.figures th:first-child { text-align: left; }
.note { color: #606060; font-size: 13px; }
.key span { display: inline-block; padding: 1px 6px; margin-right: 4px; font-size: 12px; }
nav a { margin-right: 0.8em; }
"""

#: What draws a DOT text as inline SVG; None when Graphviz is not installed.
DrawSvg = Callable[[str], "str | None"]


def report_html(program: Program, sims: tuple[Simulation, ...], plan: Plan | None, *, source: str,
                commands: list[str], draw: DrawSvg, metrics: Mapping | None = None) -> str:
    """The page of ``program`` (priced, with a profile; read from ``source``): ``sims`` are
    :func:`~dhelix.dsl.simulator.report.compare`'s simulations, the first as written with
    ``detail=True``; ``plan`` the SI plan (None without SI blocks); ``commands`` the command
    lines that reproduce the page; ``draw`` turns DOT text into inline SVG (or None);
    ``metrics`` a run's ``--metrics`` JSON (validated by the caller)."""
    first = sims[0]
    body = [f"<h1>{html(source)}: {html(first.program)}</h1>",
            f'<p class="note">{html(describe(first))}</p>',
            "<nav>" + "".join(f'<a href="#{key}">{html(title)}</a>' for key, title in SECTIONS.items()) + "</nav>",
            _section("commands", "<pre>" + html("\n".join(commands)) + "</pre>")]
    body += [_section(what, _diagram(program, what, plan, draw)) for what in ("pipeline", "placement", "dag")]
    body.append(_section("pairing", _pairing(program, plan, draw)))
    body.append(_section("timeline", _timeline(first)))
    body.append(_section("memory", _memory(program, first)))
    body.append(_section("compare", "<pre>" + html(format_comparison(sims)) + "</pre>"))
    body.append(_section("measured", _measured(first, metrics)))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>dhelix report: {html(source)}</title><style>{STYLE}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _section(key: str, content: str) -> str:
    return f'<section id="{key}">\n<h2>{html(SECTIONS[key])}</h2>\n{content}\n</section>'


def _diagram(program: Program, what: str, plan: Plan | None, draw: DrawSvg) -> str:
    svg = draw(diagram_source(program, what, plan=plan))
    if svg is not None:
        return f'<div class="picture">{svg}</div>'
    text = {"pipeline": dump_lowered, "placement": dump_placement, "dag": dump_dags}[what](program)
    return ('<p class="note">Graphviz <code>dot</code> is not installed, so this is the text form '
            f"(the compiler's dump of this stage); install Graphviz for the picture.</p><pre>{html(text)}</pre>")


def _pairing(program: Program, plan: Plan | None, draw: DrawSvg) -> str:
    if plan is None:
        return '<p class="note">This schedule has no SI blocks, so there is no pairing to draw.</p>'
    table = f"<pre>{html(format_plan(plan))}</pre>"
    svg = draw(diagram_source(program, "pairing", plan=plan))
    return (f'<div class="picture">{svg}</div>' if svg is not None else "") + table


def _timeline(sim: Simulation) -> str:
    key = "".join(f'<span style="background:{colour}">{html(name)}</span>' for name, colour in (
        ("forward", "#6baed6"), ("backward", "#74c476"), ("weight gradient", "#fdae6b"),
        ("optimizer", "#bdbdbd"), ("pipeline send", "#9e9ac8"), ("data-parallel collective", "#fb6a4a"),
        ("collective of an SI pair", "#dadaeb"), ("layer comm hidden", "#969696"),
        ("layer comm exposed", "#de2d26")))
    notes = ('<p class="note">One band per pipeline rank; rows: the compute lane (an SI block is its '
             "forward over its backward, white lines between its segment pairs), a strip splitting each "
             "action's layer communication into hidden and exposed, then each communication lane: the "
             "collectives SI segment pairs run there (upper row, drawn over their pair) and pipeline sends and "
             "data-parallel collectives (lower row). Hover a shape for its figures.</p>")
    return (f'<p class="key">{key}</p>{notes}<div class="picture">'
            f"{timeline_svg(sim.events, len(sim.ranks), sim.step_time)}</div>{_lane_table(sim)}"
            f"<pre>{html(format_simulation(sim))}</pre>")


def _lane_table(sim: Simulation) -> str:
    """Per rank and lane: communication total, hidden and exposed."""
    lanes = _lanes(sim)
    head = "<tr><th>rank</th><th>communication</th><th>lane</th><th>total</th><th>hidden</th><th>exposed</th></tr>"
    rows = []
    for r in sim.ranks:
        for name, total, exposed, key in (("layer collectives", r.layer_comm, r.layer_exposed, "layer"),
                                          ("pipeline send/recv", r.pp_comm, r.pp_exposed, "SEND"),
                                          ("data-parallel", r.dp_comm, r.dp_exposed, "DP")):
            if total <= 0:
                continue
            rows.append(f"<tr><td>r{r.rank}</td><td>{name}</td><td>{html(lanes.get(key, '-'))}</td>"
                        f"<td>{duration(total)}</td><td>{duration(max(0.0, total - exposed))}</td>"
                        f"<td>{duration(exposed)}</td></tr>")
    if not rows:
        return '<p class="note">No communication in this step.</p>'
    return f'<table class="figures">{head}{"".join(rows)}</table>'


def _lanes(sim: Simulation) -> dict[str, str]:
    """Which lanes each kind of communication used in ``sim``'s trace."""
    found: dict[str, set] = {}
    for event in sim.events:
        kind = (event.args or {}).get("kind")
        kind = "layer" if kind == "SI collective" else kind
        if event.lane != "compute" and kind:
            found.setdefault(kind, set()).add(event.lane)
    return {kind: ", ".join(sorted(lanes)) for kind, lanes in found.items()}


def _memory(program: Program, sim: Simulation) -> str:
    capacity = program.profile.memory_gb
    units = Units.of([sim])
    device = (f"the {capacity:g} GB of one {program.profile.name} device" if capacity else
              f"the {program.profile.name} profile gives no device memory")
    key = "".join(f'<span style="background:{colour}">{name}</span>' for name, colour in (
        ("weights", "#6baed6"), ("gradients", "#74c476"), ("optimizer", "#fdae6b"),
        ("activations (peak)", "#9e9ac8")))
    return (f'<p class="key">{key}</p><p class="note">Predicted peak per pipeline rank (model states and live '
            f"activations at their peak) against {html(device)}.</p>"
            f'<div class="picture">{memory_svg(sim.ranks, capacity * GB if capacity else None, units.memory)}</div>')


def _measured(sim: Simulation, metrics: Mapping | None) -> str:
    if metrics is None:
        return ('<p class="note">No run given: the last commands above make one and show it here, '
                "measured beside predicted.</p>")
    predicted = metrics.get("predicted") or {}
    rows = [("step time", metrics.get("step_s"), predicted.get("step_s"), sim.step_time, duration),
            ("exposed communication", metrics.get("exposed_comm_s"), predicted.get("exposed_comm_s"),
             max(r.layer_exposed + r.dp_exposed for r in sim.ranks), duration),
            ("peak activations", metrics.get("peak_activations_bytes"), predicted.get("peak_activations_bytes"),
             max(r.activations for r in sim.ranks), _mib)]
    head = "<tr><th>figure</th><th>measured</th><th>predicted by the run</th><th>predicted here</th></tr>"
    cells = "".join(f"<tr><td>{name}</td>" + "".join(f"<td>{'—' if v is None else fmt(v)}</td>" for v in values)
                    + "</tr>" for name, *values, fmt in rows)
    losses = metrics.get("losses") or []
    note = (f"{metrics.get('file', '?')}: {metrics.get('steps', len(losses))} step(s), backend "
            f"{metrics.get('backend', '?')}, SI {'on' if metrics.get('si') else 'off'}")
    if losses:
        note += f", loss {losses[0]:.4f} → {losses[-1]:.4f}"
    why = predicted.get("note")
    return (f'<p class="note">{html(note)}. Measured: medians over steps, the first excluded. '
            f"{html(why or '')}</p><table class=\"figures\">{head}{cells}</table>{_measured_ranks(metrics)}")


def _measured_ranks(metrics: Mapping) -> str:
    """Per rank of the run: its median step and its memory beside the prediction for its
    pipeline rank (what ``--metrics`` holds of it)."""
    ranks = [r for r in metrics.get("ranks") or [] if isinstance(r, Mapping)]
    if not ranks:
        return ""
    predicted = {p.get("pp"): p for p in (metrics.get("predicted") or {}).get("pipeline_ranks") or []
                 if isinstance(p, Mapping)}
    head = ("<tr><th>rank</th><th>pipeline rank</th><th>device</th><th>step (median)</th>"
            "<th>peak activations</th><th>predicted</th><th>model states</th><th>predicted</th></tr>")
    rows = []
    for r in ranks:
        steps = [t for t in r.get("step_s") or [] if isinstance(t, (int, float))]
        step = _median(steps[1:] or steps)
        mine = predicted.get(r.get("pp"), {})
        cells = [r.get("rank"), r.get("pp"), r.get("device"), None if step is None else duration(step),
                 *(None if v is None else _mib(v) for v in (r.get("peak_activations_bytes"),
                                                            mine.get("peak_activations_bytes"),
                                                            r.get("model_states_bytes"),
                                                            mine.get("model_states_bytes")))]
        rows.append("<tr>" + "".join(f"<td>{'—' if c is None else html(str(c))}</td>" for c in cells) + "</tr>")
    return f'<h3>Per rank</h3><table class="figures">{head}{"".join(rows)}</table>'


def _median(values: list) -> float | None:
    if not values:
        return None
    ordered, middle = sorted(values), len(values) // 2
    return ordered[middle] if len(values) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3f} MiB"


#: The figures :func:`_measured` reads from a run's metrics, each a number or null.
METRIC_KEYS = ("step_s", "exposed_comm_s", "peak_activations_bytes")


def parse_metrics(text: str, name: str) -> dict:
    """The metrics JSON ``text`` of ``dhelix run --metrics`` (read from ``name``) as a dict;
    DhelixError naming the file and what is wrong when it is not such a file."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise DhelixError(f"{name}: not JSON ({exc})") from None
    if not isinstance(data, dict) or "step_s" not in data or not isinstance(data.get("predicted", {}), dict):
        raise DhelixError(f"{name}: not the metrics of a run (no 'step_s' figure)")
    for key in METRIC_KEYS:
        for where in (data, data.get("predicted") or {}):
            value = where.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise DhelixError(f"{name}: '{key}' is {value!r}, not a number")
    losses = data.get("losses", [])
    if not isinstance(losses, list) or not all(isinstance(v, (int, float)) for v in losses):
        raise DhelixError(f"{name}: 'losses' is not a list of numbers")
    return data
