"""``--as-rank R`` of `dhelix run` and `dhelix profile`: one rank of the program's whole mesh alone
in this process (:mod:`dhelix.interpreter.ops.standin`), its options, their checks and the run's
report. torch is imported only when a rank runs."""

from __future__ import annotations

import json
import os
import sys

import attrs

from dhelix.cli.launch import check_memory, choose_backend
from dhelix.cli.paths import write_output
from dhelix.cli.run_options import preflight_data, refuse_data, run_options, warn, write_trace
from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.simulator.runplan import plan_run
from dhelix.interpreter.training.train import EMULATIONS  # torch-free at import


def add_as_rank_arguments(parser) -> None:
    """Add ``--as-rank`` and ``--emulate-links`` (run and profile: one rank of the program's
    world alone on this machine)."""
    parser.add_argument("--as-rank", type=int, metavar="R",
                        help="run rank R of the program's whole mesh alone in this process, at its real shard "
                             "shapes, every collective and pipeline transfer a stand-in on its lane (the real "
                             "job's shapes, order, streams, memory and time; not its numbers)")
    parser.add_argument("--emulate-links", choices=EMULATIONS, default="copy",
                        help="with --as-rank, what a stand-in transfer costs: copy its bytes on the wire through "
                             "pinned host memory on its lane (default), keep the lane busy for the profile's "
                             "predicted time (sleep), or nothing (none)")


def check_as_rank(args, program) -> None:
    """UsageError for ``--as-rank`` out of the mesh, under torchrun, or with what needs the
    other ranks; and for ``--emulate-links`` without it."""
    if args.as_rank is None:
        if args.emulate_links != "copy":
            raise UsageError("--emulate-links goes with --as-rank R (one rank run alone)")
        return
    world = program.mesh.world
    if not 0 <= args.as_rank < world:
        raise UsageError(f"--as-rank {args.as_rank}: the mesh has ranks 0 to {world - 1} ({world} in all)")
    if "WORLD_SIZE" in os.environ:
        raise UsageError("--as-rank runs one rank alone in this process; under torchrun every process is a rank "
                         "already: run without --as-rank")
    for flag in ("check", "save", "resume", "export_weights", "nproc"):
        if getattr(args, flag, None):
            raise UsageError(f"--{flag.replace('_', '-')} needs the other ranks' real values; --as-rank runs one "
                             "rank with stand-in transfers (run without --as-rank for it)")


def run_as_rank(args, text: str, program, choices, outputs: dict) -> int:
    """``dhelix run --as-rank R``: rank R alone in this process (:func:`~dhelix.interpreter.launch.join.run_as_rank`),
    then its figures beside the simulator's for its stage."""
    from dhelix.interpreter.launch import join
    from dhelix.interpreter.training import rank_summary, train

    compiled = plan_run(program, args.file, choices, mode=args.si_plan, interleave=args.si, text=text)
    train.preflight(program, compiled.reference)
    options = attrs.evolve(run_options(args, compiled, choose_backend(args.backend, 1)), as_rank=args.as_rank,
                           emulate=args.emulate_links)
    warn(filter(None, [check_memory(program, 1, options.backend, force=args.force)]))
    if options.data is not None:
        refuse_data(outputs, options.data)
    preflight_data(options)
    print(f"dhelix run: {args.file}: rank {args.as_rank} of {program.mesh.world} alone on "
          f"{'the GPU' if options.backend == 'nccl' else 'the CPU'}, links emulated by {args.emulate_links}; "
          f"{options.steps} step(s)", file=sys.stderr if args.json else sys.stdout, flush=True)
    result = join.run_as_rank(options, train.train)
    figures = rank_summary.summarize_rank(program, options, result)
    numbers = json.dumps(rank_summary.rank_metrics(figures), indent=1) + "\n"
    print(numbers if args.json else "dhelix run: " + rank_summary.format_rank(
        figures, args.file, program.pipeline.name, program.mesh), end="" if args.json else "\n")
    if outputs.get("--metrics") is not None:
        write_output(outputs["--metrics"], numbers)
    if outputs.get("--trace") is not None:
        write_trace(outputs["--trace"], program, options, result)
    if outputs.get("--log") is not None:
        print(f"log: {outputs['--log']} (one JSON line per step)", file=sys.stderr if args.json else sys.stdout)
    return 0
