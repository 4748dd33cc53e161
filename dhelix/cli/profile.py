"""`dhelix profile FILE [-o OUT.yaml] [--backend gloo|nccl] [--repeats N] [--nproc N]`:
measure a hardware profile for FILE on the machine and mesh at hand.

Launched like `dhelix run` (local gloo ranks by default, or each process of a ``torchrun``
world), it times every op of the program's layer alone and in the pairs the planner can
choose, fits the link rates, and writes a profile YAML (:mod:`dhelix.interpreter.profiler`,
:mod:`dhelix.dsl.planner.calibrate`). The default output is ``<program>-<host>.yaml`` beside
the program, so that ``cluster { profile = "<program>-<host>.yaml" }`` names it. The output
may not be the program, one of its imports or the profile it names (exit code 2).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from dhelix.dsl.core.errors import DhelixError, UsageError
from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.passes.pipeline import check_text

DEFAULT_REPEATS = 5


def register(subparsers) -> None:
    """Add the ``profile`` command to the CLI's sub-command parsers."""
    prof = subparsers.add_parser(
        "profile", help="measure a hardware profile (op times, overlap, links) for a program on this machine",
        description="Time every op of FILE's forward and backward layer alone and in the pairs the planner "
                    "can choose, on N local gloo ranks (N = the mesh size) or under torchrun, and write a "
                    "profile YAML that `cluster { profile = \"OUT.yaml\" }` accepts.")
    prof.add_argument("file", metavar="FILE")
    prof.add_argument("-o", "--output", metavar="OUT.yaml",
                      help="where to write the profile (default: <program>-<host>.yaml beside the program)")
    prof.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                      help="collective backend (default gloo; nccl needs one GPU per rank)")
    prof.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, metavar="N",
                      help=f"timed repetitions of each measurement, after one warm-up (default {DEFAULT_REPEATS})")
    prof.add_argument("--nproc", type=int, metavar="N", help="local ranks to spawn (must equal the mesh size)")
    prof.add_argument("--timeout", type=float, default=60.0, metavar="S",
                      help="collective timeout in seconds (default 60)")
    prof.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    """`dhelix profile FILE …`: check the program and the output path, then measure."""
    from dhelix.interpreter import launch, profile_launch

    if args.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    text = read_source(args.file)
    program = check_text(text, args.file)
    if program.model is None:
        raise UsageError(f"'{args.file}' is a library file: it has no model to profile")
    out = output_path(args.file, args.output, program, profile_launch.host_name())
    launch.preflight(program)
    command = shlex.join(["dhelix", "profile", args.file, "-o", str(out), "--backend", args.backend,
                          "--repeats", str(args.repeats)])
    options = profile_launch.ProfileOptions(args.file, text, str(out), args.backend, args.repeats,
                                            timeout=args.timeout, command=command)
    world = program.mesh.world
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise DhelixError(f"the mesh has {world} ranks ({launch.describe_mesh(program.mesh)}) but torchrun "
                              f"started {os.environ['WORLD_SIZE']}",
                              notes=["start torchrun with nnodes × nproc-per-node equal to the mesh size"])
        return profile_launch.profile_rank(options, int(os.environ["RANK"]), world, "env://")
    nproc = args.nproc or world
    if nproc != world:
        raise UsageError(f"--nproc {nproc} does not match the mesh: it has {world} ranks "
                         f"({launch.describe_mesh(program.mesh)})")
    return profile_launch.spawn_profile(options, nproc)


def output_path(program_file: str, given: str | None, program, host: str) -> Path:
    """Where the profile goes: ``given``, else ``<program>-<host>.yaml`` beside the program.
    UsageError for a name that is not .yaml, a missing folder, or one of the run's inputs
    (the program, its imports, the profile it names)."""
    source = Path(program_file)
    out = Path(given) if given else source.with_name(f"{source.stem}-{host}.yaml")
    inputs = [Path(path) for path in program.files if path]
    if program.profile is not None and Path(program.profile.path).is_file():
        inputs.append(Path(program.profile.path))
    for path in inputs:
        if path.exists() and out.resolve() == path.resolve():
            raise UsageError(f"-o {out} would overwrite '{path}', an input of this profile run; choose another name")
    if out.suffix.lower() not in (".yaml", ".yml"):
        raise UsageError(f"-o {out}: a profile is a .yaml file")
    if not out.parent.is_dir():
        raise UsageError(f"-o {out}: the folder '{out.parent}' does not exist")
    return out
