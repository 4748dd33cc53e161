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
    print(f"{'example':18} | {'as written (SI on)':>26} | {'SI off':>26} | {'1F1B, fold none':>26}")
    print(f"{'':18} | {'bubble   idle/rank':>26} | {'bubble   idle/rank':>26} | {'bubble   idle/rank':>26}")
    for path in sorted((ROOT / "examples").glob("*.dhx")):
        program = check_text(path.read_text(), str(path.relative_to(ROOT)))
        if program.profile is None or program.mesh.size("pp") == 1:
            continue  # no pipeline, no bubble
        cells = []
        for sim in compare(program):
            idle = sum(sim.pipeline_time - rank.busy for rank in sim.ranks) / len(sim.ranks)
            cells.append(f"{sim.bubble_ratio * 100:6.1f}%  {idle * 1e3:9.3f} ms")
        print(f"{path.stem:18} | " + " | ".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    main()
