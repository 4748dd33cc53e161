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

``--fit`` also fits each platform's profile to that platform's runs (a GPU as its sources name
it: torchtitan's power-capped H100 apart from the SXM5 parts) (``dhelix calibrate``'s fit:
:mod:`~dhelix.dsl.fidelity.fit`) and prints, per run, the fitted error and the leave-one-out
error, and, per source, the error of a profile fitted on the *other* sources alone
(leave-one-source-out: a source the fit never saw, the honest figure for a new cluster).

The held-out set of issue 52 (Korthikanti et al. 2022, Table 5 and Figure 1) is not in the
file and is never read here.
"""

from __future__ import annotations

import argparse
import collections
import functools

import attrs
import os
import platform
import sys
import time
from pathlib import Path

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.fidelity.fit import fit_profile, identifiable
from dhelix.dsl.fidelity.predict import predict, profile_name, program_text, run_case, run_profile
from dhelix.dsl.fidelity.runs import load_runs
from dhelix.dsl.frontend.profiles import load_profile
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.events import simulate

RUNS = Path(__file__).resolve().parent / "published_runs.yaml"
KNOBS = ("gemm", "gemm_fp8", "attention", "overhead", "local", "cross")
#: A platform is fitted (and ablated) with at least this many runs of its own system.
MIN_FIT_RUNS = 8


def family(run) -> str:
    """The shipped profile of the run's GPU (``a100``, ``h100``, …)."""
    return profile_name(run) or run.gpu


def platform_of(run) -> str:
    """The platform a profile is fitted to: the GPU as the source names it, less the default
    form factor and memory (``h100-sxm``, ``h100-sxm-80gb`` -> ``h100``); a variant the source
    names apart stays apart (torchtitan's ``h100-96gb-hbm2e-500w``: power-capped to 500 W,
    slower memory — not the SXM5 part at 700 W the others ran)."""
    parts = [p for p in run.gpu.lower().split("-") if p not in ("sxm", "80gb")]
    return "-".join(parts)


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
    for key, label in (("source", lambda r: r.source.key), ("platform", platform_of)):
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
    parser.add_argument("--ablate", action="store_true", help="also each cost term's share: the error of the "
                        "shipped profiles with one term taken out at a time")
    parser.add_argument("--source", action="append", default=[], help="only this source (repeatable)")
    parser.add_argument("--gpu", action="append", default=[], help="only this GPU's runs (a100, h100, …; repeatable)")
    args = parser.parse_args()
    runs = [r for r in load_runs(args.runs) if (not args.source or r.source.key in args.source)
            and (not args.gpu or family(r) in args.gpu)]
    print(f"machine: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), python {platform.python_version()}")
    print(f"runs: {os.path.relpath(args.runs)}, {len(runs)} rows; profiles: the shipped ones with each source's cluster facts")
    print(f"\n{'source':<22} {'run':<34} {'model':<24} {'layout':<32} {'measured':>9} {'predicted':>9} {'error':>7}")
    started = time.perf_counter()
    rows, skipped, memory = [], [], []
    for run in runs:
        p = predict(run)
        run = p.run  # as predicted: a tuned source's unstated interleaving chosen
        if p.error is None:
            skipped.append((run, p.problem))
            continue
        rows.append((run, p.error))
        if run.memory_gib is not None:
            memory.append((run, p.predicted_peak_gib))
        print(f"{run.source.key:<22} {run.id[:34]:<34} {model_name(run)[:24]:<24} {run.layout()[:32]:<32} "
              f"{p.measured_s:>8.3f}s {p.predicted_s:>8.3f}s {100 * p.error:>+6.1f}%", flush=True)
    for run, why in skipped:
        print(f"{run.source.key:<22} {run.id[:34]:<34} not predicted: {why}")
    print_groups(f"shipped profiles ({time.perf_counter() - started:.0f} s):", rows)
    print_memory(memory)
    print_tp_overlap(runs)
    if args.ablate:
        ablate([run for run, _ in rows])
    if args.fit:
        fit_each_gpu([run for run, _ in rows])
    return 0


#: The streaming multiprocessors of each shipped GPU (the datasheets), for the tile-and-wave term.
SMS = {"a100": 108, "h100": 132, "a40": 84, "a800": 108}

