"""What one rank run alone measured (``dhelix run --as-rank R``), beside the simulator's
prediction for that rank.

A rank in a stand-in world (:mod:`dhelix.interpreter.ops.standin`) never waits for a pipeline
peer: its receives are stand-ins, ready once issued. So the figure it measures is its own work
and the communication its lanes leave exposed, and the prediction beside it is the same for its
pipeline stage: the simulated compute of the stage (``busy``, its layers' exposed communication
inside), its exposed DP communication and its optimizer step — not the whole step, which adds the waits for the peers
(the pipeline bubble), printed on its own line. Memory: on CUDA the allocator's peak
(``max_memory_allocated``: weights, gradients, optimizer states, activations and buffers)
beside the simulated model states plus activation peak; on CPU the interpreter's own count of
the same two. Nothing here imports torch or prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from dhelix.dsl.core.errors import DhelixError

from .summary import RunResult, describe_mesh, profile_provenance, steady

if TYPE_CHECKING:
    from .train import RunOptions


@attrs.frozen(kw_only=True)
class RankAlone:
    """One rank's medians per step (seconds; first step excluded) and peaks (bytes), measured
    and simulated (None where the program cannot be simulated)."""

    rank: int
    stage: int
    world: int
    device: str
    emulate: str
    losses: tuple[float, ...]
    step: float
    #: Per lane (local, cross): the seconds measured exposed, and busy with transfers.
    lanes: dict
    busy: dict
    peak_memory: int
    predicted_alone: float | None = None
    predicted_step: float | None = None
    predicted_exposed: float | None = None
    predicted_memory: float | None = None
    note: str = ""


def summarize_rank(program, options: "RunOptions", result: RunResult) -> RankAlone:
    """The figures of ``result``, rank ``options.as_rank`` of ``program`` run alone."""
    [record] = result.ranks
    lanes = sorted({lane for step in record.lanes for lane in step})
    measured_lanes = {lane: steady([step.get(lane, (0.0, 0.0))[0] for step in record.lanes]) for lane in lanes}
    busy = {lane: steady([step.get(lane, (0.0, 0.0))[1] for step in record.lanes]) for lane in lanes}
    peak = record.cuda_peak if record.cuda_peak is not None else record.model_states + record.peak_activations
    stage = program.mesh.position(record.rank, "pp")
    figures = RankAlone(rank=record.rank, stage=stage, world=program.mesh.world, device=record.device,
                        emulate=options.emulate, losses=result.losses, step=steady(record.step),
                        lanes=measured_lanes, busy=busy, peak_memory=peak)
    return _predicted(figures, options, stage)


def _predicted(figures: RankAlone, options: "RunOptions", stage: int) -> RankAlone:
    from dhelix.dsl.simulator.runplan import price

    try:
        simulation = price(options.compiled, zero1=options.zero1, optimizer_check=options.optimizer_check)
    except DhelixError as exc:
        return attrs.evolve(figures, note=f"cannot simulate this program: {exc.message}")
    stats = simulation.ranks[stage]
    # The stage's compute (its layers' exposed communication inside), the DP tail, the optimizer.
    return attrs.evolve(figures, predicted_alone=stats.busy + stats.dp_exposed + stats.optimizer,
                        predicted_step=simulation.step_time, predicted_exposed=stats.layer_exposed + stats.dp_exposed,
                        predicted_memory=stats.memory,
                        note="predicted " + profile_provenance(options.compiled.program.profile,
                                                               options.compiled.program.cluster.profile))


def format_rank(figures: RankAlone, path: str, pipeline: str, mesh) -> str:
    """The end-of-run table of a rank run alone: measured beside simulated."""
    ms = lambda value: "—" if value is None else f"{1e3 * value:.2f}ms"  # noqa: E731
    gib = lambda value: "—" if value is None else f"{value / 2**30:.3f}GiB"  # noqa: E731
    exposed = sum(figures.lanes.values())
    lines = [f"{path}: {pipeline}, {describe_mesh(mesh)}: rank {figures.rank} of {figures.world} alone on "
             f"{figures.device} (pipeline stage {figures.stage}), links emulated by {figures.emulate}",
             "numbers are not the reference's: every collective and pipeline transfer is a stand-in of the right "
             "shape (shapes, order, lanes, memory and time are the real rank's)",
             f"loss {figures.losses[0]:.4f} -> {figures.losses[-1]:.4f} over {len(figures.losses)} step(s) "
             "(stand-in numbers); medians per step (first step excluded):",
             f"{'':>28} {'measured':>12} {'simulated':>12}",
             f"{'step (this rank alone)':>28} {ms(figures.step):>12} {ms(figures.predicted_alone):>12}",
             f"{'exposed comm':>28} {ms(exposed):>12} {ms(figures.predicted_exposed):>12}"]
    for lane in sorted(figures.lanes):
        busy = figures.busy.get(lane, 0.0)
        exposed_here = figures.lanes[lane]
        hidden = ("" if not busy else f"; hidden {100 * (1 - exposed_here / busy):.1f}% of its {ms(busy)} busy"
                  if exposed_here <= busy else f"; more than its {ms(busy)} busy (waits for the lane's thread)")
        lines.append(f"{'  on the ' + lane + ' lane':>28} {ms(figures.lanes[lane]):>12}{hidden}")
    lines.append(f"{'peak memory':>28} {gib(figures.peak_memory):>12} {gib(figures.predicted_memory):>12}")
    if figures.predicted_step is not None:
        lines.append(f"the whole step with the pipeline's waits is simulated at {ms(figures.predicted_step)} "
                     "(a rank alone never waits for its peers)")
    what = ("CUDA's max_memory_allocated" if figures.device.startswith("cuda")
            else "the interpreter's count of model states and live activations")
    lines.append(f"peak memory measured: {what}; simulated: model states plus the activation peak")
    if figures.note:
        lines.append(f"simulator: {figures.note}")
    return "\n".join(lines)


def rank_metrics(figures: RankAlone) -> dict:
    """The figures as plain values (seconds, bytes) for ``--json`` and ``--metrics``."""
    return {"rank": figures.rank, "stage": figures.stage, "world": figures.world, "device": figures.device,
            "emulate": figures.emulate, "losses": list(figures.losses), "step_s": figures.step,
            "exposed_comm_s": sum(figures.lanes.values()), "lanes_exposed_s": dict(figures.lanes),
            "lanes_busy_s": dict(figures.busy),
            "peak_memory_bytes": figures.peak_memory,
            "predicted": {"alone_s": figures.predicted_alone, "step_s": figures.predicted_step,
                          "exposed_comm_s": figures.predicted_exposed,
                          "peak_memory_bytes": figures.predicted_memory, "note": figures.note}}
