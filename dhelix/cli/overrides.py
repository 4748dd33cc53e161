"""The override options of `dhelix render` and `dhelix export` (``--ranks``, ``--microbatches``,
``--layers``, ``--pipeline``, ``--fold``); what they do is :mod:`dhelix.dsl.passes.overrides`."""

from __future__ import annotations

from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.core.program import fold_kinds_text
from dhelix.dsl.passes.overrides import Overrides


def add_override_arguments(parser) -> None:
    """Add the override options to an argparse (sub)parser."""
    group = parser.add_argument_group("overrides (re-run fold, lower and validate with other sizes)")
    group.add_argument("--ranks", type=int, metavar="P", help="pipeline ranks (the mesh's pp)")
    group.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per step")
    group.add_argument("--layers", type=int, metavar="L", help="model layers")
    group.add_argument("--pipeline", metavar="NAME",
                       help="another pipeline defined in the file or its imports; the fold follows "
                            "the pipeline's `for` clause unless --fold is given")
    group.add_argument("--fold", metavar="FOLD", help=fold_kinds_text("V"))


def overrides_from_args(args) -> Overrides:
    """The :class:`Overrides` of parsed arguments; UsageError for a size below 1."""
    for name in ("ranks", "microbatches", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be at least 1, got {value}")
    return Overrides(args.ranks, args.microbatches, args.layers, args.pipeline, args.fold)
