"""The one compiled artefact of a run: what ``dhelix run`` and ``dhelix profile`` build once,
price with the simulator and hand to their ranks, which never compile again.

A :class:`RunPlan` holds the program through every pass with every choice the tools make
(:func:`~dhelix.dsl.simulator.launch.priced_program`: chunk counts, group orders, backward
priority, ``launch = auto``), the reference model's DAGs (the layer on a mesh of size 1, from
which the interpreter reads how each weight is sharded:
:func:`~dhelix.dsl.passes.overrides.reference_dags`) and the SI plan the ranks run, in one
typed form per mode:

* :class:`SegmentPairs` — ``planned``, ``op_by_op``, ``sequential``: one segment plan that
  every layer pair runs and its issue orders (:class:`~dhelix.dsl.planner.pair_order.BlockOrder`,
  every case of an SI block computed, with and without the CUDA pair barrier); for
  ``planned`` also the planner's :class:`~dhelix.dsl.core.plan.Plan` it came from, which
  prices the run;
* :class:`BlockOrders` — ``scheduled``: the block scheduler's schedule of a whole SI block for
  every (forward layers, backward layers) the program's blocks can have; the ranks run its
  issue order, the simulator prices its make-span.

It also holds :class:`ExecFacts`, what each rank's executor reads of the program (the B and
W actions' ops, selective recomputation's drops, the SI pairs checked, the transfers' keys
and order), derived here once rather than by every rank.

:func:`price` simulates the run from that same object, so what was priced is what the ranks
run. A RunPlan is frozen and picklable (spawned ranks receive it).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from dhelix.dsl.core.oplib import in_weight_pass, selective_drops
from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.program import LayerDag, Op, Program
from dhelix.dsl.core.schedule import Transfer
from dhelix.dsl.passes.fsdp import is_fsdp, replicas_substituted, shard_axis
from dhelix.dsl.passes.overrides import reference_dags
from dhelix.dsl.passes.validate import check_fifo, transfer_key
from dhelix.dsl.planner.blockorder import BlockIssue, BlockSchedule
from dhelix.dsl.planner.pair_order import BlockOrder, InFlight, Issue, order_pair
from dhelix.dsl.planner.si_plan import (PLANS, PlanFn, SegmentPlan, SIMode, backward_ops, check_plan, fixed_plan,
                                        has_si_blocks, sequential_plan)
from dhelix.dsl.simulator.events import Simulation, block_scheduler, schedule_plan, simulate
from dhelix.dsl.simulator.launch import priced_program
from dhelix.dsl.simulator.si_pairs import interleaves


@attrs.frozen
class SegmentPairs:
    """The SI plan of ``mode`` (planned, op_by_op or sequential): the segment pairs every
    layer pair runs; ``planned`` is the planner's Plan they came from (planned only);
    ``issues`` their issue orders without and with the pair barrier (:func:`issue_orders`;
    None for a program without layers)."""

    mode: SIMode
    pairs: SegmentPlan
    planned: Plan | None = None
    issues: tuple[BlockOrder, BlockOrder] | None = attrs.field(default=None, eq=False)

    def plan_for(self) -> PlanFn:
        """The executor's plan function: these pairs for every layer pair."""
        return fixed_plan(self.pairs)

    def issue_order(self, barrier: bool) -> BlockOrder | None:
        """The issue orders the ranks run, with the pair barrier (CUDA) or without."""
        return None if self.issues is None else self.issues[barrier]

    def orders(self) -> None:
        """No block orders: SI blocks run layer pair by layer pair."""
        return None


@attrs.frozen
class BlockOrders:
    """The SI plan of ``scheduled``: the block scheduler's schedule of a whole SI block, one
    per (forward layers, backward layers) an SI block of the program can have."""

    schedules: tuple[BlockSchedule, ...]
    mode: ClassVar[SIMode] = SIMode.SCHEDULED

    def plan_for(self) -> PlanFn:
        """The executor's plan function, unused by blocks run whole: no interleaving."""
        return sequential_plan

    def orders(self) -> dict[tuple[int, int], tuple[BlockIssue, ...]]:
        """The issue order of every block by its (forward layers, backward layers)."""
        return {schedule.layers: schedule.order for schedule in self.schedules}

    def issue_order(self, barrier: bool) -> None:
        """No pair issue orders: blocks run whole in :meth:`orders`."""
        return None

    def schedule(self, forward_layers: int, backward_layers: int) -> BlockSchedule:
        """The schedule of a block of these layer counts (KeyError for counts it has none for)."""
        return next(s for s in self.schedules if s.layers == (forward_layers, backward_layers))


SIPlan = SegmentPairs | BlockOrders


