"""The located reading of a hardware profile's YAML (:mod:`.profiles` holds the schema).

:class:`ProfileReader` composes the text with PyYAML's safe loader (refusing anchors, aliases
and nesting past :data:`MAX_YAML_DEPTH` first) and walks the node tree: each scalar checked
as the schema asks (a number within its bounds, a whole number, a string, a choice, a list),
each mistake a :class:`ProfileError` at its line and column, collected so that one reading
reports them all.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import yaml

from dhelix.dsl.core.errors import DhelixError, ErrorCollector, visible
from dhelix.dsl.core.span import Source, Span
from dhelix.dsl.core.wording import did_you_mean

#: How deeply a profile's YAML may nest (the schema needs 4 levels).
MAX_YAML_DEPTH = 16
#: Every number of a profile other than an OEF is 0 or within [MIN_MAGNITUDE, MAX_MAGNITUDE]
#: in its unit (TFLOP/s, GB/s, µs, fractions): outside it a cost would underflow to 0 or
#: overflow to inf, and no hardware is that fast or slow.
MIN_MAGNITUDE, MAX_MAGNITUDE = 1e-6, 1e9
#: The range of an OEF (the paper's Eq. 1): 0 is no overlap, 1 hides the shorter op.
OEF_LOW, OEF_HIGH = -1.0, 2.0


class ProfileError(DhelixError):
    """A hardware profile that cannot be read, or one that does not follow the schema."""


class ProfileReader:
    """Walks a composed YAML node tree, converting scalars and recording located errors."""

    def __init__(self, source: Source):
        self.source = source
        self.errors = ErrorCollector()
        self._loader: Any = None  # a yaml.SafeLoader (untyped), made by compose, once the text is known to be safe to compose
        self.key_nodes: dict[int, yaml.Node] = {}  # id(value node) -> its key node

    def compose(self):
        """The root node of the text; a located ProfileError for a YAML syntax error, a
        character YAML does not allow, nesting past :data:`MAX_YAML_DEPTH` or an alias."""
        try:
            self._check_structure()
            self._loader = yaml.SafeLoader(self.source.text)
            node = self._loader.get_single_node()
        except yaml.reader.ReaderError as exc:  # a character YAML does not allow: no mark
            char = visible(chr(exc.character)) if isinstance(exc.character, int) else "?"
            raise ProfileError(f"character '{char}' is not allowed in YAML", self._position_span(exc.position),
                               ["YAML allows tabs, newlines and printable characters, even in comments"]) from None
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            span = Span(self.source, mark.line + 1, mark.column + 1, mark.line + 1, mark.column + 2)
            notes = [f"{exc.context}" + (f" (line {exc.context_mark.line + 1})" if exc.context_mark else "")] \
                if exc.context else []
            raise ProfileError(f"YAML syntax error: {exc.problem}", span, notes) from None
        finally:
            if self._loader is not None:
                self._loader.dispose()
        if node is None:
            raise ProfileError("the profile is empty", Span(self.source, 1, 1, 1, 2),
                               ["a profile is a YAML mapping; see the shipped stdlib/h100.yaml"])
        return node

    def _check_structure(self) -> None:
        """Refuse, before composing, what would make composing slow or deep: the composer
        recurses once per nesting level, and an alias repeats a whole subtree (a small file
        of aliases of aliases expands without bound)."""
        depth = 0
        for event in yaml.parse(self.source.text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise ProfileError("YAML anchors and aliases are not allowed in a profile", self._mark_span(event),
                                   ["write the values out: a profile is read by people, and aliases "
                                    "can make a small file expand without bound"])
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise ProfileError(f"nested more than {MAX_YAML_DEPTH} levels deep", self._mark_span(event),
                                       ["a profile's deepest part (measured.pairs) is 4 levels deep"])
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1

    def _mark_span(self, event) -> Span:
        mark = event.start_mark
        return Span(self.source, mark.line + 1, mark.column + 1, mark.line + 1, mark.column + 2)

    def _position_span(self, position: int) -> Span:
        text = self.source.text
        line = text.count("\n", 0, position) + 1
        column = position - (text.rfind("\n", 0, position) + 1) + 1
        return Span(self.source, line, column, line, column + 1)

    def span(self, node) -> Span:
        """The 1-based span of ``node`` (its first line only, for a block collection)."""
        start, end = node.start_mark, node.end_mark
        if end.line != start.line:  # a block collection ends on a later line: underline its first line
            return Span(self.source, start.line + 1, start.column + 1, start.line + 1,
                        len(self.source.line(start.line + 1)) + 1)
        return Span(self.source, start.line + 1, start.column + 1, end.line + 1, end.column + 1)

    def error(self, node, message: str, notes: Sequence[str] = ()) -> None:
        """Record a ProfileError located at ``node``."""
        self.errors.add(ProfileError(message, self.span(node), notes))

    def _what(self, node) -> str:
        if isinstance(node, yaml.MappingNode):
            return "a mapping"
        if isinstance(node, yaml.SequenceNode):
            return "a list"
        kind = node.tag.rsplit(":", 1)[-1]
        names = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "null": "null"}
        return f"{names.get(kind, kind)} '{node.value}'" if kind != "null" else "nothing (null)"

    def mapping(self, node, where: str, allowed: Sequence[str] | None, required: Sequence[str]) -> dict | None:
        """The key -> value-node dict of a mapping's well-formed keys (errors are recorded for
        the others and for missing ``required`` keys); None if ``node`` is not a mapping."""
        label = where or "the profile"
        if node is None:
            return None
        if not isinstance(node, yaml.MappingNode):
            self.error(node, f"{label} must be a mapping, got {self._what(node)}")
            return None
        out = {}
        for key_node, value in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None:
                self.error(key_node, f"keys of {label} must be plain names")
            elif key in out:
                self.error(key_node, f"'{key}' is set twice in {label}")
            elif allowed is not None and key not in allowed:
                self.error(key_node, f"unknown key '{key}' in {label}",
                           did_you_mean(key, allowed) + [f"keys here: {', '.join(allowed)}"])
            else:
                out[key] = value
                self.key_nodes[id(value)] = key_node
        missing = [key for key in required if key not in out]
        if missing:
            self.error(node, f"{label} is missing {', '.join(repr(k) for k in missing)}")
        # Keep going with the keys that are fine, so one run reports every mistake.
        return out

    def number(self, node, where: str, positive=False, nonneg=False, high=None, oef=False) -> float | None:
        """A real number within the given bounds, else None with a located error."""
        if node is None:
            return None
        if not isinstance(node, yaml.ScalarNode) or node.tag.rsplit(":", 1)[-1] not in ("int", "float"):
            self.error(node, f"'{where}' must be a number, got {self._what(node)}")
            return None
        try:
            value = float(self._loader.construct_object(node))
        except OverflowError:  # an integer of hundreds of digits
            value = math.inf
        if oef and not OEF_LOW <= value <= OEF_HIGH:
            self.error(node, f"OEF {node.value} of '{where}' is outside [-1, 2]",
                       ["OEF = (T_i + T_j - P) / min(T_i, T_j): 0 is no overlap, 1 hides the shorter op",
                        "measured values beyond the range are noise: clamp them and say so in a comment"])
            return None
        if not math.isfinite(value):
            self.error(node, f"'{where}' must be a finite number, got {_short(node.value)}")
            return None
        if (positive and value <= 0) or (nonneg and value < 0):
            bound = "positive" if positive else "zero or positive"
            self.error(node, f"'{where}' must be {bound}, got {node.value}")
            return None
        if high is not None and value > high:
            self.error(node, f"'{where}' must be at most {high:g}, got {node.value}")
            return None
        if not oef and value != 0 and not MIN_MAGNITUDE <= abs(value) <= MAX_MAGNITUDE:
            self.error(node, f"'{where}' must be {'' if positive else '0 or '}between {MIN_MAGNITUDE:g} and {MAX_MAGNITUDE:g}, "
                       f"got {_short(node.value)}", ["a profile's numbers are in TFLOP/s, GB/s, µs or fractions"])
            return None
        return value

    def number_map(self, node, where: str, allowed, required, **bounds) -> dict | None:
        """A mapping of names to numbers (see :meth:`number` for the bounds)."""
        entries = self.mapping(node, where, allowed, required)
        if entries is None:
            return None
        out = {key: self.number(value, f"{where}.{key}", **bounds) for key, value in entries.items()}
        # A required key left out (or misspelt) has its error from mapping().
        return None if None in out.values() or any(key not in out for key in required) else out

    def integer(self, node, where: str) -> int | None:
        """A positive integer, else None with a located error."""
        if node is None:
            return None
        if not isinstance(node, yaml.ScalarNode) or node.tag.rsplit(":", 1)[-1] != "int":
            self.error(node, f"'{where}' must be a whole number, got {self._what(node)}")
            return None
        value = int(self._loader.construct_object(node))
        if not 1 <= value <= MAX_MAGNITUDE:
            bound = "at least 1" if value < 1 else f"at most {MAX_MAGNITUDE:.0f}"
            self.error(node, f"'{where}' must be {bound}, got {_short(node.value)}")
            return None
        return value

    def string(self, node, where: str) -> str | None:
        """A string scalar, else None with a located error (None for a missing node)."""
        if node is None:
            return None
        if not isinstance(node, yaml.ScalarNode) or node.tag.rsplit(":", 1)[-1] != "str":
            self.error(node, f"'{where}' must be a string, got {self._what(node)}")
            return None
        return node.value

    def choice(self, node, where: str, choices: Sequence[str]) -> str | None:
        """One of ``choices``, else None with a located error and a "did you mean"."""
        value = self.string(node, where)
        if value is not None and value not in choices:
            self.error(node, f"'{where}' must be one of {', '.join(choices)}, got '{value}'",
                       did_you_mean(value, choices))
            return None
        return value

    def sequence(self, node, where: str) -> list:
        """The items of a YAML list, else [] with a located error."""
        if not isinstance(node, yaml.SequenceNode):
            self.error(node, f"'{where}' must be a list, got {self._what(node)}")
            return []
        return list(node.value)

    def string_list(self, node, where: str) -> tuple[str, ...] | None:
        """A list of strings (op names), else None with a located error."""
        if node is None:
            return None
        if not isinstance(node, yaml.SequenceNode):
            self.error(node, f"'{where}' must be a list of op names, got {self._what(node)}")
            return None
        names = [self.string(item, where) for item in node.value]
        return tuple(name for name in names if name is not None) if None not in names else None


def _short(text: str) -> str:
    """A scalar as messages quote it: a 400-digit number is cut to its first digits."""
    return text if len(text) <= 24 else f"{text[:12]}… ({len(text)} characters)"
