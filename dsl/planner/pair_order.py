"""The order in which an SI block issues the ops of each segment pair.

A segment pair holds a piece of each strand's op sequence; the plan says which ops run
together, not in which order one host thread issues them, and that order decides how much
communication the other strand's compute hides. :func:`order_pair` is a small list
scheduler over both strands' ops. It repeatedly picks, among the ops whose producers in the
pair have run, the first by class:

0. a collective whose inputs exist (none is a collective still in flight): issued at once,
   asynchronously, so it is in flight while the thread computes;
1. a compute op on the way to a collective of the pair, the one that unlocks a collective
   soonest first: its *distance* is the number of unrun compute ops the nearest collective
   depending on it still waits for, itself included (the critical path to the next
   collective, counted in ops: nothing here knows durations);
2. an op on the way to a collective that reads a collective still in flight (running it
   waits) which some compute op has covered since it was issued — the oldest first;
3. a compute op that leads to no collective of the pair (filler to hide collectives behind);
4. an op on the way to a collective that reads an uncovered one: waiting for a collective
   nothing has run beside would expose all of it, so filler goes first;
5. an op that waits and leads to no collective.

Ties go to the strict alternation's order (forward op i, backward op i, forward op i+1, …).
A collective is only waited for by the op that reads it, so collectives stay in flight
across pair boundaries unless the runner puts a barrier there (``barrier``).

The order is static — a function of the plan and the DAGs only, never of which collective
happens to have finished — because every rank of a process group must issue that group's
collectives in the same order (gloo and NCCL match them by order), and every rank of a
group runs the same plan.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs

from dhelix.dsl.core.program import Op

from .si_plan import SegmentPlan

#: The strands of an SI pair as issue records name them: the forward (F) and backward (B) one.
STRANDS = ("F", "B")


@attrs.frozen
class Issue:
    """One op of a segment pair as the runner issues it: its strand (``F`` or ``B``) and the
    op; a collective (``comm``) is issued asynchronously."""

    strand: str
    op: Op
    #: An op of the next layer pair's forward layer, issued in this one (:class:`BlockOrder`).
    ahead: bool = False

    @property
    def comm(self) -> bool:
        """Whether the op is a collective (issued with ``async_op``)."""
        return self.op.kind == "comm"

    @property
    def name(self) -> str:
        """``strand.op``, e.g. ``B.rs2.bwd``: how traces and tests name the issue."""
        return f"{self.strand}.{self.op.name}"


#: One segment pair ready to run: its index in the plan and its ops in issue order.
PairIssues = tuple[int, tuple[Issue, ...]]


@attrs.define
class InFlight:
    """The collectives issued and not yet read, carried from pair to pair: ``issued`` maps
    (strand, collective name) to its issue number; ``clock`` numbers every issued op;
    ``last_compute`` is the number of the last compute op issued (a collective issued
    before it is *covered*: something ran beside it)."""

    issued: dict[tuple[str, str], int] = attrs.field(factory=dict)
    clock: int = 0
    last_compute: int = -1

    def covered(self, key: tuple[str, str]) -> bool:
        """Whether a compute op was issued after in-flight collective ``key``."""
        return self.issued[key] < self.last_compute


def order_pair(fwd: Sequence[Op], bwd: Sequence[Op], flight: InFlight) -> tuple[Issue, ...]:
    """The issue order of one segment pair with forward ops ``fwd`` and backward ops ``bwd``
    (each in a legal order of its DAG; either may be empty), by the rules of the module.

    ``flight`` holds the collectives earlier pairs left in flight and is updated in place:
    ops that read one remove it, collectives issued here are added. Assumes every input an
    op has in its own DAG is produced by an earlier pair or by an op of this pair
    (:func:`.si_plan.check_plan`)."""
    left: dict[tuple[str, str], Op] = {}
    position: dict[tuple[str, str], int] = {}
    for offset, ops in enumerate((fwd, bwd)):
        for i, op in enumerate(ops):
            key = (STRANDS[offset], op.name)
            left[key], position[key] = op, 2 * i + offset
    order = []
    while left:
        ready = [key for key, op in left.items() if not any((key[0], name) in left for name in op.deps)]
        distance = _distances(left)
        key = min(ready, key=lambda k: _rank(k, left[k], flight, distance, position))
        op = left.pop(key)
        for name in op.deps:
            flight.issued.pop((key[0], name), None)
        if op.kind == "comm":
            flight.issued[key] = flight.clock
        else:
            flight.last_compute = flight.clock
        flight.clock += 1
        order.append(Issue(strand=key[0], op=op))
    return tuple(order)


def _rank(key: tuple[str, str], op: Op, flight: InFlight, distance: Mapping[tuple[str, str], int],
          position: Mapping[tuple[str, str], int]) -> tuple:
    """The sort key of a ready op: (class, oldest awaited issue, distance, alternation order)."""
    comm = op.kind == "comm"
    waits = [(key[0], name) for name in op.deps if (key[0], name) in flight.issued]
    steps = 0 if comm else distance.get(key)
    leads = steps is not None
    if not waits:
        return (0 if comm else 1 if leads else 3, 0, steps or 0, position[key])
    oldest = min(flight.issued[w] for w in waits)
    if not leads:
        cls = 5
    else:
        cls = 2 if all(flight.covered(w) for w in waits) else 4
    return (cls, oldest, steps, position[key])


def _distances(left: Mapping[tuple[str, str], Op]) -> dict[tuple[str, str], int]:
    """For each unrun compute op that an unrun collective of the pair depends on: the fewest
    unrun compute ops (itself included) such a collective still waits for."""
    distance: dict[tuple[str, str], int] = {}
    for key, op in left.items():
        if op.kind != "comm":
            continue
        ancestors = _ancestors(key, left)
        computes = [a for a in ancestors if left[a].kind != "comm"]
        for a in computes:
            distance[a] = min(distance.get(a, len(computes)), len(computes))
    return distance


def _ancestors(key: tuple[str, str], left: Mapping[tuple[str, str], Op]) -> set[tuple[str, str]]:
    # The unrun ops of the same strand that ``key`` depends on, directly or not.
    found: set[tuple[str, str]] = set()
    stack = [key]
    while stack:
        for name in left[stack.pop()].deps:
            producer = (key[0], name)
            if producer in left and producer not in found:
                found.add(producer)
                stack.append(producer)
    return found


def plan_order(plan: SegmentPlan, fwd_ops: Mapping[str, Op] | None, bwd_ops: Mapping[str, Op] | None,
               barrier: bool, flight: InFlight | None = None,
               issued: frozenset[tuple[str, str]] = frozenset()) -> tuple[PairIssues, ...]:
    """Every non-empty segment pair of ``plan`` with its ops in issue order, for one layer
    pair. ``fwd_ops``/``bwd_ops`` are the ops each strand runs, by name, or None when that
    strand has no layer here (chains of unequal length); plan names missing from
    ``bwd_ops`` (the wgrads of a split B) are skipped. ``barrier``: whether the runner waits
    for every collective at the end of each pair (then none is in flight when the next
    starts); otherwise collectives stay in flight until their reader, across pairs.
    ``flight``: collectives already in flight when the layer pair starts; ``issued``: the
    (strand, op name) issued before it (the leads)."""
    flight = flight if flight is not None else InFlight()
    pairs = []
    for index, (fnames, bnames) in enumerate(plan):
        fwd = [fwd_ops[name] for name in fnames if ("F", name) not in issued] if fwd_ops is not None else []
        bwd = [bwd_ops[name] for name in bnames if name in bwd_ops and ("B", name) not in issued] \
            if bwd_ops is not None else []
        if not (fwd or bwd):
            continue
        pairs.append((index, order_pair(fwd, bwd, flight)))
        if barrier:
            flight.issued.clear()
    return tuple(pairs)


def strand_lead(ops: Sequence[Op], plan: SegmentPlan, strand: str, output: str) -> tuple[Op, ...]:
    """A layer's lead on ``strand``: its ops in the plan's order up to and including its
    first collective (forward ``ln1``, ``ag1``; backward ``h2.bwd``, ``rs2.bwd``), which read
    only the layer's input (its output gradient) and so can be issued as soon as the
    previous layer of the strand produced it (its op ``output``). Empty when issuing it
    early gains nothing: the layer has no collective, the lead is the whole layer, or the
    previous layer's result is itself a collective (the lead would wait for it at once)."""
    by_name = {op.name: op for op in ops}
    side = 0 if strand == "F" else 1
    lead = []
    for names in plan:
        for name in names[side]:
            if name not in by_name:
                continue
            lead.append(by_name[name])
            if by_name[name].kind == "comm":
                if len(lead) == len(by_name) or by_name[output].kind == "comm":
                    return ()
                return tuple(lead)
    return ()