@attrs.frozen
class ExecFacts:
    """What each rank's executor reads of the program, derived once: the ops a B action runs
    (without the wgrads a split schedule moves to W) and those a W action runs, the forward
    ops whose outputs selective recomputation drops (none without it) and the SI plan's
    segment pairs, checked to run every op of both DAGs once, each after what it reads; per
    pipeline rank, what each of its SEND and RECV actions carries (``transfer_keys``: the
    action and its :func:`~dhelix.dsl.passes.validate.transfer_key`); and where the
    schedule's sends and receives between two ranks come in different orders (``fifo``:
    :func:`~dhelix.dsl.passes.validate.check_fifo`, which a backend without tags refuses);
    the issue orders of a forward and of a backward layer run without a partner strand
    (``alone``: :func:`~dhelix.dsl.planner.pair_order.order_pair` of one strand); and what
    ZeRO-3 needs (``fsdp``: whether the layer weights are dp pieces, ``shard_axis`` the axis
    they are pieces over, ``replicas_sliced``: whether a substitution left replicated weights
    sliced, :mod:`dhelix.dsl.passes.fsdp`)."""

    backward_ops: tuple[Op, ...]
    weight_ops: tuple[Op, ...]
    selective: tuple[str, ...]
    pairs: SegmentPlan
    transfer_keys: tuple[tuple[tuple[Transfer, tuple | None], ...], ...] = ()
    fifo: tuple[str, ...] = ()
    alone: tuple[tuple[Issue, ...], tuple[Issue, ...]] = ((), ())
    fsdp: bool = False
    shard_axis: str = "dp"
    replicas_sliced: bool = False

    @classmethod
    def of(cls, program: Program, plan_for: PlanFn = sequential_plan) -> "ExecFacts":
        """The facts of ``program`` (through every pass, with a model) whose SI blocks pair
        as ``plan_for`` says. Raises ValueError for a plan that does not cover both DAGs once
        in an order they allow (a bug of the planner, not the user's)."""
        forward, backward, lowered = program.forward, program.backward, program.lowered
        assert forward is not None and backward is not None and lowered is not None and program.train is not None, \
            "a program through every pass, with a model"
        split = lowered.split
        weight = tuple(op for op in backward.ops if in_weight_pass(op))
        pairs = plan_for(forward, backward)
        check_plan(pairs, forward, backward, {op.name for op in weight} if split else set())
        selective = selective_drops(forward.ops, backward.ops) if program.train.recompute == "selective" else ()
        keys = tuple(tuple((action, transfer_key(lowered, rank, action)) for action in row
                           if isinstance(action, Transfer)) for rank, row in enumerate(lowered.actions))
        b_ops = backward_ops(backward, split)
        alone = (order_pair(forward.ops, (), InFlight()), order_pair((), b_ops, InFlight()))
        return cls(b_ops, weight, selective, pairs, keys, tuple(check_fifo(lowered)), alone, is_fsdp(program),
                   shard_axis(program), replicas_substituted(program))


@attrs.frozen(kw_only=True)
class RunPlan:
    """A run compiled once: the source ``path``, the priced ``program`` (every pass run),
    the ``reference`` model's forward and backward DAGs, the ``si`` plan, whether SI blocks
    interleave at all (``interleave``; else each runs its F then its B) and the ``choices``
    the tools made (chunks, orders, launch), for the summary; ``text`` is the source as read
    (a checkpoint keeps it, so that the model can be rebuilt from the checkpoint alone)."""

    path: str
    program: Program
    reference: tuple[LayerDag, LayerDag]
    si: SIPlan
    interleave: bool = True
    choices: tuple = ()
    text: str = ""
    #: What the ranks' executors read of the program (:class:`ExecFacts`), derived here.
    facts: ExecFacts | None = None

    @property
    def mode(self) -> SIMode:
        """The SI plan's mode (what the summary and the trace name)."""
        return self.si.mode


def build_run_plan(text: str, path: str, *, profile: str | None = None, gpus_per_node: int | None = None,
                   mode: SIMode = SIMode.PLANNED, interleave: bool = True) -> RunPlan:
    """The RunPlan of ``text`` (the file ``path``, with a model): priced with ``profile``
    instead of its cluster block's when given, on nodes of ``gpus_per_node`` ranks when given
    (a measured topology), planned by :func:`plan_run`. Raises the passes' and the planner's
    located errors."""
    program, choices = priced_program(text, path, profile, gpus_per_node)
    return plan_run(program, path, choices, mode=mode, interleave=interleave, text=text)


