"""`dhelix run FILE`: train the program's model with the interpreter.

By default the command spawns one local process per mesh rank and joins them in a gloo
world (the embedded default: no cluster needed). Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) each process is one rank of torchrun's world, NCCL or gloo::

    dhelix run examples/tiny_llama_cpu.dhx --steps 20
    torchrun --nnodes 2 --nproc-per-node 8 ... -m dhelix run FILE --backend nccl

Rank 0 shows a progress bar (loss, tokens/s, step time); the command then prints the summary
(:mod:`dhelix.interpreter.summary`): measured step time, exposed communication (time a rank
was blocked on communication), peak activation memory, and the simulator's prediction beside
them. ``--trace out.json`` writes a Chrome trace (:mod:`dhelix.dsl.render.trace`): a process
per rank, a thread per lane; ``--metrics out.json`` the summary's figures, the prediction and
every rank's per-step times as JSON (for scripts). ``--check`` prints every step's comparison with the
single-process reference instead and exits 1 when it differs by more than the tolerance.

A bad run ends with a message and a non-zero exit code, never a hang: the spawner
(:mod:`dhelix.interpreter.spawn`) stops the other ranks as soon as one fails and names it;
collectives time out after ``--timeout`` seconds. Everything that can be checked before the
ranks start is (the program, the output path, what the interpreter supports). torch is
imported only when the command runs, so registering it keeps ``dhelix check`` torch-free.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dhelix.cli.launch import add_launch_arguments, check_launch_numbers, choose_backend, local_ranks
from dhelix.cli.paths import output_path, program_inputs, refuse_inputs, write_output
from dhelix.dsl.core.errors import DhelixError, UsageError
from dhelix.dsl.frontend.imports import read_source
from dhelix.cli.overrides import add_profile_argument
from dhelix.dsl.passes.overrides import checked_program, require_model
from dhelix.dsl.render.trace import trace_json


def register(subparsers) -> None:
    """Add the ``run`` command to the CLI's sub-command parsers."""
    run = subparsers.add_parser(
        "run", help="train the model with the interpreter on local gloo ranks or under torchrun",
        description="Run FILE's schedule with torch.distributed: by default on N local gloo "
                    "processes (N = the mesh's world size); under torchrun on its world.")
    run.add_argument("file", metavar="FILE")
    run.add_argument("--steps", type=int, metavar="K",
                     help="training steps (default: the train block's steps, else 10)")
    run.add_argument("--no-si", dest="si", action="store_false",
                     help="run SI blocks as a forward then a backward (same numbers, no overlap)")
    run.add_argument("--si-plan", choices=("planned", "op_by_op", "sequential"), default="planned",
                     help="segment pairs of SI blocks: the planner's (default; op_by_op when the "
                          "cluster names no profile), op i beside op i, or no interleaving")
    run.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace of what ran")
    run.add_argument("--metrics", metavar="OUT.json",
                     help="write the summary's figures as JSON: step time and exposed communication "
                          "(medians without the first step), the simulator's prediction of both, and "
                          "every rank's per-step times, in seconds")
    run.add_argument("--seed", type=int,
                     help="seed of the weights and the data (default: the train block's seed, else 0)")
    run.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    run.add_argument("--zero1", action="store_true",
                     help="shard the optimizer state over dp (ZeRO-1), as `train { zero = 1 }` does")
    run.add_argument("--check", action="store_true",
                     help="compare every step's loss and gradients with the single-process reference")
    run.add_argument("--json", action="store_true",
                     help="print the summary's figures as JSON (what --metrics writes) instead of the table")
    add_launch_arguments(run, what="train")
    add_profile_argument(run)
    run.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    """`dhelix run FILE …`: check the program and the output, then run it on a spawned or
    torchrun world and print what rank 0 brings back; returns the exit code."""
    if args.steps is not None and args.steps < 1:
        raise UsageError("--steps must be at least 1")
    check_launch_numbers(args)
    outputs = {flag: output_path(value, flag, inputs=(args.file,))
               for flag, value in (("--trace", args.trace), ("--metrics", args.metrics)) if value}
    if args.check and args.json:
        raise UsageError("--check prints every step's comparison with the reference; it has no --json")
    if args.check and outputs:
        raise UsageError(f"--check compares every step with the reference and prints that; it writes no "
                         f"{' or '.join(outputs)} (run without --check for them)")
    if len({os.path.realpath(path) for path in outputs.values()}) < len(outputs):
        raise UsageError(f"--trace and --metrics name the same file '{args.trace}'; give each its own")
    text = read_source(args.file)
    program = checked_program(text, args.file, args.profile)
    require_model(program, args.file)
    for flag, path in outputs.items():
        refuse_inputs(path, flag, program_inputs(program))
    from dhelix.interpreter import spawn

    spawn.quiet_numpy_warning()  # before torch is first imported
    from dhelix.interpreter import train

    train.preflight(program)
    placed = spawn.torchrun_rank(program)
    nproc = local_ranks(args, program, torchrun=placed is not None)
    options = run_options(args, text, program, choose_backend(args.backend, nproc))
    if placed is not None:
        result = spawn.run_rank(options, *placed, train.train, gpus_per_node=program.mesh.gpus_per_node)
    else:
        result = spawn.run_local(options, nproc, train.train)
    if result is None:  # not global rank 0: rank 0 reports for the run
        return 0
    return report(program, options, result, outputs.get("--trace"), outputs.get("--metrics"), as_json=args.json)


