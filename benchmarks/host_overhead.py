"""The interpreter's host cost per action and per operator, beside a plain-torch loop issuing the
same operators: one rank's real action list (``--as-rank``, links emulated by ``none``) with tensors
so small that compute is negligible.

    python benchmarks/host_overhead.py --rounds 21 --profile --output benchmarks/results/cpu_host_overhead.txt

For each program (the Llama-70B TP-8 pair, the 64-rank tp8 x pp4 x dp2 Llama-70B, the Phi-3.5-MoE
64-rank program), a variant with the same mesh, schedule, layer and strands but small sizes (and,
for the 64-rank ones, fewer layers and micro-batches) is compiled once as ``dhelix run`` does
(:func:`~dhelix.dsl.simulator.runplan.build_run_plan`) and rank R runs alone in this process in
a stand-in world (:func:`~dhelix.interpreter.ops.standin.join_standin_world`,
:class:`~dhelix.interpreter.ops.standin.EmulatedComm` with ``none``: every collective's stand-in
written at once on the calling thread), by the executor that ``dhelix run`` builds (no optimizer:
the action list only), and by the same executor without the memory probe (``Recorder(memory_probe=False)``:
no walk of the live tensors after every layer, and a collective complete at its issue leaves its
tensor, not a Pending).

The floor. One step runs under a ``TorchFunctionMode`` that records every top-level torch call the
step makes (function or tensor method, its arguments as they were: the same tensors); the plain
loop calls them again in that order — the same operators on the same shapes, nothing else: no
names looked up, no dicts, no Python between them but the loop. Calls returning no tensor (shape
and storage queries) are left out of it. Interpreter steps (probe on), plain loops and interpreter
steps without the probe alternate, one of each per round; medians over the rounds, of wall time
and of the calling thread's CPU time
(``time.thread_time``: on a machine shared with other work, the time the thread ran, not the
time it waited for a core; with links emulated by ``none`` and one intra-op thread, every
transfer and kernel runs on this thread), and the minima of the CPU times (what other work on
a shared machine adds to a thread's CPU time — caches and a core's other hyperthread taken —
only ever adds: the least is the nearest to the step's own cost). ``--profile`` adds a cProfile of a few interpreter steps per
program, its top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from dhelix.dsl.core.schedule import Interleaved  # noqa: E402
from dhelix.dsl.simulator.runplan import build_run_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: The sizes every variant takes: a few rows and columns per rank, fp32 (the CPU's flash
#: attention kernels; bf16 attention recomputes under autograd there).
_TINY = {"hidden": 64, "ffn": 128, "seq": 16, "vocab": 64, "dtype": "fp32"}

#: name → (source file, its model settings replaced, rank run). Sizes keep every divisibility
#: the mesh needs (heads and kv_heads by tp, seq by tp for sequence parallelism, experts by ep).
PROGRAMS = {
    "llama70b_tp8_pair": ("benchmarks/llama70b_tp8_pair.dhx",
                          _TINY | {"heads": 8, "kv_heads": 8}, 0),
    "llama70b_a40_64 (8 layers, m 8)": ("benchmarks/llama70b_a40_64.dhx",
                                         _TINY | {"heads": 8, "kv_heads": 8, "layers": 8, "microbatches": 8}, 0),
    "phi31b_a40 MoE (8 layers, m 8)": ("examples/phi31b_a40.dhx",
                                        _TINY | {"heads": 8, "kv_heads": 8, "layers": 8, "microbatches": 8}, 0),
}


def variant(path: str, sizes: dict) -> str:
    """The source of ``path`` with each ``name = value`` setting of ``sizes`` replaced."""
    text = (ROOT / path).read_text()
    for name, value in sizes.items():
        text, count = re.subn(rf"(?m)^(\s*{name}\s*=\s*)\S+", rf"\g<1>{value}", text)
        if count != 1:
            raise SystemExit(f"{path}: expected one '{name} =' setting, found {count}")
    return text


class Recording(TorchFunctionMode):
    """Records every top-level torch call as ``(func, args, kwargs)``; those returning no
    tensor (shape and storage queries) are dropped afterwards."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _holds_tensor(out):
            self.calls.append((func, args, kwargs))
        return out


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def plain_loop(calls) -> None:
    """The floor: the recorded torch calls, again, in order."""
    with torch.no_grad():
        for func, args, kwargs in calls:
            func(*args, **kwargs)


