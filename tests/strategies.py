"""Hypothesis strategies for random dhelix syntax trees, covering every node of ``dsl/core/syntax.py``.

Trees are built without spans, so they compare equal to what the parser builds from their
printed text. Names avoid the keywords only where the grammar reserves them (lark's contextual
lexer makes a keyword an ordinary name wherever the keyword cannot start a statement):

* pipeline bodies reserve ``F B W SI repeat require`` as statement starts (let names);
* layer bodies reserve ``in out`` as statement starts (op result names);
* setting keys avoid ``F B W SI repeat require`` too: LALR merges the "end of an expression"
  states of all contexts, so after ``a = 1`` a setting key ``F`` lexes as the action ``F``.

Everywhere else (model names, expression names, selectors, ...) keywords are fair game and
are drawn on purpose.
"""

from __future__ import annotations

import re

from hypothesis import strategies as st

from dhelix.dsl.core import syntax as s

KEYWORDS = (
    "import", "model", "cluster", "mesh", "train", "fold", "pipeline", "repeat", "require",
    "SI", "F", "B", "W", "layer", "in", "out", "strands", "overlap", "comm_with_comm",
    "movable", "forbid", "with", "on", "off", "min", "max", "partition", "chunk", "by",
    "along", "substitute", "as", "group", "move", "later",
)
PIPELINE_RESERVED = frozenset({"F", "B", "W", "SI", "repeat", "require"})
LAYER_RESERVED = frozenset({"in", "out"})
# LALR shares the end-of-expression states with pipeline bodies, so after `a = 1` the
# statement keywords of pipelines are reserved as setting keys (the actions are not).
SETTING_RESERVED = frozenset({"repeat", "require"})

_COMMON_NAMES = ("x", "y", "p", "r", "m", "v", "tp", "cp", "dp", "hidden", "seq", "warm", "_a1")


def names(reserved: frozenset[str] = frozenset()) -> st.SearchStrategy[str]:
    """Identifiers (``[A-Za-z_][A-Za-z0-9_]*``), keywords included, minus ``reserved``."""
    drawn = st.one_of(
        st.sampled_from(_COMMON_NAMES),
        st.sampled_from(KEYWORDS),
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True),
    )
    return drawn.filter(lambda name: name not in reserved)


def exprs(max_leaves: int = 8) -> st.SearchStrategy[s.Expr]:
    """Integer expressions with every operator, nested negation and calls."""
    leaves = st.one_of(st.integers(0, 10**6).map(s.Int), names().map(s.Name))

    def extend(inner):
        return st.one_of(
            st.builds(s.BinOp, st.sampled_from(["+", "-", "*", "/", "//", "%"]), inner, inner),
            st.builds(s.Neg, inner),
            st.builds(s.Call, st.one_of(st.sampled_from(["min", "max"]), names()),
                      st.lists(inner, min_size=1, max_size=3).map(tuple)),
        )

    return st.recursive(leaves, extend, max_leaves=max_leaves)


def strings() -> st.SearchStrategy[s.Str]:
    """String values: one line, no double quote; ``#`` included to tease the comment scanner."""
    alphabet = st.one_of(st.sampled_from('#ab 1/.{}'),
                         st.characters(exclude_characters='"\n', exclude_categories=("Cs", "Cc")))
    return st.text(alphabet, max_size=8).map(s.Str)


def _tuples(elements, min_size: int = 0, max_size: int = 4):
    return st.lists(elements, min_size=min_size, max_size=max_size).map(tuple)


# --- configuration -------------------------------------------------------------------------

def settings() -> st.SearchStrategy[s.Setting]:
    """``key = value`` with an expression or a string value."""
    return st.builds(s.Setting, names(SETTING_RESERVED), st.one_of(exprs(), strings()))


def config_items() -> st.SearchStrategy:
    """Imports, model/cluster/mesh/train blocks, fold lines and pipeline references."""
    return st.one_of(
        st.builds(s.Import, strings().map(lambda text: text.value)),
        st.builds(s.ModelDef, names(), _tuples(settings())),
        st.builds(s.ConfigBlock, st.sampled_from(["cluster", "mesh", "train"]), _tuples(settings())),
        st.builds(s.Fold, names(), st.none() | exprs(4)),
        st.builds(s.PipelineRef, names()),
    )


# --- pipelines -----------------------------------------------------------------------------

