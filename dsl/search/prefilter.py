"""What the checks refuse of a layout's schedules, known from the sizes before any is priced.

Most of the choices a search visits that the checks refuse are refused on sizes alone: the
layers do not split into the fold's stages on ``pp`` ranks, or a pipeline's ``require``
refuses its ``p``, ``m``, ``v`` (``g``, ``gb``) — the same for every layout with those
sizes. :class:`ScheduleChecks` runs those checks once per fold, pipeline, ``pp`` and
micro-batch count, with the functions the checker and the passes run, and the search takes
the schedules they refuse out of a layout's visit before they reach the pricer
(:func:`~dhelix.dsl.search.branch.branch`), each counted with the reason pricing it would
have given: the first one in the passes' order — the checker's stage split, then the strands
block's selectors (the layout's, found with its bound: :attr:`~dhelix.dsl.search.bound.Bound.strands`),
then the fold pass's tied ends, the lowering's fold clause and size limits and the ``let``
and ``require`` statements that open the pipeline (:func:`~dhelix.dsl.passes.lower.leading_failure`).
What these cannot tell without lowering the whole schedule (a ``require`` after a repeat, a
deadlock) the pricer still refuses; nothing they refuse would have been priced
(tests/test_tune_prefilter.py holds both to the pricer).
"""

from __future__ import annotations

from dhelix.dsl.core.errors import DhelixError, first_message
from dhelix.dsl.core.program import FoldSpec, Program
from dhelix.dsl.frontend.limits import schedule_size_error
from dhelix.dsl.frontend.modelcheck import stage_split_error
from dhelix.dsl.passes.fold import Ends, placement_of, tie_placement_error
from dhelix.dsl.passes.lower import check_fold, leading_failure
from dhelix.dsl.search.space import Choice
from dhelix.dsl.search.variant import launch_reads


class ScheduleChecks:
    """The checks of a schedule on its sizes, for the variants of the checked ``program``
    (its model, its train block's ``launch`` settings and the pipelines it defines; a
    pipeline generated per layout is left to the pricer)."""

    def __init__(self, program: Program):
        assert program.model is not None and program.train is not None, "a checked model"
        self.model, self.layers = program.model, program.model.setting("layers")
        self.pipelines = {pipeline.name: pipeline for pipeline in program.pipelines}
        self._reads = {name: launch_reads(pipeline) for name, pipeline in self.pipelines.items()}
        self._launch, self._launch_backward = program.train.launch, program.train.launch_backward
        self._split: dict[tuple[str, int, Ends], str | None] = {}
        self._passes: dict[tuple[str, str, int, int, Ends], str | None] = {}

    def refusal(self, choice: Choice, strands: str | None) -> str | None:
        """Why the checks refuse ``choice`` (of a layout whose bound the passes accepted;
        ``strands``: why its strands block is refused, None when it is not), as pricing it
        gives the reason (:func:`~dhelix.dsl.core.errors.first_message`); None when these
        checks do not refuse it."""
        if choice.pipeline not in self.pipelines:
            return None
        layout = choice.layout
        ends = _ends(layout.stage_ends)
        split = self._split_refusal(choice.fold, layout.pp, ends)
        if split is not None or strands is not None:
            return split or strands
        key = (choice.fold, choice.pipeline, layout.pp, layout.microbatches, ends)
        if key not in self._passes:
            self._passes[key] = self._pass_refusal(*key)
        return self._passes[key]

    def _split_refusal(self, fold: str, pp: int, ends: Ends) -> str | None:
        """The checker's refusal of fold ``fold`` (its text) on ``pp`` ranks: the layers do not
        split into its stages (equal ones, or with the first and last stages' ``ends``)."""
        key = (fold, pp, ends)
        if key not in self._split:
            spec = _fold_spec(fold)
            error = stage_split_error(spec.text, self.layers, pp, spec.v, None, ends, copies=spec.copies)
            self._split[key] = None if error is None else error.message
        return self._split[key]

    def _pass_refusal(self, fold: str, name: str, pp: int, microbatches: int, ends: Ends) -> str | None:
        """The first refusal of the fold and lower passes (:mod:`~dhelix.dsl.passes.pipeline`)
        that the sizes decide, for fold ``fold`` (it splits the layers) and pipeline ``name``
        on ``pp`` ranks and ``microbatches``; None when there is none."""
        spec, pipeline = _fold_spec(fold), self.pipelines[name]
        placement = placement_of(spec, self.layers, pp, ends)
        reads = self._reads[name]
        launch = self._launch if isinstance(self._launch, int) and "g" in reads else None
        backward = self._launch_backward if isinstance(self._launch_backward, int) and "gb" in reads else None
        error: DhelixError | None
        try:  # in the passes' order: fold (tied ends), then lower
            error = tie_placement_error(self.model, spec, placement)
            if error is None:
                check_fold(pipeline, placement.kind)
                error = schedule_size_error(pp, microbatches, placement.chunks, self.layers, None) \
                    or leading_failure(pipeline, ranks=pp, microbatches=microbatches, placement=placement,
                                       launch=launch, launch_backward=backward)
        except DhelixError as exc:  # check_fold's: the pipeline is written for another fold
            error = exc
        return None if error is None else first_message(error)


def _ends(stage_ends: tuple[int, int]) -> Ends:
    """A layout's first and last stages' layers (0: an equal share) as the fold pass takes them."""
    first, last = stage_ends
    return (first or None, last or None)


def _fold_spec(text: str) -> FoldSpec:
    """The fold of a choice's text: ``none``, ``u``, ``bidir`` or ``loop(v)``."""
    kind, _, argument = text.partition("(")
    return FoldSpec.of(kind, int(argument.rstrip(")")) if argument else None)

