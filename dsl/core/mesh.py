"""The device mesh: axis sizes, rank coordinates, process groups and their lanes.

Axes are listed innermost first (``mesh { tp = 8 pp = 2 dp = 4 }`` puts consecutive ranks
in one TP group). ``ep`` is not a dimension of its own: as in the paper (Phi-31B runs EP8
inside DP16), expert-parallel groups are blocks of consecutive DP coordinates. A group is
*local* when all its ranks share a node (``gpus_per_node``), else *cross*-node; the
interpreter gives each kind its own communication lane.
"""

from __future__ import annotations

import collections
import functools
import math

import attrs

from dhelix.dsl.core.span import spans_field

#: Dimensions that multiply into the world size, in the default (Megatron) order.
DIMENSIONS = ("tp", "cp", "dp", "pp")
#: Every axis a mesh block may size, in the order the language lists them: the dimensions and
#: ``ep``, which splits the experts over a part of dp.
MESH_AXES = ("tp", "cp", "ep", "dp", "pp")
#: The dimensions in the order `dhelix tune` places them where the file's mesh block does not
#: say (``ep`` lives inside ``dp``: it has no place of its own). The search tries every
#: placement; this order only names where a new axis goes and which of equal orders is shown.
TUNE_ORDER = ("tp", "cp", "pp", "dp")

#: The communication lanes: collectives of node-local groups and of cross-node groups.
COMM_LANES = ("local", "cross")
#: The sub-axes of a group partition (Centauri §3.1.2): the groups of an axis that span nodes
#: split into their ranks on one node (``tp.intra``, a local group) and the ranks at the same
#: place on every node (``tp.inter``, a cross-node group). A group's position on the axis is
#: ``inter * intra_size + intra``, so an all_gather over intra then inter gathers in axis order.
INTRA, INTER = "intra", "inter"
#: The sub-axes of hybrid sharding (HSDP, ``train { zero = 3  shard = K }``): the dp groups
#: split into groups of ``K`` consecutive dp positions (``dp.shard``, over which ZeRO-3 shards
#: the weights) and the ranks at the same place in every such group (``dp.replicate``, over
#: which the shards' gradients are all-reduced). A dp position is ``replicate * K + shard``.
SHARD, REPLICATE = "shard", "replicate"
#: The sub-axis of ZeRO-3 with context parallelism (torchtitan's ``dp_shard_cp``): each dp
#: group joined with every cp coordinate (``dp.cp``), one group of dp × cp ranks over which
#: the layer weights are sharded, since a weight is replicated over cp as over dp. Its groups
#: are runs of consecutive positions only when cp and dp are neighbours in the mesh order
#: (:meth:`Mesh.joined_cp`); a position is ``dp · cp_size + cp`` where cp lies inside dp.
JOINED = "cp"
#: The level of a declared topology (``cluster { levels { … } }``) whose units are the nodes,
#: and the one whose unit is the whole cluster, added when the levels stop below it.
NODE_LEVEL, CLUSTER_LEVEL = "node", "cluster"


