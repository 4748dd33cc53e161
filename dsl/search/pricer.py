"""The pricing of one choice of `dhelix tune` (:class:`Pricer`) and what it returns: a
choice priced, refused, deferred, over the memory or ruled out by a bound.

Every choice is a program variant (:mod:`variant`) checked by the passes of `dhelix check`,
given the planner's choices as `simulate` gives them, priced by the step simulator and held
to the profile's device memory; what the choices share (layer DAGs, lowered schedules, step
costs, SI plans) is computed once.

One module, though over 500 lines, because it is one thing: the :class:`Pricer` and the outcomes
of one priced choice it returns.
"""

from __future__ import annotations

from typing import Any

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError, DhelixError, first_message
from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.program import Program
from dhelix.dsl.core.schedule import Lowered
from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.planner.chunking import ChunkChoice, choose_all
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.search.bound import Bound, held_memory, layout_bound, relaxed_layer, with_optimizer
from dhelix.dsl.search.generated import GENERATED, generated_pipeline, placeholder
from dhelix.dsl.search.duplicates import program_key
from dhelix.dsl.search.headroom import Reserve
from dhelix.dsl.search.offload import OFFLOAD_PERCENTS, fastest_percent, offload_slower
from dhelix.dsl.search.partitions import NOTHING_TO_PARTITION, generated_partition
from dhelix.dsl.search.peaks import OverPeaks
from dhelix.dsl.search.plan_cache import PlanCache
from dhelix.dsl.search.prefilter import ScheduleChecks
from dhelix.dsl.search.space import Choice, Layout
from dhelix.dsl.search.variant import apply_choice, launch_reads
from dhelix.dsl.passes.fsdp import shard_weights
from dhelix.dsl.simulator.costs import LayerCosts, StepCosts, layer_costs, step_costs
from dhelix.dsl.simulator.events import Simulation, Untimed, has_si, simulate, untimed
from dhelix.dsl.simulator.host_memory import host_refusal
from dhelix.dsl.simulator.launch import make_choices
from dhelix.dsl.simulator.memory import GB


@attrs.frozen
class Priced:
    """A choice the passes accepted and the simulator priced; ``fits`` under the device's
    memory (always True when the profile gives none)."""

    choice: Choice
    sim: Simulation = attrs.field(eq=False, repr=False)
    fits: bool
    #: Whether the planner left out ``by auto`` counts that do not fit the device memory
    #: (:func:`~dhelix.dsl.simulator.launch.choose_counts_by_step`): a choice needing less
    #: memory may then take a faster count.
    squeezed: bool = False
    #: What makes it the program it is (:func:`~dhelix.dsl.search.duplicates.program_key`):
    #: the top keeps one of the choices with equal keys (None: never merged).
    program: tuple | None = attrs.field(default=None, eq=False, repr=False)

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
class Deferred:
    """A choice left to price later (``defer``): its SI layer pair not planned yet, or its
    chunk counts not settled yet; and a lower bound of its step (seconds: its untimed floor,
    or its step before the planner's choices, less the rounding margin). ``loose``: a choice
    whose counts wait, bound by its untimed floor only so far (:meth:`Pricer.price` with
    ``tighten`` gives the bound of its step before the planner's choices)."""

    choice: Choice
    bound: float
    loose: bool = False


@attrs.frozen
class TooBig:
    """A choice whose peak memory (bytes on its busiest GPU, computed without simulating its
    step) exceeds the device's."""

    choice: Choice
    memory: float


@attrs.frozen
class Pruned:
    """A choice whose lower bound (seconds) showed it cannot enter the top."""

    choice: Choice
    bound: float