def with_lead(pairs: Sequence[PairIssues], lead: Sequence[Op], strand: str, after: str
              ) -> tuple[PairIssues, ...]:
    """``pairs`` with the next layer's ``lead`` on ``strand`` (:func:`strand_lead`) issued
    right after this layer pair's op ``after`` of that strand (the op producing the layer's
    result) (``ahead``)."""
    ahead = tuple(Issue(strand=strand, op=op, ahead=True) for op in lead)
    at, position = next((at, position) for at, (_, issues) in enumerate(pairs)
                        for position, issue in enumerate(issues)
                        if issue.strand == strand and not issue.ahead and issue.op.name == after)
    index, issues = pairs[at]
    return tuple(pairs[:at]) + ((index, issues[:position + 1] + ahead + issues[position + 1:]),) + tuple(pairs[at + 1:])


@attrs.frozen
class BlockOrder:
    """The issue order of a layer pair's segment pairs (:func:`plan_order`) for each case of
    an SI block: both strands have a layer, only the forward one, only the backward one.
    Built once per executor: every layer pair of every SI block runs the same plan.

    Between the layer pairs of a block, each strand's next layer's lead (:func:`strand_lead`:
    its first collective and what feeds it) is issued in this layer pair, right after the
    op that produces this layer's result (the forward's output, the backward's input
    gradient), instead of in the next layer pair: both strands would otherwise open every
    layer pair waiting for a collective that depends on the previous one's last
    collectives. Their collectives are on the wire while this layer pair's remaining ops
    run (the backward's wgrads, the forward's last GEMMs). The next layer pair is ordered
    with them in flight (``led``)."""

    plan: SegmentPlan
    fwd: Mapping[str, Op]
    bwd: Mapping[str, Op]
    barrier: bool
    #: The forward and the backward strand's leads (empty: none).
    lead: tuple[Op, ...] = ()
    back_lead: tuple[Op, ...] = ()
    #: The ops producing a layer's output (forward) and input gradient (backward).
    outputs: tuple[str, str] = ("", "")
    _orders: dict = attrs.field(factory=dict, eq=False, repr=False)

    @classmethod
    def build(cls, plan: SegmentPlan, fwd_ops: Sequence[Op], bwd_ops: Sequence[Op],
              barrier: bool, outputs: tuple[str, str]) -> "BlockOrder":
        """The orders of ``plan`` over the forward ops ``fwd_ops`` and the backward ops a B
        action runs, ``bwd_ops``; ``barrier`` as in :func:`plan_order`; ``outputs``: the ops
        producing the layer's output and its input gradient (the DAGs' ``output``)."""
        return cls(plan=plan, fwd={op.name: op for op in fwd_ops}, bwd={op.name: op for op in bwd_ops},
                   barrier=barrier, lead=strand_lead(fwd_ops, plan, "F", outputs[0]),
                   back_lead=strand_lead(bwd_ops, plan, "B", outputs[1]), outputs=outputs)

    def complete(self) -> "BlockOrder":
        """This order with every case an SI block can ask for computed (each strand's layer
        led or not), so that whoever holds it never orders a pair again; returns itself."""
        for forward, backward in ((True, True), (True, False), (False, True)):
            for led in (False, True):
                for back_led in (False, True):
                    self.pairs(forward, backward, led=led, back_led=back_led)
        return self

    @property
    def both(self) -> tuple[PairIssues, ...]:
        """Both strands have a layer, no lead issued or to issue."""
        return self.pairs(True, True)

    @property
    def forward(self) -> tuple[PairIssues, ...]:
        """Only the forward strand has a layer."""
        return self.pairs(True, False)

    @property
    def backward(self) -> tuple[PairIssues, ...]:
        """Only the backward strand has a layer."""
        return self.pairs(False, True)

    def pairs(self, forward: bool, backward: bool, led: bool = False, lead_next: bool = False,
              back_led: bool = False, back_lead_next: bool = False) -> tuple[PairIssues, ...]:
        """The pairs to run when the forward and/or the backward strand has a layer; ``led``
        / ``back_led``: that strand's layer had its lead issued in the previous layer pair;
        ``lead_next`` / ``back_lead_next``: issue that strand's next layer's lead in this one
        (each only where the strand has a layer and a lead)."""
        leading = forward and bool(self.lead), backward and bool(self.back_lead)
        led, lead_next = led and leading[0], lead_next and leading[0]
        back_led, back_lead_next = back_led and leading[1], back_lead_next and leading[1]
        key = (forward, backward, led, back_led)
        if key not in self._orders:
            leads = [(strand, ops) for strand, ops, on in (("F", self.lead, led), ("B", self.back_lead, back_led))
                     if on]
            # the leads' collectives in flight (under a barrier: complete) when the pair starts
            flight = InFlight(issued={} if self.barrier else {(s, ops[-1].name): 0 for s, ops in leads},
                              clock=1 if leads else 0)
            self._orders[key] = plan_order(self.plan, self.fwd if forward else None,
                                           self.bwd if backward else None, self.barrier, flight,
                                           frozenset((s, op.name) for s, ops in leads for op in ops))
        pairs = self._orders[key]
        if lead_next:
            pairs = with_lead(pairs, self.lead, "F", self.outputs[0])
        if back_lead_next:
            pairs = with_lead(pairs, self.back_lead, "B", self.outputs[1])
        return pairs
