"""How long the DP pairing search takes: a Llama TP+SP layer pair and a 40+-operator MoE layer.

Run from the repository root::

    .venv/bin/python benchmarks/planner_speed.py [--max-segment N] [--repeat R] [--unbounded] [--chunked] [--exact]
    .venv/bin/python benchmarks/planner_speed.py --against DIR [--rounds R]

The pair cost is ``dsl.planner.paircost.PairCost`` with each program's profile (the shipped "a40")
when that module is installed, else a synthetic three-lane cost defined below (the numbers
then only show the search's own speed). Every timed run gets a fresh cost object, since
PairCost caches its results. ``--unbounded`` also plans the Llama pair with segments of any
length and says whether the default bound found the same plan. ``--chunked`` also plans the SI
pair of a Llama-70B-shaped layer (TP8 on 64 A40s) whose three Centauri chains (``ag1 + qkv``,
``prj + rs1``, ``ag2 + fc1 + act + fc2 + rs2``) run in 4 and in 8 chunks, as a ``partition``
block written by hand (or by ``dhelix tune`` without SI) makes them. ``--exact`` also plans the
MoE pair with segments of any length (exact over every order within the moving ops' window and
every segmentation) and prints the relaxation's lower bound (``relaxed_total``: no window, no
segment bound), which no plan over any order can beat.

``--against DIR`` times the MoE pair's exact plan here and in another checkout of the project
(DIR, e.g. a ``git worktree`` of an earlier commit), each in a fresh process running that
checkout's own benchmark (``--exact --repeat 1``), the two alternated for ``--rounds`` rounds
(the other first in odd rounds): the wall-clock seconds it prints for the plan, the CPU
seconds of the whole process (on a machine shared with other work they tell more), their
medians and ratios, and whether both found the same total.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from pathlib import Path

from dhelix.dsl.planner.certify import relaxed_total
from dhelix.dsl.planner.pairing import AUTO, plan_layers
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.planner.sequences import DEFAULT_MAX_PREFIXES

ROOT = Path(__file__).resolve().parent.parent

# A MoE layer of 46 forward and 60 backward operators: attention, a tensor-parallel shared
# expert and four routed expert groups, each with its own dispatch and combine all-to-all.
_GROUP = """
  pm{k} = permute(ln2, rt, top_k)
  dsp{k} = all_to_all(pm{k}, ep)
  fc1{k} = grouped_gemm(dsp{k}, hidden, 2 * ffn, experts / ep)
  act{k} = swiglu(fc1{k})
  fc2{k} = grouped_gemm(act{k}, ffn, hidden, experts / ep)
  cmb{k} = all_to_all(fc2{k}, ep)
  up{k} = unpermute(cmb{k}, rt, top_k)"""
MOE_PROGRAM = """
import "stdlib/pipelines.dhx"
layer moe_big {
  in x [tokens / tp, hidden]
  ln1 = rmsnorm(x)
  ag1 = all_gather(ln1, tp)
  qkv = gemm(ag1, hidden, (heads + 2 * kv_heads) * head_dim / tp)
  att = attention(qkv, heads / tp, kv_heads / tp, causal, cp)
  prj = gemm(att, hidden / tp, hidden)
  rs1 = reduce_scatter(prj, tp)
  h1 = add(rs1, x)
  ln2 = rmsnorm(h1)
  ag2 = all_gather(ln2, tp)
  sfc1 = gemm(ag2, hidden, 2 * ffn / tp)
  sact = swiglu(sfc1)
  sfc2 = gemm(sact, ffn / tp, hidden)
  rs2 = reduce_scatter(sfc2, tp)
  rt = router(ln2, experts)""" + "".join(_GROUP.format(k=k) for k in range(4)) + """
  m1 = add(up0, up1)
  m2 = add(m1, up2)
  m3 = add(m2, up3)
  m4 = add(m3, rs2)
  h2 = add(m4, h1)
  out h2
}
model moe_big {
  layers = 8  hidden = 4096  ffn = 2048  heads = 32  kv_heads = 8  seq = 4096  vocab = 32000
  experts = 32  top_k = 2  dtype = bf16  layer = moe_big
}
cluster { nodes = 4  gpus_per_node = 8  profile = "a40" }
mesh { tp = 2  ep = 4  pp = 2  dp = 8 }
train { micro_batch = 1  microbatches = 8 }
fold u
pipeline w_helix
strands {
  overlap tp, ep
  comm_with_comm on
  movable wgrad, router
}
"""

# A Llama-70B-shaped layer pair with Centauri chunk chains (docs/language.md, "Partition").
CHUNKED_PROGRAM = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model llama70b {{
  layers = 80  hidden = 8192  ffn = 28672  heads = 64  kv_heads = 8  seq = 8192  vocab = 128256
  dtype = bf16  layer = llama
}}
cluster {{ nodes = 8  gpus_per_node = 8  profile = "a40" }}
mesh {{ tp = 8  pp = 2  dp = 4 }}
train {{ micro_batch = 1  microbatches = 16  zero = 1 }}
fold u
pipeline w_helix
strands {{ overlap tp  comm_with_comm on  movable wgrad }}
partition {{
  chunk ag1 + qkv by {k}
  chunk prj + rs1 by {k}
  chunk ag2 + fc1 + act + fc2 + rs2 by {k}
}}
"""
CHUNKS = (4, 8)


