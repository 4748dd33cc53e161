"""Strand interleaving over an emulated two-node link: how much communication does SI hide?

Run as root (it creates network namespaces)::

    sudo .venv/bin/python benchmarks/two_nodes.py --rounds 5 --output benchmarks/results/cpu_two_nodes.txt

What it does:

1. creates two network namespaces joined by a veth pair whose ends are rate limited with
   ``tc tbf`` (``--rate``, default 200 Mbit/s); only the private addresses 10.213.0.1/24 and
   10.213.0.2/24 live on that veth, and the namespaces (with the veth) are deleted on exit,
   on failure and on Ctrl-C (``benchmarks/two_node_link.py``);
2. writes the benchmark program: a small Llama with ``cluster { nodes = 2 gpus_per_node = 1 }``
   and ``mesh { tp = 2 }``, so its tensor-parallel group spans the two "nodes" and every layer
   collective goes over the limited link (the cross lane), and ``pipeline w_helix`` with
   ``fold u``, so all but the first micro-batch's forward and the last one's backward run in
   SI blocks: with m micro-batches, (m - 1) / m of the layer passes, which caps the hidden
   fraction below (8 micro-batches: 87.5 %). Hidden 1024 and seq 256 make compute and
   communication per step comparable at 200 Mbit/s on the 2-CPU machine it was written on
   (≈3.5 s and ≈4.2 s for 4 layers × 4 micro-batches; the tensor-parallel collectives grow
   with seq × hidden, the GEMMs with seq × hidden²). Or ``--program FILE``: a program whose
   cluster has 2 nodes;
3. profiles the link with ``dhelix profile`` when this dhelix has that command, and points the
   program's cluster profile at the result, so the SI plan is planned for this link; without
   it the plan comes from the shipped ``a40`` profile, and the output says so;
4. runs, alternated in every round (the order rotates from round to round), one rank per
   namespace (``ip netns exec NS env RANK=… MASTER_ADDR=<veth address of rank 0>
   GLOO_SOCKET_IFNAME=<veth> python -m dhelix run FILE``): SI with the planner's plan,
   SI in the block scheduler's order (``--si-plan scheduled``), SI with the op_by_op plan,
   ``--no-si``, and a collectives-only replay of the same layer
   collectives without the compute (``benchmarks/collective_replay.py``);
5. prints per mode the median over rounds of the step time and of the exposed communication
   (each run's own figure is the median over its steps without the first, slowest rank), the
   ratio SI ÷ no-SI, and the hidden fraction of min(compute, communication); ``--trace DIR``
   keeps a Chrome trace of each ``dhelix run`` mode's last-round run (what waited for what).

The goals of the issue (a benchmark, not a test; the machine it runs on decides): where
compute and communication per layer are comparable, SI step ≤ 0.70 × the ``--no-si`` step,
and ≥ 80 % of min(compute, communication) hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs

# Beside this file (the script's folder is the first on sys.path): the link and what the
# two-node benchmarks share.
from two_node_link import Shaping, TwoNodeLink
from two_node_runs import (run_main, BenchError, Report, World, add_link_arguments, command_line, machine, median, percent_text,
                           profile_link, ratio_text, seconds_text)

from dhelix.dsl.passes.pipeline import check_text

HERE = Path(__file__).resolve().parent
REPLAY = HERE / "collective_replay.py"
SI_GOAL, HIDDEN_GOAL = 0.70, 0.80
#: Issue 32's goal for Centauri + SI: its step at most this share of the no-SI step, and no
#: slower than SI alone.
CENTAURI_SI_GOAL = 0.65
CENTAURI_FILE = "two_nodes_centauri.dhx"
PROFILE_SETTING = re.compile(r'\bprofile\s*=\s*"[^"\n]*"')


@attrs.frozen
class Mode:
    """One way of running the program: a name and the command after ``python``."""

    name: str
    args: tuple[str, ...]  # {file} stands for the program ({centauri}: with --centauri's block)


MODES = (
    Mode("SI planned", ("-m", "dhelix", "run", "{file}", "--si-plan", "planned")),
    Mode("SI scheduled", ("-m", "dhelix", "run", "{file}", "--si-plan", "scheduled")),
    Mode("SI op_by_op", ("-m", "dhelix", "run", "{file}", "--si-plan", "op_by_op")),
    Mode("no SI", ("-m", "dhelix", "run", "{file}", "--no-si")),
    Mode("comm only", (str(REPLAY), "{file}")),
)
#: With ``--centauri``: the program with that partition block, SI on (planned) and off.
CENTAURI_MODES = (
    Mode("Centauri+SI", ("-m", "dhelix", "run", "{centauri}", "--si-plan", "planned")),
    Mode("Centauri", ("-m", "dhelix", "run", "{centauri}", "--no-si")),
)


def benchmark_program(args, profile: str) -> str:
    """The built-in program: a Llama layer with tp = 2 across the two nodes, w_helix on fold u."""
    heads = args.hidden // 64
    return f"""# Written by benchmarks/two_nodes.py: tp = 2 across two emulated nodes (the cross lane).
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"

