"""How long the step simulator takes on Llama-3.1-405B at DP64 TP8 PP16 (8192 H100s, Table 1 row 1).

Run from the repository root::

    .venv/bin/python benchmarks/simulator_speed.py [--microbatches M] [--repeat R]

Llama-3.1-405B has 126 layers, which divide neither into 16 stages (fold none) nor into 32
(fold u), so the program here has **128 layers** and runs DHelix's own schedule, ``w_helix``
on ``fold u`` (4 layers per stage, 32 stages on 16 pipeline ranks); seq 8192, micro-batch 1,
M micro-batches (default 64), the shipped ``h100`` profile. The SI plan is made once, outside
the timing (that is the planner's cost, see benchmarks/planner_speed.py); the timings are of
:func:`dsl.simulator.events.simulate` alone, for M and for 2·M micro-batches, with their ratio (the
simulator is linear in the number of actions, so about 2 is expected).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.events import schedule_plan, simulate

PROGRAM = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model llama405b {{
  layers = 128  hidden = 16384  ffn = 53248  heads = 128  kv_heads = 8
  seq = 8192  vocab = 128256  dtype = bf16  layer = llama
}}
cluster {{ nodes = 1024  gpus_per_node = 8  profile = "h100" }}
mesh {{ tp = 8  dp = 64  pp = 16 }}
train {{ micro_batch = 1  microbatches = {microbatches} }}
fold u
pipeline w_helix
strands {{
  overlap tp
  comm_with_comm on
  movable wgrad
}}
"""


def timed(microbatches: int, plan, repeat: int):
    """(best seconds to simulate, the simulation, number of actions) for ``microbatches``."""
    program = check_text(PROGRAM.format(microbatches=microbatches), "llama405b_dp64_tp8_pp16.dhx")
    best, sim = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        sim = simulate(program, plan, zero1=True)
        best = min(best, time.perf_counter() - start)
    actions = sum(len(row) for row in program.lowered.actions)
    return best, sim, actions, program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    print("config: Llama-3.1-405B shape with 128 layers (126 do not fold), DP64 TP8 PP16 on 8192 H100 "
          "(profile h100), seq 8192, w_helix on fold u, ZeRO-1")
    program = check_text(PROGRAM.format(microbatches=args.microbatches), "llama405b_dp64_tp8_pp16.dhx")
    start = time.perf_counter()
    plan = schedule_plan(program)
    print(f"plan (once, not timed below): {time.perf_counter() - start:.2f} s, speedup {plan.speedup:.3f}x")
    results = []
    for m in (args.microbatches, 2 * args.microbatches):
        seconds, sim, actions, _ = timed(m, plan, args.repeat)
        results.append(seconds)
        print(f"m = {m:4d}: {actions:6d} actions on 16 ranks, simulated in {seconds:.3f} s "
              f"(best of {args.repeat}); step {sim.step_time:.2f} s, {sim.tflops_per_gpu:.0f} TFLOPS/GPU, "
              f"MFU {100 * sim.mfu:.1f}%, bubble {100 * sim.bubble_ratio:.1f}%, peak memory "
              f"{sim.peak_rank.memory / 1e9:.1f} GB (r{sim.peak_rank.rank})")
    print(f"time ratio for twice the micro-batches: {results[1] / results[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
