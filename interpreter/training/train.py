"""The training loop of one rank: build the executor and the optimizer, run the steps.

:func:`train` runs inside an initialised torch.distributed world (:mod:`.spawn` joins it) and
returns, on global rank 0, a :class:`~.summary.RunResult`: the losses and every rank's
measurements and trace events, gathered there; None on the other ranks. With
``RunOptions.check`` it compares every step with the single-process reference instead
(:func:`.harness.check_steps`) and returns the comparisons.

The loop's one output of its own is the progress bar that rank 0 draws on standard error
(loss, tokens/s, step time) when that is a terminal (logs stay readable when redirected):
progress can only come from the process that runs the steps, which under the local spawner is
a child of the command. Everything else is a value.

torch is imported inside the functions, so that registering the command line stays light.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import attrs

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.options import RunSettings, option
from dhelix.dsl.core.timeline import TraceEvent
from dhelix.dsl.planner.si_plan import SIMode
from dhelix.dsl.simulator.runplan import RunPlan

from .summary import RankRecord, RunResult

#: Test hook: ``rank:step:action`` makes that rank exit abruptly before that action;
#: ``rank:step:action:stop`` stops it (SIGSTOP, a hang) and ``…:kill`` kills it (SIGKILL).
FAULT_ENV = "DHELIX_TEST_FAULT"
FAULT_EXIT = 13
#: Steps of a run when neither the caller nor the train block says.
DEFAULT_STEPS = option("steps").default
#: How many of the newest checkpoints a run keeps (``dhelix run --keep``).
DEFAULT_KEEP = option("keep").default
#: What a stand-in transfer of a rank run alone costs (``--emulate-links``,
#: :mod:`dhelix.interpreter.ops.standin`): its bytes copied on its lane, the profile's time slept
#: there, or nothing.
EMULATIONS = ("copy", "sleep", "none")


class NonFiniteError(DhelixError):
    """A training step whose loss or gradient norm is not a finite number (the update was not
    applied). Every rank meets it alike; rank 0's message names the gradients."""

    reported_by_rank_0 = True


@attrs.frozen(kw_only=True)
class RunOptions(RunSettings):
    """Everything a rank needs to run (picklable: spawned ranks receive it): the declared run
    options (:class:`~dhelix.dsl.core.options.RunSettings`, one field per option of
    :data:`~dhelix.dsl.core.options.OPTIONS`: steps, seed, lr, …) and what the command
    computes. ``compiled`` is the run compiled once by the command
    (:class:`~dhelix.dsl.simulator.runplan.RunPlan`: the priced program, the reference DAGs,
    the SI plan), which ranks run and never compile again; ``trace`` is where the trace goes
    (events are recorded only with one)."""

    path: str
    compiled: RunPlan
    backend: str = "gloo"
    #: The training data (:class:`~.data.DataSpec`; None: seeded random tokens).
    data: object = None
    #: The held-out data (a DataSpec, ``--eval-data``); None: the tail of ``data``.
    eval_data: object = None
    #: ``dhelix run --as-rank R``: this process is rank R of the program's world, alone, every
    #: transfer a stand-in on its lane (:mod:`dhelix.interpreter.ops.standin`); None: a real rank.
    as_rank: int | None = None
    #: What a stand-in transfer costs (``--emulate-links``): copy, sleep or none.
    emulate: str = "copy"

    @property
    def decay(self) -> bool:
        """Cosine decay of the learning rate over the run's steps (else constant after warm-up)."""
        return self.lr_decay == "cosine"

    @property
    def si(self) -> bool:
        """Whether SI blocks interleave their strands (else each runs its F then its B)."""
        return self.compiled.interleave

    @property
    def plan(self) -> SIMode:
        """How SI blocks run: the compiled SI plan's mode."""
        return self.compiled.mode

    def schedule(self) -> dict:
        """The learning-rate schedule's settings, stored in a checkpoint so that a resume
        can say when it differs."""
        return {"lr": self.lr, "warmup": self.warmup, "decay": "cosine" if self.decay else "constant",
                "steps": self.steps, "weight_decay": self.weight_decay, "clip": self.clip}

    def lr_schedule(self, start: int = 0):
        """The learning-rate schedule (:class:`~.schedule.LRSchedule`, torch's schedulers)
        positioned at update ``start`` (0-based; a resumed run's checkpoint step)."""
        from .schedule import LRSchedule

        return LRSchedule.at(start, self.lr, self.warmup, self.steps if self.decay else None)


