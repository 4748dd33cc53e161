"""A run's timeline as records: what the simulator predicts and the interpreter measures.

Both describe a run the same way, one record per piece of work or counter sample, times in
seconds; :mod:`dhelix.dsl.render.trace` writes them as a Chrome trace.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple


class TraceEvent(NamedTuple):
    """One piece of work: on ``rank``'s ``lane`` from ``start`` for ``duration`` seconds.

    A plain 6-tuple in this order is accepted wherever a TraceEvent is.
    """

    rank: int
    lane: str
    name: str
    start: float
    duration: float
    args: Mapping | None = None


class CounterSample(NamedTuple):
    """A value of counter ``name`` on ``rank`` from time ``time`` (seconds) on, e.g. the
    bytes of live activations; ``values`` maps series names to numbers."""

    rank: int
    name: str
    time: float
    values: Mapping
