"""The four diagrams of a program as Graphviz DOT text, by name: what `dhelix render --what`
and `dhelix report` draw.

- ``pipeline``: ranks × unit time, F/B/W/SI blocks (:mod:`dsl.render.pipeline`);
- ``placement``: which layers each rank and chunk holds (:mod:`dsl.render.placement`);
- ``dag``: the layer's forward DAG and its derived backward DAG (:mod:`dsl.render.dag`);
- ``pairing``: the SI plan of a layer pair as a ladder (:mod:`dsl.render.ladder`); needs a profile.
"""

from __future__ import annotations

from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.program import Program
from dhelix.dsl.render.dag import dag_dot
from dhelix.dsl.render.ladder import ladder_dot
from dhelix.dsl.render.pipeline import pipeline_dot, pipeline_title
from dhelix.dsl.render.placement import placement_dot
from dhelix.dsl.simulator.events import schedule_plan

#: The diagrams, with the last pass each one needs.
DIAGRAMS = {"pipeline": "validate", "placement": "fold", "dag": "autodiff", "pairing": "validate"}


def diagram_source(program: Program, what: str, overridden: str = "", plan: Plan | None = None) -> str:
    """The DOT text of diagram ``what`` for a program run through the passes it needs;
    ``overridden`` names the command-line overrides, shown in the placement's title; ``plan``
    is the SI plan the ladder draws (planned here when None)."""
    if what == "pipeline":
        assert program.lowered is not None, "run through lower"
        fold = program.placement.kind
        return pipeline_dot(program.lowered, pipeline_title(program.lowered, fold))
    if what == "placement":
        assert program.model is not None, "a model file"
        name = program.model.name + (f" ({overridden})" if overridden else "")
        return placement_dot(program.placement, name, program.model.setting("layers"))
    if what == "pairing":
        return ladder_dot(plan or schedule_plan(program))
    assert program.forward is not None and program.backward is not None, "run through autodiff"
    return dag_dot(program.forward, program.backward)
