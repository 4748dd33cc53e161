"""The canonical printer behind ``dhelix fmt``.

Canonical form:

* two-space indentation; a block's header and ``{`` on one line, its closing ``}`` on a
  line of its own; an empty block prints as ``strands {}``;
* one setting or statement per line: ``key = value``, ``repeat n {``,
  ``require m >= p``, ``F``, ``F[1]``, ``SI(F[1], B)``, ``in x [seq / tp, hidden]``,
  ``y = gemm(x, hidden, n = 2 * hidden)``, ``out y``, ``overlap tp, cp``,
  ``comm_with_comm on``, ``movable wgrad, attention.bwd``, ``forbid a.b with c``,
  ``chunk ag1 + qkv by 2``, ``chunk ag2 along features by 2``,
  ``substitute ar as reduce_scatter + all_gather``, ``group ag1 + rs1``;
* except that a ``repeat`` of actions only stays on one line, as the paper draws schedules:
  ``repeat m - warm { F B }``, ``repeat n { SI(F[1], B) W }`` (unless a comment needs a line
  inside it; a comment after it stays after it);
* expressions as :func:`~dhelix.dsl.frontend.exprs.format_expr` prints them (minimal parentheses),
  strings in double quotes, ``fold loop(2)``;
* one blank line between top-level items, except that consecutive imports, and consecutive
  ``fold`` / ``pipeline NAME`` lines, stay together; no other blank lines, except one where
  the source has one after an own-line comment that another comment or a statement follows
  (a file header, a commented section);
* the file ends with one newline (an empty file stays empty).

Comments are never lost. A comment is ``#`` to the end of the line, outside a string. Each is
attached to a statement (a top-level item, a setting, a pipeline/layer/strands statement)
by its position in the source:

1. *trailing*: the statement that ends last on the comment's line keeps it at the end of its
   own last line, after two spaces (for a block that is the ``}`` line), except that a
   non-empty block written on one line (``mesh { tp = 8  pp = 2 }  # note``) keeps it after
   its ``{``, since it describes the whole block;
2. *leading*: a comment inside a one-line statement written over several lines goes above it;
3. *header*: otherwise a block that starts on the comment's line keeps it after its ``{``
   (the innermost such block);
4. *leading*: any other comment goes above the next statement, or, when the block ends first,
   above that block's closing ``}`` (at the block's inner indentation);
5. comments after the last item go at the end of the file, after a blank line.

So comments keep their order and ``fmt`` is idempotent with them.
"""

from __future__ import annotations

from typing import Callable

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.span import Span
from dhelix.dsl.frontend.exprs import format_expr
from dhelix.dsl.frontend.parser import parse

INDENT = "  "


@attrs.frozen
class Comment:
    """One ``#`` comment: 1-based line and column of its ``#``, its text from the ``#``, and
    whether a blank line follows it in the source (kept between comments of one group)."""

    line: int
    column: int
    text: str
    blank_after: bool = False


def find_comments(text: str) -> list[Comment]:
    """The comments of ``text`` in source order, trailing whitespace stripped.

    Assumes the grammar's lexing: strings are ``"..."`` on one line, ``#`` outside a string
    starts a comment. Lines are counted at ``\\n`` only, as lark counts them.
    """
    comments = []
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        in_string = False
        for index, char in enumerate(line):
            if char == '"':
                in_string = not in_string
            elif char == "#" and not in_string:
                blank_after = number < len(lines) and not lines[number].strip()
                comments.append(Comment(number, index + 1, line[index:].rstrip(), blank_after))
                break
    return comments


# --- how each statement prints ---------------------------------------------------------------

def _value(value) -> str:
    return f'"{value.value}"' if isinstance(value, s.Str) else format_expr(value)


def _act(act: s.Act) -> str:
    if act.microbatch is not None:
        assert act.chunk is not None, "the parser gives a chunk whenever there is a micro-batch"
        return f"{act.kind}[{format_expr(act.chunk)}, {format_expr(act.microbatch)}]"
    return act.kind if act.chunk is None else f"{act.kind}[{format_expr(act.chunk)}]"


def _arg(arg: s.Arg) -> str:
    return format_expr(arg.value) if arg.key is None else f"{arg.key} = {format_expr(arg.value)}"


def _layer_in(node: s.LayerIn) -> str:
    if node.shape is None:
        return f"in {node.name}"
    return f"in {node.name} [{format_expr(node.shape[0])}, {format_expr(node.shape[1])}]"


def _count(expr) -> str:
    # A chunk count that is not a number or a name is parenthesised (the grammar's rule).
    text = format_expr(expr)
    return text if isinstance(expr, (s.Int, s.Name)) else f"({text})"


