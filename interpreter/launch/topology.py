"""Is the machine what the program says? The nodes the ranks really run on, checked against
the cluster block.

The lanes of every collective (local or cross-node) and the simulator's prediction come from
the cluster block's ``gpus_per_node``: global rank r is on node ``r // gpus_per_node``. Under
torchrun that is an assumption about how the job was launched, so each rank publishes where
it runs (torchrun's node rank ``GROUP_RANK`` and the host name) through the rendezvous store
and every rank checks the whole world before training (:func:`check_placement`). The local
spawner's ranks share one machine on purpose (two "nodes" of a CPU example), so it is not
checked there. A torchrun of every rank on one host is the same on purpose (``torchrun
--standalone`` of a CPU example): its nodes are emulated as the local spawner's are
(:func:`emulated_nodes`), and the summary says so. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import socket

import attrs

from dhelix.dsl.core.errors import DhelixError

PREFIX = "dhelix/node/"


class PlacementError(DhelixError):
    """The nodes the ranks run on do not fit the program. Every rank reads the same
    placements and meets the same error, so only global rank 0 reports it."""

    reported_by_rank_0 = True


@attrs.frozen
class Where:
    """Where a rank runs: torchrun's node rank (``GROUP_RANK``) and the host's name."""

    node: int
    host: str

    def __str__(self) -> str:
        return f"{self.host} (node {self.node})"


def here() -> Where:
    """This process's node rank (0 outside torchrun) and host name."""
    return Where(int(os.environ.get("GROUP_RANK", 0)), socket.gethostname())


def exchange(store, rank: int, world: int) -> list[Where]:
    """Publish this rank's :func:`here` in ``store`` and read every rank's (waits for them,
    up to the store's timeout)."""
    mine = here()
    store.set(f"{PREFIX}{rank}", json.dumps([mine.node, mine.host]))
    return [Where(*json.loads(store.get(f"{PREFIX}{other}"))) for other in range(world)]


def emulated_nodes(places: list[Where], gpus_per_node: int) -> str:
    """The summary's line when every rank runs on one host and the cluster block says several
    nodes: those nodes are emulated on it, as ``dhelix run``'s own launcher does (lanes and
    prediction follow the cluster block); "" when the ranks are not all on one host or the
    program has one node."""
    world = len(places)
    if world <= gpus_per_node or any(place != places[0] for place in places):
        return ""
    return (f"emulated, the cluster block's {world // gpus_per_node} node(s) of {gpus_per_node} rank(s) on one "
            f"host ({places[0].host}), as the local launcher does; lanes and prediction follow the cluster block")


def check_placement(places: list[Where], gpus_per_node: int) -> None:
    """Raise DhelixError when the ranks' real nodes differ from the cluster block's: ranks the
    program puts on one node that run on different ones, or the other way round. The message
    names the first ranks and hosts that disagree."""
    for rank, place in enumerate(places):
        for other in range(rank + 1, len(places)):
            said = rank // gpus_per_node == other // gpus_per_node
            real = place == places[other]
            if said == real:
                continue
            nodes = {}
            for r, p in enumerate(places):
                nodes.setdefault(p, []).append(r)
            measured = "; ".join(f"ranks {_span(ranks)} on {p}" for p, ranks in nodes.items())
            claim = "the same node" if said else "different nodes"
            fact = "different ones" if said else "the same one"
            raise PlacementError(
                f"the cluster block puts ranks {rank} and {other} on {claim} (gpus_per_node = {gpus_per_node}), "
                f"but they run on {fact}: rank {rank} on {place}, rank {other} on {places[other]}",
                notes=[f"measured: {measured}",
                       f"set gpus_per_node = {_measured_per_node(nodes)} in the cluster block, or launch "
                       f"{gpus_per_node} rank(s) per node"])


def measured_per_node(places: list[Where]) -> int:
    """The ranks per node the ranks really run with, when they are laid out as a cluster
    block can say (rank r on node r // n, every node with n ranks); else DhelixError naming
    where the layout breaks."""
    nodes: dict[Where, list[int]] = {}
    for rank, place in enumerate(places):
        nodes.setdefault(place, []).append(rank)
    per_node = _measured_per_node(nodes)
    blocks = [list(range(start, start + per_node)) for start in range(0, len(places), per_node)]
    if sorted(nodes.values()) != blocks:
        measured = "; ".join(f"ranks {_span(ranks)} on {p}" for p, ranks in nodes.items())
        raise PlacementError(
            "the measured topology cannot be used: the ranks are not laid out as consecutive blocks of "
            "equal size per node, which is what a cluster block (gpus_per_node) can describe",
            notes=[f"measured: {measured}",
                   "launch the same number of ranks on every node, node by node (torchrun does)"])
    return per_node


def describe_measured(per_node: int, world: int, declared: int) -> str:
    """One line for the run summary: the topology the run used instead of the declared one."""
    nodes = world // per_node
    if per_node == declared:
        return f"measured, {per_node} rank(s) per node on {nodes} node(s), as the cluster block says"
    return (f"measured, {per_node} rank(s) per node on {nodes} node(s), used instead of the cluster block's "
            f"gpus_per_node = {declared} (lanes and prediction follow the measured nodes)")


def _measured_per_node(nodes: dict) -> int:
    return max(len(ranks) for ranks in nodes.values())


def _span(ranks: list[int]) -> str:
    contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
    if contiguous and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
