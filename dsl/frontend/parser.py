"""Parse dhelix text into a :class:`~dhelix.dsl.core.syntax.Module`.

The grammar (``grammar/dhelix.lark``) is loaded once, lazily, with lark's LALR parser in
strict mode. Lark's exceptions are translated into :class:`ParseError` in the user's words
(``expected '}' or a setting``) and raised ``from None``; a :class:`Transformer` with one
small method per rule builds the frozen syntax nodes.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

import lark
from lark import Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import BIDI_CONTROLS, ParseError, visible
from dhelix.dsl.core.span import Source, Span
from dhelix.dsl.core.wording import did_you_mean, join_words
from dhelix.dsl.frontend import grammar_cache

ACTIONS = ("F", "B", "W")

#: How deeply expressions and repeat blocks may nest: parentheses on the right of an
#: operator, unary minus, min/max calls and repeat blocks each add a level; a flat chain
#: ``1 + 1 + … + 1`` is one level however long. Deeper text is a located ParseError.
MAX_NESTING = 100
#: The most digits a number may have (every size is far smaller; Python refuses to convert
#: numbers of over 4300 digits, and long ones make arithmetic slow).
MAX_DIGITS = 30

#: Start rules: `start` for files; the others let tests and tools parse fragments.
START_RULES = ("start", "expr", "layer_def", "pipeline_def", "strands_def", "partition_def")

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
    cache = grammar_cache.usable_file(f"lark{lark.__version__}")
    parser = lark.Lark(grammar_text(), parser="lalr", strict=True, propagate_positions=True,
                       maybe_placeholders=False, start=list(START_RULES), cache=cache or False)
    if cache is not None:
        grammar_cache.seal(cache)
    return parser


def parse(text: str, path: str = "<string>", start: str = "start"):
    """Parse ``text`` (shown as ``path`` in messages) from rule ``start``.

    Returns a :class:`syntax.Module` for ``start``, else the node of the fragment.
    Raises :class:`ParseError` located at the offending character or token.
    """
    source = Source(path, text)
    _refuse_bidi_controls(source)
    # A byte-order mark (kept by a reader that did not drop it) is whitespace to the parser;
    # a space in its place keeps every column.
    text = " " + text[1:] if text.startswith("\ufeff") else text
    try:
        tree = _lark().parse(text, start=start)
    except UnexpectedInput as exc:
        raise _translate(exc, source) from None
    try:
        return _Builder(source).build(tree)
    except VisitError as exc:  # lark wraps what a builder method raises
        if isinstance(exc.orig_exc, ParseError):
            raise exc.orig_exc from None
        raise


_BIDI = re.compile("[" + "".join(sorted(BIDI_CONTROLS)) + "]")


def _refuse_bidi_controls(source: Source) -> None:
    """A bidirectional control character makes an editor show text in another order than
    the parser reads it ("Trojan Source", CVE-2021-42574): refused wherever it is."""
    found = _BIDI.search(source.text)
    if found:
        raise ParseError(f"bidirectional control character {visible(found.group())} in the text",
                         _offset_span(source, found.start()),
                         ["it makes editors show the text in another order than dhelix reads it; "
                          "remove it (dhelix refuses it even in comments and strings)"])


def _describe(terminal: str) -> str:
    if terminal in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[terminal]
    for term in _lark().terminals:
        if term.name == terminal and term.pattern.type == "str":
            return f"'{term.pattern.value}'"
    return terminal.lower()


# Terminal groups that read better as one word: `expected an expression` rather than
# `expected a name, a number, '(' or '-'`.
_OPERATORS = {"PLUS": "+", "MINUS": "-", "STAR": "*", "SLASH": "/", "__ANON_0": "//", "PERCENT": "%"}
_VALUE_START = {"NAME", "INT", "LPAR", "MINUS"}
_STATEMENTS = ("IMPORT", "MODEL", "CLUSTER", "MESH", "TRAIN", "FOLD", "PIPELINE", "LAYER", "STRANDS",
               "PARTITION")
_CLOSERS = {"{": "}", "(": ")", "[": "]"}
_CLOSER_TERMINALS = {"{": "RBRACE", "(": "RPAR", "[": "RSQB"}


def _expected(names) -> str:
    """The terminals a parser state accepts, in the user's words: ``an expression or '}'``."""
    names = set(names)
    groups = []
    if set(_STATEMENTS) <= names:
        groups.append("a statement (" + ", ".join(t.lower() for t in _STATEMENTS) + ")")
        names -= set(_STATEMENTS)
    if _VALUE_START <= names:
        groups.append("an expression")
        names -= _VALUE_START
    operators = [symbol for name, symbol in _OPERATORS.items() if name in names]
    words = sorted({_describe(n) for n in names - set(_OPERATORS) if not n.startswith("_")},
                   key=lambda w: (not w[0].isalpha(), w))  # words before punctuation
    words = groups + words
    if len(operators) > 1:
        words.append(f"an operator ({' '.join(operators)})")
    elif operators:
        words.append(f"'{operators[0]}'")
    return join_words(words, "or")


