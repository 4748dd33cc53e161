"""Trace events for the inside of an SI block: which segment pair ran when, and which
collective it hid.

The step simulator prices an SI layer pair as one piece of work (the plan's ``total``); with
``simulate(..., detail=True)`` each such piece is also drawn as its segment pairs, so a
trace or a report shows where each tensor-parallel collective of the two strands ran:

* on the compute lane, one slice per segment pair, ``SI pair k``, nested inside the block's
  slice, with the pair's forward and backward ops and its communication by lane in ``args``;
* on each communication lane the pair uses, one slice spanning the pair, named after the
  collectives that run there (``β ag1`` for the forward strand's, ``α rs2`` for the
  backward's), with the compute ops they overlap in ``args["hidden behind"]``.

A collective is drawn over the whole pair it runs in (the plan says which pair, not where
inside it); the pairs' lengths are the plan's predicted times, scaled to the piece's seconds.
"""

from __future__ import annotations

from dhelix.dsl.core.mesh import COMM_LANES
from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.timeline import TraceEvent

#: Forward strand first: the paper's β forward over the α backward.
STRANDS = {"forward": "β", "backward": "α"}


def pair_events(rank: int, plan: Plan, start: float, seconds: float, layer: int) -> list[TraceEvent]:
    """The trace events of one SI layer pair (``layer``: its index in the block) run by
    ``plan`` on ``rank`` from ``start`` for ``seconds`` (see the module docstring)."""
    ops = {op.name: op for op in plan.ops}
    total = sum(pair.time for pair in plan.pairs)
    scale = seconds / total if total > 0 else 0.0
    events, now = [], start
    for k, pair in enumerate(plan.pairs, 1):
        length = pair.time * scale
        compute = [name for name in pair.forward + pair.backward if ops[name].lane == "compute"]
        lanes = {lane: [f"{STRANDS[ops[name].strand]} {name}" for name in pair.forward + pair.backward
                        if ops[name].lane == lane] for lane in COMM_LANES}
        args = {"kind": "SI pair", "layer pair": layer, "pair": k, "forward": list(pair.forward),
                "backward": list(pair.backward), **{lane: names for lane, names in lanes.items() if names},
                "predicted_s": pair.time, "alone_s": pair.alone}
        events.append(TraceEvent(rank, "compute", f"SI pair {k}", now, length, args))
        for lane, names in lanes.items():
            if names:
                events.append(TraceEvent(rank, lane, ", ".join(names), now, length,
                                         {"kind": "SI collective", "layer pair": layer, "pair": k,
                                          "hidden behind": compute}))
        now += length
    return events
