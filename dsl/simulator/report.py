"""Variants to compare and the text reports of the step simulator.

:func:`compare` simulates a program as written and then minus one feature at a time on the
same model, mesh and micro-batches: without SI (every SI block runs its forward, then its
backward), as plain 1F1B without folding (``fold none``, ``one_f_one_b``), without its
partition block, without its model-level overlaps — each column differs from the first in
the one feature its label names.
:func:`format_simulation` and :func:`format_comparison` print the figures; every number is
formatted with a fixed precision, so the text is deterministic.
"""

from __future__ import annotations

import attrs

from dhelix.dsl.frontend.profilecheck import StaleProfileError
from dhelix.dsl.frontend.stdlib import stdlib_pipelines
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.simulator.memory import GB
from dhelix.dsl.core.errors import DhelixWarning
from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.program import FoldSpec, Program
from dhelix.dsl.core.table import format_table
from dhelix.dsl.simulator.events import Simulation, has_si, require_profile, schedule_plan, simulate
from dhelix.dsl.simulator.costs import cost_of

BASELINE_PIPELINE = "one_f_one_b"


def unfolded_1f1b(program: Program) -> Program:
    """``program`` re-lowered as 1F1B without folding (same model, mesh and micro-batches).

    Takes ``one_f_one_b`` from the program's pipelines, else from the standard library.
    Raises the usual located errors if the layers do not split over the pipeline ranks.
    """
    pipeline = next((p for p in program.pipelines if p.name == BASELINE_PIPELINE), None)
    pipeline = pipeline or stdlib_pipelines()[BASELINE_PIPELINE]
    changed = attrs.evolve(program, fold=FoldSpec.of("none", span=program.fold.span if program.fold else None),
                           pipeline=pipeline)
    # Only the fold and the pipeline change: the layer DAGs and strands stay, and the passes
    # from the fold on run again.
    return passes.rerun(changed, after="strands")


def unpartitioned(program: Program) -> Program:
    """``program`` without its partition block (Centauri off: nor what the planner chose for it),
    every pass after check run again. A profile measured on the partitioned program times its
    chunks, which are no ops of the whole layer: the variant then keeps only the profile's
    derived rates (peak, links, OEF, slowdown, launch gap), as :func:`compare` labels it."""
    bare = attrs.evolve(program, partition=None, chunk_counts=(), group_orders=(), backward_first=None,
                        substituted=())
    try:
        return passes.rerun(bare, after="check")
    except StaleProfileError:
        return passes.rerun(attrs.evolve(bare, profile=attrs.evolve(program.profile, measured=None)), after="check")


def without_model_level(program: Program) -> Program:
    """``program`` without Centauri's model-level overlaps that it turns on: ZeRO-1's weight
    gather after the optimizer again (``param_gather = step``) and the pipeline's default
    micro-batches per chunk (no ``launch``); every pass after check run again."""
    assert program.train is not None, "a checked model"
    train = attrs.evolve(program.train, param_gather="step", launch=None)
    return passes.rerun(attrs.evolve(program, train=train, launch=None), after="check")


def has_model_level(program: Program) -> bool:
    """Whether ``program`` turns on a model-level overlap that :func:`without_model_level` removes."""
    train = program.train
    return train is not None and (train.param_gather != "step" or train.launch is not None)


