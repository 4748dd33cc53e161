"""Syntax tree of a dhelix file: frozen attrs nodes built by :mod:`dhelix.dsl.frontend.parser`.

Fields hold plain values (strings, ints, tuples of nodes). Each node's ``span`` and the
per-field ``spans`` (the tokens of its names) are keyword-only and excluded from equality,
so two texts that differ only in layout or comments parse to equal trees.
"""

from __future__ import annotations

from typing import Union

import attrs

from dhelix.dsl.core.span import Span


@attrs.frozen
class Node:
    """Base of all syntax nodes: a span and the spans of named fields."""

    # attrs.field written out (span_field and spans_field's settings): mypy's attrs plugin sees
    # keyword-only only there, and the subclasses' fields come after these defaults.
    span: Span | None = attrs.field(default=None, kw_only=True, eq=False, repr=False)
    spans: dict = attrs.field(factory=dict, kw_only=True, eq=False, repr=False)

    def span_of(self, field: str) -> Span | None:
        """The span of the token that wrote ``field`` (falls back to the node's span)."""
        return self.spans.get(field, self.span)


# --- expressions --------------------------------------------------------------------------

@attrs.frozen
class Int(Node):
    value: int


@attrs.frozen
class Name(Node):
    id: str


@attrs.frozen
class BinOp(Node):
    op: str  # one of + - * / // %
    left: "Expr"
    right: "Expr"


@attrs.frozen
class Neg(Node):
    operand: "Expr"


@attrs.frozen
class Call(Node):
    func: str  # min | max
    args: tuple["Expr", ...]


Expr = Union[Int, Name, BinOp, Neg, Call]


@attrs.frozen
class Str(Node):
    value: str


# --- configuration ------------------------------------------------------------------------

@attrs.frozen
class Import(Node):
    path: str


@attrs.frozen
class Setting(Node):
    key: str
    value: Union[Expr, Str]


@attrs.frozen
class ModelDef(Node):
    name: str
    settings: tuple[Setting, ...]


@attrs.frozen
class Levels(Node):
    """``levels { island = 2  node = 4 }`` inside a cluster block: the GPUs in one unit of
    each level of the topology, smallest first."""

    settings: tuple[Setting, ...]
    #: What code that reads a block's settings by key sees (it sets no value of the block).
    key = "levels"


@attrs.frozen
class ConfigBlock(Node):
    kind: str  # cluster | mesh | train
    settings: tuple[Setting | Levels, ...]  # a Levels block only in a cluster block


@attrs.frozen
class Fold(Node):
    kind: str  # none | u | loop
    arg: Expr | None


# --- pipelines ----------------------------------------------------------------------------

@attrs.frozen
class PipelineRef(Node):
    name: str


@attrs.frozen
class Let(Node):
    name: str
    value: Expr


@attrs.frozen
class Require(Node):
    left: Expr
    op: str
    right: Expr


@attrs.frozen
class Act(Node):
    kind: str  # F | B | W
    chunk: Expr | None
    microbatch: Expr | None = None  # B[c, k]: micro-batch k, not the (kind, chunk) counter's next


@attrs.frozen
class SIBlock(Node):
    fwd: Act
    bwd: Act


@attrs.frozen
class Repeat(Node):
    count: Expr
    body: tuple["PStmt", ...]


PStmt = Union[Let, Require, Act, SIBlock, Repeat]


@attrs.frozen
class PipelineDef(Node):
    name: str
    body: tuple[PStmt, ...]
    fold: str | None = None  # the fold kind it is written for (`pipeline w_helix for u`)


# --- layer DAGs ---------------------------------------------------------------------------

@attrs.frozen
class LayerIn(Node):
    name: str
    shape: tuple[Expr, Expr] | None


@attrs.frozen
class LayerOut(Node):
    name: str


@attrs.frozen
class Arg(Node):
    value: Expr
    key: str | None = None  # set for keyword arguments


@attrs.frozen
class OpApply(Node):
    name: str
    op: str
    args: tuple[Arg, ...]


LStmt = Union[LayerIn, OpApply, LayerOut]


@attrs.frozen
class LayerDef(Node):
    name: str
    body: tuple[LStmt, ...]


# --- strands ------------------------------------------------------------------------------

@attrs.frozen
class Selector(Node):
    parts: tuple[str, ...]

    def __str__(self) -> str:
        return ".".join(self.parts)


@attrs.frozen
class Overlap(Node):
    kinds: tuple[str, ...]


@attrs.frozen
class CommWithComm(Node):
    value: str  # on | off


@attrs.frozen
class Movable(Node):
    selectors: tuple[Selector, ...]


@attrs.frozen
class Forbid(Node):
    first: Selector
    second: Selector


SStmt = Union[Overlap, CommWithComm, Movable, Forbid]


@attrs.frozen
class StrandsDef(Node):
    body: tuple[SStmt, ...]


# --- partition (Centauri) ------------------------------------------------------------------

@attrs.frozen
class Chunk(Node):
    """``chunk a + b by k [along dim]``: split the chain ``ops`` into ``parts`` chunks
    along ``dim`` (None: tokens, the default). Each op name's span is ``ops.i``."""

    ops: tuple[str, ...]
    parts: Expr
    dim: str | None = None


@attrs.frozen
class Substitute(Node):
    """``substitute ar as reduce_scatter + all_gather``: replace collective ``op`` by the
    sequence ``into``. Spans: ``op`` and ``into.i``."""

    op: str
    into: tuple[str, ...]


@attrs.frozen
class Move(Node):
    """``move ar1 + ar2 later``: move the all_gathers ``ops`` past the elementwise operators
    that read them (sequence parallelism of the layer's tokens). Spans: ``ops.i``."""

    ops: tuple[str, ...]


@attrs.frozen
class Group(Node):
    """``group ag1 + rs1 [first inter]``: run each collective as sub-collectives over the
    node-local and the cross-node part of its group, the sub-group ``first`` names (``inter``
    or ``intra``; a level when the cluster declares levels; None: chosen by cost) first.
    Spans: ``ops.i`` and ``first``."""

    ops: tuple[str, ...]
    first: str | None = None


@attrs.frozen
class Backward(Node):
    """``backward wgrad first``: which half of each GEMM's backward runs first (``dgrad`` or
    ``wgrad``). Span: ``first``."""

    first: str


XStmt = Union[Chunk, Substitute, Move, Group, Backward]


@attrs.frozen
class PartitionDef(Node):
    body: tuple[XStmt, ...]


Item = Union[Import, ModelDef, ConfigBlock, Fold, PipelineRef, PipelineDef, LayerDef, StrandsDef, PartitionDef]


@attrs.frozen
class Module(Node):
    """One parsed file: its items in source order."""

    items: tuple[Item, ...]
