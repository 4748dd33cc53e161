"""The block scheduler: one static issue order for a whole SI block, across its layer pairs.

The planner (:mod:`.pairing`) cuts one layer pair into segment pairs, and every layer pair
of a block runs that plan, one after the other. At a layer boundary both strands then need
a collective that depends on the previous layer's last one (a Llama layer under sequence
parallelism ends each half with a reduce-scatter followed, after a norm, by an all-gather),
and on one host thread both wait together: in a two-node run the thread waited about a
quarter of every layer pair (``benchmarks/results/cpu_two_nodes_block_scheduler.txt``). There,
bound by the link, this order measured no faster than the plan's (slower in two runs of
three), though its model prices a layer pair 15 % shorter: it is an option
(``--si-plan scheduled``), not the default.

:func:`schedule_block` instead orders every op of the block — forward layers ``0 … nf-1``
of one strand, backward layers ``0 … nb-1`` of the other — by list scheduling over a model
of the rank: one compute lane (the host thread or the compute stream) running one op at a
time, and each communication lane running its collectives one after the other in issue
order. Repeatedly:

1. every collective whose inputs have all been issued is issued at once (on its lane it
   starts when its inputs are computed and the lane is free);
2. else the compute op to run next is, among those whose inputs have all been issued, one
   whose inputs will have arrived when the thread is free, the first by the rule's
   priority; when every such op would wait, the one whose inputs arrive first (ties: by
   priority).

Two priorities are tried, and the order with the shorter make-span is kept (the first on a
tie): the longest path to the end of its strand's chain (collectives included: the critical
path first), and the least compute before the next collective it leads to (what unlocks
communication soonest first; ties by the path). Neither is best everywhere: a long strand's
critical path can starve the other strand's collectives, and unlocking first can leave the
long strand's work for the end.

Nothing ties a strand's layer to the other strand's layer of the same index, so the
strands drift apart: while one strand waits for its reduce-scatter and all-gather, the other
computes, possibly its next layer. Memory bounds the drift (:func:`block_nodes`): backward
layer k+2 starts only once every op of backward layer k has run (its wgrads, which nothing
else waits for, cannot be put off to the block's end: their saved tensors stay alive at
most two layers), and forward layer k+2 only once backward layer k has (the forward
allocates no further ahead of what the backward frees than that). A collective whose input
is another collective is issued only once that one has arrived (issuing it earlier would
block the thread on it).

The order is a function of the DAGs, the layer counts and the profile's op times only —
the same on every rank of a group, as the collectives' matching by order requires — and the
model's make-span is the simulator's price of the block. Op times are each op alone
(:meth:`~.paircost.PairCost.solo`), a compute op that starts while a collective is in
flight stretched by the profile's ``slowdown``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs

from dhelix.dsl.core.program import Op

#: An issue of the block order: (strand ``F`` or ``B``, layer index in its chain, op name).
BlockIssue = tuple[str, int, str]


@attrs.frozen
class BlockSchedule:
    """A block's issue order and what the model predicts for it (seconds)."""

    order: tuple[BlockIssue, ...]
    layers: tuple[int, int]  # forward layers, backward layers
    makespan: float
    compute: float  # the compute lane's busy time
    comm: float  # the collectives' time, all lanes
    #: The thread idle before its last op (waiting for collectives); with a collective
    #: ending the block, make-span = compute + waits + that tail.
    waits: float

    @property
    def comm_exposed(self) -> float:
        """Communication that shows in the make-span."""
        return min(max(self.makespan - self.compute, 0.0), self.comm)


def chain_nodes(ops: Sequence[Op], output: str, strand: str, layers: int) -> dict[BlockIssue, list[BlockIssue]]:
    """Every op of ``layers`` consecutive layers of one strand with its producers: the
    producers in its own layer, and for an op that reads the layer's input (none of its
    inputs is an op of the layer) the previous layer's ``output`` op."""
    names = {op.name for op in ops}
    nodes: dict[BlockIssue, list[BlockIssue]] = {}
    for layer in range(layers):
        for op in ops:
            deps = [(strand, layer, name) for name in op.deps if name in names]
            if layer > 0 and not deps:
                deps.append((strand, layer - 1, output))
            nodes[(strand, layer, op.name)] = deps
    return nodes


