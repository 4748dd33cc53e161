"""`dhelix tune FILE [--gpus N] [--keep S,…] [--partitions] [--generated] [--stages] [--budget SECONDS] [--memory-margin GB|%]
[--top K] [--uncertainty [--robust]] [--measure K [--measure-steps N]] [-o best.dhx] [--json] [--profile P]`: search
the fastest schedule that fits.

FILE gives the model, the cluster and the global batch (its dp × micro_batch × microbatches
sequences); `tune` searches the mesh, micro-batches, ZeRO stage, recomputation,
``param_gather``, with ``--partitions`` Centauri's partition, fold, pipeline (with
``--generated`` the zero-bubble scheduler's too, :mod:`dhelix.dsl.search.generated`), with
``--stages`` the end stages' layers, where the profile has a host section the optimizer's
states in host memory (the share offloaded too, :mod:`dhelix.dsl.search.offload`), and SI on or off
(``train { si }``, for the pipelines that write SI blocks; a file that writes it keeps it)
(:mod:`dhelix.dsl.search`), keeping what ``--keep`` names as written, and prints the
top K that fit the device's memory, less a reserve kept free (``--memory-margin``,
:mod:`dhelix.dsl.search.headroom`), with one line on why the best wins; ``-o`` writes the best
as a formatted program that `check` and `run` take; ``--json`` prints the result as JSON.
``--uncertainty`` prices the top K again within what the profile does not know
(:mod:`dhelix.dsl.search.uncertainty`), ``--robust`` chooses the best worst case of them.
``--measure K`` then runs the K fastest for a few steps where the program runs and chooses the
measured fastest instead (:mod:`dhelix.cli.tune_measure`).
"""

from __future__ import annotations

import json
import os
import sys

import attrs

from dhelix.cli.launch import torchrun_world
from dhelix.cli.overrides import add_profile_argument
from dhelix.cli.paths import output_path, program_inputs, write_output
from dhelix.cli.tune_measure import (add_measure_arguments, check_launchable, check_measure_numbers, format_measurement,
                                     kept_steps, measure_top, measurement_json)
from dhelix.dsl.core.errors import DhelixError, UsageError
from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.frontend.imports import load_modules, read_source
from dhelix.dsl.frontend.limits import limit_of
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.passes.overrides import require_model
from dhelix.dsl.search import headroom, uncertainty
from dhelix.dsl.search.explain import (differences, format_outcome, format_spreads, memory_cap, size_text, step_parts,
                                       why_best)
from dhelix.dsl.search.space import KEEPABLE, space_of
from dhelix.dsl.search.pricer import Priced
from dhelix.dsl.search.tune import Outcome, Pricer, search
from dhelix.dsl.search.variant import relocate, require_main_blocks, variant_text, with_profile_setting
from dhelix.dsl.simulator.events import require_profile
from dhelix.dsl.simulator.report import simulation_metrics


