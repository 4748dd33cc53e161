"""`dhelix simulate FILE [--compare] [--zero1] [--si-plan P] [--trace OUT.json]`: predict one training step.

Prints the simulator's report (:func:`dsl.simulator.report.format_simulation`): step time,
tokens/s, TFLOPS/GPU, MFU, bubble ratio, communication hidden and exposed, and memory per
pipeline rank. ``--compare`` prints instead the side-by-side table of the program as written
and minus one feature at a time (:func:`dsl.simulator.report.compare`). ``--zero1`` shards the optimizer states (and
reduce-scatters the gradients, all-gathers the weights) over the data-parallel group.
``--si-plan scheduled`` prices the SI blocks whole in the block scheduler's order, as
``dhelix run --si-plan scheduled`` runs them. ``--trace`` writes the Chrome trace of the run
as written (open it in ui.perfetto.dev): a process per pipeline rank, a thread per lane, and
inside each SI block its segment pairs, with the collectives each pair hides drawn on their
lanes (:mod:`dsl.simulator.pairtrace`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dhelix.cli.paths import output_path, program_inputs, refuse_inputs, write_output
from dhelix.dsl.core.errors import DhelixError, ErrorGroup, UsageError
from dhelix.cli.overrides import add_profile_argument
from dhelix.dsl.passes.overrides import require_model
from dhelix.dsl.simulator.launch import priced_program
from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.frontend.profilecheck import undeclared_links
from dhelix.dsl.simulator.report import (compare, format_comparison, format_simulation,
                                         memory_warnings, simulation_metrics)
from dhelix.dsl.simulator.events import Simulation, has_si, require_profile, schedule_plan, simulate
from dhelix.dsl.planner.si_plan import SIMode
from dhelix.dsl.simulator.costs import cost_of
from dhelix.dsl.render.trace import trace_json


def register(subparsers) -> None:
    """Add the ``simulate`` command to the CLI's sub-command parsers."""
    sim = subparsers.add_parser(
        "simulate", help="predict step time, MFU, bubble, hidden communication and memory",
        description="Simulate one training step of FILE over every pipeline rank (one representative "
                    "DP/TP replica) on the cluster's hardware profile, with SI blocks from the plan.")
    sim.add_argument("file", metavar="FILE")
    sim.add_argument("--compare", action="store_true",
                     help="compare with the program minus one feature at a time: without SI, as 1F1B without "
                          "folding, without its partition block, without its model-level overlaps (those it has)")
    sim.add_argument("--zero1", action="store_true",
                     help="shard optimizer states over the data-parallel group (ZeRO-1, distributed optimizer), "
                          "as `train { zero = 1 }` does")
    sim.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace (Perfetto) of the run as written")
    sim.add_argument("--strict", action="store_true",
                     help="a rank whose predicted peak memory exceeds the profile's device memory is an "
                          "error (exit 1), not a warning")
    sim.add_argument("--si-plan", choices=(SIMode.PLANNED.value, SIMode.SCHEDULED.value), default=SIMode.PLANNED.value,
                     help="price SI blocks layer pair by layer pair with the planner's plan, or whole in "
                          "the block scheduler's order (as `dhelix run --si-plan` runs them)")
    add_profile_argument(sim)
    sim.add_argument("--json", action="store_true",
                     help="print the figures as JSON instead of the tables (seconds, bytes, ratios; with "
                          "--compare a list, one object per simulation)")
    sim.set_defaults(func=cmd_simulate)


def cmd_simulate(args) -> int:
    """`dhelix simulate FILE [--compare] [--zero1] [--trace OUT.json] [--strict]`; returns the exit code."""
    trace = trace_path(args.trace, args.file) if args.trace else None
    program, chunks = priced_program(read_source(args.file), args.file, args.profile)
    require_model(program, args.file)
    if trace is not None:
        refuse_inputs(trace, "--trace", program_inputs(program))
    require_profile(program)
    cost = cost_of(program)
    plan = schedule_plan(program, cost) if has_si(program) else None
    assert program.mesh is not None  # require_profile: a model file
    title = f"{args.file}: profile {program.profile.name}, mesh " + " ".join(
        f"{axis}{size}" for axis, size in zip(program.mesh.order, program.mesh.sizes, strict=True) if size > 1)
    if plan is not None:
        title += (f"; SI plan per layer pair {plan.total * 1e3:.3f} ms vs {plan.sequential * 1e3:.3f} ms "
                  f"sequential ({plan.speedup:.3f}x)")
    title += "".join(f"\n{choice.block} {choice.describe()}" for choice in chunks)
    scheduled = args.si_plan == SIMode.SCHEDULED
    if plan is not None and scheduled:
        title += "; SI blocks priced whole by the block scheduler"
    sims = compare(program, plan, zero1=args.zero1, scheduled=scheduled) if args.compare else (
        simulate(program, plan, zero1=args.zero1, cost=cost, label="as written", scheduled=scheduled),)
    if args.json:
        figures = [simulation_metrics(sim) for sim in sims]
        print(json.dumps(figures if args.compare else figures[0], indent=1))
    else:
        sys.stdout.write(format_comparison(sims, title) if args.compare else format_simulation(sims[0], title))
    if trace is not None:
        # Again with the SI blocks' segment pairs and the collectives they hide in the trace.
        detailed = simulate(program, plan, zero1=args.zero1, cost=cost, label=sims[0].label, scheduled=scheduled,
                            detail=True)
        write_trace(trace, detailed, args.file)
        # With --json, standard output is the JSON alone.
        print(f"wrote {trace} (open it in https://ui.perfetto.dev)", file=sys.stderr if args.json else sys.stdout)
    return memory_verdict(program, sims[0], args.strict)


def memory_verdict(program, sim: Simulation, strict: bool) -> int:
    """Print a warning per rank whose predicted peak exceeds the device memory (standard
    error), or with ``strict`` raise them as errors; returns the exit code otherwise. The
    profile's links for levels the program does not declare are warned of either way (they
    say nothing about the prediction)."""
    sys.stdout.flush()  # the table first, then what it means
    for warning in undeclared_links(program):
        print(warning.render(), file=sys.stderr)
    warnings = memory_warnings(program, sim)
    if strict and warnings:
        errors = [DhelixError(w.message, w.span, w.notes) for w in warnings]
        raise errors[0] if len(errors) == 1 else ErrorGroup(errors)
    for warning in warnings:
        print(warning.render(), file=sys.stderr)
    return 0


def write_trace(path: Path, sim: Simulation, source: str) -> None:
    """Write the Chrome trace of ``sim`` to ``path``; UsageError if it cannot be written."""
    metadata = {"source": source, "program": sim.program, "schedule": sim.pipeline, "fold": sim.fold,
                "si": sim.si, "zero1": sim.zero1, "step_time_s": round(sim.step_time, 9),
                "simulated": "one DP/TP replica: a process per pipeline rank"}
    write_output(path, trace_json(sim.events, counters=sim.counters, process_name="pipeline rank {rank}",
                                  metadata=metadata))


def trace_path(text: str, program_file: str) -> Path:
    """The ``--trace`` path after checking that it is a .json file and
    :func:`paths.output_path`'s rules. Raises UsageError; creates nothing."""
    if Path(text).suffix.lower() != ".json":
        raise UsageError(f"--trace {text}: a Chrome trace is a .json file")
    return output_path(text, "--trace", inputs=(program_file,))