class Pricer:
    """Prices choices of one program: the parsed files, the pipelines they define, the
    cluster's node size and the world searched. ``reserve`` (a
    :class:`~dhelix.dsl.search.headroom.Reserve`) is kept free on every device: a choice
    fits when its peak fits in the device's memory less the reserve (:attr:`capacity`)."""

    def __init__(self, modules: list[s.Module], base: Program, world: int, reserve: Reserve | None = None):
        self.modules, self.world = modules, world
        self.pipelines = {p.name: p for p in base.pipelines}
        assert base.cluster is not None and base.model is not None, "a checked model"
        #: The generated pipelines the program does not define (dhelix.dsl.search.generated):
        #: their stand-ins here, each layout's own written into its variant.
        self.generated_names = tuple(name for name in GENERATED if name not in self.pipelines)
        self.pipelines.update({name: placeholder(name) for name in self.generated_names})
        #: What each pipeline reads of the launch builtins (walking its statements per variant
        #: was a twentieth of a search).
        self._reads = {name: launch_reads(pipeline) for name, pipeline in self.pipelines.items()}
        #: What the checks refuse of a schedule on its sizes: the search leaves it unpriced.
        self.schedule_checks = ScheduleChecks(base)
        self._generated: dict[tuple, s.PipelineDef] = {}
        self.gpus_per_node = base.cluster.gpus_per_node
        #: The device's memory (GB, None: not known) and the bytes kept free on it.
        self.memory_gb = base.profile.memory_gb
        self.reserve = reserve if reserve is not None else Reserve()
        # A profile's measured op times belong to one mesh and shape (dsl.frontend.profilecheck):
        # every variant is priced by its derived rates alone, so all are priced alike. The
        # planner's own memory checks (``by auto`` counts, ``launch = auto``) read the
        # profile's memory: what the reserve leaves.
        capacity = self.capacity
        usable = None if capacity is None else capacity / GB
        self.profile = attrs.evolve(base.profile, measured=None, memory_gb=usable)
        self.cost = PairCost(self.profile, base.model.dtype, seq=base.model.get("seq"))
        #: Whether offloading any share is no faster than the device's optimizer step: then a
        #: choice offloads only where its twin does not fit the device (:mod:`offload`).
        self.offload_slower = offload_slower(self.profile, base.model.dtype)
        assert base.train is not None, "a checked model"
        #: Whether the file partitions its layers, and writes launch (launch_backward): a choice
        #: keeps them where its pipeline reads g (gb).
        self._written = (base.partition is not None, base.train.launch is not None,
                         base.train.launch_backward is not None)
        self.plans = PlanCache(self.cost)
        self._bounds: dict[tuple, Bound | str] = {}
        self._dags: dict[Layout, Program] = {}
        self._lowered: dict[tuple, tuple[Any, Lowered] | DhelixError] = {}
        self._partitions: dict[Layout, s.PartitionDef | None] = {}
        self._partition_refusals: dict[tuple, DhelixError] = {}  # by (layout key, fold, pipeline)
        self._layer_choices: dict[tuple, tuple[dict, tuple]] = {}
        self._rechecked_dags: dict[tuple, Program] = {}
        self._costs: dict[tuple, tuple] = {}
        #: Layer costs (plain, and relaxed: dhelix.dsl.search.bound.relaxed_layer) by what they read.
        self._layers: dict[tuple, tuple] = {}
        self._derivations: dict[Layout, tuple | DhelixError] = {}
        self._unsettled: dict[Choice, float] = {}
        #: The steps the last :meth:`chosen` simulated, by what its choices set (:func:`_settled`).
        self._stepped: dict[tuple, Simulation] = {}
        #: What each action does, shared by the untimed walks of programs with the same costs
        #: and placement (both kept alive here: by self._costs and self._lowered).
        self._untimed: dict = {}
        #: The peaks found over the device memory, by what they read (dhelix.dsl.search.peaks).
        self._over_peaks = OverPeaks()
        #: The fastest share of each set of shares an offloading layout's bound took.
        self._fastest: dict[tuple[int, ...], int] = {}
        #: The mesh and train blocks written for the choices (apply_choice's ``blocks``).
        self._blocks: dict = {}
        #: Whether the last :meth:`chosen` left out counts over the device memory.
        self.squeezed = False
        #: The choice checked last (up to validate), and its program or why it was refused.
        self._last: tuple[Choice | None, Program | DhelixError | None] = (None, None)

    @property
    def capacity(self) -> float | None:
        """The bytes a choice's peak may take on a device: its memory less the reserve
        (None: the profile gives no memory)."""
        if self.memory_gb is None:
            return None
        return self.memory_gb * GB - self.reserve.bytes_of(self.memory_gb)

    def checked(self, choice: Choice, stop: str = "validate", share: bool = True) -> Program:
        """The variant of ``choice`` through the passes up to ``stop`` (DhelixError if refused);
        ``share``: an SI-off choice as its SI-on twin checked (:meth:`_si_off`).

        The layer DAGs (the passes up to autodiff) depend on the layout only — the model,
        mesh, train and partition blocks — not on the fold or pipeline, so they are derived
        once per layout and shared by its schedules."""
        if share and stop == "validate" and choice.si == "off" and choice.layout.partition == "written":
            return self._si_off(choice)
        # Up to the layer DAGs a generated partition's chains are checked whole (count 1).
        if stop != "validate":
            program = attrs.evolve(check_program(self.variant(choice)), profile=self.profile)
            if stop != "autodiff":
                return self.plans.intern(passes.rerun(program, after="check", stop=stop))
            return self._derived(program, choice.layout)
        try:
            program = self._validated(attrs.evolve(check_program(self.variant(choice)), profile=self.profile), choice)
        except DhelixError as exc:
            self._last = (choice, exc)
            raise
        self._last = (choice, program)
        return program

    def _derived(self, program: Program, layout: Layout) -> Program:
        """``program`` (``layout`` checked) through the passes up to autodiff. What they
        derive (the layer names' values, the forward and backward DAGs) reads the model, the
        mesh, the micro-batches and the partition, and the train block's ZeRO stage only for
        ZeRO-3 (FSDP's ops, which selective recomputation reorders): layouts that differ
        in ZeRO 0, 1 or 2, ``param_gather`` or recomputation (below ZeRO-3) share them."""
        key = attrs.evolve(layout, zero=3 if layout.zero == 3 else 0, param_gather="step",
                           recompute=layout.recompute if layout.zero == 3 else "none", recompute_layers=0,
                           stage_ends=(0, 0), offload="none", offload_percent=0)
        if key not in self._derivations:
            try:
                done = self._sharded(program, layout) or passes.rerun(program, after="check", stop="autodiff")
                done = self.plans.intern(done)
                self._derivations[key] = (done.env, done.forward, done.backward)
            except DhelixError as exc:
                self._derivations[key] = exc
        found = self._derivations[key]
        if isinstance(found, DhelixError):
            raise found
        env, forward, backward = found
        return attrs.evolve(program, env=env, forward=forward, backward=backward)

    def _sharded(self, program: Program, layout: Layout) -> Program | None:
        """``program`` (``layout`` checked: ZeRO-3 with the file's partition and no shard
        group) through the passes up to autodiff from the layer DAGs its ZeRO-0 twin derived
        (the same model, mesh, micro-batches and partition: the passes before ZeRO-3's
        :func:`~dhelix.dsl.passes.fsdp.shard_weights` read no more), only that pass run
        again: ZeRO-3 layouts are a third of a large search's, and the passes before it take
        most of the time (it refuses those with ep). None
        (derive it whole) for another layout, or when the twin was not derived."""
        if layout.zero != 3 or layout.shard or layout.partition != "written":
            return None
        found = self._derivations.get(attrs.evolve(layout, zero=0, param_gather="step", recompute="none", offload="none",
                                                   offload_percent=0))
        if found is None or isinstance(found, DhelixError):
            return None
        env, forward, backward = found
        return shard_weights(attrs.evolve(program, env=env, forward=forward, backward=backward))

    def _si_off(self, choice: Choice) -> Program:
        """``choice`` (SI off, the file's partition) checked: its SI-on twin as checked (the
        choice before it in a search: kept), with the train block's ``si = off`` — the one
        setting that tells their variants apart, which no check reads (tests/test_tune.py
        holds the two to each other)."""
        twin = attrs.evolve(choice, si="on")
        if self._last[0] != twin:
            try:
                self.checked(twin)
            except DhelixError:
                pass
        found = self._last[1]
        if isinstance(found, DhelixError):
            raise found
        assert found is not None and found.train is not None, "the twin was checked just now"
        return attrs.evolve(found, train=attrs.evolve(found.train, si="off"))

    def _validated(self, program: Program, choice: Choice) -> Program:
        """``program`` (``choice`` checked) through the passes after check, its layer DAGs
        shared by its layout and its schedule lowered once."""
        dags = self.layer_dags(choice.layout, (choice.fold, choice.pipeline))  # SI on: the cache holds its train block
        program = passes.strands(attrs.evolve(program, env=dags.env, forward=dags.forward, backward=dags.backward))
        placement, lowered = self.lowered(program)
        return attrs.evolve(program, placement=placement, lowered=lowered)

    def lowered(self, program: Program) -> tuple[Any, Lowered]:
        """(placement, validated lowered schedule) of ``program`` (checked up to strands):
        they depend on the fold, the pipeline, its sizes (p, m, g), the layer count and the end stages' layers
        only, so each is lowered and validated once; a refusal is kept and raised again."""
        assert program.fold is not None and program.pipeline is not None and program.mesh is not None \
            and program.train is not None and program.model is not None, "a checked model"
        key = (program.fold.text, program.pipeline.name, program.mesh.size("pp"), program.train.microbatches,
               passes.launch_of(program), program.model.setting("layers"), program.train.stage_ends,
               program.pipeline if program.pipeline.name in self.generated_names else None)
        if key not in self._lowered:
            try:
                done = passes.rerun(program, after="strands")
                assert done.lowered is not None, "the lower pass ran"
                self._lowered[key] = (done.placement, done.lowered)
            except DhelixError as exc:
                self._lowered[key] = exc
        found = self._lowered[key]
        if isinstance(found, DhelixError):
            raise found
        return found

    def layer_dags(self, layout: Layout, schedule: tuple[str, ...]) -> Program:
        """The program of ``layout`` (with ``schedule``: fold, pipeline and, if not on, si)
        up to its layer DAGs, once per layout."""
        if layout not in self._dags:
            if layout.offload != "none":  # read by the simulator only (the profile's host was checked once): the twin's, set
                twin = self.layer_dags(attrs.evolve(layout, offload="none", offload_percent=0), schedule)
                self._dags[layout] = _offloading(twin, layout.offload_percent or 100)
            elif layout.recompute_layers:  # read by no check but its own (it needs full): the twin's, set
                twin = self.layer_dags(attrs.evolve(layout, recompute_layers=0), schedule)
                assert twin.train is not None, "a checked model"
                self._dags[layout] = attrs.evolve(twin, train=attrs.evolve(
                    twin.train, recompute_layers=layout.recompute_layers))
            else:
                self._dags[layout] = self.checked(Choice(layout, *schedule), stop="autodiff")
        return self._dags[layout]

    def variant(self, choice: Choice, modules: list[s.Module] | None = None) -> list[s.Module]:
        """The parsed files (``modules``, default the priced ones) with ``choice`` written in
        (its generated partition block too, when its partition is ``auto``)."""
        partition = self.generated(choice) if choice.layout.partition == "auto" else None
        if len(self._blocks) >= _BLOCKS_KEPT:  # (a layout's choices come together: few are read again)
            self._blocks.clear()
        modules = apply_choice(modules or self.modules, choice, self.pipelines, self.gpus_per_node, self.world, partition,
                               self._reads[choice.pipeline], self._blocks)
        if choice.pipeline in self.generated_names:
            modules = self._with_generated(modules, choice)
        return modules

    def _with_generated(self, modules: list[s.Module], choice: Choice) -> list[s.Module]:
        """``modules`` (``choice`` written in) with the definition of its generated pipeline
        for its layout in the main file: the scheduler's, from the layout's stage costs
        (the program with a stand-in through its fold pass), once per layout and name."""
        key = (choice.layout, choice.pipeline)
        if key not in self._generated:
            stand_in = attrs.evolve(check_program(_with_pipeline(modules, placeholder(choice.pipeline))),
                                    profile=self.profile)
            self._generated[key] = generated_pipeline(choice.pipeline, passes.rerun(stand_in, after="check",
                                                                                     stop="fold"))
        return _with_pipeline(modules, self._generated[key])

    def generated(self, choice: Choice) -> s.PartitionDef:
        """The partition block generated for the layout of ``choice``
        (:func:`~dhelix.dsl.search.partitions.generated_partition` of its layer before any
        partition), once per layout's mesh, micro-batch and sharding, its chunk chains
        included whether SI is on or off (:meth:`price` defers such a choice by its bound
        until it can still enter the top); CheckError when nothing applies (then the choice
        is the same as its twin without one)."""
        layout = choice.layout
        key = attrs.evolve(layout, partition="written", microbatches=0, recompute="none", recompute_layers=0,
                           param_gather="step", stage_ends=(0, 0), offload="none", offload_percent=0)
        # A refusal may be the schedule's (a fold's stage split): kept per schedule.
        refusal = (key, choice.fold, choice.pipeline)
        if key not in self._partitions and refusal not in self._partition_refusals:
            twin = attrs.evolve(choice, layout=attrs.evolve(layout, partition="written"))
            try:
                program = passes.rerun(check_program(self.variant(twin)), after="check", stop="shapes")
                self._partitions[key] = generated_partition(program)
            except DhelixError as exc:
                self._partition_refusals[refusal] = exc
        if key not in self._partitions:
            raise self._partition_refusals[refusal]
        found = self._partitions[key]
        if found is None:
            raise CheckError(NOTHING_TO_PARTITION)
        return found

    def chosen(self, program: Program, layout: Layout) -> Program:
        """``program`` (a choice of ``layout``, checked) with the choices the tools make
        before pricing (:func:`~dhelix.dsl.simulator.launch.make_choices`). The planner's
        layer-level choices depend on the layer alone: made once per layer DAGs, partition
        block and mesh, whatever the schedule; the counts settled by the step are not."""
        def rerun(p: Program) -> Program:
            return self._rechecked(p, layout)

        def layer(p: Program) -> tuple[Program, tuple]:
            key = (p.forward, p.backward, p.partition, p.mesh)
            if key not in self._layer_choices:
                made, choices = choose_all(p)
                self._layer_choices[key] = ({name: getattr(made, name) for name in _LAYER_CHOICES}, choices)
            fields, choices = self._layer_choices[key]
            return rerun(attrs.evolve(p, **fields)), choices

        def fits(p: Program) -> bool:  # the pairs at their lane bound: the peak is the real one
            if self.capacity is None:
                return True
            p = self.plans.intern(p)
            return max(untimed(p, self.relaxed(p, layout), memo=self._untimed).memory) <= self.capacity

        self._stepped.clear()
        program, choices = make_choices(program, self.step_seconds, rerun, layer, fits)
        self.squeezed = any(isinstance(c, ChunkChoice) and c.over for c in choices)
        return program

    def _rechecked(self, program: Program, layout: Layout) -> Program:
        """``program`` (checked, its planner choices set) through the passes after check
        again: the layer DAGs once per layout and choices, the schedule from the cache."""
        key = (layout, program.substituted, program.chunk_counts, program.group_orders, program.backward_first)
        if key not in self._rechecked_dags:
            self._rechecked_dags[key] = self.plans.intern(passes.rerun(program, after="check", stop="autodiff"))
        dags = self._rechecked_dags[key]
        program = passes.strands(attrs.evolve(program, env=dags.env, forward=dags.forward, backward=dags.backward))
        placement, lowered = self.lowered(program)
        return attrs.evolve(program, placement=placement, lowered=lowered)

    def step_seconds(self, program: Program) -> float:
        """The simulated step of a checked ``program``, its SI plan from the cache; its
        simulation kept until the next :meth:`chosen` (the counts the step settles on were
        simulated so: :meth:`price` does not simulate them again)."""
        program = self.plans.intern(program)
        plan = self.plans.plan(program) if has_si(program) else None
        sim = self._stepped[_settled(program)] = simulate(program, plan, cost=self.cost, trace=False)
        return sim.step_time

    def bound(self, layout: Layout, schedule: tuple[str, str, str]) -> Bound | str:
        """The lower bounds of ``layout`` (checked with the schedule ``schedule`` up to the
        layer DAGs) and why its strands block is refused if it is, or why the passes refuse it."""
        # A refusal may be the schedule's (a fold's stage split); an offloading layout's time
        # bound reads the device's capacity.
        key: tuple = (layout, schedule) + ((self.capacity,) if layout.offload != "none" else ())
        if key not in self._bounds and layout.offload != "none":  # its twin's, with the optimizer offloaded
            twin = self.bound(_on_device(layout), schedule)
            if isinstance(twin, str):
                self._bounds[key] = twin
            else:
                program = self.layer_dags(layout, schedule)
                percents = (layout.offload_percent,) if layout.offload_percent else OFFLOAD_PERCENTS
                costs = self.costs(program, layout, None)
                # A share that fits the device has its memory bound within it: the time bound
                # takes the fastest of those, the memory bound the largest share's (the least).
                # The memory bound only falls as the share grows: those that fit are the
                # shares from the least that does (bisected).
                least = _first(percents, lambda percent: not self._over(
                    held_memory(twin, _offloading(program, percent), costs)))
                fastest = self._fastest_share(percents[percents.index(least):] if least is not None else percents)
                self._bounds[key] = with_optimizer(twin, _offloading(program, fastest),
                                                   _offloading(program, max(percents)), costs)
        if key not in self._bounds:
            try:
                program = self.layer_dags(layout, schedule)
                found = layout_bound(program, self.cost, self.costs(program, layout, None))
            except DhelixError as exc:
                self._bounds[key] = first_message(exc)
            else:
                try:
                    passes.strands(program)
                except DhelixError as exc:
                    found = attrs.evolve(found, strands=first_message(exc))
                self._bounds[key] = found
        return self._bounds[key]

    def _fastest_share(self, percents: tuple[int, ...]) -> int:
        """:func:`~dhelix.dsl.search.offload.fastest_percent` of ``percents``, once per tuple."""
        found = self._fastest.get(percents)
        if found is None:
            found = self._fastest[percents] = fastest_percent(percents, self.profile, self.cost.dtype)
        return found

    def price(self, choice: Choice, cutoff: float | None = None, memory_first: bool = False, defer: bool = False,
              tighten: bool = False) -> Priced | Refused | Pruned | TooBig | Deferred:
        """``choice`` checked, given the planner's choices, simulated and held to the memory.

        With ``memory_first`` (the search), a choice's peak memory and a floor of its step are
        computed first, without timing its step (:func:`~dhelix.dsl.simulator.events.untimed`:
        the peak the simulation would report), and one over the device memory is returned as
        TooBig, one whose floor exceeds the ``cutoff`` as Pruned, both unsimulated. With
        ``defer`` too, a choice that would need its SI layer pair planned first is returned
        as Deferred, with its floor; so is one whose partition has chunk chains, SI on or
        off, before the planner settles their counts (which simulates the step several
        times): with the floor of its program before the choices (:meth:`unsettled_costs`;
        a peak over the device memory or a floor above the ``cutoff`` rules it out first),
        ``loose``; with ``tighten`` too, with :meth:`unsettled_bound` (a simulation: most
        such choices never need it, their floor above the final cutoff). A schedule with SI
        blocks whose layer pair is not planned yet is first simulated with each layer pair at
        its lower bound (:func:`~dhelix.dsl.search.bound.relaxed_costs`): its memory is the
        real one (a rank's allocations follow its actions' order, not their durations),
        so one that does not fit is returned as such without planning; and with a ``cutoff``
        (seconds), when even that step exceeds the cutoff the choice is Pruned."""
        self.squeezed = False
        plain = memory_first and self._walked_alone(choice)
        if plain:  # another of its class found over the memory: so is it (dhelix.dsl.search.peaks)
            peak = self._over_peaks.get(choice)
            if peak is not None and self._over(peak):
                return TooBig(_largest_share(choice), peak)
        try:
            program = self.checked(choice)
            assert program.train is not None, "a checked model"
            launch = program.train.launch is not None or program.train.launch_backward is not None
            walked: Untimed | None = None  # the chosen share's untimed figures, where choosing it walked them
            if choice.layout.offload != "none" and not choice.layout.offload_percent:
                shared = self._offload_share(choice, program, launch, memory_first)
                if plain and isinstance(shared, TooBig):
                    self._over_peaks.add(choice, shared.memory)
                if not isinstance(shared, tuple):
                    return shared
                choice, program, walked = shared
            if program.partition is not None or launch:
                # Settling chains' counts simulates the step several times (and plans
                # several SI layer pairs under SI): deferred.
                chained = defer and not launch and _has_chains(program.partition)
                if (cutoff is not None or chained) and not launch:
                    if memory_first:  # untimed first: the peak, and a floor of the bound below
                        seen = untimed(program, self.unsettled_costs(program, choice.layout), memo=self._untimed)
                        if self._over(max(seen.memory)):
                            return TooBig(choice, max(seen.memory))
                        if cutoff is not None and seen.floor * (1 - FLOOR_MARGIN) > cutoff:
                            return Pruned(choice, seen.floor)
                        if chained and not tighten:
                            return Deferred(choice, seen.floor * (1 - FLOOR_MARGIN), loose=True)
                    unsettled = self.unsettled_bound(choice, program)
                    if cutoff is not None and unsettled * (1 - FLOOR_MARGIN) > cutoff:
                        return Pruned(choice, unsettled)
                    if chained:
                        return Deferred(choice, unsettled * (1 - FLOOR_MARGIN))
                program = self.chosen(program, choice.layout)
                settled = self._stepped.get(_settled(program))
                if settled is not None:  # simulated as the step settled the counts
                    sim = attrs.evolve(settled, label=choice.describe())
                    peak = max(r.memory for r in sim.ranks)
                    if memory_first and self._over(peak):
                        return TooBig(choice, peak)
                    return Priced(choice, sim, self._fits(sim), self.squeezed, program_key(program, choice, sim))
            si = has_si(program)
            planned = not si or self.plans.has(program)
            costs = None
            if memory_first:
                # Untimed: the exact peak, and a floor of the step (the SI pairs at their
                # lane bound until the layer pair is planned).
                plan = self.plans.plan(program) if si and planned else None
                if walked is None:
                    costs = self.costs(program, choice.layout, plan) if planned else self.relaxed(program, choice.layout)
                    walked = untimed(program, costs, memo=self._untimed)
                seen = walked
                if self._over(max(seen.memory)):
                    if plain:
                        self._over_peaks.add(choice, max(seen.memory))
                    return TooBig(choice, max(seen.memory))
                if cutoff is not None and seen.floor * (1 - FLOOR_MARGIN) > cutoff:
                    return Pruned(choice, seen.floor)
                if defer and not planned:
                    return Deferred(choice, seen.floor * (1 - FLOOR_MARGIN))
            if not planned and (cutoff is not None or not memory_first):
                relaxed = simulate(program, costs=self.relaxed(program, choice.layout), label=choice.describe(),
                                   trace=False)
                if not self._fits(relaxed):
                    return Priced(choice, relaxed, False)
                if cutoff is not None and relaxed.step_time * (1 - FLOOR_MARGIN) > cutoff:
                    return Pruned(choice, relaxed.step_time)
            plan = self.plans.plan(program) if si else None
            sim = simulate(program, plan, cost=self.cost, costs=self.costs(program, choice.layout, plan),
                           label=choice.describe(), trace=False)
        except DhelixError as exc:
            return Refused(choice, first_message(exc))
        return Priced(choice, sim, self._fits(sim), self.squeezed, program_key(program, choice, sim))

    def _walked_alone(self, choice: Choice) -> bool:
        """Whether :meth:`price` holds ``choice`` to the memory by its untimed walk before
        any planner's choice (no partition block, no ``launch`` its pipeline reads, not a
        generated pipeline): its peak is then its class's (:mod:`~dhelix.dsl.search.peaks`)."""
        partitioned, launch, launch_backward = self._written
        reads = self._reads[choice.pipeline]
        return (choice.layout.partition == "written" and not partitioned and choice.pipeline not in self.generated_names
                and not (launch and "g" in reads) and not (launch_backward and "gb" in reads))

    def offloads_only_to_fit(self, choice: Choice) -> bool:
        """Whether :meth:`price` rules ``choice`` (offloading, its share to choose) out
        wherever its twin on the device fits (its peak, untimed or simulated): where offloading
        is no faster and no planner's choice of its program reads the memory (no partition
        block, no ``launch`` its pipeline reads)."""
        partitioned, launch, launch_backward = self._written
        reads = self._reads[choice.pipeline]
        return (self.offload_slower and choice.layout.offload != "none" and not choice.layout.offload_percent
                and choice.layout.partition == "written" and not partitioned
                and not (launch and "g" in reads) and not (launch_backward and "gb" in reads))

    def _offload_share(self, choice: Choice, program: Program, launch: bool, memory_first: bool = False
                       ) -> tuple[Choice, Program, Untimed | None] | Pruned | Refused | TooBig:
        """``choice`` (offloading, its share not chosen; ``program``: it checked) with the
        share it offloads chosen (:mod:`offload`), its program so and its untimed figures
        where they were walked (None: not); or Pruned where its twin on the device fits and
        offloading is no faster (the twin's untimed floor as bound), or Refused where every
        share the device needs exceeds a node's host memory.
        The fastest of the shares whose untimed peak fits the device and whose host bytes fit
        a node's (both monotone in the share: bisected); all where the planner's choices read
        the memory (a partition block, ``launch``), or where no share fits the device: with
        ``memory_first``, TooBig then, with the peak of all offloaded (as :meth:`price` finds
        it next: the largest share is tried first, one walk settles such a choice)."""
        if program.partition is not None or launch:
            return (*_with_share(choice, program, 100), None)
        costs = self._memory_costs(program, choice.layout)
        seen: dict[int, Untimed] = {}

        def at(percent: int) -> Untimed:
            if percent not in seen:
                seen[percent] = untimed(_offloading(program, percent), costs, memo=self._untimed)
            return seen[percent]

        def fits(percent: int) -> bool:
            return not self._over(max(at(percent).memory))

        most_offloaded = OFFLOAD_PERCENTS[-1]
        if not fits(most_offloaded):  # nor does any other share (nor the twin): the peak only grows as fewer go
            chosen, program = _with_share(choice, program, most_offloaded)
            return TooBig(chosen, max(at(most_offloaded).memory)) if memory_first else (chosen, program, None)
        if self.offload_slower and fits(0):
            return Pruned(choice, at(0).floor)
        least = _first(OFFLOAD_PERCENTS, fits)
        assert least is not None, "the largest share fits"
        most = _last(OFFLOAD_PERCENTS, lambda percent: host_refusal(program, at(percent).host) is None)
        if most is None or most < least:
            refused = host_refusal(program, at(least).host)
            assert refused is not None, "the least share over the host memory"
            return Refused(_with_share(choice, program, least)[0], first_message(refused))
        shares = [percent for percent in OFFLOAD_PERCENTS if least <= percent <= most]
        percent = fastest_percent(shares, self.profile, self.cost.dtype)
        return (*_with_share(choice, program, percent), seen.get(percent))

    def _memory_costs(self, program: Program, layout: Layout) -> StepCosts:
        """The step costs :meth:`price` reads the untimed peak of ``program`` (checked, of
        ``layout``) with: planned, or with the SI pairs at their lane bound (the same peak)."""
        if not has_si(program):
            return self.costs(program, layout, None)
        if self.plans.has(program):
            return self.costs(program, layout, self.plans.plan(program))
        return self.relaxed(program, layout)

    def unsettled_bound(self, choice: Choice, program: Program) -> float:
        """A lower bound of the step (seconds) of ``choice`` (``program``: it checked, with a
        partition block) whatever the planner then chooses, computed before it chooses:
        ``program`` simulated with :meth:`unsettled_costs`. Once per choice: a deferred
        choice reads it again when it is settled."""
        found = self._unsettled.get(choice)
        if found is None:
            costs = self.unsettled_costs(program, choice.layout)
            found = self._unsettled[choice] = simulate(program, costs=costs, trace=False).step_time
        return found

    def unsettled_costs(self, program: Program, layout: Layout) -> StepCosts:
        """The step costs of ``program`` (a checked choice of ``layout`` with a partition
        block, before the planner's choices) with every chain whole, substitutions undone
        and every layer pass at a lower bound of it in any pieces
        (:func:`~dhelix.dsl.search.bound.relaxed_costs` with ``layers``): simulated, a lower
        bound of its step whatever the planner chooses. Their untimed peak
        (:func:`~dhelix.dsl.simulator.events.untimed`) is the real one of ``program`` (a
        rank's allocations follow its actions' order, not their durations), and a lower
        bound of the chosen program's: chunks and substitutions never lessen what a layer
        keeps for its backward (each chunk keeps its piece of what the whole chain keeps; a
        substituted all_reduce's readers keep what they kept). Once per layout, layer DAGs
        and whether the schedule splits W off, as :meth:`relaxed`."""
        assert program.lowered is not None, "a validated model"
        key = (layout, id(program.forward), id(program.backward), program.lowered.split, "unsettled")
        found = self._costs.get(key)
        if found is None:
            costs = self.costs(program, layout, None)
            found = self._costs[key] = (program.forward, program.backward, None,
                                        attrs.evolve(costs, layer=self._relaxed_layer(program, costs, True)))
        return found[3]

    def costs(self, program: Program, layout: Layout, plan: Plan | None) -> StepCosts:
        """:func:`~dhelix.dsl.simulator.costs.step_costs` of ``program`` (a checked choice of
        ``layout``, its layer DAGs interned) with ``plan``: they depend on the layout (mesh,
        recomputation), the layer DAGs and the plan only, not on the schedule, so they are
        computed once for the schedules that share them (and for a layout offloading its
        optimizer and its twin that does not: the simulator reads that from the program)."""
        key = (_on_device(layout), id(program.forward), id(program.backward), id(plan))
        found = self._costs.get(key)
        if found is None:
            # The objects are kept with their costs, so their ids are not reused.
            found = self._costs[key] = (program.forward, program.backward, plan,
                                        step_costs(program, plan, self.cost, self._layer_costs(program, plan)))
        return found[3]

    def _layer_costs(self, program: Program, plan: Plan | None) -> LayerCosts:
        """:func:`~dhelix.dsl.simulator.costs.layer_costs` of ``program`` (its layer DAGs
        interned) with ``plan``: they read the layer DAGs, the recomputation and the plan
        only, so the layouts that share these (other meshes' data and pipeline sizes, ZeRO
        stages, placements) share them."""
        assert program.train is not None, "a checked model"
        key = (id(program.forward), id(program.backward), program.train.recompute, id(plan))
        found = self._layers.get(key)
        if found is None:  # (kept with their objects, so that their ids are not reused)
            found = self._layers[key] = (program.forward, program.backward, plan,
                                         layer_costs(program, self.cost, plan))
        return found[3]

    def _relaxed_layer(self, program: Program, costs: StepCosts, layers: bool) -> LayerCosts:
        """:func:`~dhelix.dsl.search.bound.relaxed_layer` of ``program`` (``costs``: its step
        costs without a plan), once per what it reads: the layer DAGs, whether the schedule
        splits W off, the recomputation and the partition block."""
        assert program.lowered is not None and program.train is not None, "a validated model"
        key = (id(program.forward), id(program.backward), program.lowered.split, program.train.recompute,
               program.partition, layers)
        found = self._layers.get(key)
        if found is None:
            found = self._layers[key] = (program.forward, program.backward, None,
                                         relaxed_layer(program, self.cost, costs.layer, layers))
        return found[3]

    def relaxed(self, program: Program, layout: Layout) -> StepCosts:
        """:func:`~dhelix.dsl.search.bound.relaxed_costs` of ``program`` (a checked choice of ``layout``), once per
        layout, layer DAGs and whether the schedule splits W off (what the pairs' bound reads)."""
        assert program.lowered is not None, "a validated model"
        key = (_on_device(layout), id(program.forward), id(program.backward), program.lowered.split,
               "relaxed")
        found = self._costs.get(key)
        if found is None:
            costs = self.costs(program, layout, None)
            found = self._costs[key] = (program.forward, program.backward, None,
                                        attrs.evolve(costs, layer=self._relaxed_layer(program, costs, False)))
        return found[3]

    def _fits(self, sim: Simulation) -> bool:
        return not self._over(max(r.memory for r in sim.ranks))

    def _over(self, peak: float) -> bool:
        capacity = self.capacity
        return capacity is not None and peak > capacity


