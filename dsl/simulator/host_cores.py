"""The cores of a CPU host, shared by its ranks: the step they allow at least.

The simulator runs one timeline per pipeline rank as if each rank had a core of its own (the
profile times ops at a core's speed: :mod:`dhelix.dsl.frontend.host_cores`). A host that
runs more ranks than it has cores cannot do that: in each second it does at most ``cores``
seconds of CPU work. Every rank's CPU work in the step is its computation (its compute lane's
busy time less the layer communication it waited for, plus its optimizer step) and the part
of its communication the cores do (``comm_busy`` of the time of its layer, pipeline and
data-parallel communication). A pipeline transfer busies the sender and the receiver, but its
time is counted once, at the sender: the two sides of a 16 KiB gloo send took 83 and 93 µs of
CPU here (back to back), less together than one rank of a two-rank all_gather of the same bytes
(405-947 µs), and a send's price holds the link's latency, in which neither side works. The
step of a host is then at least its ranks' CPU work over its cores: a bound that holds when
the ranks keep every core busy (measured here: 4 ranks on 2 cores, the run's CPU seconds
per step over the step); ranks that all wait for one another leave cores idle, and the step
is longer than the bound.

Every host runs the same mix of the world's ranks (the mesh's ranks are spread evenly, and a
pipeline rank stands for its TP, CP and DP replicas), so a host's work is its share of the
world's. Without a profile ``cores`` section (a GPU), or with a core for each rank, the bound
is 0: it changes nothing.
"""

from __future__ import annotations

from typing import Sequence

from dhelix.dsl.frontend.host_cores import HostCores
from dhelix.dsl.simulator.simulation import RankStats


def cpu_seconds(cores: HostCores, ranks: Sequence[RankStats], world: int) -> float:
    """The CPU seconds of one step summed over the ``world``'s ranks, of which ``ranks`` are
    the simulated pipeline ranks (each standing for ``world / len(ranks)`` ranks)."""
    if not ranks:
        return 0.0
    replicas = world / len(ranks)
    return replicas * sum(r.busy - r.layer_exposed + r.optimizer
                          + cores.comm_busy * (r.layer_comm + r.pp_comm + r.dp_comm) for r in ranks)


def cores_bound(cores: HostCores | None, ranks: Sequence[RankStats], world: int) -> float:
    """The shortest step a host's shared cores allow (seconds): the CPU work of the host's
    ranks over its usable cores; 0 without ``cores`` or when the host has a core per rank."""
    if cores is None or not world:
        return 0.0
    on_host = cores.ranks_on_host(world)
    if on_host <= cores.usable:
        return 0.0
    return cpu_seconds(cores, ranks, world) * on_host / world / cores.usable