#: How many layers a strand may start ahead of the backward layers that have run whole.
LAG = 2


def block_nodes(fwd: Sequence[Op], bwd: Sequence[Op], outputs: tuple[str, str],
                layers: tuple[int, int]) -> dict[BlockIssue, list[BlockIssue]]:
    """Both chains' ops with their producers (:func:`chain_nodes`), plus the memory bound of
    the module: the ops that start forward or backward layer k + LAG also wait for every op
    of backward layer k."""
    nodes = chain_nodes(fwd, outputs[0], "F", layers[0]) | chain_nodes(bwd, outputs[1], "B", layers[1])
    for strand, ops, count in (("F", fwd, layers[0]), ("B", bwd, layers[1])):
        names = {op.name for op in ops}
        roots = [op.name for op in ops if not any(dep in names for dep in op.deps)]
        for layer in range(LAG, count):
            if layer - LAG >= layers[1]:
                break
            done = [("B", layer - LAG, op.name) for op in bwd]
            for root in roots:
                nodes[(strand, layer, root)] = nodes[(strand, layer, root)] + done
    return nodes


def schedule_block(fwd: Sequence[Op], bwd: Sequence[Op], outputs: tuple[str, str], layers: tuple[int, int],
                   seconds: Callable[[Op], float], slowdown: float = 0.0) -> BlockSchedule:
    """The block order of ``layers[0]`` forward layers (DAG ops ``fwd``, in a topological
    order, output op ``outputs[0]``) beside ``layers[1]`` backward layers (``bwd``,
    ``outputs[1]``), by the rules of the module; ``seconds(op)`` is an op's time alone,
    ``slowdown`` the profile's stretch of compute beside a collective. Returns the order
    and its modelled times (the best of the module's two priorities)."""
    ops = {("F", op.name): op for op in fwd}
    ops.update({("B", op.name): op for op in bwd})
    nodes = block_nodes(fwd, bwd, outputs, (layers[0], layers[1]))
    duration = {node: seconds(ops[(node[0], node[2])]) for node in nodes}
    succ: dict[BlockIssue, list[BlockIssue]] = {node: [] for node in nodes}
    for node, deps in nodes.items():
        for dep in deps:
            succ[dep].append(node)
    path = _longest_paths(nodes, succ, duration)
    unlock = _to_collective(nodes, succ, duration, ops)
    # Ties: the forward strand, the earlier layer, the op's place in its DAG.
    place = {node: (node[0] != "F", node[1], i) for i, node in enumerate(nodes)}
    rules = ({node: (-path[node], place[node]) for node in nodes},
             {node: (unlock[node], -path[node], place[node]) for node in nodes})
    best = None
    for priority in rules:
        schedule = _list_schedule(nodes, succ, ops, duration, priority, slowdown, tuple(layers))
        if best is None or schedule.makespan < best.makespan:
            best = schedule
    assert best is not None, "two priorities"
    return best


