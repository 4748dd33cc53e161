"""The declared options (:mod:`dhelix.dsl.core.options`) on the command line: their arguments,
their help with other options spelt as flags, their range checks, and the values a run takes
from the command line, the train block and the defaults.

A flag given on the command line wins over the train block's key, which wins over the
declared default: argparse's default is therefore None for every option but a switch, so that
"not given" can be told apart (``--keep`` needs ``--save``; a default does not); read an
option's value with :func:`value_of`.
"""

from __future__ import annotations

import re

from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.core.options import OPTIONS, Option, in_range, option, range_words


def flag(o: Option) -> str:
    """``--weight-decay`` for the option ``weight_decay``."""
    return "--" + o.spelled


def help_text(o: Option) -> str:
    """``o``'s help for argparse: ``{name}`` spelt as that option's flag, ``{-word}`` as
    ``--word``, ``{default}`` as its default, ``%`` escaped."""
    def spell(match: re.Match) -> str:
        word = match.group(1)
        if word == "default":
            return f"{o.default:g}" if o.kind is float else str(o.default)
        return "--" + word[1:] if word.startswith("-") else flag(option(word))

    return re.sub(r"\{(-?[a-z][a-z0-9_-]*)\}", spell, o.help).replace("%", "%%")


def add_options(parser, names: tuple[str, ...] | list[str] | None = None, *, group: str | None = None) -> None:
    """Add an argument to ``parser`` (a parser or an argument group) for each declared option
    with a flag: those called ``names``, or else every one of ``group`` ("run", "training")."""
    chosen = [option(name) for name in names] if names is not None else \
        [o for o in OPTIONS if o.group == group and o.on_command_line]
    for o in chosen:
        spellings = [flag(o)] + ["--" + alias for alias in o.aliases]
        if o.kind is bool:
            parser.add_argument(*spellings, dest=o.name, action="store_false" if o.default else "store_true",
                                help=help_text(o))
            continue
        extra = {"choices": list(o.choices)} if o.choices else {"metavar": o.metavar}
        parser.add_argument(*spellings, dest=o.name, type=o.kind, default=None,
                            nargs="+" if o.many else None,
                            help=help_text(o), **extra)


def check_options(args, names: tuple[str, ...] | list[str] | None = None) -> None:
    """UsageError for the first option (of ``names``, else every declared one ``args`` has)
    given outside its range."""
    chosen = [option(name) for name in names] if names is not None else OPTIONS
    for o in chosen:
        value = getattr(args, o.name, None)
        words = range_words(o)
        if value is None or words is None or in_range(o, value):
            continue
        shown = f"{value:g}" if o.kind is float else str(value)
        raise UsageError(f"{flag(o)} must be {words}" + ("; got " if o.kind is float else ", got ") + shown)


def value_of(args, name: str, train=None):
    """The value of option ``name`` for a run: the command line's when given, else the train
    block's (``train``: the program's :class:`~dhelix.dsl.core.program.Train`) when it writes
    it, else the declared default."""
    o = option(name)
    given = getattr(args, o.name, None)
    if given is not None and not (o.kind is bool and given == o.default):
        return given
    written = train.setting(o.train) if train is not None and o.train else None
    return written if written is not None else o.default


def run_values(args, train=None) -> dict:
    """Every run option's value (:func:`value_of`), by ``RunOptions`` field."""
    from dhelix.dsl.core.options import run_fields

    return {o.name: value_of(args, o.name, train) for o in run_fields()}
