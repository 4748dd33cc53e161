"""Every stdlib pipeline in unit time, then simulated on the DHelix paper's programs and a
1024-GPU Llama-70B, with where `dhelix tune` ranks each, as Markdown tables.

Run: ``.venv/bin/python benchmarks/schedule_table.py [--ranks 4] [--microbatches 8 16 32]
[--programs FILE …] [--unit-only]``.

Unit time: :func:`dhelix.dsl.passes.unittime.unit_time` (F = 1, B = 2 or B = W = 1 when split,
an SI block the sum of its pair, transfers free), exact and the same on every machine; the peer
is 1F1B at the same p and m. docs/schedules.md shows it.

Simulated: for each program (the paper's examples with a pipeline, pp > 1, and
benchmarks/llama70b_h100_1024.dhx), every (fold, pipeline, SI) that `dhelix tune` would try
with the mesh, the micro-batches, ZeRO, recomputation, the partition and the gathers kept as
written (`--keep mesh,micro_batch,zero,recompute,shard,partition,param_gather,offload`) and the
zero-bubble scheduler's zb_1p and zb_2p offered (`--generated`): the program is rewritten with
that fold and pipeline as tune rewrites it (:mod:`dhelix.dsl.search.variant`), checked, and
simulated on its profile (:class:`dhelix.dsl.search.pricer.Pricer`, under tune's default memory
margin), one step: step time, bubble ratio, peak memory, P2P sends and bytes. The last column
is the place `dhelix tune` gives the choice (:func:`dhelix.dsl.search.tune.search` over the same
space, every choice that fits ranked; tune lists a choice that is another's program again once).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import sys
import time
from fractions import Fraction
from pathlib import Path

import attrs

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.frontend.imports import load_modules, read_source
from dhelix.dsl.frontend.stdlib import fold_of, stdlib_pipelines
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.passes.fold import placement_for
from dhelix.dsl.passes.lower import lower_pipeline
from dhelix.dsl.passes.unittime import peak_in_flight, unit_time
from dhelix.dsl.passes.validate import validate_lowered
from dhelix.dsl.search import headroom
from dhelix.dsl.search.generated import GENERATED
from dhelix.dsl.search.pricer import Priced
from dhelix.dsl.search.space import Choice, space_of
from dhelix.dsl.search.tune import Pricer, search
from dhelix.dsl.simulator.memory import GB

ROOT = Path(__file__).resolve().parent.parent
#: The DHelix paper's programs with a pipeline (pp > 1; llama8b_a40, llama8b_centauri_a40 and
#: megatron_tp_substitute_a40 have none, so every pipeline is the same there), and the 1024-GPU
#: Llama-70B on the shipped h100 profile, as written (ZeRO 0: tune_speed.py's starting point)
#: and with Megatron's distributed optimizer (ZeRO-1, as the paper's examples): (label, file,
#: settings added to its train block).
PROGRAMS = (("gpt18b_a40", "examples/gpt18b_a40.dhx", ""), ("llama39b_a40", "examples/llama39b_a40.dhx", ""),
            ("llama39b_cp2_a40", "examples/llama39b_cp2_a40.dhx", ""), ("phi31b_a40", "examples/phi31b_a40.dhx", ""),
            ("llama66b_a800", "examples/llama66b_a800.dhx", ""),
            ("llama70b_h100_1024", "benchmarks/llama70b_h100_1024.dhx", ""),
            ("llama70b_h100_1024 zero1", "benchmarks/llama70b_h100_1024.dhx", "zero = 1"))
#: What `dhelix tune --keep` keeps so that only the fold, the pipeline and SI vary.
KEEP = ("mesh", "micro_batch", "zero", "recompute", "shard", "partition", "param_gather", "offload")
#: The schedules issue 55 added, in the summary table (the zero-bubble scheduler's two last).
NEW = ("looped_bfs", "interleaved_zb", "zbv", "zb_h2", "v_min", "v_half", "one_f_one_b_overlap", "dualpipe") + tuple(GENERATED)


# --- unit time ---------------------------------------------------------------------------------

def table_rows(ranks: int, microbatches: list[int]) -> list[list[str]]:
    """One row per (pipeline, m): the unit-time figures, or why the pipeline refuses m."""
    pipelines = stdlib_pipelines()
    rows = []
    for m in microbatches:
        baseline = _run(pipelines, "one_f_one_b", ranks, m)[0].normalized_makespan
        for name, (kind, arg) in ((n, fold_of(d)) for n, d in stdlib_pipelines().items()):
            fold = kind if arg is None else f"{kind}({arg})"
            try:
                timing, lowered = _run(pipelines, name, ranks, m)
            except DhelixError as error:
                rows.append([name, fold, str(m), "—", "—", "—", "—", "—", error.message])
                continue
            rows.append([name, fold, str(m), str(timing.makespan),
                         _number(timing.normalized_makespan),
                         f"{float(timing.normalized_makespan / baseline):.3f}",
                         f"{timing.bubble_ratio} = {float(timing.bubble_ratio):.3f}",
                         _number(Fraction(max(peak_in_flight(lowered)) * lowered.copies, lowered.chunks)), ""])
    return rows


def _run(pipelines, name: str, ranks: int, m: int):
    kind, arg = fold_of(stdlib_pipelines()[name])
    lowered = lower_pipeline(pipelines[name], ranks=ranks, microbatches=m,
                             placement=placement_for(kind, arg, 12 * ranks, ranks))
    validate_lowered(lowered)
    return unit_time(lowered), lowered


def _number(value: Fraction) -> str:
    return str(value) if value.denominator == 1 else f"{float(value):.1f}"


HEADER = ["pipeline", "fold", "m", "make-span", "make-span / v", "vs 1F1B", "bubble ratio",
          "in flight / v", "note"]


def markdown(rows: list[list[str]], header: list[str] = HEADER) -> str:
    """A Markdown table of ``rows`` under ``header``, without the last (note) column if it is
    empty."""
    columns = len(header) if any(row[-1] for row in rows) else len(header) - 1
    table = [header[:columns]] + [row[:columns] for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(columns)]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |"
             for row in table]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# --- simulated ---------------------------------------------------------------------------------

@attrs.frozen
class Simulated:
    """One program's choices: each one's pricing (Priced or why it was refused), tune's
    place for it, and the facts the table's heading gives."""

    label: str
    heading: str
    choices: tuple[Choice, ...]
    priced: dict
    ranks: dict
    written: tuple[str, str]
    seconds: float


