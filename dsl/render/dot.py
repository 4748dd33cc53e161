"""Small helpers for writing Graphviz DOT text by hand.

The renderers write DOT themselves rather than through a builder so that the text is fully
under their control: the same input gives byte-identical output (no dict or set order, no
timestamps), which is what lets golden files and committed diagrams diff cleanly.
"""

from __future__ import annotations

import hashlib
import re
import subprocess

from dhelix.dsl.core.errors import DhelixError

#: The font of every diagram: Graphviz maps it to a sans-serif face with Greek letters
#: (DejaVu Sans or Liberation Sans on Linux, Helvetica on macOS).
FONT = "Helvetica"
#: The longest text one DOT string or label piece holds: Graphviz rejects strings of 16384
#: characters or more, so longer ones (a 20,000-character op name) are shortened.
MAX_TEXT = 1000


def shorten(text: str) -> str:
    """``text``, or for one over :data:`MAX_TEXT` characters its start and end around '…'
    and a digest of the whole, so two long names that differ stay different."""
    if len(text) <= MAX_TEXT:
        return text
    digest = hashlib.sha1(text.encode()).hexdigest()[:8]
    half = (MAX_TEXT - 16) // 2
    return f"{text[:half]}…{digest}…{text[-half:]}"


def quote(text: str) -> str:
    """``text`` as a double-quoted DOT string (IDs and plain labels)."""
    escaped = shorten(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def html(text: str) -> str:
    """``text`` escaped for an HTML-like label."""
    return shorten(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def attributes(**values) -> str:
    """``[key="value", …]`` with keys in the order given; None values are left out."""
    parts = [f"{key}={quote(str(value))}" for key, value in values.items() if value is not None]
    return f"[{', '.join(parts)}]" if parts else ""


def with_html_label(label: str, **values) -> str:
    """Like :func:`attributes`, with an HTML-like ``label=<…>`` (already escaped) at the end."""
    parts = [f"{key}={quote(str(value))}" for key, value in values.items() if value is not None]
    return f"[{', '.join(parts + [f'label=<{label}>'])}]"


def graph_header(kind: str, name: str, **values) -> list[str]:
    """The opening lines of a graph: ``digraph name {`` and the graph-wide font defaults."""
    lines = [f"{kind} {quote(name)} {{"]
    lines += [f"  {key}={quote(str(value))};" for key, value in values.items() if value is not None]
    lines += [f"  node {attributes(fontname=FONT)};", f"  edge {attributes(fontname=FONT)};"]
    return lines


def run_dot(dot: str, source: str, fmt: str, name: str) -> bytes:
    """The picture Graphviz's ``dot`` program (at path ``dot``) draws from ``source`` in
    format ``fmt`` (svg, png); DhelixError naming ``name`` (what was being drawn) when it fails."""
    result = subprocess.run([dot, f"-T{fmt}"], input=source.encode(), capture_output=True, check=False)
    if result.returncode != 0:
        raise DhelixError(f"Graphviz dot failed to draw {name}: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def inline_svg(svg: str) -> str:
    """Graphviz's SVG as an element to inline in HTML5: from ``<svg`` on, without the XML
    prolog, the doctype, comments and the namespace attributes (HTML needs none), so the page
    names no address."""
    body = svg[svg.index("<svg"):]
    body = re.sub(r"<!--.*?-->", "", body, flags=re.S)
    return re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", body)