def register(subparsers) -> None:
    """Add the ``tune`` command to the CLI's sub-command parsers."""
    tune = subparsers.add_parser(
        "tune", help="search the fastest schedule that fits: mesh, micro-batches, ZeRO, recomputation, fold, pipeline, SI",
        description="Search the mesh factorization, micro-batch size and count (at the file's global batch), "
                    "ZeRO stage, recomputation, optimizer offload (where the profile has a host section: a choice "
                    "offloads the share of its optimizer states it needs to fit, where it does not fit without), fold, "
                    "pipeline and SI on/off for FILE's model on its cluster; price every candidate with the step "
                    "simulator under the device's memory (branch and bound: exact) and "
                    "print the fastest.")
    tune.add_argument("file", metavar="FILE")
    tune.add_argument("--gpus", type=int, metavar="N",
                      help="search for N GPUs (a multiple of the cluster's gpus_per_node) instead of the cluster's")
    tune.add_argument("--keep", metavar="S,…", default="",
                      help=f"settings that stay as written, comma-separated: {', '.join(KEEPABLE)}")
    tune.add_argument("--budget", type=float, metavar="SECONDS",
                      help="stop after this many seconds with the best found so far (default: search to the end)")
    tune.add_argument("--partitions", action="store_true",
                      help="search Centauri's partition too: the file's own partition block (or none) against one "
                           "generated for each layout, the planner choosing its chunk counts, substitutions and "
                           "orders (slower: a candidate's chunk counts are settled by simulating its step)")
    tune.add_argument("--generated", action="store_true",
                      help="search the zero-bubble scheduler's pipelines too (zb_1p and zb_2p, fold none: at most p "
                           "and 2p-1 micro-batches in flight per rank), written for each layout from its F, B and W "
                           "times; the winner's file holds the one it picked")
    tune.add_argument("--stages", action="store_true",
                      help="search uneven pipeline stages too: on each pipeline size, both end stages (the "
                           "embedding's and the LM head's) lighter by the least that leaves the others an equal "
                           "share, and the last alone so (train { first_stage_layers last_stage_layers }); a pipeline "
                           "size that does not divide the layers can then work")
    tune.add_argument("--memory-margin", metavar="GB|%", default=None,
                      help="memory kept free on every device for the CUDA context, the collectives' buffers and "
                           "fragmentation: gigabytes (2.5) or a part of the device (8%%); a choice fits when its "
                           f"peak fits in the rest (default {headroom.DEFAULT.describe().replace('%', '%%')})")
    tune.add_argument("--top", type=int, default=5, metavar="K", help="how many to show (default 5)")
    tune.add_argument("-j", "--jobs", type=int, metavar="N", default=None,
                      help=f"search with N processes side by side (default: this machine's cores, at most "
                           f"{MAX_DEFAULT_JOBS}; one where processes cannot be forked); without --budget the result is the "
                           "same as with 1, the counts may differ")
    tune.add_argument("--uncertainty", action="store_true",
                      help="price the top K again within the profile's uncertainty (collective efficiency, GEMM "
                           "efficiency, link latency: every corner of their ranges) and show each one's median and "
                           "worst step, marking a choice whose rank changes")
    tune.add_argument("--robust", action="store_true",
                      help="with --uncertainty: choose the best worst case of the top K (for -o and --json too)")
    add_measure_arguments(tune)
    tune.add_argument("-o", "--output", metavar="OUT.dhx",
                      help="write the best (with --measure: the measured fastest) as a program file")
    tune.add_argument("--json", action="store_true", help="print the result as JSON")
    add_profile_argument(tune)
    tune.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    """`dhelix tune FILE …`; returns the exit code."""
    if not 1 <= args.top <= 100:
        raise UsageError(f"--top must be between 1 and 100, got {args.top}")
    jobs = default_jobs() if args.jobs is None else args.jobs
    if jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {jobs}")
    if args.budget is not None and not args.budget > 0:
        raise UsageError(f"--budget must be a positive number of seconds, got {args.budget}")
    check_measure_numbers(args)
    reserve = _reserve(args.memory_margin)
    text = read_source(args.file)
    modules = load_modules(text, args.file)
    if args.profile is not None:
        modules = with_profile_setting(modules, os.path.abspath(args.profile) if _is_file(args.profile) else args.profile)
    checked = check_program(modules)
    require_model(checked, args.file)
    require_main_blocks(modules, args.file)
    require_profile(checked)
    measured = checked.profile.measured is not None
    # Every candidate is priced by the profile's derived rates (tune.Pricer), the file too.
    base = passes.rerun(attrs.evolve(checked, profile=attrs.evolve(checked.profile, measured=None)), after="check")
    output = output_path(args.output, "-o", inputs=program_inputs(base)) if args.output else None
    world = _world(args.gpus, base)
    keep = tuple(name.strip() for name in args.keep.split(",") if name.strip())
    try:
        space = space_of(base, world, keep, partitions=args.partitions, generated=args.generated,
                         stages=args.stages)
    except UsageError as exc:
        raise UsageError(f"--keep: {exc.message}") from None
    if args.measure is not None:
        check_launchable(base, world, args.budget)
    pricer = Pricer(modules, base, world, reserve)
    if pricer.capacity is not None and pricer.capacity <= 0:
        raise UsageError(f"--memory-margin {reserve.describe()}: it leaves nothing of the device's "
                         f"{pricer.memory_gb:g} GB")
    try:
        outcome = search(pricer, space, top=args.top, budget=args.budget, progress=_progress_bar(args.json), jobs=jobs)
    except DhelixError as exc:
        if jobs > 1:
            exc.add_note(f"it searched with --jobs {jobs}: -j 1 searches in this process alone")
        raise
    assert base.model is not None and base.cluster is not None  # check_launchable's and the space's checks
    title = (f"{args.file}: model {base.model.name} on {world} GPUs ({world // base.cluster.gpus_per_node} x "
             f"{base.cluster.gpus_per_node}), profile {base.profile.name}, global batch {space.sequences} "
             f"sequences of {base.model.get('seq')}")
    if outcome.memory_gb is not None:
        title += (f"\nkept free on each device: {outcome.reserve_gb:.2f} GB (--memory-margin {reserve.describe()}: "
                  "CUDA context, collective buffers, fragmentation)")
    if measured:
        title += ("\nthe profile's measured op times belong to one mesh and shape: every candidate is priced "
                  "with its derived rates (peak, links, overlap) instead")
    spread = None
    if (args.uncertainty or args.robust) and outcome.top:
        spread = _spreads(outcome, modules, base, world, reserve, args.robust)
        if args.robust:
            outcome = attrs.evolve(outcome, top=tuple(s.priced for s in spread))
    measurement = None
    if args.measure is not None and outcome.top:
        measurement = _measure(args, outcome, title, pricer, text, world)
        if measurement is None:
            return 0  # another rank of a torchrun world: global rank 0 reports and writes
    if args.json:
        found = _json(outcome, args.file, world, space.sequences, measurement)
        if spread is not None:
            found["uncertainty"] = {"knobs": [attrs.asdict(k) for k in uncertainty.KNOBS], "robust": args.robust,
                                    "top": [{"choice": s.priced.choice.settings(), "steps_s": list(s.steps),
                                             "median_s": s.median, "worst_s": s.worst, "ranks": list(s.ranks),
                                             "rank_changes": s.flips} for s in spread]}
        print(json.dumps(found, indent=1, default=list))
    elif measurement is not None:
        sys.stdout.write(format_measurement(measurement, _prediction_note(checked)))
    else:
        sys.stdout.write(format_outcome(outcome, title))
        if spread is not None:
            sys.stdout.write("\n" + format_spreads(spread, uncertainty.KNOBS, args.robust, outcome.gpus_per_node))
    if measurement is not None and measurement.best is None:
        print("dhelix tune: no candidate could be measured, nothing chosen" + (f" ({output} not written)"
                                                                              if output is not None else ""),
              file=sys.stderr)
        return 1
    if output is not None and outcome.top:
        _write_best(output, outcome, measurement, pricer, text, args.file, world, base.profile.name, args.json)
    if not outcome.top:
        print(_nothing_fits(outcome, args.budget), file=sys.stderr)
        return 1
    return 0


