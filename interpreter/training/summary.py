"""What a run measured, beside what the simulator predicted: values the command line prints.

The training loop (:mod:`.train`) ends on global rank 0 with a :class:`RunResult`: the losses
and, per rank, a :class:`RankRecord` of step times, time blocked on communication, peak live
activations and the trace events. :func:`summarize` turns it into a :class:`RunSummary`
(medians per rank, the measured step time, exposed communication and activation peak, and the
simulator's prediction of the same three for the same program, SI and ZeRO settings);
:func:`format_summary` is its table. Nothing here imports torch or prints.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import TYPE_CHECKING

import attrs

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.timeline import TraceEvent
from dhelix.dsl.planner.si_plan import SIMode

if TYPE_CHECKING:
    from .train import RunOptions

@attrs.frozen(kw_only=True)
class RankRecord:
    """What one rank measured: per step the time, the seconds blocked on collectives
    (exposed communication) and on pipeline receives (bubbles included); the peak of live
    activation bytes, the CUDA allocator's peak (None on CPU) and the trace events."""

    rank: int
    step: tuple[float, ...]
    collective: tuple[float, ...]
    p2p: tuple[float, ...]
    peak_activations: int
    cuda_peak: int | None = None
    #: Per step, the seconds the rank's main thread was runnable but waiting for a CPU core
    #: (empty where the kernel does not say).
    core_wait: tuple[float, ...] = ()
    #: Per step, the CPU seconds the rank's process used, every thread of it (the collective
    #: backend's too): user and system time.
    cpu: tuple[float, ...] = ()
    #: Bytes of weights, gradients and optimizer moments and masters after the last step;
    #: the optimizer's flat work buffers beside them.
    model_states: int = 0
    optimizer_scratch: int = 0
    #: Offloaded (``train { offload = optimizer }``): bytes of host memory the optimizer keeps
    #: (its share of masters and moments, the copies' staging buffers); 0 otherwise.
    host_states: int = 0
    events: tuple[TraceEvent, ...] = ()
    device: str = "cpu"
    host: str = ""
    #: In a stand-in world (``--as-rank``): per step, per lane, the seconds exposed and busy; and every
    #: transfer issued, ``(kind, axis, shape)`` in issue order.
    lanes: tuple = ()
    issued: tuple = ()
    #: ``train { optimizer_check = post }``: (step, "clipped" or "skipped") of every update
    #: this rank made before the global gradient norm was known and rolled back (1-based).
    rollbacks: tuple[tuple[int, str], ...] = ()


@attrs.frozen(kw_only=True)
class RunResult:
    """What a run gives back on global rank 0: the loss of every step, every rank's record
    (empty for ``--check`` runs) and, for ``--check``, the per-step comparisons with the
    reference (:class:`~.harness.StepCheck`)."""

    losses: tuple[float, ...]
    ranks: tuple[RankRecord, ...] = ()
    checks: tuple = ()
    #: (step, held-out loss) of every evaluation.
    evals: tuple = ()
    #: The ranks per node measured under torchrun when they replaced the cluster block's
    #: (``--topology measured``), and the summary's line saying so; None and "" otherwise.
    gpus_per_node: int | None = None
    topology: str = ""
    #: The steps (1-based) skipped because their loss or gradient norm was not finite
    #: (``--skip-nonfinite``).
    skipped: tuple[int, ...] = ()
    #: With evaluations on data: (distinct held-out windows each evaluation covers, held-out
    #: windows in all); None otherwise.
    held_out: tuple[int, int] | None = None

    @property
    def rollbacks(self) -> tuple[tuple[int, int, str], ...]:
        """(step, rank, "clipped" or "skipped") of every update a rank rolled back
        (``optimizer_check = post``), by step then rank."""
        return tuple(sorted((step, r.rank, why) for r in self.ranks for step, why in r.rollbacks))

    @property
    def events(self) -> tuple[TraceEvent, ...]:
        """Every rank's trace events, in rank order."""
        return tuple(event for record in self.ranks for event in record.events)


@attrs.frozen(kw_only=True)
class RankFigures:
    """One rank's medians per step (seconds) and its activation peak (bytes)."""

    rank: int
    step_time: float
    exposed_comm: float
    p2p_wait: float
    peak_activations: int


