"""Parse dhelix text into a :class:`~dhelix.dsl.syntax.Module`.

The grammar (``grammar/dhelix.lark``) is loaded once, lazily, with lark's LALR parser in
strict mode. Lark's exceptions are translated into :class:`ParseError` in the user's words
(``expected '}' or a setting``) and raised ``from None``; a :class:`Transformer` with one
small method per rule builds the frozen syntax nodes.
"""

from __future__ import annotations

import functools
from importlib import resources

import lark
from lark import Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from . import syntax as s
from .errors import ParseError
from .span import Source, Span

#: Start rules: `start` for files; the others let tests and tools parse fragments.
START_RULES = ("start", "expr", "layer_def", "pipeline_def", "strands_def")

_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "a number",
    "STRING": 'a string ("...")',
    "COMPARE": "a comparison (>=, <=, ==, !=, >, <)",
    "$END": "the end of the file",
}


@functools.cache
def grammar_text() -> str:
    """The text of ``dhelix.lark`` as installed with the package."""
    return resources.files("dhelix.grammar").joinpath("dhelix.lark").read_text()


@functools.cache
def _lark() -> lark.Lark:
    return lark.Lark(grammar_text(), parser="lalr", strict=True, propagate_positions=True,
                     maybe_placeholders=False, start=list(START_RULES))


def parse(text: str, path: str = "<string>", start: str = "start"):
    """Parse ``text`` (shown as ``path`` in messages) from rule ``start``.

    Returns a :class:`syntax.Module` for ``start``, else the node of the fragment.
    Raises :class:`ParseError` located at the offending character or token.
    """
    source = Source(path, text)
    try:
        tree = _lark().parse(text, start=start)
    except UnexpectedInput as exc:
        raise _translate(exc, source) from None
    return _Builder(source).transform(tree)


def _describe(terminal: str) -> str:
    if terminal in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[terminal]
    for term in _lark().terminals:
        if term.name == terminal and term.pattern.type == "str":
            return f"'{term.pattern.value}'"
    return terminal.lower()


_OPERATORS = {"PLUS", "MINUS", "STAR", "SLASH", "PERCENT", "__ANON_0"}


def _expected(names) -> str:
    names = set(names)
    words = sorted({_describe(n) for n in names - _OPERATORS if not n.startswith("_")},
                   key=lambda w: (not w[0].isalpha(), w))  # words before punctuation
    if names & _OPERATORS:
        words.append("an operator (+ - * / // %)")
    if len(words) > 6:
        words = words[:6] + ["…"]
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _translate(exc: UnexpectedInput, source: Source) -> ParseError:
    line, column = max(exc.line, 1), max(exc.column, 1)
    if isinstance(exc, UnexpectedCharacters):
        char = source.text[exc.pos_in_stream] if exc.pos_in_stream < len(source.text) else "?"
        span = Span(source, line, column, line, column + 1)
        # The lexer's allowed set can be a union over parser states: only show a short one.
        allowed = exc.allowed or set()
        notes = [f"expected {_expected(allowed)} here"] if 0 < len(allowed) <= 4 else []
        notes += _hints(char)
        return ParseError(f"unexpected character {char!r}", span, notes)
    if isinstance(exc, UnexpectedEOF) or (isinstance(exc, UnexpectedToken) and exc.token.type == "$END"):
        last = source.text.rstrip().splitlines() or [""]
        line = len(last)
        span = Span(source, line, max(1, len(last[-1])), line, max(2, len(last[-1]) + 1))
        expected = getattr(exc, "expected", None) or getattr(exc, "accepts", None) or []
        return ParseError("unexpected end of file", span,
                          [f"expected {_expected(expected)}; is a closing '}}' missing?"])
    assert isinstance(exc, UnexpectedToken)
    token = exc.token
    end_column = getattr(token, "end_column", None) or column + len(str(token))
    span = Span(source, line, column, line, end_column)
    notes = [f"expected {_expected(exc.accepts or exc.expected)}"] + _hints(str(token))
    return ParseError(f"unexpected {_describe_token(token)}", span, notes)


def _describe_token(token: Token) -> str:
    if token.type in ("NAME", "INT", "STRING"):
        return f"{_TERMINAL_WORDS[token.type].split(' (')[0].removeprefix('a ')} {str(token)!r}"
    return repr(str(token))


def _hints(text: str) -> list[str]:
    hints = {
        ";": "dhelix statements need no ';' — put the next one on its own line",
        ":": "settings are written `key = value`, not `key: value`",
        "'": 'strings use double quotes: "a40"',
        "[": "chunk indices follow an action: F[1]; shapes follow an input: in x [seq, hidden]",
        "F": "'F', 'B' and 'W' are actions inside a pipeline, not names",
        "B": "'F', 'B' and 'W' are actions inside a pipeline, not names",
        "W": "'F', 'B' and 'W' are actions inside a pipeline, not names",
    }
    return [hints[text]] if text in hints else []


@v_args(meta=True)
class _Builder(Transformer):
    """Builds syntax nodes; every rule of the grammar has a method, anything else is a bug."""

    def __init__(self, source: Source):
        super().__init__(visit_tokens=False)
        self.source = source

    def __default__(self, data, children, meta):
        raise NotImplementedError(f"grammar rule {data!r} has no builder method")

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
        return s.PipelineDef(str(name), tuple(body), span=self._span(meta),
                             spans={"name": self._tok(name)})

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
        return s.Act(str(kind), chunk[0] if chunk else None, span=self._span(meta))

    def chunk(self, meta, children):
        return children[0]

    def si_block(self, meta, children):
        fwd, bwd = children
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

    # --- expressions ------------------------------------------------------------------
    def int(self, meta, children):
        return s.Int(int(children[0]), span=self._span(meta))

    def name(self, meta, children):
        return s.Name(str(children[0]), span=self._span(meta))

    def call(self, meta, children):
        func, *args = children
        return s.Call(str(func), tuple(args), span=self._span(meta), spans={"func": self._tok(func)})

    def neg(self, meta, children):
        return s.Neg(children[0], span=self._span(meta))

    def _binop(op):  # noqa: N805 - a small factory for the five binary rules
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