def _list_schedule(nodes, succ, ops, duration, priority, slowdown, layers) -> BlockSchedule:
    """The list schedule of the module's model with ``priority`` (a sort key per op)."""
    left = {node: len(deps) for node, deps in nodes.items()}
    comms: list[BlockIssue] = []  # ready collectives
    computes: list[BlockIssue] = []  # ready compute ops
    for node, count in left.items():
        if count == 0:
            _push(node, ops, comms, computes)
    done: dict[BlockIssue, float] = {}
    lane_free: dict[str, float] = {}
    in_flight: list[tuple[float, float]] = []  # (start, end) of every collective
    order: list[BlockIssue] = []
    now = busy = waits = comm_time = 0.0

    def arrival(node) -> float:  # when the collectives a collective reads have arrived
        return max([0.0] + [done[dep] for dep in nodes[node] if ops[(dep[0], dep[2])].kind == "comm"])

    while comms or computes:
        issuable = [node for node in comms if arrival(node) <= now]
        if issuable or not computes:
            node = min(issuable, key=priority.__getitem__) if issuable else \
                min(comms, key=lambda n: (arrival(n), priority[n]))
            comms.remove(node)
            if arrival(node) > now:  # nothing else to run: the thread waits for its input
                waits += arrival(node) - now
                now = arrival(node)
            lane = ops[(node[0], node[2])].lane
            start = max([now, lane_free.get(lane, 0.0)] + [done[dep] for dep in nodes[node]])
            done[node] = lane_free[lane] = start + duration[node]
            in_flight.append((start, done[node]))
            comm_time += duration[node]
        else:
            node = min(computes, key=lambda n: _choice(n, nodes, done, now, priority))
            computes.remove(node)
            start = max([now] + [done[dep] for dep in nodes[node]])
            waits += start - now
            stretch = 1.0 + slowdown if any(s <= start < e for s, e in in_flight) else 1.0
            now = done[node] = start + duration[node] * stretch
            busy += duration[node] * stretch
        order.append(node)
        for nxt in succ[node]:
            left[nxt] -= 1
            if left[nxt] == 0:
                _push(nxt, ops, comms, computes)
    makespan = max(done.values(), default=0.0)
    return BlockSchedule(order=tuple(order), layers=layers, makespan=makespan, compute=busy,
                         comm=comm_time, waits=waits)


def _push(node, ops, comms, computes) -> None:
    (comms if ops[(node[0], node[2])].kind == "comm" else computes).append(node)


def _choice(node, nodes, done, now, priority) -> tuple:
    """The sort key of a ready compute op: runs without waiting first, then by priority."""
    arrives = max([0.0] + [done[dep] for dep in nodes[node]])
    if arrives <= now:
        return (0, 0.0, priority[node])
    return (1, arrives, priority[node])


def _to_collective(nodes, succ, duration, ops) -> dict[BlockIssue, float]:
    """Each compute op's time plus the least compute after it before a collective it leads
    to (infinite when it leads to none); 0 for a collective."""
    far = float("inf")
    unlock: dict[BlockIssue, float] = {}
    for node in reversed(_topological(nodes, succ)):
        if ops[(node[0], node[2])].kind == "comm":
            unlock[node] = 0.0
        else:
            unlock[node] = duration[node] + min((unlock[n] for n in succ[node]), default=far)
    return unlock


def _longest_paths(nodes, succ, duration) -> dict[BlockIssue, float]:
    """Each op's time plus the longest chain of ops after it (its strand's critical path)."""
    path: dict[BlockIssue, float] = {}
    for node in reversed(_topological(nodes, succ)):
        path[node] = duration[node] + max((path[n] for n in succ[node]), default=0.0)
    return path


def _topological(nodes, succ) -> list[BlockIssue]:
    left = {node: len(deps) for node, deps in nodes.items()}
    ready = [node for node, count in left.items() if count == 0]
    out = []
    while ready:
        node = ready.pop()
        out.append(node)
        for nxt in succ[node]:
            left[nxt] -= 1
            if left[nxt] == 0:
                ready.append(nxt)
    return out


class BlockScheduler:
    """:func:`schedule_block` for one layer pair's DAGs and one cost, cached by layer
    counts (every SI block with the same counts runs the same order)."""

    def __init__(self, fwd: Sequence[Op], bwd: Sequence[Op], outputs: tuple[str, str],
                 seconds: Callable[[Op], float], slowdown: float = 0.0):
        self.fwd, self.bwd, self.outputs = tuple(fwd), tuple(bwd), outputs
        self.seconds, self.slowdown = seconds, slowdown
        self._cache: dict[tuple[int, int], BlockSchedule] = {}

    def __call__(self, forward_layers: int, backward_layers: int) -> BlockSchedule:
        key = (forward_layers, backward_layers)
        if key not in self._cache:
            self._cache[key] = schedule_block(self.fwd, self.bwd, self.outputs, key, self.seconds, self.slowdown)
        return self._cache[key]
