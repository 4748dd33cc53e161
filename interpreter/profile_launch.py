"""`dhelix profile FILE`: start the ranks, time the layer (:mod:`.profiler`), write the profile.

Launched like ``dhelix run``: by default one local process per mesh rank in a gloo world;
under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) each process is one rank of its world.
Every rank measures; rank 0 pools the samples, derives the profile
(:func:`dhelix.dsl.planner.calibrate.derive_profile`), writes it as YAML stamped with the
machine, torch version, backend, date and command, reads it back through the schema and
prints a summary. What the profile cannot measure comes from the program's own profile (its
cluster block), or the shipped :data:`DEFAULT_BASE` when it names none.

This module imports torch only when a rank starts, like :mod:`.launch`.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

import attrs

from dhelix.dsl.core.errors import DhelixError

#: The shipped profile that supplies unmeasurable values when the program names none.
DEFAULT_BASE = "h100"


@attrs.frozen
class ProfileOptions:
    """Everything a rank needs (picklable: spawned ranks receive it)."""

    path: str
    text: str
    out: str
    backend: str = "gloo"
    repeats: int = 5
    warmup: int = 1
    timeout: float = 60.0
    command: str = ""


def host_name() -> str:
    """This machine's name, safe in a file name (``host`` when it has none)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", platform.node()).strip("-") or "host"


def spawn_profile(options: ProfileOptions, nproc: int) -> int:
    """Start ``nproc`` local ranks and watch them (as `dhelix run` does); the exit code."""
    import multiprocessing

    from .launch import _free_port, stop, watch

    context = multiprocessing.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [context.Process(target=_spawned, args=(options, rank, nproc, init), name=f"dhelix-profile{rank}")
             for rank in range(nproc)]
    for proc in procs:
        proc.start()
    try:
        failure = watch(procs)
    except KeyboardInterrupt:
        stop(procs)
        raise
    if failure is None:
        return 0
    rank, code = failure
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    print(f"dhelix profile: rank {rank} {how}; stopped the other {nproc - 1} rank(s)", file=sys.stderr)
    return 1


def _spawned(options: ProfileOptions, rank: int, world: int, init: str) -> None:
    sys.exit(profile_rank(options, rank, world, init))


def profile_rank(options: ProfileOptions, rank: int, world: int, init: str) -> int:
    """Join the world as ``rank``, measure, and on rank 0 write the profile; the exit code."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from .launch import _local_world, _quiet_numpy_warning

    _quiet_numpy_warning()
    device = torch.device("cpu")
    if options.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, _local_world(world))))
    dist.init_process_group(options.backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=options.timeout))
    try:
        return _measure_and_write(options, device)
    except DhelixError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    except (RuntimeError, ValueError) as exc:  # a peer's failure seen through a collective
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()


def _measure_and_write(options: ProfileOptions, device) -> int:
    from tqdm import tqdm

    from dhelix.dsl.passes.pipeline import check_text
    from dhelix.dsl.planner.calibrate import pool

    from .comm import DistComm
    from .harness import gather_to_first
    from .profiler import Clock, LayerBench, barrier, measure, measurements

    program = check_text(options.text, options.path)
    comm = DistComm(program.mesh, device, timeout_s=options.timeout)
    bench = LayerBench(program, comm, device)
    items = measurements(program, bench, comm, Clock(device), device)
    meet = barrier(device)
    meet()
    tqdm.set_lock(threading.RLock())  # not tqdm's multiprocessing lock: a stopped rank would leak it
    bar = tqdm(total=len(items) * (options.warmup + options.repeats), desc="dhelix profile", unit="timing",
               disable=comm.rank != 0, file=sys.stderr)
    samples = measure(items, options.repeats, options.warmup, meet, bar.update)
    bar.close()
    ranks = gather_to_first(samples)
    if ranks is None:
        return 0
    profile = write_profile(options, program, pool(ranks), device)
    print(summary(options, program, profile, len(ranks), items))
    return 0


def write_profile(options: ProfileOptions, program, timings, device):
    """Derive the profile of ``timings``, write it to ``options.out`` and read it back
    through the schema (a profile we cannot read is a bug here, not the user's)."""
    import torch

    from dhelix.dsl.frontend.profile_writer import render_profile
    from dhelix.dsl.frontend.profiles import load_profile, parse_profile
    from dhelix.dsl.planner.calibrate import Stamp, derive_profile

    base = program.profile or load_profile(DEFAULT_BASE)
    stamp = Stamp(source=options.path, machine=machine(device), torch=torch.__version__, backend=options.backend,
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"), command=options.command,
                  repeats=options.repeats)
    profile, notes = derive_profile(program, timings, stamp, base, name=host_name())
    header = [f"Measured by `{options.command}`." if options.command else "Measured by `dhelix profile`.",
              "Every number names its source: [measured] timed on this machine, [derived] computed from",
              f"the timings, [executor] how the interpreter runs, [from {base.name}] copied from that profile.",
              "Re-run the command to refresh it; the measured: section fits this program only."]
    text = render_profile(profile, notes, header)
    Path(options.out).write_text(text)
    return parse_profile(text, options.out)


def machine(device) -> str:
    """The host and what it computes on: the GPU's name, or the CPU model and core count."""
    import torch

    if device.type == "cuda":
        return f"{platform.node()}: {torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {model}, {os.cpu_count()} CPU cores"


def summary(options: ProfileOptions, program, profile, world: int, items) -> str:
    """What rank 0 prints: what was timed, the headline figures, how to use the file."""
    from .launch import describe_mesh

    dtype = program.model.dtype
    counts = {kind: sum(1 for item in items if item.kind == kind) for kind in ("ops", "pairs", "sweep")}
    links = "; ".join(f"{lane} {link.bw_gbps:g} GB/s + {link.latency_us:g} µs per step"
                      for lane, link in profile.links.items())
    classes = ", ".join(f"{cls} {value:g}" for cls, value in profile.oef_classes.items())
    relative = os.path.relpath(Path(options.out).resolve(), Path(options.path).resolve().parent)
    return "\n".join([
        f"dhelix profile: {options.path} on {world} {options.backend} rank(s) ({describe_mesh(program.mesh)}), "
        f"{options.repeats} timed repeat(s) after {options.warmup} warm-up",
        f"timed {counts['ops']} ops alone, {counts['pairs']} op pairs, {counts['sweep']} link sizes; "
        f"wrote {options.out}",
        f"  compute  peak {profile.peak_tflops[dtype] * 1e3:g} GFLOP/s {dtype} (fastest op), "
        f"memory {profile.hbm_gbps:g} GB/s",
        f"  links    {links}",
        f"  overlap  OEF {classes}; slowdown {profile.slowdown:g}; launch gap {profile.launch_gap.fixed_us:g} µs",
        f'use it: cluster {{ profile = "{relative}" }}  (a path relative to the program file)'])
