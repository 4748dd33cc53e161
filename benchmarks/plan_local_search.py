"""What the planner's local search buys on the layer pairs `dhelix tune` plans most: the
chunked Llama-70B pairs of a `--partitions` search on 1024 H100s.

Run from the repository root::

    .venv/bin/python benchmarks/plan_local_search.py [--no-exact] [--choice TEXT]

The choice (default: tp8 cp8 pp2 dp8, fold u, w_helix, a generated partition) is priced as
`dhelix tune --partitions` prices it: its chunk counts settled by the whole step, which
plans one SI layer pair per set of counts tried. For each of those pairs, printed: its ops,
the search with segments of at most 4 ops alone (``max_segment=4``: the plan before the local
search), the default plan (that search, then the local search of ``dsl/planner/refine.py``;
its moves), and the search with segments of any length inside the same moving-op windows
(the optimum there; slow: half a minute to minutes per pair, ``--no-exact`` skips it); each
with its CPU seconds on this machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
from functools import partial
from pathlib import Path
from typing import Callable

from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.frontend.imports import load_modules, read_source
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.planner.pairing import DEFAULT_MAX_SEGMENT, plan_layers
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.search.space import Choice, space_of
from dhelix.dsl.search.tune import Pricer
from dhelix.dsl.simulator.costs import si_backward

ROOT = Path(__file__).resolve().parent.parent
FILE = ROOT / "benchmarks" / "llama70b_h100_1024.dhx"
CHOICE = "tp8 cp8 pp2 dp8  b1 m128  zero1  recompute none  partition auto  fold u  w_helix"


def tune_pairs(choice_text: str) -> tuple[list[tuple], Callable[[], PairCost]]:
    """The SI layer pairs (forward DAG, backward DAG, strands block) planned while `tune`
    settles ``choice_text``'s chunk counts, in order, and a maker of fresh pair costs as
    the search prices them (its profile, dtype and sequence)."""
    modules = load_modules(read_source(str(FILE)), str(FILE))
    base = passes.rerun(check_program(modules), after="check")
    space = space_of(base, partitions=True)
    pricer = Pricer(modules, base, base.mesh.world)
    choice = next((Choice(layout, *schedule) for layout in space.layouts() for schedule in space.schedules
                   if Choice(layout, *schedule).describe() == choice_text), None)
    if choice is None:
        raise SystemExit(f"no choice of {FILE.name}'s space reads {choice_text!r}")
    pairs = []
    planned = pricer.plans.plan

    def record(program):
        pairs.append((program.forward, si_backward(program), program.strands))
        return planned(program)
    pricer.plans.plan = record
    pricer.chosen(pricer.checked(choice), choice.layout)
    return pairs, lambda: PairCost(pricer.profile, base.model.dtype, seq=base.model.get("seq"))


def timed(fn):
    """``fn()`` and the CPU seconds it took (the garbage of the searches before collected
    first, so that it is not charged to this one)."""
    gc.collect()
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-exact", action="store_true", help="skip the search with segments of any length")
    parser.add_argument("--choice", default=CHOICE, help="the choice of the search, as tune describes it")
    args = parser.parse_args()
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"load average {os.getloadavg()[0]:.1f} at the start (seconds are CPU seconds)")
    pairs, fresh = tune_pairs(args.choice)
    print(f"{FILE.relative_to(ROOT)}, choice {args.choice}: {len(pairs)} SI layer pairs planned")
    gaps = []
    for forward, backward, strands in pairs:
        cost = fresh()  # a fresh cache per search: each pays its own pricing
        capped, capped_s = timed(partial(plan_layers, forward, backward, strands, cost, max_segment=DEFAULT_MAX_SEGMENT))
        cost = fresh()
        default, default_s = timed(partial(plan_layers, forward, backward, strands, cost))
        line = (f"  {len(forward.ops)} + {len(backward.ops)} ops, windows {default.stats.forward_window}/"
                f"{default.stats.backward_window}: 4-op search {capped.total * 1e3:.4f} ms ({capped_s:.2f} s); "
                f"default {default.total * 1e3:.4f} ms ({default_s:.2f} s, {default.stats.local_moves} local "
                f"move{'s' if default.stats.local_moves != 1 else ''})")
        if not args.no_exact:
            cost = fresh()
            exact, exact_s = timed(partial(plan_layers, forward, backward, strands, cost, max_segment=None))
            line += (f"; any length {exact.total * 1e3:.4f} ms ({exact_s:.1f} s): 4-op "
                     f"{100 * (capped.total / exact.total - 1):.2f} % above it, default "
                     f"{100 * (default.total / exact.total - 1):.2f} %")
            gaps.append((capped.total / exact.total - 1, default.total / exact.total - 1))
        print(line, flush=True)
    if gaps:
        print(f"above the optimum inside the windows: 4-op search {100 * min(g[0] for g in gaps):.1f}-"
              f"{100 * max(g[0] for g in gaps):.1f} %, default {100 * min(g[1] for g in gaps):.1f}-"
              f"{100 * max(g[1] for g in gaps):.1f} %")


if __name__ == "__main__":
    main()
