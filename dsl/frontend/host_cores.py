"""A profile's ``cores`` section: the processor cores of the host a CPU profile was measured on,
which that host's ranks share.

``dhelix profile`` on CPU ranks times each op in bursts shorter than a scheduler slice, so an
op's time is a core's speed. When a host runs more ranks than it has cores, the ranks take
turns on the cores: the step cannot be shorter than the CPU work of the host's ranks over its
cores. That work is their computation plus the part of their communication the cores do
themselves (on gloo, the copies through the loopback sockets and the reductions), which the
profile measures as the CPU seconds of its timed collectives over their time
(``comm_busy``). :mod:`dhelix.dsl.simulator.host_cores` prices the bound.

The section is optional; a GPU profile has none, and neither does a host with a core per rank
(the bound never binds there). Schema::

    cores:
      usable: 2        # cores the measuring ranks could run on (their CPU affinity), > 0
      ranks: 4         # ranks that ran on the host while it was measured, > 0
      comm_busy: 0.67  # CPU seconds of a collective over its time, in [0, 1]
"""

from __future__ import annotations

import attrs

CORES_KEYS = ("usable", "ranks", "comm_busy")


@attrs.frozen
class HostCores:
    """The cores of a CPU host and the ranks that share them (module docstring)."""

    usable: int
    ranks: int
    comm_busy: float

    def ranks_on_host(self, world: int) -> int:
        """The ranks of a ``world`` that share one host's cores: as many as the host ran when
        it was measured, at most the world."""
        return min(self.ranks, world)


def read_cores(reader, node) -> HostCores | None:
    """The ``cores`` section of a profile, read with the profile's ``reader`` (every mistake a
    located error there); None when it has errors."""
    keys = reader.mapping(node, "cores", CORES_KEYS, CORES_KEYS)
    if keys is None:
        return None
    usable = reader.integer(keys.get("usable"), "cores.usable")
    ranks = reader.integer(keys.get("ranks"), "cores.ranks")
    busy = reader.number(keys.get("comm_busy"), "cores.comm_busy", nonneg=True, high=1.0)
    if usable is None or ranks is None or busy is None:
        return None
    return HostCores(usable=usable, ranks=ranks, comm_busy=busy)
