"""`dhelix report FILE -o report.html [--profile P] [--run metrics.json]`: one page that shows a schedule.

Writes one self-contained HTML file (:mod:`dhelix.dsl.render.report`): the commands that
reproduce it, the pipeline, the placement, the layer DAG, the SI pairing ladder, every pipeline
rank's simulated step with hidden and exposed communication per lane, memory per rank
against the device, the ``simulate --compare`` table and, with ``--run`` (the JSON of
``dhelix run --metrics``), measured beside predicted. Diagrams are Graphviz's SVG inlined
when ``dot`` is installed, their text form otherwise (said on the page and here). The page
names no network address and runs no script. ``-o`` never overwrites an input (the program,
its imports, its profile, the ``--run`` file). ``--run`` metrics written for another
program (their fingerprint of its sources differs) are refused; metrics without one (an
older dhelix's) are taken with a warning.
"""

from __future__ import annotations

import shlex
import shutil
import sys

from dhelix.cli.overrides import add_profile_argument
from dhelix.cli.paths import output_path, program_inputs, refuse_inputs, write_output
from dhelix.dsl.core.errors import DhelixError, DhelixWarning, UsageError
from dhelix.dsl.core.textfile import FileProblem, read_text_file
from dhelix.dsl.frontend.imports import read_source, sources_digest
from dhelix.dsl.passes.overrides import require_model
from dhelix.dsl.render.dot import inline_svg, run_dot
from dhelix.dsl.render.report import parse_metrics, report_html
from dhelix.dsl.simulator.events import has_si, require_profile, schedule_plan, simulate
from dhelix.dsl.simulator.costs import cost_of
from dhelix.dsl.simulator.launch import priced_program
from dhelix.dsl.simulator.report import compare


def register(subparsers) -> None:
    """Add the ``report`` command to the CLI's sub-command parsers."""
    report = subparsers.add_parser(
        "report", help="write one self-contained HTML page showing the schedule, its prediction and a run",
        description="Write one HTML file (no network, no script) with FILE's pipeline, placement, layer DAG, "
                    "pairing ladder, each rank's simulated step, memory per rank, the --compare table and, "
                    "with --run, a run's measured figures beside the prediction.")
    report.add_argument("file", metavar="FILE")
    report.add_argument("-o", "--output", metavar="OUT.html", required=True, help="the page to write (.html)")
    add_profile_argument(report)
    report.add_argument("--run", metavar="METRICS.json",
                        help="a run's figures, as `dhelix run FILE --metrics METRICS.json` wrote them")
    report.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    """`dhelix report FILE -o OUT.html [--profile P] [--run METRICS.json]`; returns the exit code."""
    inputs = (args.file, *((args.run,) if args.run else ()))
    output = output_path(args.output, "-o", inputs=inputs)
    metrics = read_metrics(args.run) if args.run else None
    text = read_source(args.file)
    program, _ = priced_program(text, args.file, args.profile)
    require_model(program, args.file)
    if metrics is not None:
        same_program(metrics, args.run, args.file, sources_digest(program.files, text))
    refuse_inputs(output, "-o", (*program_inputs(program), *inputs))
    if output.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"-o {args.output}: the report is an .html file")
    require_profile(program)
    cost = cost_of(program)
    plan = schedule_plan(program, cost) if has_si(program) else None
    sims = compare(program, plan)
    # The first column again, with the SI blocks' segment pairs in its trace.
    sims = (simulate(program, plan, cost=cost, label=sims[0].label, detail=True), *sims[1:])
    dot = shutil.which("dot")
    page = report_html(program, sims, plan, source=args.file, commands=commands(args),
                       draw=(lambda source: inline_svg(run_dot(dot, source, "svg", args.output).decode()))
                       if dot else (lambda source: None), metrics=metrics)
    write_output(output, page)
    print(f"wrote {output}" + ("" if dot else " (diagrams as text: Graphviz `dot` is not installed)"))
    return 0


def read_metrics(path: str) -> dict:
    """The metrics JSON at ``path`` (``--run``); UsageError when it cannot be read."""
    try:
        text = read_text_file(path)
    except FileProblem as exc:
        raise UsageError(f"--run {path}: cannot read it: {exc.reason}") from None
    try:
        return parse_metrics(text, path)
    except DhelixError as exc:
        exc.add_note("--run takes the file `dhelix run FILE --metrics OUT.json` wrote")
        raise


def same_program(metrics: dict, path: str, file: str, digest: str) -> None:
    """Refuse the metrics at ``path`` (``--run``) when they were written for another program
    than ``file`` (whose sources' digest is ``digest``: a UsageError, for the page would show
    one program's run beside another's prediction); warn when they carry no fingerprint
    (an older dhelix wrote them: nothing to compare)."""
    written = metrics.get("program")
    found = written.get("sources_sha256") if isinstance(written, dict) else None
    if found is None:
        print(DhelixWarning(f"--run {path}: these metrics name no fingerprint of their program (an older dhelix "
                            f"wrote them): nothing tells they are a run of {file}",
                            notes=[f"`dhelix run {file} --metrics {path}` writes one"]).render(), file=sys.stderr)
    elif found != digest:
        ran = metrics.get("file")
        ran = f"'{ran}', " if isinstance(ran, str) else ""
        raise UsageError(f"--run {path}: those are the metrics of a run of another program ({ran}sources {found}), "
                         f"not of {file} as it is now (sources {digest}); give the metrics `dhelix run {file} "
                         "--metrics OUT.json` writes")


def commands(args) -> list[str]:
    """The command lines that reproduce the page (and the figures it shows)."""
    file, profile = shlex.quote(args.file), (f" --profile {shlex.quote(args.profile)}" if args.profile else "")
    lines = [f"dhelix check {file}",
             f"dhelix render {file} --what pipeline -o pipeline.svg",
             f"dhelix simulate {file}{profile} --compare --trace step.json"]
    run = shlex.quote(args.run or "run.json")
    lines.append(f"dhelix run {file}{profile} --metrics {run}")
    lines.append(f"dhelix report {file} -o {shlex.quote(args.output)}{profile} --run {run}")
    return lines
