"""``dhelix run FILE``: train the program's model with the interpreter.

By default the command spawns one local process per mesh rank and joins them in a gloo
world (the embedded default: no cluster needed). Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) each process is one rank of torchrun's world, NCCL or gloo::

    dhelix run examples/tiny_llama_cpu.dhx --steps 20
    torchrun --nnodes 2 --nproc-per-node 8 ... -m dhelix run FILE --backend nccl

Rank 0 shows a progress bar (loss, tokens/s, step time) and ends with a summary: measured
step time, exposed communication (time a rank was blocked on communication), peak
activation memory, and the simulator's prediction beside them when ``dhelix.dsl.simulator.events``
is there. ``--trace out.json`` writes a Chrome trace: a process per rank, a thread per lane.

A bad run ends with a message and a non-zero exit code, never a hang: the parent watches its
children and stops the rest as soon as one fails, naming it; collectives time out after
``--timeout`` seconds. This module imports torch only when a run starts, so registering the
command keeps ``dhelix check`` fast and torch-free.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import attrs

from dhelix.dsl.core.errors import DhelixError, UsageError
from dhelix.dsl.core.mesh import LANES
from dhelix.dsl.frontend.imports import read_source

#: Test hook: ``rank:step:action`` makes that rank exit abruptly before that action.
FAULT_ENV = "DHELIX_TEST_FAULT"
FAULT_EXIT = 13
#: Largest absolute difference from the reference that ``--check`` accepts (fp32).
CHECK_TOLERANCE = 1e-5


@attrs.frozen
class RunOptions:
    """Everything a rank needs to run (picklable: spawned ranks receive it)."""

    path: str
    text: str
    steps: int = 10
    backend: str = "gloo"
    si: bool = True
    plan: str = "op_by_op"
    trace: str | None = None
    seed: int = 0
    lr: float = 1e-3
    zero1: bool = False
    timeout: float = 60.0
    check: bool = False
    pairs: tuple | None = None  # the planner's segment pairs when plan == "planned"


#: Steps of a run when neither --steps nor the train block says.
DEFAULT_STEPS = 10


def register(subparsers) -> None:
    """Add the ``run`` command to the CLI's sub-command parsers."""
    run = subparsers.add_parser(
        "run", help="train the model with the interpreter on local gloo ranks or under torchrun",
        description="Run FILE's schedule with torch.distributed: by default on N local gloo "
                    "processes (N = the mesh's world size); under torchrun on its world.")
    run.add_argument("file", metavar="FILE")
    run.add_argument("--nproc", type=int, metavar="N", help="local ranks to spawn (must equal the mesh size)")
    run.add_argument("--steps", type=int, metavar="K",
                     help="training steps (default: the train block's steps, else 10)")
    run.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                     help="collective backend (default gloo; nccl needs one GPU per rank)")
    run.add_argument("--no-si", dest="si", action="store_false",
                     help="run SI blocks as a forward then a backward (same numbers, no overlap)")
    run.add_argument("--si-plan", choices=("planned", "op_by_op", "sequential"), default="planned",
                     help="segment pairs of SI blocks: the planner's (default; op_by_op when the "
                          "cluster names no profile), op i beside op i, or no interleaving")
    run.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace of what ran")
    run.add_argument("--seed", type=int,
                     help="seed of the weights and the data (default: the train block's seed, else 0)")
    run.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    run.add_argument("--zero1", action="store_true", help="shard the optimizer state over dp (ZeRO-1)")
    run.add_argument("--timeout", type=float, default=60.0, metavar="S",
                     help="collective timeout in seconds: a dead peer ends the run after this (default 60)")
    run.add_argument("--check", action="store_true",
                     help="compare every step's loss and gradients with the single-process reference")
    run.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    """`dhelix run FILE …`: check the program, then run it on a spawned or torchrun world."""
    from dhelix.dsl.passes.pipeline import check_text

    if args.steps is not None and args.steps < 1:
        raise UsageError("--steps must be at least 1")
    text = read_source(args.file)
    program = check_text(text, args.file)
    if program.model is None:
        raise UsageError(f"'{args.file}' is a library file: it has no model to run")
    _quiet_numpy_warning()
    preflight(program)
    plan, pairs = _si_plan(program, args.si_plan) if args.si else (args.si_plan, None)
    steps = args.steps if args.steps is not None else program.train.steps or DEFAULT_STEPS
    seed = args.seed if args.seed is not None else program.train.seed
    options = RunOptions(args.file, text, steps, args.backend or "gloo", args.si, plan,
                         args.trace, seed, args.lr, args.zero1, args.timeout, args.check, pairs)
    world = program.mesh.world
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise DhelixError(f"the mesh has {world} ranks ({describe_mesh(program.mesh)}) but torchrun "
                              f"started {os.environ['WORLD_SIZE']}",
                              notes=["start torchrun with nnodes × nproc-per-node equal to the mesh size"])
        return rank_main(options, int(os.environ["RANK"]), world, "env://")
    nproc = args.nproc or world
    if nproc != world:
        raise UsageError(f"--nproc {nproc} does not match the mesh: it has {world} ranks "
                         f"({describe_mesh(program.mesh)})")
    return spawn(options, nproc)


