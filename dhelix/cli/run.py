"""`dhelix run FILE`: train the program's model with the interpreter.

By default the command spawns one local process per mesh rank and joins them in a gloo
world (the embedded default: no cluster needed). Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) each process is one rank of torchrun's world, NCCL or gloo::

    dhelix run examples/tiny_llama_cpu.dhx --steps 20
    torchrun --nnodes 2 --nproc-per-node 8 ... -m dhelix run FILE --backend nccl

Rank 0 shows a progress bar (loss, tokens/s, step time); the command then prints the summary
(:mod:`dhelix.interpreter.training.summary`): measured step time, exposed communication (time a rank
was blocked on communication), peak activation memory, and the simulator's prediction beside
them. ``--trace out.json`` writes a Chrome trace (:mod:`dhelix.dsl.render.trace`): a process
per rank, a thread per lane; ``--metrics out.json`` the summary's figures, the prediction and
every rank's per-step times as JSON (for scripts). ``--check`` prints every step's comparison with the
single-process reference instead and exits 1 when it differs by more than the tolerance.

A bad run ends with a message and a non-zero exit code, never a hang: the spawner
(:mod:`dhelix.interpreter.launch.spawn`) stops the other ranks as soon as one fails and names it;
collectives time out after ``--timeout`` seconds. Everything that can be checked before the
ranks start is (the program, the output path, what the interpreter supports). torch is
imported only when the command runs, so registering it keeps ``dhelix check`` torch-free.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path

import attrs

from dhelix.cli.as_rank import add_as_rank_arguments, check_as_rank, run_as_rank
from dhelix.cli.launch import (add_launch_arguments, backend_without_torch, check_launch_numbers, check_memory,
                               choose_backend, local_ranks, torchrun_world)
from dhelix.cli.paths import output_folder, output_path, program_inputs, refuse_inputs, write_output
from dhelix.cli.run_options import preflight_data, refuse_data, reporter, run_options, warn, write_trace
from dhelix.dsl.core.errors import DhelixError, OutputError, UsageError
from dhelix.dsl.passes.runcheck import unrunnable
from dhelix.dsl.frontend.imports import read_source
from dhelix.cli.options import add_options, check_options, value_of
from dhelix.cli.overrides import add_profile_argument
from dhelix.dsl.frontend.profilecheck import undeclared_links
from dhelix.dsl.passes.axisuse import unused_axes
from dhelix.dsl.passes.overrides import require_model
from dhelix.dsl.simulator.launch import priced_program
from dhelix.dsl.planner.si_plan import SIMode
from dhelix.dsl.simulator.runplan import build_run_plan, plan_run
from dhelix.interpreter.training.steplog import refuse_earlier_log


def register(subparsers) -> None:
    """Add the ``run`` command to the CLI's sub-command parsers."""
    run = subparsers.add_parser(
        "run", help="train the model with the interpreter on local gloo ranks or under torchrun",
        description="Run FILE's schedule with torch.distributed: by default on N local gloo "
                    "processes (N = the mesh's world size); under torchrun on its world.")
    run.add_argument("file", metavar="FILE")
    add_options(run, group="run")  # steps, seed, lr, … as dhelix.dsl.core.options declares them
    run.add_argument("--no-si", dest="si", action="store_false",
                     help="run SI blocks as a forward then a backward (same numbers, no overlap)")
    run.add_argument("--si-plan", choices=[mode.value for mode in SIMode], default=SIMode.PLANNED.value,
                     help="how SI blocks run: the planner's segment pairs, layer pair by layer pair "
                          "(default), one order of the whole block from the block scheduler, both "
                          "from the profile (op_by_op when the cluster names none), op i beside op "
                          "i, or no interleaving")
    add_launch_arguments(run)
    add_profile_argument(run)
    add_as_rank_arguments(run)
    _add_training_arguments(run)
    run.set_defaults(func=cmd_run)


def _add_training_arguments(run) -> None:
    data = run.add_argument_group("data, checkpoints and the training loop")
    add_options(data, group="training")


def cmd_run(args) -> int:
    """`dhelix run FILE …`: check the program and the output, then run it on a spawned or
    torchrun world and print what rank 0 brings back; returns the exit code. Under torchrun an
    error every rank meets alike is reported once (:func:`_reported_elsewhere`)."""
    started: list[bool] = []
    try:
        with contextlib.ExitStack() as held:  # the --save folder's lock, let go when the command ends
            return _run(args, started, held)
    except DhelixError as exc:
        if _reported_elsewhere(exc, bool(started)):
            _await_the_reporter(exc)
            return 2 if isinstance(exc, UsageError) else 1  # the reporter's exit code
        raise