#: One-line statements: node type -> its text.
_LEAVES: dict[type, Callable[..., str]] = {
    s.Import: lambda n: f'import "{n.path}"',
    s.Setting: lambda n: f"{n.key} = {_value(n.value)}",
    s.Fold: lambda n: f"fold {n.kind}" + ("" if n.arg is None else f"({format_expr(n.arg)})"),
    s.PipelineRef: lambda n: f"pipeline {n.name}",
    s.Let: lambda n: f"{n.name} = {format_expr(n.value)}",
    s.Require: lambda n: f"require {format_expr(n.left)} {n.op} {format_expr(n.right)}",
    s.Act: _act,
    s.SIBlock: lambda n: f"SI({_act(n.fwd)}, {_act(n.bwd)})",
    s.LayerIn: _layer_in,
    s.LayerOut: lambda n: f"out {n.name}",
    s.OpApply: lambda n: f"{n.name} = {n.op}({', '.join(_arg(a) for a in n.args)})",
    s.Overlap: lambda n: "overlap " + ", ".join(n.kinds),
    s.CommWithComm: lambda n: f"comm_with_comm {n.value}",
    s.Movable: lambda n: "movable " + ", ".join(str(sel) for sel in n.selectors),
    s.Forbid: lambda n: f"forbid {n.first} with {n.second}",
    s.Chunk: lambda n: f"chunk {' + '.join(n.ops)}" + (f" along {n.dim}" if n.dim else "")
    + f" by {_count(n.parts)}",
    s.Substitute: lambda n: f"substitute {n.op} as {' + '.join(n.into)}",
    s.Move: lambda n: f"move {' + '.join(n.ops)} later",
    s.Backward: lambda n: f"backward {n.first} first",
    s.Group: lambda n: f"group {' + '.join(n.ops)}" + (f" first {n.first}" if n.first else ""),
}

#: Blocks: node type -> (header before ``{``, statements inside).
_BLOCKS: dict[type, Callable[..., tuple[str, tuple]]] = {
    s.ModelDef: lambda n: (f"model {n.name}", n.settings),
    s.ConfigBlock: lambda n: (n.kind, n.settings),
    s.Levels: lambda n: ("levels", n.settings),
    s.PipelineDef: lambda n: (f"pipeline {n.name}" + (f" for {n.fold}" if n.fold else ""), n.body),
    s.Repeat: lambda n: (f"repeat {format_expr(n.count)}", n.body),
    s.LayerDef: lambda n: (f"layer {n.name}", n.body),
    s.StrandsDef: lambda n: ("strands", n.body),
    s.PartitionDef: lambda n: ("partition", n.body),
}

def format_statement(node: s.Node) -> str:
    """The canonical one-line text of a statement node (a setting, ``chunk a + b by 2``…)."""
    return _LEAVES[type(node)](node)


# Top-level one-liners of the same group print without a blank line between them.
_GROUPS = {s.Import: "import", s.Fold: "select", s.PipelineRef: "select"}


# --- attaching comments to statements --------------------------------------------------------

@attrs.define
class _Attached:
    """Comments by the ``id`` of their statement (equal statements may occur twice)."""

    leading: dict[int, list[Comment]] = attrs.Factory(dict)
    trailing: dict[int, str] = attrs.Factory(dict)
    header: dict[int, str] = attrs.Factory(dict)
    closing: dict[int, list[Comment]] = attrs.Factory(dict)
    end: list[Comment] = attrs.Factory(list)


@attrs.frozen
class _Anchor:
    """A place a comment can attach to: a statement's start, or a block's closing brace."""

    line: int
    column: int
    node: s.Node
    closing: bool


def _anchors(statements, out: list[_Anchor]) -> list[_Anchor]:
    """The anchors of ``statements`` and everything inside them, in source order."""
    for node in statements:
        if node.span is None:
            continue
        out.append(_Anchor(node.span.line, node.span.column, node, False))
        if type(node) in _BLOCKS:
            _anchors(_BLOCKS[type(node)](node)[1], out)
            out.append(_Anchor(node.span.end_line, node.span.end_column - 1, node, True))
    return out


def _attach_comments(module: s.Module, comments: list[Comment]) -> _Attached:
    """Decide which statement each comment belongs to (see the module docstring)."""
    anchors = _anchors(module.items, [])
    attached = _Attached()
    for comment in comments:
        _attach(comment, anchors, attached)
    return attached


def _span(node: s.Node) -> Span:
    """The span of a node of the parsed text (every such node has one)."""
    assert node.span is not None, f"{type(node).__name__} without a span"
    return node.span


def _is_one_line_block(node: s.Node) -> bool:
    return type(node) in _BLOCKS and _span(node).line == _span(node).end_line \
        and bool(_BLOCKS[type(node)](node)[1])


