"""Unit-time dry run: make-span and bubble ratio of a lowered schedule, in exact fractions.

Costs per action: F = 1; B = 2 for a full backward, or B = 1 and W = 1 when the schedule splits
its backward (so B + W = 2 either way); an SI block costs the sum of its pair (the unit-time
model gives strand interleaving no speed-up: that is the planner's business); SEND and RECV
cost 0. Each action starts when its rank has finished the previous one and, for a RECV, when
the matching SEND has run (sends are eager, as in :func:`validate.dry_run`).

Costs are per chunk action: with v chunks per rank an action does 1/v of a rank's layers, so
compare make-spans across folds after dividing by v (``Timing.normalized_makespan``).

The bubble ratio is idle / (p × make-span), idle being p × make-span minus the busy time of all
ranks. For 1F1B it is exactly (p − 1) / (m + p − 1): make-span 3(m + p − 1), busy 3m per rank.

:func:`timed_run` is the same dry run with other costs (:class:`Costs`: F, B and W times and a
transfer latency, exact fractions): the zero-bubble papers' T_F, T_B, T_W, which tell apart
schedules that unit time prices alike (ZB-H1 and ZB-H2 both reach 3m + p − 1 in unit time),
and what :mod:`dhelix.dsl.passes.zbgen` schedules with.
"""

from __future__ import annotations

from fractions import Fraction

import attrs

from dhelix.dsl.core.schedule import Interleaved, Lowered, Transfer, computes
from dhelix.dsl.passes.validate import dry_run, transfer_key


@attrs.frozen
class Costs:
    """Per chunk action: the forward ``f``, the input-gradient backward ``b`` and the weight
    gradient ``w`` (a full backward costs b + w), and ``transfer``, the latency between a SEND
    and the RECV it lets finish. Exact numbers (int or Fraction) keep timings comparable."""

    f: Fraction = attrs.field(default=Fraction(1), converter=Fraction)
    b: Fraction = attrs.field(default=Fraction(1), converter=Fraction)
    w: Fraction = attrs.field(default=Fraction(1), converter=Fraction)
    transfer: Fraction = attrs.field(default=Fraction(0), converter=Fraction)


#: The unit-time costs: F = B = W = 1 (a full backward 2), free transfers.
UNIT = Costs()


@attrs.frozen
class Timing:
    """The result of a unit-time run: per-rank (start, end) of every action, and totals."""

    lowered: Lowered
    starts: tuple[tuple, ...]
    ends: tuple[tuple, ...]

    @property
    def makespan(self):
        """When the last rank finishes."""
        return max((row[-1] for row in self.ends if row), default=0)

    @property
    def busy(self):
        """Total compute time summed over ranks."""
        return sum(end - start for s_row, e_row in zip(self.starts, self.ends, strict=True)
                   for start, end in zip(s_row, e_row, strict=True))

    @property
    def bubble_ratio(self) -> Fraction:
        """idle / (p × make-span), exact; 0 for an empty schedule."""
        total = self.lowered.ranks * self.makespan
        return Fraction(total - self.busy, total) if total else Fraction(0)

    @property
    def normalized_makespan(self) -> Fraction:
        """Make-span / v: in units of a forward over all the layers of one rank's model copy
        (fold bidir's v = 2 chunks are two copies' stages, each a whole rank's L/p layers:
        make-span · copies / v)."""
        return Fraction(self.makespan * self.lowered.copies, self.lowered.chunks)


def action_cost(action, split: bool, costs: Costs = UNIT):
    """Cost of one action: F, B (B + W when not ``split``), W, SI its pair, transfers 0
    (their latency is the RECV's wait); in unit time F 1, B 2 (1 when split), W 1."""
    if isinstance(action, Transfer):
        return 0
    if isinstance(action, Interleaved):
        return sum(action_cost(part, split, costs) for part in action.parts)
    cost = {"F": costs.f, "B": costs.b if split else costs.b + costs.w, "W": costs.w}[action.kind]
    return int(cost) if cost.denominator == 1 else cost


def unit_time(lowered: Lowered) -> Timing:
    """Run ``lowered`` in unit time (see the module docstring) and return its :class:`Timing`.

    Assumes ``validate.validate_lowered`` passed; raises ScheduleError if the ranks deadlock.
    """
    return timed_run(lowered, UNIT)


def timed_run(lowered: Lowered, costs: Costs) -> Timing:
    """Run ``lowered`` with ``costs`` (each action as soon as its rank is free and, for a
    RECV, ``costs.transfer`` after its SEND) and return its :class:`Timing`; as
    :func:`unit_time` otherwise."""
    split = lowered.split
    latency = int(costs.transfer) if costs.transfer.denominator == 1 else costs.transfer
    starts = [[0] * len(row) for row in lowered.actions]
    ends = [[0] * len(row) for row in lowered.actions]
    free = [0] * lowered.ranks
    sent: dict = {}
    # dry_run's order puts every SEND before its RECV, so one pass settles every start time.
    for rank, step in dry_run(lowered):
        action = lowered.actions[rank][step]
        start = free[rank]
        if isinstance(action, Transfer):
            key = transfer_key(lowered, rank, action)
            if action.kind == "SEND":
                sent[key] = start
            else:
                start = max(start, sent[key] + latency)
        end = start + action_cost(action, split, costs)
        starts[rank][step], ends[rank][step] = start, end
        free[rank] = end
    return Timing(lowered, tuple(map(tuple, starts)), tuple(map(tuple, ends)))


def peak_in_flight(lowered: Lowered, inside_blocks: bool = False) -> tuple[int, ...]:
    """Per rank, the most (micro-batch, chunk) activations held at once, in program order.

    A forward adds one; its backward B frees it (W keeps only weight-gradient inputs, which
    this count ignores). A memory proxy: divide by v for whole-rank activations. With
    ``inside_blocks``, an SI block's forward counts before its backward frees one (what the
    block holds when it runs its forward first, as SI off does); else a block counts whole.
    """
    peaks = []
    for row in lowered.actions:
        live = peak = 0
        for action in row:
            for part in computes(action):
                live += {"F": 1, "B": -1}.get(part.kind, 0)
                if inside_blocks:
                    peak = max(peak, live)
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)



def describe(timing: Timing) -> str:
    """The unit-time figures in words, as ``check --dump validate`` and the pipeline diagram
    say them: ``unit-time make-span 27 whole-rank forwards (54 chunk actions; F = 1, B = 2),
    unit-time bubble ratio 1/9 = 0.111``. They count actions, not seconds: the simulator's
    pipeline make-span and bubble ratio price the same schedule with the op costs and the
    transfers, so they differ."""
    lowered = timing.lowered
    costs = "F = B = W = 1" if lowered.split else "F = 1, B = 2"
    span = timing.normalized_makespan
    span_text = str(span) if span.denominator == 1 else f"{float(span):g}"
    chunks = f"{timing.makespan} chunk actions; " if lowered.chunks > 1 else ""
    ratio = timing.bubble_ratio
    return (f"unit-time make-span {span_text} whole-rank forwards ({chunks}{costs}), "
            f"unit-time bubble ratio {ratio} = {float(ratio):.3f}")
