"""The interpreter against torch.distributed.pipelining on the same model, mesh and gloo world.

Run: ``.venv/bin/python benchmarks/interpreter_vs_torch.py [--pp 2] [--rounds 7]``.

One gloo world of ``pp`` local ranks (torch.distributed.pipelining has no tensor
parallelism, so the mesh is ``pp`` only) runs a tiny Llama with the same seeded weights and
batches through:

* the interpreter's ``one_f_one_b`` (fold none)    vs  ``Schedule1F1B``;
* the interpreter's ``dualpipe_v`` and ``w_helix`` (fold u)  vs  ``ScheduleDualPipeV``;
* ``w_helix`` with strand interleaving on vs off.

Runs alternate (interpreter, peer, interpreter, …) after a warm-up step each, one
training step (forward + backward, no optimizer) per run, between barriers; the step time
of a run is the slowest rank's. The script prints the machine, the configuration, the
median step times and their ratio (interpreter / peer: below 1 is faster). Both sides
compute the same loss, which is printed as a check. torch's stages run the reference
model's operators under autograd; the interpreter runs its explicit kernels.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
import warnings
from datetime import timedelta

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV  # noqa: E402

from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.ops.comm import DistComm  # noqa: E402
from dhelix.interpreter.execute.executor import Executor  # noqa: E402
from dhelix.interpreter.ops.kernels import EPS  # noqa: E402
from dhelix.interpreter.verify.reference import ReferenceModel, make_batch, reference_layer  # noqa: E402
from dhelix.dsl.planner.si_plan import op_by_op_plan  # noqa: E402
from dhelix.interpreter.ops.weights import EMBEDDING, FINAL_NORM, LM_HEAD  # noqa: E402

SEED, DATA_SEED = 0, 1


def program(pp: int, pipeline: str, fold: str, microbatches: int):
    """The benchmark model on ``pp`` ranks, one per "node"."""
    return check_text(f"""
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model bench {{ layers = {4 * pp}  hidden = 128  ffn = 256  heads = 4  kv_heads = 2  seq = 64
  vocab = 512  dtype = fp32  layer = llama }}
