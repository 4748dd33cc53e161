"""Centauri's model-level scheduling (ASPLOS'24 §3.2.3, Eq. 2): how many micro-batches to
launch together, ``train { launch = auto }``.

Eq. 2 chooses L1 forward and L2 backward micro-batches launched together so that the
partitioned weight all-gather hides behind L1 forwards and the gradient reduce-scatter behind
L2 backwards, under the device's memory cap (``L · m ≤ M``, m the activations of one). In
dhelix the micro-batches launched together per model chunk are the pipelines' builtin ``g``
(``interleaved_1f1b`` runs each chunk ``g`` micro-batches in a row, Megatron's
``microbatch_group_size_per_vp_stage``; its warm-up, so the activations in flight, grows
with ``g``), one count for both phases. The choice simulates the whole step for every ``g``
the pipeline accepts (each divisor of m from p on; a ``require`` it fails refuses it) and
keeps the fastest whose predicted peak fits the profile's device memory, ties to the smaller
``g``: the simulator charges what Eq. 2 writes in closed form — the weight gathers of ZeRO-1
under the forward (``param_gather = forward``, each layer's first forward waiting for its
own), ZeRO-3's gathers and the gradient reductions as the backward frees them — and the
pipeline bubble and transfers Eq. 2 leaves out. Without a memory figure in the profile
every ``g`` fits.
"""

from __future__ import annotations

from typing import Any, Callable, cast

import attrs

from dhelix.dsl.core.errors import DhelixError, first_message
from dhelix.dsl.core.program import AUTO, Program
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.passes.overrides import checked_program
from dhelix.dsl.passes.workload import chunk_statements, is_auto
from dhelix.dsl.planner.chunking import ChunkChoice, OrderChoice, SubstitutionChoice, choose_all
from dhelix.dsl.simulator.events import peak_memory, simulate
from dhelix.dsl.simulator.memory import GB


@attrs.frozen
class LaunchTry:
    """One ``g`` tried: the simulated step (seconds) and peak memory (bytes) of its busiest
    rank, or None and why it was refused."""

    launch: int  # the g tried (the gb tried, for launch_backward)
    seconds: float | None
    peak: float | None = None
    why: str = ""


@attrs.frozen
class LaunchChoice:
    """The ``g`` chosen for ``launch = auto`` and every one tried."""

    chosen: int
    tries: tuple[LaunchTry, ...]
    memory_gb: float | None
    setting: str = "launch"  # or "launch_backward" (the backward's gb)
    block = "train"  # the block whose setting it chose

    def describe(self) -> str:
        """``launch = auto: 4 (2: 1234.567 ms 40.1 GB, 4: …)``."""
        def one(t: LaunchTry) -> str:
            if t.seconds is None or t.peak is None:  # (priced tries have both)
                return f"{t.launch}: refused ({t.why})"
            over = self.memory_gb is not None and t.peak / 1e9 > self.memory_gb
            return f"{t.launch}: {t.seconds * 1e3:.3f} ms {t.peak / 1e9:.3g} GB{' (does not fit)' if over else ''}"
        cap = f"; device memory {self.memory_gb:g} GB" if self.memory_gb is not None else ""
        phase = " in the backward" if self.setting == BACKWARD else ""
        return (f"{self.setting} = auto: {self.chosen} micro-batches per chunk together{phase} "
                f"({', '.join(one(t) for t in self.tries)}; simulated step, peak of the busiest rank{cap})")


def priced_program(text: str, path: str, profile: str | None = None, gpus_per_node: int | None = None
                   ) -> tuple[Program, tuple[ChunkChoice | OrderChoice | SubstitutionChoice | LaunchChoice, ...]]:
    """:func:`~dhelix.dsl.passes.overrides.checked_program` with every choice the tools make
    before they price or run it — the planner's (:func:`~dhelix.dsl.planner.chunking.choose_all`:
    chunk counts, group orders, backward priority), then the launch count
    (:func:`choose_launch`) — and the choices, for ``dhelix plan`` to print."""
    return make_choices(checked_program(text, path, profile, gpus_per_node))