def _translate(exc: UnexpectedInput, source: Source) -> ParseError:
    if isinstance(exc, UnexpectedCharacters):
        return _bad_character(exc, source)
    if isinstance(exc, UnexpectedEOF) or (isinstance(exc, UnexpectedToken) and exc.token.type == "$END"):
        return _early_end(exc, source)
    if isinstance(exc, UnexpectedToken):
        return _missing_brace(source, exc.token) or _bad_token(exc, source)
    line, column = max(exc.line, 1), max(exc.column, 1)
    return ParseError("syntax error", Span(source, line, column, line, column + 1))


def _bad_character(exc: UnexpectedCharacters, source: Source) -> ParseError:
    line, column = max(exc.line, 1), max(exc.column, 1)
    text = source.text
    pos = exc.pos_in_stream if exc.pos_in_stream is not None else len(text)  # None: no offset known
    char = text[pos] if pos < len(text) else "?"
    span = Span(source, line, column, line, column + 1)
    # The lexer's allowed set can be a union over parser states: only show a short one.
    allowed = exc.allowed or set()
    notes = [f"expected {_expected(allowed)} here"] if 0 < len(allowed) <= 4 else []
    notes += _character_hints(char, text, pos)
    return ParseError(f"unexpected character {char!r}", span, notes)


def _character_hints(char: str, text: str, pos: int) -> list[str]:
    line_end = text.find("\n", pos)
    rest = text[pos + 1:line_end if line_end >= 0 else len(text)]
    if char == "'":
        inner = rest.split("'")[0] if "'" in rest else "a40"
        return [f'strings use double quotes: "{inner}"']
    if char == '"':
        return ["this string is not closed: a string ends with '\"' on the same line"]
    hints = {
        ";": "dhelix statements need no ';' — put the next one on its own line",
        ":": "write `name = value`, not `name: value`",
        "×": "multiply with '*'",
        "÷": "divide with '/' (exact) or '//' (rounding down)",
        "−": "subtract with '-'",
        "–": "subtract with '-'",
    }
    return [hints[char]] if char in hints else []


def _early_end(exc: UnexpectedInput, source: Source) -> ParseError:
    """The file ends inside a statement: point at the bracket left open, if that is why."""
    expected = set(getattr(exc, "accepts", None) or getattr(exc, "expected", None) or ())
    opened = _open_brackets(source.text, len(source.text))
    if opened and _CLOSER_TERMINALS[opened[-1][0]] in expected:
        char, offset = opened[-1]
        return ParseError(f"unexpected end of file: this '{char}' is never closed", _offset_span(source, offset),
                          [f"add the missing '{_CLOSERS[char]}' where the {_bracket_kind(char)} ends"])
    lines = source.text.rstrip().splitlines() or [""]
    line, column = len(lines), max(1, len(lines[-1]))
    notes = [f"expected {_expected(expected)}"] if expected else []
    return ParseError("unexpected end of file", Span(source, line, column, line, column + 1), notes)


def _bracket_kind(char: str) -> str:
    return {"{": "block", "(": "argument list", "[": "shape or chunk index"}[char]


