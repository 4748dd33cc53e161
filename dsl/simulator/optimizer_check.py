"""What the step's global checks cost: the gradient norm's all-reduce before the optimizer, and
what post-validation (``train { optimizer_check = post }``) pays instead.

Every step the interpreter sums the squared gradient norm over the whole world (one fp64
scalar; ``--clip`` clips to it and the non-finite check reads it) before any rank updates:
a world-wide all-reduce that no rank leaves before the last has joined, then the optimizer.
With ``optimizer_check = post`` (the zero-bubble paper's post-validation, Qi et al., ICLR'24
§4) each rank updates as soon as its own gradients are averaged, while the norm is reduced,
and publishes the update (ZeRO-1's weight gathers) only once the norm has arrived: its end is
the later of its update and the norm. It first copies what the update overwrites, so that a
step the norm says to clip or skip can be rolled back: that copy is its price
(:func:`copy_seconds`). The simulator prices the step the norm lets stand (a rolled-back step
pays the update again after the norm, as the synchronous step plus the copy).

The all-reduce of one scalar is latency-bound: NCCL runs it as a tree, so it is priced
``2·(⌈log₂ nodes⌉·α_cross + ⌈log₂ ranks per node⌉·α_local)`` — up the tree and down again,
one link latency (the profile's ``latency_us``) a level [assumed: NCCL's tree algorithm for
small messages; the ring model of the other collectives would charge 2·(world − 1) latencies].
"""

from __future__ import annotations

import math

from dhelix.dsl.core.program import Program
from dhelix.dsl.core.options import option
from dhelix.dsl.planner.costmodel import optimizer_time

#: Bytes the copy before an optimistic update moves per parameter: the two fp32 moments and
#: the fp32 master (or the fp32 parameter itself), each read and written.
COPY_BYTES_PER_PARAM = 24
#: What the optimizer's copy is priced as, in optimizer_time's terms (its bytes per
#: parameter for fp32: the gradient read and the 24 bytes of states).
_OPTIMIZER_FP32_BYTES = 28


def post_validated(program: Program, given: str | None = None) -> bool:
    """Whether ``program``'s step is post-validated: ``given`` (a run's ``--optimizer-check``),
    else the train block's ``optimizer_check``, else the default (sync)."""
    if given is None:
        train = program.train
        written = train.setting("optimizer_check") if train is not None else None
        given = written if written is not None else option("optimizer_check").default
    return given == "post"


def norm_sync_seconds(program: Program) -> float:
    """Seconds of the gradient norm's all-reduce over ``program``'s world (0 for one rank)."""
    mesh, profile = program.mesh, program.profile
    assert mesh is not None and profile is not None, "a validated program with a profile"
    world = mesh.world
    if world <= 1:
        return 0.0
    per_node = min(world, mesh.gpus_per_node)
    nodes = math.ceil(world / per_node)
    levels_cross, levels_local = math.ceil(math.log2(nodes)), math.ceil(math.log2(per_node))
    return 2e-6 * (levels_cross * profile.links["cross"].latency_us
                   + levels_local * profile.links["local"].latency_us)


def copy_seconds(params: float, program: Program) -> float:
    """Seconds of post-validation's copy of the optimizer states of ``params`` parameters (a
    rank's part of them), as memory-bound as the optimizer itself; 0 where the norm takes
    no time to arrive (one rank: nothing to hide, and the interpreter takes no copy)."""
    if norm_sync_seconds(program) == 0.0:
        return 0.0
    assert program.profile is not None, "a program with a profile"
    return optimizer_time(params, "fp32", program.profile) * COPY_BYTES_PER_PARAM / _OPTIMIZER_FP32_BYTES
