"""The ``dhelix`` command line.

User mistakes print as ``file:line:col: message`` with the source line and a caret, exit
code 1; command-line mistakes exit 2; nothing surfaces as a traceback. Commands that need
torch (run, profile) import it only when invoked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dhelix.dsl.core.errors import DhelixError, UsageError
from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.passes.pipeline import STAGES, STAGE_NAMES, check_text, dump_stage, run_until


def cmd_check(args) -> int:
    """`dhelix check FILE [--dump STAGE]`."""
    text = read_source(args.file)
    if args.dump:
        sys.stdout.write(dump_stage(args.dump, run_until(text, args.file, args.dump)))
        return 0
    program = check_text(text, args.file)
    what = f"model {program.model.name}" if program.model else "library"
    layers, pipelines = len(program.layers), len(program.pipelines)
    print(f"{args.file}: ok ({what}; {layers} layer{'s' * (layers != 1)} and "
          f"{pipelines} pipeline{'s' * (pipelines != 1)} defined)")
    return 0


def cmd_fmt(args) -> int:
    """`dhelix fmt FILE [--check | --stdout]`."""
    from dhelix.dsl.frontend.fmt import format_source

    text = read_source(args.file)
    formatted = format_source(text, args.file)
    if args.check:
        if formatted != text:
            print(f"{args.file}: not in canonical form (run `dhelix fmt {args.file}`)")
            return 1
        return 0
    if args.stdout:
        sys.stdout.write(formatted)
    elif formatted != text:
        Path(args.file).write_text(formatted)
        print(f"{args.file}: reformatted")
    return 0


def build_parser(extra=()) -> argparse.ArgumentParser:
    """The argument parser with one sub-command per verb; ``extra`` are registration
    functions ``register(subparsers)`` of commands defined outside dsl/ (``run``)."""
    parser = argparse.ArgumentParser(prog="dhelix", description=(
        "Declare, check, plan, draw, simulate and run DHelix strand-interleaved training schedules."))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = sub.add_parser("check", help="check a schedule file and optionally dump a stage's IR",
                           description="Parse and check FILE with its imports; print every error found.")
    check.add_argument("file", metavar="FILE")
    stages = "; ".join(f"{s.name}: {s.doc}" for s in STAGES)
    check.add_argument("--dump", metavar="STAGE", choices=STAGE_NAMES,
                       help=f"print the IR after STAGE instead of a summary ({stages})")
    check.set_defaults(func=cmd_check)
    fmt = sub.add_parser("fmt", help="rewrite a file in canonical form",
                         description="Rewrite FILE in canonical form (comments are kept).")
    fmt.add_argument("file", metavar="FILE")
    mode = fmt.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only report whether FILE is canonical (exit 1 if not)")
    mode.add_argument("--stdout", action="store_true", help="print the canonical form instead of rewriting FILE")
    fmt.set_defaults(func=cmd_fmt)
    from dhelix.dsl.render import torch_csv as export
    from dhelix.cli import plan as plan_cli
    from dhelix.cli import render
    from dhelix.cli import simulate as sim_cli
    from dhelix.cli import profile as profile_cli

    for register in (render.register, export.register, plan_cli.register, sim_cli.register, profile_cli.register,
                     *extra):
        register(sub)
    return parser


def main(argv: list[str] | None = None, extra=()) -> int:
    """Run the command line with the compiler's commands and ``extra`` ones; returns the exit
    code. ``dhelix.cli.main`` adds the interpreter's ``run``."""
    parser = build_parser(extra)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"dhelix: {exc.message}", file=sys.stderr)
        return 2
    except DhelixError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dhelix: interrupted", file=sys.stderr)
        return 130
