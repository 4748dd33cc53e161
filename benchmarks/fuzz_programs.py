"""The differential program fuzzer's long run: random tiny programs over the whole language
(tests/random_programs.py) through check, fmt, plan, simulate and, for some of those on at
most 4 ranks, ``run --check`` against the single-process reference.

Run from the repository root::

    .venv/bin/python benchmarks/fuzz_programs.py [--minutes M] [--seed S] [--run-every N] [--tune-every N]

Every program ``check`` accepts must round-trip through ``fmt`` and finish ``plan`` and
``simulate`` (``--si-plan`` planned or scheduled, drawn) with no other error than a located
one; every ``--run-every``-th accepted program on at most 4 ranks also runs one step of
``dhelix run --check`` (its ``--si-plan`` drawn from the four modes), which must match the
reference (fp32, 1e-5); every ``--tune-every``-th accepted program is also tuned (``tune -o``,
what it keeps and ``--partitions`` drawn): it exits 0 or with a located error, what it writes
must check and, where the program also runs, run ``--check`` too. Printed: programs tried, accepted, refused by check (the most
common reasons), runs, and each failure with its program.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from random_programs import RUN_SI_PLANS, SIMULATE_SI_PLANS, TUNE_KEEPS, differential, program, world_of  # noqa: E402


def main() -> None:
    """Parse the options, fuzz until the time is up, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    parser.add_argument("--run-every", type=int, default=6, metavar="N",
                        help="run --check every N-th accepted program on at most 4 ranks (default 6)")
    parser.add_argument("--tune-every", type=int, default=3, metavar="N",
                        help="tune every N-th accepted program, its --keep and --partitions drawn, and check "
                             "(and, with run --check, run) what it writes (default 3; 0: never)")
    args = parser.parse_args()
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    rng = random.Random(args.seed)
    counts, reasons, failures = collections.Counter(), collections.Counter(), []
    end, started = time.monotonic() + 60 * args.minutes, time.monotonic()
    while time.monotonic() < end:
        text = program(rng.choice)
        small = world_of(text) <= 4
        run = rng.choice(RUN_SI_PLANS) if small and counts["accepted small"] % args.run_every == 0 else None
        tune = (rng.choice(TUNE_KEEPS), rng.choice((False, True))) \
            if args.tune_every and counts["accepted"] % args.tune_every == 0 else None
        with tempfile.TemporaryDirectory() as folder:
            status, detail = differential(text, folder, simulate_si_plan=rng.choice(SIMULATE_SI_PLANS),
                                          run_si_plan=run, tune=tune)
        counts["tried"] += 1
        if status == "rejected":
            counts["rejected"] += 1
            reasons[detail.split(" (", 1)[0][:60]] += 1
            continue
        counts["accepted"] += 1
        counts["accepted small"] += small
        counts["run --check"] += run is not None
        counts["tuned"] += tune is not None
        if status == "failed":
            failures.append((detail, text))
            print(f"FAILURE {len(failures)} (program {counts['tried']}):\n{detail}\n{text}", flush=True)
    minutes = (time.monotonic() - started) / 60
    print(f"{counts['tried']} programs in {minutes:.1f} min: {counts['accepted']} accepted by check "
          f"({counts['accepted small']} on at most 4 ranks), {counts['rejected']} refused with a located error; "
          f"{counts['run --check']} also ran one step of run --check, {counts['tuned']} were tuned (-o checked); "
          f"{len(failures)} failures")
    print("most common refusals:")
    for reason, count in reasons.most_common(8):
        print(f"  {count:4d}  {reason}")


if __name__ == "__main__":
    main()
