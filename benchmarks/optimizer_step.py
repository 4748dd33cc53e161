"""The AdamW update of one rank: the per-tensor Python loop the optimizer used to run against
torch's own AdamW (``torch.optim.adamw.adamw``, what ``torch.optim.AdamW`` runs) with its
multi-tensor (foreach) and fused kernels, on the parameters of a program's model.

Run from the repository root::

    .venv/bin/python benchmarks/optimizer_step.py [--program examples/tiny_llama_cpu.dhx] [--repeat 50]

The parameters are the program's full (single-rank) seeded weights in fp32, the gradients
random; each variant updates its own copy from the same start, in place, as
:meth:`dhelix.interpreter.training.optim.DistributedAdamW.step` does after its gradient
averaging (not timed here). Every variant is run ``--repeat`` times after two warm-ups, the
variants interleaved; the median per update is printed with the largest difference of the
parameters from the loop's after one update (a check, not a figure). On the device of the
first CUDA GPU when one is there, else on one CPU thread (a rank's).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.optim.adamw import adamw

from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.passes.overrides import reference_dags
from dhelix.interpreter.ops.weights import WeightPlan

BETAS, EPS, WEIGHT_DECAY, LR = (0.9, 0.95), 1e-8, 0.1, 1e-3


def loop_update(params, grads, exp_avgs, exp_avg_sqs, denoms, step: int) -> None:
    """The per-tensor loop (the optimizer's update before torch's kernels), in place."""
    beta1, beta2 = BETAS
    step_size, correction2 = LR / (1 - beta1 ** step), 1 - beta2 ** step
    for param, grad, exp_avg, exp_avg_sq, denom in zip(params, grads, exp_avgs, exp_avg_sqs, denoms, strict=True):
        param.mul_(1 - LR * WEIGHT_DECAY)
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        torch.div(exp_avg_sq, correction2, out=denom).sqrt_().add_(EPS)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def torch_update(params, grads, exp_avgs, exp_avg_sqs, step: int, **kernel) -> None:
    """torch's AdamW on the same lists (``foreach=True`` or ``fused=True``), in place."""
    steps = torch.full((len(params),), float(step - 1), device=params[0].device).unbind(0)
    adamw(params, grads, exp_avgs, exp_avg_sqs, [], list(steps), amsgrad=False, beta1=BETAS[0], beta2=BETAS[1],
          lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS, maximize=False, **kernel)


def model_tensors(program_path: str, device) -> list[torch.Tensor]:
    """The program's full fp32 weights, one tensor per parameter."""
    program = check_text(Path(program_path).read_text(), program_path)
    plan = WeightPlan(program, 0, reference_dags(program))
    return [plan.full(name).to(device) for name in plan.names()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--program", default="examples/tiny_llama_cpu.dhx")
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    weights = model_tensors(args.program, device)
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(w.shape, generator=generator).to(device) for w in weights]
    variants = {"per-tensor loop": None, "torch foreach": {"foreach": True}, "torch fused": {"fused": True}}
    state = {name: ([w.clone() for w in weights], [torch.zeros_like(w) for w in weights],
                    [torch.zeros_like(w) for w in weights], [torch.zeros_like(w) for w in weights])
             for name in variants}

    def update(name: str, step: int) -> None:
        params, exp_avgs, exp_avg_sqs, denoms = state[name]
        if variants[name] is None:
            loop_update(params, grads, exp_avgs, exp_avg_sqs, denoms, step)
        else:
            torch_update(params, grads, exp_avgs, exp_avg_sqs, step, **variants[name])

    for name in variants:
        update(name, 1)
    diffs = {name: max((p - q).abs().max().item() for p, q in zip(state[name][0], state["per-tensor loop"][0],
                                                                   strict=True)) for name in variants}
    times = {name: [] for name in variants}
    for step in range(2, args.repeat + 4):
        for name in variants:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            update(name, step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step > 3:
                times[name].append(time.perf_counter() - start)
    elements = sum(w.numel() for w in weights)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, 1 thread"
    print(f"machine: {platform.node()}: {where}; python {platform.python_version()}, torch {torch.__version__}")
    print(f"program: {args.program}: {len(weights)} parameters, {elements:,} elements (fp32); "
          f"median of {args.repeat} updates per variant, interleaved")
    base = statistics.median(times["per-tensor loop"])
    print(f"{'variant':<18} {'per update':>12} {'÷ loop':>8} {'max |Δ| after one update':>26}")
    for name in variants:
        median = statistics.median(times[name])
        print(f"{name:<18} {median * 1e3:>10.3f}ms {median / base:>8.3f} {diffs[name]:>26.2e}")


if __name__ == "__main__":
    main()
