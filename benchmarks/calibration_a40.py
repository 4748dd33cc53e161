"""Calibrate the a40 profile against Megatron-LM's published time breakdown, then validate it.

Run from the repository root::

    .venv/bin/python benchmarks/calibration_a40.py [--fit]

The DHelix paper's Fig. 3 splits Megatron-LM's training time on its 64-A40 cluster into TP,
CP and EP communication, computation and "others", per model. Its numbers, the configurations
they belong to (Fig. 12's CP = 2 runs and Phi-31B's Table 6 run) and what the paper measured on
them are in ``benchmarks/a40_published.yaml`` with their sources. For each model this script
builds the program (the layer DAGs of ``stdlib/layers.dhx``, the paper's shapes and meshes,
micro-batch 1 and the 8M-token / 1600-sequence global batch) and simulates

* **Megatron-LM**: 1F1B without folding, no SI (:func:`dsl.simulator.report.unfolded_1f1b`);
  its single-strand layers already overlap a strand's own independent comm and compute, as
  Megatron does (ring P2P under attention, a dgrad reduce-scatter under the wgrad GEMM);
* **DHelix**: ``w_helix`` on ``fold u`` with SI, overlapping the model's communication axes,
  comm-with-comm on, wgrad movable.

**The breakdown** of a simulated Megatron-LM step, as a profiler's timeline shows it: per
pipeline rank, *comp* is the time the compute lane is busy (slowed by concurrent comm as the
profile says); *TP / CP / EP* is the time the compute lane idles while communication of that
axis runs (split evenly when two axes run at once); *others* is the rest of the step (pipeline
bubble, pipeline transfers, gradient sync, optimizer). Shares are means over the ranks.

**The calibration.** Shares are ratios: they fix communication time relative to compute time,
not either one alone. The compute fractions (``achieved.gemm``, ``achieved.attention``) stay as
the anchor, and the fit moves four bandwidth efficiencies, each a fraction of a link's
published peak (PCIe 4.0 32 GB/s, 100 Gb/s InfiniBand per node of 8 GPUs): ring collectives
inside a node, P2P inside a node, all-to-all inside a node, and every collective across nodes
(:data:`KNOBS`). ``--fit`` runs the search (golden section on one efficiency at a time, all
rows at once, RMS of the share residuals) from the uncalibrated values (all 1.0, what
``stdlib_schedules/a40.yaml`` shipped before); without it the script reports the shipped
profile. No per-model factor exists anywhere.

**The validation** is what the calibration did not see: Megatron-LM's TFLOPS/GPU (tokens/s for
Phi) and DHelix's speedup over it, on the breakdown's runs and on Fig. 11's (seq 8192, no CP),
for the uncalibrated and the shipped profile.

**What it does not fit** (see benchmarks/results/cpu_calibration_a40.txt): *others* comes out
low on most runs (the paper does not say what it holds); with one ring efficiency for every
node-local group, the tp 4 runs' TP share is high by up to 9 points while the tp 8 runs' is low
by up to 3 (a tp 4 ring may stay on one side of the node's PCIe tree, a tp 8 ring cannot; the
profile has no such topology); Phi-31B's Megatron-LM throughput is 1.5x the paper's, which no
bandwidth explains (the MoE layer's compute cost is the suspect).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from pathlib import Path

import attrs
import yaml

from dhelix.dsl.core.mesh import MESH_AXES
from dhelix.dsl.frontend.profiles import COLLECTIVES, Profile, load_profile
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.costs import cost_of, step_costs
from dhelix.dsl.simulator.events import simulate
from dhelix.dsl.simulator.report import unfolded_1f1b

PUBLISHED = Path(__file__).resolve().parent / "a40_published.yaml"
SHARES = ("tp", "cp", "ep", "comp", "others")
AXES = ("tp", "cp", "ep")


@attrs.frozen
class Knob:
    """One fitted number: the bandwidth efficiency of ``collectives`` on ``lane``."""

    name: str
    collectives: tuple[str, ...]
    lane: str
    what: str


KNOBS = (
    Knob("ring.local", ("all_gather", "reduce_scatter", "all_reduce"), "local", "ring collectives in a node (TP)"),
    Knob("p2p.local", ("p2p",), "local", "send/recv in a node (CP ring at tp 4)"),
    Knob("all_to_all.local", ("all_to_all",), "local", "all-to-all in a node (EP)"),
    Knob("cross", COLLECTIVES, "cross", "every collective across nodes (CP ring at tp 8, DP, PP)"),
)
#: The efficiencies stdlib_schedules/a40.yaml had before this calibration: the link peak.
UNCALIBRATED = {knob.name: 1.0 for knob in KNOBS}


def knob_values(profile: Profile) -> dict[str, float]:
    """The current value of every knob in ``profile`` (read from its first collective)."""
    return {k.name: profile.collectives[k.collectives[0]].efficiency_on(k.lane) for k in KNOBS}


def with_knobs(profile: Profile, values: dict[str, float]) -> Profile:
    """``profile`` with the knobs set to ``values`` (knob name -> efficiency)."""
    collectives = dict(profile.collectives)
    for knob in KNOBS:
        if knob.name not in values:
            continue
        for name in knob.collectives:
            old = collectives[name]
            lanes = {lane: old.efficiency_on(lane) for lane in ("local", "cross")}
            lanes[knob.lane] = values[knob.name]
            collectives[name] = attrs.evolve(old, lanes=lanes)
    return attrs.evolve(profile, collectives=collectives)


# ---------------------------------------------------------------- the programs

@attrs.frozen
class Run:
    """One published configuration: its name, program text and published figures."""

    name: str
    text: str
    published: dict  # shares, tflops or tokens_per_second, speedup


def program_text(model_name: str, model: dict, run: dict, kv_heads: int | None = None) -> str:
    """The DHelix program of one published run (module docstring); the Megatron-LM baseline
    is derived from it by :func:`unfolded_1f1b`. Llama gets ``kv_heads``, by default as many
    as its heads ([mha] in a40_published.yaml)."""
    settings = dict(model)
    layer = settings.pop("layer")
    if layer == "llama":
        settings["kv_heads"] = kv_heads or settings["heads"]
    mesh = run["mesh"]
    axes = [a for a in ("tp", "cp", "dp", "pp") if mesh.get(a, 1) > 1]  # Megatron's order, innermost first
    mesh_text = "  ".join(f"{a} = {mesh[a]}" for a in axes) + (f"  ep = {mesh['ep']}" if "ep" in mesh else "")
    overlap = ", ".join(a for a in AXES if mesh.get(a, 1) > 1)
    model_text = "  ".join(f"{k} = {v}" for k, v in settings.items())
    return f"""import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model {model_name.lower().replace("-", "_").replace(".", "_")} {{
  {model_text}
  seq = {run["seq"]}  dtype = bf16  layer = {layer}
}}
cluster {{ nodes = 8  gpus_per_node = 8  profile = "a40" }}
mesh {{ {mesh_text} }}
train {{ micro_batch = 1  microbatches = {run["sequences"] // mesh["dp"]} }}
fold u
pipeline w_helix
strands {{
  overlap {overlap}
  comm_with_comm on
  movable wgrad
}}
"""


def published_runs(section: str, kv_heads: int | None = None) -> list[Run]:
    """The runs of ``section`` (``breakdown`` or ``throughput``) of a40_published.yaml."""
    data = yaml.safe_load(PUBLISHED.read_text())
    runs = []
    for run in data[section]:
        name = run["model"]
        text = program_text(name, data["models"][name], run, kv_heads)
        figures = {k: v for k, v in run.items() if k in ("shares", "tflops", "tokens_per_second", "speedup")}
        runs.append(Run(name, text, figures))
    return runs


# ---------------------------------------------------------------- the breakdown

def layer_split(cost, ops) -> dict[str, float]:
    """Seconds of one layer pass run alone, split as a profiler's timeline shows it: ``comp``
    the compute lane's busy time, and per communication axis the time the compute lane idles
    while that axis communicates (shared evenly by axes running together)."""
    _, slots = cost.schedule(tuple(ops))
    axis = {op.name: op.axis for op in ops}
    compute = [(s.start, s.end) for s in slots if s.lane == "compute"]
    comm = [(s.start, s.end, axis[s.op]) for s in slots if s.lane != "compute"]
    edges = sorted({t for s in slots for t in (s.start, s.end)})
    out = dict.fromkeys(("comp",) + AXES, 0.0)
    for begin, end in zip(edges, edges[1:]):
        middle = (begin + end) / 2
        if any(a <= middle < b for a, b in compute):
            out["comp"] += end - begin
            continue
        running = [ax for a, b, ax in comm if a <= middle < b]
        for ax in running:
            out[ax] += (end - begin) / len(running)
    return out


@attrs.frozen
class Step:
    """A simulated step: the breakdown shares, step time and throughput."""

    shares: dict
    step_time: float
    tflops: float
    tokens_per_second: float


def megatron_step(program) -> Step:
    """Simulate ``program``'s Megatron-LM baseline and break its step down (module docstring).

    Raises RuntimeError if the pieces do not add up to the simulator's busy time per rank
    (the breakdown would then no longer describe the simulated step).
    """
    baseline = unfolded_1f1b(program)
    cost = cost_of(baseline)
    costs = step_costs(baseline, None, cost)
    sim = simulate(baseline, cost=cost, costs=costs)
    layer = [layer_split(cost, dag.ops) for dag in (baseline.forward, baseline.backward)]
    stages, m = baseline.placement.stages, baseline.train.microbatches
    heads = costs.heads
    totals = dict.fromkeys(("comp",) + AXES, 0.0)
    for rank, stats in enumerate(sim.ranks):
        busy = 0.0
        for key in totals:
            part = m * len(stages[rank].layers) * (layer[0][key] + layer[1][key])
            totals[key] += part
            busy += part
        extras = (heads.embed_forward, heads.embed_backward) if rank == 0 else ()
        if rank == len(stages) - 1:
            extras += (heads.head_forward, heads.head_backward, heads.head_weight)
        for work in extras:  # embedding and LM head: their collectives run over tp
            totals["tp"] += m * work.exposed
            totals["comp"] += m * (work.seconds - work.exposed)
            busy += m * work.seconds
        if not math.isclose(busy, stats.busy, rel_tol=1e-6):
            raise RuntimeError(f"breakdown of rank {rank} adds up to {busy} s, the simulator says {stats.busy} s")
    whole = len(sim.ranks) * sim.step_time
    shares = {key: totals[key] / whole for key in ("comp",) + AXES}
    shares["others"] = 1.0 - sum(shares.values())
    return Step(shares, sim.step_time, sim.tflops_per_gpu, sim.tokens_per_second)


def dhelix_speedup(program, baseline: Step) -> float:
    """Megatron-LM's step time over DHelix's (the program as written, SI planned)."""
    return baseline.step_time / simulate(program).step_time


def residual(step: Step, published: dict) -> float:
    """RMS over the five shares of simulated minus published."""
    return math.sqrt(sum((step.shares[k] - published[k]) ** 2 for k in SHARES) / len(SHARES))


# ---------------------------------------------------------------- the fit

class Calibration:
    """The breakdown runs checked once, simulated under any profile."""

    def __init__(self, runs: list[Run]):
        self.runs = runs
        self.programs = [check_text(run.text, f"{run.name}.dhx") for run in runs]

    def steps(self, profile: Profile) -> list[Step]:
        """The Megatron-LM breakdown of every run under ``profile``."""
        return [megatron_step(attrs.evolve(p, profile=profile)) for p in self.programs]

    def rms(self, profile: Profile) -> float:
        """RMS share residual over all runs and shares."""
        steps = self.steps(profile)
        return math.sqrt(sum(residual(s, r.published["shares"]) ** 2
                             for s, r in zip(steps, self.runs, strict=True)) / len(steps))

    def fit(self, profile: Profile, start: dict[str, float], sweeps: int = 3) -> dict[str, float]:
        """Coordinate search from ``start``: each knob in turn by golden section over
        [0.05, 1.0], ``sweeps`` times; prints the RMS after each knob. Returns the values."""
        values = dict(start)
        for sweep in range(sweeps):
            for knob in KNOBS:
                def objective(x: float, name=knob.name) -> float:
                    return self.rms(with_knobs(profile, {**values, name: x}))
                values[knob.name] = golden_section(objective, 0.05, 1.0)
                print(f"  sweep {sweep + 1}: {knob.name:17} {values[knob.name]:.3f}  "
                      f"RMS {self.rms(with_knobs(profile, values)):.4f}", flush=True)
        return values


def golden_section(f, low: float, high: float, steps: int = 16) -> float:
    """The minimiser of a unimodal ``f`` on [low, high], to about (high - low) / 2000."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


# ---------------------------------------------------------------- the report

def print_breakdown(runs: list[Run], before: list[Step], after: list[Step]) -> None:
    """Per model and share: uncalibrated, calibrated and published; RMS residual per model."""
    print(f"{'model':10} {'share':7} {'uncal.':>7} {'calib.':>7} {'paper':>7}   "
          f"{'RMS uncal.':>10} {'RMS calib.':>10}")
    for run, old, new in zip(runs, before, after, strict=True):
        shares = run.published["shares"]
        for i, key in enumerate(SHARES):
            tail = f"   {residual(old, shares):10.3f} {residual(new, shares):10.3f}" if i == 0 else ""
            print(f"{run.name if i == 0 else '':10} {key:7} {old.shares[key]:7.1%} {new.shares[key]:7.1%} "
                  f"{shares[key]:7.1%}{tail}")
    for label, steps in (("uncalibrated", before), ("calibrated", after)):
        total = math.sqrt(sum(residual(s, r.published["shares"]) ** 2
                              for s, r in zip(steps, runs, strict=True)) / len(runs))
        print(f"RMS share residual over all models, {label}: {total:.4f}")


def throughput(step: Step, published: dict) -> tuple[float, float, str]:
    """(predicted, published, unit): TFLOPS/GPU, or tokens/s where the paper gives that."""
    if "tflops" in published:
        return step.tflops, published["tflops"], "TFLOPS"
    return step.tokens_per_second, published["tokens_per_second"], "tok/s"


def validate(title: str, runs: list[Run], profiles: tuple[Profile, Profile]) -> None:
    """Megatron-LM throughput and DHelix speedup, uncalibrated and calibrated, beside the paper,
    with each prediction's ratio to the paper; then the range of the ratios per profile."""
    print(f"\n{title}")
    print(f"{'model':10} {'mesh':34} | {'Megatron-LM TFLOPS/GPU or tokens/s':>36} | {'DHelix speedup':>30} | "
          f"{'calibrated / paper':>18}")
    print(f"{'':10} {'':34} | {'uncal.':>9} {'calib.':>9} {'paper':>9} {'unit':>6} | "
          f"{'uncal.':>9} {'calib.':>9} {'paper':>10} | {'throughput':>10} {'speedup':>7}")
    ratios = {label: ([], []) for label in ("uncalibrated", "calibrated")}
    for run in runs:
        program = check_text(run.text, f"{run.name}.dhx")
        predicted, speedups = [], []
        for profile, label in zip(profiles, ratios, strict=True):
            variant = attrs.evolve(program, profile=profile)
            step = megatron_step(variant)
            value, paper, unit = throughput(step, run.published)
            predicted.append(value)
            speedups.append(dhelix_speedup(variant, step))
            ratios[label][0].append(value / paper)
            ratios[label][1].append(speedups[-1] / run.published["speedup"])
        digits = 1 if unit == "TFLOPS" else 0
        cells = " ".join(f"{v:9,.{digits}f}" for v in (*predicted, paper))
        print(f"{run.name:10} {describe_mesh(program):34} | {cells} {unit:>6} | "
              f"{speedups[0]:8.3f}x {speedups[1]:8.3f}x {run.published['speedup']:9.3f}x | "
              f"{ratios['calibrated'][0][-1]:10.3f} {ratios['calibrated'][1][-1]:7.3f}")
    for label, (throughputs, speeds) in ratios.items():
        print(f"  {label:12} / paper: throughput {min(throughputs):.3f}-{max(throughputs):.3f}, "
              f"speedup {min(speeds):.3f}-{max(speeds):.3f}")


def describe_mesh(program) -> str:
    """The run's mesh and micro-batches, e.g. ``tp8 cp2 dp4, m=128``."""
    mesh = program.mesh
    axes = " ".join(f"{a}{mesh.size(a)}" for a in MESH_AXES if mesh.size(a) > 1)
    return f"{axes}, seq {program.model.get('seq')}, m={program.train.microbatches}"


def gqa_note(profile: Profile) -> None:
    """The CP share the calibrated profile gives Llama with Llama 3's 8 KV heads instead of MHA."""
    print("\nwhy MHA for Llama ([mha] in a40_published.yaml): the calibrated profile with 8 KV heads")
    for run in published_runs("breakdown", kv_heads=8):
        if run.name.startswith("Llama"):
            step = megatron_step(attrs.evolve(check_text(run.text, f"{run.name}.dhx"), profile=profile))
            print(f"  {run.name:10} CP share {step.shares['cp']:6.1%} (paper {run.published['shares']['cp']:.1%})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--fit", action="store_true", help="run the search and print its result")
    args = parser.parse_args(argv)
    shipped = load_profile("a40")
    uncalibrated = with_knobs(shipped, UNCALIBRATED)
    print(f"machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}")
    print("config: the a40 profile; Megatron-LM = 1F1B, fold none, SI off; DHelix = w_helix, fold u, "
          "SI on (overlap tp/cp/ep, comm_with_comm, movable wgrad); micro-batch 1; bf16")
    print("knobs (bandwidth efficiency, fraction of the link peak):  " + ",  ".join(
        f"{k.name} = {v:.2f}" for k, v in zip(KNOBS, knob_values(shipped).values(), strict=True)))
    for knob in KNOBS:
        print(f"  {knob.name:17} {knob.what}")
    calibration = Calibration(published_runs("breakdown"))
    if args.fit:
        print(f"\nfit from the uncalibrated values (RMS {calibration.rms(uncalibrated):.4f}):")
        values = calibration.fit(shipped, UNCALIBRATED)
        print("fitted: " + ",  ".join(f"{name} = {value:.3f}" for name, value in values.items()))
        print("shipped (rounded to 2 digits in a40.yaml): " + ",  ".join(
            f"{name} = {value:.2f}" for name, value in knob_values(shipped).items()))
    print("\nMegatron-LM time breakdown, simulated (uncalibrated, calibrated) beside the paper's Fig. 3")
    print_breakdown(calibration.runs, calibration.steps(uncalibrated), calibration.steps(shipped))
    validate("validation on the same runs (Fig. 12, Table 6): not fitted", calibration.runs,
             (uncalibrated, shipped))
    validate("validation on Fig. 11's runs (seq 8192, no CP; no breakdown published)",
             published_runs("throughput"), (uncalibrated, shipped))
    gqa_note(shipped)


if __name__ == "__main__":
    main()