def preflight(program, reference=None) -> None:
    """Raise DhelixError for a program the interpreter cannot run, before any rank starts
    (``reference``: its reference DAGs when known, see :class:`~.weights.WeightPlan`)."""
    from dhelix.interpreter.execute.layer_exec import LayerPlan
    from dhelix.interpreter.ops.weights import ShardingError, WeightPlan

    try:
        WeightPlan(program, reference=reference)
        LayerPlan.build(program.forward, program.backward, program.train.micro_batch)
    except (ShardingError, NotImplementedError) as exc:
        raise DhelixError(f"the interpreter cannot run this program: {exc}") from None


def train(options: RunOptions, device, heartbeat=None) -> RunResult | None:
    """Build the executor and the optimizer and run the steps (or check them) on ``device``
    (a torch.device), telling ``heartbeat`` (a :class:`.heartbeat.Heartbeat`, optional) each
    action begun; returns the run's result on global rank 0, None elsewhere. Collective
    over the world."""
    import torch.distributed as dist

    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.verify.harness import broadcast_from_first, check_steps
    from .data import DataSource, load_corpus, resume_data
    from .optim import AdamWConfig, for_executor
    from dhelix.interpreter.execute.recording import Recorder

    compiled = options.compiled
    program = compiled.program
    if options.as_rank is not None:
        from dhelix.interpreter.ops.standin import EmulatedComm

        comm = EmulatedComm(program.mesh, device, program.profile, options.emulate, timeout_s=options.timeout)
    else:
        comm = DistComm(program.mesh, device, timeout_s=options.timeout)
    recorder = Recorder(trace=options.trace is not None, cuda=device.type == "cuda")
    # Every rank must run the same plan (collectives are issued in plan order). `run` and
    # `profile` hand rank 0's RunPlan to every rank; `tune --measure` under torchrun plans each
    # candidate on every process, so rank 0's plan wins.
    si = broadcast_from_first(compiled.si)
    config = AdamWConfig(lr=options.lr, weight_decay=options.weight_decay, clip=options.clip,
                         master=options.master, post=options.optimizer_check == "post",
                         grad_reduce_dtype=options.grad_reduce_dtype)
    executor = Executor(program, comm, seed=options.seed, device=device, si=compiled.interleave,
                        plan_for=si.plan_for(), use_tags=options.backend == "gloo", block_orders=si.orders(),
                        recorder=recorder, on_action=_action_hook(comm, program, heartbeat),
                        reference=compiled.reference, init=options.init,
                        issue_order=si.issue_order(device.type == "cuda"),
                        facts=compiled.facts if si == compiled.si else None,
                        optimizer=functools.partial(for_executor, zero1=options.zero1, config=config),
                        stand_in_weights=options.as_rank is not None)
    optimizer = executor.optimizer
    corpus = None if options.data is None else load_corpus(options.data, program.model.get("vocab"),
                                                           program.model.get("seq"), options.eval_data)
    source = DataSource(program, comm.size("dp"), options.seed, corpus)
    # Every group exists everywhere; also aligns the trace clocks (on NCCL, on this rank's GPU).
    dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()
    recorder.origin = time.perf_counter()
    if options.check:
        # The reference is compared on rank 0: its comparisons are the verdict.
        checks = tuple(check_steps(executor, optimizer, options.steps, source.batch,
                                     options.lr_schedule().rates(options.steps)))
        return RunResult(losses=tuple(c.loss for c in checks), checks=checks) if comm.rank == 0 else None
    start = 0
    if options.resume is not None:
        from .checkpoint import load

        # Under torchrun each rank's command chose the save (--resume auto): rank 0's choice holds.
        options = attrs.evolve(options, resume=broadcast_from_first(options.resume))
        meta = load(options.resume, executor, optimizer, source.global_sequences)
        start = meta["step"]
        resume_data(options.data, meta.get("data"), source)
    from .checkpoint import save_group

    # Saves and the export wait in a group of their own, without the collectives' timeout.
    saving = save_group() if options.save or options.export_weights else None
    losses, times, evals, skipped, rolled = _steps(options, executor, optimizer, device, source, start, saving)
    optimizer.settle()  # the last step's weight gathers, when they run under the next forward
    if options.as_rank is not None:
        comm.lanes.close()
    if options.export_weights is not None:
        from .checkpoint import export_weights

        export_weights(options.export_weights, executor, optimizer)
        dist.barrier(group=saving)  # rank 0 wrote the file: the others waited here, not in a collective
    result = _gather(executor, losses, times, evals, optimizer, rolled)
    return None if result is None else attrs.evolve(result, skipped=skipped,
                                                    held_out=source.held_out_coverage() if evals else None)


