"""`dhelix generate FILE --pipeline zb`: the zero-bubble scheduler's pipeline for FILE's sizes.

The times of one pipeline stage come from FILE's profile through the simulator's cost model
(:func:`dhelix.dsl.search.generated.stage_costs`: per layer forward, input gradient and weight
gradient, times the layers of a stage, and the pipeline transfer), or from ``--times``. The scheduler is
:func:`dhelix.dsl.planner.zero_bubble.generate`; the file written checks as a library and
imports into FILE (``import "OUT.dhx"``, ``pipeline zb_auto``, ``fold none``).
"""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.passes.unittime import Costs, timed_run
from dhelix.dsl.planner.zero_bubble import generate, pipeline_text
from dhelix.dsl.search.generated import stage_costs, w_share

#: The generated pipeline's name.
NAME = "zb_auto"


def write_pipeline(args) -> int:
    """Write (or print) the generated pipeline for ``args.target``; returns the exit code."""
    from dhelix import api
    from dhelix.dsl.passes.fold import placement_for
    from dhelix.dsl.passes.lower import lower_pipeline
    from dhelix.dsl.frontend.parser import parse

    program = api.load_program(args.target)
    assert program.mesh is not None and program.train is not None and program.model is not None, \
        "load_program refuses a file without a model"
    ranks, microbatches = program.mesh.size("pp"), program.train.microbatches
    limit = ranks if args.memory is None else args.memory
    if limit < 1:
        raise UsageError("--memory must be at least 1 (micro-batches of activations a rank may hold)")
    costs, source = (_parse_times(args.times), "--times") if args.times else (stage_costs(program), "the profile")
    unit = "" if args.times else " ms"
    share = w_share(program)
    generated = generate(ranks, microbatches, costs, limit, share)
    placement = placement_for("none", None, program.model.setting("layers"), ranks)

    def span(pipeline) -> Fraction:
        return timed_run(lower_pipeline(pipeline, ranks=ranks, microbatches=microbatches, placement=placement),
                         costs).makespan

    text = pipeline_text(generated, NAME)
    ours = span(parse(text, "generated.dhx", start="pipeline_def"))
    zb_h1 = span(next(p for p in program.pipelines if p.name == "zb_h1")) \
        if any(p.name == "zb_h1" for p in program.pipelines) else None
    header = (f"Written by `dhelix generate {args.target} --pipeline zb`: the zero-bubble heuristic "
              f"(W policy '{generated.policy}')\n"
              f"for p = {ranks}, m = {microbatches}, at most {limit} micro-batches of activations per rank (a W "
              f"keeping {float(share):.2g} of one), with the times of {source}:\n"
              f"F {_number(costs.f, unit)}, B {_number(costs.b, unit)}, W {_number(costs.w, unit)}, "
              f"transfer {_number(costs.transfer, unit)}; "
              f"make-span {_number(ours, unit)}" + (f" (zb_h1: {_number(zb_h1, unit)})" if zb_h1 is not None else "") + ".\n"
              f"Use it with `import \"{Path(args.output).name if args.output else 'THIS.dhx'}\"`, "
              f"`fold none` and `pipeline {NAME}`.")
    text = pipeline_text(generated, NAME, header)
    if args.output:
        Path(args.output).write_text(text)
        print(f"{args.output}: pipeline {NAME} for p = {ranks}, m = {microbatches}, in flight <= {limit}; "
              f"make-span {_number(ours, unit)}" + (f", zb_h1 {_number(zb_h1, unit)}" if zb_h1 is not None else ""))
    else:
        sys.stdout.write(text)
    return 0


def _parse_times(text: str) -> Costs:
    try:
        values = [Fraction(part.strip()) for part in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (3, 4) or any(v < 0 for v in values) or any(v == 0 for v in values[:3]):
        raise UsageError(f"--times {text}: give F,B,W (and the transfer C) as positive numbers, e.g. 1,1,1 or 1,2,1,0.5")
    return Costs(*values)


def _number(value, unit: str) -> str:
    """``value`` in milliseconds when ``unit`` says so (seconds given), else as given."""
    return f"{float(value) * 1e3:.4g} ms" if unit else f"{float(value):g}"
