"""One device: the interpreter against plain torch autograd on the same model and batch.

Run: ``python benchmarks/one_device.py [--program benchmarks/one_gpu_llama.dhx] [--rounds 7]``
(on a GPU when one is there, else on the CPU).

With one rank every group has size 1: there is no communication to hide, so this measures
what the interpreter itself costs against the plainest peer — its explicit kernels, its
action list and its strand-interleaved order — on one training step (forward and backward
of every micro-batch, gradients kept, no optimizer step):

* ``torch``: the reference model (the same seeded weights) under autograd, one backward per
  micro-batch, gradients accumulated (what a data loader loop with gradient accumulation does);
* ``interpreter, SI on``: the program's schedule with its SI blocks interleaved
  (``op_by_op``: with nothing to hide, the planner's plan would pair the same ops);
* ``interpreter, SI off``: the same blocks as a forward then a backward.

Runs alternate (torch, SI on, SI off, then the order rotates) after a warm-up step each; a run
is timed between device synchronisations. Prints the machine, the configuration, per side the
median step time, the model TFLOP/s (6 · matmul parameters · tokens plus causal attention,
the usual MFU count) and the ratio against torch, and the peak memory of each side. The loss
of both is printed as a check.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.ops.comm import SingleRankComm  # noqa: E402
from dhelix.interpreter.execute.executor import Executor  # noqa: E402
from dhelix.interpreter.verify.reference import ReferenceModel, make_batch  # noqa: E402
from dhelix.dsl.planner.si_plan import op_by_op_plan  # noqa: E402
from dhelix.interpreter.ops.weights import EMBEDDING, torch_dtype  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SEED, DATA_SEED = 0, 1


def machine(device: torch.device) -> str:
    """The host, the device's name and memory, torch's version."""
    where = f"{os.cpu_count()} CPU cores"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs), " + where
    return f"{platform.node()}: {where}; Python {platform.python_version()}, torch {torch.__version__}" + \
        (f", CUDA {torch.version.cuda}" if device.type == "cuda" else "")


def model_flops(program) -> float:
    """FLOPs of one step's forward and backward as MFU counts them: 6 per matmul parameter
    and token (embedding lookups excluded), plus causal attention's 6 · seq · hidden per token
    and layer (QKᵀ and PV, half the square, three passes)."""
    reference = ReferenceModel(program, SEED, torch.float32)
    matmul = sum(p.numel() for name, p in reference.params.items() if p.dim() == 2 and name != EMBEDDING)
    del reference
    model, train = program.model, program.train
    tokens = train.microbatches * train.micro_batch * model.get("seq")
    attention = 6 * model.get("layers") * model.get("seq") * model.get("hidden")
    return tokens * (6 * matmul + attention)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_side(program, batch, device):
    """One step of the reference model under autograd with gradient accumulation."""
    model = ReferenceModel(program, SEED, torch_dtype(program)).to(device)
    count = batch.inputs.shape[0]
    micro = [tuple(t.to(device) for t in batch.micro(m)) for m in range(count)]

    def step():
        model.zero_grad(set_to_none=False)
        total = 0.0
        for ids, targets in micro:
            loss = model.micro_loss(ids, targets) / count
            loss.backward()
            total += loss.detach()
        return total

    return step


def interpreter_side(program, batch, device, si: bool):
    executor = Executor(program, SingleRankComm(), seed=SEED, device=device, si=si, plan_for=op_by_op_plan)
    return lambda: executor.step(batch)


def timed(fn, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def peak(fn, device) -> float | None:
    """Peak allocated GiB over one call of ``fn`` (CUDA only)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", type=Path, default=ROOT / "benchmarks" / "one_gpu_llama.dhx")
    parser.add_argument("--rounds", type=int, default=7, help="timed runs of each side (default 7)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    torch.manual_seed(SEED)
    program = check_text(args.program.read_text(), str(args.program))
    if program.mesh.world != 1:
        raise SystemExit(f"{args.program}: the mesh has {program.mesh.world} ranks; this benchmark runs one")
    model, train = program.model, program.train
    print(f"machine: {machine(device)}")
    print(f"config: {args.program.name}: {model.get('layers')} layers, hidden {model.get('hidden')}, "
          f"ffn {model.get('ffn')}, heads {model.get('heads')}/{model.get('kv_heads')}, seq {model.get('seq')}, "
          f"vocab {model.get('vocab')}, {torch_dtype(program)}; micro_batch {train.micro_batch}, "
          f"{train.microbatches} micro-batches, pipeline {program.pipeline.name}; median of {args.rounds} "
          "alternated runs after a warm-up each", flush=True)
    flops = model_flops(program)
    batch = make_batch(program, DATA_SEED)
    sides = {"torch (autograd, grad accumulation)": torch_side(program, batch, device),
             "interpreter, SI on": interpreter_side(program, batch, device, True),
             "interpreter, SI off": interpreter_side(program, batch, device, False)}
    losses = {name: float(fn()) for name, fn in sides.items()}  # the warm-up, and the check
    print("loss: " + ", ".join(f"{name} {loss:.5f}" for name, loss in losses.items()), flush=True)
    memory = {name: peak(fn, device) for name, fn in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for index in range(args.rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            times[name].append(timed(sides[name], device))
        gc.collect()
    base = statistics.median(times[names[0]])
    print(f"\n{'side':<38} {'median':>10} {'min':>9} {'max':>9} {'TFLOP/s':>8} {'÷ torch':>8} {'peak GiB':>9}")
    for name in names:
        median = statistics.median(times[name])
        mem = memory[name]
        print(f"{name:<38} {1e3 * median:>8.1f}ms {1e3 * min(times[name]):>7.1f}ms {1e3 * max(times[name]):>7.1f}ms "
              f"{flops / median / 1e12:>8.1f} {median / base:>8.3f} {'-' if mem is None else f'{mem:.1f}':>9}")
    print(f"model FLOPs per step: {flops / 1e12:.2f} TFLOP")
    return 0


if __name__ == "__main__":
    sys.exit(main())