def _attach(comment: Comment, anchors: list[_Anchor], attached: _Attached) -> None:
    # Rule 1: trailing — the statement ending last on this line (comments run to the line end,
    # so anything ending on the line ends before the comment).
    ending = [a.node for a in anchors if not a.closing and _span(a.node).end_line == comment.line]
    if ending:
        node = max(ending, key=lambda n: _span(n).end_column)
        if _is_one_line_block(node):
            attached.header[id(node)] = comment.text  # it describes the whole block
        else:
            attached.trailing[id(node)] = comment.text
        return
    # Rule 2: inside a one-line statement written over several lines.
    for anchor in anchors:
        span = _span(anchor.node)
        if type(anchor.node) in _LEAVES and span.line <= comment.line < span.end_line:
            attached.leading.setdefault(id(anchor.node), []).append(comment)
            return
    # Rule 3: after the `{` of the innermost block starting on this line.
    opening = [a.node for a in anchors if not a.closing and type(a.node) in _BLOCKS
               and _span(a.node).line == comment.line]
    if opening:
        attached.header[id(opening[-1])] = comment.text
        return
    # Rule 4: the next statement or closing brace; rule 5: the end of the file.
    after = [a for a in anchors if (a.line, a.column) > (comment.line, comment.column)]
    if not after:
        attached.end.append(comment)
    elif after[0].closing:
        attached.closing.setdefault(id(after[0].node), []).append(comment)
    else:
        attached.leading.setdefault(id(after[0].node), []).append(comment)


# --- printing ---------------------------------------------------------------------------------

def _comment_lines(comments: list[Comment], pad: str, blank_after_last: bool) -> list[str]:
    """A group of own-line comments; a blank line after one in the source stays (once),
    after the last only where a statement follows (``blank_after_last``)."""
    lines = []
    for index, comment in enumerate(comments):
        lines.append(pad + comment.text)
        if comment.blank_after and (blank_after_last or index < len(comments) - 1):
            lines.append("")
    return lines


def _statement(node: s.Node, depth: int, attached: _Attached) -> list[str]:
    """The lines of one statement at ``depth``, with its comments."""
    pad = INDENT * depth
    lines = _comment_lines(attached.leading.get(id(node), []), pad, True)
    if type(node) in _BLOCKS:
        lines += _block(node, depth, attached)
    else:
        lines.append(pad + _LEAVES[type(node)](node))
    if id(node) in attached.trailing:
        lines[-1] += "  " + attached.trailing[id(node)]
    return lines


def _compact_repeat(node: s.Node, attached: _Attached) -> str | None:
    """``repeat m - warm { F B }`` on one line, as the paper draws schedules, when the body is
    only actions and no comment needs a line inside it (one after it is fine)."""
    if not isinstance(node, s.Repeat) or not node.body or id(node) in attached.closing:
        return None
    if (id(node) in attached.header) + (id(node) in attached.trailing) > 1:
        return None  # two comments cannot share the one line
    for statement in node.body:
        if not isinstance(statement, (s.Act, s.SIBlock)):
            return None
        if id(statement) in attached.leading or id(statement) in attached.trailing:
            return None
    actions = " ".join(_LEAVES[type(statement)](statement) for statement in node.body)
    comment = attached.header.get(id(node), "")
    return f"repeat {format_expr(node.count)} {{ {actions} }}" + (comment and "  " + comment)


def _block(node: s.Node, depth: int, attached: _Attached) -> list[str]:
    header, body = _BLOCKS[type(node)](node)
    pad = INDENT * depth
    compact = _compact_repeat(node, attached)
    if compact is not None:
        return [pad + compact]
    closing = attached.closing.get(id(node), [])
    opening = f"{pad}{header} {{"
    if id(node) in attached.header:
        opening += "  " + attached.header[id(node)]
    elif not body and not closing:
        return [opening + "}"]
    lines = [opening]
    for statement in body:
        lines += _statement(statement, depth + 1, attached)
    lines += _comment_lines(closing, pad + INDENT, False)
    lines.append(pad + "}")
    return lines


def _grouped(previous: s.Node, item: s.Node) -> bool:
    group = _GROUPS.get(type(item))
    return group is not None and group == _GROUPS.get(type(previous))


def format_module(module: s.Module, comments: list[Comment] | None = None) -> str:
    """The canonical text of ``module``, with ``comments`` (from :func:`find_comments` over
    the text ``module`` was parsed from) placed by the spans of its nodes.

    Without spans (a tree built in code) every comment goes to the end of the file.
    Returns "" for an empty module without comments, else text ending in one newline.
    """
    attached = _attach_comments(module, comments or [])
    lines: list[str] = []
    previous = None
    for item in module.items:
        if previous is not None and not _grouped(previous, item):
            lines.append("")
        lines += _statement(item, 0, attached)
        previous = item
    if attached.end and lines:
        lines.append("")
    lines += _comment_lines(attached.end, "", False)
    return "\n".join(lines) + "\n" if lines else ""


def format_source(text: str, path: str = "<string>") -> str:
    """Parse ``text`` (named ``path`` in errors) and return its canonical form, comments kept.

    Raises :class:`~dhelix.dsl.core.errors.ParseError` when ``text`` does not parse.
    """
    return format_module(parse(text, path), find_comments(text))