def _spreads(outcome: Outcome, modules, base, world: int, reserve, robust: bool):
    """``--uncertainty``: the top choices priced at every corner of the profile's uncertainty
    (:mod:`dhelix.dsl.search.uncertainty`), by worst step with ``robust``."""
    def price_at(factors):
        profile = uncertainty.perturbed(base.profile, factors)
        pricer = Pricer(modules, attrs.evolve(base, profile=profile), world, reserve)

        def price(priced) -> float:
            result = pricer.price(priced.choice)
            return result.seconds if isinstance(result, Priced) else float("inf")
        return price

    found = uncertainty.spreads(outcome.top, price_at)
    return uncertainty.most_robust(found) if robust else found


def _measure(args, outcome: Outcome, title: str, pricer: Pricer, text: str, world: int):
    """``--measure``: the search's table first (the measuring takes a while), then its
    fastest run (:func:`~dhelix.cli.tune_measure.measure_top`); their Measurement, or None
    on a torchrun rank other than global rank 0 (which alone prints)."""
    reporter = torchrun_world() in (None, (0, world))
    if reporter and not args.json:
        sys.stdout.write(format_outcome(outcome, title) + "\n")
        sys.stdout.flush()
    measurement = measure_top(outcome.top[:args.measure], pricer, text, args.file, args.measure_steps)
    return measurement if reporter else None


def _write_best(output, outcome: Outcome, measurement, pricer: Pricer, text: str, path: str, world: int,
                profile: str, quiet: bool) -> None:
    """Write the chosen program to ``output``: the search's best, or with a ``measurement``
    its measured fastest, with a header saying what it is."""
    best = outcome.top[0] if measurement is None else measurement.best.priced
    variant = pricer.variant(best.choice, load_modules(text, path))  # the file's own profile
    why = (f"the fastest of {outcome.choices:,} choices that fit" if measurement is None else
           f"the measured fastest of the {len(measurement.rows)} fastest predicted (predicted "
           f"#{measurement.best.predicted_rank} of the {outcome.choices:,} choices searched)")
    header = (f"Written by `dhelix tune {path}` on {world} GPUs, profile {profile}: {why}.\nPredicted step "
              f"{best.seconds * 1e3:,.3f} ms, {best.sim.tokens_per_second:,.0f} tokens/s, MFU {best.sim.mfu:.1%}, "
              f"peak {best.sim.peak_rank.memory / 1e9:.2f} GB.")
    if measurement is not None:
        header += (f"\nMeasured step {measurement.best.seconds * 1e3:,.3f} ms (median of {kept_steps(measurement.steps)}, "
                   f"{measurement.best.ranks} {measurement.best.backend} ranks).")
    write_output(output, variant_text(relocate(variant, path, str(output)), text, header))
    if not quiet:
        print(f"wrote {output}")


