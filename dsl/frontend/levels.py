"""The cluster's topology levels: ``cluster { … levels { island = 2  node = 4  rack = 8 } }``.

Each setting names a level and the GPUs in one unit of it (an NVLink island, a node, a
rack), smallest first; each divides the next. The node is the level of ``gpus_per_node``
GPUs (written or not, and named ``node``); the whole cluster is a level of its own
(``cluster``) when the last written one is smaller. A group partition over such a topology
runs one stage per level a group spans (:meth:`dhelix.dsl.core.mesh.Mesh.level_stages`).
"""

from __future__ import annotations

import itertools

from dhelix.dsl.core.errors import CheckError, ErrorCollector
from dhelix.dsl.core.mesh import CLUSTER_LEVEL, INTER, INTRA, NODE_LEVEL, REPLICATE, SHARD

#: Names a level may not take: the whole cluster's (implicit) and the sub-axes and generated
#: op names of the other partitions (``tp.intra``, ``dp.shard``, ``ag1.rest``, ``ar.rs``…),
#: the three-way split's among them (``ag1.place``, ``ag1.mates``, ``ag1.near``,
#: ``fc1.gather_w.part``): a level's stage op is named ``AG.<level>``, and must not be one.
RESERVED = (CLUSTER_LEVEL, INTRA, INTER, SHARD, REPLICATE, "rest", "rs", "ag", "weights",
            "place", "mates", "near", "part")


def build_levels(block, nodes: int, gpus_per_node: int, errors: ErrorCollector) -> tuple[tuple[str, int], ...]:
    """The full topology of a levels block (its evaluated settings, ``BlockValues``),
    ``((level, GPUs per unit), …)`` smallest first, with the node (``gpus_per_node``) and the
    whole cluster added where not written; () after recording located errors: a value that is
    not a whole number of at least 2, a reserved or generated-looking name, levels out of
    order or not dividing the next, a ``node`` that is not ``gpus_per_node``, a level of
    ``gpus_per_node`` GPUs named otherwise, a level that does not divide the cluster."""
    found = len(errors.errors)
    world = nodes * gpus_per_node
    written = []
    for name, gpus in block.values.items():
        span = block.nodes[name].span_of("key")
        if name in RESERVED or (len(name) > 1 and name[0] in "bcrs" and name[1:].isdigit()):
            errors.add(CheckError(f"'{name}' cannot name a level", span,
                                  [f"names taken: {', '.join(RESERVED)} and the chunk names (c0, s0, r0, b0…)",
                                   "the whole cluster is the level 'cluster' when the last level is smaller"]))
        elif not isinstance(gpus, int) or gpus < 2:
            errors.add(CheckError(f"level '{name}' must hold at least 2 GPUs, got {gpus}", block.span(name),
                                  ["a level's value is the number of GPUs in one unit of it"]))
        elif gpus > world or world % gpus:
            errors.add(CheckError(f"level '{name}' = {gpus} does not divide the cluster's {world} GPUs",
                                  block.span(name), [f"the units of a level tile the cluster ({nodes} nodes x "
                                                     f"{gpus_per_node} GPUs)"]))
        elif (name == NODE_LEVEL) != (gpus == gpus_per_node):
            what = f"node = {gpus}, but gpus_per_node = {gpus_per_node}" if name == NODE_LEVEL else \
                f"level '{name}' = {gpus} is the node (gpus_per_node = {gpus_per_node})"
            errors.add(CheckError(what, block.span(name), [f"the level of gpus_per_node GPUs is '{NODE_LEVEL}': "
                                                           f"write node = {gpus_per_node}, or leave it out"]))
        else:
            written.append((name, gpus, block.span(name)))
    if len(errors.errors) > found or block.failed:
        return ()
    _check_order(written, errors)
    if len(errors.errors) > found:
        return ()
    levels = [(name, gpus) for name, gpus, _ in written]
    if gpus_per_node not in [g for _, g in levels]:
        levels.append((NODE_LEVEL, gpus_per_node))
    if world not in [g for _, g in levels]:
        levels.append((CLUSTER_LEVEL, world))
    levels.sort(key=lambda level: level[1])
    for (below, small), (name, large) in itertools.pairwise(levels):
        if large % small:  # only against the implicit node: the written ones are checked above
            span = next(sp for n, _, sp in written if n in (below, name))
            errors.add(CheckError(f"level '{name}' = {large} is not a multiple of '{below}' = {small}", span,
                                  ["each level's units are made of whole units of the level below"]))
            return ()
    return tuple(levels)


def _check_order(written, errors: ErrorCollector) -> None:
    """Errors for written levels that do not grow, or do not divide the next."""
    for (below, small, _), (name, large, span) in itertools.pairwise(written):
        if large <= small:
            errors.add(CheckError(f"level '{name}' = {large} follows '{below}' = {small}", span,
                                  ["list the levels smallest first, each larger than the one before"]))
        elif large % small:
            errors.add(CheckError(f"level '{name}' = {large} is not a multiple of '{below}' = {small}", span,
                                  ["each level's units are made of whole units of the level below"]))
