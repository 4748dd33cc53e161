"""How far the planner's default plan is from the fastest, on every shipped example.

Run from the repository root::

    .venv/bin/python benchmarks/plan_optimality.py [--also-segments N] [FILE ...]

For each example with a model and a profile (default: every ``examples/*.dhx``), the SI plan
that ``plan``, ``simulate`` and ``run`` use (the default bounds: segments of any length when
the two strands have at most 20,000 pairs of segments, else at most 4 ops and then the local
search of dsl/planner/refine.py; a moving-op window past 300 prefixes) beside what
``plan --certify`` works out: the search with segments of any length where the moving ops had
no window, else the relaxation's lower bound of every plan.
Printed per example: the bounds used, the default total, the fastest (or the bound) and the
gap, and the seconds each search took on this machine (indicative only: a shared machine);
``--also-segments N`` adds the plan with segments of at most N ops where the default loses.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.simulator.launch import priced_program
from dhelix.dsl.simulator.si_pairs import plan_optimality, schedule_plan

ROOT = Path(__file__).resolve().parent.parent


def row(path: Path, also: int | None = None) -> str | None:
    """One example's line, or None when it has no layer pair to plan."""
    name = str(path.relative_to(ROOT))
    try:
        program, _ = priced_program(read_source(name), name, None)
    except DhelixError as error:
        return f"{name}: not planned ({error.message})"
    if program.forward is None or program.profile is None:
        return None
    start = time.process_time()
    plan = schedule_plan(program)
    planned = time.process_time() - start
    start = time.process_time()
    known = plan_optimality(program, plan)
    checked = time.process_time() - start
    stats = plan.stats
    bounds = f"segments <= {stats.max_segment or 'any'}, windows {stats.forward_window}/{stats.backward_window}"
    default = f"{plan.total * 1e3:.3f} ms ({planned:.2f} s)"
    if stats.exhaustive:
        verdict = "exact search"
    elif known.exact:
        gap = 100 * (plan.total / known.fastest - 1)
        verdict = (f"fastest {known.fastest * 1e3:.3f} ms ({checked:.2f} s): "
                   + (f"default {gap:.2f}% slower" if known.faster(plan) else "default is the fastest"))
        if also and known.faster(plan):
            start = time.process_time()
            wider = schedule_plan(program, max_segment=also)
            verdict += (f"; segments <= {also}: {wider.total * 1e3:.3f} ms ({time.process_time() - start:.2f} s)")
    elif known.floor is not None:
        verdict = f"lower bound {known.floor * 1e3:.3f} ms ({checked:.2f} s): default within {100 * (plan.total / known.floor - 1):.2f}%"
    else:
        verdict = "nothing proven (measured profile)"
    return f"{name}: {bounds}; default {default}; {verdict}"


def main(argv: list[str]) -> int:
    """Print the machine line, then one line per example."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--also-segments", type=int, metavar="N", default=None)
    parser.add_argument("files", nargs="*")
    args = parser.parse_args(argv)
    paths = [Path(arg).resolve() for arg in args.files] or sorted((ROOT / "examples").glob("*.dhx"))
    os.chdir(ROOT)
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; load average {os.getloadavg()[0]:.1f} at the start "
          "(seconds are CPU seconds)")
    for path in paths:
        line = row(path, args.also_segments)
        if line is not None:
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
