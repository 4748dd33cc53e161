"""`dhelix profile FILE [-o OUT.yaml] [--backend gloo|nccl] [--repeats N] [--nproc N]`:
measure a hardware profile for FILE on the machine and mesh at hand.

Launched like `dhelix run` (local gloo ranks by default, or each process of a ``torchrun``
world, :mod:`dhelix.interpreter.launch.spawn`), the ranks time every op of the program's layer alone
and in the pairs the planner can choose (:mod:`dhelix.interpreter.measure.profiler`); rank 0 brings
the pooled samples back and this command fits the link rates, derives the profile
(:mod:`dhelix.dsl.planner.calibrate`), writes it as YAML stamped with the machine, torch
version, backend, date and command, reads it back through the schema and prints a summary.
What the profile cannot measure comes from the program's own profile (its cluster block), or
the shipped ``h100`` when it names none.

The default output is ``<program>-<host>.yaml`` beside the program, so that
``cluster { profile = "<program>-<host>.yaml" }`` names it. The output is checked before any
rank starts (:mod:`dhelix.cli.paths`): it may not be the program, one of its imports or the
profile it names, and must be a ``.yaml`` file that can be written (exit code 2).
"""

from __future__ import annotations

import functools
import os
import shlex
from datetime import datetime, timezone
from pathlib import Path

from dhelix.cli.launch import add_launch_arguments, check_launch_numbers, choose_backend, local_ranks, torchrun_world
from dhelix.cli.options import value_of
from dhelix.cli.paths import output_path, program_inputs, refuse_inputs, write_output
from dhelix.cli.as_rank import add_as_rank_arguments, check_as_rank
from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.passes.overrides import for_measuring, require_model
from dhelix.dsl.simulator.runplan import measuring_plan

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
    prof.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, metavar="N",
                      help=f"timed repetitions of each measurement, after one warm-up (default {DEFAULT_REPEATS})")
    add_launch_arguments(prof)
    add_as_rank_arguments(prof)
    prof.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    """`dhelix profile FILE …`: check the program and the output path, measure on the
    ranks, write the profile; returns the exit code."""
    if args.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    check_launch_numbers(args)
    text = read_source(args.file)
    world = torchrun_world()
    hosted = None  # the env:// store, when this process hosts it for the compile handed over
    if world is not None and args.as_rank is None:
        # One compile for the whole world: global rank 0's, handed to the others (store.py).
        from dhelix.interpreter.launch import store

        build = functools.partial(_compile, args, text)
        compiled, hosted = store.compiled_once(build, world, "profile", value_of(args, "timeout"))
    else:
        compiled = _compile(args, text)
    program = compiled.program
    from dhelix.interpreter.measure import profile_launch
    from dhelix.interpreter.launch import join, spawn

    out = _output(args, program, profile_launch.host_name())
    alone = args.as_rank is not None
    placed = None if alone else join.torchrun_rank(program)
    nproc = 1 if alone else local_ranks(args, program, torchrun=placed is not None)
    backend = choose_backend(args.backend, nproc)
    command = shlex.join(["dhelix", "profile", args.file, "-o", str(out), "--backend", backend,
                          "--repeats", str(args.repeats)]
                         + (["--as-rank", str(args.as_rank), "--emulate-links", args.emulate_links] if alone else []))
    assert program.train is not None and program.mesh is not None  # a model file
    options = profile_launch.ProfileOptions(path=args.file, compiled=compiled, backend=backend,
                                            repeats=args.repeats, timeout=value_of(args, "timeout"),
                                            seed=program.train.seed, as_rank=args.as_rank,
                                            emulate=args.emulate_links)
    if alone:
        samples = join.run_as_rank(options, profile_launch.measure_layer)
    elif placed is not None:
        samples = join.run_rank(options, *placed, profile_launch.measure_layer,
                                gpus_per_node=program.mesh.gpus_per_node, host=hosted)
    else:
        samples = spawn.run_local(options, nproc, profile_launch.measure_layer)
    if samples is None:  # not global rank 0: rank 0 writes the profile
        return 0
    profile = write_profile(out, program, options, samples, command, profile_launch.host_name())
    print(summary(args.file, out, program, options, samples, profile))
    return 0


