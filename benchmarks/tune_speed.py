"""How long `dhelix tune` takes to search: the tiny example's whole space, and Llama-70B-shaped
models on 64 A40s and on 1024 H100s.

Run from the repository root::

    .venv/bin/python benchmarks/tune_speed.py [--only NAME] [--partitions] [--top] [--jobs N]

Each search runs to the end (no budget) with the top 5 kept, in one process or ``--jobs N``
side by side (as `dhelix tune --jobs N`). Printed per search: wall-clock and CPU seconds (the
search processes' together; CPU seconds tell the search's own cost on a machine shared with
other work; the load average is printed too), the space (choices, layouts), what the branch and bound
did with it (simulated, ruled out by a bound, over the device memory, refused by the checks),
the SI plans computed, and the best choice with its predicted step.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.frontend.imports import load_modules, read_source
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.search.space import space_of
from dhelix.dsl.search.tune import Pricer, search

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "tiny": ROOT / "examples" / "tiny_llama_cpu.dhx",
    "llama70b_64xa40": ROOT / "benchmarks" / "llama70b_a40_64.dhx",
    "llama70b_1024xh100": ROOT / "benchmarks" / "llama70b_h100_1024.dhx",
}


def _cpu() -> float:
    """CPU seconds of this process and its ended children (the search processes)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def run_case(name: str, path: Path, partitions: bool = False, top_list: bool = False, jobs: int = 1) -> None:
    """Search the file ``path`` with ``jobs`` processes and print what it took (and the top 5
    found, with ``top_list``)."""
    load = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), _cpu()
    text = read_source(str(path))
    modules = load_modules(text, str(path))
    base = passes.rerun(check_program(modules), after="check")
    space = space_of(base, partitions=partitions)
    outcome = search(Pricer(modules, base, base.mesh.world), space, top=5, jobs=jobs)
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    print(f"{name}{' --partitions' if partitions else ''}{f' --jobs {jobs}' if jobs > 1 else ''}: "
          f"{path.relative_to(ROOT)}, {base.mesh.world} GPUs, "
          f"profile {base.profile.name}, "
          f"global batch {space.sequences} x {base.model.get('seq')}")
    print(f"  {wall:.1f} s wall, {cpu:.1f} s CPU (load average {load:.1f} at the start); "
          f"{outcome.choices:,} choices in {outcome.layouts:,} layouts: {outcome.simulated:,} simulated "
          f"({outcome.fit:,} fit), {outcome.pruned:,} ruled out by a bound, {outcome.too_big:,} over "
          f"{outcome.memory_gb:g} GB, {outcome.refused:,} refused by the checks, "
          f"{outcome.same:,} the same as another; {outcome.plans} SI plans"
          + (f"; the best found after {outcome.found:.1f} s" if outcome.found is not None else ""))
    if outcome.top:
        best = outcome.top[0]
        print(f"  best: {best.choice.describe()}: {best.seconds * 1e3:,.3f} ms, MFU {best.sim.mfu:.1%}, "
              f"peak {best.sim.peak_rank.memory / 1e9:.2f} GB")
    if top_list:
        for rank, found in enumerate(outcome.top, 1):
            print(f"  top {rank}: {found.choice.describe()}: {found.seconds * 1e3:,.6f} ms, "
                  f"peak {found.sim.peak_rank.memory / 1e9:.4f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), help="run one search")
    parser.add_argument("--partitions", action="store_true", help="search Centauri's partition too (tune --partitions)")
    parser.add_argument("--top", action="store_true", help="print the top 5 found too (to compare two searches)")
    parser.add_argument("--jobs", type=int, default=1, help="search processes side by side (tune --jobs)")
    args = parser.parse_args()
    print(f"machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    for name, path in CASES.items():
        if args.only in (None, name):
            run_case(name, path, args.partitions, args.top, args.jobs)


if __name__ == "__main__":
    main()
