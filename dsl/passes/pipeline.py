"""The named pipeline of passes that the CLI runs and can stop after (``--dump STAGE``).

Each pass is a pure function from the previous stage's result to the next; ``STAGES``
lists them in order with the dumper that prints their result.
"""

from __future__ import annotations

from typing import Callable

import attrs

from dhelix.dsl.passes import dump
from dhelix.dsl.passes.autodiff import derive_backward
from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.core.errors import DhelixError, ErrorGroup
from dhelix.dsl.frontend.imports import load_modules
from dhelix.dsl.passes.lower import check_fold, lower_pipeline
from dhelix.dsl.frontend.parser import parse
from dhelix.dsl.core.program import Program
from dhelix.dsl.passes.validate import validate_lowered


@attrs.frozen
class Stage:
    name: str
    doc: str
    dumper: Callable[[object], str]


STAGES = (
    Stage("parse", "the syntax tree of the main file", dump.dump_syntax),
    Stage("resolve", "the files loaded through imports and what they define", dump.dump_modules),
    Stage("check", "the checked configuration: model, mesh groups and lanes, fold, pipeline, strands",
          dump.dump_config),
    Stage("shapes", "the forward layer DAG with per-GPU shapes, kinds and lanes", dump.dump_forward),
    Stage("autodiff", "the forward and the derived backward layer DAGs", dump.dump_dags),
    Stage("fold", "which layers each pipeline rank and chunk holds", dump.dump_placement),
    Stage("lower", "the per-rank action lists of the pipeline (text form)", dump.dump_lowered),
    Stage("validate", "the lowered lists after validation, with their unit-time make-span",
          dump.dump_validated),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)


def run_until(text: str, path: str, stop: str = STAGE_NAMES[-1]):
    """Run the passes on ``text`` (the file ``path``) up to and including ``stop``.

    Returns that stage's result: a Module (parse), a list of Modules (resolve) or a
    Program. Raises DhelixError subclasses for every user mistake.
    """
    if stop == "parse":
        return parse(text, path)
    modules = load_modules(text, path)
    if stop == "resolve":
        return modules
    program = check_program(modules)
    for stage, run in _PROGRAM_PASSES:
        if STAGE_NAMES.index(stop) < STAGE_NAMES.index(stage):
            break
        program = run(program)
    return program


def autodiff(program: Program) -> Program:
    """The program with its backward layer DAG derived (unchanged for a library file)."""
    if program.forward is None:
        return program
    return attrs.evolve(program, backward=derive_backward(program.forward))


def lower(program: Program) -> Program:
    """The program with its pipeline lowered to per-rank action lists (unvalidated)."""
    if program.model is None:
        return program
    try:
        check_fold(program.pipeline, program.placement.kind, program.fold.span)
        lowered = lower_pipeline(program.pipeline, ranks=program.mesh.size("pp"),
                                 microbatches=program.train.microbatches, placement=program.placement)
    except DhelixError as exc:
        _note_sizes(exc, program)
        raise
    return attrs.evolve(program, lowered=lowered)


def _note_sizes(error: DhelixError, program: Program) -> None:
    """Say where the program sets the sizes a pipeline failed on: the error usually points
    into the pipeline's definition, often in the standard library, not at the user's file."""
    last = error.errors[-1] if isinstance(error, ErrorGroup) else error
    where = [f"m = microbatches = {program.train.microbatches} (train block at {program.train.span})"
             if program.train.span else None,
             f"p = pp = {program.mesh.size('pp')} and v = {program.placement.chunks} "
             f"(fold {program.fold.kind})"]
    last.notes = last.notes + (f"this program has {', '.join(w for w in where if w)}",)


def validate(program: Program) -> Program:
    """The program unchanged, once its lowered schedule is shown to run without deadlock."""
    if program.lowered is not None:
        validate_lowered(program.lowered)
    return program


# The fold placement is computed while checking (it is where layer counts are checked).
_PROGRAM_PASSES = (("autodiff", autodiff), ("lower", lower), ("validate", validate))


def check_text(text: str, path: str) -> Program:
    """Run every pass on ``text``; the entry point of `dhelix check` and the fuzz test."""
    return run_until(text, path)


def dump_stage(stop: str, result) -> str:
    """The text dump of ``result``, the output of stage ``stop``."""
    return next(stage for stage in STAGES if stage.name == stop).dumper(result)
