"""The search of `dhelix tune`: branch and bound over the layouts of a :class:`Space`.

Every choice is a program variant (:mod:`variant`) checked by the passes of `dhelix check`,
given the planner's choices as `simulate` gives them (``by auto`` chunk counts, group orders,
``launch = auto``), priced by the step simulator and capped by the profile's device memory.
Layouts are visited in order of their lower bound (:mod:`bound`); once the K-th best step
priced is no longer than the next layout's bound, no unvisited choice can enter the top K,
and the search stops. The result equals an exhaustive pricing of every choice
(:func:`exhaustive`; a test holds the two to each other).

Work is shared across choices: the SI plan of a layer pair depends on the two layer DAGs, the
strands block and the profile only, so it is computed once per distinct pair
(:class:`PlanCache`), and equal DAGs are interned so the pair-cost caches hit.
"""

from __future__ import annotations

import time
from typing import Callable

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import DhelixError, first_message
from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.program import LayerDag, Program
from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.planner.chunking import choose_all
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.search.bound import Bound, layout_bound
from dhelix.dsl.search.space import Choice, Layout, Space
from dhelix.dsl.search.variant import apply_choice
from dhelix.dsl.simulator.costs import input_backward
from dhelix.dsl.simulator.events import Simulation, has_si, simulate
from dhelix.dsl.simulator.launch import choose_launch
from dhelix.dsl.simulator.memory import GB


@attrs.frozen
class Priced:
    """A choice the passes accepted and the simulator priced; ``fits`` under the device's
    memory (always True when the profile gives none)."""

    choice: Choice
    sim: Simulation = attrs.field(eq=False, repr=False)
    fits: bool

    @property
    def seconds(self) -> float:
        """The simulated step."""
        return self.sim.step_time


@attrs.frozen
class Refused:
    """A choice the passes refused (or a layout whose bound ruled it out), and why."""

    choice: Choice | Layout
    why: str


@attrs.frozen
class Outcome:
    """What a search found: the best ``top`` choices that fit, fastest first, and counts of
    what it looked at. ``complete`` is False when the time budget ran out first (then
    ``bound`` is the least lower bound among the layouts not visited)."""

    top: tuple[Priced, ...]
    priced: int
    refused: int
    pruned: int
    too_big: int
    layouts: int
    choices: int
    seconds: float
    complete: bool = True
    bound: float | None = None
    plans: int = 0
    memory_gb: float | None = None
    reasons: tuple[tuple[str, int], ...] = ()


class PlanCache:
    """SI plans by what determines them: the forward DAG, the backward DAG an SI block runs,
    the strands block and the pricing (one PairCost per search). Interns DAGs too: equal
    DAGs of different variants become one object, so the PairCost's caches (by op identity)
    serve every variant."""

    def __init__(self, cost: PairCost):
        self.cost = cost
        self._plans: dict[tuple, Plan] = {}
        self._dags: dict[LayerDag, LayerDag] = {}

    def intern(self, program: Program) -> Program:
        """``program`` with its layer DAGs replaced by equal ones seen before."""
        if program.forward is None or program.backward is None:
            return program
        forward = self._dags.setdefault(program.forward, program.forward)
        backward = self._dags.setdefault(program.backward, program.backward)
        return attrs.evolve(program, forward=forward, backward=backward)

    def plan(self, program: Program) -> Plan:
        """The plan :func:`~dhelix.dsl.simulator.events.schedule_plan` would compute."""
        from dhelix.dsl.planner.pairing import plan_layers

        backward = program.backward
        if program.lowered is not None and program.lowered.split:
            backward = input_backward(backward)
        key = (program.forward, backward, program.strands)
        if key not in self._plans:
            self._plans[key] = plan_layers(program.forward, backward, program.strands, self.cost)
        return self._plans[key]

    def __len__(self) -> int:
        return len(self._plans)


