"""Words and tables for a search's result: what differs between two choices, why the best
beats the runner-up, and the ranked table `dhelix tune` prints."""

from __future__ import annotations

from dhelix.dsl.core.table import format_table
from dhelix.dsl.search.space import Choice
from dhelix.dsl.search.tune import Outcome, Priced
from dhelix.dsl.simulator.events import Simulation
from dhelix.dsl.simulator.memory import GB


def differences(choice: Choice, best: Choice) -> str:
    """The settings of ``choice`` that differ from ``best``'s, ``pp 4 (2), b 2 (1), SI off (on)``; "best"
    for the best itself."""
    if choice == best:
        return "best"
    mine, theirs = choice.settings(), best.settings()
    names = {"micro_batch": "b", "microbatches": "m", "si": "SI"}

    def text(value) -> str:  # an order of mesh axes: innermost first
        return " ".join(value) if isinstance(value, tuple) else str(value)

    return ", ".join(f"{names.get(key, key)} {text(value)} ({text(theirs[key])})" for key, value in mine.items()
                     if value != theirs[key])


def step_parts(sim: Simulation) -> dict[str, float]:
    """The step of ``sim`` split into what a rank spends it on, averaged over the pipeline
    ranks (seconds): compute and exposed layer communication while busy, the pipeline's idle
    time (bubble, waiting for transfers), and the tail after the pipeline (exposed gradient
    reduction and the optimizer)."""
    busy = sim.mean("busy")
    layer_exposed = sim.mean("layer_exposed")
    return {"compute": busy - layer_exposed, "exposed layer communication": layer_exposed,
            "pipeline idle (bubble, transfers)": max(0.0, sim.pipeline_time - busy),
            "gradient reduction and optimizer after the pipeline": max(0.0, sim.step_time - sim.pipeline_time)}


def why_best(best: Priced, runner: Priced) -> str:
    """One line: how much faster the best is than the runner-up, the part of the step that
    differs most, and the settings behind it."""
    gap = runner.seconds - best.seconds
    if gap <= 1e-9 * runner.seconds:
        return (f"the best ties the runner-up ({differences(runner.choice, best.choice)}): the same predicted step, "
                "so the order of the settings decides (a schedule changes nothing on one pipeline rank, say)")
    mine, theirs = step_parts(best.sim), step_parts(runner.sim)
    part = max(mine, key=lambda k: abs(theirs[k] - mine[k]))
    delta = theirs[part] - mine[part]
    return (f"the best is {_ms(gap)} ({gap / runner.seconds:.1%}) faster than the runner-up "
            f"({differences(runner.choice, best.choice)}): its {part} is {_ms(abs(delta))} "
            f"{'shorter' if delta > 0 else 'longer'} ({_ms(mine[part])} vs {_ms(theirs[part])} per rank)")


def format_outcome(outcome: Outcome, title: str) -> str:
    """The ranked table of the top choices with what the search looked at, for the terminal."""
    lines = [title, _summary(outcome)]
    if not outcome.top:
        return "\n".join(lines) + "\n"
    best = outcome.top[0].choice
    offloads = any(p.choice.layout.offload != "none" for p in outcome.top)
    rows = []
    for rank, p in enumerate(outcome.top, start=1):
        sim = p.sim
        exposed = sim.mean("layer_exposed") + sim.mean("pp_exposed") + sim.mean("dp_exposed")
        peak = sim.peak_rank
        usable = outcome.usable_gb
        rows.append([str(rank), p.choice.layout.describe(outcome.gpus_per_node or None),
                     p.choice.schedule().removeprefix("fold "),
                     _ms(sim.step_time), f"{sim.tokens_per_second:,.0f}", f"{sim.mfu:.1%}",
                     f"{peak.memory / GB:.2f} (r{peak.rank})",
                     f"{peak.memory / GB / usable:.0%}" if usable else "—", _ms(exposed), differences(p.choice, best)])
        if offloads:
            host = max(r.states.host for r in sim.ranks)
            rows[-1].insert(8, f"{host / GB:.2f}" if host else "—")
    header = ["#", "layout", "schedule", "step", "tokens/s", "MFU", "peak GB", "of usable", "exposed comm",
              "differs from #1"]
    if offloads:
        header.insert(8, "host GB")
    lines += [""] + format_table(header, rows, right=(0, 3, 4, 5, 6, 7, 8) + ((9,) if offloads else ()))
    lines += ["", "layout: the mesh innermost first, '|' where a node ends (tp4|2: each tp group on 2 nodes, 4 "
                  "ranks on each)"]
    if offloads:
        lines += ["offload P%: P % of the optimizer's states (fp32 masters and moments) in host memory, stepped by "
                  "the host's AdamW; host GB: what they take per GPU at most"]
    if len(outcome.top) > 1:
        lines += [why_best(outcome.top[0], outcome.top[1])]
    return "\n".join(lines) + "\n"


