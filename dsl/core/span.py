"""Source files and spans: where a piece of dhelix text came from.

A span never takes part in IR equality (every IR field holding one is declared with
``eq=False``), so ``parse("m = 1+2") == parse("m  =  1 + 2")``.
"""

from __future__ import annotations

import functools

import attrs


@attrs.frozen(eq=False)
class Source:
    """The text of one file and the name it is shown under in messages."""

    path: str
    text: str

    def line(self, number: int) -> str:
        """Return line ``number`` (1-based) without its newline, or '' past the end."""
        lines = self._lines
        return lines[number - 1].removesuffix("\r") if 0 < number <= len(lines) else ""

    @functools.cached_property
    def _lines(self) -> list[str]:
        # Split once per file, not once per error: a file with many errors stays linear.
        # Only '\n' ends a line, as for the parser's line numbers (splitlines would also
        # split at '\x0c', '\x1c' or U+2028 and shift every later line).
        return self.text.split("\n")


@attrs.frozen(eq=False)
class Span:
    """A range of a source: 1-based line and column of the first and last character."""

    source: Source
    line: int
    column: int
    end_line: int
    end_column: int

    @classmethod
    def from_meta(cls, source: Source, meta) -> "Span":
        """Build a span from a lark ``Meta`` or ``Token`` (anything with line/column)."""
        return cls(source, meta.line, meta.column, meta.end_line, meta.end_column)

    def merge(self, other: "Span") -> "Span":
        """The smallest span covering ``self`` and ``other`` (same source assumed)."""
        start = min((self.line, self.column), (other.line, other.column))
        end = max((self.end_line, self.end_column), (other.end_line, other.end_column))
        return Span(self.source, start[0], start[1], end[0], end[1])

    def __str__(self) -> str:
        return f"{self.source.path}:{self.line}:{self.column}"


def span_field():
    """An attrs field for a node's span: keyword-only, optional, excluded from equality."""
    return attrs.field(default=None, kw_only=True, eq=False, repr=False)


def spans_field():
    """An attrs field mapping a node's field names to the spans of their tokens."""
    return attrs.field(factory=dict, kw_only=True, eq=False, repr=False)
