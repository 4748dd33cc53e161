"""`dhelix tune` against the paper's hand-made configurations: for every paper example, the
predicted step of the example as shipped beside the step of what `tune` chooses for the same
model, cluster and global batch (its space holds the shipped choice, so it is never slower),
and the memory SI costs over one strand.

Run from the repository root::

    .venv/bin/python benchmarks/tune_vs_paper.py [--only NAME] [--partitions]

Per example: the shipped choice and its predicted step and peak memory; the tuned choice, its
step, peak and the ratio shipped / tuned; the settings that differ. Then, for the example's
layout, the peak memory of the W schedule with SI, without SI, and of 1F1B without folding,
split into model states and activations: where SI's extra memory over one strand goes.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.frontend.imports import load_modules, read_source
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.search.explain import differences
from dhelix.dsl.search.space import Choice, Layout, space_of
from dhelix.dsl.search.tune import Pricer, Priced, search
from dhelix.dsl.simulator.launch import priced_program
from dhelix.dsl.simulator.report import compare

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("llama8b_a40", "gpt18b_a40", "llama39b_a40", "llama39b_cp2_a40", "phi31b_a40", "llama66b_a800",
            "llama8b_centauri_a40", "megatron_tp_substitute_a40")


def shipped_choice(program) -> Choice:
    """The Choice a checked program makes as written."""
    mesh, train = program.mesh, program.train
    return Choice(Layout(mesh.size("tp"), mesh.size("cp"), mesh.size("pp"), mesh.size("dp"), mesh.size("ep"),
                         train.micro_batch, train.microbatches, train.zero, train.shard or 0, train.recompute,
                         "written", train.param_gather),
                  program.fold.text, program.pipeline.name, program.train.si or "on")


def run_example(name: str, partitions: bool = False) -> None:
    """Tune the example ``name`` and print it beside the shipped one."""
    path = ROOT / "examples" / f"{name}.dhx"
    text = read_source(str(path))
    modules = load_modules(text, str(path))
    base = passes.rerun(check_program(modules), after="check")
    pricer = Pricer(modules, base, base.mesh.world)
    space = space_of(base, partitions=partitions)
    shipped = shipped_choice(base)
    assert shipped in set(space.choices()), f"{name}: the shipped choice is outside the space"
    as_shipped = pricer.price(shipped)
    start = time.process_time()
    outcome = search(pricer, space, top=1)
    seconds = time.process_time() - start
    print(f"{name}{' --partitions' if partitions else ''}: {base.mesh.world} GPUs, profile {base.profile.name}, "
          f"global batch {space.sequences} x "
          f"{base.model.get('seq')} ({seconds:.0f} s CPU to tune)")
    if isinstance(as_shipped, Priced):
        fits = "fits" if as_shipped.fits else "does NOT fit"
        print(f"  shipped  {shipped.describe()}: {as_shipped.seconds:.3f} s, peak "
              f"{as_shipped.sim.peak_rank.memory / 1e9:.2f} GB ({fits})")
    else:
        print(f"  shipped  {shipped.describe()}: refused ({as_shipped.why})")
    if outcome.top:
        best = outcome.top[0]
        ratio = f", shipped / tuned {as_shipped.seconds / best.seconds:.3f}x" if isinstance(as_shipped, Priced) else ""
        print(f"  tuned    {best.choice.describe()}: {best.seconds:.3f} s, peak "
              f"{best.sim.peak_rank.memory / 1e9:.2f} GB{ratio}")
        print(f"  differs: {differences(best.choice, shipped) if best.choice != shipped else 'nothing: the shipped choice is the best'}")
    _si_memory(text, str(path))


def _si_memory(text: str, path: str) -> None:
    """The peak rank's memory with SI, without, and as 1F1B without folding."""
    program, _ = priced_program(text, path)
    sims = compare(program)
    row = []
    for sim in sims:
        r = sim.peak_rank
        row.append(f"{sim.label}: {r.memory / 1e9:.2f} GB (states {r.states.total / 1e9:.2f} + activations "
                   f"{r.activations / 1e9:.2f}, rank {r.rank})")
    print("  memory  " + "; ".join(row))
    si = sims[0]
    flat = next(sim for sim in sims if sim.label == "1F1B, fold none")
    extra = si.peak_rank.memory - flat.peak_rank.memory
    acts = si.peak_rank.activations - flat.peak_rank.activations
    print(f"  SI + fold over 1F1B: {extra / 1e9:+.2f} GB ({extra / flat.peak_rank.memory:+.1%}), of which "
          f"activations {acts / 1e9:+.2f} GB ({acts / flat.peak_rank.memory:+.1%}) and model states "
          f"{(extra - acts) / 1e9:+.2f} GB (the fold puts both model ends on rank 0)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=EXAMPLES)
    parser.add_argument("--partitions", action="store_true", help="search Centauri's partition too (tune --partitions)")
    args = parser.parse_args()
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    for name in EXAMPLES:
        if args.only in (None, name):
            run_example(name, args.partitions)


if __name__ == "__main__":
    main()
