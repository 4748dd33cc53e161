"""The device mesh: axis sizes, rank coordinates, process groups and their lanes.

Axes are listed innermost first (``mesh { tp = 8 pp = 2 dp = 4 }`` puts consecutive ranks
in one TP group). ``ep`` is not a dimension of its own: as in the paper (Phi-31B runs EP8
inside DP16), expert-parallel groups are blocks of consecutive DP coordinates. A group is
*local* when all its ranks share a node (``gpus_per_node``), else *cross*-node; the
interpreter gives each kind its own communication lane.
"""

from __future__ import annotations

import functools
import math

import attrs

#: Dimensions that multiply into the world size, in the default (Megatron) order.
DIMENSIONS = ("tp", "cp", "dp", "pp")

#: The communication lanes: collectives of node-local groups and of cross-node groups.
COMM_LANES = ("local", "cross")
#: Every lane an op runs on, the compute stream first: the order in which plan tables,
#: traces and the pair cost list them.
LANES = ("compute", *COMM_LANES)


@attrs.frozen
class Mesh:
    """Axis sizes in mesh order (innermost first), the EP size and the node size."""

    order: tuple[str, ...]
    sizes: tuple[int, ...]
    ep: int = 1
    gpus_per_node: int = 1

    @property
    def world(self) -> int:
        """Number of ranks: the product of the dimension sizes (ep lives inside dp)."""
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        """Size of ``axis`` (1 for an axis the mesh does not list)."""
        if axis == "ep":
            return self.ep
        return self.sizes[self.order.index(axis)] if axis in self.order else 1

    def stride(self, axis: str) -> int:
        """Distance in rank numbers between neighbours along ``axis``."""
        if axis == "ep":
            axis = "dp"
        if axis not in self.order:
            return 1
        return math.prod(self.sizes[: self.order.index(axis)])

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every listed axis."""
        return {axis: (rank // self.stride(axis)) % self.size(axis) for axis in self.order}

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """All process groups of ``axis``, each a tuple of ranks in axis order, sorted."""
        return list(_groups(self, axis))

    def lane(self, axis: str) -> str:
        """``local`` when every group of ``axis`` lies inside one node, else ``cross``."""
        return _lane(self, axis)


@functools.cache
def _groups(mesh: Mesh, axis: str) -> tuple[tuple[int, ...], ...]:
    size, stride = mesh.size(axis), mesh.stride(axis)
    seen, out = set(), []
    for rank in range(mesh.world):
        if rank in seen:
            continue
        # The group's first member has coordinate 0 on the axis (or on its EP block).
        group = tuple(rank + i * stride for i in range(size))
        seen.update(group)
        out.append(group)
    return tuple(sorted(out))


@functools.cache
def _lane(mesh: Mesh, axis: str) -> str:
    per_node = mesh.gpus_per_node
    local, cross = COMM_LANES
    for group in _groups(mesh, axis):
        if len({rank // per_node for rank in group}) > 1:
            return cross
    return local