#: How long a torchrun rank whose error its node's reporter prints waits to be stopped.
REPORTER_GRACE_S = 10.0


def _await_the_reporter(exc: DhelixError) -> None:
    """Under torchrun the first rank of a node to fail makes the node's agent stop the others
    (SIGTERM): a rank that left its error to a reporter on its node (:func:`_reported_elsewhere`)
    waits up to :data:`REPORTER_GRACE_S` for that, so that the reporter is never stopped before
    it has printed the error. The reporter of an error every rank meets alike is global rank 0
    (node 0): the other nodes' ranks leave at once."""
    if getattr(exc, "reported_by_rank_0", False) and os.environ.get("GROUP_RANK", "0") != "0":
        return
    import time

    time.sleep(REPORTER_GRACE_S)


def _reported_elsewhere(exc: DhelixError, started: bool) -> bool:
    """Whether another process of a torchrun world reports ``exc``: the nodes' placement, which
    every rank reads alike, is reported by global rank 0; an error met before the ranks join
    (the command line, the program, the data) by each node's local rank 0. Errors every rank
    meets alike (``reported_by_rank_0``: the placement, a non-finite step) by global rank 0."""
    rank = os.environ.get("RANK")
    if rank is None or "WORLD_SIZE" not in os.environ:
        return False
    if getattr(exc, "reported_by_rank_0", False):  # the placement, a non-finite step
        return rank != "0"
    return not started and not reporter()


def _run(args, started: list, held: contextlib.ExitStack) -> int:
    """The body of :func:`cmd_run`; appends to ``started`` once the ranks begin to join; the
    locks it takes go into ``held``."""
    _check_numbers(args)
    check_launch_numbers(args)
    continuing = args.resume is not None  # --resume auto too: the same run, started again
    args.resume, verified = _resume_auto(args.save) if args.resume == "auto" else (args.resume, None)
    outputs = _outputs(args, held)
    if args.check and args.json:
        raise UsageError("--check prints every step's comparison with the reference; it has no --json")
    if args.check and (outputs or args.resume):
        raise UsageError(f"--check compares every step with the reference and prints that; it writes no "
                         f"{' or '.join(outputs) or '--resume'} (run without --check for them)")
    if args.init and (args.resume or args.check):
        raise UsageError(f"--init starts a run from Hugging Face weights; {'--resume' if args.resume else '--check'} "
                         "starts from its own (give one of them)")
    if len({os.path.realpath(path) for path in outputs.values()}) < len(outputs):
        raise UsageError(f"{' and '.join(outputs)} name the same file; give each its own")
    _say_first(args)
    text = read_source(args.file)
    world = torchrun_world()
    hosted = None  # the env:// store, when this process hosts it for the compile handed over
    if world is not None and args.as_rank is None:
        # One compile for the whole world: global rank 0's, handed to the others (store.py).
        from dhelix.interpreter.launch import store

        build = functools.partial(_compile, args, text, outputs)
        compiled, hosted = store.compiled_once(build, world, "run", value_of(args, "timeout"))
        program = compiled.program
        fits = _check_memory_early(args, program)  # this node's memory, on every node
        from dhelix.interpreter.launch import join, spawn
        from dhelix.interpreter.training import train
    else:
        program, choices = _checked_program(args, text, outputs)
        if args.as_rank is not None:
            return run_as_rank(args, text, program, choices, outputs)
        fits = _check_memory_early(args, program)  # before torch is imported and the SI blocks planned
        from dhelix.interpreter.launch import join, spawn

        spawn.warm_up_ranks()  # local ranks: their process server loads torch meanwhile
        from dhelix.interpreter.training import train

        compiled = _planned(args, text, program, choices)
    placed = join.torchrun_rank(program)
    if args.topology == "measured" and placed is None:
        raise UsageError("--topology measured applies under torchrun: the local launcher's ranks share this "
                         "machine on purpose (the cluster block's nodes are emulated); run without it")
    nproc = local_ranks(args, program, torchrun=placed is not None)
    options = run_options(args, compiled, choose_backend(args.backend, nproc))
    if (args.tokenizer or args.eval_data) and options.data is None:
        raise UsageError(f"{'--tokenizer' if args.tokenizer else '--eval-data'} goes with training data: give --data, "
                         "or a train block's data")
    if not fits:  # the backend needed torch to tell
        warn(filter(None, [check_memory(program, nproc, options.backend, force=args.force)]))
    for given in (options.data, options.eval_data):
        if given is not None:
            refuse_data(outputs, given)
    if "--log" in outputs:  # an earlier run's log only when continuing that run
        try:
            refuse_earlier_log(outputs["--log"], continuing)
        except UsageError as exc:
            raise UsageError(f"--log {exc.message}", notes=[*exc.notes, "--resume continues that run and its log"]) from None
    preflight_data(options, verified)
    _print_header(program, options, args, placed, nproc, compiled.choices)
    started.append(True)
    if placed is not None:
        replanned = {}

        def replan(options, gpus_per_node: int):
            # The measured nodes decide the lanes: compiled again, once for the world (rank 0's,
            # handed over), before the rank runs anything.
            if gpus_per_node not in replanned:
                from dhelix.interpreter.launch import store

                build = functools.partial(build_run_plan, text, args.file, profile=args.profile,
                                          gpus_per_node=gpus_per_node, mode=args.si_plan, interleave=args.si)
                replanned[gpus_per_node] = store.from_rank_0(build, *placed, f"run-{gpus_per_node}-per-node",
                                                             store.env_address())
            return attrs.evolve(options, compiled=replanned[gpus_per_node])

        assert program.mesh is not None  # a model file
        result = join.run_rank(options, *placed, train.train, gpus_per_node=program.mesh.gpus_per_node,
                               replan=replan, host=hosted)
    else:
        result = spawn.run_local(options, nproc, train.train)
    if result is None:  # not global rank 0: rank 0 reports for the run
        return 0
    if result.gpus_per_node is not None:  # the run used the measured nodes: so does its prediction
        options = replan(options, result.gpus_per_node)
    return report(options.compiled.program, options, result, outputs.get("--trace"), outputs.get("--metrics"),
                  as_json=args.json)