class Rank:
    """Rank ``rank`` of ``text`` alone in this process: its executor and a batch."""

    def __init__(self, path: str, text: str, rank: int):
        from dhelix.interpreter.execute.executor import Executor
        from dhelix.interpreter.execute.recording import Recorder
        from dhelix.interpreter.ops.standin import EmulatedComm, join_standin_world
        from dhelix.interpreter.training.data import DataSource
        from dhelix.interpreter.verify.harness import replica_batch

        self.compiled = build_run_plan(text, str(ROOT / path))
        program = self.compiled.program
        join_standin_world(rank, program.mesh.world)
        device = torch.device("cpu")
        self.comm = EmulatedComm(program.mesh, device, program.profile, "none")
        si = self.compiled.si

        def executor(recorder: Recorder) -> Executor:
            return Executor(program, self.comm, seed=1, device=device, si=self.compiled.interleave,
                            plan_for=si.plan_for(), use_tags=True, block_orders=si.orders(), recorder=recorder,
                            reference=self.compiled.reference, issue_order=si.issue_order(False),
                            stand_in_weights=True)
        # As `dhelix run` makes it (the memory probe on), and the same without the probe.
        self.executor, self.unprobed = executor(Recorder()), executor(Recorder(memory_probe=False))
        batch = DataSource(program, self.comm.size("dp"), 1, None).batch(0)
        self.batch = replica_batch(batch, self.comm.index("dp"), program.train.microbatches)
        self.program = program

    def step(self, probe: bool = True) -> None:
        (self.executor if probe else self.unprobed).step(self.batch)

    def close(self) -> None:
        self.comm.lanes.close()
        dist.destroy_process_group()


def counts(rank: Rank) -> dict:
    """The rank's actions per step by kind, and its layer ops per step (DAG ops run)."""
    from dhelix.interpreter.execute import layer_exec

    kinds: dict[str, int] = {}
    for action in rank.executor.actions:
        kind = "SI" if isinstance(action, Interleaved) else action.kind
        kinds[kind] = kinds.get(kind, 0) + 1
    ops = [0]
    run = layer_exec.LayerRun
    init, forward_op, backward_op = run.__init__, run.forward_op, run.backward_op

    def counted(method):
        def counting(self, *args, **kwargs):
            ops[0] += 1
            return method(self, *args, **kwargs)
        return counting

    def slow(self, *args, **kwargs):  # every op through the counted methods, not the compiled calls
        init(self, *args, **kwargs)
        self.fast = False

    run.__init__, run.forward_op, run.backward_op = slow, counted(forward_op), counted(backward_op)
    try:
        rank.step()
    finally:
        run.__init__, run.forward_op, run.backward_op = init, forward_op, backward_op
    return {"kinds": kinds, "actions": sum(kinds.values()), "layer_ops": ops[0]}


