"""Lark's parse errors in the user's words: :func:`translate` turns an unexpected character,
token or end of file into a located :class:`~dhelix.dsl.core.errors.ParseError` (``expected
'}' or a setting``, with hints: the bracket still open, a misspelt keyword);
:func:`refuse_bidi_controls` refuses the text an editor would show in another order.
"""

from __future__ import annotations

import re

from lark import Token
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from dhelix.dsl.core.errors import BIDI_CONTROLS, ParseError, visible
from dhelix.dsl.core.span import Source, Span
from dhelix.dsl.core.wording import did_you_mean, join_words
from dhelix.dsl.frontend.grammar import lark_parser

_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "a number",
    "STRING": 'a string ("...")',
    "COMPARE": "a comparison (>=, <=, ==, !=, >, <)",
    "$END": "the end of the file",
}


_BIDI = re.compile("[" + "".join(sorted(BIDI_CONTROLS)) + "]")


def refuse_bidi_controls(source: Source) -> None:
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
    for term in lark_parser().terminals:
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


def translate(exc: UnexpectedInput, source: Source) -> ParseError:
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