def _checked_program(args, text: str, outputs: dict) -> tuple:
    """The priced program of ``text`` and the choices made (:func:`priced_program`), checked
    for a run: a model, ``--as-rank``, outputs that are no input, what the interpreter cannot
    run (raised), warnings printed."""
    program, choices = priced_program(text, args.file, args.profile)
    require_model(program, args.file)
    check_as_rank(args, program)
    for flag, path in outputs.items():
        refuse_inputs(path, flag, program_inputs(program))
    warn([*unused_axes(program), *undeclared_links(program)])
    for problem in unrunnable(program):  # check warns; a run cannot go on
        raise DhelixError(problem.message, problem.span, problem.notes)
    return program, choices


def _planned(args, text: str, program, choices: tuple):
    """The RunPlan of the checked ``program`` (its SI blocks planned), which the interpreter
    can run (:func:`~dhelix.interpreter.training.train.preflight`)."""
    from dhelix.interpreter.training import train

    compiled = plan_run(program, args.file, choices, mode=args.si_plan, interleave=args.si, text=text)
    train.preflight(program, compiled.reference)
    return compiled


def _compile(args, text: str, outputs: dict):
    """The run compiled: :func:`_checked_program`, then :func:`_planned` (under torchrun,
    global rank 0's command runs this for the whole world)."""
    program, choices = _checked_program(args, text, outputs)
    return _planned(args, text, program, choices)


def _say_first(args) -> None:
    """The command's first line, at once: what it does before any rank starts (compiling a
    paper-scale program takes seconds); standard error with ``--json``; once per node."""
    if reporter():
        print(f"dhelix run: {args.file}: compiling, then checking that it fits this machine's memory before any "
              "rank starts", file=sys.stderr if args.json else sys.stdout, flush=True)


def _check_memory_early(args, program) -> bool:
    """:func:`~dhelix.cli.launch.check_memory` before torch is imported, when the backend is
    known without it (:func:`~dhelix.cli.launch.backend_without_torch`: gloo); returns
    whether it checked (raising DhelixError when the run does not fit, unless ``--force``)."""
    if backend_without_torch(args.backend) != "gloo":
        return False
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if torchrun else local_ranks(args, program, torchrun=False)
    warn(filter(None, [check_memory(program, local, "gloo", force=args.force)]))
    return True