def _quiet_numpy_warning() -> None:
    import warnings

    # torch warns on import when NumPy is absent; the interpreter does not use NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def _si_plan(program, name: str) -> tuple[str, tuple | None]:
    """The SI plan to run: (its name, the planner's pairs for ``planned``). Without a
    hardware profile the planner has no costs, so ``planned`` falls back to ``op_by_op``."""
    from .si import has_si_blocks, planned_pairs

    if name != "planned" or not has_si_blocks(program.lowered):
        return name, None
    if program.profile is None:
        return "op_by_op", None
    return name, planned_pairs(program)


def describe_mesh(mesh) -> str:
    """``tp 2 × pp 2`` (the axes larger than 1, innermost first)."""
    parts = [f"{axis} {size}" for axis, size in zip(mesh.order, mesh.sizes, strict=True) if size > 1]
    return " × ".join(parts) or "1 rank"


def preflight(program) -> None:
    """Raise DhelixError for a program the interpreter cannot run, before any rank starts."""
    from .layer_exec import LayerPlan
    from .weights import ShardingError, WeightPlan

    try:
        WeightPlan(program)
        LayerPlan.build(program.forward, program.backward, program.train.micro_batch)
    except (ShardingError, NotImplementedError) as exc:
        raise DhelixError(f"the interpreter cannot run this program: {exc}") from None


# -- the local world -------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(options: RunOptions, nproc: int) -> int:
    """Start ``nproc`` local ranks and watch them; returns the exit code of the run."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [context.Process(target=_spawned, args=(options, rank, nproc, init), name=f"dhelix-rank{rank}")
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
    print(f"dhelix run: rank {rank} {how}; stopped the other {nproc - 1} rank(s)", file=sys.stderr)
    return 1


def watch(procs) -> tuple[int, int] | None:
    """Wait for every process; as soon as one exits non-zero, stop the others and return
    (its rank, its exit code). None when all succeed."""
    from multiprocessing.connection import wait

    alive = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while alive:
        for sentinel in wait(list(alive), timeout=1.0):
            rank = alive.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                stop(procs)
                return rank, procs[rank].exitcode
    return None


def stop(procs, grace: float = 3.0) -> None:
    """Terminate the processes still running; kill those that outlive ``grace`` seconds."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _spawned(options: RunOptions, rank: int, world: int, init: str) -> None:
    sys.exit(rank_main(options, rank, world, init))


# -- one rank ---------------------------------------------------------------------------------

def rank_main(options: RunOptions, rank: int, world: int, init: str) -> int:
    """Join the world as ``rank`` and train; returns this process's exit code (failures
    are printed with the rank, the action and the schedule grid)."""
    from datetime import timedelta

    _quiet_numpy_warning()
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if options.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, _local_world(world))))
    torch.manual_seed(options.seed)
    dist.init_process_group(options.backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=options.timeout))
    try:
        return train(options, device)
    except DhelixError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    except (RuntimeError, ValueError) as exc:  # a peer's failure seen through a collective
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()