def compare(program: Program, plan: Plan | None = None, *, zero1: bool = False,
            scheduled: bool = False) -> tuple[Simulation, ...]:
    """``program`` as written (SI blocks by the block scheduler with ``scheduled``), then the
    program minus one feature at a time, each labelled with what it removes, for the
    features it has: SI (every SI block runs its forward, then its backward), the fold and
    pipeline (1F1B without folding), the partition block (and the planner's choices for it)
    and the model-level overlaps (:func:`without_model_level`). Everything else stays as
    written: each column differs from the first in one feature only."""
    require_profile(program)
    cost = cost_of(program)
    if plan is None and has_si(program):
        plan = schedule_plan(program, cost)
    sims = [simulate(program, plan, zero1=zero1, cost=cost, label="as written", scheduled=scheduled)]
    if has_si(program):
        sims.append(simulate(program, plan, si=False, zero1=zero1, cost=cost, label="without SI"))
    assert program.fold is not None and program.pipeline is not None, "a checked model"
    if program.fold.kind != "none" or program.pipeline.name != BASELINE_PIPELINE:
        sims.append(simulate(unfolded_1f1b(program), zero1=zero1, cost=cost, label="1F1B, fold none"))
    variants = ((unpartitioned, "without partition") if program.partition is not None else None,
                (without_model_level, "without model-level overlap") if has_model_level(program) else None)
    for change, label in filter(None, variants):
        other = change(program)
        if other.profile is not None and other.profile.measured is None and program.profile.measured is not None:
            label += " (profile's rates)"  # its measured section fits the program as written only
        other_cost = cost_of(other)
        other_plan = schedule_plan(other, other_cost) if has_si(other) else None
        sims.append(simulate(other, other_plan, zero1=zero1, cost=other_cost, label=label, scheduled=scheduled))
    return tuple(sims)


def describe(sim: Simulation) -> str:
    """One line naming the schedule: pipeline, fold, p, m, v and whether SI is on."""
    p, m, v = sim.shape
    si = "SI on" if sim.si else "no SI"
    optimizer = (f"ZeRO-3 (HSDP: layer weights and gradients sharded over groups of {sim.shard} dp ranks, "
                 "replicated across them)" if sim.shard else
                 "ZeRO-3 (FSDP: layer weights and gradients sharded)" if sim.fsdp else
                 ("ZeRO-2 (optimizer states and gradients sharded)" if sim.zero == 2 else "ZeRO-1 optimizer")
                 + (", weight gather under the next forward" if sim.gather_under_forward else "")
                 if sim.zero1 else "replicated optimizer")
    host = max(r.states.host for r in sim.ranks)
    share = sim.offload if sim.offload < 100 else None
    optimizer += (f", {f'{share}% of it ' if share else ''}offloaded to host ({host / GB:.3g} GB of host memory per GPU "
                  "at most)" if host else "")
    return f"{sim.program}: {sim.pipeline}, fold {sim.fold}, p={p} m={m} v={v}, {si}, {optimizer}"


@attrs.frozen
class Units:
    """The time and memory units of a report, picked from its largest figures so that tiny
    CPU examples and 405B models both read well: (name, divisor) each."""

    time: tuple[str, float]
    memory: tuple[str, float]

    @classmethod
    def of(cls, sims) -> "Units":
        """Units for the simulations ``sims`` (their longest step, their largest peak memory)."""
        step = max(s.step_time for s in sims)
        memory = max(s.peak_rank.memory for s in sims)
        time = next((unit for unit in (("s", 1.0), ("ms", 1e-3)) if step >= unit[1]), ("us", 1e-6))
        size = next((unit for unit in (("GB", GB), ("MB", 1e6)) if memory >= unit[1]), ("KB", 1e3))
        return cls(time, size)

    def t(self, seconds: float) -> str:
        """A time in the report's unit, 3 decimals."""
        return f"{seconds / self.time[1]:.3f}"

    def m(self, nbytes: float) -> str:
        """Bytes in the report's unit, 2 decimals."""
        return f"{nbytes / self.memory[1]:.2f}"