def _outputs(args, held: contextlib.ExitStack) -> dict:
    """The run's output files and folder by option, each checked (:mod:`dhelix.cli.paths`),
    none inside a checkpoint folder; the --save folder's lock goes into ``held``."""
    from dhelix.interpreter.training.manifest import inside_checkpoint

    outputs = {flag: output_path(value, flag, inputs=(args.file,))
               for flag, value in (("--trace", args.trace), ("--metrics", args.metrics), ("--log", args.log),
                                   ("--export-weights", args.export_weights)) if value}
    for flag, path in outputs.items():
        if (folder := inside_checkpoint(path, args.save)) is not None:
            raise UsageError(f"{flag} {path}: that is inside the checkpoint folder '{folder}', whose files are the "
                             "checkpoint's; give a path outside it")
    if args.save:
        outputs["--save"] = _save_folder(args.save, args.resume, held)
    return outputs


def _print_header(program, options, args, placed, nproc: int, choices=()) -> None:
    """Say what runs before the ranks start (training takes a while), what the planner
    chose for the program's ``auto`` settings (``choices``, :func:`priced_program`'s) and
    what data trains (or that none was given: seeded random tokens):
    standard output, or standard error with ``--json`` (whose output is the JSON alone);
    once per node."""
    from dhelix.interpreter.training import summary

    if not reporter():
        return
    ranks = program.mesh.world if placed is not None else nproc
    line = summary.run_header(args.file, program.pipeline.name, summary.describe_mesh(program.mesh), ranks,
                              options.backend, summary.describe_si(program, options))
    what = "checking every step against the single-process reference" if options.check else "training"
    out = sys.stderr if args.json else sys.stdout
    print(f"dhelix run: {line}; {what}, {options.steps} step(s)", file=out, flush=True)
    if choices:  # each choice's head: what was chosen, not every candidate's time (dhelix plan lists those)
        chosen = "; ".join(f"{choice.block} {choice.describe().split(' (')[0]}" for choice in choices)
        print(f"  chosen by the planner: {chosen}", file=out, flush=True)
    print(f"  data: {summary.describe_data(options.data, options.eval_data)}", file=out, flush=True)


def _check_numbers(args) -> None:
    """UsageError for an option out of its declared range (:func:`~dhelix.cli.options.check_options`),
    a blend's weights that do not parse, or a save option without --save."""
    check_options(args)
    if args.data:  # the blend's weights, before anything is compiled
        from dhelix.interpreter.training.blend import parse_items

        parse_items(args.data, "--data")
    for flag, value in (("--save-every", args.save_every), ("--keep", args.keep)):
        if value is not None and not args.save:
            raise UsageError(f"{flag} needs --save DIR (where to save)")


def _save_folder(text: str, resume: str | None, held: contextlib.ExitStack) -> Path:
    """``--save DIR`` as a folder the run may create or add saves to (probed), locked for this
    run (:class:`~dhelix.interpreter.training.manifest.FolderLock`, by global rank 0 under
    torchrun; into ``held``: another run saving there is refused), refused when it holds
    another run's checkpoint: only a run resumed from that folder may save over it."""
    from dhelix.interpreter.training.checkpoint import saves_in
    from dhelix.interpreter.training.manifest import FolderLock

    path = output_folder(text, "--save")
    if os.environ.get("RANK", "0") == "0" or "WORLD_SIZE" not in os.environ:
        held.enter_context(FolderLock(path))
    saves = saves_in(path) if path.is_dir() else []
    # The same run: resumed from this folder or from one of its saves.
    same = resume is not None and os.path.realpath(path) in (
        os.path.realpath(resume), os.path.dirname(os.path.realpath(resume)))
    if saves and not same:
        raise UsageError(f"--save {text}: the folder holds a checkpoint of another run ({saves[-1].name}), which "
                         f"this run's saves would replace; continue that run with --resume {text}, or give "
                         "another folder")
    return path