def make_choices(program: Program, step: Callable[[Program], float] | None = None,
                 rerun: Callable[[Program], Program] | None = None, layer: Callable | None = None,
                 fits: Callable[[Program], bool] | None = None
                 ) -> tuple[Program, tuple[ChunkChoice | OrderChoice | SubstitutionChoice | LaunchChoice, ...]]:
    """``program`` (checked, any stage from check on) with every choice the tools make before
    they price or run it, in order: the planner's (``layer``, default
    :func:`~dhelix.dsl.planner.chunking.choose_all`), the ``by auto`` counts settled by the
    whole step (:func:`choose_counts_by_step`, with ``step``, ``rerun`` and ``fits``), the
    launch counts (:func:`choose_launch`, forward then backward); and the choices. A search
    passes hooks that reuse what it has computed for other choices."""
    program, choices = (layer or choose_all)(program)
    program, choices = choose_counts_by_step(program, choices, step, rerun, fits)
    program, launch = choose_launch(program)
    program, backward = choose_launch(program, BACKWARD)
    return program, choices + launch + backward


#: How many of the counts a layer prices best the whole step then decides among (the chain
#: whole, count :data:`WHOLE`, always among them).
STEP_CANDIDATES = 3
WHOLE = 1
#: What :func:`choose_counts_by_step` keeps for counts whose program does not fit the device.
_OVER = "over the device memory"
#: Passes over the statements at most (each pass tries every statement's candidates with the
#: others at their counts so far; the next pass runs only when one changed).
STEP_PASSES = 3


def fits_device(program: Program) -> bool:
    """Whether the peak memory of ``program``'s busiest rank fits its profile's device
    memory (:func:`~dhelix.dsl.simulator.events.peak_memory`, without planning or timing
    its step); True when the profile gives no memory figure."""
    memory_gb = program.profile.memory_gb if program.profile is not None else None
    return memory_gb is None or peak_memory(program) <= memory_gb * GB


def choose_counts_by_step(program: Program, choices: tuple, step: Callable[[Program], float] | None = None,
                          rerun: Callable[[Program], Program] | None = None,
                          fits: Callable[[Program], bool] | None = None) -> tuple[Program, tuple]:
    """``program`` with each ``by auto`` count chosen among the :data:`STEP_CANDIDATES` that
    price the layer best and the chain whole, by simulating the whole step with each (a count that wins the layer
    can lose the step: SI pairs the chunks with the other strand, the pipeline carries them),
    one statement after the other, the others at their counts so far; ties to the count
    held so far (first: the layer's choice). The statements are passed over again while a
    pass changes a count (at most :data:`STEP_PASSES`): a count chosen later can make
    another statement's first choice lose, and a single pass would then end on whichever
    path the layer's choices set it on. Counts whose program does not fit the device
    memory are not stepped (chunks keep more for the backward than the chain whole: the
    fastest count may not fit) and never chosen over one that fits; a statement none of
    whose counts fits keeps the count held. ``choices`` are those of
    :func:`~dhelix.dsl.planner.chunking.choose_all`; returned with the chunk choices updated
    (each with the steps of its last pass, and the counts over the memory). ``rerun(program)`` runs the passes after check
    again with the counts set (default :func:`~dhelix.dsl.passes.pipeline.rerun`),
    ``step(program)`` gives the step seconds of what it returns (default: :func:`simulate` it),
    ``fits(program)`` whether its peak fits the device (default: :func:`fits_device`)."""
    step = step or (lambda p: simulate(p, trace=False).step_time)
    rerun = rerun or (lambda p: passes.rerun(p, after="check"))
    fits = fits or fits_device
    if program.profile is None or not any(isinstance(c, ChunkChoice) for c in choices):
        return program, choices
    autos = [index for index, st in enumerate(chunk_statements(program.partition)) if is_auto(st)]
    counts = dict(program.chunk_counts)
    # Per auto statement (by its position among the choices): its index and the counts tried.
    tried: dict[int, tuple[int, list]] = {}
    for position, choice in enumerate(choices):
        if isinstance(choice, ChunkChoice) and len(tried) < len(autos):
            priced = sorted((c for c in choice.candidates if c.seconds is not None), key=lambda c: cast(float, c.seconds))
            values = [choice.chosen] + [c.value for c in priced if c.value != choice.chosen][:STEP_CANDIDATES - 1]
            if WHOLE not in values and any(c.value == WHOLE for c in priced):
                values.append(WHOLE)  # Algorithm 1 leaves a collective whole where chunks do not pay
            tried[position] = (autos[len(tried)], values)
    # Each statement's first try is the counts so far, stepped already: each set is stepped once.
    stepped: dict[tuple, float | str | None] = {}  # a step, _OVER (does not fit) or None (refused)
    steps_of: dict[int, tuple] = {}
    over_of: dict[int, tuple] = {}
    for _ in range(STEP_PASSES):
        changed = False
        for position, (index, values) in tried.items():
            held = counts[index]
            steps: list[tuple[int | str, float]] = []
            over = []
            for value in [held] + [v for v in values if v != held]:
                key = tuple(sorted({**counts, index: value}.items()))
                if key not in stepped:
                    try:
                        counted = rerun(attrs.evolve(program, chunk_counts=key))
                        stepped[key] = step(counted) if fits(counted) else _OVER
                    except DhelixError:
                        stepped[key] = None
                result = stepped[key]
                if result == _OVER:
                    over.append(value)
                elif isinstance(result, (int, float)):
                    steps.append((value, result))
            best = min(steps, key=lambda vt: vt[1])[0] if steps else held
            changed = changed or best != held
            counts[index] = best
            steps_of[position], over_of[position] = tuple(steps), tuple(over)
        if not changed:
            break
    updated = tuple(attrs.evolve(choice, chosen=counts[tried[k][0]], steps=steps_of[k], over=over_of[k])
                    if k in tried else choice for k, choice in enumerate(choices))
    chosen = rerun(attrs.evolve(program, chunk_counts=tuple(sorted(counts.items()))))
    return chosen, updated