def _prediction_note(checked) -> str:
    """What the predictions beside the measurements are for: this machine's measured profile,
    or another machine's (then the ratio compares two machines, and says how to price this one)."""
    from dhelix.interpreter.training.summary import profile_provenance

    note = "predicted " + profile_provenance(checked.profile, checked.cluster.profile)
    if checked.profile.measured is None or "not on this machine" in note:
        note += (": measured/predicted compares two machines, so read the orders, not the times "
                 "(`dhelix profile FILE -o here.yaml`, then `tune --profile here.yaml` prices this one)")
    return note


#: The most processes `tune` starts unless told (``--jobs``): each keeps its own caches.
MAX_DEFAULT_JOBS = 8


def default_jobs() -> int:
    """The processes `tune` searches with by default: the cores this process may run on, at
    most :data:`MAX_DEFAULT_JOBS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_JOBS, cores))


def _world(gpus: int | None, base) -> int:
    per_node = base.cluster.gpus_per_node
    if gpus is None:
        return base.cluster.nodes * per_node
    if gpus < 1 or gpus % per_node:
        raise UsageError(f"--gpus {gpus}: give a positive multiple of the cluster's gpus_per_node ({per_node})")
    nodes = limit_of("cluster", "nodes")
    if gpus > nodes * per_node:
        raise UsageError(f"--gpus {gpus}: at most {nodes:,} nodes of {per_node} ({nodes * per_node:,} GPUs), the "
                         "cluster block's limit")
    return gpus


def _reserve(text: str | None) -> headroom.Reserve:
    """``--memory-margin``'s reserve (the default without it)."""
    if text is None:
        return headroom.DEFAULT
    try:
        return headroom.parse_reserve(text)
    except UsageError as exc:
        raise UsageError(f"--memory-margin: {exc.message}") from None


def _is_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or "/" in name


def _nothing_fits(outcome: Outcome, budget: float | None) -> str:
    """Why the search found no choice: the time budget, the memory (the nearest choice's
    need against what a device leaves), the checks' refusals — each that ruled some out."""
    why = []
    if not outcome.complete:
        why.append(f"--budget {budget:g} s ran out before any choice that fits was priced ({outcome.simulated:,} "
                   f"simulated of {outcome.choices:,}): give it more time")
    if outcome.too_big:
        need = "" if outcome.nearest_gb is None else (
            f": the nearest needs {'' if outcome.nearest_exact else 'at least '}{size_text(outcome.nearest_gb * 1e9)} "
            f"against the {memory_cap(outcome)}")
        why.append(f"{outcome.too_big:,} over the memory{need}; --memory-margin sets the reserve, and ZeRO, "
                   "recomputation and more pipeline stages need less")
    if outcome.refused:
        shown = "; ".join(f"{reason} ({n:,})" for reason, n in outcome.reasons[:3])
        why.append(f"{outcome.refused:,} refused by the checks: {shown}")
    if not why:
        why.append("the space is empty (see --keep)")
    return "no choice fits: " + "\n  ".join(why)


def _progress_bar(quiet: bool):
    """A progress callback: a tqdm bar on a terminal when tqdm is installed, else nothing."""
    if quiet or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = {}

    def update(done: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, desc="layouts", unit="layout", leave=False)
        if done == 0:
            return
        bar["bar"].total = total
        bar["bar"].n = done
        bar["bar"].refresh()
        if done >= total:
            bar["bar"].close()
    return update


def _json(outcome: Outcome, path: str, world: int, sequences: int, measurement=None) -> dict:
    best = outcome.top[0].choice if outcome.top else None
    found = {
        "file": path, "gpus": world, "sequences": sequences, "complete": outcome.complete,
        "searched": {"choices": outcome.choices, "layouts": outcome.layouts, "simulated": outcome.simulated,
                     "fit": outcome.fit,
                     "pruned": outcome.pruned, "over_memory": outcome.too_big, "refused": outcome.refused,
                     "same": outcome.same, "plans": outcome.plans, "seconds": outcome.seconds, "jobs": outcome.jobs,
                     "best_found_s": outcome.found},
        "memory_gb": outcome.memory_gb, "reserve_gb": outcome.reserve_gb,
        "top": [{"choice": p.choice.settings(), "differs": differences(p.choice, outcome.top[0].choice), "parts_s": step_parts(p.sim),
                 "offloads": p.choice.layout.offload != "none", **simulation_metrics(p.sim)} for p in outcome.top],
        "why": why_best(outcome.top[0], outcome.top[1]) if len(outcome.top) > 1 else None,
    }
    if measurement is not None:
        found["measured"] = measurement_json(measurement)
    chosen = best if measurement is None else measurement.best.priced.choice if measurement.best else None
    found["chosen"] = None if chosen is None else chosen.settings()
    return found
