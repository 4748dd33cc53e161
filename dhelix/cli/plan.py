"""`dhelix plan FILE [--json] [--max-segment N]`: the SI plan of a schedule file's layer pair.

Every layer of a model has the same DAG, so one plan (the forward of one strand's layer beside
the backward of the other strand's) is what every layer pair of every SI block runs. The
command prints where the plan is used (how many layer pairs per step), then the plan table of
:func:`dsl.core.plan.format_plan`: per segment pair its ops by lane, predicted time and time
alone, then the sequential time, the speedup and the communication hidden, and whether the plan
is the fastest (``--certify`` works it out where the search was bounded). ``--json`` prints
the same as JSON (:func:`dsl.core.plan.plan_to_json` under ``"plan"``), keys in a fixed order.

A file without a hardware profile is an error located at its cluster block (the cost model
needs one); a library file (no model) is an error too.
"""

from __future__ import annotations

import json
import sys

from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.planner.chunking import ChunkChoice
from dhelix.dsl.planner.pairing import AUTO, DEFAULT_EXACT_PAIRS, DEFAULT_MAX_SEGMENT
from dhelix.cli.overrides import add_profile_argument
from dhelix.dsl.passes.overrides import require_model
from dhelix.dsl.simulator.launch import priced_program
from dhelix.dsl.core.plan import format_plan, optimality_line, plan_to_json
from dhelix.dsl.core.program import Program
from dhelix.dsl.core.schedule import Interleaved
from dhelix.dsl.simulator.events import require_profile, schedule_plan
from dhelix.dsl.simulator.si_pairs import plan_optimality


def register(subparsers) -> None:
    """Add the ``plan`` command to the CLI's sub-command parsers."""
    plan = subparsers.add_parser(
        "plan", help="search and print the SI plan of the file's layer pair",
        description="Check FILE, search the best strand-interleaving plan of its layer pair (forward of "
                    "one strand beside the backward of the other) on the cluster's hardware profile, and "
                    "print its segment pairs, lanes, predicted and sequential time, speedup and hidden "
                    "communication.")
    plan.add_argument("file", metavar="FILE")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--certify", action="store_true",
                      help="where the search was bounded, say how far the plan can be from the fastest: the "
                           "search with segments of any length where it is small enough (seconds), else a "
                           "proven lower bound of every plan")
    plan.add_argument("--max-segment", type=int, metavar="N", default=None,
                      help=f"at most N ops per segment (0: no bound; default: no bound, so the plan is exact, "
                           f"when the strands have at most {DEFAULT_EXACT_PAIRS} pairs of segments, else "
                           f"{DEFAULT_MAX_SEGMENT})")
    add_profile_argument(plan)
    plan.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    """`dhelix plan FILE [--json] [--max-segment N]`; returns the exit code."""
    if args.max_segment is not None and args.max_segment < 0:
        raise UsageError(f"--max-segment must be 0 (no bound) or more, got {args.max_segment}")
    program, chunks = priced_program(read_source(args.file), args.file, args.profile)
    require_model(program, args.file)
    require_profile(program)
    plan = schedule_plan(program, max_segment=AUTO if args.max_segment is None else args.max_segment or None)
    usage = plan_usage(program)
    known = plan_optimality(program, plan) if args.certify else None
    if args.json:
        assert program.model is not None  # require_model
        # The planner's choices: a `by auto` count with the layer's time at each count tried;
        # the others (group orders, substitutions, launch counts) as their one-line description.
        data = {"file": args.file, "model": program.model.name, "layer": program.model.layer,
                "profile": program.profile.name, **usage, "plan": plan_to_json(plan),
                "optimality": optimality_json(plan, known),
                "chunks": [{"ops": list(c.ops), "chosen": c.chosen,
                            "candidates": {c2.value: c2.seconds for c2 in c.candidates}}
                           for c in chunks if isinstance(c, ChunkChoice)],
                "choices": [c.describe() for c in chunks if not isinstance(c, ChunkChoice)]}
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return 0
    sys.stdout.write(plan_header(args.file, program, usage) + "\n"
                     + "".join(f"{choice.block} {choice.describe()}\n" for choice in chunks) + format_plan(plan)
                     + optimality_line(plan, known) + _next_step(plan, known) + "\n")
    return 0


def _next_step(plan, known) -> str:
    """What to run next after the optimality line: --certify where nothing was checked, the
    faster plan's command where one was found."""
    if known is None and optimality_line(plan).startswith("optimality: not checked"):
        return "; plan --certify compares it with every order and segmentation"
    if known is not None and known.faster(plan):
        return "; plan --max-segment 0 shows that plan"
    return ""


def optimality_json(plan, known) -> dict:
    """``--json``'s optimality: the line as text, and the figures behind it where worked out."""
    data = {"text": optimality_line(plan, known)}
    if known is not None:
        data.update(exact=known.exact, fastest=known.fastest, lower_bound=known.floor)
    return data


def plan_usage(program: Program) -> dict:
    """Where the plan runs: SI blocks and layer pairs per step (summed over pipeline ranks),
    and whether the backward it pairs lacks the wgrads (a schedule that splits W off)."""
    lowered, stages = program.lowered, program.placement.stages
    assert lowered is not None, "a validated model"
    blocks = pairs = 0
    for rank, row in enumerate(lowered.actions):
        for action in row:
            if isinstance(action, Interleaved):
                blocks += 1
                fwd = stages[lowered.stage_of(rank, action.fwd.chunk)]  # (validated: on the placement)
                bwd = stages[lowered.stage_of(rank, action.bwd.chunk)]
                pairs += min(len(fwd.layers), len(bwd.layers))
    return {"pipeline": lowered.name, "fold": program.placement.kind, "ranks": lowered.ranks,
            "microbatches": lowered.microbatches, "chunks": lowered.chunks, "si_blocks": blocks,
            "layer_pairs": pairs, "backward_without_wgrad": lowered.split}


def plan_header(path: str, program: Program, usage: dict) -> str:
    """The lines above the plan table: file, model, profile, schedule and where the plan runs."""
    assert program.model is not None, "a model file"
    lines = [f"{path}: model {program.model.name}, layer {program.model.layer}, profile {program.profile.name}; "
             f"{usage['pipeline']} on fold {usage['fold']} (p={usage['ranks']}, m={usage['microbatches']}, "
             f"v={usage['chunks']})"]
    if usage["si_blocks"]:
        lines.append(f"every layer pair of an SI block runs this plan: {usage['layer_pairs']} layer pairs in "
                     f"{usage['si_blocks']} SI blocks per step (all pipeline ranks)")
    else:
        lines.append("the schedule has no SI blocks: this is the plan an SI block would run")
    if usage["backward_without_wgrad"]:
        lines.append("the schedule splits W off, so the backward here is B without its wgrad ops")
    return "\n".join(lines) + "\n"
