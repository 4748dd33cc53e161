"""Centauri's evaluation (ASPLOS'24, sec. 5) predicted by dhelix: its baselines by name, both clusters.

Every model size of Table 4 (Small, Medium, Big with 30 layers, Large) and every parallel family of
Figs. 8-11 (FSDP 16 and DP 16 on 2 nodes, FSDP + DP and TP + PP + DP on 6 nodes), on Centauri's
Cluster A (the shipped ``a100`` profile: 25 Gb/s per GPU across nodes) and Cluster B
(``benchmarks/centauri_cluster_b.yaml``: the same with 100 Gb/s), then the scalability series of
Figs. 13-14. Each configuration is a program this script writes (``centauri_table4.program_text``:
the stdlib ``llama`` layer, bf16, seq 2048) and prices as ``dhelix simulate`` does
(``priced_program``: the planner's ``by auto`` counts, group orders, backward priority and launch
counts, then the step simulator). Each baseline is the paper's, realised by dhelix settings that
the output lists; Centauri is the same program with its partition block and model-level settings.
Predictions from the profiles, not measurements:

    .venv/bin/python benchmarks/centauri_eval.py
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

from centauri_table4 import HERE, MEMORY_GB, SIZES, WEIGHT_CHUNKS, program_text
from dhelix.dsl.core.errors import DhelixError, first_message
from dhelix.dsl.simulator.events import simulate
from dhelix.dsl.simulator.launch import priced_program

#: Centauri's two clusters (sec. 5, "Testbed"): the profile each is priced with.
CLUSTERS = {"A": ("a100", "25 Gb/s per GPU across nodes"),
            "B": ("centauri_cluster_b.yaml", "100 Gb/s per GPU across nodes")}

#: 1F1B without folding: the schedule of every baseline without pipeline parallelism.
ONE_F_ONE_B = dict(fold="none", pipeline="one_f_one_b")
INTERLEAVED = "fold = loop(2), pipeline = interleaved_1f1b"
#: Table 2's substitution of the HSDP replicas' all-reduce (ZeRO-1/2 across the replicas).
SUBSTITUTED = "substitute weights as reduce_scatter + all_gather"

#: The paper's baselines (sec. 5, "Baseline"; Fig. 6a for OOO) and the dhelix settings that realise them.
BASELINES = {
    "DDP": "zero = 0, grad_reduce = backward: each layer's gradients all-reduced as the backward finishes "
           "the layer (DDP's buckets, one per layer)",
    "OOO": "the baseline it sits beside plus partition { backward dgrad first }: the activation gradient first "
           "in every layer (how Centauri's Fig. 6a draws OOO back-prop). OOO's own reordering across layers "
           "(reverse first-k) is not expressible: dhelix orders a backward within a layer, or splits W off",
    "ZeRO-1": "zero = 1, grad_reduce = step, param_gather = step: Megatron's distributed optimizer as of the "
              "paper's Megatron (gradients reduce-scattered after the backward, weights gathered after the step)",
    "ZeRO-2": "zero = 2: each micro-batch's layer gradients reduce-scattered after its backward, weights "
              "gathered after the step",
    "ZeRO-3": "zero = 3 (FSDP): each layer's weights gathered ahead in order of use, its gradients "
              "reduce-scattered per micro-batch; no partition block",
    "HSDP": "zero = 3, shard = K: ZeRO-3 in groups of K, the pieces' gradients all-reduced across the "
            "replicas under the backward",
    "ZeRO-1+2+3": f"zero = 3, shard = K, partition {{ {SUBSTITUTED} }}: "
                  "ZeRO-3 in the shard group, ZeRO-1/2 across the replicas, overlapped directly",
    "Megatron-LM": f"zero = 1, grad_reduce = backward, param_gather = forward, {INTERLEAVED} with g = p: "
                   "Megatron's --overlap-grad-reduce and --overlap-param-gather (its TP/SP collectives "
                   "not overlapped)",
    "Megatron-23": "zero = 1, grad_reduce = step, param_gather = step, same pipeline: the paper's "
                        "Megatron (e6d7e09), no DP overlap",
}

#: Centauri per family, as dhelix writes it.
CENTAURI = {
    "FSDP": "partition { group weights; chunk qkv|prj|fc1|fc2 along outputs by auto } (backward priority by "
            "cost, Eq. 1)",
    "DP": f"zero = 1, param_gather = forward, grad_reduce = backward, launch = auto, launch_backward = auto, "
          f"{INTERLEAVED} (the all-reduce substituted, its halves under the backward and the next forward, "
          "Eq. 2's L1 and L2 chosen)",
    "HSDP": "group weights where the shard group spans nodes, the weight chunks as for FSDP; the replicas' "
            "all-reduce whole or substituted (reduce_scatter + all_gather), whichever is predicted faster",
    "TP+PP+DP": "zero = 1, partition { chunk ag2 + fc1 + act + fc2 + rs2 by auto }, param_gather = forward, "
                "launch = auto, launch_backward = auto, interleaved 1F1B",
}

PAPER_SINGLE, PAPER_HYBRID = "up to 1.45x (single)", "up to 1.49x (hybrid)"


def predict(size: str, profile: str, settings: dict):
    """The simulation of Table 4's ``size`` with ``settings`` (keywords of ``program_text``) on
    ``profile``, priced as ``dhelix simulate`` prices a file; a DhelixError when it does not check."""
    text = program_text(size, profile=profile, **settings)
    program, _ = priced_program(text, str(HERE / f"{size}.dhx"))
    return simulate(program)


def pipeline_for(size: str, pp: int, interleaved: bool) -> dict:
    """Interleaved 1F1B on two model chunks per rank where the layers split so, else 1F1B."""
    if interleaved and SIZES[size][2] % (2 * pp) == 0:
        return dict(fold="loop(2)", pipeline="interleaved_1f1b")
    return ONE_F_ONE_B


#: Width of a table's label column and of each figure's.
LABEL, CELL = 24, 12


def cells(sims: dict) -> str:
    """Each variant's step seconds ('!': its predicted peak is above the A100's memory; '-': not run)."""
    return "".join(f"{'-':>{CELL}} " if s is None else
                   f"{s.step_time:{CELL}.3f}{'!' if s.peak_rank.memory / 1e9 > MEMORY_GB else ' '}"
                   for s in sims.values())


def speedups(sims: dict) -> str:
    """Centauri's speedup over each baseline, then over the fastest baseline that fits in memory."""
    centauri = sims["Centauri"]
    baselines = [s for name, s in sims.items() if name != "Centauri"]
    fitting = [s.step_time for s in baselines if s and s.peak_rank.memory / 1e9 <= MEMORY_GB]
    if centauri is None:
        return "".join(f"{'-':>{CELL}}" for _ in range(len(baselines) + 1))
    ratios = [s and s.step_time / centauri.step_time for s in baselines]
    ratios.append(min(fitting) / centauri.step_time if fitting else None)
    return "".join(f"{'-':>{CELL - 1}} " if r is None else f"{r:{CELL - 1}.2f}x" for r in ratios)


