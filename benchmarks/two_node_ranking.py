"""Does the simulator order layouts and schedules as the emulated two-node link does?

Run as root (it creates network namespaces)::

    .venv/bin/python benchmarks/two_node_ranking.py --rounds 3 --output benchmarks/results/cpu_two_node_ranking.txt

What it does (issue 52, deliverable 4, the ranking part):

1. creates the two namespaces joined by the rate-limited veth of ``two_node_link.py`` (removed
   on exit, on failure and on Ctrl-C) and a world of 4 ranks, 2 per namespace
   (``two_node_runs.World``);
2. measures a profile of the base program (tp 2 × pp 2, ``fold u``, ``w_helix``) on that link
   once, ``dhelix profile`` run as the 4 ranks across the namespaces, and keeps its derived
   rates (peak, memory, the local and cross links, OEF, slowdown, launch gap) as
   ``link_rates.yaml``: its ``measured:`` op times belong to the base mesh only, so every
   variant is priced by the same derived rates, as ``dhelix tune`` prices its candidates;
3. writes one tiny Llama (sized so that a step takes 0.1-1 s on a 2-core machine) in
   :data:`VARIANTS`: meshes tp2 pp2 / pp2 dp2 / tp2 dp2 / dp4, ``fold u`` + ``w_helix``
   against ``fold none`` + ``one_f_one_b``, SI on and off, two micro-batch counts, one with a
   Centauri ``partition`` block; all at the same global batch;
4. predicts each with ``dhelix simulate FILE --profile link_rates.yaml --json``;
5. runs ``dhelix tune`` of the base program with the same profile, ``--keep`` holding what
   the variants do not vary (ZeRO, recomputation, sharding, the parameter gather); when its
   choice is not one of the variants it is measured beside them as one more;
6. runs every variant with ``dhelix run --steps N --metrics`` over the link, alternated in
   every round (the order rotating each round, so load drift hits every variant alike);
7. prints per variant the predicted step, the median measured step and its spread over the
   rounds, the median core wait (seconds a rank was runnable but waited for a CPU core), both
   ranks, Kendall's τ-b between the predicted and measured order, and where tune's choice
   lands in the measured order.

``--ranks 2`` runs one rank per namespace instead (:data:`VARIANTS_TWO`: tp 2, pp 2, dp 2 and
cp 2, every axis across the link; the pipelines of the library on pp 2, SI on and off, a
Centauri partition): each rank has a core of its own on a 2-core machine, so the measured order
is not the order in which 4 ranks happened to get 2 cores. ``--priority -N`` runs the ranks
under ``nice -n -N``, ``--priority rt`` under real-time scheduling (root; see
``two_node_runs.priority_prefix``), ahead of whatever else the machine runs.

The link's tbf burst is small (:data:`BURST`, ``--burst``): the link then charges its rate for
every message as a wire does, not only for those larger than what it lends after idling.

The goals of the issue (a benchmark, not a test: the machine and its load decide): τ ≥ 0.8
over at least 8 variants; tune's choice measured best or within 3 % of the best.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import attrs
import yaml

# Beside this file (the script's folder is the first on sys.path): the link and what the
# two-node benchmarks share.
from two_node_link import Shaping, TwoNodeLink
from two_node_runs import (run_main, BenchError, Report, World, add_link_arguments, command_line, machine, median,
                           priority_prefix, profile_link)

from dhelix.dsl.passes.pipeline import check_text

TAU_GOAL, TUNE_GOAL = 0.8, 0.03
#: tbf's burst here: three 1500-byte packets' worth. A token bucket lets a message of up to its
#: burst cross at the veth's own speed once the link has idled long enough to refill it, which
#: a wire does not: with 256 KB a pipeline's activations (32-128 KB, sent between computations)
#: crossed free while the profile's link sweep, back to back, paid the rate for every byte; at
#: 32 KB a micro-batch of 1 sequence still crossed free and one of 2 did not.
BURST = "4kb"
CENTAURI = ("chunk ag1 + qkv by 2", "chunk ag2 + fc1 + act + fc2 + rs2 by 2")
TUNE_KEEP = "zero,recompute,shard,param_gather"


@attrs.frozen
class Variant:
    """One layout and schedule of the model, at the global batch of the others."""

    name: str
    mesh: tuple[tuple[str, int], ...]  # written in this order: the innermost axis first (the local lane)
    micro_batch: int
    microbatches: int
    fold: str = "u"
    pipeline: str = "w_helix"
    si: bool = True
    partition: tuple[str, ...] = ()
    file: str | None = None  # a program written elsewhere (tune's choice), not from the template

    @property
    def filename(self) -> str:
        return self.file or f"{self.name}.dhx"


#: 16 sequences per step in every variant: micro_batch × microbatches × dp.
VARIANTS = (
    Variant("tp2pp2_u_whelix_m8", (("tp", 2), ("pp", 2)), 2, 8),
    Variant("tp2pp2_u_whelix_m8_si_off", (("tp", 2), ("pp", 2)), 2, 8, si=False),
    Variant("tp2pp2_none_1f1b_m8", (("tp", 2), ("pp", 2)), 2, 8, fold="none", pipeline="one_f_one_b"),
    Variant("tp2pp2_u_whelix_m4", (("tp", 2), ("pp", 2)), 4, 4),
    Variant("tp2pp2_u_whelix_m8_centauri", (("tp", 2), ("pp", 2)), 2, 8, partition=CENTAURI),
    Variant("pp2dp2_u_whelix_m4", (("pp", 2), ("dp", 2)), 2, 4),
    Variant("pp2dp2_none_1f1b_m4", (("pp", 2), ("dp", 2)), 2, 4, fold="none", pipeline="one_f_one_b"),
    Variant("tp2dp2_u_whelix_m4", (("tp", 2), ("dp", 2)), 2, 4),
    Variant("dp4_none_1f1b_m2", (("dp", 4),), 2, 2, fold="none", pipeline="one_f_one_b"),
)
#: One rank per node (``--ranks 2``): every axis crosses the link; 16 sequences per step too.
VARIANTS_TWO = (
    Variant("tp2_u_whelix_m8", (("tp", 2),), 2, 8),
    Variant("tp2_u_whelix_m8_si_off", (("tp", 2),), 2, 8, si=False),
    Variant("tp2_none_1f1b_m8", (("tp", 2),), 2, 8, fold="none", pipeline="one_f_one_b"),
    Variant("tp2_none_1f1b_m8_centauri", (("tp", 2),), 2, 8, fold="none", pipeline="one_f_one_b",
            partition=CENTAURI),
    Variant("pp2_u_whelix_m8", (("pp", 2),), 2, 8),
    Variant("pp2_u_whelix_m8_si_off", (("pp", 2),), 2, 8, si=False),
    Variant("pp2_u_whelix_m4", (("pp", 2),), 4, 4),
    Variant("pp2_none_1f1b_m8", (("pp", 2),), 2, 8, fold="none", pipeline="one_f_one_b"),
    Variant("pp2_none_gpipe_m8", (("pp", 2),), 2, 8, fold="none", pipeline="gpipe"),
    Variant("pp2_none_zbh1_m8", (("pp", 2),), 2, 8, fold="none", pipeline="zb_h1"),
    Variant("pp2_u_dualpipev_m8", (("pp", 2),), 2, 8, pipeline="dualpipe_v"),
    Variant("pp2_loop2_interleaved_m8", (("pp", 2),), 2, 8, fold="loop(2)", pipeline="interleaved_1f1b"),
    Variant("dp2_none_1f1b_m4", (("dp", 2),), 2, 4, fold="none", pipeline="one_f_one_b"),
    Variant("cp2_none_1f1b_m8", (("cp", 2),), 2, 8, fold="none", pipeline="one_f_one_b"),
)


def variant_set(ranks: int) -> tuple[Variant, ...]:
    """The variants of a world of ``ranks`` (2 or 4); the first is the base tune starts from."""
    return VARIANTS_TWO if ranks == 2 else VARIANTS


def program_text(variant: Variant, args, profile: str) -> str:
    """The variant's program: the tiny Llama on 2 nodes × ``args.ranks // 2`` ranks."""
    mesh = "\n".join(f"  {axis} = {size}" for axis, size in variant.mesh)
    partition = ""
    if variant.partition:
        partition = "\npartition {\n" + "".join(f"  {line}\n" for line in variant.partition) + "}\n"
    si = "" if variant.si else "  si = off\n"
    heads = max(2, args.hidden // 32)
    return f"""# Written by benchmarks/two_node_ranking.py: variant {variant.name}.
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"

model two_node_ranking {{
  layers = {args.layers}
  hidden = {args.hidden}
  ffn = {2 * args.hidden}
  heads = {heads}
  kv_heads = {max(1, heads // 2)}
  seq = {args.seq}
  vocab = 256
  dtype = fp32
  layer = llama
}}

cluster {{
  nodes = 2
  gpus_per_node = {args.ranks // 2}
  profile = "{profile}"
}}

mesh {{
{mesh}
}}

train {{
  micro_batch = {variant.micro_batch}
  microbatches = {variant.microbatches}
  seed = 1234
{si}}}

fold {variant.fold}
pipeline {variant.pipeline}

strands {{
  overlap tp
  comm_with_comm on
  movable wgrad
}}
{partition}"""


# -- the arithmetic (pure; tests/test_two_nodes_bench.py) ----------------------------------------

def kendall_tau(xs, ys) -> float | None:
    """Kendall's τ-b of two equally long sequences (ties in either counted as neither
    concordant nor discordant, and the denominator corrected for them); None when fewer than
    two pairs can be compared or one sequence is constant."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} values against {len(ys)}")
    concordant = discordant = only_x = only_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = _sign(xs[i] - xs[j]), _sign(ys[i] - ys[j])
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                only_x += 1
            elif dy == 0:
                only_y += 1
            elif dx == dy:
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + only_x) * (concordant + discordant + only_y))
    return None if denominator == 0 else (concordant - discordant) / denominator


def _sign(value) -> int:
    return (value > 0) - (value < 0)


def ranks(values) -> list[float]:
    """1 for the smallest value, ties sharing the mean of their places."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            result[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return result


# -- predicting, tuning, measuring --------------------------------------------------------------

def rates_only(measured: Path, out: Path) -> None:
    """Write the profile ``measured`` without its ``measured:`` section (the op times of the
    one program it was taken on): the derived rates every variant is priced by."""
    data = yaml.safe_load(measured.read_text())
    data.pop("measured", None)
    out.write_text("# benchmarks/two_node_ranking.py: " + measured.name + " without its measured: op times\n"
                   + yaml.safe_dump(data, sort_keys=False))


def dhelix(args: list[str], workdir: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -m dhelix ARGS`` in ``workdir`` (outside the namespaces: no ranks)."""
    return subprocess.run([sys.executable, "-m", "dhelix", *args], capture_output=True, text=True,
                          cwd=workdir, timeout=timeout)


def simulate(path: Path, profile: str, workdir: Path) -> dict:
    """``dhelix simulate FILE --profile PROFILE --json``'s figures."""
    result = dhelix(["simulate", path.name, "--profile", profile, "--json"], workdir, 600)
    if result.returncode != 0:
        raise BenchError(f"dhelix simulate {path.name} failed:\n{result.stderr[-3000:]}")
    data = json.loads(result.stdout)
    return data[0] if isinstance(data, list) else data


def key_of(mesh: dict, micro_batch: int, microbatches: int, sim: dict, partition: bool) -> tuple:
    """What tells two programs' choices apart: mesh sizes, the micro-batches, the schedule as the
    simulator ran it (SI only where its schedule has SI blocks), a partition block or none."""
    sizes = tuple(sorted((axis, size) for axis, size in mesh.items() if size > 1))
    return (sizes, micro_batch, microbatches, sim["fold"], sim["pipeline"], bool(sim["si"]), partition)


def variant_key(variant: Variant, sim: dict) -> tuple:
    return key_of(dict(variant.mesh), variant.micro_batch, variant.microbatches, sim, bool(variant.partition))


def tune(workdir: Path, base: Variant, profile: str, report: Report) -> tuple[dict, dict]:
    """``dhelix tune`` of the base program with ``profile``: (its chosen JSON entry, its
    choice's settings); writes ``tuned.dhx``."""
    command = ["tune", base.filename, "--profile", profile, "--keep", TUNE_KEEP, "--top", "5", "-j", "1",
               "--json", "-o", "tuned.dhx"]
    result = dhelix(command, workdir, 1800)
    if result.returncode != 0:
        raise BenchError(f"dhelix tune failed:\n{result.stderr[-3000:]}")
    data = json.loads(result.stdout)
    best = data["top"][0]
    searched = data["searched"]
    report(f"tune: `dhelix {' '.join(command[:-3])}` searched {searched['choices']:,} choices "
           f"({searched['layouts']} layouts), {searched['simulated']} simulated; its top 5:")
    for index, entry in enumerate(data["top"], 1):
        report(f"  {index}  {entry['label']:<58} {1e3 * entry['step_s']:8.1f} ms")
    return best, best["choice"]


def tuned_variant(choice: dict, sim: dict, variants: list[Variant], sims: dict) -> tuple[Variant, bool]:
    """The variant tune's choice is (and False), or a new one for tuned.dhx (and True)."""
    mesh = {axis: choice[axis] for axis in ("tp", "cp", "pp", "dp", "ep")}
    wanted = key_of(mesh, choice["micro_batch"], choice["microbatches"], sim, choice["partition"] != "written"
                    and choice["partition"] != "none")
    for variant in variants:
        if variant_key(variant, sims[variant.name]) == wanted and not variant.partition:
            return variant, False
    sizes = tuple((axis, size) for axis, size in mesh.items() if size > 1)
    return Variant("tune_choice", sizes, choice["micro_batch"], choice["microbatches"], choice["fold"],
                   choice["pipeline"], bool(sim["si"]), file="tuned.dhx"), True


def run_rounds(world: World, variants: list[Variant], args, report: Report) -> dict[str, list[dict]]:
    """Every variant once per round, the order rotating by one each round; the metrics of each
    variant's runs (the link's counters added)."""
    results: dict[str, list[dict]] = {v.name: [] for v in variants}
    for round_index in range(args.rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            metrics = world.workdir / f"round{round_index + 1}-{variant.name}.json"
            command = ["-m", "dhelix", "run", variant.filename, "--steps", str(args.steps), "--metrics", str(metrics)]
            before = world.link.counters()
            ok, where = world.run(command, variant.name)
            after = world.link.counters()
            label = f"round {round_index + 1}/{args.rounds}  {variant.name:<28}"
            if not ok:
                report(f"{label} FAILED: {where}")
                if not args.keep_going:
                    raise BenchError(f"{variant.name} failed (--keep-going goes on after a failed run)")
                continue
            data = json.loads(metrics.read_text())
            data["link"] = {key: after[key] - before[key] for key in after}
            data["core_wait"] = core_wait(data)
            results[variant.name].append(data)
            wait = "—" if data["core_wait"] is None else f"{1e3 * data['core_wait']:6.1f} ms"
            report(f"{label} step {1e3 * data['step_s']:7.1f} ms   core wait {wait}   "
                   f"link {data['link']['bytes'] / 2**20:6.1f} MiB, {data['link']['dropped']} drops   "
                   f"(load average {os.getloadavg()[0]:.1f})")
    return results


def core_wait(metrics: dict) -> float | None:
    """The largest of the ranks' median per-step core waits (without the first step)."""
    waits = [median(rank.get("core_wait_s", [])[1:]) for rank in metrics.get("ranks", [])]
    waits = [w for w in waits if w is not None]
    return max(waits) if waits else None


def summarise(variants: list[Variant], predicted: dict[str, float], results: dict[str, list[dict]],
              tuned: Variant, report: Report, world: int = 4) -> None:
    """The table, τ and where tune's choice lands."""
    measured = {v.name: median([d["step_s"] for d in results[v.name]]) for v in variants}
    done = [v for v in variants if measured[v.name] is not None]
    pred_rank = dict(zip([v.name for v in done], ranks([predicted[v.name] for v in done]), strict=True))
    meas_rank = dict(zip([v.name for v in done], ranks([measured[v.name] for v in done]), strict=True))
    report()
    report("per variant: predicted (dhelix simulate --profile link_rates.yaml), measured (the median over the rounds "
           "of each run's step: the median over its steps without the first, of the slowest rank), the spread "
           "(min-max over the rounds), the median core wait, and the ranks (1 = fastest):")
    report(f"{'variant':<28} {'predicted':>10} {'measured':>10} {'spread':>17} {'core wait':>10} "
           f"{'pred ÷ meas':>11} {'rank pred':>9} {'rank meas':>9}")
    for v in sorted(done, key=lambda v: measured[v.name]):
        steps = [d["step_s"] for d in results[v.name]]
        wait = median([d["core_wait"] for d in results[v.name] if d["core_wait"] is not None])
        report(f"{v.name:<28} {1e3 * predicted[v.name]:8.1f}ms {1e3 * measured[v.name]:8.1f}ms "
               f"{1e3 * min(steps):7.1f}-{1e3 * max(steps):6.1f}ms "
               f"{'—' if wait is None else f'{1e3 * wait:8.1f}ms':>10} "
               f"{predicted[v.name] / measured[v.name]:>11.3f} {pred_rank[v.name]:>9g} {meas_rank[v.name]:>9g}")
    tau = kendall_tau([predicted[v.name] for v in done], [measured[v.name] for v in done])
    report()
    tau_text = "—" if tau is None else f"{tau:.3f}"
    verdict = "—" if tau is None else ("met" if tau >= TAU_GOAL and len(done) >= 8 else "not met")
    report(f"Kendall τ-b (predicted against measured order) over {len(done)} variants: {tau_text} "
           f"(goal ≥ {TAU_GOAL} over ≥ 8: {verdict})")
    waits = {v.name: median([d["core_wait"] for d in results[v.name] if d["core_wait"] is not None]) for v in done}
    if all(w is not None for w in waits.values()):
        less_wait = kendall_tau([predicted[v.name] for v in done], [measured[v.name] - waits[v.name] for v in done])
        report(f"  against measured less the median core wait (what the simulator does not model: {world} ranks on "
               f"{os.cpu_count()} cores): {'—' if less_wait is None else f'{less_wait:.3f}'}")
    within = [v for v in done if v.name != tuned.name]
    tau_without = kendall_tau([predicted[v.name] for v in within], [measured[v.name] for v in within])
    if tuned.name == "tune_choice" and tau_without is not None:
        report(f"  without tune's choice (the {len(within)} written variants): {tau_without:.3f}")
    if measured.get(tuned.name) is not None:
        best = min(measured[v.name] for v in done)
        behind = measured[tuned.name] / best - 1
        place = sorted(measured[v.name] for v in done).index(measured[tuned.name]) + 1
        report(f"tune's choice ({tuned.name}) lands {place} of {len(done)} in the measured order, "
               f"{100 * behind:.1f} % behind the measured best (goal: best or within {100 * TUNE_GOAL:.0f} %: "
               f"{'met' if behind <= TUNE_GOAL else 'not met'})")


# -- the benchmark -----------------------------------------------------------------------------

def uptime() -> str:
    result = subprocess.run(["uptime"], capture_output=True, text=True)
    return result.stdout.strip() or f"load average {os.getloadavg()}"


def bench(args, report: Report, workdir: Path) -> int:
    """Everything between the checks and the clean-up; returns the exit code."""
    report(f"$ {command_line()}")
    report(f"machine: {machine()}")
    report(f"uptime before: {uptime()}")
    variants = list(variant_set(args.ranks))
    base = variants[0]
    for variant in variants:  # checked now, not minutes in
        text = program_text(variant, args, "a40")
        check_text(text, str(workdir / variant.filename))
        (workdir / variant.filename).write_text(text)
    report(f"model: llama × {args.layers} layers, hidden {args.hidden}, ffn {2 * args.hidden}, seq {args.seq}, fp32, "
           f"16 sequences per step; cluster 2 nodes × {args.ranks // 2} ranks "
           + ("(the mesh's first axis on the local lane, the next on the cross lane)" if args.ranks == 4
              else "(every axis on the cross lane)")
           + f"; {args.steps} steps per run, {args.rounds} rounds"
           + (f"; ranks under {' '.join(priority_prefix(args.priority))}" if args.priority else ""))
    with TwoNodeLink(Shaping(rate=args.rate, burst=args.burst, latency=args.latency)) as link:
        report(f"link: {link.describe()}")
        world = World(link, args.ranks, args.ranks // 2, workdir, args.run_timeout, priority_prefix(args.priority))
        measured = profile_link(world, workdir / base.filename, args, report)
        rates_only(workdir / measured, workdir / "link_rates.yaml")
        report(f"priced with link_rates.yaml: {measured} without its measured op times (they belong to "
               f"{base.name}'s mesh and shapes), as `dhelix tune` prices every candidate")
        for variant in variants:
            (workdir / variant.filename).write_text(program_text(variant, args, "link_rates.yaml"))
        sims = {v.name: simulate(workdir / v.filename, "link_rates.yaml", workdir) for v in variants}
        best, choice = tune(workdir, base, "link_rates.yaml", report)
        tuned, added = tuned_variant(choice, best, variants, sims)
        if added:
            report(f"tune's choice is none of the variants: measured as tune_choice (tuned.dhx: {best['label']})")
            variants.append(tuned)
            sims[tuned.name] = simulate(workdir / tuned.filename, "link_rates.yaml", workdir)
        else:
            report(f"tune's choice is {tuned.name} ({best['label']})")
        predicted = {name: sim["step_s"] for name, sim in sims.items()}
        report(f"uptime before the rounds: {uptime()}")
        results = run_rounds(world, variants, args, report)
    summarise(variants, predicted, results, tuned, report, args.ranks)
    report(f"uptime after: {uptime()}")
    return 0


def parse_args(argv=None):
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_link_arguments(parser, "200mbit", BURST)
    parser.set_defaults(rounds=3, steps=5)
    parser.add_argument("--hidden", type=int, default=128, help="the model's hidden size")
    parser.add_argument("--seq", type=int, default=64, help="sequence length")
    parser.add_argument("--layers", type=int, default=4, help="layers (a multiple of 4: pp 2 on fold u)")
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=4,
                        help="ranks: 2 per namespace (4) or 1 (2, a core each on a 2-core machine)")
    parser.add_argument("--priority", metavar="N|rt",
                        help="run the ranks under `nice -n N` or, with rt, real-time (chrt -f; root)")
    parser.add_argument("--profile-repeats", type=int, default=3, help="--repeats of `dhelix profile`")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--keep-going", action="store_true", help="go on after a failed run")
    parser.add_argument("--keep-files", action="store_true", help="keep the programs, profiles, logs and metrics")
    parser.add_argument("--output", metavar="FILE", help="also write everything printed to FILE")
    parser.add_argument("--cleanup", action="store_true",
                        help="delete the namespaces a killed run left behind, then exit")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        parser.error("--rounds must be at least 1 and --steps at least 2 (the first step is left out)")
    return args


def main(argv=None) -> int:
    """Check that the link can be made, run the benchmark, always remove what it created."""
    return run_main("two_node_ranking.py", parse_args(argv), bench, "dhx2n-rank-", (subprocess.TimeoutExpired,))


if __name__ == "__main__":
    sys.exit(main())
