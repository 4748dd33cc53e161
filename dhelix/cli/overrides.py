"""The override options of `dhelix render` and `dhelix export` (``--ranks``, ``--microbatches``,
``--layers``, ``--pipeline``, ``--fold``), and ``--profile`` of `plan`, `simulate` and `run`;
what they do is :mod:`dhelix.dsl.passes.overrides`."""

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


def add_profile_argument(parser) -> None:
    """Add ``--profile NAME|FILE`` to an argparse (sub)parser."""
    parser.add_argument("--profile", metavar="NAME|FILE",
                        help="price with this hardware profile instead of the one the cluster block names: a "
                             "shipped name (a40, h100, …) or a YAML file, e.g. one written by `dhelix profile`")