def header(names) -> str:
    """The column heads of a family's table: step seconds of each, then Centauri's speedups."""
    baselines = [name for name in names if name != "Centauri"]
    times = "".join(f"{name:>{CELL}} " for name in names)
    over = "".join(f"{name:>{CELL}}" for name in [*baselines, "best fits"])
    return (f"{'':{LABEL}} {'step s':^{len(times)}} | {'Centauri over':^{len(over)}} |\n"
            f"{'size   b  mesh':{LABEL}} {times} | {over} | paper")


def emit(label: str, variants: dict, size: str, profile: str, paper: str) -> None:
    """Simulate each variant (name -> settings), print its row; a variant that does not check is '-'
    and its reason follows the row."""
    sims, reasons = {}, {}
    for name, settings in variants.items():
        try:
            sims[name] = predict(size, profile, settings)
        except DhelixError as exc:
            sims[name] = None
            reasons.setdefault(first_message(exc), []).append(name)
    print(f"{label:{LABEL}} {cells(sims)} | {speedups(sims)} | {paper}")
    for reason, names in reasons.items():
        print(f"{'':{LABEL}}   not run ({', '.join(names)}): {reason}")


def fsdp16(size: str, profile: str) -> None:
    """Fig. 8: FSDP 16 on 2 nodes, 4 micro-batches of 1, 2 and 4 sequences per device."""
    for batch in (1, 2, 4):
        base = dict(mesh="dp = 16", nodes=2, batch=batch, microbatches=4, zero=3, **ONE_F_ONE_B)
        variants = {"ZeRO-3": base, "OOO": dict(base, partition="backward dgrad first"),
                    "Centauri": dict(base, partition="\n".join(["group weights", *WEIGHT_CHUNKS]))}
        emit(f"{size:6} {batch}  FSDP16", variants, size, profile, "over 1.4x at larger b and model; " + PAPER_SINGLE)


