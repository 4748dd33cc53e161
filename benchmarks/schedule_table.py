"""Unit-time make-span and bubble ratio of every stdlib pipeline, as a Markdown table.

Run: ``.venv/bin/python benchmarks/schedule_table.py [--ranks 4] [--microbatches 8 16 32]``.
The numbers come from :func:`dhelix.dsl.passes.unittime.unit_time` (F = 1, B = 2 or B = W = 1 when
split, an SI block the sum of its pair, transfers free), so they are exact and the same on
every machine; the peer is 1F1B at the same p and m. docs/schedules.md shows the output.
"""

from __future__ import annotations

import argparse
import platform
import sys
from fractions import Fraction

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.passes.fold import placement_for
from dhelix.dsl.passes.lower import lower_pipeline
from dhelix.dsl.frontend.stdlib import fold_of, stdlib_pipelines
from dhelix.dsl.passes.unittime import peak_in_flight, unit_time
from dhelix.dsl.passes.validate import validate_lowered



def table_rows(ranks: int, microbatches: list[int]) -> list[list[str]]:
    """One row per (pipeline, m): the unit-time figures, or why the pipeline refuses m."""
    pipelines = stdlib_pipelines()
    rows = []
    for m in microbatches:
        baseline = _run(pipelines, "one_f_one_b", ranks, m)[0].normalized_makespan
        for name, (kind, arg) in ((n, fold_of(d)) for n, d in stdlib_pipelines().items()):
            fold = kind if arg is None else f"{kind}({arg})"
            try:
                timing, lowered = _run(pipelines, name, ranks, m)
            except DhelixError as error:
                rows.append([name, fold, str(m), "—", "—", "—", "—", "—", error.message])
                continue
            rows.append([name, fold, str(m), str(timing.makespan),
                         _number(timing.normalized_makespan),
                         f"{float(timing.normalized_makespan / baseline):.3f}",
                         f"{timing.bubble_ratio} = {float(timing.bubble_ratio):.3f}",
                         _number(Fraction(max(peak_in_flight(lowered)), lowered.chunks)), ""])
    return rows


def _run(pipelines, name: str, ranks: int, m: int):
    kind, arg = fold_of(stdlib_pipelines()[name])
    lowered = lower_pipeline(pipelines[name], ranks=ranks, microbatches=m,
                             placement=placement_for(kind, arg, 12 * ranks, ranks))
    validate_lowered(lowered)
    return unit_time(lowered), lowered


def _number(value: Fraction) -> str:
    return str(value) if value.denominator == 1 else f"{float(value):.1f}"


HEADER = ["pipeline", "fold", "m", "make-span", "make-span / v", "vs 1F1B", "bubble ratio",
          "in flight / v", "note"]


def markdown(rows: list[list[str]]) -> str:
    """A Markdown table of ``rows`` under HEADER, without the note column if it is empty."""
    columns = len(HEADER) if any(row[-1] for row in rows) else len(HEADER) - 1
    table = [HEADER[:columns]] + [row[:columns] for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(columns)]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |"
             for row in table]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Print the table for the sizes on the command line; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args(argv)
    print(f"# machine: {platform.node() or 'unknown'}, Python {platform.python_version()} "
          f"(unit time: the figures do not depend on it)")
    print(f"# p = {args.ranks}, m = {', '.join(map(str, args.microbatches))}; "
          f"make-span in chunk actions (F = 1), make-span / v in whole-rank forwards; "
          f"'vs 1F1B' = (make-span / v) / 1F1B's at the same m; in flight / v = the most "
          f"activations a rank holds, in whole-rank micro-batches")
    print(markdown(table_rows(args.ranks, args.microbatches)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
