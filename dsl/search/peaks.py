"""The choices a search found over the device memory, shared by those whose peak is theirs.

A choice's peak (:func:`~dhelix.dsl.simulator.events.untimed`: each pipeline rank's model
states and live activations) reads the mesh's sizes, the train block and the schedule, not
the order of the mesh axes (which decides only which links a group's collectives cross:
their times) nor ``param_gather`` (when ZeRO-1's all-gather runs: a time). Nor do the checks
read the two, but the layout's own (ZeRO-3's shard group over dp × cp, which the layout's
bound checks before any of its schedules is visited). So among choices that differ only in
these (:func:`peak_class`), of layouts the bound accepted, one that the checks accept and
finds over the device memory settles the others: each is over it too, by the same peak,
without being checked or walked again (tests/test_tune_peaks.py holds both facts).

Only for a choice whose peak is its untimed walk's, before any planner's choice (no
partition block, no ``launch`` its pipeline reads, not a generated pipeline): the pricer
says which (:meth:`~dhelix.dsl.search.pricer.Pricer.price`).
"""

from __future__ import annotations

import attrs

from dhelix.dsl.search.space import Choice


def peak_class(choice: Choice) -> Choice:
    """``choice`` with what its peak does not read set alike: the mesh axes in the file's
    order, ZeRO-1's all-gather after the optimizer."""
    return Choice(attrs.evolve(choice.layout, order=(), param_gather="step"), choice.fold, choice.pipeline, choice.si)


class OverPeaks:
    """The peaks (bytes on the busiest rank) of the choices found over the device memory, by
    :func:`peak_class`."""

    def __init__(self) -> None:
        self._found: dict[Choice, float] = {}

    def get(self, choice: Choice) -> float | None:
        """The peak of a choice of the class of ``choice`` found over the memory (the caller
        holds it to the memory as it is now), else None."""
        return self._found.get(peak_class(choice)) if self._found else None

    def add(self, choice: Choice, peak: float) -> None:
        """Keep ``peak`` (over the memory) for the class of ``choice``."""
        self._found[peak_class(choice)] = peak