#: The most mesh and train blocks written kept at once (:meth:`Pricer.variant`).
_BLOCKS_KEPT = 4096


#: The relative margin by which an untimed floor must exceed the K-th best step to rule a
#: choice out: far above the rounding of summing its work in another order, and above the
#: 12 digits :func:`~dhelix.dsl.search.tune._rank` calls a tie.
FLOOR_MARGIN = 1e-9


#: The Program fields the planner's layer-level choices set (chunking.choose_all).
_LAYER_CHOICES = ("substituted", "chunk_counts", "group_orders", "backward_first")


def _with_pipeline(modules: list[s.Module], pipeline: s.PipelineDef) -> list[s.Module]:
    """``modules`` with ``pipeline`` defined at the end of the main file (the last module)."""
    main = modules[-1]
    return modules[:-1] + [attrs.evolve(main, items=main.items + (pipeline,))]


def _offloading(program: Program, percent: int) -> Program:
    """``program`` with ``percent`` % of its optimizer states offloaded (0: none; 100: all,
    written as no ``offload_percent``)."""
    assert program.train is not None, "a checked model"
    return attrs.evolve(program, train=attrs.evolve(program.train, offload="optimizer" if percent else "none",
                                                    offload_percent=percent if 0 < percent < 100 else None))


def _on_device(layout: Layout) -> Layout:
    """``layout`` with its optimizer states on the device (an offloading layout's twin)."""
    return attrs.evolve(layout, offload="none", offload_percent=0)