def _timed(run) -> tuple[float, float]:
    """Wall and this thread's CPU seconds of ``run()``."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    run()
    return time.perf_counter() - start, time.thread_time() - start_cpu


def measure(name: str, path: str, sizes: dict, rank_index: int, rounds: int, profile: bool) -> list[str]:
    rank = Rank(path, variant(path, sizes), rank_index)
    try:
        rank.step()  # warm-up
        rank.step(probe=False)
        seen = counts(rank)
        recording = Recording()
        with recording:
            rank.step()
        calls = recording.calls
        plain_loop(calls)  # warm-up
        times: dict[str, list[tuple[float, float]]] = {"probe": [], "plain": [], "bare": []}
        for _ in range(rounds):  # alternated: an interpreter step, a plain loop, a step without the probe
            times["probe"].append(_timed(rank.step))
            times["plain"].append(_timed(lambda: plain_loop(calls)))
            times["bare"].append(_timed(lambda: rank.step(probe=False)))
        wall = {key: [w for w, _ in got] for key, got in times.items()}
        cpu = {key: [c for _, c in got] for key, got in times.items()}
        plain = statistics.median(wall["plain"])
        plain_cpu = statistics.median(cpu["plain"])
        program = rank.program
        mesh = " x ".join(f"{axis}{size}" for axis, size in zip(program.mesh.order, program.mesh.sizes, strict=True)
                          if size > 1) + (f" (ep{program.mesh.ep} inside dp)" if program.mesh.ep > 1 else "")
        kinds = " ".join(f"{k} {v}" for k, v in sorted(seen["kinds"].items()))
        si = rank.compiled.mode.value if rank.compiled.interleave else "off"
        lines = [f"\n{name}: {path} with {', '.join(f'{k} = {v}' for k, v in sizes.items())}; rank {rank_index} of "
                 f"{program.mesh.world} ({mesh}), {program.pipeline.name}, SI {si}",
                 f"  per step: {seen['actions']} actions ({kinds}), {seen['layer_ops']} layer ops, "
                 f"{len(calls)} torch calls",
                 f"  plain-torch loop {1e3 * plain:9.2f} ms  (min {1e3 * min(wall['plain']):.2f})   "
                 f"this thread's CPU time {1e3 * plain_cpu:6.2f} ms  (min {1e3 * min(cpu['plain']):.2f})"]
        for key, what in (("probe", "interpreter step, memory probe on (as dhelix run)"),
                          ("bare", "interpreter step, memory probe off")):
            ours, ours_cpu = statistics.median(wall[key]), statistics.median(cpu[key])
            lines += [f"  {what}:",
                      f"    wall {1e3 * ours:7.2f} ms (min {1e3 * min(wall[key]):.2f})  ratio {ours / plain:.2f}x   "
                      f"CPU time {1e3 * ours_cpu:6.2f} ms  ratio {ours_cpu / plain_cpu:.2f}x   (minima "
                      f"{1e3 * min(cpu[key]):.2f} and {1e3 * min(cpu['plain']):.2f} ms: ratio "
                      f"{min(cpu[key]) / min(cpu['plain']):.2f}x)",
                      f"    host per action {1e6 * ours / seen['actions']:7.1f} us   per layer op "
                      f"{1e6 * ours / seen['layer_ops']:5.1f} us   per torch call {1e6 * ours / len(calls):5.2f} us "
                      f"(plain loop {1e6 * plain / len(calls):5.2f} us)   above the floor: "
                      f"{1e6 * (ours - plain) / seen['layer_ops']:.1f} us per layer op"]
        if profile:
            lines += _profile(rank)
        return lines
    finally:
        rank.close()


def _profile(rank: Rank, steps: int = 3) -> list[str]:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        rank.step()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    total = stats.total_tt
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:15]
    lines = [f"  cProfile, {steps} steps ({total / steps * 1e3:.1f} ms a step under the profiler, "
             f"{stats.total_calls // steps} function calls a step), top own time:"]
    for (file, line, func), (_, calls, own, _, _) in rows:
        where = f"{Path(file).name}:{line}" if line else file
        lines.append(f"    {100 * own / total:5.1f}%  {own / steps * 1e3:7.2f} ms  {calls // steps:>7} calls  "
                     f"{func} ({where})")
    return lines


def machine() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, load average {load}; "
            f"python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} intra-op "
            f"thread(s); date {time.strftime('%Y-%m-%d %H:%M')}")


#: What :func:`against` reads of a run's report: a program's name, then its plain loop's CPU
#: time and each interpreter step's CPU-time ratio and minima ratio (probe on, then off).
_PROGRAM = re.compile(r"^(\S[^:]*): ", re.M)
_PLAIN = re.compile(r"this thread's CPU time +([0-9.]+) ms")
_RATIO = re.compile(r"CPU time +([0-9.]+) ms +ratio ([0-9.]+)x .*: ratio ([0-9.]+)x\)")


def _summary(report: str) -> dict[str, tuple[float, ...]]:
    """By program: (plain loop ms, probe-on ms, its ratio, its minima ratio, probe-off ms,
    its ratio, its minima ratio), CPU times, from a report this script printed."""
    found = {}
    names = list(_PROGRAM.finditer(report))
    for at, match in enumerate(names):
        part = report[match.end():names[at + 1].start() if at + 1 < len(names) else len(report)]
        plain = _PLAIN.search(part)
        ratios = _RATIO.findall(part)
        if plain is None or len(ratios) != 2:
            continue
        found[match.group(1)] = (float(plain.group(1)),) + tuple(float(x) for r in ratios for x in r)
    return found


def against(other: Path, processes: int, rounds: int, programs: list[str]) -> list[str]:
    """This checkout's benchmark and ``other``'s (an earlier tree), in alternated processes
    (``other`` first), ``processes`` each, each run with ``rounds`` and ``programs``: the
    lines of each process's ratios, then their medians by tree."""
    import subprocess
    import tempfile

    from tune_speed import _BOOT, _package_view

    short = {name: name.split(" (")[0] for name in programs}
    lines = [f"\n## Before ({other}) and after (this checkout), alternated processes, {processes} each; per "
             "program, this thread's CPU time: the plain loop, and the interpreter step with the memory probe "
             "on and off, its ratio to the loop (in brackets, the ratio of the minima)"]
    # (PYTHONPATH left out: a site hook on it could import another checkout's package first.)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"before": other, "after": ROOT}
        views = {side: _package_view(tree, Path(scratch) / side) for side, tree in trees.items()}
        for process in range(processes):
            for side in ("before", "after"):
                load = " ".join(f"{x:.2f}" for x in os.getloadavg())
                command = [sys.executable, "-c", _BOOT, str(views[side]), str(trees[side] / "benchmarks" /
                           "host_overhead.py"), "--rounds", str(rounds), "--programs", *programs]
                out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=trees[side],
                                     env=env).stdout
                got = _summary(out)
                runs[side].append(got)
                lines.append(f"-- {side}, process {process + 1}, load average {load}")
                for name in programs:
                    plain, on, on_r, on_min, off, off_r, off_min = got[name]
                    lines.append(f"  {short[name]:<20} plain loop {plain:6.2f} ms   probe on {on:6.2f} ms {on_r:.2f}x "
                                 f"({on_min:.2f}x)   probe off {off:6.2f} ms {off_r:.2f}x ({off_min:.2f}x)")
                print("\n".join(lines[-1 - len(programs):]), file=sys.stderr, flush=True)
    lines.append("medians over the processes (of each process's median ratio; in brackets, of its minima ratio):")
    for side in ("before", "after"):
        for name in programs:
            on, on_min, off, off_min = (statistics.median(run[name][i] for run in runs[side]) for i in (2, 3, 5, 6))
            lines.append(f"  {side:<6} {short[name]:<20} probe on {on:.2f}x ({on_min:.2f}x)   "
                         f"probe off {off:.2f}x ({off_min:.2f}x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--programs", nargs="+", choices=list(PROGRAMS), default=list(PROGRAMS))
    parser.add_argument("--profile", action="store_true", help="a cProfile of 3 interpreter steps per program")
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="then this script of another checkout (an earlier tree) and this one, alternated")
    parser.add_argument("--processes", type=int, default=3, help="processes per tree with --against (default 3)")
    parser.add_argument("--output", help="also write the report here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the floor and the interpreter alike: dispatch, not kernels
    lines = [f"$ python benchmarks/host_overhead.py {' '.join(sys.argv[1:])}", machine(),
             f"config: one rank's action list in a stand-in world, links emulated by none, no optimizer step; "
             f"{args.rounds} alternated rounds (an interpreter step, a plain loop, an interpreter step without the "
             f"memory probe), medians"]
    for name in args.programs:
        path, sizes, rank = PROGRAMS[name]
        lines += measure(name, path, sizes, rank, args.rounds, args.profile)
        print("\n".join(lines[-9:]), file=sys.stderr, flush=True)
    if args.against is not None:
        lines += against(args.against.resolve(), args.processes, args.rounds, args.programs)
    lines.append(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
