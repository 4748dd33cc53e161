"""Parse dhelix text into a :class:`~dhelix.dsl.core.syntax.Module`.

The grammar (``grammar/dhelix.lark``) is loaded once, lazily, with lark's LALR parser in
strict mode (:mod:`.grammar`). Lark's exceptions are translated into :class:`ParseError` in the
user's words (``expected '}' or a setting``, :mod:`.parse_errors`) and raised ``from None``; a
:class:`Transformer` with one small method per rule builds the frozen syntax nodes.
"""

from __future__ import annotations

from lark import Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedInput, VisitError

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import ParseError
from dhelix.dsl.core.span import Source, Span
from dhelix.dsl.core.wording import did_you_mean
from dhelix.dsl.frontend.grammar import lark_parser
from dhelix.dsl.frontend.parse_errors import refuse_bidi_controls, translate

ACTIONS = ("F", "B", "W")

#: How deeply expressions and repeat blocks may nest: parentheses on the right of an
#: operator, unary minus, min/max calls and repeat blocks each add a level; a flat chain
#: ``1 + 1 + … + 1`` is one level however long. Deeper text is a located ParseError.
MAX_NESTING = 100
#: The most digits a number may have (every size is far smaller; Python refuses to convert
#: numbers of over 4300 digits, and long ones make arithmetic slow).
MAX_DIGITS = 30


def parse(text: str, path: str = "<string>", start: str = "start"):
    """Parse ``text`` (shown as ``path`` in messages) from rule ``start``.

    Returns a :class:`syntax.Module` for ``start``, else the node of the fragment.
    Raises :class:`ParseError` located at the offending character or token.
    """
    source = Source(path, text)
    refuse_bidi_controls(source)
    # A byte-order mark (kept by a reader that did not drop it) is whitespace to the parser;
    # a space in its place keeps every column.
    text = " " + text[1:] if text.startswith("\ufeff") else text
    try:
        tree = lark_parser().parse(text, start=start)
    except UnexpectedInput as exc:
        raise translate(exc, source) from None
    try:
        return _Builder(source).build(tree)
    except VisitError as exc:  # lark wraps what a builder method raises
        if isinstance(exc.orig_exc, ParseError):
            raise exc.orig_exc from None
        raise


