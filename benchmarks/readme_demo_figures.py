"""README's `make demo` figures, generated from what `make demo` wrote.

Reads the run's ``out/metrics.json`` (``dhelix run --metrics``) and ``out/train.jsonl``
(``--log``), writes ``benchmarks/results/cpu_demo.txt`` (the command, the machine, the figures)
and rewrites the sentence between README's ``<!-- demo figures -->`` markers from that file,
so the two cannot disagree (``tests/test_docs.py`` checks they do not)::

    make demo && .venv/bin/python benchmarks/readme_demo_figures.py

``--check`` rewrites nothing and exits 1 when README's sentence is not the results file's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "cpu_demo.txt"
README = ROOT / "README.md"
BEGIN, END = "<!-- demo figures -->", "<!-- /demo figures -->"
COMMAND = "$ make demo && .venv/bin/python benchmarks/readme_demo_figures.py"
#: The figures, in the results file's order: key, then how the sentence reads it.
KEYS = ("steps", "first_loss", "last_loss", "held_out_loss", "held_out_perplexity", "held_out_windows",
        "step_ms_measured", "step_ms_simulated", "cpu_ms_per_step", "cores_used")


def figures(metrics: dict, log_lines: list[dict]) -> dict[str, str]:
    """The demo's figures as the text they are printed with: the run's ``metrics`` (its
    --metrics JSON) and its step log's lines (the last evaluation's perplexity)."""
    evals = [line for line in log_lines if "eval_loss" in line]
    if not metrics.get("held_out") or not evals:
        raise SystemExit("the run evaluated nothing: out/train.jsonl has no eval line (is it `make demo`'s?)")
    held = metrics["held_out"][-1]["loss"]
    windows = metrics.get("held_out_windows")
    return {
        "steps": str(metrics["steps"]),
        "first_loss": f"{metrics['losses'][0]:.2f}",
        "last_loss": f"{metrics['losses'][-1]:.2f}",
        "held_out_loss": f"{held:.2f}",
        "held_out_perplexity": f"{evals[-1]['eval_ppl']:.1f}",
        "held_out_windows": f"{windows['evaluated']} of {windows['of']}" if windows else "unknown",
        "step_ms_measured": f"{1e3 * metrics['step_s']:.0f}",
        "step_ms_simulated": f"{1e3 * metrics['predicted']['step_s']:.0f}",
        **cpu_figures(metrics),
    }


def cpu_figures(metrics: dict) -> dict[str, str]:
    """The CPU seconds per step the ranks used (each rank's median without the first step,
    every thread of its process, summed over the ranks) and that over the step: the cores the
    run kept busy ("unknown" where the metrics have no CPU times)."""
    ranks = metrics.get("ranks", [])
    if not ranks or not all(rank.get("cpu_s") for rank in ranks):
        return {"cpu_ms_per_step": "unknown", "cores_used": "unknown"}
    cpu = sum(statistics.median(rank["cpu_s"][1:] or rank["cpu_s"]) for rank in ranks)
    return {"cpu_ms_per_step": f"{1e3 * cpu:.0f}", "cores_used": f"{cpu / metrics['step_s']:.2f}"}


def results_text(found: dict[str, str]) -> str:
    """The results file: the command, the machine and date, one ``key: value`` line per figure."""
    machine = f"{platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} when written"
    return "\n".join([COMMAND, f"machine: {machine}; date: {date.today().isoformat()}",
                      *(f"{key}: {found[key]}" for key in KEYS)]) + "\n"


def read_results(text: str) -> dict[str, str]:
    """The figures of a results file :func:`results_text` wrote."""
    pairs = (line.split(": ", 1) for line in text.splitlines()[2:] if ": " in line)
    return {key: value for key, value in pairs if key in KEYS}


def sentence(found: dict[str, str]) -> str:
    """README's sentence of the figures (what goes between the markers)."""
    return (f"On this project's 2-core machine the loss fell from {found['first_loss']} to {found['last_loss']} in "
            f"{found['steps']} steps, held-out {found['held_out_loss']} (perplexity "
            f"{found['held_out_perplexity']}, over {found['held_out_windows']} held-out windows), against ln 256 "
            f"≈ 5.55 for a uniform guess; a step took {found['step_ms_measured']} ms measured beside "
            f"{found['step_ms_simulated']} ms simulated for the profile it had just measured")


def marked(readme: str) -> tuple[int, int]:
    """Where README's generated sentence starts and ends (between the markers)."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no {BEGIN} … {END} markers")
    return start + len(BEGIN), end


def main() -> None:
    """Write the results file and README's sentence (or, with --check, compare them)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", default="out/metrics.json", help="the demo run's --metrics JSON")
    parser.add_argument("--log", default="out/train.jsonl", help="the demo run's step log")
    parser.add_argument("--check", action="store_true", help="only say whether README agrees with the results file")
    args = parser.parse_args()
    readme = README.read_text()
    start, end = marked(readme)
    if args.check:
        same = readme[start:end] == sentence(read_results(RESULTS.read_text()))
        print("README's demo figures are the results file's" if same else "README's demo figures are stale")
        sys.exit(0 if same else 1)
    metrics = json.loads(Path(args.metrics).read_text())
    log = [json.loads(line) for line in Path(args.log).read_text().splitlines() if line.strip()]
    found = figures(metrics, log)
    assert all(math.isfinite(float(found[key])) for key in ("first_loss", "last_loss", "held_out_loss"))
    RESULTS.write_text(results_text(found))
    README.write_text(readme[:start] + sentence(found) + readme[end:])
    print(f"wrote {RESULTS.relative_to(ROOT)} and README.md's demo figures: {sentence(found)}")


if __name__ == "__main__":
    main()
