"""How long `dhelix tune` takes to search: the tiny example's whole space, and Llama-70B-shaped
models on 64 A40s and on 1024 H100s.

Run from the repository root::

    .venv/bin/python benchmarks/tune_speed.py [--only NAME] [--partitions] [--keep S,…] [--top] [--jobs N]
    .venv/bin/python benchmarks/tune_speed.py --against DIR [--rounds R] [--only NAME] [--partitions] [--keep S,…] [--jobs N]

Each search runs to the end (no budget) with the top 5 kept, in one process or ``--jobs N``
side by side (as `dhelix tune --jobs N`). Printed per search: wall-clock and CPU seconds (the
search processes' together; CPU seconds tell the search's own cost on a machine shared with
other work; the load average is printed too), the space (choices, layouts), what the branch and bound
did with it (simulated, ruled out by a bound, over the device memory, refused by the checks),
the SI plans computed, and the best choice with its predicted step.

``--against DIR`` times another checkout of the project (DIR, e.g. a ``git worktree`` of an
earlier commit) side by side with this one: each search runs in a fresh process of this
interpreter, the two alternated for ``--rounds`` rounds (the other first in odd rounds); the
wall-clock and CPU seconds of each run, their medians and the ratios (this one over the
other; CPU seconds tell more than wall-clock ones on a machine shared with other work) are
printed, and whether both found the same best step. ``--keep`` holds settings as written
(`dhelix tune --keep`; ``--keep offload``: the optimizer's states where the file has them, as
searches did before offload was searched by default); with ``--against``, here only.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
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


def run_case(name: str, path: Path, partitions: bool = False, top_list: bool = False, jobs: int = 1,
             keep: tuple[str, ...] = ()) -> None:
    """Search the file ``path`` with ``jobs`` processes and print what it took (and the top 5
    found, with ``top_list``)."""
    load = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), _cpu()
    text = read_source(str(path))
    modules = load_modules(text, str(path))
    base = passes.rerun(check_program(modules), after="check")
    space = space_of(base, keep, partitions=partitions)
    outcome = search(Pricer(modules, base, base.mesh.world), space, top=5, jobs=jobs)
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    kept = f" --keep {','.join(keep)}" if keep else ""
    print(f"{name}{' --partitions' if partitions else ''}{kept}"
          f"{f' --jobs {jobs}' if jobs > 1 else ''}: "
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


#: Run in a fresh interpreter: the checkout given first on the command line imported as
#: ``dhelix`` (a view of its folders as the package's, made by :func:`_package_view`) in
#: place of the installed one, then its benchmark run with the arguments after it.
_BOOT = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
view, script = sys.argv[1], sys.argv[2]
sys.path.insert(0, view)
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def _package_view(checkout: Path, into: Path) -> Path:
    """A folder in ``into`` holding ``checkout``'s packages laid out as the installed
    ``dhelix`` (pyproject's package-dir: dsl/ as dhelix.dsl, ...), by symbolic links."""
    package = into / "dhelix"
    package.mkdir(parents=True)
    for entry in (checkout / "dhelix").iterdir():
        (package / entry.name).symlink_to(entry)
    for folder, name in (("dsl", "dsl"), ("interpreter", "interpreter"), ("grammar", "grammar"),
                         ("stdlib_schedules", "stdlib_schedules")):
        (package / name).symlink_to(checkout / folder)
    return into


def _timed(checkout: Path, view: Path, name: str, partitions: bool, jobs: int,
           keep: tuple[str, ...] = ()) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, best choice and step) of one search of case ``name`` run
    by ``checkout``'s own benchmark, as it prints them."""
    command = [sys.executable, "-c", _BOOT, str(view), str(checkout / "benchmarks" / "tune_speed.py"), "--only", name,
               "--jobs", str(jobs)] + (["--partitions"] if partitions else []) + (["--keep", ",".join(keep)] if keep else [])
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=checkout).stdout
    found = re.search(r"^  ([0-9.]+) s wall, ([0-9.]+) s CPU", out, re.M)
    return float(found.group(1)), float(found.group(2)), re.search(r"^  best: (.*)$", out, re.M).group(1)


def against(other: Path, rounds: int, names: list[str], partitions: bool, jobs: int, keep: tuple[str, ...] = ()) -> None:
    """Time each case of ``names`` here and in the checkout ``other``, alternated for
    ``rounds`` rounds; print each run, the medians and their ratio."""
    with tempfile.TemporaryDirectory() as scratch:
        views = {"this": _package_view(ROOT, Path(scratch) / "this"), "other": _package_view(other, Path(scratch) / "other")}
        trees = {"this": ROOT, "other": other}
        for name in names:
            walls: dict[str, list[float]] = {"this": [], "other": []}
            cpus: dict[str, list[float]] = {"this": [], "other": []}
            bests: dict[str, set[str]] = {"this": set(), "other": set()}
            for round_ in range(rounds):
                for side in (("other", "this") if round_ % 2 == 0 else ("this", "other")):
                    wall, cpu, best = _timed(trees[side], views[side], name, partitions, jobs, keep if side == "this" else ())
                    walls[side].append(wall)
                    cpus[side].append(cpu)
                    bests[side].add(best)
                    print(f"{name}{' --partitions' if partitions else ''} --jobs {jobs}, round {round_ + 1}, "
                          f"{side} ({trees[side]}): {wall:.1f} s wall, {cpu:.1f} s CPU "
                          f"(load average {os.getloadavg()[0]:.1f} after)",
                          flush=True)
            here, there = statistics.median(walls["this"]), statistics.median(walls["other"])
            cpu_here, cpu_there = statistics.median(cpus["this"]), statistics.median(cpus["other"])
            print(f"{name}: median {here:.1f} s here against {there:.1f} s there over {rounds} rounds: "
                  f"{here / there:.3f}x (CPU {cpu_here:.1f} s against {cpu_there:.1f} s: {cpu_here / cpu_there:.3f}x); "
                  f"the same best: {bests['this'] == bests['other'] and len(bests['this']) == 1}"
                  f" ({'; '.join(sorted(bests['this']))})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), help="run one search")
    parser.add_argument("--partitions", action="store_true", help="search Centauri's partition too (tune --partitions)")
    parser.add_argument("--keep", default="", metavar="S,…",
                        help="settings held as written (tune --keep; with --against, here only)")
    parser.add_argument("--top", action="store_true", help="print the top 5 found too (to compare two searches)")
    parser.add_argument("--jobs", type=int, default=1, help="search processes side by side (tune --jobs)")
    parser.add_argument("--against", type=Path, help="another checkout to time side by side with this one")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds with --against")
    args = parser.parse_args()
    print(f"machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    keep = tuple(name for name in args.keep.split(",") if name)
    if args.against is not None:
        against(args.against.resolve(), args.rounds, [n for n in CASES if args.only in (None, n)], args.partitions,
                args.jobs, keep)
        return
    for name, path in CASES.items():
        if args.only in (None, name):
            run_case(name, path, args.partitions, args.top, args.jobs, keep)


if __name__ == "__main__":
    main()