def dp16(size: str, profile: str) -> None:
    """Fig. 9: DP 16 on 2 nodes, 4 micro-batches of 1, 2 and 4 sequences per device."""
    for batch in (1, 2, 4):
        base = dict(mesh="dp = 16", nodes=2, batch=batch, microbatches=4, **ONE_F_ONE_B)
        centauri = dict(base, zero=1, train="param_gather = forward  launch = auto  launch_backward = auto",
                        **pipeline_for(size, 1, interleaved=True))
        if centauri["fold"] == "none":  # no launch count without interleaving
            centauri["train"] = "param_gather = forward"
        variants = {"DDP": dict(base, zero=0), "OOO": dict(base, zero=0, partition="backward dgrad first"),
                    "ZeRO-1": dict(base, zero=1, train="grad_reduce = step"), "ZeRO-2": dict(base, zero=2),
                    "Centauri": centauri}
        mark = "" if centauri["fold"] != "none" else " 1F1B"
        emit(f"{size:6} {batch}  DP16{mark}", variants, size, profile, PAPER_SINGLE)


def hsdp(size: str, profile: str) -> None:
    """Fig. 10: FSDP + DP on 6 nodes (48 GPUs), DP3+FSDP16, DP6+FSDP8, DP12+FSDP4, micro-batch 1."""
    for shard in (16, 8, 4):
        base = dict(mesh="dp = 48", nodes=6, batch=1, microbatches=4, zero=3, train=f"shard = {shard}",
                    **ONE_F_ONE_B)
        chunks = "\n".join((["group weights"] if shard > 8 else []) + WEIGHT_CHUNKS)
        variants = {"HSDP": base, "ZeRO-1+2+3": dict(base, partition=SUBSTITUTED),
                    "OOO": dict(base, partition="backward dgrad first"), "Centauri": dict(base, partition=chunks),
                    "C. subst.": dict(base, partition=chunks + "\n" + SUBSTITUTED)}
        emit_best_of(f"{size:6} 1  DP{48 // shard}+FSDP{shard}", variants, size, profile, PAPER_HYBRID)


def emit_best_of(label: str, variants: dict, size: str, profile: str, paper: str) -> None:
    """As :func:`emit` where Centauri is the faster of its two primitive forms ('Centauri' whole,
    'C. subst.' substituted): Table 2's pruning, which the language does not offer for HSDP's
    all-reduce (``substitute weights as auto``)."""
    substituted = variants.pop("C. subst.")
    try:
        whole_time = predict(size, profile, variants["Centauri"]).step_time
        if predict(size, profile, substituted).step_time < whole_time:
            variants["Centauri"], label = substituted, label + " *"
    except DhelixError:
        pass  # emit says why
    emit(label, variants, size, profile, paper)


#: Fig. 11's meshes: the text names TP4+PP3+DP4; the other two are this script's choice of the
#: "various TP, PP, and DP group configurations" on 48 GPUs.
TP_PP_DP = ((4, 4, "named"), (2, 8, "chosen here"), (8, 2, "chosen here"))


def tp_pp_dp(size: str, profile: str) -> None:
    """Fig. 11: TP + PP 3 + DP on 6 nodes, 6 micro-batches (the paper's gradient accumulation), b = 1 and 4."""
    for tp, dp, origin in TP_PP_DP:
        for batch in (1, 4):
            pipe = pipeline_for(size, 3, interleaved=True)
            base = dict(mesh=f"tp = {tp}  dp = {dp}  pp = 3", nodes=6, batch=batch, microbatches=6, zero=1, **pipe)
            launch = "  launch = auto  launch_backward = auto" if pipe["fold"] != "none" else ""
            variants = {"Megatron-LM": dict(base, train="param_gather = forward"),
                        "Megatron-23": dict(base, train="grad_reduce = step"),
                        "Centauri": dict(base, train="param_gather = forward" + launch,
                                         partition="chunk ag2 + fc1 + act + fc2 + rs2 by auto")}
            note = "" if pipe["fold"] != "none" else " 1F1B"
            emit(f"{size:6} {batch}  TP{tp}DP{dp}{note}", variants, size, profile,
                 PAPER_HYBRID + ("" if origin == "named" else "; mesh chosen here"))


FAMILIES = (
    ("Fig. 8: FSDP 16 on 2 nodes (dp = 16, zero = 3), 4 micro-batches of b sequences", ("ZeRO-3", "OOO"), "FSDP",
     fsdp16),
    ("Fig. 9: DP 16 on 2 nodes (dp = 16), 4 micro-batches of b sequences", ("DDP", "OOO", "ZeRO-1", "ZeRO-2"),
     "DP", dp16),
    ("Fig. 10: FSDP + DP on 6 nodes (dp = 48, zero = 3, shard = 16, 8, 4), b = 1, 4 micro-batches",
     ("HSDP", "ZeRO-1+2+3", "OOO"), "HSDP", hsdp),
    ("Fig. 11: TP + PP 3 + DP on 6 nodes (tp/dp as labelled), 6 micro-batches of b sequences",
     ("Megatron-LM", "Megatron-23"), "TP+PP+DP", tp_pp_dp),
)

