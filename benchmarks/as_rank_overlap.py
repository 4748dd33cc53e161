"""Communication hiding of one rank on one GPU: `dhelix run --as-rank R` with SI planned, op by op
and off, alternated rounds, medians; then one torch.profiler run of each for the kernels.

    python benchmarks/as_rank_overlap.py --program benchmarks/llama70b_tp8_pair.dhx --emulate copy sleep \
        --steps 21 --rounds 3 --output OUT.txt --traces DIR

Each run is a fresh process (`dhelix run … --json`): its step time and, per lane, the seconds the
compute stream stalled on a transfer (exposed) and the lane was busy (the module
dhelix.interpreter.ops.standin measures both with CUDA events), medians over the steps after the
first. Communication hidden = 1 - exposed / busy. From each variant's profiled run (--traces):
the compute stream's kernel time per step (SI on over SI off: the slowdown of kernels that run
beside transfers) and the gaps between its consecutive kernels (launch gaps and stalls).
Runs on CPU too (no kernels there: the profile part is skipped).
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dhelix.interpreter.training.train import STEP_MARK

VARIANTS = {"SI planned": [], "SI op_by_op": ["--si-plan", "op_by_op"], "SI off": ["--no-si"]}


def run(program: str, rank: int, emulate: str, steps: int, extra: list, trace: Path | None = None) -> dict:
    """One `dhelix run --as-rank` in a fresh process; its --json figures."""
    command = [sys.executable, "-m", "dhelix", "run", program, "--as-rank", str(rank), "--emulate-links", emulate,
               "--steps", str(steps), "--json", "--force", *extra]
    if trace is not None:
        command += ["--trace", str(trace)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def kernels(trace: Path) -> tuple[float, list[float], int, int]:
    """From a torch.profiler trace: the compute stream's kernel seconds, the gaps (seconds)
    between its consecutive kernels and how many kernels it ran, over the steps after the
    first (which compiles and warms up), and how many steps that is."""
    events = json.loads(trace.read_text())["traceEvents"]
    marks = sorted((event["ts"], event["ts"] + event["dur"]) for event in events
                   if event.get("ph") == "X" and event.get("name", "").startswith(STEP_MARK))
    if len(marks) < 2:
        raise SystemExit(f"{trace}: fewer than two '{STEP_MARK}N' spans; profile at least two steps")
    after_first = marks[0][1]  # a step ends with the host reading its loss: its kernels are done
    by_stream: dict = {}
    for event in events:
        if event.get("cat") == "kernel" and event.get("ph") == "X" and event["ts"] >= after_first:
            by_stream.setdefault(event["args"].get("stream"), []).append((event["ts"], event["dur"]))
    if not by_stream:
        return 0.0, [], 0, len(marks) - 1
    # The compute stream: the one with the most kernel time (the lanes' streams run copies, sleeps).
    stream = max(by_stream, key=lambda s: sum(d for _, d in by_stream[s]))
    spans = sorted(by_stream[stream])
    gaps = [max(0.0, b[0] - (a[0] + a[1])) / 1e6 for a, b in zip(spans, spans[1:])]
    return sum(d for _, d in spans) / 1e6, gaps, len(spans), len(marks) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", default="benchmarks/llama70b_tp8_pair.dhx")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--emulate", nargs="+", default=["copy"])
    parser.add_argument("--steps", type=int, default=21, help="steps per run (the first is excluded)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--profile-variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="the variants of the profiled runs (SI off is their kernel-time baseline)")
    parser.add_argument("--output", help="also write the report here")
    parser.add_argument("--traces", help="folder for the profiled runs' traces (skipped when not given)")
    args = parser.parse_args()
    lines = [f"$ python benchmarks/as_rank_overlap.py {' '.join(sys.argv[1:])}", _machine()]
    for emulate in args.emulate:
        lines += _one_emulation(args, emulate)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.output:
        Path(args.output).write_text(text)


def _one_emulation(args, emulate: str) -> list[str]:
    results: dict = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):  # alternated: each round runs every variant once
        for name, extra in VARIANTS.items():
            started = time.perf_counter()
            results[name].append(run(args.program, args.rank, emulate, args.steps, extra))
            got = results[name][-1]
            print(f"# {emulate} round {round_ + 1} {name}: step {1e3 * got['step_s']:.2f}ms, exposed "
                  f"{1e3 * got['exposed_comm_s']:.2f}ms, busy {1e3 * sum(got['lanes_busy_s'].values()):.2f}ms "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    first = results["SI planned"][0]
    lines = [f"\n{args.program}: rank {args.rank} of {first['world']} alone on {first['device']}, links emulated by "
             f"{emulate}; {args.rounds} alternated rounds x {args.steps} steps, medians of the rounds' medians "
             "(first step of each run excluded)",
             f"{'variant':<14} {'step':>10} {'÷ SI off':>9} {'exposed':>10} {'busy':>10} {'hidden':>8} {'peak GiB':>9}"
             f" {'simulated step':>15}"]
    off = statistics.median(r["step_s"] for r in results["SI off"])
    for name, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)
        exposed = statistics.median(r["exposed_comm_s"] for r in runs)
        busy = statistics.median(sum(r["lanes_busy_s"].values()) for r in runs)
        hidden = f"{100 * (1 - exposed / busy):.1f}%" if busy else "-"
        peak = max(r["peak_memory_bytes"] for r in runs) / 2**30
        predicted = runs[0]["predicted"]["alone_s"]
        lines.append(f"{name:<14} {1e3 * step:>8.2f}ms {step / off:>9.3f} {1e3 * exposed:>8.2f}ms {1e3 * busy:>8.2f}ms"
                     f" {hidden:>8} {peak:>9.2f} {'-' if predicted is None else f'{1e3 * predicted:.2f}ms':>15}")
    lines.append(f"simulated peak memory: {first['predicted']['peak_memory_bytes'] / 2**30:.2f} GiB; "
                 f"{first['predicted']['note']}")
    if args.traces and first["device"].startswith("cuda"):
        lines += _kernels(args, emulate)
    return lines


def _kernels(args, emulate: str) -> list[str]:
    folder = Path(args.traces)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"torch.profiler, {args.profile_steps} steps per variant (per step, the first excluded):",
             f"{'variant':<14} {'kernels':>8} {'kernel time':>12} {'÷ base':>9} {'gaps':>10} {'median gap':>11}"
             f" {'p90 gap':>9} {'gaps > 20us':>12}"]
    figures = {}
    for name in args.profile_variants:
        extra = VARIANTS[name]
        ours = folder / f"{emulate}_{name.replace(' ', '_')}.json"
        run(args.program, args.rank, emulate, args.profile_steps, extra, trace=ours)
        profiled = ours.with_suffix(f".rank{args.rank}.json")
        figures[name] = kernels(profiled)
        if name == "SI planned":  # keep one trace, compressed
            with gzip.open(str(profiled) + ".gz", "wb") as out:
                out.write(profiled.read_bytes())
        profiled.unlink()
    base = figures["SI off"][0] if "SI off" in figures else next(iter(figures.values()))[0]
    for name, (seconds, gaps, count, steps) in figures.items():
        ordered = sorted(gaps) or [0.0]
        lines.append(f"{name:<14} {count // steps:>8} {1e3 * seconds / steps:>10.2f}ms {seconds / base:>9.3f}"
                     f" {1e3 * sum(gaps) / steps:>8.2f}ms {1e6 * ordered[len(ordered) // 2]:>9.1f}us"
                     f" {1e6 * ordered[int(0.9 * (len(ordered) - 1))]:>7.1f}us {sum(g > 20e-6 for g in gaps) // steps:>12}")
    return lines


def _machine() -> str:
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpu}"
    except ImportError:
        versions = "no torch"
    return f"machine: {platform.platform()}, {versions}; date: {time.strftime('%Y-%m-%d')}"


if __name__ == "__main__":
    main()