def simulate_program(label: str, path: str, extra: str = "") -> Simulated:
    """Price every (fold, pipeline, SI) of ``path`` (``extra`` added to its train block) with
    the rest kept as written, as `dhelix tune --keep … --generated` does, and rank them with
    tune's search."""
    start = time.perf_counter()
    text = read_source(str(ROOT / path))
    if extra:
        text = re.sub(r"^train \{", "train {\n  " + extra, text, count=1, flags=re.MULTILINE)
    modules = load_modules(text, str(ROOT / path))
    checked = check_program(modules)
    # As tune: every candidate priced by the profile's derived rates.
    base = passes.rerun(attrs.evolve(checked, profile=attrs.evolve(checked.profile, measured=None)), after="check")
    space = space_of(base, None, KEEP, generated=True)
    pricer = Pricer(modules, base, base.mesh.world, headroom.DEFAULT)
    choices = tuple(space.choices())
    priced = {choice: pricer.price(choice) for choice in choices}
    outcome = search(pricer, space, top=len(choices))
    ranks: dict = {found.choice: place for place, found in enumerate(outcome.top, 1)}
    # A choice tune lists once with another (the same program: zb_1p written as zb_h1's
    # order, say) takes that one's place, marked "=".
    for choice, result in priced.items():
        if choice not in ranks and isinstance(result, Priced) and result.fits:
            same = [found for found in outcome.top if found.program == result.program]
            ranks[choice] = f"=#{ranks[same[0].choice]}" if same else "?"
    mesh, train, profile = base.mesh, base.train, base.profile
    layout = " ".join(f"{axis}{mesh.size(axis)}" for axis in ("tp", "cp", "pp", "dp", "ep") if mesh.size(axis) > 1)
    usable = pricer.capacity / GB if pricer.capacity is not None else None
    heading = (f"{label} ({path}{', ' + extra if extra else ''}): {base.model.name}, {layout}, b{train.micro_batch} m{train.microbatches}, "
               f"{mesh.world} GPUs, profile {profile.name}; written: fold {base.fold.text} {base.pipeline.name}; "
               f"device {pricer.memory_gb:g} GB, usable {usable:.2f} GB (tune's default margin)")
    return Simulated(label, heading, choices, priced, ranks, (base.fold.text, base.pipeline.name),
                     time.perf_counter() - start)


SIM_HEADER = ["pipeline", "fold", "SI", "step s", "vs 1F1B", "bubble", "peak GB (rank)", "fits",
              "P2P sends / rank", "P2P GB / rank", "tune #", "note"]


def _order(choices) -> list[Choice]:
    """The choices in the stdlib's order (zb_1p and zb_2p last), SI off after SI on."""
    names = list(stdlib_pipelines()) + list(GENERATED)
    return sorted(choices, key=lambda c: (names.index(c.pipeline), c.fold, c.si != "on"))


