"""Fixed-width text tables, as the plan table and the simulation reports print them."""

from __future__ import annotations

from typing import Collection, Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> list[str]:
    """The lines of a table: ``header``, then ``rows`` (cells as strings, as many per row as
    the header has). Each column is as wide as its widest cell, columns are two spaces
    apart, the columns whose index is in ``right`` are right-aligned and the others
    left-aligned; trailing spaces are stripped."""
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [cell.rjust(width) if c in right else cell.ljust(width)
                 for c, (cell, width) in enumerate(zip(row, widths, strict=True))]
        return "  ".join(cells).rstrip()

    return [line(header)] + [line(row) for row in rows]