class SyntheticCost:
    """A stand-in pair cost: op times from shapes, lanes run one op at a time, an op waits
    for its inputs inside the segment, co-executed compute runs 15% slower, and every pair
    pays a 20 µs launch gap."""

    def duration(self, op) -> float:
        tokens, features = op.shape if len(op.shape) == 2 else (1, 1)
        if op.kind == "comm":
            return 2 * tokens * features / (25e9 if op.lane == "local" else 12e9)
        if op.op_class == "gemm" and op.weight:
            return 2 * tokens * op.weight[-2] * op.weight[-1] / 150e12
        if op.op_class == "attention":
            return 2 * tokens * tokens * features / 150e12
        return 6 * tokens * features / 600e9

    def solo(self, ops) -> float:
        return self._span([list(ops)], 1.0)

    def pair(self, fwd, bwd) -> float:
        return self._span([list(fwd), list(bwd)], 1.15) + 20e-6

    def _span(self, strands: list[list], slowdown: float) -> float:
        lanes = {"compute": 0.0, "local": 0.0, "cross": 0.0}
        done: dict[str, float] = {}
        heads = [0] * len(strands)
        while any(h < len(ops) for h, ops in zip(heads, strands, strict=True)):
            starts = [(self._start(ops[h], lanes, done), s) for s, (h, ops) in enumerate(zip(heads, strands))
                      if h < len(ops)]
            start, s = min(starts)
            op = strands[s][heads[s]]
            lane = op.lane if op.kind == "comm" else "compute"
            factor = slowdown if lane == "compute" and len(strands) > 1 else 1.0
            done[op.name] = lanes[lane] = start + self.duration(op) * factor
            heads[s] += 1
        return max(lanes.values())

    def _start(self, op, lanes, done) -> float:
        lane = op.lane if op.kind == "comm" else "compute"
        return max([lanes[lane]] + [done[name] for name in op.inputs if name in done])


def cost_factory(program):
    """A function making a fresh cost for ``program`` and the name of the model behind it."""
    try:
        from dhelix.dsl.planner.paircost import PairCost
        PairCost.for_program(program)
    except Exception as error:  # missing module or profile: the search alone is still timed
        print(f"note: PairCost unavailable ({type(error).__name__}: {error}); using the synthetic cost")
        return SyntheticCost, "synthetic three-lane cost"
    return (lambda: PairCost.for_program(program)), f"PairCost, profile {program.cluster.profile}"


def bench(title: str, program, repeat: int, **bounds) -> object:
    """Plan ``program``'s layer pair ``repeat`` times; print the best time and the plan's figures."""
    make, cost_name = cost_factory(program)
    best, plan = float("inf"), None
    for _ in range(repeat):
        cost = make()
        start = time.perf_counter()
        plan = plan_layers(program.forward, program.backward, program.strands, cost, **bounds)
        best = min(best, time.perf_counter() - start)
    st = plan.stats
    print(f"{title}: {len(plan.forward_order)} + {len(plan.backward_order)} ops, "
          f"{st.forward_orders} x {st.backward_orders} legal orders, "
          f"{st.forward_prefixes} x {st.backward_prefixes} prefixes "
          f"(windows {st.forward_window}/{st.backward_window}), segments <= {st.max_segment or 'any'}")
    print(f"  {best:.3f} s to plan ({cost_name}; {st.pair_evaluations} pair costs); "
          f"{len(plan.pairs)} segment pairs, predicted {plan.total * 1e3:.3f} ms vs sequential "
          f"{plan.sequential * 1e3:.3f} ms (speedup {plan.speedup:.3f}x), comm hidden "
          f"{100 * plan.comm_hidden_fraction:.1f}%")
    return plan


def exact_moe(moe, default, max_prefixes: int) -> None:
    """Plan the MoE pair with segments of any length; print it beside the lower bound of
    every plan over every order (no window) and every segmentation."""
    make, _ = cost_factory(moe)
    start = time.perf_counter()
    bound = relaxed_total(moe.forward, moe.backward, moe.strands, make())
    took = time.perf_counter() - start
    if bound is not None:
        print(f"  lower bound of every plan (every order, no window, any segments): {bound * 1e3:.3f} ms "
              f"({took:.3f} s)")
    exact = bench("moe_big, segments unbounded", moe, 1, max_segment=None, max_prefixes=max_prefixes)
    print(f"  vs the default bounds: {exact.total * 1e3:.3f} vs {default.total * 1e3:.3f} ms")


