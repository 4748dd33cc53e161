"""The one error hierarchy of dhelix.

Every user mistake is a :class:`DhelixError` carrying a span (or, at run time, a rank and an
action); it renders as ``file:line:col: message``, the source line, a caret underline and
notes. Validators collect many errors and raise one :class:`ErrorGroup`.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from dhelix.dsl.core.span import Span


class DhelixError(Exception):
    """A user-facing error: a message, an optional span and notes saying what to do."""

    def __init__(self, message: str, span: Span | None = None, notes: Sequence[str] = ()):
        super().__init__(message)
        self.message = message
        self.span = span
        self.notes = tuple(notes)

    def render(self) -> str:
        """The message as the CLI prints it, with the source line and a caret underline."""
        head = f"{self.span}: {self.message}" if self.span else f"error: {self.message}"
        lines = [_printable(head)]
        if self.span is not None:
            lines.extend(_excerpt(self.span))
        lines.extend(_printable(f"  note: {note}") for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def add_note(self, note: str) -> None:
        """Append ``note`` to the notes the error renders with (callers add context, e.g. the
        command line says which command was running)."""
        self.notes = self.notes + (note,)


class ParseError(DhelixError):
    """The text is not in the language (unexpected character or token, missing brace)."""


class CheckError(DhelixError):
    """The program parses but is wrong: unknown names, cycles, shapes, sizes."""


class ImportFailure(DhelixError):
    """An import that cannot be read or that closes a cycle."""


class ScheduleError(DhelixError):
    """A pipeline schedule that cannot run; ``grid`` shows the ranks × steps with the failure."""

    def __init__(self, message: str, span: Span | None = None, notes: Sequence[str] = (),
                 grid: str = ""):
        super().__init__(message, span, notes)
        self.grid = grid

    def render(self) -> str:
        text = super().render()
        return f"{text}\n{self.grid}" if self.grid else text


class UsageError(DhelixError):
    """A wrong command line (exit code 2), as opposed to a wrong program (exit code 1)."""


class OutputError(DhelixError):
    """An output that could not be written although its place was probed before the run (a
    disk that filled up, a place made read-only meanwhile): the message names the path and the
    system's reason, the notes what was removed and what was kept. Exit code 1: the command
    line was right."""


class DhelixWarning(DhelixError):
    """A located warning: something that runs but likely not as meant (a prediction that
    does not fit the device). Rendered like an error with ``warning:`` before the message;
    a command may print it and go on, or raise it as an error when asked to be strict."""

    def render(self) -> str:
        text = DhelixError(f"warning: {self.message}", self.span, self.notes).render()
        return text.replace("error: warning:", "warning:", 1)


class ErrorGroup(DhelixError):
    """Several errors found by one validator, sorted by position and rendered one after another."""

    def __init__(self, errors: Iterable[DhelixError]):
        self.errors = sorted(errors, key=_position)
        count = len(self.errors)
        super().__init__(f"{count} error{'s' if count != 1 else ''}")

    def render(self) -> str:
        body = "\n".join(error.render() for error in self.errors)
        return f"{body}\n{self.message}" if len(self.errors) > 1 else body

    def add_note(self, note: str) -> None:
        # A group renders its members, not its own notes: the last member carries the note.
        self.errors[-1].add_note(note)


def first_message(error: DhelixError) -> str:
    """The message of ``error``, or of the first member of an :class:`ErrorGroup` (a one-line
    reason, where a candidate a planner tried was refused)."""
    return error.errors[0].message if isinstance(error, ErrorGroup) and error.errors else error.message


#: The most errors one check reports: past it they are counted, not kept, so a file with an
#: error on each of its 100,000 lines is checked in linear time and a readable report.
MAX_REPORTED = 100


class ErrorCollector:
    """Gathers errors during a check so that all of them are reported at once (the first
    :data:`MAX_REPORTED`; the rest are counted)."""

    def __init__(self) -> None:
        self.errors: list[DhelixError] = []
        self.dropped = 0

    @property
    def full(self) -> bool:
        """Whether further errors are only counted: callers may skip wording them (a
        did-you-mean over every name of a long file, once per error, is quadratic)."""
        return len(self.errors) >= MAX_REPORTED

    def add(self, error: DhelixError) -> None:
        """Record ``error`` (an ErrorGroup is flattened)."""
        for one in error.errors if isinstance(error, ErrorGroup) else (error,):
            if self.full:
                self.dropped += 1
            else:
                self.errors.append(one)

    def raise_if_any(self) -> None:
        """Raise the one error, or an ErrorGroup of all of them, if any were recorded."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            group = ErrorGroup(self.errors)
            if self.dropped:
                group.add_note(f"{self.dropped} more error{'s' * (self.dropped != 1)} not shown: "
                               f"dhelix reports the first {MAX_REPORTED}")
            raise group


def _position(error: DhelixError) -> tuple:
    span = error.span
    if span is None:
        return ("", 0, 0)
    return (span.source.path, span.line, span.column)


#: The most characters of a source line an excerpt shows; a longer line is cut around the caret.
EXCERPT_WIDTH = 120


def _excerpt(span: Span) -> list[str]:
    text = span.source.line(span.line)
    if not text:
        return []
    width = len(str(span.line))
    start = min(span.column, len(text) + 1)
    end = span.end_column if span.end_line == span.line else len(text) + 1
    end = max(start + 1, min(end, len(text) + 1))
    shown = [visible(char) for char in text]
    # Columns count characters; an escaped control character takes several.
    before, under = sum(map(len, shown[:start - 1])), max(1, sum(map(len, shown[start - 1:end - 1])))
    line = "".join(shown)
    left = max(0, min(before - EXCERPT_WIDTH // 3, len(line) - EXCERPT_WIDTH))
    right = left + EXCERPT_WIDTH
    cut_left, cut_right = ("…" if left > 0 else ""), ("…" if right < len(line) else "")
    line = cut_left + line[left:right] + cut_right
    caret_at = before - left + len(cut_left)
    carets = "^" * max(1, min(under, len(line) - caret_at))
    gutter = " " * width
    return [f"  {span.line} | {line}", f"  {gutter} | {' ' * caret_at}{carets}"]


#: Characters that reorder how a line is displayed (CVE-2021-42574, "Trojan Source").
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c")


def _printable(text: str) -> str:
    # Messages quote the user's strings and paths: escape what could drive the terminal.
    return "".join(char if char == "\n" else visible(char) for char in text)


def visible(char: str) -> str:
    """``char`` as a message shows it: control and bidirectional-override characters as
    escapes (``\\x1b``), so echoing a source line cannot drive the terminal."""
    code = ord(char)
    if char == "\t" or (32 <= code < 127) or (code > 159 and char not in BIDI_CONTROLS and char != "\ufeff"):
        return char
    return f"\\x{code:02x}" if code < 256 else f"\\u{code:04x}"