@v_args(meta=True)
class _Builder(Transformer):
    """Builds syntax nodes; every rule of the grammar has a method, anything else is a bug."""

    def __init__(self, source: Source):
        super().__init__(visit_tokens=False)
        self.source = source

    def __default__(self, data, children, meta):
        raise NotImplementedError(f"grammar rule {data!r} has no builder method")

    def build(self, root: Tree):
        """Transform ``root`` bottom-up without recursion (lark's own transform recurses once
        per level, and a chain of 500 ``+`` is 500 levels), checking :data:`MAX_NESTING`."""
        results: list = []  # the built children, innermost last
        depths: list[int] = []
        stack: list[tuple[object, bool]] = [(root, False)]
        while stack:
            node, children_done = stack.pop()
            if not isinstance(node, Tree):
                results.append(node)
                depths.append(0)
            elif children_done:
                count = len(node.children)
                children, child_depths = results[len(results) - count:], depths[len(depths) - count:]
                del results[len(results) - count:], depths[len(depths) - count:]
                depth = _nesting(node.data, child_depths)
                if depth > MAX_NESTING:
                    raise ParseError(f"nested more than {MAX_NESTING} levels deep", self._span(node.meta),
                                     ["parentheses on the right of an operator, '-', min/max calls "
                                      "and repeat blocks each add a level; a flat chain "
                                      "`1 + 1 + … + 1` is one level", "name a part with `x = …` "
                                      "(in a pipeline) or a setting, and use the name"])
                results.append(self._call_userfunc(node, children))
                depths.append(depth)
            else:
                stack.append((node, True))
                stack.extend((child, False) for child in reversed(node.children))
        return results[0]

    def _span(self, meta) -> Span | None:
        return None if getattr(meta, "empty", True) else Span.from_meta(self.source, meta)

    def _tok(self, token: Token) -> Span:
        return Span.from_meta(self.source, token)

    # --- file and configuration -------------------------------------------------------
    def start(self, meta, items):
        return s.Module(tuple(items), span=self._span(meta))

    def import_stmt(self, meta, children):
        (path,) = children
        return s.Import(path[1:-1], span=self._span(meta), spans={"path": self._tok(path)})

    def model_def(self, meta, children):
        name, *settings = children
        return s.ModelDef(str(name), tuple(settings), span=self._span(meta),
                          spans={"name": self._tok(name)})

    def _block(self, kind, meta, settings):
        return s.ConfigBlock(kind, tuple(settings), span=self._span(meta))

    def cluster_def(self, meta, children):
        return self._block("cluster", meta, children)

    def levels_def(self, meta, children):
        name, *settings = children
        if str(name) != s.Levels.key:
            raise ParseError(f"unknown block '{name} {{ … }}' in the cluster block", self._tok(name),
                             did_you_mean(str(name), [s.Levels.key]) +
                             ["the cluster block takes settings and a `levels { island = 2 … }` block"])
        return s.Levels(tuple(settings), span=self._span(meta))

    def mesh_def(self, meta, children):
        return self._block("mesh", meta, children)

    def train_def(self, meta, children):
        return self._block("train", meta, children)

    def setting(self, meta, children):
        key, value = children
        return s.Setting(str(key), value, span=self._span(meta), spans={"key": self._tok(key)})

    def string(self, meta, children):
        (token,) = children
        return s.Str(str(token)[1:-1], span=self._span(meta))

    def fold_stmt(self, meta, children):
        kind, *arg = children
        return s.Fold(str(kind), arg[0] if arg else None, span=self._span(meta),
                      spans={"kind": self._tok(kind)})

    def fold_arg(self, meta, children):
        return children[0]

    # --- pipelines --------------------------------------------------------------------
    def pipeline_ref(self, meta, children):
        (name,) = children
        return s.PipelineRef(str(name), span=self._span(meta), spans={"name": self._tok(name)})

    def pipeline_def(self, meta, children):
        name, *body = children
        fold = body.pop(0) if body and isinstance(body[0], Token) else None
        spans = {"name": self._tok(name)} | ({"fold": self._tok(fold)} if fold else {})
        return s.PipelineDef(str(name), tuple(body), str(fold) if fold else None,
                             span=self._span(meta), spans=spans)

    def pipeline_fold(self, meta, children):
        return children[0]

    def let_stmt(self, meta, children):
        name, value = children
        return s.Let(str(name), value, span=self._span(meta), spans={"name": self._tok(name)})

    def repeat_stmt(self, meta, children):
        count, *body = children
        return s.Repeat(count, tuple(body), span=self._span(meta))

    def require_stmt(self, meta, children):
        left, op, right = children
        return s.Require(left, str(op), right, span=self._span(meta))

    def act(self, meta, children):
        kind, *chunk = children
        if str(kind) not in ACTIONS:
            raise ParseError(f"unknown action '{kind}'", self._tok(kind),
                             did_you_mean(str(kind), ACTIONS) +
                             ["a pipeline statement is `name = expr`, `repeat N { … }`, `require a >= b`, "
                              "an action F, B, W (F[1] for chunk 1) or SI(F, B)"])
        index, microbatch = chunk[0] if chunk else (None, None)
        return s.Act(str(kind), index, microbatch, span=self._span(meta), spans={"kind": self._tok(kind)})

    def chunk(self, meta, children):
        return children[0], children[1] if len(children) > 1 else None

    def si_block(self, meta, children):
        name, fwd, bwd = children
        if str(name) != "SI":
            raise ParseError(f"unknown block '{name}(…)'", self._tok(name),
                             did_you_mean(str(name), ["SI"]) + ["a strand-interleaved block is SI(F, B)"])
        return s.SIBlock(fwd, bwd, span=self._span(meta))

    # --- layers -----------------------------------------------------------------------
    def layer_def(self, meta, children):
        name, *body = children
        return s.LayerDef(str(name), tuple(body), span=self._span(meta),
                          spans={"name": self._tok(name)})

    def layer_in(self, meta, children):
        name, *shape = children
        return s.LayerIn(str(name), shape[0] if shape else None, span=self._span(meta),
                         spans={"name": self._tok(name)})

    def shape(self, meta, children):
        return tuple(children)

    def layer_out(self, meta, children):
        (name,) = children
        return s.LayerOut(str(name), span=self._span(meta), spans={"name": self._tok(name)})

    def op_apply(self, meta, children):
        name, op, *args = children
        return s.OpApply(str(name), str(op), tuple(a for a in args if a is not None),
                         span=self._span(meta), spans={"name": self._tok(name), "op": self._tok(op)})

    def arg(self, meta, children):
        return s.Arg(children[0], span=self._span(meta))

    def kwarg(self, meta, children):
        key, value = children
        return s.Arg(value, str(key), span=self._span(meta), spans={"key": self._tok(key)})

    # --- strands ----------------------------------------------------------------------
    def strands_def(self, meta, children):
        return s.StrandsDef(tuple(children), span=self._span(meta))

    def overlap(self, meta, children):
        return s.Overlap(tuple(str(c) for c in children), span=self._span(meta),
                         spans={f"kinds.{i}": self._tok(c) for i, c in enumerate(children)})

    def comm_with_comm(self, meta, children):
        (value,) = children
        return s.CommWithComm(str(value), span=self._span(meta), spans={"value": self._tok(value)})

    def movable(self, meta, children):
        return s.Movable(tuple(children), span=self._span(meta))

    def forbid(self, meta, children):
        first, second = children
        return s.Forbid(first, second, span=self._span(meta))

    def selector(self, meta, children):
        return s.Selector(tuple(str(c) for c in children), span=self._span(meta))

    # --- partition --------------------------------------------------------------------
    def partition_def(self, meta, children):
        return s.PartitionDef(tuple(children), span=self._span(meta))

    def op_name(self, meta, children):
        # One token spanning the dotted name, as a plain NAME would.
        first, last = children[0], children[-1]
        return Token("NAME", ".".join(str(c) for c in children), start_pos=first.start_pos, line=first.line,
                     column=first.column, end_line=last.end_line, end_column=last.end_column, end_pos=last.end_pos)

    def chunk_stmt(self, meta, children):
        *names, parts = children
        dim = names.pop() if names and isinstance(names[-1], tuple) else None
        spans = {f"ops.{i}": self._tok(n) for i, n in enumerate(names)}
        if dim is not None:
            spans["dim"] = dim[1]
        return s.Chunk(tuple(str(n) for n in names), parts, dim[0] if dim else None,
                       span=self._span(meta), spans=spans)

    def along(self, meta, children):
        (dim,) = children
        return (str(dim), self._tok(dim))

    def group_stmt(self, meta, children):
        names = list(children)
        first = names.pop() if names and isinstance(names[-1], tuple) else None
        spans = {f"ops.{i}": self._tok(n) for i, n in enumerate(names)}
        if first is not None:
            spans["first"] = first[1]
        return s.Group(tuple(str(n) for n in names), first[0] if first else None, span=self._span(meta), spans=spans)

    def backward_stmt(self, meta, children):
        (first,) = children
        return s.Backward(str(first), span=self._span(meta), spans={"first": self._tok(first)})

    def first(self, meta, children):
        (part,) = children
        return (str(part), self._tok(part))

    def move_stmt(self, meta, children):
        spans = {f"ops.{i}": self._tok(n) for i, n in enumerate(children)}
        return s.Move(tuple(str(n) for n in children), span=self._span(meta), spans=spans)

    def substitute_stmt(self, meta, children):
        op, *into = children
        spans = {"op": self._tok(op)} | {f"into.{i}": self._tok(n) for i, n in enumerate(into)}
        return s.Substitute(str(op), tuple(str(n) for n in into), span=self._span(meta), spans=spans)

    # --- expressions ------------------------------------------------------------------
    def int(self, meta, children):
        (token,) = children
        digits = str(token).lstrip("0") or "0"
        if len(digits) > MAX_DIGITS:
            raise ParseError(f"number with {len(digits)} digits is too large", self._span(meta),
                             [f"numbers have at most {MAX_DIGITS} digits; every size is far smaller"])
        return s.Int(int(digits), span=self._span(meta))

    def name(self, meta, children):
        return s.Name(str(children[0]), span=self._span(meta))

    def call(self, meta, children):
        func, *args = children
        return s.Call(str(func), tuple(args), span=self._span(meta), spans={"func": self._tok(func)})

    def neg(self, meta, children):
        return s.Neg(children[0], span=self._span(meta))

    @staticmethod
    def _binop(op: str):  # a small factory for the five binary rules
        def method(self, meta, children):
            left, right = children
            return s.BinOp(op, left, right, span=self._span(meta))
        return method

    add = _binop("+")
    sub = _binop("-")
    mul = _binop("*")
    div = _binop("/")
    floordiv = _binop("//")
    mod = _binop("%")
    del _binop


_BINARY = frozenset({"add", "sub", "mul", "div", "floordiv", "mod"})
_NESTING = frozenset({"neg", "call", "repeat_stmt"})


def _nesting(rule: str, child_depths: list[int]) -> int:
    """The nesting level of a node of ``rule`` over children at ``child_depths``: a binary
    operator's left operand is at its own level (chains are flat), its right one a level in."""
    if rule in _BINARY:
        left, right = child_depths
        return max(left, right + 1)
    deepest = max(child_depths, default=0)
    return deepest + 1 if rule in _NESTING else deepest
