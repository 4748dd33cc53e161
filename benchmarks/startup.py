"""Where the time before the first step of `dhelix run` goes, on this machine.

    python benchmarks/startup.py [--repeats N] [FILE]

Runs ``dhelix run FILE --steps 1`` (default the tiny CPU example) N times each way — ranks
forked from a forkserver that imported torch, ``torch._dynamo`` and the training loop's modules
once (what `dhelix run` does), forked from one that imported torch and the loop's entry only
(before: each rank then imports ``torch._dynamo`` when it makes its optimizer), and ranks
spawned, each importing torch itself (before that) — and prints, per run, the seconds until the
run's header (the command has checked, compiled and priced the program and is about to start
the ranks) and until the process exits, with the parts measured alone for scale: ``python -c
"import torch"``, ``dhelix --version`` and ``dhelix check FILE``. The load average is printed
beside each figure: on a shared machine it moves them more than any change here.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: ``dhelix run`` with ranks spawned, each importing torch: the start-up before the forkserver.
SPAWNED = ("import sys\n"
           "import multiprocessing\n"
           "from dhelix.interpreter.launch import spawn\n"
           "spawn.rank_context = lambda: multiprocessing.get_context('spawn')\n"
           "spawn.warm_up_ranks = lambda: None\n"
           "from dhelix.cli.main import main\n"
           "sys.exit(main(sys.argv[1:]))\n")


#: ``dhelix run`` with the forkserver preloading torch and the training loop's entry alone.
TORCH_ONLY = ("import sys\n"
              "from dhelix.interpreter.launch import spawn\n"
              "spawn.PRELOAD = [spawn.PRELOAD[0], 'torch', 'torch.distributed', 'dhelix.interpreter.training.train']\n"
              "from dhelix.cli.main import main\n"
              "sys.exit(main(sys.argv[1:]))\n")


def timed(command: list[str]) -> tuple[float | None, float]:
    """(seconds until the header ``dhelix run: FILE: … rank(s) …`` appeared — not the line the
    command prints at once, before compiling — and seconds until exit) of ``command``."""
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    header = None
    for line in proc.stdout:
        if header is None and line.startswith("dhelix run:") and " rank(s), " in line:
            header = time.monotonic() - start
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(command)} failed")
    return header, time.monotonic() - start


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def main() -> None:
    """Print the figures (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", default="examples/tiny_llama_cpu.dhx")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    python = sys.executable
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"file: {args.file}, `dhelix run FILE --steps 1`, {args.repeats} repeat(s) each way, alternating\n")
    for name, command in (("python -c 'import torch'", [python, "-c", "import torch"]),
                          ("dhelix --version", [python, "-m", "dhelix", "--version"]),
                          ("dhelix check FILE", [python, "-m", "dhelix", "check", args.file])):
        times = [timed(command)[1] for _ in range(args.repeats)]
        print(f"{name:<28} median {statistics.median(times):6.2f} s  ({', '.join(f'{t:.2f}' for t in times)}; "
              f"{load()})")
    print()
    ways = {"forked (forkserver)": [python, "-m", "dhelix", "run", args.file, "--steps", "1"],
            "forked, torch only": [python, "-c", TORCH_ONLY, "run", args.file, "--steps", "1"],
            "spawned": [python, "-c", SPAWNED, "run", args.file, "--steps", "1"]}
    results: dict[str, list] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, command in ways.items():
            header, total = timed(command)
            results[name].append((header, total))
            print(f"{name:<20} header at {header:6.2f} s, exit at {total:6.2f} s  ({load()})")
    print()
    for name, runs in results.items():
        print(f"{name:<20} median: header {statistics.median(h for h, _ in runs):6.2f} s, "
              f"after the header {statistics.median(t - h for h, t in runs):6.2f} s, "
              f"exit {statistics.median(t for _, t in runs):6.2f} s")


if __name__ == "__main__":
    main()