#: Each term of the cost model the set exercises: how a run's profile (its cluster facts applied)
#: has it and lacks it.
TERMS = {
    "GEMM tile and wave quantization": (
        lambda run, p: attrs.evolve(p, kernels=attrs.evolve(p.kernels, sms=SMS[family(run)])),
        lambda run, p: attrs.evolve(p, kernels=attrs.evolve(p.kernels, sms=None))),
    "materialized attention (runs without flash)": (
        lambda run, p: p,
        lambda run, p: attrs.evolve(p, kernels=attrs.evolve(p.kernels, attention="flash"))),
    "the source's cross-node bandwidth": (
        lambda run, p: p,
        lambda run, p: attrs.evolve(p, links={**p.links, "cross": load_profile(family(run)).links["cross"]})),
}


def ablate(runs) -> None:
    """Each term's share, fairly: each platform's profile fitted again with the term and
    without it (a term that a fit without it matches as well — by the leave-one-out error —
    does not earn its place; a term the runs do not exercise changes nothing)."""
    print("\nablation: each platform fitted with each term and without it (runs of their platform's own system)")
    by_platform = collections.defaultdict(list)
    for run in runs:
        if not run.system:
            by_platform[platform_of(run)].append(run)
    for name in sorted(by_platform):
        group = by_platform[name]
        if len(group) < MIN_FIT_RUNS:
            continue
        base = load_profile(family(group[0]))
        for term, ways in TERMS.items():
            line = []
            for label, way in zip(("with", "without"), ways, strict=True):
                cases = [attrs.evolve(run_case(run, base), on=functools.partial(_composed, way, run)) for run in group]
                fit = fit_profile(cases, base, identifiable(KNOBS, cases), iterations=15)
                line.append(f"{label}: fitted {mean_abs(fit.after):4.1f} %, left out {mean_abs(fit.loo):4.1f} %")
            print(f"  {name:<24} {term:<44} " + "; ".join(line), flush=True)


def _composed(way, run, profile):
    return way(run, run_profile(run, profile))


def mean_abs(errors) -> float:
    return 100 * sum(abs(e) for e in errors) / len(errors)


def print_memory(rows) -> None:
    """Published peak memory per GPU beside the simulator's peak (model states and live
    activations of the fullest pipeline rank)."""
    if not rows:
        return
    print("\npeak memory per GPU, published beside predicted (GiB):")
    print(f"  {'run':<34} {'layout':<32} {'published':>9} {'predicted':>9} {'ratio':>6}")
    for run, predicted in rows:
        print(f"  {run.id[:34]:<34} {run.layout()[:32]:<32} {run.memory_gib:>9.1f} {predicted:>9.1f} "
              f"{predicted / run.memory_gib:>6.2f}")
    errors = [predicted / run.memory_gib - 1 for run, predicted in rows]
    print(f"  predicted / published - 1: {stats(errors)}")


#: Runs a source measured twice, its tensor-parallel collectives run whole and then overlapped
#: with their GEMMs (torchtitan's async TP: each all_gather and reduce_scatter cut into pieces
#: that run under the pieces of the GEMM beside it): (run as is, run with TP overlap).
TP_OVERLAP_PAIRS = (
    ("torchtitan-t4-70b-256gpu-tp", "torchtitan-t4-70b-256gpu-asynctp"),
    ("torchtitan-asynctp-70b-256gpu-bf16-vanilla-tp", "torchtitan-asynctp-70b-256gpu-bf16-async-tp"),
    ("torchtitan-asynctp-8b-64gpu-bf16-vanilla-tp", "torchtitan-asynctp-8b-64gpu-bf16-async-tp"),
)
#: The nearest the language writes: a workload partition of each TP region into 4 chunks
#: (Centauri), its gathers under the chunks' GEMMs and its reduce_scatters under the next chunk's.
TP_OVERLAP_PARTITION = "chunk ag1 + qkv by 4  chunk prj + rs1 by 4  chunk ag2 + fc1 + act + fc2 + rs2 by 4"