def run_options(args, text: str, program, backend: str):
    """The interpreter's RunOptions from the command line and the program's train block."""
    from dhelix.interpreter import train

    plan, pairs = train.si_plan(program, args.si_plan) if args.si else (args.si_plan, None)
    return train.RunOptions(
        path=args.file, text=text,
        steps=args.steps if args.steps is not None else program.train.steps or train.DEFAULT_STEPS,
        backend=backend, si=args.si, plan=plan, trace=args.trace,
        seed=args.seed if args.seed is not None else program.train.seed, lr=args.lr,
        zero1=args.zero1 or program.train.zero >= 1, timeout=args.timeout, check=args.check, pairs=pairs,
        profile=_profile_for_ranks(args.profile))


def _profile_for_ranks(profile: str | None) -> str | None:
    """``--profile`` as the ranks must read it: a file by its absolute path (a torchrun
    rank may start elsewhere), a shipped name as it is."""
    if profile is None or not profile.endswith((".yaml", ".yml")) and "/" not in profile:
        return profile
    return str(Path(profile).resolve())


def report(program, options, result, trace: Path | None, metrics: Path | None = None, *,
           as_json: bool = False) -> int:
    """Print the checks (``--check``: exit 1 past the tolerance, raised as DhelixError) or
    the summary (``as_json``: the metrics as JSON, alone on standard output), and write the
    trace and the metrics; returns the exit code."""
    from dhelix.interpreter import summary

    if options.check:
        for check in result.checks:
            print(check)
        worst = summary.worst_difference(result.checks)
        if worst > summary.CHECK_TOLERANCE:
            raise DhelixError(f"the interpreter differs from the reference by {worst:.2e}, more than "
                              f"{summary.CHECK_TOLERANCE}")
        return 0
    figures = summary.summarize(program, options, result)
    numbers = json.dumps(summary.metrics(figures, options, result), indent=1) + "\n"
    print(numbers if as_json else "dhelix run: " + summary.format_summary(figures), end="" if as_json else "\n")
    if metrics is not None:
        write_output(metrics, numbers)
    if trace is not None:
        write_trace(trace, program, options, result)
        print(f"trace: {trace} ({len(result.events)} events; open in Perfetto or chrome://tracing)",
              file=sys.stderr if as_json else sys.stdout)
    return 0


def write_trace(path: Path, program, options, result) -> None:
    """Write the Chrome trace of a run's ``result`` (every rank's events, measured) to
    ``path``; UsageError if it cannot be written."""
    metadata = {"source": options.path, "program": program.model.name, "schedule": program.pipeline.name,
                "backend": options.backend, "si": options.si, "si_plan": options.plan, "zero1": options.zero1,
                "steps": options.steps, "measured": "dhelix run: a process per rank, a thread per lane"}
    write_output(path, trace_json(result.events, metadata=metadata))