#: ``train { launch_backward }``: the backward's micro-batches launched together (``gb``).
BACKWARD = "launch_backward"


def choose_launch(program: Program, setting: str = "launch") -> tuple[Program, tuple[LaunchChoice, ...]]:
    """``program`` (checked, any stage from check on) with the pipelines' ``g`` chosen for
    ``train { launch = auto }`` (``setting`` "launch"; the backward's ``gb`` too unless
    ``launch_backward`` is set), or ``gb`` for ``launch_backward = auto`` (``setting``
    :data:`BACKWARD`, with ``g`` as chosen or written: Eq. 2's L2 after L1), its later passes
    run again; unchanged with () otherwise."""
    train = program.train
    if train is None or getattr(train, setting) != AUTO or program.profile is None or program.mesh is None:
        return program, ()
    p, m = program.mesh.size("pp"), train.microbatches
    memory_gb = program.profile.memory_gb
    assert program.pipeline is not None, "a checked model"
    tries = []
    for g in (k for k in range(max(1, p), m + 1) if m % k == 0):
        try:
            tried = passes.rerun(attrs.evolve(program, **_set(setting, g)), after="check")
            sim = simulate(tried)
        except DhelixError as exc:
            tries.append(LaunchTry(g, None, why=first_message(exc)))
            continue
        tries.append(LaunchTry(g, sim.step_time, sim.peak_rank.memory))
    priced = [t for t in tries if t.seconds is not None]
    fits = [t for t in priced if memory_gb is None or (t.peak is not None and t.peak / 1e9 <= memory_gb)]
    pool = fits or priced
    if not pool:
        raise DhelixError(f"{setting} = auto: no micro-batch count fits pipeline {program.pipeline.name}",
                          getattr(train, f"{setting}_span") or train.span, [t.why for t in tries][:1])
    best = min(pool, key=lambda t: (t.seconds, t.launch)).launch
    return passes.rerun(attrs.evolve(program, **_set(setting, best)), after="check"), \
        (LaunchChoice(best, tuple(tries), memory_gb, setting),)


def _set(setting: str, value: int) -> dict[str, Any]:
    """The Program field ``setting`` (``launch`` or ``launch_backward``) set to ``value``, as
    keyword arguments of :func:`attrs.evolve`."""
    return {setting: value}
