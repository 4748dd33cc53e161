"""Hold dhelix's step-time predictions to published, measured training runs.

Run from the repository root::

    .venv/bin/python benchmarks/published_runs.py [--fit] [--runs FILE] [--source KEY …]

``benchmarks/published_runs.yaml`` holds the runs (Megatron-LM, MegaScale's Megatron-LM
baseline, Llama 3, torchtitan, NeMo, Megatron-Bridge, the DHelix paper), each with its source's
words, its table or section, and the facts of its cluster; :mod:`dhelix.dsl.fidelity` turns each
into a program (:mod:`~dhelix.dsl.fidelity.predict`) and simulates it. The script prints, per
run, the source, the model, the layout, the measured and predicted iteration seconds and the
error (``predicted / measured - 1``: negative is too fast), the runs a program cannot express
with the reason, then the mean and max |error| overall, per source and per GPU.

``--fit`` also fits each GPU's profile to that GPU's runs (``dhelix calibrate``'s fit:
:mod:`~dhelix.dsl.fidelity.fit`) and prints, per run, the fitted error and the leave-one-out
error, and, per source, the error of a profile fitted on the *other* sources alone
(leave-one-source-out: a source the fit never saw, the honest figure for a new cluster).

The held-out set of issue 52 (Korthikanti et al. 2022, Table 5 and Figure 1) is not in the
file and is never read here.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import time
from pathlib import Path

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.fidelity.fit import fit_profile
from dhelix.dsl.fidelity.predict import GPU_PROFILES, predict, run_case
from dhelix.dsl.fidelity.runs import load_runs
from dhelix.dsl.frontend.profiles import load_profile

RUNS = Path(__file__).resolve().parent / "published_runs.yaml"
KNOBS = ("gemm", "gemm_fp8", "attention", "overhead", "local", "cross")


def family(run) -> str:
    return GPU_PROFILES.get(run.gpu.lower().split("-")[0], run.gpu)


def stats(errors) -> str:
    absolute = [abs(e) for e in errors]
    if not absolute:
        return "no runs"
    return f"mean |error| {100 * sum(absolute) / len(absolute):5.1f}%, max {100 * max(absolute):5.1f}% ({len(absolute)} runs)"


def model_name(run) -> str:
    m = run.model
    size = m.get("name") or f"L{m['layers']} h{m['hidden']}"
    return f"{run.family} {size} s{m['seq']}"


def print_groups(title: str, rows) -> None:
    """``rows``: (run, error) pairs; the stats overall, per source, per GPU."""
    print(f"\n{title}")
    print(f"  {'all':<24} {stats([e for _, e in rows])}")
    for key, label in (("source", lambda r: r.source.key), ("gpu", family)):
        groups = collections.defaultdict(list)
        for run, error in rows:
            groups[label(run)].append(error)
        for name in sorted(groups):
            print(f"  {key} {name:<17} {stats(groups[name])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=str(RUNS), help="the runs file (default: published_runs.yaml)")
    parser.add_argument("--fit", action="store_true", help="also fit each GPU's profile: fitted, leave-one-out "
                        "and leave-one-source-out errors")
    parser.add_argument("--source", action="append", default=[], help="only this source (repeatable)")
    args = parser.parse_args()
    runs = [r for r in load_runs(args.runs) if not args.source or r.source.key in args.source]
    print(f"machine: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), python {platform.python_version()}")
    print(f"runs: {args.runs}, {len(runs)} rows; profiles: the shipped ones with each source's cluster facts")
    print(f"\n{'source':<22} {'run':<34} {'model':<24} {'layout':<32} {'measured':>9} {'predicted':>9} {'error':>7}")
    started = time.perf_counter()
    rows, skipped = [], []
    for run in runs:
        p = predict(run)
        if p.error is None:
            skipped.append((run, p.problem))
            continue
        rows.append((run, p.error))
        print(f"{run.source.key:<22} {run.id[:34]:<34} {model_name(run)[:24]:<24} {run.layout()[:32]:<32} "
              f"{p.measured_s:>8.3f}s {p.predicted_s:>8.3f}s {100 * p.error:>+6.1f}%", flush=True)
    for run, why in skipped:
        print(f"{run.source.key:<22} {run.id[:34]:<34} not predicted: {why}")
    print_groups(f"shipped profiles ({time.perf_counter() - started:.0f} s):", rows)
    if args.fit:
        fit_each_gpu([run for run, _ in rows])
    return 0


def fit_each_gpu(runs) -> None:
    by_gpu = collections.defaultdict(list)
    for run in runs:
        by_gpu[family(run)].append(run)
    fitted_rows, loo_rows, loso_rows = [], [], []
    for gpu in sorted(by_gpu):
        gpu_runs = by_gpu[gpu]
        base = load_profile(gpu)
        cases = [run_case(run, base) for run in gpu_runs]
        started = time.perf_counter()
        fit = fit_profile(cases, base, KNOBS)
        print(f"\nfit of the {gpu} profile on its {len(cases)} runs ({fit.evaluations} evaluations, "
              f"{time.perf_counter() - started:.0f} s): " + ", ".join(
                  f"{k} {fit.start[k]:.4g} -> {fit.values[k]:.4g}" for k in fit.knobs))
        print(f"  {'run':<34} {'start':>7} {'fitted':>7} {'loo':>7}")
        for run, before, after, loo in zip(gpu_runs, fit.before, fit.after, fit.loo, strict=True):
            print(f"  {run.id[:34]:<34} {100 * before:>+6.1f}% {100 * after:>+6.1f}% {100 * loo:>+6.1f}%")
            fitted_rows.append((run, after))
            loo_rows.append((run, loo))
        sources = sorted({run.source.key for run in gpu_runs})
        for source in sources if len(sources) > 1 else ():
            train = [c for c, r in zip(cases, gpu_runs, strict=True) if r.source.key != source]
            held = [c for c, r in zip(cases, gpu_runs, strict=True) if r.source.key == source]
            other = fit_profile(train, base, KNOBS)
            errors = [c.predicted_s(other.profile) / c.measured_s - 1 for c in held]
            loso_rows += [(r, e) for r, e in zip([r for r in gpu_runs if r.source.key == source], errors, strict=True)]
            print(f"  {source} left out (fitted on {len(train)} runs of the others): {stats(errors)}")
    print_groups("fitted per GPU (in sample):", fitted_rows)
    print_groups("leave-one-out:", loo_rows)
    if loso_rows:
        print_groups("leave-one-source-out (GPUs with runs of two or more sources):", loso_rows)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DhelixError as exc:
        print(exc.render(), file=sys.stderr)
        sys.exit(1)