def print_tp_overlap(runs) -> None:
    """The measured speed-up of overlapping TP communication beside the simulator's for the same
    layout with :data:`TP_OVERLAP_PARTITION` (the runs' programs themselves have no partition:
    the source's overlap is its own implementation, not dhelix's)."""
    by_id = {run.id: run for run in runs}
    pairs = [(by_id[a], by_id[b]) for a, b in TP_OVERLAP_PAIRS if a in by_id and b in by_id]
    if not pairs:
        return
    print(f"\nTP communication overlapped, measured beside the simulator's partition {{ {TP_OVERLAP_PARTITION} }}:")
    print(f"  {'run':<44} {'layout':<24} {'measured':>9} {'predicted':>9}")
    for plain, overlapped in pairs:
        case = run_case(plain)
        profile = case.on(load_profile(family(plain)))
        text = program_text(case.run) + f"\npartition {{ {TP_OVERLAP_PARTITION} }}\n"
        chunked = attrs.evolve(check_text(text, f"{plain.id}.dhx"), profile=profile)
        whole = simulate(attrs.evolve(case.program, profile=profile), trace=False).step_time
        parts = simulate(chunked, trace=False).step_time
        measured = case.measured_s / run_case(overlapped).measured_s
        print(f"  {overlapped.id[:44]:<44} {plain.layout()[:24]:<24} {measured:>8.3f}x {whole / parts:>8.3f}x")


def fit_each_gpu(runs) -> None:
    by_gpu, apart = collections.defaultdict(list), collections.defaultdict(list)
    for run in runs:
        (apart if run.system else by_gpu)[platform_of(run)].append(run)
    fitted_rows, loo_rows, loso_rows, apart_rows = [], [], [], []
    for gpu in sorted(by_gpu):
        gpu_runs = by_gpu[gpu]
        base = load_profile(family(gpu_runs[0]))
        if len(gpu_runs) < MIN_FIT_RUNS:
            print(f"\n{gpu}: {len(gpu_runs)} run(s), fewer than {MIN_FIT_RUNS}: not fitted")
            continue
        cases = [run_case(run, base) for run in gpu_runs]
        started = time.perf_counter()
        knobs = identifiable(KNOBS, cases)
        fit = fit_profile(cases, base, knobs, iterations=15, progress=lambda line, gpu=gpu: print(f"  {gpu}: {line}", file=sys.stderr))
        print(f"\nfit of the {gpu} profile on its {len(cases)} runs ({fit.evaluations} evaluations, "
              f"{time.perf_counter() - started:.0f} s): " + ", ".join(
                  f"{k} {fit.start[k]:.4g} -> {fit.values[k]:.4g}" for k in fit.knobs))
        print(f"  {'run':<34} {'start':>7} {'fitted':>7} {'loo':>7}")
        for run, before, after, loo in zip(gpu_runs, fit.before, fit.after, fit.loo, strict=True):
            print(f"  {run.id[:34]:<34} {100 * before:>+6.1f}% {100 * after:>+6.1f}% {100 * loo:>+6.1f}%")
            fitted_rows.append((run, after))
            loo_rows.append((run, loo))
        for run in apart.get(gpu, ()):
            error = run_case(run, base).predicted_s(fit.profile) / run_case(run, base).measured_s - 1
            print(f"  {run.id[:34]:<34} {'':>7} {100 * error:>+6.1f}%  (another system, {run.system}: "
                  "not fitted on, priced with the fit)")
            apart_rows.append((run, error))
        sources = sorted({run.source.key for run in gpu_runs})
        for source in sources if len(sources) > 1 else ():
            train = [c for c, r in zip(cases, gpu_runs, strict=True) if r.source.key != source]
            held = [c for c, r in zip(cases, gpu_runs, strict=True) if r.source.key == source]
            other = fit_profile(train, base, identifiable(KNOBS, train), iterations=10)
            errors = [c.predicted_s(other.profile) / c.measured_s - 1 for c in held]
            loso_rows += [(r, e) for r, e in zip([r for r in gpu_runs if r.source.key == source], errors, strict=True)]
            print(f"  {source} left out (fitted on {len(train)} runs of the others): {stats(errors)}")
    print_groups("fitted per platform (in sample):", fitted_rows)
    if apart_rows:
        print_groups("runs of another system than their platform's (not fitted on):", apart_rows)
    print_groups("leave-one-out:", loo_rows)
    if loso_rows:
        print_groups("leave-one-source-out (GPUs with runs of two or more sources):", loso_rows)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DhelixError as exc:
        print(exc.render(), file=sys.stderr)
        sys.exit(1)