cluster {{ nodes = {pp}  gpus_per_node = 1 }}
mesh {{ pp = {pp} }}
train {{ micro_batch = 2  microbatches = {microbatches} }}
fold {fold}
pipeline {pipeline}
""", "bench.dhx")


class StageModule(torch.nn.Module):
    """Layers ``layers`` of the reference model as an nn.Module, with the embedding on the
    first stage and the final norm and LM head (returning logits) on the last."""

    def __init__(self, reference: ReferenceModel, layers: range, first: bool, last: bool):
        super().__init__()
        self.reference, self.layers, self.first, self.last = reference, layers, first, last
        names = [n for n in reference.params if any(n.startswith(f"layers.{i}.") for i in layers)]
        names += ([EMBEDDING] if first else []) + ([FINAL_NORM, LM_HEAD] if last else [])
        self.weights = torch.nn.ParameterDict(
            {n.replace(".", "__"): torch.nn.Parameter(reference.params[n].detach().clone()) for n in names})

    def forward(self, x):
        micro_batch = self.reference.program.train.micro_batch
        if self.first:
            x = F.embedding(x.reshape(-1), self.weights[EMBEDDING])
        for layer in self.layers:
            weights = {op: self.weights[f"layers__{layer}__{op}"] for op in self.reference.plan.layer_specs}
            x = reference_layer(self.reference.plan.full_forward, weights, x, micro_batch)
        if self.last:
            x = F.rms_norm(x, (x.shape[-1],), self.weights[FINAL_NORM], eps=EPS) @ self.weights[LM_HEAD]
        return x


def loss_fn(logits, targets):
    """Mean token cross-entropy of one micro-batch (the reference model's loss)."""
    return F.cross_entropy(logits, targets.reshape(-1))


def _example_io(prog, index: int, count: int):
    # Static shapes: torch then skips its metadata exchange (which needs NumPy).
    micro_batch, seq = prog.train.micro_batch, prog.model.get("seq")
    hidden = torch.empty(micro_batch * seq, prog.model.get("hidden"), requires_grad=True)
    inputs = torch.zeros(micro_batch, seq, dtype=torch.long) if index == 0 else hidden
    outputs = torch.empty(micro_batch * seq, prog.model.get("vocab")) if index == count - 1 else hidden
    return inputs, outputs


def torch_schedule(prog, rank: int, kind):
    """``kind`` (Schedule1F1B or ScheduleDualPipeV) over this rank's stages of ``prog``."""
    reference = ReferenceModel(prog, SEED)
    count = len(prog.placement.stages)
    stages = [PipelineStage(StageModule(reference, s.layers, s.index == 0, s.index == count - 1),
                            s.index, count, torch.device("cpu"), *_example_io(prog, s.index, count))
              for s in prog.placement.stages if s.rank == rank]
    stages.sort(key=lambda stage: stage.stage_index)
    if kind is Schedule1F1B:
        return kind(stages[0], prog.train.microbatches, loss_fn=loss_fn), stages
    return kind(stages, prog.train.microbatches, loss_fn=loss_fn), stages


def run_torch(schedule, stages, batch, last_stage: int):
    """One step of a torch schedule; the loss (mean over micro-batches) where the last stage is."""
    ids, targets = (t.reshape(-1, t.shape[-1]) for t in (batch.inputs, batch.targets))
    indices = {stage.stage_index for stage in stages}
    losses: list = []
    args = (ids,) if 0 in indices else ()
    kwargs = dict(target=targets, losses=losses) if last_stage in indices else {}
    schedule.step(*args, **kwargs)
    for stage in stages:
        stage.submod.zero_grad(set_to_none=True)
    return torch.stack(losses).mean().item() if losses else None


def timed(fn) -> float:
    """Seconds of ``fn()`` between barriers, the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def compare(label: str, left, right, rounds: int, rank: int) -> None:
    """Alternate ``left`` and ``right`` for ``rounds`` rounds after a warm-up of each and
    print the median step times and the ratio on rank 0."""
    left(), right()
    times = {"left": [], "right": []}
    for _ in range(rounds):
        times["left"].append(timed(left))
        times["right"].append(timed(right))
    if rank == 0:
        a, b = statistics.median(times["left"]), statistics.median(times["right"])
        print(f"{label:<58} {1e3 * a:>9.1f} ms {1e3 * b:>9.1f} ms {a / b:>7.3f}", flush=True)


def _pairs(pp: int, microbatches: int, rank: int):
    comm_cache: dict = {}

    def interpreter(pipeline, fold, si=True):
        prog = program(pp, pipeline, fold, microbatches)
        comm = comm_cache.setdefault(fold, DistComm(prog.mesh))
        executor = Executor(prog, comm, seed=SEED, si=si, plan_for=op_by_op_plan)
        batch = make_batch(prog, DATA_SEED)
        return prog, batch, lambda: executor.step(batch)

    def peer(prog, batch, kind):
        schedule, stages = torch_schedule(prog, rank, kind)
        return lambda: run_torch(schedule, stages, batch, len(prog.placement.stages) - 1)

    prog, batch, one_f_one_b = interpreter("one_f_one_b", "none")
    yield "interpreter one_f_one_b / torch Schedule1F1B", one_f_one_b, peer(prog, batch, Schedule1F1B)
    prog_v, batch_v, dualpipe = interpreter("dualpipe_v", "u")
    torch_v = peer(prog_v, batch_v, ScheduleDualPipeV)
    yield "interpreter dualpipe_v (SI on) / torch ScheduleDualPipeV", dualpipe, torch_v
    _, _, helix = interpreter("w_helix", "u")
    yield "interpreter w_helix (SI on) / torch ScheduleDualPipeV", helix, torch_v
    _, _, helix_off = interpreter("w_helix", "u", si=False)
    yield "interpreter w_helix: SI on / SI off", helix, helix_off


def _check_losses(pp: int, microbatches: int, rank: int) -> None:
    prog = program(pp, "one_f_one_b", "none", microbatches)
    executor = Executor(prog, DistComm(prog.mesh), seed=SEED)
    batch = make_batch(prog, DATA_SEED)
    ours = executor.step(batch).item()
    schedule, stages = torch_schedule(prog, rank, Schedule1F1B)
    theirs = torch.tensor([run_torch(schedule, stages, batch, pp - 1) or 0.0])
    dist.all_reduce(theirs)
    if rank == 0:
        print(f"loss check (1F1B): interpreter {ours:.6f}, torch {theirs.item():.6f}", flush=True)


def worker(rank: int, world: int, port: int, rounds: int, microbatches: int) -> None:
    """One rank of the benchmark world: the loss check, then every comparison."""
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    torch.manual_seed(SEED)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        _check_losses(world, microbatches, rank)
        if rank == 0:
            print(f"{'comparison':<58} {'left':>12} {'right':>12} {'ratio':>7}", flush=True)
        for label, left, right in _pairs(world, microbatches, rank):
            compare(label, left, right, rounds, rank)
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Parse the options, print the machine and the configuration, spawn the world."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (gloo processes)")
    parser.add_argument("--rounds", type=int, default=7, help="timed runs of each side")
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; python {sys.version.split()[0]}, torch {torch.__version__}")
    print(f"config: tiny Llama, {4 * args.pp} layers, hidden 128, seq 64, micro_batch 2, "
          f"{args.microbatches} micro-batches; gloo world of {args.pp} ranks (mesh pp = {args.pp}); "
          f"median of {args.rounds} alternated runs")
    print("work per step, both sides: forward and backward of every micro-batch, gradients kept; "
          "no optimizer step and no DP gradient sync on either (dp = 1)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(worker, args=(args.pp, port, args.rounds, args.microbatches), nprocs=args.pp,
                       start_method="spawn")


if __name__ == "__main__":
    main()