def _action_hook(comm, program, heartbeat):
    """What runs before each action: the heartbeat's beat and the test fault, as there are."""
    fault = _fault_hook(comm.rank)
    if heartbeat is None:
        return fault
    actions = program.lowered.actions[comm.index("pp")]

    def hook(step: int, index: int) -> None:
        heartbeat.beat(step, index, actions[index])
        if fault is not None:
            fault(step, index)

    return hook


def _fault_hook(rank: int):
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None  # under torchrun, the first attempt only: its restarts then run clean
    fault_rank, step, action, *how = spec.split(":")
    if int(fault_rank) != rank:
        return None

    def hook(at_step: int, at_action: int) -> None:
        if (at_step, at_action) != (int(step), int(action)):
            return
        if how == ["stop"]:  # a hang inside the action: it runs a moment, then no longer runs
            time.sleep(1.0)  # (long enough for the heartbeat to publish where it is)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif how == ["kill"]:  # killed from outside, a moment into the action
            time.sleep(1.0)  # (long enough for the heartbeat to publish where it is)
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(FAULT_EXIT)  # a crash: no clean-up, no goodbye to the peers

    return hook


def _steps(options: RunOptions, executor, optimizer, device, source, start: int, saving=None):
    """Run steps ``start`` … ``options.steps - 1`` with a progress bar on rank 0, evaluating,
    saving (through the process group ``saving``) and logging as the options say; returns
    the losses, the per-step times (step, blocked on collectives, blocked on pipeline
    receives), the evaluations (step, loss), the steps skipped as non-finite (1-based) and
    the (step, why) of each update this rank rolled back (``optimizer_check = post``: why is
    "clipped" or "skipped", :attr:`~.optim.DistributedAdamW.rollbacks`). A non-finite step stops the run
    (NonFiniteError) unless ``options.skip_nonfinite``."""
    from tqdm import tqdm

    from .steplog import StepLog

    # A thread lock instead of tqdm's default multiprocessing one: a rank stopped by the
    # spawner would leak its semaphore.
    tqdm.set_lock(threading.RLock())
    rank = executor.comm.rank
    tokens = source.global_sequences * executor.program.model.get("seq")
    losses, times, evals, skipped = [], {"step": [], "collective": [], "p2p": [], "core_wait": [], "cpu": [], "lanes": []}, [], []
    rolled: list[tuple[int, str]] = []
    log = StepLog(options.log if rank == 0 else None, tokens, resumed=start if options.resume else None)
    rotation = None
    if options.save and rank == 0:  # the older saves are removed off the training's critical path
        from .checkpoint import Rotation, resolve

        rotation = Rotation(resolve(options.resume) if options.resume else None)
    schedule = options.lr_schedule(start)
    bar = tqdm(range(start, options.steps), desc="training", unit="step", disable=None if rank == 0 else True,
               file=sys.stderr)
    with _cuda_profile(options, device, rank), log:
        for step in bar:
            lr, before = schedule.lr, len(optimizer.rollbacks)
            with _step_mark(step, _profiled(options, device)):
                bad = _one_step(executor, optimizer, device, source.batch(step), lr, times, losses,
                                finite=options.as_rank is None)
            schedule.advance()
            rolled += [(step + 1, why) for _, why in optimizer.rollbacks[before:]]
            record = log.step(step, losses[-1], lr, optimizer.last_norm, times, _peak_bytes(executor),
                              skipped=bad is not None)
            if bad is not None:
                if not options.skip_nonfinite:
                    raise _nonfinite_error(step, losses[-1], optimizer.last_norm, bad, rank)
                skipped.append(step + 1)
            if options.eval_every and ((step + 1) % options.eval_every == 0 or step + 1 == options.steps):
                evals.append((step, _evaluate(executor, source)))
                log.evaluation(step, evals[-1][1])
            if options.save and (step + 1 == options.steps or (
                    options.save_every and (step + 1) % options.save_every == 0)):
                from .checkpoint import save
                from .data import saved_data

                save(options.save, executor, optimizer, step=step + 1, seed=options.seed,
                     global_sequences=source.global_sequences, group=saving, schedule=options.schedule(),
                     keep=options.keep, program={"path": os.path.abspath(options.path), "text": options.compiled.text},
                     data=saved_data(options.data, source) if rank == 0 else None, rotation=rotation)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                            step_ms=f"{1e3 * times['step'][-1]:.1f}")
    bar.close()
    if options.save:  # the last removals: the others wait for them here, not in a collective under --timeout
        import torch.distributed as dist

        if rotation is not None:
            rotation.join()
        dist.barrier(group=saving)
    return losses, times, evals, tuple(skipped), tuple(rolled)


