"""`dhelix tune --measure K`: the search's K fastest choices run for a few steps where the
program would run, re-ranked by their measured step time.

The search prices every choice with the simulator; measuring checks its order where it
matters, on the few choices that are left (NeMo's AutoConfigurator and DeepSpeed's autotuner
only measure: dhelix prunes by simulation first). Each candidate is compiled in the command
once, as `dhelix run` compiles a file (:func:`~dhelix.dsl.simulator.launch.priced_program`,
then a :class:`~dhelix.dsl.simulator.runplan.RunPlan`: the ranks never parse), and started by
`run`'s launcher (:mod:`dhelix.interpreter.launch.spawn`): local ranks here, or this
process's rank of a torchrun world. Candidates run one after another, never side by side (they
would slow each other down), each in fresh rank processes, on seeded random tokens (a step's
time does not depend on the data). A candidate's measured step is the median, over the steps
after the first (which pays for allocations and connections), of the slowest rank's time per
step, as `dhelix run`'s summary measures it. A candidate that cannot run (over this machine's
memory, a dtype the interpreter has no kernels for, a rank that fails) is reported in its row
and left out of the measured order; it never ends the command.

torch is imported only when a candidate runs.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

import attrs

from dhelix.cli.launch import torchrun_world
from dhelix.dsl.core.errors import DhelixError, UsageError, first_message
from dhelix.dsl.core.table import format_table
from dhelix.dsl.search.explain import differences
from dhelix.dsl.search.tune import Priced, Pricer
from dhelix.dsl.search.variant import variant_text

#: The steps each candidate runs unless told (``--measure-steps``): the first warms up, the
#: median of the others is its measured step.
DEFAULT_STEPS = 3
MAX_STEPS = 100
#: The most candidates ``--measure`` runs (``--top``'s limit).
MAX_CANDIDATES = 100
#: The most ranks a candidate may start on this machine: past it, the cluster measures.
MAX_LOCAL_RANKS = 64
#: The collective timeout of a measured candidate (seconds): a hung rank ends its row.
TIMEOUT_S = 60.0


def add_measure_arguments(parser) -> None:
    """Add ``--measure K`` and ``--measure-steps N`` to `tune`'s ``parser``."""
    parser.add_argument("--measure", type=int, metavar="K",
                        help="after the search, run the K fastest (at most 100; --top is raised to K) for a few "
                             "steps each, one after another, where the program would run (local ranks, or the "
                             "world under torchrun), and choose the measured fastest: its table puts measured "
                             "beside predicted")
    parser.add_argument("--measure-steps", type=int, metavar="N",
                        help=f"steps each measured candidate runs (default {DEFAULT_STEPS}, at least 2): the first "
                             "warms up, its measured step is the median of the others")


def check_measure_numbers(args) -> None:
    """UsageError for a ``--measure`` or ``--measure-steps`` out of range, or steps without
    ``--measure``; raises ``args.top`` to ``args.measure`` (every measured candidate is shown)."""
    if args.measure is None:
        if args.measure_steps is not None:
            raise UsageError("--measure-steps goes with --measure K (how many of the fastest to run)")
        return
    if not 1 <= args.measure <= MAX_CANDIDATES:
        raise UsageError(f"--measure must be between 1 and {MAX_CANDIDATES}, got {args.measure}")
    steps = DEFAULT_STEPS if args.measure_steps is None else args.measure_steps
    if not 2 <= steps <= MAX_STEPS:
        raise UsageError(f"--measure-steps must be between 2 and {MAX_STEPS} (the first warms up), got {steps}")
    args.measure_steps = steps
    args.top = max(args.top, args.measure)


def check_launchable(program, world: int, budget: float | None) -> None:
    """Before the search: DhelixError (located) when ``program`` (the file, checked) cannot be
    run whatever the search chooses (a dtype the interpreter has no kernels for); UsageError
    when its candidates (each of ``world`` ranks) cannot be measured from here — more local
    ranks than :data:`MAX_LOCAL_RANKS`, a torchrun world of another size, or a time ``budget``
    under torchrun (each rank searches; a budget could stop them at different choices).
    Starts the local ranks' forkserver (torch loads meanwhile)."""
    from dhelix.dsl.passes.runcheck import unrunnable

    for problem in unrunnable(program):
        raise DhelixError(problem.message, problem.span,
                          [*problem.notes, "--measure runs the candidates: tune without it to search only"])
    placed = torchrun_world()
    if placed is None:
        if world > MAX_LOCAL_RANKS:
            raise UsageError(
                f"--measure runs each candidate on its {world} ranks, and this machine starts at most "
                f"{MAX_LOCAL_RANKS} local ones: measure on the cluster (torchrun with {world} processes in all "
                f"running `dhelix tune … --measure K`), or search a smaller world here with --gpus")
        from dhelix.interpreter.launch import spawn

        spawn.warm_up_ranks()
        return
    if placed[1] != world:
        raise UsageError(f"--measure under torchrun runs each candidate on torchrun's {placed[1]} processes, and "
                         f"the search is for {world} GPUs: start {world} processes in all, or give --gpus {placed[1]}")
    if budget is not None:
        raise UsageError("--budget under torchrun: every process searches, and a time budget could stop them at "
                         "different choices; search without it (or tune on one machine, then `dhelix run` the "
                         "result under torchrun)")