#: Figs. 13-14: the model and per-device batch of the scalability series (the paper does not say
#: which it plotted), and the GPU counts (the paper's text reaches 256).
SCALE_SIZE, SCALE_BATCH, SCALE_GPUS = "Big", 2, (16, 32, 64, 128, 256)


def scaling(profile: str, shard: int | None, paper: str) -> None:
    """Fig. 13 (``shard`` None: FSDP over every GPU) or Fig. 14 (FSDP 16 + DP, Centauri as for Fig. 10):
    each variant's step as the GPUs grow at a fixed per-device batch (weak scaling: equal steps are
    equal throughput per GPU)."""
    for gpus in SCALE_GPUS:
        if shard and gpus <= shard:
            continue
        base = dict(mesh=f"dp = {gpus}", nodes=gpus // 8, batch=SCALE_BATCH, microbatches=4, zero=3,
                    train=f"shard = {shard}" if shard else "", **ONE_F_ONE_B)
        chunks = "\n".join(["group weights", *WEIGHT_CHUNKS])
        label, row = f"{SCALE_SIZE:6} {SCALE_BATCH}  {gpus} GPUs", paper if gpus == SCALE_GPUS[-1] else ""
        if not shard:
            emit(label, {"ZeRO-3": base, "Centauri": dict(base, partition=chunks)}, SCALE_SIZE, profile, row)
            continue
        emit_best_of(label, {"HSDP": base, "ZeRO-1+2+3": dict(base, partition=SUBSTITUTED),
                             "Centauri": dict(base, partition=chunks),
                             "C. subst.": dict(base, partition=chunks + "\n" + SUBSTITUTED)}, SCALE_SIZE, profile, row)


#: Figs. 13-14: the paper's words per cluster (its text gives a number for Cluster B's FSDP only).
SCALING_PAPER = {
    ("A", None): "throughput 'comparable to' Cluster B's",
    ("B", None): "nearly 5 % on 256 GPUs",
    ("A", 16): "'a high speedup' over the baselines",
    ("B", 16): "double the speedup of Zero1+2+3 direct overlapping",
}


def main(argv=None) -> int:
    """Print the tables (the command, the machine and date first)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--clusters", nargs="*", default=list(CLUSTERS), choices=list(CLUSTERS))
    parser.add_argument("--no-scaling", action="store_true", help="leave out Figs. 13-14")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    print(f"$ .venv/bin/python benchmarks/centauri_eval.py{''.join(' ' + a for a in given)}")
    print(f"machine: {platform.platform()}, Python {platform.python_version()}; date: {datetime.date.today()} "
          "(predictions: the figures do not depend on the machine)")
    print("Table 4 LLaMA sizes, bf16, seq 2048; step seconds as `dhelix simulate` predicts them; '!': predicted "
          f"peak above the A100's {MEMORY_GB} GB (the paper omits such runs as OOM)")
    print("baselines as the paper defines them, and the dhelix settings that realise each:")
    for name, text in BASELINES.items():
        print(f"  {name}: {text}")
    print("'1F1B' after a mesh: the layers do not split into 2 model chunks per rank, so Centauri (and "
          "Megatron-LM) run 1F1B without launch counts; '*': Centauri's faster primitive form is the "
          "substituted one")
    print("Centauri, per family:")
    for name, text in CENTAURI.items():
        print(f"  {name}: {text}")
    for cluster in args.clusters:
        profile, link = CLUSTERS[cluster]
        for title, names, _, rows in FAMILIES:
            print(f"\n== Cluster {cluster} ({profile}: {link}) -- {title}")
            print(header([*names, "Centauri"]))
            for size in args.sizes:
                rows(size, profile)
    if not args.no_scaling:
        for fig, shard, names in (("13: FSDP (dp = GPUs, zero = 3)", None, ("ZeRO-3",)),
                                  ("14: FSDP 16 + DP (dp = GPUs, zero = 3, shard = 16)", 16, ("HSDP", "ZeRO-1+2+3"))):
            for cluster in args.clusters:
                profile, link = CLUSTERS[cluster]
                print(f"\n== Cluster {cluster} ({profile}: {link}) -- Fig. {fig}, LLaMA {SCALE_SIZE}, b = "
                      f"{SCALE_BATCH}, 4 micro-batches, weak scaling (size and batch chosen here)")
                print(header([*names, "Centauri"]))
                scaling(profile, shard, SCALING_PAPER[cluster, shard])
    return 0


if __name__ == "__main__":
    sys.exit(main())