@attrs.frozen(kw_only=True)
class Figures:
    """Step time and exposed communication (seconds), activation peak (bytes); None where
    a figure is not known (exposed communication is not timed on CUDA)."""

    step_time: float | None = None
    exposed_comm: float | None = None
    peak_activations: float | None = None
    #: Per pipeline rank (the simulator's ranks, in order): the activation peak and the model
    #: states' bytes; empty where not known.
    rank_activations: tuple[float, ...] = ()
    rank_states: tuple[float, ...] = ()


@attrs.frozen(kw_only=True)
class RunSummary:
    """The end of a run: what ran, the losses, per-rank medians, measured beside predicted."""

    path: str
    pipeline: str
    mesh: str
    backend: str
    si: str
    losses: tuple[float, ...]
    ranks: tuple[RankFigures, ...]
    measured: Figures
    predicted: Figures
    cuda_peak: int | None = None
    note: str = ""
    devices: str = ""
    topology: str = ""
    #: The pipeline rank (pp coordinate) of each of :attr:`ranks`.
    pipeline_ranks: tuple[int, ...] = ()


def describe_devices(ranks) -> str:
    """Which device each rank ran on: ``cpu on every rank (host a)``, or per host the ranks
    and their devices (``a: rank 0 cuda:0, rank 1 cuda:1; b: …``)."""
    hosts: dict[str, list] = {}
    for record in ranks:
        hosts.setdefault(record.host or "this host", []).append(record)
    if all(record.device == "cpu" for record in ranks):
        return f"cpu on every rank ({', '.join(hosts)})"
    return "; ".join(f"{host}: " + ", ".join(f"rank {r.rank} {r.device}" for r in records)
                     for host, records in hosts.items())


def describe_si(program, options: "RunOptions") -> str:
    """What the run does with SI blocks: ``on (planned plan)``, ``off``, or, for a schedule
    that has none, says so (SI then changes nothing)."""
    from dhelix.dsl.planner.si_plan import has_si_blocks

    if not has_si_blocks(program.lowered):
        return "none (the schedule has no SI blocks)"
    if options.si:
        return f"on ({options.plan} plan)"
    return "off (the train block's si = off)" if not program.train.interleaves else "off"


def describe_data(data, eval_data=None) -> str:
    """What the run trains on, plainly: the data's path (``data``: a DataSpec or a Blend of
    them; None: seeded random tokens), its tokenizer and where the held-out part comes
    from (``eval_data``: the ``--eval-data`` DataSpec; None: the data's tail)."""
    if data is None:
        return "seeded random tokens (no data given)"
    sources = getattr(data, "sources", (data,))
    weights = getattr(data, "weights", None)
    if len(sources) == 1:
        what = sources[0].path
    else:
        shares = weights or ("by size",) * len(sources)
        what = "a blend of " + ", ".join(f"{source.path} ({share if isinstance(share, str) else f'{share:g}'})"
                                         for source, share in zip(sources, shares, strict=True))
    given = f"given by {sources[0].flag}" if sources[0].flag else "the train block's data"
    tokens = (f"text through the tokenizer {sources[0].tokenizer}" if sources[0].tokenizer
              else "text as byte-level tokens")
    held = (f"held out: {eval_data.path} ({eval_data.flag or 'given apart'})" if eval_data is not None
            else "held out: the last 10% of its tokens" + (" (of each source)" if len(sources) > 1 else ""))
    return f"{what} ({given}; {tokens}, token files as stored; {held})"


def run_header(path: str, pipeline: str, mesh: str, ranks: int, backend: str, si: str) -> str:
    """The line that says what runs: ``FILE: pipeline, mesh on N backend rank(s), SI …``
    (printed before the ranks start, and again atop the summary)."""
    return f"{path}: {pipeline}, {mesh} on {ranks} {backend} rank(s), SI {si}"


def describe_mesh(mesh) -> str:
    """``tp 2 × pp 2`` (the axes larger than 1, innermost first); ``dp 4 (ep 2)`` where the
    experts are split over part of dp."""
    parts = [f"{axis} {size}" + (f" (ep {mesh.ep})" if axis == "dp" and mesh.ep > 1 else "")
             for axis, size in zip(mesh.order, mesh.sizes, strict=True) if size > 1]
    return " × ".join(parts) or "1 rank"


