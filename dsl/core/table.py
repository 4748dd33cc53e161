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


def duration(seconds: float) -> str:
    """``seconds`` with three significant digits in the unit that reads best: ``1.25 s``,
    ``12.5 ms``, ``125 µs``, ``3.10 ns``; ``0 s`` for zero. Tiny times never print as
    ``0.000 ms``."""
    seconds = float(f"{seconds:.3g}")  # rounded first, so 999.6 µs reads 1.00 ms
    if seconds == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{_significant(seconds / scale)} {unit}"
    return f"{_significant(seconds / 1e-9)} ns"


def _significant(value: float) -> str:
    # Three significant digits without an exponent: 1.25, 12.5, 125, 1250.
    digits = max(0, 2 - (len(str(int(abs(value)))) - 1)) if abs(value) >= 1 else 3
    return f"{value:.{digits}f}"
