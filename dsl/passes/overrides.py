"""Overrides of a program's pipeline settings, for drawing and exporting (the options that
give them are in :mod:`dhelix.cli.overrides`).

`dhelix render` and `dhelix export` can redraw a file's schedule at other sizes without
editing it: ``--ranks P`` (mesh pp), ``--microbatches M``, ``--layers L``, ``--pipeline NAME``
and ``--fold none|u|loop(V)``. The file is checked as written (the check stage); the
overrides then replace fields of the checked Program with :func:`attrs.evolve`, and the passes
after check run on the result (:func:`~dhelix.dsl.passes.pipeline.rerun`), so an override that
does not fit (8 layers on 3 ranks, w_helix with m < p) is reported like any schedule error,
with a note naming the overrides in force.

Only the pipeline dimension changes: ``--ranks`` makes the mesh's world size differ from the
cluster's, which only the checker looks at.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.frontend.limits import limit_of
from dhelix.dsl.frontend.profiles import load_profile
from dhelix.dsl.core.errors import CheckError, DhelixError, ErrorGroup, UsageError
from dhelix.dsl.core.mesh import Mesh
from dhelix.dsl.core.program import FOLD_KINDS, FoldSpec, LayerDag, Program, fold_kinds_text
from dhelix.dsl.core.wording import did_you_mean

_FOLD = re.compile(r"(\w+)(?:\((\d+)\))?$")  # a kind, and a count in parentheses


@attrs.frozen
class Overrides:
    """The overrides given on the command line; None leaves the file's value."""

    ranks: int | None = None
    microbatches: int | None = None
    layers: int | None = None
    pipeline: str | None = None
    fold: str | None = None

    def describe(self) -> str:
        """The overrides as command-line flags (empty when there are none)."""
        flags = [f"--{field.name} {value}" for field in attrs.fields(Overrides)
                 if (value := getattr(self, field.name)) is not None]
        return " ".join(flags)


def load_file(path: str, overrides: Overrides, stop: str = "validate") -> Program:
    """Read the schedule file ``path`` and :func:`load_program` it (UsageError if unreadable)."""
    return load_program(read_source(path), path, overrides, stop)


def load_program(text: str, path: str, overrides: Overrides, stop: str = "validate") -> Program:
    """Check ``text`` (the file ``path``), apply ``overrides`` and run the passes up to ``stop``.

    ``stop`` is a stage after check (``autodiff``, ``fold``, ``validate``, …). Raises
    UsageError for a file without a model or a bad override value, and the usual located
    errors for everything else (with a note naming the overrides when the passes after them
    fail).
    """
    program = passes.run_until(text, path, "check")
    require_model(program, path)
    program = _apply(program, overrides)
    try:
        return passes.rerun(program, after="check", stop=stop)
    except DhelixError as exc:
        if overrides.describe():
            _add_note(exc, f"with the overrides {overrides.describe()}")
        raise


def with_profile(program: Program, name_or_path: str) -> Program:
    """``program`` priced with another hardware profile: a shipped name or a YAML path
    (relative to the working folder), as if its cluster block named it; the passes after
    check run again, so a measured profile of another program is refused as in the file.
    Raises ProfileError for a profile that cannot be read."""
    if program.cluster is None:  # a library file: nothing to price
        return program
    profile = load_profile(name_or_path)
    cluster = attrs.evolve(program.cluster, profile=name_or_path, profile_span=None)
    return passes.rerun(attrs.evolve(program, profile=profile, cluster=cluster), after="check")


def checked_program(text: str, path: str, profile: str | None = None,
                    gpus_per_node: int | None = None) -> Program:
    """The program of ``text`` (the file ``path``) through every pass, priced with
    ``profile`` (:func:`with_profile`) when one is given instead of its cluster block's, on
    nodes of ``gpus_per_node`` ranks (:func:`with_nodes`) when that is given."""
    if profile is None and gpus_per_node is None:
        return passes.check_text(text, path)
    program = passes.run_until(text, path, "check")
    if gpus_per_node is not None:
        program = with_nodes(program, gpus_per_node)
    return with_profile(program, profile) if profile is not None else passes.rerun(program, after="check")