def steady(values) -> float:
    """The median of ``values`` without the first, which pays for warm-up (allocations,
    connection set-up); with the first when it is the only one."""
    ordered = sorted(values[1:] or values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def summarize(program, options: "RunOptions", result: RunResult) -> RunSummary:
    """The summary of ``result``, a run of ``program`` as ``options`` says."""
    ranks = result.ranks
    per_step = [max(times) for times in zip(*(r.step for r in ranks), strict=True)]
    # On CUDA, waits only order streams: host time says nothing about exposed communication.
    exposed = None if options.backend == "nccl" else max(steady(r.collective) for r in ranks)
    cuda = [r.cuda_peak for r in ranks if r.cuda_peak is not None]
    predicted, note = simulated(program, options)
    shared = shared_cores(ranks, core_wait=max((steady(r.core_wait) for r in ranks if r.core_wait), default=None),
                          counted=program.profile is not None and program.profile.cores is not None)
    note = "; ".join(filter(None, [note, shared]))
    return RunSummary(
        path=options.path, pipeline=program.pipeline.name, mesh=describe_mesh(program.mesh),
        backend=options.backend, si=describe_si(program, options),
        losses=result.losses,
        ranks=tuple(RankFigures(rank=r.rank, step_time=steady(r.step), exposed_comm=steady(r.collective),
                                p2p_wait=steady(r.p2p), peak_activations=r.peak_activations) for r in ranks),
        measured=Figures(step_time=steady(per_step), exposed_comm=exposed,
                         peak_activations=max(r.peak_activations for r in ranks)),
        predicted=predicted, cuda_peak=max(cuda) if cuda else None, note=note, devices=describe_devices(ranks),
        topology=result.topology,
        pipeline_ranks=tuple(program.mesh.position(r.rank, "pp") for r in ranks))


def simulated(program, options: "RunOptions") -> tuple[Figures, str]:
    """The simulator's step time, exposed communication (layer and DP collectives, the worst
    rank's) and activation peak of the run ``options.compiled`` (of ``program``) as the
    ranks ran it (:func:`~dhelix.dsl.simulator.runplan.price`), with a note saying
    what they are a prediction of (and when the step is the bound of a CPU host's shared
    cores, :mod:`dhelix.dsl.simulator.host_cores`); empty figures and the reason when it
    cannot simulate."""
    from dhelix.dsl.simulator.runplan import price

    try:
        result = price(options.compiled, zero1=options.zero1, optimizer_check=options.optimizer_check)
    except DhelixError as exc:
        return Figures(), f"cannot simulate this program: {exc.message}"
    note = "predicted " + profile_provenance(program.profile, program.cluster.profile)
    if options.si and options.plan not in (SIMode.PLANNED, SIMode.SCHEDULED):
        note += "; it prices SI blocks with the planner's plan, this run used " + options.plan
    if result.cores_bound > result.timeline_time:
        cores = program.profile.cores
        note += (f"; {cores.ranks_on_host(result.world)} ranks share {cores.usable} cores where the profile was "
                 f"measured: the step is at least their CPU work over the cores, {1e3 * result.step_time:.1f} ms "
                 f"({1e3 * result.timeline_time:.1f} ms on a core each)")
    return Figures(step_time=result.step_time,
                   exposed_comm=max(r.layer_exposed + r.dp_exposed for r in result.ranks),
                   peak_activations=max(r.activations for r in result.ranks),
                   rank_activations=tuple(r.activations for r in result.ranks),
                   rank_states=tuple(r.states.total for r in result.ranks)), note


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or ``taskset``
    narrows; the machine's count where the system does not say)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_cpu_ranks(ranks, host: str | None = None) -> int:
    """How many of ``ranks`` ran on this machine's (``host``'s) CPU."""
    host = host if host is not None else socket.gethostname()
    return sum(1 for r in ranks if r.device == "cpu" and r.host in (host, ""))


def shared_cores(ranks, cores: int | None = None, host: str | None = None, core_wait: float | None = None,
                 counted: bool = False) -> str:
    """Why a CPU run on more local ranks than this machine has cores can be slower than the
    prediction, plainly, or "" when it is not such a run; ``core_wait``: the seconds per step
    the slowest-waiting rank was runnable but waiting for a core (median, None: not known);
    ``counted``: the profile states its host's cores, so that the prediction holds the
    bound of their shared work. ``cores`` and ``host`` default to this machine's."""
    cores = cores or usable_cores()
    local = local_cpu_ranks(ranks, host)
    if local <= cores:
        return ""
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    waited = "" if core_wait is None else f" (measured: a rank waited {1e3 * core_wait:.2f}ms per step for a core)"
    priced = ("the prediction counts the ranks' CPU work over the cores the profile was measured with (the step "
              "is at least that), not when the ranks want a core at the same moment, nor other processes' load"
              if counted else "the profile does not say how many cores its host had, so the prediction gives "
              "each rank a core of its own")
    return (f"{local} ranks share {cores} CPU cores here{load}: the profile times each op in bursts "
            f"shorter than a scheduler slice (a core's speed), while in the run a rank waits for a core{waited} "
            f"and each collective also for its peer to be scheduled; {priced}, so the step measured here can be "
            f"longer")


def metrics(summary: RunSummary, options: "RunOptions", result: RunResult) -> dict:
    """The summary's figures and every rank's per-step times as plain values (what
    ``dhelix run --metrics`` writes as JSON for scripts such as benchmarks/two_nodes.py):
    seconds and bytes; ``program`` the fingerprint of the program's sources
    (:func:`~dhelix.dsl.frontend.imports.sources_digest`); ``held_out`` the held-out losses
    (step numbered from 1, as the summary counts) and ``held_out_windows`` how much of the
    held-out data each covered; ``data`` what trained; ``exposed_comm_s`` is None on CUDA, predicted figures None when the
    program cannot be simulated."""
    from dhelix.dsl.frontend.imports import sources_digest

    measured, predicted = summary.measured, summary.predicted
    compiled = options.compiled
    return {
        "file": options.path,
        # What `dhelix report --run` checks it is given the metrics of its program by.
        "program": {"sources_sha256": sources_digest(compiled.program.files, compiled.text)},
        "backend": options.backend, "si": options.si, "plan": options.plan,
        "topology": summary.topology or "declared",
        "steps": len(result.losses), "losses": list(result.losses),
        "held_out": [{"step": step + 1, "loss": loss} for step, loss in result.evals],
        "held_out_windows": None if result.held_out is None else dict(zip(("evaluated", "of"), result.held_out,
                                                                          strict=True)),
        "data": describe_data(options.data, options.eval_data),
        "step_s": measured.step_time, "exposed_comm_s": measured.exposed_comm,
        "peak_activations_bytes": measured.peak_activations,
        "predicted": {"step_s": predicted.step_time, "exposed_comm_s": predicted.exposed_comm,
                      "peak_activations_bytes": predicted.peak_activations, "note": summary.note,
                      "pipeline_ranks": [{"pp": pp, "peak_activations_bytes": acts, "model_states_bytes": states}
                                         for pp, (acts, states) in enumerate(zip(predicted.rank_activations,
                                                                                 predicted.rank_states, strict=True))]},
        "ranks": [{"rank": r.rank, "pp": summary.pipeline_ranks[i] if summary.pipeline_ranks else 0, "device": r.device, "host": r.host,
                   "step_s": list(r.step), "collective_s": list(r.collective), "p2p_s": list(r.p2p), "core_wait_s": list(r.core_wait),
                   "cpu_s": list(r.cpu),
                   "peak_activations_bytes": r.peak_activations, "model_states_bytes": r.model_states,
                   "optimizer_scratch_bytes": r.optimizer_scratch, "host_states_bytes": r.host_states}
                  for i, r in enumerate(result.ranks)],
        "optimizer_check": options.optimizer_check,
        "rollbacks": [{"step": step, "rank": rank, "redone": why} for step, rank, why in result.rollbacks],
    }


def rollback_line(rollbacks: tuple[tuple[int, int, str], ...]) -> str:
    """The summary's line naming the updates post-validation rolled back (``rollbacks``:
    :attr:`RunResult.rollbacks`): at which step, on which rank, and whether the update was
    redone clipped or skipped."""
    shown = "; ".join(f"step {step} on rank {rank} ({'redone clipped' if why == 'clipped' else 'not applied'})"
                      for step, rank, why in rollbacks[:8])
    more = f"; … {len(rollbacks) - 8} more" if len(rollbacks) > 8 else ""
    return (f"rolled back: {len(rollbacks)} update(s) made before the global gradient norm was known "
            f"(optimizer_check = post): {shown}{more}")


def profile_provenance(profile, named: str) -> str:
    """Whose machine the prediction is for, plainly: ``with the profile measured on this
    machine`` only when ``profile`` (named ``named``) was measured on this host."""
    measured = profile.measured
    if measured is None:
        return f"for the {named} profile (not measured here), not for this machine"
    host = str(measured.stamp.get("machine", "")).split(":", 1)[0]
    when = measured.stamp.get("date", "")
    if host == platform.node():
        return f"with the profile {named} measured on this machine ({when})"
    return f"with the profile {named} measured on {host or 'another machine'} ({when}), not on this machine"


def held_out_extent(coverage: tuple[int, int] | None) -> str:
    """What an evaluation covered, exactly (``coverage``: RunResult.held_out): ``all 12
    held-out windows`` or ``16 of the 57 held-out windows (one global batch, the first)``;
    seeded random tokens where None."""
    if coverage is None:
        return "one global batch of seeded random tokens"
    evaluated, total = coverage
    if evaluated >= total:
        return f"all {total} held-out window(s) of seq + 1 tokens"
    return (f"{evaluated} of the {total} held-out windows of seq + 1 tokens (one global batch: the first "
            f"{evaluated}; the other {total - evaluated} are not evaluated)")


def format_summary(summary: RunSummary) -> str:
    """The end-of-run table: what ran, the losses, per rank the median step time, time
    blocked on collectives and on pipeline receives and the activation peak; then the
    measured figures beside the simulated ones."""
    lines = [run_header(summary.path, summary.pipeline, summary.mesh, len(summary.ranks), summary.backend, summary.si),
             *([f"devices: {summary.devices}"] if summary.devices else []),
             *([f"topology: {summary.topology}"] if summary.topology else []),
             f"loss {summary.losses[0]:.4f} -> {summary.losses[-1]:.4f} over {len(summary.losses)} step(s); "
             "medians per step (first step excluded):",
             f"{'rank':>6} {'step time':>12} {'exposed comm':>14} {'p2p wait':>12} {'peak activations':>18}"]
    for r in summary.ranks:
        lines.append(f"{r.rank:>6} {1e3 * r.step_time:>10.2f}ms {1e3 * r.exposed_comm:>12.2f}ms"
                     f" {1e3 * r.p2p_wait:>10.2f}ms {r.peak_activations / 2**20:>15.3f}MiB")
    measured, predicted = summary.measured, summary.predicted
    lines += [f"{'':>14} {'measured':>12} {'simulated':>12}",
              f"{'step time':>14} {1e3 * measured.step_time:>10.2f}ms {_fmt(predicted.step_time, 1e3, 'ms'):>12}",
              f"{'exposed comm':>14} {_fmt(measured.exposed_comm, 1e3, 'ms'):>12} "
              f"{_fmt(predicted.exposed_comm, 1e3, 'ms'):>12}",
              f"{'peak act.':>14} {measured.peak_activations / 2**20:>9.3f}MiB "
              f"{_fmt(predicted.peak_activations, 2**-20, 'MiB'):>12}"]
    if measured.exposed_comm is None:
        lines.append("exposed comm: not timed on CUDA; see the per-rank torch.profiler traces written "
                     "beside the trace")
    if summary.cuda_peak is not None:
        lines.append(f"CUDA peak allocated (weights and buffers included): {summary.cuda_peak / 2**20:.1f}MiB")
    if summary.note:
        lines.append(f"simulator: {summary.note}")
    return "\n".join(lines)


def _fmt(value, scale: float, unit: str) -> str:
    return "—" if value is None else f"{value * scale:.2f}{unit}"
