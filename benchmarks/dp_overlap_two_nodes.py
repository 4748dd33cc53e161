"""Data-parallel gradient reduction under the backward, over an emulated two-node link.

Run as root (it creates network namespaces, as ``benchmarks/two_nodes.py`` does)::

    sudo .venv/bin/python benchmarks/dp_overlap_two_nodes.py --rounds 5 \\
        --output benchmarks/results/cpu_two_nodes_dp_overlap.txt

The program: a small Llama with ``mesh { dp = 2 }`` over ``cluster { nodes = 2
gpus_per_node = 1 }``, so the data-parallel gradient reduction crosses the rate-limited veth
(the cross lane) and nothing else does. It runs in two modes, alternated in every round (the
order rotating), one rank per namespace:

* ``grad_reduce = backward`` (dhelix's default): each layer's all-reduce (reduce-scatter under
  ``--zero1``) is issued as the step's last backward of that layer ends and flies beside the
  backward of the layers below it;
* ``grad_reduce = step``: every bucket is reduced after the step's last backward.

With ``--hsdp`` the program is hybrid sharding instead: ``dp = 4`` on two nodes of 2 ranks,
``zero = 3  shard = 2``, so each node's two ranks shard the layer weights (their gathers and
reduce-scatters inside the node) and the pieces' all-reduce across the two nodes is what
crosses the link: per layer under the backward (once the layer's last reduce-scatter has
landed) or after the step.

The link is profiled first with ``dhelix profile`` (its all_gather sweep over dp measures the
cross lane), so that each run's prediction (``dhelix run`` simulates the program with the
profile it runs on) is of this machine. It prints per mode the median over rounds of the step
time, of the time blocked on collectives (each run's figure: the median over its steps without
the first, of the slowest rank) and of the simulated step with sim ÷ run, and the ratio
backward ÷ step, measured and simulated. The reduction can hide at most behind the last
micro-batch's backward below each layer (what is left of the backward once a layer's last
gradient exists), so few micro-batches and several layers give it the most room.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Beside this file (the script's folder is the first on sys.path): the link and what the
# two-node benchmarks share.
from two_node_link import Shaping, TwoNodeLink
from two_node_runs import (run_main, BenchError, Report, World, add_link_arguments, command_line, machine, median, profile_link,
                           ratio_text, seconds_text)

from dhelix.dsl.passes.pipeline import check_text

MODES = ("backward", "step")


def per_node(args) -> int:
    """Ranks on each emulated node: 2 under ``--hsdp`` (a shard group per node), else 1."""
    return 2 if args.hsdp else 1


def program_text(args, grad_reduce: str) -> str:
    """The benchmark program with ``train { grad_reduce = … }``."""
    heads = args.hidden // 64
    zero = "  zero = 3  shard = 2" if args.hsdp else "  zero = 1" if args.zero1 else ""
    return f"""# Written by benchmarks/dp_overlap_two_nodes.py: dp = 2 across two emulated nodes.
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"

