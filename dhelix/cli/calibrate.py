"""`dhelix calibrate RUNS… [--profile P] [--gpu G] [--knobs K,…] [-o OUT.yaml]`: fit a profile
to measured runs and say how well it predicts the ones it did not see.

RUNS are sets of measured runs (:mod:`dsl.fidelity.runs`: YAML, or CSV with ``--sources``)
and ``dhelix run --metrics`` files, mixed freely. The command prints, per run, the measured
step, the starting profile's prediction and error, the fitted profile's error and the
leave-one-out error (:mod:`dsl.fidelity.fit`), then the mean and max |error| of each, and
writes the fitted profile with ``-o``, its header saying what it was fitted on and how well.
"""

from __future__ import annotations

import json
import sys

from dhelix.cli.paths import output_path, write_output
from dhelix.dsl.core.errors import DhelixError, UsageError


def register(subparsers) -> None:
    """Add the ``calibrate`` command to the CLI's sub-command parsers."""
    cal = subparsers.add_parser(
        "calibrate", help="fit a profile to measured runs; print the leave-one-out error",
        description="Fit the knobs of a hardware profile to measured runs (published ones in a YAML or CSV "
                    "set, or your own `dhelix run --metrics` files) and print each run's error before, after "
                    "and left out of the fit.")
    cal.add_argument("runs", nargs="+", metavar="RUNS", help="a runs file (.yaml, .csv) or a metrics .json")
    cal.add_argument("--sources", metavar="FILE.yaml", help="the sources of a CSV of runs (a YAML with 'sources')")
    cal.add_argument("--profile", metavar="NAME|PATH",
                     help="the profile to start from (default: the runs' GPU's shipped profile, or a metrics "
                          "file's program's own)")
    cal.add_argument("--gpu", metavar="G", help="only the runs on this GPU (a100, h100, a40, …)")
    cal.add_argument("--knobs", default="gemm,overhead,local,cross", metavar="K,…",
                     help="what to fit (default gemm,overhead,local,cross; also attention, streaming)")
    cal.add_argument("-o", "--output", metavar="OUT.yaml", help="write the fitted profile")
    cal.add_argument("--json", action="store_true", help="print the result as JSON")
    cal.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    """`dhelix calibrate`; returns the exit code."""
    from dhelix.dsl.fidelity.fit import KNOBS, fit_profile
    from dhelix.dsl.frontend.profiles import load_profile

    knobs = tuple(k for k in args.knobs.split(",") if k)
    unknown = [k for k in knobs if k not in KNOBS]
    if not knobs or unknown:
        raise UsageError(f"--knobs {args.knobs}: unknown knob(s) {', '.join(unknown) or '(none given)'}; "
                         f"knobs: {', '.join(KNOBS)}")
    output = output_path(args.output, "-o", inputs=args.runs) if args.output else None
    cases, skipped, gpus = _cases(args)
    if not cases:
        raise DhelixError("no run to fit to" + (f" on GPU '{args.gpu}'" if args.gpu else ""),
                          notes=[f"{name}: {why}" for name, why in skipped[:5]])
    if args.profile:
        profile = load_profile(args.profile)
    elif gpus:
        if len(gpus) > 1:
            raise UsageError(f"the runs are on {', '.join(sorted(gpus))}: one profile fits one GPU; "
                             "choose one with --gpu")
        profile = load_profile(next(iter(gpus)))
    else:
        profile = cases[0].program.profile
    progress = (lambda line: print(line, file=sys.stderr)) if not args.json else None
    fit = fit_profile(cases, profile, knobs, progress=progress)
    if args.json:
        print(json.dumps(_as_json(fit, skipped), indent=1))
    else:
        sys.stdout.write(format_fit(fit, skipped))
    if output is not None:
        write_output(output, _profile_text(fit, args.runs))
        if not args.json:
            print(f"wrote {output}")
    return 0


def _cases(args):
    from dhelix.dsl.fidelity.predict import base_profile, metrics_case, profile_name, run_case
    from dhelix.dsl.fidelity.runs import load_runs
    from dhelix.dsl.frontend.profiles import load_profile

    cases, skipped, gpus = [], [], set()
    for path in args.runs:
        if path.endswith(".json"):
            cases.append(metrics_case(path))
            continue
        for run in load_runs(path, args.sources):
            if args.gpu and profile_name(run) != args.gpu.lower():
                continue
            try:
                profile = load_profile(args.profile) if args.profile else base_profile(run)
                cases.append(run_case(run, profile))
                gpus.add(profile_name(run))
            except DhelixError as exc:
                skipped.append((run.id, exc.message.splitlines()[0]))
    return cases, skipped, gpus


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def format_fit(fit, skipped) -> str:
    """The per-run table and the summary lines."""
    lines = [f"{'run':<34} {'layout':<34} {'measured':>10} {'start':>10} {'err':>7} {'fitted':>7} {'loo':>7}"]
    for case, before, after, loo in zip(fit.cases, fit.before, fit.after, fit.loo, strict=True):
        lines.append(f"{case.id[:34]:<34} {case.label[:34]:<34} {case.measured_s:>9.3f}s "
                     f"{case.measured_s * (1 + before):>9.3f}s {_pct(before):>7} {_pct(after):>7} {_pct(loo):>7}")
    for name, why in skipped:
        lines.append(f"{name[:34]:<34} skipped: {why}")
    lines.append(_stats_line("start", fit.before))
    lines.append(_stats_line("fitted", fit.after))
    lines.append(_stats_line("leave-one-out", fit.loo))
    lines.append("fitted: " + ", ".join(f"{k} {fit.start[k]:.4g} -> {fit.values[k]:.4g}" for k in fit.knobs)
                 + f" ({fit.evaluations} evaluations of {len(fit.cases)} runs)")
    return "\n".join(lines) + "\n"


def _stats_line(label: str, errors) -> str:
    absolute = [abs(e) for e in errors]
    return (f"{label:>14}: mean |error| {100 * sum(absolute) / len(absolute):.1f}%, "
            f"max {100 * max(absolute):.1f}% over {len(absolute)} runs")


def _as_json(fit, skipped) -> dict:
    return {"knobs": {k: {"start": fit.start[k], "fitted": fit.values[k]} for k in fit.knobs},
            "runs": [{"id": c.id, "layout": c.label, "measured_s": c.measured_s, "error_start": b,
                      "error_fitted": a, "error_loo": l}
                     for c, b, a, l in zip(fit.cases, fit.before, fit.after, fit.loo, strict=True)],
            "skipped": [{"id": name, "why": why} for name, why in skipped],
            "evaluations": fit.evaluations}


def _profile_text(fit, sources) -> str:
    from dhelix.dsl.frontend.profile_writer import render_profile

    def mean(errors):
        return 100 * sum(abs(e) for e in errors) / len(errors)

    header = [f"Fitted by `dhelix calibrate` on {len(fit.cases)} measured runs of {', '.join(sources)}",
              f"(knobs {', '.join(fit.knobs)}): mean |error| {mean(fit.before):.1f}% before, {mean(fit.after):.1f}% "
              f"fitted, {mean(fit.loo):.1f}% leave-one-out (max {100 * max(abs(e) for e in fit.loo):.1f}%)."]
    notes = {f"achieved.{k}": "[fitted]" for k in ("gemm", "attention", "norm", "add", "activation")}
    notes["kernels.overhead_us"] = "[fitted]"
    return render_profile(fit.profile, notes, header)
