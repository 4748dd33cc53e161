"""Which priced choices of `dhelix tune` are one program under two names.

On one pipeline stage, say, a fold into chunks and the pipelines that differ only in how they
order the stages of a rank run the same layers in the same order: a forward through chunk 0
then chunk 1 of a micro-batch is one forward through all the layers. The search keeps one of
them in its top (:func:`~dhelix.dsl.search.branch.insert`), so that the table is not filled
with rows that differ by their names only.

Two choices are the same program when their layouts are equal and their ranks run the same
layer passes in the same order (:func:`layer_passes`), with SI on or off alike where the
schedule has SI blocks, and their simulations agree on the step and the peak memory."""

from __future__ import annotations

from dhelix.dsl.core.program import Program
from dhelix.dsl.core.schedule import Compute, Interleaved, Transfer
from dhelix.dsl.search.space import Choice
from dhelix.dsl.simulator.simulation import Simulation


def program_key(program: Program, choice: Choice, sim: Simulation) -> tuple:
    """What makes ``choice`` (checked as ``program``, simulated as ``sim``) the program it
    is: equal keys are the same program (module docstring)."""
    lowered = program.lowered
    assert lowered is not None, "a validated program"
    return (choice.layout, choice.si if lowered.interleaved else None, layer_passes(program),
            round(sim.step_time, 12), round(max(r.memory for r in sim.ranks), 3))


def layer_passes(program: Program) -> tuple:
    """Each rank's actions as the layers they run, in order: a computation as (kind,
    micro-batch, first layer, last layer), consecutive ones of one kind and micro-batch
    over adjacent layers (a forward going up, a backward going down) merged into one; an SI
    block as its two computations; a transfer as (kind, data, micro-batch, its layers, peer)."""
    lowered, placement = program.lowered, program.placement
    assert lowered is not None and placement is not None, "a validated program"
    stages = placement.stages

    def layers(rank: int, chunk: int) -> tuple[int, int]:
        stage = stages[lowered.stage_of(rank, chunk)]
        return stage.first_layer, stage.stop_layer - 1

    rows = []
    for rank, actions in enumerate(lowered.actions):
        row: list[tuple] = []
        for action in actions:
            if isinstance(action, Transfer):
                row.append((action.kind, action.data, action.microbatch, layers(rank, action.chunk), action.peer))
            elif isinstance(action, Interleaved):
                row.append(("SI",) + tuple((c.kind, c.microbatch, *layers(rank, c.chunk)) for c in action.parts))
            else:
                _append(row, action, *layers(rank, action.chunk))
        rows.append(tuple(row))
    return tuple(rows)


def _append(row: list[tuple], action: Compute, first: int, last: int) -> None:
    """Add a computation over layers ``first..last`` to ``row``, merged into the one before
    when that one is of its kind and micro-batch and its layers continue in its direction."""
    if row and len(row[-1]) == 4 and row[-1][:2] == (action.kind, action.microbatch):
        kind, microbatch, low, high = row[-1]
        if kind == "F" and high + 1 == first:
            row[-1] = (kind, microbatch, low, last)
            return
        if kind != "F" and last + 1 == low:
            row[-1] = (kind, microbatch, first, high)
            return
    row.append((action.kind, action.microbatch, first, last))