class Pricer:
    """Prices choices of one program: the parsed files, the pipelines they define, the
    cluster's node size and the world searched."""

    def __init__(self, modules: list[s.Module], base: Program, world: int):
        self.modules, self.world = modules, world
        self.pipelines = {p.name: p for p in base.pipelines}
        self.gpus_per_node = base.cluster.gpus_per_node
        # A profile's measured op times belong to one mesh and shape (dsl.frontend.profilecheck):
        # every variant is priced by its derived rates alone, so all are priced alike.
        self.profile = attrs.evolve(base.profile, measured=None)
        self.cost = PairCost(self.profile, base.model.dtype, seq=base.model.get("seq"))
        self.plans = PlanCache(self.cost)
        self.memory_gb = base.profile.memory_gb
        self._bounds: dict[Layout, Bound | str] = {}

    def checked(self, choice: Choice, stop: str = "validate") -> Program:
        """The variant of ``choice`` through the passes up to ``stop`` (DhelixError if refused)."""
        program = check_program(self.variant(choice))
        program = attrs.evolve(program, profile=self.profile)
        return self.plans.intern(passes.rerun(program, after="check", stop=stop))

    def variant(self, choice: Choice, modules: list[s.Module] | None = None) -> list[s.Module]:
        """The parsed files (``modules``, default the priced ones) with ``choice`` written in."""
        return apply_choice(modules or self.modules, choice, self.pipelines, self.gpus_per_node, self.world)

    def bound(self, layout: Layout, schedule: tuple[str, str]) -> Bound | str:
        """The lower bounds of ``layout`` (checked with the schedule ``schedule`` up to the
        layer DAGs), or why the passes refuse it."""
        if layout not in self._bounds:
            try:
                program = self.checked(Choice(layout, *schedule), stop="autodiff")
                self._bounds[layout] = layout_bound(program, self.cost)
            except DhelixError as exc:
                self._bounds[layout] = first_message(exc)
        return self._bounds[layout]

    def price(self, choice: Choice) -> Priced | Refused:
        """``choice`` checked, given the planner's choices, simulated and held to the memory."""
        try:
            program = self.checked(choice)
            if program.partition is not None or program.train.launch is not None:
                program, _ = choose_all(program)
                program, _ = choose_launch(program)
                program = self.plans.intern(program)
            plan = self.plans.plan(program) if has_si(program) else None
            sim = simulate(program, plan, cost=self.cost, label=choice.describe())
        except DhelixError as exc:
            return Refused(choice, first_message(exc))
        fits = self.memory_gb is None or max(r.memory for r in sim.ranks) <= self.memory_gb * GB
        return Priced(choice, sim, fits)

    def program(self, choice: Choice) -> Program:
        """The variant of ``choice`` through every pass and the planner's choices."""
        program, _ = choose_all(self.checked(choice))
        return choose_launch(program)[0]


def search(pricer: Pricer, space: Space, *, top: int = 5, budget: float | None = None,
           progress: Callable[[int, int], None] | None = None) -> Outcome:
    """The ``top`` fastest choices of ``space`` that fit, by branch and bound (see the module
    docstring); ``budget`` caps the seconds spent (None: none); ``progress(done, total)`` is
    called as layouts are visited."""
    start = time.perf_counter()
    layouts = list(space.layouts())
    first = space.schedules[0] if space.schedules else None
    bounded: list[tuple[float, Layout]] = []
    refused, too_big, reasons = 0, 0, {}
    for index, layout in enumerate(layouts):
        bound = pricer.bound(layout, _bound_schedule(space, first))
        if isinstance(bound, str):
            refused += len(space.schedules)
            reasons[bound] = reasons.get(bound, 0) + len(space.schedules)
        elif pricer.memory_gb is not None and bound.memory > pricer.memory_gb * GB:
            too_big += len(space.schedules)
        else:
            bounded.append((bound.seconds, layout))
        if progress and index % 16 == 0:
            progress(0, len(layouts))
    bounded.sort()
    best: list[Priced] = []
    priced = pruned = 0
    complete, left = True, None
    for visited, (seconds, layout) in enumerate(bounded):
        if len(best) >= top and seconds > best[top - 1].seconds:
            pruned += (len(bounded) - visited) * len(space.schedules)
            break
        if budget is not None and time.perf_counter() - start > budget:
            complete, left = False, seconds
            break
        for fold, pipeline in space.schedules:
            result = pricer.price(Choice(layout, fold, pipeline))
            if isinstance(result, Refused):
                refused += 1
                reasons[result.why] = reasons.get(result.why, 0) + 1
                continue
            priced += 1
            if not result.fits:
                too_big += 1
                continue
            best = _insert(best, result, top)
        if progress:
            progress(visited + 1, len(bounded))
    return Outcome(tuple(best), priced, refused, pruned, too_big, len(layouts), len(layouts) * len(space.schedules),
                   time.perf_counter() - start, complete, left, len(pricer.plans), pricer.memory_gb,
                   tuple(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))))


def exhaustive(pricer: Pricer, space: Space, top: int = 5) -> tuple[Priced, ...]:
    """The ``top`` fastest fitting choices found by pricing every choice of ``space`` (what
    :func:`search` must equal; slow, for tests)."""
    best: list[Priced] = []
    for choice in space.choices():
        result = pricer.price(choice)
        if isinstance(result, Priced) and result.fits:
            best = _insert(best, result, top)
    return tuple(best)


def _insert(best: list[Priced], result: Priced, top: int) -> list[Priced]:
    """``best`` with ``result`` in its place (fastest first; ties in choice order) cut to ``top``."""
    return sorted(best + [result], key=_rank)[:top]


def _rank(p: Priced) -> tuple:
    # Steps equal to the last rounding digits are ties, settled by the choice's order.
    return (round(p.seconds, 12), p.choice)


def _bound_schedule(space: Space, first: tuple[str, str] | None) -> tuple[str, str]:
    """The schedule the layouts' DAGs are checked with: the first with fold none (every
    fold's stage split divides a fold-none one), else the first."""
    return next((sched for sched in space.schedules if sched[0] == "none"), first)