def _local_world(world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def _fault_hook(rank: int):
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    fault_rank, step, action = (int(part) for part in spec.split(":"))
    if fault_rank != rank:
        return None

    def hook(at_step: int, at_action: int) -> None:
        if (at_step, at_action) == (step, action):
            os._exit(FAULT_EXIT)  # a crash: no clean-up, no goodbye to the peers

    return hook


def train(options: RunOptions, device) -> int:
    """Build the executor and the optimizer, run the steps, print the summary on rank 0."""
    import torch.distributed as dist

    from dhelix.dsl.passes.pipeline import check_text

    from .comm import DistComm
    from .executor import Executor
    from .harness import broadcast_from_first
    from .optim import AdamWConfig, DistributedAdamW
    from .si import PLANS, Recorder, fixed_plan

    program = check_text(options.text, options.path)
    comm = DistComm(program.mesh, device, timeout_s=options.timeout)
    recorder = Recorder(trace=options.trace is not None, cuda=device.type == "cuda")
    # Every rank must run the same plan (collectives are issued in plan order); under
    # torchrun each process planned on its own, so rank 0's plan wins.
    pairs = broadcast_from_first(options.pairs)
    plan_for = fixed_plan(pairs) if pairs is not None else PLANS.get(options.plan, PLANS["sequential"])
    executor = Executor(program, comm, seed=options.seed, device=device, si=options.si,
                        plan_for=plan_for, use_tags=options.backend == "gloo",
                        recorder=recorder, on_action=_fault_hook(comm.rank))
    optimizer = DistributedAdamW(executor.params, executor.comm, zero1=options.zero1,
                                 config=AdamWConfig(lr=options.lr),
                                 expert=executor.weights.ep_sharded(executor.params))
    dist.barrier()  # every group exists everywhere; also aligns the trace clocks
    recorder.origin = time.perf_counter()
    if options.check:
        return _check(options, executor, optimizer)
    losses, times = _steps(options, program, executor, optimizer, device)
    _report(options, program, executor, losses, times)
    return 0


def _steps(options, program, executor, optimizer, device):
    from tqdm import tqdm

    # A thread lock instead of tqdm's default multiprocessing one: a rank stopped by the
    # launcher would leak its semaphore.
    tqdm.set_lock(threading.RLock())
    rank, comm = executor.comm.rank, executor.comm
    tokens = program.train.micro_batch * program.model.get("seq") * program.train.microbatches * comm.size("dp")
    losses, times = [], {"step": [], "collective": [], "p2p": []}
    bar = tqdm(range(options.steps), desc="dhelix run", unit="step", disable=rank != 0, file=sys.stderr)
    with _cuda_profile(options, device, rank):
        for step in bar:
            _one_step(program, executor, optimizer, device, options.seed + step, times, losses)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens / times['step'][-1]:.0f}",
                            step_ms=f"{1e3 * times['step'][-1]:.1f}")
    bar.close()
    return losses, times


def _one_step(program, executor, optimizer, device, seed: int, times: dict, losses: list) -> None:
    import torch

    from .harness import global_batch, replica_batch

    """One training step; appends its loss and its times (step, blocked on collectives,
    blocked on pipeline receives) to ``losses`` and ``times``."""
    comm, waited = executor.comm, executor.recorder.waited
    batch = replica_batch(global_batch(program, seed), comm.index("dp"), program.train.microbatches)
    start, before = time.perf_counter(), dict(waited)
    loss = executor.step(batch)
    optimizer.step(executor.grads())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times["step"].append(time.perf_counter() - start)
    for kind in ("collective", "p2p"):
        times[kind].append(waited[kind] - before[kind])
    losses.append(loss.item())


def _cuda_profile(options, device, rank: int):
    """On CUDA with --trace, torch.profiler over the steps, written per rank beside the
    trace (``OUT.rank3.json``): the host timestamps of our own trace say when work was
    launched, the profiler's when the compute and NCCL streams ran it."""
    import contextlib

    if device.type != "cuda" or options.trace is None:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    @contextlib.contextmanager
    def profiled():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            yield
        prof.export_chrome_trace(str(Path(options.trace).with_suffix(f".rank{rank}.json")))

    return profiled()


def _check(options, executor, optimizer) -> int:
    import torch
    import torch.distributed as dist

    from .harness import check_steps

    checks = check_steps(executor, optimizer, options.steps, options.seed)
    worst = max((max(c.loss_diff, c.grad_diff, c.update_diff) for c in checks), default=0.0)
    if executor.comm.rank == 0:
        for check in checks:
            print(check)
    flag = torch.tensor([float(worst > CHECK_TOLERANCE)], device=executor.device)
    dist.broadcast(flag, 0)
    if flag.item():
        if executor.comm.rank == 0:
            print(f"dhelix run: the interpreter differs from the reference by more than {CHECK_TOLERANCE}",
                  file=sys.stderr)
        return 1
    return 0


# -- the summary and the trace -----------------------------------------------------------------

def _report(options, program, executor, losses, times) -> None:
    from .harness import gather_to_first

    import torch

    recorder = executor.recorder
    mine = dict(rank=executor.comm.rank, times=times, peak=recorder.peak_bytes, events=recorder.events)
    if executor.device.type == "cuda":  # what the allocator saw: weights, gradients and buffers too
        mine["cuda_peak"] = torch.cuda.max_memory_allocated(executor.device)
    ranks = gather_to_first(mine)
    if ranks is None:
        return
    print(summary(options, program, losses, ranks))
    if options.trace:
        write_trace(options.trace, ranks)
        print(f"trace: {options.trace} ({sum(len(r['events']) for r in ranks)} events; open in Perfetto "
              "or chrome://tracing)")


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _steady(values):
    # The first step pays for warm-up (allocations, connection set-up): leave it out if we can.
    return _median(values[1:] or values)