def with_nodes(program: Program, gpus_per_node: int) -> Program:
    """The checked ``program`` (check stage) on nodes of ``gpus_per_node`` ranks instead of
    its cluster block's (the measured topology of a run): its mesh's lanes and the group
    partitions follow them. The passes after check are not run."""
    if program.cluster is None:
        return program
    if program.cluster.levels and gpus_per_node != program.cluster.gpus_per_node:
        raise CheckError(f"the cluster's levels are declared for nodes of {program.cluster.gpus_per_node} GPUs, "
                         f"but the nodes hold {gpus_per_node}", program.cluster.span,
                         ["declare the levels of the nodes the program runs on, or run with --topology declared"])
    assert program.mesh is not None, "a checked cluster has its mesh"
    cluster = attrs.evolve(program.cluster, nodes=program.mesh.world // gpus_per_node, gpus_per_node=gpus_per_node)
    return attrs.evolve(program, cluster=cluster, mesh=attrs.evolve(program.mesh, gpus_per_node=gpus_per_node))


def for_measuring(text: str, path: str) -> Program:
    """The program of ``text`` (the file ``path``) checked with its profile's measured
    section set aside: what a new measurement replaces, so a stale one is no error here.
    The profile's other values stay (they fill in what cannot be measured)."""
    program = passes.run_until(text, path, "check")
    if program.profile is not None and program.profile.measured is not None:
        program = attrs.evolve(program, profile=attrs.evolve(program.profile, measured=None))
    return passes.rerun(program, after="check")


def reference_dags(program: Program) -> tuple[LayerDag, LayerDag]:
    """The program's layer instantiated with every mesh axis of size 1 (its collectives
    elided, full weights), unpartitioned and unpriced: the forward and backward DAGs of the
    single-process reference model, from which the interpreter reads how each weight is
    sharded. ``program`` is checked (any stage from check on)."""
    # The same passes (shapes, autodiff) on a mesh of size 1, so the layer's names (tokens,
    # head_dim, …) have one definition. Without the profile: nothing here is priced, and a
    # measured profile fits the program's own shapes. Nor partitioned: chunks are a
    # schedule of the same layer, which the reference checks.
    mesh = program.mesh
    assert mesh is not None, "a checked model"
    single = Mesh(mesh.order, (1,) * len(mesh.sizes), 1, mesh.gpus_per_node)
    full = passes.rerun(attrs.evolve(program, mesh=single, profile=None, partition=None), after="check",
                        stop="autodiff")
    assert full.forward is not None and full.backward is not None, "shapes and autodiff made them"
    return full.forward, full.backward


def require_model(program: Program, path: str) -> None:
    """UsageError (exit 2) when ``program``, the file ``path``, is a library file (no model
    block): the one behaviour of every command that needs a model."""
    if program.model is None:
        raise UsageError(f"'{path}' is a library file (no model block): give a file with a model, "
                         "e.g. examples/tiny_llama_cpu.dhx")


def _add_note(error: DhelixError, note: str) -> None:
    # A group renders its members, not its own notes: note the last member instead.
    target = error.errors[-1] if isinstance(error, ErrorGroup) else error
    target.notes = target.notes + (note,)


def _apply(program: Program, overrides: Overrides) -> Program:
    for flag, block, key, value in (("--ranks", "mesh", "pp", overrides.ranks),
                                    ("--microbatches", "train", "microbatches", overrides.microbatches),
                                    ("--layers", "model", "layers", overrides.layers)):
        if value is not None and not 1 <= value <= limit_of(block, key):
            raise UsageError(f"{flag} must be between 1 and {limit_of(block, key):,}, got {value}")
    assert program.mesh is not None and program.train is not None and program.model is not None \
        and program.fold is not None, "a checked model"
    changes: dict[str, Any] = {}  # Program fields of their own types
    if overrides.ranks is not None:
        mesh = program.mesh
        sizes = tuple(overrides.ranks if axis == "pp" else size
                      for axis, size in zip(mesh.order, mesh.sizes, strict=True))
        changes["mesh"] = attrs.evolve(mesh, sizes=sizes)
    if overrides.microbatches is not None:
        changes["train"] = attrs.evolve(program.train, microbatches=overrides.microbatches)
    if overrides.layers is not None:
        settings = tuple((key, overrides.layers if key == "layers" else value)
                         for key, value in program.model.settings)
        changes["model"] = attrs.evolve(program.model, settings=settings)
    pipeline = program.pipeline
    if overrides.pipeline is not None:
        pipeline = _pipeline(program, overrides.pipeline)
        changes["pipeline"] = pipeline
    fold = _fold(program.fold, overrides.fold, pipeline, overrides.pipeline is not None)
    if fold is not None:
        changes["fold"] = fold
    return attrs.evolve(program, **changes)


def _pipeline(program: Program, name: str):
    for pipeline in program.pipelines:
        if pipeline.name == name:
            return pipeline
    names = sorted(p.name for p in program.pipelines)
    notes = did_you_mean(name, names)
    raise UsageError(f"--pipeline: unknown pipeline '{name}'"
                     + (f" ({' '.join(notes)})" if notes else "")
                     + f"; pipelines: {', '.join(names) or 'none (import stdlib/pipelines.dhx)'}")


def _fold(current: FoldSpec, written: str | None, pipeline, pipeline_changed: bool) -> FoldSpec | None:
    """The FoldSpec to use, or None to keep ``current``. The new spec keeps the file's span so
    that a fold error still points at the file's fold statement."""
    if written is not None:
        return _written_fold(written, current.span)
    declared = pipeline.fold if pipeline is not None else None
    if not pipeline_changed or declared is None or declared == current.kind:
        return None
    if FOLD_KINDS[declared] is None:
        raise UsageError(f"--pipeline {pipeline.name} is written for fold {declared}(V): "
                         f"add --fold {declared}(2) (or another V)")
    return FoldSpec.of(declared, span=current.span)


def _written_fold(written: str, span) -> FoldSpec:
    """The FoldSpec of ``--fold`` text (``u``, ``loop(3)``); UsageError when it names none."""
    match = _FOLD.match(written)
    kind, count = (match[1], match[2]) if match else (written, None)
    if kind not in FOLD_KINDS or (FOLD_KINDS[kind] is None) != (count is not None):
        notes = did_you_mean(kind, FOLD_KINDS) if kind not in FOLD_KINDS else []
        raise UsageError(f"--fold: unknown fold '{written}'" + (f" ({notes[0]})" if notes else "")
                         + f"; folds: {fold_kinds_text('V')} (e.g. loop(2))")
    return FoldSpec.of(kind, int(count) if count else None, span=span)
