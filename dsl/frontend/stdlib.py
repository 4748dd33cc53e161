"""The installed standard library as data: its pipeline definitions and the fold each needs."""

from __future__ import annotations

import functools
from importlib import resources

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.program import FOLD_KINDS
from dhelix.dsl.frontend.parser import parse

#: The chunks per rank used for a pipeline written `for loop` (the clause gives no count).
DEFAULT_LOOP_CHUNKS = 2


@functools.cache
def stdlib_pipelines() -> dict[str, s.PipelineDef]:
    """The PipelineDefs of the installed ``stdlib/pipelines.dhx``, by name, in file order."""
    text = resources.files("dhelix.stdlib_schedules").joinpath("pipelines.dhx").read_text()
    module = parse(text, "stdlib/pipelines.dhx")
    return {item.name: item for item in module.items if isinstance(item, s.PipelineDef)}


def fold_of(pipeline: s.PipelineDef) -> tuple[str, int | None]:
    """The (fold kind, loop chunks or None) a pipeline's ``for`` clause asks for; ``none``
    when it has no clause."""
    kind = pipeline.fold or "none"
    return kind, DEFAULT_LOOP_CHUNKS if FOLD_KINDS[kind] is None else None