def _compile(args, text: str):
    """The RunPlan ``dhelix profile`` measures (:func:`measuring_plan`), checked: a model,
    ``--as-rank``, a program the interpreter can run (under torchrun, global rank 0's command
    runs this for the whole world)."""
    from dhelix.interpreter.training import train

    program = for_measuring(text, args.file)  # a stale measured profile is what this replaces
    require_model(program, args.file)
    check_as_rank(args, program)
    compiled = measuring_plan(program, args.file)
    train.preflight(program, compiled.reference)
    return compiled


def _output(args, program, host: str) -> Path:
    """The checked output path: ``-o``, else ``<program>-<host>.yaml`` beside the program."""
    source = Path(args.file)
    given = args.output or str(source.with_name(f"{source.stem}-{host}.yaml"))
    out = output_path(given, "-o", inputs=(args.file,))
    refuse_inputs(out, "-o", program_inputs(program))
    if out.suffix.lower() not in (".yaml", ".yml"):
        raise UsageError(f"-o {given}: a profile is a .yaml file")
    return out


def write_profile(out: Path, program, options, samples, command: str, host: str):
    """Derive the profile of ``samples``, write it to ``out`` and read it back through the
    schema (a profile that cannot be read back is a bug here, not the user's)."""
    import attrs

    from dhelix.dsl.frontend.profile_writer import render_profile
    from dhelix.dsl.frontend.profiles import load_profile, parse_profile
    from dhelix.dsl.planner.calibrate import Stamp, derive_profile
    from dhelix.interpreter.measure.profile_launch import DEFAULT_BASE

    base = program.profile or load_profile(DEFAULT_BASE)
    stamp = Stamp(source=options.path, machine=samples.machine, torch=samples.torch, backend=options.backend,
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"), command=command,
                  repeats=options.repeats, memory_gb=samples.memory_gb)
    profile, notes = derive_profile(program, samples.timings, stamp, base, name=host)
    if samples.cores is not None:
        profile = attrs.evolve(profile, cores=host_cores(samples, notes))
    header = [f"Measured by `{command}`.",
              "Every number names its source: [measured] timed on this machine, [derived] computed from",
              f"the timings, [executor] how the interpreter runs, [from {base.name}] copied from that profile.",
              "Re-run the command to refresh it; the measured: section fits this program only."]
    text = render_profile(profile, notes, header)
    write_output(out, text)
    return parse_profile(text, str(out))


def host_cores(samples, notes: dict):
    """The :class:`~dhelix.dsl.frontend.host_cores.HostCores` of a profile measured on CPU
    ranks (``samples``), with its notes added to ``notes``: the cores rank 0 could run on,
    the ranks on its host, and the CPU µs a run of each layer collective cost them, summed
    over the layer's collectives, over those collectives' times alone (the times the
    simulator charges them; 1 when none was timed)."""
    from dhelix.dsl.frontend.host_cores import HostCores

    cpu = samples.comm_cpu
    timed = sum(samples.timings.ops.get(name, 0.0) for name in cpu)
    busy = min(1.0, sum(cpu.values()) / timed) if cpu and timed > 0 else 1.0
    notes["cores.usable"] = "[measured] the cores rank 0 could run on (its CPU affinity)"
    notes["cores.ranks"] = "[measured] the ranks that ran on its host"
    notes["cores.comm_busy"] = (f"[measured] CPU time of the layer's {len(cpu)} collectives (each run back to back, "
                                f"{sum(cpu.values()) / 1e3:.3g} ms) over their times alone ({timed / 1e3:.3g} ms)"
                                if cpu and timed > 0 else "[assumed] no collective timed: all of it")
    return HostCores(usable=samples.cores, ranks=samples.host_ranks, comm_busy=round(busy, 3))