def memory_warnings(program: Program, sim: Simulation) -> list[DhelixWarning]:
    """A warning per rank of ``sim`` whose predicted peak memory exceeds the device memory
    of the program's profile (none when the profile does not give it), located at the
    cluster's ``profile`` setting, where the device is named."""
    capacity = program.profile.memory_gb
    if capacity is None:
        return []
    warnings = []
    for r in sim.ranks:
        if r.memory <= capacity * GB:
            continue
        states = r.states
        warnings.append(DhelixWarning(
            f"pipeline rank {r.rank} needs {r.memory / GB:.2f} GB at its predicted peak ({sim.label}), more "
            f"than the {capacity:g} GB of one {program.profile.name} device",
            program.cluster.profile_span if program.cluster is not None else None,
            [f"model states {states.total / GB:.2f} GB (weights {states.params / GB:.2f}, gradients "
             f"{states.grads / GB:.2f}, optimizer {states.optimizer / GB:.2f}) and live activations "
             f"{r.activations / GB:.2f} GB",
             "to fit: shard the optimizer states over data parallelism (ZeRO-1), more tensor or pipeline "
             "parallelism, or a schedule with fewer micro-batches in flight, or full activation recomputation"]))
    return warnings


def format_simulation(sim: Simulation, title: str = "") -> str:
    """The report of one simulation: step figures, communication and memory per rank."""
    u = Units.of([sim])
    ts, ms = u.time[0], u.memory[0]
    lines = [title] if title else []
    lines += [
        describe(sim),
        "one DP/TP replica simulated: every TP rank of a pipeline rank and every DP replica runs "
        "the same timeline",
        "",
        f"step time      {u.t(sim.step_time)} {ts}  (pipeline {u.t(sim.pipeline_time)} {ts}, then gradient "
        f"sync and optimizer {u.t(sim.step_time - sim.pipeline_time)} {ts})",
        f"throughput     {sim.tokens_per_second:,.0f} tokens/s",
        f"TFLOPS/GPU     {sim.tflops_per_gpu:.1f}  (MFU {100 * sim.mfu:.1f}% of "
        f"{sim.peak_flops / 1e12:.1f} TFLOPS; Megatron's FLOP count)",
        f"bubble ratio   {100 * sim.bubble_ratio:.1f}%  (idle compute in the pipeline make-span, priced; the "
        "unit-time bubble ratio counts actions as F = 1, B = 2 with free transfers)",
        "",
        *_table(["communication per rank (mean)", f"total {ts}", f"hidden {ts}", f"exposed {ts}", "hidden"],
                [_comm_row("layer (tp, cp, ep, FSDP dp)" if sim.fsdp else "layer (tp, cp, ep)", sim, "layer_comm", "layer_exposed", u),
                 _comm_row("pipeline send/recv", sim, "pp_comm", "pp_exposed", u),
                 _comm_row("data-parallel gradients" if not sim.fsdp else
                           "data-parallel (ends, shards)" if sim.shard else "data-parallel (model's ends)",
                           sim, "dp_comm", "dp_exposed", u)]),
        "",
        *_table(["rank", f"busy {ts}", f"end {ts}", "sends", f"sent {ms}", f"params {ms}", f"grads {ms}",
                 f"optimizer {ms}", f"activations {ms}", f"at {ts}", f"peak {ms}"],
                [_rank_row(r, u) for r in sim.ranks]),
    ]
    return "\n".join(lines) + "\n"


def _comm_row(name: str, sim: Simulation, total: str, exposed: str, u: Units) -> list[str]:
    whole, shown = sim.mean(total), sim.mean(exposed)
    share = f"{100 * (whole - shown) / whole:.1f}%" if whole > 0 else "-"
    return [name, u.t(whole), u.t(max(0.0, whole - shown)), u.t(shown), share]


def _rank_row(r, u: Units) -> list[str]:
    return [f"r{r.rank}", u.t(r.busy), u.t(r.end), str(r.sends), u.m(r.send_bytes), u.m(r.states.params),
            u.m(r.states.grads), u.m(r.states.optimizer), u.m(r.activations), u.t(r.activations_at),
            u.m(r.memory)]