@attrs.frozen(kw_only=True)
class Measured:
    """One candidate: its place in the predicted order (``predicted_rank``, 1-based), what
    the search priced (``priced``), the slowest rank's time of every step it ran (seconds;
    empty when it did not run), the ranks and backend it ran on, and why it did not run
    (``failure``, "" when it ran)."""

    predicted_rank: int
    priced: Priced
    steps: tuple[float, ...] = ()
    ranks: int = 0
    backend: str = ""
    failure: str = ""

    @property
    def seconds(self) -> float | None:
        """The measured step: the median of the steps after the first; None when it did not run."""
        if not self.steps:
            return None
        from dhelix.interpreter.training.summary import steady

        return steady(self.steps)

    @property
    def ratio(self) -> float | None:
        """Measured ÷ predicted step; None when it did not run."""
        return None if self.seconds is None else self.seconds / self.priced.seconds


@attrs.frozen(kw_only=True)
class Measurement:
    """The measured candidates in the predicted order (``rows``), the steps each ran and
    whether the ranks were on this machine (``local``)."""

    rows: tuple[Measured, ...]
    steps: int
    local: bool = True

    @property
    def ranked(self) -> tuple[Measured, ...]:
        """The rows that ran, fastest measured first (ties: the predicted order)."""
        ran = [row for row in self.rows if row.seconds is not None]
        return tuple(sorted(ran, key=lambda row: (row.seconds, row.predicted_rank)))

    @property
    def best(self) -> Measured | None:
        """The measured fastest; None when no candidate ran."""
        return self.ranked[0] if self.ranked else None


def measure_top(top: tuple[Priced, ...], pricer: Pricer, text: str, path: str, steps: int,
                quiet: bool = False) -> Measurement:
    """Run each of ``top`` (the search's fastest, in order) for ``steps`` steps, one after
    another: its program (``pricer``'s variant of the file ``path`` whose source is ``text``)
    compiled here as `dhelix run` compiles it, its ranks started by `run`'s launcher (local,
    or this process's rank under torchrun); standard error gets a line per candidate unless
    ``quiet`` (under torchrun, from global rank 0 alone). A candidate's failure is kept in its row."""
    placed = torchrun_world()
    say = sys.stderr if not quiet and (placed is None or placed[0] == 0) else None
    rows = []
    for index, priced in enumerate(top, start=1):
        what = f"{priced.choice.layout.describe()}, {priced.choice.schedule()}"
        _say(say, f"dhelix tune: measuring {index}/{len(top)}: {what} for {steps} steps")
        try:
            row = _run_candidate(index, priced, pricer, text, path, steps, placed)
        except DhelixError as exc:
            row = Measured(predicted_rank=index, priced=priced, failure=first_message(exc).splitlines()[0])
        if row.failure:
            _say(say, f"  not measured: {row.failure}")
        else:
            assert row.seconds is not None, "a measured row"
            kept = ", ".join(_ms(s) for s in row.steps)
            _say(say, f"  {_ms(row.seconds)} on {row.ranks} {row.backend} rank(s) (every step: {kept})")
        rows.append(row)
    return Measurement(rows=tuple(rows), steps=steps, local=placed is None)


def _run_candidate(index: int, priced: Priced, pricer: Pricer, text: str, path: str, steps: int,
                   placed: tuple[int, int] | None) -> Measured:
    """Compile the candidate ``priced`` once and run it for ``steps`` steps; raises
    DhelixError when it cannot (the command keeps the message in its row)."""
    from dhelix.cli.launch import check_memory, choose_backend
    from dhelix.dsl.passes.runcheck import unrunnable
    from dhelix.dsl.simulator.launch import priced_program
    from dhelix.dsl.simulator.runplan import plan_run
    from dhelix.interpreter.launch import join, spawn
    from dhelix.interpreter.training import train

    source = variant_text(pricer.variant(priced.choice), text, "")
    program, choices = priced_program(source, path)
    for problem in unrunnable(program):
        raise DhelixError(problem.message, problem.span, problem.notes)
    compiled = plan_run(program, path, choices, text=source)
    train.preflight(program, compiled.reference)
    assert program.mesh is not None and program.train is not None, "a checked model"
    nproc = program.mesh.world if placed is None else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = choose_backend(None, nproc)
    check_memory(program, nproc, backend)
    # the declared run options by name (RunSettings' fields are made from OPTIONS), as run's are
    declared: dict[str, Any] = {"steps": steps, "seed": program.train.seed or 0, "zero1": program.train.zero >= 1, "timeout": TIMEOUT_S}
    options = train.RunOptions(**declared, path=path, compiled=compiled, backend=backend)
    if placed is None:
        result = spawn.run_local(options, nproc, train.train)
    else:
        result = join.run_rank(options, *placed, train.train, gpus_per_node=program.mesh.gpus_per_node,
                               prefix=f"dhelix/tune-measure-{index}/")
    if result is None:  # another rank of a torchrun world: global rank 0 measures
        return Measured(predicted_rank=index, priced=priced, failure="measured by global rank 0")
    per_step = tuple(max(times) for times in zip(*(r.step for r in result.ranks), strict=True))
    return Measured(predicted_rank=index, priced=priced, steps=per_step, ranks=len(result.ranks), backend=backend)


