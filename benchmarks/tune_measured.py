"""`dhelix tune` measured, not only predicted: profile this machine, tune the tiny example with
that profile, then run the tuned program and the shipped one alternately.

::

    .venv/bin/python benchmarks/tune_measured.py --rounds 5 --output benchmarks/results/cpu_tune_measured.txt

1. ``dhelix profile examples/tiny_llama_cpu.dhx -o WORK/this-machine.yaml`` (local gloo ranks);
2. ``dhelix tune examples/tiny_llama_cpu.dhx --profile WORK/this-machine.yaml -o WORK/tuned.dhx``
   (every candidate priced by the profile's derived rates: its measured op times belong to
   the shipped mesh only), and both predictions from that same pricing;
3. ``dhelix run`` of the shipped and the tuned program, alternated in every round (the order
   flips from round to round), each writing ``--metrics``; the medians over rounds, and the
   ratio tuned ÷ shipped measured beside predicted; beside each run the CPU seconds its ranks
   used per step and the cores it got (those over the step), and beside the prediction the
   same without the bound of the profile's shared cores (a core per rank).

A benchmark, not a test: the figures belong to the machine it runs on and to its load at the
time (printed beside every run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from predict_vs_run import dhelix, machine

from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.frontend.imports import load_modules, read_source
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.search.tune import Pricer
from dhelix.dsl.search.variant import with_profile_setting
from tune_vs_paper import shipped_choice

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "examples" / "tiny_llama_cpu.dhx"


def predictions(profile: Path, tuned_text: str) -> tuple:
    """(shipped, tuned) simulations by tune's pricing with ``profile``, and both choices."""
    modules = with_profile_setting(load_modules(read_source(str(PROGRAM)), str(PROGRAM)), str(profile))
    base = passes.rerun(check_program(modules), after="check")
    tuned_path = profile.parent / "tuned.dhx"
    tuned_base = passes.rerun(check_program(load_modules(tuned_text, str(tuned_path))), after="check")
    pricer = Pricer(modules, base, base.mesh.world)
    shipped, tuned = shipped_choice(base), shipped_choice(tuned_base)
    return pricer.price(shipped).sim, pricer.price(tuned).sim, shipped.describe(), tuned.describe()


def cpu_seconds(metrics: dict) -> float:
    """The CPU seconds of a step summed over the ranks (each rank's median without the first
    step, every thread of its process), from ``dhelix run --metrics``."""
    return sum(statistics.median(rank["cpu_s"][1:] or rank["cpu_s"]) for rank in metrics["ranks"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="dhelix profile --repeats (default 5)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"# {shlex.join(['python', 'benchmarks/tune_measured.py', *(argv if argv is not None else sys.argv[1:])])}")
    say(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="dhelix-tune-") as folder:
        work = Path(folder)
        printed = say

        def say(line: str = "") -> None:  # the temporary folder is WORK in the report
            printed(line.replace(folder, "WORK"))
        profile, tuned = work / "this-machine.yaml", work / "tuned.dhx"
        for command in (("profile", str(PROGRAM), "-o", str(profile), "--repeats", str(args.repeats)),
                        ("tune", str(PROGRAM), "--profile", str(profile), "-o", str(tuned))):
            result = dhelix(*command, timeout=args.timeout)
            if result.returncode != 0:
                raise SystemExit(f"dhelix {command[0]} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
            if command[0] == "tune":
                say("`dhelix tune examples/tiny_llama_cpu.dhx --profile this-machine.yaml -o tuned.dhx`:")
                for line in result.stdout.splitlines():
                    say(f"  {line}")
        shipped_sim, tuned_sim, shipped_text, tuned_text = predictions(profile, tuned.read_text())
        shipped_s, tuned_s = shipped_sim.step_time, tuned_sim.step_time
        for name, text, sim in (("shipped", shipped_text, shipped_sim), ("tuned", tuned_text, tuned_sim)):
            say(f"{name + ':':<8} {text}: predicted {sim.step_time * 1e3:.3f} ms (a core per rank {sim.timeline_time * 1e3:.3f} "
                f"ms, the ranks' CPU work over the profile's cores {sim.cores_bound * 1e3:.3f} ms)")
        steps: dict[str, list[float]] = {"shipped": [], "tuned": []}
        cores: dict[str, list[float]] = {"shipped": [], "tuned": []}
        programs = {"shipped": PROGRAM, "tuned": tuned}
        for index in range(args.rounds):
            order = ("shipped", "tuned") if index % 2 == 0 else ("tuned", "shipped")
            for name in order:
                metrics = work / f"round{index + 1}-{name}.json"
                result = dhelix("run", str(programs[name]), "--steps", str(args.steps), "--metrics", str(metrics),
                                timeout=args.timeout)
                if result.returncode != 0:
                    raise SystemExit(f"dhelix run ({name}) failed:\n{result.stderr[-2000:]}")
                data = json.loads(metrics.read_text())
                step, cpu = data["step_s"], cpu_seconds(data)
                steps[name].append(step)
                cores[name].append(cpu / step)
                say(f"round {index + 1}/{args.rounds}  {name:<8} step {step * 1e3:8.1f} ms  CPU {cpu * 1e3:6.1f} ms "
                    f"(cores got {cpu / step:.2f})  (load average {os.getloadavg()[0]:.1f})")
    shipped_run, tuned_run = statistics.median(steps["shipped"]), statistics.median(steps["tuned"])
    say()
    say(f"median step: shipped {shipped_run * 1e3:.1f} ms, tuned {tuned_run * 1e3:.1f} ms; tuned ÷ shipped measured "
        f"{tuned_run / shipped_run:.3f}, predicted {tuned_s / shipped_s:.3f}; tuned faster in "
        f"{sum(t < s for s, t in zip(steps['shipped'], steps['tuned'], strict=True))} of {args.rounds} rounds")
    say(f"with a core per rank (no bound of the shared cores) the prediction is "
        f"{tuned_sim.timeline_time / shipped_sim.timeline_time:.3f}; the runs got {statistics.median(cores['shipped']):.2f} "
        f"(shipped) and {statistics.median(cores['tuned']):.2f} (tuned) cores, median (CPU seconds over the step)")
    if args.output is not None:
        args.output.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