def summary(options, program, losses, ranks) -> str:
    """The end-of-run table: per rank the median step time, time blocked on collectives
    (exposed communication) and on pipeline receives (bubbles included) and the peak of
    live activations; then the measured values beside the simulator's prediction."""
    si = f"on ({options.plan} plan)" if options.si else "off"
    lines = [f"dhelix run: {options.path}: {program.pipeline.name}, {describe_mesh(program.mesh)} on "
             f"{len(ranks)} {options.backend} rank(s), SI {si}",
             f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} step(s); medians per step "
             "(first step excluded):",
             f"{'rank':>6} {'step time':>12} {'exposed comm':>14} {'p2p wait':>12} {'peak activations':>18}"]
    for r in ranks:
        t = r["times"]
        lines.append(f"{r['rank']:>6} {1e3 * _steady(t['step']):>10.2f}ms {1e3 * _steady(t['collective']):>12.2f}ms"
                     f" {1e3 * _steady(t['p2p']):>10.2f}ms {r['peak'] / 2**20:>15.3f}MiB")
    step = _steady([max(per_rank) for per_rank in zip(*(r["times"]["step"] for r in ranks), strict=True)])
    # On CUDA, waits only order streams: host time says nothing about exposed communication.
    exposed = None if options.backend == "nccl" else max(_steady(r["times"]["collective"]) for r in ranks)
    peak = max(r["peak"] for r in ranks)
    predicted = simulated(program, options)
    lines += [f"{'':>14} {'measured':>12} {'simulated':>12}",
              f"{'step time':>14} {1e3 * step:>10.2f}ms {_fmt(predicted.get('step_time'), 1e3, 'ms'):>12}",
              f"{'exposed comm':>14} {_fmt(exposed, 1e3, 'ms'):>12} {_fmt(predicted.get('exposed_comm'), 1e3, 'ms'):>12}",
              f"{'peak act.':>14} {peak / 2**20:>9.3f}MiB {_fmt(predicted.get('peak_memory'), 2**-20, 'MiB'):>12}"]
    if exposed is None:
        lines.append("exposed comm: not timed on CUDA; see the torch.profiler traces of --trace")
        cuda_peak = max(r.get("cuda_peak", 0) for r in ranks)
        lines.append(f"CUDA peak allocated (weights and buffers included): {cuda_peak / 2**20:.1f}MiB")
    if "note" in predicted:
        lines.append(f"simulator: {predicted['note']}")
    return "\n".join(lines)


def _fmt(value, scale: float, unit: str) -> str:
    return "—" if value is None else f"{value * scale:.2f}{unit}"


def simulated(program, options) -> dict:
    """The simulator's step time, exposed communication (layer and DP collectives, the
    worst rank's; seconds) and peak activation bytes for ``program`` run as ``options``
    says, with a note; only a note when the simulator is missing or cannot run it."""
    try:
        from dhelix.dsl.simulator.events import simulate
    except ImportError:
        return {"note": "not available (no dhelix.dsl.simulator.events)"}
    try:
        result = simulate(program, si=options.si, zero1=options.zero1)
    except DhelixError as exc:
        return {"note": f"cannot simulate this program: {exc.message}"}
    note = f"predicted for the {program.cluster.profile} profile, not for this machine"
    if options.si and options.plan != "planned":
        note += "; it prices SI blocks with the planner's plan, this run used " + options.plan
    return {"step_time": result.step_time,
            "exposed_comm": max(r.layer_exposed + r.dp_exposed for r in result.ranks),
            "peak_memory": max(r.activations for r in result.ranks), "note": note}


def write_trace(path: str, ranks) -> None:
    """A Chrome trace of every rank's events: a process per rank, a thread per lane."""
    events = []
    for r in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": r["rank"], "args": {"name": f"rank {r['rank']}"}})
        for tid, lane in enumerate(LANES):
            events.append({"ph": "M", "name": "thread_name", "pid": r["rank"], "tid": tid, "args": {"name": lane}})
        for name, lane, start, duration in r["events"]:
            events.append({"ph": "X", "name": name, "cat": lane, "pid": r["rank"], "tid": LANES.index(lane),
                           "ts": round(start * 1e6, 3), "dur": round(duration * 1e6, 3)})
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