def _say(out: TextIO | None, line: str) -> None:
    if out is not None:
        print(line, file=out, flush=True)


def format_measurement(measurement: Measurement, note: str = "") -> str:
    """The measured candidates, fastest measured first (then those that did not run), each
    with its predicted and measured step and their ratio; a line naming the measured best
    and whether it is the predicted best. ``note``: a line on what the prediction is for."""
    kept = kept_steps(measurement.steps)
    where = "on this machine" if measurement.local else "on torchrun's world"
    lines = [f"measured {where}, one candidate after another: the median of {kept} (step 1 warms up) of the "
             "slowest rank's step time"]
    if note:
        lines.append(note)
    ranked = measurement.ranked
    order = [*ranked, *(row for row in measurement.rows if row.seconds is None)]
    best_choice = measurement.rows[0].priced.choice
    rows = []
    for row in order:
        measured_rank = str(ranked.index(row) + 1) if row in ranked else "-"
        later = row.steps[1:]
        spread = "" if len(later) < 2 else f" ({min(later) * 1e3:,.3f}-{max(later) * 1e3:,.3f})"
        rows.append([measured_rank, str(row.predicted_rank), row.priced.choice.layout.describe(),
                     row.priced.choice.schedule().removeprefix("fold "), _ms(row.priced.seconds),
                     "-" if row.seconds is None else _ms(row.seconds) + spread,
                     "-" if row.ratio is None else f"{row.ratio:,.2f}x",
                     row.failure or ("predicted best" if row.priced.choice == best_choice
                                     else differences(row.priced.choice, best_choice))])
    header = ["measured #", "predicted #", "layout", "schedule", "predicted", "measured (range)", "measured/predicted",
              "differs from predicted #1"]
    lines += [""] + format_table(header, rows, right=(0, 1, 4, 5, 6)) + ["", final_line(measurement)]
    return "\n".join(lines) + "\n"


def kept_steps(steps: int) -> str:
    """The steps a measured step is the median of, in words: ``step 2``, ``steps 2-5``."""
    return "step 2" if steps == 2 else f"steps 2-{steps}"


def final_line(measurement: Measurement) -> str:
    """The measured best, and whether it differs from the predicted best."""
    best = measurement.best
    if best is None:
        return ("no candidate could be measured here (see each row): measure where the program runs (torchrun on the "
                "cluster), or search a world this machine can start with --gpus")
    first = measurement.rows[0]
    assert best.seconds is not None, "the ranked rows were measured"
    if best.predicted_rank == 1:
        return f"measured best: predicted #1, {_ms(best.seconds)}: the same as the predicted best"
    versus = ("the predicted best did not run" if first.seconds is None else
              f"{_ms(first.seconds - best.seconds)} ({(first.seconds - best.seconds) / first.seconds:.1%}) faster than "
              f"the predicted best's {_ms(first.seconds)}")
    line = (f"measured best: predicted #{best.predicted_rank} ({differences(best.priced.choice, first.priced.choice)}), "
            f"{_ms(best.seconds)}: it differs from the predicted best, {versus}")
    if first.seconds is not None and first.seconds - best.seconds < max(_spread(best), _spread(first)):
        line += (" — within the spread of their steps, so more --measure-steps (or a quieter machine) may order "
                 "them otherwise")
    return line


def _spread(row: Measured) -> float:
    """The range of a row's steps after the first (seconds; 0 with one)."""
    kept = row.steps[1:]
    return max(kept) - min(kept) if kept else 0.0


def measurement_json(measurement: Measurement) -> dict:
    """The measurement as plain values (seconds): every candidate in the predicted order,
    the measured order as predicted ranks, the measured best's predicted rank (None: none ran)."""
    best = measurement.best
    return {
        "steps": measurement.steps, "kept_steps": list(range(2, measurement.steps + 1)),
        "local": measurement.local,
        "candidates": [{"predicted_rank": row.predicted_rank,
                        "measured_rank": (measurement.ranked.index(row) + 1) if row in measurement.ranked else None,
                        "choice": row.priced.choice.settings(), "predicted_s": row.priced.seconds,
                        "measured_s": row.seconds, "ratio": row.ratio, "step_s": list(row.steps),
                        "ranks": row.ranks, "backend": row.backend, "failure": row.failure or None}
                       for row in measurement.rows],
        "measured_order": [row.predicted_rank for row in measurement.ranked],
        "best_predicted_rank": None if best is None else best.predicted_rank,
        "differs_from_predicted": None if best is None else best.predicted_rank != 1,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"