def _largest_share(choice: Choice) -> Choice:
    """``choice`` as :meth:`Pricer.price` reports it over the memory: offloading its largest
    share where the share is to choose (no share fits then)."""
    layout = choice.layout
    if layout.offload == "none" or layout.offload_percent:
        return choice
    return attrs.evolve(choice, layout=attrs.evolve(layout, offload_percent=OFFLOAD_PERCENTS[-1]))


def _with_share(choice: Choice, program: Program, percent: int) -> tuple[Choice, Program]:
    """``choice`` and its ``program`` offloading ``percent`` % of the optimizer states."""
    return attrs.evolve(choice, layout=attrs.evolve(choice.layout, offload_percent=percent)), \
        _offloading(program, percent)


def _first(values: tuple[int, ...], holds) -> int | None:
    """The first of ``values`` where ``holds`` (false, then true: bisected; the first tried
    first), None where it never does."""
    if holds(values[0]):
        return values[0]
    low, high = 1, len(values)  # holds(values[high]) where high < len(values)
    while low < high:
        middle = (low + high) // 2
        if holds(values[middle]):
            high = middle
        else:
            low = middle + 1
    return values[low] if low < len(values) else None


def _last(values: tuple[int, ...], holds) -> int | None:
    """The last of ``values`` where ``holds`` (true, then false: bisected; the last tried
    first), None where it never does."""
    return _first(tuple(reversed(values)), holds)


def _has_chains(block: s.PartitionDef | None) -> bool:
    """Whether the partition ``block`` has chunk statements (whose counts the planner settles)."""
    return block is not None and any(isinstance(st, s.Chunk) for st in block.body)


def _settled(program: Program) -> tuple:
    """What the choices made by :meth:`Pricer.chosen` set in ``program`` (of one choice):
    the planner's layer-level choices and the train block (the launch counts)."""
    return program.chunk_counts, program.substituted, program.group_orders, program.backward_first, program.train