def summary(path: str, out: Path, program, options, samples, profile) -> str:
    """What the command prints: what was timed, the headline figures, how to use the file."""
    from dhelix.interpreter.training.summary import describe_mesh

    dtype = program.model.dtype
    counts = samples.counts
    links = "; ".join(f"{lane} {link.bw_gbps:g} GB/s + {link.latency_us:g} µs per step" + _efficiencies(profile, lane)
                      for lane, link in profile.links.items())
    classes = ", ".join(f"{cls} {value:g}" for cls, value in profile.oef_classes.items())
    relative = os.path.relpath(out.resolve(), Path(path).resolve().parent)
    where = (f"rank {options.as_rank} of {program.mesh.world} alone ({describe_mesh(program.mesh)}), links emulated "
             f"by {options.emulate}" if options.as_rank is not None
             else f"{samples.world} {options.backend} rank(s) ({describe_mesh(program.mesh)})")
    return "\n".join([
        f"dhelix profile: {path} on {where}, {options.repeats} timed repeat(s) after {options.warmup} warm-up",
        *([f"  note     the links are the emulation's ({_EMULATED[options.emulate]}); the compute and the overlap "
           "with it are this device's at the real shard shapes"] if options.as_rank is not None else []),
        f"timed {counts['ops']} layer ops alone, {counts.get('layer', 0)} pass of the whole layer, "
        f"{counts.get('ends', 0)} embedding and LM-head passes, "
        f"{counts.get('optimizer', 0)} optimizer step, "
        f"{counts['pairs']} op pairs, {counts['sweep']} link sizes, {counts.get('kinds', 0)} other collectives; "
        f"wrote {out}",
        f"  compute  peak {profile.peak_tflops[dtype] * 1e3:g} GFLOP/s {dtype} (fastest op), "
        f"memory {profile.hbm_gbps:g} GB/s"
        + (f", optimizer {profile.optimizer_gbps:g} GB/s" if profile.optimizer_gbps is not None else ""),
        f"  links    {links}",
        f"  overlap  OEF {classes}; slowdown {profile.slowdown:g}; launch gap {profile.launch_gap.fixed_us:g} µs",
        *_noise_lines(samples.timings, profile, program),
        f'use it: cluster {{ profile = "{relative}" }}  (a path relative to the program file)'])


def _efficiencies(profile, lane: str) -> str:
    """`` (all_reduce 1, p2p 1, all_gather 0.67, …)``: the collectives' efficiencies on
    ``lane`` where they were measured (not all 1); empty otherwise."""
    found = {name: model.efficiency_on(lane) for name, model in profile.collectives.items()
             if name in ("all_gather", "reduce_scatter", "all_reduce", "p2p")}
    if all(value == 1 for value in found.values()):
        return ""
    return " (" + ", ".join(f"{name} {value:g}" for name, value in found.items()) + ")"


#: What the link figures of a profile measured by a rank alone are.
_EMULATED = {"copy": "the rate of copying the wire bytes to pinned host memory",
             "sleep": "the program's own profile's link times, slept",
             "none": "no cost at all: take the links from another profile"}


def _noise_lines(timings, profile, program) -> list[str]:
    """The lines that say the overlap figures are noise, with the way to better ones; none
    when the timings agree. Only the figures measured here are judged: an OEF class no pair
    of ``program`` measured is its base profile's (a one-node program times no inter pair)."""
    from dhelix.dsl.planner.calibrate import measured_classes, noise

    measured = measured_classes(program.forward.ops + program.backward.ops, timings)
    reasons = noise(timings, profile.oef_classes, measured)
    if not reasons:
        return []
    return ["  noise    these overlap figures are noise: " + "; ".join(reasons),
            "           re-measure on an idle machine (`uptime`: load below the core count) with more --repeats; "
            "plans made with this profile follow the noise"]
