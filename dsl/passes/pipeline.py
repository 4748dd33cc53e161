"""The named pipeline of passes that the CLI runs and can stop after (``--dump STAGE``).

``STAGES`` lists them in order: parse, resolve and check build the configured Program from
text; every later stage is a pure pass Program → Program that fills in the fields it owns
(``produces``). :func:`run_until` runs a file up to a stage; :func:`rerun` runs the passes
after a stage again on a program changed since (other sizes, pipeline or fold), which is how
the command-line overrides and the simulator's unfolded 1F1B variant reuse the pipeline.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from dhelix.dsl.passes import dump
from dhelix.dsl.passes.autodiff import derive_backward
from dhelix.dsl.passes.fsdp import shard_weights
from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.core.errors import DhelixError, ErrorGroup
from dhelix.dsl.frontend.imports import load_modules
from dhelix.dsl.frontend.limits import schedule_size_error
from dhelix.dsl.frontend.modelcheck import layer_env
from dhelix.dsl.frontend.profilecheck import check_measured
from dhelix.dsl.passes.fold import placement_of, tie_placement_error
from dhelix.dsl.passes.lower import check_fold, lower_pipeline
from dhelix.dsl.frontend.parser import parse
from dhelix.dsl.core.program import Program
from dhelix.dsl.passes.partition import partition_forward
from dhelix.dsl.passes.priority import backward_first, prioritized
from dhelix.dsl.passes.shapes import instantiate
from dhelix.dsl.passes.strands import check_selectors
from dhelix.dsl.passes.validate import validate_lowered


@attrs.frozen
class Stage:
    """One stage: its name, what its dump shows, the dumper, and for a pass after check the
    function that runs it and the Program fields it writes (``produces``: those it fills
    in and those it rewrites; a test holds every pass to it)."""

    name: str
    doc: str
    dumper: Callable[[Any], str]  # of what the stage made: a syntax tree, modules or a Program
    run: Callable[[Program], Program] | None = None
    produces: tuple[str, ...] = ()


def shapes(program: Program) -> Program:
    """The program with the names its layer's expressions see (``env``) and its forward
    layer DAG with per-GPU shapes (unchanged for a library file)."""
    if program.model is None:
        return program
    layer = program.layer(program.model.layer)
    assert program.mesh is not None and program.train is not None and layer is not None, "a checked model"
    env = layer_env(program.model, program.mesh, program.train)
    forward = instantiate(layer, env, program.mesh)
    return attrs.evolve(program, env=tuple(env.items()), forward=forward)


def partition(program: Program) -> Program:
    """The program with its forward layer DAG rewritten by its partition block (Centauri's
    substitutions, chunks and group partitions), unchanged without one; ProfileError when its
    profile's measured section was taken on another program (other ops, shapes, mesh or
    dtype), checked here because the measured ops are those of the rewritten DAG."""
    if program.forward is not None and program.partition is not None:
        assert program.mesh is not None, "a checked model"
        program = attrs.evolve(program, forward=partition_forward(program.forward, program.partition,
                                                                  dict(program.env), program.mesh,
                                                                  dict(program.chunk_counts), dict(program.group_orders),
                                                                  program.substituted))
    check_measured(program)
    return program


def autodiff(program: Program) -> Program:
    """The program with its backward layer DAG derived (unchanged for a library file) and,
    under ZeRO-3, both DAGs carrying the weights' gathers and the gradients' reduce-scatters."""
    if program.forward is None:
        return program
    backward = prioritized(derive_backward(program.forward), backward_first(program))
    return shard_weights(attrs.evolve(program, backward=backward))


def strands(program: Program) -> Program:
    """The program unchanged, once every selector of its strands block names operators of
    its forward or backward DAG."""
    if program.forward is not None and program.backward is not None:
        check_selectors(program.strands, program.forward, program.backward)
    return program


def fold(program: Program) -> Program:
    """The program with the placement of its fold: which layers each pipeline rank and
    chunk holds (unchanged for a library file)."""
    if program.model is None:
        return program
    assert program.fold is not None and program.mesh is not None and program.train is not None, "a checked model"
    placement = placement_of(program.fold, program.model.setting("layers"), program.mesh.size("pp"),
                             program.train.stage_ends, program.train.stages_span)
    if (error := tie_placement_error(program.model, program.fold, placement)) is not None:
        raise error
    return attrs.evolve(program, placement=placement)


def lower(program: Program) -> Program:
    """The program with its pipeline lowered to per-rank action lists (unvalidated)."""
    if program.model is None:
        return program
    assert program.pipeline is not None and program.fold is not None and program.mesh is not None \
        and program.train is not None, "a checked model"
    try:
        check_fold(program.pipeline, program.placement.kind, program.fold.span)
        too_large = schedule_size_error(program.mesh.size("pp"), program.train.microbatches,
                                        program.placement.chunks, program.model.setting("layers"),
                                        program.train.span)
        if too_large:
            raise too_large
        lowered = lower_pipeline(program.pipeline, ranks=program.mesh.size("pp"),
                                 microbatches=program.train.microbatches, placement=program.placement,
                                 launch=launch_of(program), launch_backward=launch_backward_of(program))
    except DhelixError as exc:
        _note_sizes(exc, program)
        raise
    return attrs.evolve(program, lowered=lowered)


def launch_of(program: Program) -> int | None:
    """The pipeline's ``g`` (micro-batches launched together per chunk): the planner's choice
    for ``train { launch = auto }``, the number written, else None (p)."""
    if program.launch is not None:
        return program.launch
    launch = program.train.launch if program.train is not None else None
    return launch if isinstance(launch, int) else None


def launch_backward_of(program: Program) -> int | None:
    """The pipeline's ``gb`` (micro-batches launched together per chunk in the backward): the
    planner's choice for ``train { launch_backward = auto }``, the number written, else None
    (``g``)."""
    if program.launch_backward is not None:
        return program.launch_backward
    launch = program.train.launch_backward if program.train is not None else None
    return launch if isinstance(launch, int) else None


def _note_sizes(error: DhelixError, program: Program) -> None:
    """Say where the program sets the sizes a pipeline failed on: the error usually points
    into the pipeline's definition, often in the standard library, not at the user's file."""
    last = error.errors[-1] if isinstance(error, ErrorGroup) else error
    assert program.train is not None and program.mesh is not None and program.fold is not None, "a checked model"
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


STAGES = (
    Stage("parse", "the syntax tree of the main file", dump.dump_syntax),
    Stage("resolve", "the files loaded through imports and what they define", dump.dump_modules),
    Stage("check", "the checked configuration: model, mesh groups and lanes, fold, pipeline, strands",
          dump.dump_config),
    Stage("shapes", "the forward layer DAG with per-GPU shapes, kinds and lanes", dump.dump_forward,
          shapes, ("env", "forward")),
    Stage("partition", "the forward layer DAG after the partition block's substitutions and chunks",
          dump.dump_forward, partition, ("forward",)),
    Stage("autodiff", "the forward and the derived backward layer DAGs (with ZeRO-3's weight "
          "gathers and gradient reduce-scatters)", dump.dump_dags,
          autodiff, ("backward", "forward")),
    Stage("strands", "the operators each selector of the strands block names", dump.dump_strands,
          strands),
    Stage("fold", "which layers each pipeline rank and chunk holds", dump.dump_placement,
          fold, ("placement",)),
    Stage("lower", "the per-rank action lists of the pipeline (text form)", dump.dump_lowered,
          lower, ("lowered",)),
    Stage("validate", "the lowered lists after validation, with their unit-time make-span",
          dump.dump_validated, validate),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)
_FIRST_PASS = next(i for i, stage in enumerate(STAGES) if stage.run is not None)


def run_until(text: str, path: str, stop: str = STAGE_NAMES[-1]):
    """Run the stages on ``text`` (the file ``path``) up to and including ``stop``.

    Returns that stage's result: a Module (parse), a list of Modules (resolve) or a
    Program. Raises DhelixError subclasses for every user mistake.
    """
    if stop == "parse":
        return parse(text, path)
    modules = load_modules(text, path)
    if stop == "resolve":
        return modules
    return rerun(check_program(modules), after="check", stop=stop)


def rerun(program: Program, after: str, stop: str = STAGE_NAMES[-1]) -> Program:
    """Run the passes after stage ``after`` up to and including ``stop`` on ``program``.

    ``program`` went through ``after`` (or further) and may have been changed since with
    :func:`attrs.evolve`: other pipeline ranks, micro-batches, layers, pipeline or fold. What
    the passes after ``after`` produced is dropped first, so no result of the old program
    survives, not even past ``stop``. A field that a pass after ``after`` rewrites (the
    forward DAG: partition, autodiff under ZeRO-3) no longer holds what the stage that made
    it left, so the passes run again from that stage. ``after`` is ``check`` or a later stage
    (ValueError otherwise: a caller bug). When the names the layer's expressions see
    (``env``: the model's sizes, the mesh, the micro-batches) are no longer what the shapes
    pass made of the program, the passes run again from shapes, so that the result equals a
    fresh run of the changed program, whole. Raises the passes' located errors.
    """
    first = STAGE_NAMES.index(after) + 1
    if first < _FIRST_PASS:
        raise ValueError(f"rerun after '{after}': the passes start after '{STAGE_NAMES[_FIRST_PASS - 1]}'")
    rewritten = {field for stage in STAGES[first:] for field in stage.produces}
    first = next((i for i, stage in enumerate(STAGES[:first]) if set(stage.produces) & rewritten), first)
    shaped = STAGE_NAMES.index("shapes")
    if first > shaped and program.model is not None and program.env != _layer_names(program):
        first = shaped  # the names the layer sees changed (micro-batches, sizes): its DAGs are derived again
    defaults = attrs.fields_dict(Program)
    cleared: dict[str, Any] = {field: defaults[field].default for stage in STAGES[first:] for field in stage.produces}
    program = attrs.evolve(program, **cleared)
    for stage in STAGES[first:STAGE_NAMES.index(stop) + 1]:
        assert stage.run is not None, "the stages after check are passes"
        program = stage.run(program)
    return program


def _layer_names(program: Program) -> tuple[tuple[str, int], ...]:
    """The ``env`` the shapes pass gives ``program`` now (its model, mesh and train block)."""
    assert program.model is not None and program.mesh is not None and program.train is not None, "a checked model"
    return tuple(layer_env(program.model, program.mesh, program.train).items())


def check_text(text: str, path: str) -> Program:
    """Run every pass on ``text``; the entry point of `dhelix check` and the fuzz test."""
    return run_until(text, path)


def dump_stage(stop: str, result) -> str:
    """The text dump of ``result``, the output of stage ``stop``."""
    return next(stage for stage in STAGES if stage.name == stop).dumper(result)
