"""`dhelix checkpoint verify CK`: check a checkpoint's saves against their manifests.

CK is a `dhelix run --save` folder (every save in it is checked, newest first) or one save
of it (``CK/step-000010``). Each file's size and SHA-256 is compared with the manifest the
save wrote last (:mod:`dhelix.interpreter.training.manifest`); an intact save is one line on
standard output, a damaged one an error naming the file (exit 1), a save without a manifest
(an older dhelix's) a warning. Needs no torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dhelix.dsl.core.errors import ErrorGroup, UsageError


def register(subparsers) -> None:
    """Add the ``checkpoint`` command (``verify``) to the CLI's sub-command parsers."""
    checkpoint = subparsers.add_parser(
        "checkpoint", help="check a checkpoint folder's saves against their manifests",
        description="Work on a `dhelix run --save` folder.")
    actions = checkpoint.add_subparsers(dest="action", required=True, metavar="ACTION")
    verify = actions.add_parser(
        "verify", help="check every file of each save against its manifest (size and SHA-256)",
        description="Check every file of each save in CK (or of the one save CK) against the manifest written "
                    "when the save completed; exit 1 naming the first damaged file of each damaged save.")
    verify.add_argument("ck", metavar="CK", help="a `dhelix run --save` folder, or one save of it (CK/step-000010)")
    verify.set_defaults(func=cmd_verify)


def cmd_verify(args) -> int:
    """`dhelix checkpoint verify CK`; prints one line per intact save, raises the damaged
    saves' errors (exit 1); returns the exit code."""
    from dhelix.interpreter.training.manifest import (META, CheckpointError, check_save, describe, intact_saves,
                                                      saves_in)

    root = Path(args.ck)
    if not root.is_dir():
        raise UsageError(f"{args.ck}: no such folder; give a `dhelix run --save` folder")
    if (root / META).is_file():
        checked = [(root, *check_save(root))]
    elif saves_in(root):
        checked = list(intact_saves(root))
    else:
        raise CheckpointError(f"'{args.ck}' is not a dhelix checkpoint: it holds no save (step-*)",
                              notes=["give a folder that a run saved its checkpoints in, or one of its saves"])
    damaged = []
    for folder, warnings, error in checked:
        for warning in warnings:
            print(warning.render(), file=sys.stderr)
        if error is not None:
            damaged.append(error)
        else:
            print(f"{folder}: {describe(folder, verified=not warnings)}")
    if damaged:
        raise damaged[0] if len(damaged) == 1 else ErrorGroup(damaged)
    return 0

