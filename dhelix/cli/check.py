"""`dhelix check FILE [--dump STAGE]`: check a schedule file, or print a stage's IR.

Prints a one-line summary of what the file defines when it is correct (after the located
warnings of what runs but likely not as meant: a mesh axis the layer never uses); every error
found (located, with the source line and a caret) otherwise, exit code 1. ``--dump STAGE`` runs the
named pass pipeline up to STAGE and prints that stage's IR instead.
"""

from __future__ import annotations

import sys

from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.frontend.profilecheck import undeclared_links
from dhelix.dsl.passes.axisuse import unused_axes
from dhelix.dsl.passes.runcheck import unrunnable
from dhelix.dsl.passes.pipeline import STAGES, STAGE_NAMES, check_text, dump_stage, run_until


def register(subparsers) -> None:
    """Add the ``check`` command to the CLI's sub-command parsers."""
    check = subparsers.add_parser(
        "check", help="check a schedule file and optionally dump a stage's IR",
        description="Parse and check FILE with its imports; print every error found.")
    check.add_argument("file", metavar="FILE")
    stages = "; ".join(f"{s.name}: {s.doc}" for s in STAGES)
    check.add_argument("--dump", metavar="STAGE", choices=STAGE_NAMES,
                       help=f"print the IR after STAGE instead of a summary ({stages})")
    check.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    """`dhelix check FILE [--dump STAGE]`; returns the exit code."""
    text = read_source(args.file)
    if args.dump:
        sys.stdout.write(dump_stage(args.dump, run_until(text, args.file, args.dump)))
        return 0
    program = check_text(text, args.file)
    _check_host_memory(program)
    for warning in [*unused_axes(program), *undeclared_links(program), *unrunnable(program)]:
        print(warning.render(), file=sys.stderr)
    print(f"{args.file}: ok ({summary(program)})")
    return 0


def _check_host_memory(program) -> None:
    """Refuse a program whose offloaded optimizer states exceed a node's host memory (the
    profile's ``host.memory_gb``), naming the bytes (the simulator's model states, no step timed)."""
    train, profile = program.train, program.profile
    if train is None or not train.offloads or profile is None or profile.host is None or profile.host.memory_gb is None:
        return
    from dhelix.dsl.simulator.events import host_states
    from dhelix.dsl.simulator.host_memory import host_refusal

    refusal = host_refusal(program, host_states(program))
    if refusal is not None:
        raise refusal


def summary(program) -> str:
    """What a checked file holds, in a few words: the model (its real layer count, layer
    DAG, dtype), mesh, pipeline and fold; then the definitions it and its imports provide."""
    layers, pipelines = len(program.layers), len(program.pipelines)
    defined = (f"{layers} layer DAG{'s' * (layers != 1)} and {pipelines} pipeline{'s' * (pipelines != 1)} "
               "defined with the imports")
    model = program.model
    if model is None:
        return f"library; {defined}"
    count = model.get("layers")
    mesh = " × ".join(f"{axis} {size}" for axis, size in zip(program.mesh.order, program.mesh.sizes, strict=True)
                      if size > 1) or "1 rank"
    return (f"model {model.name}: {count} layer{'s' * (count != 1)} of {model.layer}, {model.dtype}; mesh {mesh}, "
            f"pipeline {program.pipeline.name}, fold {program.fold.kind}; {defined}")