def base_axis(axis: str) -> str:
    """The mesh axis of ``axis``, a mesh axis or one of its sub-axes (``tp`` for ``tp.intra``)."""
    return axis.partition(".")[0]


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
    #: The size of the FSDP shard groups under hybrid sharding (0: none; see SHARD).
    dp_shard: int = 0
    #: The cluster's declared topology, ``((level, GPUs per unit), …)`` smallest first, the
    #: node and the whole cluster included; () for two levels (node and cluster) undeclared.
    #: A group partition over it splits a group into one stage per level (sub-axis
    #: ``tp.island``: the group's ranks in one island), :meth:`level_stages`.
    levels: tuple[tuple[str, int], ...] = ()
    #: Where each written axis is set in the mesh block (axis → span), for located warnings.
    spans: dict = spans_field()

    @property
    def world(self) -> int:
        """Number of ranks: the product of the dimension sizes (ep lives inside dp)."""
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        """Size of ``axis`` (1 for an axis the mesh does not list); a sub-axis's size comes
        from :meth:`hierarchy` (ValueError for the sub-axis of an axis that has none)."""
        if "." in axis:
            return self._sub(axis)[0]
        if axis == "ep":
            return self.ep
        return self.sizes[self.order.index(axis)] if axis in self.order else 1

    def stride(self, axis: str) -> int:
        """Distance in rank numbers between neighbours along ``axis``."""
        if "." in axis:
            return self._sub(axis)[1]
        if axis == "ep":
            axis = "dp"
        if axis not in self.order:
            return 1
        return math.prod(self.sizes[: self.order.index(axis)])

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every listed axis."""
        return {axis: (rank // self.stride(axis)) % self.size(axis) for axis in self.order}

    def position(self, rank: int, axis: str) -> int:
        """The position of ``rank`` in its group of ``axis``, a listed axis or a sub-axis."""
        if "." not in axis:
            return self.coords(rank).get(axis, 0)
        return (rank // self.stride(axis)) % self.size(axis)

    def hierarchy(self, axis: str) -> tuple[int, int] | str | None:
        """How the groups of mesh axis ``axis`` split over nodes: (ranks on each node, nodes)
        when every group spans nodes with as many ranks on each; None when the groups lie
        inside one node; else a sentence saying how a group is unbalanced."""
        group = self.groups(axis)[0] if self.size(axis) > 1 else ()
        counts: dict[int, int] = {}
        for rank in group:
            counts[rank // self.gpus_per_node] = counts.get(rank // self.gpus_per_node, 0) + 1
        if len(counts) <= 1:
            return None
        if len(set(counts.values())) > 1:
            spread = ", ".join(f"{n} rank{'s' if n > 1 else ''} on node {node}" for node, n in counts.items())
            return f"the {axis} group {list(group)} has {spread}"
        per_node = next(iter(counts.values()))
        return per_node, len(counts)

    def per_node(self, axis: str) -> int:
        """Ranks of a group of ``axis`` (a mesh axis or a sub-axis) on each node it spans,
        1 when the groups lie inside one node or spread unevenly."""
        return _per_node(self, axis)

    def sub_axes(self) -> tuple[str, ...]:
        """The sub-axes of every listed axis whose groups span nodes evenly, and hybrid
        sharding's (``dp.shard``, ``dp.replicate``) when it is on, with the shard groups'
        own (``dp.shard.intra``, ``dp.shard.inter``) when they span nodes evenly."""
        hybrid = (f"dp.{SHARD}", f"dp.{REPLICATE}") if 1 < self.dp_shard < self.size("dp") else ()
        joined = (f"dp.{JOINED}",) if self.size("cp") > 1 and isinstance(self.joined_cp(), tuple) else ()
        return tuple(f"{axis}.{part}" for axis in self.order + hybrid[:1] + joined
                     if isinstance(split := self.hierarchy(axis), tuple) and split[0] > 1
                     for part in (INTRA, INTER)) + hybrid + joined + self._level_axes()

    def fsdp_axis(self) -> str:
        """The axis ZeRO-3 shards the layer weights over: ``dp``; ``dp.cp`` (:data:`JOINED`)
        with cp > 1, a weight being replicated over cp as over dp; ``dp.shard`` under hybrid
        sharding (:data:`SHARD`)."""
        if self.dp_shard:
            return f"dp.{SHARD}"
        # (cp and dp apart in the mesh order: the check refuses ZeRO-3 there)
        return f"dp.{JOINED}" if self.size("cp") > 1 and isinstance(self.joined_cp(), tuple) else "dp"

    def joined_cp(self) -> tuple[int, int] | str:
        """(size, stride) of :data:`JOINED`'s groups, dp × cp ranks each, or a sentence saying
        why they are not runs of evenly spaced ranks (cp and dp not neighbours in the mesh
        order, another axis larger than 1 between them)."""
        dp, cp = self.size("dp"), self.size("cp")
        if dp == 1 or cp == 1:
            return (dp * cp, self.stride("dp" if cp == 1 else "cp"))
        if self.stride("cp") * cp == self.stride("dp"):
            return dp * cp, self.stride("cp")
        if self.stride("dp") * dp == self.stride("cp"):
            return dp * cp, self.stride("dp")
        between = [axis for axis in self.order if self.size(axis) > 1 and axis not in ("cp", "dp")
                   and min(self.stride("cp"), self.stride("dp")) < self.stride(axis)
                   < max(self.stride("cp"), self.stride("dp"))]
        return f"the mesh puts {' and '.join(between) or 'another axis'} between cp and dp"

    def _level_axes(self) -> tuple[str, ...]:
        """The level sub-axes (``tp.island``) of every listed axis split over two levels or more."""
        out = []
        for axis in self.order:
            stages = self.level_stages(axis)
            if not isinstance(stages, str) and len(stages) > 1:
                out += [f"{axis}.{level}" for level, _, _ in stages]
        return tuple(out)

    def level_stages(self, axis: str) -> tuple[tuple[str, int, int], ...] | str:
        """The stages of a group partition of mesh axis ``axis`` over the declared levels
        (Centauri §3.1.2's d-dimensional mesh [N1 … Nd]): ``(level, size, stride)`` for each
        level that splits its groups, smallest level first — the group's ranks in one unit of
        the level at the same place in the units of the level below; () without declared
        levels or for groups inside one unit of the smallest; else a sentence saying what is
        wrong: a group unbalanced (unequal ranks in the units of a level), or two groups that
        span the levels differently."""
        return _level_stages(self, axis)

    def _sub(self, axis: str) -> tuple[int, int]:
        """(size, stride) of sub-axis ``axis``: a mesh axis's (``tp.intra``, ``dp.shard``) or a
        sub-axis's group partition (``dp.shard.inter``)."""
        base, _, part = axis.rpartition(".")
        if part in dict(self.levels) and "." not in base:
            stages = self.level_stages(base)
            found = [(size, stride) for level, size, stride in stages if level == part] \
                if not isinstance(stages, str) else []
            if not found:
                raise ValueError(f"{axis}: {base} has no {part} stage on this mesh")
            return found[0]
        if part == JOINED and base == "dp":
            joined = self.joined_cp()
            if isinstance(joined, str):
                raise ValueError(f"{axis}: {joined}")
            return joined
        if part in (SHARD, REPLICATE):
            if base != "dp" or not 1 < self.dp_shard < self.size("dp"):
                raise ValueError(f"{axis}: the mesh has no hybrid sharding of dp")
            stride = self.stride("dp")
            return (self.dp_shard, stride) if part == SHARD else (self.size("dp") // self.dp_shard,
                                                                   stride * self.dp_shard)
        split = self.hierarchy(base)
        if not isinstance(split, tuple) or part not in (INTRA, INTER):
            raise ValueError(f"{axis}: {base} has no {part} sub-axis on this mesh")
        per_node, nodes = split
        stride = self.stride(base)
        return (per_node, stride) if part == INTRA else (nodes, stride * per_node)

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """All process groups of ``axis``, each a tuple of ranks in axis order, sorted."""
        return list(_groups(self, axis))

    def lane(self, axis: str) -> str:
        """``local`` when every group of ``axis`` lies inside one node, else ``cross``."""
        return _lane(self, axis)


def ranks_per_node(ranks, gpus_per_node: int) -> int:
    """Ranks of the group ``ranks`` on each node it spans: 1 when it lies inside one node or
    holds unequal numbers on its nodes."""
    counts = collections.Counter(rank // gpus_per_node for rank in ranks)
    return counts.most_common(1)[0][1] if len(counts) > 1 and len(set(counts.values())) == 1 else 1


@functools.cache
def _per_node(mesh: Mesh, axis: str) -> int:
    return ranks_per_node(_groups(mesh, axis)[0], mesh.gpus_per_node)


@functools.cache
def _groups(mesh: Mesh, axis: str) -> tuple[tuple[int, ...], ...]:
    size, stride = mesh.size(axis), mesh.stride(axis)
    seen: set[int] = set()
    out: list[tuple[int, ...]] = []
    for rank in range(mesh.world):
        if rank in seen:
            continue
        # The group's first member has coordinate 0 on the axis (or on its EP block).
        group = tuple(rank + i * stride for i in range(size))
        seen.update(group)
        out.append(group)
    return tuple(sorted(out))


@functools.cache
def _level_stages(mesh: Mesh, axis: str) -> tuple[tuple[str, int, int], ...] | str:
    if not mesh.levels or mesh.size(axis) <= 1:
        return ()
    groups, stride = mesh.groups(axis), mesh.stride(axis)
    first = _group_stages(mesh, axis, groups[0], stride)
    # The stages are the axis's, not a group's: every group must span the levels alike.
    for group in groups[1:] if not isinstance(first, str) else ():
        other = _group_stages(mesh, axis, group, stride)
        if other != first:
            return (other if isinstance(other, str) else
                    f"the {axis} groups span the levels differently: {list(groups[0])} "
                    f"{_spread(first)}, {list(group)} {_spread(other)}")
    return first


def _spread(stages) -> str:
    """How a group's :func:`_group_stages` span the levels, in words."""
    return "splits at the " + " and the ".join(f"{level} ({size})" for level, size, _ in stages) if stages else \
        "lies inside one unit of the smallest level"


def _group_stages(mesh: Mesh, axis: str, group, stride: int) -> tuple[tuple[str, int, int], ...] | str:
    """:meth:`Mesh.level_stages` of one group of ``axis``."""
    stages, below = [], 1  # ranks of the group in one unit of the level below
    for level, gpus in mesh.levels:
        counts = collections.Counter(rank // gpus for rank in group)
        if len(set(counts.values())) > 1:
            spread = ", ".join(f"{n} in {level} {unit}" for unit, n in sorted(counts.items()))
            return f"the {axis} group {list(group)} has {spread}"
        inside = next(iter(counts.values()))
        if inside % below:
            return f"the {axis} group {list(group)} has {inside} ranks in each {level}, not a multiple of {below}"
        if inside > below:
            stages.append((level, inside // below, stride * below))
        below = inside
    return tuple(stages)


@functools.cache
def _lane(mesh: Mesh, axis: str) -> str:
    per_node = mesh.gpus_per_node
    local, cross = COMM_LANES
    for group in _groups(mesh, axis):
        if len({rank // per_node for rank in group}) > 1:
            return cross
    return local
