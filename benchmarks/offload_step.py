"""What optimizer offload (``train { offload = optimizer }``) does to a step, as the simulator
prices it: Llama-70B-shaped models on 64 H100s and 64 A40s (the benchmarks' files), ZeRO 0, 1
and 2, the optimizer's states on the device, in host memory, and half of them there
(``offload_percent = 50``).

Run from the repository root::

    .venv/bin/python benchmarks/offload_step.py

Printed per case: the step, the optimizer's part of it (on the device, or the gradients' copy
to the host, the host's AdamW and the weights' copy back), the busiest rank's device peak and
the host memory its optimizer keeps, each for the profile's ``host`` section (link and host
AdamW rate, which the shipped profiles state with their sources).
"""

from __future__ import annotations

import platform
import re
import sys
from pathlib import Path

from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.planner.costmodel import offload_time, optimizer_time
from dhelix.dsl.simulator.events import simulate
from dhelix.dsl.simulator.memory import GB

ROOT = Path(__file__).resolve().parent.parent
CASES = {"llama70b_64xh100": ROOT / "benchmarks" / "llama70b_h100_64.dhx",
         "llama70b_64xa40": ROOT / "benchmarks" / "llama70b_a40_64.dhx"}


#: What the train block writes for each row: the offload column's text.
OFFLOADS = {"none": "offload = none", "optimizer": "offload = optimizer",
            "50%": "offload = optimizer  offload_percent = 50"}


def variant(text: str, zero: int, offload: str) -> str:
    """``text`` with its train block's ZeRO stage and offload (:data:`OFFLOADS`) set."""
    return re.sub(r"train \{\n", f"train {{\n  zero = {zero}\n  {OFFLOADS[offload]}\n", text, count=1)


def main() -> None:
    print(f"machine: {platform.platform()}, Python {platform.python_version()}")
    for name, path in CASES.items():
        text = path.read_text()
        base = check_text(text, str(path))
        host = base.profile.host
        print(f"{name}: {path.relative_to(ROOT)}, profile {base.profile.name} (host link {host.link_gbps:g} GB/s, "
              f"host AdamW {host.optimizer_gbps:g} GB/s)")
        print(f"  {'zero':>4}  {'offload':>9}  {'step s':>9}  {'optimizer s':>11}  {'peak GB':>8}  {'host GB':>8}")
        for zero in (0, 1, 2):
            for offload in OFFLOADS:
                program = check_text(variant(text, zero, offload), str(path))
                sim = simulate(program)
                peak = max(sim.ranks, key=lambda r: r.memory)
                print(f"  {zero:>4}  {offload:>9}  {sim.step_time:9.3f}  {peak.optimizer:11.3f}  "
                      f"{peak.memory / GB:8.2f}  {peak.states.host / GB:8.2f}")
        params = 1e9
        split = offload_time(params, base.model.dtype, base.profile)
        print(f"  per 10^9 local parameters ({base.model.dtype}): device AdamW "
              f"{optimizer_time(params, base.model.dtype, base.profile):.3f} s; offloaded {split.seconds:.3f} s "
              f"(to host {split.to_host:.3f}, host AdamW {split.host:.3f}, to device {split.to_device:.3f})")


if __name__ == "__main__":
    sys.exit(main())
