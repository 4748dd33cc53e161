"""`dhelix export FILE --torch-csv OUT [--torch-format FORM] [overrides]`: write the lowered
schedule for torch.distributed.pipelining.

The CSV and its two forms are :mod:`dhelix.dsl.render.torch_csv`'s; this module reads the
command line, checks the output path (:mod:`dhelix.cli.paths`), writes the file and says on
standard error what it wrote. The overrides (``--ranks``, ``--microbatches``, ``--layers``,
``--pipeline``, ``--fold``) re-lower the file's schedule at other sizes, as for ``render``.
"""

from __future__ import annotations

import sys

from dhelix.cli.paths import output_path, program_inputs, refuse_inputs, write_output
from dhelix.dsl.core.errors import UsageError
from dhelix.cli.overrides import add_override_arguments, overrides_from_args
from dhelix.dsl.passes.overrides import load_file
from dhelix.dsl.render.torch_csv import TORCH_FORMATS, torch_csv


def register(subparsers) -> None:
    """Add the ``export`` command to the CLI's sub-command parsers."""
    export = subparsers.add_parser(
        "export", help="write the lowered schedule for torch.distributed.pipelining",
        description="Write FILE's lowered pipeline schedule as the CSV that torch.distributed."
                    "pipelining's _PipelineScheduleRuntime._load_csv reads (SI blocks as "
                    "OVERLAP_F_B).")
    export.add_argument("file", metavar="FILE")
    export.add_argument("--torch-csv", metavar="OUT", help="write the torch schedule CSV to OUT")
    export.add_argument("--torch-format", default="compute_only", metavar="FORM",
                        help="compute_only (default; torch adds SEND/RECV itself) or compute_comms "
                             "(dhelix's own SEND/RECV; load with format=\"compute_comms\")")
    add_override_arguments(export)
    export.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    """`dhelix export FILE --torch-csv OUT [--torch-format FORM] [overrides]`; returns the
    exit code."""
    if args.torch_format not in TORCH_FORMATS:
        raise UsageError(f"--torch-format: unknown form '{args.torch_format}'; "
                         f"forms: {', '.join(TORCH_FORMATS)}")
    if not args.torch_csv:
        raise UsageError("nothing to export: give --torch-csv OUT.csv")
    output = output_path(args.torch_csv, "--torch-csv", inputs=(args.file,))
    program = load_file(args.file, overrides_from_args(args))
    refuse_inputs(output, "--torch-csv", program_inputs(program))
    write_output(output, torch_csv(program.lowered, args.torch_format))
    lowered = program.lowered
    print(f"{output}: {lowered.name}, p = {lowered.ranks}, m = {lowered.microbatches}, "
          f"{len(lowered.stages)} stages, {args.torch_format}", file=sys.stderr)
    return 0