def _missing_brace(source: Source, token: Token) -> ParseError | None:
    """A statement keyword starting a line while a '{' of an earlier line is still open:
    the block before it lacks its '}' (lark only notices a token or two later)."""
    text = source.text
    start = token.start_pos or 0  # a lexed token always has its offset
    opened = _open_brackets(text, start)
    line_start = text.rfind("\n", 0, start) + 1
    if not opened or opened[-1][0] != "{" or opened[-1][1] >= line_start:
        return None
    match = re.match(r"[ \t]*([A-Za-z_]\w*)[ \t]*(=?)", text[line_start:])
    if match is None or match.group(1).upper() not in _STATEMENTS or match.group(2):
        return None
    word = match.group(1)
    span = _offset_span(source, line_start + match.start(1), len(word))
    return ParseError(f"missing '}}' before '{word}'", span,
                      [f"the '{{' at {_offset_span(source, opened[-1][1])} is never closed"])


def _bad_token(exc: UnexpectedToken, source: Source) -> ParseError:
    token = exc.token
    line, column = max(exc.line, 1), max(exc.column, 1)
    end_column = getattr(token, "end_column", None) or column + len(str(token))
    span = Span(source, line, column, line, end_column)
    expected = set(exc.accepts or exc.expected or ())
    notes = [f"expected {_expected(expected)}"] + _token_hints(token, expected, source)
    return ParseError(f"unexpected {_describe_token(token)}", span, notes)


def _describe_token(token: Token) -> str:
    if token.type in ("NAME", "INT", "STRING"):
        return f"{_TERMINAL_WORDS[token.type].split(' (')[0].removeprefix('a ')} {str(token)!r}"
    return repr(str(token))


def _token_hints(token: Token, expected: set[str], source: Source) -> list[str]:
    text, before = str(token), source.text[:token.start_pos].rstrip()
    keywords = [word.strip("'") for word in map(_describe, expected) if word.strip("'").isalpha()]
    hints = did_you_mean(text, keywords) if token.type == "NAME" else []
    opened = _open_brackets(source.text, token.start_pos or 0)
    if opened and opened[-1][0] in "([" and _CLOSER_TERMINALS[opened[-1][0]] in expected:
        hints.append(f"the '{opened[-1][0]}' at {_offset_span(source, opened[-1][1])} is still open")
    if text == "}" and not opened:
        hints.append("no '{' is open here: is this '}' one too many?")
    if expected == {"EQUAL"} and (previous := re.search(r"[A-Za-z_]\w*$", before)):
        hints.append(_name_hint(previous.group()))
    conditions = {
        "a name starts with a letter or '_'": token.type == "INT" and "NAME" in expected,
        "no ',' is needed between settings or statements": text == "," and "COMMA" not in expected,
        "compare with '=='": text == "=" and "COMPARE" in expected,
        "numbers are whole: dhelix has no decimals": text == "." and before[-1:].isdigit(),
        "there is no power operator '**'; write the number out": text == "*" and before.endswith("*"),
        "a shape has two dimensions: [tokens, features]": text == "]" and expected == {"COMMA"},
        "chunk indices follow an action: F[1]; shapes follow an input: in x [seq, hidden]": text == "[",
    }
    return hints + [hint for hint, applies in conditions.items() if applies]


def _name_hint(word: str) -> str:
    return f"'{word}' starts a definition `{word} = …` here"


def _open_brackets(text: str, end: int) -> list[tuple[str, int]]:
    """The brackets opened before offset ``end`` and not yet closed, outermost first, as
    (bracket, offset); brackets in comments and strings do not count."""
    stack: list[tuple[str, int]] = []
    for match in re.finditer(r'#[^\n]*|"[^"\n]*"?|[{}()\[\]]', text[:end]):
        char = match.group()
        if char in _CLOSERS:
            stack.append((char, match.start()))
        elif char in "})]":
            # Close the innermost matching bracket; an unmatched closer changes nothing.
            for index in range(len(stack) - 1, -1, -1):
                if _CLOSERS[stack[index][0]] == char:
                    del stack[index:]
                    break
    return stack


def _offset_span(source: Source, offset: int, length: int = 1) -> Span:
    line = source.text.count("\n", 0, offset) + 1
    column = offset - (source.text.rfind("\n", 0, offset) + 1) + 1
    return Span(source, line, column, line, column + length)


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