def acts(kinds=("F", "B", "W")) -> st.SearchStrategy[s.Act]:
    """``F``, ``B[1]``, ``W[1, k]``, ...: an action with an optional chunk and, after a chunk,
    an optional micro-batch."""
    plain = st.builds(s.Act, st.sampled_from(kinds), st.none() | exprs(3))
    return plain | st.builds(s.Act, st.sampled_from(kinds), exprs(3), exprs(3))


def pipeline_statements(depth: int = 2) -> st.SearchStrategy:
    """Let, require, actions, SI blocks and (to ``depth`` levels) repeats."""
    leaf = st.one_of(
        st.builds(s.Let, names(PIPELINE_RESERVED), exprs()),
        st.builds(s.Require, exprs(4), st.sampled_from([">=", "<=", "==", "!=", ">", "<"]),
                  exprs(4)),
        acts(),
        st.builds(s.SIBlock, acts(("F",)), acts(("B",))),
    )
    if depth == 0:
        return leaf
    repeat = st.builds(s.Repeat, exprs(4), _tuples(pipeline_statements(depth - 1), max_size=3))
    return st.one_of(leaf, repeat)


def pipeline_defs() -> st.SearchStrategy[s.PipelineDef]:
    """A named per-rank schedule."""
    return st.builds(s.PipelineDef, names(), _tuples(pipeline_statements()), st.none() | names())


# --- layers and strands --------------------------------------------------------------------

def layer_statements() -> st.SearchStrategy:
    """Inputs with and without shapes, op applications with positional and keyword args, outputs."""
    arg = st.builds(s.Arg, exprs(4), st.none() | names())
    return st.one_of(
        st.builds(s.LayerIn, names(), st.none() | st.tuples(exprs(4), exprs(4))),
        st.builds(s.OpApply, names(LAYER_RESERVED), names(), _tuples(arg)),
        st.builds(s.LayerOut, names()),
    )


def selectors() -> st.SearchStrategy[s.Selector]:
    """``gemm``, ``attention.bwd``: dotted op selectors."""
    return st.builds(s.Selector, _tuples(names(), min_size=1, max_size=3))


def strands_statements() -> st.SearchStrategy:
    """overlap, comm_with_comm, movable and forbid."""
    return st.one_of(
        st.builds(s.Overlap, _tuples(names(), min_size=1, max_size=3)),
        st.builds(s.CommWithComm, st.sampled_from(["on", "off"]) | names()),
        st.builds(s.Movable, _tuples(selectors(), min_size=1, max_size=3)),
        st.builds(s.Forbid, selectors(), selectors()),
    )


def partition_statements() -> st.SearchStrategy:
    """chunk (with and without along; counts of every expression form), substitute, move and group."""
    return st.one_of(
        st.builds(s.Chunk, _tuples(names(), min_size=1, max_size=3), exprs(4), st.none() | names()),
        st.builds(s.Substitute, names(), _tuples(names(), min_size=1, max_size=3)),
        st.builds(s.Move, _tuples(names(), min_size=1, max_size=3)),
        st.builds(s.Group, _tuples(names(), min_size=1, max_size=3)),
    )


def items() -> st.SearchStrategy:
    """Any top-level item."""
    return st.one_of(
        config_items(),
        pipeline_defs(),
        st.builds(s.LayerDef, names(), _tuples(layer_statements(), max_size=5)),
        st.builds(s.StrandsDef, _tuples(strands_statements())),
        st.builds(s.PartitionDef, _tuples(partition_statements())),
    )


def modules(max_items: int = 5) -> st.SearchStrategy[s.Module]:
    """Whole files."""
    return st.builds(s.Module, _tuples(items(), max_size=max_items))


# --- layouts -------------------------------------------------------------------------------

#: Rough dhelix tokens: strings and comments whole, whitespace, words, numbers, operators.
TOKEN = re.compile(r'"[^"\n]*"|#[^\n]*|\s+|[A-Za-z_]\w*|\d+|//|>=|<=|==|!=|.', re.S)

_GAPS = (" ", "\n", "\n\n", "  # c{}\n", "\n# d{}\n", "\n  # e{}\n\n")


@st.composite
def relayouts(draw, text: str) -> str:
    """``text`` with each run of whitespace replaced by a space, newlines, or a comment —
    so statements split over lines and comments land in every position."""
    out, count = [], 0
    for token in TOKEN.findall(text):
        if token.isspace():
            gap = draw(st.sampled_from(_GAPS))
            if "{}" in gap:
                gap, count = gap.format(count), count + 1
            token = gap
        out.append(token)
    return "".join(out)
