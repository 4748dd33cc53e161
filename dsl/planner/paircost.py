"""P(seg_f, seg_b): the make-span of a forward and a backward segment co-executed on three lanes.

This is the pair cost of the DHelix DP (the paper's Eq. 2). The model, in order of use:

1. **Measured.** If the profile's ``measured:`` section has exactly this segment pair (by op
   names, for this dtype), that time is the answer; nothing is added.
2. **Lanes.** Every op becomes tasks (:func:`~dhelix.dsl.planner.costmodel.op_tasks`): compute ops on
   the compute lane, collectives on ``local`` or ``cross``; a carrying ring-attention step is
   a compute task plus a P2P task that run together. A lane runs one task at a time, so
   compute never overlaps compute and a comm lane never overlaps itself (the paper's
   "comm type with itself"). Within a strand each lane keeps the segment's order (a CUDA
   stream); an op waits for its inputs inside the segment, inputs outside it are done.
   When a lane frees and both strands have a ready head for it, the issue order decides:
   Johnson's two-machine rule (compute that soon unlocks long communication first), and
   where that had to choose, also longest-remaining-path first; the faster one is kept
   (:meth:`PairCost.schedule` returns its timeline for the interpreter to follow).
3. **Rates.** Concurrently running tasks slow each other down. With OEF ``e`` between two
   tasks, each runs at ``1 / (2 - e)`` of its solo speed, which reproduces the paper's
   single-op formula ``P = T_i + T_j - e·min(T_i, T_j)`` exactly for any two op lengths.
   With three tasks (compute, local, cross), task k runs at ``1 / (1 + Σ_m (1 - e_km))``;
   the total progress rate stays >= 1 whenever every e >= 0 (never worse than one after the
   other). ``e`` between the two strands is the profile's OEF (per-pair override, else the
   class default); within one strand (independent own comm and compute, e.g. the wgrad ∥
   reduce_scatter "dual-colour" blocks of the paper's Fig. 10, or a ring step's two halves)
   it is ``1 - σ`` for compute with comm (σ = ``slowdown.compute_with_comm``, the Table 7
   kernel slowdown) and the ``intra_inter`` class for local with cross. OEFs above 1 are
   measurement noise (NOTES §1.1) and are clamped to 1, so a pair is never faster than
   its longest task.
4. **Pair.** ``P(f, b) = min(interleaved, P(f, ∅) + P(∅, b)) + gap``: the lanes may always
   run the two segments back to back, so a pair never costs more than its solos plus the
   profile's launch gap (``max(fixed_us, comm_fraction · solo comm time)``), which is paid
   whenever both sides are non-empty. ``P(f, ∅)`` is the same simulation with one strand.

:class:`PairCost` caches results by op identity (the planner reuses the same Op objects), and
behind that by what the model reads of a segment pair (:meth:`PairCost.shape`): two pairs of
the same shape — the same tasks in the same order with the same in-segment dependencies, the
same OEF-override keys and the same order of names across the strands (the issue tie-break) —
are simulated once. The expert groups of a MoE layer and the chunks of a Centauri chain
repeat one shape under different names.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from dhelix.dsl.planner.costmodel import Task, op_tasks
from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.mesh import LANES
from dhelix.dsl.frontend.profiles import Profile, load_profile
from dhelix.dsl.planner.segment_bound import OverlapBound, SegmentBound, lane_chain

_LANES = {lane: index for index, lane in enumerate(LANES)}


@attrs.frozen
class Slot:
    """One task of a simulated pair: which strand and op, on which lane, when."""

    strand: str  # fwd | bwd
    op: str
    lane: str
    start: float
    end: float


class _Segment:
    """One segment prepared for simulation (cached per segment): ops, in-segment
    dependencies, remaining-path lengths and per-lane task queues in segment order."""

    __slots__ = ("names", "waiting", "dependents", "ntasks", "tail", "queues", "comm", "_preps", "_ranked")

    def __init__(self, preps: list[tuple[str, tuple[str, ...], tuple]]):
        index = {name: i for i, (name, _, _) in enumerate(preps)}
        self.names = [name for name, _, _ in preps]
        self.waiting = [0] * len(preps)
        self.dependents: list[list[int]] = [[] for _ in preps]
        for i, (name, inputs, _) in enumerate(preps):
            for source in dict.fromkeys(inputs):
                j = index.get(source)
                if j is None:
                    continue  # produced outside the segment: done
                if j > i:
                    raise ValueError(f"segment order is not topological: {name} before {source}")
                self.waiting[i] += 1
                self.dependents[j].append(i)
        self.ntasks = [len(tasks) for _, _, tasks in preps]
        self.tail = [0.0] * len(preps)
        for i in range(len(preps) - 1, -1, -1):
            longest = max(t[1] for t in preps[i][2])
            self.tail[i] = longest + max((self.tail[j] for j in self.dependents[i]), default=0.0)
        # queues[lane] = [(op index, seconds, task uid)] in segment order
        self.queues: list[list[tuple[int, float, int]]] = [[], [], []]
        for i, (_, _, tasks) in enumerate(preps):
            for lane, seconds, uid in tasks:
                self.queues[lane].append((i, seconds, uid))
        self.comm = sum(seconds for lane in (1, 2) for _, seconds, _ in self.queues[lane])
        self._preps = preps
        self._ranked: list[tuple | None] = [None, None]

    def ranked(self, policy: int) -> tuple:
        """Per lane, the queue's (op index, seconds, task uid, issue key) under ``policy`` of
        _simulate (0: Johnson's rule, 1: longest path); the key ends with the op's name.
        Worked out when first asked for: a segment simulated only alone never needs the
        keys (one strand never has to choose), and Johnson's cost a pass over op pairs."""
        found = self._ranked[policy]
        if found is None:
            keys = self._johnson_keys(self._preps) if policy == 0 else self.tail
            found = self._ranked[policy] = tuple(
                tuple([(i, seconds, uid, (keys[i], self.names[i])) for i, seconds, uid in queue])
                for queue in self.queues)
        return found

    def _johnson_keys(self, preps) -> list[tuple]:
        """Issue keys after Johnson's two-machine rule: a compute op gating a comm op later in
        its strand is ranked by the compute time c before that comm and the comm's time m:
        first the ones with c < m (shortest c first), then the others (longest m first),
        then ops that gate no comm (longest remaining path first)."""
        n = len(preps)
        ancestors: list[set[int]] = [set() for _ in range(n)]
        for i in range(n):
            for j in self.dependents[i]:
                ancestors[j] |= ancestors[i] | {i}
        keys = []
        for i in range(n):
            gate = next((k for k in range(i + 1, n) if i in ancestors[k] and any(t[0] for t in preps[k][2])), None)
            if gate is None:
                keys.append((0, self.tail[i]))
                continue
            before = sum(max(t[1] for t in preps[j][2]) for j in range(i, gate)
                         if j == i or j in ancestors[gate])
            comm = max(t[1] for t in preps[gate][2] if t[0])
            keys.append((2, -before) if before < comm else (1, comm))
        return keys


class PairCost:
    """Pair and solo costs of segments on one profile and dtype.

    ``seq`` is the full sequence length attention attends over (see costmodel). Use
    :meth:`for_program` to take the profile, dtype and sequence from a checked program.
    Results are cached by segment shape (a segment's ops looked up by their identity: the cache
    holds them alive).
    """

    def __init__(self, profile: Profile, dtype: str, *, seq: int | None = None):
        self.profile, self.dtype, self.seq = profile, dtype, seq
        self._tasks: list[Task] = []  # task uid -> Task
        self._ops: dict[int, tuple] = {}  # id(op) -> (name, inputs, ((lane, s, uid), ...)), op
        self._segments: dict[tuple, tuple[_Segment, tuple, tuple, int]] = {}
        # Results by shape (see the module docstring); unused with a measured section.
        self._by_shape: dict[tuple, float] = {}
        self._shape_numbers: dict[tuple, int] = {}  # a segment's shape -> a number naming it in _by_shape
        self._override_keys = frozenset(key for pair in profile.oef_pairs for key in pair)
        # A measured section's results, keyed by op ids; each entry holds its ops so that no id is reused.
        self._solo: dict[tuple, tuple[float, tuple]] = {}
        self._pair: dict[tuple, tuple[float, tuple]] = {}
        self._oef: dict[tuple[int, int, bool], float] = {}
        self._rates: dict[tuple, tuple[float, ...]] = {}
        measured = profile.measured
        self._measured = measured if measured is not None and measured.dtype == dtype else None
        self._kinds: dict[tuple, int] = {}  # OEF class of a task -> a representative task id
        self._overlap = OverlapBound(self)

    @classmethod
    def for_program(cls, program, profile: Profile | None = None) -> "PairCost":
        """A PairCost for a checked Program: its model's dtype and seq, and ``profile`` or
        the one its cluster block names (as the checker loaded it, relative to the program)."""
        profile = profile or program.profile
        if profile is None:
            name = program.cluster.profile if program.cluster is not None else None
            if name is None:
                raise DhelixError("the program's cluster block names no profile",
                                  notes=['add profile = "a40" (or a800, h100, a path) to the cluster block'])
            profile = load_profile(name, span=program.cluster.span)
        return cls(profile, program.model.dtype, seq=program.model.get("seq"))

    # ------------------------------------------------------------ public API

    def solo(self, ops: Sequence) -> float:
        """P(seg, ∅): seconds for one segment alone (its own comm overlaps its own compute
        only where they are independent)."""
        if not ops:
            return 0.0
        if not self._measured:
            alone = _one_lane(self, ops)
            if alone is not None:
                return alone
        entry = self._segment_entry(ops)
        if self._measured:
            key = tuple(map(id, ops))
            hit = self._solo.get(key)
            if hit is not None:
                return hit[0]
            value = self._measured_time(ops, ())
            if value is None:
                value = _simulate(self, (entry[0],), 1, False)[0]
            self._solo[key] = (value, tuple(ops))
            return value
        shape_key = ("solo", entry[3])
        value = self._by_shape.get(shape_key)
        if value is None:
            # (policy 1: with one strand the policy never has to choose, and its keys are cheaper)
            value = self._by_shape[shape_key] = _simulate(self, (entry[0],), 1, False)[0]
        return value

    def pair(self, fwd: Sequence, bwd: Sequence) -> float:
        """P(fwd, bwd): seconds for a forward-strand and a backward-strand segment run
        together; with one side empty, the other's solo time."""
        if not fwd or not bwd:
            return self.solo(fwd or bwd)
        if self._measured:
            key = (tuple(map(id, fwd)), tuple(map(id, bwd)))
            hit = self._pair.get(key)
            if hit is not None:
                return hit[0]
            value = self._measured_time(fwd, bwd)
            if value is None:
                value = self._modelled_pair(fwd, bwd, False)[0]
            self._pair[key] = (value, (tuple(fwd), tuple(bwd)))
            return value
        first, second = self._segment_entry(fwd), self._segment_entry(bwd)
        return self.pair_of_shapes(fwd, bwd, (first[3], first[0].names), (second[3], second[0].names))

    def pair_of_shapes(self, fwd: Sequence, bwd: Sequence, first: tuple[int, Sequence[str]],
                       second: tuple[int, Sequence[str]]) -> float:
        """:meth:`pair` of two non-empty segments (no measured section), given each one's
        (:meth:`shape_number`, op names): what a caller asking for many pairs of the same
        segments (the planner) works out once per segment."""
        key = (first[0], second[0], _name_order(first[1], second[1]))
        value = self._by_shape.get(key)
        if value is None:
            value = self._by_shape[key] = self._modelled_pair(fwd, bwd, False)[0]
        return value

    def schedule(self, fwd: Sequence, bwd: Sequence = ()) -> tuple[float, list[Slot]]:
        """The modelled P (launch gap included; measured values are not used) and the task
        timeline behind it: what the interpreter should issue, lane by lane, and when."""
        if fwd and bwd:
            return self._modelled_pair(fwd, bwd, True)
        if not fwd and not bwd:
            return 0.0, []
        span, slots, _ = _simulate(self, (self._segment(fwd or bwd),), 1, True)
        strand = "fwd" if fwd else "bwd"
        return span, [attrs.evolve(slot, strand=strand) for slot in slots]

    def lane_work(self, ops: Sequence) -> tuple[float, ...]:
        """Seconds of work ``ops`` put on each lane (compute, local, cross) at full speed:
        a lower bound of any segment pairing's make-span that runs them (a lane runs one
        task at a time, and running beside others only slows a task)."""
        work = [0.0] * len(LANES)
        for op in ops:
            for lane, seconds, _ in self._prepare(op)[2]:
                work[lane] += seconds
        return tuple(work)

    def segment_bound(self, ops: Sequence) -> SegmentBound | None:
        """What a lower bound of any step holding ``ops`` needs (:class:`SegmentBound`), or
        None when the profile's ``measured:`` section may price a step in place of the
        model (a measured time obeys no model bound)."""
        if self._measured is not None:
            return None
        preps = [self._prepare(op) for op in ops]
        work = self.lane_work(ops)
        chain = lane_chain([inputs for _, inputs, _ in preps], [tasks for _, _, tasks in preps],
                           [name for name, _, _ in preps]) if ops else 0.0
        return SegmentBound(work, chain, work[1] + work[2], self.profile.launch_gap, self.task_kinds(ops), self._overlap)

    def task_kinds(self, ops: Sequence) -> tuple[frozenset, ...]:
        """Per lane, one task id for each OEF class its ops' tasks fall in (the class and
        the keys the profile's overrides name): what :class:`OverlapBound` reads."""
        kinds: list[set[int]] = [set(), set(), set()]
        for op in ops:
            for lane, _, uid in self._prepare(op)[2]:
                task = self._tasks[uid]
                sig = (task.cls, tuple(k for k in task.keys if k in self._override_keys))
                kinds[lane].add(self._kinds.setdefault(sig, uid))
        return tuple(frozenset(k) for k in kinds)

    def gap(self, fwd: Sequence, bwd: Sequence) -> float:
        """The launch gap a pair of these two non-empty segments pays."""
        comm = self._segment(fwd).comm + self._segment(bwd).comm
        return self.profile.launch_gap.seconds(comm)

    # ------------------------------------------------------------ internals

    def _measured_time(self, fwd: Sequence, bwd: Sequence) -> float | None:
        names_f, names_b = tuple(o.name for o in fwd), tuple(o.name for o in bwd)
        if self._measured is None:
            return None
        found = self._measured.pair_us(names_f, names_b)
        if found is None and not bwd:  # solo() does not know the side of its segment
            found = self._measured.pair_us((), names_f)
        return None if found is None else found * 1e-6

    def _modelled_pair(self, fwd: Sequence, bwd: Sequence, record: bool):
        segs = (self._segment(fwd), self._segment(bwd))
        # Two issue orders: Johnson's rule, and where it had to choose between the strands,
        # also longest remaining path first (each wins where the other errs).
        best = _simulate(self, segs, 0, record)
        if best[2]:
            other = _simulate(self, segs, 1, record)
            if other[0] < best[0]:
                best = other
        span, slots, _ = best
        apart = self.solo(fwd) + self.solo(bwd)
        if apart < span:  # run back to back: the forward segment first, then the backward one
            span = apart
            if record:
                first, f_slots = self.schedule(fwd)
                _, b_slots = self.schedule((), bwd)
                slots = f_slots + [attrs.evolve(s, start=s.start + first, end=s.end + first) for s in b_slots]
        return span + self.gap(fwd, bwd), slots

    def shape_number(self, ops: Sequence) -> int:
        """A number naming the shape of the segment ``ops`` (:meth:`shape`), one per shape
        for this cost's life."""
        return self._segment_entry(ops)[3]

    def shape(self, ops: Sequence) -> tuple:
        """What the lane model reads of a segment, names aside: per op in order, its tasks
        (lane, seconds, OEF class, the keys the profile's OEF overrides name) and the
        positions of its inputs inside the segment. Segments of one shape cost the same."""
        return self._segment_entry(ops)[2]

    def _segment(self, ops: Sequence) -> _Segment:
        return self._segment_entry(ops)[0]

    def _segment_entry(self, ops: Sequence) -> tuple[_Segment, tuple, tuple, int]:
        """(prepared segment, its ops, its shape, the shape's number): once per op list."""
        key = tuple(map(id, ops))
        hit = self._segments.get(key)
        if hit is None:
            preps = [self._prepare(op) for op in ops]
            shape = self._shape_of(preps)
            number = self._shape_numbers.setdefault(shape, len(self._shape_numbers))
            hit = (_Segment(preps), tuple(ops), shape, number)
            self._segments[key] = hit  # holding the ops keeps their ids unique
        return hit

    def _shape_of(self, preps: list[tuple]) -> tuple:
        index = {name: i for i, (name, _, _) in enumerate(preps)}
        shape = []
        for _, inputs, lanes in preps:
            tasks = tuple((lane, seconds, self._tasks[uid].cls,
                           tuple(k for k in self._tasks[uid].keys if k in self._override_keys))
                          for lane, seconds, uid in lanes)
            shape.append((tasks, tuple(sorted({index[x] for x in inputs if x in index}))))
        return tuple(shape)

    def _prepare(self, op) -> tuple:
        hit = self._ops.get(id(op))
        if hit is None:
            tasks = op_tasks(op, self.profile, self.dtype, seq=self.seq)
            if self._measured is not None and op.name in self._measured.ops and len(tasks) == 1:
                tasks = (attrs.evolve(tasks[0], seconds=self._measured.ops[op.name] * 1e-6),)
            lanes = []
            for task in tasks:
                lanes.append((_LANES[task.lane], task.seconds, len(self._tasks)))
                self._tasks.append(task)
            hit = ((op.name, tuple(op.deps), tuple(lanes)), op)
            self._ops[id(op)] = hit
        return hit[0]

    def rates(self, running: tuple[tuple[int, int], ...]) -> tuple[float, ...]:
        """Speeds (fractions of solo speed) of concurrently running tasks, each given as
        (strand, task uid): ``1 / (1 + Σ_others (1 - OEF))`` (see the module docstring)."""
        value = self._rates.get(running)
        if value is None:
            value = tuple(1.0 / (1.0 + sum(1.0 - self._oef_of(a, b) for j, b in enumerate(running) if j != i))
                          for i, a in enumerate(running))
            self._rates[running] = value
        return value

    def _oef_of(self, a: tuple[int, int], b: tuple[int, int]) -> float:
        if a[0] == b[0]:
            return self.oef(a[1], b[1], True)
        return self.oef(a[1], b[1], False) if a[0] == 0 else self.oef(b[1], a[1], False)

    def oef(self, uid_a: int, uid_b: int, same_strand: bool) -> float:
        """The OEF between two running tasks on different lanes (``uid_a`` forward-strand when
        the strands differ), clamped to at most 1."""
        key = (uid_a, uid_b, same_strand)
        value = self._oef.get(key)
        if value is None:
            a, b = self._tasks[uid_a], self._tasks[uid_b]
            if same_strand:
                value = 1.0 - self.profile.slowdown if "comp" in (a.cls, b.cls) \
                    else self.profile.oef_classes["intra_inter"]
            else:
                default = "_".join(sorted((a.cls, b.cls), key=_CLASS_ORDER.index))
                value = self.profile.oef(a.keys, b.keys, default)
            value = min(1.0, value)
            self._oef[key] = value
        return value


_CLASS_ORDER = ("comp", "intra", "inter")


def _one_lane(cost: PairCost, ops: Sequence) -> float | None:
    """The solo time of a segment whose tasks all run on one lane (None for any other):
    one task at a time, each at full speed, so their seconds added in issue order, which is
    what :func:`_simulate` adds up for it, without preparing the segment."""
    lane, total = -1, 0.0
    for op in ops:
        for task_lane, seconds, _ in cost._prepare(op)[2]:
            if task_lane != lane:
                if lane >= 0:
                    return None
                lane = task_lane
            total += seconds
    return total


def _name_order(fwd: Sequence[str], bwd: Sequence[str]) -> tuple[int, ...]:
    """How each forward op's name compares with each backward op's (-1, 0, 1): the only use
    the simulation makes of names is to break ties between the strands' ready heads."""
    return tuple([(f > b) - (f < b) for f in fwd for b in bwd])


@attrs.define
class _Running:
    """A task on a lane: its strand, op and task id, the work it has left (seconds at full
    rate), when it started, and (strand, task id), what its rate is looked up by. Mutable (a
    slots class): the hot loop updates ``remaining``."""

    strand: int
    op: int
    uid: int
    remaining: float
    start: float
    key: tuple[int, int]


def _simulate(cost: PairCost, segs: tuple[_Segment, ...], policy: int, record: bool):
    """Event simulation of one or two strands on three lanes.

    ``policy`` picks among the ready heads of one lane: 0 by Johnson's rule
    (:meth:`_Segment._johnson_keys`), 1 longest remaining path first; ties go by op name,
    so swapping the strands changes nothing. Returns (make-span, slots, contested): whether
    the policy ever had to choose.
    """
    waiting = [list(seg.waiting) for seg in segs]
    left = [list(seg.ntasks) for seg in segs]
    heads = [[0] * len(segs) for _ in range(3)]
    ranked = [seg.ranked(policy) for seg in segs]
    strands = range(len(segs))
    running: list[_Running | None] = [None, None, None]  # per lane
    now, slots, contested, busy = 0.0, [], False, 0
    while True:
        for lane in range(3):
            if running[lane] is not None:
                continue
            best = chosen = None
            for strand in strands:
                queue, head = ranked[strand][lane], heads[lane][strand]
                if head < len(queue):
                    item = queue[head]
                    if waiting[strand][item[0]] == 0:
                        # Keys end with the op name, so the choice never depends on strand order.
                        if best is None:
                            best, chosen = strand, item
                        else:
                            contested = True
                            if chosen is None or item[3] > chosen[3]:
                                best, chosen = strand, item
            if best is not None and chosen is not None:
                op, seconds, uid, _ = chosen
                heads[lane][best] += 1
                running[lane] = _Running(best, op, uid, seconds, now, (best, uid))
                busy += 1
        if not busy:
            break
        step = _advance(cost, [r for r in running if r is not None])
        now += step
        for lane in range(3):
            r = running[lane]
            if r is None or r.remaining > 0.0:
                continue
            running[lane] = None
            busy -= 1
            strand, op = r.strand, r.op
            left[strand][op] -= 1
            if left[strand][op] == 0:
                for j in segs[strand].dependents[op]:
                    waiting[strand][j] -= 1
            if record:
                slots.append(Slot(("fwd", "bwd")[strand], segs[strand].names[op], LANES[lane], r.start, now))
    if any(any(counts) for counts in left):
        raise ValueError("segment simulation stalled: an op waits for one that cannot start")
    return now, slots, contested


def _advance(cost: PairCost, active: list[_Running]) -> float:
    """Progress the running tasks to the next finish (the finishing ones get exactly 0 work
    left, the others lose rate·step); returns the time step."""
    if len(active) == 1:
        step, active[0].remaining = active[0].remaining, 0.0
        return step
    rates = cost.rates(tuple([r.key for r in active]))
    times = [r.remaining / rate for r, rate in zip(active, rates)]
    step = min(times)
    for r, rate, time in zip(active, rates, times):
        r.remaining = 0.0 if time <= step * (1.0 + 1e-12) else r.remaining - rate * step
    return step