def _resume_auto(save: str | None) -> tuple[str | None, list]:
    """``--resume auto``: the newest intact save in ``--save DIR`` (damaged saves skipped,
    each with a warning) and what verifying it said, or (None, []) to start afresh; says
    which on standard error. Every rank of a torchrun world reads the same folder by the
    same rule (and rank 0's choice holds, :func:`~dhelix.interpreter.training.train.train`)."""
    from dhelix.dsl.core.errors import DhelixWarning
    from dhelix.interpreter.training.manifest import intact_saves

    if not save:
        raise UsageError("--resume auto continues from the newest save in --save DIR: give --save")
    root = Path(save)
    for folder, warnings, damage in intact_saves(root) if root.is_dir() else ():
        if damage is not None:
            warn([DhelixWarning(f"--resume auto: {damage.message}; this save is skipped", notes=damage.notes)])
            continue
        warn([f"dhelix run: --resume auto: continuing from {folder}"])
        return str(folder), warnings
    warn([f"dhelix run: --resume auto: no save in {save} yet; starting from the first step"])
    return None, []


def report(program, options, result, trace: Path | None, metrics: Path | None = None, *,
           as_json: bool = False) -> int:
    """Print the checks (``--check``: exit 1 past the tolerance, raised as DhelixError) or
    the summary (``as_json``: the metrics as JSON, alone on standard output), and write the
    trace and the metrics; returns the exit code."""
    from dhelix.interpreter.training import summary

    if options.check:
        from dhelix.interpreter.verify.harness import worst_excess

        for check in result.checks:
            print(check)
        ratio, quantity, worst, tolerance, step = worst_excess(result.checks)
        nearest = (f"{quantity} of step {step}, {worst:.2e} {'>' if ratio > 1 else '<='} {tolerance:.2e} "
                   f"({program.model.dtype}: its floor + eps·√(terms summed)·|reference value|)")
        if ratio > 1:
            print(f"check: FAILED: {len(result.checks)} step(s), worst difference: {nearest}")
            raise DhelixError(f"the interpreter differs from the reference by {worst:.2e} in the {quantity} of "
                              f"step {step}, more than {tolerance:.2e} ({program.model.dtype})")
        print(f"check: passed: {len(result.checks)} step(s) match the single-process reference, nearest its "
              f"tolerance: {nearest}")
        return 0
    figures = summary.summarize(program, options, result)
    numbers = json.dumps(summary.metrics(figures, options, result), indent=1) + "\n"
    print(numbers if as_json else "dhelix run: " + summary.format_summary(figures), end="" if as_json else "\n")
    _report_training(options, result, sys.stderr if as_json else sys.stdout)
    try:
        if metrics is not None:
            write_output(metrics, numbers)
        if trace is not None:
            write_trace(trace, program, options, result)
            print(f"trace: {trace} ({len(result.events)} events; open in Perfetto or chrome://tracing)",
                  file=sys.stderr if as_json else sys.stdout)
    except OutputError as exc:
        exc.add_note("the training finished: the summary above and the other outputs are complete")
        raise
    return 0


def _report_training(options, result, out) -> None:
    """The lines about what the training loop kept (the held-out loss, saves, weights, log),
    printed to ``out``."""
    import math

    from dhelix.interpreter.training import summary

    if result.losses:
        print(f"loss: {result.losses[0]:.4f} at the first step run, {result.losses[-1]:.4f} at step {options.steps}",
              file=out)
    if result.evals:
        step, loss = result.evals[-1]
        print(f"held-out: loss {loss:.4f}, perplexity {math.exp(min(loss, 80.0)):.2f} after step {step + 1}, over "
              f"{summary.held_out_extent(result.held_out)}", file=out)
    if result.skipped:
        shown = ", ".join(map(str, result.skipped[:10])) + (" …" if len(result.skipped) > 10 else "")
        print(f"skipped: {len(result.skipped)} step(s) whose loss or gradient norm was not finite ({shown})",
              file=out)
    if result.rollbacks:
        print(summary.rollback_line(result.rollbacks), file=out)
    if options.resume:
        print(f"resumed: from {options.resume}", file=out)
    if options.save:
        print(f"checkpoint: {options.save} (step {options.steps}, the {options.keep} newest saves kept; resume "
              f"with --resume {options.save})", file=out)
    if options.export_weights:
        print(f"weights: {options.export_weights} (torch.load it into the reference model's load_state_dict)",
              file=out)
    if options.log:
        board = Path(options.log).with_suffix(".tb")
        scalars = (f"TensorBoard scalars in {board}" if board.is_dir() else
                   "no TensorBoard scalars: tensorboard is not installed")
        print(f"log: {options.log} (one JSON line per step and per evaluation; {scalars})", file=out)


