"""`dhelix fmt FILE [--check | --stdout]`: rewrite a schedule file in canonical form.

The canonical printer is :func:`dhelix.dsl.frontend.fmt.format_source` (comments kept). The
file is rewritten in place only when it changes; ``--check`` only reports (exit 1 when the
file is not canonical) and ``--stdout`` prints the canonical form instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.frontend.imports import read_source


def register(subparsers) -> None:
    """Add the ``fmt`` command to the CLI's sub-command parsers."""
    fmt = subparsers.add_parser("fmt", help="rewrite a file in canonical form",
                                description="Rewrite FILE in canonical form (comments are kept).")
    fmt.add_argument("file", metavar="FILE")
    mode = fmt.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only report whether FILE is canonical (exit 1 if not)")
    mode.add_argument("--stdout", action="store_true", help="print the canonical form instead of rewriting FILE")
    fmt.set_defaults(func=cmd_fmt)


def cmd_fmt(args) -> int:
    """`dhelix fmt FILE [--check | --stdout]`; returns the exit code."""
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
        try:
            Path(args.file).write_text(formatted)
        except OSError as exc:
            raise UsageError(f"cannot write '{args.file}': {exc.strerror or exc}") from None
        print(f"{args.file}: reformatted")
    return 0
