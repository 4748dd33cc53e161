"""Bubble of the W schedule with SI against SI off and 1F1B without folding, per example.

Prints, for every example with a profile, the simulator's bubble share (idle / (p x pipeline
make-span)) and the idle time per rank in seconds. SI shortens the busy time, so the same idle
time is a larger share; compare the idle seconds too. Predictions from the shipped profiles,
not measurements:

    .venv/bin/python benchmarks/bubble_share.py
"""

from __future__ import annotations

from pathlib import Path

from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.report import compare

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    # One line per column of `simulate --compare` (the program as written, then minus one
    # feature at a time: the columns differ per example, so each line names its own).
    print(f"{'example':28} {'column':30} {'bubble':>7} {'idle/rank':>13}")
    for path in sorted((ROOT / "examples").glob("*.dhx")):
        program = check_text(path.read_text(), str(path.relative_to(ROOT)))
        if program.profile is None or program.mesh.size("pp") == 1:
            continue  # no pipeline, no bubble
        for index, sim in enumerate(compare(program)):
            idle = sum(sim.pipeline_time - rank.busy for rank in sim.ranks) / len(sim.ranks)
            name = path.stem if index == 0 else ""
            print(f"{name:28} {sim.label:30} {sim.bubble_ratio * 100:6.1f}% {idle * 1e3:10.3f} ms")


if __name__ == "__main__":
    main()