model two_nodes {{
  layers = {args.layers}
  hidden = {args.hidden}
  ffn = {args.ffn or 2 * args.hidden}
  heads = {heads}
  kv_heads = {max(1, heads // 2)}
  seq = {args.seq}
  vocab = 512
  dtype = fp32
  layer = llama
}}

cluster {{
  nodes = 2
  gpus_per_node = 1
  profile = "{profile}"
}}

mesh {{
  tp = 2
}}

train {{
  micro_batch = 1
  microbatches = {args.microbatches}
  seed = 0
}}

fold u
pipeline w_helix

strands {{
  overlap tp
  comm_with_comm on
  movable wgrad
}}
"""


def with_profile(program, profile: str) -> str:
    """The text of ``program`` (a checked Program with a cluster block) with the cluster's
    profile set to ``profile``: the setting replaced, or added before the block's ``}``."""
    span = program.cluster.span
    text = span.source.text
    start, end = _offset(text, span.line, span.column), _offset(text, span.end_line, span.end_column)
    block, setting = text[start:end], f'profile = "{profile}"'
    if PROFILE_SETTING.search(block):
        block = PROFILE_SETTING.sub(setting, block, count=1)
    else:  # on a line of its own: the block's last line may end in a comment
        block = f"{block[:-1].rstrip(' ')}\n  {setting}\n}}"
    return text[:start] + block + text[end:]


def _offset(text: str, line: int, column: int) -> int:
    """The index in ``text`` of 1-based ``line`` and ``column``."""
    return sum(len(before) + 1 for before in text.split("\n")[:line - 1]) + column - 1


# -- the output --------------------------------------------------------------------------------

# -- launching one world over the two namespaces ------------------------------------------------

# -- the benchmark -----------------------------------------------------------------------------

def trace_file(folder: str, mode: Mode) -> Path:
    """Where ``--trace FOLDER`` puts the Chrome trace of ``mode``'s last-round run."""
    return Path(folder) / f"{mode.name.replace(' ', '_')}.json"


def run_rounds(world: World, program: Path, args, report: Report) -> dict[str, list[dict]]:
    """Every mode once per round, the order rotating by one mode each round; returns the
    metrics of the successful runs by mode name."""
    modes = selected_modes(args)
    results: dict[str, list[dict]] = {mode.name: [] for mode in modes}
    for round_index in range(args.rounds):
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            metrics = world.workdir / f"round{round_index + 1}-{mode.name.replace(' ', '_')}.json"
            command = [arg.format(file=program, centauri=program.with_name(CENTAURI_FILE)) for arg in mode.args]
            command += ["--steps", str(args.steps), "--metrics", str(metrics)]
            if args.trace and round_index == args.rounds - 1 and "dhelix" in mode.args:
                command += ["--trace", str(trace_file(args.trace, mode).resolve())]
            before = world.link.counters()
            ok, where = world.run(command, mode.name)
            after = world.link.counters()
            label = f"round {round_index + 1}/{args.rounds}  {mode.name:<13}"
            if not ok:
                report(f"{label} FAILED: {where}")
                if not args.keep_going:
                    raise BenchError(f"{mode.name} failed (--keep-going goes on after a failed run)")
                continue
            data = json.loads(metrics.read_text())
            data["link"] = {key: after[key] - before[key] for key in after}
            results[mode.name].append(data)
            report(f"{label} step {data['step_s']:7.3f} s   exposed comm {data['exposed_comm_s']:7.3f} s   "
                   f"link drops {data['link']['dropped']:5d} of {data['link']['packets']} packets   "
                   f"(load average {os.getloadavg()[0]:.1f})")
    return results


def selected_modes(args) -> tuple[Mode, ...]:
    """The modes ``--skip`` leaves, in MODES' order (no SI and the replay always run: the
    ratios need them)."""
    skip = {name.strip() for name in (args.skip or "").split(",") if name.strip()}
    modes = MODES + (CENTAURI_MODES if args.centauri else ())
    unknown = skip - {mode.name for mode in modes}
    if unknown or skip & {"no SI", "comm only"}:
        raise BenchError(f"--skip {args.skip}: give modes among "
                         + ", ".join(m.name for m in modes if m.name not in ("no SI", "comm only")))
    return tuple(mode for mode in modes if mode.name not in skip)


def summarise(results: dict[str, list[dict]], report: Report) -> None:
    """The table of medians, the ratios, the hidden fractions and the goals."""
    step = {m: median([d["step_s"] for d in runs]) for m, runs in results.items()}
    exposed = {m: median([d["exposed_comm_s"] for d in runs]) for m, runs in results.items()}
    report()
    report("medians over the rounds (a run's figure: the median over its steps without the first, "
           "of the slowest rank):")
    report(f"{'mode':<13} {'runs':>4} {'step time':>10} {'min':>8} {'max':>8} {'exposed comm':>13} "
           f"{'simulated':>10} {'sim ÷ run':>9}")
    for mode, runs in results.items():
        steps = [d["step_s"] for d in runs]
        predicted = median([d["predicted"]["step_s"] for d in runs
                             if (d.get("predicted") or {}).get("step_s") is not None])
        ratio = None if predicted is None or not step[mode] else predicted / step[mode]
        report(f"{mode:<13} {len(runs):>4} {seconds_text(step[mode]):>10} {seconds_text(min(steps, default=None)):>8} "
               f"{seconds_text(max(steps, default=None)):>8} {seconds_text(exposed[mode]):>13} "
               f"{seconds_text(predicted):>10} {ratio_text(ratio):>9}")
    notes = {d["predicted"].get("note") for runs in results.values() for d in runs if d.get("predicted")}
    for note in sorted(n for n in notes if n):
        report(f"simulated: {note} (the goal: within 15 % of the measured step)")
    replay = results["comm only"]
    if replay:
        sent = replay[0]["ranks"][0]["bytes_sent"]
        report(f"comm only: {replay[0]['ranks'][0]['collectives']} layer collectives per step, "
               f"{sent / 2**20:.1f} MiB sent per rank, {8 * sent / step['comm only'] / 1e6:.0f} Mbit/s achieved")
    no_si, comm = step["no SI"], step["comm only"]
    compute = None if no_si is None or exposed["no SI"] is None else no_si - exposed["no SI"]
    report()
    report("compute       = no-SI step - no-SI exposed comm (the time the no-SI run was not waiting "
           f"on a collective) = {seconds_text(compute)}")
    report(f"communication = the comm-only replay's step (the same layer collectives, no compute) = {seconds_text(comm)}")
    report("SI ÷ no-SI    = SI step / no-SI step (goal ≤ 0.70)")
    report("hidden        = (no-SI step - SI step) / min(compute, communication) (goal ≥ 80 %)")
    if "Centauri+SI" in results:
        report("Centauri+SI   = the program with --centauri's partition block, SI planned (goals: ≤ "
               f"{CENTAURI_SI_GOAL:.2f} of no SI, and ≤ SI planned's step)")
    for mode in (m for m in results if m not in ("no SI", "comm only")):
        ratio = None if step[mode] is None or not no_si else step[mode] / no_si
        hidden = None
        if None not in (step[mode], no_si, compute, comm) and min(compute, comm) > 0:
            hidden = (no_si - step[mode]) / min(compute, comm)
        met = [f"SI ÷ no-SI {'met' if ratio <= SI_GOAL else 'not met'}" if ratio is not None else "",
               f"hidden {'met' if hidden >= HIDDEN_GOAL else 'not met'}" if hidden is not None else ""]
        if mode == "Centauri":  # SI off: the SI goals do not apply
            report(f"{mode:<13}  ÷ no-SI {ratio_text(ratio)}   hidden {percent_text(hidden)}   (Centauri's "
                   "partition alone, no SI)")
            continue
        if mode == "Centauri+SI" and ratio is not None:
            alone = step.get("SI planned")
            met = [f"≤ {CENTAURI_SI_GOAL:.2f} of no SI {'met' if ratio <= CENTAURI_SI_GOAL else 'not met'}"]
            if alone:
                met.append(f"÷ SI planned {ratio_text(step[mode] / alone)} "
                           f"({'met' if step[mode] <= alone else 'not met'})")
        report(f"{mode:<13}  SI ÷ no-SI {ratio_text(ratio)}   hidden {percent_text(hidden)}   goals: "
               + (", ".join(m for m in met if m) or "—"))
        if hidden is not None and hidden > 1:
            report(f"{'':<13}  above 100 %: SI saved more than the whole communication, which it cannot; "
                   "the runs of the two modes saw different loads of the machine")


def load_program(args, workdir: Path) -> tuple[str, object]:
    """The benchmark program's text and its checked Program; BenchError when ``--program``
    names one that cannot be split over two nodes."""
    if args.program:
        text = Path(args.program).read_text()
    else:
        text = benchmark_program(args, "a40")
    # Checked where it will run from: a --program with relative imports of its own files fails here.
    program = check_text(text, str(workdir / "two_nodes.dhx"))
    if program.model is None or program.cluster is None:
        raise BenchError("the program needs a model and a cluster block")
    if args.centauri:
        if program.partition is not None:
            raise BenchError("--centauri adds a partition block: give a --program without one")
        check_text(centauri_text(text, args.centauri), str(workdir / CENTAURI_FILE))  # a mistake now, not minutes in
    nodes, per_node = program.cluster.nodes, program.cluster.gpus_per_node
    if nodes != 2 or program.mesh.world != 2 * per_node:
        raise BenchError(f"the program must run on 2 nodes of gpus_per_node ranks: its cluster has {nodes} "
                         f"node(s) of {per_node} and its mesh {program.mesh.world} rank(s)")
    return text, program


def centauri_text(text: str, statements: str) -> str:
    """The program ``text`` with ``partition { statements }`` added (``--centauri``)."""
    return f"{text.rstrip()}\n\npartition {{\n  {statements}\n}}\n"


def describe(program, args) -> str:
    """The configuration in one line."""
    model = dict(program.model.settings)
    mesh = " × ".join(f"{a} {n}" for a, n in zip(program.mesh.order, program.mesh.sizes, strict=True) if n > 1)
    lanes = ", ".join(f"{a}: {program.mesh.lane(a)}" for a, n in zip(program.mesh.order, program.mesh.sizes,
                                                                    strict=True) if n > 1)
    return (f"{program.model.layer} layers × {model.get('layers')}, hidden {model.get('hidden')}, ffn "
            f"{model.get('ffn')}, seq {model.get('seq')}, {program.model.dtype}; micro_batch "
            f"{program.train.micro_batch}, {program.train.microbatches} micro-batches; mesh {mesh} ({lanes}); "
            f"cluster {program.cluster.nodes} nodes × {program.cluster.gpus_per_node}; "
            f"fold {program.fold.kind}, pipeline {program.pipeline.name}; {args.steps} steps per run, "
            f"{args.rounds} rounds")


def bench(args, report: Report, workdir: Path) -> int:
    """Everything between the checks and the clean-up; returns the exit code."""
    report(f"$ {command_line()}")
    report(f"machine: {machine()}")
    text, program = load_program(args, workdir)
    path = workdir / "two_nodes.dhx"
    path.write_text(text)
    report(f"config: {describe(program, args)}")
    with TwoNodeLink(Shaping(rate=args.rate, burst=args.burst, latency=args.latency)) as link:
        report(f"link: {link.describe()}")
        world = World(link, program.mesh.world, program.cluster.gpus_per_node, workdir, args.run_timeout)
        if args.centauri:  # its own profile: its layer's ops are the chunks
            centauri = path.with_name(CENTAURI_FILE)
            centauri.write_text(centauri_text(text, args.centauri))
            report(f"Centauri: the program with `partition {{ {args.centauri} }}` ({CENTAURI_FILE})")
            measured = None if args.no_profile else profile_link(world, centauri, args, report, "link_centauri.yaml")
            if measured is not None:
                centauri.write_text(with_profile(check_text(centauri.read_text(), str(centauri)), measured))
            check_text(centauri.read_text(), str(centauri))
        profile = None if args.no_profile else profile_link(world, path, args, report)
        if profile is not None:
            path.write_text(with_profile(program, profile))
            program = check_text(path.read_text(), str(path))
        report(f"SI planned: planned for the {program.cluster.profile or 'no'} profile"
               + ("" if program.cluster.profile else " (dhelix run falls back to op_by_op)"))
        if args.show_plan and program.cluster.profile:
            for shown in [path.name] + ([CENTAURI_FILE] if args.centauri else []):
                plan = subprocess.run([sys.executable, "-m", "dhelix", "plan", shown], capture_output=True,
                                      text=True, cwd=workdir)
                for line in (plan.stdout or plan.stderr).rstrip().split("\n"):
                    report(f"  {line}")
        results = run_rounds(world, path, args, report)
    summarise(results, report)
    report(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def parse_args(argv=None):
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_link_arguments(parser, "200mbit")
    parser.add_argument("--skip", metavar="MODES",
                        help='SI modes not to run, comma-separated (e.g. "SI op_by_op")')
    parser.add_argument("--program", metavar="FILE",
                        help="run this program instead of the built-in one (2 nodes; imports other than "
                             "the stdlib must be absolute paths)")
    parser.add_argument("--hidden", type=int, default=1024, help="built-in program: hidden size")
    parser.add_argument("--ffn", type=int, help="built-in program: ffn size (default 2 × hidden)")
    parser.add_argument("--seq", type=int, default=256, help="built-in program: sequence length")
    parser.add_argument("--layers", type=int, default=2, help="built-in program: layers (even: fold u)")
    parser.add_argument("--microbatches", type=int, default=8, help="built-in program: micro-batches per step")
    parser.add_argument("--centauri", metavar="STATEMENTS",
                        help='also run the program with `partition { STATEMENTS }` added, SI on and off '
                             '(modes "Centauri+SI" and "Centauri"), e.g. "chunk ag2 + fc1 + act + fc2 + rs2 by 2"')
    parser.add_argument("--no-profile", action="store_true", help="do not run `dhelix profile` even if it exists")
    parser.add_argument("--profile-repeats", type=int, default=5, help="--repeats of `dhelix profile`")
    parser.add_argument("--show-plan", action="store_true", help="print `dhelix plan` of the program")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--keep-going", action="store_true", help="go on after a failed run")
    parser.add_argument("--keep-files", action="store_true", help="keep the program, logs and metrics")
    parser.add_argument("--output", metavar="FILE", help="also write everything printed to FILE")
    parser.add_argument("--trace", metavar="DIR",
                        help="write a Chrome trace of each mode's last-round run into DIR (MODE.json)")
    parser.add_argument("--cleanup", action="store_true",
                        help="delete the namespaces a killed run left behind, then exit")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        parser.error("--rounds must be at least 1 and --steps at least 2 (the first step is left out)")
    if args.trace:
        kept = [str(trace_file(args.trace, m)) for m in MODES + CENTAURI_MODES if trace_file(args.trace, m).exists()]
        if kept:
            parser.error(f"--trace {args.trace} already holds {', '.join(kept)}: "
                         "name an empty or new folder (nothing is overwritten)")
    return args


def main(argv=None) -> int:
    """Check that the link can be made, run the benchmark, always remove what it created."""
    args = parse_args(argv)

    def traced_bench(args, report, workdir):
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
        return bench(args, report, workdir)
    return run_main("two_nodes.py", args, traced_bench, "dhx2n-")


if __name__ == "__main__":
    sys.exit(main())
