"""The grammar (``grammar/dhelix.lark``) as lark's LALR parser in strict mode, built once,
lazily, its tables kept between commands (:mod:`.grammar_cache`).
"""

from __future__ import annotations

import functools
from importlib import resources

import lark

from dhelix.dsl.frontend import grammar_cache

#: Start rules: `start` for files; the others let tests and tools parse fragments.
START_RULES = ("start", "expr", "layer_def", "pipeline_def", "strands_def", "partition_def")


@functools.cache
def grammar_text() -> str:
    """The text of ``dhelix.lark`` as installed with the package."""
    return resources.files("dhelix.grammar").joinpath("dhelix.lark").read_text()


@functools.cache
def lark_parser() -> lark.Lark:
    """The parser of every start rule (:data:`START_RULES`)."""
    cache = grammar_cache.usable_file(f"lark{lark.__version__}")
    parser = lark.Lark(grammar_text(), parser="lalr", strict=True, propagate_positions=True,
                       maybe_placeholders=False, start=list(START_RULES), cache=cache or False)
    if cache is not None:
        grammar_cache.seal(cache)
    return parser