def _summary(outcome: Outcome) -> str:
    cap = "no device memory in the profile" if outcome.memory_gb is None else memory_cap(outcome)
    processes = f" by {outcome.jobs} processes" if outcome.jobs > 1 else ""
    text = (f"searched {outcome.choices:,} choices ({outcome.layouts:,} layouts) in {outcome.seconds:.1f} s{processes}: "
            f"{outcome.simulated:,} simulated, {outcome.fit:,} of them fit; {outcome.pruned:,} ruled out by "
            f"their lower bound, {outcome.too_big:,} over the {cap}, {outcome.refused:,} refused by the checks, "
            f"{outcome.same:,} the same as another (nothing to partition); "
            f"{outcome.plans} SI plan{'s' if outcome.plans != 1 else ''} computed")
    if outcome.found is not None:
        text += (f"; the best was found after {outcome.found:.1f} s"
                 + (" (the rest: proving that nothing beats it)" if outcome.complete else ""))
    if not outcome.complete:
        text += "\nstopped by the time budget: " + (
            f"the choices not visited take at least {_ms(outcome.bound)} per step" if outcome.bound is not None
            else "some layouts were not even bounded") + " (more time may find a faster one)"
    return text


def memory_cap(outcome: Outcome) -> str:
    """What a choice's peak is held to, in words: ``44.60 GB usable (device 48 GB less a 3.40 GB
    reserve)``, or ``device memory 48 GB`` without a reserve."""
    usable = outcome.usable_gb
    if not outcome.reserve_gb or usable is None:
        return f"device memory {outcome.memory_gb:g} GB"
    return (f"{size_text(usable * GB)} usable (device {outcome.memory_gb:g} GB less a "
            f"{size_text(outcome.reserve_gb * GB)} reserve)")


def size_text(nbytes: float) -> str:
    """Bytes in the largest unit (GB, MB, kB) they make at least one of, two decimals: ``3.40 GB``,
    ``14.30 kB``."""
    for unit, size in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def format_spreads(found, knobs, robust: bool = False, gpus_per_node: int | None = None) -> str:
    """The top choices priced within the profile's uncertainty (:mod:`~dhelix.dsl.search.uncertainty`:
    ``found`` Spreads over ``knobs``): each one's step at the profile's values, median and
    worst over the corners, and the ranks it takes among them, ``*`` where its rank changes;
    ``robust``: ``found`` is ordered by worst step, the first chosen; ``gpus_per_node`` marks
    where a node ends in each mesh."""
    rows = []
    for number, spread in enumerate(found, start=1):
        ranks = sorted(set(spread.ranks))
        choice = spread.priced.choice
        rows.append([str(number), choice.layout.describe(gpus_per_node), choice.schedule().removeprefix("fold "),
                     _ms(spread.steps[0]), _ms(spread.median), _ms(spread.worst),
                     f"{ranks[0]}-{ranks[-1]} *" if spread.flips else str(ranks[0])])
    header = ["#", "layout", "schedule", "step", "median", "worst", "ranks"]
    lines = [f"within the profile's uncertainty ({', '.join(k.describe() for k in knobs)}; every corner of that box "
             f"and the profile's own values, {2 ** len(knobs) + 1} steps each):"]
    lines += format_table(header, rows, right=(0, 3, 4, 5, 6))
    flips = [spread for spread in found if spread.flips]
    lines.append("* its rank among these changes within the uncertainty" if flips else
                 "the order of these holds at every corner")
    if robust:
        lines.append(f"chosen: the best worst case, {_ms(found[0].worst)} ({found[0].priced.choice.describe()})")
    return "\n".join(lines) + "\n"