def _exact_run(checkout: Path, view: Path) -> tuple[float, float, str]:
    """(wall seconds of the MoE pair's exact plan as ``checkout``'s benchmark prints them, CPU
    seconds of its whole process, the plan's total as printed) of one fresh run."""
    import resource
    import subprocess

    from tune_speed import _BOOT

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    command = [sys.executable, "-c", _BOOT, str(view), str(checkout / "benchmarks" / "planner_speed.py"), "--exact",
               "--repeat", "1"]
    # (PYTHONPATH left out: a site hook on it could import another checkout's package first.)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=checkout, env=env).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("moe_big, segments unbounded"))
    found = re.search(r"([0-9.]+) s to plan .* predicted ([0-9.]+) ms", lines[at + 1])
    assert found is not None, lines[at + 1]
    return float(found.group(1)), cpu, found.group(2)


def against(other: Path, rounds: int) -> None:
    """The MoE pair's exact plan timed here and in the checkout ``other``, alternated for
    ``rounds`` rounds; each run, the medians and their ratios printed."""
    import statistics
    import tempfile

    from tune_speed import _package_view

    with tempfile.TemporaryDirectory() as scratch:
        trees = {"this": ROOT, "other": other}
        views = {side: _package_view(tree, Path(scratch) / side) for side, tree in trees.items()}
        walls: dict[str, list[float]] = {"this": [], "other": []}
        cpus: dict[str, list[float]] = {"this": [], "other": []}
        totals: dict[str, set[str]] = {"this": set(), "other": set()}
        for round_ in range(rounds):
            for side in (("other", "this") if round_ % 2 == 0 else ("this", "other")):
                wall, cpu, total = _exact_run(trees[side], views[side])
                walls[side].append(wall)
                cpus[side].append(cpu)
                totals[side].add(total)
                print(f"moe_big exact, round {round_ + 1}, {side} ({trees[side]}): {wall:.1f} s to plan, "
                      f"{cpu:.1f} s CPU for the whole run, total {total} ms "
                      f"(load average {os.getloadavg()[0]:.1f} after)", flush=True)
        here, there = statistics.median(walls["this"]), statistics.median(walls["other"])
        cpu_here, cpu_there = statistics.median(cpus["this"]), statistics.median(cpus["other"])
        print(f"moe_big exact: median {here:.1f} s here against {there:.1f} s there over {rounds} rounds: "
              f"{here / there:.3f}x (CPU {cpu_here:.1f} s against {cpu_there:.1f} s: {cpu_here / cpu_there:.3f}x); "
              f"the same total: {totals['this'] == totals['other'] and len(totals['this']) == 1}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-segment", type=int, default=None,
                        help="at most N ops per segment (0: no bound; default: the planner's own)")
    parser.add_argument("--max-prefixes", type=int, default=DEFAULT_MAX_PREFIXES)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--unbounded", action="store_true", help="also plan Llama with segments of any length")
    parser.add_argument("--exact", action="store_true",
                        help="also plan the MoE pair with segments of any length, and print its lower bound")
    parser.add_argument("--chunked", action="store_true",
                        help="also plan a Llama-70B-shaped pair with three chunk chains (4 and 8 chunks)")
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="time the MoE pair's exact plan here and in the checkout DIR, alternated")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of --against (default 2)")
    args = parser.parse_args(argv)
    if args.against is not None:
        against(args.against.resolve(), args.rounds)
        return 0
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}; date: {time.strftime('%Y-%m-%d')}; load average {load}")
    segment = AUTO if args.max_segment is None else args.max_segment or None
    bounds = dict(max_segment=segment, max_prefixes=args.max_prefixes)
    llama_path = ROOT / "examples" / "llama39b_a40.dhx"
    llama = check_text(llama_path.read_text(), str(llama_path))
    plan = bench("llama39b_a40 (TP8 + SP)", llama, args.repeat, **bounds)
    if args.unbounded:
        free = bench("llama39b_a40, segments unbounded", llama, 1, max_segment=None,
                     max_prefixes=args.max_prefixes)
        print(f"  same total as with segments <= {plan.stats.max_segment}: {free.total == plan.total}")
    moe = check_text(MOE_PROGRAM, str(ROOT / "benchmarks" / "moe_big.dhx"))
    default = bench("moe_big (TP2 EP4, 4 expert groups)", moe, 1, **bounds)
    if args.exact:
        exact_moe(moe, default, args.max_prefixes)
    if args.chunked:
        for k in CHUNKS:
            chunked = check_text(CHUNKED_PROGRAM.format(k=k), str(ROOT / "benchmarks" / f"llama70b_chunk{k}.dhx"))
            bench(f"llama70b TP8, three chains by {k}", chunked, 1, **bounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