def plan_run(program: Program, path: str, choices: tuple = (), *, mode: SIMode = SIMode.PLANNED,
             interleave: bool = True, text: str = "") -> RunPlan:
    """The RunPlan of ``program`` (priced: :func:`~dhelix.dsl.simulator.launch.priced_program`,
    which made ``choices``; with a model), the file ``path``: its reference DAGs and its SI
    blocks run as ``mode`` says (:func:`choose_si`), interleaved unless ``interleave`` is
    False or the train block says ``si = off``; ``text`` is its source."""
    mode = SIMode(mode)
    interleave = interleave and interleaves(program)  # `--no-si` or the train block's si = off
    si = choose_si(program, mode, interleave)
    return RunPlan(path=path, program=program, reference=reference_dags(program), si=si, interleave=interleave,
                   choices=choices, text=text, facts=ExecFacts.of(program, si.plan_for()))


def measuring_plan(program: Program, path: str) -> RunPlan:
    """The RunPlan ``dhelix profile`` measures: ``program`` (the file ``path``, with a model)
    as :func:`~dhelix.dsl.passes.overrides.for_measuring` checked it, its profile's measured
    section set aside; nothing planned, no interleaving."""
    si = _unplanned(program, SIMode.SEQUENTIAL)
    return RunPlan(path=path, program=program, reference=reference_dags(program), si=si, interleave=False,
                   facts=ExecFacts.of(program, si.plan_for()))


def choose_si(program: Program, mode: SIMode, interleave: bool = True) -> SIPlan:
    """The SI plan ``mode`` gives ``program``: the planner's pairs for ``planned``, the block
    scheduler's orders for ``scheduled`` — both need the profile's costs, so without a
    profile both fall back to ``op_by_op`` — and the plans without costs otherwise. When
    SI blocks do not interleave, or the schedule has none, nothing is planned (the mode is
    kept; ``planned`` and ``scheduled`` then run no interleaving)."""
    if not interleave or not has_si_blocks(program.lowered) or mode not in (SIMode.PLANNED, SIMode.SCHEDULED):
        return _unplanned(program, mode)
    if program.profile is None:
        return _unplanned(program, SIMode.OP_BY_OP)
    if mode == SIMode.SCHEDULED:
        scheduler = block_scheduler(program)
        counts = sorted({len(stage.layers) for stage in program.placement.stages})
        return BlockOrders(tuple(scheduler(nf, nb) for nf in counts for nb in counts))
    plan = schedule_plan(program)
    pairs = tuple((tuple(pair.forward), tuple(pair.backward)) for pair in plan.pairs)
    return SegmentPairs(SIMode.PLANNED, pairs, plan, issue_orders(program, pairs))


def _unplanned(program: Program, mode: SIMode) -> SegmentPairs:
    """``mode`` with the pairs of the plans built without costs (no interleaving for
    ``planned`` and ``scheduled``, which have none)."""
    if program.forward is None or program.backward is None:
        return SegmentPairs(mode, ())
    pairs = PLANS.get(mode, sequential_plan)(program.forward, program.backward)
    return SegmentPairs(mode, pairs, issues=issue_orders(program, pairs))


def issue_orders(program: Program, pairs: SegmentPlan) -> tuple[BlockOrder, BlockOrder]:
    """The issue orders of ``pairs`` over ``program``'s layer pair as an SI block's B action
    runs it (without the wgrads a split schedule moves to W), every case computed: without
    the pair barrier (gloo) and with it (CUDA's streams)."""
    assert program.forward is not None and program.backward is not None and program.lowered is not None, \
        "a validated model"
    fwd_ops, bwd_ops = program.forward.ops, backward_ops(program.backward, program.lowered.split)
    outputs = (program.forward.output, program.backward.output)
    gloo, cuda = (BlockOrder.build(pairs, fwd_ops, bwd_ops, barrier, outputs).complete() for barrier in (False, True))
    return gloo, cuda


def price(run: RunPlan, *, zero1: bool = False, optimizer_check: str | None = None) -> Simulation:
    """The simulated step of ``run`` as its ranks run it: its SI blocks priced with its own
    plan (the planner's pairs, the block scheduler's schedules; ``op_by_op`` and
    ``sequential`` with the planner's plan, as the summary notes), or as F then B without
    interleaving; ``zero1`` and ``optimizer_check`` as
    :func:`~dhelix.dsl.simulator.events.simulate`. Raises DhelixError for a program without
    a profile."""
    si = run.si
    if isinstance(si, BlockOrders):
        return simulate(run.program, si=run.interleave, zero1=zero1, blocks=si.schedule,
                        optimizer_check=optimizer_check)
    return simulate(run.program, si.planned, si=run.interleave, zero1=zero1, optimizer_check=optimizer_check)
