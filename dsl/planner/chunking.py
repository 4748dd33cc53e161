"""Centauri's operation-level scheduling (ASPLOS'24 §3.2.1, Algorithm 1): the chunk count of
every ``chunk … by auto`` statement of a partition block, and the launch order (inter- or
intra-node sub-group first) of every collective of a ``group`` statement without ``first``,
chosen with the cost model.

The partition pass leaves an auto chain whole until it is given a count
(``Program.chunk_counts``). Here each auto statement, in block order, tries every candidate
count — 1 and each count up to :data:`MAX_CHUNKS` the pass accepts (the chain's dimension
must divide) — with the counts chosen before it kept, and prices the layer's forward and
backward DAGs alone (:meth:`~.paircost.PairCost.solo`, in the order the interpreter issues
one strand: :func:`issue_order`): a chunk's collective overlaps the compute of the chunk
before it, and every chunk pays its collective's latency and launch gap, so the best count
trades the two. The smallest total wins, ties to the fewer chunks.
Centauri's Algorithm 1 searches one collective's partitions the same way with its own cost
model; pricing the whole layer also counts what a chain does to the ops around it. A
candidate the passes refuse (a count that does not divide, a measured profile taken on
another program) is skipped with the reason, shown by ``dhelix plan``.

Besides the counts, a chain that starts with a gather a ``group`` statement splits tries
``stages`` (Algorithm 1's uneven partition, lines 8-22: compute on what the first stage
brought while the second runs, then on the rest; :func:`~dhelix.dsl.passes.workload.is_stages`),
priced the same way with either stage first where no ``first`` fixes the order (the order
itself is chosen after the counts, below); a chain whose gather has no stages does not list it.
A gemm chunked along its outputs under ZeRO-3 with ``group weights`` tries ``stages`` too
(its columns split at its weight gather's stages, either order where none is fixed).
Beside ``stages``, ``stages3`` (Algorithm 1's finer split, lines 19-20: the node's blocks, this
place's on the other nodes, the rest), which runs the node-local stage first; for a gemm's
weight gather, each stage's columns (:mod:`dhelix.dsl.passes.fsdp`).

Orders come after the counts (Algorithm 1 partitions the workload, then orders the group's
stages): each such collective, in block order, is priced both ways the same way, the others
kept, and the faster order wins, ties to the one that carries fewest bytes across nodes
(:func:`~dhelix.dsl.passes.partition.fewest_cross_bytes`, which is also what ``dhelix
check`` shows before any choice). ``weights`` stands for ZeRO-3's gathers (its
reduce-scatters run the reverse order).

Before all of these (substitutions apply first), each ``substitute X as auto`` statement:
X whole against Table 2's scalable form for its kind (``Program.substituted``), priced the
same way, ties to whole — Centauri prunes the substitutions that do not pay.

Last, the layer-level priority (§3.2.2, Eq. 1: T1, each GEMM's dgrad first, against T2,
its wgrad first; :mod:`dhelix.dsl.passes.priority`) of a program with a partition block and
no ``backward … first`` statement: both priced the same way, ties to dgrad (Megatron's).
Eq. 1 writes T1 and T2 in closed form for one TP + FSDP layer; pricing the layer's DAG
evaluates the same overlaps for whatever the layer holds.

The choice needs the profile's costs, so it is made here, at the planner stage, and the
commands that price or run a program (plan, simulate, run) apply it through
:func:`dhelix.dsl.simulator.launch.priced_program`; ``dhelix check`` shows auto chains whole.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import DhelixError, first_message
from dhelix.dsl.core.program import Op, Program
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.passes.fsdp import is_fsdp
from dhelix.dsl.core.oplib import DGRAD, OUTPUTS, PARTITION_DIMS
from dhelix.dsl.core.mesh import base_axis
from dhelix.dsl.passes.group_levels import ORDER_JOIN, default_order, every_order, order_text, stages_of
from dhelix.dsl.passes.partition import ORDERS, WEIGHTS, fewest_cross_bytes, is_auto_substitution, scalable_form
from dhelix.dsl.passes.workload import STAGES, STAGES3, chunk_statements, is_auto
from dhelix.dsl.passes.priority import PRIORITIES, backward_statement
from dhelix.dsl.planner.paircost import PairCost

#: The largest chunk count ``by auto`` tries (Centauri's MAX_CHUNKS).
MAX_CHUNKS = 8


@attrs.frozen
class Candidate:
    """One chunk count or group order tried: the layer's forward + backward time alone with
    it (seconds), or None and why the passes refused it."""

    value: int | str  # a chunk count (or STAGES), an order or a priority
    seconds: float | None
    why: str = ""


@attrs.frozen
class ChunkChoice:
    """The count chosen for one ``by auto`` statement and every candidate tried."""

    ops: tuple[str, ...]
    chosen: int | str  # a count, or STAGES
    candidates: tuple[Candidate, ...]
    #: The whole step's seconds of the counts the layer priced best, when the step chose
    #: among them (:func:`dhelix.dsl.simulator.launch.choose_counts_by_step`); () otherwise.
    steps: tuple[tuple[int | str, float], ...] = ()
    #: The counts of those whose program does not fit the device memory (not stepped).
    over: tuple[int | str, ...] = ()
    block = "partition"  # the block whose statement it chose for

    def describe(self) -> str:
        """``chunk ag2 + fc1 by auto: 4 (1: 12.3 ms, 2: 10.1 ms, 4: 9.8 ms, 8: 10.4 ms)``, then
        ``; by the step: 4: 330.1 ms, 2: 329.8 ms`` when the step chose, then ``; over the
        device memory: 8`` for counts that do not fit."""
        text = _described(f"chunk {' + '.join(self.ops)} by auto: {self.chosen}", self.candidates)
        if self.steps:
            text += "; by the whole step: " + ", ".join(f"{v}: {t * 1e3:.3f} ms" for v, t in self.steps)
        if self.over:
            text += f"; over the device memory: {', '.join(str(v) for v in self.over)}"
        return text


@attrs.frozen
class OrderChoice:
    """What runs first, chosen for ``what``: a collective of a ``group`` statement
    (``group ag1``; ``group weights``: ZeRO-3's gathers) — ``inter`` or ``intra`` — or the
    layer's ``backward`` — ``dgrad`` or ``wgrad`` — and the layer's time alone with each."""

    what: str
    chosen: str
    candidates: tuple[Candidate, ...]
    block = "partition"  # the block whose statement it chose for

    def describe(self) -> str:
        """``group ag1: inter first (inter: 1.234 ms, intra: 1.456 ms; …)``; over declared
        levels ``group ag1: cluster>node>island (island>node>cluster: 1.234 ms, …)``."""
        first = "" if ORDER_JOIN in self.chosen else " first"
        return _described(f"{self.what}: {self.chosen}{first}", self.candidates)


@attrs.frozen
class SubstitutionChoice:
    """Whether the collective of a ``substitute X as auto`` statement is substituted (by
    Table 2's scalable form, ``form``) or pruned (left whole), and the layer's time alone
    both ways."""

    op: str
    chosen: str  # WHOLE or the form, "reduce_scatter + all_gather", "reduce", "broadcast"
    candidates: tuple[Candidate, ...]
    block = "partition"  # the block whose statement it chose for

    def describe(self) -> str:
        """``substitute rs1 as auto: whole (whole: 1.234 ms, reduce: 1.456 ms; …)``."""
        return _described(f"substitute {self.op} as auto: {self.chosen}", self.candidates)


#: A ``substitute … as auto`` the planner pruned: the collective stays as written.
WHOLE = "whole"


def choose_all(program: Program) -> tuple[Program, tuple[ChunkChoice | OrderChoice | SubstitutionChoice, ...]]:
    """``program`` (checked, any stage from check on) with its substitutions, chunk counts,
    group orders and backward priority chosen, in that order (:func:`choose_substitutions`,
    :func:`choose_chunks`, :func:`choose_orders`, :func:`choose_priority`), and the choices.
    The model level's launch count, which simulates the step, comes after
    (:func:`dhelix.dsl.simulator.launch.priced_program`)."""
    program, substitutions = choose_substitutions(program)
    program, chunks = choose_chunks(program)
    program, orders = choose_orders(program)
    program, priority = choose_priority(program)
    return program, substitutions + chunks + orders + priority


def choose_substitutions(program: Program) -> tuple[Program, tuple[SubstitutionChoice, ...]]:
    """``program`` (checked, any stage from check on) with each collective of a ``substitute
    X as auto`` statement substituted by Table 2's scalable form for its kind where that makes
    the layer's forward + backward alone faster (Centauri's pruning of substitutions that do
    not pay; ties to leaving it whole), its later passes run again; unchanged with () when
    it has none."""
    if program.partition is None or program.forward is None or program.profile is None:
        return program, ()
    kinds = {op.name: op.op for op in program.forward.ops}
    names = [st.op for st in program.partition.body
             if isinstance(st, s.Substitute) and is_auto_substitution(st) and st.op in kinds]
    if not names:
        return program, ()
    chosen, choices = set(program.substituted), []
    for name in names:
        form = " + ".join(scalable_form(kinds[name]) or ())
        candidates = tuple(Candidate(value, *_price(attrs.evolve(program, substituted=tuple(sorted(names_with)))))
                           for value, names_with in ((WHOLE, chosen - {name}), (form, chosen | {name})))
        best = _fastest(candidates, WHOLE)
        chosen = chosen | {name} if best != WHOLE else chosen - {name}
        choices.append(SubstitutionChoice(name, best, candidates))
    return passes.rerun(attrs.evolve(program, substituted=tuple(sorted(chosen))), after="check"), tuple(choices)


def choose_priority(program: Program) -> tuple[Program, tuple[OrderChoice, ...]]:
    """``program`` (checked, any stage from check on) with the layer-level priority chosen by
    the cost model when it has a partition block without a ``backward … first`` statement,
    its later passes run again; unchanged with () otherwise."""
    if program.partition is None or backward_statement(program) is not None or program.forward is None \
            or program.profile is None:
        return program, ()
    candidates = tuple(Candidate(first, *_price(attrs.evolve(program, backward_first=first))) for first in PRIORITIES)
    best = _fastest(candidates, DGRAD)
    return passes.rerun(attrs.evolve(program, backward_first=best), after="check"), \
        (OrderChoice("backward", best, candidates),)


def choose_orders(program: Program) -> tuple[Program, tuple[OrderChoice, ...]]:
    """``program`` (checked, any stage from check on, its chunk counts chosen) with the
    launch order of every collective of its ``group`` statements without ``first`` chosen by
    the cost model, its later passes run again; unchanged with () when it has none."""
    names = _unordered(program)
    if not names or program.profile is None:
        return program, ()
    orders = dict(program.group_orders)
    choices = []
    for name, op in names:
        tried, default = _orders_of(program, name, op)
        candidates = tuple(Candidate(order, *_price(attrs.evolve(
            program, group_orders=tuple(sorted({**orders, name: order}.items()))))) for order in tried)
        # A measured profile holds the ops of one order: the other is refused, not an error.
        best = _fastest(candidates, default)
        orders[name] = best
        choices.append(OrderChoice(f"group {name}", best, candidates))
    chosen = attrs.evolve(program, group_orders=tuple(sorted(orders.items())))
    return passes.rerun(chosen, after="check"), tuple(choices)


def _orders_of(program: Program, name: str, kind: str) -> tuple[tuple[str, ...], str]:
    """The orders to try for collective ``name`` (of ``kind``) of a group statement, and the
    one ties go to: inter or intra first, or over a declared topology every order of the
    levels its group spans (:mod:`dhelix.dsl.passes.group_levels`)."""
    assert program.mesh is not None and program.forward is not None, "a checked model"
    if not program.mesh.levels or name == WEIGHTS:
        return ORDERS, fewest_cross_bytes(kind)
    axis = next(base_axis(str(op.axis)) for op in program.forward.ops if op.kind == "comm" and name in (op.name, op.origin))
    stages = stages_of(name, axis, program.mesh, None)
    if not isinstance(stages, tuple):
        return ORDERS, fewest_cross_bytes(kind)
    return tuple(order_text(order) for order in every_order(stages)), order_text(default_order(kind, stages))


def _unordered(program: Program) -> list[tuple[str, str]]:
    """(name, collective kind) of each collective a ``group`` statement without ``first``
    splits, in block order; ``weights`` (an all_gather's order) under ZeRO-3."""
    if program.partition is None or program.forward is None:
        return []
    # A chunked collective's chunks name it as their origin (the concat that joins them keeps
    # its name, so only collectives count); a split one's last stage keeps its name.
    comms = [op for op in program.forward.ops if op.kind == "comm"]
    written = {op.origin: op.op for op in comms if op.origin} | {op.name: op.op for op in comms}
    found = []
    for st in program.partition.body:
        if isinstance(st, s.Group) and st.first is None:
            for name in st.ops:
                if name in written:
                    found.append((name, written[name]))
                elif name == WEIGHTS and is_fsdp(program):
                    found.append((name, "all_gather"))
    return found


def choose_chunks(program: Program) -> tuple[Program, tuple[ChunkChoice, ...]]:
    """``program`` (checked, any stage from check on) with every ``by auto`` count chosen by
    the cost model, its later passes run again; unchanged with () when it has none."""
    statements = chunk_statements(program.partition)
    autos = [index for index, st in enumerate(statements) if is_auto(st)]
    if not autos or program.forward is None or program.profile is None:
        return program, ()
    counts = dict(program.chunk_counts)
    choices = []
    for index in autos:
        candidates = []
        # Stages split the tokens a gather brings, or a gemm's columns at its weight gather's
        # stages (ZeRO-3 under group weights): not a candidate along features.
        dim = statements[index].dim
        staged = [STAGES, STAGES3] if dim in (None, PARTITION_DIMS[0], OUTPUTS) else []
        for count in [*range(1, MAX_CHUNKS + 1), *staged]:
            tried = attrs.evolve(program, chunk_counts=tuple(sorted({**counts, index: count}.items())))
            if count in (STAGES, STAGES3):  # with either stage first where the order is still open
                seconds, why = _staged(tried, WEIGHTS if dim == OUTPUTS else statements[index].ops[0])
            else:
                seconds, why = _price(tried)
            # Counts the dimension does not divide, and the stages of a gather no group
            # statement splits, are expected for most chains: left out of the report.
            if count == 1 or seconds is not None or not why.startswith(_EXPECTED):
                candidates.append(Candidate(count, seconds, why))
        priced = [c for c in candidates if c.seconds is not None]
        best = min(priced, key=_cheapest) if priced else Candidate(1, None)
        counts[index] = best.value
        choices.append(ChunkChoice(statements[index].ops, best.value,
                                   tuple(c for c in candidates if c.seconds is not None or c.value != 1)))
    chosen = attrs.evolve(program, chunk_counts=tuple(sorted(counts.items())))
    return passes.rerun(chosen, after="check"), tuple(choices)


def _staged(program: Program, gather: str) -> tuple[float | None, str]:
    """:func:`_price` of ``program`` whose chain splits at the stages of ``gather``, the
    cheaper of both orders when no ``first`` fixes it (Algorithm 1 weighs the chunks with the
    order: the fast node-local stage first brings intra_size blocks to compute on while the
    slow one runs; the inter-node stage first brings inter_size)."""
    # Over declared levels an activation gather's order is chosen after the counts, among every
    # order of its stages; ZeRO-3's weight gather splits at the node whatever the levels.
    if gather not in dict(_unordered(program)) or (program.mesh is not None and program.mesh.levels
                                                   and gather != WEIGHTS):
        return _price(program)
    orders = dict(program.group_orders)
    priced = [_price(attrs.evolve(program, group_orders=tuple(sorted({**orders, gather: order}.items()))))
              for order in ORDERS]
    found = [p for p in priced if p[0] is not None]
    return min(found) if found else priced[0]


def _price(program: Program) -> tuple[float | None, str]:
    """(forward + backward seconds of the layer alone, "") with the program's chunk counts and
    group orders, or (None, why)."""
    try:
        tried = passes.rerun(program, after="check", stop="autodiff")
    except DhelixError as exc:
        return None, _why(first_message(exc))
    assert tried.model is not None and tried.forward is not None and tried.backward is not None, "a checked model"
    cost = PairCost(tried.profile, tried.model.dtype, seq=tried.model.get("seq"))
    return cost.solo(issue_order(tried.forward.ops)) + cost.solo(issue_order(tried.backward.ops)), ""


def issue_order(ops: Sequence[Op]) -> list[Op]:
    """``ops`` (a DAG in a topological order) in the order the interpreter issues one strand:
    a collective as soon as its inputs exist, else the first ready compute op. Chunks come
    chunk-major from the partition pass; this lets chunk i + 1's collective go before chunk
    i's compute, as it runs."""
    names = {op.name for op in ops}
    done: set[str] = set()
    left = list(ops)
    order: list[Op] = []
    while left:
        ready = [op for op in left if all(name in done or name not in names for name in op.deps)]
        op = next((o for o in ready if o.kind == "comm"), ready[0])
        left.remove(op)
        done.add(op.name)
        order.append(op)
    return order


#: Relative difference below which two priced candidates tie (float rounding of equal sums).
_TIE = 1e-9


def _fastest(candidates, default):
    """The value of the fastest priced candidate, ``default`` when it ties with it (or when
    nothing could be priced)."""
    priced = [c for c in candidates if c.seconds is not None]
    if not priced:
        return default
    best = min(c.seconds for c in priced)
    tied = [c.value for c in priced if c.seconds <= best * (1 + _TIE)]
    return default if default in tied else tied[0]


def _described(head: str, candidates) -> str:
    # Refused candidates are grouped by their reason (its words up to the candidate's own
    # particulars: "…, and ag2 runs island, cluster and node in that order").
    refused: dict[str, list[str]] = {}
    for c in candidates:
        if c.seconds is None:
            refused.setdefault(c.why.split(", and ")[0], []).append(str(c.value))
    tried = [f"{c.value}: {c.seconds * 1e3:.3f} ms" for c in candidates if c.seconds is not None]
    tried += [f"{' and '.join(values) if len(values) < 3 else ', '.join(values)}: refused ({why})"
              for why, values in refused.items()]
    return f"{head} ({', '.join(tried)}; forward + backward of a layer alone)"


def _why(message: str) -> str:
    # A count the chain's dimension does not divide, or stages where there are none, is
    # expected for most candidates: keyed so that those are left out of the report,
    # anything else is shown.
    if "divid" in message:
        return "the chain's dimension does not divide"
    if "has no stages" in message:
        return f"the chain's gather has no stages: {message}"
    return message


_EXPECTED = ("the chain's dimension", "the chain's gather")


def _cheapest(candidate: Candidate) -> tuple:
    # Fastest first; ties to fewer chunks, the stages' uneven two after two even ones, their
    # three after three.
    value = candidate.value
    return candidate.seconds, value if isinstance(value, int) else {STAGES: 2.5, STAGES3: 3.5}[value]