def format_comparison(sims: tuple[Simulation, ...], title: str = "") -> str:
    """The side-by-side table of :func:`compare`'s simulations, with memory ratios."""
    u = Units.of(sims)
    ts, ms = u.time[0], u.memory[0]
    first = sims[0]
    rows = [
        ["schedule"] + [f"{s.pipeline}, fold {s.fold}" for s in sims],
        ["SI blocks co-executed"] + ["yes" if s.si else "no" for s in sims],
        [f"step time {ts}"] + [u.t(s.step_time) for s in sims],
        [f"pipeline make-span {ts}"] + [u.t(s.pipeline_time) for s in sims],
        ["tokens/s"] + [f"{s.tokens_per_second:,.0f}" for s in sims],
        ["TFLOPS/GPU"] + [f"{s.tflops_per_gpu:.1f}" for s in sims],
        ["MFU"] + [f"{100 * s.mfu:.1f}%" for s in sims],
        ["bubble ratio"] + [f"{100 * s.bubble_ratio:.1f}%" for s in sims],
        [f"layer comm exposed {ts}"] + [u.t(s.mean("layer_exposed")) for s in sims],
        [f"pipeline comm exposed {ts}"] + [u.t(s.mean("pp_exposed")) for s in sims],
        [f"DP comm exposed {ts}"] + [u.t(s.mean("dp_exposed")) for s in sims],
        ["P2P sends per rank"] + [f"{s.mean('sends'):.1f}" for s in sims],
        [f"peak memory {ms} (rank)"] + [f"{u.m(s.peak_rank.memory)} (r{s.peak_rank.rank})" for s in sims],
        [f"  of which activations {ms}"] + [u.m(s.peak_rank.activations) for s in sims],
        [f"peak activations {ms}"] + [u.m(max(r.activations for r in s.ranks)) for s in sims],
        ["step time vs as written"] + [f"{s.step_time / first.step_time:.3f}x" for s in sims],
        ["peak memory vs as written"] + [f"{s.peak_rank.memory / first.peak_rank.memory:.3f}x" for s in sims],
    ]
    lines = [title] if title else []
    lines += [describe(first), "figures per rank are means over the pipeline ranks; one DP/TP replica simulated", ""]
    lines += _table([""] + [s.label for s in sims], rows)
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    # Names in the first column, figures right-aligned in the others.
    return format_table(header, rows, right=range(1, len(header)))


def simulation_metrics(sim: Simulation) -> dict:
    """The figures of :func:`format_simulation` as plain values (``dhelix simulate --json``):
    seconds, bytes, ratios (not percentages); communication per rank as means over the
    pipeline ranks, as the table shows it; every rank's row."""
    comm = {name: {"total_s": sim.mean(total), "exposed_s": sim.mean(exposed),
                   "hidden_s": max(0.0, sim.mean(total) - sim.mean(exposed))}
            for name, total, exposed in (("layer", "layer_comm", "layer_exposed"),
                                         ("pipeline", "pp_comm", "pp_exposed"),
                                         ("data_parallel", "dp_comm", "dp_exposed"))}
    return {
        "label": sim.label, "program": sim.program, "pipeline": sim.pipeline, "fold": sim.fold,
        "p": sim.shape[0], "m": sim.shape[1], "v": sim.shape[2], "si": sim.si, "zero1": sim.zero1,
        "step_s": sim.step_time, "pipeline_s": sim.pipeline_time, "tokens_per_s": sim.tokens_per_second,
        "tflops_per_gpu": sim.tflops_per_gpu, "mfu": sim.mfu, "peak_flops": sim.peak_flops,
        "bubble_ratio": sim.bubble_ratio, "sends_per_rank": sim.mean("sends"), "comm_per_rank": comm,
        "peak_memory_bytes": sim.peak_rank.memory, "peak_memory_rank": sim.peak_rank.rank,
        "ranks": [{"rank": r.rank, "busy_s": r.busy, "end_s": r.end, "sends": r.sends, "sent_bytes": r.send_bytes,
                   "params_bytes": r.states.params, "grads_bytes": r.states.grads,
                   "optimizer_bytes": r.states.optimizer, "host_bytes": r.states.host,
                   "activations_bytes": r.activations,
                   "activations_at_s": r.activations_at, "memory_bytes": r.memory} for r in sim.ranks],
    }
