"""Replay a program's layer collectives without the compute: how long does its communication take?

Run one process per rank, launched like ``dhelix run`` under torchrun (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set; gloo)::

    python benchmarks/collective_replay.py FILE --steps 4 --metrics OUT.json

Each step issues, in a no-SI run's order, every collective the layers of one training step
issue on this rank: for each F and B of the rank's lowered schedule (both halves of an SI
block), for each layer of that chunk, the collectives of the forward or backward layer DAG
at their shard shapes and dtype, over the same process groups ``dhelix run`` builds
(:class:`~dhelix.interpreter.ops.comm.DistComm`), each waited for before the next is issued.
Left out, and said so in the output: pipeline sends and receives (their timing is the
pipeline's, not the link's), the LM head's loss reductions and the optimizer's gradient
synchronisation (a few KiB per step for these models). Rank 0 writes the same JSON as
``dhelix run --metrics`` (``exposed_comm_s`` = ``step_s``: nothing hides it) plus the bytes
each rank sends per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import attrs

from dhelix.dsl.core.oplib import in_weight_pass
from dhelix.dsl.core.schedule import computes

#: Collectives the replay can issue, and the share of its input each rank sends over the
#: link. A reduce_scatter sends (n-1)/n of its input on every backend: on gloo the
#: Communicator runs it as an all_to_all and a local sum (torch's gloo reduce_scatter_tensor
#: would send an all_reduce's 2(n-1)/n).
SENT_SHARE = {
    "all_gather": lambda n: n - 1,           # its input goes to each of the n - 1 others
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@attrs.frozen
class Collective:
    """One collective of a layer DAG as issued on a rank: ``op`` over ``axis`` on an input
    of ``shape``; ``group_size`` ranks take part."""

    name: str
    op: str
    axis: str
    shape: tuple[int, ...]
    group_size: int


def replay_schedule(program, rank: int) -> tuple[Collective, ...]:
    """The layer collectives global ``rank`` issues in one training step of ``program`` (a
    checked Program with its lowered schedule), in a no-SI run's order. ValueError for a
    collective the replay cannot issue (send/recv inside a layer DAG)."""
    pp_index = program.mesh.coords(rank).get("pp", 0)
    split = program.lowered.split  # W runs the weight gradients (and, under ZeRO-3, their reduce-scatters)
    backward = [op for op in program.backward.ops if not (split and in_weight_pass(op))]
    per_kind = {"F": _layer_collectives(program.forward.ops, "forward"),
                "B": _layer_collectives(backward, "backward"),
                "W": _layer_collectives([op for op in program.backward.ops if split and in_weight_pass(op)], "backward")}
    issued = []
    for action in program.lowered.actions[pp_index]:
        for part in computes(action):
            layers = len(program.placement.stage_at(pp_index, part.chunk).layers)
            issued += per_kind[part.kind] * layers
    return tuple(issued)


#: ZeRO-3's weight gathers and gradient reduce-scatters are these collectives of their shapes.
_AS = {"param_gather": "all_gather", "grad_scatter": "reduce_scatter"}


def _layer_collectives(ops, direction: str) -> list[Collective]:
    found = []
    for op in ops:
        if op.kind != "comm" or op.group_size == 1:
            continue
        kind = _AS.get(op.op, op.op)
        if kind not in SENT_SHARE:
            raise ValueError(f"the replay cannot issue {op.name} ({op.op} over {op.axis}) of the "
                             f"{direction} layer: only {', '.join(SENT_SHARE)}")
        found.append(Collective(name=op.name, op=kind, axis=op.axis, shape=tuple(op.in_shapes[0]),
                                group_size=op.group_size))
    return found


def bytes_sent(collectives, dtype: str) -> float:
    """Bytes one rank sends for ``collectives`` (see :data:`SENT_SHARE`) with elements of ``dtype``."""
    total = 0.0
    for c in collectives:
        elements = 1
        for size in c.shape:
            elements *= size
        total += SENT_SHARE[c.op](c.group_size) * elements * DTYPE_BYTES[dtype]
    return total


def replay_step(comm, collectives, inputs: dict) -> None:
    """Issue ``collectives`` one after the other on ``comm``, each waited for."""
    for c in collectives:
        getattr(comm, c.op)(inputs[c.shape], c.axis)


def main(argv=None) -> int:
    """Join the torchrun-style world from the environment, replay, write the metrics on rank 0."""
    parser = argparse.ArgumentParser(description="Replay FILE's layer collectives without compute "
                                                 "(one process per rank, torchrun environment).")
    parser.add_argument("file", metavar="FILE")
    parser.add_argument("--steps", type=int, default=4, help="steps to time (the first is left out of the median)")
    parser.add_argument("--metrics", metavar="OUT.json", required=True, help="where rank 0 writes the times")
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.distributed as dist

    from dhelix.dsl.frontend.imports import read_source
    from dhelix.dsl.passes.pipeline import check_text
    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.verify.harness import gather_to_first
    from dhelix.interpreter.ops.weights import torch_dtype

    program = check_text(read_source(args.file), args.file)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.timeout))
    try:
        comm = DistComm(program.mesh, "cpu", timeout_s=args.timeout)
        collectives = replay_schedule(program, comm.rank)
        generator = torch.Generator().manual_seed(0)
        inputs = {c.shape: torch.randn(c.shape, generator=generator).to(torch_dtype(program))
                  for c in collectives}
        steps = []
        for _ in range(args.steps):
            dist.barrier()  # both ranks start the step together: the times are the link's
            start = time.perf_counter()
            replay_step(comm, collectives, inputs)
            steps.append(time.perf_counter() - start)
        mine = {"rank": comm.rank, "step_s": steps, "collectives": len(collectives),
                "bytes_sent": bytes_sent(collectives, program.model.dtype)}
        ranks = gather_to_first(mine)
    finally:
        dist.destroy_process_group()
    if ranks is not None:
        _write(args.metrics, args.file, ranks)
    return 0


def _write(path: str, file: str, ranks: list[dict]) -> None:
    slowest = [max(times) for times in zip(*(r["step_s"] for r in ranks), strict=True)]
    step = statistics.median(slowest[1:] or slowest)
    Path(path).write_text(json.dumps({"file": file, "replay": True, "step_s": step, "exposed_comm_s": step,
                                      "ranks": ranks}, indent=1) + "\n")
    print(f"collective replay: {ranks[0]['collectives']} collectives per step on rank 0, "
          f"{ranks[0]['bytes_sent'] / 2**20:.1f} MiB sent per rank; median step {1e3 * step:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
