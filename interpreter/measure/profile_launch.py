"""`dhelix profile FILE` on the ranks: time the layer (:mod:`.profiler`) and bring the
samples to rank 0.

Started like ``dhelix run`` by :mod:`.spawn` (local gloo ranks, or each process of a
``torchrun`` world): :func:`measure_layer` is the ``work`` every rank runs. Each rank times
the same measurements in the same order; rank 0 gathers every rank's samples and returns
them pooled (medians: :func:`dhelix.dsl.planner.calibrate.pool`) with what the profile's
stamp needs (the machine, torch's version). Deriving the profile and writing the YAML is the
command's job (:mod:`dhelix.cli.profile`), on the parent, where the output path was checked.

This module imports torch only inside a rank.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import threading

import attrs

#: The shipped profile that supplies unmeasurable values when the program names none.
DEFAULT_BASE = "h100"


@attrs.frozen(kw_only=True)
class ProfileOptions:
    """Everything a rank needs (picklable: spawned ranks receive it). ``compiled`` is the
    program compiled once by the command (:func:`~dhelix.dsl.simulator.runplan.measuring_plan`),
    which ranks never compile again; ``seed`` seeds the weights and inputs the ops run on;
    ``timeout`` is the collectives' timeout in seconds."""

    path: str
    compiled: object
    backend: str = "gloo"
    repeats: int = 5
    warmup: int = 1
    timeout: float = 60.0
    seed: int = 0
    #: ``dhelix profile --as-rank R``: rank R alone, every transfer a stand-in costing what
    #: ``emulate`` says (:mod:`dhelix.interpreter.ops.standin`); None: a real rank.
    as_rank: int | None = None
    emulate: str = "copy"


@attrs.frozen
class ProfileSamples:
    """What rank 0 brings back: the pooled ``timings``, how many measurements of each kind
    were timed (``counts``), the world size, the machine and torch's version."""

    timings: object
    counts: dict
    world: int
    machine: str
    torch: str
    memory_gb: float | None = None
    #: On CPU ranks: the cores rank 0 could run on, the ranks that ran on its host, and per
    #: layer collective the median CPU µs a run of it cost those ranks (None on GPUs).
    cores: int | None = None
    host_ranks: int | None = None
    comm_cpu: dict | None = None


def host_name() -> str:
    """This machine's name, safe in a file name (``host`` when it has none)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", platform.node()).strip("-") or "host"


def measure_layer(options: ProfileOptions, device, heartbeat=None) -> ProfileSamples | None:
    """Time the program's layer on this rank (a :data:`~dhelix.interpreter.launch.join.Work`), telling ``heartbeat``
    (optional) each timing done; the pooled samples of every rank on global rank 0, None
    elsewhere. Rank 0 shows a progress bar on a terminal."""
    import torch
    from tqdm import tqdm

    from dhelix.dsl.core.oplib import END_OPS, LAYER_PASS, OPTIMIZER_STEP
    from dhelix.dsl.planner.calibrate import pool

    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.verify.harness import gather_to_first
    from .profiler import Clock, EndsBench, LayerBench, OptimizerBench, barrier, measure, measurements

    program, reference = options.compiled.program, options.compiled.reference
    if options.as_rank is not None:
        from dhelix.interpreter.ops.standin import EmulatedComm

        comm = EmulatedComm(program.mesh, device, program.profile, options.emulate, timeout_s=options.timeout)
    else:
        comm = DistComm(program.mesh, device, timeout_s=options.timeout)
    bench = LayerBench(program, comm, device, seed=options.seed, reference=reference)
    ends = EndsBench(program, comm, device, seed=options.seed, reference=reference) \
        if program.model.get("vocab") else None
    optimizer = OptimizerBench(program, comm, device, seed=options.seed, reference=reference)
    items = measurements(program, bench, comm, Clock(device), device, ends, optimizer)
    meet = barrier(device)
    meet()
    tqdm.set_lock(threading.RLock())  # not tqdm's multiprocessing lock: a stopped rank would leak it
    bar = tqdm(total=len(items) * (options.warmup + options.repeats), desc="profiling", unit="timing",
               disable=None if comm.rank == 0 else True, file=sys.stderr)

    def done() -> None:
        bar.update()
        if heartbeat is not None:
            heartbeat.beat(0, bar.n, "a profiling timing")

    samples = measure(items, options.repeats, options.warmup, meet, done)
    bar.close()
    if options.as_rank is not None:
        comm.lanes.close()
    gathered = gather_to_first((samples, samples.pop("cpu"), platform.node()))
    if gathered is None:
        return None
    ranks = [rank_samples for rank_samples, _, _ in gathered]
    counts = {kind: sum(1 for item in items if item.kind == kind) for kind in ("ops", "pairs", "sweep", "kinds")}
    counts["ends"] = sum(1 for item in items if item.key in END_OPS)
    counts["optimizer"] = sum(1 for item in items if item.key == OPTIMIZER_STEP)
    counts["layer"] = sum(1 for item in items if item.key == LAYER_PASS)
    counts["ops"] -= counts["ends"] + counts["optimizer"] + counts["layer"]
    cores = host_ranks = comm_cpu = None
    if device.type == "cpu" and options.as_rank is None:
        from dhelix.interpreter.training.summary import usable_cores

        here = [cpu for _, cpu, node in gathered if node == platform.node()]
        cores, host_ranks = usable_cores(), len(here)
        comm_cpu = {name: statistics.median(us for cpu in here for us in cpu.get(name, ()))
                    for name in sorted({name for cpu in here for name in cpu})}
    return ProfileSamples(pool(ranks), counts, len(ranks), machine(device), torch.__version__,
                          device_memory_gb(device), cores=cores, host_ranks=host_ranks, comm_cpu=comm_cpu)


def device_memory_gb(device) -> float | None:
    """Memory one rank may use, in GB: the GPU's, or on CPU this machine's physical memory
    shared by the local ranks; None when the system does not say."""
    import torch

    if device.type == "cuda":
        return round(torch.cuda.get_device_properties(device).total_memory / 1e9, 2)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    import torch.distributed as dist

    from dhelix.interpreter.ops.standin import standin_world

    # Spawned local ranks share this machine; under torchrun, LOCAL_WORLD_SIZE ranks do; a rank
    # alone (--as-rank) has it to itself.
    local = 1 if standin_world() else int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return round(total / max(1, local) / 1e9, 2)


def machine(device) -> str:
    """The host and what it computes on: the GPU's name, or the CPU model and core count."""
    import torch

    if device.type == "cuda":
        return f"{platform.node()}: {torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node()}: {model}, {os.cpu_count()} CPU cores"