model dp_two_nodes {{
  layers = {args.layers}
  hidden = {args.hidden}
  ffn = {2 * args.hidden}
  heads = {heads}
  kv_heads = {max(1, heads // 2)}
  seq = {args.seq}
  vocab = 512
  dtype = fp32
  layer = llama
}}

cluster {{
  nodes = 2
  gpus_per_node = {per_node(args)}
  profile = "a40"
}}

mesh {{
  dp = {2 * per_node(args)}
}}

train {{
  micro_batch = 1
  microbatches = {args.microbatches}
  seed = 0{zero}
  grad_reduce = {grad_reduce}
}}

pipeline one_f_one_b
"""


def run_rounds(world: World, files: dict[str, Path], args, report: Report) -> dict[str, list[dict]]:
    """Both modes once per round, alternating which goes first; the metrics by mode."""
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        order = MODES if round_index % 2 == 0 else MODES[::-1]
        for mode in order:
            metrics = world.workdir / f"round{round_index + 1}-{mode}.json"
            command = ["-m", "dhelix", "run", str(files[mode]), "--steps", str(args.steps), "--metrics", str(metrics)]
            ok, where = world.run(command, mode)
            label = f"round {round_index + 1}/{args.rounds}  grad_reduce = {mode:<8}"
            if not ok:
                raise BenchError(f"{label} failed: {where}")
            data = json.loads(metrics.read_text())
            results[mode].append(data)
            report(f"{label}  step {data['step_s']:7.3f} s   blocked on collectives {data['exposed_comm_s']:7.3f} s"
                   f"   (load average {os.getloadavg()[0]:.1f})")
    return results


def summarise(results: dict[str, list[dict]], report: Report) -> None:
    """The medians, per-round ratios and their median."""
    report()
    report("medians over the rounds (a run's figure: the median over its steps without the first, "
           "of the slowest rank):")
    report(f"{'grad_reduce':<12} {'runs':>4} {'step time':>10} {'min':>8} {'max':>8} {'blocked on collectives':>23} "
           f"{'simulated':>10} {'sim ÷ run':>9}")
    step, simulated = {}, {}
    for mode, runs in results.items():
        steps = [d["step_s"] for d in runs]
        step[mode] = median(steps)
        simulated[mode] = median([d["predicted"]["step_s"] for d in runs
                                   if (d.get("predicted") or {}).get("step_s") is not None])
        ratio = None if simulated[mode] is None else simulated[mode] / step[mode]
        exposed = median([d['exposed_comm_s'] for d in runs])
        report(f"{mode:<12} {len(runs):>4} {seconds_text(step[mode]):>10} {seconds_text(min(steps)):>8} "
               f"{seconds_text(max(steps)):>8} {seconds_text(exposed):>23} {seconds_text(simulated[mode]):>10} "
               f"{ratio_text(ratio):>9}")
    notes = {d["predicted"].get("note") for runs in results.values() for d in runs if d.get("predicted")}
    for note in sorted(n for n in notes if n):
        report(f"simulated: {note}")
    pairs = [b["step_s"] / s["step_s"] for b, s in zip(results["backward"], results["step"], strict=True)]
    report()
    predicted = None if None in simulated.values() else simulated["backward"] / simulated["step"]
    report(f"backward ÷ step: medians {ratio_text(step['backward'] / step['step'])} (simulated {ratio_text(predicted)}); "
           f"per round {', '.join(f'{r:.3f}' for r in pairs)} (shorter in {sum(r < 1 for r in pairs)}/{len(pairs)})")


def bench(args, report: Report, workdir: Path) -> int:
    """Write the programs, make the link, run the rounds, summarise."""
    report(f"$ {command_line()}")
    report(f"machine: {machine()}")
    files = {}
    for mode in MODES:
        files[mode] = workdir / f"dp_{mode}.dhx"
        files[mode].write_text(program_text(args, mode))
        check_text(files[mode].read_text(), str(files[mode]))
    sharding = ", ZeRO-3 with shard = 2 (HSDP: the pieces' all-reduce crosses)" if args.hsdp else \
        ", ZeRO-1" if args.zero1 else ""
    report(f"config: llama layers × {args.layers}, hidden {args.hidden}, ffn {2 * args.hidden}, seq {args.seq}, "
           f"fp32; micro_batch 1, {args.microbatches} micro-batches, 1F1B; mesh dp {2 * per_node(args)} across 2 "
           f"nodes × {per_node(args)} (cross lane){sharding}; {args.steps} steps per run, {args.rounds} rounds")
    with TwoNodeLink(Shaping(rate=args.rate, burst=args.burst, latency=args.latency)) as link:
        report(f"link: {link.describe()}")
        world = World(link, 2 * per_node(args), per_node(args), workdir, args.run_timeout)
        if not args.no_profile and profile_link(world, files["backward"], args, report) is not None:
            for path in files.values():  # both modes run, and are predicted, on the link's profile
                path.write_text(path.read_text().replace('profile = "a40"', 'profile = "link.yaml"'))
        results = run_rounds(world, files, args, report)
    summarise(results, report)
    report(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def parse_args(argv=None):
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_link_arguments(parser, "400mbit")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size")
    parser.add_argument("--seq", type=int, default=512, help="sequence length")
    parser.add_argument("--layers", type=int, default=4, help="layers")
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--zero1", action="store_true", help="ZeRO-1: reduce-scatter instead of all-reduce")
    parser.add_argument("--hsdp", action="store_true",
                        help="hybrid sharding on 2 nodes of 2 ranks: the pieces' all-reduce crosses the link")
    parser.add_argument("--no-profile", action="store_true", help="run on the shipped a40 profile, not the link's")
    parser.add_argument("--profile-repeats", type=int, default=3, help="--repeats of `dhelix profile`")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--output", metavar="FILE", help="also write everything printed to FILE")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        parser.error("--rounds must be at least 1 and --steps at least 2 (the first step is left out)")
    return args


def main(argv=None) -> int:
    """Check that the link can be made, run the benchmark, always remove what it created."""
    return run_main("dp_overlap_two_nodes.py", parse_args(argv), bench, "dhxdp-")


if __name__ == "__main__":
    sys.exit(main())
