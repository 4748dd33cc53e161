"""dhelix's predictions for Centauri's evaluation (ASPLOS'24, sec. 5), beside what the paper reports.

Centauri's Table 4 LLaMA sizes (hidden, heads, layers; seq 2048; LLaMA-1: multi-head attention,
SwiGLU width 2/3 of 4h rounded up to 256, vocabulary 32000) on its Cluster A (the shipped
``a100`` profile: 8 A100-80G per node on NVSwitch, 25 Gb/s of InfiniBand per GPU), bf16:

* FSDP 16 on 2 nodes (``dp = 16``, ``zero = 3``), micro-batch 1, 2 and 4 sequences per device,
  4 micro-batches per step. Centauri = ``partition { group weights }`` with the orders and the
  backward priority the planner chooses (the weight gathers across nodes first, the gradient
  reduce-scatters inside the node first; each GEMM's dgrad or wgrad first, Eq. 1). The row
  "+ weight chunks" adds the workload partition of the weight gathers: every GEMM split over
  column blocks of its weight, each block gathered and reduce-scattered on its own
  (``chunk qkv along outputs by auto``, …, the counts chosen by the cost model, Algorithm 1).
* DP 16 on 2 nodes: baseline ZeRO-0 (one all-reduce per layer's gradients, issued as the
  backward produces them, as DDP's buckets); Centauri = its primitive substitution, ZeRO-1
  (reduce-scatter, then the all-gather of the updated weights), with the model-level overlap
  of that all-gather with the next forward (``train { param_gather = forward }``); the row
  "ZeRO-1, gather after step" keeps the all-gather after the optimizer; "vs ZeRO-1 without
  overlap" compares with the paper's ZeRO-1 baseline instead (Megatron's distributed optimizer
  of 2023: ``grad_reduce = step``, the reduce-scatter after the backward, the all-gather after
  the step) — its SI columns run that baseline on the W; "+ launch N, interl."
  adds Centauri's choice of micro-batches launched together (``launch = auto``, Eq. 2) on two
  model chunks per rank (``fold loop(2)``, ``interleaved_1f1b``; no SI blocks there, so its
  SI columns repeat the Centauri one).
* TP 4 + PP 3 + DP 4 on 6 nodes, 6 micro-batches (the paper's gradient accumulation), ZeRO-1.
  Centauri = ``partition { chunk ag2 + fc1 + act + fc2 + rs2 by auto }`` (workload partition of
  the MLP, its count chosen by the cost model) and ``param_gather = forward``; its "+ launch"
  row adds ``launch = auto`` on the interleaved schedule as for DP 16; "vs no overlap" compares it
  with Megatron's baseline of 2023, whose gradients are reduced after the pipeline
  (``grad_reduce = step``).

* FSDP + DP on 6 nodes (48 GPUs), Centauri's DP3+FSDP16, DP6+FSDP8 and DP12+FSDP4: hybrid
  sharding, ``dp = 48``, ``zero = 3``, ``shard = 16 | 8 | 4``, micro-batch 1, 4 micro-batches.
  Centauri = the backward priority chosen by cost (Eq. 1), and for DP3+FSDP16, whose shard
  groups span 2 nodes, ``group weights`` (the shard group's collectives over its own
  sub-groups across and inside the nodes); DP6+FSDP8's and DP12+FSDP4's lie inside a node.

For each: the baseline (1F1B, no partition, SI off: Megatron), Centauri only (1F1B with the
partition), SI only (the W schedule, fold u, SI on, no partition) and Centauri + SI, with the
simulated step time and the speedup over the baseline. The paper reports up to 1.45x for single
parallelism (FSDP, DP) and up to 1.49x for hybrid. Not modelled: separate forward and
backward launch counts (Eq. 2's L1, L2: on
interleaved 1F1B a larger backward count breaks the warm-up and a smaller one only delays the
gradients, see the results file). Predictions from the shipped profile, not
measurements:

    .venv/bin/python benchmarks/centauri_table4.py
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

from dhelix.dsl.core.errors import DhelixError, first_message
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.launch import make_choices
from dhelix.dsl.simulator.events import has_si, schedule_plan, simulate
from dhelix.dsl.simulator.costs import cost_of
from dhelix.dsl.simulator.report import unfolded_1f1b, unpartitioned

HERE = Path(__file__).resolve().parent

#: Centauri's Table 4 (hidden, heads, layers); Big lists 8, 10 and 30 layers.
SIZES = {"Small": (4096, 32, 18), "Medium": (5120, 40, 15), "Big": (6656, 52, 30), "Large": (8192, 64, 8)}
PAPER = {"single": "up to 1.45x", "hybrid": "up to 1.49x"}

TEMPLATE = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model llama {{ layers = {layers}  hidden = {hidden}  ffn = {ffn}  heads = {heads}  kv_heads = {heads}  seq = 2048
  vocab = 32000  dtype = bf16  layer = llama }}
cluster {{ nodes = {nodes}  gpus_per_node = 8  profile = "{profile}" }}
mesh {{ {mesh} }}
train {{ micro_batch = {batch}  microbatches = {microbatches}  zero = {zero}  {train} }}
fold {fold}
pipeline {pipeline}
{partition}
"""