def sim_rows(result: Simulated) -> list[list[str]]:
    """One row per choice of ``result``: its simulated figures, or why it was refused."""
    baseline = next(r for c, r in result.priced.items() if c.pipeline == "one_f_one_b" and isinstance(r, Priced))
    rows = []
    for choice in _order(result.choices):
        found = result.priced[choice]
        written = (choice.fold, choice.pipeline) == result.written and choice.si == "on"
        cells = [choice.pipeline + (" (written)" if written else ""), choice.fold, choice.si]
        if not isinstance(found, Priced):
            rows.append(cells + ["—"] * 8 + [getattr(found, "why", type(found).__name__)])
            continue
        sim = found.sim
        peak = sim.peak_rank
        place = result.ranks.get(choice)
        rows.append(cells + [f"{sim.step_time:.3f}", f"{sim.step_time / baseline.sim.step_time:.3f}",
                             f"{sim.bubble_ratio:.1%}", f"{peak.memory / GB:.1f} (r{peak.rank})",
                             "yes" if found.fits else "over", f"{sim.mean('sends'):g}",
                             f"{sim.mean('send_bytes') / GB:.2f}",
                             "—" if place is None else (f"#{place}" if isinstance(place, int) else place), ""])
    return rows


def summary_rows(results: list[Simulated]) -> list[list[str]]:
    """Per program, tune's best and the best place of each new schedule (over its folds and
    SI on or off): '#k', or 'over' (none fits the memory), '—' (refused at these sizes)."""
    rows = []
    for result in results:
        best = min(((place, c) for c, place in result.ranks.items() if place == 1), default=None)
        cells = [result.label, "—" if best is None else _choice_text(best[1])]
        for name in NEW:
            mine = [c for c in result.choices if c.pipeline == name]
            places = [int(str(result.ranks[c]).lstrip("=#")) for c in mine if c in result.ranks]
            if places:
                cells.append(f"#{min(places)}")
            elif any(isinstance(result.priced[c], Priced) for c in mine):
                cells.append("over")
            else:
                cells.append("—")
        rows.append(cells + [""])
    return rows


def _choice_text(choice: Choice) -> str:
    return f"{choice.fold} {choice.pipeline}" + (" SI off" if choice.si == "off" else "")


def main(argv=None) -> int:
    """Print the tables for the sizes and programs on the command line; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--programs", nargs="+", metavar="FILE",
                        help="programs to simulate, relative to the repository (default: the paper's and Llama-70B)")
    parser.add_argument("--unit-only", action="store_true", help="the unit-time table only")
    args = parser.parse_args(argv)
    print(f"# machine: {platform.node() or 'unknown'}, Python {platform.python_version()}; "
          f"date: {datetime.date.today()}")
    print("\n## Unit time (the figures do not depend on the machine)\n")
    print(f"p = {args.ranks}, m = {', '.join(map(str, args.microbatches))}; "
          f"make-span in chunk actions (F = 1), make-span / v in whole-rank forwards; "
          f"'vs 1F1B' = (make-span / v) / 1F1B's at the same m; in flight / v = the most "
          f"activations a rank holds, in whole-rank micro-batches (fold bidir: v / 2, each chunk a whole "
          f"rank's stage of one model copy)\n")
    print(markdown(table_rows(args.ranks, args.microbatches)))
    if args.unit_only:
        return 0
    print("\n## Simulated, one step (the simulator's figures: the same on every machine)\n")
    print("Every (fold, pipeline, SI) `dhelix tune --keep " + ",".join(KEEP) + " --generated` tries; "
          "'vs 1F1B' = step / 1F1B's (fold none); bubble = idle share of the compute lanes until the "
          "last pipeline action (waiting for a peer or a transfer; exposed layer communication counts as "
          "busy); peak GB: the "
          "highest rank's predicted peak (weights, gradients, optimizer states, activations); P2P: the "
          "pipeline's sends per rank per step (mean over the pipeline ranks) and their bytes; tune #: "
          "the place `dhelix tune` gives it among the choices that fit ('=#k': the same program as #k, "
          "listed once; '—': refused or over the memory)")
    results = []
    programs = PROGRAMS if not args.programs else tuple((Path(p).stem, p, "") for p in args.programs)
    for label, path, extra in programs:
        result = simulate_program(label, path, extra)
        results.append(result)
        print(f"\n### {result.heading}\n")
        print(markdown(sim_rows(result), SIM_HEADER))
    print("\n## Where `dhelix tune` puts the new schedules (best place over their folds and SI)\n")
    print("'#k': its best place among the choices that fit; 'over': priced, none fits the memory; "
          "'—': refused at these sizes (a fold the layers do not split into, m below what it needs)\n")
    print(markdown(summary_rows(results), ["program", "tune's #1"] + list(NEW) + ["note"]))
    print(f"\n(simulated and searched in {sum(r.seconds for r in results):.1f} s on this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