def _peak_bytes(executor) -> int:
    import torch

    if executor.device.type == "cuda":
        return torch.cuda.max_memory_allocated(executor.device)
    return executor.recorder.peak_bytes


def run_queue_seconds() -> float | None:
    """Seconds this thread has been runnable but waiting for a CPU core (Linux's
    ``/proc/thread-self/schedstat``, second field); None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def model_state_bytes(executor, optimizer) -> int:
    """Bytes of the model states this rank holds after a step, each storage once: its
    weights (ZeRO-3: its pieces), the gradients of the last step (ZeRO-2: the full ones it
    did not drop and the optimizer's reduced 1/dp parts of those it did,
    :attr:`~.optim.DistributedAdamW.grad_parts`) and the optimizer's moments and fp32 masters
    (:meth:`~.optim.DistributedAdamW.state_tensors`)."""
    return _storage_bytes([executor.params, executor.grads(), optimizer.grad_parts, optimizer.state_tensors()])


def _storage_bytes(values) -> int:
    from dhelix.interpreter.execute.layer_exec import count_storages

    seen: dict[int, int] = {}
    count_storages(values, seen)
    return sum(seen.values())


def _evaluate(executor, source) -> float:
    """The loss of the held-out batch with the current weights (its gradients are dropped):
    one global batch, the first windows of the held-out data (how many of them:
    :meth:`~.data.DataSource.held_out_coverage`, which the summary states)."""
    from dhelix.interpreter.verify.harness import replica_batch

    batch = replica_batch(source.held_out(), executor.comm.index("dp"), executor.program.train.microbatches)
    return executor.step(batch, hand_over=False).item()  # nothing to reduce


def _one_step(executor, optimizer, device, batch, lr: float, times: dict, losses: list, finite: bool = True):
    """One training step on the global ``batch`` with learning rate ``lr``; appends its loss
    and its times (step, blocked on collectives, blocked on pipeline receives) to
    ``losses`` and ``times``. A loss or gradient norm that is not finite (the same verdict
    on every rank: both are global) is not applied: returns what rank 0 gathered of the
    non-finite gradients (:func:`_nonfinite_grads`), else None."""
    import torch

    from dhelix.interpreter.verify.harness import replica_batch

    comm, waited = executor.comm, executor.recorder.waited
    batch = replica_batch(batch, comm.index("dp"), executor.program.train.microbatches)
    start, before, queued, cpu = time.perf_counter(), dict(waited), run_queue_seconds(), time.process_time()
    loss = executor.step(batch)
    grads = executor.grads()
    # The loss is read once the norm has been (that waits for the device already).
    # A rank alone (--as-rank) computes stand-in numbers: every update is applied, finite or not.
    applied = optimizer.step(grads, lr, accept=lambda norm: not finite or (norm is None or math.isfinite(norm))
                             and math.isfinite(loss.item()))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times["step"].append(time.perf_counter() - start)
    times["cpu"].append(time.process_time() - cpu)
    if queued is not None:
        times["core_wait"].append(run_queue_seconds() - queued)
    for kind in ("collective", "p2p"):
        times[kind].append(waited[kind] - before[kind])
    lanes = getattr(comm.inner, "lanes", None)  # a stand-in world's lanes time their exposure
    if lanes is not None:
        times["lanes"].append(lanes.take())
    losses.append(loss.item())
    return None if applied else _nonfinite_grads(grads, comm.rank)


def _nonfinite_grads(grads: dict, rank: int) -> list:
    """Every rank's non-finite gradients (name list, model order) gathered on rank 0 as
    (rank, names); an empty list elsewhere. Collective over the world."""
    import torch

    from dhelix.interpreter.verify.harness import gather_to_first

    names = [name for name, grad in grads.items() if not bool(torch.isfinite(grad).all())]
    return gather_to_first((rank, names)) or []


def _nonfinite_error(step: int, loss: float, norm: float | None, found: list, rank: int) -> NonFiniteError:
    """The error that stops a run at non-finite training ``step`` (0-based), naming the
    first non-finite gradients each rank holds (``found``, rank 0's gathering)."""
    what = [f"loss {loss}"] + ([f"gradient norm {norm}"] if norm is not None else [])
    named = [f"rank {r}: {', '.join(names[:3])}{' …' if len(names) > 3 else ''} ({len(names)} in all)"
             for r, names in found if names]
    notes = [f"first non-finite gradients: {'; '.join(named)}" if named
             else "every gradient is finite: the loss itself overflowed" if found
             else "rank 0 names the non-finite gradients"]
    notes += ["the update was not applied; the last checkpoint (if any) was saved before it"]
    return NonFiniteError(f"rank {rank}: training step {step + 1} is not finite ({', '.join(what)}); the run "
                          "stopped", notes=notes)


def _step_mark(step: int, profiled: bool):
    """Under torch.profiler (``profiled``), the span of training ``step`` named ``dhelix step N``
    (1-based) in the trace, so that a reader can take the steps apart (the first holds the
    compilation)."""
    if not profiled:
        return contextlib.nullcontext()
    from torch.profiler import record_function

    return record_function(f"{STEP_MARK}{step + 1}")


#: The name of a training step's span in a torch.profiler trace, before its 1-based number.
STEP_MARK = "dhelix step "


def _profiled(options: RunOptions, device) -> bool:
    """Whether torch.profiler records the run: on CUDA with a trace."""
    return device.type == "cuda" and options.trace is not None


def _cuda_profile(options: RunOptions, device, rank: int):
    """On CUDA with a trace, torch.profiler over the steps, written per rank beside the
    trace (``OUT.rank3.json``): the host timestamps of our own trace say when work was
    launched, the profiler's when the compute and NCCL streams ran it."""
    if not _profiled(options, device):
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    @contextlib.contextmanager
    def profiled():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            yield
        prof.export_chrome_trace(str(Path(options.trace).with_suffix(f".rank{rank}.json")))

    return profiled()


def _gather(executor, losses: list, times: dict, evals: list, optimizer, rolled: tuple = ()) -> RunResult | None:
    """Every rank's record gathered on global rank 0 as the run's result (None elsewhere);
    ``rolled``: the (step, why) of the updates this rank rolled back."""
    import torch

    from dhelix.interpreter.verify.harness import gather_to_first

    recorder, rank = executor.recorder, executor.comm.rank
    cuda_peak = None
    if executor.device.type == "cuda":  # what the allocator saw: weights, gradients and buffers too
        cuda_peak = torch.cuda.max_memory_allocated(executor.device)
    mine = RankRecord(rank=rank, step=tuple(times["step"]), collective=tuple(times["collective"]),
                      p2p=tuple(times["p2p"]), core_wait=tuple(times["core_wait"]), cpu=tuple(times["cpu"]),
                      peak_activations=recorder.peak_bytes, cuda_peak=cuda_peak,
                      model_states=model_state_bytes(executor, optimizer),
                      optimizer_scratch=_storage_bytes(optimizer.scratch_tensors()),
                      host_states=_storage_bytes(optimizer.host_tensors()),
                      device=str(executor.device), host=socket.gethostname(),
                      lanes=tuple(times["lanes"]), rollbacks=tuple(rolled), issued=tuple(getattr(executor.comm.inner, "issued", ())),
                      events=tuple(TraceEvent(rank, lane, name, start, duration)
                                   for name, lane, start, duration in recorder.events))
    ranks = gather_to_first(mine)
    return None if ranks is None else RunResult(losses=tuple(losses), ranks=tuple(ranks), evals=tuple(evals))