def ffn_of(hidden: int) -> int:
    """LLaMA-1's SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256."""
    return -(-(8 * hidden // 3) // 256) * 256


def pipeline_ranks(mesh: str) -> int:
    """The ``pp`` of a mesh block's text (``"tp = 4  dp = 4  pp = 3"`` gives 3; 1 when unset)."""
    words = mesh.replace("=", " = ").split()
    return next((int(words[i + 2]) for i, word in enumerate(words[:-2]) if word == "pp" and words[i + 1] == "="), 1)


def program_text(size: str, *, mesh: str, nodes: int, batch: int, microbatches: int, zero: int, partition: str = "",
                 train: str = "", fold: str = "u", pipeline: str = "w_helix", profile: str = "a100") -> str:
    """The text of the program of Table 4's ``size`` on ``nodes`` nodes of 8 GPUs with the given mesh,
    train settings and partition block. Fold u whose layers do not split into 2 stages per pipeline
    rank (Medium's 15) falls back to fold none with 1F1B, which has no SI blocks (as ``dhelix new``)."""
    hidden, heads, layers = SIZES[size]
    if fold == "u" and layers % (2 * pipeline_ranks(mesh)):
        fold, pipeline = "none", "one_f_one_b"
    return TEMPLATE.format(layers=layers, hidden=hidden, ffn=ffn_of(hidden), heads=heads, nodes=nodes, mesh=mesh,
                           batch=batch, microbatches=microbatches, zero=zero, train=train, fold=fold,
                           pipeline=pipeline, profile=profile,
                           partition=f"partition {{\n  {partition.strip()}\n}}" if partition else "")


def program(size: str, **settings):
    """The checked program of :func:`program_text` (same settings) with the choices ``plan``,
    ``simulate`` and ``run`` make where the program leaves them to the tools
    (:func:`~dhelix.dsl.simulator.launch.make_choices`: the planner's orders, backward priority
    and chunk counts, the counts then settled by the whole step, the launch counts). A profile
    given by path is read relative to this folder."""
    text = program_text(size, **settings)
    return make_choices(check_text(text, str(HERE / f"{size}.dhx")))[0]


#: Centauri's workload partition of FSDP's weight gathers: every GEMM over blocks of its
#: weight's columns, each block gathered on its own, the counts chosen by the cost model.
WEIGHT_CHUNKS = [f"chunk {gemm} along outputs by auto" for gemm in ("qkv", "prj", "fc1", "fc2")]

#: Centauri's model level: chunks launched together (train { launch = auto }, Eq. 2) need an
#: interleaved schedule: two model chunks per rank.
INTERLEAVED = dict(fold="loop(2)", pipeline="interleaved_1f1b")


def _si(prog):
    """The simulation of ``prog`` with its SI plan; None when its schedule has no SI block (fold none)."""
    if not has_si(prog):
        return None
    cost = cost_of(prog)
    return simulate(prog, schedule_plan(prog, cost), cost=cost)


def four(centauri, plain):
    """Step seconds of baseline, Centauri only, SI only, Centauri + SI (and peak memory GB of each);
    None for the SI variants of a program without SI blocks."""
    return figures((simulate(unfolded_1f1b(plain)), simulate(unfolded_1f1b(centauri)), _si(plain), _si(centauri)))


def figures(sims):
    """The step seconds and peak memory GB of each simulation (None for None)."""
    return [s and s.step_time for s in sims], [s and s.peak_rank.memory / 1e9 for s in sims]


#: A100-80G: a predicted peak above it is marked (the run would not fit).
MEMORY_GB = 80


def row(label: str, times, memory, paper: str) -> str:
    """One line of the table: each variant's step time and speedup over the first ('!': its peak memory
    is above the device's; 'no SI (fold none)' for a variant that was not simulated), the peaks, the paper's figure."""
    base = times[0]
    cells = "  ".join(f"{'no SI (fold none)':>18}" if t is None else
                      f"{t:8.3f} s {base / t:5.2f}x{'!' if m > MEMORY_GB else ' '}" for t, m in zip(times, memory))
    peaks = "/".join("-" if m is None else f"{m:.0f}" for m in memory)
    return f"{label:47} {cells}   {peaks:>11}   {paper}"


def fsdp16_rows(size: str) -> None:
    """FSDP 16 on 2 nodes, group-partitioned, and with the weight gathers chunked too."""
    for batch in (1, 2, 4):
        try:
            kw = dict(mesh="dp = 16", nodes=2, batch=batch, microbatches=4, zero=3)
            centauri = program(size, partition="group weights", **kw)
            times, memory = four(centauri, unpartitioned(centauri))
            print(row(f"FSDP16, 2 nodes, b={batch}", times, memory, PAPER["single"]))
            chunked = program(size, partition="\n".join(["group weights", *WEIGHT_CHUNKS]), **kw)
            times, memory = four(chunked, unpartitioned(chunked))
            counts = ", ".join(f"{op.origin} {op.columns[1]}" for op in chunked.forward.ops
                               if op.op == "gemm" and op.columns and op.columns[0] == 0)
            print(row(f"FSDP16, 2 nodes, b={batch} + weight chunks", times, memory, PAPER["single"])
                  + f"   ({counts or 'none chosen'})")
        except DhelixError as exc:
            print(f"{'FSDP16, 2 nodes, b=' + str(batch):47} not run: {first_message(exc)}")


def dp16_rows(size: str) -> None:
    """DP 16 on 2 nodes: ZeRO-1 against ZeRO-0 and against ZeRO-1 without overlap, and launched together."""
    for batch in (1, 4):
        try:
            kw = dict(mesh="dp = 16", nodes=2, batch=batch, microbatches=4)
            zero0 = program(size, zero=0, **kw)
            for label, train in (("ZeRO-1, gather under fwd", "param_gather = forward"),
                                 ("ZeRO-1, gather after step", "")):
                zero1 = program(size, zero=1, train=train, **kw)
                sims = (simulate(unfolded_1f1b(zero0)), simulate(unfolded_1f1b(zero1)), _si(zero0), _si(zero1))
                print(row(f"DP16, 2 nodes, b={batch} ({label})", *figures(sims), PAPER["single"]))
            # The paper's ZeRO-1 baseline (Megatron's distributed optimizer of 2023): the
            # gradients reduce-scattered after the backward, the weights gathered after the step.
            late = program(size, zero=1, train="grad_reduce = step", **kw)
            zero1 = program(size, zero=1, train="param_gather = forward", **kw)
            sims = (simulate(unfolded_1f1b(late)), simulate(unfolded_1f1b(zero1)), _si(late), _si(zero1))
            print(row(f"DP16, 2 nodes, b={batch} (vs ZeRO-1 without overlap)", *figures(sims), PAPER["single"]))
            launched = program(size, zero=1, train="param_gather = forward  launch = auto", **kw, **INTERLEAVED)
            sims = (simulate(unfolded_1f1b(zero0)), simulate(launched), _si(zero0), simulate(launched))
            print(row(f"DP16, 2 nodes, b={batch} (+ launch {launched.launch}, interl.)",
                      *figures(sims), PAPER["single"]))
        except DhelixError as exc:
            print(f"{'DP16, 2 nodes, b=' + str(batch):47} not run: {first_message(exc)}")


def hybrid_rows(size: str) -> None:
    """TP 4 + PP 3 + DP 4 on 6 nodes: the MLP chunked, the gathers under the forward, launched together."""
    try:
        kw = dict(mesh="tp = 4  dp = 4  pp = 3", nodes=6, batch=1, microbatches=6, zero=1)
        centauri = program(size, partition="chunk ag2 + fc1 + act + fc2 + rs2 by auto",
                           train="param_gather = forward", **kw)
        plain = program(size, **kw)
        times, memory = four(centauri, plain)
        print(row("TP4+PP3+DP4, 6 nodes, m=6", times, memory, PAPER["hybrid"]))
        launched = program(size, partition="chunk ag2 + fc1 + act + fc2 + rs2 by auto",
                           train="param_gather = forward  launch = auto", **kw, **INTERLEAVED)
        sims = (simulate(unfolded_1f1b(plain)), simulate(launched), _si(plain), simulate(launched))
        print(row(f"TP4+PP3+DP4, 6 nodes, m=6 (+ launch {launched.launch}, interl.)",
                  *figures(sims), PAPER["hybrid"]))
        # Megatron's baseline of 2023: the gradients reduced after the pipeline.
        late = program(size, train="grad_reduce = step", **kw)
        sims = (simulate(unfolded_1f1b(late)), simulate(launched), _si(late), simulate(launched))
        print(row(f"TP4+PP3+DP4, m=6 (+ launch {launched.launch}) vs no overlap",
                  *figures(sims), PAPER["hybrid"]))
    except DhelixError as exc:
        print(f"{'TP4+PP3+DP4, 6 nodes, m=6':47} not run: {first_message(exc)}")


def hsdp_rows(size: str) -> None:
    """FSDP + DP on 6 nodes: hybrid sharding with shard groups of 16, 8 and 4."""
    for shard in (16, 8, 4):
        label = f"DP{48 // shard}+FSDP{shard} (HSDP), 6 nodes, b=1"
        try:
            kw = dict(mesh="dp = 48", nodes=6, batch=1, microbatches=4, zero=3, train=f"shard = {shard}")
            partition = "group weights" if shard > 8 else " "  # spans nodes of 8 GPUs
            times, memory = four(program(size, partition=partition, **kw), program(size, **kw))
            print(row(label, times, memory, PAPER["hybrid"]))
        except DhelixError as exc:
            print(f"{label:47} not run: {first_message(exc)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    print(f"$ .venv/bin/python benchmarks/centauri_table4.py{''.join(' ' + a for a in given)}")
    print(f"machine: {platform.platform()}, Python {platform.python_version()} (predictions: the figures do not "
          f"depend on it); date: {datetime.date.today()}")
    print("profile a100 (Centauri's Cluster A), bf16, seq 2048; step time and speedup over the baseline")
    print(f"peak GB: the four variants' predicted peak memory per GPU; '!': above the A100's {MEMORY_GB} GB")
    head = "  ".join(f"{name:>18}" for name in ("baseline", "Centauri only", "SI only", "Centauri + SI"))
    print(f"{'configuration':47} {head}   {'peak GB':>11}   paper (Centauri)")
    for size in args.sizes:
        layers = SIZES[size][2]
        print(f"-- LLaMA {size} (hidden {SIZES[size][0]}, {SIZES[size][1]} heads, {layers} layers)")
        for rows in (fsdp16_rows, dp16_rows, hybrid_rows, hsdp_rows):
            rows(size)
    return 0



if __name__ == "__main__":
    sys.exit(main())
