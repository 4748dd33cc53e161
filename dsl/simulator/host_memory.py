"""The host memory an offloaded optimizer takes per node (``train { offload = optimizer }``),
held to the profile's ``host.memory_gb``.

Each GPU's offloaded states (its fp32 masters and moments and the staging buffers,
:func:`~dhelix.dsl.simulator.memory.host_bytes`) live in the memory of the host it sits in,
which all the GPUs of a node share: a node needs the sum over its GPUs, each GPU the figure
of its pipeline rank (the ranks of one pipeline stage hold equal shares). The busiest node
decides; the nodes differ only where a node holds GPUs of several pipeline stages.
"""

from __future__ import annotations

import collections
import functools
from typing import Sequence

import attrs

from dhelix.dsl.core.errors import CheckError
from dhelix.dsl.core.mesh import Mesh
from dhelix.dsl.core.program import Program
from dhelix.dsl.simulator.memory import GB


@attrs.frozen
class NodeHost:
    """The host bytes of the busiest node: its index, the bytes and, per pipeline rank, how
    many of its GPUs hold that rank's share."""

    node: int
    total: float
    gpus: tuple[tuple[int, int], ...]


def busiest_node(mesh: Mesh, per_rank: Sequence[float]) -> NodeHost:
    """The node of ``mesh`` whose GPUs' host bytes add up to the most (the first of equals),
    ``per_rank`` giving each pipeline rank's bytes per GPU."""
    best = None
    for node, counts in _node_stages(mesh.world, mesh.gpus_per_node, mesh.stride("pp"), mesh.size("pp")):
        total = sum(per_rank[stage] * gpus for stage, gpus in counts)
        if best is None or total > best.total:
            best = NodeHost(node, total, counts)
    assert best is not None, "a mesh of at least one node"
    return best


@functools.lru_cache(maxsize=256)
def _node_stages(world: int, gpus_per_node: int, stride: int, stages: int) -> tuple[tuple[int, tuple], ...]:
    """(first node, ((pipeline rank, its GPUs there), …)) for each distinct make-up of a node
    (the ranks ``node·g … node·g + g − 1`` of a mesh whose pipeline axis has ``stages`` ranks
    ``stride`` apart)."""
    seen: dict[tuple, int] = {}
    for node in range(max(1, world // gpus_per_node)):
        first = node * gpus_per_node
        counts = collections.Counter((rank // stride) % stages for rank in range(first, min(world, first + gpus_per_node)))
        seen.setdefault(tuple(sorted(counts.items())), node)
    return tuple((node, counts) for counts, node in seen.items())


def host_refusal(program: Program, per_rank: Sequence[float]) -> CheckError | None:
    """Why ``program`` (validated, with a profile) cannot run: its offloaded optimizer states
    (``per_rank``: each pipeline rank's host bytes per GPU) exceed the host memory of a node
    that its profile gives (``host.memory_gb``), located at the train block's ``offload``;
    None when they fit, nothing is offloaded or the profile gives no host memory."""
    host = program.profile.host if program.profile is not None else None
    if host is None or host.memory_gb is None or program.mesh is None or not any(per_rank):
        return None
    node = busiest_node(program.mesh, per_rank)
    if node.total <= host.memory_gb * GB:
        return None
    assert program.train is not None and program.profile is not None, "a validated model"
    return CheckError(
        f"the offloaded optimizer states take {node.total / GB:.4g} GB of host memory on node {node.node}, more "
        f"than the {host.memory_gb:g} GB of a node's host that profile '{program.profile.name}' gives (host.memory_gb)",
        program.train.offload_span,
        [f"node {node.node}: {node_text(node, per_rank)}",
         "to fit: offload a smaller share (offload_percent), shard the optimizer states over data parallelism "
         "(zero = 1), or more tensor or pipeline parallelism"])


def node_text(node: NodeHost, per_rank: Sequence[float]) -> str:
    """``8 GPUs x 52.3 GB (pipeline rank 0)``, one term per pipeline rank the node holds."""
    return " + ".join(f"{gpus} GPU{'s' if gpus > 1 else ''} x {per_rank[stage] / GB:.4g} GB (pipeline rank {stage})"
                      for stage, gpus in node.gpus)
